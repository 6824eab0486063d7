//! `producer serve-batches`: the OpenAI Batch API in front of the fleet
//! (see [`crate::batches`]).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use common::spec::JobSpec;
use common::store::RedisStore;
use tokio_util::sync::CancellationToken;

use super::{RedisArgs, refuse};
use crate::commands::console::key_lines;

#[derive(Debug, Args)]
pub struct ServeBatchesArgs {
    #[command(flatten)]
    pub redis: RedisArgs,
    /// Where to listen (loopback unless told otherwise).
    #[arg(long, default_value = "127.0.0.1:8090")]
    pub bind: std::net::SocketAddr,
    /// A job spec whose provider, limits, prices, budget and sink every
    /// batch's job uses (its `[output]`, when it has fields, validates answers).
    #[arg(long, value_name = "FILE")]
    pub provider_spec: PathBuf,
    /// A file of `name:token` lines, one per API key (tokens of 16
    /// characters or more); also read from BATCHFLEET_BATCHES_KEYS.
    #[arg(long, value_name = "FILE")]
    pub keys_file: Option<PathBuf>,
    /// Named templates: `DIR/<name>.toml` job specs whose `[output]`
    /// validates the answers of a batch created with `metadata={"template": "<name>"}`.
    #[arg(long, value_name = "DIR")]
    pub templates: Option<PathBuf>,
    /// Where uploaded and produced files are kept.
    #[arg(long, value_name = "DIR", default_value = "batchfleet-batches")]
    pub data_dir: PathBuf,
    /// The largest file accepted, in MiB.
    #[arg(long, default_value_t = 200)]
    pub max_upload_mb: u64,
    /// How often batches are moved along (counts, finalizing), in ms.
    #[arg(long, default_value_t = 1000)]
    pub poll_ms: u64,
    /// The most tasks a batch's job holds in Redis at once (as enqueue's --max-backlog).
    #[arg(long, env = "BATCHFLEET_MAX_BACKLOG", default_value_t = 100_000)]
    pub max_backlog: u64,
    /// Enqueue even into a Redis that may evict keys (tests only).
    #[arg(long, hide = true)]
    pub allow_evicting_redis: bool,
}

/// The variable that may hold API keys (`name:token` lines, or comma-separated).
pub const KEYS_ENV: &str = "BATCHFLEET_BATCHES_KEYS";

pub async fn run(args: ServeBatchesArgs, cancel: CancellationToken) -> anyhow::Result<ExitCode> {
    crate::commands::console::init_logs();
    let keys = match key_lines(args.keys_file.as_deref(), "--keys-file", KEYS_ENV) {
        Ok(k) => k,
        Err(why) => return refuse(why),
    };
    let provider_spec = match JobSpec::load(&args.provider_spec.to_string_lossy()) {
        Ok(s) => s,
        Err(e) => return refuse(format_args!("--provider-spec: {e}")),
    };
    let store = RedisStore::connect(&args.redis.url).await?;
    let config = crate::batches::Config {
        bind: args.bind,
        keys,
        provider_spec,
        templates: args.templates,
        data_dir: args.data_dir,
        max_upload_bytes: args.max_upload_mb.saturating_mul(1024 * 1024),
        redis_url: args.redis.url,
        poll: std::time::Duration::from_millis(args.poll_ms.max(50)),
        max_backlog: args.max_backlog,
        allow_evicting_redis: args.allow_evicting_redis,
    };
    match crate::batches::run(config, store, cancel, None).await {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(e) => refuse(format_args!("{e:#}")),
    }
}

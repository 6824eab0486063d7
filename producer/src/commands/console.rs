//! `producer console`: its flags, its reviewers, and the server started.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;
use common::store::RedisStore;
use tokio_util::sync::CancellationToken;

use super::{RedisArgs, refuse};
use crate::console::auth::Reviewers;

#[derive(Debug, Args)]
pub struct ConsoleArgs {
    #[command(flatten)]
    pub redis: RedisArgs,
    /// Where to listen (loopback unless told otherwise).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub bind: std::net::SocketAddr,
    /// A file of `name:token` lines, one per reviewer (tokens of 16
    /// characters or more).
    #[arg(long, value_name = "FILE")]
    pub tokens_file: Option<PathBuf>,
    /// Take the reviewer's name from this request header, set by a reverse
    /// proxy that signs reviewers in (only for a console the proxy alone
    /// can reach).
    #[arg(long, value_name = "HEADER")]
    pub trusted_header: Option<String>,
    /// How long an entry a reviewer opened stays held for them: other
    /// reviewers (here or at `review next`) are given the next free one;
    /// a lease nobody gives back returns the entry then.
    #[arg(long, default_value_t = 600)]
    pub lease_secs: u64,
}

/// The variable that may hold reviewer tokens (`name:token` lines, or
/// comma-separated), never a flag: flags show in the process list.
pub const TOKENS_ENV: &str = "BATCHFLEET_CONSOLE_TOKENS";

/// Runs `producer console` until cancelled.
pub async fn run(args: ConsoleArgs, cancel: CancellationToken) -> anyhow::Result<ExitCode> {
    init_logs();
    let reviewers = match key_lines(args.tokens_file.as_deref(), "--tokens-file", TOKENS_ENV) {
        Ok(r) => r,
        Err(why) => return refuse(why),
    };
    if let Some(h) = &args.trusted_header
        && axum::http::HeaderName::from_bytes(h.as_bytes()).is_err()
    {
        return refuse(format_args!("--trusted-header `{h}` is not a header name"));
    }
    let store = RedisStore::connect(&args.redis.url).await?;
    let config = crate::console::ConsoleConfig {
        bind: args.bind,
        redis_flag: common::secret::redis_flag(&args.redis.url),
        reviewers,
        trusted_header: args.trusted_header,
        lease: std::time::Duration::from_secs(args.lease_secs.max(1)),
    };
    match crate::console::run(config, store, cancel, None).await {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(e) => refuse(format_args!("{e:#}")),
    }
}

/// Logs to standard error, `info` unless `RUST_LOG` says otherwise.
pub fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_ansi(common::log::colour())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(common::log::Stderr)
        .log_internal_errors(false)
        .try_init();
}

/// The `name:token` lines of a file (`flag`) and of the variable `env`, together.
pub fn key_lines(file: Option<&Path>, flag: &str, env: &str) -> Result<Reviewers, String> {
    let mut reviewers = Reviewers::default();
    if let Some(path) = file {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{flag} {}: {e}", path.display()))?;
        reviewers.extend(Reviewers::parse(&text, &format!("{flag} {}", path.display()))?);
    }
    if let Ok(text) = std::env::var(env) {
        reviewers.extend(Reviewers::parse(&text.replace(',', "\n"), env)?);
    }
    Ok(reviewers)
}

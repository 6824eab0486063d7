//! One module per family of `producer` commands: each owns its flags (a
//! clap `Args` or `Subcommand` type) and the function that runs them.
//! [`crate::cli`] only names the commands and dispatches.
//!
//! The shared parts live here: the `--redis` flag, the exit codes, and
//! [`job_store`], which refuses a job name that names no job.
//!
//! - [`enqueue`]: `enqueue` (a dataset, a sample, another job's records).
//! - [`spec`]: `spec check`, `spec update`.
//! - [`status`]: `status`, `jobs`, `export`, `manifest`, `dropped`.
//! - [`report`]: `report`, `estimate`, `compare`, `audit`.
//! - [`control`]: `cancel`, `resume`, `retry`, `delete`.
//! - [`rerun`]: `rerun` (a job's done records, by filter, again in a new job).
//! - [`review`]: `review` (list, show, accept, revise, requeue, reject, next, export, import).
//! - [`console`]: `console` (the web console's flags and reviewers).
//! - [`serve_batches`]: `serve-batches` (the OpenAI Batch API in front of the fleet).

pub mod console;
pub mod control;
pub mod enqueue;
pub mod report;
pub mod rerun;
pub mod review;
pub mod serve_batches;
pub mod shell;
pub mod spec;
pub mod status;

use std::process::ExitCode;

use clap::Args;
use common::store::RedisStore;

/// Exit code when input (spec, dataset, flags, a job name) is refused.
pub const EXIT_INPUT: u8 = 2;
/// Exit code of `status --require-complete` for an incomplete job.
pub const EXIT_INCOMPLETE: u8 = 4;
/// Exit code when another reviewer acted on the entry first.
pub const EXIT_LOST_RACE: u8 = 5;
/// Exit code when an enqueue was interrupted (rerun to resume).
pub const EXIT_INTERRUPTED: u8 = 130;

#[derive(Debug, Args, Clone)]
pub struct RedisArgs {
    /// Redis URL (`redis://[user:password@]host:port[/db]`, or `host:port`).
    #[arg(
        long = "redis",
        env = "REDIS_URL",
        default_value = "redis://127.0.0.1:6379",
        hide_env_values = true
    )]
    pub url: String,
}

/// The flags of a command about one job and nothing else.
#[derive(Debug, Args)]
pub struct JobArgs {
    #[arg(long)]
    pub job: String,
    #[command(flatten)]
    pub redis: RedisArgs,
}

/// Prints `error: {why}` and gives [`EXIT_INPUT`]: input refused.
pub fn refuse(why: impl std::fmt::Display) -> anyhow::Result<ExitCode> {
    common::errln!("error: {why}");
    Ok(ExitCode::from(EXIT_INPUT))
}

/// A `--job` that names no job in the Redis looked in (the message names
/// that Redis, the jobs it has and the nearest name).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct NoSuchJob(String);

/// Connects for a command about an existing job: refuses a name no job has.
pub async fn job_store(redis: &RedisArgs, job: &str) -> anyhow::Result<RedisStore> {
    let store = RedisStore::connect(&redis.url).await?;
    let jobs = store.jobs().await?;
    if jobs.iter().any(|j| j == job) || store.job_spec(job).await.ok().flatten().is_some() {
        return Ok(store);
    }
    let at = common::secret::redact_url(&redis.url);
    let flag = common::secret::redis_flag(&redis.url);
    let message = match common::suggest::nearest(job, jobs.iter().map(String::as_str)) {
        _ if jobs.is_empty() => format!(
            "no job `{job}` in the Redis at {at}: it has no jobs at all. Enqueue one with \
             `producer enqueue DATASET.jsonl --job {job} --spec SPEC.toml{flag}`"
        ),
        Some(near) => format!(
            "no job `{job}` in the Redis at {at} (its jobs: {}). Did you mean `{near}`? Try: {}",
            jobs.join(", "),
            this_command(Some(near), &redis.url)
        ),
        None => format!("no job `{job}` in the Redis at {at} (its jobs: {})", jobs.join(", ")),
    };
    Err(NoSuchJob(message).into())
}

/// This command line again, ready to paste (with `--job` set to `job` when
/// given): its `--redis` as [`common::secret::redis_flag`] writes it (never
/// a password), words quoted for the shell where they need it.
pub fn this_command(job: Option<&str>, redis_url: &str) -> String {
    let mut words = vec!["producer".to_owned()];
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match (a.as_str(), job) {
            ("--job", Some(job)) => {
                args.next();
                words.push(format!("--job {}", common::suggest::shell_word(job)));
            }
            ("--redis", _) => {
                args.next();
            }
            (a, Some(job)) if a.starts_with("--job=") => words.push(format!("--job={job}")),
            (a, _) if a.starts_with("--redis=") => {}
            (a, _) => words.push(common::suggest::shell_word(a)),
        }
    }
    format!("{}{}", words.join(" "), common::secret::redis_flag(redis_url))
}

/// The job's spec as enqueued; prints why when there is none.
pub async fn spec_or_report(store: &RedisStore, job: &str) -> Option<common::spec::JobSpec> {
    match crate::review::job_spec(store, job).await {
        Ok(s) => Some(s),
        Err(e) => {
            common::errln!("error: {e}");
            None
        }
    }
}

/// A JSON line when asked for one, else the text `print` writes.
pub fn print_json_or<T: serde::Serialize>(json: bool, value: &T, print: impl FnOnce(&T)) -> anyhow::Result<()> {
    if json {
        crate::outln!("{}", serde_json::to_string(value)?);
    } else {
        print(value);
    }
    Ok(())
}

//! `producer cancel`, `resume`, `retry` and `delete`: stop a job, bring it
//! back, give a set of its records a new round (see [`crate::control`]), or
//! remove it from Redis.

use std::process::ExitCode;

use clap::Args;

use super::{JobArgs, RedisArgs, job_store, print_json_or, refuse, this_command};
use crate::control::ControlError;

#[derive(Debug, Args)]
pub struct ResumeCmd {
    #[arg(long)]
    pub job: String,
    /// A new spend cap in USD for a job halted on its budget (more than
    /// it spent and has in flight).
    #[arg(long)]
    pub budget: Option<f64>,
    #[command(flatten)]
    pub redis: RedisArgs,
}

#[derive(Debug, Args)]
pub struct DeadlineCmd {
    #[arg(long)]
    pub job: String,
    /// A duration from now (`45m`, `6h`, `1h30m`, `2d`) or an instant
    /// (`2026-12-07T18:00:00Z`).
    pub when: String,
    #[command(flatten)]
    pub redis: RedisArgs,
}

#[derive(Debug, Args)]
pub struct RetryCmd {
    #[arg(long)]
    pub job: String,
    #[command(flatten)]
    pub redis: RedisArgs,
    /// review: every record in review; dropped: records rejected by a
    /// reviewer; missing: records reconciliation finds missing (input read
    /// back from their dataset line).
    #[arg(long, value_enum)]
    pub from: crate::retry::From,
    /// Recorded in each record's history.
    #[arg(long, env = "USER", default_value = "unknown")]
    pub reviewer: String,
    #[arg(long)]
    pub json: bool,
}

/// `producer cancel`.
pub async fn cancel(cmd: JobArgs) -> anyhow::Result<ExitCode> {
    let store = job_store(&cmd.redis, &cmd.job).await?;
    said(crate::control::cancel(&store, &cmd.job).await)
}

/// `producer resume`.
pub async fn resume(cmd: ResumeCmd) -> anyhow::Result<ExitCode> {
    let store = job_store(&cmd.redis, &cmd.job).await?;
    said(crate::control::resume(&store, &cmd.job, cmd.budget).await)
}

/// `producer deadline`.
pub async fn deadline(cmd: DeadlineCmd) -> anyhow::Result<ExitCode> {
    let store = job_store(&cmd.redis, &cmd.job).await?;
    let now = common::route::now_ms();
    said(crate::control::set_deadline(&store, &cmd.job, &cmd.when, now).await)
}

fn said(r: Result<String, ControlError>) -> anyhow::Result<ExitCode> {
    match r {
        Ok(said) => {
            crate::outln!("{said}");
            Ok(ExitCode::SUCCESS)
        }
        Err(ControlError::Refused(why)) => refuse(why),
        Err(ControlError::Store(e)) => Err(e.into()),
    }
}

/// `producer retry --from review|dropped|missing`.
pub async fn retry(cmd: RetryCmd) -> anyhow::Result<ExitCode> {
    let job = cmd.job.as_str();
    let store = job_store(&cmd.redis, job).await?;
    match crate::retry::retry(&store, job, cmd.from, &cmd.reviewer).await {
        Ok(s) => print_json_or(cmd.json, &s, |s| {
            crate::outln!("job {job}: {} records re-queued for a new round", s.requeued);
            for (why, n) in &s.skipped {
                crate::outln!("  not retried: {n} ({why})");
            }
        })?,
        Err(crate::review::ReviewError::Store(e)) => return Err(e.into()),
        Err(e) => return refuse(e),
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Debug, Args)]
pub struct DeleteCmd {
    #[arg(long)]
    pub job: String,
    #[command(flatten)]
    pub redis: RedisArgs,
    /// No question asked (for scripts): delete at once.
    #[arg(long)]
    pub yes: bool,
    /// Delete even while live workers hold tasks of the job (stop them
    /// first: an outcome they store afterwards writes keys of the job again).
    #[arg(long)]
    pub force: bool,
}

/// `producer delete`: every key of the job in Redis, after a confirmation
/// (the job's name typed at a terminal, or `--yes`); never the sink's rows.
pub async fn delete(cmd: DeleteCmd) -> anyhow::Result<ExitCode> {
    let job = cmd.job.as_str();
    let store = job_store(&cmd.redis, job).await?;
    let this = this_command(None, &cmd.redis.url);
    // Refused before the question when workers hold tasks (and checked
    // again after it: a worker may have started meanwhile).
    if !cmd.force
        && let Err(e) = crate::control::refuse_held(&store, job).await
    {
        return deleted(Err(e), job, &this);
    }
    if !cmd.yes && !confirmed(job)? {
        return refuse(format_args!(
            "job `{job}` not deleted: confirm by typing its name at a terminal, or add --yes: {this} --yes"
        ));
    }
    deleted(crate::control::delete(&store, job, cmd.force).await, job, &this)
}

fn deleted(r: Result<u64, ControlError>, job: &str, this: &str) -> anyhow::Result<ExitCode> {
    match r {
        Ok(removed) => {
            crate::outln!(
                "job {job} deleted: {removed} keys removed from Redis (a sink's rows, in PostgreSQL or files, are kept)"
            );
            Ok(ExitCode::SUCCESS)
        }
        Err(ControlError::Refused(why)) => refuse(format_args!(
            "{why}: stop them (or wait until they are done; `producer status --job {job}` shows what is in \
             flight), or delete anyway with: {this} --force"
        )),
        Err(ControlError::Store(e)) => Err(e.into()),
    }
}

/// Asks for the job's name on the terminal; false without a terminal.
fn confirmed(job: &str) -> anyhow::Result<bool> {
    use std::io::{BufRead, IsTerminal, Write};
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        return Ok(false);
    }
    let mut err = std::io::stderr();
    write!(
        err,
        "delete every key of job `{job}` from Redis? Type its name to confirm: "
    )?;
    err.flush()?;
    let mut answer = String::new();
    stdin.lock().read_line(&mut answer)?;
    Ok(answer.trim() == job)
}

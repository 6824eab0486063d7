//! `producer cancel`, `resume` and `retry`: stop a job, bring it back, or
//! give a set of its records a new round (see [`crate::control`]).

use std::process::ExitCode;

use clap::Args;

use super::{JobArgs, RedisArgs, job_store, print_json_or, refuse};
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

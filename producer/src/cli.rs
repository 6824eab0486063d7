//! The command line of `producer`: the commands by name, and [`run`], which
//! `main` calls. Each command's flags and code live in [`crate::commands`].

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use crate::commands::{
    EXIT_INPUT, JobArgs, NoSuchJob, console, control, enqueue, report, rerun, review, serve_batches, shell, spec,
    status,
};

#[derive(Debug, Parser)]
#[command(
    name = "producer",
    version,
    about = "batchfleet producer: enqueue datasets and inspect jobs"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Enqueue a JSONL dataset into a job: idempotent and resumable.
    Enqueue(enqueue::EnqueueCmd),
    /// Job specs.
    #[command(subcommand)]
    Spec(spec::SpecCmd),
    /// Every job of the Redis: created, records, done / review / dropped /
    /// remaining, state (halted, waiting, cancelled...), spend.
    Jobs(status::JobsCmd),
    /// The fleet's workers: id, host, version, jobs, in flight, records/s,
    /// started, last seen; alive, draining, stopped or dead.
    Workers(status::WorkersCmd),
    /// Print a job's manifest (JSON).
    Manifest(JobArgs),
    /// Where every record of a job is (from Redis, not counters).
    Status(status::StatusCmd),
    /// Failure distribution (error code x field), retries, attempts, tokens, cost.
    Report(report::ReportCmd),
    /// Write a job's records as JSONL (one line per record, keyed by record_id).
    Export(status::ExportCmd),
    /// After a sample run: the full dataset's cost and duration, with a range.
    Estimate(report::EstimateCmd),
    /// Two jobs side by side (e.g. the same records under two prompt versions).
    Compare(report::CompareCmd),
    /// Cancel a job: no new claims, in-flight work finishes, the rest is marked
    /// cancelled (kept for reconciliation; `resume` brings it back).
    Cancel(JobArgs),
    /// Resume a cancelled or halted job: cancelled records go back to the streams.
    Resume(control::ResumeCmd),
    /// Set or move a job's deadline (`producer deadline --job J 30m`): a
    /// job with the flex tier sends more calls standard as it nears.
    Deadline(control::DeadlineCmd),
    /// A new round of attempts for a set of records (ids kept, attempts count on).
    Retry(control::RetryCmd),
    /// A job's done records, selected by a filter (errors of earlier
    /// attempts, attempts, when committed, input or output), run again in a
    /// new job under a changed spec; --dry-run counts first.
    Rerun(rerun::RerunCmd),
    /// Remove every key of a job from Redis (asks first; --yes for scripts).
    /// Refused while workers hold its tasks, unless --force. A sink's rows
    /// are kept.
    Delete(control::DeleteCmd),
    /// Drain the review queue: list, show, accept, requeue, reject.
    Review(review::ReviewArgs),
    /// A job's dropped lines: line, id, reason, detail.
    Dropped(status::DroppedCmd),
    /// Spot checks: with --sample N, put N more committed results of the job
    /// in its audit queue (people judge them in the console); without, print
    /// the accuracy the verdicts so far estimate.
    Audit(report::AuditCmd),
    /// A record's chain: each call's request and response sha256, model and
    /// endpoint, and the response's bytes read back from the sink and
    /// checked against their hash (exit 1 when one is missing or altered).
    Trace(report::TraceCmd),
    /// Serve the web console: jobs, their live status, the review queue.
    /// Reviewers sign in with a token of their own: `name:token` lines in
    /// --tokens-file or in the variable BATCHFLEET_CONSOLE_TOKENS.
    Console(console::ConsoleArgs),
    /// Serve the OpenAI Batch API (`/v1/files`, `/v1/batches`) in front of
    /// the fleet: code written for `client.batches` runs unchanged with its
    /// base_url pointed here. API keys: `name:token` lines in --keys-file or
    /// in the variable BATCHFLEET_BATCHES_KEYS.
    ServeBatches(serve_batches::ServeBatchesArgs),
    /// Shell completions, generated from this command line: `producer
    /// completions bash > ~/.local/share/bash-completion/completions/producer`.
    Completions(shell::CompletionsCmd),
    /// Man pages, generated from this command line: `producer man --dir
    /// ~/.local/share/man/man1` writes one per command.
    Man(shell::ManCmd),
}

/// Runs a parsed command line; `main` only sets up the runtime and signals.
pub async fn run(cli: Cli, cancel: CancellationToken) -> ExitCode {
    match dispatch(cli.command, cancel).await {
        Ok(code) => code,
        Err(e) if e.downcast_ref::<NoSuchJob>().is_some() => {
            common::errln!("error: {e}");
            ExitCode::from(EXIT_INPUT)
        }
        // The reader of our output went away (`| head`): end quietly.
        Err(e) if crate::out::is_closed_pipe(&e) => ExitCode::from(crate::out::EXIT_CLOSED_PIPE),
        Err(e) => {
            common::errln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn dispatch(command: Command, cancel: CancellationToken) -> anyhow::Result<ExitCode> {
    match command {
        Command::Enqueue(cmd) => enqueue::run(cmd, cancel).await,
        Command::Spec(cmd) => spec::run(cmd).await,
        Command::Jobs(cmd) => status::jobs(cmd).await,
        Command::Manifest(cmd) => status::manifest(cmd).await,
        Command::Status(cmd) => status::status(cmd, cancel).await,
        Command::Report(cmd) => report::report(cmd).await,
        Command::Export(cmd) => status::export(cmd).await,
        Command::Estimate(cmd) => report::estimate(cmd).await,
        Command::Compare(cmd) => report::compare(cmd).await,
        Command::Cancel(cmd) => control::cancel(cmd).await,
        Command::Resume(cmd) => control::resume(cmd).await,
        Command::Deadline(cmd) => control::deadline(cmd).await,
        Command::Retry(cmd) => control::retry(cmd).await,
        Command::Rerun(cmd) => rerun::run(cmd, cancel).await,
        Command::Delete(cmd) => control::delete(cmd).await,
        Command::Review(cmd) => review::run(cmd, cancel).await,
        Command::Dropped(cmd) => status::dropped(cmd).await,
        Command::Workers(cmd) => status::workers(cmd).await,
        Command::Audit(cmd) => report::audit(cmd).await,
        Command::Trace(cmd) => report::trace(cmd).await,
        Command::Console(cmd) => console::run(cmd, cancel).await,
        Command::ServeBatches(cmd) => serve_batches::run(cmd, cancel).await,
        Command::Completions(cmd) => shell::completions(cmd, <Cli as clap::CommandFactory>::command()),
        Command::Man(cmd) => shell::man(cmd, <Cli as clap::CommandFactory>::command()),
    }
}

//! The `producer` command: puts datasets into jobs and inspects them.
//!
//! - [`audit`]: spot checks: sample committed results, judge them, the accuracy.
//! - [`batches`]: the OpenAI Batch API (`serve-batches`) in front of the fleet.
//! - [`cli`]: the command line: the commands by name, dispatched.
//! - [`commands`]: each command family's flags and code.
//! - [`compare`]: two jobs side by side (failures, validity, cost, regressions).
//! - [`console`]: the web console (jobs, the review queue, spot-checks).
//! - [`control`]: cancel and resume a job (command line and console).
//! - [`out`]: standard output that survives a closed pipe.
//! - [`enqueue`]: a dataset into the job's streams, exactly once, resumable.
//! - [`estimate`]: after a sample, the full dataset's cost and duration.
//! - [`jobs`]: every job of a Redis, a line each (`producer jobs`, the console's jobs page).
//! - [`reader`]: flat-memory line reading with byte offsets; file hashing.
//! - [`progress`]: progress bar or periodic log lines.
//! - [`status`]: where every record of a job is; results export.
//! - [`reconcile`]: missing / duplicated / unknown records, from the data.
//! - [`report`]: failure distribution, retries, attempts, tokens and cost.
//! - [`retry`]: a new round from the review, rejected or missing records.
//! - [`select`]: a stratified sample, another job's records (`--from-job`).
//! - [`review`]: people drain the review queue (list, show, accept, requeue, reject).
//! - [`filter`]: what selects review entries and done records; [`bulk`]: bulk actions on the review queue.
//! - [`terminal`]: the reviewer's terminal (raw keys, lines, always restored).
//! - [`trace`]: a record's chain back to the request and response bytes that produced it.

pub mod audit;
pub mod batches;
pub mod bulk;
pub mod cli;
pub mod commands;
pub mod compare;
pub mod console;
pub mod control;
pub mod enqueue;
pub mod estimate;
pub mod filter;
pub mod jobs;
pub mod out;
pub mod precheck;
pub mod progress;
pub mod reader;
pub mod reconcile;
pub mod report;
pub mod retry;
pub mod review;
pub mod select;
pub mod sink;
pub mod status;
pub mod terminal;
pub mod trace;
pub mod workers;

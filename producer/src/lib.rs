//! The `producer` command: puts datasets into jobs and inspects them.
//!
//! - [`cli`]: the command line (one typed config per subcommand).
//! - [`out`]: standard output that survives a closed pipe.
//! - [`enqueue`]: a dataset into the job's streams, exactly once, resumable.
//! - [`reader`]: flat-memory line reading with byte offsets; file hashing.
//! - [`progress`]: progress bar or periodic log lines.
//! - [`status`]: where every record of a job is; results export.
//! - [`reconcile`]: missing / duplicated / unknown records, from the data.
//! - [`report`]: failure distribution, retries, attempts, tokens and cost.
//! - [`retry`]: a new round from the review, rejected or missing records.
//! - [`review`]: people drain the review queue (list, show, accept, requeue, reject).

pub mod cli;
pub mod enqueue;
pub mod out;
pub mod progress;
pub mod reader;
pub mod reconcile;
pub mod report;
pub mod retry;
pub mod review;
pub mod sink;
pub mod status;

//! The jobs a Redis holds, a line each: `producer jobs` prints them and the
//! console's jobs page shows them, both through [`state`], so the two agree.

use common::store::{RedisStore, StoreError};
use serde::Serialize;

use crate::status::JobStatus;

/// A job's state in a word or two, and the class the console colours it by:
/// halted (on its budget or not), cancelled, waiting for its provider,
/// complete, running (work left in its queues or batches), else waiting.
pub fn state(
    halted: Option<&str>,
    waiting: bool,
    cancelled: bool,
    complete: bool,
    open: bool,
) -> (&'static str, &'static str) {
    match (halted, cancelled, complete) {
        (Some(r), _, _) if r.starts_with("budget") => ("halted: budget", "bad"),
        (Some(_), _, _) => ("halted", "bad"),
        (None, true, _) => ("cancelled", "warn"),
        (None, false, false) if waiting => ("waiting: provider unavailable", "warn"),
        (None, false, true) => ("complete", "good"),
        (None, false, false) if open => ("running", "run"),
        _ => ("waiting", "warn"),
    }
}

/// One job as `producer jobs` lists it.
#[derive(Debug, Clone, Serialize)]
pub struct JobLine {
    pub job: String,
    /// When its first enqueue finished (None before one did).
    pub created: Option<String>,
    /// The records it expects (None before an enqueue finished).
    pub records: Option<u64>,
    pub done: u64,
    pub review: u64,
    pub dropped: u64,
    pub cancelled: u64,
    /// Expected records in none of the four sets yet.
    pub remaining: u64,
    pub state: &'static str,
    /// Why it is halted, or why it waits (its provider fails every call).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub halted: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waiting: Option<String>,
    /// What it spent (the cost ledger: it only grows).
    pub spent_usd: f64,
}

impl JobLine {
    /// The line of a job whose reconciliation is `status`.
    pub async fn read(store: &RedisStore, status: &JobStatus) -> Result<JobLine, StoreError> {
        let job = status.job.as_str();
        let manifest = store.load_manifest(job).await?;
        let partitions = match (&manifest, store.job_spec(job).await.ok().flatten()) {
            (Some(m), _) => m.partitions,
            (None, Some(spec)) => spec.job.partitions,
            (None, None) => 0,
        };
        let open = store
            .work_left(job, partitions)
            .await?
            .iter()
            .any(|w| w.queued + w.in_flight + w.delayed + w.shards > 0);
        let cancelled = store.cancelled(job).await?;
        let (state, _) = state(
            status.halted.as_deref(),
            status.waiting.is_some(),
            cancelled,
            status.complete,
            open,
        );
        let settled = status.done + status.review + status.dropped + status.cancelled;
        Ok(JobLine {
            job: job.to_owned(),
            created: manifest.map(|m| m.created_at),
            records: status.expected,
            done: status.done,
            review: status.review,
            dropped: status.dropped,
            cancelled: status.cancelled,
            remaining: status.expected.unwrap_or(status.known).saturating_sub(settled),
            state,
            halted: status.halted.clone(),
            waiting: status.waiting.clone(),
            spent_usd: status.cost_usd,
        })
    }
}

/// Every job of the Redis, by name, each reconciled now.
pub async fn list(store: &RedisStore) -> Result<Vec<JobLine>, StoreError> {
    let mut lines = Vec::new();
    for job in store.jobs().await? {
        let status = crate::status::status(store, &job, false, false).await?;
        lines.push(JobLine::read(store, &status).await?);
    }
    Ok(lines)
}

/// The lines as a table, then why the halted and waiting jobs wait (a
/// halted job with the command that resumes it; `redis_flag` as
/// [`common::secret::redis_flag`] writes it).
pub fn print(lines: &[JobLine], redis_flag: &str) {
    let width = lines.iter().map(|l| l.job.len()).max().unwrap_or(3).max(3);
    crate::outln!(
        "{:<width$}  {:<20}  {:>10}  {:>10}  {:>8}  {:>8}  {:>10}  {:>12}  STATE",
        "JOB",
        "CREATED",
        "RECORDS",
        "DONE",
        "REVIEW",
        "DROPPED",
        "REMAINING",
        "SPENT USD"
    );
    for l in lines {
        crate::outln!(
            "{:<width$}  {:<20}  {:>10}  {:>10}  {:>8}  {:>8}  {:>10}  {:>12.6}  {}",
            l.job,
            l.created.as_deref().map_or("-", |c| c.get(..19).unwrap_or(c)),
            l.records.map_or("-".to_owned(), |r| r.to_string()),
            l.done,
            l.review,
            l.dropped,
            l.remaining,
            l.spent_usd,
            l.state
        );
    }
    for l in lines {
        if let Some(why) = &l.halted {
            crate::outln!(
                "{}: halted: {why}. Once the cause is fixed: producer resume --job {}{redis_flag}",
                l.job,
                l.job
            );
        } else if let Some(why) = &l.waiting {
            crate::outln!("{}: waiting: {why}", l.job);
        }
    }
}

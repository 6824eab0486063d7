//! The store's job-level verbs: cancel and resume.

use redis::AsyncCommands;

use super::{RedisStore, StoreError, Wake};
use crate::keys;
use crate::task::{RecordState, Task};

/// Records per script call when cancelling or resuming (bounds each step).
const PAGE: usize = 500;

impl RedisStore {
    /// Cancels a job: workers stop claiming it; every task not yet delivered
    /// and every waiting retry is marked `cancelled` and kept for resume.
    /// In-flight tasks finish. Returns how many records were cancelled.
    pub async fn cancel_job(&self, job: &str, partitions: u32) -> Result<u64, StoreError> {
        let _: () = self.conn.clone().set(keys::cancel(job), "cancelled").await?;
        self.wake(job, Wake::Flags).await;
        let mut total = 0;
        for p in 0..partitions {
            loop {
                let n: u64 = self
                    .scripts
                    .cancel_page
                    .key(keys::stream(job, p))
                    .key(keys::state(job, p))
                    .key(keys::delayed(job, p))
                    .key(keys::cancelled(job, p))
                    .key(keys::sink(job, p))
                    .arg(keys::GROUP)
                    .arg(PAGE)
                    .invoke_async(&mut self.conn.clone())
                    .await?;
                total += n;
                if n == 0 {
                    break;
                }
            }
        }
        Ok(total)
    }

    /// Resumes a job: cancelled records go back on their streams, and the
    /// cancel and halt flags are lifted. Returns how many records were re-queued.
    pub async fn resume_job(&self, job: &str, partitions: u32) -> Result<u64, StoreError> {
        let mut total = 0;
        for p in 0..partitions {
            loop {
                let left: u64 = self.conn.clone().hlen(keys::cancelled(job, p)).await?;
                if left == 0 {
                    break;
                }
                let n: u64 = self
                    .scripts
                    .resume_page
                    .key(keys::stream(job, p))
                    .key(keys::state(job, p))
                    .key(keys::cancelled(job, p))
                    .arg(PAGE)
                    .invoke_async(&mut self.conn.clone())
                    .await?;
                total += n;
            }
        }
        let _: () = self
            .conn
            .clone()
            .del(&[
                keys::cancel(job),
                keys::halt(job),
                keys::breaker(job),
                keys::batch_failures(job),
                // A resumed job's outage budget starts again.
                keys::outage(job),
            ])
            .await?;
        // Every worker's drift watch starts over from here: an alarm over
        // rates from before the resume halts nothing.
        let mark = format!(
            "{}-{}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
            std::process::id()
        );
        let _: () = self.conn.clone().set(keys::resumed(job), mark).await?;
        self.wake(job, Wake::Flags).await;
        Ok(total)
    }

    /// Re-queues one record for a new round (`task`) if its state is still `expected`.
    pub async fn retry_record(
        &self,
        job: &str,
        partition: u32,
        expected: &RecordState,
        task: &Task,
    ) -> Result<bool, StoreError> {
        let n: i64 = self
            .scripts
            .retry_record
            .key(keys::stream(job, partition))
            .key(keys::state(job, partition))
            .arg(&task.rid)
            .arg(expected.encode().as_ref())
            .arg(task.encode())
            .invoke_async(&mut self.conn.clone())
            .await?;
        if n == 1 {
            self.wake(job, Wake::Work).await;
        }
        Ok(n == 1)
    }

    /// The job's tag of a dataset (see `dataset_tag.lua`): the same for
    /// every pass of the same file, another for each other file.
    pub async fn dataset_tag(&self, job: &str, sha256: &str) -> Result<u64, StoreError> {
        Ok(self
            .scripts
            .dataset_tag
            .key(keys::datasets(job))
            .arg(sha256)
            .invoke_async(&mut self.conn.clone())
            .await?)
    }

    /// The origin (`<dataset tag>:<line>`, or `<dataset sha12>:<line>` for a
    /// record enqueued by an earlier version) an enqueue stored for a record
    /// (in its state entry once its result is in the sink; for jobs enqueued
    /// before origins were kept, while its idempotency key lives).
    pub async fn record_origin(
        &self,
        job: &str,
        partition: u32,
        record_id: &str,
    ) -> Result<Option<String>, StoreError> {
        let mut c = self.conn.clone();
        let state: Option<String> = c.hget(keys::state(job, partition), record_id).await?;
        if let Some(o) = state.as_deref().and_then(crate::task::RecordState::sunk_origin) {
            return Ok(Some(o.to_owned()));
        }
        let kept: Option<String> = c.hget(keys::origins(job, partition), record_id).await?;
        match kept {
            Some(o) => Ok(Some(o)),
            None => Ok(c.get(keys::idem(job, partition, record_id)).await?),
        }
    }

    /// The structured-output form an endpoint was found to accept, if learned.
    pub async fn accepted_form(&self, endpoint: &str) -> Result<Option<String>, StoreError> {
        Ok(self.conn.clone().get(keys::accepted_form(endpoint)).await?)
    }

    /// Remembers, fleet-wide, the form an endpoint accepts.
    pub async fn remember_form(&self, endpoint: &str, form: &str) -> Result<(), StoreError> {
        let _: () = self.conn.clone().set(keys::accepted_form(endpoint), form).await?;
        // Every worker's watcher reads it now, not at its next round (the
        // entry names no endpoint: a URL may hold credentials).
        self.wake("", Wake::Flags).await;
        Ok(())
    }

    /// Counts one more call that failed with a non-retryable error of this
    /// signature; returns how many did, fleet-wide.
    pub async fn breaker_count(&self, job: &str, signature: &str) -> Result<u64, StoreError> {
        Ok(self.conn.clone().hincr(keys::breaker(job), signature, 1).await?)
    }

    /// Notes that the job's provider answered at least once.
    pub async fn mark_proven(&self, job: &str) -> Result<(), StoreError> {
        let added: u64 = self.conn.clone().hset(keys::breaker(job), "proven", 1).await?;
        // Every worker leaves one-call-at-a-time now, not at its next round
        // (woken by the first worker to say so).
        if added > 0 {
            self.wake(job, Wake::Flags).await;
        }
        Ok(())
    }

    /// Whether the job's provider ever answered.
    pub async fn proven(&self, job: &str) -> Result<bool, StoreError> {
        let v: Option<String> = self.conn.clone().hget(keys::breaker(job), "proven").await?;
        Ok(v.is_some())
    }

    /// Counts paid answers whose outcome could not be stored (see
    /// [`RedisStore::lost_answers`]).
    pub async fn add_lost_answers(&self, job: &str, n: u64) -> Result<(), StoreError> {
        let _: i64 = self.conn.clone().hincr(keys::counters(job), "answers_lost", n).await?;
        Ok(())
    }

    /// Paid answers of the job that left no result: a worker got them but
    /// could not store the outcome before its visibility timeout.
    pub async fn lost_answers(&self, job: &str) -> Result<u64, StoreError> {
        let n: Option<u64> = self.conn.clone().hget(keys::counters(job), "answers_lost").await?;
        Ok(n.unwrap_or(0))
    }

    /// Replaces a job's stored spec (`producer spec update`), recording the
    /// change (who, when, what differs) in the job's spec history.
    pub async fn replace_spec(&self, job: &str, spec_toml: &str, change: &str) -> Result<(), StoreError> {
        let at = crate::manifest::now_rfc3339();
        let _: () = redis::pipe()
            .atomic()
            .set(keys::spec(job), spec_toml)
            .ignore()
            .hset(keys::spec_changes(job), format!("{at} {}", std::process::id()), change)
            .ignore()
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(())
    }
}

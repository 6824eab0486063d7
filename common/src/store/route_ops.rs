//! The store's route verbs: the job's deadline, and the counts the
//! planner reads (see [`crate::route`]).

use redis::AsyncCommands;

use super::{RedisStore, StoreError};
use crate::keys;

/// What the fleet's counters say for the planner.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlanCounts {
    /// Unix ms (None: the job has none).
    pub deadline_ms: Option<u64>,
    /// Records the job holds (its manifest's; None while none is written).
    pub expected: Option<u64>,
    /// Records settled so far (done, to review, dropped): the stats' sum.
    pub settled: u64,
}

impl PlanCounts {
    /// Records not settled yet.
    pub fn remaining(&self) -> u64 {
        self.expected.unwrap_or(0).saturating_sub(self.settled)
    }
}

impl RedisStore {
    /// Sets the job's deadline (Unix ms); `first`: only when it has none
    /// (a resumed enqueue keeps the deadline of the first). Returns whether
    /// it was set.
    pub async fn set_deadline(&self, job: &str, at_ms: u64, first: bool) -> Result<bool, StoreError> {
        let mut cmd = redis::cmd("SET");
        cmd.arg(keys::deadline(job)).arg(at_ms);
        if first {
            cmd.arg("NX");
        }
        let set: Option<String> = cmd.query_async(&mut self.conn.clone()).await?;
        Ok(set.is_some())
    }

    /// The job's deadline, Unix ms (None: none).
    pub async fn deadline(&self, job: &str) -> Result<Option<u64>, StoreError> {
        let at: Option<String> = self.conn.clone().get(keys::deadline(job)).await?;
        Ok(at.and_then(|a| a.parse().ok()))
    }

    /// The deadline, the records expected and the records settled.
    pub async fn plan_counts(&self, job: &str, partitions: u32) -> Result<PlanCounts, StoreError> {
        let stats = self.stats(job, partitions).await?;
        Ok(PlanCounts {
            deadline_ms: self.deadline(job).await?,
            expected: self.load_manifest(job).await?.map(|m| m.expected_records),
            settled: stats.timeline.values().map(|m| m.done + m.failed).sum(),
        })
    }
}

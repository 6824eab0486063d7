//! The promoter: moves due retries from each partition's delayed set back to
//! its stream (one atomic script per partition and page).

use std::sync::Arc;
use std::time::Duration;

use crate::fleet::{Fleet, STORE_ERROR_PAUSE};
use crate::process::now_ms;
use crate::reclaim::maintenance_period;
use crate::service::Service;

/// Due retries moved per partition and round.
const PAGE: usize = 500;

pub struct Promoter {
    fleet: Arc<Fleet>,
}

impl Promoter {
    pub fn new(fleet: Arc<Fleet>) -> Promoter {
        Promoter { fleet }
    }

    /// Promotes retries due at `now_ms` over every partition of every job
    /// (halted ones too: they wait in the stream, not in the delayed set).
    /// Returns how many went back to the streams.
    pub async fn promote_round(&self, now_ms: u64) -> u64 {
        let f = &self.fleet;
        let mut moved = 0;
        for job in &f.jobs {
            for p in 0..job.spec.job.partitions {
                match f.store.promote_due(&job.name, p, now_ms, PAGE).await {
                    Ok(n) => moved += n,
                    Err(e) => f.store_error(&e).await,
                }
            }
        }
        moved
    }
}

impl Service for Promoter {
    fn name(&self) -> &'static str {
        "promote"
    }

    async fn run_once(&mut self) -> Option<Duration> {
        let errors = self.fleet.store_errors_seen();
        self.promote_round(now_ms()).await;
        let period = maintenance_period(self.fleet.visibility);
        Some(if self.fleet.store_errors_seen() > errors {
            period.max(STORE_ERROR_PAUSE)
        } else {
            period
        })
    }
}

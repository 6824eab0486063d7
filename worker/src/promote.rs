//! The promoter: moves due retries from each partition's delayed set back to
//! its stream (one atomic script per partition and page), then sleeps until
//! the next retry is due, at most [`LONGEST_SLEEP`]; a retry scheduled by
//! this worker wakes it sooner. (Another worker's retries are promoted by
//! that worker; should it die, this one finds them within the longest sleep.)

use std::sync::Arc;
use std::time::Duration;

use crate::clock::now_ms;
use crate::fleet::{Fleet, STORE_ERROR_PAUSE};
use crate::service::Service;

/// Due retries moved per script call.
pub const PAGE: usize = 500;
/// The longest the promoter sleeps with no retry due sooner: it only
/// bounds how late a retry is promoted that another worker scheduled after
/// this one looked and then died (its own promoter would have woken).
pub const LONGEST_SLEEP: Duration = Duration::from_secs(60);

pub struct Promoter {
    fleet: Arc<Fleet>,
}

impl Promoter {
    pub fn new(fleet: Arc<Fleet>) -> Promoter {
        Promoter { fleet }
    }

    /// Promotes what is due at `now_ms` in every partition. Returns how many
    /// moved and when the next retry waiting anywhere is due (Unix ms).
    pub async fn promote_round(&self, now_ms: u64) -> (u64, Option<u64>) {
        let f = &self.fleet;
        let (mut moved, mut next) = (0, None::<u64>);
        for job in &f.jobs {
            let (n, due, errors) = f
                .store
                .promote_job(&job.name, job.spec.job.partitions, now_ms, PAGE)
                .await;
            moved += n;
            next = next.into_iter().chain(due).min();
            for e in &errors {
                f.store_error(e).await;
            }
        }
        (moved, next)
    }
}

impl Service for Promoter {
    fn name(&self) -> &'static str {
        "promote"
    }

    async fn run_once(&mut self) -> Option<Duration> {
        let errors = self.fleet.store_errors_seen();
        let now = now_ms();
        let (_, next) = self.promote_round(now).await;
        if self.fleet.store_errors_seen() > errors {
            return Some(STORE_ERROR_PAUSE);
        }
        let sleep = next.map_or(LONGEST_SLEEP, |due| {
            Duration::from_millis(due.saturating_sub(now)).min(LONGEST_SLEEP)
        });
        let _ = tokio::time::timeout(sleep, self.fleet.limits.retry_scheduled.notified()).await;
        Some(Duration::ZERO)
    }
}

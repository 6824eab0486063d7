//! The watcher: reads every job's halt and cancel flags and its provider's
//! outage from Redis (every [`PERIOD`], and at once when the fleet is told a
//! flag changed), so the claimer skips halted and cancelled jobs and only
//! probes a provider taken for down; and renews this worker's lease on its
//! consumer name.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use crate::fleet::{Fleet, STORE_ERROR_PAUSE};
use crate::service::Service;

/// How long a worker's lease on its consumer name lives unless renewed (the
/// watcher renews it every [`PERIOD`]).
pub const CONSUMER_LEASE: Duration = Duration::from_secs(30);

/// How often the flags are read.
pub const PERIOD: Duration = Duration::from_secs(10);

pub struct Watcher {
    fleet: Arc<Fleet>,
}

impl Watcher {
    pub fn new(fleet: Arc<Fleet>) -> Watcher {
        Watcher { fleet }
    }

    /// Reads the flags once. On a Redis error a job keeps the flags it had.
    /// Returns true when the next round should come within a second (a halt
    /// seen here is not yet old enough to be forgotten).
    pub async fn watch_round(&self) -> bool {
        let f = &self.fleet;
        let before = f.halted();
        let mut halted = BTreeMap::new();
        let mut cancelled = BTreeSet::new();
        for job in &f.jobs {
            match f.store.job_flags(&job.name).await {
                Ok(flags) => {
                    if let Some(reason) = flags.halted {
                        job.drift_watch(&f.limits.metrics).halted();
                        halted.insert(job.name.clone(), reason);
                    }
                    job.drift_watch(&f.limits.metrics).resume_mark(flags.resume_mark);
                    if flags.cancelled {
                        cancelled.insert(job.name.clone());
                    }
                }
                Err(e) => {
                    // A job keeps the flags it had.
                    f.store_error(&e).await;
                    if let Some(reason) = before.get(&job.name) {
                        halted.insert(job.name.clone(), reason.clone());
                    }
                    if f.is_cancelled(&job.name) {
                        cancelled.insert(job.name.clone());
                    }
                }
            }
            // The provider's outage, as the fleet knows it: taken for down
            // (only probes go out), or back (claim again at once).
            match f.store.provider_outage(&job.name).await {
                Ok(o) => {
                    let was_down = job.outage.is_down();
                    job.outage.from_redis(&job.name, &o);
                    if was_down && !o.down {
                        f.wake_claimer.notify_one();
                    }
                }
                Err(e) => f.store_error(&e).await,
            }
            if !job.breaker.proven() && matches!(f.store.proven(&job.name).await, Ok(true)) {
                job.breaker.set_proven();
            }
            if job.spec.provider.structured_output == common::spec::StructuredOutput::Auto
                && let Ok(Some(form)) = f.store.accepted_form(&job.forms.endpoint).await
            {
                job.forms.learned(&form);
            }
        }
        let stopped = |f: &Fleet| -> Vec<bool> {
            f.jobs
                .iter()
                .map(|j| f.is_halted(&j.name) || f.is_cancelled(&j.name))
                .collect()
        };
        let stopped_before = stopped(f);
        let soon = f.set_flags(halted, cancelled);
        let lifted = stopped_before.iter().zip(stopped(f)).any(|(&was, now)| was && !now);
        if lifted {
            // A halt or cancel was lifted: claim again at once.
            f.wake_claimer.notify_one();
        }
        f.flush_lost_answers().await;
        match f
            .store
            .lease_consumer(&f.config.consumer, &f.lease_token, CONSUMER_LEASE)
            .await
        {
            Ok(true) => {}
            Ok(false) => {
                tracing::error!(consumer = %f.config.consumer, "another worker took this consumer name: stopping");
                f.shutdown.cancel();
            }
            Err(e) => f.store_error(&e).await,
        }
        soon
    }
}

impl Service for Watcher {
    fn name(&self) -> &'static str {
        "watch"
    }

    /// A round, then a wait of [`PERIOD`] that a wake-up (a halt, cancel or
    /// resume anywhere in the fleet) cuts short.
    async fn run_once(&mut self) -> Option<Duration> {
        let errors = self.fleet.store_errors_seen();
        let soon = self.watch_round().await;
        if self.fleet.store_errors_seen() > errors {
            return Some(STORE_ERROR_PAUSE);
        }
        let wait = if soon { Duration::from_secs(1) } else { PERIOD };
        let _ = tokio::time::timeout(wait, self.fleet.wake_watcher.notified()).await;
        Some(Duration::ZERO)
    }
}

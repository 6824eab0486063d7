//! The watcher: reads every job's halt and cancel flags and its provider's
//! outage from Redis (at once when the fleet is told one changed, and every
//! [`FLAGS_PERIOD`] should a wake-up be lost), so the claimer skips halted
//! and cancelled jobs and only probes a provider taken for down; and renews
//! this worker's lease on its consumer name (every [`PERIOD`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use crate::fleet::{Fleet, STORE_ERROR_PAUSE};
use crate::service::Service;

/// How long a worker's lease on its consumer name lives unless renewed (the
/// watcher renews it every [`PERIOD`]).
pub const CONSUMER_LEASE: Duration = Duration::from_secs(30);

/// How often the lease is renewed.
pub const PERIOD: Duration = Duration::from_secs(10);

/// How often the flags are read with no wake-up: every change of a flag or
/// an outage wakes the fleet (`bf:wake`), so this read only catches one
/// lost (a reconnect); an idle fleet's Redis commands are mostly such
/// rounds (#32: "idle is free").
pub const FLAGS_PERIOD: Duration = Duration::from_secs(30);

pub struct Watcher {
    fleet: Arc<Fleet>,
    /// When the flags were last read (None: never, or a wake-up asks).
    flags_read: Option<tokio::time::Instant>,
}

impl Watcher {
    pub fn new(fleet: Arc<Fleet>) -> Watcher {
        Watcher {
            fleet,
            flags_read: None,
        }
    }

    /// Reads the flags and renews the lease, once. Returns true when the
    /// next round should come within a second (see [`Watcher::read_flags`]).
    pub async fn watch_round(&self) -> bool {
        let soon = self.read_flags().await;
        self.renew_lease().await;
        soon
    }

    /// Reads the flags once. On a Redis error a job keeps the flags it had.
    /// Returns true when the next round should come within a second (a halt
    /// seen here is not yet old enough to be forgotten).
    async fn read_flags(&self) -> bool {
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
        soon
    }

    /// Renews this worker's lease on its consumer name (stops the worker
    /// when another took it), and writes what answers were kept back while
    /// Redis was away.
    async fn renew_lease(&self) {
        let f = &self.fleet;
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
    }
}

impl Service for Watcher {
    fn name(&self) -> &'static str {
        "watch"
    }

    /// A round (the flags when due or asked for, the lease), then a wait of
    /// [`PERIOD`] that a wake-up (a halt, cancel, resume or outage anywhere
    /// in the fleet) cuts short, and which asks for the flags.
    async fn run_once(&mut self) -> Option<Duration> {
        let errors = self.fleet.store_errors_seen();
        let now = tokio::time::Instant::now();
        let mut soon = false;
        if self.flags_read.is_none_or(|at| now.duration_since(at) >= FLAGS_PERIOD) {
            soon = self.read_flags().await;
            self.flags_read = (!soon).then_some(now);
        }
        self.renew_lease().await;
        if self.fleet.store_errors_seen() > errors {
            self.flags_read = None;
            return Some(STORE_ERROR_PAUSE);
        }
        let wait = if soon { Duration::from_secs(1) } else { PERIOD };
        if tokio::time::timeout(wait, self.fleet.wake_watcher.notified())
            .await
            .is_ok()
        {
            self.flags_read = None;
        }
        Some(Duration::ZERO)
    }
}

//! The rescuer: takes over tasks a dead or stuck worker left pending past
//! the visibility timeout (`XPENDING ... IDLE` over the whole pending list,
//! then `XCLAIM`, which re-checks the idle time atomically: two workers never
//! both take one), as far as free permits and the fleet's budget allow. A
//! partition with nothing pending at all is looked at again only a whole
//! visibility timeout later: no task delivered after that look can be
//! overdue sooner (an idle fleet's commands, #32).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;

use common::store::IdleEntry;

use crate::fleet::{Fleet, STORE_ERROR_PAUSE};
use crate::job::JobCtx;
use crate::plan::Route;
use crate::service::Service;

pub struct Rescuer {
    fleet: Arc<Fleet>,
    /// Partitions (job, partition) found with nothing pending, and when to
    /// look at them again.
    quiet: HashMap<(String, u32), Instant>,
}

impl Rescuer {
    pub fn new(fleet: Arc<Fleet>) -> Rescuer {
        Rescuer {
            fleet,
            quiet: HashMap::new(),
        }
    }

    /// One look over every partition of every job that is not halted.
    /// Returns how many tasks were taken over and started. What could not be
    /// taken now (no free slot, no budget, another worker was faster) is left
    /// in the fleet's reclaim backlog, which holds new claims back.
    pub async fn rescue_round(&mut self) -> usize {
        let f = &self.fleet.clone();
        if !f.own_pending_read.load(Ordering::Relaxed) {
            return 0;
        }
        let visibility = f.visibility.as_millis() as u64;
        let mut backlog = 0;
        let mut started = 0;
        for job in &f.jobs {
            if f.is_halted(&job.name) {
                continue;
            }
            for p in 0..job.spec.job.partitions {
                if !self.pending_here(&job.name, p).await {
                    continue;
                }
                // Take budget only for tasks that are really there to take over.
                let idle = match f
                    .store
                    .idle_pending(&job.name, p, visibility, f.config.concurrency)
                    .await
                {
                    Ok(entries) => entries,
                    Err(e) => {
                        f.store_error(&e).await;
                        continue;
                    }
                };
                let taken = self.take_over(job, p, &idle).await;
                started += taken;
                backlog += idle.len().saturating_sub(taken);
            }
        }
        if f.reclaim_backlog.swap(backlog, Ordering::Relaxed) > 0 && backlog == 0 {
            // Claims were held back for the dead workers' tasks: not any more.
            f.wake_claimer.notify_one();
        }
        started
    }

    /// Whether partition `p` of `job` may hold a task to take over: false
    /// while a look found nothing pending there less than a visibility
    /// timeout ago, and when this look finds nothing pending.
    async fn pending_here(&mut self, job: &str, p: u32) -> bool {
        let key = (job.to_owned(), p);
        let now = Instant::now();
        if self.quiet.get(&key).is_some_and(|until| *until > now) {
            return false;
        }
        match self.fleet.store.pending_count(job, p).await {
            Ok(0) => {
                self.quiet.insert(key, now + self.fleet.visibility);
                false
            }
            Ok(_) => {
                self.quiet.remove(&key);
                true
            }
            Err(e) => {
                self.fleet.store_error(&e).await;
                false
            }
        }
    }

    /// Takes over as many of `idle` as free slots and the fleet budget allow,
    /// and starts them. Returns how many were started.
    async fn take_over(&self, job: &Arc<JobCtx>, p: u32, idle: &[IdleEntry]) -> usize {
        let f = &self.fleet;
        let free = f.permits.available_permits().min(idle.len());
        if free == 0 {
            return 0;
        }
        // While the provider is down, a fallback takes them (else they wait as released).
        let route = match (job.outage.is_down(), &job.fallback) {
            (true, Some(_)) => Route::Fallback,
            _ => Route::Primary,
        };
        let (mut grants, ..) = f.grants(job, free, route).await;
        if grants.is_empty() {
            return 0;
        }
        let free = grants.len();
        let mut started = 0;
        let visibility = f.visibility.as_millis() as u64;
        match f
            .store
            .reclaim(&job.name, p, &f.config.consumer, visibility, &idle[..free])
            .await
        {
            Ok(batch) => {
                for d in batch {
                    tracing::info!(job = %job.name, record_id = %d.task.rid, deliveries = d.deliveries, "reclaimed a task from a dead or stuck worker");
                    match f.permits.clone().try_acquire_owned() {
                        Ok(permit) => {
                            let grant = grants.pop();
                            f.spawn(job.clone(), d, permit, (grant, route));
                            started += 1;
                        }
                        Err(_) => break, // stays pending, owned by us; reclaimed again later
                    }
                }
            }
            Err(e) => f.store_error(&e).await,
        }
        grants.release(f).await;
        started
    }

    /// How often to look: often enough that a dead worker's task waits little
    /// past the visibility timeout; every 100 ms while some wait for a slot.
    pub fn period(&self) -> Duration {
        if self.fleet.reclaim_backlog.load(Ordering::Relaxed) > 0 {
            Duration::from_millis(100)
        } else {
            maintenance_period(self.fleet.visibility)
        }
    }
}

/// The rescuer's period: a quarter of the visibility timeout, 100 ms to 30 s
/// (a dead worker's task waits at most that long past its timeout).
pub fn maintenance_period(visibility: Duration) -> Duration {
    (visibility / 4).clamp(Duration::from_millis(100), Duration::from_secs(30))
}

impl Service for Rescuer {
    fn name(&self) -> &'static str {
        "reclaim"
    }

    async fn run_once(&mut self) -> Option<Duration> {
        let errors = self.fleet.store_errors_seen();
        self.rescue_round().await;
        if self.fleet.store_errors_seen() > errors {
            return Some(STORE_ERROR_PAUSE.max(self.period()));
        }
        Some(self.period())
    }
}

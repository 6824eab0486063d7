//! The rescuer: takes over tasks a dead or stuck worker left pending past
//! the visibility timeout (`XPENDING ... IDLE` over the whole pending list,
//! then `XCLAIM`, which re-checks the idle time atomically: two workers never
//! both take one), as far as free permits and the fleet's budget allow.
//!
//! A look at a partition reads its oldest pending entries with their idle
//! times (one `XPENDING`). When that is all of them, none can be overdue
//! before the most idle of them reaches the visibility timeout, and nothing
//! delivered after the look sooner: the partition is looked at again then
//! (a whole visibility timeout later when nothing is pending), not every
//! round (an idle or waiting fleet's commands, #32). A partition holding
//! more than a look reads is scanned for its overdue entries every round.

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

/// Pending entries a look reads, the oldest first.
const LOOK: usize = 32;

pub struct Rescuer {
    fleet: Arc<Fleet>,
    /// Partitions (job, partition) none of whose pending entries can be
    /// overdue yet, and when one could be.
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
        let mut backlog = 0;
        let mut started = 0;
        for job in &f.jobs {
            if f.is_halted(&job.name) {
                continue;
            }
            for p in 0..job.spec.job.partitions {
                let Some(idle) = self.overdue(&job.name, p).await else {
                    continue;
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

    /// The entries of partition `p` of `job` overdue now, None when none
    /// can be (the partition is quiet until one could be, or Redis is away).
    async fn overdue(&mut self, job: &str, p: u32) -> Option<Vec<IdleEntry>> {
        let f = &self.fleet;
        let key = (job.to_owned(), p);
        let now = Instant::now();
        if self.quiet.get(&key).is_some_and(|until| *until > now) {
            return None;
        }
        let visibility = f.visibility.as_millis() as u64;
        let read = |min_idle, limit| f.store.idle_pending(job, p, min_idle, limit);
        let head = match read(0, LOOK).await {
            Ok(head) => head,
            Err(e) => {
                f.store_error(&e).await;
                return None;
            }
        };
        if head.len() < LOOK {
            // Every pending entry, read: the most idle not yet overdue says
            // when one could be (nothing pending: a visibility timeout on).
            let (overdue, young): (Vec<_>, Vec<_>) = head.into_iter().partition(|e| e.idle_ms >= visibility);
            let most_idle = young.iter().map(|e| e.idle_ms).max().unwrap_or(0);
            if overdue.is_empty() {
                self.quiet
                    .insert(key, now + Duration::from_millis(visibility - most_idle));
                return None;
            }
            self.quiet.remove(&key);
            return Some(overdue);
        }
        self.quiet.remove(&key);
        // Take budget only for tasks that are really there to take over.
        match read(visibility, f.config.concurrency).await {
            Ok(idle) => Some(idle),
            Err(e) => {
                f.store_error(&e).await;
                None
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

//! What a worker's services share: the store, the jobs, the concurrency
//! permits, the task tracker, the jobs' halt and cancel flags, and the run's
//! summary. It also starts one delivered task ([`Fleet::spawn`]) and settles
//! its rate-limit grant when the task ends.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::store::{Bound, Finish, Finished, RedisStore, StoreError};
use common::task::Delivery;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::task::TaskTracker;

use crate::config::{Config, RunSummary};
use crate::http::Health;
use crate::job::{JobCtx, Limits, Settled};
use crate::limiter::{Acquired, Grant, Limiter};
use crate::plan::Route;
use crate::process::process;
use crate::telemetry::Metrics;

/// The state a worker's services share.
pub struct Fleet {
    pub store: RedisStore,
    pub jobs: Vec<Arc<JobCtx>>,
    /// Each job's fleet-wide rate limits (by job name; one for every job).
    limiters: BTreeMap<String, Arc<Limiter>>,
    pub limits: Limits,
    pub config: Config,
    /// A pending task idle this long is taken over.
    pub visibility: Duration,
    /// In-flight work gets this long after the services stop (the config's,
    /// resolved against the provider timeouts).
    pub drain_timeout: Duration,
    pub summary: tokio::sync::Mutex<RunSummary>,
    pub metrics: Arc<Metrics>,
    pub health: Arc<Health>,
    /// Requests in flight in this process: one permit per task, until its
    /// outcome goes to be stored (see [`crate::slot`]).
    pub permits: Arc<Semaphore>,
    /// Outcomes of tasks that gave their permit back waiting to be stored:
    /// as many as permits.
    pub storing: Arc<Semaphore>,
    /// Every started task, for the drain.
    pub tracker: TaskTracker,
    flags: Mutex<Flags>,
    /// Tasks of dead or stuck workers the rescuer saw waiting to be taken
    /// over and could not take: while any wait, no new claims, so a busy
    /// fleet runs them first.
    pub reclaim_backlog: AtomicUsize,
    /// The claimer has read this consumer's own pending entries; the rescuer
    /// waits for it, or what it takes over would be read again as "own pending".
    pub own_pending_read: AtomicBool,
    /// Failed Redis calls of the services so far: a round that saw one
    /// waits [`STORE_ERROR_PAUSE`] before the next.
    store_errors: AtomicU64,
    /// Paid answers lost per job, not yet counted in Redis (it was away).
    lost_answers: Mutex<BTreeMap<String, u64>>,
    /// Records this worker settled (done, to review, dropped), for its heartbeat.
    pub settled: AtomicU64,
    /// When it started (Unix ms).
    pub started_ms: u64,
    /// This process's token on its consumer name's lease.
    pub lease_token: String,
    /// Fired to stop the services: a signal, `--drain` done, or the consumer
    /// name's lease lost to another worker.
    pub shutdown: tokio_util::sync::CancellationToken,
    /// New work, or a concurrency slot freed while someone waited for one
    /// (from the wake-up listener), or a task of this worker ended, the sink
    /// caught up, dead workers' tasks were all taken over: the claimer looks
    /// again at once.
    pub wake_claimer: tokio::sync::Notify,
    /// A job's flags changed (halt, cancel, resume): the watcher looks at once.
    pub wake_watcher: tokio::sync::Notify,
}

/// Jobs halted (fleet-wide, or seen here first) and cancelled.
#[derive(Default)]
struct Flags {
    /// From Redis, refreshed by the watcher.
    halted: BTreeMap<String, String>,
    /// Seen by this process's tasks (with when), known before the next refresh.
    halted_here: BTreeMap<String, (String, std::time::Instant)>,
    cancelled: BTreeSet<String>,
}

impl Fleet {
    pub fn new(
        store: RedisStore,
        jobs: Vec<(JobCtx, Limiter)>,
        limits: Limits,
        config: Config,
        visibility: Duration,
        metrics: Arc<Metrics>,
        health: Arc<Health>,
    ) -> Fleet {
        let (mut served, mut limiters) = (Vec::new(), BTreeMap::new());
        for (job, limiter) in jobs {
            limiters.insert(job.name.clone(), Arc::new(limiter));
            served.push(Arc::new(job));
        }
        Fleet {
            permits: Arc::new(Semaphore::new(config.concurrency.max(1))),
            storing: Arc::new(Semaphore::new(config.concurrency.max(1))),
            tracker: TaskTracker::new(),
            store,
            jobs: served,
            limiters,
            limits,
            drain_timeout: config.drain_timeout.unwrap_or(crate::config::DRAIN_MARGIN),
            config,
            visibility,
            summary: tokio::sync::Mutex::new(RunSummary::default()),
            metrics,
            health,
            flags: Mutex::new(Flags::default()),
            reclaim_backlog: AtomicUsize::new(0),
            own_pending_read: AtomicBool::new(false),
            store_errors: AtomicU64::new(0),
            lost_answers: Mutex::new(BTreeMap::new()),
            settled: AtomicU64::new(0),
            started_ms: crate::clock::now_ms(),
            lease_token: format!("{:016x}{:08x}", rand::random::<u64>(), std::process::id()),
            shutdown: tokio_util::sync::CancellationToken::new(),
            wake_claimer: tokio::sync::Notify::new(),
            wake_watcher: tokio::sync::Notify::new(),
        }
    }

    /// Jobs halted now, with the reason (from Redis or seen here).
    pub fn halted(&self) -> BTreeMap<String, String> {
        let f = self.flags.lock().unwrap_or_else(|e| e.into_inner());
        let mut all = f.halted.clone();
        for (k, (v, _)) in &f.halted_here {
            all.entry(k.clone()).or_insert_with(|| v.clone());
        }
        all
    }

    pub fn is_halted(&self, job: &str) -> bool {
        let f = self.flags.lock().unwrap_or_else(|e| e.into_inner());
        f.halted.contains_key(job) || f.halted_here.contains_key(job)
    }

    pub fn is_cancelled(&self, job: &str) -> bool {
        let f = self.flags.lock().unwrap_or_else(|e| e.into_inner());
        f.cancelled.contains(job)
    }

    /// The watcher's view of Redis: halted and cancelled jobs. A halt this
    /// worker saw is forgotten once Redis no longer has it (an operator
    /// lifted it: `producer resume`), unless it is too recent for Redis to
    /// have been read after it. Returns true when such a recent halt was kept
    /// (the watcher then looks again as soon as it is no longer too recent).
    pub fn set_flags(&self, halted: BTreeMap<String, String>, cancelled: BTreeSet<String>) -> bool {
        let mut f = self.flags.lock().unwrap_or_else(|e| e.into_inner());
        let mut kept_recent = false;
        f.halted_here.retain(|job, (_, at)| {
            let recent = !halted.contains_key(job) && at.elapsed() < Duration::from_secs(1);
            kept_recent |= recent;
            halted.contains_key(job) || recent
        });
        f.halted = halted;
        f.cancelled = cancelled;
        self.health
            .halted
            .store(!f.halted.is_empty() || !f.halted_here.is_empty(), Ordering::Relaxed);
        kept_recent
    }

    pub fn halted_here(&self, job: &str, reason: &str) {
        let mut f = self.flags.lock().unwrap_or_else(|e| e.into_inner());
        f.halted_here
            .insert(job.to_owned(), (reason.to_owned(), std::time::Instant::now()));
        self.health.halted.store(true, Ordering::Relaxed);
    }

    /// The job's fleet-wide rate limits.
    pub fn limiter(&self, job: &JobCtx) -> &Arc<Limiter> {
        // Fleet::new makes one for every job it is given.
        &self.limiters[&job.name]
    }

    /// Every limiter of this worker: the jobs' own and their fallbacks'.
    pub fn all_limiters(&self) -> impl Iterator<Item = &Arc<Limiter>> {
        let fallbacks = self.jobs.iter().filter_map(|j| j.fallback.as_ref().map(|f| &f.limiter));
        self.limiters.values().chain(fallbacks)
    }

    /// The limiter of a route's provider (the fallback's own, or the job's).
    pub fn limiter_for<'a>(&'a self, job: &'a JobCtx, route: Route) -> &'a Arc<Limiter> {
        match (route, &job.fallback) {
            (Route::Fallback, Some(f)) => &f.limiter,
            _ => self.limiter(job),
        }
    }

    /// Up to `want` grants of the limiter of `route`'s provider; when fewer,
    /// how long to wait and what held the rest back.
    pub async fn grants(&self, job: &Arc<JobCtx>, want: usize, route: Route) -> (HeldGrants, Duration, Bound) {
        // The acquisition runs on the tracker: a round cancelled while Redis
        // answers (SIGTERM) must not leave the reservation it made unsettled;
        // with nobody to take them, the grants go straight back.
        let (tx, rx) = tokio::sync::oneshot::channel();
        let limiter = self.limiter_for(job, route).clone();
        self.tracker.spawn(async move {
            let got = limiter.try_acquire(want).await;
            if let Err(Ok(got)) = tx.send(got) {
                let _ = limiter.release_now(got.grants).await;
            }
        });
        let got = match rx.await {
            Ok(Ok(got)) => got,
            failed => {
                if let Ok(Err(e)) = &failed {
                    self.store_error(e).await;
                }
                Acquired {
                    wait: Duration::from_millis(200),
                    ..Acquired::default()
                }
            }
        };
        // Paced by the rate (held back, or given grants ahead of the
        // buckets) with half the slots or more to spare, and the fleet's
        // slots holding no grant back lately: the job's outcomes may wait
        // a moment for each other (a lingering outcome holds its slots,
        // which must not become what limits the worker or the fleet).
        let now = tokio::time::Instant::now();
        let limiter = self.limiter_for(job, route);
        if (got.bound == Bound::Rate || got.grants.iter().any(|g| g.at > now))
            && 2 * self.permits.available_permits() >= self.config.concurrency
            && !limiter.slots_held_back()
        {
            limiter.paced().mark();
        }
        (self.held(job, route, got.grants), got.wait, got.bound)
    }

    /// No grants: for a probe the limits spare ([`Limiter::spares_probes`]).
    pub fn no_grants(&self, job: &Arc<JobCtx>, route: Route) -> HeldGrants {
        self.held(job, route, Vec::new())
    }

    /// `grants` of the limiter of `route`'s provider, held for tasks.
    fn held(&self, job: &JobCtx, route: Route, grants: Vec<Grant>) -> HeldGrants {
        HeldGrants {
            limiter: self.limiter_for(job, route).clone(),
            grants,
            tracker: self.tracker.clone(),
        }
    }

    /// Gives the delivery this worker's failed probe kept back to its
    /// stream (its failed calls in its task's history; for a cancelled job
    /// kept for resume, as a task it would not call): when the next probe
    /// is not this worker's own (another worker holds the lease, or the
    /// provider is up: see [`crate::outage::OutageWatch::take_kept`]), or
    /// `always` (the job is not claimed now, or the worker stops). Should
    /// Redis be away, it stays kept for the next round.
    pub async fn give_back_kept(&self, job: &JobCtx, always: bool) {
        let Some(d) = job.outage.take_kept(always) else {
            return;
        };
        let given = if self.is_cancelled(&job.name) {
            self.cancel_task(job, &d).await.map(drop)
        } else {
            let how = Finish::Release(d.task.clone());
            self.store.finish(&job.name, &d, &how).await.map(drop)
        };
        if let Err(e) = given {
            job.outage.put_back(d);
            self.store_error(&e).await;
        }
    }

    /// Starts one delivered task on the tracker, to call `route`'s provider;
    /// it holds `permit` until its outcome goes to be stored (then a storing
    /// slot, see [`crate::slot`]), and the rate-limit `grant` until it is settled.
    pub fn spawn(
        self: &Arc<Self>,
        job: Arc<JobCtx>,
        d: Delivery,
        permit: OwnedSemaphorePermit,
        (grant, route): (Option<Grant>, Route),
    ) {
        let me = self.clone();
        // Only a provider taken for down has probes (and keeps other tasks
        // waiting); the fallback's calls are no probes.
        let probe = (route == Route::Primary && job.outage.is_down()).then(|| d.task.rid.clone());
        if probe.is_none() {
            // Claimed as a probe, but the provider came back meanwhile: no
            // probe mark is left behind.
            job.outage.probe_ended(&d.task.rid);
        }
        job.breaker.in_flight.fetch_add(1, Ordering::Relaxed);
        let slot = crate::slot::Slot::new(permit, self.storing.clone());
        self.tracker.spawn(async move {
            // A grant given ahead of the buckets: its call waits for its time.
            if let Some(g) = &grant {
                tokio::time::sleep_until(g.at).await;
            }
            let mut report = None;
            // While the provider is down only the probe is called; a task
            // taken over from a dead worker, or claimed just before the
            // outage was seen, waits in the queue with the others.
            let waits = probe.as_deref().is_some_and(|rid| !job.outage.is_probe(rid));
            let settled = if me.is_halted(&job.name) || waits {
                // Claimed before a halt was seen: handed back, not called, so it
                // runs as soon as the halt is lifted.
                let _ = me.store.finish(&job.name, &d, &Finish::Release(d.task.clone())).await;
                None
            } else if me.is_cancelled(&job.name) {
                // The job was cancelled before this task ran: keep it for resume.
                Some(me.cancel_task(&job, &d).await)
            } else {
                // Boxed: the task's work is a future of about 11 KB, which
                // held here would make every task's future (moved as it is
                // spawned) twice that; boxed, the task's is under 2 KB.
                Some(Box::pin(slot.scope(process(&job, d, &me.limits, &mut report, route))).await)
            };
            slot.release();
            job.breaker.in_flight.fetch_sub(1, Ordering::Relaxed);
            // A probe that made no call (poison, an input error...) gives its lease back.
            if probe.is_some_and(|rid| job.outage.probe_ended(&rid))
                && let Err(e) = job.outage.no_probe(&me.store, &job.name).await
            {
                me.store_error(&e).await;
            }
            // Its slot is free here; a call may also have proven the
            // provider (the breaker's one call at a time). Where slots
            // limit the fleet, the claimer is woken once the slot is free
            // in the fleet's budget too (it would find it still taken);
            // elsewhere the settlement may wait a moment for others (see
            // `Limiter::settle`) and the claimer does not.
            let limiter = me.limiter_for(&job, route);
            let slot_first = grant.is_some() && limiter.slots_matter();
            if !slot_first {
                me.wake_claimer.notify_one();
            }
            if let Some(grant) = grant {
                let settled_budget = match &report {
                    Some(r) => limiter.settle(grant, &r.used, &r.headers).await,
                    None => limiter.release(grant).await,
                };
                if let Err(e) = settled_budget {
                    tracing::warn!(error = %e, "could not settle a rate-limit grant (it expires by itself)");
                }
            }
            if slot_first {
                me.wake_claimer.notify_one();
            }
            if let Some(settled) = settled {
                me.count_settled(&job.name, &settled).await;
            }
        });
    }

    /// Counts how a task ended, in the run's summary and the metrics.
    pub async fn count_settled(&self, job: &str, settled: &Result<Settled, StoreError>) {
        let mut s = self.summary.lock().await;
        match settled {
            Ok(settled) => {
                *s.outcomes.entry(settled.label().to_owned()).or_default() += 1;
                if matches!(settled, Settled::Committed | Settled::Reviewed | Settled::Dropped) {
                    self.settled.fetch_add(1, Ordering::Relaxed);
                }
                self.metrics.records.with_label_values(&[job, settled.label()]).inc();
                if let Settled::Halted(reason) = settled {
                    self.halted_here(job, reason);
                    s.halted.insert(job.to_owned(), reason.clone());
                }
                if *settled == Settled::AnswerLost {
                    let mut lost = self.lost_answers.lock().unwrap_or_else(|e| e.into_inner());
                    *lost.entry(job.to_owned()).or_default() += 1;
                }
            }
            Err(e) => {
                s.store_errors += 1;
                tracing::warn!(error = %e, "store error: the task stays pending and will be retried");
            }
        }
    }

    async fn cancel_task(&self, job: &JobCtx, d: &Delivery) -> Result<Settled, StoreError> {
        let done = self.store.finish(&job.name, d, &Finish::Cancel(d.task.clone())).await?;
        Ok(match done {
            Finished::Stale => Settled::Stale,
            _ => Settled::Cancelled,
        })
    }

    /// Counts and logs a failed Redis call. The caller's loop waits before
    /// its next round (the wait is cancellable there).
    pub async fn store_error(&self, e: &StoreError) {
        self.store_errors.fetch_add(1, Ordering::Relaxed);
        self.summary.lock().await.store_errors += 1;
        self.metrics.store_errors.inc();
        tracing::warn!(error = %e, "Redis call failed; retrying");
    }

    /// Counts in Redis the paid answers lost since the last call, and
    /// records their calls in the ledger.
    pub async fn flush_lost_answers(&self) {
        for (job, calls) in self.limits.calls.take_lost() {
            if let Err(e) = self.store.record_paid(&job, &calls).await {
                self.limits.calls.keep_lost(&job, calls);
                self.store_error(&e).await;
            }
        }
        let pending = std::mem::take(&mut *self.lost_answers.lock().unwrap_or_else(|e| e.into_inner()));
        for (job, n) in pending {
            if let Err(e) = self.store.add_lost_answers(&job, n).await {
                *self
                    .lost_answers
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .entry(job)
                    .or_default() += n;
                self.store_error(&e).await;
            }
        }
    }

    /// Failed Redis calls of the services so far (compare before and after a round).
    pub fn store_errors_seen(&self) -> u64 {
        self.store_errors.load(Ordering::Relaxed)
    }

    /// Every job is complete, or halted (nothing more this worker can do).
    pub async fn jobs_finished(&self) -> bool {
        let halted = self.halted();
        for job in &self.jobs {
            if halted.contains_key(&job.name) {
                continue;
            }
            match self.store.remaining(&job.name, job.spec.job.partitions).await {
                Ok(r) if r.is_empty() => {}
                Ok(_) => return false,
                Err(e) => {
                    self.store_error(&e).await;
                    return false;
                }
            }
        }
        true
    }
}

/// Rate-limit grants a round holds. What it does not hand to a task goes
/// back to the fleet's budget: at once with [`HeldGrants::release`], or,
/// when the round is cancelled mid-way, from a task started on drop.
pub struct HeldGrants {
    limiter: Arc<Limiter>,
    grants: Vec<Grant>,
    tracker: TaskTracker,
}

impl HeldGrants {
    pub fn len(&self) -> usize {
        self.grants.len()
    }

    pub fn is_empty(&self) -> bool {
        self.grants.is_empty()
    }

    /// One grant for a task.
    pub fn pop(&mut self) -> Option<Grant> {
        self.grants.pop()
    }

    /// Gives back the grants not used, at once and together (one call).
    pub async fn release(mut self, fleet: &Fleet) {
        if let Err(e) = self.limiter.release_now(std::mem::take(&mut self.grants)).await {
            fleet.store_error(&e).await;
        }
    }
}

impl Drop for HeldGrants {
    fn drop(&mut self) {
        let grants = std::mem::take(&mut self.grants);
        if grants.is_empty() {
            return;
        }
        let limiter = self.limiter.clone();
        self.tracker.spawn(async move {
            if let Err(e) = limiter.release_now(grants).await {
                tracing::warn!(error = %e, "could not give back rate-limit grants (they expire by themselves)");
            }
        });
    }
}

/// After a failed Redis call, a loop waits this long before its next round.
pub const STORE_ERROR_PAUSE: Duration = Duration::from_millis(200);

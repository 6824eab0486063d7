//! The worker's tasks and its shutdown order.
//!
//! One loop claims tasks (own pending first, then new ones) while permits are
//! free, spawns each on the task tracker, and on a timer reclaims tasks of dead
//! workers and promotes due retries. Shutdown order: stop claiming; give
//! in-flight work `drain_timeout` to finish; anything unfinished stays pending
//! (un-acked) in Redis and is reclaimed by another worker.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::keys;
use common::spec::JobSpec;
use common::store::{Delivery, Finish, IdleEntry, RedisStore, RetryTask, StoreError};
use common::template::{Template, system_prompt};
use common::validate::json_schema;
use serde_json::json;
use tokio::sync::{Mutex, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::http::{Health, serve};
use crate::limiter::{Grant, Limiter};
use crate::process::{JobCtx, Limits, Settled, now_ms, process};
use crate::provider::Provider;
use crate::telemetry::Metrics;

/// The worker's configuration; `main` builds it from flags and env.
#[derive(Debug, Clone)]
pub struct Config {
    pub redis_url: String,
    /// Jobs to work on; empty means every job in Redis.
    pub jobs: Vec<String>,
    /// Requests in flight in this process.
    pub concurrency: usize,
    /// Unique consumer name of this process.
    pub consumer: String,
    /// Exit when the jobs are complete (no queued, pending or delayed task).
    pub drain: bool,
    /// How long in-flight work may take to finish after SIGTERM.
    pub drain_timeout: Duration,
    /// A pending task idle this long is taken over; None: provider timeout + 30 s.
    pub visibility_timeout: Option<Duration>,
    /// Deliveries after which a task goes to review as poison.
    pub max_deliveries: u32,
    /// Sleep between claims when there is nothing to do.
    pub idle_poll: Duration,
    /// Overrides every job's `provider.base_url`.
    pub base_url: Option<String>,
    /// Start even when Redis may evict keys (never in production).
    pub allow_evicting_redis: bool,
    /// Where `/metrics`, `/healthz` and `/readyz` are served (None: not at all).
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Where attempt spans go (nowhere unless an OTLP endpoint is configured).
    pub traces: common::otel::Traces,
}

/// What a run did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RunSummary {
    pub outcomes: BTreeMap<String, u64>,
    pub store_errors: u64,
    /// Jobs halted, with the reason.
    pub halted: BTreeMap<String, String>,
    /// Tasks still running when the drain timeout ran out (left pending).
    pub abandoned: usize,
    /// Times this worker waited for the fleet's rate-limit budget, and how long.
    pub rate_limit_waits: u64,
    pub rate_limit_wait_ms: u64,
    /// Per job with limits: grants, tokens reserved and returned, 429s, budget.
    pub limiters: BTreeMap<String, crate::limiter::LimiterReport>,
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    Refused(String),
}

struct Worker {
    store: RedisStore,
    jobs: Vec<Arc<JobCtx>>,
    limits: Limits,
    config: Config,
    visibility: Duration,
    summary: Mutex<RunSummary>,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    /// Jobs this process saw halted, known before the next Redis check.
    halted_here: std::sync::Mutex<BTreeMap<String, String>>,
    /// Jobs cancelled by an operator (refreshed with the halt check).
    cancelled: std::sync::Mutex<std::collections::BTreeSet<String>>,
    /// Tasks of dead or stuck workers the last maintenance saw waiting to be
    /// taken over and could not take: while any wait, no new claims, so a busy
    /// fleet still runs them first (maintenance then looks every 100 ms).
    reclaim_backlog: std::sync::atomic::AtomicUsize,
}

/// Runs until `cancel` fires (or, with `drain`, until the jobs are complete).
pub async fn run(config: Config, cancel: CancellationToken) -> Result<RunSummary, RunError> {
    let store = RedisStore::connect(&config.redis_url).await?;
    match store.eviction_policy().await? {
        Some(p) if p == "noeviction" => {}
        Some(p) if !config.allow_evicting_redis => {
            return Err(RunError::Refused(format!(
                "Redis maxmemory-policy is `{p}`: it can evict queue state and lose records. \
                 Set `maxmemory-policy noeviction` (CONFIG SET maxmemory-policy noeviction)."
            )));
        }
        None if !config.allow_evicting_redis => {
            return Err(RunError::Refused(
                "cannot read Redis maxmemory-policy (CONFIG GET is not allowed): make sure it is `noeviction`, \
                 then start with --allow-evicting-redis to skip this check"
                    .into(),
            ));
        }
        _ => tracing::warn!("starting against a Redis whose eviction policy was not verified"),
    }
    let names = if config.jobs.is_empty() {
        store.jobs().await?
    } else {
        config.jobs.clone()
    };
    let mut jobs = Vec::new();
    for name in names {
        jobs.push(load_job(&store, &name, config.base_url.as_deref()).await?);
    }
    let max_timeout = jobs.iter().map(|j| j.spec.provider.timeout_secs).max().unwrap_or(60);
    let visibility = config
        .visibility_timeout
        .unwrap_or(Duration::from_secs(max_timeout + 30));
    if visibility <= Duration::from_secs(max_timeout) {
        return Err(RunError::Refused(format!(
            "--visibility-timeout ({visibility:?}) must exceed the longest provider timeout ({max_timeout}s), \
             or live tasks would be taken over mid-call"
        )));
    }
    // A grant's concurrency slot lives as long as its task may: a dead
    // worker's slots come back when its tasks could be reclaimed.
    for job in &mut jobs {
        let url = config.base_url.as_deref().unwrap_or(&job.spec.provider.base_url);
        job.limiter = Limiter::for_job(&store, &job.spec, url, &config.consumer, visibility);
    }
    let jobs: Vec<Arc<JobCtx>> = jobs.into_iter().map(Arc::new).collect();
    let metrics = Arc::new(Metrics::new());
    for job in &jobs {
        metrics.set_limits(&job.name, &job.spec.limits);
    }
    let health = Arc::new(Health::default());
    if let Some(addr) = config.metrics_addr {
        let jobs_info: Vec<(String, u32)> = jobs.iter().map(|j| (j.name.clone(), j.spec.job.partitions)).collect();
        let bound = serve(addr, metrics.clone(), store.clone(), jobs_info, health.clone())
            .await
            .map_err(|e| RunError::Refused(format!("cannot serve metrics on {addr}: {e}")))?;
        tracing::info!(addr = %bound, "metrics, healthz and readyz listening");
    }
    let worker = Arc::new(Worker {
        limits: Limits {
            max_deliveries: config.max_deliveries,
            worker: config.consumer.clone(),
            metrics: metrics.clone(),
            traces: config.traces.clone(),
        },
        metrics,
        health,
        store,
        jobs,
        visibility,
        summary: Mutex::new(RunSummary::default()),
        halted_here: std::sync::Mutex::new(BTreeMap::new()),
        cancelled: std::sync::Mutex::new(std::collections::BTreeSet::new()),
        reclaim_backlog: Default::default(),
        config,
    });
    tracing::info!(consumer = %worker.config.consumer, jobs = worker.jobs.len(), visibility_ms = visibility.as_millis() as u64, "worker started");
    let tracker = TaskTracker::new();
    let permits = Arc::new(Semaphore::new(worker.config.concurrency.max(1)));
    worker.main_loop(&tracker, &permits, &cancel).await;
    worker.health.draining.store(true, std::sync::atomic::Ordering::Relaxed);

    // Shutdown: claiming has stopped; give in-flight work its deadline.
    tracker.close();
    let in_flight = tracker.len();
    if in_flight > 0 {
        tracing::info!(
            in_flight,
            timeout_ms = worker.config.drain_timeout.as_millis() as u64,
            "draining in-flight tasks"
        );
    }
    let drained = tokio::time::timeout(worker.config.drain_timeout, tracker.wait())
        .await
        .is_ok();
    let mut summary = worker.summary.lock().await.clone();
    for job in &worker.jobs {
        if let Some(limiter) = &job.limiter
            && let Ok(report) = limiter.report().await
        {
            summary.limiters.insert(job.name.clone(), report);
        }
    }
    if !drained {
        summary.abandoned = tracker.len();
        tracing::warn!(
            abandoned = summary.abandoned,
            "drain timeout: unfinished tasks stay pending for another worker"
        );
    }
    Ok(summary)
}

async fn load_job(store: &RedisStore, name: &str, base_url: Option<&str>) -> Result<JobCtx, RunError> {
    keys::valid_job_name(name).map_err(|e| RunError::Refused(e.to_string()))?;
    let text = store.load_spec_text(name).await?.ok_or_else(|| {
        RunError::Refused(format!(
            "job `{name}` does not exist (no spec in Redis): enqueue it first"
        ))
    })?;
    let spec = JobSpec::parse(&text, &format!("spec of job `{name}`")).map_err(|e| RunError::Refused(e.to_string()))?;
    let api_key = std::env::var(&spec.provider.api_key_env).unwrap_or_default();
    if api_key.is_empty() {
        return Err(RunError::Refused(format!(
            "job `{name}`: the environment variable {} (provider.api_key_env) is not set",
            spec.provider.api_key_env
        )));
    }
    let provider =
        Provider::new(&spec, base_url, api_key).map_err(|e| RunError::Refused(format!("HTTP client: {e}")))?;
    let user = Template::parse(&spec.prompt.user).map_err(|e| RunError::Refused(format!("prompt.user: {e}")))?;
    Ok(JobCtx {
        limiter: None,
        name: name.to_owned(),
        system: system_prompt(&spec),
        user,
        response_format: spec.provider.structured_output.then(|| json_schema(&spec)),
        versions: json!(common::spec::versions_map(&spec)),
        provider,
        spec,
    })
}

impl Worker {
    async fn main_loop(self: &Arc<Self>, tracker: &TaskTracker, permits: &Arc<Semaphore>, cancel: &CancellationToken) {
        // The first pass reads this consumer's own pending entries; reclaiming
        // waits until after it, or the entries it takes over would be read
        // again as "own pending" and processed twice.
        let mut own_pending = true;
        // Grants asked for per round follow what the last round could claim,
        // so an idle or nearly drained job does not take and give back a full
        // block of grants on every poll.
        let mut last_claimed = usize::MAX;
        let mut rounds: u32 = 0;
        let mut last_maintenance = Instant::now();
        // Often enough that a dead worker's task waits little past the visibility timeout.
        let maintenance_every = (self.visibility / 10).clamp(Duration::from_millis(100), Duration::from_secs(2));
        let mut last_halt_check = Instant::now() - Duration::from_secs(3600);
        let mut halted: BTreeMap<String, String> = BTreeMap::new();
        loop {
            if cancel.is_cancelled() {
                return;
            }
            // A permit before a claim: a saturated worker does not hoard tasks.
            let first = tokio::select! {
                p = permits.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => return },
                _ = cancel.cancelled() => return,
            };
            let seen_here = self.halted_here.lock().map(|h| h.clone()).unwrap_or_default();
            if last_halt_check.elapsed() >= Duration::from_millis(500) || seen_here.len() > halted.len() {
                last_halt_check = Instant::now();
                halted.clear();
                halted.extend(seen_here);
                let mut cancelled = std::collections::BTreeSet::new();
                for job in &self.jobs {
                    match self.store.halted(&job.name).await {
                        Ok(Some(reason)) => {
                            halted.insert(job.name.clone(), reason);
                        }
                        Ok(None) => {}
                        Err(e) => self.store_error(&e).await,
                    }
                    match self.store.cancelled(&job.name).await {
                        Ok(true) => {
                            cancelled.insert(job.name.clone());
                        }
                        Ok(false) => {}
                        Err(e) => self.store_error(&e).await,
                    }
                }
                if let Ok(mut c) = self.cancelled.lock() {
                    *c = cancelled;
                }
            }
            let backlog = self.reclaim_backlog.load(std::sync::atomic::Ordering::Relaxed) > 0;
            let mut first = Some(first);
            if last_maintenance.elapsed() >= maintenance_every
                || (backlog && last_maintenance.elapsed() >= Duration::from_millis(100))
            {
                last_maintenance = Instant::now();
                // The permit this round holds counts: a saturated worker frees
                // one slot at a time, and a dead worker's task must get it.
                self.maintain(&halted, tracker, permits, &mut first).await;
            }
            let mut claimed = 0usize;
            let mut limited: Option<Duration> = None;
            // Each round starts at the next partition: the first one read gets
            // most of the free slots, and no partition may wait for the others to drain.
            rounds = rounds.wrapping_add(1);
            for job in &self.jobs {
                if halted.contains_key(&job.name) || self.is_cancelled(&job.name) {
                    continue;
                }
                let free = self.claimable(permits, first.is_some());
                let want = free.min(last_claimed.saturating_mul(2).max(1));
                // Budget before claim: a throttled fleet leaves tasks in the stream.
                let mut grants = match self.grants(job, want).await {
                    Some((g, wait)) => {
                        if g.is_empty() {
                            limited = Some(limited.map_or(wait, |w| w.min(wait)));
                            continue;
                        }
                        Some(g)
                    }
                    None => None,
                };
                let n = job.spec.job.partitions;
                for p in (0..n).map(|i| (i + rounds) % n) {
                    let want = match &grants {
                        Some(g) => g.len(),
                        None => self.claimable(permits, first.is_some()),
                    };
                    if want == 0 {
                        break;
                    }
                    let batch = match self
                        .store
                        .claim(&job.name, p, &self.config.consumer, want, own_pending)
                        .await
                    {
                        Ok(batch) => batch,
                        Err(e) => {
                            self.store_error(&e).await;
                            continue;
                        }
                    };
                    for d in batch {
                        let permit = match first.take() {
                            Some(p) => p,
                            None => match permits.clone().try_acquire_owned() {
                                Ok(p) => p,
                                // Cannot happen (we asked for what was free); it stays pending.
                                Err(_) => break,
                            },
                        };
                        claimed += 1;
                        let grant = grants.as_mut().and_then(Vec::pop);
                        self.spawn(tracker, job.clone(), d, permit, grant);
                    }
                }
                if let (Some(limiter), Some(unused)) = (&job.limiter, grants) {
                    for g in unused {
                        if let Err(e) = limiter.release(g).await {
                            self.store_error(&e).await;
                        }
                    }
                }
            }
            own_pending = false;
            last_claimed = claimed;
            drop(first);
            self.health.loop_ok();
            self.health
                .halted
                .store(!halted.is_empty(), std::sync::atomic::Ordering::Relaxed);
            if claimed > 0 {
                continue;
            }
            if self.config.drain && tracker.is_empty() && self.jobs_finished(&halted).await {
                let mut s = self.summary.lock().await;
                s.halted = halted.clone();
                return;
            }
            // Nothing claimed: wait for the budget when that was the reason.
            let pause = match limited {
                Some(wait) => {
                    let wait = wait.clamp(Duration::from_millis(5), Duration::from_secs(1));
                    let mut s = self.summary.lock().await;
                    s.rate_limit_waits += 1;
                    s.rate_limit_wait_ms += wait.as_millis() as u64;
                    self.metrics.rate_limit_wait.observe(wait.as_secs_f64());
                    wait
                }
                None => self.config.idle_poll,
            };
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = cancel.cancelled() => return,
            }
        }
    }

    fn is_cancelled(&self, job: &str) -> bool {
        self.cancelled.lock().is_ok_and(|c| c.contains(job))
    }

    async fn cancel_task(&self, job: &JobCtx, d: &Delivery) -> Result<Settled, StoreError> {
        let task = RetryTask {
            rid: d.record_id.clone(),
            input: d.input.clone(),
            attempt: d.attempts_before,
            calls: d.calls_before,
            base: d.round_base,
            feedback: d.feedback.clone(),
            history: d.history.clone(),
            tp: d.traceparent.clone(),
        };
        self.store.finish(&job.name, d, &Finish::Cancel { task }).await?;
        Ok(Settled::Cancelled)
    }

    /// Up to `want` grants of the job's limiter (None: the job has no limits).
    async fn grants(&self, job: &JobCtx, want: usize) -> Option<(Vec<Grant>, Duration)> {
        let limiter = job.limiter.as_ref()?;
        match limiter.try_acquire(want).await {
            Ok(got) => Some(got),
            Err(e) => {
                self.store_error(&e).await;
                Some((Vec::new(), Duration::from_millis(200)))
            }
        }
    }

    fn spawn(
        self: &Arc<Self>,
        tracker: &TaskTracker,
        job: Arc<JobCtx>,
        d: Delivery,
        permit: OwnedSemaphorePermit,
        grant: Option<Grant>,
    ) {
        let me = self.clone();
        tracker.spawn(async move {
            let mut report = None;
            let settled = if me.halted_here.lock().is_ok_and(|h| h.contains_key(&job.name)) {
                // Claimed before a halt was seen: leave it pending, do not call.
                None
            } else if me.is_cancelled(&job.name) {
                // The job was cancelled before this task ran: keep it for resume.
                Some(me.cancel_task(&job, &d).await)
            } else {
                Some(process(&me.store, &job, d, &me.limits, &mut report).await)
            };
            drop(permit);
            if let (Some(limiter), Some(grant)) = (&job.limiter, grant) {
                let settled_budget = match &report {
                    Some(r) => limiter.settle(grant, &r.used, &r.headers).await,
                    None => limiter.release(grant).await,
                };
                if let Err(e) = settled_budget {
                    tracing::warn!(error = %e, "could not settle a rate-limit grant (it expires by itself)");
                }
            }
            let Some(settled) = settled else { return };
            let mut s = me.summary.lock().await;
            match settled {
                Ok(settled) => {
                    *s.outcomes.entry(settled.label().to_owned()).or_default() += 1;
                    me.metrics
                        .records
                        .with_label_values(&[job.name.as_str(), settled.label()])
                        .inc();
                    if let Settled::Halted(reason) = settled {
                        if let Ok(mut h) = me.halted_here.lock() {
                            h.insert(job.name.clone(), reason.clone());
                        }
                        s.halted.insert(job.name.clone(), reason);
                    }
                }
                Err(e) => {
                    s.store_errors += 1;
                    tracing::warn!(error = %e, "store error: the task stays pending and will be retried");
                }
            }
        });
    }

    /// Promotes due retries and takes over tasks of dead workers.
    async fn maintain(
        self: &Arc<Self>,
        halted: &BTreeMap<String, String>,
        tracker: &TaskTracker,
        permits: &Arc<Semaphore>,
        first: &mut Option<OwnedSemaphorePermit>,
    ) {
        let now = now_ms();
        let mut backlog = 0;
        for job in &self.jobs {
            for p in 0..job.spec.job.partitions {
                if let Err(e) = self.store.promote_due(&job.name, p, now, 500).await {
                    self.store_error(&e).await;
                }
                if halted.contains_key(&job.name) {
                    continue;
                }
                // Take budget only for tasks that are really there to take over.
                let idle = match self
                    .store
                    .idle_pending(
                        &job.name,
                        p,
                        self.visibility.as_millis() as u64,
                        self.config.concurrency,
                    )
                    .await
                {
                    Ok(entries) => entries,
                    Err(e) => {
                        self.store_error(&e).await;
                        continue;
                    }
                };
                let taken = self.take_over(job, p, &idle, tracker, permits, first).await;
                // What could not be taken now (no slot, no budget, another worker
                // was faster) holds new claims back until the next look.
                backlog += idle.len().saturating_sub(taken);
            }
        }
        self.reclaim_backlog
            .store(backlog, std::sync::atomic::Ordering::Relaxed);
    }

    /// Takes over as many of `idle` as free slots and the fleet budget allow,
    /// and starts them. Returns how many were started.
    async fn take_over(
        self: &Arc<Self>,
        job: &Arc<JobCtx>,
        p: u32,
        idle: &[IdleEntry],
        tracker: &TaskTracker,
        permits: &Arc<Semaphore>,
        first: &mut Option<OwnedSemaphorePermit>,
    ) -> usize {
        let free = (permits.available_permits() + usize::from(first.is_some())).min(idle.len());
        if free == 0 {
            return 0;
        }
        let mut grants = match self.grants(job, free).await {
            Some((g, _)) if g.is_empty() => return 0,
            Some((g, _)) => Some(g),
            None => None,
        };
        let free = grants.as_ref().map_or(free, Vec::len);
        let mut started = 0;
        let visibility = self.visibility.as_millis() as u64;
        match self
            .store
            .reclaim(&job.name, p, &self.config.consumer, visibility, &idle[..free])
            .await
        {
            Ok(batch) => {
                for d in batch {
                    tracing::info!(job = %job.name, record_id = %d.record_id, deliveries = d.deliveries, "reclaimed a task from a dead or stuck worker");
                    let permit = match first.take() {
                        Some(p) => Ok(p),
                        None => permits.clone().try_acquire_owned(),
                    };
                    match permit {
                        Ok(permit) => {
                            let grant = grants.as_mut().and_then(Vec::pop);
                            self.spawn(tracker, job.clone(), d, permit, grant);
                            started += 1;
                        }
                        Err(_) => break, // stays pending, owned by us; reclaimed again later
                    }
                }
            }
            Err(e) => self.store_error(&e).await,
        }
        if let (Some(limiter), Some(unused)) = (&job.limiter, grants) {
            for g in unused {
                if let Err(e) = limiter.release(g).await {
                    self.store_error(&e).await;
                }
            }
        }
        started
    }

    /// Slots for new claims: none while tasks of a dead or stuck worker wait
    /// to be taken over (they are the oldest work; they go first, on slots
    /// and on the fleet's budget alike).
    fn claimable(&self, permits: &Semaphore, first: bool) -> usize {
        if self.reclaim_backlog.load(std::sync::atomic::Ordering::Relaxed) > 0 {
            return 0;
        }
        permits.available_permits() + usize::from(first)
    }

    /// Every job is complete, or halted (nothing more this worker can do).
    async fn jobs_finished(&self, halted: &BTreeMap<String, String>) -> bool {
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

    async fn store_error(&self, e: &StoreError) {
        self.summary.lock().await.store_errors += 1;
        self.metrics.store_errors.inc();
        tracing::warn!(error = %e, "Redis call failed; retrying");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

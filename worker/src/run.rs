//! The worker's run: connect and check, load the jobs, start the services,
//! and stop them in a stated order.
//!
//! Services (each a loop around a `run_once` a test can call, see
//! [`crate::service`]): the claimer ([`crate::claim`]), the rescuer that takes
//! over dead workers' tasks ([`crate::reclaim`]), the promoter of due retries
//! ([`crate::promote`]), the watcher of halt and cancel flags
//! ([`crate::watch`]), and the HTTP server of `/metrics`, `/healthz`, `/readyz`.
//!
//! Shutdown order, on SIGTERM / Ctrl-C (or, with `--drain`, once every job is
//! complete): 1. the claimer, rescuer, promoter and watcher stop (no new
//! claims); 2. `/readyz` says draining; 3. in-flight tasks get `drain_timeout`
//! to finish (by default long enough for the longest provider timeout);
//! anything unfinished stays pending (un-acked) in Redis and is reclaimed by
//! another worker, and the calls it was waiting on are recorded as paid
//! without a result; 4. the limiters report; 5. the HTTP server stops.

use std::sync::Arc;
use std::time::Duration;

use common::spec::JobSpec;
use common::store::{RedisStore, StoreError, valid_job_name};
use tokio_util::sync::CancellationToken;

use crate::claim::Claimer;
pub use crate::config::{Config, DEFAULT_METRICS_ADDR, DRAIN_MARGIN, RunError, RunSummary};
use crate::fleet::Fleet;
use crate::heartbeat::Beater;
use crate::http::{Health, serve};
use crate::job::{JobCtx, Limits};
use crate::limiter::Limiter;
use crate::promote::Promoter;
use crate::provider::Provider;
use crate::reclaim::Rescuer;
use crate::service;
use crate::service::Service;
use crate::sink::SinkWriter;
use crate::telemetry::Metrics;
use crate::wake::Listener;
use crate::watch::Watcher;

/// How long a drain that ran out of time still waits for answered calls
/// whose outcome is being stored, before it records them as lost.
const COMMIT_GRACE: Duration = Duration::from_secs(2);

/// The least time a leaving worker gives its sink writers, even past the
/// drain timeout.
const SINK_GRACE: Duration = Duration::from_secs(2);

/// Runs until `cancel` fires (or, with `drain`, until the jobs are complete).
pub async fn run(config: Config, cancel: CancellationToken) -> Result<RunSummary, RunError> {
    let mut total = RunSummary::default();
    // One set of metrics for the worker's life: a rejoin does not reset its counters.
    let metrics = Arc::new(Metrics::new());
    loop {
        let (summary, rejoin) = serve_jobs(config.clone(), &metrics, &cancel).await?;
        total.absorb(summary);
        if !rejoin || cancel.is_cancelled() {
            return Ok(total);
        }
        tracing::info!("a job was enqueued since this worker started: serving every job again, the new one too");
    }
}

/// How often a worker that serves every job looks for new ones.
const NEW_JOB_POLL: Duration = Duration::from_secs(2);

/// Stops the fleet (`stop`) when a job appears that `serving` lacks, and
/// says so (`rejoin`): the worker then finishes what it holds and starts
/// again serving every job (the jobs a fleet serves are set at its start).
async fn watch_new_jobs(
    store: RedisStore,
    serving: Vec<String>,
    stop: CancellationToken,
    rejoin: Arc<std::sync::atomic::AtomicBool>,
) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(NEW_JOB_POLL) => {}
        }
        if let Ok(jobs) = store.jobs().await
            && jobs.iter().any(|j| !serving.contains(j))
        {
            rejoin.store(true, std::sync::atomic::Ordering::Relaxed);
            stop.cancel();
            return;
        }
    }
}

/// Serves one set of jobs until cancelled (or, serving every job, until a
/// new one appears: the bool says so).
async fn serve_jobs(
    config: Config,
    metrics: &Arc<Metrics>,
    cancel: &CancellationToken,
) -> Result<(RunSummary, bool), RunError> {
    // Wake-ups are read from here on, on a connection of their own (a
    // blocking read holds it): nothing enqueued after this is missed.
    let listener_store = RedisStore::connect(&config.redis_url).await?;
    let wake_cursor = listener_store.wake_cursor().await?;
    let every_job = config.jobs.is_empty() && !config.drain;
    let Some(jobs) = jobs_to_serve(&listener_store, &config, cancel).await? else {
        return Ok((RunSummary::default(), false));
    };
    let config = Config { jobs, ..config };
    let (fleet, endpoints) = start(config, metrics.clone()).await?;
    tracing::info!(consumer = %fleet.config.consumer, jobs = fleet.jobs.len(), visibility_ms = fleet.visibility.as_millis() as u64, "worker started");
    // The watcher's first look comes before the first claim: a halted or
    // cancelled job is never claimed from.
    Watcher::new(fleet.clone()).watch_round().await;
    let stop = fleet.shutdown.clone();
    let signalled = {
        let stop = stop.clone();
        let cancel = cancel.clone();
        tokio::spawn(async move {
            cancel.cancelled().await;
            stop.cancel();
        })
    };
    let rejoin = Arc::new(std::sync::atomic::AtomicBool::new(false));
    if every_job {
        let serving = fleet.jobs.iter().map(|j| j.name.clone()).collect();
        tokio::spawn(watch_new_jobs(
            fleet.store.clone(),
            serving,
            stop.clone(),
            rejoin.clone(),
        ));
    }
    let loops = spawn_services(&fleet, listener_store, wake_cursor);
    stop.cancelled().await;
    let rejoin = rejoin.load(std::sync::atomic::Ordering::Relaxed) && !cancel.is_cancelled();

    // 1. No new claims.
    loops.wait().await;
    if rejoin {
        // Not a shutdown: every call in flight runs to its end (no drain deadline).
        fleet.tracker.close();
        fleet.tracker.wait().await;
    }
    // 2. Not ready any more; the fleet sees it draining.
    fleet.health.draining.store(true, std::sync::atomic::Ordering::Relaxed);
    // The heartbeat goes on through the drain (draining, not dead).
    let beats = {
        let fleet = fleet.clone();
        tokio::spawn(async move {
            let mut beater = Beater::new(fleet.clone());
            loop {
                let wait = beater.run_once().await.unwrap_or(fleet.config.heartbeat);
                tokio::time::sleep(wait).await;
            }
        })
    };
    // 3. In-flight work gets its deadline; 4. what the limiters saw.
    let summary = drain(&fleet).await;
    // 5. The consumer name is free again; the HTTP endpoints go last.
    signalled.abort();
    beats.abort();
    Beater::new(fleet.clone()).goodbye().await;
    if let Err(e) = fleet
        .store
        .release_consumer(&fleet.config.consumer, &fleet.lease_token)
        .await
    {
        tracing::warn!(error = %e, "could not give back the consumer name (its lease expires by itself)");
    }
    endpoints.close().await;
    Ok((summary, rejoin))
}

/// The worker's loops: claimer, rescuer, promoter, watcher, listener, and
/// each job's sink writers and batcher.
fn spawn_services(
    fleet: &Arc<Fleet>,
    listener_store: RedisStore,
    wake_cursor: String,
) -> tokio_util::task::TaskTracker {
    let stop = fleet.shutdown.clone();
    let loops = tokio_util::task::TaskTracker::new();
    loops.spawn(service::run(Claimer::new(fleet.clone(), stop.clone()), stop.clone()));
    loops.spawn(service::run(Rescuer::new(fleet.clone()), stop.clone()));
    loops.spawn(service::run(Promoter::new(fleet.clone()), stop.clone()));
    loops.spawn(service::run(Watcher::new(fleet.clone()), stop.clone()));
    loops.spawn(service::run(Beater::new(fleet.clone()), stop.clone()));
    loops.spawn(service::run(
        Listener::new(fleet.clone(), listener_store, wake_cursor),
        stop.clone(),
    ));
    for job in &fleet.jobs {
        for writer in SinkWriter::for_job(fleet, job) {
            loops.spawn(service::run(writer, stop.clone()));
        }
        if let Some(batcher) = crate::batcher::Batcher::for_job(fleet, job) {
            loops.spawn(service::run(batcher, stop.clone()));
        }
        if let Some(planner) = crate::replan::PlanService::for_job(fleet, job) {
            loops.spawn(service::run(planner, stop.clone()));
        }
    }
    loops.close();
    loops
}

/// In-flight work gets the drain timeout; calls cut off are recorded as
/// paid; then what was committed and paid goes to the sink within the same
/// deadline, or a moment past it when the drain used it all (the calls
/// recorded at the end reach the sink too: a fleet's last worker leaves
/// nothing only in Redis while the sink is up).
async fn drain(fleet: &Arc<Fleet>) -> RunSummary {
    fleet.tracker.close();
    let in_flight = fleet.tracker.len();
    if in_flight > 0 {
        tracing::info!(
            in_flight,
            timeout_ms = fleet.drain_timeout.as_millis() as u64,
            "draining in-flight tasks"
        );
    }
    let started_drain = std::time::Instant::now();
    let drained = tokio::time::timeout(fleet.drain_timeout, fleet.tracker.wait())
        .await
        .is_ok();
    let mut abandoned = (0, 0);
    if !drained {
        abandoned = (fleet.tracker.len(), record_cut_off_calls(fleet).await);
        tracing::warn!(
            abandoned = abandoned.0,
            "drain timeout: unfinished tasks stay pending for another worker"
        );
    }
    fleet.flush_lost_answers().await;
    for job in &fleet.jobs {
        fleet.give_back_kept(job, true).await;
        if let Err(e) = job.outage.leave(&fleet.store, &job.name, &fleet.config.consumer).await {
            tracing::warn!(job = %job.name, error = %e, "could not give back the next probe's lease (it runs out by itself)");
        }
    }
    // What was committed reaches the sink before the worker leaves (within
    // the same deadline, at least SINK_GRACE; whatever is left another
    // worker writes).
    let deadline = (started_drain + fleet.drain_timeout).max(std::time::Instant::now() + SINK_GRACE);
    let mut flushes = tokio::task::JoinSet::new();
    for job in &fleet.jobs {
        for mut writer in SinkWriter::for_job(fleet, job) {
            flushes.spawn(async move { writer.flush(deadline).await });
        }
    }
    while flushes.join_next().await.is_some() {}
    let mut summary = fleet.summary.lock().await.clone();
    for job in &fleet.jobs {
        if let Ok(report) = fleet.limiter(job).report().await {
            summary.limiters.insert(job.name.clone(), report);
        }
        if let Some(f) = &job.fallback
            && let Ok(report) = f.limiter.report().await
        {
            summary.limiters.insert(format!("{}/{}", job.name, f.name), report);
        }
    }
    summary.abandoned = abandoned.0;
    summary.calls_abandoned += abandoned.1;
    summary
}

/// Calls still waiting for their answer may be generated and billed:
/// recorded in the ledger as paid without a result (tokens estimated),
/// never dropped. Answered calls still committing get a moment to finish;
/// those that do not are recorded as lost. Returns the calls recorded.
async fn record_cut_off_calls(fleet: &Fleet) -> u64 {
    let cut_off = fleet.limits.calls.abandon();
    let grace = std::time::Instant::now() + COMMIT_GRACE;
    while fleet.limits.calls.committing() > 0 && std::time::Instant::now() < grace {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let lost = fleet.limits.calls.lost_at_exit();
    let mut recorded = 0;
    for (job, calls, what) in cut_off
        .into_iter()
        .map(|(j, c)| (j, c, "cut off before their answer"))
        .chain(lost.into_iter().map(|(j, c)| (j, c, "answered, outcome not stored")))
    {
        let tokens: u64 = calls.iter().map(|(_, c)| c.usage.prompt + c.usage.completion).sum();
        tracing::warn!(
            job = %job,
            calls = calls.len(),
            tokens,
            "drain timeout: calls {what}, recorded as paid without a result"
        );
        recorded += calls.len() as u64;
        if let Err(e) = fleet.store.record_paid(&job, &calls).await {
            tracing::error!(job = %job, calls = calls.len(), error = %e, "could not record calls paid without a result");
        }
    }
    recorded
}

/// The job's API key: none for a server that takes none (`provider.needs_key
/// = false`, or a loopback server with the variable unset: said once); else
/// the variable's value, checked.
fn api_key(name: &str, spec: &JobSpec, base_url: &str) -> Result<String, RunError> {
    let var = &spec.provider.api_key_env;
    if !spec.provider.needs_key {
        return Ok(String::new());
    }
    let api_key = std::env::var(var).unwrap_or_default();
    if api_key.is_empty() && common::secret::is_loopback_url(base_url) {
        tracing::info!(job = %name, base_url = %common::secret::redact_url(base_url),
            "{var} is not set: calling a server on this machine without a key (provider.needs_key = false says so and silences this)");
        return Ok(api_key);
    }
    if api_key.is_empty() {
        return Err(RunError::Refused(format!(
            "job `{name}`: the environment variable {var} (provider.api_key_env) is not set; \
             for a server that takes no key, set provider.needs_key = false in the spec"
        )));
    }
    common::secret::check_api_key(var, &api_key).map_err(|e| RunError::Refused(format!("job `{name}`: {e}")))?;
    Ok(api_key)
}

/// Opens the job's raw response store before the first answer comes (a
/// store that cannot open now is tried again with each answer; meanwhile
/// the bytes go inline).
async fn warm_raw(job: &JobCtx) {
    let Some(raw) = &job.raw else { return };
    match tokio::time::timeout(Duration::from_secs(15), raw.warm()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(job = %job.name, error = %e, "the sink's raw response store is not open yet"),
        Err(_) => tracing::warn!(job = %job.name, "the sink's raw response store did not open within 15 s"),
    }
}

/// The job's checker model (`[check]`), at its own endpoint and key when
/// the spec names them, else the job's (the worker's `--base-url` too).
fn checker(name: &str, spec: &JobSpec, base_url: Option<&str>) -> Result<Option<Provider>, RunError> {
    let check = &spec.check;
    if !check.is_on() {
        return Ok(None);
    }
    let mut as_job = spec.clone();
    as_job.provider.model = check.model.clone();
    let base = match &check.base_url {
        Some(url) => url.clone(),
        None => base_url.unwrap_or(&spec.provider.base_url).to_owned(),
    };
    as_job.provider.base_url = base.clone();
    if let Some(var) = &check.api_key_env {
        as_job.provider.api_key_env = var.clone();
    }
    let key = api_key(name, &as_job, &base)?;
    Provider::new(&as_job, None, key)
        .map(Some)
        .map_err(|e| RunError::Refused(format!("the checker's HTTP client: {e}")))
}

/// The job's first fallback provider (`[[provider.fallbacks]]`), with its
/// own client, key and limits.
fn fallback(
    store: &RedisStore,
    name: &str,
    spec: &JobSpec,
    config: &Config,
) -> Result<Option<crate::job::FallbackCtx>, RunError> {
    let Some(f) = spec.provider.fallbacks.first() else {
        return Ok(None);
    };
    let as_fallback = spec.as_fallback(f);
    let key = api_key(name, &as_fallback, &f.base_url)?;
    let provider = Provider::new(&as_fallback, None, key)
        .map_err(|e| RunError::Refused(format!("the fallback's HTTP client: {e}")))?;
    let limiter = Limiter::for_job(store, &as_fallback, &f.base_url, &config.consumer);
    Ok(Some(crate::job::FallbackCtx {
        name: f.name.clone(),
        spec: as_fallback,
        provider,
        limiter: Arc::new(limiter),
    }))
}

/// How often a worker looks for the jobs it waits for.
const JOB_WAIT_POLL: Duration = Duration::from_secs(1);

/// The jobs this worker serves: those named (`--job`), once each exists
/// (workers may start before the producer: a missing job is waited for,
/// said once; with `--drain` it is refused), or every job in Redis (said at
/// start). None when stopped while waiting.
async fn jobs_to_serve(
    store: &RedisStore,
    config: &Config,
    cancel: &CancellationToken,
) -> Result<Option<Vec<String>>, RunError> {
    let at = common::secret::redact_url(&config.redis_url);
    let mut said = false;
    loop {
        let existing = store.jobs().await?;
        if config.jobs.is_empty() {
            if !existing.is_empty() || config.drain {
                tracing::info!(
                    redis = %at,
                    jobs = %existing.join(", "),
                    "serving every job in Redis (no --job given); a job enqueued later is served within seconds (this worker finishes what it holds, then starts again with it)"
                );
                return Ok(Some(existing));
            }
        } else {
            let missing: Vec<&String> = config.jobs.iter().filter(|j| !existing.contains(j)).collect();
            if missing.is_empty() {
                return Ok(Some(config.jobs.clone()));
            }
            let names: Vec<String> = missing.iter().map(|j| format!("`{j}`")).collect();
            let mut why = format!(
                "job {} does not exist in the Redis at {at} (its jobs: {})",
                names.join(", "),
                if existing.is_empty() {
                    "none".to_owned()
                } else {
                    existing.join(", ")
                }
            );
            if let Some(near) = missing
                .iter()
                .find_map(|j| common::suggest::nearest(j, existing.iter().map(String::as_str)))
            {
                why.push_str(&format!("; did you mean --job {near}?"));
            }
            if config.drain {
                return Err(RunError::Refused(format!(
                    "{why}. Enqueue it first (producer enqueue DATASET.jsonl --job {} --spec SPEC.toml{}), \
                     or name an existing job",
                    missing[0],
                    common::secret::redis_flag(&config.redis_url)
                )));
            }
            if !said {
                tracing::warn!("{why}: waiting for it to be enqueued");
                said = true;
            }
        }
        if !said {
            tracing::warn!(redis = %at, "no job in Redis yet: waiting for one to be enqueued");
            said = true;
        }
        tokio::select! {
            _ = cancel.cancelled() => return Ok(None),
            _ = tokio::time::sleep(JOB_WAIT_POLL) => {}
        }
    }
}

/// The worker's HTTP endpoints (`/metrics`, `/healthz`, `/readyz`).
pub struct Endpoints {
    stop: CancellationToken,
    served: Option<tokio::task::JoinHandle<()>>,
}

impl Endpoints {
    /// Stops them, and waits (a moment at most) until their port is free
    /// again: a worker that starts again serving every job binds the same
    /// port, where a scraper looks for it.
    pub async fn close(self) {
        self.stop.cancel();
        if let Some(served) = self.served {
            let _ = tokio::time::timeout(Duration::from_secs(2), served).await;
        }
    }
}

/// Connects, checks Redis and the config, loads the jobs and starts the
/// HTTP endpoints. Returns the fleet's shared state (no service runs yet: a
/// test can drive them one round at a time) and the HTTP endpoints.
pub async fn start(config: Config, metrics: Arc<Metrics>) -> Result<(Arc<Fleet>, Endpoints), RunError> {
    config.validate()?;
    let store = connect(&config).await?;
    let mut jobs = load_jobs(&store, &config).await?;
    let (visibility, drain_timeout) = timeouts(&jobs, &config)?;
    // A grant's concurrency slot lives as long as its task may: a dead
    // worker's slots come back when its tasks could be reclaimed.
    for (job, limiter) in &mut jobs {
        limiter.set_lease(visibility);
        if let Some(l) = job.fallback.as_mut().and_then(|f| Arc::get_mut(&mut f.limiter)) {
            l.set_lease(visibility);
        }
        if let Some(b) = &job.budget {
            b.set_lease(visibility);
        }
    }
    for (job, _) in &jobs {
        metrics.set_limits(&job.name, &job.spec.limits);
    }
    let health = Arc::new(Health::default());
    let http_stop = CancellationToken::new();
    let mut served = None;
    if let Some(addr) = config.metrics_addr {
        let jobs_info: Vec<crate::telemetry::Watched> = jobs
            .iter()
            .map(|(j, limiter)| crate::telemetry::Watched {
                job: j.name.clone(),
                partitions: j.spec.job.partitions,
                limiter: Some(limiter.id().to_owned()),
            })
            .collect();
        let serve_on = |addr| {
            let (metrics, store, health, stop) = (metrics.clone(), store.clone(), health.clone(), http_stop.clone());
            serve(addr, metrics, store, jobs_info.clone(), health, stop)
        };
        served = Some(serve_metrics(addr, config.metrics_fallback, serve_on).await?);
    }
    let limits = Limits {
        max_deliveries: config.max_deliveries,
        worker: config.consumer.clone(),
        metrics: metrics.clone(),
        traces: config.traces.clone(),
        visibility,
        retry_scheduled: tokio::sync::Notify::new(),
        calls: crate::calls::CallsInFlight::default(),
    };
    let config = Config {
        drain_timeout: Some(drain_timeout),
        ..config
    };
    let fleet = Fleet::new(store, jobs, limits, config, visibility, metrics, health);
    take_consumer_name(&fleet).await?;
    let endpoints = Endpoints {
        stop: http_stop,
        served,
    };
    Ok((Arc::new(fleet), endpoints))
}

/// Connects to Redis and refuses one that may evict keys (unless allowed).
async fn connect(config: &Config) -> Result<RedisStore, RunError> {
    let store = RedisStore::connect(&config.redis_url).await?;
    match store.refuse_eviction().await {
        Ok(()) => {}
        Err(e @ StoreError::Evicting { .. }) if !config.allow_evicting_redis => {
            return Err(RunError::Refused(e.to_string()));
        }
        Err(StoreError::Evicting { .. }) => {
            tracing::warn!("starting against a Redis whose eviction policy was not verified")
        }
        Err(e) => return Err(e.into()),
    }
    Ok(store)
}

/// The jobs this worker serves (`--job`, or every job in Redis), each with
/// its rate limits; their clients scrub every secret the worker knows.
async fn load_jobs(store: &RedisStore, config: &Config) -> Result<Vec<(JobCtx, Limiter)>, RunError> {
    let names = if config.jobs.is_empty() {
        store.jobs().await?
    } else {
        config.jobs.clone()
    };
    let mut jobs = Vec::new();
    let mut secrets = common::secret::url_passwords(&config.redis_url);
    for name in names {
        let (job, limiter, key) = load_job(store, &name, config).await?;
        secrets.push(key);
        if let Some(checker) = &job.checker {
            secrets.push(checker.key().to_owned());
        }
        if let Some(f) = &job.fallback {
            secrets.push(f.provider.key().to_owned());
        }
        if let Some(common::sink::Target::Postgres(url)) = &job.sink {
            secrets.extend(common::sink::db_passwords(url));
        }
        jobs.push((job, limiter));
    }
    let scrubber = common::secret::Scrubber::new(secrets);
    for (job, _) in &mut jobs {
        job.provider.set_scrubber(scrubber.clone());
        if let Some(checker) = &mut job.checker {
            checker.set_scrubber(scrubber.clone());
        }
        if let Some(f) = &mut job.fallback {
            f.provider.set_scrubber(scrubber.clone());
        }
    }
    Ok(jobs)
}

/// The visibility and drain timeouts, against the longest provider timeout:
/// a visibility that would let live tasks be taken over mid-call is refused.
fn timeouts(jobs: &[(JobCtx, Limiter)], config: &Config) -> Result<(Duration, Duration), RunError> {
    let max_timeout = jobs
        .iter()
        .map(|(j, _)| j.spec.provider.timeout_secs)
        .max()
        .unwrap_or(60);
    let visibility = config
        .visibility_timeout
        .unwrap_or(Duration::from_secs(max_timeout + 30));
    if visibility <= Duration::from_secs(max_timeout) {
        return Err(RunError::Refused(format!(
            "--visibility-timeout ({visibility:?}) must exceed the longest provider timeout ({max_timeout}s), \
             or live tasks would be taken over mid-call"
        )));
    }
    let drain_timeout = config
        .drain_timeout
        .unwrap_or(Duration::from_secs(max_timeout) + DRAIN_MARGIN);
    if drain_timeout < Duration::from_secs(max_timeout) + DRAIN_MARGIN {
        tracing::warn!(
            drain_timeout_ms = drain_timeout.as_millis() as u64,
            provider_timeout_s = max_timeout,
            "the drain timeout is shorter than the longest provider timeout + 5 s: a call still running at \
             shutdown is cut off and recorded as paid without a result (its task is taken over and called again)"
        );
    }
    Ok((visibility, drain_timeout))
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `addr`, or (with
/// `fallback`, when another process holds it) on a free port of its host.
async fn serve_metrics<F, Fut>(
    addr: std::net::SocketAddr,
    fallback: bool,
    serve_on: F,
) -> Result<tokio::task::JoinHandle<()>, RunError>
where
    F: Fn(std::net::SocketAddr) -> Fut,
    Fut: std::future::Future<Output = std::io::Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>)>>,
{
    let (bound, served) = match serve_on(addr).await {
        Ok(bound) => bound,
        Err(e) if fallback && e.kind() == std::io::ErrorKind::AddrInUse => {
            let free = std::net::SocketAddr::new(addr.ip(), 0);
            let (bound, served) = serve_on(free)
                .await
                .map_err(|e| RunError::Refused(format!("cannot serve metrics on {free}: {e}")))?;
            tracing::warn!(
                busy = %addr,
                addr = %bound,
                "the default metrics address is in use (another worker on this host?): serving on a free port"
            );
            (bound, served)
        }
        Err(e) => return Err(RunError::Refused(format!("cannot serve metrics on {addr}: {e}"))),
    };
    tracing::info!(addr = %bound, "metrics, healthz and readyz listening");
    Ok(served)
}

/// Takes the lease on this worker's consumer name, waiting out a dead
/// worker's lease; refuses a name a live worker holds.
async fn take_consumer_name(fleet: &Fleet) -> Result<(), RunError> {
    let name = &fleet.config.consumer;
    let deadline = tokio::time::Instant::now() + crate::watch::CONSUMER_LEASE + Duration::from_secs(1);
    let mut said = false;
    loop {
        if fleet
            .store
            .lease_consumer(name, &fleet.lease_token, crate::watch::CONSUMER_LEASE)
            .await?
        {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(RunError::Refused(format!(
                "consumer name `{name}` is in use by a live worker (it renews its lease every 10 s): \
                 give each worker its own --consumer name, or none (a unique one is made)"
            )));
        }
        if !said {
            tracing::warn!(consumer = %name, "the consumer name is held by another worker; waiting for its lease to expire");
            said = true;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A job's context, its rate limits, and its API key (for the scrubber).
async fn load_job(store: &RedisStore, name: &str, config: &Config) -> Result<(JobCtx, Limiter, String), RunError> {
    let (base_url, breaker_errors) = (config.base_url.as_deref(), config.breaker_errors);
    valid_job_name(name).map_err(|e| RunError::Refused(e.to_string()))?;
    let spec: JobSpec = store
        .job_spec(name)
        .await
        .map_err(|e| match e {
            StoreError::Corrupt { reason, .. } => RunError::Refused(reason),
            other => RunError::Store(other),
        })?
        .ok_or_else(|| {
            RunError::Refused(format!(
                "job `{name}` does not exist (no spec in Redis): enqueue it first"
            ))
        })?;
    let api_key = api_key(name, &spec, base_url.unwrap_or(&spec.provider.base_url))?;
    let sink = match (spec.sink.kind, spec.sink.url_env.as_deref()) {
        (common::spec::SinkKind::Files, _) => {
            let dir = std::path::PathBuf::from(spec.sink.dir.clone().unwrap_or_default());
            // Refused now, not at the first batch: a directory it cannot create or write.
            common::sink::FileSink::open(&dir, name, spec.sink.segment_limits())
                .map_err(|e| RunError::Refused(format!("job `{name}`: sink.dir: {e}")))?;
            Some(common::sink::Target::Files(dir))
        }
        (common::spec::SinkKind::Postgres, Some(var)) => match std::env::var(var) {
            Ok(url) if !url.is_empty() => Some(common::sink::Target::Postgres(url)),
            _ => {
                return Err(RunError::Refused(format!(
                    "job `{name}`: the environment variable {var} (sink.url_env) is not set: it holds the database URL results are written to"
                )));
            }
        },
        _ => None,
    };
    let provider =
        Provider::new(&spec, base_url, api_key.clone()).map_err(|e| RunError::Refused(format!("HTTP client: {e}")))?;
    let limiter = Limiter::for_job(
        store,
        &spec,
        base_url.unwrap_or(&spec.provider.base_url),
        &config.consumer,
    );
    let queue = Arc::new(crate::queue::RedisQueue::paced(store, name, limiter.paced()));
    let mut job = JobCtx::new(name, spec, provider, queue, base_url, breaker_errors).map_err(RunError::Refused)?;
    job.checker = checker(name, &job.spec, base_url)?;
    job.fallback = fallback(store, name, &job.spec, config)?;
    if let Some(target) = sink {
        job.set_sink(target)
            .map_err(|e| RunError::Refused(format!("job `{name}`: sink: {e}")))?;
        warm_raw(&job).await;
    }
    if let Some(cap) = job.spec.budget.max_cost_usd {
        // The cap the workers reserve against exists (a spec updated to have one, or a lost key).
        store.set_budget_cap(name, cap, true).await?;
    }
    // What the fleet already learned about the provider.
    if let Some(learned) = store.accepted_form(&job.forms.endpoint).await? {
        job.forms.learned(&learned);
    }
    if store.proven(name).await? {
        job.breaker.set_proven();
    }
    Ok((job, limiter, api_key))
}

//! What a worker holds for each job it serves ([`JobCtx`]: its spec,
//! provider client, fleet-wide controls and outcome store), what it was told
//! about the run ([`Limits`]), and how a task ends for it ([`Settled`]).

use std::sync::Arc;

use common::ledger::PaidCall;
use common::otel::Traces;
use common::spec::JobSpec;
use common::store::{Finish, Finished, StoreError};
use common::task::{Delivery, Stamp};
use common::template::Template;

use crate::limiter::{RateHeaders, Used};
use crate::provider::Provider;
use crate::queue::JobQueue;
use crate::telemetry::Metrics;

/// Everything a worker needs to process one job's tasks.
pub struct JobCtx {
    pub name: String,
    pub spec: JobSpec,
    pub system: String,
    pub user: Template,
    /// The structured-output form sent (negotiated with `auto`).
    pub forms: crate::form::Forms,
    pub provider: Provider,
    /// Halts the job on systematic provider errors.
    pub breaker: crate::breaker::Breaker,
    /// The job's provider outage: one probe at a time while it is down.
    pub outage: crate::outage::OutageWatch,
    /// Where the job's results go after Redis (None: they stay there).
    pub sink: Option<common::sink::Target>,
    /// Where the responses' bytes are kept (beside the sink; None: no sink).
    pub raw: Option<common::sink::RawStore>,
    /// Until when (Unix ms) the raw store is taken for down after it failed:
    /// bytes go inline into the record's history meanwhile, at once.
    raw_down_until: std::sync::atomic::AtomicU64,
    /// Outcomes waiting for the sink reached `sink.max_backlog`: no claims
    /// for the job until the sink catches up (set by its sink writer).
    pub sink_full: std::sync::atomic::AtomicBool,
    /// The job's model and versions (renewed with the time for each record).
    pub stamp: Stamp,
    /// What the fleet shares about the job: the pipeline's one door to it.
    pub queue: Arc<dyn JobQueue>,
    /// The job's spend cap, when its spec has one (`[budget] max_cost_usd`).
    pub budget: Option<crate::budget::JobBudget>,
    /// The cross-check's model (`[check]`), when the job has one.
    pub checker: Option<crate::provider::Provider>,
    /// This worker's watch over the job's failure rates (see [`crate::drift`]).
    pub drift: std::sync::Mutex<crate::drift::DriftWatch>,
    /// Which tier each call takes (`provider.tiers`; see [`crate::plan`]).
    pub plan: crate::plan::Planner,
    /// The first of `[[provider.fallbacks]]`: it takes the calls while the
    /// provider is down, or too slow for the deadline.
    pub fallback: Option<FallbackCtx>,
}

/// A fallback provider as the worker holds it.
pub struct FallbackCtx {
    /// The route's name (the ledger's, `status`'s).
    pub name: String,
    /// The job's spec with the fallback's endpoint, model, key, limits and
    /// prices ([`JobSpec::as_fallback`]).
    pub spec: JobSpec,
    pub provider: Provider,
    /// Its key's fleet-wide limits.
    pub limiter: Arc<crate::limiter::Limiter>,
}

impl JobCtx {
    /// A job's context over `queue`: its prompts parsed, its structured-output
    /// form, breaker, outage view and budget fresh (a fleet then reads what
    /// the fleet already learned: see `run::load_job`). `base_url`: the
    /// worker's override of the spec's. Err names the spec field at fault.
    pub fn new(
        name: &str,
        spec: JobSpec,
        provider: Provider,
        queue: Arc<dyn JobQueue>,
        base_url: Option<&str>,
        breaker_errors: u64,
    ) -> Result<JobCtx, String> {
        let user = Template::parse(&spec.prompt.user).map_err(|e| format!("prompt.user: {e}"))?;
        let base_url = base_url.unwrap_or(&spec.provider.base_url);
        Ok(JobCtx {
            stamp: Stamp::now(&spec),
            breaker: crate::breaker::Breaker::new(breaker_errors),
            outage: crate::outage::OutageWatch::new(spec.retry.outage_budget_ms(), base_url),
            forms: crate::form::Forms::new(&spec, base_url, None),
            sink: None,
            raw: None,
            raw_down_until: std::sync::atomic::AtomicU64::new(0),
            checker: None,
            drift: std::sync::Mutex::new(crate::drift::DriftWatch::new(spec.drift.clone())),
            plan: crate::plan::Planner::new(&spec),
            fallback: None,
            sink_full: std::sync::atomic::AtomicBool::new(false),
            // Its lease is set once every job is loaded (the visibility timeout).
            budget: spec
                .budget
                .max_cost_usd
                .map(|_| crate::budget::JobBudget::new(queue.clone())),
            queue,
            name: name.to_owned(),
            system: common::spec::system_prompt(&spec),
            user,
            provider,
            spec,
        })
    }

    /// The client of the provider a route calls.
    pub fn provider_for(&self, route: crate::plan::Route) -> &Provider {
        match (route, &self.fallback) {
            (crate::plan::Route::Fallback, Some(f)) => &f.provider,
            _ => &self.provider,
        }
    }

    /// The prices of a call on `route`, at `tier` (the fallback's own, or
    /// the job's at the tier's).
    pub fn prices_for(&self, route: crate::plan::Route, tier: Option<common::route::Tier>) -> common::spec::Prices {
        match (route, &self.fallback) {
            (crate::plan::Route::Fallback, Some(f)) => f.spec.prices.clone(),
            (crate::plan::Route::Batch, _) => self.spec.prices.batch(),
            _ => self.spec.prices.of_tier(tier.unwrap_or(common::route::Tier::Standard)),
        }
    }

    /// The route's name in the ledger and the stats: the fallback's, the
    /// tier's, or `standard` for a job with a fallback (None: a job with
    /// one route names none).
    pub fn route_name(&self, route: crate::plan::Route, tier: Option<common::route::Tier>) -> Option<String> {
        let routed = self.plan.routed() || self.fallback.is_some();
        match (route, &self.fallback, tier) {
            (crate::plan::Route::Fallback, Some(f), _) => Some(f.name.clone()),
            (crate::plan::Route::Batch, _, _) => routed.then(|| "batch".to_owned()),
            (_, _, Some(t)) => Some(t.name().to_owned()),
            (_, Some(_), None) => Some(common::route::Tier::Standard.name().to_owned()),
            (_, None, None) => None,
        }
    }

    /// The job's drift watch with what it needs of the job (see [`crate::drift`]).
    pub fn drift_watch<'a>(&'a self, metrics: &'a Metrics) -> crate::drift::Watched<'a> {
        crate::drift::Watched {
            watch: &self.drift,
            job: &self.name,
            queue: self.queue.as_ref(),
            metrics,
        }
    }

    /// Stores a task's outcome (with its ack), batched with the job's other
    /// outcomes of the moment.
    /// Sends the job's results to `target` after Redis, and keeps its
    /// responses' bytes beside them (the audit trail). Err: the raw store
    /// cannot be named there (a job name no directory can have).
    pub fn set_sink(&mut self, target: common::sink::Target) -> Result<(), String> {
        let raw = common::sink::RawStore::of(&target, &self.name, &self.spec).map_err(|e| e.to_string())?;
        self.raw = Some(raw);
        self.sink = Some(target);
        Ok(())
    }

    /// Keeps bytes in the job's raw store, waiting `patience` at most: a
    /// store that failed is left alone for [`RAW_DOWN`] (the caller keeps
    /// the bytes another way meanwhile, without waiting).
    pub async fn keep_raw(&self, bytes: &[u8], patience: std::time::Duration) -> RawKept {
        use std::sync::atomic::Ordering;
        let Some(raw) = &self.raw else {
            return RawKept::NoStore;
        };
        if crate::clock::now_ms() < self.raw_down_until.load(Ordering::Relaxed) {
            return RawKept::Down("the sink did not take the last one".into());
        }
        let why = match tokio::time::timeout(patience, raw.keep(bytes)).await {
            Ok(Ok(_)) => return RawKept::Kept,
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("the sink did not answer within {patience:?}"),
        };
        let until = crate::clock::now_ms() + RAW_DOWN.as_millis() as u64;
        self.raw_down_until.store(until, Ordering::Relaxed);
        tracing::warn!(job = %self.name, error = %why, "the sink does not take the responses' bytes: they go into the records' histories for {RAW_DOWN:?}");
        RawKept::Down(why)
    }

    pub async fn finish(&self, d: &Delivery, how: &Finish) -> Result<Finished, StoreError> {
        self.finish_paid(d, how, None).await
    }

    /// [`JobCtx::finish`] with the paid call the delivery made, recorded in
    /// the ledger by the same atomic step (see [`Finishing::paid`]).
    pub async fn finish_paid(
        &self,
        d: &Delivery,
        how: &Finish,
        paid: Option<&PaidCall>,
    ) -> Result<Finished, StoreError> {
        let sampled = self.spec.audit.sampled(&d.task.rid);
        self.queue.finish(d, how, paid, sampled).await
    }
}

/// How long a raw store that failed is left alone.
pub const RAW_DOWN: std::time::Duration = std::time::Duration::from_secs(10);

/// What [`JobCtx::keep_raw`] came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RawKept {
    Kept,
    /// The job has no sink.
    NoStore,
    /// The store failed now or a moment ago (why).
    Down(String),
}

/// What a call used and what the provider said about limits, for settlement.
#[derive(Debug, Clone, Copy, Default)]
pub struct CallReport {
    pub used: Used,
    pub headers: RateHeaders,
}

/// How a task ended for this worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    Committed,
    Retried,
    /// A valid answer kept for the checker's (`[check]`): its call is next.
    Checking,
    Reviewed,
    Dropped,
    /// Already in a terminal state (a redelivery, or a late copy): only acked.
    AlreadySettled,
    /// Another worker took the task over since this delivery (this one hung
    /// or was stopped past the visibility timeout): nothing was applied.
    Stale,
    /// The answer was paid for, but Redis could not store the outcome before
    /// the visibility timeout: the task is left for another worker.
    AnswerLost,
    /// The job was cancelled before the task ran: kept for resume.
    Cancelled,
    /// Not called: its job's budget is held by the calls in flight; handed back.
    Deferred,
    /// Fleet-level fault: left pending, the job halted.
    Halted(String),
}

impl Settled {
    pub fn label(&self) -> &'static str {
        match self {
            Settled::Committed => "commit",
            Settled::Retried => "retry",
            Settled::Checking => "check",
            Settled::Reviewed => "review",
            Settled::Dropped => "drop",
            Settled::AlreadySettled => "already_settled",
            Settled::Stale => "stale",
            Settled::AnswerLost => "answer_lost",
            Settled::Cancelled => "cancelled",
            Settled::Deferred => "deferred",
            Settled::Halted(_) => "halt",
        }
    }
}

/// What the worker was told about poison and identity.
pub struct Limits {
    /// A task delivered more often than this goes to review as poison.
    pub max_deliveries: u32,
    pub worker: String,
    pub metrics: std::sync::Arc<Metrics>,
    pub traces: Traces,
    /// A task idle this long is taken over: an outcome is stored before then, or not at all.
    pub visibility: std::time::Duration,
    /// A task of this worker scheduled a retry: the promoter looks again.
    pub retry_scheduled: tokio::sync::Notify,
    /// Model calls waiting for their answer.
    pub calls: crate::calls::CallsInFlight,
}

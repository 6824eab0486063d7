//! What a worker holds for each job it serves ([`JobCtx`]: its spec,
//! provider client, fleet-wide controls and outcome store), what it was told
//! about the run ([`Limits`]), and how a task ends for it ([`Settled`]).

use common::batch::GroupCommit;
use common::ledger::PaidCall;
use common::otel::Traces;
use common::spec::JobSpec;
use common::store::{Finish, Finished, Finishing, RedisStore, StoreError};
use common::task::{Delivery, Stamp};
use common::template::Template;

use crate::limiter::{Limiter, RateHeaders, Used};
use crate::provider::Provider;
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
    /// The fleet-wide budget of the job's provider (always on; the spec's
    /// limits are its ceilings).
    pub limiter: Limiter,
    /// Halts the job on systematic provider errors.
    pub breaker: crate::breaker::Breaker,
    /// The job's provider outage: one probe at a time while it is down.
    pub outage: crate::outage::OutageWatch,
    /// Where the job's results go after Redis (None: they stay there).
    pub sink: Option<common::sink::Target>,
    /// Outcomes waiting for the sink reached `sink.max_backlog`: no claims
    /// for the job until the sink catches up (set by its sink writer).
    pub sink_full: std::sync::atomic::AtomicBool,
    /// The job's model and versions (renewed with the time for each record).
    pub stamp: Stamp,
    /// Outcomes of the job's tasks, batched (see [`finisher`]).
    pub finisher: GroupCommit<Finishing, Result<Finished, StoreError>>,
    /// The job's spend cap, when its spec has one (`[budget] max_cost_usd`).
    pub budget: Option<crate::budget::JobBudget>,
}

/// Outcomes stored together while the last call is on its way: one script
/// call per partition serves every task that finished meanwhile (at most
/// this many a call).
const FINISH_BATCH: usize = 64;

/// The job's batched outcome store: each outcome still atomic and
/// first-writer-wins on its own (see `finish.lua`).
pub fn finisher(store: &RedisStore, job: &str) -> GroupCommit<Finishing, Result<Finished, StoreError>> {
    let (store, job) = (store.clone(), job.to_owned());
    GroupCommit::new(FINISH_BATCH, move |items: Vec<Finishing>| {
        let (store, job) = (store.clone(), job.clone());
        async move { store.finish_many(&job, &items).await }
    })
}

impl JobCtx {
    /// Stores a task's outcome (with its ack), batched with the job's other
    /// outcomes of the moment.
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
        self.finisher
            .call(Finishing::new(d, how).paid(paid).audit(sampled))
            .await
            .unwrap_or(Err(StoreError::ShuttingDown))
    }
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

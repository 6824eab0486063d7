//! What an attempt leaves behind, whichever step made it (the first
//! model's call in [`crate::process`], the checker's in [`crate::check`]):
//! its budget reservation, its audit trail, its log line and metrics, and
//! its outcome stored ([`Settle`]: retried while Redis is away, up to the
//! visibility timeout).

use common::decision::{Decision, Outcome};
use common::ledger::PaidCall;
use common::otel::{Span, SpanKind};
use common::store::{Finish, Finished, StoreError};
use common::task::{Delivery, Task, Trail, Usage};
use common::template::lookup;
use common::validate::FieldError;
use serde_json::{Map, Value};

use crate::job::{JobCtx, Limits, RawKept, Settled};
use crate::judge::error_codes;
use crate::limiter::Used;
use crate::provider::{CallResult, ErrorKind};
use crate::telemetry::status_class;

/// Reserves the call at its most, at `prices`, against the job's cap, when it has one:
/// Err when it is not to be sent now (the job halted on its cap, or the
/// calls in flight hold the room: the task handed back either way, not an attempt).
pub async fn reserve(
    job: &JobCtx,
    d: &Delivery,
    limits: &Limits,
    at_most: &Usage,
    prices: &common::spec::Prices,
) -> Result<Result<Option<crate::budget::Reservation>, Settled>, StoreError> {
    let Some(budget) = &job.budget else {
        return Ok(Ok(None));
    };
    let amount = crate::budget::at_most_nusd(prices, at_most);
    // Waiting for room must leave the call its whole timeout before the
    // task could be taken over (a second paid call).
    let room = limits
        .visibility
        .saturating_sub(std::time::Duration::from_secs(job.spec.provider.timeout_secs) + crate::config::DRAIN_MARGIN)
        .saturating_sub(d.claimed_at.elapsed());
    let settled = match budget.reserve(amount, room.min(limits.visibility / 4)).await? {
        Ok(r) => return Ok(Ok(Some(r))),
        Err(crate::budget::Refused::Halted) => {
            // The job's cap could pass: halted (by the script).
            let reason = job.queue.halted().await?.unwrap_or_else(|| "budget".into());
            tracing::error!(job = %job.name, reason = %reason, "job halted on its budget: tasks stay queued");
            Settled::Halted(reason)
        }
        Err(crate::budget::Refused::Busy) => Settled::Deferred,
    };
    let _ = job.finish(d, &Finish::Release(d.task.clone())).await;
    Ok(Err(settled))
}

/// Settles a call's reservation against the job's cap with what it used
/// at `prices` (an estimate keeps the amount reserved; no usage, nothing).
pub async fn settle_reservation(
    job: &JobCtx,
    reservation: Option<crate::budget::Reservation>,
    usage: Option<Usage>,
    prices: &common::spec::Prices,
) {
    let (Some(budget), Some(r)) = (&job.budget, reservation) else {
        return;
    };
    let actual = match usage {
        Some(u) if !u.estimated => common::ledger::nano_usd(u.cost(prices)),
        Some(_) => r.amount_nusd,
        None => 0,
    };
    if let Err(e) = budget.settle(r, actual).await {
        tracing::warn!(job = %job.name, error = %e, "could not settle a budget reservation (it is charged in full when it expires)");
    }
}

/// The attempt's audit trail: the hashes of the request sent and the
/// response received, and the response's bytes kept in the job's sink
/// before its outcome is stored. A sink that does not take them within a
/// second (down, slow, refusing) is not waited for: the bytes go inline into
/// the attempt (`Trail::response_body`), and with the record's outcome into
/// the sink later; a paid answer is never held up by its copy.
pub async fn keep_trail(
    job: &JobCtx,
    d: &Delivery,
    limits: &Limits,
    (provider, request): (&crate::provider::Provider, &serde_json::value::RawValue),
    response: Option<&str>,
    batch_files: Vec<String>,
) -> Trail {
    let mut trail = Trail {
        request_sha256: common::sink::sha256_hex(request.get().as_bytes()),
        model: provider.model().to_owned(),
        provider: provider.endpoint(),
        response_sha256: response.map(|b| common::sink::sha256_hex(b.as_bytes())),
        response_kept: false,
        response_body: None,
        batch_files,
    };
    let Some(body) = response else { return trail };
    // Never at the cost of the outcome's own time before the visibility timeout.
    let left = limits.visibility.saturating_sub(d.claimed_at.elapsed()) / 4;
    match job.keep_raw(body.as_bytes(), RAW_PATIENCE.min(left)).await {
        RawKept::Kept => trail.response_kept = true,
        RawKept::NoStore => {}
        RawKept::Down(_) => {
            limits.metrics.raw_inline.with_label_values(&[&job.name]).inc();
            trail.response_body = Some(body.to_owned());
        }
    }
    trail
}

/// How long a response's bytes wait for the sink before going inline.
const RAW_PATIENCE: std::time::Duration = std::time::Duration::from_secs(1);

/// What a call used, for the limiter: usage when the provider reported it.
pub fn used_of(result: &CallResult) -> Used {
    match result {
        CallResult::Message { usage: Some(u), .. } => Used {
            prompt_tokens: Some(u.prompt),
            completion_tokens: Some(u.completion),
            ..Used::default()
        },
        CallResult::Failed(e) if e.kind == ErrorKind::RateLimited => Used {
            rate_limited: true,
            retry_after_ms: e.retry_after_ms,
            ..Used::default()
        },
        CallResult::Failed(e) if e.cause == "timeout" => Used {
            timed_out: true,
            ..Used::default()
        },
        _ => Used::default(),
    }
}

/// Applies the outcome with one atomic store call (the `commit` span).
///
/// After a call (`called`) the answer is not given up at the first Redis
/// error: the call is retried with back-off for as long as this delivery is
/// surely still the live one (until a second before the visibility
/// timeout); only then is the answer counted lost and the task left for
/// another worker (its paid call, `paid`, is recorded in the ledger when
/// Redis takes it: as lost).
/// What a delivery's outcome is stored with: [`Settle::store`].
#[derive(Clone, Copy)]
pub struct Settle<'a> {
    pub job: &'a JobCtx,
    pub d: &'a Delivery,
    pub span: &'a Span,
    pub limits: &'a Limits,
    /// The paid call the outcome carries into the ledger, if any.
    pub paid: Option<&'a PaidCall>,
}

impl Settle<'_> {
    /// Stores a retry `delay_ms` from now. Due at once (a failed probe while
    /// the provider is down, a refused response format, a backoff of 0): back
    /// on the stream (the fleet woken), not through the delayed set; while
    /// the provider is down (a failed probe) it wakes no one: only the next
    /// probe takes it, on its own time (with a fallback, the fallback may).
    pub async fn retry(&self, task: Task, delay_ms: u64, called: bool) -> Result<Settled, StoreError> {
        let job = self.job;
        let due_ms = if delay_ms == 0 {
            0
        } else {
            crate::clock::now_ms() + delay_ms
        };
        let how = if due_ms == 0 && job.outage.is_down() && job.fallback.is_none() {
            // This worker's failed probe, whose failure left it the next
            // probe's lease: its delivery is kept for that probe (no trip
            // back through the stream); a paid call goes to the ledger with
            // its outcome, so such a probe's record goes back.
            if self.paid.is_some() {
                Finish::Requeue(task)
            } else {
                match job.outage.keep(self.d, task, self.limits.visibility) {
                    None => return Ok(Settled::Retried),
                    Some(task) => Finish::Requeue(task),
                }
            }
        } else {
            Finish::Retry { due_ms, task }
        };
        let settled = self.store(how, Settled::Retried, called).await;
        if due_ms > 0 {
            self.limits.retry_scheduled.notify_one();
        }
        settled
    }

    pub async fn store(&self, how: Finish, then: Settled, called: bool) -> Result<Settled, StoreError> {
        let Settle {
            job,
            d,
            span,
            limits,
            paid,
        } = *self;
        // The call is over: its slot may go to another task while this
        // outcome waits for its commit.
        crate::slot::storing_outcome();
        let commit = span.child("commit", SpanKind::Internal);
        commit.set("batchfleet.finish", then.label());
        let deadline = limits.visibility.saturating_sub(std::time::Duration::from_secs(1));
        let mut pause = std::time::Duration::from_millis(50);
        let finished = loop {
            match job.finish_paid(d, &how, paid).await {
                Ok(f) => break f,
                Err(e) if called && d.claimed_at.elapsed() + pause < deadline => {
                    limits.metrics.store_errors.inc();
                    tracing::warn!(job = %job.name, record_id = %d.task.rid, error = %e, "cannot store a paid answer yet; retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(std::time::Duration::from_secs(1));
                }
                Err(e) if called => {
                    commit.fail(format!("store error: {e}"));
                    tracing::error!(job = %job.name, record_id = %d.task.rid, error = %e, "a paid answer could not be stored before the visibility timeout: lost");
                    if let Some(call) = paid {
                        limits.calls.lose(&job.name, d.partition, call.clone());
                    }
                    return Ok(Settled::AnswerLost);
                }
                Err(e) => {
                    commit.fail(format!("store error: {e}"));
                    return Err(e);
                }
            }
        };
        commit.set("batchfleet.moved", finished == Finished::Moved);
        Ok(match finished {
            Finished::Moved => then,
            Finished::AlreadySettled => Settled::AlreadySettled,
            Finished::Stale => {
                tracing::warn!(job = %job.name, record_id = %d.task.rid, "a late outcome of a task another worker took over: not applied");
                Settled::Stale
            }
        })
    }
}

pub fn business_key(input: &Map<String, Value>, id_field: &str) -> String {
    match lookup(input, id_field) {
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
        None => String::new(),
    }
}

pub fn outcome_label(o: &Outcome) -> &str {
    match o {
        Outcome::Valid => "valid",
        Outcome::Invalid(_) => "invalid_output",
        Outcome::Transient { cause, .. } => cause,
        Outcome::RateLimited { .. } => "rate_limited",
        Outcome::Truncated => "truncated",
        Outcome::Refused { cause } => cause,
        Outcome::Permanent { cause } => cause,
        Outcome::FleetHalt { cause } => cause,
        Outcome::InputError { reason } => reason,
        Outcome::Poison { .. } => "poison",
        Outcome::Suspect { cause } => cause,
        Outcome::FormRefused => "response_format_refused",
        Outcome::NoNewAttempt => "no_new_attempt",
        Outcome::OverBudget { .. } => "over_budget",
    }
}

pub fn decision_label(d: &Decision) -> &'static str {
    match d {
        Decision::Commit => "commit",
        Decision::Retry { .. } => "retry",
        Decision::Review { .. } => "review",
        Decision::Drop { .. } => "drop",
        Decision::Halt { .. } => "halt",
    }
}

/// What one attempt came to, for its log line and its metrics.
pub struct AttemptFacts<'a> {
    pub attempt: u32,
    pub decision: &'a str,
    pub outcome: &'a str,
    /// The online call's (none for a batch's line).
    pub elapsed: Option<std::time::Duration>,
    pub status: Option<u16>,
    pub usage: Option<&'a Usage>,
    /// USD, at the prices it was made at.
    pub cost: f64,
    pub errors: &'a [FieldError],
}

/// Logs an attempt and counts it: one place for both.
pub fn attempt_event(job: &JobCtx, d: &Delivery, limits: &Limits, f: AttemptFacts<'_>) {
    let m = &limits.metrics;
    let name = job.name.as_str();
    let class = status_class(f.status);
    m.provider_requests.with_label_values(&[name, class]).inc();
    if let Some(elapsed) = f.elapsed {
        m.model_latency
            .with_label_values(&[name, class])
            .observe(elapsed.as_secs_f64());
    }
    m.attempts.with_label_values(&[name, f.outcome]).inc();
    if f.status == Some(429) && f.outcome == "rate_limited" {
        m.rate_limited.with_label_values(&[name]).inc();
    }
    for e in f.errors {
        m.validation_errors
            .with_label_values(&[name, e.code.as_str(), e.field.as_str()])
            .inc();
    }
    let u = f.usage.copied().unwrap_or_default();
    for (kind, n) in [("prompt", u.prompt), ("cached", u.cached), ("completion", u.completion)] {
        if n > 0 {
            m.tokens.with_label_values(&[name, kind]).inc_by(n);
        }
    }
    m.cost.with_label_values(&[name]).inc_by(f.cost);
    let codes = error_codes(f.errors);
    log_event(
        job,
        d,
        f.attempt,
        f.decision,
        f.outcome,
        f.elapsed.map_or(0, |e| e.as_millis() as u64),
        &codes,
    );
}

pub fn log_event(
    job: &JobCtx,
    d: &Delivery,
    attempt: u32,
    decision: &str,
    outcome: &str,
    elapsed_ms: u64,
    errors: &[String],
) {
    let v = &job.spec.versions;
    tracing::info!(
        job = %job.name,
        record_id = %d.task.rid,
        attempt,
        outcome,
        decision,
        elapsed_ms,
        errors = ?errors,
        versions = %format_args!("source={} prompt={} output={}", v.source, v.prompt, v.output),
        "attempt"
    );
}

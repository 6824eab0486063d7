//! The cross-check's step (see `common::check`): a valid answer the job's
//! `[check]` selects is kept in the task with its paid call
//! ([`checking_task`]), and the record's next delivery calls the checker
//! model with the same prompt, or the spec's verification prompt ([`run`]):
//! the fields that must agree agree, and the first answer is committed; or they do not, and the record goes
//! to review with both answers (reason `checker_disagrees`, an `E_CHECK`
//! error per field). The checker's call is in the ledger (cause `check`)
//! and in the record's history with its verdict and audit trail. A checker
//! that fails transiently costs time, never the kept answer, for as long as
//! the job waits out an outage (then the record is reviewed with it); an
//! error about one record reviews it; a key or quota refused halts the job.

use common::check::{DISAGREES, Pending, Verdict};
use common::decision::{Decision, Outcome, ProviderState, Standing, decide};
use common::ledger::{Cause, Fate, PaidCall};
use common::otel::Span;
use common::store::{Finish, StoreError};
use common::task::{Answer, Attempt, Delivery, HistoryItem, ResultRecord, ReviewEntry, ReviewFacts, Task, Usage};
use common::validate::{ErrorCode, FieldError};
use rand::RngExt;

use crate::attempt::{
    AttemptFacts, Settle, attempt_event, business_key, decision_label, keep_trail, outcome_label, reserve, used_of,
};
use crate::clock::now_ms;
use crate::job::{CallReport, JobCtx, Limits, Settled};
use crate::judge::Reply;
use crate::limiter::estimate_tokens;
use crate::provider::{CallResult, Request};

/// The task that keeps a valid answer for the checker, when the job checks
/// this one (None: commit it now).
pub(crate) fn checking_task(
    job: &JobCtx,
    d: &Delivery,
    attempts: u32,
    calls: u32,
    reply: &Reply,
    history: &[HistoryItem],
) -> Option<Task> {
    let output = reply.output.as_ref()?;
    if job.checker.is_none() || d.task.check.is_some() || !job.spec.check.selects(&d.task.rid, output) {
        return None;
    }
    let mut task = d.task.next(attempts, calls, Vec::new(), history.to_vec());
    // Batch mode: the checker is called online.
    task.online = true;
    task.check = Some(Box::new(Pending {
        output: output.clone(),
        response_id: reply.response_id.clone(),
        repairs: reply.repairs.clone(),
        usage: reply.usage,
    }));
    Some(task)
}

/// The checker's call for a task holding a valid answer, and what it comes to.
pub(crate) async fn run(
    job: &JobCtx,
    d: &Delivery,
    limits: &Limits,
    report: &mut Option<CallReport>,
    span: &Span,
) -> Result<Settled, StoreError> {
    let pending = d.task.check.as_deref().cloned().expect("run only for a pending check");
    let input = d.task.input_object();
    let key = business_key(&input, &job.spec.job.id_field);
    let settle = Settle {
        job,
        d,
        span,
        limits,
        paid: None,
    };
    let Planned {
        checker,
        prompt,
        at_most,
        prices,
    } = match plan(job, d, limits, &pending, &key) {
        Ok(planned) => planned,
        Err(unsent) => {
            let (how, then) = *unsent;
            return settle.store(how, then, false).await;
        }
    };
    let call = match call(job, d, limits, (checker, &prompt), (&at_most, &prices), span).await? {
        Ok(call) => call,
        Err(settled) => return Ok(settled),
    };
    // The job's limiter hears of the call only when it went to the job's own endpoint.
    if checker.endpoint() == job.provider.endpoint() {
        *report = Some(call.report);
    }
    let (verdict, decision) = judge(job, d, checker.model(), &pending, &call);
    let stamp = job.stamp.renewed();
    let mut history = d.task.history.clone();
    history.push(HistoryItem::Attempt(told(
        job,
        d,
        limits,
        &call,
        (&decision, verdict.clone()),
        &stamp,
    )));
    let settle = Settle {
        paid: call.paid.as_ref(),
        ..settle
    };
    let task = |history: Vec<HistoryItem>| {
        let mut task = d.task.clone();
        task.calls = call.calls;
        task.history = history;
        task.failing_since = call.failing_since;
        task
    };
    match decision {
        Decision::Commit => {
            let result = result(job, d, limits, &pending, &key, history);
            settle.store(Finish::Commit(result), Settled::Committed, true).await
        }
        Decision::Review { reason } => {
            let errors = verdict.as_ref().map(disagreements).unwrap_or_default();
            let entry = review_entry(job, d, limits, (&key, &prompt), &pending, &errors, &reason, history);
            settle.store(Finish::Review(entry), Settled::Reviewed, true).await
        }
        Decision::Retry { delay_ms, .. } => {
            let how = Finish::Retry {
                due_ms: now_ms() + delay_ms,
                task: task(history),
            };
            let settled = settle.store(how, Settled::Retried, true).await;
            limits.retry_scheduled.notify_one();
            settled
        }
        Decision::Halt { reason } | Decision::Drop { reason } => {
            job.queue.halt(&reason).await?;
            tracing::error!(job = %job.name, reason = %reason, "fleet halted: the checker refuses its calls; tasks stay queued");
            let _ = job
                .finish_paid(d, &Finish::Release(task(history)), call.paid.as_ref())
                .await;
            Ok(Settled::Halted(reason))
        }
    }
}

/// The checker's call to make: its prompt, at its most, at its prices.
struct Planned<'a> {
    checker: &'a crate::provider::Provider,
    prompt: String,
    at_most: Usage,
    prices: common::spec::Prices,
}

/// The checker's call, or how the record ends without it (Err): a check
/// delivered too often (every worker that took it died or hung on it) and
/// a call that could pass the record's own caps go to a person with the
/// first answer (kept, paid for); a job whose spec no longer names a
/// checker (or renders the record) commits the answer as it is.
fn plan<'a>(
    job: &'a JobCtx,
    d: &Delivery,
    limits: &Limits,
    pending: &Pending,
    key: &str,
) -> Result<Planned<'a>, Box<(Finish, Settled)>> {
    let review = |prompt: &str, reason: &str| {
        let entry = review_entry(
            job,
            d,
            limits,
            (key, prompt),
            pending,
            &[],
            reason,
            d.task.history.clone(),
        );
        Box::new((Finish::Review(entry), Settled::Reviewed))
    };
    if d.deliveries > limits.max_deliveries {
        return Err(review("", "poison"));
    }
    let prompt = job
        .spec
        .check
        .prompt_for(&job.user, &d.task.input_object(), &pending.output);
    let (Some(checker), Ok(prompt)) = (&job.checker, prompt) else {
        let result = result(job, d, limits, pending, key, d.task.history.clone());
        return Err(Box::new((Finish::Commit(result), Settled::Committed)));
    };
    let prices = job.spec.check.prices.clone().unwrap_or_else(|| job.spec.prices.clone());
    let at_most = crate::budget::at_most(
        &job.spec,
        &[&job.system, &prompt],
        job.forms.format_bytes(job.forms.current().0),
    );
    if let Some(why) = crate::budget::over_record_cap(&job.spec, &d.task, &at_most, &prices) {
        tracing::warn!(job = %job.name, record_id = %d.task.rid, why = %why, "record over its budget: to review with the first answer, the checker not called");
        return Err(review(&prompt, "budget"));
    }
    Ok(Planned {
        checker,
        prompt,
        at_most,
        prices,
    })
}

/// The checker's call as made: its reply, the paid call it may be billed
/// for (held among the calls in flight until the outcome is stored), its
/// audit trail, and what it tells the limiter.
struct CheckerCall<'a> {
    reply: Reply,
    paid: Option<PaidCall>,
    /// Until the outcome is stored: a drain that runs out meanwhile records
    /// the paid call as lost.
    _waiting: crate::calls::CallInFlight<'a>,
    trail: common::task::Trail,
    calls: u32,
    elapsed: std::time::Duration,
    cost: f64,
    report: CallReport,
    /// When the record's checker calls began failing in a row (0: answered).
    failing_since: u64,
}

/// Calls the checker with `prompt`, reserved against the job's cap at the
/// checker's prices (Err: not sent now, the task handed back).
async fn call<'a>(
    job: &JobCtx,
    d: &Delivery,
    limits: &'a Limits,
    (checker, prompt): (&crate::provider::Provider, &str),
    (at_most, prices): (&Usage, &common::spec::Prices),
    span: &Span,
) -> Result<Result<CheckerCall<'a>, Settled>, StoreError> {
    let (_, response_format) = job.forms.current();
    let body = checker.body(&Request {
        system: &job.system,
        user: prompt,
        feedback: None,
        previous: None,
        temperature: None,
        response_format,
        record: &d.task.rid,
        worker: &limits.worker,
        service_tier: None,
    });
    let calls = d.task.calls + 1;
    let tokens = estimate_tokens(&job.system) + estimate_tokens(prompt);
    let estimate = Usage::estimate(tokens, u64::from(job.spec.provider.max_tokens));
    let reservation = match reserve(job, d, limits, at_most, prices).await? {
        Ok(r) => r,
        Err(settled) => return Ok(Err(settled)),
    };
    let paid_at = |usage: Usage| {
        let mut call = PaidCall::new(
            &d.task,
            d.task.attempt,
            calls,
            d.deliveries,
            &limits.worker,
            usage,
            prices,
            now_ms(),
        );
        call.cause = Cause::Check;
        call.to_model(checker.model())
    };
    let mut cut_off = paid_at(estimate);
    cut_off.fate = Fate::Abandoned;
    limits.metrics.in_flight.inc();
    let waiting = limits.calls.start(&job.name, d.partition, cut_off);
    let started_ms = now_ms();
    let called = checker.call(&d.task.rid, &limits.worker, &body).await;
    limits.metrics.in_flight.dec();
    let report = CallReport {
        used: used_of(&called.result),
        headers: called.headers,
    };
    let trail = keep_trail(job, d, limits, (checker, &body), called.body.as_deref(), Vec::new()).await;
    let answered = matches!(called.result, CallResult::Message { .. });
    let mut reply = called.result.into_reply(&job.spec, &d.task.input_object(), span);
    if reply.usage.is_none() && (answered || report.used.timed_out) {
        reply.usage = Some(estimate);
    }
    crate::attempt::settle_reservation(job, reservation, reply.usage, prices).await;
    let paid = waiting.answered(reply.usage.map(paid_at));
    let cost = reply.usage.map_or(0.0, |u| u.cost(prices));
    let failing_since = match reply.outcome.is_world_failure() {
        true if d.task.failing_since > 0 => d.task.failing_since,
        true => started_ms,
        false => 0,
    };
    Ok(Ok(CheckerCall {
        reply,
        paid,
        _waiting: waiting,
        trail,
        calls,
        elapsed: called.elapsed,
        cost,
        report,
        failing_since,
    }))
}

/// The checker's call as the record's history keeps it, logged and counted.
fn told(
    job: &JobCtx,
    d: &Delivery,
    limits: &Limits,
    call: &CheckerCall<'_>,
    (decision, verdict): (&Decision, Option<Verdict>),
    stamp: &common::task::Stamp,
) -> Attempt {
    let reply = &call.reply;
    let outcome = match &verdict {
        Some(v) if v.agrees() => "check_agrees",
        Some(v) if v.checker.is_none() => "check_invalid",
        Some(_) => "check_disagrees",
        None => outcome_label(&reply.outcome),
    };
    let decision = decision_label(decision);
    let facts = AttemptFacts {
        attempt: d.task.attempt,
        decision,
        outcome,
        elapsed: Some(call.elapsed),
        status: reply.status,
        usage: reply.usage.as_ref(),
        cost: call.cost,
        errors: &[],
    };
    attempt_event(job, d, limits, facts);
    Attempt {
        attempt: d.task.attempt,
        call: call.calls,
        at: stamp.at.clone(),
        worker: limits.worker.clone(),
        elapsed_ms: call.elapsed.as_millis() as u64,
        status: reply.status,
        response_id: reply.response_id.clone(),
        finish_reason: reply.finish_reason.clone(),
        outcome: outcome.to_owned(),
        errors: reply.errors().to_vec(),
        repairs: reply.repairs.clone(),
        usage: reply.usage,
        decision: decision.to_owned(),
        error: reply.error.as_ref().and_then(|e| e.message.clone()),
        feedback: None,
        batch: None,
        tier: None,
        trail: call.trail.clone(),
        check: verdict,
    }
}

/// A review entry with the first answer as its last output (accepting it
/// as it is keeps that answer).
#[allow(clippy::too_many_arguments)]
fn review_entry(
    job: &JobCtx,
    d: &Delivery,
    limits: &Limits,
    (key, prompt): (&str, &str),
    pending: &Pending,
    errors: &[FieldError],
    reason: &str,
    history: Vec<HistoryItem>,
) -> ReviewEntry {
    let first = serde_json::to_string(&pending.output).unwrap_or_default();
    let facts = ReviewFacts {
        key,
        prompt,
        last_raw_output: &first,
        errors,
        attempts: d.task.attempt,
        reason,
    };
    ReviewEntry::new(d, facts, history, &job.stamp.renewed(), &limits.worker)
}

/// What the checker's answer comes to: a verdict when it answered, and the
/// decision. Agreement commits; a disagreement (or an answer of its own
/// that is not valid: `checker_invalid`) is reviewed with both. A failure
/// waits as any call's does, for as long as the job waits out an outage,
/// then the record is reviewed with the first answer; an error about this
/// record alone reviews it at once; only one about the checker's setup (a
/// key or quota refused) halts the job.
fn judge(
    job: &JobCtx,
    d: &Delivery,
    model: &str,
    pending: &Pending,
    call: &CheckerCall<'_>,
) -> (Option<Verdict>, Decision) {
    let reply = &call.reply;
    let verdict = |checker: Option<serde_json::Map<String, serde_json::Value>>| {
        let fields = match &checker {
            Some(out) => job.spec.check.compare(&pending.output, out),
            None => job.spec.check.fields.iter().map(|f| (f.clone(), false)).collect(),
        };
        Verdict {
            model: model.to_owned(),
            fields,
            first: pending.output.clone(),
            checker,
        }
    };
    let review = |reason: &str| Decision::Review {
        reason: reason.to_owned(),
    };
    match &reply.outcome {
        Outcome::Valid => {
            let v = verdict(reply.output.clone());
            let decision = if v.agrees() {
                Decision::Commit
            } else {
                review(DISAGREES)
            };
            (Some(v), decision)
        }
        // The checker's own answer is wrong or missing: nothing to agree with.
        Outcome::Invalid(_) | Outcome::Truncated | Outcome::Refused { .. } => (Some(verdict(None)), review(INVALID)),
        other => {
            let failing_ms = match call.failing_since {
                0 => 0,
                since => now_ms().saturating_sub(since),
            };
            let standing = Standing {
                attempt: d.task.attempt.max(1),
                calls: call.calls,
                provider: ProviderState::Up { failing_ms },
            };
            let said = reply.error.as_ref().and_then(|e| e.message.clone()).unwrap_or_default();
            let decision = match decide(standing, other, &job.spec.retry, rand::rng().random_range(0.0..1.0)) {
                Decision::Retry { delay_ms, cause, .. } => Decision::Retry {
                    delay_ms,
                    cause,
                    feedback: None,
                },
                Decision::Halt { reason } => Decision::Halt {
                    reason: format!(
                        "the checker ({model}) refuses its calls: {reason}: {said}; fix [check] (model, base_url, \
                         api_key_env), then `producer resume --job {}`",
                        job.name
                    ),
                },
                Decision::Review { reason } | Decision::Drop { reason } => review(&format!("checker_{reason}")),
                Decision::Commit => review(INVALID),
            };
            (None, decision)
        }
    }
}

/// The review reason of a checker whose own answer was not valid.
const INVALID: &str = "checker_invalid";

/// An `E_CHECK` error per field the checker answered otherwise (or one for
/// the whole answer when the checker's was not valid).
fn disagreements(v: &Verdict) -> Vec<FieldError> {
    if v.checker.is_none() {
        return vec![FieldError {
            code: ErrorCode::Check,
            field: String::new(),
            message: format!("the checker ({}) gave no valid answer to compare with", v.model),
        }];
    }
    v.side_by_side()
        .into_iter()
        .filter(|(_, _, _, agree)| !agree)
        .map(|(field, first, checker, _)| FieldError {
            code: ErrorCode::Check,
            message: format!("the checker ({}) answered {checker}, the first model {first}", v.model),
            field,
        })
        .collect()
}

/// The kept answer as the record's result.
fn result(
    job: &JobCtx,
    d: &Delivery,
    limits: &Limits,
    pending: &Pending,
    key: &str,
    history: Vec<HistoryItem>,
) -> ResultRecord {
    let answer = Answer {
        key: key.to_owned(),
        output: pending.output.clone(),
        attempts: d.task.attempt,
        calls: common::task::calls_in(&history),
        response_id: pending.response_id.clone(),
        repairs: pending.repairs.clone(),
        usage: pending.usage,
    };
    let mut result = ResultRecord::from_model(&d.task, answer, history, &job.stamp.renewed(), &limits.worker);
    if job.sink.is_some() || job.spec.audit.sampled(&d.task.rid) {
        result.input = Some(d.task.input.clone());
    }
    result
}

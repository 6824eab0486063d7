//! One delivered task, start to end: render, call, validate, decide, apply.
//!
//! The decision itself is [`common::decision::decide`]; this module gathers
//! its inputs and applies its answer with one atomic store call.

use common::decision::{Decision, Outcome, Standing, decide};
use common::ledger::{Fate, PaidCall};
use common::otel::{Span, SpanKind};
use common::route::Tier;
use common::store::{Finish, StoreError};
use common::task::{
    Answer, Attempt, Delivery, HistoryItem, RecordState, ResultRecord, ReviewEntry, ReviewFacts, Stamp, Task, Trail,
    Usage,
};
use common::validate::{FieldError, feedback_with_note};
use rand::RngExt;
use serde_json::{Map, Value};

use crate::attempt::{
    AttemptFacts, Settle, attempt_event, business_key, decision_label, keep_trail, log_event, outcome_label, reserve,
    used_of,
};
use crate::calls::CallInFlight;
use crate::clock::now_ms;
use crate::job::{CallReport, JobCtx, Limits, Settled};
use crate::judge::Reply;
use crate::limiter::estimate_tokens;
use crate::plan::Route;
use crate::provider::{CallResult, Request};

/// Processes one delivery. Store errors are returned (the task then stays
/// pending and is reclaimed); everything else ends in a [`Settled`]. `report`
/// receives what the model call used (it stays None when no call was made).
///
/// With tracing on, the attempt is a span (child of the record's enqueue
/// span) holding `model_call`, `validate` and `commit` spans.
pub async fn process(
    job: &JobCtx,
    d: Delivery,
    limits: &Limits,
    report: &mut Option<CallReport>,
    route: Route,
) -> Result<Settled, StoreError> {
    let span = attempt_span(job, &d, limits);
    let settled = run_attempt(job, d, limits, (report, route), &span).await;
    attempt_settled(&span, &settled);
    settled
}

/// An attempt's span (a child of the record's enqueue span) with the facts
/// every attempt has: its delivery, or the shard whose batch answered it.
fn attempt_span(job: &JobCtx, d: &Delivery, limits: &Limits) -> Span {
    let span = limits.traces.start("attempt", SpanKind::Consumer, Some(&d.task.tp));
    if span.is_on() {
        span.set("batchfleet.job", job.name.clone());
        span.set("batchfleet.record_id", d.task.rid.clone());
        span.set("batchfleet.partition", i64::from(d.partition));
        match &d.shard {
            Some(shard) => span.set("batchfleet.shard", shard.clone()),
            None => span.set("batchfleet.delivery", i64::from(d.deliveries)),
        }
        span.set("batchfleet.worker", limits.worker.clone());
    }
    span
}

/// How the attempt ended, on its span.
fn attempt_settled(span: &Span, settled: &Result<Settled, StoreError>) {
    match settled {
        Ok(s) => span.set("batchfleet.settled", s.label()),
        Err(e) => span.fail(format!("store error: {e}")),
    }
}

/// What a delivery is before any call: attempts so far, its input and key.
pub struct Before {
    /// Attempts made before this delivery; each redelivery beyond the first
    /// is an attempt whose worker died, and counts.
    attempts: u32,
    input: Map<String, Value>,
    key: String,
}

/// A task's request before any call: what the model is sent, and what its
/// answer is judged with. Built the same way for an online call and for a
/// line of a provider batch (the same body, byte for byte).
pub struct Prepared {
    before: Before,
    /// The user prompt with the feedback, as the review entry shows it.
    user: String,
    sent_feedback: Option<String>,
    form: common::spec::StructuredOutput,
    /// The request body.
    pub body: Box<serde_json::value::RawValue>,
    fp: String,
    /// What the call may cost if the server generates it and we never see it.
    estimate: Usage,
    /// At most what the call can use: its messages and `max_tokens`.
    pub at_most: Usage,
    /// The tier it asks for (None: the job names none: standard).
    pub tier: Option<Tier>,
    /// The provider it goes to.
    pub route: Route,
}

impl Prepared {
    /// The request's fingerprint (see [`crate::provider::fingerprint`]).
    pub fn fingerprint(&self) -> &str {
        &self.fp
    }
}

/// Before any call: a poison task or an input error is decided without one
/// (returned with the delivery's facts); otherwise the request.
pub fn prepare(job: &JobCtx, d: &Delivery, limits: &Limits, route: Route) -> Result<Prepared, Box<(Before, Outcome)>> {
    let input = d.task.input_object();
    let before = Before {
        attempts: d.task.attempt + d.deliveries.saturating_sub(1),
        key: business_key(&input, &job.spec.job.id_field),
        input,
    };
    if d.deliveries > limits.max_deliveries {
        let outcome = Outcome::Poison {
            deliveries: d.deliveries,
        };
        return Err(Box::new((before, outcome)));
    }
    if let Some(field) = &job.spec.prompt.request_field {
        return prepare_passthrough(job, d, before, (field, route));
    }
    let rendered = match job.user.render(&before.input) {
        Ok(rendered) => rendered,
        Err(missing) => {
            let outcome = Outcome::InputError {
                reason: missing.to_string(),
            };
            return Err(Box::new((before, outcome)));
        }
    };
    let sent_feedback = feedback_with_note(&d.task.feedback, d.task.note.as_deref());
    let user = match &sent_feedback {
        None => rendered.clone(),
        Some(f) => format!("{rendered}\n\n{f}"),
    };
    let (form, response_format) = job.forms.current();
    let tier = (route == Route::Primary).then(|| job.plan.tier_for(&d.task)).flatten();
    let in_round = (before.attempts + 1).saturating_sub(d.task.base);
    let previous = d.task.answer.as_deref().filter(|_| sent_feedback.is_some());
    let request = Request {
        system: &job.system,
        user: &rendered,
        feedback: sent_feedback.as_deref(),
        previous,
        temperature: job.spec.retry.temperature(in_round),
        response_format,
        record: &d.task.rid,
        worker: &limits.worker,
        service_tier: tier.map(Tier::service_tier),
    };
    let body = job.provider_for(route).body(&request);
    // The fingerprint leaves the tier out: the same request on another tier
    // buys the same answer, and is not sent again.
    let untiered = tier.map(|_| {
        job.provider_for(route).body(&Request {
            service_tier: None,
            ..request
        })
    });
    let fp = crate::provider::fingerprint(untiered.as_ref().unwrap_or(&body));
    let estimate = Usage::estimate(
        estimate_tokens(&job.system) + estimate_tokens(&user) + previous.map_or(0, estimate_tokens),
        u64::from(job.spec.provider.max_tokens),
    );
    // As the body sends them: system, user, and after invalid output the
    // model's answer and the feedback as messages of their own.
    let messages: Vec<&str> = match (previous, sent_feedback.as_deref()) {
        (Some(previous), Some(fb)) => vec![job.system.as_str(), rendered.as_str(), previous, fb],
        _ => vec![job.system.as_str(), user.as_str()],
    };
    let at_most = crate::budget::at_most(&job.spec, &messages, job.forms.format_bytes(form));
    Ok(Prepared {
        fp,
        before,
        user,
        sent_feedback,
        form,
        body,
        estimate,
        at_most,
        tier,
        route,
    })
}

/// [`prepare`] for a request passed through from the record's `field`.
fn prepare_passthrough(
    job: &JobCtx,
    d: &Delivery,
    before: Before,
    (field, route): (&str, Route),
) -> Result<Prepared, Box<(Before, Outcome)>> {
    let sent_feedback = feedback_with_note(&d.task.feedback, d.task.note.as_deref());
    let previous = d.task.answer.as_deref().filter(|_| sent_feedback.is_some());
    let retry = previous.zip(sent_feedback.as_deref());
    let request = common::template::lookup(&before.input, field);
    // A request that sets no response_format is asked for the job's fields (a template's).
    let (form, response_format) = if job.spec.output.fields.is_empty() {
        (common::spec::StructuredOutput::Off, None)
    } else {
        job.forms.current()
    };
    // A request that names its tier keeps it; otherwise the plan's.
    let named = request
        .and_then(|r| r.get("service_tier"))
        .and_then(serde_json::Value::as_str);
    let planned = (route == Route::Primary).then(|| job.plan.tier_for(&d.task)).flatten();
    let tier = match named {
        _ if route != Route::Primary => None,
        Some(t) => Some(if t == "flex" { Tier::Flex } else { Tier::Standard }),
        None => planned,
    };
    let provider = job.provider_for(route);
    let made = |tier: Option<&str>| {
        let to = (tier, route == Route::Fallback);
        provider.passthrough_body(request, field, retry, response_format, to)
    };
    let (body, max_tokens, formatted) = match made(planned.map(Tier::service_tier)) {
        Ok(made) => made,
        Err(reason) => return Err(Box::new((before, Outcome::InputError { reason }))),
    };
    // The fingerprint leaves the plan's tier out (see [`prepare`]).
    let fp = match (named, planned) {
        (None, Some(_)) => made(None).map_or_else(
            |_| crate::provider::fingerprint(&body),
            |(b, ..)| crate::provider::fingerprint(&b),
        ),
        _ => crate::provider::fingerprint(&body),
    };
    let form = if formatted {
        form
    } else {
        common::spec::StructuredOutput::Off
    };
    // The review entry shows the request as sent.
    let user = body.get().to_owned();
    let estimate = Usage::estimate(estimate_tokens(&user), max_tokens);
    // Estimated from the body's bytes, the response format in it included.
    let mut at_most = crate::budget::at_most(&job.spec, &[user.as_str()], 0);
    at_most.completion = max_tokens;
    at_most.total = at_most.prompt + max_tokens;
    Ok(Prepared {
        fp,
        before,
        user,
        sent_feedback,
        form,
        body,
        estimate,
        at_most,
        tier,
        route,
    })
}

/// How a call was made, for its paid call.
enum Via<'a> {
    /// Online: waiting in [`CallsInFlight`] until its outcome is stored,
    /// with its budget reservation.
    Online {
        waiting: CallInFlight<'a>,
        reservation: Option<crate::budget::Reservation>,
    },
    /// Through the provider's Batch API: at batch prices, its ledger key
    /// drawn from the output line that answered it.
    Batch { line: String },
}

async fn run_attempt(
    job: &JobCtx,
    d: Delivery,
    limits: &Limits,
    (report, route): (&mut Option<CallReport>, Route),
    span: &Span,
) -> Result<Settled, StoreError> {
    // Read with the claim, moments ago: still the live delivery (the commit
    // checks again), no round trip of its own.
    let (state, live) = match &d.state_at_claim {
        Some(state) if d.claimed_at.elapsed() < limits.visibility / 4 => (state.clone(), true),
        _ => job.queue.check(&d).await?,
    };
    if state.as_ref().is_some_and(RecordState::is_terminal) {
        job.queue.ack(&d).await?;
        return Ok(Settled::AlreadySettled);
    }
    if !live {
        tracing::warn!(job = %job.name, record_id = %d.task.rid, "the task was taken over by another worker before its call: not called");
        return Ok(Settled::Stale);
    }
    if d.task.check.is_some() {
        return crate::check::run(job, &d, limits, report, span).await;
    }
    // Poison and input errors are decided before any call.
    let prep = match prepare(job, &d, limits, route) {
        Ok(prep) => prep,
        Err(unsent) => {
            let (before, outcome) = *unsent;
            return without_call(job, &d, &before, outcome, None, limits, span).await;
        }
    };
    if d.task.answered.contains(&prep.fp) {
        // The same request already got its answer: sending it again buys the same one.
        let outcome = Outcome::NoNewAttempt;
        return without_call(job, &d, &prep.before, outcome, Some(&prep.user), limits, span).await;
    }
    // The record's own caps, then the job's, against the call at its most.
    if let Some(why) = crate::budget::over_record_cap(&job.spec, &d.task, &prep.at_most, &job.spec.prices) {
        tracing::warn!(job = %job.name, record_id = %d.task.rid, why = %why, "record over its budget: to review, not called");
        let outcome = Outcome::OverBudget { why };
        return without_call(job, &d, &prep.before, outcome, Some(&prep.user), limits, span).await;
    }
    let prices = job.prices_for(prep.route, prep.tier);
    let reservation = match reserve(job, &d, limits, &prep.at_most, &prices).await? {
        Ok(reservation) => reservation,
        Err(settled) => return Ok(settled),
    };
    let call_span = span.child("model_call", SpanKind::Client);
    limits.metrics.in_flight.inc();
    let mut if_cut_off = paid_call(job, &d, limits, (prep.before.attempts + 1, prep.estimate), &prep);
    if_cut_off.fate = Fate::Abandoned;
    // Held until the outcome is stored (the end of this function).
    let waiting = limits.calls.start(&job.name, d.partition, if_cut_off);
    let provider = job.provider_for(prep.route);
    let called = provider.call(&d.task.rid, &limits.worker, &prep.body).await;
    limits.metrics.in_flight.dec();
    trace_call(&call_span, job, &called.result);
    call_span.end();
    *report = Some(CallReport {
        used: used_of(&called.result),
        headers: called.headers,
    });
    let via = Via::Online { waiting, reservation };
    let got = Got {
        result: called.result,
        elapsed: Some(called.elapsed),
        body: called.body,
        batch_files: Vec::new(),
    };
    conclude(job, &d, limits, span, &prep, got, via).await
}

/// What came back for a call, whichever way it was made.
struct Got {
    result: CallResult,
    /// How long the online call took (None: a batch line's is the batch's).
    elapsed: Option<std::time::Duration>,
    /// The response's body as kept (None: no response came).
    body: Option<String>,
    /// A batch line's: the sha256 of the batch's files, as kept.
    batch_files: Vec<String>,
}

/// One line of a provider batch's output or error file, as
/// [`settle_batch_line`] takes it (see `crate::batcher::answer_of_line`).
pub struct BatchAnswer {
    pub result: CallResult,
    /// The line's response body (None: the line carries an error, no response).
    pub body: Option<String>,
    /// The sha256 of the batch's output and error files, as kept in the
    /// job's raw store (the line is in one of them).
    pub batch_files: Vec<String>,
}

/// The paid call an attempt makes, at online prices (its tier's).
pub(crate) fn paid_call(
    job: &JobCtx,
    d: &Delivery,
    limits: &Limits,
    (attempt, usage): (u32, Usage),
    prep: &Prepared,
) -> PaidCall {
    let call = PaidCall::new(
        &d.task,
        attempt,
        d.task.calls + 1,
        d.deliveries,
        &limits.worker,
        usage,
        &job.spec.prices,
        now_ms(),
    );
    match (prep.route, &job.fallback) {
        (Route::Fallback, Some(f)) => call
            .on_route(&f.name, &f.spec.prices, &job.spec.prices)
            .to_model(&f.spec.provider.model),
        _ => call
            .on_tier(prep.tier.unwrap_or(Tier::Standard), &job.spec.prices)
            .to_model(&job.spec.provider.model),
    }
}

/// Settles one line of a provider batch's output or error file, answering
/// the task `d` a shard held (its delivery fenced by the shard): the same
/// validate, decide and apply as an online answer, at batch prices. `line`
/// names the line (the batch and its line id): its paid call is recorded
/// once however often the line is settled.
pub async fn settle_batch_line(
    job: &JobCtx,
    d: &Delivery,
    limits: &Limits,
    answer: BatchAnswer,
    line: String,
) -> Result<Settled, StoreError> {
    let span = attempt_span(job, d, limits);
    let settled = match prepare(job, d, limits, Route::Batch) {
        Ok(prep) => {
            let got = Got {
                result: answer.result,
                elapsed: None,
                body: answer.body,
                batch_files: answer.batch_files,
            };
            conclude(job, d, limits, &span, &prep, got, Via::Batch { line }).await
        }
        // Its template no longer renders (a spec changed under the shard):
        // decided as before a call; the answer is not used.
        Err(unsent) => {
            let (before, outcome) = *unsent;
            without_call(job, d, &before, outcome, None, limits, &span).await
        }
    };
    attempt_settled(&span, &settled);
    span.end();
    settled
}

/// Decides a task a shard held that was left out of the shard's file:
/// poison, an input error, or a request that would repeat one already
/// answered (decided as online, without a call).
pub async fn settle_unsent(job: &JobCtx, d: &Delivery, limits: &Limits) -> Result<Settled, StoreError> {
    let span = Span::none();
    match prepare(job, d, limits, Route::Batch) {
        Err(unsent) => {
            let (before, outcome) = *unsent;
            without_call(job, d, &before, outcome, None, limits, &span).await
        }
        Ok(prep) => {
            let outcome = Outcome::NoNewAttempt;
            without_call(job, d, &prep.before, outcome, Some(&prep.user), limits, &span).await
        }
    }
}

/// From a call's result to its stored outcome: keep its bytes, validate,
/// judge, decide, record the paid call, apply.
async fn conclude(
    job: &JobCtx,
    d: &Delivery,
    limits: &Limits,
    span: &Span,
    prep: &Prepared,
    got: Got,
    via: Via<'_>,
) -> Result<Settled, StoreError> {
    let sent = (job.provider_for(prep.route), &*prep.body);
    let trail = keep_trail(job, d, limits, sent, got.body.as_deref(), got.batch_files.clone()).await;
    let Got {
        result, elapsed, body, ..
    } = got;
    let (mut reply, answered) = reply_of(job, (limits, span), prep, result, body.as_deref()).await;
    let (waiting, line) = settle_via(job, &reply, via, job.prices_for(prep.route, prep.tier)).await;

    // An online call tells the fleet whether the provider answers (an
    // outage that outlasted the job's budget halts it).
    let (failing_since, answered_ms) = match elapsed {
        Some(took) => note_provider(job, d, limits, &mut reply, took, prep).await,
        // A batch's line: the provider answered the batch.
        None => (failing_since(d, &reply.outcome, std::time::Duration::ZERO), now_ms()),
    };
    // Transient, rate-limited, halted and suspect calls are not attempts:
    // the record was not at fault.
    let counts_as_attempt = reply.outcome.is_attempt();
    let before = &prep.before;
    let attempt = before.attempts + u32::from(counts_as_attempt);
    let paid = paid_of(
        job,
        d,
        limits,
        (attempt, prep),
        &reply,
        line.as_deref(),
        waiting.as_ref(),
    );
    let calls = d.task.calls + 1;
    let standing = Standing {
        attempt: attempt.saturating_sub(d.task.base).max(1),
        calls,
        provider: provider_state(job, prep.route, failing_since, answered_ms),
    };
    let decision = decide(
        standing,
        &reply.outcome,
        &job.spec.retry,
        rand::rng().random_range(0.0..1.0),
    );
    let stamp = job.stamp.renewed();
    let record = AttemptRecord {
        attempt,
        call: calls,
        elapsed,
        decision: &decision,
        batch_line: line.as_deref(),
        trail,
    };
    let history = record.told(job, d, limits, span, &reply, prep, &stamp);
    // The review entry shows the prompt as the model last saw it, feedback included.
    let facts = Facts {
        prompt: &prep.user,
        raw: &reply.raw,
        errors: reply.errors(),
        attempts: attempt,
    };
    let answer = Call {
        calls,
        reply: &reply,
        fingerprint: answered.then(|| prep.fp.clone()),
        paid,
        failing_since,
    };
    let answer = Some(answer);
    apply(
        job,
        d,
        decision.clone(),
        before,
        facts,
        answer,
        history,
        &stamp,
        limits,
        span,
    )
    .await
}

/// A call's result as the record's reply: judged (breaker, structured-output
/// form), watched for drift, with the usage it may be billed for. Also
/// whether the provider answered.
async fn reply_of(
    job: &JobCtx,
    (limits, span): (&Limits, &Span),
    prep: &Prepared,
    result: CallResult,
    body: Option<&str>,
) -> (Reply, bool) {
    let answered = matches!(result, CallResult::Message { .. });
    let timed_out = used_of(&result).timed_out;
    let mut reply = result.into_reply(&job.spec, &prep.before.input, span);
    if job.spec.prompt.passthrough() && reply.output.is_some() {
        // A passed-through request's result is the provider's whole response.
        reply.output = body.and_then(|b| serde_json::from_str(b).ok());
    }
    judge_errors(job, &mut reply, (prep.form, prep.route)).await;
    let key = business_key(&prep.before.input, &job.spec.job.id_field);
    job.drift_watch(&limits.metrics).observe(&key, &reply.outcome).await;
    if reply.usage.is_none() && (timed_out || answered) {
        // The server may have generated (and billed) it after we gave up,
        // or answered without saying what it used.
        reply.usage = Some(prep.estimate);
    }
    (reply, answered)
}

/// The provider's state as the record's decision sees it: the fleet's
/// outage view, or for a fallback's call its own (it answers for itself).
fn provider_state(job: &JobCtx, route: Route, failing_since: u64, answered_ms: u64) -> common::decision::ProviderState {
    match route {
        Route::Fallback => common::decision::ProviderState::Up {
            failing_ms: if failing_since > 0 {
                now_ms().saturating_sub(failing_since)
            } else {
                0
            },
        },
        _ => job.outage.provider_state(failing_since, answered_ms, now_ms()),
    }
}

/// The paid call an answer (or a timed-out call) may be billed for, priced
/// as it was made, for the ledger with its outcome: once (none when a drain
/// recorded it as cut off meanwhile).
fn paid_of(
    job: &JobCtx,
    d: &Delivery,
    limits: &Limits,
    (attempt, prep): (u32, &Prepared),
    reply: &Reply,
    line: Option<&str>,
    waiting: Option<&CallInFlight<'_>>,
) -> Option<PaidCall> {
    let call = reply.usage.map(|u| {
        let call = paid_call(job, d, limits, (attempt, u), prep);
        match line {
            Some(line) => call.batched(&job.spec.prices.batch(), &job.spec.prices, line),
            None => call,
        }
    });
    match waiting {
        Some(w) => w.answered(call),
        None => call,
    }
}

/// Settles an online call's budget reservation at what the call cost (an
/// estimated call keeps its whole reservation: it may have cost that).
/// Returns the call's place among the calls in flight, or the batch line
/// that answered it.
async fn settle_via<'a>(
    job: &JobCtx,
    reply: &Reply,
    via: Via<'a>,
    prices: common::spec::Prices,
) -> (Option<CallInFlight<'a>>, Option<String>) {
    match via {
        Via::Online { waiting, reservation } => {
            crate::attempt::settle_reservation(job, reservation, reply.usage, &prices).await;
            (Some(waiting), None)
        }
        Via::Batch { line } => (None, Some(line)),
    }
}

/// What an attempt's history item records beside its reply.
struct AttemptRecord<'a> {
    attempt: u32,
    call: u32,
    elapsed: Option<std::time::Duration>,
    decision: &'a Decision,
    /// The batch line that answered it (`batch:line`), in batch mode.
    batch_line: Option<&'a str>,
    trail: Trail,
}

impl AttemptRecord<'_> {
    /// Tells the world about the attempt: the record's history with it
    /// (returned), its span, its log line and metrics.
    #[allow(clippy::too_many_arguments)]
    fn told(
        &self,
        job: &JobCtx,
        d: &Delivery,
        limits: &Limits,
        span: &Span,
        reply: &Reply,
        prep: &Prepared,
        stamp: &Stamp,
    ) -> Vec<HistoryItem> {
        let mut history = d.task.history.clone();
        let route = job.route_name(prep.route, prep.tier);
        history.push(HistoryItem::Attempt(self.of(reply, prep, (stamp, route), limits)));
        let (outcome, decision) = (outcome_label(&reply.outcome), decision_label(self.decision));
        if span.is_on() {
            span.set("batchfleet.attempt", i64::from(self.attempt));
            span.set("batchfleet.outcome", outcome.to_owned());
            span.set("batchfleet.decision", decision);
        }
        let prices = match self.batch_line {
            Some(_) => job.spec.prices.batch(),
            None => job.prices_for(prep.route, prep.tier),
        };
        let facts = AttemptFacts {
            attempt: self.attempt,
            decision,
            outcome,
            elapsed: self.elapsed,
            status: reply.status,
            usage: reply.usage.as_ref(),
            cost: reply.usage.map_or(0.0, |u| u.cost(&prices)),
            errors: reply.errors(),
        };
        attempt_event(job, d, limits, facts);
        history
    }

    /// The attempt as the record's history keeps it.
    fn of(&self, reply: &Reply, prep: &Prepared, (stamp, route): (&Stamp, Option<String>), limits: &Limits) -> Attempt {
        Attempt {
            attempt: self.attempt,
            call: self.call,
            at: stamp.at.clone(),
            worker: limits.worker.clone(),
            elapsed_ms: self.elapsed.map_or(0, |e| e.as_millis() as u64),
            status: reply.status,
            response_id: reply.response_id.clone(),
            finish_reason: reply.finish_reason.clone(),
            outcome: outcome_label(&reply.outcome).to_owned(),
            errors: reply.errors().to_vec(),
            repairs: reply.repairs.clone(),
            usage: reply.usage,
            decision: decision_label(self.decision).to_owned(),
            error: reply.error.as_ref().and_then(|e| e.message.clone()),
            feedback: prep.sent_feedback.clone(),
            batch: self.batch_line.and_then(|l| l.split(':').next()).map(str::to_owned),
            tier: route,
            trail: self.trail.clone(),
            check: None,
        }
    }
}

/// Tells the fleet's outage state what an online call came to (see
/// [`crate::outage`]): a transient failure or a 429 joins the fleet's
/// streak of failures, anything else the provider said ends it. Returns
/// when the record's calls began failing in a row (Unix ms; 0 when this
/// one was answered) and when the fleet last got an answer. When the
/// provider has been down for longer than the job's outage budget the
/// outcome becomes a halt.
async fn note_provider(
    job: &JobCtx,
    d: &Delivery,
    limits: &Limits,
    reply: &mut Reply,
    took: std::time::Duration,
    prep: &Prepared,
) -> (u64, u64) {
    if prep.route == Route::Fallback {
        // The fallback's answers say nothing of the provider's outage.
        return (failing_since(d, &reply.outcome, took), 0);
    }
    // A flex refusal is the provider's answer (it is up, its cheap tier is
    // busy): the plan learns from it; the outage streak does not.
    let flex_refused = reply
        .error
        .as_ref()
        .is_some_and(|e| e.cause == crate::plan::FLEX_REFUSED);
    if prep.tier == Some(Tier::Flex) {
        job.plan.saw_flex(flex_refused);
    }
    let failed = reply.outcome.is_world_failure() && !flex_refused;
    let noted = match (&reply.error, failed) {
        (Some(err), true) => {
            let noted = job
                .outage
                .failed(&*job.queue, &job.name, &d.task.rid, err, took, &limits.worker)
                .await;
            noted.map(|(answered_ms, halt)| {
                // With a fallback the job does not halt for the provider's
                // outage: the fallback does the work meanwhile.
                if let Some(reason) = halt.filter(|_| job.fallback.is_none()) {
                    reply.outcome = Outcome::FleetHalt { cause: reason };
                }
                answered_ms
            })
        }
        _ => job
            .outage
            .answered(&*job.queue, &job.name, &d.task.rid)
            .await
            .map(|()| 0),
    };
    // Unknown (Redis away): the record only waits.
    let answered_ms = noted.unwrap_or_else(|e| {
        limits.metrics.store_errors.inc();
        tracing::warn!(job = %job.name, error = %e, "could not tell the fleet whether the provider answers");
        0
    });
    (failing_since(d, &reply.outcome, took), answered_ms)
}

/// When the record's calls began failing in a row, this one included (Unix
/// ms; 0 when this call's outcome was no transient failure or 429).
fn failing_since(d: &Delivery, outcome: &Outcome, took: std::time::Duration) -> u64 {
    if !outcome.is_world_failure() {
        return 0;
    }
    match d.task.failing_since {
        0 => now_ms().saturating_sub(took.as_millis() as u64),
        since => since,
    }
}

/// Runs a non-retryable provider error through the job's circuit breaker
/// (see [`crate::breaker`]): it stays about the record, or makes the record
/// wait, or halts the job with the provider's message. Any answer proves the
/// provider (told to Redis once).
async fn judge_errors(job: &JobCtx, reply: &mut Reply, (form, route): (common::spec::StructuredOutput, Route)) {
    use crate::breaker::Verdict;
    let mut form_refused = None;
    // A request refused for its shape: with `auto`, the next structured-output
    // form; otherwise not a passing error (the breaker decides). The form is
    // the provider's: a fallback's refusal teaches it nothing.
    if let Some(err) = &reply.error
        && route != Route::Fallback
        && matches!(err.status, Some(400 | 422 | 500))
        && err.message.as_deref().is_some_and(crate::form::refuses_request)
    {
        if let Some(next) = job.forms.refused(form) {
            if next != form {
                tracing::warn!(
                    job = %job.name,
                    refused = form.name(),
                    using = next.name(),
                    message = err.message.as_deref().unwrap_or(""),
                    "the server refuses this structured-output form: falling back (remembered for the fleet)"
                );
                if let Err(e) = job.queue.remember_form(&job.forms.endpoint, next.name()).await {
                    tracing::warn!(error = %e, "could not remember the accepted form");
                }
            }
            reply.outcome = Outcome::FormRefused;
            return;
        }
        if let Outcome::Transient { cause, .. } = &reply.outcome {
            reply.outcome = Outcome::Permanent { cause: cause.clone() };
        }
        form_refused = Some(form);
    }
    match &reply.outcome {
        // The provider answers (valid or not, the model is at fault, not the setup).
        // (A fallback's answer proves nothing of the provider.)
        Outcome::Valid | Outcome::Invalid(_) | Outcome::Truncated | Outcome::Refused { .. }
            if route == Route::Fallback => {}
        Outcome::Valid | Outcome::Invalid(_) | Outcome::Truncated | Outcome::Refused { .. } => {
            if job.breaker.on_answer()
                && let Err(e) = job.queue.mark_proven().await
            {
                tracing::warn!(error = %e, "could not note the provider as proven");
            }
        }
        Outcome::Permanent { cause } => {
            let Some(err) = &reply.error else { return };
            let signature = err.signature();
            let count = if job.breaker.proven() {
                0
            } else {
                job.queue.breaker_count(&signature).await.unwrap_or(0)
            };
            let message = err.message.as_deref().unwrap_or("no message");
            match job.breaker.judge(&signature, count) {
                Verdict::Record => {}
                Verdict::Suspect => {
                    reply.outcome = Outcome::Suspect { cause: cause.clone() };
                }
                Verdict::Halt => {
                    let n = count.max(job.breaker.threshold);
                    let hint = form_refused.map(|f| refused_form_hint(job, f)).unwrap_or_default();
                    reply.outcome = Outcome::FleetHalt {
                        cause: format!(
                            "systematic provider error: {cause} on {n} calls in a row from {}: {message}{hint}",
                            match (route, &job.fallback) {
                                (Route::Fallback, Some(f)) => common::secret::redact_url(&f.spec.provider.base_url),
                                _ => job.outage.base_url().to_owned(),
                            }
                        ),
                    };
                }
            }
        }
        _ => {}
    }
}

/// What a halt on a refused structured-output form tells the person: the
/// setting that fixes it, and how to run the records with it.
fn refused_form_hint(job: &JobCtx, form: common::spec::StructuredOutput) -> String {
    format!(
        ". The server refuses the structured-output form `{}` (provider.structured_output = {}): \
         set provider.structured_output = \"auto\" to send the first form it accepts (json_schema, then \
         json_object with the schema, then the prompt alone); the setting is part of the record ids, so enqueue \
         the dataset with the changed spec under a new --job name",
        form.name(),
        // `true`, `"json_object"`...: written as the spec writes it.
        serde_json::to_string(&job.spec.provider.structured_output).unwrap_or_else(|_| form.name().to_owned()),
    )
}

/// Decides and applies an outcome reached without calling the model
/// (poison, an input error, a request that would repeat an answered one).
#[allow(clippy::too_many_arguments)]
async fn without_call(
    job: &JobCtx,
    d: &Delivery,
    before: &Before,
    outcome: Outcome,
    prompt: Option<&str>,
    limits: &Limits,
    span: &Span,
) -> Result<Settled, StoreError> {
    // Before a call (poison, an input error) the entry shows nothing sent;
    // otherwise the prompt and the last answer with its errors.
    let facts = match prompt {
        None => Facts {
            prompt: "",
            raw: "",
            errors: &[],
            attempts: before.attempts,
        },
        Some(prompt) => Facts {
            prompt,
            raw: d.task.answer.as_deref().unwrap_or(""),
            errors: &d.task.feedback,
            attempts: before.attempts,
        },
    };
    let decision = decide(
        Standing::new(before.attempts.max(1), d.task.calls),
        &outcome,
        &job.spec.retry,
        0.0,
    );
    log_event(
        job,
        d,
        before.attempts,
        decision_label(&decision),
        outcome_label(&outcome),
        0,
        &[],
    );
    let stamp = job.stamp.renewed();
    let history = d.task.history.clone();
    apply(job, d, decision, before, facts, None, history, &stamp, limits, span).await
}

/// What a review entry needs from the attempt.
struct Facts<'a> {
    prompt: &'a str,
    raw: &'a str,
    errors: &'a [FieldError],
    attempts: u32,
}

/// The call an attempt made: calls so far, what it came to, and the
/// request's fingerprint when it got an answer.
struct Call<'a> {
    calls: u32,
    reply: &'a Reply,
    fingerprint: Option<String>,
    /// For the ledger, when the call may be billed.
    paid: Option<PaidCall>,
    /// When the record's calls began failing in a row (0: this one was answered).
    failing_since: u64,
}

/// Applies a decision with one atomic store call (or, for a halt, stops the
/// fleet and leaves the task pending). `answer` is the call made, if any.
#[allow(clippy::too_many_arguments)]
async fn apply(
    job: &JobCtx,
    d: &Delivery,
    decision: Decision,
    before: &Before,
    facts: Facts<'_>,
    answer: Option<Call<'_>>,
    history: Vec<HistoryItem>,
    stamp: &Stamp,
    limits: &Limits,
    span: &Span,
) -> Result<Settled, StoreError> {
    let called = answer.is_some();
    let paid = answer.as_ref().and_then(|a| a.paid.clone());
    let settle = Settle {
        job,
        d,
        span,
        limits,
        paid: paid.as_ref(),
    };
    match decision {
        Decision::Commit => {
            let Some(Call { calls, reply, .. }) = answer else {
                return Err(StoreError::Corrupt {
                    key: d.task.rid.clone(),
                    reason: "a commit without an answer".into(),
                });
            };
            if let Some(task) = crate::check::checking_task(job, d, facts.attempts, calls, reply, &history) {
                // Kept with its paid call; the checker's call is the record's next step.
                let how = Finish::Retry { due_ms: now_ms(), task };
                let settled = settle.store(how, Settled::Checking, true).await;
                limits.retry_scheduled.notify_one();
                return settled;
            }
            let result = result_of(job, d, before, facts.attempts, (calls, reply), history, stamp, limits);
            settle.store(Finish::Commit(result), Settled::Committed, true).await
        }
        Decision::Retry { delay_ms, feedback, .. } => {
            let task = retry_task(
                job,
                d,
                facts.attempts,
                answer.as_ref(),
                feedback.unwrap_or_default(),
                history,
            );
            settle.retry(task, delay_ms, called).await
        }
        Decision::Review { reason } => {
            let review = ReviewFacts {
                key: &before.key,
                prompt: facts.prompt,
                last_raw_output: facts.raw,
                errors: facts.errors,
                attempts: facts.attempts,
                reason: &reason,
            };
            let entry = ReviewEntry::new(d, review, history, stamp, &limits.worker);
            settle.store(Finish::Review(entry), Settled::Reviewed, called).await
        }
        Decision::Drop { reason } => settle.store(Finish::Drop { reason }, Settled::Dropped, false).await,
        Decision::Halt { reason } => {
            // Leave the task pending: it is not the record's fault and must not
            // use up an attempt. Claiming stops fleet-wide until the halt is lifted.
            job.queue.halt(&reason).await?;
            tracing::error!(job = %job.name, reason = %reason, "fleet halted: tasks stay queued");
            let task = halted_task(d, facts.attempts, answer.as_ref(), history);
            let _ = job.finish_paid(d, &Finish::Release(task), paid.as_ref()).await;
            Ok(Settled::Halted(reason))
        }
    }
}

/// A commit's result: the valid answer with its attempts, calls and
/// history; with its input when the job has a sink (the row keeps it) or a
/// person spot-checks it.
#[allow(clippy::too_many_arguments)]
fn result_of(
    job: &JobCtx,
    d: &Delivery,
    before: &Before,
    attempts: u32,
    (calls, reply): (u32, &Reply),
    history: Vec<HistoryItem>,
    stamp: &Stamp,
    limits: &Limits,
) -> ResultRecord {
    let valid = Answer {
        key: before.key.clone(),
        output: reply.output.clone().unwrap_or_default(),
        attempts,
        calls,
        response_id: reply.response_id.clone(),
        repairs: reply.repairs.clone(),
        usage: reply.usage,
    };
    let mut result = ResultRecord::from_model(&d.task, valid, history, stamp, &limits.worker);
    if job.sink.is_some() || job.spec.audit.sampled(&d.task.rid) {
        result.input = Some(d.task.input.clone());
    }
    result
}

/// The task a halt hands back at once (it runs as soon as the halt is
/// lifted): the call it made (a timed-out one may be billed) stays in its
/// history and in the ledger; its feedback for the model too.
fn halted_task(d: &Delivery, attempts: u32, answer: Option<&Call<'_>>, history: Vec<HistoryItem>) -> Task {
    let Some(call) = answer else {
        return d.task.clone();
    };
    let mut task = d.task.next(attempts, call.calls, d.task.feedback.clone(), history);
    task.answer = d.task.answer.clone();
    task.failing_since = call.failing_since;
    task
}

/// The task of a retry: the attempt counted, the feedback for the model
/// (beside its own answer), the call's fingerprint and failing time.
fn retry_task(
    job: &JobCtx,
    d: &Delivery,
    attempts: u32,
    answer: Option<&Call<'_>>,
    feedback: Vec<FieldError>,
    history: Vec<HistoryItem>,
) -> Task {
    let calls = answer.map_or(d.task.calls, |a| a.calls);
    let mut task = d.task.next(attempts, calls, feedback, history);
    // Batch mode with `[batch] retries = "online"`: the retry calls online.
    let spec = &job.spec;
    if spec.provider.mode == common::spec::ProviderMode::Batch
        && spec.batch.retries == common::spec::BatchRetries::Online
    {
        task.online = true;
    }
    task.failing_since = answer.map_or(d.task.failing_since, |a| a.failing_since);
    if let Some(call) = answer {
        task.answered.extend(call.fingerprint.clone());
        // The model sees its own answer beside the feedback on it.
        if !task.feedback.is_empty() {
            task.answer = Some(call.reply.raw.clone());
        }
    }
    task
}

/// What the model call did, on its span: status, model, tokens, latency.
fn trace_call(span: &Span, job: &JobCtx, result: &CallResult) {
    if !span.is_on() {
        return;
    }
    span.set("gen_ai.request.model", job.spec.provider.model.clone());
    match result {
        CallResult::Message {
            finish_reason, usage, ..
        } => {
            span.set("http.response.status_code", 200_i64);
            span.set("gen_ai.response.finish_reasons", finish_reason.clone());
            if let Some(u) = usage {
                span.set("gen_ai.usage.input_tokens", u.prompt as i64);
                span.set("gen_ai.usage.output_tokens", u.completion as i64);
            }
        }
        CallResult::Failed(e) => {
            if let Some(s) = e.status {
                span.set("http.response.status_code", i64::from(s));
            }
            span.fail(e.cause.clone());
        }
    }
}

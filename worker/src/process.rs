//! One delivered task, start to end: render, call, validate, decide, apply.
//!
//! The decision itself is [`common::decision::decide`]; this module gathers
//! its inputs and applies its answer with one atomic store call.

use common::decision::{Decision, Outcome, decide};
use common::manifest::now_rfc3339;
use common::otel::{Span, SpanKind, Traces};
use common::spec::JobSpec;
use common::store::{Delivery, Finish, RedisStore, RetryTask, StoreError};
use common::template::{Template, lookup};
use common::validate::{FieldError, Validation, feedback, validate};
use rand::RngExt;
use serde_json::{Map, Value, json};

use crate::limiter::{Limiter, RateHeaders, Used};
use crate::provider::{CallResult, ErrorKind, Provider, Request};
use crate::telemetry::{Metrics, status_class};

/// Everything a worker needs to process one job's tasks.
pub struct JobCtx {
    pub name: String,
    pub spec: JobSpec,
    pub system: String,
    pub user: Template,
    pub response_format: Option<Value>,
    pub provider: Provider,
    pub versions: Value,
    /// The fleet-wide budget of the job's provider, when the spec sets limits.
    pub limiter: Option<Limiter>,
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
    /// The job was cancelled before the task ran: kept for resume.
    Cancelled,
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
            Settled::Cancelled => "cancelled",
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
}

const TERMINAL_PREFIXES: &[&str] = &["done", "review", "dropped", "cancelled"];

/// Processes one delivery. Store errors are returned (the task then stays
/// pending and is reclaimed); everything else ends in a [`Settled`]. `report`
/// receives what the model call used (it stays None when no call was made).
///
/// With tracing on, the attempt is a span (child of the record's enqueue
/// span) holding `model_call`, `validate` and `commit` spans.
pub async fn process(
    store: &RedisStore,
    job: &JobCtx,
    d: Delivery,
    limits: &Limits,
    report: &mut Option<CallReport>,
) -> Result<Settled, StoreError> {
    let span = limits.traces.start("attempt", SpanKind::Consumer, Some(&d.traceparent));
    if span.is_on() {
        span.set("batchfleet.job", job.name.clone());
        span.set("batchfleet.record_id", d.record_id.clone());
        span.set("batchfleet.partition", i64::from(d.partition));
        span.set("batchfleet.delivery", i64::from(d.deliveries));
        span.set("batchfleet.worker", limits.worker.clone());
    }
    let settled = run_attempt(store, job, d, limits, report, &span).await;
    match &settled {
        Ok(s) => span.set("batchfleet.settled", s.label()),
        Err(e) => span.fail(format!("store error: {e}")),
    }
    settled
}

async fn run_attempt(
    store: &RedisStore,
    job: &JobCtx,
    d: Delivery,
    limits: &Limits,
    report: &mut Option<CallReport>,
    span: &Span,
) -> Result<Settled, StoreError> {
    let state = store.record_state(&job.name, d.partition, &d.record_id).await?;
    if state
        .as_deref()
        .is_some_and(|s| TERMINAL_PREFIXES.iter().any(|t| s.starts_with(t)))
    {
        store.ack(&job.name, &d).await?;
        return Ok(Settled::AlreadySettled);
    }
    let mut history: Vec<Value> = serde_json::from_str(&d.history).unwrap_or_default();
    // Each redelivery beyond the first is an attempt whose worker died: count it.
    let lost = d.deliveries.saturating_sub(1);
    let attempts_before = d.attempts_before + lost;
    let input: Map<String, Value> = serde_json::from_str::<Value>(&d.input)
        .ok()
        .and_then(|v| v.as_object().cloned())
        .unwrap_or_default();
    let key = business_key(&input, &job.spec.job.id_field);

    if d.deliveries > limits.max_deliveries {
        let entry = review_entry(job, &d, &key, "", "", &[], attempts_before, "poison", &history, limits);
        return settle(store, job, &d, Finish::Review { entry }, Settled::Reviewed, span).await;
    }

    let rendered = match job.user.render(&input) {
        Ok(r) => r,
        Err(missing) => {
            let reason = missing.to_string();
            log_event(job, &d, attempts_before, "drop", &reason, 0, &[]);
            return settle(store, job, &d, Finish::Drop { reason }, Settled::Dropped, span).await;
        }
    };
    let previous_errors: Vec<FieldError> = serde_json::from_str(&d.feedback).unwrap_or_default();
    let user = if previous_errors.is_empty() {
        rendered.clone()
    } else {
        format!("{rendered}\n\n{}", feedback(&previous_errors))
    };
    let request = Request {
        system: &job.system,
        user: &user,
        response_format: job.response_format.as_ref(),
    };
    let call_span = span.child("model_call", SpanKind::Client);
    limits.metrics.in_flight.inc();
    let (result, headers, elapsed) = job.provider.call(&request).await;
    limits.metrics.in_flight.dec();
    let elapsed_ms = elapsed.as_millis() as u64;
    trace_call(&call_span, job, &result);
    call_span.end();
    *report = Some(CallReport {
        used: used_of(&result),
        headers,
    });

    let raw: String;
    let status: Option<u16>;
    let mut usage = Value::Null;
    let mut finish_reason = String::new();
    let mut response_id = None;
    let mut repairs_done = Vec::new();
    let mut valid_output = None;
    let outcome = match result {
        CallResult::Failed(e) => {
            status = e.status;
            raw = format!(
                "{} ({})",
                e.cause,
                e.status.map_or("no response".into(), |s| format!("HTTP {s}"))
            );
            match e.kind {
                ErrorKind::Transient => Outcome::Transient {
                    cause: e.cause,
                    retry_after_ms: e.retry_after_ms,
                },
                ErrorKind::RateLimited => Outcome::RateLimited {
                    retry_after_ms: e.retry_after_ms,
                },
                ErrorKind::Permanent => Outcome::Permanent { cause: e.cause },
                ErrorKind::FleetHalt => Outcome::FleetHalt { cause: e.cause },
            }
        }
        CallResult::Message {
            response_id: id,
            content,
            finish_reason: fr,
            refusal,
            usage: u,
        } => {
            status = Some(200);
            response_id = id;
            usage = u.unwrap_or(Value::Null);
            finish_reason = fr;
            let refused = refusal.is_some();
            raw = match refusal {
                Some(r) if content.is_empty() => r,
                _ => content,
            };
            if finish_reason == "content_filter" {
                Outcome::Refused {
                    cause: "content_filter".into(),
                }
            } else if refused {
                Outcome::Refused {
                    cause: "refusal".into(),
                }
            } else if finish_reason == "length" {
                Outcome::Truncated
            } else {
                let check = span.child("validate", SpanKind::Internal);
                let verdict = validate(&job.spec, &raw);
                match verdict {
                    Validation::Valid { output, repairs } => {
                        check.set("batchfleet.valid", true);
                        check.set("batchfleet.repairs", repairs.len() as i64);
                        repairs_done = repairs;
                        valid_output = Some(output);
                        Outcome::Valid
                    }
                    Validation::Invalid { errors, repairs } => {
                        if check.is_on() {
                            check.set("batchfleet.valid", false);
                            check.set("batchfleet.errors", error_codes(&errors).join(", "));
                        }
                        repairs_done = repairs;
                        Outcome::Invalid(errors)
                    }
                }
            }
        }
    };
    // Rate-limited and halted calls are not attempts: the record was not at fault.
    let counts_as_attempt = !matches!(outcome, Outcome::RateLimited { .. } | Outcome::FleetHalt { .. });
    let attempt = attempts_before + u32::from(counts_as_attempt);
    let calls = d.calls_before + 1;
    let errors: Vec<FieldError> = match &outcome {
        Outcome::Invalid(e) => e.clone(),
        _ => vec![],
    };
    let decision = decide(
        attempt.saturating_sub(d.round_base).max(1),
        calls,
        &outcome,
        &job.spec.retry,
        rand::rng().random_range(0.0..1.0),
    );
    history.push(json!({
        "attempt": attempt,
        "call": calls,
        "at": now_rfc3339(),
        "worker": limits.worker,
        "elapsed_ms": elapsed_ms,
        "status": status,
        "response_id": response_id,
        "finish_reason": finish_reason,
        "outcome": outcome_label(&outcome),
        "errors": errors,
        "repairs": repairs_done,
        "usage": usage,
        "decision": decision_label(&decision),
    }));
    let history_json = Value::Array(history.clone()).to_string();
    if span.is_on() {
        span.set("batchfleet.attempt", i64::from(attempt));
        span.set("batchfleet.outcome", outcome_label(&outcome).to_owned());
        span.set("batchfleet.decision", decision_label(&decision));
    }
    attempt_event(
        job,
        &d,
        limits,
        AttemptFacts {
            attempt,
            decision: decision_label(&decision),
            outcome: outcome_label(&outcome),
            elapsed,
            status,
            usage: &usage,
            errors: &errors,
        },
    );

    match decision {
        Decision::Commit => {
            let mut output = valid_output.unwrap_or_default();
            // System fields come from code, never from the model.
            output.insert("record_id".into(), json!(d.record_id));
            output.insert("_model".into(), json!(job.spec.provider.model));
            let result = json!({
                "record_id": d.record_id,
                "key": key,
                "output": output,
                "attempts": attempt,
                "calls": calls,
                "response_id": response_id,
                "repairs": repairs_done,
                "usage": usage,
                "history": history,
                "model": job.spec.provider.model,
                "versions": job.versions,
                "human": false,
                "worker": limits.worker,
                "committed_at": now_rfc3339(),
            });
            settle(
                store,
                job,
                &d,
                Finish::Commit {
                    result: result.to_string(),
                },
                Settled::Committed,
                span,
            )
            .await
        }
        Decision::Retry { delay_ms, feedback, .. } => {
            let task = RetryTask {
                rid: d.record_id.clone(),
                input: d.input.clone(),
                attempt,
                calls,
                base: d.round_base,
                feedback: serde_json::to_string(&feedback.unwrap_or_default()).unwrap_or_else(|_| "[]".into()),
                history: history_json,
                tp: d.traceparent.clone(),
            };
            let due_ms = now_ms() + delay_ms;
            settle(store, job, &d, Finish::Retry { due_ms, task }, Settled::Retried, span).await
        }
        Decision::Review { reason } => {
            let entry = review_entry(
                job, &d, &key, &rendered, &raw, &errors, attempt, &reason, &history, limits,
            );
            settle(store, job, &d, Finish::Review { entry }, Settled::Reviewed, span).await
        }
        Decision::Drop { reason } => settle(store, job, &d, Finish::Drop { reason }, Settled::Dropped, span).await,
        Decision::Halt { reason } => {
            // Leave the task pending: it is not the record's fault and must not
            // use up an attempt. Claiming stops fleet-wide until the halt is lifted.
            store.halt(&job.name, &reason).await?;
            tracing::error!(job = %job.name, reason = %reason, "fleet halted: the provider refuses this key; tasks stay queued");
            Ok(Settled::Halted(reason))
        }
    }
}

/// What a call used, for the limiter: usage when the provider reported it.
fn used_of(result: &CallResult) -> Used {
    match result {
        CallResult::Message { usage: Some(u), .. } => Used {
            prompt_tokens: u["prompt_tokens"].as_u64(),
            completion_tokens: u["completion_tokens"].as_u64(),
            ..Used::default()
        },
        CallResult::Failed(e) if e.kind == ErrorKind::RateLimited => Used {
            rate_limited: true,
            retry_after_ms: e.retry_after_ms,
            ..Used::default()
        },
        _ => Used::default(),
    }
}

/// Applies the outcome with one atomic store call (the `commit` span).
async fn settle(
    store: &RedisStore,
    job: &JobCtx,
    d: &Delivery,
    how: Finish,
    then: Settled,
    span: &Span,
) -> Result<Settled, StoreError> {
    let commit = span.child("commit", SpanKind::Internal);
    commit.set("batchfleet.finish", then.label());
    let moved = store.finish(&job.name, d, &how).await;
    match &moved {
        Ok(moved) => commit.set("batchfleet.moved", *moved),
        Err(e) => commit.fail(format!("store error: {e}")),
    }
    Ok(if moved? { then } else { Settled::AlreadySettled })
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
                for (attr, field) in [
                    ("gen_ai.usage.input_tokens", "prompt_tokens"),
                    ("gen_ai.usage.output_tokens", "completion_tokens"),
                ] {
                    if let Some(n) = u[field].as_i64() {
                        span.set(attr, n);
                    }
                }
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

fn error_codes(errors: &[FieldError]) -> Vec<String> {
    errors
        .iter()
        .map(|e| format!("{} {}", e.code.as_str(), e.field))
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn review_entry(
    job: &JobCtx,
    d: &Delivery,
    key: &str,
    prompt: &str,
    raw: &str,
    errors: &[FieldError],
    attempts: u32,
    reason: &str,
    history: &[Value],
    limits: &Limits,
) -> String {
    json!({
        "record_id": d.record_id,
        "key": key,
        "input": serde_json::from_str::<Value>(&d.input).unwrap_or(Value::String(d.input.clone())),
        "prompt": prompt,
        "last_raw_output": raw,
        "errors": errors,
        "attempts": attempts,
        "deliveries": d.deliveries,
        "reason": reason,
        "history": history,
        "versions": job.versions,
        "worker": limits.worker,
        "created_at": now_rfc3339(),
        "actions": [],
    })
    .to_string()
}

fn business_key(input: &Map<String, Value>, id_field: &str) -> String {
    match lookup(input, id_field) {
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
        None => String::new(),
    }
}

fn outcome_label(o: &Outcome) -> &str {
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
    }
}

fn decision_label(d: &Decision) -> &'static str {
    match d {
        Decision::Commit => "commit",
        Decision::Retry { .. } => "retry",
        Decision::Review { .. } => "review",
        Decision::Drop { .. } => "drop",
        Decision::Halt { .. } => "halt",
    }
}

/// What one attempt came to, for its log line and its metrics.
struct AttemptFacts<'a> {
    attempt: u32,
    decision: &'a str,
    outcome: &'a str,
    elapsed: std::time::Duration,
    status: Option<u16>,
    usage: &'a Value,
    errors: &'a [FieldError],
}

/// Logs an attempt and counts it: one place for both.
fn attempt_event(job: &JobCtx, d: &Delivery, limits: &Limits, f: AttemptFacts<'_>) {
    let m = &limits.metrics;
    let name = job.name.as_str();
    let class = status_class(f.status);
    m.provider_requests.with_label_values(&[name, class]).inc();
    m.model_latency
        .with_label_values(&[name, class])
        .observe(f.elapsed.as_secs_f64());
    m.attempts.with_label_values(&[name, f.outcome]).inc();
    if f.status == Some(429) && f.outcome == "rate_limited" {
        m.rate_limited.with_label_values(&[name]).inc();
    }
    for e in f.errors {
        m.validation_errors
            .with_label_values(&[name, e.code.as_str(), e.field.as_str()])
            .inc();
    }
    let prompt = f.usage["prompt_tokens"].as_u64().unwrap_or(0);
    let cached = f.usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    let completion = f.usage["completion_tokens"].as_u64().unwrap_or(0);
    for (kind, n) in [("prompt", prompt), ("cached", cached), ("completion", completion)] {
        if n > 0 {
            m.tokens.with_label_values(&[name, kind]).inc_by(n);
        }
    }
    m.cost
        .with_label_values(&[name])
        .inc_by(job.spec.prices.cost(prompt, cached, completion));
    let codes = error_codes(f.errors);
    log_event(
        job,
        d,
        f.attempt,
        f.decision,
        f.outcome,
        f.elapsed.as_millis() as u64,
        &codes,
    );
}

fn log_event(
    job: &JobCtx,
    d: &Delivery,
    attempt: u32,
    decision: &str,
    outcome: &str,
    elapsed_ms: u64,
    errors: &[String],
) {
    tracing::info!(
        job = %job.name,
        record_id = %d.record_id,
        attempt,
        outcome,
        decision,
        elapsed_ms,
        errors = ?errors,
        "attempt"
    );
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

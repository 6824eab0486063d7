//! What a call comes to for the record: a failure by its kind; a message by
//! its finish reason and refusal, then by validating it against the spec.
//! The [`Reply`] holds the [`Outcome`] that `decide` takes. The provider
//! client ([`crate::provider`]) only calls and classifies.

use common::decision::Outcome;
use common::otel::{Span, SpanKind};
use common::spec::JobSpec;
use common::task::Usage;
use common::validate::{FieldError, Repair, Validation, validate_record};
use serde_json::{Map, Value};

use crate::provider::{CallError, CallResult, ErrorKind};

/// What a call came to for the record: the outcome, and the facts its
/// history keeps.
#[derive(Debug, Clone)]
pub struct Reply {
    pub outcome: Outcome,
    /// The model's raw output (or refusal), or a short description of the failure.
    pub raw: String,
    pub status: Option<u16>,
    pub usage: Option<Usage>,
    pub finish_reason: String,
    pub response_id: Option<String>,
    pub repairs: Vec<Repair>,
    /// The validated output, when the outcome is `Valid`.
    pub output: Option<Map<String, Value>>,
    /// The failure, when the call failed.
    pub error: Option<CallError>,
}

impl Reply {
    /// The validation errors of an invalid output (none otherwise).
    pub fn errors(&self) -> &[FieldError] {
        match &self.outcome {
            Outcome::Invalid(e) => e,
            _ => &[],
        }
    }
}

impl CallResult {
    /// Maps the answer to an outcome: a failure by its kind; a message by its
    /// finish reason and refusal, then by validating it against the spec (in
    /// a `validate` span, child of `span`).
    pub fn into_reply(self, spec: &JobSpec, input: &Map<String, Value>, span: &Span) -> Reply {
        match self {
            CallResult::Failed(e) => failed(e),
            CallResult::Message {
                response_id,
                content,
                finish_reason,
                refusal,
                usage,
            } => {
                let refused = refusal.is_some();
                let raw = match refusal {
                    Some(r) if content.is_empty() => r,
                    _ => content,
                };
                let mut reply = Reply {
                    outcome: Outcome::Valid,
                    error: None,
                    raw,
                    status: Some(200),
                    usage,
                    finish_reason,
                    response_id,
                    repairs: vec![],
                    output: None,
                };
                reply.outcome = match reply.finish_reason.as_str() {
                    "content_filter" => Outcome::Refused {
                        cause: "content_filter".into(),
                    },
                    _ if refused => Outcome::Refused {
                        cause: "refusal".into(),
                    },
                    "length" => Outcome::Truncated,
                    _ => validated(&mut reply, spec, input, span),
                };
                reply
            }
        }
    }
}

/// Validation errors as logs and spans name them: `code field`.
pub fn error_codes(errors: &[FieldError]) -> Vec<String> {
    errors
        .iter()
        .map(|e| format!("{} {}", e.code.as_str(), e.field))
        .collect()
}

/// A failed call's reply: its outcome by the failure's kind.
fn failed(e: CallError) -> Reply {
    Reply {
        raw: format!(
            "{} ({}){}",
            e.cause,
            e.status.map_or("no response".into(), |s| format!("HTTP {s}")),
            e.message.as_deref().map(|m| format!(": {m}")).unwrap_or_default()
        ),
        error: Some(e.clone()),
        status: e.status,
        outcome: match e.kind {
            ErrorKind::Transient => Outcome::Transient {
                cause: e.cause,
                retry_after_ms: e.retry_after_ms,
            },
            ErrorKind::RateLimited => Outcome::RateLimited {
                retry_after_ms: e.retry_after_ms,
            },
            ErrorKind::Permanent => Outcome::Permanent { cause: e.cause },
            ErrorKind::FleetHalt => Outcome::FleetHalt { cause: e.cause },
        },
        usage: None,
        finish_reason: String::new(),
        response_id: None,
        repairs: vec![],
        output: None,
    }
}

/// Validates a complete answer against the spec (in a `validate` span,
/// child of `span`): its output and repairs go into `reply`.
fn validated(reply: &mut Reply, spec: &JobSpec, input: &Map<String, Value>, span: &Span) -> Outcome {
    if spec.prompt.passthrough() && spec.output.fields.is_empty() {
        // A passed-through request without fields: any answer is valid (the
        // output is the whole response, see `process::conclude`).
        reply.output = Some(Map::new());
        return Outcome::Valid;
    }
    let check = span.child("validate", SpanKind::Internal);
    match validate_record(spec, &reply.raw, Some(input)) {
        Validation::Valid { output, repairs } => {
            check.set("batchfleet.valid", true);
            check.set("batchfleet.repairs", repairs.len() as i64);
            reply.repairs = repairs;
            reply.output = Some(output);
            Outcome::Valid
        }
        Validation::Invalid { errors, repairs } => {
            if check.is_on() {
                check.set("batchfleet.valid", false);
                check.set("batchfleet.errors", error_codes(&errors).join(", "));
            }
            reply.repairs = repairs;
            Outcome::Invalid(errors)
        }
    }
}

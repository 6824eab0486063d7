//! A record's lifecycle as types, each with one encoding: the [`Task`] a
//! worker is given, the [`RecordState`] the job keeps per record, the history
//! items ([`Attempt`], [`Action`]) with their [`Usage`], the [`ResultRecord`]
//! and the [`ReviewEntry`].
//!
//! Only the store encodes and decodes these in Redis; Lua scripts pass an
//! encoded task through without knowing its fields (the one exception, the
//! record id, is always the encoding's first field: see [`Task::encode`]).
//! System fields (record id, model, versions, worker, times) are stamped by
//! [`Stamp`], in one place.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserializer};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::spec::{JobSpec, Prices};
use crate::validate::{FieldError, Repair};

/// Where a record is. Its string form (the value in the partition's state
/// hash, and what the Lua scripts compare) is [`RecordState::encode`]:
/// `queued`, `delayed`, `done`, `review`, `cancelled`, `dropped:<reason>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RecordState {
    /// A task for it is in the stream (waiting, or delivered and in flight).
    Queued,
    /// Waiting in the delayed set to be retried.
    Delayed,
    /// Held by a provider batch shard (batch mode): its task is in the
    /// shard's hash until the batch's answer settles it.
    Batched,
    /// Has its one result.
    Done,
    /// In the review queue.
    Review,
    /// Not processed, with the reason (an input error, or `rejected` by a reviewer).
    Dropped(String),
    /// Cancelled by an operator; kept for resume.
    Cancelled,
}

impl RecordState {
    /// The reason a reviewer's rejection drops a record with.
    pub const REJECTED: &'static str = "rejected";
    const DROPPED_PREFIX: &'static str = "dropped:";

    /// The one string form of a state.
    pub fn encode(&self) -> Cow<'static, str> {
        match self {
            RecordState::Queued => "queued".into(),
            RecordState::Delayed => "delayed".into(),
            RecordState::Batched => "batched".into(),
            RecordState::Done => "done".into(),
            RecordState::Review => "review".into(),
            RecordState::Cancelled => "cancelled".into(),
            RecordState::Dropped(reason) => format!("{}{reason}", Self::DROPPED_PREFIX).into(),
        }
    }

    /// A done record whose result the sink holds keeps its origin in its
    /// state entry (`d@<dataset tag>:<line>`): the smallest terminal marker
    /// (its result, idempotency key and origins entry left Redis), at most
    /// 14 bytes so that Redis keeps it in its smallest string allocation.
    pub const SUNK_PREFIX: &'static str = "d@";
    /// The same marker as an earlier version wrote it.
    const SUNK_PREFIX_V1: &'static str = "done@";

    /// The origin a sunk record's state entry holds.
    pub fn sunk_origin(text: &str) -> Option<&str> {
        text.strip_prefix(Self::SUNK_PREFIX)
            .or_else(|| text.strip_prefix(Self::SUNK_PREFIX_V1))
    }

    /// Reads a state hash value; None for a value no version ever wrote.
    pub fn decode(text: &str) -> Option<RecordState> {
        if Self::sunk_origin(text).is_some() {
            return Some(RecordState::Done);
        }
        const FIXED: [RecordState; 6] = [
            RecordState::Queued,
            RecordState::Delayed,
            RecordState::Batched,
            RecordState::Done,
            RecordState::Review,
            RecordState::Cancelled,
        ];
        match text.strip_prefix(Self::DROPPED_PREFIX) {
            Some(reason) => Some(RecordState::Dropped(reason.to_owned())),
            None => FIXED.into_iter().find(|s| s.encode() == text),
        }
    }

    /// Done, review, dropped or cancelled: no worker may move it any more.
    pub fn is_terminal(&self) -> bool {
        !matches!(self, RecordState::Queued | RecordState::Delayed | RecordState::Batched)
    }
}

impl fmt::Display for RecordState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.encode())
    }
}

/// What one call used, normalised once from the provider's `usage` object:
/// cached tokens are clamped to the prompt tokens here and nowhere else.
/// Encoded in the provider's own shape (`prompt_tokens`, `completion_tokens`,
/// `total_tokens`, `prompt_tokens_details.cached_tokens`,
/// `completion_tokens_details.reasoning_tokens`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt: u64,
    pub cached: u64,
    pub completion: u64,
    pub reasoning: u64,
    pub total: u64,
    /// Not reported by the provider but estimated by us (a call that timed
    /// out: the server may have generated and billed it): the prompt from
    /// its length, the completion as `max_tokens`. Encoded as `"estimated": true`.
    pub estimated: bool,
}

#[derive(Serialize, Deserialize, Default)]
struct UsageWire {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    total_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    prompt_tokens_details: Option<Details>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    completion_tokens_details: Option<Details>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    estimated: bool,
}

#[derive(Serialize, Deserialize, Default)]
struct Details {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cached_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    reasoning_tokens: Option<u64>,
}

impl Usage {
    /// The provider's `usage` object; None when it is absent or not an object.
    pub fn from_provider(v: &Value) -> Option<Usage> {
        if !v.is_object() {
            return None;
        }
        // `estimated` is ours to say, never the provider's.
        let wire = serde_json::from_value::<UsageWire>(v.clone()).ok()?;
        Some(Usage {
            estimated: false,
            ..Usage::from(wire)
        })
    }

    /// What a call the provider never answered may have used: `prompt`
    /// tokens estimated from the request, the completion as `max_tokens`.
    pub fn estimate(prompt: u64, max_tokens: u64) -> Usage {
        Usage {
            prompt,
            completion: max_tokens,
            total: prompt + max_tokens,
            estimated: true,
            ..Usage::default()
        }
    }

    /// USD for this call at `prices`.
    pub fn cost(&self, prices: &Prices) -> f64 {
        prices.cost(self.prompt, self.cached, self.completion)
    }
}

impl From<UsageWire> for Usage {
    fn from(w: UsageWire) -> Usage {
        let prompt = w.prompt_tokens.unwrap_or(0);
        let completion = w.completion_tokens.unwrap_or(0);
        Usage {
            prompt,
            cached: w
                .prompt_tokens_details
                .and_then(|d| d.cached_tokens)
                .unwrap_or(0)
                .min(prompt),
            completion,
            reasoning: w
                .completion_tokens_details
                .and_then(|d| d.reasoning_tokens)
                .unwrap_or(0),
            total: w.total_tokens.unwrap_or(prompt + completion),
            estimated: w.estimated,
        }
    }
}

impl Serialize for Usage {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        UsageWire {
            prompt_tokens: Some(self.prompt),
            completion_tokens: Some(self.completion),
            total_tokens: Some(self.total),
            prompt_tokens_details: (self.cached > 0).then_some(Details {
                cached_tokens: Some(self.cached),
                reasoning_tokens: None,
            }),
            completion_tokens_details: (self.reasoning > 0).then_some(Details {
                cached_tokens: None,
                reasoning_tokens: Some(self.reasoning),
            }),
            estimated: self.estimated,
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for Usage {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Usage, D::Error> {
        UsageWire::deserialize(d).map(Usage::from)
    }
}

/// One call to the model for a record, as its history keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Attempt {
    /// Attempts counted so far, this one included (rate-limited calls are not attempts).
    pub attempt: u32,
    /// Calls made for the record so far, this one included.
    pub call: u32,
    #[serde(default)]
    pub at: String,
    #[serde(default)]
    pub worker: String,
    #[serde(default)]
    pub elapsed_ms: u64,
    #[serde(default)]
    pub status: Option<u16>,
    #[serde(default)]
    pub response_id: Option<String>,
    #[serde(default)]
    pub finish_reason: String,
    /// What the call came to (`valid`, `invalid_output`, a transport cause...).
    #[serde(default)]
    pub outcome: String,
    #[serde(default)]
    pub errors: Vec<FieldError>,
    #[serde(default)]
    pub repairs: Vec<Repair>,
    #[serde(default)]
    pub usage: Option<Usage>,
    /// commit | retry | review | drop | halt
    #[serde(default)]
    pub decision: String,
    /// The provider's error message, for a failed call (bounded, secrets removed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The validator's feedback this call carried to the model, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feedback: Option<String>,
    /// Batch mode: the provider batch that answered it (priced at batch prices).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch: Option<String>,
    /// The tier it was sent on, when the job names tiers (`flex`, `standard`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<String>,
    /// The audit trail: what was sent, to whom, and what came back.
    #[serde(default, skip_serializing_if = "Trail::is_empty")]
    pub trail: Trail,
    /// A checker's call: what it came to against the first model's answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub check: Option<Verdict>,
}

/// Where an attempt's bytes went and came from: the sha256 of the exact
/// request body sent, the model and endpoint it was sent to, and the sha256
/// of the response body received (kept in the job's sink under that hash:
/// see `common::sink::raw`; `producer trace` follows the chain).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Trail {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub request_sha256: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub model: String,
    /// The provider's base URL (credentials removed).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub provider: String,
    /// None: no response came (a timeout, a reset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_sha256: Option<String>,
    /// Whether the response's bytes are in the sink (false: the job has no
    /// sink, or keeping them failed; the hash still names them).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub response_kept: bool,
    /// The response's bytes themselves, when the sink did not take them at
    /// the time (down, slow): they travel with the record's outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_body: Option<String>,
    /// Batch mode: the sha256 of the batch's output and error files, kept
    /// whole (the response is one of their lines).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub batch_files: Vec<String>,
}

impl Trail {
    pub fn is_empty(&self) -> bool {
        *self == Trail::default()
    }
}

/// What a person or an operator did to a record (accept, requeue, reject, retry).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Action {
    pub action: String,
    pub by: String,
    pub at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl Action {
    /// An action by `by`, now.
    pub fn new(action: &str, by: &str) -> Action {
        Action {
            action: action.to_owned(),
            by: by.to_owned(),
            at: crate::manifest::now_rfc3339(),
            note: None,
            reason: None,
        }
    }
}

/// One item of a record's history: a call, or an action on it.
// Nearly every item is an attempt: boxing it would cost each one an allocation.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum HistoryItem {
    Attempt(Attempt),
    Action(Action),
}

impl<'de> Deserialize<'de> for HistoryItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<HistoryItem, D::Error> {
        let v = Value::deserialize(d)?;
        if v.get("action").is_some() {
            serde_json::from_value(v)
                .map(HistoryItem::Action)
                .map_err(de::Error::custom)
        } else {
            serde_json::from_value(v)
                .map(HistoryItem::Attempt)
                .map_err(de::Error::custom)
        }
    }
}

impl HistoryItem {
    pub fn as_attempt(&self) -> Option<&Attempt> {
        match self {
            HistoryItem::Attempt(a) => Some(a),
            HistoryItem::Action(_) => None,
        }
    }
}

/// Calls a history holds: its attempt items (actions are not calls).
pub fn calls_in(history: &[HistoryItem]) -> u32 {
    history.iter().filter(|h| h.as_attempt().is_some()).count() as u32
}

/// The work a worker is given for one record. Encoded as one JSON object
/// whose first field is always `rid` (promote reads it there without
/// decoding); the input is embedded as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Task {
    /// Absent from a stream entry's encoding (the entry's `rid` field holds it).
    #[serde(default)]
    pub rid: String,
    /// Batch mode: the next attempt calls the model online (`[batch]
    /// retries = "online"`), not in a shard. Encoded right after the
    /// record id (`{"rid":"…","online":true`, or `{"online":true` in a
    /// stream entry), where the packing script looks for it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub online: bool,
    /// The record's input object, exactly as enqueued.
    pub input: Input,
    /// Attempts made before this task (deliveries lost to dead workers included).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub attempt: u32,
    /// Calls made before this task (rate-limited ones included).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub calls: u32,
    /// Attempts made before the current round began (`retry --from` and a
    /// requeue start a new round; attempts count on across rounds).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub base: u32,
    /// Validation errors of the previous attempt, shown to the model next time.
    #[serde(default, deserialize_with = "list_or_text", skip_serializing_if = "Vec::is_empty")]
    pub feedback: Vec<FieldError>,
    /// Every call and action so far.
    #[serde(default, deserialize_with = "list_or_text", skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<HistoryItem>,
    /// W3C traceparent of the record's enqueue span (empty when not traced).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub tp: String,
    /// The last answer, shown to the model with the feedback on its errors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
    /// Fingerprints of the requests that got an answer: none is sent again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub answered: Vec<String>,
    /// A reviewer's note for the round they requeued it into: shown to the
    /// model with its last answer on every attempt of that round.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// When the record's calls began failing transiently in a row (the
    /// start of the first failed call, Unix ms); 0 when the last call was
    /// answered. A record whose own calls alone fail for the job's outage
    /// budget goes to review.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub failing_since: u64,
    /// A valid answer waiting for the checker's (see [`crate::check`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub check: Option<Box<Pending>>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

fn is_zero_u64(n: &u64) -> bool {
    *n == 0
}

/// A value that is not what its encoding promises.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct DecodeError(String);

impl Task {
    /// A first task for a record: no attempts yet.
    pub fn new(rid: &str, input: &str, traceparent: &str) -> Result<Task, DecodeError> {
        Ok(Task {
            rid: rid.to_owned(),
            online: false,
            input: Input::parse(input)?,
            attempt: 0,
            calls: 0,
            base: 0,
            feedback: vec![],
            history: vec![],
            tp: traceparent.to_owned(),
            answer: None,
            answered: vec![],
            note: None,
            failing_since: 0,
            check: None,
        })
    }

    /// The one encoding (`{"rid":...` first).
    pub fn encode(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn decode(text: &str) -> Result<Task, DecodeError> {
        serde_json::from_str(text).map_err(|e| DecodeError(format!("task: {e}")))
    }

    /// The encoding a stream entry holds beside its `rid` field: the same
    /// without the record id (64 bytes less per queued record).
    pub fn encode_entry(&self) -> String {
        let full = self.encode();
        let prefix = format!("{{\"rid\":{},", serde_json::to_string(&self.rid).unwrap_or_default());
        match full.strip_prefix(&prefix) {
            Some(rest) => format!("{{{rest}"),
            None => full,
        }
    }

    /// A stream entry's fields: `task` (the encoding) or, from versions
    /// before it, one field per item (`rid`, `input`, `attempt`, `calls`,
    /// `base`, `feedback`, `history`, `tp`).
    pub fn from_entry_fields<'a>(fields: impl IntoIterator<Item = (&'a str, &'a str)>) -> Result<Task, DecodeError> {
        let mut legacy = Map::new();
        let mut rid: Option<String> = None;
        let mut encoded: Option<&str> = None;
        for (k, v) in fields {
            match k {
                "task" => encoded = Some(v),
                "rid" => {
                    rid = Some(v.to_owned());
                    legacy.insert("rid".into(), Value::String(v.to_owned()));
                }
                "attempt" | "calls" | "base" => {
                    legacy.insert(k.into(), Value::from(v.parse::<u32>().unwrap_or(0)));
                }
                "input" | "feedback" | "history" | "tp" => {
                    legacy.insert(k.into(), Value::String(v.to_owned()));
                }
                _ => {}
            }
        }
        if let Some(text) = encoded {
            let mut t = Task::decode(text)?;
            if let Some(r) = rid.filter(|r| !r.is_empty()) {
                t.rid = r;
            }
            if t.rid.is_empty() {
                return Err(DecodeError("task entry without a record id".into()));
            }
            return Ok(t);
        }
        if legacy.get("rid").is_none_or(|r| r.as_str().is_none_or(str::is_empty)) {
            return Err(DecodeError("task entry without a record id".into()));
        }
        legacy.entry("input").or_insert_with(|| Value::String("{}".into()));
        serde_json::from_value(Value::Object(legacy)).map_err(|e| DecodeError(format!("task: {e}")))
    }

    /// The input as an object (empty when it is not one).
    pub fn input_object(&self) -> Map<String, Value> {
        self.input.object()
    }

    /// The next task for the same record: attempts and calls so far, with
    /// feedback for the model and the history grown by this attempt (its
    /// calls not failing: the caller sets [`Task::failing_since`] after a failure).
    pub fn next(&self, attempt: u32, calls: u32, feedback: Vec<FieldError>, history: Vec<HistoryItem>) -> Task {
        Task {
            rid: self.rid.clone(),
            online: self.online,
            input: self.input.clone(),
            attempt,
            calls,
            base: self.base,
            feedback,
            history,
            tp: self.tp.clone(),
            answer: None,
            answered: self.answered.clone(),
            note: self.note.clone(),
            failing_since: 0,
            check: None,
        }
    }
}

/// A record's input object, kept exactly as enqueued (embedded in an
/// encoding as JSON, not as a string of JSON).
#[derive(Debug, Clone, Serialize)]
#[serde(transparent)]
pub struct Input(Box<RawValue>);

impl Input {
    /// The JSON text of an input.
    pub fn parse(text: &str) -> Result<Input, DecodeError> {
        RawValue::from_string(text.trim().to_owned())
            .map(Input)
            .map_err(|e| DecodeError(format!("input: {e}")))
    }

    /// The JSON text, as enqueued.
    pub fn get(&self) -> &str {
        self.0.get()
    }

    /// As an object (empty when it is not one).
    pub fn object(&self) -> Map<String, Value> {
        serde_json::from_str(self.get()).unwrap_or_default()
    }

    /// As a JSON value (Null when unreadable).
    pub fn value(&self) -> Value {
        serde_json::from_str(self.get()).unwrap_or(Value::Null)
    }
}

impl PartialEq for Input {
    fn eq(&self, other: &Input) -> bool {
        self.get() == other.get()
    }
}

/// Embedded JSON, or (versions before the one encoding) a string holding the JSON text.
impl<'de> Deserialize<'de> for Input {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Input, D::Error> {
        let v = Box::<RawValue>::deserialize(d)?;
        if v.get().starts_with('"') {
            let text: String = serde_json::from_str(v.get()).map_err(de::Error::custom)?;
            return Input::parse(&text).map_err(de::Error::custom);
        }
        Ok(Input(v))
    }
}

/// A list, or (versions before the one encoding) a string holding its JSON.
fn list_or_text<'de, D: Deserializer<'de>, T: de::DeserializeOwned>(d: D) -> Result<Vec<T>, D::Error> {
    // Through a Value, not an untagged enum: numbers keep their exact text
    // (serde_json's arbitrary precision) only outside untagged enums.
    match Value::deserialize(d)? {
        Value::Null => Ok(vec![]),
        Value::String(t) if t.trim().is_empty() => Ok(vec![]),
        Value::String(t) => serde_json::from_str(&t).map_err(de::Error::custom),
        list => serde_json::from_value(list).map_err(de::Error::custom),
    }
}

/// A task as delivered to a worker: the stream entry, to whom, and how often
/// it was delivered. The consumer and the delivery count are the fencing
/// token: an outcome applies only while the entry is still pending for this
/// consumer with this count (another worker that took it over changed both).
#[derive(Debug, Clone)]
pub struct Delivery {
    pub partition: u32,
    /// The stream entry id (what is acknowledged).
    pub entry_id: String,
    /// Times this entry was delivered, this delivery included (Redis's count).
    pub deliveries: u32,
    /// The consumer it was delivered to.
    pub consumer: String,
    /// When it was delivered: its outcome must be stored before the
    /// visibility timeout, or another worker takes the task over.
    /// (tokio's clock: the same as the system's, but a test may pause it)
    pub claimed_at: tokio::time::Instant,
    pub task: Task,
    /// The record's state as read right after the claim (None: not read;
    /// Some(None): the job does not know the record). Fresh, it spares the
    /// check before the call its round trip (the commit is fenced anyway).
    pub state_at_claim: Option<Option<RecordState>>,
    /// Batch mode: the shard holding the task (no stream entry: the outcome
    /// is fenced by the shard still holding it).
    pub shard: Option<String>,
}

/// The system fields of everything written for a record: the model, the
/// versions, who wrote it and when. Stamped here, never taken from a model.
#[derive(Debug, Clone)]
pub struct Stamp {
    pub model: String,
    pub versions: BTreeMap<String, String>,
    pub at: String,
}

impl Stamp {
    /// Now, for the job's spec.
    pub fn now(spec: &JobSpec) -> Stamp {
        Stamp {
            model: spec.provider.model.clone(),
            versions: crate::spec::versions_map(spec)
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v))
                .collect(),
            at: crate::manifest::now_rfc3339(),
        }
    }

    /// The same model and versions, stamped now (the versions are derived
    /// from the spec once per job, not once per record).
    pub fn renewed(&self) -> Stamp {
        Stamp {
            at: crate::manifest::now_rfc3339(),
            ..self.clone()
        }
    }

    /// The output with its system fields: the record id and the model.
    pub fn output(&self, mut output: Map<String, Value>, record_id: &str) -> Map<String, Value> {
        output.insert("record_id".into(), Value::String(record_id.to_owned()));
        output.insert("_model".into(), Value::String(self.model.clone()));
        output
    }

    /// A person's output with its system fields: the record id and who
    /// wrote it (`_reviewer`), not the model.
    pub fn human_output(&self, mut output: Map<String, Value>, record_id: &str, reviewer: &str) -> Map<String, Value> {
        output.remove("_model");
        output.insert("record_id".into(), Value::String(record_id.to_owned()));
        output.insert("_reviewer".into(), Value::String(reviewer.to_owned()));
        output
    }
}

/// A record's one result: the validated output and how it was made.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResultRecord {
    pub record_id: String,
    /// The business key (the spec's `id_field`).
    #[serde(default)]
    pub key: String,
    pub output: Map<String, Value>,
    #[serde(default)]
    pub attempts: u32,
    #[serde(default)]
    pub calls: u32,
    #[serde(default)]
    pub response_id: Option<String>,
    #[serde(default)]
    pub repairs: Vec<Repair>,
    /// What the call that produced the output used (None for a person's output).
    #[serde(default)]
    pub usage: Option<Usage>,
    #[serde(default)]
    pub history: Vec<HistoryItem>,
    #[serde(default)]
    pub model: String,
    #[serde(default)]
    pub versions: BTreeMap<String, String>,
    #[serde(default)]
    pub human: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reviewer: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<String>,
    #[serde(default)]
    pub committed_at: String,
    /// The record's input, kept beside the result for a job with a sink:
    /// written into the results table, and needed to send the record back
    /// to review when the database refuses the row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<Input>,
    /// People's edits after the commit, oldest first: each keeps the output
    /// it replaced (`output` is the latest).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub revisions: Vec<Revision>,
}

/// A person's edit of a committed result: an explicit revision, never a
/// silent overwrite.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Revision {
    /// 1 for the first edit of a result.
    pub revision: u32,
    /// The output it replaced, kept.
    pub previous: Map<String, Value>,
    /// The output it set.
    pub output: Map<String, Value>,
    pub by: String,
    pub at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// How a model's valid answer was made, for its result.
#[derive(Debug, Clone)]
pub struct Answer {
    pub key: String,
    pub output: Map<String, Value>,
    pub attempts: u32,
    pub calls: u32,
    pub response_id: Option<String>,
    pub repairs: Vec<Repair>,
    pub usage: Option<Usage>,
}

impl ResultRecord {
    /// A model's valid answer, committed by `worker`.
    pub fn from_model(task: &Task, answer: Answer, history: Vec<HistoryItem>, stamp: &Stamp, worker: &str) -> Self {
        ResultRecord {
            output: stamp.output(answer.output, &task.rid),
            record_id: task.rid.clone(),
            key: answer.key,
            attempts: answer.attempts,
            calls: answer.calls,
            response_id: answer.response_id,
            repairs: answer.repairs,
            usage: answer.usage,
            history,
            model: stamp.model.clone(),
            versions: stamp.versions.clone(),
            human: false,
            reviewer: None,
            worker: Some(worker.to_owned()),
            committed_at: stamp.at.clone(),
            input: None,
            revisions: Vec::new(),
        }
    }

    /// This result with a person's revision of its output (already
    /// validated) as the latest; the output it replaces is kept in the
    /// revision, and the history records who and why.
    pub fn revised(&self, output: Map<String, Value>, by: &str, note: Option<&str>) -> ResultRecord {
        let mut r = self.clone();
        let revision = Revision {
            revision: self.revisions.last().map_or(0, |v| v.revision) + 1,
            previous: self.output.clone(),
            output: output.clone(),
            by: by.to_owned(),
            at: crate::manifest::now_rfc3339(),
            note: note.map(str::to_owned),
        };
        r.history.push(HistoryItem::Action(Action {
            note: revision.note.clone(),
            ..Action::new("revise", by)
        }));
        r.revisions.push(revision);
        r.output = output;
        r.human = true;
        r.reviewer = Some(by.to_owned());
        r
    }

    /// A person's output (already validated) for a record in review.
    pub fn from_review(
        entry: &ReviewEntry,
        output: Map<String, Value>,
        repairs: Vec<Repair>,
        stamp: &Stamp,
        reviewer: &str,
    ) -> Self {
        ResultRecord {
            output: stamp.human_output(output, &entry.record_id, reviewer),
            record_id: entry.record_id.clone(),
            key: entry.key.clone(),
            attempts: entry.attempts,
            calls: calls_in(&entry.history),
            response_id: None,
            repairs,
            usage: None,
            history: entry.history.clone(),
            model: stamp.model.clone(),
            versions: stamp.versions.clone(),
            human: true,
            reviewer: Some(reviewer.to_owned()),
            worker: None,
            committed_at: stamp.at.clone(),
            input: None,
            revisions: Vec::new(),
        }
    }

    pub fn encode(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn decode(text: &str) -> Result<ResultRecord, DecodeError> {
        serde_json::from_str(text).map_err(|e| DecodeError(format!("result: {e}")))
    }
}

/// A record a person must look at: what went in, what came out, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReviewEntry {
    pub record_id: String,
    #[serde(default)]
    pub key: String,
    /// The record's input, exactly as enqueued.
    pub input: Input,
    /// The rendered user prompt (empty when the record never reached the model).
    #[serde(default)]
    pub prompt: String,
    #[serde(default)]
    pub last_raw_output: String,
    #[serde(default)]
    pub errors: Vec<FieldError>,
    #[serde(default)]
    pub attempts: u32,
    #[serde(default)]
    pub deliveries: u32,
    pub reason: String,
    #[serde(default)]
    pub history: Vec<HistoryItem>,
    #[serde(default)]
    pub versions: BTreeMap<String, String>,
    #[serde(default)]
    pub worker: String,
    #[serde(default)]
    pub created_at: String,
    /// What people did to the entry (once archived).
    #[serde(default)]
    pub actions: Vec<Action>,
    /// The entry's encoding as it was read: an action applies only while the
    /// stored entry is still exactly this (two reviewers cannot both win).
    #[serde(skip)]
    pub seen: String,
}

/// What a worker knows when it sends a record to review.
#[derive(Debug, Clone)]
pub struct ReviewFacts<'a> {
    pub key: &'a str,
    pub prompt: &'a str,
    pub last_raw_output: &'a str,
    pub errors: &'a [FieldError],
    pub attempts: u32,
    pub reason: &'a str,
}

impl ReviewEntry {
    /// A new entry for a delivered task.
    pub fn new(d: &Delivery, facts: ReviewFacts<'_>, history: Vec<HistoryItem>, stamp: &Stamp, worker: &str) -> Self {
        ReviewEntry {
            record_id: d.task.rid.clone(),
            key: facts.key.to_owned(),
            input: d.task.input.clone(),
            prompt: facts.prompt.to_owned(),
            last_raw_output: facts.last_raw_output.to_owned(),
            errors: facts.errors.to_vec(),
            attempts: facts.attempts,
            deliveries: d.deliveries,
            reason: facts.reason.to_owned(),
            history,
            versions: stamp.versions.clone(),
            worker: worker.to_owned(),
            created_at: stamp.at.clone(),
            actions: vec![],
            seen: String::new(),
        }
    }

    /// A committed result the sink's database refused to store (a
    /// constraint of the user's own), back for a person with the database's
    /// message; None for a result without its input (nothing to review it by).
    pub fn of_refused(r: &ResultRecord, message: &str, worker: &str) -> Option<Self> {
        Some(ReviewEntry {
            record_id: r.record_id.clone(),
            key: r.key.clone(),
            input: r.input.clone()?,
            prompt: String::new(),
            last_raw_output: Value::Object(r.output.clone()).to_string(),
            errors: vec![FieldError {
                code: crate::validate::ErrorCode::Sink,
                field: String::new(),
                message: format!("the database refused the row: {message}"),
            }],
            attempts: r.attempts,
            deliveries: 0,
            reason: Self::SINK_REJECTED.into(),
            history: r.history.clone(),
            versions: r.versions.clone(),
            worker: worker.to_owned(),
            created_at: crate::manifest::now_rfc3339(),
            actions: vec![],
            seen: String::new(),
        })
    }

    /// The review reason of a result the sink's database refused.
    pub const SINK_REJECTED: &'static str = "sink_rejected";

    /// A task for a fresh round of attempts (they count on from here), with
    /// `mark` recording who started it.
    pub fn requeue(&self, mark: &Action) -> Task {
        let mut history = self.history.clone();
        history.push(HistoryItem::Action(mark.clone()));
        Task {
            rid: self.record_id.clone(),
            online: false,
            input: self.input.clone(),
            attempt: self.attempts,
            calls: calls_in(&self.history),
            base: self.attempts,
            feedback: vec![],
            history,
            tp: String::new(),
            // With a note, the model sees its last answer and the note on it.
            answer: mark.note.as_ref().map(|_| self.last_raw_output.clone()),
            answered: vec![],
            note: mark.note.clone(),
            failing_since: 0,
            check: None,
        }
    }

    /// The entry as archived, with `act` appended to its actions.
    pub fn archived(&self, act: Action) -> ReviewEntry {
        let mut a = self.clone();
        a.actions.push(act);
        a.seen = String::new();
        a
    }

    /// The input as a JSON value (for display and export).
    pub fn input_value(&self) -> Value {
        self.input.value()
    }

    pub fn encode(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Decodes an entry, remembering the text it was read from.
    pub fn decode(text: &str) -> Result<ReviewEntry, DecodeError> {
        let mut e: ReviewEntry = serde_json::from_str(text).map_err(|e| DecodeError(format!("review entry: {e}")))?;
        e.seen = text.to_owned();
        Ok(e)
    }
}

/// A valid answer waiting for its check (kept in the task: it was paid for).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Pending {
    pub output: Map<String, Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_id: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub repairs: Vec<crate::validate::Repair>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<crate::task::Usage>,
}

/// What a check came to, kept on the checker's call in the record's history.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    pub model: String,
    /// Field by field: agreed or not.
    pub fields: BTreeMap<String, bool>,
    /// The first model's answer and the checker's (the checker's absent
    /// when it was not valid: its errors are the call's).
    pub first: Map<String, Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checker: Option<Map<String, Value>>,
}

impl Verdict {
    pub fn agrees(&self) -> bool {
        self.checker.is_some() && self.fields.values().all(|a| *a)
    }

    /// The fields side by side, for people: `field  first  checker  agree?`.
    pub fn side_by_side(&self) -> Vec<(String, String, String, bool)> {
        let text = |m: Option<&Map<String, Value>>, f: &str| {
            m.and_then(|m| m.get(f)).map_or("-".to_owned(), |v| match v {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            })
        };
        self.fields
            .iter()
            .map(|(f, agree)| {
                (
                    f.clone(),
                    text(Some(&self.first), f),
                    text(self.checker.as_ref(), f),
                    *agree,
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::ErrorCode;

    fn err() -> FieldError {
        FieldError {
            code: ErrorCode::Enum,
            field: "label".into(),
            message: "must be one of a, b".into(),
        }
    }

    fn attempt(n: u32) -> HistoryItem {
        HistoryItem::Attempt(Attempt {
            attempt: n,
            call: n,
            at: "2026-01-01T00:00:00Z".into(),
            worker: "w1".into(),
            elapsed_ms: 12,
            status: Some(200),
            response_id: Some(format!("resp-{n}")),
            finish_reason: "stop".into(),
            outcome: "invalid_output".into(),
            errors: vec![err()],
            repairs: vec![Repair::CodeFence],
            usage: Some(Usage {
                prompt: 10,
                cached: 4,
                completion: 5,
                reasoning: 0,
                total: 15,
                estimated: false,
            }),
            decision: "retry".into(),
            error: None,
            feedback: None,
            batch: None,
            tier: None,
            trail: Trail {
                request_sha256: "ab".repeat(32),
                model: "m".into(),
                provider: "http://127.0.0.1:9/v1".into(),
                response_sha256: Some("cd".repeat(32)),
                response_kept: true,
                response_body: None,
                batch_files: Vec::new(),
            },
            check: None,
        })
    }

    #[test]
    fn states_have_one_string_form() {
        let all = [
            RecordState::Queued,
            RecordState::Delayed,
            RecordState::Done,
            RecordState::Review,
            RecordState::Cancelled,
            RecordState::Dropped("template_missing:text".into()),
            RecordState::Dropped(RecordState::REJECTED.into()),
        ];
        for s in all {
            assert_eq!(RecordState::decode(&s.encode()), Some(s.clone()), "{s}");
            assert_eq!(
                s.is_terminal(),
                !matches!(s, RecordState::Queued | RecordState::Delayed)
            );
        }
        assert_eq!(
            RecordState::decode("dropped:rejected").unwrap().encode(),
            "dropped:rejected"
        );
        assert_eq!(RecordState::decode("weird"), None);
        // A sunk record: done, its origin in the entry (and as an earlier version wrote it).
        assert_eq!(RecordState::decode("d@3:42"), Some(RecordState::Done));
        assert_eq!(RecordState::sunk_origin("d@3:42"), Some("3:42"));
        assert_eq!(RecordState::decode("done@0123456789ab:42"), Some(RecordState::Done));
        assert_eq!(
            RecordState::sunk_origin("done@0123456789ab:42"),
            Some("0123456789ab:42")
        );
        // Small enough for Redis's 16-byte allocation (1-byte header, NUL):
        // a thousand datasets of a hundred million lines.
        assert!(format!("{}999:99999999", RecordState::SUNK_PREFIX).len() <= 14);
        assert_eq!(RecordState::sunk_origin("done"), None);
    }

    #[test]
    fn task_round_trips_and_starts_with_its_record_id() {
        let t = Task {
            rid: "ab".repeat(32),
            online: false,
            input: Input::parse(r#"{"id":"m1","n":12345678901234567890123,"x":1.50}"#).unwrap(),
            attempt: 2,
            calls: 3,
            base: 1,
            feedback: vec![err()],
            history: vec![attempt(1), HistoryItem::Action(Action::new("requeue", "ana"))],
            tp: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
            answer: Some("{\"label\":\"nope\"}".into()),
            answered: vec!["0123456789abcdef".into()],
            note: Some("the label is billing".into()),
            failing_since: 1_796_000_000_000,
            check: Some(Box::new(Pending {
                output: serde_json::from_str(r#"{"label":"billing"}"#).unwrap(),
                response_id: Some("chatcmpl-1".into()),
                repairs: vec![],
                usage: None,
            })),
        };
        let text = t.encode();
        assert!(text.starts_with(&format!("{{\"rid\":\"{}\"", t.rid)), "{text}");
        // The input is embedded as written: big integers and trailing zeros kept.
        assert!(
            text.contains(r#""input":{"id":"m1","n":12345678901234567890123,"x":1.50}"#),
            "{text}"
        );
        let back = Task::decode(&text).unwrap();
        assert_eq!(back.encode(), text);
        assert_eq!(back.history, t.history);
        assert_eq!(back.feedback, t.feedback);
        assert_eq!(back.input_object()["id"], "m1");
    }

    #[test]
    fn an_untraced_task_has_no_tp() {
        let t = Task::new("r1", "{\"a\":1}", "").unwrap();
        assert!(!t.encode().contains("\"tp\""), "{}", t.encode());
    }

    #[test]
    fn tasks_of_earlier_versions_decode() {
        // The delayed set and the cancelled hash held this JSON, with the
        // input, feedback and history as JSON text.
        let old = r#"{"rid":"r1","input":"{\"id\":\"m1\"}","attempt":2,"calls":4,"feedback":"[{\"code\":\"E_ENUM\",\"field\":\"label\",\"message\":\"must be one of a, b\"}]","history":"[{\"attempt\":1,\"call\":1,\"usage\":null},{\"action\":\"retry\",\"by\":\"op\",\"at\":\"t\"}]"}"#;
        let t = Task::decode(old).unwrap();
        assert_eq!((t.rid.as_str(), t.attempt, t.calls, t.base), ("r1", 2, 4, 0));
        assert_eq!(t.input.get(), r#"{"id":"m1"}"#);
        assert_eq!(t.feedback, vec![err()]);
        assert_eq!(t.history.len(), 2);
        assert_eq!(calls_in(&t.history), 1);
        assert!(t.tp.is_empty());

        // Stream entries held one field per item; a copy injected by hand
        // may hold only `rid` and `input`.
        let fields = [
            ("rid", "r2"),
            ("input", "{\"id\":\"m2\"}"),
            ("attempt", "1"),
            ("calls", "2"),
            ("base", "1"),
            ("feedback", "[]"),
            ("history", "[]"),
            ("tp", ""),
        ];
        let t = Task::from_entry_fields(fields).unwrap();
        assert_eq!((t.rid.as_str(), t.attempt, t.calls, t.base), ("r2", 1, 2, 1));
        assert_eq!(t.input.get(), r#"{"id":"m2"}"#);
        let t = Task::from_entry_fields([("rid", "r3"), ("input", "{}")]).unwrap();
        assert_eq!((t.attempt, t.calls, t.feedback.len(), t.history.len()), (0, 0, 0, 0));
        assert!(Task::from_entry_fields([("input", "{}")]).is_err());

        // Today's entries: the encoded task, without its record id (the entry's `rid` has it).
        let enc = Task::new("r4", "{\"k\":[1,2]}", "").unwrap().encode_entry();
        assert_eq!(enc, "{\"input\":{\"k\":[1,2]}}");
        let t = Task::from_entry_fields([("rid", "r4"), ("task", enc.as_str())]).unwrap();
        assert_eq!((t.rid.as_str(), t.input.get()), ("r4", "{\"k\":[1,2]}"));
        // Entries written by promote and resume hold the whole encoding.
        let full = Task::new("r5", "{}", "").unwrap().encode();
        assert_eq!(
            Task::from_entry_fields([("rid", "r5"), ("task", full.as_str())])
                .unwrap()
                .rid,
            "r5"
        );
    }

    #[test]
    fn usage_is_normalised_once() {
        let u = Usage::from_provider(&serde_json::json!({
            "prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
            "prompt_tokens_details": {"cached_tokens": 50},
            "completion_tokens_details": {"reasoning_tokens": 2}
        }))
        .unwrap();
        assert_eq!(
            (u.prompt, u.cached, u.completion, u.reasoning, u.total),
            (10, 10, 3, 2, 13)
        );
        let back: Usage = serde_json::from_str(&serde_json::to_string(&u).unwrap()).unwrap();
        assert_eq!(back, u);
        let v = serde_json::to_value(u).unwrap();
        assert_eq!(v["prompt_tokens"], 10);
        assert_eq!(v["prompt_tokens_details"]["cached_tokens"], 10);
        assert_eq!(Usage::from_provider(&Value::Null), None);
        let bare = Usage::from_provider(&serde_json::json!({"prompt_tokens": 7})).unwrap();
        assert_eq!((bare.prompt, bare.completion, bare.total), (7, 0, 7));
    }

    #[test]
    fn results_and_review_entries_round_trip() {
        let spec = JobSpec::parse(include_str!("../../examples/job.toml"), "example").unwrap();
        let stamp = Stamp::now(&spec);
        let task = Task::new("r1", r#"{"message_id":"m1","text":"hi"}"#, "").unwrap();
        let d = Delivery {
            partition: 0,
            entry_id: "1-0".into(),
            deliveries: 2,
            consumer: "w1".into(),
            claimed_at: tokio::time::Instant::now(),
            task: task.clone(),
            state_at_claim: None,
            shard: None,
        };
        let mut out = Map::new();
        out.insert("label".into(), Value::from("billing"));
        out.insert("record_id".into(), Value::from("from the model"));
        let answer = Answer {
            key: "m1".into(),
            output: out.clone(),
            attempts: 1,
            calls: 1,
            response_id: Some("resp-1".into()),
            repairs: vec![],
            usage: None,
        };
        let r = ResultRecord::from_model(&task, answer, vec![attempt(1)], &stamp, "w1");
        assert_eq!(r.output["record_id"], "r1", "system fields come from code");
        assert_eq!(r.output["_model"], Value::from(spec.provider.model.clone()));
        assert_eq!(ResultRecord::decode(&r.encode()).unwrap(), r);

        let facts = ReviewFacts {
            key: "m1",
            prompt: "classify: hi",
            last_raw_output: "{\"label\":\"nope\"}",
            errors: &[err()],
            attempts: 3,
            reason: "attempts_exhausted",
        };
        let e = ReviewEntry::new(&d, facts, vec![attempt(1), attempt(2)], &stamp, "w1");
        let text = e.encode();
        let back = ReviewEntry::decode(&text).unwrap();
        assert_eq!(back.seen, text);
        assert_eq!(back.encode(), text);
        assert_eq!(back.input_value()["message_id"], "m1");

        let mark = Action::new("requeue", "ana");
        let next = back.requeue(&mark);
        assert_eq!((next.attempt, next.base, next.calls), (3, 3, 2));
        assert_eq!(next.history.len(), 3);
        assert_eq!(next.input.get(), task.input.get());

        let human = ResultRecord::from_review(&back, out, vec![], &stamp, "ana");
        assert!(human.human);
        assert_eq!(human.reviewer.as_deref(), Some("ana"));
        assert_eq!((human.attempts, human.calls), (3, 2));
        assert_eq!(human.output["record_id"], "r1");

        let archived = back.archived(mark);
        assert_eq!(archived.actions.len(), 1);
        assert!(archived.seen.is_empty());
    }

    #[test]
    fn review_entries_of_earlier_versions_decode() {
        // Earlier entries held the input as parsed JSON and requeue notes as null.
        let old = r#"{"record_id":"r1","key":"m1","input":{"message_id":"m1"},"prompt":"p","last_raw_output":"x","errors":[],"attempts":2,"deliveries":1,"reason":"poison","history":[{"action":"requeue","by":"a","at":"t","note":null}],"versions":{"prompt":"1"},"worker":"w","created_at":"t","actions":[]}"#;
        let e = ReviewEntry::decode(old).unwrap();
        assert_eq!(e.input.get(), r#"{"message_id":"m1"}"#);
        assert_eq!(calls_in(&e.history), 0);
        // Results a person accepted had no calls, usage or worker.
        let r = ResultRecord::decode(r#"{"record_id":"r1","key":"m1","output":{"a":1},"attempts":2,"repairs":[],"history":[],"model":"m","versions":{},"human":true,"reviewer":"ana","committed_at":"t"}"#).unwrap();
        assert_eq!((r.calls, r.usage, r.worker), (0, None, None));
    }
}

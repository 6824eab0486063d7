//! What every sink stores, whatever its kind: a batch of a partition's
//! outcomes as rows (results, failures, paid calls), the sink stream entries
//! they came from, the figures a result keeps in Redis once it left, and
//! why a sink could not do its work.

use serde_json::Value;
use serde_json::value::RawValue;

use crate::ledger::PaidCall;
use crate::spec::Prices;
use crate::task::{ResultRecord, ReviewEntry, Usage};

/// Why the sink could not do its work; every message is scrubbed of the
/// database URL's password.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SinkError {
    /// Down, unreachable, or the connection broke: retried with back-off.
    #[error("cannot reach the database: {0}")]
    Unreachable(String),
    /// Authentication or authorization failed: retried, but needs a person.
    #[error("the database refused the connection: {0}")]
    Refused(String),
    /// The table exists but lacks a column or has one of another type.
    #[error("{0}")]
    Schema(String),
    /// The database refused the rows (a constraint the user added...).
    #[error("the database rejected a batch: {0}")]
    Rejected(String),
    /// The files sink cannot write its directory (full, read-only, gone...).
    #[error("the sink directory failed: {0}")]
    Disk(String),
}

impl SinkError {
    /// A bounded label for `batchfleet_sink_errors_total{cause}`.
    pub fn cause(&self) -> &'static str {
        match self {
            SinkError::Unreachable(_) => "unreachable",
            SinkError::Refused(_) => "refused",
            SinkError::Schema(_) => "schema",
            SinkError::Rejected(_) => "rejected",
            SinkError::Disk(_) => "disk",
        }
    }
}

/// One committed result as a row (and, as JSON, a line of the files sink).
/// Its large JSON parts are kept as text: read from Redis, they reach the
/// database (or the file) as they were, never parsed into values and
/// written again.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ResultRow {
    pub record_id: String,
    pub business_key: String,
    pub versions: Box<RawValue>,
    pub output: Box<RawValue>,
    pub attempts: i32,
    pub calls: i32,
    pub prompt_tokens: Option<i64>,
    pub cached_tokens: Option<i64>,
    pub completion_tokens: Option<i64>,
    pub cost_usd: Option<f64>,
    pub model: String,
    pub response_id: Option<String>,
    pub human: bool,
    pub reviewer: Option<String>,
    pub committed_at: String,
    pub usage: Option<Box<RawValue>>,
    pub repairs: Box<RawValue>,
    pub history: Box<RawValue>,
    pub worker: Option<String>,
    pub input: Option<Box<RawValue>>,
}

/// A result's encoding as the sink reads it: the scalars, and the JSON
/// parts as text.
#[derive(serde::Deserialize)]
struct LeanResult {
    record_id: String,
    #[serde(default)]
    key: String,
    output: Box<RawValue>,
    #[serde(default)]
    attempts: u32,
    #[serde(default)]
    calls: u32,
    #[serde(default)]
    response_id: Option<String>,
    #[serde(default)]
    repairs: Option<Box<RawValue>>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    history: Option<Box<RawValue>>,
    #[serde(default)]
    model: String,
    #[serde(default)]
    versions: Option<Box<RawValue>>,
    #[serde(default)]
    human: bool,
    #[serde(default)]
    reviewer: Option<String>,
    #[serde(default)]
    worker: Option<String>,
    #[serde(default)]
    committed_at: String,
    #[serde(default)]
    input: Option<Box<RawValue>>,
}

/// Of a history item, only what the sunk counters need.
#[derive(serde::Deserialize)]
struct UsageOnly {
    #[serde(default)]
    usage: Option<Usage>,
}

fn raw(text: &str) -> Box<RawValue> {
    RawValue::from_string(text.to_owned())
        .unwrap_or_else(|_| RawValue::from_string("null".into()).expect("null is JSON"))
}

fn to_raw(v: &impl serde::Serialize, empty: &str) -> Box<RawValue> {
    serde_json::value::to_raw_value(v).unwrap_or_else(|_| raw(empty))
}

impl ResultRow {
    /// A result's encoding in Redis as its row, and the figures the sunk
    /// counters keep of it, without decoding its history and input.
    pub fn parse(text: &str, prices: &Prices) -> Result<(ResultRow, SunkResult), String> {
        let r: LeanResult = serde_json::from_str(text).map_err(|e| format!("result: {e}"))?;
        let history = r.history.unwrap_or_else(|| raw("[]"));
        let mut tokens = Tokens::default();
        for u in serde_json::from_str::<Vec<UsageOnly>>(history.get())
            .map_err(|e| format!("result history: {e}"))?
            .into_iter()
            .filter_map(|h| h.usage)
        {
            tokens.add(u.prompt, u.completion, u.cached);
        }
        let sunk = SunkResult {
            rid: r.record_id.clone(),
            attempts: r.attempts,
            tokens,
        };
        let row = ResultRow {
            record_id: r.record_id,
            business_key: r.key,
            versions: r.versions.unwrap_or_else(|| raw("{}")),
            output: r.output,
            attempts: i32::try_from(r.attempts).unwrap_or(i32::MAX),
            calls: i32::try_from(r.calls).unwrap_or(i32::MAX),
            prompt_tokens: r.usage.map(|u| u.prompt as i64),
            cached_tokens: r.usage.map(|u| u.cached as i64),
            completion_tokens: r.usage.map(|u| u.completion as i64),
            cost_usd: r.usage.map(|u| u.cost(prices)),
            model: r.model,
            response_id: r.response_id,
            human: r.human,
            reviewer: r.reviewer,
            committed_at: r.committed_at,
            usage: r.usage.as_ref().map(|u| to_raw(u, "null")),
            repairs: r.repairs.unwrap_or_else(|| raw("[]")),
            history,
            worker: r.worker,
            input: r.input,
        };
        Ok((row, sunk))
    }

    /// The result this row was written from.
    pub fn into_record(self) -> ResultRecord {
        ResultRecord {
            record_id: self.record_id,
            key: self.business_key,
            output: serde_json::from_str(self.output.get()).unwrap_or_default(),
            attempts: u32::try_from(self.attempts).unwrap_or(0),
            calls: u32::try_from(self.calls).unwrap_or(0),
            response_id: self.response_id,
            repairs: serde_json::from_str(self.repairs.get()).unwrap_or_default(),
            usage: self.usage.and_then(|u| serde_json::from_str(u.get()).ok()),
            history: serde_json::from_str(self.history.get()).unwrap_or_default(),
            model: self.model,
            versions: serde_json::from_str(self.versions.get()).unwrap_or_default(),
            human: self.human,
            reviewer: self.reviewer,
            worker: self.worker,
            committed_at: self.committed_at,
            input: self.input.and_then(|v| crate::task::Input::parse(v.get()).ok()),
            revisions: Vec::new(),
        }
    }
}

/// A record that did not become done (yet): in review, dropped or cancelled.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct FailureRow {
    pub record_id: String,
    pub business_key: String,
    /// `review`, `dropped` or `cancelled`.
    pub state: String,
    pub reason: String,
    pub errors: Value,
    pub at: String,
}

impl FailureRow {
    /// A record in `state` (dropped, cancelled, rejected...) with `reason`,
    /// as of now; its business key is not at hand here.
    pub fn of_state(rid: &str, state: &str, reason: &str) -> FailureRow {
        FailureRow {
            record_id: rid.to_owned(),
            business_key: String::new(),
            state: state.to_owned(),
            reason: reason.to_owned(),
            errors: Value::Array(vec![]),
            at: crate::manifest::now_rfc3339(),
        }
    }

    pub fn of_review(e: &ReviewEntry) -> FailureRow {
        FailureRow {
            record_id: e.record_id.clone(),
            business_key: e.key.clone(),
            state: "review".into(),
            reason: e.reason.clone(),
            errors: serde_json::to_value(&e.errors).unwrap_or(Value::Null),
            at: e.created_at.clone(),
        }
    }
}

/// A person's edit of a written result, as a row of `<table>_revisions`
/// (and, as JSON, a line of the files sink's revisions).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RevisionRow {
    pub record_id: String,
    pub revision: i32,
    pub job: String,
    pub previous: Value,
    pub output: Value,
    pub reviewer: String,
    pub note: Option<String>,
    pub revised_at: String,
}

impl RevisionRow {
    pub fn revision(&self) -> crate::task::Revision {
        let map = |v: &Value| v.as_object().cloned().unwrap_or_default();
        crate::task::Revision {
            revision: u32::try_from(self.revision).unwrap_or(0),
            previous: map(&self.previous),
            output: map(&self.output),
            by: self.reviewer.clone(),
            at: self.revised_at.clone(),
            note: self.note.clone(),
        }
    }
}

/// A result with its revisions, oldest first: the latest one's output is
/// the result's output.
pub fn with_revisions(mut r: ResultRecord, revisions: &[RevisionRow]) -> ResultRecord {
    for row in revisions {
        let v = row.revision();
        r.output = v.output.clone();
        r.human = true;
        r.reviewer = Some(v.by.clone());
        r.revisions.push(v);
    }
    r
}

/// One entry of a sink stream.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SinkEntry {
    pub entry_id: String,
    pub rid: String,
    /// A committed result (`r`), or a record in review, dropped or
    /// cancelled (`f`), or one of its paid calls (`l`, with `call`).
    pub result: bool,
    /// A paid call: its key in the ledger.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call: Option<String>,
}

impl SinkEntry {
    /// A record in review, dropped or cancelled (read from its state now).
    pub fn is_failure(&self) -> bool {
        !self.result && self.call.is_none()
    }
}

/// Tokens of every call a result's history holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Tokens {
    pub prompt: u64,
    pub completion: u64,
    pub cached: u64,
}

impl Tokens {
    pub fn of(r: &ResultRecord) -> Tokens {
        let mut t = Tokens::default();
        for u in r.history.iter().filter_map(|h| h.as_attempt()?.usage) {
            t.add(u.prompt, u.completion, u.cached);
        }
        t
    }

    pub fn add(&mut self, prompt: u64, completion: u64, cached: u64) {
        self.prompt += prompt;
        self.completion += completion;
        self.cached += cached;
    }
}

/// The figures of a result the sink holds, kept in Redis's `sunk`
/// counters once the result leaves Redis.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SunkResult {
    pub rid: String,
    pub attempts: u32,
    pub tokens: Tokens,
}

impl SunkResult {
    pub fn of(r: &ResultRecord) -> SunkResult {
        SunkResult {
            rid: r.record_id.clone(),
            attempts: r.attempts,
            tokens: Tokens::of(r),
        }
    }
}

/// What a batch of sink entries names, read from Redis.
#[derive(Debug, Clone, Default)]
pub struct SinkBatch {
    /// The committed results as rows (their large JSON parts as Redis holds
    /// them, unparsed), ...
    pub results: Vec<ResultRow>,
    /// ... the figures each keeps in the `sunk` counters once it leaves Redis, ...
    pub sunk: Vec<SunkResult>,
    /// ... and each one's encoding in Redis (decoded only when needed).
    pub texts: Vec<String>,
    /// Records whose state is review, dropped or cancelled now, and results
    /// that cannot be read (kept as `rejected`).
    pub failures: Vec<FailureRow>,
    /// The paid calls the batch names that are still in the ledger hash
    /// (each once).
    pub paid: Vec<PaidCall>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_read_lean_from_redis_is_the_row_of_the_decoded_result() {
        let text = r#"{"record_id":"r1","key":"k1","output":{"label":"billing","n":12345678901234567890},
            "attempts":2,"calls":3,"response_id":"resp-1","repairs":[],
            "usage":{"prompt_tokens":100,"completion_tokens":20,"total_tokens":120,"prompt_tokens_details":{"cached_tokens":40}},
            "history":[{"attempt":1,"call":1,"outcome":"invalid_output","usage":{"prompt_tokens":90,"completion_tokens":10}},
                       {"action":"requeue","by":"ann","at":"2026-01-01T00:00:00Z"},
                       {"attempt":2,"call":3,"outcome":"valid","usage":{"prompt_tokens":100,"completion_tokens":20,
                        "prompt_tokens_details":{"cached_tokens":40}}}],
            "model":"m","versions":{"source":"1","prompt":"2"},"human":false,"worker":"w1",
            "committed_at":"2026-01-01T00:00:01Z","input":{"id":"k1","big":1.000000000000000000001}}"#;
        let prices = Prices::default();
        let (lean, sunk) = ResultRow::parse(text, &prices).unwrap();
        let decoded = ResultRecord::decode(text).unwrap();
        // The row of the decoded result, encoded again (its history with every default).
        let (full, _) = ResultRow::parse(&decoded.encode(), &prices).unwrap();
        assert_eq!(lean.clone().into_record(), full.clone().into_record());
        assert_eq!(
            (lean.cached_tokens, lean.cost_usd, lean.prompt_tokens),
            (full.cached_tokens, full.cost_usd, Some(100))
        );
        assert_eq!(sunk, SunkResult::of(&decoded));
        assert_eq!(
            (sunk.tokens.prompt, sunk.tokens.completion, sunk.tokens.cached),
            (190, 30, 40)
        );
        assert!(
            lean.input.as_ref().unwrap().get().contains("1.000000000000000000001"),
            "numbers kept as written"
        );
        assert_eq!(lean.into_record(), decoded, "and back to the result it was");
        assert!(ResultRow::parse("{\"record_id\": 1}", &prices).is_err());
    }
}

//! Provider batch mode's shards: a partition's queued tasks packed into one
//! input file for the provider's Batch API, and its life from packing to
//! the last record settled.
//!
//! A shard is written to Redis before every step that the provider cannot
//! undo: its tasks are moved out of the stream into the shard's hash in one
//! atomic step (`shard.lua pack`), its state is `submitting` before the
//! batch is created (a create is not idempotent: after a crash or a create
//! whose answer was lost, the batch is looked up by its metadata before any
//! new create), and each record leaves the shard only when its outcome is
//! stored (`finish.lua`, fenced by the shard still holding it).

use serde::{Deserialize, Serialize};

/// Where a shard is, in the order of its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardState {
    /// Its tasks are in its hash; no file yet.
    Packed,
    /// Its input file is uploaded (`file_id`).
    Uploaded,
    /// A create was (or is about to be) sent: before any new one, the
    /// provider's batches are searched for this shard's.
    Submitting,
    /// The provider has the batch (`batch_id`): `validating`,
    /// `in_progress`, `finalizing` at the provider.
    Submitted,
    /// The batch ended (`completed`, `failed`, `expired` or `cancelled`):
    /// its lines are being settled.
    Ended,
    /// Every record left it.
    Reconciled,
}

impl ShardState {
    pub fn name(self) -> &'static str {
        match self {
            ShardState::Packed => "packed",
            ShardState::Uploaded => "uploaded",
            ShardState::Submitting => "submitting",
            ShardState::Submitted => "submitted",
            ShardState::Ended => "ended",
            ShardState::Reconciled => "reconciled",
        }
    }
}

/// A shard as Redis keeps it (`keys::shards`, a JSON value per shard).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Shard {
    pub id: String,
    pub partition: u32,
    pub state: ShardState,
    /// Records packed into it.
    pub records: u64,
    /// Tokens its requests may use at most (prompt and `max_tokens` each):
    /// what it counts against the provider's enqueued-token limit.
    #[serde(default)]
    pub tokens: u64,
    pub created_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_sha256: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_id: Option<String>,
    /// Creates sent for it (a create whose answer was lost counts).
    #[serde(default)]
    pub submits: u32,
    /// The provider's own status of the batch (`in_progress`, `expired`...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_status: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_file_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_file_id: Option<String>,
    /// The worker working on it, and until when (any worker takes over a
    /// shard whose lease ran out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    #[serde(default)]
    pub lease_until_ms: u64,
    /// When the provider's batch was last looked at.
    #[serde(default)]
    pub polled_ms: u64,
    /// What went wrong at the provider (a file that failed validation...),
    /// and what the lines came to: reported, never silently dropped.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    /// Settled from its lines: records with a line, duplicate lines,
    /// lines for records it does not hold, records with no line (re-sharded).
    #[serde(default)]
    pub lines: LineCounts,
}

/// What a finished batch's lines came to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LineCounts {
    pub settled: u64,
    pub duplicates: u64,
    pub unknown: u64,
    pub missing: u64,
}

impl Shard {
    /// A new shard of `partition`, packed now, held by `owner` until `lease_until_ms`.
    pub fn new(id: String, partition: u32, owner: &str, now_ms: u64, lease_until_ms: u64) -> Shard {
        Shard {
            id,
            partition,
            state: ShardState::Packed,
            records: 0,
            tokens: 0,
            created_ms: now_ms,
            file_id: None,
            file_sha256: None,
            batch_id: None,
            submits: 0,
            provider_status: None,
            output_file_id: None,
            error_file_id: None,
            owner: Some(owner.to_owned()),
            lease_until_ms,
            polled_ms: 0,
            notes: Vec::new(),
            lines: LineCounts::default(),
        }
    }

    pub fn encode(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn decode(text: &str) -> Result<Shard, String> {
        serde_json::from_str(text).map_err(|e| format!("shard: {e}"))
    }

    /// Whether `worker` may work on it now: its own, or nobody's lease runs.
    pub fn free_for(&self, worker: &str, now_ms: u64) -> bool {
        self.owner.as_deref() == Some(worker) || self.lease_until_ms <= now_ms
    }

    /// The metadata its batch is created with, and found again by.
    pub fn metadata(&self, job_key: &str) -> serde_json::Value {
        serde_json::json!({"batchfleet_job": job_key, "batchfleet_shard": self.id})
    }
}

/// A shard as `producer status` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ShardView {
    pub id: String,
    pub partition: u32,
    pub state: String,
    pub records: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub provider_status: Option<String>,
    pub lines: LineCounts,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

impl From<&Shard> for ShardView {
    fn from(s: &Shard) -> ShardView {
        ShardView {
            id: s.id.clone(),
            partition: s.partition,
            state: s.state.name().to_owned(),
            records: s.records,
            batch_id: s.batch_id.clone(),
            provider_status: s.provider_status.clone(),
            lines: s.lines,
            notes: s.notes.clone(),
        }
    }
}

/// One line of a batch's output or error file, as the provider writes it:
/// `{custom_id, response: {status_code, body}, error: {code, message}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct OutputLine {
    /// The provider's id of the line (`batch_req_...`), when it gives one.
    pub id: Option<String>,
    pub custom_id: String,
    /// The response's status and body (its JSON as text), when there is one.
    pub response: Option<(u16, String)>,
    /// The line's own error (a request the batch could not run).
    pub error: Option<(String, String)>,
}

impl OutputLine {
    pub fn parse(line: &str) -> Result<OutputLine, String> {
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
        let custom_id = v["custom_id"].as_str().ok_or("no custom_id")?.to_owned();
        let response = v["response"].as_object().map(|r| {
            (
                r.get("status_code").and_then(serde_json::Value::as_u64).unwrap_or(0) as u16,
                r.get("body").map(ToString::to_string).unwrap_or_default(),
            )
        });
        let error = v["error"].as_object().map(|e| {
            let text = |k: &str| e.get(k).and_then(serde_json::Value::as_str).unwrap_or("").to_owned();
            (text("code"), text("message"))
        });
        Ok(OutputLine {
            id: v["id"].as_str().map(str::to_owned),
            custom_id,
            response,
            error,
        })
    }

    /// A 2xx response.
    pub fn answered(&self) -> bool {
        self.response.as_ref().is_some_and(|(s, _)| (200..300).contains(s))
    }

    /// The request never ran: its batch expired or was cancelled first
    /// (`batch_expired`, `batch_cancelled`). Not an attempt: it goes into
    /// another shard, as if it had no line.
    pub fn not_run(&self) -> bool {
        self.response.is_none()
            && self
                .error
                .as_ref()
                .is_some_and(|(code, _)| matches!(code.as_str(), "batch_expired" | "batch_cancelled"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shard_round_trips_and_its_lease_is_its_owners_until_it_runs_out() {
        let s = Shard {
            id: "p1-000003".into(),
            partition: 1,
            state: ShardState::Submitting,
            records: 10,
            tokens: 5000,
            created_ms: 1,
            file_id: Some("file-1".into()),
            file_sha256: None,
            batch_id: None,
            submits: 1,
            provider_status: None,
            output_file_id: None,
            error_file_id: None,
            owner: Some("w1".into()),
            lease_until_ms: 1000,
            polled_ms: 0,
            notes: vec![],
            lines: LineCounts::default(),
        };
        assert_eq!(Shard::decode(&s.encode()).unwrap(), s);
        assert!(s.free_for("w1", 10) && !s.free_for("w2", 10) && s.free_for("w2", 1000));
        assert!(ShardState::Packed < ShardState::Submitting && ShardState::Ended < ShardState::Reconciled);
        assert_eq!(s.metadata("k")["batchfleet_shard"], "p1-000003");
    }

    #[test]
    fn output_lines_are_read_as_providers_write_them() {
        let ok = OutputLine::parse(
            r#"{"id":"b1","custom_id":"r1","response":{"status_code":200,"request_id":"q","body":{"choices":[]}},"error":null}"#,
        )
        .unwrap();
        assert!(ok.answered() && ok.error.is_none());
        assert_eq!(ok.response.as_ref().unwrap().1, r#"{"choices":[]}"#);
        let failed = OutputLine::parse(
            r#"{"custom_id":"r2","response":null,"error":{"code":"batch_expired","message":"expired"}}"#,
        )
        .unwrap();
        assert!(!failed.answered());
        assert_eq!(failed.error, Some(("batch_expired".into(), "expired".into())));
        assert!(OutputLine::parse(r#"{"response":null}"#).is_err());
    }
}

//! `producer review`: people drain the review queue. Every action is one
//! atomic script that only applies if the entry is unchanged since it was
//! read, records who and when, and archives the entry with its actions.

use std::path::Path;

use common::keys;
use common::manifest::now_rfc3339;
use common::spec::JobSpec;
use common::store::{RedisStore, ReviewAction, ReviewOutcome};
use common::validate::{Validation, validate};
use serde_json::{Value, json};

/// Why a review command did not apply.
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    #[error("{0}")]
    NotFound(String),
    #[error("the corrected output is invalid:\n{}", .0.join("\n"))]
    Invalid(Vec<String>),
    #[error("record {0} was handled by another reviewer first (or changed meanwhile): nothing was done")]
    Lost(String),
    #[error("record {0} already has a result: nothing was done")]
    AlreadyDone(String),
    #[error(transparent)]
    Store(#[from] common::store::StoreError),
    #[error("{0}")]
    Io(String),
}

/// A job's spec as enqueued, and its partition count.
pub async fn job_spec(store: &RedisStore, job: &str) -> Result<JobSpec, ReviewError> {
    let text = store
        .load_spec_text(job)
        .await?
        .ok_or_else(|| ReviewError::NotFound(format!("job `{job}` does not exist")))?;
    JobSpec::parse(&text, job).map_err(|e| ReviewError::Io(e.to_string()))
}

/// Every review entry of a job, optionally filtered by reason or error code.
pub async fn list(
    store: &RedisStore,
    job: &str,
    reason: Option<&str>,
    code: Option<&str>,
) -> Result<Vec<Value>, ReviewError> {
    let spec = job_spec(store, job).await?;
    let mut out = Vec::new();
    for p in 0..spec.job.partitions {
        store
            .scan_hash(&keys::review(job, p), |_, json| {
                let Ok(e) = serde_json::from_str::<Value>(&json) else {
                    return;
                };
                let reason_ok = reason.is_none_or(|r| e["reason"].as_str().is_some_and(|x| x.starts_with(r)));
                let code_ok = code.is_none_or(|c| {
                    e["errors"]
                        .as_array()
                        .is_some_and(|errs| errs.iter().any(|x| x["code"] == c))
                });
                if reason_ok && code_ok {
                    out.push(e);
                }
            })
            .await?;
    }
    out.sort_by(|a, b| a["record_id"].as_str().cmp(&b["record_id"].as_str()));
    Ok(out)
}

/// Finds an entry by record id, a unique record id prefix, or business key.
/// Returns (record id, partition, entry JSON text).
pub async fn find(store: &RedisStore, job: &str, id: &str) -> Result<(String, u32, String), ReviewError> {
    let spec = job_spec(store, job).await?;
    let mut found: Vec<(String, u32, String)> = Vec::new();
    for p in 0..spec.job.partitions {
        store
            .scan_hash(&keys::review(job, p), |rid, json| {
                let key_matches = serde_json::from_str::<Value>(&json).is_ok_and(|e| e["key"] == id);
                if rid == id || (id.len() >= 8 && rid.starts_with(id)) || key_matches {
                    found.push((rid, p, json));
                }
            })
            .await?;
    }
    match found.len() {
        1 => Ok(found.remove(0)),
        0 => Err(ReviewError::NotFound(format!(
            "no review entry for `{id}` in job `{job}`"
        ))),
        n => Err(ReviewError::NotFound(format!(
            "`{id}` matches {n} review entries: give more of the record id"
        ))),
    }
}

/// Accepts a person's output for a record: validated like a model output,
/// then committed as the record's result, marked human-provided.
pub async fn accept(
    store: &RedisStore,
    job: &str,
    id: &str,
    output: &str,
    reviewer: &str,
) -> Result<String, ReviewError> {
    let spec = job_spec(store, job).await?;
    let (rid, p, seen) = find(store, job, id).await?;
    let entry: Value = serde_json::from_str(&seen).unwrap_or(Value::Null);
    let (mut out, repairs) = match validate(&spec, output) {
        Validation::Valid { output, repairs } => (output, repairs),
        Validation::Invalid { errors, .. } => {
            return Err(ReviewError::Invalid(
                errors.iter().map(|e| format!("  - {e}")).collect(),
            ));
        }
    };
    out.insert("record_id".into(), json!(rid));
    out.insert("_model".into(), json!(spec.provider.model));
    let now = now_rfc3339();
    let result = json!({
        "record_id": rid,
        "key": entry["key"],
        "output": out,
        "attempts": entry["attempts"],
        "repairs": repairs,
        "history": entry["history"],
        "model": spec.provider.model,
        "versions": common::spec::versions_map(&spec),
        "human": true,
        "reviewer": reviewer,
        "committed_at": now,
    });
    let action = ReviewAction::Accept {
        result: result.to_string(),
    };
    apply(
        store,
        job,
        &rid,
        p,
        &seen,
        &entry,
        json!({"action": "accept", "by": reviewer, "at": now}),
        &action,
    )
    .await?;
    Ok(rid)
}

/// Puts a record back on the stream for a fresh round of attempts (the
/// attempt count goes on); the note and the earlier attempts stay in its history.
pub async fn requeue(
    store: &RedisStore,
    job: &str,
    id: &str,
    note: Option<&str>,
    reviewer: &str,
) -> Result<String, ReviewError> {
    let (rid, p, seen) = find(store, job, id).await?;
    let entry: Value = serde_json::from_str(&seen).unwrap_or(Value::Null);
    let now = now_rfc3339();
    let act = json!({"action": "requeue", "by": reviewer, "at": now, "note": note});
    let mut history = entry["history"].as_array().cloned().unwrap_or_default();
    history.push(act.clone());
    let action = ReviewAction::Requeue {
        input: entry["input"].to_string(),
        attempts: entry["attempts"].as_u64().unwrap_or(0) as u32,
        calls: entry["history"].as_array().map_or(0, |h| h.len() as u32),
        history: Value::Array(history).to_string(),
    };
    apply(store, job, &rid, p, &seen, &entry, act, &action).await?;
    Ok(rid)
}

/// Rejects a record: terminal (`dropped:rejected`), kept in the archive.
pub async fn reject(
    store: &RedisStore,
    job: &str,
    id: &str,
    reason: &str,
    reviewer: &str,
) -> Result<String, ReviewError> {
    let (rid, p, seen) = find(store, job, id).await?;
    let entry: Value = serde_json::from_str(&seen).unwrap_or(Value::Null);
    let act = json!({"action": "reject", "by": reviewer, "at": now_rfc3339(), "reason": reason});
    let action = ReviewAction::Reject {
        reason: reason.to_owned(),
    };
    apply(store, job, &rid, p, &seen, &entry, act, &action).await?;
    Ok(rid)
}

#[allow(clippy::too_many_arguments)]
async fn apply(
    store: &RedisStore,
    job: &str,
    rid: &str,
    p: u32,
    seen: &str,
    entry: &Value,
    act: Value,
    action: &ReviewAction,
) -> Result<(), ReviewError> {
    let mut archived = entry.clone();
    if let Some(actions) = archived.get_mut("actions").and_then(Value::as_array_mut) {
        actions.push(act);
    } else {
        archived["actions"] = json!([act]);
    }
    match store
        .review_act(job, p, rid, seen, &archived.to_string(), action)
        .await?
    {
        ReviewOutcome::Applied => Ok(()),
        ReviewOutcome::Lost => Err(ReviewError::Lost(rid.to_owned())),
        ReviewOutcome::AlreadyDone => Err(ReviewError::AlreadyDone(rid.to_owned())),
    }
}

/// The text a person edits with `--edit`: the last output, pretty when JSON.
pub fn editable(entry: &Value) -> String {
    let raw = entry["last_raw_output"].as_str().unwrap_or("");
    serde_json::from_str::<Value>(raw)
        .ok()
        .and_then(|v| serde_json::to_string_pretty(&v).ok())
        .unwrap_or_else(|| raw.to_owned())
}

/// Opens `$EDITOR` (default `vi`) on `text` and returns what was saved.
pub fn edit_in_editor(text: &str, dir: &Path) -> Result<String, ReviewError> {
    let path = dir.join(format!("batchfleet-review-{}.json", std::process::id()));
    std::fs::write(&path, text).map_err(|e| ReviewError::Io(format!("cannot write {}: {e}", path.display())))?;
    let editor = std::env::var("EDITOR").unwrap_or_else(|_| "vi".into());
    let status = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{editor} \"$1\""))
        .arg("sh")
        .arg(&path)
        .status()
        .map_err(|e| ReviewError::Io(format!("cannot run $EDITOR ({editor}): {e}")))?;
    let edited = std::fs::read_to_string(&path).map_err(|e| ReviewError::Io(e.to_string()));
    let _ = std::fs::remove_file(&path);
    if !status.success() {
        return Err(ReviewError::Io(format!(
            "$EDITOR ({editor}) exited with {status}: nothing was done"
        )));
    }
    edited
}

//! `producer retry --from review|dropped|missing`: a new round of attempts for
//! a set of records, keeping their record ids and counting attempts on.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use common::keys;
use common::store::{RedisStore, ReviewAction, ReviewOutcome};
use serde::Serialize;
use serde_json::{Value, json};

use crate::reader::{LineReader, file_sha256};
use crate::reconcile::reconcile;
use crate::review::{ReviewError, job_spec};

/// Which set a new round is built from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum From {
    /// Every record in review.
    Review,
    /// Records rejected by a reviewer (input errors cannot be retried: fix the data).
    Dropped,
    /// Records reconciliation finds missing; their input is read back from the
    /// dataset they were enqueued from.
    Missing,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct RetrySummary {
    pub requeued: u64,
    /// Records that could not be retried, by reason.
    pub skipped: BTreeMap<String, u64>,
}

impl RetrySummary {
    fn skip(&mut self, why: &str) {
        *self.skipped.entry(why.to_owned()).or_default() += 1;
    }
}

pub async fn retry(store: &RedisStore, job: &str, from: From, who: &str) -> Result<RetrySummary, ReviewError> {
    let spec = job_spec(store, job).await?;
    let mut out = RetrySummary::default();
    let mark = json!({"action": "retry", "by": who, "at": common::manifest::now_rfc3339()});
    match from {
        From::Review => {
            for p in 0..spec.job.partitions {
                let mut entries = Vec::new();
                store
                    .scan_hash(&keys::review(job, p), |rid, json| entries.push((rid, json)))
                    .await?;
                for (rid, seen) in entries {
                    let entry: Value = serde_json::from_str(&seen).unwrap_or(Value::Null);
                    let mut history = entry["history"].as_array().cloned().unwrap_or_default();
                    history.push(mark.clone());
                    let mut archived = entry.clone();
                    archived["actions"] = json!([mark.clone()]);
                    let action = ReviewAction::Requeue {
                        input: entry["input"].to_string(),
                        attempts: entry["attempts"].as_u64().unwrap_or(0) as u32,
                        calls: calls_of(&entry["history"]),
                        history: Value::Array(history).to_string(),
                    };
                    match store
                        .review_act(job, p, &rid, &seen, &archived.to_string(), &action)
                        .await?
                    {
                        ReviewOutcome::Applied => out.requeued += 1,
                        _ => out.skip("changed meanwhile"),
                    }
                }
            }
        }
        From::Dropped => {
            for p in 0..spec.job.partitions {
                let mut dropped = Vec::new();
                store
                    .scan_hash(&keys::state(job, p), |rid, state| {
                        if let Some(reason) = state.strip_prefix("dropped:") {
                            dropped.push((rid, reason.to_owned()));
                        }
                    })
                    .await?;
                for (rid, reason) in dropped {
                    if reason != "rejected" {
                        out.skip(&format!("{reason} (an input error: fix the data and enqueue again)"));
                        continue;
                    }
                    let archived = store.archived_review(job, p, &rid).await?;
                    let Some(entry) = archived.and_then(|a| serde_json::from_str::<Value>(&a).ok()) else {
                        out.skip("rejected, but its review entry is gone");
                        continue;
                    };
                    let mut history = entry["history"].as_array().cloned().unwrap_or_default();
                    history.push(mark.clone());
                    let requeued = store
                        .retry_record(
                            job,
                            p,
                            &rid,
                            "dropped:rejected",
                            &entry["input"].to_string(),
                            entry["attempts"].as_u64().unwrap_or(0) as u32,
                            calls_of(&entry["history"]),
                            &Value::Array(history).to_string(),
                        )
                        .await?;
                    if requeued {
                        out.requeued += 1;
                    } else {
                        out.skip("changed meanwhile");
                    }
                }
            }
        }
        From::Missing => retry_missing(store, job, spec.job.partitions, &mark, &mut out).await?,
    }
    Ok(out)
}

fn calls_of(history: &Value) -> u32 {
    history
        .as_array()
        .map_or(0, |h| h.iter().filter(|x| x.get("call").is_some()).count() as u32)
}

/// A missing record to rebuild: record id, partition, the state it was seen in.
type Wanted = (String, u32, String);

/// Missing records: their task is gone, so their input is read back from the
/// dataset line their idempotency key points at (`<sha12>:<line>`), after
/// checking the file still has the sha256 the manifest recorded.
async fn retry_missing(
    store: &RedisStore,
    job: &str,
    partitions: u32,
    mark: &Value,
    out: &mut RetrySummary,
) -> Result<(), ReviewError> {
    let r = reconcile(store, job, partitions).await?;
    let manifest = store.load_manifest(job).await?;
    let datasets: HashMap<String, (String, String)> = manifest
        .map(|m| {
            m.datasets
                .into_iter()
                .map(|d| {
                    (
                        d.dataset.short().to_owned(),
                        (d.dataset.path.clone(), d.dataset.sha256.clone()),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let mut wanted: HashMap<String, BTreeMap<u64, Vec<Wanted>>> = HashMap::new();
    for a in &r.missing {
        let state = a.what.split('`').nth(1).unwrap_or("").to_owned();
        match store.record_origin(job, a.partition, &a.record_id).await? {
            Some(origin) => {
                let Some((short, line)) = origin.split_once(':') else {
                    out.skip("origin unreadable");
                    continue;
                };
                let Ok(line) = line.parse::<u64>() else {
                    out.skip("origin unreadable");
                    continue;
                };
                wanted
                    .entry(short.to_owned())
                    .or_default()
                    .entry(line)
                    .or_default()
                    .push((a.record_id.clone(), a.partition, state));
            }
            None => out.skip("its idempotency key expired: its dataset line is unknown"),
        }
    }
    for (short, lines) in wanted {
        let n: u64 = lines.values().map(|v| v.len() as u64).sum();
        let Some((path, sha)) = datasets.get(&short) else {
            (0..n).for_each(|_| out.skip("its dataset is not in the manifest"));
            continue;
        };
        let path = Path::new(path);
        match file_sha256(path) {
            Ok((actual, _)) if &actual == sha => {}
            _ => {
                (0..n).for_each(|_| out.skip("its dataset file is gone or changed"));
                continue;
            }
        }
        let mut reader = LineReader::open(path, 0, 0, usize::MAX / 2).map_err(|e| ReviewError::Io(e.to_string()))?;
        let mut buf = Vec::new();
        while let Some(pos) = reader.next_line(&mut buf).map_err(|e| ReviewError::Io(e.to_string()))? {
            let Some(records) = lines.get(&pos.number) else {
                continue;
            };
            let text = String::from_utf8_lossy(buf.strip_suffix(b"\r").unwrap_or(&buf)).into_owned();
            let text = text.trim_start_matches('\u{feff}');
            let Ok(input) = serde_json::from_str::<Value>(text) else {
                records
                    .iter()
                    .for_each(|_| out.skip("its dataset line no longer parses"));
                continue;
            };
            for (rid, p, state) in records {
                let history = json!([mark]).to_string();
                if store
                    .retry_record(job, *p, rid, state, &input.to_string(), 0, 0, &history)
                    .await?
                {
                    out.requeued += 1;
                } else {
                    out.skip("changed meanwhile");
                }
            }
        }
    }
    Ok(())
}

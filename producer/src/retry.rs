//! `producer retry --from review|dropped|missing`: a new round of attempts for
//! a set of records, keeping their record ids and counting attempts on.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use common::store::{RedisStore, ReviewAction, ReviewOutcome};
use common::task::{Action, RecordState, Task};
use serde::Serialize;
use serde_json::Value;

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
    let mark = Action::new("retry", who);
    match from {
        From::Review => {
            for p in 0..spec.job.partitions {
                let mut entries = Vec::new();
                store.review_entries(job, p, |e| entries.push(e)).await?;
                for entry in entries {
                    let task = entry.requeue(&mark);
                    let archived = entry.archived(mark.clone());
                    match store
                        .review_act(job, p, &entry, &archived, &ReviewAction::Requeue(task))
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
                    .record_states(job, p, |rid, state| {
                        if let Some(RecordState::Dropped(reason)) = state {
                            dropped.push((rid, reason));
                        }
                    })
                    .await?;
                for (rid, reason) in dropped {
                    if reason != RecordState::REJECTED {
                        out.skip(&format!("{reason} (an input error: fix the data and enqueue again)"));
                        continue;
                    }
                    let Some(entry) = store.archived_review(job, p, &rid).await.ok().flatten() else {
                        out.skip("rejected, but its review entry is gone");
                        continue;
                    };
                    let expected = RecordState::Dropped(RecordState::REJECTED.into());
                    if store.retry_record(job, p, &expected, &entry.requeue(&mark)).await? {
                        out.requeued += 1;
                    } else {
                        out.skip("changed meanwhile");
                    }
                }
            }
        }
        From::Missing => {
            let sink = spec.sink.kind != common::spec::SinkKind::None;
            retry_missing(store, job, spec.job.partitions, sink, &mut out, &mark).await?
        }
    }
    Ok(out)
}

/// Missing records: their task is gone, so their input is read back from the
/// dataset line their origin points at (see [`dataset_inputs`]).
async fn retry_missing(
    store: &RedisStore,
    job: &str,
    partitions: u32,
    sink: bool,
    out: &mut RetrySummary,
    mark: &Action,
) -> Result<(), ReviewError> {
    let r = reconcile(store, job, partitions, sink).await?;
    let mut wanted = Vec::new();
    let mut states = HashMap::new();
    for a in &r.missing {
        let Some(state) = a.state.clone() else {
            out.skip("its state is unreadable");
            continue;
        };
        wanted.push((a.record_id.clone(), a.partition));
        states.insert(a.record_id.clone(), (a.partition, state));
    }
    let (inputs, skipped) = dataset_inputs(store, job, &wanted).await?;
    for (why, n) in skipped {
        *out.skipped.entry(why).or_default() += n;
    }
    for (rid, input) in inputs {
        let Some((p, state)) = states.get(&rid) else { continue };
        let Ok(mut task) = Task::new(&rid, &input, "") else {
            out.skip("its dataset line no longer parses");
            continue;
        };
        task.history.push(common::task::HistoryItem::Action(mark.clone()));
        if store.retry_record(job, *p, state, &task).await? {
            out.requeued += 1;
        } else {
            out.skip("changed meanwhile");
        }
    }
    Ok(())
}

/// The inputs of records read back from the dataset lines their origins
/// point at (`<dataset tag>:<line>`, or `<sha12>:<line>` from an earlier
/// version), after checking each file still has the sha256 the manifest
/// recorded: record id -> the line's JSON, and the records not found, by why.
pub async fn dataset_inputs(
    store: &RedisStore,
    job: &str,
    wanted: &[(String, u32)],
) -> Result<(HashMap<String, String>, BTreeMap<String, u64>), ReviewError> {
    let mut found = HashMap::new();
    let mut skipped: BTreeMap<String, u64> = BTreeMap::new();
    let mut skip = |why: &str, n: u64| *skipped.entry(why.to_owned()).or_default() += n;
    let manifest = store.load_manifest(job).await?;
    // Each dataset by its tag and by its sha12 (origins of earlier versions).
    let datasets: HashMap<String, (String, String)> = manifest
        .map(|m| {
            m.datasets
                .into_iter()
                .flat_map(|d| {
                    let file = (d.dataset.path.clone(), d.dataset.sha256.clone());
                    let by_tag = d.tag.map(|t| (t.to_string(), file.clone()));
                    std::iter::once((d.dataset.short().to_owned(), file)).chain(by_tag)
                })
                .collect()
        })
        .unwrap_or_default();
    let mut lines_of: HashMap<String, BTreeMap<u64, Vec<String>>> = HashMap::new();
    for (rid, p) in wanted {
        let origin = store.record_origin(job, *p, rid).await?;
        let Some(origin) = origin else {
            skip("its idempotency key expired: its dataset line is unknown", 1);
            continue;
        };
        let Some((short, line)) = origin
            .split_once(':')
            .and_then(|(s, l)| Some((s, l.parse::<u64>().ok()?)))
        else {
            skip("origin unreadable", 1);
            continue;
        };
        lines_of
            .entry(short.to_owned())
            .or_default()
            .entry(line)
            .or_default()
            .push(rid.clone());
    }
    for (short, lines) in lines_of {
        let n: u64 = lines.values().map(|v| v.len() as u64).sum();
        let Some((path, sha)) = datasets.get(&short) else {
            skip("its dataset is not in the manifest", n);
            continue;
        };
        let path = Path::new(path);
        match file_sha256(path) {
            Ok((actual, _)) if &actual == sha => {}
            _ => {
                skip("its dataset file is gone or changed", n);
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
            match serde_json::from_str::<Value>(text) {
                Ok(input) => {
                    for rid in records {
                        found.insert(rid.clone(), input.to_string());
                    }
                }
                Err(_) => skip("its dataset line no longer parses", records.len() as u64),
            }
        }
    }
    Ok((found, skipped))
}

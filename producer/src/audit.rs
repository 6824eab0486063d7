//! Spot checks (see [`common::audit`]): `producer audit --sample N` puts a
//! seeded sample of a job's committed results in its audit queue; people
//! judge them (in the console), and a wrong one is corrected as an explicit
//! revision of the result; the verdicts estimate the job's accuracy.

use std::collections::{BTreeMap, HashSet};

use common::audit::Verdict;
use common::record::partition_of;
use common::spec::{FieldType, JobSpec, SinkKind, audit_draw};
use common::store::RedisStore;
use common::task::{RecordState, ResultRecord};
use serde::Serialize;
use serde_json::Value;

use crate::review::{ReviewError, job_spec};

/// What `producer audit --sample N` did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SampleSummary {
    /// Records that joined the audit queue now.
    pub sampled: u64,
    /// Records waiting for a spot check, these included.
    pub waiting: u64,
    /// Done records of the job.
    pub done: u64,
    /// Records that could not be sampled, by why (their input is unknown).
    pub skipped: BTreeMap<String, u64>,
}

/// Puts `n` more done records of a job in its audit queue: those ranked
/// first by `sha256(seed, record id)` among the ones not waiting or judged
/// already (the same job and seed always give the same ones). A result
/// that does not carry its input (a job without a sink) gets it from its
/// dataset line.
pub async fn sample(store: &RedisStore, job: &str, n: u64, seed: u64) -> Result<SampleSummary, ReviewError> {
    let spec = job_spec(store, job).await?;
    let partitions = spec.job.partitions;
    let mut ranked: Vec<(f64, String, u32)> = Vec::new();
    for p in 0..partitions {
        store
            .record_states(job, p, |rid, state| {
                if state == Some(RecordState::Done) {
                    ranked.push((audit_draw(seed, &rid), rid, p));
                }
            })
            .await?;
    }
    ranked.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut out = SampleSummary {
        done: ranked.len() as u64,
        ..SampleSummary::default()
    };
    let with_input = spec.sink.kind != SinkKind::None;
    let mut next = ranked.into_iter().map(|(_, rid, p)| (rid, p));
    while out.sampled < n {
        let chunk: Vec<(String, u32)> = next.by_ref().take((n - out.sampled) as usize).collect();
        if chunk.is_empty() {
            break;
        }
        let mut inputs = std::collections::HashMap::new();
        if !with_input {
            let (found, skipped) = crate::retry::dataset_inputs(store, job, &chunk).await?;
            for (why, k) in skipped {
                *out.skipped.entry(why).or_default() += k;
            }
            inputs = found;
        }
        let mut by_partition: BTreeMap<u32, Vec<(String, String)>> = BTreeMap::new();
        for (rid, p) in chunk {
            let input = match inputs.remove(&rid) {
                Some(text) => text,
                None if with_input => String::new(),
                None => continue,
            };
            by_partition.entry(p).or_default().push((rid, input));
        }
        for (p, items) in by_partition {
            out.sampled += store.audit_sample(job, p, &items).await?;
        }
    }
    out.waiting = store.audit_waiting(job, partitions).await?;
    Ok(out)
}

/// A done record's result as it is now (its latest revision's output),
/// wherever it is: in Redis, or in the sink once it left.
pub async fn current_result(
    store: &RedisStore,
    spec: &JobSpec,
    job: &str,
    rid: &str,
) -> Result<Option<ResultRecord>, ReviewError> {
    let p = partition_of(rid, spec.job.partitions);
    if let Some(text) = store.result_text(job, p, rid).await? {
        return ResultRecord::decode(&text)
            .map(Some)
            .map_err(|e| ReviewError::Io(e.to_string()));
    }
    let io = |e: common::sink::SinkError| ReviewError::Io(e.to_string());
    match spec.sink.kind {
        SinkKind::None => Ok(None),
        SinkKind::Files => {
            let dir = std::path::PathBuf::from(spec.sink.dir.clone().unwrap_or_default());
            let Some(w) = common::sink::files::find_written(&dir, job, rid).map_err(io)? else {
                return Ok(None);
            };
            let mut r = w.result.clone();
            if let Value::Object(o) = w.current(&dir, job).map_err(io)? {
                r.output = o;
            }
            Ok(Some(r))
        }
        SinkKind::Postgres => {
            let context = format!("record {rid}'s result is in PostgreSQL");
            let db = crate::sink::connect(spec, &context, "to read it")
                .await
                .map_err(|e| ReviewError::Io(e.to_string()))?;
            db.result(job, rid).await.map_err(io)
        }
    }
}

/// The values of an output's enum fields: the accuracy per label is read
/// from these.
pub fn labels(spec: &JobSpec, output: &serde_json::Map<String, Value>) -> BTreeMap<String, String> {
    spec.output
        .fields
        .iter()
        .filter(|(_, f)| f.kind == FieldType::String && f.enum_values.is_some())
        .filter_map(|(name, _)| Some((name.clone(), output.get(name.as_str())?.as_str()?.to_owned())))
        .collect()
}

/// What judging a record came to.
#[derive(Debug)]
pub enum Judged {
    /// Recorded (with the correcting revision's number, for an incorrect result).
    Recorded(Option<u32>),
    /// Someone judged it first (or it was never sampled): their verdict.
    Already(Option<Verdict>),
}

/// A person's verdict on a sampled result: correct, or incorrect with the
/// output it should have had (validated like a reviewer's accept, kept as a
/// revision of the result, the one it replaces kept too).
pub async fn judge(
    store: &RedisStore,
    spec: &JobSpec,
    job: &str,
    rid: &str,
    corrected: Option<&str>,
    note: Option<&str>,
    reviewer: &str,
) -> Result<Judged, ReviewError> {
    let p = partition_of(rid, spec.job.partitions);
    if store.audit_item(job, p, rid).await?.is_none() {
        return Ok(Judged::Already(store.audit_verdict(job, p, rid).await?));
    }
    let Some(current) = current_result(store, spec, job, rid).await? else {
        return Err(ReviewError::NotFound(format!("record {rid} has no result to judge")));
    };
    let revision = match corrected {
        Some(output) => Some(crate::review::revise(store, job, rid, output, note, reviewer).await?.1),
        None => None,
    };
    let verdict = Verdict {
        correct: corrected.is_none(),
        by: reviewer.to_owned(),
        at: common::manifest::now_rfc3339(),
        labels: labels(spec, &current.output),
        revision,
        note: note.map(str::to_owned),
    };
    if store.audit_judge(job, p, rid, &verdict).await? {
        Ok(Judged::Recorded(revision))
    } else {
        Ok(Judged::Already(store.audit_verdict(job, p, rid).await?))
    }
}

/// The records this reviewer skipped are passed by; the next one waiting.
pub async fn next_waiting(
    store: &RedisStore,
    job: &str,
    partitions: u32,
    skipped: &HashSet<String>,
) -> Result<Option<common::store::AuditItem>, ReviewError> {
    Ok(store.audit_next(job, partitions, skipped).await?)
}

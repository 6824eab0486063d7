//! Reconciliation: proves from the data in Redis (never from counters) that
//! every record of a job is in exactly one place, and names the ones that are
//! not: `missing` (a record whose task, retry, result or review entry is gone),
//! `duplicates` (a record in two places, or twice in one), `unknown` (a task,
//! retry, result, review entry or cancelled task for a record the job does not know).
//!
//! One partition is held in memory at a time. While workers run, records move
//! between places; a suspect is only reported if a second pass finds it again.

use std::collections::HashMap;

use common::store::{RecordSet, RedisStore, StoreError};
use common::task::RecordState;
use serde::Serialize;

/// One anomaly: which record, in which partition, and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Anomaly {
    pub record_id: String,
    pub partition: u32,
    pub what: String,
    /// The record's state when it was found (None: not known to the job).
    #[serde(skip)]
    pub state: Option<RecordState>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Reconciliation {
    pub missing: Vec<Anomaly>,
    pub duplicates: Vec<Anomaly>,
    pub unknown: Vec<Anomaly>,
}

impl Reconciliation {
    pub fn is_clean(&self) -> bool {
        self.missing.is_empty() && self.duplicates.is_empty() && self.unknown.is_empty()
    }
}

/// Where one record was found, within one partition.
#[derive(Default)]
struct Seen {
    /// None: not in the job's records; Some(None): a state value no version writes.
    state: Option<Option<RecordState>>,
    in_stream: u32,
    delayed: u32,
    result: bool,
    review: bool,
    cancelled: bool,
}

/// Reconciles every partition; anomalies found twice in a row are reported.
/// With `sink`, a done record's result may have left Redis for the sink
/// (proved there: `status --require-complete` checks the sink's own data).
pub async fn reconcile(
    store: &RedisStore,
    job: &str,
    partitions: u32,
    sink: bool,
) -> Result<Reconciliation, StoreError> {
    let mut out = Reconciliation::default();
    for p in 0..partitions {
        let first = reconcile_partition(store, job, p, sink).await?;
        if first.is_clean() {
            continue;
        }
        let second = reconcile_partition(store, job, p, sink).await?;
        let keep = |a: Vec<Anomaly>, b: &[Anomaly]| a.into_iter().filter(|x| b.contains(x)).collect::<Vec<_>>();
        out.missing.extend(keep(first.missing, &second.missing));
        out.duplicates.extend(keep(first.duplicates, &second.duplicates));
        out.unknown.extend(keep(first.unknown, &second.unknown));
    }
    Ok(out)
}

async fn reconcile_partition(store: &RedisStore, job: &str, p: u32, sink: bool) -> Result<Reconciliation, StoreError> {
    let mut seen: HashMap<String, Seen> = HashMap::new();
    store
        .record_states(job, p, |rid, state| seen.entry(rid).or_default().state = Some(state))
        .await?;
    store
        .scan_stream_rids(job, p, |rid| seen.entry(rid).or_default().in_stream += 1)
        .await?;
    store
        .record_ids(job, p, RecordSet::Delayed, |rid| {
            seen.entry(rid).or_default().delayed += 1
        })
        .await?;
    store
        .record_ids(job, p, RecordSet::Results, |rid| {
            seen.entry(rid).or_default().result = true
        })
        .await?;
    store
        .record_ids(job, p, RecordSet::Review, |rid| {
            seen.entry(rid).or_default().review = true
        })
        .await?;
    store
        .record_ids(job, p, RecordSet::Cancelled, |rid| {
            seen.entry(rid).or_default().cancelled = true
        })
        .await?;

    let mut out = Reconciliation::default();
    for (rid, s) in seen {
        let known = s.state.clone().flatten();
        let report = |list: &mut Vec<Anomaly>, what: &str| {
            list.push(Anomaly {
                record_id: rid.clone(),
                partition: p,
                what: what.to_owned(),
                state: known.clone(),
            })
        };
        let places = u32::from(s.in_stream > 0)
            + u32::from(s.delayed > 0)
            + u32::from(s.result)
            + u32::from(s.review)
            + u32::from(s.cancelled);
        let Some(state) = s.state.clone() else {
            report(
                &mut out.unknown,
                "not in the job's records, but has a task, retry, result or review entry",
            );
            continue;
        };
        if s.in_stream > 1 || s.delayed > 1 || places > 1 {
            report(&mut out.duplicates, &describe(&s));
            continue;
        }
        let ok = match &state {
            Some(RecordState::Queued) => s.in_stream == 1,
            Some(RecordState::Delayed) => s.delayed == 1,
            Some(RecordState::Done) => (s.result || sink) && places == u32::from(s.result),
            Some(RecordState::Review) => s.review && places == 1,
            Some(RecordState::Cancelled) => s.cancelled && places == 1,
            Some(RecordState::Dropped(_)) => places == 0,
            None => false,
        };
        let state = state.map_or_else(|| "?".to_owned(), |st| st.encode().into_owned());
        if ok {
            continue;
        }
        if places == 0 {
            report(&mut out.missing, &format!("state `{state}` but {}", describe(&s)));
        } else {
            report(&mut out.duplicates, &format!("state `{state}` but {}", describe(&s)));
        }
    }
    out.missing.sort();
    out.duplicates.sort();
    out.unknown.sort();
    Ok(out)
}

fn describe(s: &Seen) -> String {
    let mut parts = Vec::new();
    if s.in_stream > 0 {
        parts.push(format!("{} task(s) in the stream", s.in_stream));
    }
    if s.delayed > 0 {
        parts.push(format!("{} waiting retr(ies)", s.delayed));
    }
    if s.result {
        parts.push("a result".to_owned());
    }
    if s.review {
        parts.push("a review entry".to_owned());
    }
    if s.cancelled {
        parts.push("a cancelled task".to_owned());
    }
    if parts.is_empty() {
        "found nowhere (no task, retry, result or review entry)".to_owned()
    } else {
        format!("found as {}", parts.join(" and "))
    }
}

//! Reconciliation: proves from the data in Redis (never from counters) that
//! every record of a job is in exactly one place, and names the ones that are
//! not: `missing` (a record whose task, retry, result or review entry is gone),
//! `duplicates` (a record in two places, or twice in one), `unknown` (a task,
//! retry, result, review entry or cancelled task for a record the job does not know).
//!
//! One partition at a time, and of it only the records somewhere other than
//! the state hash are held in memory (those in flight, and the results still
//! in Redis: with a sink only those not yet in it); the states stream past
//! them. While workers run, records move between places; a suspect is
//! only reported if a second pass finds it again.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use common::ids::id_bytes;
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

/// Where one record was found, within one partition: 6 bytes, so that a
/// partition of a million records is held in a few tens of MiB.
#[derive(Default, Clone, Copy)]
struct Seen {
    state: Known,
    in_stream: u8,
    delayed: u8,
    /// Held by provider batch shards (batch mode).
    batched: u8,
    result: bool,
    review: bool,
    cancelled: bool,
}

/// A record's state as the reconciliation needs it.
#[derive(Default, Clone, Copy, PartialEq, Eq)]
enum Known {
    /// Not in the job's records.
    #[default]
    No,
    /// A state value no version writes.
    Unreadable,
    Queued,
    Delayed,
    Batched,
    Done,
    Review,
    Cancelled,
    Dropped,
}

impl Known {
    fn of(state: &Option<RecordState>) -> Known {
        match state {
            None => Known::Unreadable,
            Some(RecordState::Queued) => Known::Queued,
            Some(RecordState::Delayed) => Known::Delayed,
            Some(RecordState::Batched) => Known::Batched,
            Some(RecordState::Done) => Known::Done,
            Some(RecordState::Review) => Known::Review,
            Some(RecordState::Cancelled) => Known::Cancelled,
            Some(RecordState::Dropped(_)) => Known::Dropped,
        }
    }
}

/// A partition's records by id: 32 bytes for the 64 hex digits every record
/// id is, the text for anything else found in Redis.
#[derive(Default)]
struct Partition {
    ids: HashMap<[u8; 32], Seen, BuildHasherDefault<IdHasher>>,
    other: HashMap<String, Seen>,
}

impl Partition {
    fn at(&mut self, rid: String) -> &mut Seen {
        match id_bytes(rid.as_bytes()) {
            Some(b) => self.ids.entry(b).or_default(),
            None => self.other.entry(rid).or_default(),
        }
    }

    fn get_mut(&mut self, rid: &str) -> Option<&mut Seen> {
        match id_bytes(rid.as_bytes()) {
            Some(b) => self.ids.get_mut(&b),
            None => self.other.get_mut(rid),
        }
    }
}

/// Hashes a record id's bytes by their first eight: ids are sha256 digests,
/// already uniform (SipHash over all 32 was the reconciliation's largest
/// cost). An id made to collide only slows its own partition's check.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut head = [0u8; 8];
        let n = bytes.len().min(8);
        head[..n].copy_from_slice(&bytes[..n]);
        self.0 ^= u64::from_le_bytes(head);
    }

    /// The length prefix a slice hashes first says nothing (always 32).
    fn write_usize(&mut self, _: usize) {}

    fn finish(&self) -> u64 {
        self.0
    }
}

/// What the records' states add up to, counted in the reconciliation's own
/// pass over them (`status` reads them once).
#[derive(Debug, Clone, Default)]
pub struct Tally {
    pub known: u64,
    pub queued: u64,
    pub delayed: u64,
    /// Held by provider batch shards.
    pub batched: u64,
    pub done: u64,
    pub review: u64,
    pub cancelled: u64,
    pub dropped: u64,
    pub dropped_by_reason: std::collections::BTreeMap<String, u64>,
    /// The done records' ids, when asked for.
    pub done_ids: Option<common::ids::RecordIds>,
}

impl Tally {
    fn add(&mut self, rid: &str, state: &Option<RecordState>) {
        self.known += 1;
        match state {
            Some(RecordState::Queued) => self.queued += 1,
            Some(RecordState::Delayed) => self.delayed += 1,
            Some(RecordState::Batched) => self.batched += 1,
            Some(RecordState::Done) => {
                self.done += 1;
                if let Some(ids) = &mut self.done_ids {
                    ids.push(rid);
                }
            }
            Some(RecordState::Review) => self.review += 1,
            Some(RecordState::Cancelled) => self.cancelled += 1,
            Some(RecordState::Dropped(reason)) => {
                self.dropped += 1;
                *self.dropped_by_reason.entry(reason.clone()).or_default() += 1;
            }
            None => {}
        }
    }
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
    reconcile_counting(store, job, partitions, sink, None).await
}

/// [`reconcile`], counting the states into `tally` on the way.
pub async fn reconcile_counting(
    store: &RedisStore,
    job: &str,
    partitions: u32,
    sink: bool,
    mut tally: Option<&mut Tally>,
) -> Result<Reconciliation, StoreError> {
    let mut out = Reconciliation::default();
    for p in 0..partitions {
        let first = reconcile_partition(store, job, p, sink, tally.as_deref_mut()).await?;
        if first.is_clean() {
            continue;
        }
        let second = reconcile_partition(store, job, p, sink, None).await?;
        let keep = |a: Vec<Anomaly>, b: &[Anomaly]| a.into_iter().filter(|x| b.contains(x)).collect::<Vec<_>>();
        out.missing.extend(keep(first.missing, &second.missing));
        out.duplicates.extend(keep(first.duplicates, &second.duplicates));
        out.unknown.extend(keep(first.unknown, &second.unknown));
    }
    Ok(out)
}

async fn reconcile_partition(
    store: &RedisStore,
    job: &str,
    p: u32,
    sink: bool,
    tally: Option<&mut Tally>,
) -> Result<Reconciliation, StoreError> {
    let found = suspects(store, job, p, sink, tally).await?;
    // Only the few records found wrong are described, their state read again.
    let mut out = Reconciliation::default();
    for (rid, s, f) in found {
        let state = match s.state {
            Known::No => None,
            _ => store.record_state(job, p, &rid).await?,
        };
        let shown = state
            .as_ref()
            .map_or_else(|| "?".to_owned(), |st| st.encode().into_owned());
        let (list, what) = match f {
            Finding::Unknown => (
                &mut out.unknown,
                "not in the job's records, but has a task, retry, result or review entry".to_owned(),
            ),
            Finding::Twice => (&mut out.duplicates, describe(&s)),
            Finding::Missing => (&mut out.missing, format!("state `{shown}` but {}", describe(&s))),
            Finding::Misplaced => (&mut out.duplicates, format!("state `{shown}` but {}", describe(&s))),
        };
        list.push(Anomaly {
            record_id: rid,
            partition: p,
            what,
            state,
        });
    }
    // A scan may return a field twice (a hash resized meanwhile): each
    // record is reported once.
    for list in [&mut out.missing, &mut out.duplicates, &mut out.unknown] {
        list.sort();
        list.dedup();
    }
    Ok(out)
}

/// The records of a partition that look wrong. Every place that holds
/// records (stream, retries, shards, results, review, cancelled) is read
/// first, into memory: the records in flight, and (with a sink) the results
/// not yet in it. Then the states are streamed past them (counted into
/// `tally`): a record in no place is judged on its state alone and not held,
/// so ten million finished records whose results are in a sink cost no
/// memory here.
async fn suspects(
    store: &RedisStore,
    job: &str,
    p: u32,
    sink: bool,
    mut tally: Option<&mut Tally>,
) -> Result<Vec<(String, Seen, Finding)>, StoreError> {
    let mut seen = read_places(store, job, p).await?;
    let mut found = Vec::new();
    store
        .record_states(job, p, |rid, state| {
            if let Some(t) = tally.as_deref_mut() {
                t.add(&rid, &state);
            }
            let known = Known::of(&state);
            if let Some(s) = seen.get_mut(&rid) {
                s.state = known;
                return;
            }
            let s = Seen {
                state: known,
                ..Seen::default()
            };
            if let Some(f) = finding(&s, sink) {
                found.push((rid, s, f));
            }
        })
        .await?;
    for (b, s) in seen.ids {
        if let Some(f) = finding(&s, sink) {
            found.push((hex::encode(b), s, f));
        }
    }
    for (rid, s) in seen.other {
        if let Some(f) = finding(&s, sink) {
            found.push((rid, s, f));
        }
    }
    Ok(found)
}

/// Every place that holds a record of a partition, one scan each.
async fn read_places(store: &RedisStore, job: &str, p: u32) -> Result<Partition, StoreError> {
    let mut seen = Partition::default();
    store
        .scan_stream_rids(job, p, |rid| {
            let s = seen.at(rid);
            s.in_stream = s.in_stream.saturating_add(1);
        })
        .await?;
    store
        .record_ids(job, p, RecordSet::Delayed, |rid| {
            let s = seen.at(rid);
            s.delayed = s.delayed.saturating_add(1);
        })
        .await?;
    store
        .shard_rids(job, p, |rid| {
            let s = seen.at(rid);
            s.batched = s.batched.saturating_add(1);
        })
        .await?;
    store
        .record_ids(job, p, RecordSet::Results, |rid| seen.at(rid).result = true)
        .await?;
    store
        .record_ids(job, p, RecordSet::Review, |rid| seen.at(rid).review = true)
        .await?;
    store
        .record_ids(job, p, RecordSet::Cancelled, |rid| seen.at(rid).cancelled = true)
        .await?;
    Ok(seen)
}

/// What is wrong with a record, if anything.
#[derive(Clone, Copy)]
enum Finding {
    /// Not in the job's records, but somewhere.
    Unknown,
    /// In two places, or twice in one.
    Twice,
    /// Its state says where it should be, and it is nowhere.
    Missing,
    /// Somewhere its state does not say.
    Misplaced,
}

fn finding(s: &Seen, sink: bool) -> Option<Finding> {
    let places = u32::from(s.in_stream > 0)
        + u32::from(s.delayed > 0)
        + u32::from(s.batched > 0)
        + u32::from(s.result)
        + u32::from(s.review)
        + u32::from(s.cancelled);
    if s.state == Known::No {
        return Some(Finding::Unknown);
    }
    if s.in_stream > 1 || s.delayed > 1 || s.batched > 1 || places > 1 {
        return Some(Finding::Twice);
    }
    let ok = match s.state {
        Known::Queued => s.in_stream == 1,
        Known::Delayed => s.delayed == 1,
        Known::Batched => s.batched == 1,
        Known::Done => (s.result || sink) && places == u32::from(s.result),
        Known::Review => s.review && places == 1,
        Known::Cancelled => s.cancelled && places == 1,
        Known::Dropped => places == 0,
        Known::Unreadable | Known::No => false,
    };
    match (ok, places) {
        (true, _) => None,
        (false, 0) => Some(Finding::Missing),
        (false, _) => Some(Finding::Misplaced),
    }
}

fn describe(s: &Seen) -> String {
    let mut parts = Vec::new();
    if s.in_stream > 0 {
        parts.push(format!("{} task(s) in the stream", s.in_stream));
    }
    if s.delayed > 0 {
        parts.push(format!("{} waiting retr(ies)", s.delayed));
    }
    if s.batched > 0 {
        parts.push(format!("in {} batch shard(s)", s.batched));
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
        "found nowhere (no task, retry, batch shard, result or review entry)".to_owned()
    } else {
        format!("found as {}", parts.join(" and "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_other_texts_are_counted_apart() {
        let id = "ab".repeat(32);
        let mut p = Partition::default();
        p.at(id.clone()).in_stream += 1;
        p.at(id.clone()).in_stream += 1;
        p.at(id.to_uppercase()).result = true;
        assert_eq!(p.ids.len(), 1);
        assert_eq!(p.ids[&id_bytes(id.as_bytes()).unwrap()].in_stream, 2);
        assert!(p.other[&id.to_uppercase()].result);
    }
}

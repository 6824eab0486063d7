//! The store's sink verbs: take a batch of a partition's sink stream (new
//! entries, or entries a dead writer left pending), read the outcomes and
//! paid calls they name, and acknowledge them once the sink's transaction
//! committed.

use redis::Value;

use super::worker_ops::{as_array, as_string};
use super::{RedisStore, StoreError};
use crate::keys;
use crate::ledger::PaidCall;
use crate::sink::{FailureRow, ResultRow, SinkBatch, SinkEntry, SunkResult, Tokens};
use crate::spec::Prices;
use crate::task::{RecordState, ReviewEntry};

/// What has left Redis for a job's sink.
#[derive(Debug, Clone, Default)]
pub struct Sunk {
    /// Rows that were new in the sink.
    pub written: u64,
    /// Results removed from Redis once the sink held them.
    pub done: u64,
    /// The tokens of their calls.
    pub tokens: Tokens,
    /// Attempts -> results removed that took that many.
    pub attempts_histogram: std::collections::BTreeMap<u64, u64>,
}

/// The entries of a stream reply (`[[id, [field, value...]]...]`).
fn sink_entries(reply: &Value) -> Vec<SinkEntry> {
    let mut out = Vec::new();
    for entry in as_array(reply) {
        let parts = as_array(entry);
        let (Some(id), Some(fields)) = (parts.first().and_then(as_string), parts.get(1)) else {
            continue;
        };
        let fields: Vec<String> = as_array(fields).iter().filter_map(as_string).collect();
        let get = |k: &str| fields.chunks(2).find(|kv| kv[0] == k).and_then(|kv| kv.get(1)).cloned();
        if let Some(rid) = get("rid") {
            let kind = get("k");
            out.push(SinkEntry {
                entry_id: id,
                rid,
                result: kind.as_deref() == Some("r"),
                call: if kind.as_deref() == Some("l") { get("c") } else { None },
            });
        }
    }
    out
}

/// Up to `count` ids pending in a sink stream's group from `start` (an id,
/// `(id` after it, or `-`), only those idle at least `idle_ms` when given.
async fn pending_ids(
    c: &mut super::Conn,
    stream: &str,
    idle_ms: Option<u64>,
    start: &str,
    count: usize,
) -> Result<Vec<String>, StoreError> {
    let mut cmd = redis::cmd("XPENDING");
    cmd.arg(stream).arg(keys::SINK_GROUP);
    if let Some(idle) = idle_ms {
        cmd.arg("IDLE").arg(idle);
    }
    let listed: Value = cmd.arg(start).arg("+").arg(count.max(1)).query_async(c).await?;
    Ok(as_array(&listed)
        .iter()
        .filter_map(|e| as_string(as_array(e).first()?))
        .collect())
}

/// `XCLAIM`s sink entries for `consumer` (the commands the worker's ACL has).
async fn claim(
    c: &mut super::Conn,
    stream: &str,
    consumer: &str,
    min_idle_ms: u64,
    ids: &[String],
) -> Result<Vec<SinkEntry>, StoreError> {
    let mut cmd = redis::cmd("XCLAIM");
    cmd.arg(stream).arg(keys::SINK_GROUP).arg(consumer).arg(min_idle_ms);
    for id in ids {
        cmd.arg(id);
    }
    let claimed: Value = cmd.query_async(c).await?;
    Ok(sink_entries(&claimed))
}

/// `XREADGROUP` of a sink stream from `id` (`>`: new entries; `0`: the
/// consumer's own pending ones).
async fn read_group(
    c: &mut super::Conn,
    stream: &str,
    consumer: &str,
    count: usize,
    id: &str,
) -> Result<Vec<SinkEntry>, StoreError> {
    let reply: Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(keys::SINK_GROUP)
        .arg(consumer)
        .arg("COUNT")
        .arg(count.max(1))
        .arg("STREAMS")
        .arg(stream)
        .arg(id)
        .query_async(c)
        .await?;
    let mut out = Vec::new();
    for s in as_array(&reply) {
        out.extend(sink_entries(as_array(s).get(1).unwrap_or(&Value::Nil)));
    }
    Ok(out)
}

/// The values of `fields` of one hash, in their order.
async fn hmget(c: &mut super::Conn, key: String, fields: &[&str]) -> Result<Vec<Option<String>>, StoreError> {
    Ok(redis::cmd("HMGET").arg(key).arg(fields).query_async(c).await?)
}

impl RedisStore {
    /// Up to `count` entries of a partition's sink stream for `consumer`:
    /// with `own`, the consumer's own pending entries (a batch this worker
    /// read and did not acknowledge before it stopped or was cancelled);
    /// else, with `stale_ms`, first those pending longer than that (their
    /// writer died or hung mid-batch; claimed over), else new ones.
    pub async fn sink_take(
        &self,
        job: &str,
        partition: u32,
        consumer: &str,
        count: usize,
        stale_ms: Option<u64>,
        own: bool,
    ) -> Result<Vec<SinkEntry>, StoreError> {
        let stream = keys::sink(job, partition);
        let mut c = self.conn.clone();
        if own {
            return read_group(&mut c, &stream, consumer, count, "0").await;
        }
        if let Some(stale_ms) = stale_ms {
            let ids = pending_ids(&mut c, &stream, Some(stale_ms), "-", count).await?;
            if !ids.is_empty() {
                return claim(&mut c, &stream, consumer, stale_ms, &ids).await;
            }
        }
        read_group(&mut c, &stream, consumer, count, ">").await
    }

    /// For the files sink, whose writer holds the partition alone: with a
    /// `cursor`, the next entries still pending from before it took the
    /// partition (any consumer's: a previous writer's, or its own earlier
    /// life's), claimed, and the cursor to go on from (None when every one
    /// was taken); without, or when none is left, new entries.
    pub async fn sink_take_held(
        &self,
        job: &str,
        partition: u32,
        consumer: &str,
        count: usize,
        cursor: Option<&str>,
    ) -> Result<(Vec<SinkEntry>, Option<String>), StoreError> {
        let stream = keys::sink(job, partition);
        let mut c = self.conn.clone();
        let Some(cursor) = cursor else {
            return Ok((read_group(&mut c, &stream, consumer, count, ">").await?, None));
        };
        let start = if cursor == "0-0" {
            "-".to_owned()
        } else {
            format!("({cursor}")
        };
        let ids = pending_ids(&mut c, &stream, None, &start, count).await?;
        let next = (ids.len() >= count.max(1)).then(|| ids.last().cloned()).flatten();
        if ids.is_empty() {
            // Nothing (left) to take over: new entries, in the same call.
            return Ok((read_group(&mut c, &stream, consumer, count, ">").await?, None));
        }
        Ok((claim(&mut c, &stream, consumer, 0, &ids).await?, next))
    }

    /// The results and failures a batch names, as Redis holds them now: a
    /// failure entry whose record has become done since is skipped (its
    /// result entry follows), and so is a result that is no longer there.
    pub async fn sink_read(
        &self,
        job: &str,
        partition: u32,
        entries: &[SinkEntry],
        prices: &Prices,
    ) -> Result<SinkBatch, StoreError> {
        let mut c = self.conn.clone();
        let mut batch = SinkBatch::default();
        let results: Vec<&str> = entries.iter().filter(|e| e.result).map(|e| e.rid.as_str()).collect();
        if !results.is_empty() {
            let texts = hmget(&mut c, keys::results(job, partition), &results).await?;
            let mut seen = std::collections::HashSet::new();
            for (rid, t) in results.iter().zip(texts) {
                let Some(t) = t else { continue };
                if !seen.insert(*rid) {
                    continue; // handed over twice in one batch: one row
                }
                match ResultRow::parse(&t, prices) {
                    Ok((row, sunk)) => {
                        batch.results.push(row);
                        batch.sunk.push(sunk);
                        batch.texts.push(t);
                    }
                    // Kept as a failure, so the rest of the batch is written.
                    Err(e) => batch.failures.push(FailureRow::of_state(
                        rid,
                        "rejected",
                        &format!("the result in Redis cannot be read: {e}"),
                    )),
                }
            }
        }
        batch.paid = self.sink_read_paid(job, partition, entries).await?;
        batch
            .failures
            .extend(self.sink_read_failures(job, partition, entries).await?);
        Ok(batch)
    }

    /// The paid calls a batch names, from the ledger (one that left it
    /// after an earlier batch put it in the sink is skipped).
    async fn sink_read_paid(
        &self,
        job: &str,
        partition: u32,
        entries: &[SinkEntry],
    ) -> Result<Vec<PaidCall>, StoreError> {
        let mut c = self.conn.clone();
        let mut paid = Vec::new();
        let mut calls: Vec<&str> = entries.iter().filter_map(|e| e.call.as_deref()).collect();
        calls.sort_unstable();
        calls.dedup();
        if !calls.is_empty() {
            let key = keys::ledger(job, partition);
            let texts = hmget(&mut c, key.clone(), &calls).await?;
            for (call, t) in calls.iter().zip(texts) {
                // Gone: it left the ledger after an earlier batch put it in the sink.
                let Some(t) = t else { continue };
                paid.push(PaidCall::decode(call, &t).map_err(|reason| StoreError::Corrupt {
                    key: key.clone(),
                    reason,
                })?);
            }
        }
        Ok(paid)
    }

    /// The failure rows of the records a batch names as failed, as their
    /// state says now (a record reviewed then rejected in one batch is read once).
    async fn sink_read_failures(
        &self,
        job: &str,
        partition: u32,
        entries: &[SinkEntry],
    ) -> Result<Vec<FailureRow>, StoreError> {
        let mut c = self.conn.clone();
        let mut rows = Vec::new();
        // A record handed over as a failure twice in one batch (review, then
        // rejected) is read once: its state now says which.
        let mut failed: Vec<&str> = entries
            .iter()
            .filter(|e| e.is_failure())
            .map(|e| e.rid.as_str())
            .collect();
        failed.sort_unstable();
        failed.dedup();
        if !failed.is_empty() {
            let states = hmget(&mut c, keys::state(job, partition), &failed).await?;
            let states: Vec<Option<RecordState>> = states
                .into_iter()
                .map(|t| t.as_deref().and_then(RecordState::decode))
                .collect();
            // The review entries of those in review, in one read.
            let in_review: Vec<&str> = failed
                .iter()
                .zip(&states)
                .filter(|(_, st)| **st == Some(RecordState::Review))
                .map(|(rid, _)| *rid)
                .collect();
            let mut texts_of = std::collections::HashMap::new();
            if !in_review.is_empty() {
                let texts = hmget(&mut c, keys::review(job, partition), &in_review).await?;
                texts_of.extend(in_review.iter().zip(texts).filter_map(|(rid, t)| Some((*rid, t?))));
            }
            for (rid, state) in failed.iter().zip(states) {
                let row = match state {
                    Some(RecordState::Review) => match texts_of.get(rid).map(|t| ReviewEntry::decode(t)) {
                        Some(Ok(e)) => FailureRow::of_review(&e),
                        _ => FailureRow::of_state(rid, "review", ""),
                    },
                    Some(RecordState::Dropped(reason)) => FailureRow::of_state(rid, "dropped", &reason),
                    Some(RecordState::Cancelled) => FailureRow::of_state(rid, "cancelled", "cancelled"),
                    _ => continue,
                };
                rows.push(row);
            }
        }
        Ok(rows)
    }

    /// Acknowledges and deletes entries the sink holds durably, counts the
    /// rows that were new there (`written`: a lower bound, since a batch
    /// committed by a writer that stopped before this call is written again
    /// later and is not new then), and removes the results the sink holds
    /// from Redis, their figures added to the partition's `sunk` counters.
    /// The paid calls the sink holds (`paid`, their keys) leave the ledger
    /// hash `hold` from now (the same call stored again meanwhile is still
    /// counted once); those whose time has come leave now (so a call with
    /// nothing to acknowledge trims the ledger). Returns the results removed.
    #[allow(clippy::too_many_arguments)]
    pub async fn sink_ack(
        &self,
        job: &str,
        partition: u32,
        entries: &[SinkEntry],
        written: u64,
        sunk: &[SunkResult],
        paid: &[String],
        hold: std::time::Duration,
    ) -> Result<u64, StoreError> {
        let mut inv = self.sink_ack_call(job, partition);
        inv.arg(keys::SINK_GROUP)
            .arg(written)
            .arg(hold.as_millis() as u64)
            .arg(entries.len())
            .arg(paid.len());
        for e in entries {
            inv.arg(&e.entry_id);
        }
        for key in paid {
            inv.arg(key);
        }
        for r in sunk {
            inv.key(keys::idem(job, partition, &r.rid));
        }
        for r in sunk {
            let t = r.tokens;
            inv.arg(&r.rid)
                .arg(r.attempts)
                .arg(t.prompt)
                .arg(t.completion)
                .arg(t.cached);
        }
        let (removed, _trimmed): (u64, u64) = inv.invoke_async(&mut self.conn.clone()).await?;
        Ok(removed)
    }

    /// `sink_ack.lua` with the partition's first seven keys.
    fn sink_ack_call(&self, job: &str, partition: u32) -> redis::ScriptInvocation<'_> {
        let mut inv = self.scripts.sink_ack.prepare_invoke();
        inv.key(keys::sink(job, partition))
            .key(keys::results(job, partition))
            .key(keys::sunk(job, partition))
            .key(keys::state(job, partition))
            .key(keys::origins(job, partition))
            .key(keys::ledger(job, partition))
            .key(keys::ledger_sunk(job, partition));
        inv
    }

    /// Leaves a partition's ledger to expire when the last call's hold ends,
    /// once the sink holds every call in it (see `ledger_expire.lua`):
    /// Some(seconds until then), None when it holds calls the sink does not
    /// hold yet (nothing changed). An empty ledger: Some(0).
    pub async fn ledger_expire(&self, job: &str, partition: u32) -> Result<Option<u64>, StoreError> {
        let secs: i64 = self
            .scripts
            .ledger_expire
            .key(keys::ledger(job, partition))
            .key(keys::ledger_sunk(job, partition))
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(u64::try_from(secs).ok())
    }

    /// Lets the paid calls of a partition whose time in the ledger hash is
    /// over (see [`RedisStore::sink_ack`]) leave it, all of them.
    pub async fn ledger_trim(&self, job: &str, partition: u32, hold: std::time::Duration) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let mut inv = self.sink_ack_call(job, partition);
            inv.arg(keys::SINK_GROUP)
                .arg(0)
                .arg(hold.as_millis() as u64)
                .arg(0)
                .arg(0);
            let (_, trimmed): (u64, u64) = inv.invoke_async(&mut self.conn.clone()).await?;
            total += trimmed;
            // At most 1,000 leave per call.
            if trimmed < 1000 {
                return Ok(total);
            }
        }
    }

    /// Outcomes not yet in the sink (queued in its streams or being
    /// written), over every partition; None when the job has no sink streams.
    pub async fn sink_backlog(&self, job: &str, partitions: u32) -> Result<Option<u64>, StoreError> {
        let exists: Vec<u64> = self
            .per_partition(partitions, |p| redis::cmd("EXISTS").arg(keys::sink(job, p)).clone())
            .await?;
        if exists.iter().all(|e| *e == 0) {
            return Ok(None);
        }
        let lens: Vec<u64> = self
            .per_partition(partitions, |p| redis::cmd("XLEN").arg(keys::sink(job, p)).clone())
            .await?;
        Ok(Some(lens.iter().sum()))
    }

    /// Sends a done record whose row the database refused back to review
    /// (see `sink_refuse.lua`). Returns whether it moved.
    pub async fn sink_refuse(&self, job: &str, partition: u32, entry: &ReviewEntry) -> Result<bool, StoreError> {
        let moved: i64 = self
            .scripts
            .sink_refuse
            .key(keys::state(job, partition))
            .key(keys::results(job, partition))
            .key(keys::review(job, partition))
            .key(keys::sink(job, partition))
            .arg(&entry.record_id)
            .arg(entry.encode())
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(moved == 1)
    }

    /// Paid calls in the ledger hashes the sink does not hold yet (every
    /// call minus those kept a while after the sink took them), over the
    /// job's partitions.
    pub async fn ledger_unsunk(&self, job: &str, partitions: u32) -> Result<u64, StoreError> {
        let calls: Vec<u64> = self
            .per_partition(partitions, |p| redis::cmd("HLEN").arg(keys::ledger(job, p)).clone())
            .await?;
        let held: Vec<u64> = self
            .per_partition(partitions, |p| {
                redis::cmd("ZCARD").arg(keys::ledger_sunk(job, p)).clone()
            })
            .await?;
        Ok(calls.iter().zip(&held).map(|(c, h)| c.saturating_sub(*h)).sum())
    }

    /// What has left Redis for the sink, summed over the job's partitions.
    pub async fn sunk(&self, job: &str, partitions: u32) -> Result<Sunk, StoreError> {
        let all: Vec<std::collections::HashMap<String, u64>> = self
            .per_partition(partitions, |p| redis::cmd("HGETALL").arg(keys::sunk(job, p)).clone())
            .await?;
        let mut out = Sunk::default();
        for (field, n) in all.into_iter().flatten() {
            match field.as_str() {
                "written" => out.written += n,
                "done" => out.done += n,
                "prompt" => out.tokens.prompt += n,
                "completion" => out.tokens.completion += n,
                "cached" => out.tokens.cached += n,
                a => {
                    if let Some(attempts) = a.strip_prefix('a').and_then(|k| k.parse().ok()) {
                        *out.attempts_histogram.entry(attempts).or_default() += n;
                    }
                }
            }
        }
        Ok(out)
    }
}

//! The store's worker verbs: claim, reclaim, finish (commit / retry / review /
//! drop, each with its ack), promote due retries, halt.

use redis::AsyncCommands;
use redis::Value;

use super::{RedisStore, StoreError};
use crate::keys;
use crate::task::{Delivery, RecordState, ResultRecord, ReviewEntry, Task};

/// A pending entry idle past the visibility timeout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdleEntry {
    pub entry_id: String,
    /// Times it was delivered so far.
    pub deliveries: u32,
    /// How long since its last delivery, ms, when it was read.
    pub idle_ms: u64,
}

/// What to do with a delivered task; each is one atomic script with the ack.
#[derive(Debug, Clone)]
pub enum Finish {
    Commit(ResultRecord),
    /// Back to the delayed set, due at `due_ms` (Unix ms); 0: at once,
    /// back on the stream as a new entry and the fleet woken (a probe that
    /// failed while the provider is down, a refused response format, a
    /// backoff of 0: no trip through the delayed set and the promoter).
    Retry {
        due_ms: u64,
        task: Task,
    },
    /// Back on the stream at once as a retry due at 0 is, the fleet not
    /// woken: a record due at once while the provider is taken for down
    /// and the job has no fallback (a failed probe, a call that was out
    /// when the outage began): no worker takes it but the next probe,
    /// which goes on its own time.
    Requeue(Task),
    Review(ReviewEntry),
    /// An input error: never retried.
    Drop {
        reason: String,
    },
    /// The job was cancelled before this task was processed: kept for resume.
    Cancel(Task),
    /// Not called (the job is halted): back to the stream as a new entry, so
    /// it runs as soon as the halt is lifted instead of after a visibility timeout.
    Release(Task),
}

/// One task's outcome as [`RedisStore::finish_many`] takes it: the
/// delivery's fencing token (entry, consumer, delivery count) and the
/// outcome, encoded.
#[derive(Debug, Clone)]
pub struct Finishing {
    pub partition: u32,
    /// Batch mode: the shard holding the task (its outcome is fenced by the
    /// shard, not by a stream entry).
    shard: Option<String>,
    entry_id: String,
    rid: String,
    consumer: String,
    deliveries: u32,
    mode: &'static str,
    value: String,
    due_ms: u64,
    /// Back on the stream at once: the fleet is woken once it is.
    wake: bool,
    /// The paid call the delivery made: its ledger key, encoding and spend (see finish.lua).
    paid_key: String,
    paid: String,
    spend: String,
    /// The stats fields the outcome counts once it moves the record.
    stats: String,
}

impl Finishing {
    /// Whether this is an online call's outcome that settles its record for
    /// good: a result or a review entry, with the paid call that answered
    /// it, fenced by a stream entry (not a batch's shard). Nothing goes back
    /// on a stream for the fleet, and it comes one a call, never from a
    /// loop that stores outcomes one after another.
    pub fn ends_a_call(&self) -> bool {
        matches!(self.mode, "commit" | "commit_audit" | "review") && !self.paid_key.is_empty() && self.shard.is_none()
    }

    /// With the paid call the delivery made, recorded in the ledger with the
    /// outcome (once, under its key, however often this is stored).
    pub fn paid(mut self, call: Option<&crate::ledger::PaidCall>) -> Finishing {
        if let Some(call) = call {
            self.paid_key = call.key();
            self.paid = call.encode();
            self.spend = call.spend_args();
        }
        self
    }

    /// A commit of a record in the spec's spot-check sample: it also joins
    /// the audit queue, in the same atomic step.
    pub fn audit(mut self, sampled: bool) -> Finishing {
        if sampled && self.mode == "commit" {
            self.mode = "commit_audit";
        }
        self
    }

    pub fn new(d: &Delivery, how: &Finish) -> Finishing {
        let (mode, value, due_ms) = match how {
            Finish::Commit(result) => ("commit", result.encode(), 0),
            Finish::Retry { due_ms, task } => ("retry", task.encode(), *due_ms),
            Finish::Requeue(task) => ("retry", task.encode(), 0),
            Finish::Review(entry) => ("review", entry.encode(), 0),
            Finish::Drop { reason } => ("drop", reason.clone(), 0),
            Finish::Cancel(task) => ("cancel", task.encode(), 0),
            Finish::Release(task) => ("release", task.encode(), 0),
        };
        Finishing {
            partition: d.partition,
            shard: d.shard.clone(),
            entry_id: d.entry_id.clone(),
            rid: d.task.rid.clone(),
            consumer: d.consumer.clone(),
            deliveries: d.deliveries,
            mode,
            value,
            due_ms,
            wake: matches!(how, Finish::Retry { due_ms: 0, .. }),
            paid_key: String::new(),
            paid: String::new(),
            spend: String::new(),
            stats: stats_fields(d, how).join("\n"),
        }
    }
}

/// The `stats` fields an outcome counts (see `keys::stats`): the
/// validation errors of the attempt this delivery made (none when it made
/// none: a poison or input error, a request that would repeat an answered
/// one), the cause of a retry, and a commit's attempts.
fn stats_fields(d: &Delivery, how: &Finish) -> Vec<String> {
    use crate::task::HistoryItem;
    let history = match how {
        Finish::Commit(r) => &r.history,
        Finish::Retry { task, .. } | Finish::Requeue(task) => &task.history,
        Finish::Review(e) => &e.history,
        _ => return Vec::new(),
    };
    let mut out = Vec::new();
    let new_attempt = history
        .last()
        .and_then(HistoryItem::as_attempt)
        .filter(|a| a.call > d.task.calls);
    if let Some(a) = new_attempt {
        out.extend(
            a.errors
                .iter()
                .map(|e| stat_field("e", &format!("{} {}", e.code.as_str(), e.field))),
        );
        if matches!(how, Finish::Retry { .. } | Finish::Requeue(_)) {
            out.push(stat_field("r", &a.outcome));
        }
    }
    if let Finish::Commit(r) = how {
        out.push(format!("a:{}", r.attempts));
        // The route of the call that gave the result (a job with tiers).
        let tier = r
            .history
            .iter()
            .rev()
            .find_map(HistoryItem::as_attempt)
            .and_then(|a| a.tier.as_deref());
        if let Some(tier) = tier {
            out.push(stat_field("rt", tier));
        }
    }
    out
}

/// `kind:name`, the name on one line (the fields are newline-separated).
fn stat_field(kind: &str, name: &str) -> String {
    format!("{kind}:{}", name.trim_end().replace(['\n', '\r'], " "))
}

/// What a [`RedisStore::finish`] came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finished {
    /// The record moved (and the entry was acknowledged).
    Moved,
    /// The record was already settled: the entry was only acknowledged.
    AlreadySettled,
    /// Another worker took the task over since this delivery: nothing was
    /// changed, nothing acknowledged (the entry is the other worker's).
    Stale,
}

/// A job's flags as a worker's watcher reads them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobFlags {
    /// Why the job is halted, if it is.
    pub halted: Option<String>,
    /// The resume mark ('' before any resume): see [`keys::resumed`].
    pub resume_mark: String,
    pub cancelled: bool,
}

/// Where the work of a job stands, from Redis.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Remaining {
    /// Entries in the streams (new and pending).
    pub in_streams: u64,
    /// Tasks waiting to retry.
    pub delayed: u64,
    /// Tasks held by provider batch shards (batch mode).
    pub batched: u64,
    /// A producer is still enqueueing the job (bounded backlog): more comes.
    pub enqueuing: bool,
}

/// One partition's queue, for metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// In the stream, not yet delivered.
    pub lag: u64,
    /// Delivered, not yet acknowledged.
    pub pending: u64,
    /// Idle time of the oldest pending entry.
    pub oldest_pending_ms: u64,
    pub delayed: u64,
    pub review: u64,
}

/// A partition's work left, as an autoscaler must see it (see the `scaler`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct WorkLeft {
    /// In the stream, never delivered (KEDA's `lagCount`).
    pub queued: u64,
    /// Delivered and not acknowledged: calls in flight, or a dead worker's
    /// tasks waiting to be taken over (KEDA's `pendingEntriesCount`).
    pub in_flight: u64,
    /// Retries waiting in the delayed set until they are due.
    pub delayed: u64,
    /// Batch mode: provider batch shards not reconciled yet, each one task
    /// (a worker polls it, whatever its size).
    pub shards: u64,
}

impl WorkLeft {
    pub fn total(&self) -> u64 {
        self.queued + self.in_flight + self.delayed + self.shards
    }

    pub fn add(&mut self, o: &WorkLeft) {
        self.queued += o.queued;
        self.in_flight += o.in_flight;
        self.delayed += o.delayed;
        self.shards += o.shards;
    }
}

impl Remaining {
    pub fn is_empty(&self) -> bool {
        self.in_streams == 0 && self.delayed == 0 && self.batched == 0 && !self.enqueuing
    }

    /// The tasks a job holds in Redis: queued, in flight and waiting to retry.
    pub fn backlog(&self) -> u64 {
        self.in_streams + self.delayed
    }
}

impl RedisStore {
    /// Reads up to `count` entries of one partition for `consumer`: new ones
    /// (`>`), or with `own_pending` the consumer's own pending entries (`0`).
    pub async fn claim(
        &self,
        job: &str,
        partition: u32,
        consumer: &str,
        count: usize,
        own_pending: bool,
    ) -> Result<Vec<Delivery>, StoreError> {
        if !own_pending {
            return self.claim_new(job, partition, consumer, count).await;
        }
        let mut out = self.read_group(job, partition, consumer, count, "0").await?;
        // Re-reading its own pending entries counted another delivery of each.
        self.exact_deliveries(job, &mut out).await?;
        Ok(out)
    }

    /// XREADGROUP of one partition from `from` (`>` new, `0` own pending).
    async fn read_group(
        &self,
        job: &str,
        partition: u32,
        consumer: &str,
        count: usize,
        from: &str,
    ) -> Result<Vec<Delivery>, StoreError> {
        let reply: Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(keys::GROUP)
            .arg(consumer)
            .arg("COUNT")
            .arg(count)
            .arg("STREAMS")
            .arg(keys::stream(job, partition))
            .arg(from)
            .query_async(&mut self.conn.clone())
            .await?;
        // [[stream, [[id, [k, v, ...]], ...]]] or nil
        let mut out = Vec::new();
        for stream in as_array(&reply) {
            let parts = as_array(stream);
            if let Some(entries) = parts.get(1) {
                for entry in as_array(entries) {
                    if let Some(d) = parse_entry(partition, consumer, entry, 1) {
                        out.push(d);
                    }
                }
            }
        }
        Ok(out)
    }

    /// New entries, then their records' states (one HMGET): the check
    /// before a paid call then needs no round trip per task. (A script doing
    /// both in one step cost Redis three times as much: the entries were
    /// converted to Lua and back.)
    async fn claim_new(
        &self,
        job: &str,
        partition: u32,
        consumer: &str,
        count: usize,
    ) -> Result<Vec<Delivery>, StoreError> {
        let mut out = self.read_group(job, partition, consumer, count, ">").await?;
        if out.is_empty() {
            return Ok(out);
        }
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(keys::state(job, partition));
        for d in &out {
            cmd.arg(&d.task.rid);
        }
        // Claimed already: without the states the tasks still run (each is
        // then checked before its call).
        if let Ok(states) = cmd.query_async::<Vec<Option<String>>>(&mut self.conn.clone()).await {
            for (d, state) in out.iter_mut().zip(states) {
                d.state_at_claim = Some(state.as_deref().and_then(RecordState::decode));
            }
        }
        Ok(out)
    }

    /// Sets each delivery's count to what Redis holds now (one pipelined
    /// XPENDING per entry); an entry no longer pending for its consumer is
    /// dropped from the list (it is not this worker's to run).
    async fn exact_deliveries(&self, job: &str, ds: &mut Vec<Delivery>) -> Result<(), StoreError> {
        if ds.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for d in ds.iter() {
            pipe.cmd("XPENDING")
                .arg(keys::stream(job, d.partition))
                .arg(keys::GROUP)
                .arg(&d.entry_id)
                .arg(&d.entry_id)
                .arg(1);
        }
        let replies: Vec<Value> = pipe.query_async(&mut self.conn.clone()).await?;
        let mut keep = Vec::with_capacity(ds.len());
        for (mut d, reply) in ds.drain(..).zip(replies) {
            if let Some((owner, count)) = pending_row(&reply)
                && owner == d.consumer
            {
                d.deliveries = count;
                keep.push(d);
            }
        }
        *ds = keep;
        Ok(())
    }

    /// Before a call: the record's state, and whether this delivery is still
    /// the live one (pending for its consumer with its delivery count), in
    /// one round trip.
    pub async fn check_delivery(&self, job: &str, d: &Delivery) -> Result<(Option<RecordState>, bool), StoreError> {
        let (state, pending): (Option<String>, Value) = redis::pipe()
            .hget(keys::state(job, d.partition), &d.task.rid)
            .cmd("XPENDING")
            .arg(keys::stream(job, d.partition))
            .arg(keys::GROUP)
            .arg(&d.entry_id)
            .arg(&d.entry_id)
            .arg(1)
            .query_async(&mut self.conn.clone())
            .await?;
        let live = pending_row(&pending).is_some_and(|(owner, n)| owner == d.consumer && n == d.deliveries);
        Ok((state.as_deref().and_then(RecordState::decode), live))
    }

    /// A delivery its worker kept for a later call (a failed probe's, for
    /// the next probe) made fresh: its idle time starts over, the delivery
    /// count unchanged, while it is still the live one (`renew.lua`).
    /// Returns None when another worker took it over meanwhile, else the
    /// record's state (`d` then holds it, as read with a claim, and is
    /// claimed now).
    pub async fn renew(&self, job: &str, d: &mut Delivery) -> Result<Option<Option<RecordState>>, StoreError> {
        let state: Option<String> = self
            .scripts
            .renew
            .key(keys::stream(job, d.partition))
            .key(keys::state(job, d.partition))
            .arg(keys::GROUP)
            .arg(&d.entry_id)
            .arg(&d.consumer)
            .arg(d.deliveries)
            .arg(&d.task.rid)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(state.map(|state| {
            let state = RecordState::decode(&state);
            d.claimed_at = tokio::time::Instant::now();
            d.state_at_claim = Some(state.clone());
            state
        }))
    }

    /// Takes over the given entries if they are still idle at least
    /// `min_idle_ms` (their worker died or hung; XCLAIM re-checks atomically,
    /// so two workers never both take one). `idle` comes from
    /// [`RedisStore::idle_pending`]; entries deleted meanwhile are dropped.
    pub async fn reclaim(
        &self,
        job: &str,
        partition: u32,
        consumer: &str,
        min_idle_ms: u64,
        idle: &[IdleEntry],
    ) -> Result<Vec<Delivery>, StoreError> {
        if idle.is_empty() {
            return Ok(vec![]);
        }
        let mut cmd = redis::cmd("XCLAIM");
        cmd.arg(keys::stream(job, partition))
            .arg(keys::GROUP)
            .arg(consumer)
            .arg(min_idle_ms);
        for e in idle {
            cmd.arg(&e.entry_id);
        }
        let reply: Value = cmd.query_async(&mut self.conn.clone()).await?;
        let mut out = Vec::new();
        for entry in as_array(&reply) {
            if let Some(d) = parse_entry(partition, consumer, entry, 1) {
                out.push(d);
            }
        }
        // XCLAIM counted this delivery: read the count it holds now.
        self.exact_deliveries(job, &mut out).await?;
        Ok(out)
    }

    /// Pending entries (up to `limit`, oldest first) idle at least
    /// `min_idle_ms` (0: any), over the whole pending list (XPENDING IDLE skips the
    /// busy ones, where XAUTOCLAIM would scan only COUNT x 10 entries of it).
    pub async fn idle_pending(
        &self,
        job: &str,
        partition: u32,
        min_idle_ms: u64,
        limit: usize,
    ) -> Result<Vec<IdleEntry>, StoreError> {
        let reply: Value = redis::cmd("XPENDING")
            .arg(keys::stream(job, partition))
            .arg(keys::GROUP)
            .arg("IDLE")
            .arg(min_idle_ms)
            .arg("-")
            .arg("+")
            .arg(limit.max(1))
            .query_async(&mut self.conn.clone())
            .await?;
        // [[id, consumer, idle ms, deliveries], ...]
        Ok(as_array(&reply)
            .iter()
            .filter_map(|e| {
                let f = as_array(e);
                Some(IdleEntry {
                    entry_id: as_string(f.first()?)?,
                    deliveries: f.get(3).and_then(as_u64).unwrap_or(1) as u32,
                    idle_ms: f.get(2).and_then(as_u64).unwrap_or(0),
                })
            })
            .collect())
    }

    /// Settles a delivered task and acknowledges it, atomically, if the
    /// delivery is still the live one (see [`Delivery`]).
    pub async fn finish(&self, job: &str, d: &Delivery, how: &Finish) -> Result<Finished, StoreError> {
        let mut done = self.finish_many(job, &[Finishing::new(d, how)]).await;
        done.pop().unwrap_or_else(|| {
            Err(StoreError::Corrupt {
                key: keys::stream(job, d.partition),
                reason: "finish.lua answered nothing".into(),
            })
        })
    }

    /// Settles delivered tasks in one script call per partition (the calls
    /// pipelined): each exactly as [`RedisStore::finish`] would alone, in
    /// the order given. Outcomes come back in that order; a partition whose
    /// call failed gives its error to its own tasks only.
    pub async fn finish_many(&self, job: &str, items: &[Finishing]) -> Vec<Result<Finished, StoreError>> {
        // Each partition's tasks (their places in `items`), in order; a
        // shard's tasks by shard (its hash is one more key).
        let mut groups: std::collections::BTreeMap<(u32, Option<&str>), Vec<usize>> = Default::default();
        for (i, f) in items.iter().enumerate() {
            groups.entry((f.partition, f.shard.as_deref())).or_default().push(i);
        }
        let calls = groups.iter().map(|(&(p, shard), slots)| {
            let mut inv = self.scripts.finish.prepare_invoke();
            inv.key(keys::stream(job, p))
                .key(keys::state(job, p))
                .key(keys::results(job, p))
                .key(keys::delayed(job, p))
                .key(keys::review(job, p))
                .key(keys::cancelled(job, p))
                .key(keys::sink(job, p))
                .key(keys::ledger(job, p))
                .key(keys::spend(job, p))
                .key(keys::stats(job, p))
                .key(keys::audit(job, p))
                .key(keys::shard(job, p, shard.unwrap_or("-")))
                .key(keys::ledger_sunk(job, p))
                .arg(keys::GROUP);
            for f in slots.iter().map(|&i| &items[i]) {
                inv.arg(&f.entry_id)
                    .arg(&f.rid)
                    .arg(f.mode)
                    .arg(&f.value)
                    .arg(f.due_ms)
                    .arg(&f.consumer)
                    .arg(f.deliveries)
                    .arg(&f.paid_key)
                    .arg(&f.paid)
                    .arg(&f.spend)
                    .arg(&f.stats);
            }
            let mut conn = self.conn.clone();
            async move {
                let moved: Vec<i64> = inv.invoke_async(&mut conn).await?;
                if moved.len() != slots.len() {
                    return Err(StoreError::Corrupt {
                        key: keys::stream(job, p),
                        reason: format!("finish.lua answered {} outcomes for {} tasks", moved.len(), slots.len()),
                    });
                }
                Ok(moved)
            }
        });
        // Sent together over the multiplexed connection.
        let replies = futures_util::future::join_all(calls).await;
        let mut out: Vec<Result<Finished, StoreError>> = vec![Ok(Finished::AlreadySettled); items.len()];
        for (slots, reply) in groups.values().zip(replies) {
            for (k, &i) in slots.iter().enumerate() {
                out[i] = match &reply {
                    Ok(moved) => Ok(match moved[k] {
                        1 => Finished::Moved,
                        -1 => Finished::Stale,
                        _ => Finished::AlreadySettled,
                    }),
                    Err(e) => Err(e.clone()),
                };
            }
        }
        // A record back on its stream at once (a retry due at 0) is new work
        // for the whole fleet, as a promoted retry is (a failed probe's is not).
        let requeued = items
            .iter()
            .zip(&out)
            .any(|(f, o)| f.wake && matches!(o, Ok(Finished::Moved)));
        if requeued {
            self.wake(job, super::Wake::Work).await;
        }
        out
    }

    /// Records paid calls that left no outcome (cut off at a drain timeout,
    /// or whose outcome could not be stored) in their partitions' ledgers.
    pub async fn record_paid(&self, job: &str, calls: &[(u32, crate::ledger::PaidCall)]) -> Result<(), StoreError> {
        let mut by_partition: std::collections::BTreeMap<u32, Vec<&crate::ledger::PaidCall>> = Default::default();
        for (p, c) in calls {
            by_partition.entry(*p).or_default().push(c);
        }
        for (p, calls) in by_partition {
            let mut inv = self.scripts.ledger.prepare_invoke();
            inv.key(keys::ledger(job, p))
                .key(keys::spend(job, p))
                .key(keys::sink(job, p))
                .key(keys::stats(job, p))
                .key(keys::ledger_sunk(job, p));
            for c in calls {
                inv.arg(c.key()).arg(c.encode()).arg(c.spend_args());
            }
            let _: u64 = inv.invoke_async(&mut self.conn.clone()).await?;
        }
        Ok(())
    }

    /// The job's spend from its counters, summed over its partitions.
    pub async fn spend(&self, job: &str, partitions: u32) -> Result<crate::ledger::Spend, StoreError> {
        // One call per partition: each is its own Cluster slot.
        let mut s = crate::ledger::Spend::default();
        for p in 0..partitions {
            let fields: std::collections::BTreeMap<String, u64> =
                self.conn.clone().hgetall(keys::spend(job, p)).await?;
            s.add_counters(&fields);
        }
        Ok(s)
    }

    /// Every paid call of a partition's ledger (in no order).
    pub async fn ledger_entries(
        &self,
        job: &str,
        partition: u32,
        mut f: impl FnMut(crate::ledger::PaidCall),
    ) -> Result<(), StoreError> {
        let key = keys::ledger(job, partition);
        let mut bad = None;
        self.scan_hash(&key, |k, v| match crate::ledger::PaidCall::decode(&k, &v) {
            Ok(call) => f(call),
            Err(reason) => bad = Some(reason),
        })
        .await?;
        match bad {
            Some(reason) => Err(StoreError::Corrupt { key, reason }),
            None => Ok(()),
        }
    }

    /// Acknowledges and deletes an entry whose record is already settled.
    pub async fn ack(&self, job: &str, d: &Delivery) -> Result<(), StoreError> {
        let stream = keys::stream(job, d.partition);
        let _: () = redis::pipe()
            .atomic()
            .cmd("XACK")
            .arg(&stream)
            .arg(keys::GROUP)
            .arg(&d.entry_id)
            .ignore()
            .cmd("XDEL")
            .arg(&stream)
            .arg(&d.entry_id)
            .ignore()
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(())
    }

    /// Moves due retries of one partition back to its stream (and wakes the
    /// fleet when it moved any). Returns how many, and when the next retry
    /// waiting there is due (Unix ms).
    pub async fn promote_due(
        &self,
        job: &str,
        partition: u32,
        now_ms: u64,
        limit: usize,
    ) -> Result<(u64, Option<u64>), StoreError> {
        let (n, next): (u64, i64) = self
            .scripts
            .promote
            .key(keys::stream(job, partition))
            .key(keys::state(job, partition))
            .key(keys::delayed(job, partition))
            .arg(now_ms)
            .arg(limit)
            .invoke_async(&mut self.conn.clone())
            .await?;
        if n > 0 {
            self.wake(job, super::Wake::Work).await;
        }
        Ok((n, u64::try_from(next).ok()))
    }

    /// Promotes what is due at `now_ms` in every partition of a job, `page`
    /// a script call. Returns how many moved, when the next retry waiting
    /// anywhere is due (Unix ms), and the partitions' errors (one failing
    /// partition does not keep the others' retries waiting).
    pub async fn promote_job(
        &self,
        job: &str,
        partitions: u32,
        now_ms: u64,
        page: usize,
    ) -> (u64, Option<u64>, Vec<StoreError>) {
        let (mut moved, mut next, mut errors) = (0, None::<u64>, Vec::new());
        for p in 0..partitions {
            match self.promote_due(job, p, now_ms, page).await {
                Ok((n, due)) => {
                    moved += n;
                    next = next.into_iter().chain(due).min();
                }
                Err(e) => errors.push(e),
            }
        }
        (moved, next, errors)
    }

    /// The record's state, if the job knows the record.
    pub async fn record_state(
        &self,
        job: &str,
        partition: u32,
        record_id: &str,
    ) -> Result<Option<RecordState>, StoreError> {
        let text: Option<String> = self.conn.clone().hget(keys::state(job, partition), record_id).await?;
        Ok(text.as_deref().and_then(RecordState::decode))
    }

    /// The record's result as Redis holds it (its encoding), if it does.
    pub async fn result_text(&self, job: &str, partition: u32, record_id: &str) -> Result<Option<String>, StoreError> {
        Ok(self.conn.clone().hget(keys::results(job, partition), record_id).await?)
    }

    /// Replaces a done record's result with its revision, if the result is
    /// still `read` (see `revise.lua`): 1 revised, 0 changed meanwhile, -1
    /// not a done record with its result in Redis.
    pub async fn revise_result(
        &self,
        job: &str,
        partition: u32,
        record_id: &str,
        read: &str,
        revised: &crate::task::ResultRecord,
    ) -> Result<i64, StoreError> {
        Ok(self
            .scripts
            .revise
            .key(keys::state(job, partition))
            .key(keys::results(job, partition))
            .arg(record_id)
            .arg(read)
            .arg(revised.encode())
            .invoke_async(&mut self.conn.clone())
            .await?)
    }

    /// Work left in a job: stream entries and delayed retries over all
    /// partitions. Each partition is read in one transaction: a retry
    /// promoted (delayed -> stream) or scheduled (stream -> delayed) between
    /// two separate reads could make a partition look empty.
    /// Read first: a producer that finished has put every task in a stream.
    pub async fn remaining(&self, job: &str, partitions: u32) -> Result<Remaining, StoreError> {
        let mut c = self.conn.clone();
        let mut r = Remaining {
            enqueuing: self.enqueuing(job).await?,
            ..Remaining::default()
        };
        for p in 0..partitions {
            let (n, z): (u64, u64) = redis::pipe()
                .atomic()
                .xlen(keys::stream(job, p))
                .zcard(keys::delayed(job, p))
                .query_async(&mut c)
                .await?;
            r.in_streams += n;
            r.delayed += z;
            for (_, s) in self.shards(job, p).await? {
                if s.state != crate::shard::ShardState::Reconciled {
                    r.batched += self.shard_held(job, p, &s.id).await?;
                }
            }
        }
        Ok(r)
    }

    /// Each partition's work left (see [`RedisStore::partition_work_left`]).
    pub async fn work_left(&self, job: &str, partitions: u32) -> Result<Vec<WorkLeft>, StoreError> {
        let mut out = Vec::with_capacity(partitions as usize);
        for p in 0..partitions {
            out.push(self.partition_work_left(job, p).await?);
        }
        Ok(out)
    }

    /// A partition's work left. Queued is the stream's length less its
    /// pending entries (acknowledged entries are deleted): unlike `XINFO
    /// GROUPS` lag it is never unknown. The stream and the delayed set are
    /// read in one transaction (a retry moving between them is counted
    /// once). A partition whose stream or group does not exist (yet) has
    /// none queued or in flight.
    pub async fn partition_work_left(&self, job: &str, p: u32) -> Result<WorkLeft, StoreError> {
        let (len, delayed): (u64, u64) = redis::pipe()
            .atomic()
            .xlen(keys::stream(job, p))
            .zcard(keys::delayed(job, p))
            .query_async(&mut self.conn.clone())
            .await?;
        let in_flight = if len == 0 {
            0
        } else {
            match self.pending_count(job, p).await {
                Ok(n) => n,
                Err(StoreError::Redis(e)) if e.code() == Some("NOGROUP") => 0,
                Err(e) => return Err(e),
            }
        };
        let shards = self
            .shards(job, p)
            .await?
            .iter()
            .filter(|(_, s)| s.state != crate::shard::ShardState::Reconciled)
            .count() as u64;
        Ok(WorkLeft {
            queued: len.saturating_sub(in_flight),
            in_flight,
            delayed,
            shards,
        })
    }

    /// Whether partition `p` of `job` may hold tasks not yet delivered to
    /// any worker: false only when `XINFO GROUPS` says its group's lag is
    /// 0 (one command; a lag the server cannot tell, or a missing group or
    /// stream, answers true: the caller then reads as usual).
    pub async fn may_have_undelivered(&self, job: &str, p: u32) -> Result<bool, StoreError> {
        let reply: Result<Value, redis::RedisError> = redis::cmd("XINFO")
            .arg("GROUPS")
            .arg(keys::stream(job, p))
            .query_async(&mut self.conn.clone())
            .await;
        let reply = match reply {
            Ok(v) => v,
            Err(e) if e.code() == Some("ERR") => return Ok(true),
            Err(e) => return Err(e.into()),
        };
        for group in as_array(&reply) {
            let fields = info_fields(group);
            let field = |name: &str| fields.iter().find(|(k, _)| k == name).map(|(_, v)| *v);
            if field("name").and_then(as_string).as_deref() == Some(keys::GROUP) {
                return Ok(field("lag").and_then(as_u64) != Some(0));
            }
        }
        Ok(true)
    }

    /// A producer is still enqueueing the job (see [`RedisStore::mark_enqueuing`]).
    pub async fn enqueuing(&self, job: &str) -> Result<bool, StoreError> {
        Ok(self.conn.clone().exists(keys::enqueuing(job)).await?)
    }

    /// Marks the job as being enqueued for `ttl_secs` (renewed by the
    /// producer while it runs); `None` clears the mark.
    pub async fn mark_enqueuing(&self, job: &str, ttl_secs: Option<u64>) -> Result<(), StoreError> {
        let mut c = self.conn.clone();
        match ttl_secs {
            // SET ... EX, not SETEX: the documented ACL grants `set`.
            Some(ttl) => {
                redis::cmd("SET")
                    .arg(keys::enqueuing(job))
                    .arg("1")
                    .arg("EX")
                    .arg(ttl)
                    .query_async::<()>(&mut c)
                    .await?
            }
            None => c.del::<_, ()>(keys::enqueuing(job)).await?,
        }
        Ok(())
    }

    /// Whether the job is cancelled (workers claim nothing for it).
    pub async fn cancelled(&self, job: &str) -> Result<bool, StoreError> {
        Ok(self.conn.clone().exists(keys::cancel(job)).await?)
    }

    /// Lag, pending, oldest pending age, delayed and review depth of a partition.
    /// Acknowledged entries are deleted, so the stream holds exactly the
    /// undelivered and the pending ones: lag = length - pending.
    pub async fn queue_stats(&self, job: &str, partition: u32) -> Result<QueueStats, StoreError> {
        let mut c = self.conn.clone();
        let w = self.partition_work_left(job, partition).await?;
        let oldest: Value = redis::cmd("XPENDING")
            .arg(keys::stream(job, partition))
            .arg(keys::GROUP)
            .arg("-")
            .arg("+")
            .arg(1)
            .query_async(&mut c)
            .await?;
        let oldest_pending_ms = as_array(&oldest)
            .first()
            .and_then(|row| as_array(row).get(2).and_then(as_u64))
            .unwrap_or(0);
        Ok(QueueStats {
            lag: w.queued,
            pending: w.in_flight,
            oldest_pending_ms,
            delayed: w.delayed,
            review: c.hlen(keys::review(job, partition)).await?,
        })
    }

    /// A job's halt, resume mark and cancel in one read (what a worker's
    /// watcher reads every round).
    pub async fn job_flags(&self, job: &str) -> Result<JobFlags, StoreError> {
        let (halted, resumed, cancel): (Option<String>, Option<String>, Option<String>) = redis::cmd("MGET")
            .arg(keys::halt(job))
            .arg(keys::resumed(job))
            .arg(keys::cancel(job))
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(JobFlags {
            halted,
            resume_mark: resumed.unwrap_or_default(),
            cancelled: cancel.is_some(),
        })
    }

    /// Why the job is halted, if it is.
    pub async fn halted(&self, job: &str) -> Result<Option<String>, StoreError> {
        Ok(self.conn.clone().get(keys::halt(job)).await?)
    }

    /// Halts the job's fleet (first reason wins).
    pub async fn halt(&self, job: &str, reason: &str) -> Result<(), StoreError> {
        let _: Option<String> = redis::cmd("SET")
            .arg(keys::halt(job))
            .arg(reason)
            .arg("NX")
            .query_async(&mut self.conn.clone())
            .await?;
        self.wake(job, super::Wake::Flags).await;
        Ok(())
    }

    /// The job's resume mark ('' before any resume): see [`keys::resumed`].
    pub async fn resume_mark(&self, job: &str) -> Result<String, StoreError> {
        Ok(self
            .conn
            .clone()
            .get::<_, Option<String>>(keys::resumed(job))
            .await?
            .unwrap_or_default())
    }

    /// Halts the job on a drift alarm of a watch that began under resume
    /// mark `mark`; false (nothing done) when the job was resumed since.
    pub async fn halt_on_drift(&self, job: &str, reason: &str, mark: &str) -> Result<bool, StoreError> {
        let halted: i64 = self
            .scripts
            .drift_halt
            .key(keys::halt(job))
            .key(keys::resumed(job))
            .arg(reason)
            .arg(mark)
            .invoke_async(&mut self.conn.clone())
            .await?;
        if halted == 1 {
            self.wake(job, super::Wake::Flags).await;
        }
        Ok(halted == 1)
    }

    /// The server's `maxmemory-policy` (from `INFO memory`: CONFIG is not in
    /// batchfleet's ACL, it can read secrets), or None when the server hides it.
    /// On a cluster every master answers: the first policy that is not
    /// `noeviction` wins, so one evicting node is enough to refuse.
    pub async fn eviction_policy(&self) -> Result<Option<String>, StoreError> {
        let reply: Value = redis::cmd("INFO")
            .arg("memory")
            .query_async(&mut self.conn.clone())
            .await?;
        let texts: Vec<String> = match &reply {
            Value::Map(nodes) => nodes.iter().filter_map(|(_, v)| as_string(v)).collect(),
            other => as_string(other).into_iter().collect(),
        };
        let mut policies = texts.iter().filter_map(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("maxmemory_policy:"))
                .map(|v| v.trim().to_owned())
        });
        let first = policies.next();
        Ok(policies.find(|p| p != "noeviction").or(first))
    }

    /// Fails with [`StoreError::Evicting`] unless the server's policy is
    /// `noeviction` (workers and the producer both refuse to run otherwise).
    pub async fn refuse_eviction(&self) -> Result<(), StoreError> {
        match self.eviction_policy().await? {
            Some(p) if p == "noeviction" => Ok(()),
            policy => Err(StoreError::Evicting { policy }),
        }
    }

    /// Takes or renews this worker's lease on its consumer name for `ttl`.
    /// False when another live worker holds it.
    pub async fn lease_consumer(
        &self,
        consumer: &str,
        token: &str,
        ttl: std::time::Duration,
    ) -> Result<bool, StoreError> {
        let n: i64 = self
            .scripts
            .lease
            .key(keys::consumer_lease(consumer))
            .arg(token)
            .arg("take")
            .arg(ttl.as_millis() as u64)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(n == 1)
    }

    /// Gives the consumer name back (if this worker still holds it).
    pub async fn release_consumer(&self, consumer: &str, token: &str) -> Result<(), StoreError> {
        let _: i64 = self
            .scripts
            .lease
            .key(keys::consumer_lease(consumer))
            .arg(token)
            .arg("release")
            .arg(0)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(())
    }

    /// All job names ever enqueued.
    pub async fn jobs(&self) -> Result<Vec<String>, StoreError> {
        let mut v: Vec<String> = self.conn.clone().smembers(keys::jobs()).await?;
        v.sort();
        Ok(v)
    }
}

pub(super) fn as_array(v: &Value) -> &[Value] {
    match v {
        Value::Array(a) => a,
        _ => &[],
    }
}

/// An `XINFO` reply's fields, as RESP3 (a map) or RESP2 (a flat array of
/// name, value) gives them.
pub(super) fn info_fields(v: &Value) -> Vec<(String, &Value)> {
    match v {
        Value::Map(m) => m.iter().filter_map(|(k, v)| Some((as_string(k)?, v))).collect(),
        other => as_array(other)
            .chunks_exact(2)
            .filter_map(|kv| Some((as_string(&kv[0])?, &kv[1])))
            .collect(),
    }
}

pub(super) fn as_string(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::Int(n) => u64::try_from(*n).ok(),
        other => as_string(other).and_then(|s| s.parse().ok()),
    }
}

/// `[[id, owner, idle ms, deliveries]]` (one XPENDING row) -> (owner, deliveries).
fn pending_row(reply: &Value) -> Option<(String, u32)> {
    let row = as_array(as_array(reply).first()?);
    Some((as_string(row.get(1)?)?, as_u64(row.get(3)?)? as u32))
}

/// `[id, [field, value, ...]]` -> Delivery. A deleted entry (nil fields)
/// or one that holds no task is skipped.
fn parse_entry(partition: u32, consumer: &str, entry: &Value, deliveries: u32) -> Option<Delivery> {
    let parts = as_array(entry);
    let entry_id = as_string(parts.first()?)?;
    let fields: Vec<String> = as_array(parts.get(1)?).iter().filter_map(as_string).collect();
    let pairs = fields.chunks_exact(2).map(|kv| (kv[0].as_str(), kv[1].as_str()));
    let task = Task::from_entry_fields(pairs).ok()?;
    Some(Delivery {
        partition,
        entry_id,
        deliveries,
        consumer: consumer.to_owned(),
        claimed_at: tokio::time::Instant::now(),
        task,
        state_at_claim: None,
        shard: None,
    })
}

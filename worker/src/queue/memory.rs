//! [`JobQueue`] in memory, for in-process tests of the pipeline: the same
//! rules as the Redis scripts (`finish.lua`, `outage.lua`, `budget.lua`),
//! one job, one partition's stream, and a clock a test moves forward.
//!
//! Not modelled: partitions (one stream), provider batch shards (a
//! delivery held by a shard is stale here), the spend counters beyond
//! calls and nano-USD (buckets, estimates, batch savings, stats), the sink
//! stream, and the outage probe's lease (the claimer's, not the pipeline's).
//!
//! Besides the trait it plays the parts the services play in a fleet:
//! [`MemoryQueue::deliver`] (a claim), [`MemoryQueue::take_over`] (the
//! rescuer's reclaim of a hung worker's task), [`MemoryQueue::promote`]
//! (due retries back to the stream), and reads what a test checks.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use common::ledger::PaidCall;
use common::store::{FailedCall, Finish, Finished, Noted, OutageRules, Provider, Reserved, StoreError};
use common::task::{Delivery, RecordState, ResultRecord, ReviewEntry, Task};

use super::{JobQueue, Op};

/// One job's shared state in memory. Clones share it (as workers share Redis).
#[derive(Clone, Default)]
pub struct MemoryQueue {
    state: Arc<Mutex<State>>,
    /// Added to the wall clock: what a test moved time forward by.
    skew_ms: Arc<AtomicU64>,
    /// Outcomes the queue refuses before it takes one again (as a Redis
    /// that is away): `u64::MAX`, until told otherwise.
    refuse: Arc<AtomicU64>,
}

#[derive(Default)]
struct State {
    next_entry: u64,
    /// Entries in the stream not delivered yet, oldest first.
    waiting: VecDeque<String>,
    /// Every entry in the stream: its task, and who holds it (consumer,
    /// delivery count) once delivered.
    entries: BTreeMap<String, Entry>,
    states: HashMap<String, RecordState>,
    results: BTreeMap<String, ResultRecord>,
    review: BTreeMap<String, ReviewEntry>,
    cancelled: BTreeMap<String, Task>,
    delayed: Vec<(u64, Task)>,
    audit: BTreeSet<String>,
    /// The ledger: call key -> the paid call (first write wins).
    paid: BTreeMap<String, PaidCall>,
    /// Counters that only grow (the `spend` hash's `calls` and `nusd`).
    spend_calls: u64,
    spend_nusd: u64,
    halt: Option<String>,
    /// Resumes so far (the resume mark).
    resumes: u64,
    outage: Outage,
    budget: Budget,
    breaker: HashMap<String, u64>,
    proven: bool,
    forms: HashMap<String, String>,
}

struct Entry {
    task: Task,
    held: Option<(String, u32)>,
}

/// `outage.lua`'s hash.
#[derive(Default)]
struct Outage {
    ok_ms: u64,
    since_ms: Option<u64>,
    fails: u64,
    rl_only: bool,
    down: bool,
    probes: u32,
    probe_at: u64,
    down_ms: u64,
    outages: u64,
}

/// `budget.lua`'s hash and reservations (nano-USD).
#[derive(Default)]
struct Budget {
    cap: Option<u64>,
    spent: u64,
    reserved: u64,
    /// member (`id:amount`) -> expiry (Unix ms).
    held: BTreeMap<String, u64>,
}

impl MemoryQueue {
    pub fn new() -> MemoryQueue {
        MemoryQueue::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The queue's clock (Unix ms): the wall clock plus what [`MemoryQueue::advance`] added.
    pub fn now_ms(&self) -> u64 {
        crate::clock::now_ms() + self.skew_ms.load(Ordering::Relaxed)
    }

    /// Moves the queue's clock forward (reservations expire, outage windows pass).
    pub fn advance(&self, ms: u64) {
        self.skew_ms.fetch_add(ms, Ordering::Relaxed);
    }

    /// The next `n` outcomes are refused (`u64::MAX`: every one, until
    /// told again), as a Redis that is away refuses them; paid calls too.
    pub fn refuse_outcomes(&self, n: u64) {
        self.refuse.store(n, Ordering::Relaxed);
    }

    /// Puts a record's task in the stream, as the producer does (a record
    /// already known is left alone: enqueue is idempotent).
    pub fn enqueue(&self, task: Task) -> bool {
        let mut s = self.lock();
        if s.states.contains_key(&task.rid) {
            return false;
        }
        s.states.insert(task.rid.clone(), RecordState::Queued);
        s.add_entry(task);
        true
    }

    /// Delivers the oldest waiting task to `consumer` (a claim).
    pub fn deliver(&self, consumer: &str) -> Option<Delivery> {
        let mut s = self.lock();
        let id = s.waiting.pop_front()?;
        let entry = s.entries.get_mut(&id)?;
        entry.held = Some((consumer.to_owned(), 1));
        Some(delivery(&id, consumer, 1, entry.task.clone()))
    }

    /// Delivers the task of `rid`'s entry again, to `consumer` (the
    /// rescuer's take-over of a hung worker's task: the earlier delivery is
    /// stale from now on).
    pub fn take_over(&self, rid: &str, consumer: &str) -> Option<Delivery> {
        let mut s = self.lock();
        let (id, entry) = s
            .entries
            .iter_mut()
            .find(|(_, e)| e.task.rid == rid && e.held.is_some())?;
        let n = entry.held.as_ref().map_or(0, |(_, n)| *n) + 1;
        entry.held = Some((consumer.to_owned(), n));
        Some(delivery(id, consumer, n, entry.task.clone()))
    }

    /// Moves the retries due by the queue's clock back to the stream
    /// (`promote.lua`: only those whose record still waits; no batch
    /// limit); returns how many it put back.
    pub fn promote(&self) -> usize {
        let now = self.now_ms();
        let mut s = self.lock();
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut s.delayed)
            .into_iter()
            .partition(|(at, _)| *at <= now);
        s.delayed = later;
        let mut moved = 0;
        for (_, task) in due {
            if s.states.get(&task.rid) == Some(&RecordState::Delayed) {
                s.states.insert(task.rid.clone(), RecordState::Queued);
                s.add_entry(task);
                moved += 1;
            }
        }
        moved
    }

    /// When the earliest retry waiting is due (Unix ms, the queue's clock).
    pub fn next_due(&self) -> Option<u64> {
        self.lock().delayed.iter().map(|(at, _)| *at).min()
    }

    pub fn state(&self, rid: &str) -> Option<RecordState> {
        self.lock().states.get(rid).cloned()
    }

    pub fn result(&self, rid: &str) -> Option<ResultRecord> {
        self.lock().results.get(rid).cloned()
    }

    pub fn review_entry(&self, rid: &str) -> Option<ReviewEntry> {
        self.lock().review.get(rid).cloned()
    }

    /// The ledger's paid calls, by key.
    pub fn paid(&self) -> Vec<PaidCall> {
        self.lock().paid.values().cloned().collect()
    }

    /// The spend counters: calls and nano-USD.
    pub fn spend(&self) -> (u64, u64) {
        let s = self.lock();
        (s.spend_calls, s.spend_nusd)
    }

    /// Entries still in the stream (waiting or delivered and not acknowledged).
    pub fn in_stream(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn halt_reason(&self) -> Option<String> {
        self.lock().halt.clone()
    }

    /// Lifts the halt (`producer resume`): the resume mark changes.
    pub fn resume(&self) {
        let mut s = self.lock();
        s.halt = None;
        s.resumes += 1;
    }

    pub fn is_down(&self) -> bool {
        self.lock().outage.down
    }

    pub fn outages(&self) -> u64 {
        self.lock().outage.outages
    }

    /// Sets the job's cap, in USD.
    pub fn set_budget_cap(&self, usd: f64) {
        self.lock().budget.cap = Some(common::ledger::nano_usd(usd));
    }

    /// The budget: spent and reserved, nano-USD.
    pub fn budget(&self) -> (u64, u64) {
        let b = &self.lock().budget;
        (b.spent, b.reserved)
    }

    pub fn audited(&self) -> BTreeSet<String> {
        self.lock().audit.clone()
    }
}

fn delivery(id: &str, consumer: &str, deliveries: u32, task: Task) -> Delivery {
    Delivery {
        partition: 0,
        entry_id: id.to_owned(),
        deliveries,
        consumer: consumer.to_owned(),
        claimed_at: tokio::time::Instant::now(),
        task,
        state_at_claim: None,
        shard: None,
    }
}

impl State {
    fn add_entry(&mut self, task: Task) {
        self.next_entry += 1;
        let id = format!("{}-0", self.next_entry);
        self.entries.insert(id.clone(), Entry { task, held: None });
        self.waiting.push_back(id);
    }

    fn is_live(&self, d: &Delivery) -> bool {
        self.entries
            .get(&d.entry_id)
            .and_then(|e| e.held.as_ref())
            .is_some_and(|(who, n)| *who == d.consumer && *n == d.deliveries)
    }

    /// `finish.lua`'s ledger step: a key new to the ledger is recorded and counted.
    fn pay(&mut self, call: &PaidCall) {
        let key = call.key();
        if self.paid.contains_key(&key) {
            return;
        }
        self.spend_calls += 1;
        self.spend_nusd += call.cost_nusd;
        self.paid.insert(key, call.clone());
    }

    /// `finish.lua`'s step for one live delivery: whether it moved the record.
    fn settle(&mut self, rid: &str, how: &Finish, audit: bool) -> bool {
        let state = match self.states.get(rid) {
            Some(RecordState::Batched) => Some(RecordState::Queued),
            other => other.cloned(),
        };
        let movable = matches!(state, Some(RecordState::Queued | RecordState::Delayed));
        let queued = state == Some(RecordState::Queued);
        let to = match how {
            Finish::Release(task) if queued => {
                self.add_entry(task.clone());
                RecordState::Queued
            }
            Finish::Retry { due_ms: 0, task } | Finish::Requeue(task) if queued => {
                self.add_entry(task.clone());
                RecordState::Queued
            }
            Finish::Retry { due_ms, task } if queued => {
                self.delayed.push((*due_ms, task.clone()));
                RecordState::Delayed
            }
            Finish::Release(_) | Finish::Retry { .. } | Finish::Requeue(_) => return false,
            _ if !movable => return false,
            Finish::Commit(result) => {
                if self.results.contains_key(rid) {
                    return false;
                }
                self.results.insert(rid.to_owned(), result.clone());
                if audit {
                    self.audit.insert(rid.to_owned());
                }
                RecordState::Done
            }
            Finish::Review(entry) => {
                self.review.insert(rid.to_owned(), entry.clone());
                RecordState::Review
            }
            Finish::Drop { reason } => RecordState::Dropped(reason.clone()),
            Finish::Cancel(task) => {
                self.cancelled.insert(rid.to_owned(), task.clone());
                RecordState::Cancelled
            }
        };
        self.states.insert(rid.to_owned(), to);
        true
    }

    /// `budget.lua`: reservations past their expiry are charged in full.
    fn expire_reservations(&mut self, now: u64) {
        let b = &mut self.budget;
        let expired: Vec<String> = b
            .held
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(m, _)| m.clone())
            .collect();
        for m in expired {
            b.held.remove(&m);
            let amount = member_amount(&m);
            b.reserved = b.reserved.saturating_sub(amount);
            b.spent += amount;
        }
    }
}

fn member_amount(member: &str) -> u64 {
    member.rsplit(':').next().and_then(|a| a.parse().ok()).unwrap_or(0)
}

fn ready<'a, T: Send + 'a>(value: T) -> Op<'a, T> {
    Box::pin(std::future::ready(Ok(value)))
}

impl JobQueue for MemoryQueue {
    fn check<'a>(&'a self, d: &'a Delivery) -> Op<'a, (Option<RecordState>, bool)> {
        let s = self.lock();
        ready((s.states.get(&d.task.rid).cloned(), s.is_live(d)))
    }

    fn ack<'a>(&'a self, d: &'a Delivery) -> Op<'a, ()> {
        self.lock().entries.remove(&d.entry_id);
        ready(())
    }

    fn finish<'a>(
        &'a self,
        d: &'a Delivery,
        how: &'a Finish,
        paid: Option<&'a PaidCall>,
        audit: bool,
    ) -> Op<'a, Finished> {
        let refused = self
            .refuse
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| match n {
                0 => None,
                u64::MAX => Some(u64::MAX),
                n => Some(n - 1),
            })
            .is_ok();
        if refused {
            return Box::pin(std::future::ready(Err(StoreError::Unreachable {
                url: "memory".into(),
                reason: "the test made the queue refuse outcomes".into(),
            })));
        }
        let mut s = self.lock();
        // The paid call first: it was paid, whatever happens to the outcome.
        if let Some(call) = paid {
            s.pay(call);
        }
        if !s.is_live(d) {
            return ready(Finished::Stale);
        }
        let moved = s.settle(&d.task.rid, how, audit);
        s.entries.remove(&d.entry_id);
        ready(if moved {
            Finished::Moved
        } else {
            Finished::AlreadySettled
        })
    }

    fn halt<'a>(&'a self, reason: &'a str) -> Op<'a, ()> {
        self.lock().halt.get_or_insert_with(|| reason.to_owned());
        ready(())
    }

    fn halted(&self) -> Op<'_, Option<String>> {
        ready(self.lock().halt.clone())
    }

    fn resume_mark(&self) -> Op<'_, String> {
        ready(self.lock().resumes.to_string())
    }

    fn halt_on_drift<'a>(&'a self, reason: &'a str, mark: &'a str) -> Op<'a, bool> {
        let mut s = self.lock();
        if s.resumes.to_string() != mark {
            return ready(false);
        }
        s.halt.get_or_insert_with(|| reason.to_owned());
        ready(true)
    }

    fn provider_failed<'a>(&'a self, call: &'a FailedCall<'a>, rules: &'a OutageRules) -> Op<'a, Noted> {
        let now = self.now_ms();
        let mut s = self.lock();
        let o = &mut s.outage;
        let started = now.saturating_sub(call.took.as_millis() as u64).max(o.ok_ms + 1);
        if !o.down {
            match o.since_ms {
                Some(since) if since > o.ok_ms => o.since_ms = Some(since.min(started)),
                _ => (o.since_ms, o.fails, o.rl_only) = (Some(started), 0, true),
            }
        }
        let since = o.since_ms.unwrap_or(started);
        o.fails += 1;
        o.rl_only &= call.rate_limited;
        let answered_ms = o.ok_ms;
        let noted = |state, next_probe_ms| Noted {
            state,
            since_ms: since,
            now_ms: now,
            answered_ms,
            next_probe_ms,
        };
        if o.down {
            if call.probe {
                o.probes += 1;
                let age = Duration::from_millis(now.saturating_sub(o.down_ms));
                o.probe_at = now + rules.probe_wait(o.probes, age).as_millis() as u64;
                return ready(noted(Provider::Down, o.probe_at));
            }
            return ready(noted(Provider::Down, 0));
        }
        let window = if o.rl_only { rules.window_429 } else { rules.window };
        if o.fails >= u64::from(rules.min_fails) && now.saturating_sub(since) >= window.as_millis() as u64 {
            let answered = noted(Provider::DownNow, 0);
            (o.down, o.probes, o.probe_at, o.down_ms) = (true, 0, now + 1000, now);
            o.outages += 1;
            return ready(answered);
        }
        ready(noted(Provider::Up, 0))
    }

    fn provider_answered(&self) -> Op<'_, Option<(u64, u64)>> {
        let now = self.now_ms();
        let mut s = self.lock();
        let o = &mut s.outage;
        o.ok_ms = now;
        if o.down {
            (o.down, o.probes, o.probe_at) = (false, 0, 0);
            return ready(Some((o.since_ms.unwrap_or(now), now)));
        }
        ready(None)
    }

    fn breaker_count<'a>(&'a self, signature: &'a str) -> Op<'a, u64> {
        let mut s = self.lock();
        let n = s.breaker.entry(signature.to_owned()).or_default();
        *n += 1;
        ready(*n)
    }

    fn mark_proven(&self) -> Op<'_, ()> {
        self.lock().proven = true;
        ready(())
    }

    fn remember_form<'a>(&'a self, endpoint: &'a str, form: &'a str) -> Op<'a, ()> {
        self.lock().forms.insert(endpoint.to_owned(), form.to_owned());
        ready(())
    }

    fn budget_reserve<'a>(&'a self, lease_ms: u64, calls: &'a [(String, u64)]) -> Op<'a, Vec<Reserved>> {
        let now = self.now_ms();
        let mut s = self.lock();
        s.expire_reservations(now);
        let mut out = Vec::new();
        let mut halted = false;
        for (id, amount) in calls {
            let b = &mut s.budget;
            let fits = |with: u64| b.cap.is_none_or(|cap| with + amount <= cap);
            let got = if halted {
                Reserved::Halted
            } else if fits(b.spent + b.reserved) {
                b.reserved += amount;
                b.held.insert(format!("{id}:{amount}"), now + lease_ms);
                Reserved::Granted
            } else if fits(b.spent) {
                Reserved::Wait
            } else {
                halted = true;
                let reason = format!(
                    "budget: spent {:.6} USD ({:.6} USD more in flight) of the job's {:.6} USD; a call costs up to {:.6}; raise it with producer resume --budget",
                    b.spent as f64 / 1e9,
                    b.reserved as f64 / 1e9,
                    b.cap.unwrap_or(0) as f64 / 1e9,
                    *amount as f64 / 1e9
                );
                s.halt.get_or_insert(reason);
                Reserved::Halted
            };
            out.push(got);
        }
        ready(out)
    }

    fn budget_settle<'a>(&'a self, calls: &'a [(String, u64, u64)]) -> Op<'a, ()> {
        let now = self.now_ms();
        let mut s = self.lock();
        s.expire_reservations(now);
        let b = &mut s.budget;
        for (id, reserved, actual) in calls {
            if b.held.remove(&format!("{id}:{reserved}")).is_some() {
                b.reserved = b.reserved.saturating_sub(*reserved);
                b.spent += actual;
            } else if actual > reserved {
                b.spent += actual - reserved;
            }
        }
        ready(())
    }
}

impl std::fmt::Debug for MemoryQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.lock();
        f.debug_struct("MemoryQueue")
            .field("records", &s.states.len())
            .field("in_stream", &s.entries.len())
            .field("halt", &s.halt)
            .finish()
    }
}

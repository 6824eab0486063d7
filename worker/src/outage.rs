//! A job's provider outage as this worker sees it (the fleet's state is in
//! Redis, see `outage.lua`): every transiently failed call joins the
//! fleet's streak, answers end it; while the provider is taken for down the
//! claimer sends one probe at a time (leased fleet-wide) instead of real
//! work, and the first answer resumes everyone. The outage is logged once
//! at WARN when this worker learns it started and once when it ended, and
//! an outage that outlasts the job's budget halts the job.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::decision::ProviderState;
use common::store::{FailedCall, OutageRules, Provider, ProviderOutage, RedisStore, StoreError};
use common::task::{Delivery, Task};

use crate::provider::{CallError, ErrorKind};
use crate::queue::JobQueue;

/// How often, at most, this worker tells the fleet its calls are answered
/// while the provider is up (at once while it is down).
const ANSWER_NOTE_EVERY: Duration = Duration::from_secs(1);

/// Whose the next probe is, as far as this worker knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Turn {
    /// The fleet's: whoever asks Redis for the lease first, when it is free.
    Fleet,
    /// This worker's: its probe failed (with a 429 or not) and Redis gave
    /// it the next one's lease.
    Mine { after_429: bool },
}

/// A probe's lease leaves this much of it past the probe's call (its
/// provider's timeout): a worker sends the probe its failed probe left it
/// without asking only in the first half of that.
pub const PROBE_MARGIN: Duration = Duration::from_secs(10);

/// A failed probe's delivery is kept for the next probe only when that
/// probe is due within this (an outage's first two minutes: its probes
/// 1 to 10 s apart): while it is kept the partition holds a pending entry,
/// which every worker's rescuer looks at every quarter of the visibility
/// timeout, and across a longer wait those looks cost a fleet more than
/// the claim and the trip back through the stream the keeping saves
/// (`make bench-waiting`: an hour-old outage, probes 30 s apart, 8
/// workers, 0.89 commands a second per worker without, 0.99 with).
pub const KEEP_ACROSS: Duration = Duration::from_secs(10);

/// Whether a kept delivery, claimed (or last renewed) `since_claim` ago,
/// must be renewed before its probe is sent. Not while its claim is as
/// fresh as the claim path counts one (a state read with the claim is
/// trusted for a quarter of the visibility timeout: `process::run_attempt`)
/// and the probe's call, its `lease` at most, ends before the delivery
/// could idle past `visibility` (no rescuer can take it over mid-call).
/// A young outage's probes, 5 s apart, renew one in three.
pub fn needs_renewal(since_claim: Duration, lease: Duration, visibility: Duration) -> bool {
    since_claim >= (visibility / 4).min(visibility.saturating_sub(lease))
}

/// Whether the probe this worker may send takes a rate grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeGrant {
    /// It takes one, as any call: its lease was asked of the fleet (the
    /// outage's first probe among them), or its worker's last probe was
    /// refused with a 429 (the provider's limit may be what fails).
    Take,
    /// It may go without one where the told limits spare probes
    /// ([`crate::limiter::Limiter::spares_probes`]): its lease is the one
    /// its worker's own failed probe left it, and that failure was no 429
    /// (the provider fails whatever the pace; one probe at a time cannot
    /// strain its limits).
    Spare,
}

/// One job's provider outage in this worker.
pub struct OutageWatch {
    rules: OutageRules,
    budget_ms: u64,
    /// Where the calls go, redacted (for the fleet's state and messages).
    base_url: String,
    /// The provider is taken for down (from Redis, or a script's answer).
    down: AtomicBool,
    /// The start of the streak that took it down (Unix ms, Redis's clock).
    since_ms: AtomicU64,
    /// When this worker last told the fleet it got an answer.
    answer_noted: Mutex<Option<Instant>>,
    /// The record whose call is the probe this worker is sending, and when
    /// it was claimed (just after its lease was taken).
    probe: Mutex<Option<(String, Instant)>>,
    /// While down: when to ask the fleet for the probe's lease again: when
    /// Redis last said the next probe may start (a wake-up does not ask
    /// sooner; the others learn it when a probe's lease or wait ends), or,
    /// marked `Mine`, when this worker's probe failed and the failure's
    /// answer gave it the next probe's lease from then on: it sends that
    /// probe without asking.
    next_probe: Mutex<Option<(Instant, Turn)>>,
    /// The probe's lease (its call's whole timeout and a margin), as the
    /// claimer last asked for it: a failed probe holds the next one's for as long.
    lease_ms: AtomicU64,
    /// Counts this worker's probes that ended: an answer Redis gave that
    /// raced a probe's end named that probe's own lease and is not kept in
    /// `next_probe`.
    probes_ended: AtomicU64,
    /// The record whose probe failed and left this worker the next probe's
    /// lease: its delivery may be kept for that probe ([`OutageWatch::keep`]).
    keepable: Mutex<Option<String>>,
    /// The delivery of this worker's failed probe, kept for its next probe
    /// (its task holds the failed call in its history, as the stream would):
    /// that probe sends it again without a claim, and the failure did not
    /// put it back on the stream (#32 item 6: 9 of a probe's 13 commands).
    kept: Mutex<Option<Delivery>>,
}

impl OutageWatch {
    pub fn new(budget_ms: u64, base_url: &str) -> OutageWatch {
        OutageWatch::with_rules(budget_ms, base_url, OutageRules::default())
    }

    /// With other rules than the fleet's (tests that take a provider down quickly).
    pub fn with_rules(budget_ms: u64, base_url: &str, rules: OutageRules) -> OutageWatch {
        OutageWatch {
            rules,
            budget_ms,
            base_url: common::secret::redact_url(base_url),
            down: AtomicBool::new(false),
            since_ms: AtomicU64::new(0),
            answer_noted: Mutex::new(None),
            probe: Mutex::new(None),
            next_probe: Mutex::new(None),
            lease_ms: AtomicU64::new(0),
            probes_ended: AtomicU64::new(0),
            keepable: Mutex::new(None),
            kept: Mutex::new(None),
        }
    }

    /// Where the job's calls go, redacted.
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::Relaxed)
    }

    /// The provider as [`common::decision::decide`] takes it, for a record
    /// whose calls have failed since `failing_since` (Unix ms; 0: its last
    /// call did not fail) while the fleet last got an answer at
    /// `answered_ms`. Only a failing streak during which others were
    /// answered counts against the record: while every call fails, it is the
    /// provider's outage (declared or not yet), never the record's.
    pub fn provider_state(&self, failing_since: u64, answered_ms: u64, now_ms: u64) -> ProviderState {
        if self.is_down() {
            return ProviderState::Down;
        }
        let failing_ms = if failing_since > 0 && answered_ms > failing_since {
            now_ms.saturating_sub(failing_since)
        } else {
            0
        };
        ProviderState::Up { failing_ms }
    }

    /// Sets this worker's view; logs when it changes.
    fn set(&self, job: &str, down: bool, since_ms: u64, why: impl FnOnce() -> String) {
        if down {
            self.since_ms.store(since_ms, Ordering::Relaxed);
        }
        if self.down.swap(down, Ordering::Relaxed) == down {
            return;
        }
        if down {
            // A turn left from an outage that ended is no one's now.
            *self.next_probe.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
        let since = common::manifest::rfc3339(since_ms / 1000);
        if down {
            tracing::warn!(
                job = %job,
                since = %since,
                budget_s = self.budget_ms / 1000,
                base_url = %self.base_url,
                "provider unavailable: {}; records wait in the queue and one probe at a time checks the provider",
                why()
            );
        } else {
            tracing::warn!(job = %job, since = %since, base_url = %self.base_url, "provider back: {}; resuming", why());
        }
    }

    /// The fleet's state, read by the watcher.
    pub fn from_redis(&self, job: &str, o: &ProviderOutage) {
        if !o.down {
            *self.probe.lock().unwrap_or_else(|e| e.into_inner()) = None;
            *self.next_probe.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
        self.set(job, o.down, o.since_ms, || {
            if o.down {
                format!(
                    "{} calls failed since {}, last error {}{}",
                    o.failed_calls,
                    common::manifest::rfc3339(o.since_ms / 1000),
                    o.last_error,
                    if o.message.is_empty() {
                        String::new()
                    } else {
                        format!(": {}", o.message)
                    }
                )
            } else {
                "another worker's call was answered".to_owned()
            }
        });
    }

    /// A call for `rid` failed transiently (or with a 429) after `took`:
    /// joins the fleet's streak. Returns when the fleet last got an answer
    /// (Unix ms), and the reason to halt the job when the provider has been
    /// down for longer than the job's budget.
    pub async fn failed(
        &self,
        queue: &dyn JobQueue,
        job: &str,
        rid: &str,
        err: &CallError,
        took: Duration,
        worker: &str,
    ) -> Result<(u64, Option<String>), StoreError> {
        let message = err.message.as_deref().unwrap_or("");
        let words = if message.is_empty() {
            String::new()
        } else {
            format!(": {message}")
        };
        let call = FailedCall {
            took,
            cause: &err.cause,
            rate_limited: err.kind == ErrorKind::RateLimited,
            message,
            base_url: &self.base_url,
            worker,
            probe: self.is_probe(rid),
            lease: Duration::from_millis(self.lease_ms.load(Ordering::Relaxed)),
        };
        let noted = queue.provider_failed(&call, &self.rules).await?;
        if call.probe {
            // The probe ends once Redis holds the next probe's time, and
            // said it: kept, and the next probe is this worker's (the
            // claimer asks nothing while the probe is out, nor when the
            // next is due; should the store fail, the task's end gives the
            // lease back instead).
            let next = (noted.next_probe_ms > 0).then(|| {
                let wait = Duration::from_millis(noted.next_probe_ms.saturating_sub(noted.now_ms));
                (
                    wait,
                    Turn::Mine {
                        after_429: call.rate_limited,
                    },
                )
            });
            *self.keepable.lock().unwrap_or_else(|e| e.into_inner()) = next.map(|_| rid.to_owned());
            self.end_probe(rid, next);
        }
        let (since_ms, now_ms) = (noted.since_ms, noted.now_ms);
        if noted.state == Provider::Up {
            if self.is_down() {
                // The outage ended and this worker had not heard yet: what
                // it decides for this record is decided with the provider
                // up, as the watcher would have it.
                let up = ProviderOutage {
                    since_ms,
                    ..ProviderOutage::default()
                };
                self.from_redis(job, &up);
            }
            return Ok((noted.answered_ms, None));
        }
        let since = common::manifest::rfc3339(since_ms / 1000);
        self.set(job, true, since_ms, || {
            format!("calls fail fleet-wide since {since}, last error {}{words}", err.cause)
        });
        let lasted = now_ms.saturating_sub(since_ms);
        if lasted < self.budget_ms {
            return Ok((noted.answered_ms, None));
        }
        let halt = format!(
            "provider unavailable for {} (since {since}, the job's retry.outage_budget_secs is {}): \
             last error {} from {}{words}",
            common::manifest::human_duration(lasted),
            self.budget_ms / 1000,
            err.cause,
            self.base_url,
        );
        Ok((noted.answered_ms, Some(halt)))
    }

    /// A call for `rid` was answered (valid or not: the provider is up).
    /// Tells the fleet at most once a second, at once while the provider is down.
    pub async fn answered(&self, queue: &dyn JobQueue, job: &str, rid: &str) -> Result<(), StoreError> {
        self.probe_ended(rid);
        {
            let mut noted = self.answer_noted.lock().unwrap_or_else(|e| e.into_inner());
            if !self.is_down() && noted.is_some_and(|at| at.elapsed() < ANSWER_NOTE_EVERY) {
                return Ok(());
            }
            *noted = Some(Instant::now());
        }
        let ended = queue.provider_answered().await?;
        if self.is_down() || ended.is_some() {
            let (since_ms, now_ms) = ended.unwrap_or((self.since_ms.load(Ordering::Relaxed), 0));
            self.set(job, false, since_ms, || match ended {
                Some(_) => format!(
                    "a call was answered after {} of failures",
                    common::manifest::human_duration(now_ms.saturating_sub(since_ms))
                ),
                None => "a call was answered".to_owned(),
            });
        }
        Ok(())
    }

    /// While the provider is down: takes the fleet's probe lease for
    /// `lease` (Ok: this worker sends the probe, and whether it takes a
    /// rate grant), or says how long until it may ask again (known from
    /// Redis's last answer: Redis is not asked again before then, nor while
    /// this worker's own probe is out). The worker whose probe failed holds
    /// the next one's lease from its start: it sends it then without
    /// asking, within half of [`PROBE_MARGIN`] (later it asks, as a late
    /// claimer must: its call could outlast the lease). An answer that
    /// raced this worker's probe's end names that probe's lease: it holds
    /// for this round only (the probe's end wakes the claimer, which asks
    /// again unless the failure said when).
    pub async fn take_probe(
        &self,
        store: &RedisStore,
        job: &str,
        lease: Duration,
        worker: &str,
    ) -> Result<Result<ProbeGrant, Duration>, StoreError> {
        self.lease_ms.store(lease.as_millis() as u64, Ordering::Relaxed);
        if let Some(known) = self.known_turn() {
            return Ok(known);
        }
        let now = Instant::now();
        if let Some(left) = self.own_probe_out(lease) {
            return Ok(Err(left));
        }
        let ended = self.probes_ended.load(Ordering::SeqCst);
        let taken = store.outage_probe(job, lease, worker).await?;
        let mut next = self.next_probe.lock().unwrap_or_else(|e| e.into_inner());
        if self.probes_ended.load(Ordering::SeqCst) == ended {
            *next = taken.err().map(|wait| (now + wait, Turn::Fleet));
        }
        Ok(taken.map(|()| ProbeGrant::Take))
    }

    /// [`OutageWatch::take_probe`] as far as this worker knows without
    /// asking: the wait Redis last gave, or the lease its own failed probe
    /// left it, taken (within half of [`PROBE_MARGIN`] of its start).
    fn known_turn(&self) -> Option<Result<ProbeGrant, Duration>> {
        let now = Instant::now();
        let mut next = self.next_probe.lock().unwrap_or_else(|e| e.into_inner());
        match *next {
            Some((at, _)) if at > now => Some(Err(at - now)),
            Some((at, Turn::Mine { after_429 })) if now < at + PROBE_MARGIN / 2 => {
                *next = None;
                Some(Ok(if after_429 { ProbeGrant::Take } else { ProbeGrant::Spare }))
            }
            _ => None,
        }
    }

    /// While this worker's own probe is out, what is left of its `lease`:
    /// the lease is the fleet's until the probe ends, and its end wakes the
    /// claimer (Redis is not asked meanwhile, unless the lease ran out: a
    /// probe task that never ended).
    fn own_probe_out(&self, lease: Duration) -> Option<Duration> {
        let probe = self.probe.lock().unwrap_or_else(|e| e.into_inner());
        let (_, taken) = probe.as_ref()?;
        lease.checked_sub(taken.elapsed())
    }

    /// A stopping worker gives back the next probe's lease its failed probe
    /// left it: a worker that asks for it then may take it when due (those
    /// that asked already wait out the lease they were told of).
    pub async fn leave(&self, store: &RedisStore, job: &str, worker: &str) -> Result<(), StoreError> {
        let mine = {
            let mut next = self.next_probe.lock().unwrap_or_else(|e| e.into_inner());
            let mine = matches!(*next, Some((_, Turn::Mine { .. })));
            if mine {
                *next = None;
            }
            mine
        };
        if mine {
            store.outage_leave(job, worker).await?;
        }
        Ok(())
    }

    /// Keeps the delivery `d` of this worker's failed probe, its task now
    /// `task`, for the next probe, when that probe is this worker's (the
    /// failure left it the lease), the provider is still down, and the
    /// probe is due within [`KEEP_ACROSS`] and soon enough to renew the
    /// delivery before its idle time reaches `visibility` (else a rescuer
    /// would take it over: the failed calls' history would be lost, and
    /// the redelivery count an attempt).
    /// None when kept; else `task` back, to be stored. Only a first
    /// delivery is kept (a redelivery's count is already in its task's attempts).
    pub fn keep(&self, d: &Delivery, task: Task, visibility: Duration) -> Option<Task> {
        let mine = self.keepable.lock().unwrap_or_else(|e| e.into_inner()).take();
        if mine.as_deref() != Some(d.task.rid.as_str()) || d.deliveries != 1 || d.shard.is_some() {
            return Some(task);
        }
        let due = match *self.next_probe.lock().unwrap_or_else(|e| e.into_inner()) {
            Some((at, Turn::Mine { .. })) => at.saturating_duration_since(Instant::now()),
            _ => return Some(task),
        };
        if due > KEEP_ACROSS || d.claimed_at.elapsed() + due + PROBE_MARGIN >= visibility {
            return Some(task);
        }
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        if kept.is_some() || !self.is_down() {
            return Some(task);
        }
        *kept = Some(Delivery { task, ..d.clone() });
        None
    }

    /// The kept delivery, for this worker's next probe, or to be given
    /// back (`for_probe` false); a kept delivery is given back when this
    /// worker learns the next probe is not its own (another worker holds
    /// the lease, or the outage ended or began again).
    pub fn take_kept(&self, for_probe: bool) -> Option<Delivery> {
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        if for_probe || !self.own_turn_next() {
            kept.take()
        } else {
            None
        }
    }

    /// Puts back a kept delivery that could not be sent this round.
    pub fn put_back(&self, d: Delivery) {
        *self.kept.lock().unwrap_or_else(|e| e.into_inner()) = Some(d);
    }

    /// Whether the next probe is this worker's own (its failed probe left
    /// it the lease, and it is not yet due or taken) while the provider is down.
    fn own_turn_next(&self) -> bool {
        self.is_down()
            && matches!(
                *self.next_probe.lock().unwrap_or_else(|e| e.into_inner()),
                Some((_, Turn::Mine { .. }))
            )
    }

    /// The probe's lease found no task to send: given back.
    pub async fn no_probe(&self, store: &RedisStore, job: &str) -> Result<(), StoreError> {
        store.outage_unprobe(job).await
    }

    /// The call for `rid` is this worker's probe.
    pub fn set_probe(&self, rid: &str) {
        *self.probe.lock().unwrap_or_else(|e| e.into_inner()) = Some((rid.to_owned(), Instant::now()));
    }

    /// Whether the call for `rid` is this worker's probe.
    pub fn is_probe(&self, rid: &str) -> bool {
        self.probe
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_some_and(|(probe, _)| probe == rid)
    }

    /// The probe's call for `rid` came back, or its task ended without one:
    /// true when `rid` was still the probe (a task that ends so made no
    /// call, and its lease is given back). The fleet is asked again for
    /// the next probe's time at the next claim round, unless the probe's
    /// failure says it (see [`OutageWatch::failed`]).
    pub fn probe_ended(&self, rid: &str) -> bool {
        self.end_probe(rid, None)
    }

    /// [`OutageWatch::probe_ended`]: the next probe's time is `next` from
    /// now (this worker's own turn) when the probe's failure said it, else
    /// asked afresh (under `next_probe`'s lock: an answer racing this is
    /// not kept).
    fn end_probe(&self, rid: &str, next: Option<(Duration, Turn)>) -> bool {
        let mut probe = self.probe.lock().unwrap_or_else(|e| e.into_inner());
        if probe.as_ref().is_none_or(|(probe, _)| probe != rid) {
            return false;
        }
        *probe = None;
        drop(probe);
        let mut at = self.next_probe.lock().unwrap_or_else(|e| e.into_inner());
        self.probes_ended.fetch_add(1, Ordering::SeqCst);
        *at = next.map(|(wait, turn)| (Instant::now() + wait, turn));
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_s_own_failures_count_only_while_the_provider_is_up() {
        let w = OutageWatch::new(60_000, "http://user:pw@127.0.0.1:9/v1");
        assert_eq!(w.base_url, "http://user:***@127.0.0.1:9/v1", "never the password");
        // Others were answered at 20 s while this record failed since 1 s.
        assert_eq!(
            w.provider_state(1_000, 20_000, 31_000),
            ProviderState::Up { failing_ms: 30_000 }
        );
        assert_eq!(
            w.provider_state(1_000, 900, 31_000),
            ProviderState::Up { failing_ms: 0 },
            "nothing answered since it began failing: the provider's outage, not the record's"
        );
        assert_eq!(
            w.provider_state(0, 20_000, 31_000),
            ProviderState::Up { failing_ms: 0 },
            "not failing"
        );
        w.set("j", true, 5, String::new);
        assert_eq!(w.provider_state(1_000, 20_000, 31_000), ProviderState::Down);
        w.set("j", false, 5, String::new);
        assert!(!w.is_down());
    }

    #[test]
    fn the_probe_mark_is_the_record_s_until_its_task_ends() {
        let w = OutageWatch::new(1, "http://h/v1");
        w.set_probe("r1");
        // An ask that raced the probe named its own lease's end.
        let lease_end = Instant::now() + Duration::from_secs(40);
        *w.next_probe.lock().unwrap() = Some((lease_end, Turn::Fleet));
        assert!(w.is_probe("r1") && !w.is_probe("r2"));
        assert!(!w.probe_ended("r2"));
        assert_eq!(
            *w.next_probe.lock().unwrap(),
            Some((lease_end, Turn::Fleet)),
            "not its probe"
        );
        let lease = Duration::from_secs(40);
        assert!(w.own_probe_out(lease).is_some_and(|left| left <= lease));
        assert!(w.probe_ended("r1"));
        assert!(!w.is_probe("r1"));
        assert_eq!(w.own_probe_out(lease), None, "no probe out");
        assert_eq!(
            *w.next_probe.lock().unwrap(),
            None,
            "its probe came back: the fleet is asked for the next one's time at once"
        );
    }

    #[test]
    fn a_probe_whose_lease_ran_out_no_longer_holds_the_claimer_back() {
        let w = OutageWatch::new(1, "http://h/v1");
        w.set_probe("r1");
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(
            w.own_probe_out(Duration::from_millis(1)),
            None,
            "a probe task that outlived its lease: Redis is asked again"
        );
        assert!(w.own_probe_out(Duration::from_secs(60)).is_some());
    }

    /// The lease a failed probe's answer gave this worker is taken without
    /// asking once due, within half of the lease's margin past the call
    /// (later Redis is asked); its probe may spare its rate grant after a
    /// failure that was no 429, not after a 429.
    #[test]
    fn a_failed_probe_s_lease_is_taken_when_due_and_spares_the_grant_unless_it_was_a_429() {
        let w = OutageWatch::new(1, "http://h/v1");
        let now = Instant::now();
        let mine = |at, after_429| *w.next_probe.lock().unwrap() = Some((at, Turn::Mine { after_429 }));
        mine(now + Duration::from_secs(3), false);
        assert!(matches!(w.known_turn(), Some(Err(wait)) if wait <= Duration::from_secs(3)));
        mine(now - Duration::from_secs(1), false);
        assert_eq!(w.known_turn(), Some(Ok(ProbeGrant::Spare)));
        assert_eq!(w.known_turn(), None, "taken once: then Redis is asked");
        mine(now - Duration::from_secs(1), true);
        assert_eq!(w.known_turn(), Some(Ok(ProbeGrant::Take)), "after a 429");
        mine(now - PROBE_MARGIN / 2, false);
        assert_eq!(
            w.known_turn(),
            None,
            "too late: its call could outlast the lease; Redis is asked"
        );
        *w.next_probe.lock().unwrap() = Some((now - Duration::from_secs(1), Turn::Fleet));
        assert_eq!(w.known_turn(), None, "another's turn: Redis is asked");
    }

    fn delivery(rid: &str, deliveries: u32) -> Delivery {
        Delivery {
            partition: 0,
            entry_id: "1-0".into(),
            deliveries,
            consumer: "w1".into(),
            claimed_at: tokio::time::Instant::now(),
            task: Task::new(rid, "{}", "").unwrap(),
            state_at_claim: None,
            shard: None,
        }
    }

    /// A kept delivery goes out without its renewal while its claim is
    /// fresh and the probe's call ends before the visibility timeout.
    #[test]
    fn a_kept_delivery_is_renewed_once_its_claim_is_stale_or_the_call_could_outlast_it() {
        let s = Duration::from_secs;
        // The example's provider timeout (30 s) and its visibility (60 s): fresh for 15 s.
        let (lease, visibility) = (s(30) + PROBE_MARGIN, s(60));
        assert!(!needs_renewal(s(0), lease, visibility));
        assert!(!needs_renewal(s(14), lease, visibility), "fresh");
        assert!(
            needs_renewal(s(15), lease, visibility),
            "a quarter of the visibility timeout"
        );
        // A visibility timeout barely past the call: the call's end binds first.
        let visibility = s(45);
        assert!(!needs_renewal(s(4), lease, visibility));
        assert!(
            needs_renewal(s(5), lease, visibility),
            "the call could end past the visibility timeout"
        );
        assert!(needs_renewal(s(0), lease, s(40)), "no room at all");
    }

    /// A failed probe's delivery is kept only for the next probe of the
    /// worker its failure left the lease (a first delivery, from a stream,
    /// the provider still down, the probe due before a rescuer could take
    /// the delivery over), and given back once the next probe is not its own.
    #[test]
    fn a_failed_probe_s_delivery_is_kept_only_for_its_worker_s_own_next_probe() {
        let w = OutageWatch::new(60_000, "http://h/v1");
        w.set("j", true, 5, String::new);
        let visibility = Duration::from_secs(40);
        let d = delivery("r1", 1);
        let keepable = |rid: &str| *w.keepable.lock().unwrap() = Some(rid.to_owned());
        let turn = |t, due: u64| *w.next_probe.lock().unwrap() = Some((Instant::now() + Duration::from_secs(due), t));
        let mine = Turn::Mine { after_429: false };
        turn(mine, 2);
        assert!(
            w.keep(&d, d.task.clone(), visibility).is_some(),
            "no failure left it the lease"
        );
        keepable("r2");
        assert!(
            w.keep(&d, d.task.clone(), visibility).is_some(),
            "another record's failure did"
        );
        keepable("r1");
        assert!(
            w.keep(&delivery("r1", 2), d.task.clone(), visibility).is_some(),
            "a redelivery"
        );
        keepable("r1");
        let batched = Delivery {
            shard: Some("s1".into()),
            ..d.clone()
        };
        assert!(w.keep(&batched, d.task.clone(), visibility).is_some(), "a shard's task");
        keepable("r1");
        turn(mine, 11);
        assert!(
            w.keep(&d, d.task.clone(), visibility).is_some(),
            "its probe due past KEEP_ACROSS (an outage past its young probes)"
        );
        keepable("r1");
        turn(mine, 4);
        assert!(
            w.keep(&d, d.task.clone(), Duration::from_secs(14)).is_some(),
            "its probe due too late for the visibility timeout: a rescuer could take it over first"
        );
        keepable("r1");
        turn(Turn::Fleet, 2);
        assert!(
            w.keep(&d, d.task.clone(), visibility).is_some(),
            "the next probe is the fleet's"
        );
        keepable("r1");
        turn(mine, 2);
        let mut failed = d.task.clone();
        failed.calls = 1;
        assert!(w.keep(&d, failed, visibility).is_none(), "kept");
        assert!(w.take_kept(false).is_none(), "kept while the next probe is its own");
        let kept = w.take_kept(true).expect("for that probe");
        assert_eq!(
            (kept.task.rid.as_str(), kept.task.calls),
            ("r1", 1),
            "its task as the failure left it"
        );
        w.put_back(kept.clone());
        turn(Turn::Fleet, 2);
        assert!(
            w.take_kept(false).is_some(),
            "given back: the next probe is the fleet's"
        );
        w.put_back(kept);
        turn(mine, 2);
        w.set("j", false, 5, String::new);
        assert!(w.take_kept(false).is_some(), "given back: the provider is up");
        keepable("r1");
        turn(mine, 2);
        assert!(
            w.keep(&d, d.task.clone(), visibility).is_some(),
            "the provider is up: it goes back"
        );
    }

    /// A worker that still takes the provider for down learns from its
    /// next failure that the fleet does not (the outage ended and its
    /// wake-up had not reached it): the record it settles is settled with
    /// the provider up (a retry that wakes the fleet, not a requeue for a
    /// probe that will never come).
    #[tokio::test]
    async fn a_failure_the_fleet_takes_for_up_ends_a_stale_outage_view() {
        let queue = crate::queue::MemoryQueue::new();
        let w = OutageWatch::new(60_000, "http://h/v1");
        w.set("j", true, 5, String::new);
        let err = CallError {
            kind: ErrorKind::Transient,
            cause: "http_503".into(),
            status: Some(503),
            retry_after_ms: None,
            message: None,
        };
        let (_, halt) = w
            .failed(&queue, "j", "r1", &err, Duration::from_millis(5), "w1")
            .await
            .unwrap();
        assert_eq!(halt, None);
        assert!(!w.is_down(), "one failure is no outage for the fleet");
    }
}

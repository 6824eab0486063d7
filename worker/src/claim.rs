//! The claim service: takes a concurrency permit, then new tasks (this
//! consumer's own pending ones on the first round), under the fleet's
//! rate-limit budget, and starts each on the tracker.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::store::Bound;
use tokio::sync::OwnedSemaphorePermit;

use crate::fleet::{Fleet, HeldGrants, STORE_ERROR_PAUSE};
use crate::job::JobCtx;
use crate::limiter::Grant;
use crate::outage::{PROBE_MARGIN, ProbeGrant, needs_renewal};
use crate::plan::Route;
use crate::service::Service;

/// The longest wait for the fleet's budget before asking again (a slot
/// freed anywhere in the fleet wakes the claimer sooner).
const MAX_BUDGET_WAIT: Duration = Duration::from_secs(10);
/// How often a `--drain` worker with nothing in flight checks whether the jobs are complete.
const DRAIN_CHECK: Duration = Duration::from_secs(1);

/// At most this share of a worker's slots (one in AHEAD_SHARE) holds tasks
/// that wait for their grant's time (grants given ahead of the buckets);
/// once it does, the claimer asks again when only half as many wait. A
/// worker whose slots hold less than the time grants may be given ahead
/// (a second of the rate: 80 calls at 4,800 a minute, for 64 slots) would
/// otherwise fill them all with waiting tasks, and then ask for one grant
/// and claim one task each time a call ends and frees one (`make
/// bench-ratelimit`, `RPM=4800`: one worker made 1.05 acquires and 4 Redis
/// round trips a model call where four made 0.03 and 0.36).
const AHEAD_SHARE: usize = 4;

/// The claimer's state between rounds.
pub struct Claimer {
    fleet: Arc<Fleet>,
    /// The first round reads this consumer's own pending entries.
    own_pending: bool,
    /// Grants asked for per round follow what the last round could claim,
    /// so an idle or nearly drained job does not take and give back a full
    /// block of grants on every poll.
    last_claimed: usize,
    rounds: u32,
    /// Fired when `--drain` finds every job complete.
    drained: tokio_util::sync::CancellationToken,
    /// When `--drain` last asked Redis whether the jobs are complete.
    drain_checked: Option<std::time::Instant>,
    /// This round is the idle poll's (no wake-up came since an empty
    /// round): a job is claimed from only when a partition may hold
    /// undelivered tasks (no grant asked and given back for nothing).
    polling: bool,
    /// Per job, when its rate buckets can give grants again (asking sooner
    /// gets nothing: a settlement's wake-up does not make the claimer ask).
    budget_at: std::collections::HashMap<(String, Route), tokio::time::Instant>,
    /// Per job, when the grants go that the tasks it claimed still wait
    /// for (grants given ahead of the buckets; see [`AHEAD_SHARE`]).
    ahead: std::collections::HashMap<(String, Route), Vec<tokio::time::Instant>>,
}

/// What one claim round did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Round {
    pub claimed: usize,
    /// Nothing was claimed for want of budget: the shortest wait the limiter named.
    pub limited: Option<Duration>,
    /// A job's provider is down and another worker's probe (or the wait
    /// between probes) holds the lease: how long until the next may start.
    pub probe_wait: Option<Duration>,
}

fn sooner(a: Option<Duration>, b: Duration) -> Option<Duration> {
    Some(a.map_or(b, |a| a.min(b)))
}

impl Claimer {
    pub fn new(fleet: Arc<Fleet>, drained: tokio_util::sync::CancellationToken) -> Claimer {
        Claimer {
            fleet,
            own_pending: true,
            last_claimed: usize::MAX,
            rounds: 0,
            drained,
            drain_checked: None,
            polling: false,
            budget_at: Default::default(),
            ahead: Default::default(),
        }
    }

    /// One claim round over every job that is neither halted nor cancelled.
    /// Waits for a free permit first (a saturated worker does not hoard
    /// tasks); claims nothing while a dead worker's tasks wait to be taken over.
    pub async fn claim_round(&mut self) -> Round {
        let f = self.fleet.clone();
        let mut round = Round::default();
        if f.reclaim_backlog.load(Ordering::Relaxed) > 0 {
            return round;
        }
        // Cancellable while it waits: a stopped worker claims nothing more.
        let first = tokio::select! {
            permit = f.permits.clone().acquire_owned() => permit,
            _ = self.drained.cancelled() => return round,
        };
        let Ok(first) = first else {
            return round;
        };
        let mut first = Some(first);
        // Each round starts at the next partition: the first one read gets
        // most of the free slots, and no partition may wait for the others to drain.
        self.rounds = self.rounds.wrapping_add(1);
        let polling = std::mem::take(&mut self.polling);
        for job in &f.jobs {
            let claimed = !f.is_halted(&job.name) && !f.is_cancelled(&job.name) && claims_online(job);
            if !claimed {
                // A job not claimed now sends no probe either.
                f.give_back_kept(job, true).await;
            } else if !polling || self.may_have_work(job).await {
                self.claim_job(job, &mut first, &mut round).await;
            }
        }
        if self.own_pending {
            self.own_pending = false;
            f.own_pending_read.store(true, Ordering::Relaxed);
        }
        // A round the rate held back says nothing of how much there is to claim.
        if round.claimed > 0 || round.limited.is_none() {
            self.last_claimed = round.claimed;
        }
        f.health.loop_ok();
        round
    }

    /// Claims what `job` may take this round (its breaker's room, one probe
    /// while its provider is down, the grants its limits give), spawning
    /// each task with a permit (`first`, then free ones) and a grant. While
    /// the provider is down a fallback takes the work (the probe still goes
    /// to the provider); it also takes what the provider's limits leave
    /// when the plan says the deadline needs more than they give.
    async fn claim_job(&mut self, job: &Arc<JobCtx>, first: &mut Option<OwnedSemaphorePermit>, round: &mut Round) {
        // The fallback's room is the worker's free slots: the provider's
        // breaker (one call at a time until it answered) says nothing of it.
        let fallback = (Route::Fallback, usize::MAX, None);
        let down = job.outage.is_down();
        if down && job.fallback.is_some() {
            if job.breaker.room() > 0
                && let Some(grant) = self.probe_turn(job, round).await
            {
                self.claim_route(job, (Route::Primary, 1, Some(grant)), first, round)
                    .await;
            }
            self.claim_route(job, fallback, first, round).await;
            return;
        }
        if !down {
            self.fleet.give_back_kept(job, false).await;
        }
        // Until the provider answered once, one call at a time.
        let room = job.breaker.room();
        if room == 0 {
            return;
        }
        if let Some(wait) = self.budget_wait(&job.name, Route::Primary) {
            round.limited = sooner(round.limited, wait);
            return;
        }
        // While the provider is down: no real work, one probe at a time
        // across the fleet (whoever holds the lease sends one task).
        let probe = if down {
            let Some(grant) = self.probe_turn(job, round).await else {
                self.fleet.give_back_kept(job, false).await;
                return;
            };
            Some(grant)
        } else {
            None
        };
        let room = if down { 1 } else { room };
        self.claim_route(job, (Route::Primary, room, probe), first, round).await;
        if !down && job.fallback.is_some() && job.plan.overflow() {
            self.claim_route(job, fallback, first, round).await;
        }
    }

    /// Claims up to `room` tasks of `job` for `route`'s provider, under its
    /// limiter's grants (`probe`: the one probe of a provider taken for
    /// down, and whether it may go without a grant where the told limits
    /// spare probes).
    async fn claim_route(
        &mut self,
        job: &Arc<JobCtx>,
        (route, room, probe): (Route, usize, Option<ProbeGrant>),
        first: &mut Option<OwnedSemaphorePermit>,
        round: &mut Round,
    ) {
        let f = self.fleet.clone();
        let claimed_before = round.claimed;
        let probing = probe.is_some();
        // No slot left (another route took them: a grant would come, and a
        // task with no slot), the rate's buckets said when to come back, or
        // a share of the slots waits for grants given ahead already.
        let free = self.claimable(first.is_some()).min(room);
        let budget_wait = self
            .budget_wait(&job.name, route)
            .or_else(|| self.ahead_wait(&job.name, route));
        if free == 0 || budget_wait.is_some() {
            return self.claim_nothing(job, probing, budget_wait, round).await;
        }
        let want = free.min(self.last_claimed.saturating_mul(2).max(1));
        let spared = probe == Some(ProbeGrant::Spare) && f.limiter_for(job, route).spares_probes();
        // Budget before claim: a throttled fleet leaves tasks in the stream.
        let (mut grants, wait, bound) = if spared {
            (f.no_grants(job, route), Duration::ZERO, Bound::None)
        } else {
            f.grants(job, want, route).await
        };
        if bound == Bound::Rate {
            self.budget_at
                .insert((job.name.clone(), route), tokio::time::Instant::now() + wait);
        }
        if grants.is_empty() && !spared {
            return self.claim_nothing(job, probing, Some(wait), round).await;
        }
        if probing {
            self.send_kept(job, first, round, &mut grants).await;
        }
        let (n, start) = (job.spec.job.partitions, self.rounds);
        for p in (0..n).map(|i| (i + start) % n) {
            let breaker_room = match route {
                Route::Fallback => usize::MAX,
                _ => job.breaker.room(),
            };
            let want = (if spared { usize::MAX } else { grants.len() })
                .min(breaker_room)
                .min(room - (round.claimed - claimed_before));
            if want == 0 || self.drained.is_cancelled() {
                break;
            }
            let batch = match f
                .store
                .claim(&job.name, p, &f.config.consumer, want, self.own_pending)
                .await
            {
                Ok(batch) => batch,
                Err(e) => {
                    f.store_error(&e).await;
                    continue;
                }
            };
            for d in batch {
                let permit = match first.take() {
                    Some(p) => p,
                    None => match f.permits.clone().try_acquire_owned() {
                        Ok(p) => p,
                        // Cannot happen (we asked for what was free); it stays pending.
                        Err(_) => break,
                    },
                };
                round.claimed += 1;
                if probing {
                    job.outage.set_probe(&d.task.rid);
                }
                let grant = grants.pop();
                self.note_ahead(&job.name, route, grant.as_ref());
                f.spawn(job.clone(), d, permit, (grant, route));
            }
        }
        grants.release(&f).await;
        if probing && round.claimed == claimed_before {
            self.probe_unsent(job).await;
        }
    }

    /// Sends this worker's probe on the delivery its failed probe kept
    /// (renewed first when its claim is no longer fresh: see
    /// [`needs_renewal`]).
    /// None is sent when none is kept, another worker took it over
    /// meanwhile, or Redis is away (then it stays kept): the round claims
    /// a fresh task instead.
    async fn send_kept(
        &self,
        job: &Arc<JobCtx>,
        first: &mut Option<OwnedSemaphorePermit>,
        round: &mut Round,
        grants: &mut HeldGrants,
    ) {
        let f = &self.fleet;
        if self.drained.is_cancelled() {
            return; // the drain gives it back
        }
        let Some(mut d) = job.outage.take_kept(true) else {
            return;
        };
        if needs_renewal(d.claimed_at.elapsed(), probe_lease(job), f.limits.visibility) {
            match f.store.renew(&job.name, &mut d).await {
                Ok(Some(_)) => {}
                Ok(None) => return,
                Err(e) => {
                    job.outage.put_back(d);
                    f.store_error(&e).await;
                    return;
                }
            }
        }
        let permit = match first.take() {
            Some(p) => p,
            None => match f.permits.clone().try_acquire_owned() {
                Ok(p) => p,
                Err(_) => {
                    job.outage.put_back(d);
                    return;
                }
            },
        };
        round.claimed += 1;
        job.outage.set_probe(&d.task.rid);
        let grant = grants.pop();
        f.spawn(job.clone(), d, permit, (grant, Route::Primary));
    }

    /// How long until the rate buckets of `job`'s `route` can give grants
    /// again, when they said so and that time has not come (asking sooner
    /// gets nothing).
    fn budget_wait(&self, job: &str, route: Route) -> Option<Duration> {
        let at = *self.budget_at.get(&(job.to_owned(), route))?;
        at.checked_duration_since(tokio::time::Instant::now())
            .filter(|wait| !wait.is_zero())
    }

    /// A route's claim that took nothing: `wait`, how long the rate holds
    /// it back (if it does); a probe this round was to send goes unsent.
    async fn claim_nothing(&self, job: &JobCtx, probing: bool, wait: Option<Duration>, round: &mut Round) {
        round.limited = wait.map_or(round.limited, |wait| sooner(round.limited, wait));
        if probing {
            self.probe_unsent(job).await;
        }
    }

    /// A task of `job`'s `route` claimed with `grant`: when the grant was
    /// given ahead of the buckets, its time counts towards [`AHEAD_SHARE`].
    fn note_ahead(&mut self, job: &str, route: Route, grant: Option<&Grant>) {
        if let Some(g) = grant.filter(|g| g.at > tokio::time::Instant::now()) {
            self.ahead.entry((job.to_owned(), route)).or_default().push(g.at);
        }
    }

    /// While a share of the slots ([`AHEAD_SHARE`]) or more holds tasks of
    /// `job`'s `route` waiting for grants given ahead: how long until half
    /// as many wait.
    fn ahead_wait(&mut self, job: &str, route: Route) -> Option<Duration> {
        let ahead = self.ahead.get_mut(&(job.to_owned(), route))?;
        let now = tokio::time::Instant::now();
        ahead.retain(|at| *at > now);
        let slots = self.fleet.config.concurrency.max(1);
        if ahead.len() * AHEAD_SHARE < slots {
            return None;
        }
        ahead.sort_unstable();
        let keep = slots / AHEAD_SHARE / 2;
        Some(ahead[ahead.len() - 1 - keep].duration_since(now))
    }

    /// While `job`'s provider is down: when this worker holds the probe's
    /// lease now, whether the probe takes a rate grant (else `round` learns
    /// how long until the next probe).
    async fn probe_turn(&self, job: &crate::job::JobCtx, round: &mut Round) -> Option<ProbeGrant> {
        let lease = probe_lease(job);
        match job
            .outage
            .take_probe(&self.fleet.store, &job.name, lease, &self.fleet.config.consumer)
            .await
        {
            Ok(Ok(grant)) => Some(grant),
            Ok(Err(wait)) => {
                round.probe_wait = sooner(round.probe_wait, wait);
                None
            }
            Err(e) => {
                self.fleet.store_error(&e).await;
                None
            }
        }
    }

    /// The probe's lease found nothing to send: given back, so the next
    /// probe need not wait out its whole call's lease.
    async fn probe_unsent(&self, job: &crate::job::JobCtx) {
        if let Err(e) = job.outage.no_probe(&self.fleet.store, &job.name).await {
            self.fleet.store_error(&e).await;
        }
    }

    /// Whether a partition of `job` may hold undelivered tasks (asked on an
    /// idle poll's round only; a Redis error answers yes).
    async fn may_have_work(&self, job: &JobCtx) -> bool {
        for p in 0..job.spec.job.partitions {
            match self.fleet.store.may_have_undelivered(&job.name, p).await {
                Ok(false) => {}
                Ok(true) => return true,
                Err(e) => {
                    self.fleet.store_error(&e).await;
                    return true;
                }
            }
        }
        false
    }

    /// Whether `--drain` may ask Redis again (at most every [`DRAIN_CHECK`]:
    /// a throttled worker with nothing in flight comes here every round).
    fn drain_check_due(&mut self) -> bool {
        if self.drain_checked.is_some_and(|at| at.elapsed() < DRAIN_CHECK) {
            return false;
        }
        self.drain_checked = Some(std::time::Instant::now());
        true
    }

    /// Slots for new claims: none while tasks of a dead or stuck worker wait
    /// to be taken over (they are the oldest work; they go first, on slots
    /// and on the fleet's budget alike).
    fn claimable(&self, holding_one: bool) -> usize {
        if self.fleet.reclaim_backlog.load(Ordering::Relaxed) > 0 {
            return 0;
        }
        self.fleet.permits.available_permits() + usize::from(holding_one)
    }
}

impl Service for Claimer {
    fn name(&self) -> &'static str {
        "claim"
    }

    /// A round stopped between reading its tasks and handing them to the
    /// tracker would leave them pending until another worker took them over
    /// (a SIGTERM'd worker must finish what it claimed): the round goes on,
    /// claiming nothing new once stopped, and the drain then waits for its tasks.
    fn finishing_grace(&self) -> Option<Duration> {
        Some(Duration::from_secs(5))
    }

    /// A round; then at once again when it claimed something, else a wait
    /// that a wake-up cuts short (new work anywhere in the fleet, or a slot
    /// freed): until the budget's refill time when that was the reason, or
    /// the idle poll (a safety net: work that comes with a wake-up starts at
    /// once). With `--drain`, stops when every job is complete.
    async fn run_once(&mut self) -> Option<Duration> {
        let f = self.fleet.clone();
        let errors = f.store_errors_seen();
        // The first round reads this consumer's own pending entries only.
        let first = self.own_pending;
        let round = self.claim_round().await;
        if round.claimed > 0 || first {
            return Some(Duration::ZERO);
        }
        if f.config.drain && f.tracker.is_empty() && self.drain_check_due() && f.jobs_finished().await {
            f.summary.lock().await.halted = f.halted();
            self.drained.cancel();
            return None;
        }
        if f.store_errors_seen() > errors {
            return Some(STORE_ERROR_PAUSE);
        }
        let wait = match round.limited {
            Some(wait) => {
                let wait = wait.clamp(Duration::from_millis(5), MAX_BUDGET_WAIT);
                let mut s = f.summary.lock().await;
                s.rate_limit_waits += 1;
                s.rate_limit_wait_ms += wait.as_millis() as u64;
                f.metrics.rate_limit_wait.observe(wait.as_secs_f64());
                wait
            }
            // Draining: the last records may be finished by other workers
            // (or by this one's tasks in flight), which send no wake-up.
            None if f.config.drain => f.config.idle_poll.min(DRAIN_CHECK),
            None => f.config.idle_poll,
        };
        let wait = round
            .probe_wait
            .map_or(wait, |p| p.clamp(Duration::from_millis(5), wait));
        let idle = round.limited.is_none() && round.probe_wait.is_none() && !f.config.drain;
        // Idle: a stop ends the wait at once (nothing claimed to finish).
        tokio::select! {
            woken = tokio::time::timeout(wait, f.wake_claimer.notified()) => self.polling = idle && woken.is_err(),
            _ = self.drained.cancelled() => return None,
        }
        Some(Duration::ZERO)
    }
}

/// Whether the claimer takes `job`'s tasks now: not in batch mode (its
/// batcher packs them into shards), not while its sink cannot keep up
/// (Redis does not grow without bound).
fn claims_online(job: &JobCtx) -> bool {
    job.spec.provider.mode != common::spec::ProviderMode::Batch
        && !job.sink_full.load(Ordering::Relaxed)
        && job.plan.claims_online()
}

/// A probe's lease: its call's whole timeout and [`PROBE_MARGIN`] past it.
fn probe_lease(job: &JobCtx) -> Duration {
    Duration::from_secs(job.spec.provider.timeout_secs) + PROBE_MARGIN
}

//! The claim service: takes a concurrency permit, then new tasks (this
//! consumer's own pending ones on the first round), under the fleet's
//! rate-limit budget, and starts each on the tracker.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::fleet::{Fleet, STORE_ERROR_PAUSE};
use crate::service::Service;

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
}

/// What one claim round did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Round {
    pub claimed: usize,
    /// Nothing was claimed for want of budget: the shortest wait the limiter named.
    pub limited: Option<Duration>,
}

impl Claimer {
    pub fn new(fleet: Arc<Fleet>, drained: tokio_util::sync::CancellationToken) -> Claimer {
        Claimer {
            fleet,
            own_pending: true,
            last_claimed: usize::MAX,
            rounds: 0,
            drained,
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
        let Ok(first) = f.permits.clone().acquire_owned().await else {
            return round;
        };
        let mut first = Some(first);
        // Each round starts at the next partition: the first one read gets
        // most of the free slots, and no partition may wait for the others to drain.
        self.rounds = self.rounds.wrapping_add(1);
        for job in &f.jobs {
            if f.is_halted(&job.name) || f.is_cancelled(&job.name) {
                continue;
            }
            // Redis does not grow without bound while the sink cannot keep up.
            if job.sink_full.load(Ordering::Relaxed) {
                continue;
            }
            // Until the provider answered once, one call at a time.
            let room = job.breaker.room();
            if room == 0 {
                continue;
            }
            let free = self.claimable(first.is_some()).min(room);
            let want = free.min(self.last_claimed.saturating_mul(2).max(1));
            // Budget before claim: a throttled fleet leaves tasks in the stream.
            let (mut grants, wait) = f.grants(job, want).await;
            if grants.is_empty() {
                round.limited = Some(round.limited.map_or(wait, |w| w.min(wait)));
                continue;
            }
            let n = job.spec.job.partitions;
            for p in (0..n).map(|i| (i + self.rounds) % n) {
                let want = grants.len().min(job.breaker.room());
                if want == 0 {
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
                    let grant = grants.pop();
                    f.spawn(job.clone(), d, permit, grant);
                }
            }
            grants.release(&f).await;
        }
        if self.own_pending {
            self.own_pending = false;
            f.own_pending_read.store(true, Ordering::Relaxed);
        }
        self.last_claimed = round.claimed;
        f.health.loop_ok();
        round
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

    /// A round; then at once again when it claimed something, else a wait:
    /// for the budget when that was the reason, or the idle poll. With
    /// `--drain`, stops when every job is complete.
    async fn run_once(&mut self) -> Option<Duration> {
        let f = self.fleet.clone();
        let errors = f.store_errors_seen();
        let round = self.claim_round().await;
        if round.claimed > 0 {
            return Some(Duration::ZERO);
        }
        if f.config.drain && f.tracker.is_empty() && f.jobs_finished().await {
            f.summary.lock().await.halted = f.halted();
            self.drained.cancel();
            return None;
        }
        if f.store_errors_seen() > errors {
            return Some(STORE_ERROR_PAUSE);
        }
        Some(match round.limited {
            Some(wait) => {
                let wait = wait.clamp(Duration::from_millis(5), Duration::from_secs(1));
                let mut s = f.summary.lock().await;
                s.rate_limit_waits += 1;
                s.rate_limit_wait_ms += wait.as_millis() as u64;
                f.metrics.rate_limit_wait.observe(wait.as_secs_f64());
                wait
            }
            None => f.config.idle_poll,
        })
    }
}

//! The planner of a job with tiers (`provider.tiers`): which tier each call
//! takes. Every worker plans for itself from the same fleet-wide figures
//! (the deadline, the records left, the records settled per second, read
//! every [`PERIOD`] by [`crate::replan::PlanService`]) and what its own flex calls saw (the
//! share the provider took); the rule is [`common::route::standard_share`].
//!
//! A record flex refused goes standard when the plan sends any share there
//! (the deadline needs the speed); otherwise it waits, like any refusal of
//! the world's, and tries flex again.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::route::{PlanFacts, Tier, standard_share};
use common::spec::JobSpec;
use common::store::PlanCounts;
use common::task::{HistoryItem, Task};

/// How often the fleet's figures are read.
pub const PERIOD: Duration = Duration::from_secs(2);

/// The settled counts kept to measure the rate, and the least time they span.
const RATE_WINDOW_MS: u64 = 60_000;
const RATE_MIN_SPAN_MS: u64 = 6_000;

/// How much of the flex acceptance's estimate each new call moves.
const ACCEPTANCE_WEIGHT: f64 = 0.02;

/// The cause of a flex refusal (see `crate::provider::classify`).
pub const FLEX_REFUSED: &str = "flex_unavailable";

/// Which way a call goes: online to the job's provider, or to its
/// fallback; or as a line of a provider batch (the Batch API).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    Primary,
    Fallback,
    Batch,
}

/// One job's plan, as this worker holds it.
pub struct Planner {
    /// The tiers the job may take; None: not routed (the provider's
    /// default, no `service_tier` sent).
    tiers: Option<Vec<Tier>>,
    /// The share of calls sent standard, as f64 bits.
    share: AtomicU64,
    /// The share of flex calls the provider took (f64 bits; starts at 1).
    acceptance: AtomicU64,
    /// Even all standard misses the deadline: a fallback takes calls too.
    overflow: std::sync::atomic::AtomicBool,
    /// `"batch"` among the tiers: records go through the Batch API while
    /// the deadline leaves its completion window (ms) and the margin.
    batch_window_ms: Option<u64>,
    /// The deadline leaves the batch's window: shards, not online calls.
    batch_now: std::sync::atomic::AtomicBool,
    /// The fleet's figures were read once (until then a job with the batch
    /// tier claims nothing online: it may all be for shards).
    planned: std::sync::atomic::AtomicBool,
    /// (Unix ms, records settled), oldest first.
    settled: Mutex<VecDeque<(u64, u64)>>,
}

impl Planner {
    pub fn new(spec: &JobSpec) -> Planner {
        Planner {
            tiers: spec.provider.routed().then(|| spec.provider.tiers()),
            share: AtomicU64::new(0f64.to_bits()),
            acceptance: AtomicU64::new(1f64.to_bits()),
            overflow: std::sync::atomic::AtomicBool::new(false),
            batch_window_ms: spec.provider.batch_tier().then(|| spec.batch.completion_window_ms()),
            batch_now: std::sync::atomic::AtomicBool::new(false),
            planned: std::sync::atomic::AtomicBool::new(false),
            settled: Mutex::new(VecDeque::new()),
        }
    }

    /// Whether the job names tiers.
    pub fn routed(&self) -> bool {
        self.tiers.is_some()
    }

    /// The share of calls sent standard now.
    pub fn share(&self) -> f64 {
        f64::from_bits(self.share.load(Ordering::Relaxed))
    }

    /// Whether the job may send records through the Batch API.
    pub fn has_batch(&self) -> bool {
        self.batch_window_ms.is_some()
    }

    /// Whether records go into batch shards now (the deadline leaves the
    /// batch's completion window), not online.
    pub fn batch_now(&self) -> bool {
        self.batch_now.load(Ordering::Relaxed)
    }

    /// Whether the plan, once read, says the deadline no longer leaves the
    /// batch's window (false before the first plan: a worker just started
    /// cancels no batch).
    pub fn batch_over(&self) -> bool {
        self.has_batch() && self.planned.load(Ordering::Relaxed) && !self.batch_now()
    }

    /// Whether the online claimer may take the job's records now: not
    /// while they go into shards, nor before the first plan says where.
    pub fn claims_online(&self) -> bool {
        !self.has_batch() || (self.planned.load(Ordering::Relaxed) && !self.batch_now())
    }

    /// Whether the deadline needs more than the provider's limits give
    /// (every call standard and still behind): a fallback takes calls too.
    pub fn overflow(&self) -> bool {
        self.overflow.load(Ordering::Relaxed)
    }

    /// The share of flex calls the provider took lately.
    pub fn acceptance(&self) -> f64 {
        f64::from_bits(self.acceptance.load(Ordering::Relaxed))
    }

    /// The tier of `task`'s next call (None: the job is not routed).
    pub fn tier_for(&self, task: &Task) -> Option<Tier> {
        let tiers = self.tiers.as_ref()?;
        let [only] = tiers.as_slice() else {
            let share = self.share();
            if share <= 0.0 {
                return Some(Tier::Flex);
            }
            let refused = last_outcome(task) == Some(FLEX_REFUSED);
            let standard = refused || rand::random::<f64>() < share;
            return Some(if standard { Tier::Standard } else { Tier::Flex });
        };
        Some(*only)
    }

    /// What a flex call came to: refused or not.
    pub fn saw_flex(&self, refused: bool) {
        let seen = if refused { 0.0 } else { 1.0 };
        let a = self.acceptance();
        let next = a + ACCEPTANCE_WEIGHT * (seen - a);
        self.acceptance.store(next.to_bits(), Ordering::Relaxed);
    }

    /// Re-plans from the fleet's counts read at `now_ms`; returns the facts
    /// it planned with.
    pub fn replan(&self, counts: PlanCounts, now_ms: u64) -> PlanFacts {
        let rate = {
            let mut seen = self.settled.lock().unwrap_or_else(|e| e.into_inner());
            seen.push_back((now_ms, counts.settled));
            while seen
                .front()
                .is_some_and(|(at, _)| now_ms.saturating_sub(*at) > RATE_WINDOW_MS)
            {
                seen.pop_front();
            }
            let (from_ms, from) = *seen.front().expect("one was just pushed");
            let span = now_ms.saturating_sub(from_ms);
            (span >= RATE_MIN_SPAN_MS).then(|| counts.settled.saturating_sub(from) as f64 * 1000.0 / span as f64)
        };
        let facts = PlanFacts {
            now_ms,
            deadline_ms: counts.deadline_ms,
            remaining: counts.remaining(),
            rate,
            flex_acceptance: self.acceptance(),
            standard_share: self.share(),
        };
        self.share.store(standard_share(&facts).to_bits(), Ordering::Relaxed);
        // The rate measured while the fallback helped counts its records
        // too: once on, the fallback stays until the provider alone would
        // end in half the time left.
        let on = self.overflow();
        let slower = |by: f64| PlanFacts {
            rate: facts.rate.map(|r| r * by),
            ..facts
        };
        let overflow = if on {
            common::route::all_standard_too_slow(&slower(0.5))
        } else {
            common::route::all_standard_too_slow(&facts)
        };
        self.overflow.store(overflow, Ordering::Relaxed);
        if let Some(window) = self.batch_window_ms {
            let left = facts.deadline_ms.map(|d| d.saturating_sub(now_ms));
            let fits = common::route::leaves_batch_window(left, window);
            self.batch_now.store(fits, Ordering::Relaxed);
        }
        self.planned.store(true, Ordering::Relaxed);
        facts
    }
}

/// The cause of the record's last call (its last attempt's outcome).
fn last_outcome(task: &Task) -> Option<&str> {
    task.history
        .iter()
        .rev()
        .find_map(HistoryItem::as_attempt)
        .map(|a| a.outcome.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(tiers: &[&str]) -> JobSpec {
        let mut s = JobSpec::parse(include_str!("../../examples/job.toml"), "job.toml").unwrap();
        s.provider.tiers = tiers.iter().map(|t| t.to_string()).collect();
        s
    }

    fn task_refused(refused: bool) -> Task {
        let outcome = if refused { FLEX_REFUSED } else { "server_error" };
        serde_json::from_value(serde_json::json!({
            "rid": "r", "input": {},
            "history": [{"attempt": 0, "call": 1, "outcome": outcome}]
        }))
        .unwrap()
    }

    #[test]
    fn tiers_follow_the_share_and_a_refused_record_goes_standard_once_any_does() {
        let plain = Planner::new(&spec(&[]));
        assert_eq!(plain.tier_for(&task_refused(true)), None, "no tiers: nothing named");
        let only = Planner::new(&spec(&["flex"]));
        assert_eq!(only.tier_for(&task_refused(true)), Some(Tier::Flex));
        let p = Planner::new(&spec(&["flex", "standard"]));
        assert_eq!(
            p.tier_for(&task_refused(true)),
            Some(Tier::Flex),
            "no hurry: flex again"
        );
        p.share.store(0.3f64.to_bits(), Ordering::Relaxed);
        assert_eq!(p.tier_for(&task_refused(true)), Some(Tier::Standard));
        let standard = (0..2000)
            .filter(|_| p.tier_for(&task_refused(false)) == Some(Tier::Standard))
            .count();
        assert!((450..750).contains(&standard), "{standard} of 2000 at 0.3");
    }

    #[test]
    fn the_batch_tier_holds_online_claims_until_planned_and_ends_only_on_a_plan() {
        let p = Planner::new(&spec(&["batch", "flex", "standard"]));
        assert!(p.has_batch());
        // A worker just started: nothing online, no batch cancelled.
        assert!(!p.claims_online() && !p.batch_now() && !p.batch_over());
        let t0 = 1_800_000_000_000;
        let counts = |left_ms: u64| PlanCounts {
            deadline_ms: Some(t0 + left_ms),
            expected: Some(100),
            settled: 0,
        };
        p.replan(counts(3 * 86_400_000), t0);
        assert!(
            p.batch_now() && !p.batch_over() && !p.claims_online(),
            "three days: shards"
        );
        p.replan(counts(25 * 3_600_000), t0);
        assert!(
            !p.batch_now() && p.batch_over() && p.claims_online(),
            "25 h: the window and the margin do not fit"
        );
        let online = Planner::new(&spec(&["flex", "standard"]));
        assert!(
            online.claims_online() && !online.batch_over(),
            "no batch tier: online from the start"
        );
    }

    #[test]
    fn the_rate_is_measured_over_the_window_and_the_deadline_moves_the_share() {
        let p = Planner::new(&spec(&["flex", "standard"]));
        for _ in 0..100 {
            p.saw_flex(true);
            p.saw_flex(false);
        }
        assert!((p.acceptance() - 0.5).abs() < 0.05, "{}", p.acceptance());
        let t0 = 1_800_000_000_000;
        let counts = |settled, left_s: u64, at: u64| PlanCounts {
            deadline_ms: Some(at + left_s * 1000),
            expected: Some(10_000),
            settled,
        };
        let first = p.replan(counts(0, 3600, t0), t0);
        assert_eq!(first.rate, None, "one count measures nothing");
        assert_eq!(p.share(), 0.0);
        // 10 records/s; 9,900 left in an hour: flex alone (5/s) is enough.
        let f = p.replan(counts(100, 3600, t0 + 10_000), t0 + 10_000);
        assert!((f.rate.unwrap() - 10.0).abs() < 1e-9, "{f:?}");
        assert_eq!(p.share(), 0.0);
        // The deadline tightened to 15 minutes: 11 records/s needed.
        p.replan(counts(200, 900, t0 + 20_000), t0 + 20_000);
        assert!(p.share() > 0.0 && p.share() < 1.0, "{}", p.share());
        // Past the margin: every call standard.
        p.replan(counts(300, 3, t0 + 30_000), t0 + 30_000);
        assert_eq!(p.share(), 1.0);
    }
}

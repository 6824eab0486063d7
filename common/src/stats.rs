//! A job's outcome counters, kept by the scripts that settle its records
//! (`keys::stats`, one hash per partition; they only grow): what a page can
//! show of a job of any size without reading its records.

use std::collections::BTreeMap;

use serde::Serialize;

/// One minute of a job's work (Redis's clock).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Minute {
    /// Records committed.
    pub done: u64,
    /// Records sent to review or dropped.
    pub failed: u64,
    /// Paid calls, and their cost in nano-USD.
    pub calls: u64,
    pub nusd: u64,
}

/// The counters of a job, summed over its partitions.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct JobStats {
    /// `E_CODE field` -> failed attempts with that validation error.
    pub errors: BTreeMap<String, u64>,
    /// Outcome -> retries it caused.
    pub retries: BTreeMap<String, u64>,
    /// Attempts -> records done in that many.
    pub attempts: BTreeMap<u64, u64>,
    /// Unix minute -> what happened in it.
    pub timeline: BTreeMap<u64, Minute>,
    /// Tier (`flex`, `standard`) -> records committed through it (a job
    /// that names `provider.tiers`).
    pub routes: BTreeMap<String, u64>,
}

impl JobStats {
    /// Adds one partition's hash (`field -> count`); fields no version
    /// writes are ignored.
    pub fn add(&mut self, fields: &BTreeMap<String, u64>) {
        for (field, &n) in fields {
            if let Some(name) = field.strip_prefix("e:") {
                *self.errors.entry(name.to_owned()).or_default() += n;
            } else if let Some(name) = field.strip_prefix("r:") {
                *self.retries.entry(name.to_owned()).or_default() += n;
            } else if let Some(name) = field.strip_prefix("rt:") {
                *self.routes.entry(name.to_owned()).or_default() += n;
            } else if let Some(a) = field.strip_prefix("a:").and_then(|a| a.parse().ok()) {
                *self.attempts.entry(a).or_default() += n;
            } else if let Some((minute, what)) = field.strip_prefix('t').and_then(|t| t.split_once(':'))
                && let Ok(minute) = minute.parse::<u64>()
            {
                let m = self.timeline.entry(minute).or_default();
                match what {
                    "d" => m.done += n,
                    "f" => m.failed += n,
                    "c" => m.calls += n,
                    "u" => m.nusd += n,
                    _ => {}
                }
            }
        }
    }

    /// Records settled (done, to review or dropped) per second over the
    /// `minutes` whole minutes before `now` (Unix seconds) and the part of
    /// the current one gone by.
    pub fn throughput(&self, now: u64, minutes: u64) -> f64 {
        let now_minute = now / 60;
        let from = now_minute.saturating_sub(minutes);
        let settled: u64 = self
            .timeline
            .range(from..=now_minute)
            .map(|(_, m)| m.done + m.failed)
            .sum();
        settled as f64 / (minutes * 60 + now % 60).max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_add_up_and_unknown_fields_are_ignored() {
        let mut s = JobStats::default();
        let p0 = BTreeMap::from([
            ("e:E_ENUM label".to_owned(), 3),
            ("r:invalid_output".to_owned(), 2),
            ("a:1".to_owned(), 10),
            ("t100:d".to_owned(), 6),
            ("t100:u".to_owned(), 500),
            ("t101:f".to_owned(), 1),
            ("future".to_owned(), 9),
        ]);
        let p1 = BTreeMap::from([("e:E_ENUM label".to_owned(), 1), ("t100:d".to_owned(), 6)]);
        s.add(&p0);
        s.add(&p1);
        assert_eq!(s.errors["E_ENUM label"], 4);
        assert_eq!((s.retries["invalid_output"], s.attempts[&1]), (2, 10));
        assert_eq!(
            s.timeline[&100],
            Minute {
                done: 12,
                failed: 0,
                calls: 0,
                nusd: 500
            }
        );
        // 13 settled over minutes 100 and 101, and 30 s into minute 102.
        assert!((s.throughput(102 * 60 + 30, 2) - 13.0 / 150.0).abs() < 1e-12);
    }
}

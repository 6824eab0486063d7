//! Drift alarms: a field or rule that suddenly fails far more often than it
//! did earlier in the same job (a provider changed its model under the same
//! name, a prompt edit reached the fleet, the data changed) pauses the job
//! instead of filling the review queue.
//!
//! A [`Detector`] watches one worker's validated answers of a job, newest
//! last: the last `window` answers, and every answer before them (the
//! baseline). For each field (`label`) and each business rule (`rule:name`)
//! it counts the answers that failed on it. It sounds an [`Alarm`] when, for
//! one of them, the window holds at least `min_failures` failures, the
//! baseline holds at least `baseline` answers, and the window's failure
//! rate is above `factor` times the baseline's. A field that never failed
//! before alarms once it fails `min_failures` times in a window.
//!
//! Pure: no clock, no I/O. The worker halts the job with the alarm's reason
//! and starts over with an empty baseline after any halt, so a resumed job
//! takes its new rate as normal.

use std::collections::{BTreeMap, VecDeque};

pub use crate::spec::DriftSpec;
use crate::validate::{ErrorCode, FieldError};

/// What an answer failed on, as drift counts it: each field once, each
/// business rule once (`rule:<name>`). A field inside an array counts
/// under its path without indices (`items[3].name` as `items[].name`):
/// the same field drifts whichever item shows it, and the keys (metric
/// labels among them) stay as few as the spec's fields.
pub fn keys_of(errors: &[FieldError]) -> Vec<String> {
    let mut keys: Vec<String> = errors
        .iter()
        .map(|e| match e.code {
            ErrorCode::Rule | ErrorCode::RuleUnevaluable => format!("rule:{}", e.field),
            _ if e.field.is_empty() => "(output)".to_owned(),
            _ => without_indices(&e.field),
        })
        .collect();
    keys.sort();
    keys.dedup();
    keys
}

/// `items[3].tags[0]` as `items[].tags[]`.
fn without_indices(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    let mut in_index = false;
    for c in path.chars() {
        match c {
            '[' => {
                in_index = true;
                out.push('[');
            }
            ']' => {
                in_index = false;
                out.push(']');
            }
            _ if in_index => {}
            _ => out.push(c),
        }
    }
    out
}

/// An example of a failed answer: the record's key and what was wrong.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    pub key: String,
    pub error: String,
}

/// A field's rate, past its earlier one.
#[derive(Debug, Clone, PartialEq)]
pub struct Alarm {
    /// `label`, or `rule:<name>`.
    pub key: String,
    pub window_failures: u32,
    pub window: u32,
    pub baseline_failures: u64,
    pub baseline: u64,
    /// The latest failures on it, newest last.
    pub examples: Vec<Example>,
}

impl Alarm {
    pub fn window_rate(&self) -> f64 {
        f64::from(self.window_failures) / f64::from(self.window.max(1))
    }

    pub fn baseline_rate(&self) -> f64 {
        self.baseline_failures as f64 / self.baseline.max(1) as f64
    }

    /// The halt's reason: what drifted, by how much, and the latest examples.
    pub fn reason(&self) -> String {
        let what = match self.key.strip_prefix("rule:") {
            Some(rule) => format!("rule `{rule}`"),
            None => format!("field `{}`", self.key),
        };
        let examples: Vec<String> = self
            .examples
            .iter()
            .map(|e| format!("{} ({})", e.key, e.error.chars().take(120).collect::<String>()))
            .collect();
        format!(
            "{REASON} {what} failed on {} of the last {} answers ({:.1}%) against {:.1}% before ({} of {}); latest: {}",
            self.window_failures,
            self.window,
            self.window_rate() * 100.0,
            self.baseline_rate() * 100.0,
            self.baseline_failures,
            self.baseline,
            examples.join("; ")
        )
    }
}

/// How a drift halt's reason begins.
pub const REASON: &str = "quality drift:";

/// How many examples an alarm carries.
const EXAMPLES: usize = 3;

/// One worker's view of one job's answers.
#[derive(Debug)]
pub struct Detector {
    spec: DriftSpec,
    /// The window's answers, oldest first: the keys each failed on.
    window: VecDeque<Vec<String>>,
    in_window: BTreeMap<String, u32>,
    before: u64,
    before_failures: BTreeMap<String, u64>,
    /// The latest failures per key, newest last.
    examples: BTreeMap<String, VecDeque<Example>>,
}

impl Detector {
    pub fn new(spec: DriftSpec) -> Detector {
        Detector {
            spec,
            window: VecDeque::new(),
            in_window: BTreeMap::new(),
            before: 0,
            before_failures: BTreeMap::new(),
            examples: BTreeMap::new(),
        }
    }

    /// Forgets everything (after a halt: a resumed job starts a new baseline).
    pub fn restart(&mut self) {
        *self = Detector::new(self.spec.clone());
    }

    /// One validated answer of record `key` and its errors (none: valid).
    /// An alarm when a key drifted (the detector then starts over).
    pub fn observe(&mut self, key: &str, errors: &[FieldError]) -> Option<Alarm> {
        if !self.spec.enabled {
            return None;
        }
        let failed = keys_of(errors);
        for k in &failed {
            *self.in_window.entry(k.clone()).or_default() += 1;
            let error = errors
                .iter()
                .find(|e| keys_of(std::slice::from_ref(*e)).first() == Some(k))
                .map(ToString::to_string)
                .unwrap_or_default();
            let ex = self.examples.entry(k.clone()).or_default();
            ex.push_back(Example {
                key: key.to_owned(),
                error,
            });
            if ex.len() > EXAMPLES {
                ex.pop_front();
            }
        }
        self.window.push_back(failed);
        if self.window.len() > self.spec.window as usize {
            let left = self.window.pop_front().unwrap_or_default();
            self.before += 1;
            for k in left {
                if let Some(n) = self.in_window.get_mut(&k) {
                    *n -= 1;
                }
                *self.before_failures.entry(k).or_default() += 1;
            }
        }
        let alarm = self.drifted()?;
        self.restart();
        Some(alarm)
    }

    fn drifted(&self) -> Option<Alarm> {
        if self.before < u64::from(self.spec.baseline()) {
            return None;
        }
        let window = self.window.len() as u32;
        self.in_window
            .iter()
            .filter(|(_, n)| **n >= self.spec.min_failures)
            .find_map(|(k, &n)| {
                let before = self.before_failures.get(k).copied().unwrap_or(0);
                let rate = f64::from(n) / f64::from(window);
                let earlier = before as f64 / self.before as f64;
                (rate > self.spec.factor * earlier).then(|| Alarm {
                    key: k.clone(),
                    window_failures: n,
                    window,
                    baseline_failures: before,
                    baseline: self.before,
                    examples: self
                        .examples
                        .get(k)
                        .map(|e| e.iter().cloned().collect())
                        .unwrap_or_default(),
                })
            })
    }

    /// Each key's failure rate in the window and before it (for the metrics).
    pub fn rates(&self) -> Vec<(String, f64, f64)> {
        let window = self.window.len().max(1) as f64;
        let before = self.before.max(1) as f64;
        let mut keys: Vec<&String> = self.in_window.keys().chain(self.before_failures.keys()).collect();
        keys.sort();
        keys.dedup();
        keys.into_iter()
            .map(|k| {
                let w = f64::from(self.in_window.get(k).copied().unwrap_or(0)) / window;
                let b = self.before_failures.get(k).copied().unwrap_or(0) as f64 / before;
                (k.clone(), w, b)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(field: &str) -> FieldError {
        FieldError {
            code: ErrorCode::Enum,
            field: field.into(),
            message: "must be one of a, b".into(),
        }
    }

    fn spec() -> DriftSpec {
        DriftSpec {
            window: 100,
            min_failures: 10,
            ..DriftSpec::default()
        }
    }

    /// `n` answers, every `every`-th failing on `field` (0: none fails).
    fn feed(d: &mut Detector, from: usize, n: usize, every: usize, field: &str) -> Option<(usize, Alarm)> {
        (from..from + n).find_map(|i| {
            let errors = if every > 0 && i % every == 0 {
                vec![err(field)]
            } else {
                vec![]
            };
            d.observe(&format!("r{i}"), &errors).map(|a| (i, a))
        })
    }

    #[test]
    fn a_steady_rate_never_alarms_and_a_tripled_one_does_within_a_window() {
        let mut d = Detector::new(spec());
        assert_eq!(feed(&mut d, 0, 5000, 20, "label"), None, "5% throughout");
        let (at, alarm) = feed(&mut d, 5000, 200, 4, "label").expect("25% after 5% is drift");
        assert!(at < 5100, "within a window: {at}");
        assert_eq!(alarm.key, "label");
        assert!(alarm.window_failures >= 10 && alarm.window_rate() > 3.0 * alarm.baseline_rate());
        assert!((alarm.baseline_rate() - 0.05).abs() < 0.01, "{alarm:?}");
        assert_eq!(alarm.examples.len(), 3);
        assert_eq!(alarm.examples.last().unwrap().key, format!("r{at}"));
        let reason = alarm.reason();
        assert!(reason.starts_with("quality drift: field `label` failed on"), "{reason}");
        assert!(
            reason.contains(&format!("r{at} (E_ENUM label: must be one of a, b)")),
            "{reason}"
        );
        // It starts over: the new rate is the baseline to come.
        assert_eq!(feed(&mut d, 6000, 3000, 4, "label"), None);
    }

    #[test]
    fn nothing_alarms_before_a_baseline_or_under_the_minimum_count() {
        let mut d = Detector::new(spec());
        assert_eq!(
            feed(&mut d, 0, 100, 2, "label"),
            None,
            "no baseline yet: failing from the start is not drift"
        );
        let mut d = Detector::new(spec());
        feed(&mut d, 0, 300, 0, "label");
        // 9 failures in a window, from none before: under min_failures.
        assert_eq!(feed(&mut d, 300, 100, 11, "label"), None);
        // A field that never failed, failing 10 times in a window: drift.
        let (_, alarm) = feed(&mut d, 400, 100, 5, "reason").expect("a new failure mode");
        assert_eq!((alarm.key.as_str(), alarm.baseline_failures), ("reason", 0));
    }

    #[test]
    fn rules_count_under_their_own_name_and_disabled_never_alarms() {
        let rule = FieldError {
            code: ErrorCode::Rule,
            field: "amount_positive".into(),
            message: "broken".into(),
        };
        assert_eq!(
            keys_of(&[rule.clone(), err("label"), err("label")]),
            ["label", "rule:amount_positive"]
        );
        // Items of an array count as one field, whichever item failed.
        assert_eq!(
            keys_of(&[err("items[3].name"), err("items[0].name"), err("items[12].tags[2]")]),
            ["items[].name", "items[].tags[]"]
        );
        let mut d = Detector::new(DriftSpec {
            enabled: false,
            ..spec()
        });
        feed(&mut d, 0, 300, 0, "label");
        assert_eq!(feed(&mut d, 300, 300, 1, "label"), None);
    }

    #[test]
    fn bad_settings_are_named() {
        let bad = DriftSpec {
            window: 5,
            factor: 1.0,
            min_failures: 0,
            baseline: Some(0),
            enabled: true,
        };
        let keys: Vec<&str> = bad.problems().iter().map(|(k, _)| *k).collect();
        assert_eq!(
            keys,
            ["drift.window", "drift.factor", "drift.min_failures", "drift.baseline"]
        );
        assert!(DriftSpec::default().problems().is_empty());
    }
}

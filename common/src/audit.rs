//! Spot checks: people judge a seeded sample of committed results, and the
//! job's accuracy is estimated from their verdicts, with a 95% interval,
//! overall and per value of each enum field.
//!
//! A field spec constrains structure only; whether a valid output is right
//! takes a person. A record is sampled when the spec's `[audit] rate` says
//! so ([`crate::spec::Audit::sampled`], decided when it is committed) or
//! when `producer audit --sample N` picks it afterwards; it waits in its
//! partition's audit queue until someone gives a [`Verdict`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A person's judgement of one committed result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    pub correct: bool,
    pub by: String,
    pub at: String,
    /// The output's enum fields as they were judged (`label` -> `billing`):
    /// the accuracy per value is read from these.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// For an incorrect result: the revision that corrected it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl Verdict {
    pub fn encode(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn decode(text: &str) -> Result<Verdict, String> {
        serde_json::from_str(text).map_err(|e| format!("audit verdict: {e}"))
    }
}

/// Correct results among those judged, with the 95% Wilson score interval
/// (sound for small samples and for rates near 0 or 1).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Rate {
    pub audited: u64,
    pub correct: u64,
    pub accuracy: f64,
    pub low: f64,
    pub high: f64,
}

impl Rate {
    pub fn of(correct: u64, audited: u64) -> Rate {
        let (low, high) = wilson(correct, audited);
        Rate {
            audited,
            correct,
            accuracy: if audited == 0 {
                0.0
            } else {
                correct as f64 / audited as f64
            },
            low,
            high,
        }
    }

    /// `93.0% (95% CI 88.1%–96.0%, 186 of 200)`.
    pub fn text(&self) -> String {
        if self.audited == 0 {
            return "nothing judged yet".to_owned();
        }
        format!(
            "{:.1}% (95% CI {:.1}%–{:.1}%, {} of {})",
            self.accuracy * 100.0,
            self.low * 100.0,
            self.high * 100.0,
            self.correct,
            self.audited
        )
    }
}

/// The 95% Wilson score interval of `k` successes in `n` trials.
pub fn wilson(k: u64, n: u64) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let z = 1.959_963_984_540_054_f64;
    let (n, p) = (n as f64, k as f64 / n as f64);
    let denom = 1.0 + z * z / n;
    let center = (p + z * z / (2.0 * n)) / denom;
    let margin = z * (p * (1.0 - p) / n + z * z / (4.0 * n * n)).sqrt() / denom;
    ((center - margin).max(0.0), (center + margin).min(1.0))
}

/// A job's estimated accuracy from its verdicts.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Accuracy {
    /// Results waiting to be judged.
    pub waiting: u64,
    pub overall: Rate,
    /// Per enum field and value: `(field, value, rate)`.
    pub by_label: Vec<(String, String, Rate)>,
}

impl Accuracy {
    pub fn of(verdicts: &[Verdict], waiting: u64) -> Accuracy {
        let correct = verdicts.iter().filter(|v| v.correct).count() as u64;
        let mut by: BTreeMap<(String, String), (u64, u64)> = BTreeMap::new();
        for v in verdicts {
            for (field, value) in &v.labels {
                let e = by.entry((field.clone(), value.clone())).or_default();
                e.0 += u64::from(v.correct);
                e.1 += 1;
            }
        }
        Accuracy {
            waiting,
            overall: Rate::of(correct, verdicts.len() as u64),
            by_label: by.into_iter().map(|((f, v), (k, n))| (f, v, Rate::of(k, n))).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wilson_interval_matches_the_textbook() {
        // 8 of 10: p = 0.8, the interval is 0.490 to 0.943.
        let (lo, hi) = wilson(8, 10);
        assert!((lo - 0.4902).abs() < 5e-4 && (hi - 0.9433).abs() < 5e-4, "{lo} {hi}");
        // All right in a small sample does not mean certainly right.
        let (lo, hi) = wilson(5, 5);
        assert!(lo < 0.6 && (hi - 1.0).abs() < 1e-12, "{lo}");
        assert_eq!(wilson(0, 0), (0.0, 1.0));
        assert_eq!(Rate::of(8, 10).text(), "80.0% (95% CI 49.0%–94.3%, 8 of 10)");
    }

    #[test]
    fn accuracy_is_counted_overall_and_per_label() {
        let v = |correct: bool, label: &str| Verdict {
            correct,
            by: "ann".into(),
            at: "t".into(),
            labels: BTreeMap::from([("label".to_owned(), label.to_owned())]),
            revision: None,
            note: None,
        };
        let a = Accuracy::of(&[v(true, "billing"), v(false, "billing"), v(true, "shipping")], 4);
        assert_eq!((a.overall.correct, a.overall.audited, a.waiting), (2, 3, 4));
        assert_eq!(a.by_label[0].0, "label");
        assert_eq!(
            (
                a.by_label[0].1.as_str(),
                a.by_label[0].2.correct,
                a.by_label[0].2.audited
            ),
            ("billing", 1, 2)
        );
        assert_eq!(Verdict::decode(&v(true, "x").encode()).unwrap(), v(true, "x"));
    }
}

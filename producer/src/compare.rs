//! `producer compare --job A --job B`: two runs side by side (usually the
//! same records under two prompt versions): failures per error code and
//! field, first-attempt validity, attempts per record, review rate, cost per
//! done record, and the records that passed in A and fail in B, by business
//! key, with both jobs' chains of versions.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use common::store::RedisStore;
use common::task::HistoryItem;
use serde::Serialize;

use crate::report::{Report, VersionLink};

/// One job's side of a comparison.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Side {
    pub job: String,
    pub chain: Vec<VersionLink>,
    /// Records with an outcome (done or in review).
    pub records: u64,
    pub done: u64,
    pub review: u64,
    /// Share of records whose first answer was valid.
    pub first_attempt_valid: f64,
    pub attempts_per_record: f64,
    pub review_rate: f64,
    pub cost_usd: f64,
    pub cost_per_done_usd: Option<f64>,
    /// `E_CODE field` -> failed attempts, and their share of all attempts.
    pub codes: BTreeMap<String, u64>,
    pub code_shares: BTreeMap<String, f64>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Comparison {
    pub a: Side,
    pub b: Side,
    /// Business keys the model got done in A, in review in B.
    pub regressions: Vec<String>,
    /// Business keys in review in A, done by the model in B.
    pub fixed: Vec<String>,
}

/// What a record came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Came {
    Done,
    /// Accepted by a person from review.
    Accepted,
    Review,
}

/// What a job's records came to, by business key.
async fn outcomes(store: &RedisStore, job: &str) -> anyhow::Result<(Report, HashMap<String, Came>, u64)> {
    let spec = crate::review::job_spec(store, job).await?;
    let report = crate::report::report(store, job, &spec).await?;
    let mut by_key = HashMap::new();
    let mut first_valid = 0u64;
    let first_ok = |h: &[HistoryItem]| {
        h.iter()
            .find_map(HistoryItem::as_attempt)
            .is_some_and(|a| a.outcome == "valid")
    };
    crate::sink::each_result(store, job, Some(&spec), spec.job.partitions, |r| {
        first_valid += u64::from(first_ok(&r.history));
        by_key.insert(r.key.clone(), if r.human { Came::Accepted } else { Came::Done });
    })
    .await?;
    for p in 0..spec.job.partitions {
        store
            .review_entries(job, p, |e| {
                first_valid += u64::from(first_ok(&e.history));
                by_key.insert(e.key.clone(), Came::Review);
            })
            .await?;
    }
    Ok((report, by_key, first_valid))
}

fn side(job: &str, r: &Report, first_valid: u64) -> Side {
    let review: u64 = r.review_by_reason.values().sum();
    let records = r.done + review;
    let attempts: u64 = r.attempts_histogram.iter().map(|(a, n)| a * n).sum();
    let share = |n: u64, of: u64| if of == 0 { 0.0 } else { n as f64 / of as f64 };
    Side {
        job: job.to_owned(),
        chain: r.chain.clone(),
        records,
        done: r.done,
        review,
        first_attempt_valid: share(first_valid, records),
        attempts_per_record: share(attempts, records),
        review_rate: share(review, records),
        cost_usd: r.total.cost_usd,
        cost_per_done_usd: (r.done > 0).then(|| r.total.cost_usd / r.done as f64),
        codes: r.validation_errors.clone(),
        code_shares: r
            .validation_errors
            .iter()
            .map(|(k, n)| (k.clone(), share(*n, attempts)))
            .collect(),
    }
}

pub async fn compare(store: &RedisStore, a: &str, b: &str) -> anyhow::Result<Comparison> {
    let (ra, ka, fa) = outcomes(store, a).await?;
    let (rb, kb, fb) = outcomes(store, b).await?;
    let mut regressions: Vec<String> = ka
        .iter()
        .filter(|(k, came)| **came == Came::Done && kb.get(*k) == Some(&Came::Review))
        .map(|(k, _)| k.clone())
        .collect();
    let mut fixed: Vec<String> = ka
        .iter()
        .filter(|(k, came)| **came == Came::Review && kb.get(*k) == Some(&Came::Done))
        .map(|(k, _)| k.clone())
        .collect();
    regressions.sort();
    fixed.sort();
    Ok(Comparison {
        a: side(a, &ra, fa),
        b: side(b, &rb, fb),
        regressions,
        fixed,
    })
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

/// The figures side by side: `(what, A, B)`.
pub fn rows(c: &Comparison) -> Vec<(String, String, String)> {
    let (a, b) = (&c.a, &c.b);
    let usd = |x: Option<f64>| x.map_or("-".into(), |v| format!("{v:.6}"));
    vec![
        (
            "records (done + review)".into(),
            a.records.to_string(),
            b.records.to_string(),
        ),
        ("done".into(), a.done.to_string(), b.done.to_string()),
        (
            "first-attempt valid".into(),
            pct(a.first_attempt_valid),
            pct(b.first_attempt_valid),
        ),
        (
            "attempts per record".into(),
            format!("{:.2}", a.attempts_per_record),
            format!("{:.2}", b.attempts_per_record),
        ),
        ("review rate".into(), pct(a.review_rate), pct(b.review_rate)),
        (
            "cost per done record (USD)".into(),
            usd(a.cost_per_done_usd),
            usd(b.cost_per_done_usd),
        ),
    ]
}

/// Failed attempts by `E_CODE field` in either job: the key, each side's
/// `count share` and its share of that side's attempts.
pub fn code_rows(c: &Comparison) -> Vec<(String, String, String, f64, f64)> {
    let codes: BTreeSet<&String> = c.a.codes.keys().chain(c.b.codes.keys()).collect();
    codes
        .into_iter()
        .map(|k| {
            let share = |s: &Side| s.code_shares.get(k).copied().unwrap_or(0.0);
            let cell = |s: &Side| format!("{} {}", s.codes.get(k).copied().unwrap_or(0), pct(share(s)));
            (k.clone(), cell(&c.a), cell(&c.b), share(&c.a), share(&c.b))
        })
        .collect()
}

/// The human view.
pub fn print(c: &Comparison) {
    let (a, b) = (&c.a, &c.b);
    crate::outln!("compare {} (A) with {} (B)", a.job, b.job);
    for (name, s) in [("A", a), ("B", b)] {
        crate::outln!("  versions {name}   {}", crate::report::chain_line(&s.chain));
    }
    crate::outln!("  {:<34} {:>14} {:>14}", "", "A", "B");
    let row = |label: &str, x: &str, y: &str| crate::outln!("  {label:<34} {x:>14} {y:>14}");
    for (what, x, y) in rows(c) {
        row(&what, &x, &y);
    }
    crate::outln!("  failed attempts by code and field (count, share of attempts):");
    for (k, x, y, _, _) in code_rows(c) {
        row(&format!("  {k}"), &x, &y);
    }
    crate::outln!(
        "  regressions (done in A, in review in B): {}",
        if c.regressions.is_empty() {
            "none".to_owned()
        } else {
            c.regressions.join(", ")
        }
    );
    crate::outln!("  fixed (in review in A, done in B): {}", c.fixed.len());
}

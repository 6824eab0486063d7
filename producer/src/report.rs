//! `producer report`: what went wrong, from the attempt histories stored
//! with every result and review entry, and what it cost, from the job's
//! cost ledger (every paid call, recorded once: see [`common::ledger`]).

use std::collections::BTreeMap;

use common::ledger::{Spend, Totals};
use common::spec::JobSpec;
use common::store::RedisStore;
use common::task::HistoryItem;
use serde::Serialize;

/// Calls, tokens and cost of a set of records (or the job's, from the ledger).
pub type Usage = Totals;

/// The calls of a record's history, each at its route's prices (a
/// provider batch's at batch prices, the flex tier's at flex prices, a
/// fallback's at its own).
fn of_history(history: &[HistoryItem], spec: &JobSpec) -> Usage {
    let mut u = Usage::default();
    let prices = &spec.prices;
    let (batch, flex) = (prices.batch(), prices.flex());
    for a in history.iter().filter_map(HistoryItem::as_attempt) {
        let fallback = spec
            .provider
            .fallbacks
            .iter()
            .find(|f| Some(f.name.as_str()) == a.tier.as_deref());
        let at = match (&a.batch, a.tier.as_deref(), fallback) {
            (Some(_), ..) => &batch,
            (None, _, Some(f)) => f.prices.as_ref().unwrap_or(prices),
            (None, Some("flex"), None) => &flex,
            _ => prices,
        };
        u.add_call(a.usage.as_ref(), at);
    }
    u
}

/// One job of a prompt's history: its versions and changelog note.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct VersionLink {
    pub job: String,
    pub versions: BTreeMap<String, String>,
    pub note: Option<String>,
}

/// The job's chain of versions: the job, then the job it was enqueued from
/// (`--from-job`), and so on back (at most 32).
pub async fn version_chain(store: &RedisStore, job: &str) -> Result<Vec<VersionLink>, common::store::StoreError> {
    let mut chain: Vec<VersionLink> = Vec::new();
    let mut next = Some(job.to_owned());
    while let Some(name) = next.take() {
        if chain.len() >= 32 || chain.iter().any(|l| l.job == name) {
            break;
        }
        let Some(m) = store.load_manifest(&name).await? else {
            break;
        };
        next = m
            .sample
            .as_ref()
            .and_then(|s| s.from_job.as_ref())
            .map(|f| f.job.clone());
        chain.push(VersionLink {
            job: name,
            versions: m.versions,
            note: m.note,
        });
    }
    Ok(chain)
}

/// A chain on one line: `job prompt=v2 (note) <- job prompt=v1`.
pub fn chain_line(chain: &[VersionLink]) -> String {
    chain
        .iter()
        .map(|l| {
            let v = ["source", "prompt", "output"]
                .iter()
                .filter_map(|k| Some(format!("{k}={}", l.versions.get(*k)?)))
                .collect::<Vec<_>>()
                .join(" ");
            match &l.note {
                Some(n) => format!("{} {v} ({n})", l.job),
                None => format!("{} {v}", l.job),
            }
        })
        .collect::<Vec<_>>()
        .join("  <-  ")
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    pub job: String,
    pub versions: BTreeMap<String, String>,
    /// The job's prompt history: it, then the jobs it was enqueued from.
    pub chain: Vec<VersionLink>,
    /// `E_CODE field` -> attempts that failed with it.
    pub validation_errors: BTreeMap<String, u64>,
    /// Why attempts were retried: outcome -> count.
    pub retries_by_cause: BTreeMap<String, u64>,
    /// Why records ended in review: reason -> count.
    pub review_by_reason: BTreeMap<String, u64>,
    /// Attempts a record took (done and review): attempts -> records.
    pub attempts_histogram: BTreeMap<u64, u64>,
    /// Usage and cost of records done in one call.
    pub first_attempt_successes: Usage,
    /// Usage and cost of records the model got done after more than one call.
    pub done_after_retries: Usage,
    /// Usage and cost of records a person accepted (from review).
    pub accepted_by_people: Usage,
    /// Usage and cost of records that ended in review.
    pub ended_in_review: Usage,
    /// Every paid call, from the ledger: what was spent, whatever became of
    /// the records since (it only grows). By cause: `first`,
    /// `transient_retry`, `validation_retry`, `human` (rounds a person
    /// started), `check` (the cross-check's model), and `no_result` (calls cut off at a worker's drain timeout,
    /// or whose outcome could not be stored: paid, estimated, no result).
    pub spend: Spend,
    /// The ledger's totals (for a job older than the ledger: the histories').
    pub total: Usage,
    pub done: u64,
    pub human_accepted: u64,
    /// Paid answers that left no result: a worker got them but could not
    /// store the outcome before its visibility timeout (Redis was away).
    pub paid_answers_lost: u64,
    /// From the manifest's creation to the last outcome the fleet reached
    /// (commit or review; a person's accept is not the fleet's work).
    pub elapsed_secs: Option<f64>,
    pub records_per_sec: Option<f64>,
    /// From the first call to the last outcome (commit or review): the time
    /// the fleet worked, whenever it started after the enqueue.
    pub processing_secs: Option<f64>,
    pub processing_records_per_sec: Option<f64>,
    /// What people's spot checks of committed results estimate.
    pub accuracy: common::audit::Accuracy,
    /// The cross-check (`[check]`): per field, the answers the checker saw
    /// and those it agreed with.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub agreement: BTreeMap<String, Agreement>,
}

/// One field's agreement between the first model and the checker.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Agreement {
    pub checked: u64,
    pub agreed: u64,
    pub rate: f64,
}

/// Builds the report of a job by scanning its results and review entries.
pub async fn report(store: &RedisStore, job: &str, spec: &JobSpec) -> anyhow::Result<Report> {
    let manifest = store.load_manifest(job).await?;
    let mut r = Report {
        job: job.to_owned(),
        versions: manifest.as_ref().map(|m| m.versions.clone()).unwrap_or_default(),
        chain: version_chain(store, job).await?,
        ..Report::default()
    };
    r.paid_answers_lost = store.lost_answers(job).await?;
    let mut worked = Worked::default();
    let mut see = |history: &[HistoryItem], outcome_at: &str| worked.see(history, outcome_at);
    crate::sink::each_result(store, job, Some(spec), spec.job.partitions, |res| {
        if !res.human {
            see(&res.history, &res.committed_at);
        }
        r.count_history(&res.history);
        *r.attempts_histogram.entry(u64::from(res.attempts)).or_default() += 1;
        let usage = of_history(&res.history, spec);
        r.done += 1;
        if res.human {
            r.human_accepted += 1;
            r.accepted_by_people.merge(&usage);
        } else if usage.calls <= 1 {
            r.first_attempt_successes.merge(&usage);
        } else {
            r.done_after_retries.merge(&usage);
        }
    })
    .await?;
    for p in 0..spec.job.partitions {
        store
            .review_entries(job, p, |e| {
                see(&e.history, &e.created_at);
                r.count_history(&e.history);
                *r.attempts_histogram.entry(u64::from(e.attempts)).or_default() += 1;
                *r.review_by_reason.entry(e.reason.clone()).or_default() += 1;
                r.ended_in_review.merge(&of_history(&e.history, spec));
            })
            .await?;
    }
    r.spend = store.spend(job, spec.job.partitions).await?;
    r.accuracy = store.accuracy(job, spec.job.partitions).await?;
    if r.spend.totals.calls > 0 {
        r.total = r.spend.totals.clone();
    } else {
        // A job older than the ledger: what its histories still hold.
        for part in [
            &r.first_attempt_successes,
            &r.done_after_retries,
            &r.accepted_by_people,
            &r.ended_in_review,
        ] {
            let part = part.clone();
            r.total.merge(&part);
        }
    }
    if let (Some(start), Some(end)) = (worked.first_call, worked.last_outcome) {
        let secs = end.saturating_sub(start).max(1) as f64;
        r.processing_secs = Some(secs);
        r.processing_records_per_sec = Some((r.done + review_total(&r)) as f64 / secs);
    }
    if let Some(m) = &manifest
        && let (Some(start), Some(end)) = (parse_rfc3339(&m.created_at), worked.last_outcome)
    {
        let secs = end.saturating_sub(start).max(1) as f64;
        r.elapsed_secs = Some(secs);
        r.records_per_sec = Some(r.done as f64 / secs);
    }
    Ok(r)
}

/// When the fleet worked on a job: its first call (its time minus its
/// duration) and its last outcome, Unix seconds.
#[derive(Default)]
struct Worked {
    first_call: Option<u64>,
    last_outcome: Option<u64>,
}

impl Worked {
    fn see(&mut self, history: &[HistoryItem], outcome_at: &str) {
        for a in history.iter().filter_map(HistoryItem::as_attempt) {
            if let Some(at) = parse_rfc3339(&a.at) {
                let started = at.saturating_sub(a.elapsed_ms / 1000);
                self.first_call = Some(self.first_call.map_or(started, |f| f.min(started)));
            }
        }
        if let Some(at) = parse_rfc3339(outcome_at) {
            self.last_outcome = Some(self.last_outcome.map_or(at, |l| l.max(at)));
        }
    }
}

fn review_total(r: &Report) -> u64 {
    r.review_by_reason.values().sum()
}

impl Report {
    /// Validation errors and retry causes of a record's calls.
    fn count_history(&mut self, history: &[HistoryItem]) {
        for a in history.iter().filter_map(HistoryItem::as_attempt) {
            for e in &a.errors {
                let k = format!("{} {}", e.code.as_str(), e.field);
                *self.validation_errors.entry(k.trim_end().to_owned()).or_default() += 1;
            }
            if a.decision == "retry" {
                *self.retries_by_cause.entry(a.outcome.clone()).or_default() += 1;
            }
            // A checker with no valid answer of its own agreed or disagreed with nothing.
            let compared = a.check.iter().filter(|v| v.checker.is_some());
            for (field, agreed) in compared.flat_map(|v| &v.fields) {
                let g = self.agreement.entry(field.clone()).or_default();
                g.checked += 1;
                g.agreed += u64::from(*agreed);
                g.rate = g.agreed as f64 / g.checked as f64;
            }
        }
    }
}

/// Seconds since the epoch of `YYYY-MM-DDTHH:MM:SSZ` (the format we write).
fn parse_rfc3339(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    if b.len() != 20 || b[4] != b'-' || b[10] != b'T' || b[19] != b'Z' {
        return None;
    }
    let n = |r: std::ops::Range<usize>| s.get(r)?.parse::<i64>().ok();
    let (y, mo, d, h, mi, se) = (n(0..4)?, n(5..7)?, n(8..10)?, n(11..13)?, n(14..16)?, n(17..19)?);
    let days = common::manifest::days_from_civil(y, mo, d);
    u64::try_from(days * 86_400 + h * 3600 + mi * 60 + se).ok()
}

/// The human view of a report.
pub fn print(r: &Report) {
    crate::outln!("report of job {}", r.job);
    let versions: Vec<String> = r.versions.iter().map(|(k, v)| format!("{k}={v}")).collect();
    crate::outln!("  versions     {}", versions.join(" "));
    if r.chain.len() > 1 || r.chain.first().is_some_and(|l| l.note.is_some()) {
        crate::outln!("  history      {}", chain_line(&r.chain));
    }
    crate::outln!("  done         {} ({} accepted by people)", r.done, r.human_accepted);
    if r.paid_answers_lost > 0 {
        crate::outln!(
            "  lost         {} paid answers left no result (Redis could not store them in time)",
            r.paid_answers_lost
        );
    }
    if let (Some(secs), Some(rate)) = (r.processing_secs, r.processing_records_per_sec) {
        crate::outln!("  processing   {secs:.0}s ({rate:.1} records/s), first call to last outcome");
    }
    if let (Some(secs), Some(rate)) = (r.elapsed_secs, r.records_per_sec) {
        crate::outln!("  elapsed      {secs:.0}s ({rate:.1} records/s), enqueue to the last outcome");
    }
    let hist: Vec<String> = r.attempts_histogram.iter().map(|(a, n)| format!("{a}:{n}")).collect();
    crate::outln!("  attempts     {} (attempts:records)", hist.join(" "));
    crate::outln!("  validation errors (attempts):");
    for (k, n) in &r.validation_errors {
        crate::outln!("    {k:<32} {n}");
    }
    crate::outln!("  retries by cause:");
    for (k, n) in &r.retries_by_cause {
        crate::outln!("    {k:<32} {n}");
    }
    crate::outln!("  review by reason:");
    for (k, n) in &r.review_by_reason {
        crate::outln!("    {k:<32} {n}");
    }
    crate::outln!("  cost (USD)                         calls   prompt   cached  completion        cost");
    for (name, u) in [
        ("first-attempt successes", &r.first_attempt_successes),
        ("done after retries", &r.done_after_retries),
        ("accepted by people", &r.accepted_by_people),
        ("ended in review", &r.ended_in_review),
    ] {
        crate::outln!(
            "    {name:<30} {:>7} {:>8} {:>8} {:>11} {:>11.6}",
            u.calls,
            u.prompt_tokens,
            u.cached_tokens,
            u.completion_tokens,
            u.cost_usd
        );
    }
    print_spend(r);
    if !r.agreement.is_empty() {
        crate::outln!("  cross-check: the checker agreed with the first model");
        for (field, g) in &r.agreement {
            crate::outln!(
                "    {field:<30} {:>7} of {:>7} checked ({:.1}%)",
                g.agreed,
                g.checked,
                g.rate * 100.0
            );
        }
    }
    if r.accuracy.overall.audited + r.accuracy.waiting > 0 {
        print_accuracy(&r.accuracy);
    }
}

/// The spend from the ledger, by cause, with what was estimated and what
/// went through the provider's Batch API.
fn print_spend(r: &Report) {
    crate::outln!("  spend (USD, every paid call, from the ledger)       calls        cost");
    for (name, bucket) in [
        ("first calls", "first"),
        ("retries after a transient failure", "transient_retry"),
        ("retries after invalid output", "validation_retry"),
        ("human remediation (requeued rounds)", "human"),
        ("the checker's calls (cross-check)", "check"),
        ("paid without a result", common::ledger::NO_RESULT),
    ] {
        let b = r.spend.bucket(bucket);
        crate::outln!("    {name:<44} {:>7} {:>11.6}", b.calls, b.cost_usd);
    }
    let t = &r.total;
    crate::outln!(
        "    {:<44} {:>7} {:>11.6}  ({} prompt, {} cached, {} completion tokens)",
        "total",
        t.calls,
        t.cost_usd,
        t.prompt_tokens,
        t.cached_tokens,
        t.completion_tokens
    );
    if t.estimated_calls > 0 {
        crate::outln!(
            "    of which estimated: {} calls timed out or cut off at shutdown, {} tokens, {:.6} USD (the server may have billed them)",
            t.estimated_calls,
            t.estimated_tokens,
            t.estimated_cost_usd
        );
    }
    if !r.spend.by_tier.is_empty() {
        let standard = r.spend.standard_cost_usd();
        crate::outln!(
            "    by route ({:.6} USD at standard prices: {:.2} of it spent)",
            standard,
            if standard > 0.0 { t.cost_usd / standard } else { 0.0 }
        );
        for (tier, part) in r.spend.routes() {
            crate::outln!(
                "      {tier:<42} {:>7} {:>11.6}  (at standard {:.6})",
                part.calls,
                part.cost_usd,
                part.standard_cost_usd
            );
        }
    }
    let b = &r.spend.batch;
    if b.calls > 0 {
        crate::outln!(
            "    of which through the provider's Batch API: {} calls, {:.6} USD at batch prices; {:.6} USD online: saved {:.6} USD ({:.0}%)",
            b.calls,
            b.cost_usd,
            b.online_cost_usd,
            b.saving_usd(),
            if b.online_cost_usd > 0.0 {
                100.0 * b.saving_usd() / b.online_cost_usd
            } else {
                0.0
            }
        );
    }
}

/// The spot checks' estimate of a job's accuracy.
pub fn print_accuracy(a: &common::audit::Accuracy) {
    crate::outln!("  spot checks  accuracy {}", a.overall.text());
    crate::outln!("    waiting    {} results to judge", a.waiting);
    for (field, value, rate) in &a.by_label {
        crate::outln!("    {field} = {value:<24} {}", rate.text());
    }
}

#[cfg(test)]
mod tests {
    use common::spec::Prices;

    use super::*;

    #[test]
    fn cost_prices_cached_tokens_separately() {
        let p = Prices {
            input_per_mtok: 1.0,
            cached_input_per_mtok: Some(0.5),
            output_per_mtok: 4.0,
            ..Prices::default()
        };
        let c = p.cost(1_000_000, 400_000, 250_000);
        assert!((c - (0.6 + 0.2 + 1.0)).abs() < 1e-9, "{c}");
        let no_cache_price = Prices {
            cached_input_per_mtok: None,
            ..p
        };
        assert!((no_cache_price.cost(1_000_000, 400_000, 0) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn timestamps_round_trip() {
        for secs in [0u64, 951_782_400, 1_795_894_621] {
            assert_eq!(parse_rfc3339(&common::manifest::rfc3339(secs)), Some(secs));
        }
        assert_eq!(parse_rfc3339("2026-11-29 19:37:01"), None);
    }
}

//! `producer estimate --job NAME`: after a sample run, what the full dataset
//! will cost and how long it will take, from the sample's measured calls,
//! tokens, cost and latency per record and the spec's limits, with a range
//! (the 95% interval of the sample's mean per record).

use common::spec::JobSpec;
use common::store::RedisStore;
use common::task::HistoryItem;
use serde::Serialize;

/// A measured figure per record over the sample: mean, 10th and 90th percentile.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct PerRecord {
    pub mean: f64,
    pub p10: f64,
    pub p90: f64,
    /// Half-width of the 95% interval of the mean.
    pub margin: f64,
}

impl PerRecord {
    fn of(mut xs: Vec<f64>) -> PerRecord {
        if xs.is_empty() {
            return PerRecord::default();
        }
        xs.sort_by(f64::total_cmp);
        let n = xs.len() as f64;
        let mean = xs.iter().sum::<f64>() / n;
        let var = if xs.len() > 1 {
            xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)
        } else {
            0.0
        };
        let at = |q: f64| xs[((n - 1.0) * q).round() as usize];
        PerRecord {
            mean,
            p10: at(0.1),
            p90: at(0.9),
            margin: 1.96 * (var / n).sqrt(),
        }
    }

    fn range(&self, records: f64) -> (f64, f64, f64) {
        (
            records * (self.mean - self.margin).max(0.0),
            records * self.mean,
            records * (self.mean + self.margin),
        )
    }
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Estimate {
    pub job: String,
    /// Records of the sample with an outcome (done or in review).
    pub sample_records: u64,
    /// Records of the full dataset (the non-blank lines of the file the
    /// sample was taken from, or `--records`).
    pub records: u64,
    pub calls: PerRecord,
    pub prompt_tokens: PerRecord,
    pub completion_tokens: PerRecord,
    pub cost_usd: PerRecord,
    /// Seconds per call.
    pub latency_secs: PerRecord,
    /// Projected cost of the full dataset: low, expected, high.
    pub total_cost_usd: (f64, f64, f64),
    /// Projected duration in seconds (low, expected, high) and the limit that binds it.
    pub duration_secs: (f64, f64, f64),
    pub bound_by: String,
    /// Why the projection may lean one way (a sample that was not drawn at random).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
    /// A job with the flex tier: the planner's share and what it costs
    /// against all-standard.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plan: Option<Plan>,
}

/// The plan for the full dataset (see [`common::route`]).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Plan {
    /// The deadline as the spec says it (None: none; every call flex).
    pub deadline: Option<String>,
    /// The share of flex calls the provider took in the sample (1.0 when
    /// the sample made none).
    pub flex_acceptance: f64,
    /// The share of calls the planner would send standard from the start.
    pub standard_share: f64,
    /// Expected cost of the plan, and of the same calls all standard and all flex.
    pub cost_usd: f64,
    pub all_standard_cost_usd: f64,
    pub all_flex_cost_usd: f64,
    /// Whether the limits let the plan end before the deadline.
    pub deadline_met: bool,
    /// `"batch"` among the tiers and the deadline leaves the batch's
    /// completion window: every record through the Batch API.
    pub all_batch: bool,
}

/// What the sample says of the routes: each record's cost at flex and at
/// batch prices, and the share of flex calls the provider took.
struct RouteSample {
    flex_prices: common::spec::Prices,
    batch_prices: common::spec::Prices,
    flex_cost: Vec<f64>,
    batch_cost: Vec<f64>,
    flex_calls: u64,
    flex_refused: u64,
}

impl RouteSample {
    fn new(prices: &common::spec::Prices) -> RouteSample {
        RouteSample {
            flex_prices: prices.flex(),
            batch_prices: prices.batch(),
            flex_cost: Vec::new(),
            batch_cost: Vec::new(),
            flex_calls: 0,
            flex_refused: 0,
        }
    }

    /// One record's calls and their usage.
    fn see(&mut self, attempts: &[&common::task::Attempt], usage: &[common::task::Usage]) {
        self.flex_cost
            .push(usage.iter().map(|u| u.cost(&self.flex_prices)).sum());
        self.batch_cost
            .push(usage.iter().map(|u| u.cost(&self.batch_prices)).sum());
        for a in attempts.iter().filter(|a| a.tier.as_deref() == Some("flex")) {
            self.flex_calls += 1;
            self.flex_refused += u64::from(a.outcome == "flex_unavailable");
        }
    }

    /// The plan for `records` of `cost` each at standard prices, at
    /// `calls_per_sec` (None: the job names neither flex nor batch).
    fn plan(self, spec: &JobSpec, records: f64, cost: f64, calls_per_sec: f64) -> Option<Plan> {
        if !spec.provider.tiers.iter().any(|t| t == "flex" || t == "batch") {
            return None;
        }
        let acceptance = match self.flex_calls {
            0 => 1.0,
            n => (n - self.flex_refused) as f64 / n as f64,
        };
        let costs = (
            cost,
            PerRecord::of(self.flex_cost).mean,
            PerRecord::of(self.batch_cost).mean,
        );
        Some(plan(spec, records, costs, acceptance, calls_per_sec))
    }
}

/// The plan for `records` records of `cost` (standard) and `flex_cost`
/// each, at `records_per_sec` if every call went flex.
fn plan(spec: &JobSpec, records: f64, costs: (f64, f64, f64), acceptance: f64, calls_per_sec: f64) -> Plan {
    use common::route::{PlanFacts, standard_share};
    let (cost, flex_cost, batch_cost) = costs;
    let left_ms = spec
        .job
        .deadline
        .as_deref()
        .and_then(|d| common::route::parse_deadline(d, common::route::now_ms()).ok())
        .map(|at| at.saturating_sub(common::route::now_ms()));
    // Settled per second all flex: each call slot settles `acceptance` of a record.
    let flex_rate = calls_per_sec * acceptance;
    let facts = PlanFacts {
        now_ms: 0,
        deadline_ms: left_ms,
        remaining: records as u64,
        rate: calls_per_sec.is_finite().then_some(flex_rate),
        flex_acceptance: acceptance,
        standard_share: 0.0,
    };
    let window_ms = spec.batch.completion_window_ms();
    let all_batch = spec.provider.batch_tier() && common::route::leaves_batch_window(left_ms, window_ms);
    if all_batch {
        return Plan {
            deadline: spec.job.deadline.clone(),
            flex_acceptance: acceptance,
            standard_share: 0.0,
            cost_usd: records * batch_cost,
            all_standard_cost_usd: records * cost,
            all_flex_cost_usd: records * flex_cost,
            deadline_met: true,
            all_batch,
        };
    }
    let p = standard_share(&facts);
    let rate = calls_per_sec * (p + (1.0 - p) * acceptance);
    let deadline_met = left_ms.is_none_or(|left| {
        let room = left.saturating_sub(common::route::margin_ms(left)) as f64 / 1000.0;
        !calls_per_sec.is_finite() || records / rate.max(1e-9) <= room
    });
    Plan {
        deadline: spec.job.deadline.clone(),
        flex_acceptance: acceptance,
        standard_share: p,
        cost_usd: records * (p * cost + (1.0 - p) * flex_cost),
        all_standard_cost_usd: records * cost,
        all_flex_cost_usd: records * flex_cost,
        deadline_met,
        all_batch,
    }
}

/// Calls a minute the spec's limits allow for calls of this shape.
fn calls_per_minute(spec: &JobSpec, prompt: f64, completion: f64, latency_secs: f64) -> (f64, String) {
    let l = &spec.limits;
    let max_tokens = f64::from(spec.provider.max_tokens);
    let mut best = (f64::INFINITY, "no limit".to_owned());
    let mut bound = |rate: f64, what: &str| {
        if rate.is_finite() && rate < best.0 {
            best = (rate, what.to_owned());
        }
    };
    if let Some(r) = l.requests_per_minute {
        bound(r as f64, "limits.requests_per_minute");
    }
    // Tokens are reserved as the prompt plus max_tokens, as the limiter does.
    if let Some(t) = l.tokens_per_minute {
        bound(t as f64 / (prompt + max_tokens).max(1.0), "limits.tokens_per_minute");
    }
    if let Some(t) = l.input_tokens_per_minute {
        bound(t as f64 / prompt.max(1.0), "limits.input_tokens_per_minute");
    }
    if let Some(t) = l.output_tokens_per_minute {
        bound(
            t as f64 / completion.max(max_tokens).max(1.0),
            "limits.output_tokens_per_minute",
        );
    }
    if let Some(c) = l.max_concurrent {
        bound(
            c as f64 * 60.0 / latency_secs.max(0.001),
            "limits.max_concurrent and the measured latency",
        );
    }
    best
}

/// The non-blank lines of the dataset the sample was taken from (the file
/// must still be the one the manifest recorded).
fn dataset_records(m: &common::manifest::Manifest) -> anyhow::Result<u64> {
    let d = m
        .datasets
        .last()
        .ok_or_else(|| anyhow::anyhow!("the job's manifest lists no dataset: give --records N"))?;
    let path = std::path::Path::new(&d.dataset.path);
    match crate::reader::file_sha256(path) {
        Ok((sha, _)) if sha == d.dataset.sha256 => {}
        _ => anyhow::bail!(
            "{} is gone or changed since the sample was taken from it: give the full dataset's size with --records N",
            d.dataset.path
        ),
    }
    let mut reader = crate::reader::LineReader::open(path, 0, 0, 64)?;
    let (mut buf, mut n) = (Vec::new(), 0u64);
    while let Some(pos) = reader.next_line(&mut buf)? {
        if pos.oversize.is_some() || !buf.iter().all(u8::is_ascii_whitespace) {
            n += 1;
        }
    }
    Ok(n)
}

pub async fn estimate(store: &RedisStore, job: &str, spec: &JobSpec, records: Option<u64>) -> anyhow::Result<Estimate> {
    let manifest = store
        .load_manifest(job)
        .await?
        .ok_or_else(|| anyhow::anyhow!("job {job} has no manifest: enqueue (a sample of) the dataset first"))?;
    let (mut calls, mut prompt, mut completion, mut cost, mut latency) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let prices = &spec.prices;
    let mut routes = RouteSample::new(prices);
    let mut see = |history: &[HistoryItem]| {
        let attempts: Vec<_> = history.iter().filter_map(HistoryItem::as_attempt).collect();
        if attempts.is_empty() {
            return;
        }
        calls.push(attempts.len() as f64);
        let usage: Vec<_> = attempts.iter().filter_map(|a| a.usage).collect();
        prompt.push(usage.iter().map(|u| u.prompt as f64).sum());
        completion.push(usage.iter().map(|u| u.completion as f64).sum());
        cost.push(usage.iter().map(|u| u.cost(prices)).sum());
        routes.see(&attempts, &usage);
        latency.extend(attempts.iter().map(|a| a.elapsed_ms as f64 / 1000.0));
    };
    crate::sink::each_result(store, job, Some(spec), spec.job.partitions, |r| see(&r.history)).await?;
    for p in 0..spec.job.partitions {
        store.review_entries(job, p, |e| see(&e.history)).await?;
    }
    let sample_records = calls.len() as u64;
    if sample_records == 0 {
        anyhow::bail!("job {job} has no record with an outcome yet: run the sample first");
    }
    let full = match records {
        Some(n) => n,
        None => dataset_records(&manifest)?,
    };
    let (calls, prompt, completion, cost, latency) = (
        PerRecord::of(calls),
        PerRecord::of(prompt),
        PerRecord::of(completion),
        PerRecord::of(cost),
        PerRecord::of(latency),
    );
    let per_call = |x: &PerRecord| x.mean / calls.mean.max(1e-9);
    let (rate, bound_by) = calls_per_minute(spec, per_call(&prompt), per_call(&completion), latency.mean);
    let n = full as f64;
    let duration = if rate.is_finite() {
        let (lo, mid, hi) = calls.range(n);
        (lo / rate * 60.0, mid / rate * 60.0, hi / rate * 60.0)
    } else {
        (0.0, 0.0, 0.0)
    };
    // Calls a second the limits allow, over calls a record takes.
    let plan = routes.plan(spec, n, cost.mean, rate / 60.0 / calls.mean.max(1e-9));
    let warning = manifest.sample.as_ref().and_then(|s| {
        if s.from_job.is_some() {
            Some("the sample is another job's records (--from-job), not drawn at random: the projection leans to them".to_owned())
        } else if s.stratify {
            Some("the sample is stratified (its extremes and rare values on purpose): the projection leans to them; a plain --sample estimates better".to_owned())
        } else {
            None
        }
    });
    Ok(Estimate {
        warning,
        job: job.to_owned(),
        sample_records,
        records: full,
        total_cost_usd: cost.range(n),
        calls,
        prompt_tokens: prompt,
        completion_tokens: completion,
        cost_usd: cost,
        latency_secs: latency,
        duration_secs: duration,
        bound_by,
        plan,
    })
}

fn hms(secs: f64) -> String {
    let s = secs.round() as u64;
    format!("{}h{:02}m{:02}s", s / 3600, s / 60 % 60, s % 60)
}

pub fn print(e: &Estimate) {
    crate::outln!(
        "estimate for job {}: {} records, from {} sampled",
        e.job,
        e.records,
        e.sample_records
    );
    crate::outln!("  per record (mean, p10-p90):");
    for (name, x, digits) in [
        ("calls", &e.calls, 2),
        ("prompt tokens", &e.prompt_tokens, 0),
        ("completion tokens", &e.completion_tokens, 0),
        ("cost (USD)", &e.cost_usd, 8),
    ] {
        crate::outln!(
            "    {name:<18} {:.digits$} ({:.digits$}-{:.digits$})",
            x.mean,
            x.p10,
            x.p90
        );
    }
    crate::outln!("    {:<18} {:.2} s a call", "latency", e.latency_secs.mean);
    if let Some(w) = &e.warning {
        crate::outln!("  warning      {w}");
    }
    let (lo, mid, hi) = e.total_cost_usd;
    crate::outln!("  cost         {mid:.4} USD (95%: {lo:.4}-{hi:.4})");
    let (lo, mid, hi) = e.duration_secs;
    if mid > 0.0 {
        crate::outln!(
            "  duration     {} ({}-{}), bound by {}",
            hms(mid),
            hms(lo),
            hms(hi),
            e.bound_by
        );
    } else {
        crate::outln!("  duration     unbounded by the spec's limits (set [limits] to estimate it)");
    }
    if let Some(p) = e.plan.as_ref().filter(|p| p.all_batch) {
        crate::outln!(
            "  plan         every record through the Batch API (deadline {}: its completion window fits)",
            p.deadline.as_deref().unwrap_or("none")
        );
    } else if let Some(p) = &e.plan {
        crate::outln!(
            "  plan         {:.0}% of calls standard, the rest flex ({:.0}% of flex calls taken in the sample); deadline {}: {}",
            100.0 * p.standard_share,
            100.0 * p.flex_acceptance,
            p.deadline.as_deref().unwrap_or("none"),
            if p.deadline_met {
                "met"
            } else {
                "NOT met even all standard: move it (producer deadline) or raise [limits]"
            }
        );
        crate::outln!(
            "  plan cost    {:.4} USD: {:.2} of all-standard ({:.4} USD); all flex {:.4} USD",
            p.cost_usd,
            if p.all_standard_cost_usd > 0.0 {
                p.cost_usd / p.all_standard_cost_usd
            } else {
                0.0
            },
            p.all_standard_cost_usd,
            p.all_flex_cost_usd
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plan_sends_flex_while_the_deadline_leaves_room() {
        let example = include_str!("../../examples/job.toml");
        let with = |deadline: &str| {
            let text = example.replacen(
                "partitions = 4 ",
                &format!("partitions = 4\ndeadline = \"{deadline}\" "),
                1,
            );
            JobSpec::parse(&text, "job.toml").unwrap()
        };
        // 10,000 records at 0.001 USD standard, 0.0005 flex; 20 calls a
        // second; flex takes 60%: 12 records a second all flex (~14 min).
        let roomy = plan(&with("1h"), 10_000.0, (0.001, 0.0005, 0.0005), 0.6, 20.0);
        assert_eq!(roomy.standard_share, 0.0);
        assert!((roomy.cost_usd - 5.0).abs() < 1e-9 && roomy.deadline_met, "{roomy:?}");
        assert!((roomy.all_standard_cost_usd - 10.0).abs() < 1e-9);
        // 11 minutes: flex alone is too slow, all standard (8.3 min) is not.
        let tight = plan(&with("11m"), 10_000.0, (0.001, 0.0005, 0.0005), 0.6, 20.0);
        assert!(tight.standard_share > 0.0 && tight.standard_share < 1.0, "{tight:?}");
        assert!(
            tight.cost_usd > 5.0 && tight.cost_usd < 10.0 && tight.deadline_met,
            "{tight:?}"
        );
        // 5 minutes: not even all standard.
        let impossible = plan(&with("5m"), 10_000.0, (0.001, 0.0005, 0.0005), 0.6, 20.0);
        assert_eq!(impossible.standard_share, 1.0);
        assert!(!impossible.deadline_met);
        // With the batch tier and days to spare: every record through the Batch API.
        let mut batch = with("3d");
        batch.provider.tiers = vec!["batch".into(), "flex".into(), "standard".into()];
        let through_batch = plan(&batch, 10_000.0, (0.001, 0.0005, 0.0004), 0.6, 20.0);
        assert!(
            through_batch.all_batch && (through_batch.cost_usd - 4.0).abs() < 1e-9,
            "{through_batch:?}"
        );
        batch.job.deadline = Some("11m".into());
        assert!(!plan(&batch, 10_000.0, (0.001, 0.0005, 0.0004), 0.6, 20.0).all_batch);
    }

    #[test]
    fn per_record_figures_have_a_mean_percentiles_and_an_interval() {
        let p = PerRecord::of((1..=10).map(f64::from).collect());
        assert!((p.mean - 5.5).abs() < 1e-12);
        assert_eq!((p.p10, p.p90), (2.0, 9.0));
        // sd of 1..=10 is 3.02765; 1.96 * sd / sqrt(10) = 1.8766
        assert!((p.margin - 1.8766).abs() < 1e-3, "{}", p.margin);
        let (lo, mid, hi) = p.range(100.0);
        assert!((mid - 550.0).abs() < 1e-9 && lo < mid && hi > mid);
        assert_eq!(PerRecord::of(vec![]), PerRecord::default());
    }
}

//! `producer status` and `producer export`: where every record of a job is,
//! read from the job's state in Redis (not from counters that could drift).

use std::collections::BTreeMap;
use std::io::Write;

use common::spec::SinkKind;
use common::store::{RedisStore, StoreError, Tokens};
use common::task::RecordState;
use serde::Serialize;

use crate::reconcile::{Reconciliation, Tally, reconcile_counting};

/// Where a job's records are.
#[derive(Debug, Clone, Default, Serialize)]
pub struct JobStatus {
    pub job: String,
    /// From the manifest (None before an enqueue completed).
    pub expected: Option<u64>,
    /// Records the job's state knows.
    pub known: u64,
    /// Waiting in a stream, not delivered yet.
    pub queued: u64,
    /// Delivered to a worker, not yet settled.
    pub in_flight: u64,
    /// Waiting to retry.
    pub delayed: u64,
    /// Held by provider batch shards (batch mode): submitted, or on their way.
    pub batched: u64,
    /// Batch mode: the job's shards by state, and the provider batch of each.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub shards: Vec<common::shard::ShardView>,
    pub done: u64,
    pub review: u64,
    pub dropped: u64,
    pub dropped_by_reason: BTreeMap<String, u64>,
    pub cancelled: u64,
    /// Expected records that are nowhere: not known to the job's state, or
    /// known but their task, retry, result or review entry is gone.
    pub missing: u64,
    /// Records in two places (or twice in one): two outcomes, two tasks.
    pub duplicates: u64,
    /// Tasks, retries, results or review entries of records the job does not know.
    pub unknown: u64,
    /// The anomalies by record id (with `--ids`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub anomalies: Option<Reconciliation>,
    /// Every expected record is in exactly one terminal set, and nothing is
    /// missing, duplicated or unknown.
    pub complete: bool,
    /// Attempts per done record: attempts -> records.
    pub attempts_histogram: BTreeMap<u64, u64>,
    /// Tokens of every paid call (from the cost ledger; for a job older
    /// than the ledger, of the done records).
    pub tokens: Tokens,
    /// What the job spent (every paid call, from the ledger: it only grows).
    pub cost_usd: f64,
    /// The job's spend cap, when it has one (`[budget] max_cost_usd`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget: Option<common::store::BudgetState>,
    /// Records the whole fleet settled (done, to review, dropped) per second
    /// over the last minute (from the job's counters).
    pub rate_per_sec: f64,
    /// Expected records not settled yet.
    pub remaining: u64,
    /// At the current rate, seconds until none remain (None: nothing was
    /// settled in the last minute, so no estimate; 0: none remain).
    pub eta_secs: Option<u64>,
    /// Dataset lines refused at enqueue (not records of the job: see `producer dropped`).
    pub dropped_at_enqueue: u64,
    /// Records and spend per route, against all-standard (a job that names
    /// `provider.tiers`, or one through the Batch API).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routes: Option<RouteStatus>,
    /// The job's deadline, and whether it holds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deadline: Option<DeadlineStatus>,
    pub halted: Option<String>,
    /// Why the job waits, in one line: `provider unavailable since <time>,
    /// last error <cause> from <base_url>: <the provider's words>` (None
    /// while its provider answers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waiting: Option<String>,
    /// The job's provider as the fleet sees it: down or not, since when,
    /// the last error, outages so far.
    pub provider: common::store::ProviderOutage,
    /// The job's result sink, when it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sink: Option<crate::sink::SinkStatus>,
    /// The done records' ids, when asked for (to check the sink against).
    #[serde(skip)]
    pub done_ids: common::ids::RecordIds,
    /// The `--redis` part of a command suggested in the text (see
    /// [`common::secret::redis_flag`]).
    #[serde(skip)]
    pub redis_flag: String,
}

/// The routes of a job: what each did, and the cost against all-standard.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RouteStatus {
    /// Tier -> records whose result came through it.
    pub records: BTreeMap<String, u64>,
    /// Tier -> calls, cost, and the same calls at standard prices.
    pub spend: BTreeMap<String, common::ledger::TierSpend>,
    /// Every call at standard prices.
    pub standard_cost_usd: f64,
    /// What was spent over that (1.0: all standard; None: nothing spent).
    pub cost_ratio_vs_standard: Option<f64>,
}

/// A job's deadline as `status` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeadlineStatus {
    /// RFC 3339, UTC.
    pub at: String,
    pub at_ms: u64,
    /// Seconds left (negative: passed).
    pub left_secs: i64,
    /// Whether the job ends in time: for a finished job, its last record
    /// settled before the deadline (to the minute of the job's counters);
    /// otherwise, the records left end in time at the current rate.
    pub holds: bool,
}

fn route_status(spend: &common::ledger::Spend, stats: &common::stats::JobStats) -> RouteStatus {
    let routes = spend.routes();
    let standard_cost_usd = spend.standard_cost_usd();
    RouteStatus {
        records: stats.routes.clone(),
        spend: routes,
        standard_cost_usd,
        cost_ratio_vs_standard: (standard_cost_usd > 0.0).then(|| spend.totals.cost_usd / standard_cost_usd),
    }
}

fn deadline_status(at_ms: u64, now_ms: u64, s: &JobStatus, stats: &common::stats::JobStats) -> DeadlineStatus {
    let holds = if s.remaining == 0 {
        let last = stats.timeline.iter().rev().find(|(_, m)| m.done + m.failed > 0);
        last.is_none_or(|(minute, _)| minute * 60_000 <= at_ms)
    } else {
        s.eta_secs.is_some_and(|eta| now_ms + eta * 1000 <= at_ms)
    };
    DeadlineStatus {
        at: common::manifest::rfc3339(at_ms / 1000),
        at_ms,
        left_secs: (at_ms as i64 - now_ms as i64) / 1000,
        holds,
    }
}

/// Reads the status of a job from Redis, with its reconciliation.
/// `with_ids` keeps the record ids of every anomaly; `keep_done` the ids of
/// the done records (in [`JobStatus::done_ids`], read in the same pass).
/// Unfinished shards listed one by one (`--json` has them all).
const SHARDS_SHOWN: usize = 20;

pub async fn status(store: &RedisStore, job: &str, with_ids: bool, keep_done: bool) -> Result<JobStatus, StoreError> {
    let manifest = store.load_manifest(job).await?;
    let spec = store.job_spec(job).await.ok().flatten();
    let partitions = match &manifest {
        Some(m) => m.partitions,
        None => spec.as_ref().map_or(0, |s| s.job.partitions),
    };
    // With a sink, a done record's result leaves Redis once the sink holds it.
    let sink = spec.as_ref().is_some_and(|s| s.sink.kind != SinkKind::None);
    let mut s = JobStatus {
        job: job.to_owned(),
        expected: manifest.as_ref().map(|m| m.expected_records),
        dropped_at_enqueue: manifest.as_ref().map_or(0, |m| m.dropped_lines),
        halted: store.halted(job).await?,
        provider: store.provider_outage(job).await?,
        ..JobStatus::default()
    };
    s.waiting = s.provider.waiting();
    let spend = read_work_and_spend(store, job, partitions, sink, &mut s).await?;
    let routed = spec
        .as_ref()
        .is_some_and(|s| s.provider.routed() || !s.provider.fallbacks.is_empty());
    let budget = store.budget(job).await?;
    s.budget = budget.cap_usd.is_some().then_some(budget);
    // The states are counted in the reconciliation's own pass over them.
    let mut t = Tally {
        done_ids: keep_done.then(common::ids::RecordIds::default),
        ..Default::default()
    };
    let r = reconcile_counting(store, job, partitions, sink, Some(&mut t)).await?;
    s.known = t.known;
    s.delayed = t.delayed;
    s.batched = t.batched;
    s.done = t.done;
    s.review = t.review;
    s.cancelled = t.cancelled;
    s.dropped = t.dropped;
    s.dropped_by_reason = t.dropped_by_reason;
    s.done_ids = t.done_ids.unwrap_or_default();
    s.queued = t.queued.saturating_sub(s.in_flight);
    s.missing = s.expected.map_or(0, |e| e.saturating_sub(s.known)) + r.missing.len() as u64;
    s.duplicates = r.duplicates.len() as u64;
    s.unknown = r.unknown.len() as u64;
    let terminal = s.done + s.review + s.dropped + s.cancelled;
    s.complete = r.is_clean() && s.expected.is_some_and(|e| e == s.known && terminal == s.known);
    if with_ids {
        s.anomalies = Some(r);
    }
    let stats = store.stats(job, partitions).await?;
    s.rate_per_sec = stats.throughput(now_secs(), 1);
    s.remaining = s.expected.unwrap_or(s.known).saturating_sub(terminal);
    s.eta_secs = eta(s.remaining, s.rate_per_sec);
    if routed || !spend.batch.is_empty() {
        s.routes = Some(route_status(&spend, &stats));
    }
    if let Some(at) = store.deadline(job).await? {
        s.deadline = Some(deadline_status(at, common::route::now_ms(), &s, &stats));
    }
    Ok(s)
}

/// In flight, shards, attempts and tokens per partition (what left Redis
/// for the sink included), then every paid call from the ledger (the done
/// records' tokens stand in for a job older than it).
async fn read_work_and_spend(
    store: &RedisStore,
    job: &str,
    partitions: u32,
    sink: bool,
    s: &mut JobStatus,
) -> Result<common::ledger::Spend, StoreError> {
    for p in 0..partitions {
        s.in_flight += store.pending_count(job, p).await?;
        let mut shards = store.shards(job, p).await?;
        shards.sort_by_key(|(_, s)| s.created_ms);
        s.shards
            .extend(shards.iter().map(|(_, sh)| common::shard::ShardView::from(sh)));
        store
            .results(job, p, |r| {
                *s.attempts_histogram.entry(u64::from(r.attempts)).or_default() += 1;
                let t = Tokens::of(&r);
                s.tokens.add(t.prompt, t.completion, t.cached);
            })
            .await?;
    }
    if sink {
        // What left Redis for the sink still counts.
        let sunk = store.sunk(job, partitions).await?;
        s.tokens
            .add(sunk.tokens.prompt, sunk.tokens.completion, sunk.tokens.cached);
        for (attempts, n) in sunk.attempts_histogram {
            *s.attempts_histogram.entry(attempts).or_default() += n;
        }
    }
    let spend = store.spend(job, partitions).await?;
    let spent = &spend.totals;
    if spent.calls > 0 {
        s.tokens = Tokens {
            prompt: spent.prompt_tokens,
            completion: spent.completion_tokens,
            cached: spent.cached_tokens,
        };
        s.cost_usd = spent.cost_usd;
    }
    Ok(spend)
}

/// Unix seconds now.
pub fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `12.50 records/s over the last minute (the fleet); 340 remaining, about 27s at this rate`.
fn rate_line(s: &JobStatus) -> String {
    let eta = match s.eta_secs {
        Some(0) => "none remaining".to_owned(),
        Some(secs) => format!(
            "{} remaining, about {} at this rate",
            s.remaining,
            common::manifest::human_duration(secs * 1000)
        ),
        None => format!(
            "{} remaining, no estimate: none settled in the last minute",
            s.remaining
        ),
    };
    format!(
        "{:.2} records/s over the last minute (the fleet); {eta}",
        s.rate_per_sec
    )
}

/// Seconds until `remaining` records are settled at `rate` per second.
pub fn eta(remaining: u64, rate: f64) -> Option<u64> {
    match remaining {
        0 => Some(0),
        _ if rate > 0.0 => Some((remaining as f64 / rate).ceil() as u64),
        _ => None,
    }
}

/// Which terminal set `export` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExportSet {
    Done,
    Review,
    Dropped,
    /// Every paid call of the cost ledger.
    Ledger,
}

impl ExportSet {
    pub fn name(self) -> &'static str {
        match self {
            ExportSet::Done => "done",
            ExportSet::Review => "review",
            ExportSet::Dropped => "dropped",
            ExportSet::Ledger => "ledger",
        }
    }
}

/// Writes one set of a job as JSONL, streamed page by page; returns how many.
/// Each line is written whole from one read, so an export taken while workers
/// run is consistent per record: a record is exported in the set it was in.
pub async fn export(
    store: &RedisStore,
    job: &str,
    partitions: u32,
    what: ExportSet,
    out: &mut impl Write,
) -> anyhow::Result<u64> {
    let mut n = 0u64;
    let mut failed: Option<std::io::Error> = None;
    let mut write = |line: String| {
        if failed.is_none() {
            match writeln!(out, "{line}") {
                Ok(()) => n += 1,
                Err(e) => failed = Some(e),
            }
        }
    };
    if matches!(what, ExportSet::Done | ExportSet::Ledger) {
        let spec = store.job_spec(job).await.ok().flatten();
        if what == ExportSet::Done {
            crate::sink::each_result(store, job, spec.as_ref(), partitions, |r| write(r.encode())).await?;
        } else {
            crate::sink::each_paid_call(store, job, spec.as_ref(), partitions, |c| write(c.line())).await?;
        }
    }
    for p in 0..partitions {
        match what {
            ExportSet::Done | ExportSet::Ledger => {}
            ExportSet::Review => store.review_entries(job, p, |e| write(e.encode())).await?,
            ExportSet::Dropped => {
                let mut dropped = Vec::new();
                store
                    .record_states(job, p, |rid, state| {
                        if let Some(RecordState::Dropped(reason)) = state {
                            dropped.push((rid, reason));
                        }
                    })
                    .await?;
                for (record_id, reason) in dropped {
                    // A person's rejection: who, why and the record, from the archived entry.
                    let archived = if reason == RecordState::REJECTED {
                        store.archived_review(job, p, &record_id).await?
                    } else {
                        None
                    };
                    let act = archived.as_ref().and_then(|e| e.actions.last());
                    write(
                        DroppedRecord {
                            key: archived.as_ref().map(|e| e.key.clone()),
                            reviewer: act.map(|a| a.by.clone()),
                            reason_text: act.and_then(|a| a.reason.clone()),
                            at: act.map(|a| a.at.clone()),
                            input: archived.as_ref().map(|e| e.input_value()),
                            record_id,
                            reason,
                        }
                        .encode(),
                    );
                }
            }
        }
    }
    if let Some(e) = failed {
        return Err(e.into());
    }
    out.flush()?;
    Ok(n)
}

/// A line of `export --what dropped`: the record and why; for a record a
/// person rejected, also its business key, who, their reason, when, and
/// its input.
#[derive(Serialize)]
struct DroppedRecord {
    record_id: String,
    reason: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    key: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reviewer: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason_text: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    input: Option<serde_json::Value>,
}

impl DroppedRecord {
    fn encode(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// Batch mode's lines of a status: tasks in batches, shards by state, and
/// the unfinished ones with their provider batch.
fn print_batches(s: &JobStatus) {
    if s.batched == 0 && s.shards.is_empty() {
        return;
    }
    crate::outln!("  in batches   {}", s.batched);
    let mut by_state: BTreeMap<&str, u64> = BTreeMap::new();
    for sh in &s.shards {
        *by_state.entry(sh.state.as_str()).or_default() += 1;
    }
    let states: Vec<String> = by_state.iter().map(|(k, n)| format!("{n} {k}")).collect();
    crate::outln!("  shards       {}", states.join(", "));
    // The unfinished ones, each with its provider batch.
    let open: Vec<_> = s.shards.iter().filter(|sh| sh.state != "reconciled").collect();
    for sh in open.iter().take(SHARDS_SHOWN) {
        crate::outln!(
            "    {:<12} {:<11} {:<11} {:>6} records  batch {}",
            sh.id,
            sh.state,
            sh.provider_status.as_deref().unwrap_or("-"),
            sh.records,
            sh.batch_id.as_deref().unwrap_or("-")
        );
    }
    if open.len() > SHARDS_SHOWN {
        crate::outln!(
            "    ... and {} more (--json lists every shard)",
            open.len() - SHARDS_SHOWN
        );
    }
}

/// The routes' lines of a status: records and cost per tier, the cost
/// against all-standard, and the deadline.
fn print_routes(s: &JobStatus) {
    if let Some(r) = &s.routes {
        for (tier, t) in &r.spend {
            let records = r.records.get(tier).copied().unwrap_or(0);
            crate::outln!(
                "    {tier:<10} {records} records, {} calls, {:.6} USD (at standard {:.6})",
                t.calls,
                t.cost_usd,
                t.standard_cost_usd
            );
        }
        if let Some(ratio) = r.cost_ratio_vs_standard {
            crate::outln!(
                "    vs standard {ratio:.2} of the {:.6} USD all-standard would have cost",
                r.standard_cost_usd
            );
        }
    }
    if let Some(d) = &s.deadline {
        let left = if d.left_secs >= 0 {
            format!("{} left", common::manifest::human_duration(d.left_secs as u64 * 1000))
        } else {
            format!(
                "passed {} ago",
                common::manifest::human_duration(d.left_secs.unsigned_abs() * 1000)
            )
        };
        let holds = if d.holds {
            "holds"
        } else {
            "DOES NOT HOLD at the current rate"
        };
        crate::outln!(
            "  deadline     {} ({left}): {holds} (producer deadline --job {}{} <when> moves it)",
            d.at,
            s.job,
            s.redis_flag
        );
    }
}

/// Each record the reconciliation found missing, duplicated or unknown.
fn print_anomalies(s: &JobStatus) {
    let Some(r) = &s.anomalies else { return };
    for (kind, list) in [
        ("missing", &r.missing),
        ("duplicate", &r.duplicates),
        ("unknown", &r.unknown),
    ] {
        for a in list {
            crate::outln!("    {kind:<10} {} (p{}): {}", a.record_id, a.partition, a.what);
        }
    }
}

/// The human view of a status.
pub fn print(s: &JobStatus) {
    crate::outln!(
        "job {}: {}",
        s.job,
        if s.complete { "COMPLETE" } else { "not complete" }
    );
    if let Some(reason) = &s.halted {
        crate::outln!(
            "  HALTED: {reason} (claiming stopped; tasks stay queued). Once the cause is fixed: producer resume --job {}{}",
            s.job,
            s.redis_flag
        );
    }
    if let Some(waiting) = &s.waiting {
        crate::outln!("  waiting: {waiting}");
    }
    crate::outln!(
        "  expected     {}",
        s.expected.map_or("? (no manifest)".into(), |e| e.to_string())
    );
    crate::outln!("  queued       {}", s.queued);
    crate::outln!("  in flight    {}", s.in_flight);
    crate::outln!("  delayed      {}", s.delayed);
    print_batches(s);
    crate::outln!("  done         {}", s.done);
    crate::outln!("  review       {}", s.review);
    crate::outln!("  dropped      {}", s.dropped);
    for (reason, n) in &s.dropped_by_reason {
        crate::outln!("    {reason:<26} {n}");
    }
    if s.cancelled > 0 {
        crate::outln!("  cancelled    {}", s.cancelled);
    }
    crate::outln!("  rate         {}", rate_line(s));
    crate::outln!("  missing      {}", s.missing);
    crate::outln!("  duplicates   {}", s.duplicates);
    crate::outln!("  unknown      {}", s.unknown);
    print_anomalies(s);
    let hist: Vec<String> = s.attempts_histogram.iter().map(|(a, n)| format!("{a}:{n}")).collect();
    crate::outln!("  attempts     {} (attempts:records over done records)", hist.join(" "));
    crate::outln!(
        "  tokens       {} prompt ({} cached), {} completion (every paid call)",
        s.tokens.prompt,
        s.tokens.cached,
        s.tokens.completion
    );
    crate::outln!("  spent        {:.6} USD", s.cost_usd);
    print_routes(s);
    if let Some(b) = &s.budget {
        crate::outln!(
            "  budget       {:.6} USD: {:.6} counted against it, {:.6} in flight",
            b.cap_usd.unwrap_or(0.0),
            b.spent_usd,
            b.reserved_usd
        );
    }
    if s.dropped_at_enqueue > 0 {
        crate::outln!(
            "  refused      {} dataset lines at enqueue (not records of the job: producer dropped --job {})",
            s.dropped_at_enqueue,
            s.job
        );
    }
}

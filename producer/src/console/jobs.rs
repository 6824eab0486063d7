//! The jobs page, a job's page and its live part, cancel, resume and delete.
//!
//! A job's figures come from counters (the queues, the spend and outcome
//! counters, the sink's backlog), read on each view; its reconciliation (the
//! five sets, missing, duplicated, unknown) is a scan of the job's state, so
//! it is cached here and refreshed in the background, never more often than
//! every few times what it took.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use askama::Template;
use axum::extract::{Form, Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use common::store::RedisStore;

use super::{Chrome, Console, Refusal, Shared, chart, job_spec, may_act, page, signed_in, thousands};
use crate::status::JobStatus;

/// How old a cached reconciliation may get, at least.
const FRESH: Duration = Duration::from_secs(5);
/// How long a page waits for a job's first reconciliation.
const FIRST_WAIT: Duration = Duration::from_millis(300);

type Slots = Arc<Mutex<HashMap<String, Slot>>>;

/// The latest reconciliation of each job.
#[derive(Default)]
pub struct StatusCache {
    slots: Slots,
}

struct Slot {
    status: Option<Arc<JobStatus>>,
    at: Instant,
    took: Duration,
    running: bool,
    failed: Option<common::store::StoreError>,
}

impl StatusCache {
    /// The job's latest reconciliation and its age, from the cache; a stale
    /// one (older than 5 s and than four times what the last one took) is
    /// refreshed in the background. The first time, the reconciliation
    /// starts in the background and is waited for a moment ([`FIRST_WAIT`]):
    /// None while it still runs (a large job's first page answers at once,
    /// and fills in as it refreshes itself).
    pub async fn get(&self, store: &RedisStore, job: &str) -> Result<Option<(Arc<JobStatus>, Duration)>, Refusal> {
        let started = Instant::now();
        loop {
            let (cached, refresh) = {
                let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
                let slot = slots.entry(job.to_owned()).or_insert(Slot {
                    status: None,
                    at: Instant::now(),
                    took: Duration::ZERO,
                    running: false,
                    failed: None,
                });
                if let Some(e) = slot.failed.take() {
                    return Err(Refusal::Store(e));
                }
                let stale = slot.status.is_none() || slot.at.elapsed() > FRESH.max(slot.took * 4);
                let refresh = stale && !slot.running;
                slot.running |= refresh;
                (slot.status.clone().map(|s| (s, slot.at.elapsed())), refresh)
            };
            if refresh {
                let (slots, store, job) = (self.slots.clone(), store.clone(), job.to_owned());
                tokio::spawn(async move { reconcile(&slots, &store, &job).await });
            }
            if cached.is_some() || started.elapsed() >= FIRST_WAIT {
                return Ok(cached);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Forgets a job's reconciliation (after cancel or resume: read it again).
    pub fn forget(&self, job: &str) {
        self.slots.lock().unwrap_or_else(|e| e.into_inner()).remove(job);
    }
}

/// Reads a job's reconciliation into its slot (a failure is given to the
/// next page that asks).
async fn reconcile(slots: &Slots, store: &RedisStore, job: &str) {
    let started = Instant::now();
    let result = crate::status::status(store, job, false, false).await;
    let mut map = slots.lock().unwrap_or_else(|e| e.into_inner());
    let Some(slot) = map.get_mut(job) else { return };
    slot.running = false;
    match result {
        Ok(status) => {
            slot.status = Some(Arc::new(status));
            slot.at = Instant::now();
            slot.took = started.elapsed();
        }
        Err(e) => slot.failed = Some(e),
    }
}

/// A job as the jobs page lists it.
pub struct JobRow {
    pub name: String,
    pub state: String,
    pub state_class: &'static str,
    pub progress: String,
    pub percent: u64,
    pub done: String,
    pub review: String,
    pub dropped: String,
    pub missing: String,
    pub cost: String,
    pub throughput: String,
}

#[derive(Template)]
#[template(path = "jobs.html")]
struct JobsPage {
    chrome: Chrome,
    jobs: Vec<JobRow>,
}

pub async fn jobs_page(State(c): State<Shared>, headers: HeaderMap) -> Result<Response, Refusal> {
    let who = signed_in(&c, &headers)?;
    let mut jobs = Vec::new();
    for name in c.store.jobs().await? {
        let Some(spec) = c.store.job_spec(&name).await.ok().flatten() else {
            continue;
        };
        let v = Live::read(&c, &name, spec.job.partitions).await?;
        jobs.push(JobRow {
            state: v.state.clone(),
            state_class: v.state_class,
            progress: v.progress.clone(),
            percent: v.percent,
            done: v.done.clone(),
            review: v.review.clone(),
            dropped: v.dropped.clone(),
            missing: v.missing.clone(),
            cost: format!("{:.4}", v.spent_usd),
            throughput: v.throughput.clone(),
            name,
        });
    }
    Ok(page(
        StatusCode::OK,
        &JobsPage {
            chrome: Chrome::of(&c, &who),
            jobs,
        },
    ))
}

/// What a job's page shows that changes while it runs (also served alone,
/// for the page to refresh itself).
pub struct Live {
    /// The five sets, as the job's reconciliation counts them ("…" while
    /// its first one runs).
    pub expected: String,
    pub done: String,
    pub review: String,
    pub dropped: String,
    pub cancelled_records: String,
    pub missing: String,
    /// Missing, duplicated, unknown, and how old the reconciliation is.
    pub anomalies: String,
    /// For the figures the page checks (the `done` count as a number).
    pub status: Arc<JobStatus>,
    pub state: String,
    pub state_class: &'static str,
    pub halted: Option<String>,
    /// Why the job waits: its provider fails every call (since when, the last error).
    pub waiting: Option<String>,
    pub cancelled: bool,
    pub progress: String,
    pub percent: u64,
    pub queued: u64,
    pub in_flight: u64,
    pub delayed: u64,
    /// Batch mode: records held by provider batch shards, and the shards not reconciled.
    pub batched: u64,
    pub shards_open: u64,
    pub spent_usd: f64,
    pub budget: Option<String>,
    pub throughput: String,
    pub verdict: String,
    pub verdict_class: &'static str,
    pub sink: Option<String>,
    pub throughput_chart: String,
    pub cost_chart: String,
    pub attempts_chart: String,
    /// Codes as columns, fields as rows.
    pub error_codes: Vec<String>,
    pub error_rows: Vec<(String, Vec<u64>)>,
    pub retries: Vec<(String, u64)>,
    pub spend_parts: Vec<(String, u64, String)>,
    /// The spot checks' estimate, overall and per label.
    pub accuracy: String,
    pub audit_waiting: u64,
    pub accuracy_by_label: Vec<(String, String, String)>,
}

impl Live {
    pub async fn read(c: &Console, job: &str, partitions: u32) -> Result<Live, Refusal> {
        let cached = c.cache.get(&c.store, job).await?;
        let reconciled = cached.is_some();
        let (status, age) = cached.unwrap_or_default();
        let store = &c.store;
        let work = store.work_left(job, partitions).await?;
        let (queued, in_flight, delayed, shards_open) = work.iter().fold((0, 0, 0, 0), |t, w| {
            (t.0 + w.queued, t.1 + w.in_flight, t.2 + w.delayed, t.3 + w.shards)
        });
        let halted = store.halted(job).await?;
        let waiting = store.provider_outage(job).await?.waiting();
        let cancelled = store.cancelled(job).await?;
        let spend = store.spend(job, partitions).await?;
        let budget = store.budget(job).await?;
        let stats = store.stats(job, partitions).await?;
        let accuracy = store.accuracy(job, partitions).await?;
        let now_minute = crate::status::now_secs() / 60;
        let expected = status.expected.unwrap_or(status.known);
        let settled = status.done + status.review + status.dropped + status.cancelled;
        let percent = (settled * 100).checked_div(expected).unwrap_or(0).min(100);
        let open = queued + in_flight + delayed + shards_open > 0;
        let (state, state_class) =
            crate::jobs::state(halted.as_deref(), waiting.is_some(), cancelled, status.complete, open);
        let verdict = verdict_of(reconciled, &status);
        let sink = sink_line(store, job, partitions).await?;
        let (throughput_chart, cost_chart, attempts_chart) = charts(&stats, now_minute);
        let (codes, error_rows) = error_table(&stats.errors);
        let spend_parts = spend
            .by_bucket
            .iter()
            .map(|(b, p)| (b.clone(), p.calls, format!("{:.6}", p.cost_usd)))
            .collect();
        let shown = Shown::of(reconciled.then_some((&status, age)), settled, expected);
        Ok(Live {
            expected: shown.expected,
            done: shown.done,
            review: shown.review,
            dropped: shown.dropped,
            cancelled_records: shown.cancelled,
            missing: shown.missing,
            anomalies: shown.anomalies,
            progress: shown.progress,
            percent,
            state: state.to_owned(),
            state_class,
            halted,
            waiting,
            cancelled,
            queued,
            in_flight,
            delayed,
            batched: status.batched,
            shards_open,
            spent_usd: spend.totals.cost_usd,
            budget: budget.cap_usd.map(|cap| {
                format!(
                    "{:.6} USD of {cap:.6} counted against the cap, {:.6} in flight",
                    budget.spent_usd, budget.reserved_usd
                )
            }),
            throughput: format!("{:.2}/s", stats.throughput(crate::status::now_secs(), 5)),
            verdict: verdict.0,
            verdict_class: verdict.1,
            sink,
            throughput_chart,
            cost_chart,
            attempts_chart,
            error_codes: codes,
            error_rows,
            retries: stats.retries.into_iter().collect(),
            spend_parts,
            accuracy: accuracy.overall.text(),
            audit_waiting: accuracy.waiting,
            accuracy_by_label: accuracy
                .by_label
                .iter()
                .map(|(f, v, r)| (f.clone(), v.clone(), r.text()))
                .collect(),
            status,
        })
    }
}

/// The counts the page shows from the last reconciliation (`…` until one
/// is cached), and how old it is.
struct Shown {
    expected: String,
    done: String,
    review: String,
    dropped: String,
    cancelled: String,
    missing: String,
    anomalies: String,
    progress: String,
}

impl Shown {
    fn of(reconciled: Option<(&JobStatus, std::time::Duration)>, settled: u64, expected: u64) -> Shown {
        let Some((status, age)) = reconciled else {
            let unknown = || "…".to_owned();
            return Shown {
                expected: unknown(),
                done: unknown(),
                review: unknown(),
                dropped: unknown(),
                cancelled: unknown(),
                missing: unknown(),
                anomalies: String::new(),
                progress: unknown(),
            };
        };
        Shown {
            expected: status.expected.map_or("?".to_owned(), thousands),
            done: thousands(status.done),
            review: thousands(status.review),
            dropped: thousands(status.dropped),
            cancelled: thousands(status.cancelled),
            missing: thousands(status.missing),
            anomalies: format!(
                "missing {}, duplicated {}, unknown {} · as of {} s ago",
                status.missing,
                status.duplicates,
                status.unknown,
                age.as_secs()
            ),
            progress: format!("{} of {}", thousands(settled), thousands(expected)),
        }
    }
}

/// What reconciliation says of the job, and its CSS class.
fn verdict_of(reconciled: bool, status: &JobStatus) -> (String, &'static str) {
    if !reconciled {
        (
            "reading the job's records… (its first reconciliation is still running)".to_owned(),
            "run",
        )
    } else if status.missing + status.duplicates + status.unknown > 0 {
        (
            format!(
                "{} missing, {} duplicated, {} unknown",
                status.missing, status.duplicates, status.unknown
            ),
            "bad",
        )
    } else if status.complete {
        (
            "every expected record is in exactly one terminal set".to_owned(),
            "good",
        )
    } else {
        ("nothing missing, duplicated or unknown so far".to_owned(), "run")
    }
}

/// The sink's line: what waits for it and what it holds (none without a sink).
async fn sink_line(store: &RedisStore, job: &str, partitions: u32) -> Result<Option<String>, Refusal> {
    let Some(spec) = store.job_spec(job).await.ok().flatten().filter(|s| !s.sink.is_none()) else {
        return Ok(None);
    };
    let backlog = store.sink_backlog(job, partitions).await?.unwrap_or(0);
    let sunk = store.sunk(job, partitions).await?;
    let kind = match spec.sink.kind {
        common::spec::SinkKind::Files => "files",
        _ => "PostgreSQL",
    };
    Ok(Some(format!(
        "{kind}: {} outcomes and paid calls waiting (sink lag), {} results written",
        thousands(backlog),
        thousands(sunk.written)
    )))
}

/// The last hour of the job's work, minute by minute: records settled,
/// the cost so far, and records done by attempts.
fn charts(stats: &common::stats::JobStats, now_minute: u64) -> (String, String, String) {
    let from = now_minute.saturating_sub(60);
    let minutes: Vec<(u64, &common::stats::Minute)> =
        stats.timeline.range(from..=now_minute).map(|(m, v)| (*m, v)).collect();
    // From the job's first minute within the hour to now.
    let start = minutes.first().map_or(now_minute, |(m, _)| *m);
    let throughput_chart = chart::minute_columns(
        &minutes.iter().map(|(m, v)| (*m, v.done + v.failed)).collect::<Vec<_>>(),
        start,
        now_minute,
        "records settled per minute",
    );
    let mut cumulative = stats.timeline.range(..from).map(|(_, v)| v.nusd).sum::<u64>() as f64 / 1e9;
    // The line starts from what was spent before its first minute.
    let mut cost_points = Vec::new();
    if !minutes.is_empty() {
        cost_points.push((start.saturating_sub(1), cumulative));
    }
    for (m, v) in &minutes {
        cumulative += v.nusd as f64 / 1e9;
        cost_points.push((*m, cumulative));
    }
    let cost_chart = chart::line(&cost_points, "cost so far");
    let attempts_chart = chart::bars(
        &stats
            .attempts
            .iter()
            .map(|(a, n)| (a.to_string(), *n))
            .collect::<Vec<_>>(),
        "records done by attempts",
    );
    (throughput_chart, cost_chart, attempts_chart)
}

/// Validation errors as a table: codes as columns, fields as rows.
fn error_table(errors: &std::collections::BTreeMap<String, u64>) -> (Vec<String>, Vec<(String, Vec<u64>)>) {
    let mut codes: Vec<String> = Vec::new();
    let mut rows: std::collections::BTreeMap<String, HashMap<String, u64>> = Default::default();
    for (key, n) in errors {
        let (code, field) = key.split_once(' ').unwrap_or((key.as_str(), ""));
        if !codes.iter().any(|c| c == code) {
            codes.push(code.to_owned());
        }
        *rows
            .entry(if field.is_empty() {
                "(the output)".into()
            } else {
                field.to_owned()
            })
            .or_default()
            .entry(code.to_owned())
            .or_default() += n;
    }
    codes.sort();
    let error_rows = rows
        .into_iter()
        .map(|(field, by_code)| {
            let counts = codes.iter().map(|c| by_code.get(c).copied().unwrap_or(0)).collect();
            (field, counts)
        })
        .collect();
    (codes, error_rows)
}

#[derive(Template)]
#[template(path = "job.html")]
struct JobPage {
    chrome: Chrome,
    job: String,
    live: Live,
    versions: Vec<(String, String)>,
    chain: String,
    datasets: Vec<String>,
    review_depth: u64,
}

#[derive(Template)]
#[template(path = "job_live.html")]
struct JobLive {
    live: Live,
}

pub async fn job_page(
    State(c): State<Shared>,
    Path(job): Path<String>,
    headers: HeaderMap,
) -> Result<Response, Refusal> {
    let who = signed_in(&c, &headers)?;
    let spec = job_spec(&c, &job).await?;
    let live = Live::read(&c, &job, spec.job.partitions).await?;
    let manifest = c.store.load_manifest(&job).await?;
    let chain = crate::report::version_chain(&c.store, &job).await?;
    Ok(page(
        StatusCode::OK,
        &JobPage {
            chrome: Chrome::of(&c, &who),
            versions: manifest
                .as_ref()
                .map(|m| m.versions.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
                .unwrap_or_default(),
            chain: crate::report::chain_line(&chain),
            datasets: manifest
                .as_ref()
                .map(|m| {
                    m.datasets
                        .iter()
                        .map(|d| {
                            let sha = &d.dataset.sha256;
                            format!("{} (sha256 {})", d.dataset.path, &sha[..12.min(sha.len())])
                        })
                        .collect()
                })
                .unwrap_or_default(),
            review_depth: c.store.review_depth(&job, spec.job.partitions).await?,
            live,
            job,
        },
    ))
}

pub async fn job_live(
    State(c): State<Shared>,
    Path(job): Path<String>,
    headers: HeaderMap,
) -> Result<Response, Refusal> {
    if super::reviewer(&c, &headers).is_none() {
        return Ok(StatusCode::UNAUTHORIZED.into_response());
    }
    let spec = job_spec(&c, &job).await?;
    let live = Live::read(&c, &job, spec.job.partitions).await?;
    Ok(page(StatusCode::OK, &JobLive { live }))
}

#[derive(serde::Deserialize)]
pub struct ConfirmQuery {
    action: String,
}

#[derive(Template)]
#[template(path = "confirm.html")]
struct ConfirmPage {
    chrome: Chrome,
    job: String,
    action: String,
    what: String,
    needs_budget: bool,
    /// Delete: the job's name must be typed; `held` tasks of live workers
    /// need the force box ticked.
    needs_name: bool,
    held: u64,
}

/// Asks before a cancel, a resume or a delete (which wants the job's name typed).
pub async fn confirm_page(
    State(c): State<Shared>,
    Path(job): Path<String>,
    Query(q): Query<ConfirmQuery>,
    headers: HeaderMap,
) -> Result<Response, Refusal> {
    let who = signed_in(&c, &headers)?;
    let spec = job_spec(&c, &job).await?;
    let work = c.store.work_left(&job, spec.job.partitions).await?;
    let left: u64 = work.iter().map(|w| w.queued + w.delayed).sum();
    let halted = c.store.halted(&job).await?;
    let held = match q.action.as_str() {
        "delete" => c.store.held_by_live_workers(&job, spec.job.partitions).await?,
        _ => 0,
    };
    let (what, needs_budget) = match q.action.as_str() {
        "cancel" => (
            format!(
                "Cancel job {job}? The fleet stops claiming it; {} records not yet called are marked cancelled \
                 (kept: resuming brings them back); calls in flight finish.",
                thousands(left)
            ),
            false,
        ),
        "resume" => {
            let on_budget = halted.as_deref().is_some_and(|r| r.starts_with("budget"));
            (
                match &halted {
                    Some(r) => format!("Resume job {job}? It is halted: {r}."),
                    None => format!("Resume job {job}? Its cancelled records go back to the queue."),
                },
                on_budget,
            )
        }
        "delete" => (
            format!(
                "Delete job {job}? Every key of it leaves Redis: its queue, records, review entries, ledger, \
                 spend and flags. Its sink's rows stay. Type the job's name to confirm."
            ),
            false,
        ),
        other => return Err(Refusal::NotFound(format!("No action `{other}`."))),
    };
    Ok(page(
        StatusCode::OK,
        &ConfirmPage {
            chrome: Chrome::of(&c, &who),
            job,
            needs_name: q.action == "delete",
            action: q.action,
            what,
            needs_budget,
            held,
        },
    ))
}

#[derive(serde::Deserialize)]
pub struct ControlForm {
    csrf: String,
    #[serde(default)]
    budget: String,
    /// Delete: the job's name as typed, and the force box.
    #[serde(default)]
    name: String,
    #[serde(default)]
    force: Option<String>,
}

pub async fn cancel(
    State(c): State<Shared>,
    Path(job): Path<String>,
    headers: HeaderMap,
    Form(f): Form<ControlForm>,
) -> Result<Response, Refusal> {
    let who = may_act(&c, &headers, &f.csrf)?;
    let done = crate::control::cancel(&c.store, &job).await;
    tracing::info!(job = %job, reviewer = %who, "cancelled from the console");
    controlled(&c, &job, done)
}

pub async fn resume(
    State(c): State<Shared>,
    Path(job): Path<String>,
    headers: HeaderMap,
    Form(f): Form<ControlForm>,
) -> Result<Response, Refusal> {
    let who = may_act(&c, &headers, &f.csrf)?;
    let budget = match f.budget.trim() {
        "" => None,
        b => match b.parse::<f64>() {
            Ok(v) => Some(v),
            Err(_) => {
                return Ok(super::message(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "Not resumed",
                    &format!("The budget `{b}` is not a number of USD."),
                ));
            }
        },
    };
    let done = crate::control::resume(&c.store, &job, budget).await;
    tracing::info!(job = %job, reviewer = %who, "resumed from the console");
    controlled(&c, &job, done)
}

/// Deletes the job once its name was typed (and, while live workers hold
/// its tasks, the force box ticked); then the jobs page.
pub async fn delete(
    State(c): State<Shared>,
    Path(job): Path<String>,
    headers: HeaderMap,
    Form(f): Form<ControlForm>,
) -> Result<Response, Refusal> {
    let who = may_act(&c, &headers, &f.csrf)?;
    if f.name.trim() != job {
        return Ok(super::message(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Not deleted",
            &format!(
                "The name typed, `{}`, is not the job's: type `{job}` to delete it.",
                f.name.trim()
            ),
        ));
    }
    let done = crate::control::delete(&c.store, &job, f.force.is_some()).await;
    c.cache.forget(&job);
    match done {
        Ok(removed) => {
            tracing::info!(job = %job, reviewer = %who, removed, "deleted from the console");
            Ok(Redirect::to("/").into_response())
        }
        Err(crate::control::ControlError::Refused(why)) => Ok(super::message(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Not deleted",
            &format!("{why}: stop them first, or tick \"delete anyway\"."),
        )),
        Err(crate::control::ControlError::Store(e)) => Err(Refusal::Store(e)),
    }
}

fn controlled(c: &Console, job: &str, done: Result<String, crate::control::ControlError>) -> Result<Response, Refusal> {
    c.cache.forget(job);
    match done {
        Ok(_) => Ok(Redirect::to(&format!("/jobs/{}", super::queue::path_part(job))).into_response()),
        Err(crate::control::ControlError::Refused(why)) => {
            Ok(super::message(StatusCode::UNPROCESSABLE_ENTITY, "Refused", &why))
        }
        Err(crate::control::ControlError::Store(e)) => Err(Refusal::Store(e)),
    }
}

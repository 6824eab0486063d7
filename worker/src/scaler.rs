//! The scaler: the one always-on component of a fleet that scales to zero.
//!
//! An autoscaler reading only a stream's lag sees the tasks nobody has
//! taken yet: not the calls in flight (a slow model, minutes per call) nor
//! the retries waiting in a partition's delayed set (a 429 storm's
//! `Retry-After`). Scaled to zero on lag alone, the fleet abandons its paid
//! calls and never promotes its retries. The scaler runs as one replica
//! beside the workers and
//! - serves each job's work left from Redis, queued + in flight + delayed,
//!   at `GET /remaining[?job=NAME]` (JSON, for KEDA's `metrics-api`
//!   trigger) and `GET /metrics` (`batchfleet_remaining_tasks{job,kind}`,
//!   for a Prometheus adapter and an HPA), whether or not a worker runs;
//! - promotes due retries itself (the same atomic script as the workers'),
//!   so a retry that comes due while no worker runs turns into stream lag,
//!   which every trigger sees.
//!
//! It holds no state of its own: a restarted scaler serves the same figures.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use common::store::{RedisStore, StoreError, WorkLeft};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use crate::clock::now_ms;

/// Not ready when no round has completed against Redis for this long.
const READY_WITHIN_MS: u64 = 30_000;
/// Pause after a failed round.
const ERROR_PAUSE: Duration = Duration::from_secs(1);

#[derive(Debug, Clone)]
pub struct Config {
    pub redis_url: String,
    /// Jobs to serve; empty means every job in Redis (read again each round).
    pub jobs: Vec<String>,
    pub bind: SocketAddr,
    /// The longest the promoter sleeps when no retry is due sooner.
    pub max_sleep: Duration,
}

/// One job's work left, summed over its partitions.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct JobWork {
    pub remaining: u64,
    #[serde(flatten)]
    pub work: WorkLeft,
    pub partitions: Vec<WorkLeft>,
    /// A producer is still enqueueing (more comes).
    pub enqueuing: bool,
    /// The job is halted (its work is still counted; why is for `producer
    /// status`, not for an endpoint without authentication).
    pub halted: bool,
}

/// Every served job's work left.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Remaining {
    pub remaining: u64,
    #[serde(flatten)]
    pub work: WorkLeft,
    pub jobs: BTreeMap<String, JobWork>,
}

pub struct Scaler {
    store: RedisStore,
    config: Config,
    /// Partition counts of the jobs seen so far (a job's count never changes).
    partitions: Mutex<BTreeMap<String, u32>>,
    promoted: Mutex<BTreeMap<String, u64>>,
    errors: AtomicU64,
    last_ok_ms: AtomicU64,
}

impl Scaler {
    pub async fn connect(config: Config) -> Result<Arc<Scaler>, StoreError> {
        let store = RedisStore::connect(&config.redis_url).await?;
        Ok(Arc::new(Scaler {
            store,
            config,
            partitions: Mutex::new(BTreeMap::new()),
            promoted: Mutex::new(BTreeMap::new()),
            errors: AtomicU64::new(0),
            last_ok_ms: AtomicU64::new(0),
        }))
    }

    /// The served jobs with their partition counts (read once per job). A
    /// job Redis does not know (yet) is left out; one whose spec cannot be
    /// read carries its error.
    async fn jobs(&self) -> Result<BTreeMap<String, Result<u32, StoreError>>, StoreError> {
        let names = if self.config.jobs.is_empty() {
            self.store.jobs().await?
        } else {
            self.config.jobs.clone()
        };
        let mut known = self.partitions.lock().await;
        let mut out = BTreeMap::new();
        for name in names {
            if let Some(p) = known.get(&name) {
                out.insert(name, Ok(*p));
                continue;
            }
            match self.store.job_spec(&name).await {
                Ok(Some(spec)) => {
                    known.insert(name.clone(), spec.job.partitions);
                    out.insert(name, Ok(spec.job.partitions));
                }
                Ok(None) => tracing::debug!(job = %name, "no such job in Redis (yet): not served"),
                Err(e) => {
                    out.insert(name, Err(e));
                }
            }
        }
        Ok(out)
    }

    fn failed(&self, job: &str, e: &StoreError) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(job = %job, error = %e, "Redis call failed");
    }

    /// Every served job's work left, read now. Any job's error fails the
    /// whole answer: an autoscaler must never see work as gone because it
    /// could not be read (KEDA does not scale to zero on a failing trigger).
    pub async fn remaining(&self, only: Option<&str>) -> Result<Option<Remaining>, StoreError> {
        let jobs = self.jobs().await.inspect_err(|e| self.failed("*", e))?;
        let mut r = Remaining::default();
        for (name, partitions) in jobs {
            if only.is_some_and(|o| o != name) {
                continue;
            }
            let job = self
                .job_work(&name, partitions)
                .await
                .inspect_err(|e| self.failed(&name, e))?;
            r.work.add(&job.work);
            r.jobs.insert(name, job);
        }
        r.remaining = r.work.total();
        if only.is_some() && r.jobs.is_empty() {
            return Ok(None);
        }
        Ok(Some(r))
    }

    async fn job_work(&self, name: &str, partitions: Result<u32, StoreError>) -> Result<JobWork, StoreError> {
        let parts = self.store.work_left(name, partitions?).await?;
        let mut work = WorkLeft::default();
        parts.iter().for_each(|p| work.add(p));
        Ok(JobWork {
            remaining: work.total(),
            work,
            partitions: parts,
            enqueuing: self.store.enqueuing(name).await?,
            halted: self.store.halted(name).await?.is_some(),
        })
    }

    /// Promotes what is due at `now` in every partition of every served
    /// job; a failing job or partition is logged and counted, the others go
    /// on. Returns how many moved, when the next retry is due (Unix ms), and
    /// whether every call succeeded.
    pub async fn promote_round(&self, now: u64) -> Result<(u64, Option<u64>, bool), StoreError> {
        let (mut moved, mut next, mut clean) = (0, None::<u64>, true);
        for (name, partitions) in self.jobs().await? {
            let partitions = match partitions {
                Ok(p) => p,
                Err(e) => {
                    self.failed(&name, &e);
                    clean = false;
                    continue;
                }
            };
            let (n, due, errors) = self
                .store
                .promote_job(&name, partitions, now, crate::promote::PAGE)
                .await;
            for e in &errors {
                self.failed(&name, e);
            }
            clean &= errors.is_empty();
            if n > 0 {
                tracing::info!(job = %name, promoted = n, "due retries back in the stream");
                *self.promoted.lock().await.entry(name.clone()).or_default() += n;
            }
            moved += n;
            next = next.into_iter().chain(due).min();
        }
        Ok((moved, next, clean))
    }

    /// Promotes due retries until `stop` fires.
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        while !stop.is_cancelled() {
            let now = now_ms();
            let sleep = match self.promote_round(now).await {
                Ok((_, next, clean)) => {
                    self.last_ok_ms.store(now_ms(), Ordering::Relaxed);
                    let until_due = next.map_or(self.config.max_sleep, |due| {
                        Duration::from_millis(due.saturating_sub(now)).min(self.config.max_sleep)
                    });
                    if clean { until_due } else { until_due.min(ERROR_PAUSE) }
                }
                Err(e) => {
                    self.failed("*", &e);
                    ERROR_PAUSE
                }
            };
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = tokio::time::sleep(sleep) => {}
            }
        }
    }

    /// Binds and serves `/remaining`, `/metrics`, `/healthz`, `/readyz`
    /// in the background until `stop` fires. Returns the bound address.
    pub async fn serve(self: &Arc<Self>, stop: CancellationToken) -> std::io::Result<SocketAddr> {
        let listener = tokio::net::TcpListener::bind(self.config.bind).await?;
        let bound = listener.local_addr()?;
        let app = Router::new()
            .route("/remaining", get(remaining_handler))
            .route("/metrics", get(metrics_handler))
            .route("/healthz", get(|| async { "ok\n" }))
            .route("/readyz", get(ready_handler))
            .with_state(self.clone());
        tokio::spawn(async move {
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await;
            if let Err(e) = served {
                tracing::error!(error = %e, "scaler's HTTP server stopped");
            }
        });
        Ok(bound)
    }
}

#[derive(serde::Deserialize)]
struct JobQuery {
    job: Option<String>,
}

async fn remaining_handler(State(s): State<Arc<Scaler>>, Query(q): Query<JobQuery>) -> Response {
    match s.remaining(q.job.as_deref()).await {
        Ok(Some(r)) => axum::Json(r).into_response(),
        Ok(None) => (
            StatusCode::NOT_FOUND,
            format!(
                "no job `{}` served here\n",
                q.job.as_deref().unwrap_or_default().escape_default()
            ),
        )
            .into_response(),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "a Redis call failed: the work left is unknown (see the scaler's log)\n",
        )
            .into_response(),
    }
}

async fn metrics_handler(State(s): State<Arc<Scaler>>) -> Response {
    // Without the work left when it cannot be read (absent series, never a
    // 0), but with the scaler's own counters.
    let read = s.remaining(None).await;
    let mut out = format!(
        "# HELP batchfleet_scaler_work_read 1 when this scrape read the work left from Redis.\n\
         # TYPE batchfleet_scaler_work_read gauge\n\
         batchfleet_scaler_work_read {}\n",
        u8::from(read.is_ok())
    );
    let r = read.ok().flatten().unwrap_or_default();
    out.push_str(
        "# HELP batchfleet_remaining_tasks Tasks of a job not finished yet, by kind: queued (never delivered), \
         in_flight (delivered, not acknowledged), delayed (retries waiting until due), shards (provider batches \
         not reconciled yet, batch mode: one each).\n\
         # TYPE batchfleet_remaining_tasks gauge\n",
    );
    for (job, w) in &r.jobs {
        for (kind, n) in [
            ("queued", w.work.queued),
            ("in_flight", w.work.in_flight),
            ("delayed", w.work.delayed),
            ("shards", w.work.shards),
        ] {
            out.push_str(&format!(
                "batchfleet_remaining_tasks{{job=\"{}\",kind=\"{kind}\"}} {n}\n",
                label(job)
            ));
        }
    }
    out.push_str(
        "# HELP batchfleet_remaining_work Tasks of a job not finished yet (queued + in flight + delayed): what the autoscaler scales on.\n\
         # TYPE batchfleet_remaining_work gauge\n",
    );
    for (job, w) in &r.jobs {
        out.push_str(&format!(
            "batchfleet_remaining_work{{job=\"{}\"}} {}\n",
            label(job),
            w.remaining
        ));
    }
    out.push_str(
        "# HELP batchfleet_scaler_promoted_total Due retries the scaler moved back to their stream.\n\
         # TYPE batchfleet_scaler_promoted_total counter\n",
    );
    for (job, n) in s.promoted.lock().await.iter() {
        out.push_str(&format!(
            "batchfleet_scaler_promoted_total{{job=\"{}\"}} {n}\n",
            label(job)
        ));
    }
    out.push_str(&format!(
        "# HELP batchfleet_scaler_store_errors_total Failed Redis calls of the scaler.\n\
         # TYPE batchfleet_scaler_store_errors_total counter\n\
         batchfleet_scaler_store_errors_total {}\n",
        s.errors.load(Ordering::Relaxed)
    ));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

async fn ready_handler(State(s): State<Arc<Scaler>>) -> Response {
    let age = now_ms().saturating_sub(s.last_ok_ms.load(Ordering::Relaxed));
    if age <= READY_WITHIN_MS {
        "ready\n".into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "no promotion round against Redis recently\n",
        )
            .into_response()
    }
}

/// A Prometheus label value (job names are restricted, but never trust that here).
fn label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

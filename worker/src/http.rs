//! The worker's HTTP endpoints: `/metrics` (Prometheus text format),
//! `/healthz` (the process is alive), `/readyz` (Redis reachable, not
//! draining, a successful claim loop recently, no open circuit breaker).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use common::store::RedisStore;

use crate::clock::now_ms;
use crate::telemetry::Metrics;

/// A claim loop that has not completed a round for this long is not ready.
const READY_WITHIN_MS: u64 = 30_000;

/// What readiness is judged on; the run loop keeps it current.
#[derive(Default)]
pub struct Health {
    pub draining: AtomicBool,
    pub halted: AtomicBool,
    /// A job's sink cannot write (outcomes wait in Redis).
    pub sink_failing: AtomicBool,
    /// When the claim loop last completed a round against Redis (Unix ms).
    pub last_ok_ms: AtomicU64,
}

impl Health {
    pub fn loop_ok(&self) {
        self.last_ok_ms.store(now_ms(), Ordering::Relaxed);
    }
}

struct Http {
    metrics: Arc<Metrics>,
    store: RedisStore,
    jobs: Vec<crate::telemetry::Watched>,
    health: Arc<Health>,
}

/// Binds `addr` (port 0 picks a free one) and serves in the background
/// until `stop` fires. Returns the bound address.
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    store: RedisStore,
    jobs: Vec<crate::telemetry::Watched>,
    health: Arc<Health>,
    stop: tokio_util::sync::CancellationToken,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let state = Arc::new(Http {
        metrics,
        store,
        jobs,
        health,
    });
    let app = Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready_handler))
        .with_state(state);
    let served = tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move { stop.cancelled().await })
            .await;
        if let Err(e) = served {
            tracing::error!(error = %e, "metrics server stopped");
        }
    });
    Ok((bound, served))
}

async fn metrics_handler(State(s): State<Arc<Http>>) -> impl IntoResponse {
    s.metrics.refresh_queues(&s.store, &s.jobs).await;
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.encode(),
    )
}

async fn ready_handler(State(s): State<Arc<Http>>) -> (StatusCode, String) {
    let not_ready = |why: &str| (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}\n"));
    if s.health.draining.load(Ordering::Relaxed) {
        return not_ready("draining");
    }
    if s.health.halted.load(Ordering::Relaxed) {
        return not_ready("circuit breaker open (a job is halted)");
    }
    if !s.store.ping().await {
        return not_ready("Redis unreachable");
    }
    if s.health.sink_failing.load(Ordering::Relaxed) {
        return not_ready("the result sink cannot write (see the worker's log; outcomes wait in Redis)");
    }
    let last = s.health.last_ok_ms.load(Ordering::Relaxed);
    if now_ms().saturating_sub(last) > READY_WITHIN_MS {
        return not_ready("no successful claim round recently");
    }
    (StatusCode::OK, "ready\n".into())
}

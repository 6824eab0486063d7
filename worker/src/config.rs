//! The worker's configuration ([`Config`], built by `main` from flags and
//! env), its refusals ([`RunError`]) and what a run did ([`RunSummary`]).

use std::collections::BTreeMap;
use std::time::Duration;

use common::store::StoreError;

/// The worker's configuration; `main` builds it from flags and env.
#[derive(Debug, Clone)]
pub struct Config {
    pub redis_url: String,
    /// Jobs to work on; empty means every job in Redis.
    pub jobs: Vec<String>,
    /// Requests in flight in this process.
    pub concurrency: usize,
    /// Unique consumer name of this process.
    pub consumer: String,
    /// Exit when the jobs are complete (no queued, pending or delayed task).
    pub drain: bool,
    /// How long in-flight work may take to finish after SIGTERM; None: the
    /// longest provider timeout + [`DRAIN_MARGIN`].
    pub drain_timeout: Option<Duration>,
    /// A pending task idle this long is taken over; None: provider timeout + 30 s.
    pub visibility_timeout: Option<Duration>,
    /// Deliveries after which a task goes to review as poison.
    pub max_deliveries: u32,
    /// Calls failing with the same non-retryable provider error before the
    /// job halts (see [`crate::breaker`]).
    pub breaker_errors: u64,
    /// Sleep between claims when there is nothing to do.
    pub idle_poll: Duration,
    /// How often the worker's heartbeat is written (`bf:workers`).
    pub heartbeat: Duration,
    /// Overrides every job's `provider.base_url`.
    pub base_url: Option<String>,
    /// Start even when Redis may evict keys (never in production).
    pub allow_evicting_redis: bool,
    /// Where `/metrics`, `/healthz` and `/readyz` are served (None: not at all).
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// The address is the default one: when it is busy (another worker on
    /// this host), serve on a free port instead and say which.
    pub metrics_fallback: bool,
    /// Where attempt spans go (nowhere unless an OTLP endpoint is configured).
    pub traces: common::otel::Traces,
}

/// What a run did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RunSummary {
    pub outcomes: BTreeMap<String, u64>,
    pub store_errors: u64,
    /// Jobs halted, with the reason.
    pub halted: BTreeMap<String, String>,
    /// Tasks still running when the drain timeout ran out (left pending).
    pub abandoned: usize,
    /// Of their model calls, those cut off before the answer came (recorded
    /// in Redis as paid without a result).
    pub calls_abandoned: u64,
    /// Times this worker waited for the fleet's rate-limit budget, and how long.
    pub rate_limit_waits: u64,
    pub rate_limit_wait_ms: u64,
    /// Per job with limits: grants, tokens reserved and returned, 429s, budget.
    pub limiters: BTreeMap<String, crate::limiter::LimiterReport>,
}

impl RunSummary {
    /// Adds a later run's counts (a worker that started again to serve a new job).
    pub fn absorb(&mut self, later: RunSummary) {
        for (k, v) in later.outcomes {
            *self.outcomes.entry(k).or_default() += v;
        }
        self.store_errors += later.store_errors;
        self.halted.extend(later.halted);
        self.abandoned += later.abandoned;
        self.calls_abandoned += later.calls_abandoned;
        self.rate_limit_waits += later.rate_limit_waits;
        self.rate_limit_wait_ms += later.rate_limit_wait_ms;
        self.limiters.extend(later.limiters);
    }
}

impl Config {
    /// Checks what can be checked before connecting.
    pub fn validate(&self) -> Result<(), RunError> {
        if self.concurrency == 0 {
            return Err(RunError::Refused("--concurrency must be at least 1".into()));
        }
        if self.consumer.trim().is_empty() {
            return Err(RunError::Refused("--consumer must not be empty".into()));
        }
        if !self.consumer.chars().all(|c| c.is_ascii_graphic()) {
            return Err(RunError::Refused(format!(
                "--consumer `{}` may hold only printable ASCII without spaces (it names the worker in Redis and in request headers)",
                self.consumer.escape_default()
            )));
        }
        if self.breaker_errors == 0 {
            return Err(RunError::Refused("--breaker-errors must be at least 1".into()));
        }
        if self.max_deliveries == 0 {
            return Err(RunError::Refused(
                "--max-deliveries must be at least 1 (with 0 every task would go to review as poison)".into(),
            ));
        }
        if self.idle_poll.is_zero() {
            return Err(RunError::Refused("--idle-poll-ms must be at least 1".into()));
        }
        Ok(())
    }
}

/// What the default drain timeout adds to the longest provider timeout (a
/// call cut off at its timeout still settles and commits within it).
pub const DRAIN_MARGIN: Duration = Duration::from_secs(5);

/// Where a worker serves `/metrics` unless told otherwise.
pub const DEFAULT_METRICS_ADDR: &str = "127.0.0.1:9464";

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    Refused(String),
}

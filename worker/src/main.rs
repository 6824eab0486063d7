//! `worker`: thin entry point. Parses flags, sets up logs and signals, and
//! calls [`worker::run::run`].

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use common::otel::Traces;
use tokio_util::sync::CancellationToken;
use worker::run::{Config, RunError, run};

/// glibc's allocator spent a quarter of the worker's CPU at zero model
/// latency (arena locks and consolidation across the runtime's threads).
/// jemalloc's thread caches do not, and keep less memory at 1,000 calls in
/// flight than mimalloc did (see BENCHMARKS.md, #15).
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Exit code when a job's fleet is halted (401/403, insufficient quota).
const EXIT_HALTED: u8 = 3;

#[derive(Debug, Parser)]
#[command(name = "worker", version, about = "batchfleet worker: claim, call, validate, commit")]
struct Args {
    /// Redis URL (`redis://[user:password@]host:port[/db]`, or `host:port`).
    #[arg(
        long = "redis",
        env = "REDIS_URL",
        default_value = "redis://127.0.0.1:6379",
        hide_env_values = true
    )]
    redis_url: String,
    /// A job to work on (repeat for several); none means every job in Redis.
    #[arg(long = "job", env = "BATCHFLEET_JOBS", value_delimiter = ',')]
    jobs: Vec<String>,
    /// Requests in flight in this process.
    #[arg(long, env = "BATCHFLEET_CONCURRENCY", default_value_t = 32)]
    concurrency: usize,
    /// Consumer name; must be unique per process (default: host-pid-random).
    #[arg(long, env = "BATCHFLEET_CONSUMER")]
    consumer: Option<String>,
    /// Exit once the jobs are complete (nothing queued, pending or delayed).
    #[arg(long)]
    drain: bool,
    /// Seconds in-flight work may take to finish after SIGTERM/SIGINT
    /// (default: the longest provider timeout + 5 s, so no call is cut off).
    #[arg(long, env = "BATCHFLEET_DRAIN_TIMEOUT_SECS")]
    drain_timeout_secs: Option<f64>,
    /// Milliseconds a pending task may stay idle before another worker takes
    /// it over (default: the longest provider timeout + 30 s).
    #[arg(long, env = "BATCHFLEET_VISIBILITY_TIMEOUT_MS")]
    visibility_timeout_ms: Option<u64>,
    /// Deliveries after which a task goes to review as poison.
    #[arg(long, env = "BATCHFLEET_MAX_DELIVERIES", default_value_t = 5)]
    max_deliveries: u32,
    /// Calls failing with the same non-retryable provider error (a 400 for a
    /// wrong key or model) before the job halts with the provider's message.
    #[arg(long, env = "BATCHFLEET_BREAKER_ERRORS", default_value_t = 3)]
    breaker_errors: u64,
    /// The longest an idle worker waits before looking for work again without
    /// a wake-up (new work wakes idle workers at once: this is a safety net).
    #[arg(long, default_value_t = 60_000)]
    idle_poll_ms: u64,
    /// How often the worker says who it is and what it does (`producer
    /// workers`, the console's Workers page); it is taken for dead after
    /// three missed beats. A quiet worker (nothing in flight or settled for
    /// a minute) beats three times less often, and says so.
    #[arg(long, default_value_t = 5_000)]
    heartbeat_ms: u64,
    /// Override every job's provider.base_url (e.g. a local simulator).
    #[arg(long, env = "BATCHFLEET_BASE_URL")]
    base_url: Option<String>,
    /// Start even when Redis may evict keys (tests only).
    #[arg(long)]
    allow_evicting_redis: bool,
    /// Address of /metrics, /healthz and /readyz (`off` disables; port 0 picks
    /// one). Unset: 127.0.0.1:9464, or a free port when another worker on
    /// this host has it (logged); an address given here must be free.
    #[arg(long, env = "BATCHFLEET_METRICS_ADDR")]
    metrics_addr: Option<String>,
    /// Log format: json (default when not a terminal) or text.
    #[arg(long, env = "BATCHFLEET_LOG_FORMAT")]
    log_format: Option<String>,
}

fn default_consumer() -> String {
    let host = std::env::var("POD_NAME")
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "worker".into());
    let suffix: u32 = rand::random();
    format!("{host}-{}-{:08x}", std::process::id(), suffix)
}

#[tokio::main]
async fn main() -> ExitCode {
    let code = run_worker(Args::parse()).await;
    // The last lines reach a reader that is still there; a stuck or closed
    // one does not keep the worker.
    common::log::flush(Duration::from_secs(2));
    code
}

async fn run_worker(args: Args) -> ExitCode {
    let json = worker::entry::init_logs(args.log_format.as_deref());
    let metrics_fallback = args.metrics_addr.is_none();
    let metrics_addr = match args
        .metrics_addr
        .as_deref()
        .unwrap_or(worker::run::DEFAULT_METRICS_ADDR)
    {
        "off" | "" => None,
        a => match a.parse() {
            Ok(addr) => Some(addr),
            Err(_) => {
                common::errln!("error: --metrics-addr `{a}` is not an address like 0.0.0.0:9464 (or `off`)");
                return ExitCode::from(2);
            }
        },
    };
    let traces = match Traces::from_env("batchfleet-worker") {
        Ok(t) => t,
        Err(e) => {
            common::errln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let config = Config {
        traces: traces.clone(),
        metrics_addr,
        metrics_fallback,
        redis_url: args.redis_url,
        jobs: args.jobs,
        concurrency: args.concurrency,
        consumer: args.consumer.unwrap_or_else(default_consumer),
        drain: args.drain,
        drain_timeout: args.drain_timeout_secs.map(|s| Duration::from_secs_f64(s.max(0.0))),
        visibility_timeout: args.visibility_timeout_ms.map(Duration::from_millis),
        max_deliveries: args.max_deliveries,
        breaker_errors: args.breaker_errors,
        idle_poll: Duration::from_millis(args.idle_poll_ms.max(1)),
        heartbeat: Duration::from_millis(args.heartbeat_ms.max(10)),
        base_url: args.base_url,
        allow_evicting_redis: args.allow_evicting_redis,
    };
    let cancel = CancellationToken::new();
    let on_signal = cancel.clone();
    tokio::spawn(async move {
        worker::entry::shutdown_signal().await;
        // Stop first: saying so can never hold the stop up.
        on_signal.cancel();
        tracing::info!("shutdown signal: no new claims; draining in-flight work");
    });
    let outcome = run(config, cancel).await;
    traces.shutdown(Duration::from_secs(5));
    match outcome {
        Ok(summary) => {
            print_summary(&summary, json);
            if summary.halted.is_empty() {
                ExitCode::SUCCESS
            } else {
                for (job, reason) in &summary.halted {
                    common::errln!(
                        "error: job `{job}` is halted: {reason}. Its records stay queued; once the cause is fixed, \
                         continue it with `producer resume --job {job}`"
                    );
                }
                ExitCode::from(EXIT_HALTED)
            }
        }
        Err(RunError::Refused(msg)) => {
            common::errln!("error: {msg}");
            ExitCode::from(2)
        }
        Err(e) => {
            common::errln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The run's summary as the last log line: a JSON log line in the JSON log
/// format (`fields.summary` holds it), else `worker summary: {...}`.
fn print_summary(summary: &worker::run::RunSummary, json: bool) {
    let body = serde_json::to_value(summary).unwrap_or_default();
    if json {
        let line = serde_json::json!({
            "timestamp": common::manifest::now_rfc3339(),
            "level": "INFO",
            "fields": {"message": "worker summary", "summary": body},
            "target": "worker",
        });
        common::errln!("{line}");
    } else {
        common::errln!("worker summary: {body}");
    }
}

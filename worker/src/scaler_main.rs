//! `scaler`: thin entry point of [`worker::scaler`]. Parses flags, sets up
//! logs and signals, serves the work left and promotes due retries.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use tokio_util::sync::CancellationToken;
use worker::scaler::{Config, Scaler};

#[derive(Debug, Parser)]
#[command(
    name = "scaler",
    version,
    about = "batchfleet scaler: the work left (queued + in flight + delayed) for the autoscaler, and due retries promoted while no worker runs"
)]
struct Args {
    /// Redis URL (`redis://[user:password@]host:port[/db]`, or `host:port`).
    #[arg(
        long = "redis",
        env = "REDIS_URL",
        default_value = "redis://127.0.0.1:6379",
        hide_env_values = true
    )]
    redis_url: String,
    /// A job to serve (repeat for several); none means every job in Redis.
    #[arg(long = "job", env = "BATCHFLEET_JOBS", value_delimiter = ',')]
    jobs: Vec<String>,
    /// Address of /remaining, /metrics, /healthz and /readyz.
    #[arg(long, env = "BATCHFLEET_SCALER_ADDR", default_value = "127.0.0.1:9465")]
    bind: String,
    /// The longest the promoter sleeps when no retry is due sooner.
    #[arg(long, default_value_t = 5_000)]
    max_sleep_ms: u64,
    /// Log format: json (default when not a terminal) or text.
    #[arg(long, env = "BATCHFLEET_LOG_FORMAT")]
    log_format: Option<String>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let code = run_scaler(Args::parse()).await;
    common::log::flush(Duration::from_secs(2));
    code
}

async fn run_scaler(args: Args) -> ExitCode {
    worker::entry::init_logs(args.log_format.as_deref());
    let Ok(bind) = args.bind.parse() else {
        common::errln!(
            "error: --bind `{}` is not an address like 127.0.0.1:9465",
            args.bind.escape_default()
        );
        return ExitCode::from(2);
    };
    for job in &args.jobs {
        if let Err(e) = common::store::valid_job_name(job) {
            common::errln!("error: --job: {e}");
            return ExitCode::from(2);
        }
    }
    let config = Config {
        redis_url: args.redis_url,
        jobs: args.jobs,
        bind,
        max_sleep: Duration::from_millis(args.max_sleep_ms.max(1)),
    };
    let scaler = match Scaler::connect(config).await {
        Ok(s) => s,
        Err(e) => {
            common::errln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let stop = CancellationToken::new();
    let bound = match scaler.serve(stop.clone()).await {
        Ok(a) => a,
        Err(e) => {
            common::errln!("error: cannot serve on {bind}: {e}");
            return ExitCode::from(2);
        }
    };
    tracing::info!(addr = %bound, "scaler listening: /remaining, /metrics, /healthz, /readyz");
    let on_signal = stop.clone();
    tokio::spawn(async move {
        worker::entry::shutdown_signal().await;
        on_signal.cancel();
    });
    scaler.run(stop).await;
    tracing::info!("scaler stopped");
    ExitCode::SUCCESS
}

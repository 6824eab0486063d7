//! What the `worker` and `scaler` entry points share: logs and signals.

use std::io::IsTerminal;

/// Sets up logs on stderr: JSON when `format` says so, or by default when
/// stderr is not a terminal; text in colour only on a terminal, and never
/// with `NO_COLOR` set. Returns whether the format is JSON. Lines go
/// through [`common::log`]: a closed or full stderr drops them (counted),
/// never stalls or panics the worker.
pub fn init_logs(format: Option<&str>) -> bool {
    let json = match format {
        Some("json") => true,
        Some(_) => false,
        None => !std::io::stderr().is_terminal(),
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    if json {
        tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .with_writer(common::log::Stderr)
            .log_internal_errors(false)
            .init();
    } else {
        tracing_subscriber::fmt()
            .with_ansi(common::log::colour())
            .with_env_filter(filter)
            .with_writer(common::log::Stderr)
            .log_internal_errors(false)
            .init();
    }
    json
}

/// Returns on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) else {
        let _ = ctrl_c.await;
        return;
    };
    tokio::select! {
        _ = ctrl_c => {}
        _ = term.recv() => {}
    }
}

//! `producer`: thin entry point. Parses the command line, wires Ctrl-C and
//! SIGTERM to a cancellation token, and calls [`producer::cli::run`].

use std::process::ExitCode;

use clap::Parser;
use tokio_util::sync::CancellationToken;

/// As in the worker (see BENCHMARKS.md, #15): glibc's malloc and free were
/// about a sixth of the reconciliation's CPU (each page's thousands of small
/// strings made on one thread and freed on another); with jemalloc an
/// enqueued record also costs the producer a third less CPU.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = producer::cli::Cli::parse();
    let cancel = CancellationToken::new();
    let on_signal = cancel.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        on_signal.cancel();
        common::errln!("stopping: finishing the batch in flight and saving the cursor (press Ctrl-C again to abort)");
        shutdown_signal().await;
        std::process::exit(130);
    });
    let code = producer::cli::run(cli, cancel).await;
    // The last lines reach a reader that is still there; a stuck or closed
    // one does not keep the command.
    common::log::flush(std::time::Duration::from_secs(2));
    code
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = ctrl_c.await;
                return;
            }
        };
        // A closed terminal (SIGHUP) ends a command as Ctrl-C does: `review
        // next` then gives its entry back.
        let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
        let hung_up = async {
            match hangup.as_mut() {
                Some(h) => {
                    h.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
            _ = hung_up => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

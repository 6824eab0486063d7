//! Enqueue progress: a bar with rate and ETA on a terminal, plain periodic
//! log lines otherwise (CI, Kubernetes Jobs), nothing when disabled.

use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::manifest::Counts;
use indicatif::{ProgressBar, ProgressStyle};

/// How often a plain progress line is printed when not on a terminal.
const LOG_EVERY: Duration = Duration::from_secs(5);

pub enum Progress {
    Off,
    Bar(ProgressBar),
    Log {
        total: u64,
        started: Instant,
        last: Mutex<Instant>,
        start_offset: u64,
    },
}

impl Progress {
    pub fn new(enabled: bool, total_bytes: u64, start_offset: u64) -> Progress {
        if !enabled {
            return Progress::Off;
        }
        if std::io::stderr().is_terminal() {
            let bar = ProgressBar::new(total_bytes);
            let style = ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta} {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar());
            bar.set_style(style);
            bar.set_position(start_offset);
            bar.enable_steady_tick(Duration::from_millis(200));
            Progress::Bar(bar)
        } else {
            let now = Instant::now();
            Progress::Log {
                total: total_bytes,
                started: now,
                last: Mutex::new(now),
                start_offset,
            }
        }
    }

    /// Reports the confirmed position.
    pub fn set(&self, offset: u64, counts: &Counts) {
        match self {
            Progress::Off => {}
            Progress::Bar(bar) => {
                bar.set_position(offset);
                bar.set_message(format!(
                    "{} lines, {} new, {} dropped",
                    counts.lines, counts.enqueued, counts.dropped
                ));
            }
            Progress::Log {
                total,
                started,
                last,
                start_offset,
            } => {
                let Ok(mut last) = last.lock() else { return };
                if last.elapsed() < LOG_EVERY {
                    return;
                }
                *last = Instant::now();
                let elapsed = started.elapsed().as_secs_f64().max(1e-9);
                let rate = (offset - start_offset) as f64 / elapsed;
                let eta = if rate > 0.0 {
                    (total - offset) as f64 / rate
                } else {
                    f64::NAN
                };
                common::errln!(
                    "enqueue: {:.1}% ({offset}/{total} bytes), {} lines, {} new, {} present, {} dropped, {:.0} bytes/s, eta {eta:.0}s",
                    100.0 * offset as f64 / (*total).max(1) as f64,
                    counts.lines,
                    counts.enqueued,
                    counts.already_present,
                    counts.dropped,
                    rate
                );
            }
        }
    }

    pub fn finish(&self) {
        if let Progress::Bar(bar) = self {
            bar.finish_and_clear();
        }
    }
}

//! The fleet's workers as their heartbeats say (`producer workers` and the
//! console's Workers page): alive, draining, stopped or dead, what each
//! serves and does, and when it was last heard of. Dead and stopped ones
//! are listed (greyed) until their entry expires.

use common::heartbeat::{Heartbeat, Liveness};
use common::store::{RedisStore, StoreError};
use serde::Serialize;

/// One worker as read now.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerLine {
    #[serde(flatten)]
    pub beat: Heartbeat,
    pub state: Liveness,
    /// Seconds since its last beat.
    pub last_seen_secs: u64,
}

impl WorkerLine {
    /// When it started, RFC 3339 UTC.
    pub fn started(&self) -> String {
        common::manifest::rfc3339(self.beat.started_ms / 1000)
    }

    /// `3s ago`, `4m10s ago`.
    pub fn last_seen(&self) -> String {
        format!("{} ago", common::manifest::human_duration(self.last_seen_secs * 1000))
    }
}

/// Every worker with an entry, live ones first, then by id.
pub async fn list(store: &RedisStore) -> Result<Vec<WorkerLine>, StoreError> {
    let (beats, now_ms) = store.workers().await?;
    let mut lines: Vec<WorkerLine> = beats
        .into_iter()
        .filter(|b| !b.expired(now_ms))
        .map(|beat| WorkerLine {
            state: beat.liveness(now_ms),
            last_seen_secs: now_ms.saturating_sub(beat.seen_ms) / 1000,
            beat,
        })
        .collect();
    lines.sort_by(|a, b| (a.state.gone(), &a.beat.id).cmp(&(b.state.gone(), &b.beat.id)));
    Ok(lines)
}

/// The text table; gone workers dimmed where standard output is a
/// terminal that takes colour.
pub fn print(lines: &[WorkerLine]) {
    use std::io::IsTerminal;
    let dim = common::log::colour_on(std::io::stdout().is_terminal());
    crate::outln!(
        "{:<32} {:<16} {:<8} {:<9} {:<20} {:>9} {:>9}  {:<20}  last seen",
        "worker",
        "host",
        "version",
        "state",
        "jobs",
        "in flight",
        "records/s",
        "started"
    );
    for l in lines {
        let row = format!(
            "{:<32} {:<16} {:<8} {:<9} {:<20} {:>9} {:>9.2}  {:<20}  {}",
            l.beat.id,
            l.beat.host,
            l.beat.version,
            l.state.name(),
            l.beat.jobs.join(","),
            l.beat.in_flight,
            l.beat.rate_per_sec,
            l.started(),
            l.last_seen()
        );
        if dim && l.state.gone() {
            crate::outln!("\x1b[2m{row}\x1b[0m");
        } else {
            crate::outln!("{row}");
        }
    }
    let live = lines.iter().filter(|l| !l.state.gone()).count();
    common::errln!(
        "{} workers: {live} alive or draining, {} dead or stopped (listed until their entry expires)",
        lines.len(),
        lines.len() - live
    );
}

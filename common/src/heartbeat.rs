//! A worker's heartbeat: who it is and what it is doing, written every few
//! seconds into `bf:workers` and read by `producer workers` and the
//! console. A worker that stops saying so is dead (three beats missed),
//! shown greyed, until its entry expires and leaves.

use serde::{Deserialize, Serialize};

/// Beats a worker may miss before it is taken for dead.
pub const MISSED_BEATS: u64 = 3;
/// Beats after its last one that a worker's entry is kept (then removed).
pub const KEPT_BEATS: u64 = 60;

/// What a worker says of itself at each beat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// Its consumer name.
    pub id: String,
    pub host: String,
    pub version: String,
    /// The jobs it serves.
    pub jobs: Vec<String>,
    /// Tasks it is working on now.
    pub in_flight: u64,
    /// Records it settled (done, to review, dropped) per second over the
    /// last minute, and since it started.
    pub rate_per_sec: f64,
    pub settled: u64,
    /// Unix ms.
    pub started_ms: u64,
    pub seen_ms: u64,
    /// Its beat interval: it is dead after [`MISSED_BEATS`] of them.
    pub every_ms: u64,
    /// Stopping: no new claims, its tasks in flight finishing.
    pub draining: bool,
    /// Run with `--drain`: it exits once its jobs have nothing left.
    #[serde(default)]
    pub drain_mode: bool,
    /// It said goodbye (its last beat).
    #[serde(default)]
    pub stopped: bool,
}

/// A worker as a reader sees it at a given time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Liveness {
    Alive,
    Draining,
    /// It exited and said so.
    Stopped,
    /// No beat for [`MISSED_BEATS`] intervals: killed, hung, or cut off.
    Dead,
}

impl Liveness {
    pub fn name(self) -> &'static str {
        match self {
            Liveness::Alive => "alive",
            Liveness::Draining => "draining",
            Liveness::Stopped => "stopped",
            Liveness::Dead => "dead",
        }
    }

    /// Shown greyed: it does no work any more.
    pub fn gone(self) -> bool {
        matches!(self, Liveness::Stopped | Liveness::Dead)
    }
}

impl Heartbeat {
    /// What the worker is at `now_ms`.
    pub fn liveness(&self, now_ms: u64) -> Liveness {
        if self.stopped {
            Liveness::Stopped
        } else if now_ms.saturating_sub(self.seen_ms) > self.every_ms.max(1) * MISSED_BEATS {
            Liveness::Dead
        } else if self.draining {
            Liveness::Draining
        } else {
            Liveness::Alive
        }
    }

    /// Whether its entry is past keeping at `now_ms`.
    pub fn expired(&self, now_ms: u64) -> bool {
        now_ms.saturating_sub(self.seen_ms) > self.every_ms.max(1) * KEPT_BEATS
    }

    pub fn encode(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn decode(text: &str) -> Option<Heartbeat> {
        serde_json::from_str(text).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn beat() -> Heartbeat {
        Heartbeat {
            id: "w1".into(),
            host: "h".into(),
            version: "0.1.0".into(),
            jobs: vec!["j".into()],
            in_flight: 2,
            rate_per_sec: 1.5,
            settled: 10,
            started_ms: 1_000,
            seen_ms: 10_000,
            every_ms: 1_000,
            draining: false,
            drain_mode: false,
            stopped: false,
        }
    }

    #[test]
    fn a_worker_is_dead_after_three_missed_beats_and_expires_after_sixty() {
        let b = beat();
        assert_eq!(b.liveness(10_000), Liveness::Alive);
        assert_eq!(b.liveness(13_000), Liveness::Alive);
        assert_eq!(b.liveness(13_001), Liveness::Dead);
        assert!(!b.expired(70_000));
        assert!(b.expired(70_001));
        let draining = Heartbeat {
            draining: true,
            ..beat()
        };
        assert_eq!(draining.liveness(10_500), Liveness::Draining);
        assert_eq!(
            draining.liveness(20_000),
            Liveness::Dead,
            "a draining worker can die too"
        );
        let stopped = Heartbeat {
            stopped: true,
            ..beat()
        };
        assert_eq!(stopped.liveness(10_000), Liveness::Stopped);
        assert!(Liveness::Dead.gone() && Liveness::Stopped.gone() && !Liveness::Draining.gone());
        assert_eq!(Heartbeat::decode(&b.encode()), Some(b));
    }
}

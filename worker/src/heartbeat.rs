//! The worker's heartbeat: every `--heartbeat-ms` it writes who it is and
//! what it is doing into `bf:workers` (see `common::heartbeat`), with its
//! rate over the last minute; a last beat when it leaves says it stopped.
//! A quiet worker (nothing in flight, nothing settled for a minute) beats
//! [`QUIET_BEATS`] times less often and says so in its beat (readers take
//! it for dead after three of its own intervals); its first busy beat comes
//! within one interval. Once a minute it also removes the entries of
//! workers long dead.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::heartbeat::Heartbeat;

use crate::fleet::Fleet;
use crate::service::Service;

/// The window of the rate a beat reports.
const RATE_WINDOW: Duration = Duration::from_secs(60);
/// How often expired entries are looked for.
const FORGET_EVERY: Duration = Duration::from_secs(60);
/// How often Redis's clock is read again; between readings a beat's time is
/// the last reading plus the time passed on this machine's steady clock.
const CLOCK_EVERY: Duration = Duration::from_secs(60);
/// How many times less often a quiet worker beats (#32: "idle is free").
pub const QUIET_BEATS: u32 = 3;

pub struct Beater {
    fleet: Arc<Fleet>,
    host: String,
    started_ms: u64,
    /// (when, records settled by then), over the last [`RATE_WINDOW`].
    window: VecDeque<(Instant, u64)>,
    forgot: Option<Instant>,
    /// Redis's clock (Unix ms) as last read, and when.
    clock: Option<(Instant, u64)>,
    /// When the last beat was written, and whether it was a quiet one.
    written: Option<(Instant, bool)>,
}

impl Beater {
    pub fn new(fleet: Arc<Fleet>) -> Beater {
        Beater {
            started_ms: fleet.started_ms,
            fleet,
            host: host_name(),
            window: VecDeque::new(),
            forgot: None,
            clock: None,
            written: None,
        }
    }

    /// The worker now, as its heartbeat says it.
    pub fn heartbeat(&mut self) -> Heartbeat {
        let f = &self.fleet;
        let settled = f.settled.load(Ordering::Relaxed);
        let now = Instant::now();
        self.window.push_back((now, settled));
        while self
            .window
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > RATE_WINDOW)
        {
            self.window.pop_front();
        }
        let rate_per_sec = match self.window.front() {
            Some((t, n)) if now.duration_since(*t) >= Duration::from_secs(1) => {
                (settled - n) as f64 / now.duration_since(*t).as_secs_f64()
            }
            // Less than a second of history: what it settled since it started.
            _ => settled as f64 / (crate::clock::now_ms().saturating_sub(self.started_ms).max(1000) as f64 / 1000.0),
        };
        Heartbeat {
            id: f.config.consumer.clone(),
            host: self.host.clone(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            jobs: f.jobs.iter().map(|j| j.name.clone()).collect(),
            // Concurrency permits taken: the requests it works on now (an
            // outcome waiting to be stored gave its permit back, see
            // `crate::slot`).
            in_flight: f
                .config
                .concurrency
                .max(1)
                .saturating_sub(f.permits.available_permits()) as u64,
            rate_per_sec: (rate_per_sec * 100.0).round() / 100.0,
            settled,
            started_ms: self.started_ms,
            seen_ms: crate::clock::now_ms(),
            every_ms: f.config.heartbeat.as_millis() as u64,
            draining: f.shutdown.is_cancelled(),
            drain_mode: f.config.drain,
            stopped: false,
        }
    }

    /// The beat to write now, if one is due: every interval while busy, a
    /// quiet one (saying its longer interval) every [`QUIET_BEATS`]
    /// intervals, the first beat after a change of either kind at once.
    fn due(&mut self) -> Option<Heartbeat> {
        let mut beat = self.heartbeat();
        let quiet = beat.in_flight == 0 && beat.rate_per_sec == 0.0 && !beat.draining;
        let every = self.fleet.config.heartbeat;
        if quiet {
            beat.every_ms *= u64::from(QUIET_BEATS);
        }
        let wait = every * QUIET_BEATS - every / 2;
        match self.written {
            Some((at, true)) if quiet && at.elapsed() < wait => None,
            _ => Some(beat),
        }
    }

    /// The last beat: the worker stopped.
    pub async fn goodbye(&mut self) {
        let beat = Heartbeat {
            stopped: true,
            in_flight: 0,
            ..self.heartbeat()
        };
        if let Err(e) = self.write(beat).await {
            tracing::debug!(error = %e, "the last heartbeat was not written");
        }
    }

    /// Writes `beat`, seen now by Redis's clock: read once every
    /// [`CLOCK_EVERY`] (every beat reading it was half an idle worker's
    /// Redis commands), else the last reading moved on by the time passed.
    async fn write(&mut self, beat: Heartbeat) -> Result<(), common::store::StoreError> {
        let seen_ms = match self.clock {
            Some((at, ms)) if at.elapsed() < CLOCK_EVERY => ms + at.elapsed().as_millis() as u64,
            _ => {
                let ms = self.fleet.store.server_ms().await?;
                self.clock = Some((Instant::now(), ms));
                ms
            }
        };
        self.fleet.store.beat(&Heartbeat { seen_ms, ..beat }).await
    }
}

impl Service for Beater {
    fn name(&self) -> &'static str {
        "heartbeat"
    }

    async fn run_once(&mut self) -> Option<Duration> {
        if let Some(beat) = self.due() {
            let quiet = beat.every_ms > self.fleet.config.heartbeat.as_millis() as u64;
            match self.write(beat).await {
                Ok(()) => self.written = Some((Instant::now(), quiet)),
                Err(e) => self.fleet.store_error(&e).await,
            }
        }
        if self.forgot.is_none_or(|t| t.elapsed() >= FORGET_EVERY) {
            self.forgot = Some(Instant::now());
            if let Err(e) = self.fleet.store.forget_workers().await {
                self.fleet.store_error(&e).await;
            }
        }
        Some(self.fleet.config.heartbeat)
    }
}

/// This machine's name (the pod's, on Kubernetes).
fn host_name() -> String {
    std::env::var("POD_NAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

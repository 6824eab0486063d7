//! This worker's watch over a job's failure rates (the rule is
//! [`common::drift`]): each validated answer feeds it, and an alarm halts
//! the job. A watch begun before the latest `producer resume` halts
//! nothing: a person looked and said to go on, so the watch starts over
//! and the rates from then on are the ones compared.

use std::collections::BTreeSet;
use std::sync::{Mutex, MutexGuard};

use common::decision::Outcome;
use common::drift::Detector;
use common::spec::DriftSpec;

use crate::queue::JobQueue;
use crate::telemetry::Metrics;

/// A job's drift watch in this worker.
pub struct DriftWatch {
    detector: Detector,
    /// The job's resume mark the watch began under (None: not read yet).
    mark: Option<String>,
    /// The fields and rules this worker's gauges show, to forget them.
    gauged: BTreeSet<String>,
}

impl DriftWatch {
    pub fn new(spec: DriftSpec) -> DriftWatch {
        DriftWatch {
            detector: Detector::new(spec),
            mark: None,
            gauged: BTreeSet::new(),
        }
    }

    /// Starts over (the job halted, or was resumed), its gauges cleared.
    fn restart(&mut self, job: &str, metrics: &Metrics) {
        self.detector.restart();
        for key in std::mem::take(&mut self.gauged) {
            for over in ["window", "before"] {
                let _ = metrics.drift_failure_ratio.remove_label_values(&[job, &key, over]);
            }
        }
    }
}

/// A job's drift watch as the worker holds it (`JobCtx::drift`), with what
/// its functions below need of the job: its name, its queue, the metrics.
pub struct Watched<'a> {
    pub watch: &'a Mutex<DriftWatch>,
    pub job: &'a str,
    pub queue: &'a dyn JobQueue,
    pub metrics: &'a Metrics,
}

impl Watched<'_> {
    fn lock(&self) -> MutexGuard<'_, DriftWatch> {
        self.watch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The watcher saw the job halted: the watch starts over (once resumed,
    /// the rates then are the ones to compare with).
    pub fn halted(&self) {
        self.lock().restart(self.job, self.metrics);
    }

    /// The watcher read the job's resume mark: a watch begun under another
    /// one starts over under this one.
    pub fn resume_mark(&self, mark: String) {
        let mut watch = self.lock();
        match &watch.mark {
            Some(seen) if *seen == mark => {}
            Some(_) => {
                watch.restart(self.job, self.metrics);
                watch.mark = Some(mark);
            }
            None => watch.mark = Some(mark),
        }
    }

    /// Adds a validated answer of record `key` to the watch: a field or
    /// rule failing far more often than it did earlier halts the job with
    /// the reason and the latest examples (the record itself goes on as
    /// decided; `producer resume` lets the job go on).
    pub async fn observe(&self, key: &str, outcome: &Outcome) {
        let errors = match outcome {
            Outcome::Valid => &[][..],
            Outcome::Invalid(errors) => errors.as_slice(),
            _ => return,
        };
        let (alarm, mark) = {
            let mut watch = self.lock();
            let alarm = watch.detector.observe(key, errors);
            let gauge = &self.metrics.drift_failure_ratio;
            for (field, window, before) in watch.detector.rates() {
                gauge.with_label_values(&[self.job, &field, "window"]).set(window);
                gauge.with_label_values(&[self.job, &field, "before"]).set(before);
                watch.gauged.insert(field);
            }
            (alarm, watch.mark.clone())
        };
        let Some(alarm) = alarm else { return };
        let reason = alarm.reason();
        let mark = match mark {
            Some(mark) => Ok(mark),
            None => self.queue.resume_mark().await,
        };
        let halted = match mark {
            Ok(mark) => self.queue.halt_on_drift(&reason, &mark).await,
            Err(e) => Err(e),
        };
        let job = self.job;
        match halted {
            Ok(true) => {
                self.metrics.drift_alarms.with_label_values(&[job, &alarm.key]).inc();
                tracing::error!(job = %job, field = %alarm.key, reason = %reason, "quality drift: halting the job (producer resume goes on)");
            }
            Ok(false) => {
                // Resumed since this watch began: a person already said to go on.
                tracing::info!(job = %job, field = %alarm.key, "a drift alarm over rates from before the job's resume: not halting, the watch starts over");
                self.lock().restart(job, self.metrics);
            }
            Err(e) => {
                tracing::warn!(job = %job, error = %e, "could not halt the job on its drift (the next alarm tries again)");
            }
        }
    }
}

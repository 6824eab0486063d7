//! The planner's service: re-plans each job with tiers or a fallback every
//! [`crate::plan::PERIOD`] from the fleet's counts (see [`crate::plan`]).

use std::sync::Arc;
use std::time::Duration;

use crate::clock::now_ms;
use crate::fleet::Fleet;
use crate::job::JobCtx;
use crate::plan::PERIOD;
use crate::service::Service;

/// Re-plans one routed job every [`PERIOD`] from the fleet's counts.
pub struct PlanService {
    fleet: Arc<Fleet>,
    job: Arc<JobCtx>,
}

impl PlanService {
    /// None: the job has neither tiers nor a fallback to choose between.
    pub fn for_job(fleet: &Arc<Fleet>, job: &Arc<JobCtx>) -> Option<PlanService> {
        (job.plan.routed() || job.fallback.is_some()).then(|| PlanService {
            fleet: fleet.clone(),
            job: job.clone(),
        })
    }

    /// The plan's figures as metrics (`batchfleet_plan{job,figure}`).
    fn show(&self, facts: &common::route::PlanFacts) {
        let (job, gauge) = (&self.job, &self.fleet.metrics.plan);
        let set = |figure: &str, v: f64| gauge.with_label_values(&[job.name.as_str(), figure]).set(v);
        set("standard_share", job.plan.share());
        set("flex_acceptance", facts.flex_acceptance);
        set("batch", f64::from(u8::from(job.plan.batch_now())));
        set("fallback", f64::from(u8::from(job.plan.overflow())));
        if let Some(at) = facts.deadline_ms {
            set("deadline_left_seconds", (at as f64 - facts.now_ms as f64) / 1000.0);
        }
    }
}

impl Service for PlanService {
    fn name(&self) -> &'static str {
        "planner"
    }

    async fn run_once(&mut self) -> Option<Duration> {
        let job = &self.job;
        match self.fleet.store.plan_counts(&job.name, job.spec.job.partitions).await {
            Ok(counts) => {
                let (before, overflow) = (job.plan.share(), job.plan.overflow());
                let facts = job.plan.replan(counts, now_ms());
                let share = job.plan.share();
                self.show(&facts);
                if job.fallback.is_some() && job.plan.overflow() != overflow {
                    tracing::info!(
                        job = %job.name,
                        remaining = facts.remaining,
                        rate = facts.rate.map(|r| format!("{r:.1}/s")).unwrap_or_default(),
                        "{}",
                        if overflow {
                            "the provider alone meets the deadline again: the fallback takes no more calls"
                        } else {
                            "even all standard misses the deadline: the fallback takes calls too"
                        }
                    );
                }
                if (share - before).abs() >= 0.05 {
                    tracing::info!(
                        job = %job.name,
                        standard_share = format!("{share:.2}"),
                        remaining = facts.remaining,
                        rate = facts.rate.map(|r| format!("{r:.1}/s")).unwrap_or_default(),
                        flex_acceptance = format!("{:.2}", facts.flex_acceptance),
                        left_s = facts.deadline_ms.map(|d| d.saturating_sub(facts.now_ms) / 1000),
                        "the plan changed: this share of calls goes standard"
                    );
                }
            }
            Err(e) => self.fleet.store_error(&e).await,
        }
        Some(PERIOD)
    }
}

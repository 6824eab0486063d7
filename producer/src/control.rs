//! Cancelling, resuming and deleting a job, with the checks both the command
//! line and the console make: a job halted on its budget resumes only with a
//! new cap above what it spent and has in flight; a job whose tasks live
//! workers hold is deleted only when forced.

use common::store::RedisStore;

/// Why a cancel or resume was refused (the input's fault, not Redis's).
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Store(#[from] common::store::StoreError),
}

/// Cancels a job: no new claims; undelivered and waiting records are marked
/// cancelled (kept for resume). Returns what it says it did.
pub async fn cancel(store: &RedisStore, job: &str) -> Result<String, ControlError> {
    let spec = spec(store, job).await?;
    let n = store.cancel_job(job, spec.job.partitions).await?;
    Ok(format!(
        "job {job} cancelled: {n} records marked cancelled; in-flight work finishes \
         (producer resume --job {job} brings them back)"
    ))
}

/// Sets (or moves) a job's deadline: `when` is a duration from now (`30m`,
/// `6h`) or an instant (`2026-12-07T18:00:00Z`). Returns what it says it did.
pub async fn set_deadline(store: &RedisStore, job: &str, when: &str, now_ms: u64) -> Result<String, ControlError> {
    let spec = spec(store, job).await?;
    let at =
        common::route::parse_deadline(when, now_ms).map_err(|why| ControlError::Refused(format!("deadline: {why}")))?;
    if at <= now_ms {
        return Err(ControlError::Refused(format!(
            "deadline: {} has passed; give a time to come, e.g. producer deadline --job {job} 30m",
            common::manifest::rfc3339(at / 1000)
        )));
    }
    let before = store.deadline(job).await?;
    store.set_deadline(job, at, false).await?;
    let was = before.map_or("none".to_owned(), |b| common::manifest::rfc3339(b / 1000));
    let routed = if spec.provider.tiers.iter().any(|t| t == "flex") {
        "its workers re-plan within seconds"
    } else {
        "shown by status; its spec names no flex tier, so every call stays standard"
    };
    Ok(format!(
        "job {job}: deadline {} (was {was}); {routed}",
        common::manifest::rfc3339(at / 1000)
    ))
}

/// Lifts a cancel or a halt; `budget` (USD) sets a new cap first. Returns
/// what it says it did.
pub async fn resume(store: &RedisStore, job: &str, budget: Option<f64>) -> Result<String, ControlError> {
    let spec = spec(store, job).await?;
    let state = store.budget(job).await?;
    let on_budget = store.halted(job).await?.is_some_and(|r| r.starts_with("budget"));
    let refuse = |m: String| Err(ControlError::Refused(m));
    let mut said = Vec::new();
    match budget {
        Some(cap) if !(cap.is_finite() && cap > 0.0) => {
            return refuse(format!("--budget must be a positive number of USD, not {cap}"));
        }
        Some(_) if spec.budget.max_cost_usd.is_none() => {
            return refuse(format!(
                "--budget: job {job}'s spec has no [budget] max_cost_usd (its workers do not reserve against a cap)"
            ));
        }
        Some(cap) if cap <= state.spent_usd + state.reserved_usd => {
            return refuse(format!(
                "--budget {cap}: job {job} already spent {:.6} USD and has {:.6} USD in flight; give more than {:.6}",
                state.spent_usd,
                state.reserved_usd,
                state.spent_usd + state.reserved_usd
            ));
        }
        Some(cap) => {
            store.set_budget_cap(job, cap, false).await?;
            said.push(format!(
                "job {job}: budget {cap:.6} USD (spent {:.6}, in flight {:.6})",
                state.spent_usd, state.reserved_usd
            ));
        }
        None if on_budget => {
            return refuse(format!(
                "job {job} is halted on its budget (spent {:.6} USD of {:.6}): resume it with --budget USD, more than it spent",
                state.spent_usd,
                state.cap_usd.unwrap_or(0.0)
            ));
        }
        None => {}
    }
    let n = store.resume_job(job, spec.job.partitions).await?;
    said.push(format!(
        "job {job} resumed: {n} cancelled records re-queued; cancel and halt flags lifted"
    ));
    Ok(said.join("\n"))
}

/// Deletes every key of a job from Redis (never the sink's rows); refused
/// while live workers hold its tasks unless `force`. Returns the keys removed.
pub async fn delete(store: &RedisStore, job: &str, force: bool) -> Result<u64, ControlError> {
    let partitions = if force {
        partitions(store, job).await?
    } else {
        refuse_held(store, job).await?
    };
    Ok(store.delete_job(job, partitions).await?)
}

/// Refused while live workers hold tasks of the job (saying how many);
/// else the job's partitions.
pub async fn refuse_held(store: &RedisStore, job: &str) -> Result<u32, ControlError> {
    let partitions = partitions(store, job).await?;
    match store.held_by_live_workers(job, partitions).await? {
        0 => Ok(partitions),
        held => Err(ControlError::Refused(format!(
            "{held} tasks of job `{job}` are held by workers right now"
        ))),
    }
}

async fn partitions(store: &RedisStore, job: &str) -> Result<u32, ControlError> {
    Ok(match store.load_manifest(job).await? {
        Some(m) => m.partitions,
        None => spec(store, job).await?.job.partitions,
    })
}

async fn spec(store: &RedisStore, job: &str) -> Result<common::spec::JobSpec, ControlError> {
    store
        .job_spec(job)
        .await?
        .ok_or_else(|| ControlError::Refused(format!("job `{job}` does not exist")))
}

//! Bulk actions on the review queue: requeue or reject every entry a
//! [`Filter`] matches. The CLI (`producer review bulk`) and the console
//! select with the same filter; each action is recorded in the job's
//! bulk-action log with its filter and count.

use common::store::RedisStore;
use common::task::ReviewEntry;
use serde::Serialize;

use crate::filter::Filter;
use crate::review::ReviewError;

/// What a bulk action does to each entry.
#[derive(Debug, Clone)]
pub enum Bulk {
    Requeue { note: Option<String> },
    Reject { reason: String },
}

impl Bulk {
    pub fn name(&self) -> &'static str {
        match self {
            Bulk::Requeue { .. } => "requeue",
            Bulk::Reject { .. } => "reject",
        }
    }
}

/// What a bulk action did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Done {
    pub matched: usize,
    pub acted: usize,
    /// Decided by someone else meanwhile (nothing done to them here).
    pub lost: usize,
    /// Held by another reviewer who has them open (left to them).
    pub held: usize,
    /// Its entry in the job's bulk-action log.
    pub log_id: String,
}

/// Applies `bulk` to `entries` (selected with `f`) as `who`, then records
/// it in the job's bulk-action log with its filter and counts.
pub async fn apply(
    store: &RedisStore,
    job: &str,
    bulk: &Bulk,
    f: &Filter,
    entries: &[(ReviewEntry, u32)],
    who: &str,
) -> Result<Done, ReviewError> {
    let mut done = Done {
        matched: entries.len(),
        ..Done::default()
    };
    let mut failed = None;
    for (e, p) in entries {
        // An entry another reviewer has open is theirs to decide.
        if store
            .review_holder(job, *p, &e.record_id)
            .await?
            .is_some_and(|h| h != who)
        {
            done.held += 1;
            continue;
        }
        let r = match bulk {
            Bulk::Requeue { note } => crate::review::requeue_entry(store, job, *p, e, note.as_deref(), who).await,
            Bulk::Reject { reason } => crate::review::reject_entry(store, job, *p, e, reason, who).await,
        };
        match r {
            Ok(_) => done.acted += 1,
            Err(ReviewError::Lost(_) | ReviewError::AlreadyDone(_)) => done.lost += 1,
            // Stop, but what was done goes to the log first.
            Err(err) => {
                failed = Some(err);
                break;
            }
        }
    }
    let detail = match bulk {
        Bulk::Requeue { note } => note.clone().unwrap_or_default(),
        Bulk::Reject { reason } => reason.clone(),
    };
    done.log_id = store
        .bulk_log_add(
            job,
            &[
                ("action", bulk.name().to_owned()),
                ("by", who.to_owned()),
                ("at", common::manifest::now_rfc3339()),
                ("filter", f.describe()),
                ("matched", done.matched.to_string()),
                ("acted", done.acted.to_string()),
                ("lost", done.lost.to_string()),
                ("held", done.held.to_string()),
                ("detail", detail),
                ("complete", failed.is_none().to_string()),
            ],
        )
        .await?;
    match failed {
        Some(err) => Err(err),
        None => Ok(done),
    }
}

//! The store's review verbs: read the queue, apply a person's decision.

use redis::AsyncCommands;

use super::{RedisStore, StoreError};
use crate::keys;
use crate::task::{ResultRecord, ReviewEntry, Task};

/// A person's decision on a review entry.
#[derive(Debug, Clone)]
pub enum ReviewAction {
    /// Commit this result (already validated), marked human-provided.
    Accept(Box<ResultRecord>),
    /// Back to the stream for a fresh round of attempts.
    Requeue(Task),
    /// Terminal: the record is dropped as `rejected`, the entry archived.
    Reject { reason: String },
}

/// What applying a decision came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReviewOutcome {
    Applied,
    /// The entry was gone or changed: another reviewer acted first.
    Lost,
    /// The record already has a result.
    AlreadyDone,
}

impl RedisStore {
    /// Applies a decision if the entry is still exactly as it was read
    /// (`entry.seen`); `archived` is the entry with the action appended.
    pub async fn review_act(
        &self,
        job: &str,
        partition: u32,
        entry: &ReviewEntry,
        archived: &ReviewEntry,
        action: &ReviewAction,
    ) -> Result<ReviewOutcome, StoreError> {
        let (name, value) = match action {
            ReviewAction::Accept(result) => ("accept", result.encode()),
            ReviewAction::Requeue(task) => ("requeue", task.encode()),
            ReviewAction::Reject { reason } => ("reject", reason.clone()),
        };
        let applied: i64 = self
            .scripts
            .review_action
            .key(keys::state(job, partition))
            .key(keys::review(job, partition))
            .key(keys::reviewed(job, partition))
            .key(keys::results(job, partition))
            .key(keys::stream(job, partition))
            .key(keys::sink(job, partition))
            .arg(&entry.record_id)
            .arg(&entry.seen)
            .arg(archived.encode())
            .arg(name)
            .arg(value)
            .invoke_async(&mut self.conn.clone())
            .await?;
        if applied == 1 && matches!(action, ReviewAction::Requeue(_)) {
            self.wake(job, super::Wake::Work).await;
        }
        Ok(match applied {
            1 => ReviewOutcome::Applied,
            -1 => ReviewOutcome::AlreadyDone,
            _ => ReviewOutcome::Lost,
        })
    }
}

/// The reviewer of a lease's token: `ann` of `ann#3f2a` (a session of
/// hers at a terminal) or of `ann` (her console).
pub(crate) fn reviewer_of(token: &str) -> &str {
    token.split_once('#').map_or(token, |(who, _)| who)
}

/// A reviewer's hold on a review entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReviewLease {
    /// This reviewer holds it (now, or still: the lease was renewed).
    Mine,
    /// Another reviewer holds it (until they act, leave it, or the lease runs out).
    HeldBy { reviewer: String },
}

impl RedisStore {
    /// Takes (or renews) `who`'s lease on a review entry for `lease`, unless
    /// another reviewer (or another session: `who` may be `name#session`)
    /// holds it. Two reviewers never hold one entry at once
    /// (`lease.lua`: one step); a lease nobody gives back expires by itself.
    pub async fn review_lease(
        &self,
        job: &str,
        partition: u32,
        rid: &str,
        who: &str,
        lease: std::time::Duration,
    ) -> Result<ReviewLease, StoreError> {
        let key = keys::review_lease(job, partition, rid);
        let n: i64 = self
            .scripts
            .lease
            .key(&key)
            .arg(who)
            .arg("take")
            .arg(lease.as_millis().max(1) as u64)
            .invoke_async(&mut self.conn.clone())
            .await?;
        if n == 1 {
            return Ok(ReviewLease::Mine);
        }
        let reviewer: Option<String> = self.conn.clone().get(&key).await?;
        Ok(match reviewer {
            Some(token) => ReviewLease::HeldBy {
                reviewer: reviewer_of(&token).to_owned(),
            },
            // It expired in between: take it now.
            None => Box::pin(self.review_lease(job, partition, rid, who, lease)).await?,
        })
    }

    /// Who holds a review entry now (None: nobody).
    pub async fn review_holder(&self, job: &str, partition: u32, rid: &str) -> Result<Option<String>, StoreError> {
        let holder: Option<String> = self.conn.clone().get(keys::review_lease(job, partition, rid)).await?;
        Ok(holder.map(|h| reviewer_of(&h).to_owned()))
    }

    /// Gives `who`'s lease on a review entry back (nothing when another holds it).
    pub async fn review_release(&self, job: &str, partition: u32, rid: &str, who: &str) -> Result<(), StoreError> {
        let _: i64 = self
            .scripts
            .lease
            .key(keys::review_lease(job, partition, rid))
            .arg(who)
            .arg("release")
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(())
    }
}

impl RedisStore {
    /// Appends a bulk action (its fields) to the job's bulk-action log.
    pub async fn bulk_log_add(&self, job: &str, fields: &[(&str, String)]) -> Result<String, StoreError> {
        let id: String = self.conn.clone().xadd(keys::bulk_log(job), "*", fields).await?;
        Ok(id)
    }

    /// The job's bulk-action log, oldest first: (entry id, fields).
    pub async fn bulk_log(&self, job: &str) -> Result<Vec<(String, Vec<(String, String)>)>, StoreError> {
        let reply: redis::streams::StreamRangeReply = self.conn.clone().xrange_all(keys::bulk_log(job)).await?;
        Ok(reply
            .ids
            .into_iter()
            .map(|e| {
                let mut fields: Vec<(String, String)> = e
                    .map
                    .iter()
                    .filter_map(|(k, v)| Some((k.clone(), redis::from_redis_value::<String>(v.clone()).ok()?)))
                    .collect();
                fields.sort();
                (e.id, fields)
            })
            .collect())
    }
}

//! The store's review verbs: read the queue, apply a person's decision.

use redis::AsyncCommands;

use super::{RedisStore, StoreError};
use crate::keys;

/// A person's decision on a review entry.
#[derive(Debug, Clone)]
pub enum ReviewAction {
    /// Commit this result (already validated), marked human-provided.
    Accept { result: String },
    /// Back to the stream for a fresh round of attempts.
    Requeue {
        input: String,
        attempts: u32,
        calls: u32,
        history: String,
    },
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
    /// The review entry of a record, if it is in review.
    pub async fn review_entry(&self, job: &str, partition: u32, record_id: &str) -> Result<Option<String>, StoreError> {
        Ok(self.conn.clone().hget(keys::review(job, partition), record_id).await?)
    }

    /// The archived review entry of a record a person acted on.
    pub async fn archived_review(
        &self,
        job: &str,
        partition: u32,
        record_id: &str,
    ) -> Result<Option<String>, StoreError> {
        Ok(self
            .conn
            .clone()
            .hget(keys::reviewed(job, partition), record_id)
            .await?)
    }

    /// Applies a decision if the entry is still exactly `seen`.
    pub async fn review_act(
        &self,
        job: &str,
        partition: u32,
        record_id: &str,
        seen: &str,
        archived: &str,
        action: &ReviewAction,
    ) -> Result<ReviewOutcome, StoreError> {
        let (name, value, attempts, calls, history) = match action {
            ReviewAction::Accept { result } => ("accept", result.as_str(), 0, 0, "[]"),
            ReviewAction::Requeue {
                input,
                attempts,
                calls,
                history,
            } => ("requeue", input.as_str(), *attempts, *calls, history.as_str()),
            ReviewAction::Reject { reason } => ("reject", reason.as_str(), 0, 0, "[]"),
        };
        let applied: i64 = self
            .scripts
            .review_action
            .key(keys::state(job, partition))
            .key(keys::review(job, partition))
            .key(keys::reviewed(job, partition))
            .key(keys::results(job, partition))
            .key(keys::stream(job, partition))
            .arg(record_id)
            .arg(seen)
            .arg(archived)
            .arg(name)
            .arg(value)
            .arg(attempts)
            .arg(calls)
            .arg(history)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(match applied {
            1 => ReviewOutcome::Applied,
            -1 => ReviewOutcome::AlreadyDone,
            _ => ReviewOutcome::Lost,
        })
    }
}

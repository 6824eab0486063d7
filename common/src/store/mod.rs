//! The queue store: job state in Redis, spoken in queue verbs.
//!
//! Every key comes from [`crate::keys`]; every multi-key step is a Lua script
//! in `scripts/` whose header lists its KEYS, ARGV and return values.

mod audit_ops;
mod budget_ops;
mod delete_ops;
mod job_ops;
mod limit_ops;
mod outage_ops;
mod permissions;
mod read_ops;
mod redis_store;
mod review_ops;
mod route_ops;
mod shard_ops;
mod sink_ops;
mod wake_ops;
mod worker_ops;

pub use audit_ops::AuditItem;
pub use budget_ops::{BudgetState, Reserved};
pub use limit_ops::{Acquired, Bound, CallKind, FreeReport, FreeWord, LimitParams, Settlement};
pub use outage_ops::{FailedCall, Noted, OutageRules, Provider, ProviderOutage};
pub use read_ops::RecordSet;
pub use redis_store::{CA_CERT_ENV, Conn, EnqueueOutcome, RedisStore, TaskEntry};

pub use crate::secret::{cluster_seeds, redact_url};
pub use crate::sink::{SinkBatch, SinkEntry, SunkResult, Tokens};
pub use review_ops::{ReviewAction, ReviewLease, ReviewOutcome};
pub use route_ops::PlanCounts;
pub use shard_ops::Packed;
pub use sink_ops::Sunk;
pub use wake_ops::{Wake, Woken};
pub use worker_ops::{Finish, Finished, Finishing, IdleEntry, JobFlags, QueueStats, Remaining, WorkLeft};

pub use crate::keys::{BadJobName, valid_job_name};

/// A store operation that failed. Messages never contain credentials.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("cannot reach Redis at {url}: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("Redis error: {0}")]
    Redis(#[from] redis::RedisError),
    /// The worker is stopping: its batched Redis calls no longer run.
    #[error("shutting down: the Redis call was not made")]
    ShuttingDown,
    #[error("corrupt value at {key}: {reason}")]
    Corrupt { key: String, reason: String },
    #[error(
        "the Redis user lacks permissions batchfleet needs: {}; grant them (deploy/redis/users.acl holds the full ACL line)",
        missing.join(" ")
    )]
    Permissions { missing: Vec<String> },
    /// The server may evict keys: it could silently delete queue state.
    #[error("{}", evicting_message(policy.as_deref()))]
    Evicting { policy: Option<String> },
}

fn evicting_message(policy: Option<&str>) -> String {
    match policy {
        Some(p) => format!(
            "Redis maxmemory-policy is `{p}`: it can evict queue state and lose records. \
             Set `maxmemory-policy noeviction` (CONFIG SET maxmemory-policy noeviction)."
        ),
        None => "cannot read Redis maxmemory-policy (CONFIG GET is not allowed): make sure it is `noeviction`, \
                 then start with --allow-evicting-redis to skip this check"
            .to_owned(),
    }
}

//! The pipeline's one door to what the fleet shares about a job
//! ([`JobQueue`]): the Redis store in a fleet ([`RedisQueue`]), memory in
//! in-process tests ([`MemoryQueue`]).
//!
//! Only what [`crate::process`] needs: whether a delivery is still live,
//! its outcome stored with its acknowledgement and its paid call (the
//! ledger's append) in one atomic step, the halt, the fleet's view of the
//! provider (outage streak, breaker counts, the structured-output form it
//! accepts), and the job's spend cap. Claiming, taking over and promoting
//! retries are the services' (see [`crate::claim`], [`crate::reclaim`],
//! [`crate::promote`]); a test drives them on [`MemoryQueue`] directly.

mod memory;
mod redis;

use common::ledger::PaidCall;
use common::store::{FailedCall, Finish, Finished, Noted, OutageRules, Reserved, StoreError};
use common::task::{Delivery, RecordState};
use futures_util::future::BoxFuture;

pub use memory::MemoryQueue;
pub use redis::RedisQueue;

/// What a queue call comes to, later.
pub type Op<'a, T> = BoxFuture<'a, Result<T, StoreError>>;

/// One job's shared state, as the pipeline sees it. Every method is about
/// the job the queue was opened for.
pub trait JobQueue: Send + Sync {
    /// The record's state, and whether `d` is still its live delivery (not
    /// taken over by another worker meanwhile).
    fn check<'a>(&'a self, d: &'a Delivery) -> Op<'a, (Option<RecordState>, bool)>;

    /// Acknowledges a delivery whose record is already settled.
    fn ack<'a>(&'a self, d: &'a Delivery) -> Op<'a, ()>;

    /// Stores the outcome of `d` and acknowledges it, in one atomic step,
    /// with the paid call it made (recorded once under its key, whatever
    /// happens to the outcome). First writer wins: a record already settled
    /// is left as it is; a delivery taken over is [`Finished::Stale`].
    /// `audit`: a commit joins the spot-check queue.
    fn finish<'a>(
        &'a self,
        d: &'a Delivery,
        how: &'a Finish,
        paid: Option<&'a PaidCall>,
        audit: bool,
    ) -> Op<'a, Finished>;

    /// Halts the job fleet-wide (the first reason wins).
    fn halt<'a>(&'a self, reason: &'a str) -> Op<'a, ()>;

    /// Why the job is halted, if it is.
    fn halted(&self) -> Op<'_, Option<String>>;

    /// The job's resume mark: it changes at every `producer resume` ('' before any).
    fn resume_mark(&self) -> Op<'_, String>;

    /// Halts the job on a drift alarm of a watch begun under resume mark
    /// `mark`; false, and nothing done, when the job was resumed since.
    fn halt_on_drift<'a>(&'a self, reason: &'a str, mark: &'a str) -> Op<'a, bool>;

    /// Adds a transiently failed call to the fleet's streak (see `outage.lua`).
    fn provider_failed<'a>(&'a self, call: &'a FailedCall<'a>, rules: &'a OutageRules) -> Op<'a, Noted>;

    /// Notes an answer; returns the outage it ended (its start and now, Unix ms).
    fn provider_answered(&self) -> Op<'_, Option<(u64, u64)>>;

    /// Counts one more call that failed with this non-retryable error's
    /// signature; returns how many did, fleet-wide.
    fn breaker_count<'a>(&'a self, signature: &'a str) -> Op<'a, u64>;

    /// Notes that the provider answered at least once.
    fn mark_proven(&self) -> Op<'_, ()>;

    /// Remembers the structured-output form an endpoint accepts.
    fn remember_form<'a>(&'a self, endpoint: &'a str, form: &'a str) -> Op<'a, ()>;

    /// Reserves calls (`(id, nano-USD at most)`) against the job's cap for
    /// `lease_ms` each (see `budget.lua`).
    fn budget_reserve<'a>(&'a self, lease_ms: u64, calls: &'a [(String, u64)]) -> Op<'a, Vec<Reserved>>;

    /// Settles reservations (`(id, reserved, actual)`, nano-USD).
    fn budget_settle<'a>(&'a self, calls: &'a [(String, u64, u64)]) -> Op<'a, ()>;
}

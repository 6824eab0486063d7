//! [`JobQueue`] over the Redis store: the fleet's.

use std::sync::Arc;
use std::time::Duration;

use common::batch::GroupCommit;
use common::ledger::PaidCall;
use common::store::{FailedCall, Finish, Finished, Finishing, Noted, OutageRules, RedisStore, Reserved, StoreError};
use common::task::{Delivery, RecordState};

use super::{JobQueue, Op};
use crate::limiter::{Lately, PACED_FOR};

/// Outcomes stored together while the last call is on its way: one script
/// call per partition serves every task that finished meanwhile (at most
/// this many a call).
const FINISH_BATCH: usize = 64;
/// How long an outcome may wait for others while the provider's rate paces
/// the worker (see [`RedisQueue::paced`]).
const FINISH_LINGER: Duration = Duration::from_millis(250);

/// One job's queue in Redis; outcomes are batched (each still atomic and
/// first-writer-wins on its own, see `finish.lua`).
pub struct RedisQueue {
    store: RedisStore,
    job: String,
    finisher: GroupCommit<Finishing, Result<Finished, StoreError>>,
}

impl RedisQueue {
    pub fn new(store: &RedisStore, job: &str) -> RedisQueue {
        Self::paced(store, job, Arc::new(Lately::new()))
    }

    /// As [`RedisQueue::new`], for a worker whose provider's rate may pace
    /// it (`paced`, see [`crate::limiter::Limiter::paced`]): while it did
    /// lately, a call's outcome that settles its record for good (a result
    /// or a review entry with its paid call, [`Finishing::ends_a_call`])
    /// waits up to [`FINISH_LINGER`] for others and shares their script
    /// call. At the rate's pace no other call is on its way to gather
    /// them, and one record's call runs the counters and the ack alone
    /// (about 20 commands); any other outcome (a retry, a requeue, a
    /// release, a cancel or a drop, which loops may store one after
    /// another), or a worker the rate does not hold back, goes at once.
    pub fn paced(store: &RedisStore, job: &str, paced: Arc<Lately>) -> RedisQueue {
        let (s, j) = (store.clone(), job.to_owned());
        let finisher = GroupCommit::lingering(
            FINISH_BATCH,
            FINISH_LINGER,
            move |f: &Finishing| !f.ends_a_call() || !paced.within(PACED_FOR),
            move |items: Vec<Finishing>| {
                let (store, job) = (s.clone(), j.clone());
                async move { store.finish_many(&job, &items).await }
            },
        );
        RedisQueue {
            store: store.clone(),
            job: job.to_owned(),
            finisher,
        }
    }
}

impl JobQueue for RedisQueue {
    fn check<'a>(&'a self, d: &'a Delivery) -> Op<'a, (Option<RecordState>, bool)> {
        Box::pin(self.store.check_delivery(&self.job, d))
    }

    fn ack<'a>(&'a self, d: &'a Delivery) -> Op<'a, ()> {
        Box::pin(self.store.ack(&self.job, d))
    }

    fn finish<'a>(
        &'a self,
        d: &'a Delivery,
        how: &'a Finish,
        paid: Option<&'a PaidCall>,
        audit: bool,
    ) -> Op<'a, Finished> {
        Box::pin(async move {
            self.finisher
                .call(Finishing::new(d, how).paid(paid).audit(audit))
                .await
                .unwrap_or(Err(StoreError::ShuttingDown))
        })
    }

    fn halt<'a>(&'a self, reason: &'a str) -> Op<'a, ()> {
        Box::pin(self.store.halt(&self.job, reason))
    }

    fn halted(&self) -> Op<'_, Option<String>> {
        Box::pin(self.store.halted(&self.job))
    }

    fn resume_mark(&self) -> Op<'_, String> {
        Box::pin(self.store.resume_mark(&self.job))
    }

    fn halt_on_drift<'a>(&'a self, reason: &'a str, mark: &'a str) -> Op<'a, bool> {
        Box::pin(self.store.halt_on_drift(&self.job, reason, mark))
    }

    fn provider_failed<'a>(&'a self, call: &'a FailedCall<'a>, rules: &'a OutageRules) -> Op<'a, Noted> {
        Box::pin(self.store.outage_failed(&self.job, call, rules))
    }

    fn provider_answered(&self) -> Op<'_, Option<(u64, u64)>> {
        Box::pin(self.store.outage_answered(&self.job))
    }

    fn breaker_count<'a>(&'a self, signature: &'a str) -> Op<'a, u64> {
        Box::pin(self.store.breaker_count(&self.job, signature))
    }

    fn mark_proven(&self) -> Op<'_, ()> {
        Box::pin(self.store.mark_proven(&self.job))
    }

    fn remember_form<'a>(&'a self, endpoint: &'a str, form: &'a str) -> Op<'a, ()> {
        Box::pin(self.store.remember_form(endpoint, form))
    }

    fn budget_reserve<'a>(&'a self, lease_ms: u64, calls: &'a [(String, u64)]) -> Op<'a, Vec<Reserved>> {
        Box::pin(self.store.budget_reserve(&self.job, lease_ms, calls))
    }

    fn budget_settle<'a>(&'a self, calls: &'a [(String, u64, u64)]) -> Op<'a, ()> {
        Box::pin(self.store.budget_settle(&self.job, calls))
    }
}

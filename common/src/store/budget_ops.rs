//! A job's spend cap (`[budget] max_cost_usd`), shared by the fleet in
//! Redis: calls are reserved at their most before they are sent and settled
//! at their cost after (see `budget.lua`).

use redis::AsyncCommands;

use super::{RedisStore, StoreError};
use crate::keys;

/// A job's budget as Redis holds it, in USD.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct BudgetState {
    /// None: the job has no cap.
    pub cap_usd: Option<f64>,
    /// Settled calls, and reservations of workers that vanished mid-call.
    pub spent_usd: f64,
    /// Calls in flight, each at its most.
    pub reserved_usd: f64,
}

/// What a reservation against the job's cap came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reserved {
    Granted,
    /// Not now: the calls in flight may leave room when they settle.
    Wait,
    /// The call could pass the cap whatever the calls in flight cost: the
    /// job is halted with reason `budget`.
    Halted,
}

impl RedisStore {
    /// Reserves `calls` (`(id, nano-USD at most)`) against the job's cap,
    /// each for `lease_ms` (see `budget.lua`); a halt wakes the fleet.
    pub async fn budget_reserve(
        &self,
        job: &str,
        lease_ms: u64,
        calls: &[(String, u64)],
    ) -> Result<Vec<Reserved>, StoreError> {
        let mut inv = self.scripts.budget.prepare_invoke();
        inv.key(keys::budget(job))
            .key(keys::budget_held(job))
            .key(keys::halt(job))
            .arg("reserve")
            .arg(lease_ms);
        for (id, amount) in calls {
            inv.arg(id).arg(amount);
        }
        let granted: Vec<i64> = inv.invoke_async(&mut self.conn.clone()).await?;
        if granted.contains(&0) {
            self.wake(job, super::Wake::Flags).await;
        }
        Ok(granted
            .into_iter()
            .map(|g| match g {
                1 => Reserved::Granted,
                2 => Reserved::Wait,
                _ => Reserved::Halted,
            })
            .collect())
    }

    /// Settles reservations (`(id, reserved, actual)`, nano-USD); one never
    /// made is ignored (settling with 0 releases a reservation whose reply was lost).
    pub async fn budget_settle(&self, job: &str, calls: &[(String, u64, u64)]) -> Result<(), StoreError> {
        let mut inv = self.scripts.budget.prepare_invoke();
        inv.key(keys::budget(job))
            .key(keys::budget_held(job))
            .key(keys::halt(job))
            .arg("settle");
        for (id, reserved, actual) in calls {
            inv.arg(format!("{id}:{reserved}")).arg(actual);
        }
        let _: u64 = inv.invoke_async(&mut self.conn.clone()).await?;
        Ok(())
    }

    /// Sets the job's cap (`only_if_unset`: the enqueue of a spec with one,
    /// which never lowers a cap raised by `producer resume --budget`).
    pub async fn set_budget_cap(&self, job: &str, cap_usd: f64, only_if_unset: bool) -> Result<(), StoreError> {
        let cap = crate::ledger::nano_usd(cap_usd);
        let mut c = self.conn.clone();
        if only_if_unset {
            let _: bool = c.hset_nx(keys::budget(job), "cap", cap).await?;
        } else {
            let _: () = c.hset(keys::budget(job), "cap", cap).await?;
        }
        Ok(())
    }

    pub async fn budget(&self, job: &str) -> Result<BudgetState, StoreError> {
        let (cap, spent, reserved): (Option<u64>, Option<i64>, Option<i64>) = redis::cmd("HMGET")
            .arg(keys::budget(job))
            .arg("cap")
            .arg("spent")
            .arg("reserved")
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(BudgetState {
            cap_usd: cap.map(|c| c as f64 / 1e9),
            spent_usd: spent.unwrap_or(0).max(0) as f64 / 1e9,
            reserved_usd: reserved.unwrap_or(0).max(0) as f64 / 1e9,
        })
    }
}

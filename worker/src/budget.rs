//! Spend control in the worker (`[budget]`).
//!
//! The job's cap is shared in Redis (see `budget.lua`): before a call is
//! sent it is reserved at its most — every prompt byte a token (a token is
//! never shorter than a byte) plus a message's overhead, and `max_tokens`
//! of completion, at the spec's prices — so what the fleet spends stays
//! within the cap unless a call costs more than that (a provider billing
//! past `max_tokens`); after the call the reservation becomes its actual
//! cost. Reservations and settlements are batched (group commit). A call
//! that does not fit waits while the calls in flight may still leave room,
//! and halts the job with reason `budget` when they cannot.
//!
//! A record's own caps are checked before each call against what its
//! history already used plus the next call at its most (the same bound): a
//! record that could pass one goes to review as `budget` instead of another
//! paid call.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::batch::GroupCommit;
use common::ledger::nano_usd;
use common::spec::{JobSpec, Prices};
use common::store::{Reserved, StoreError};

use crate::queue::JobQueue;
use common::task::{HistoryItem, Task, Usage};

/// Reservations or settlements per script call.
const BATCH: usize = 128;
/// Tokens a chat message adds to its text (role, separators).
const MESSAGE_OVERHEAD: u64 = 16;

type Reserve = (String, u64);
type Settle = (String, u64, u64);

/// The job's share of its spend cap (only for a job with `max_cost_usd`).
pub struct JobBudget {
    reserver: GroupCommit<Reserve, Result<Reserved, StoreError>>,
    settler: GroupCommit<Settle, Result<(), StoreError>>,
    lease_ms: std::sync::Arc<AtomicU64>,
}

/// Why a call was not reserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// It could pass the cap whatever the calls in flight cost: the job is halted.
    Halted,
    /// The calls in flight still hold the room it needs (waited long enough).
    Busy,
}

/// A call reserved against the cap, at its most.
#[derive(Debug)]
pub struct Reservation {
    id: String,
    pub amount_nusd: u64,
}

impl JobBudget {
    pub fn new(queue: std::sync::Arc<dyn JobQueue>) -> JobBudget {
        let lease_ms = std::sync::Arc::new(AtomicU64::new(600_000));
        let (rq, rl) = (queue.clone(), lease_ms.clone());
        let reserver = GroupCommit::new(BATCH, move |calls: Vec<Reserve>| {
            let (queue, lease) = (rq.clone(), rl.load(Ordering::Relaxed));
            async move {
                match queue.budget_reserve(lease, &calls).await {
                    Ok(granted) => granted.into_iter().map(Ok).collect(),
                    Err(e) => calls.iter().map(|_| Err(e.clone())).collect(),
                }
            }
        });
        let settler = GroupCommit::new(BATCH, move |calls: Vec<Settle>| {
            let queue = queue.clone();
            async move {
                match queue.budget_settle(&calls).await {
                    Ok(()) => calls.iter().map(|_| Ok(())).collect(),
                    Err(e) => calls.iter().map(|_| Err(e.clone())).collect(),
                }
            }
        });
        JobBudget {
            reserver,
            settler,
            lease_ms,
        }
    }

    /// How long a reservation lives when its worker vanishes (then it is
    /// charged in full): as long as the task may run.
    pub fn set_lease(&self, lease: Duration) {
        self.lease_ms.store(lease.as_millis() as u64, Ordering::Relaxed);
    }

    /// Reserves a call of at most `amount_nusd`, waiting up to `patience`
    /// while calls in flight may leave room.
    pub async fn reserve(
        &self,
        amount_nusd: u64,
        patience: Duration,
    ) -> Result<Result<Reservation, Refused>, StoreError> {
        let started = tokio::time::Instant::now();
        let mut pause = Duration::from_millis(50);
        loop {
            let id = format!("{:016x}", rand::random::<u64>());
            match self.reserver.call((id.clone(), amount_nusd)).await {
                Some(Ok(Reserved::Granted)) => return Ok(Ok(Reservation { id, amount_nusd })),
                Some(Ok(Reserved::Halted)) => return Ok(Err(Refused::Halted)),
                Some(Ok(Reserved::Wait)) if started.elapsed() + pause < patience => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                Some(Ok(Reserved::Wait)) => return Ok(Err(Refused::Busy)),
                Some(Err(e)) => {
                    // It may have been reserved before the reply was lost: release it.
                    let _ = self.settler.call((id, amount_nusd, 0)).await;
                    return Err(e);
                }
                None => return Err(StoreError::ShuttingDown),
            }
        }
    }

    /// The call cost `actual_nusd`: its reservation is released.
    pub async fn settle(&self, r: Reservation, actual_nusd: u64) -> Result<(), StoreError> {
        self.settler
            .call((r.id, r.amount_nusd, actual_nusd))
            .await
            .unwrap_or(Err(StoreError::ShuttingDown))
    }
}

/// The most a call with these messages (and a `response_format` of
/// `format_bytes`, which providers count as input) can use: every byte a token, `max_tokens` of
/// completion, nothing cached.
pub fn at_most(spec: &JobSpec, messages: &[&str], format_bytes: u64) -> Usage {
    let prompt: u64 = messages.iter().map(|m| m.len() as u64 + MESSAGE_OVERHEAD).sum::<u64>() + format_bytes;
    let completion = u64::from(spec.provider.max_tokens);
    Usage {
        prompt,
        completion,
        total: prompt + completion,
        ..Usage::default()
    }
}

/// [`at_most`] in nano-USD at `prices` (the job's, or its checker's).
pub fn at_most_nusd(prices: &common::spec::Prices, most: &Usage) -> u64 {
    nano_usd(prices.cost(most.prompt, 0, most.completion))
}

/// Why the record's next call, at its most (`next`) and priced at
/// `next_prices` (the job's, or its checker's), could pass one of its own
/// caps (None: it cannot). Each earlier call counts at its own model's prices.
pub fn over_record_cap(spec: &JobSpec, task: &Task, next: &Usage, next_prices: &Prices) -> Option<String> {
    let b = &spec.budget;
    let checker_prices = spec.check.prices.as_ref().unwrap_or(&spec.prices);
    let used: Vec<(Usage, &Prices)> = task
        .history
        .iter()
        .filter_map(HistoryItem::as_attempt)
        .filter_map(|a| {
            let prices = if a.check.is_some() {
                checker_prices
            } else {
                &spec.prices
            };
            a.usage.map(|u| (u, prices))
        })
        .collect();
    if let Some(cap) = b.max_tokens_per_record {
        let spent: u64 = used.iter().map(|(u, _)| u.prompt + u.completion).sum();
        let next_tokens = next.prompt + next.completion;
        if spent + next_tokens > cap {
            return Some(format!(
                "the record used {spent} tokens; the next call could use {next_tokens} more, past budget.max_tokens_per_record = {cap}"
            ));
        }
    }
    if let Some(cap) = b.max_cost_per_record {
        let spent: f64 = used.iter().map(|(u, prices)| u.cost(prices)).sum();
        let next_cost = next.cost(next_prices);
        if spent + next_cost > cap {
            return Some(format!(
                "the record cost {spent:.6} USD; the next call could cost {next_cost:.6} more, past budget.max_cost_per_record = {cap}"
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(budget: &str) -> JobSpec {
        let text =
            include_str!("../../examples/job.toml").replace("[prices]", &format!("[budget]\n{budget}\n[prices]"));
        JobSpec::parse(&text, "t").unwrap()
    }

    fn task_with(usage: &[(u64, u64)]) -> Task {
        let history: Vec<serde_json::Value> = usage
            .iter()
            .enumerate()
            .map(|(i, (p, c))| {
                serde_json::json!({"attempt": i + 1, "call": i + 1, "outcome": "invalid_output",
                    "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}})
            })
            .collect();
        serde_json::from_value(serde_json::json!({"rid": "r", "input": {"text": "x"}, "history": history})).unwrap()
    }

    #[test]
    fn a_record_is_stopped_before_the_call_that_could_pass_its_caps() {
        let next = Usage::estimate(300, 200);
        let s = spec("max_tokens_per_record = 1000");
        assert_eq!(
            over_record_cap(&s, &task_with(&[(250, 40)]), &next, &s.prices),
            None,
            "290 + 500 fits"
        );
        let why = over_record_cap(&s, &task_with(&[(250, 40), (260, 40)]), &next, &s.prices).unwrap();
        assert!(why.contains("used 590 tokens") && why.contains("500 more"), "{why}");
        // Cost: 0.15 and 0.60 USD per million; the next call at most 300 in, 200 out = 0.000165.
        let s = spec("max_cost_per_record = 0.0002");
        assert_eq!(over_record_cap(&s, &task_with(&[]), &next, &s.prices), None);
        assert!(over_record_cap(&s, &task_with(&[(250, 40)]), &next, &s.prices).is_some());
        assert_eq!(
            over_record_cap(&spec(""), &task_with(&[(1_000_000, 1)]), &next, &spec("").prices),
            None,
            "no caps"
        );
    }

    #[test]
    fn a_checker_call_counts_at_the_checkers_prices() {
        // The checker costs 100 times the job's model: 15 and 60 USD per million.
        let s = spec(
            "max_cost_per_record = 0.002\n[check]\nmodel = \"big\"\nfields = [\"label\"]\n[check.prices]\ninput_per_mtok = 15.0\noutput_per_mtok = 60.0",
        );
        let next = Usage::estimate(300, 200);
        let checker = s.check.prices.clone().unwrap();
        // The first answer (250 in, 40 out at the job's prices) leaves room
        // for another call of the job's model, not for the checker's (0.0165).
        let first = task_with(&[(250, 40)]);
        assert_eq!(over_record_cap(&s, &first, &next, &s.prices), None);
        let why = over_record_cap(&s, &first, &next, &checker).unwrap();
        assert!(why.contains("0.016500 more"), "{why}");
        // A checker's earlier call is counted at its prices: 0.0027 over the cap.
        let mut checked = task_with(&[(100, 20)]);
        if let Some(HistoryItem::Attempt(a)) = checked.history.first_mut() {
            a.check =
                Some(serde_json::from_value(serde_json::json!({"model": "big", "fields": {}, "first": {}})).unwrap());
        }
        let why = over_record_cap(&s, &checked, &Usage::estimate(1, 1), &s.prices).unwrap();
        assert!(why.contains("cost 0.002700"), "{why}");
    }

    #[test]
    fn a_call_is_reserved_at_its_most() {
        let s = spec("max_cost_usd = 1.0");
        // 100 bytes and 16 of overhead, and the response format's bytes, in;
        // max_tokens (200) out: 0.15 and 0.60 USD per million tokens.
        let format = serde_json::json!({"type": "json_object"});
        let most = at_most(&s, &["x".repeat(100).as_str()], format.to_string().len() as u64);
        assert_eq!((most.prompt, most.completion), (116 + 22, 200));
        assert_eq!(at_most_nusd(&s.prices, &most), (138 * 150 + 200 * 600) as u64);
        // Non-ASCII text counts its bytes, not its characters.
        let text = "verspätet 🙂";
        assert_eq!(at_most(&s, &[text], 0).prompt, 15 + 16);
    }
}

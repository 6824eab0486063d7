//! The cost ledger: every paid call, recorded once and never removed.
//!
//! A call that may be billed (the provider reported usage; or it timed out,
//! or answered without usage, and the server may have billed it anyway:
//! estimated) becomes one [`PaidCall`] entry in its partition's ledger hash,
//! under a key unique to the call ([`PaidCall::key`]), written once (only
//! when new to the ledger) by the same atomic script as the record's outcome, together with
//! counters that only grow (the partition's spend hash: calls, tokens and
//! nano-USD, in total and by bucket) — only when the entry is new, so a call
//! whose store call is retried, or recorded again as lost, counts once. A
//! call that left no outcome (cut off at a worker's drain timeout, or whose
//! outcome Redis could not store in time) is recorded on its own. Reviewing,
//! requeueing or accepting a record never changes what was spent: the report
//! reads the counters, not the records' histories. (A worker killed mid-call
//! leaves no entry: its budget reservation is charged when it expires.)

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::route::Tier;
use crate::spec::Prices;
use crate::task::{HistoryItem, Task, Usage};

/// Why a call was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// The record's first call.
    First,
    /// After a failure that was not the record's (a timeout, a 5xx, a 429).
    TransientRetry,
    /// After an answer that failed validation.
    ValidationRetry,
    /// In a round a person started (a review requeue, `retry --from`).
    Human,
    /// The checker's, cross-checking a valid answer (`[check]`).
    Check,
}

impl Cause {
    /// Why the next call of `task` is made, from what its history says: a
    /// person acted on the record (requeue, retry) before; it carries
    /// validation feedback; it was called before; or none of these.
    pub fn of(task: &Task) -> Cause {
        if task.base > 0 || task.history.iter().any(|h| matches!(h, HistoryItem::Action(_))) {
            return Cause::Human;
        }
        if !task.feedback.is_empty() {
            return Cause::ValidationRetry;
        }
        match task.history.iter().rev().find_map(HistoryItem::as_attempt) {
            None => Cause::First,
            Some(a) if a.outcome.starts_with("invalid") || a.outcome == "truncated" => Cause::ValidationRetry,
            Some(_) => Cause::TransientRetry,
        }
    }

    pub fn from_name(name: &str) -> Option<Cause> {
        [
            Cause::First,
            Cause::TransientRetry,
            Cause::ValidationRetry,
            Cause::Human,
            Cause::Check,
        ]
        .into_iter()
        .find(|c| c.name() == name)
    }

    pub fn name(self) -> &'static str {
        match self {
            Cause::First => "first",
            Cause::TransientRetry => "transient_retry",
            Cause::ValidationRetry => "validation_retry",
            Cause::Human => "human",
            Cause::Check => "check",
        }
    }
}

/// What a paid call came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fate {
    /// Its outcome was stored with it (an answer, or a timeout: estimated).
    Settled,
    /// Cut off at a worker's drain timeout before its answer came (estimated).
    Abandoned,
    /// Answered, but its outcome could not be stored before the visibility
    /// timeout (Redis was away): the answer is lost, the money is not.
    Lost,
    /// A second answer to the same request in a provider batch's output
    /// (batch mode): billed by the provider, not used.
    Duplicate,
}

impl Fate {
    pub fn name(self) -> &'static str {
        match self {
            Fate::Settled => "settled",
            Fate::Abandoned => "abandoned",
            Fate::Lost => "lost",
            Fate::Duplicate => "duplicate",
        }
    }

    pub fn from_name(name: &str) -> Option<Fate> {
        [Fate::Settled, Fate::Abandoned, Fate::Lost, Fate::Duplicate]
            .into_iter()
            .find(|f| f.name() == name)
    }
}

/// One paid call, as the ledger keeps it.
#[derive(Debug, Clone, PartialEq)]
pub struct PaidCall {
    pub rid: String,
    /// Drawn once per call: the call's key tells it from any other.
    pub nonce: String,
    /// The record's attempts so far, this one included.
    pub attempt: u32,
    /// The record's calls so far, this one included.
    pub call: u32,
    /// The delivery's count (which delivery of the task made the call).
    pub delivery: u32,
    pub worker: String,
    pub cause: Cause,
    pub fate: Fate,
    /// As reported, or estimated (`estimated`) when the call timed out or was cut off.
    pub usage: Usage,
    /// The prices it was costed at ([`price_version`]).
    pub prices: String,
    pub cost_nusd: u64,
    /// Unix ms.
    pub at_ms: u64,
    /// A call through the provider's Batch API: what it would have cost
    /// online, in nano-USD (counted with the spend, for the saving; not
    /// kept in the entry).
    pub online_nusd: Option<u64>,
    /// The route it took: `standard`, `flex` (`provider.tiers`) or `batch`
    /// (through the Batch API).
    pub tier: String,
    /// The model it was sent to.
    pub model: String,
}

/// Where a call's spend is counted: its cause, or `no_result`.
pub const NO_RESULT: &str = "no_result";

impl PaidCall {
    /// Costs `usage` at `prices` (the standard tier's; see [`PaidCall::on_tier`]).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        task: &Task,
        attempt: u32,
        call: u32,
        delivery: u32,
        worker: &str,
        usage: Usage,
        prices: &Prices,
        at_ms: u64,
    ) -> PaidCall {
        PaidCall {
            rid: task.rid.clone(),
            nonce: format!("{:012x}", rand::random::<u64>() >> 16),
            attempt,
            call,
            delivery,
            worker: worker.to_owned(),
            cause: Cause::of(task),
            fate: Fate::Settled,
            usage,
            prices: price_version(prices),
            cost_nusd: nano_usd(usage.cost(prices)),
            at_ms,
            online_nusd: None,
            tier: Tier::Standard.name().to_owned(),
            model: String::new(),
        }
    }

    /// The model the call was sent to.
    pub fn to_model(mut self, model: &str) -> PaidCall {
        self.model = model.to_owned();
        self
    }

    /// The same call on `tier`: costed at its prices, what it would have
    /// cost at `standard` prices kept for the comparison.
    pub fn on_tier(self, tier: Tier, standard: &Prices) -> PaidCall {
        match tier {
            Tier::Standard => self,
            _ => self.on_route(tier.name(), &standard.of_tier(tier), standard),
        }
    }

    /// The same call on a route other than the job's standard one (`flex`,
    /// or a fallback's name): costed at `prices`, what it would have cost at
    /// the job's `standard` prices kept for the comparison.
    pub fn on_route(mut self, route: &str, prices: &Prices, standard: &Prices) -> PaidCall {
        self.online_nusd = Some(nano_usd(self.usage.cost(standard)));
        self.cost_nusd = nano_usd(self.usage.cost(prices));
        self.prices = price_version(prices);
        self.tier = route.to_owned();
        self
    }

    /// The same call made through the provider's Batch API: costed at
    /// `batch` prices (the online cost kept for the saving), under a key
    /// drawn from `line` (the batch and the output line that answered it),
    /// so settling the same line again records nothing new.
    pub fn batched(mut self, batch: &Prices, online: &Prices, line: &str) -> PaidCall {
        use sha2::Digest;
        self.online_nusd = Some(nano_usd(self.usage.cost(online)));
        self.cost_nusd = nano_usd(self.usage.cost(batch));
        self.prices = price_version(batch);
        self.tier = "batch".to_owned();
        let mut nonce = hex::encode(sha2::Sha256::digest(line.as_bytes()));
        nonce.truncate(12);
        self.nonce = nonce;
        self
    }

    /// The call's key in the ledger hash: record id, call number, nonce.
    pub fn key(&self) -> String {
        format!("{}:{}:{}", self.rid, self.call, self.nonce)
    }

    /// The ledger's value (the key holds the record id, call and nonce):
    /// `[attempt, delivery, worker, cause, fate, prompt, cached, completion,
    /// estimated, prices, nano-USD, at_ms, tier, model]`; a call on the
    /// standard route keeps the first 12 (the job's model: what every
    /// version reads).
    pub fn encode(&self) -> String {
        let u = &self.usage;
        let mut v = serde_json::json!([
            self.attempt,
            self.delivery,
            self.worker,
            self.cause.name(),
            self.fate.name(),
            u.prompt,
            u.cached,
            u.completion,
            u8::from(u.estimated),
            self.prices,
            self.cost_nusd,
            self.at_ms
        ]);
        if self.tier != Tier::Standard.name()
            && let Some(v) = v.as_array_mut()
        {
            v.extend([serde_json::json!(self.tier), serde_json::json!(self.model)]);
        }
        v.to_string()
    }

    pub fn decode(key: &str, value: &str) -> Result<PaidCall, String> {
        let bad = |what: &str| format!("ledger entry {key}: {what}");
        let mut parts = key.rsplitn(3, ':');
        let (nonce, call, rid) = (parts.next(), parts.next(), parts.next());
        let (Some(nonce), Some(call), Some(rid)) = (nonce, call.and_then(|c| c.parse().ok()), rid) else {
            return Err(bad("key is not record:call:nonce"));
        };
        let v: Vec<serde_json::Value> = serde_json::from_str(value).map_err(|e| bad(&e.to_string()))?;
        if v.len() != 12 && v.len() != 14 {
            return Err(bad("not 12 or 14 values"));
        }
        let n = |i: usize| v[i].as_u64().ok_or_else(|| bad(&format!("value {i} is not a number")));
        let t = |i: usize| v[i].as_str().ok_or_else(|| bad(&format!("value {i} is not text")));
        let (prompt, cached, completion) = (n(5)?, n(6)?, n(7)?);
        Ok(PaidCall {
            rid: rid.to_owned(),
            nonce: nonce.to_owned(),
            attempt: n(0)? as u32,
            call,
            delivery: n(1)? as u32,
            worker: t(2)?.to_owned(),
            cause: Cause::from_name(t(3)?).ok_or_else(|| bad("unknown cause"))?,
            fate: Fate::from_name(t(4)?).ok_or_else(|| bad("unknown fate"))?,
            usage: Usage {
                prompt,
                cached,
                completion,
                total: prompt + completion,
                estimated: n(8)? == 1,
                ..Usage::default()
            },
            prices: t(9)?.to_owned(),
            cost_nusd: n(10)?,
            at_ms: n(11)?,
            online_nusd: None,
            tier: if v.len() == 14 { t(12)? } else { Tier::Standard.name() }.to_owned(),
            model: if v.len() == 14 { t(13)? } else { "" }.to_owned(),
        })
    }

    /// The call as one JSON line: of `producer export --what ledger`, and of
    /// the files sink's ledger segments ([`PaidCall::from_line`] reads it back).
    pub fn line(&self) -> String {
        serde_json::json!({
            "call_key": self.key(),
            "record_id": self.rid,
            "attempt": self.attempt,
            "call": self.call,
            "delivery": self.delivery,
            "worker": self.worker,
            "cause": self.cause.name(),
            "fate": self.fate.name(),
            "usage": self.usage,
            "prices": self.prices,
            "cost_usd": self.cost_nusd as f64 / 1e9,
            "cost_nusd": self.cost_nusd,
            "at_ms": self.at_ms,
            "tier": self.tier,
            "model": self.model,
        })
        .to_string()
    }

    /// A line [`PaidCall::line`] wrote.
    pub fn from_line(line: &str) -> Result<PaidCall, String> {
        #[derive(Deserialize)]
        struct Line {
            call_key: String,
            attempt: u32,
            delivery: u32,
            worker: String,
            cause: String,
            fate: String,
            usage: Usage,
            prices: String,
            cost_nusd: u64,
            at_ms: u64,
            #[serde(default = "standard")]
            tier: String,
            #[serde(default)]
            model: String,
        }
        fn standard() -> String {
            Tier::Standard.name().to_owned()
        }
        let l: Line = serde_json::from_str(line).map_err(|e| format!("ledger line: {e}"))?;
        let u = &l.usage;
        let encoded = serde_json::json!([
            l.attempt,
            l.delivery,
            l.worker,
            l.cause,
            l.fate,
            u.prompt,
            u.cached,
            u.completion,
            u8::from(u.estimated),
            l.prices,
            l.cost_nusd,
            l.at_ms,
            l.tier,
            l.model
        ]);
        PaidCall::decode(&l.call_key, &encoded.to_string())
    }

    /// The spend bucket: the cause, or [`NO_RESULT`] for a call that left none.
    pub fn bucket(&self) -> &'static str {
        match self.fate {
            Fate::Settled => self.cause.name(),
            Fate::Abandoned | Fate::Lost | Fate::Duplicate => NO_RESULT,
        }
    }

    /// What the scripts add to the spend counters, as they parse it:
    /// `bucket prompt cached completion nano-USD estimated`, and for a call
    /// not at standard prices its tier (`flex`, `batch`) and what it would
    /// have cost at them (nano-USD).
    pub fn spend_args(&self) -> String {
        let mut args = format!(
            "{} {} {} {} {} {}",
            self.bucket(),
            self.usage.prompt,
            self.usage.cached.min(self.usage.prompt),
            self.usage.completion,
            self.cost_nusd,
            u8::from(self.usage.estimated)
        );
        if let Some(online) = self.online_nusd {
            args.push_str(&format!(" {} {online}", self.tier));
        }
        args
    }
}

/// USD as whole nano-dollars (the counters are integers: they only grow, exactly).
pub fn nano_usd(usd: f64) -> u64 {
    (usd.max(0.0) * 1e9).round() as u64
}

/// A short name of a price list: calls costed at other prices are told apart.
pub fn price_version(p: &Prices) -> String {
    use sha2::Digest;
    let text = format!(
        "{}:{}:{}",
        p.input_per_mtok,
        p.cached_input_per_mtok.unwrap_or(p.input_per_mtok),
        p.output_per_mtok
    );
    hex::encode(&sha2::Sha256::digest(text.as_bytes())[..6])
}

/// Calls, tokens and cost of one part of a job's spend.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SpendPart {
    pub calls: u64,
    pub cost_usd: f64,
}

/// Calls, tokens and cost: of a job (its counters), or of a set of
/// records (their histories, in `producer report`).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Totals {
    pub calls: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
    pub cost_usd: f64,
    /// Of which estimated (timed out, cut off, answered without usage): the
    /// server may have billed them. Included above, and shown here.
    pub estimated_calls: u64,
    pub estimated_tokens: u64,
    pub estimated_cost_usd: f64,
}

impl Totals {
    /// One call, with its usage when there is one.
    pub fn add_call(&mut self, usage: Option<&Usage>, prices: &Prices) {
        self.calls += 1;
        if let Some(u) = usage {
            let cost = u.cost(prices);
            self.prompt_tokens += u.prompt;
            self.cached_tokens += u.cached;
            self.completion_tokens += u.completion;
            self.cost_usd += cost;
            if u.estimated {
                self.estimated_calls += 1;
                self.estimated_tokens += u.prompt + u.completion;
                self.estimated_cost_usd += cost;
            }
        }
    }

    pub fn merge(&mut self, o: &Totals) {
        self.calls += o.calls;
        self.prompt_tokens += o.prompt_tokens;
        self.cached_tokens += o.cached_tokens;
        self.completion_tokens += o.completion_tokens;
        self.cost_usd += o.cost_usd;
        self.estimated_calls += o.estimated_calls;
        self.estimated_tokens += o.estimated_tokens;
        self.estimated_cost_usd += o.estimated_cost_usd;
    }
}

/// A job's spend, from its counters (summed over the partitions).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Spend {
    #[serde(flatten)]
    pub totals: Totals,
    /// By cause (`first`, `transient_retry`, `validation_retry`, `human`) and
    /// `no_result` (cut off at shutdown, or the outcome lost).
    pub by_bucket: BTreeMap<String, SpendPart>,
    /// Calls made through the provider's Batch API (batch mode), included
    /// above: what they cost, and what they would have cost online.
    #[serde(skip_serializing_if = "BatchSpend::is_empty")]
    pub batch: BatchSpend,
    /// The calls on a tier but standard (`flex`; `provider.tiers`): calls,
    /// cost, and what they would have cost at standard prices (see
    /// [`Spend::routes`] for every route, batch and standard included).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub by_tier: BTreeMap<String, TierSpend>,
}

/// The calls of one route.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TierSpend {
    pub calls: u64,
    pub cost_usd: f64,
    /// The same calls at standard prices.
    pub standard_cost_usd: f64,
}

/// The part of a job's spend made through the Batch API.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct BatchSpend {
    pub calls: u64,
    pub cost_usd: f64,
    /// The same calls at online prices.
    pub online_cost_usd: f64,
}

impl BatchSpend {
    pub fn is_empty(&self) -> bool {
        self.calls == 0
    }

    /// What batch prices saved against online ones, in USD.
    pub fn saving_usd(&self) -> f64 {
        (self.online_cost_usd - self.cost_usd).max(0.0)
    }
}

impl Spend {
    /// Every route's calls: `standard`, and `flex` and `batch` when any
    /// call took them.
    pub fn routes(&self) -> BTreeMap<String, TierSpend> {
        let mut routes = self.by_tier.clone();
        if !self.batch.is_empty() {
            routes.insert(
                "batch".to_owned(),
                TierSpend {
                    calls: self.batch.calls,
                    cost_usd: self.batch.cost_usd,
                    standard_cost_usd: self.batch.online_cost_usd,
                },
            );
        }
        let (calls, cost) = routes
            .values()
            .fold((0, 0.0), |(n, c), t| (n + t.calls, c + t.cost_usd));
        let standard_cost = (self.totals.cost_usd - cost).max(0.0);
        routes.insert(
            "standard".to_owned(),
            TierSpend {
                calls: self.totals.calls.saturating_sub(calls),
                cost_usd: standard_cost,
                standard_cost_usd: standard_cost,
            },
        );
        routes
    }

    /// What every call would have cost at standard prices.
    pub fn standard_cost_usd(&self) -> f64 {
        self.routes().values().map(|t| t.standard_cost_usd).sum()
    }

    /// Adds one partition's spend hash (`field -> integer`).
    pub fn add_counters(&mut self, fields: &BTreeMap<String, u64>) {
        let get = |k: &str| fields.get(k).copied().unwrap_or(0);
        self.totals.merge(&Totals {
            calls: get("calls"),
            prompt_tokens: get("prompt"),
            cached_tokens: get("cached"),
            completion_tokens: get("completion"),
            cost_usd: get("nusd") as f64 / 1e9,
            estimated_calls: get("est_calls"),
            estimated_tokens: get("est_tokens"),
            estimated_cost_usd: get("est_nusd") as f64 / 1e9,
        });
        self.batch.calls += get("batch_calls");
        self.batch.cost_usd += get("batch_nusd") as f64 / 1e9;
        self.batch.online_cost_usd += get("batch_online_nusd") as f64 / 1e9;
        for (k, v) in fields {
            if let Some((what, tier)) = k.split_once('@') {
                let part = self.by_tier.entry(tier.to_owned()).or_default();
                match what {
                    "calls" => part.calls += v,
                    "nusd" => part.cost_usd += *v as f64 / 1e9,
                    "std" => part.standard_cost_usd += *v as f64 / 1e9,
                    _ => {}
                }
            } else if let Some(bucket) = k.strip_prefix("calls:") {
                self.by_bucket.entry(bucket.to_owned()).or_default().calls += v;
            } else if let Some(bucket) = k.strip_prefix("nusd:") {
                self.by_bucket.entry(bucket.to_owned()).or_default().cost_usd += *v as f64 / 1e9;
            }
        }
    }

    /// The part of one bucket (zero when it has none).
    pub fn bucket(&self, name: &str) -> SpendPart {
        self.by_bucket.get(name).cloned().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::Attempt;

    fn task() -> Task {
        serde_json::from_value(serde_json::json!({"rid": "r", "input": {"text": "hi"}})).unwrap()
    }

    fn attempt(outcome: &str) -> HistoryItem {
        let a: Attempt =
            serde_json::from_value(serde_json::json!({"attempt": 1, "call": 1, "outcome": outcome})).unwrap();
        HistoryItem::Attempt(a)
    }

    #[test]
    fn a_call_is_told_by_why_it_was_made() {
        let mut t = task();
        assert_eq!(Cause::of(&t), Cause::First);
        t.history.push(attempt("server_error"));
        assert_eq!(Cause::of(&t), Cause::TransientRetry);
        t.history.push(attempt("invalid_output"));
        assert_eq!(Cause::of(&t), Cause::ValidationRetry);
        t.base = 2;
        assert_eq!(Cause::of(&t), Cause::Human, "a round a person started");
    }

    #[test]
    fn a_call_off_the_standard_route_keeps_its_route_model_and_standard_cost() {
        let p = Prices {
            input_per_mtok: 1.0,
            output_per_mtok: 4.0,
            ..Prices::default()
        };
        let u = Usage {
            prompt: 1000,
            completion: 500,
            total: 1500,
            ..Usage::default()
        };
        let flex = PaidCall::new(&task(), 1, 1, 1, "w", u, &p, 0)
            .on_tier(Tier::Flex, &p)
            .to_model("gpt-4o-mini");
        assert_eq!(
            (flex.cost_nusd, flex.online_nusd),
            (1_500_000, Some(3_000_000)),
            "flex: half"
        );
        assert_eq!(flex.spend_args(), "first 1000 0 500 1500000 0 flex 3000000");
        assert_eq!(PaidCall::decode(&flex.key(), &flex.encode()).unwrap().tier, "flex");
        let line = PaidCall::from_line(&flex.line()).unwrap();
        assert_eq!((line.tier.as_str(), line.model.as_str()), ("flex", "gpt-4o-mini"));
        let standard = PaidCall::new(&task(), 1, 1, 1, "w", u, &p, 0).on_tier(Tier::Standard, &p);
        assert_eq!(
            standard.spend_args(),
            "first 1000 0 500 3000000 0",
            "the standard route adds nothing"
        );
        let standard = standard.to_model("gpt-4o-mini");
        assert_eq!(
            serde_json::from_str::<Vec<serde_json::Value>>(&standard.encode())
                .unwrap()
                .len(),
            12,
            "as every version writes it: the job's model"
        );
        let dear = Prices {
            input_per_mtok: 3.0,
            output_per_mtok: 12.0,
            ..Prices::default()
        };
        let backup = PaidCall::new(&task(), 1, 1, 1, "w", u, &p, 0).on_route("backup-2", &dear, &p);
        assert_eq!(backup.spend_args(), "first 1000 0 500 9000000 0 backup-2 3000000");
        // An entry of a version before routes: standard, model unknown.
        let old = r#"[1,1,"w","first","settled",1000,0,500,0,"abc",3000000,0]"#;
        let decoded = PaidCall::decode("r:1:n", old).unwrap();
        assert_eq!((decoded.tier.as_str(), decoded.model.as_str()), ("standard", ""));
        // The counters the scripts keep, read back per route.
        let mut s = Spend::default();
        s.add_counters(&BTreeMap::from([
            ("calls".into(), 3),
            ("nusd".into(), 3_000_000 + 1_500_000 + 9_000_000),
            ("calls@flex".into(), 1),
            ("nusd@flex".into(), 1_500_000),
            ("std@flex".into(), 3_000_000),
            ("calls@backup-2".into(), 1),
            ("nusd@backup-2".into(), 9_000_000),
            ("std@backup-2".into(), 3_000_000),
        ]));
        let routes = s.routes();
        assert_eq!(routes["standard"].calls, 1);
        assert!((routes["standard"].cost_usd - 0.003).abs() < 1e-12);
        assert_eq!(routes["flex"].calls, 1);
        assert!(
            (s.standard_cost_usd() - 0.009).abs() < 1e-12,
            "{}",
            s.standard_cost_usd()
        );
    }

    #[test]
    fn costs_are_whole_nano_dollars_and_prices_have_a_version() {
        let p = Prices {
            input_per_mtok: 0.15,
            cached_input_per_mtok: Some(0.075),
            output_per_mtok: 0.6,
            ..Prices::default()
        };
        let u = Usage {
            prompt: 1000,
            cached: 400,
            completion: 100,
            total: 1100,
            ..Usage::default()
        };
        let call = PaidCall::new(&task(), 1, 1, 1, "w", u, &p, 0);
        assert_eq!(call.cost_nusd, 90_000 + 30_000 + 60_000);
        assert_eq!(call.spend_args(), "first 1000 400 100 180000 0");
        assert_eq!(PaidCall::decode(&call.key(), &call.encode()).unwrap(), call);
        assert_eq!(PaidCall::from_line(&call.line()).unwrap(), call, "{}", call.line());
        assert!(call.encode().len() < 100, "{}", call.encode());
        let again = PaidCall::new(&task(), 1, 1, 1, "w", u, &p, 0);
        assert_ne!(again.key(), call.key(), "two calls never share a key");
        let other = Prices {
            output_per_mtok: 0.5,
            ..p
        };
        assert_ne!(price_version(&p), price_version(&other));
        let mut s = Spend::default();
        s.add_counters(&BTreeMap::from([
            ("calls".into(), 3),
            ("nusd".into(), 1_500_000_000),
            ("calls:first".into(), 2),
            ("nusd:first".into(), 1_000_000_000),
        ]));
        assert_eq!(s.totals.calls, 3);
        assert!((s.totals.cost_usd - 1.5).abs() < 1e-12);
        assert_eq!(s.bucket("first").calls, 2);
        assert_eq!(s.bucket("human"), SpendPart::default());
    }
}

//! The store's rate-limit verbs: fleet-wide grants and their settlement.

use super::{RedisStore, StoreError};
use crate::keys;

/// Per-minute limits and what one grant takes; 0 means "no limit".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitParams {
    pub requests: u64,
    pub tokens: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub max_concurrent: u64,
    /// Reserved per grant: total, input and output tokens.
    pub need_tokens: u64,
    pub need_input: u64,
    pub need_output: u64,
    pub burst_ms: u64,
    pub lease_ms: u64,
    /// How far ahead of the buckets a grant may be given (see `limit_acquire.lua`).
    pub ahead_ms: u64,
    /// How long a free pass may last, when nothing limits the key (0: none wanted).
    pub pass_ms: u64,
}

/// What a worker's free passes did since it last told the buckets: the
/// grants it took (the fleet's sending rate counts them), and those in
/// flight now (None: none, and none since it last told).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FreeReport {
    pub taken: u64,
    pub in_flight: Option<u64>,
}

/// A limiter's word on its free passes, told with its settlements: its
/// grant id prefix, the report, and how long the count in flight holds
/// (the slot lease).
#[derive(Debug, Clone, Copy, Default)]
pub struct FreeWord<'a> {
    pub prefix: &'a str,
    pub report: FreeReport,
    pub lease_ms: u64,
}

/// What one acquire gave: grant ids with how long each waits before its
/// call (ms), and, when fewer than asked, when to ask again and what held
/// the rest back.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Acquired {
    pub grants: Vec<(String, u64)>,
    pub wait_ms: u64,
    pub bound: Bound,
    /// Nothing limits the key: no grant was counted, and the worker takes
    /// its own for this long, with this sequence number.
    pub pass: Option<(u64, u64)>,
}

/// What held back the grants not given.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Bound {
    /// Nothing: every grant asked for was given.
    #[default]
    None,
    /// The rate buckets or a pause: nothing more before `wait_ms`.
    Rate,
    /// The concurrency slots: a settlement that frees one wakes the waiting workers.
    Concurrency,
}

/// What settling a grant tells the shared budget.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Settlement {
    /// Reserved minus used (negative when the estimate was low).
    pub tokens_back: i64,
    pub input_back: i64,
    pub output_back: i64,
    /// Limits and remaining budget from the provider's headers, when sent.
    pub header_limit_requests: Option<u64>,
    pub header_limit_tokens: Option<u64>,
    pub header_remaining_requests: Option<u64>,
    pub header_remaining_tokens: Option<u64>,
    /// When the headers' figures were seen (the headers' arrival): a
    /// settlement that waited for others tells the script how old they are,
    /// which takes them as of that moment.
    pub seen: Option<std::time::Instant>,
    /// Pause the whole fleet this long (a 429, or an exhausted budget).
    pub pause_ms: u64,
    /// What the call did, for the adaptive limits.
    pub call: CallKind,
    /// After a timeout: how much longer the concurrency slot stays taken.
    pub hold_ms: u64,
    /// The spec's ceilings (0 = none): a learned limit never grows past
    /// them, and a `remaining` figure is set in the levels at the rate the
    /// acquire applies (they are part of it).
    pub ceiling_requests: u64,
    pub ceiling_concurrent: u64,
    pub ceiling_tokens: u64,
}

/// What a settled grant's call did, as the adaptive limits see it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CallKind {
    /// Answered: a learned limit that holds the fleet back grows a little.
    Answered,
    /// Refused with 429 and told when to come back (`retry-after` and its
    /// kin): under a limit the fleet knows, about that request (the fleet
    /// goes on at 0.95 of its pace); a storm of them, or one with no known
    /// limit, pauses the fleet that long (see `limit_settle.lua`).
    RateLimitedWithHint,
    /// Refused with a bare 429: the learned limits are cut (once per event,
    /// from the second such 429 within 10 s: a lone one is noise).
    RateLimited,
    /// No answer in time: the server may still be generating it.
    TimedOut,
    /// Anything else (not called, an error unrelated to load).
    #[default]
    Other,
}

impl CallKind {
    fn name(self) -> &'static str {
        match self {
            CallKind::Answered => "ok",
            CallKind::RateLimitedWithHint => "hinted",
            CallKind::RateLimited => "limited",
            CallKind::TimedOut => "timeout",
            CallKind::Other => "other",
        }
    }
}

impl RedisStore {
    /// Takes up to `want` grants, each given with how long it waits before
    /// its call (at most `p.ahead_ms`), and, when fewer were granted, when to
    /// ask again and why.
    pub async fn limit_acquire(
        &self,
        limiter: &str,
        p: &LimitParams,
        want: usize,
        id_prefix: &str,
        free: FreeReport,
    ) -> Result<Acquired, StoreError> {
        let reply: Vec<redis::Value> = self
            .scripts
            .limit_acquire
            .key(keys::limit_buckets(limiter))
            .key(keys::limit_inflight(limiter))
            .key(keys::limit_free(limiter))
            .arg(p.requests)
            .arg(p.tokens)
            .arg(p.input_tokens)
            .arg(p.output_tokens)
            .arg(p.max_concurrent)
            .arg(p.need_tokens)
            .arg(p.need_input)
            .arg(p.need_output)
            .arg(want.max(1))
            .arg(p.burst_ms)
            .arg(p.lease_ms)
            .arg(id_prefix)
            .arg(p.ahead_ms)
            .arg(p.pass_ms)
            .arg(free.taken)
            .arg(free.in_flight.map_or(-1, |n| n as i64))
            .invoke_async(&mut self.conn.clone())
            .await?;
        let int = |v: &redis::Value| match v {
            redis::Value::Int(n) => (*n).max(0) as u64,
            _ => 0,
        };
        let head: Vec<u64> = reply.iter().take(5).map(int).collect();
        // A free pass: {0, 0, 3, pass_ms, seq}.
        if let [_, _, 3, ms, seq] = head[..] {
            return Ok(Acquired {
                pass: Some((ms, seq)),
                ..Acquired::default()
            });
        }
        let granted = head.first().copied().unwrap_or(0) as usize;
        let ids = reply.iter().skip(3).take(granted).filter_map(|v| match v {
            redis::Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
            _ => None,
        });
        let delays = reply.iter().skip(3 + granted).map(int);
        Ok(Acquired {
            grants: ids.zip(delays.chain(std::iter::repeat(0))).collect(),
            wait_ms: head.get(1).copied().unwrap_or(0),
            bound: match head.get(2) {
                Some(1) => Bound::Rate,
                Some(2) => Bound::Concurrency,
                _ => Bound::None,
            },
            pass: None,
        })
    }

    /// Settles one grant. Returns false when it had already expired.
    pub async fn limit_settle(&self, limiter: &str, grant_id: &str, s: &Settlement) -> Result<bool, StoreError> {
        let held = self.limit_settle_many(limiter, &[(grant_id.to_owned(), *s)]).await?;
        Ok(held.first().copied().unwrap_or(false))
    }

    /// Settles grants in one script call, each exactly as
    /// [`RedisStore::limit_settle`] would alone, in the order given; for
    /// each, whether it was still held.
    pub async fn limit_settle_many(
        &self,
        limiter: &str,
        grants: &[(String, Settlement)],
    ) -> Result<Vec<bool>, StoreError> {
        self.limit_settle_told(limiter, grants, FreeWord::default()).await
    }

    /// [`RedisStore::limit_settle_many`], told first what the settling
    /// limiter's free passes took and hold in flight (`word`): a 429 on a
    /// free grant may cut the learned limits at once, from what they sent.
    pub async fn limit_settle_told(
        &self,
        limiter: &str,
        grants: &[(String, Settlement)],
        word: FreeWord<'_>,
    ) -> Result<Vec<bool>, StoreError> {
        let opt = |v: Option<u64>| v.map_or(-1, |n| n as i64);
        let mut inv = self.scripts.limit_settle.prepare_invoke();
        inv.key(keys::limit_buckets(limiter))
            .key(keys::limit_inflight(limiter))
            .key(keys::limit_free(limiter))
            .arg(word.prefix)
            .arg(word.report.taken)
            .arg(opt(word.report.in_flight))
            .arg(word.lease_ms);
        for (grant_id, s) in grants {
            inv.arg(grant_id)
                .arg(s.tokens_back)
                .arg(s.input_back)
                .arg(s.output_back)
                .arg(opt(s.header_limit_requests))
                .arg(opt(s.header_limit_tokens))
                .arg(opt(s.header_remaining_requests))
                .arg(opt(s.header_remaining_tokens))
                .arg(s.pause_ms)
                .arg(s.call.name())
                .arg(s.hold_ms)
                .arg(s.ceiling_requests)
                .arg(s.ceiling_concurrent)
                .arg(s.seen.map_or(0, |t| t.elapsed().as_millis() as u64))
                .arg(s.ceiling_tokens);
        }
        let mut held: Vec<i64> = inv.invoke_async(&mut self.conn.clone()).await?;
        if held.len() != grants.len() + 1 {
            return Err(StoreError::Corrupt {
                key: keys::limit_buckets(limiter),
                reason: format!("limit_settle.lua answered {} of {} grants", held.len(), grants.len()),
            });
        }
        // Someone waited for a slot and one came free: wake the fleet.
        if held.pop() == Some(1) {
            self.wake(limiter, super::Wake::Slot).await;
        }
        Ok(held.into_iter().map(|h| h == 1).collect())
    }

    /// Current levels of a limiter's buckets (`r`, `t`, `i`, `o`) and the
    /// limits it learned from 429s (`learned_requests_per_minute`,
    /// `learned_concurrency`), those it has.
    pub async fn limit_levels(&self, limiter: &str) -> Result<std::collections::BTreeMap<String, f64>, StoreError> {
        let fields: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(keys::limit_buckets(limiter))
            .arg(&["r", "t", "i", "o", "ar", "ac"])
            .query_async(&mut self.conn.clone())
            .await?;
        Ok([
            "requests",
            "tokens",
            "input_tokens",
            "output_tokens",
            "learned_requests_per_minute",
            "learned_concurrency",
        ]
        .iter()
        .zip(fields)
        .filter_map(|(name, v)| Some(((*name).to_owned(), v?.parse().ok()?)))
        .collect())
    }
}

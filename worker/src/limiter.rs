//! Fleet-wide rate limits: grants from token buckets shared in Redis by every
//! worker of a provider key/model, taken before a task is claimed and settled
//! with the real usage after the call.
//!
//! Always on: the spec's `[limits]` are ceilings and starting points, the
//! provider's `x-ratelimit-*` headers tighten them while fresh, a 429's
//! retry hint pauses the fleet that long (under a known limit only a storm
//! of them does: an occasional one is that request's, and the fleet slows
//! a little), and bare 429s teach the rest (an
//! AIMD controller of the fleet's request rate and concurrency, in the same
//! Redis hash; see `limit_settle.lua`). A job with no `[limits]` against a
//! provider that sends no headers at all still settles near the provider's
//! limit after a few 429s.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::batch::GroupCommit;
use common::spec::JobSpec;
use common::store::{Bound, CallKind, FreeReport, FreeWord, LimitParams, RedisStore, Settlement, StoreError};
use reqwest::header::HeaderMap;
use sha2::{Digest, Sha256};

/// How many seconds of a limit the shared buckets may hold (the burst).
const BURST_MS: u64 = 2_000;
/// How far ahead of the buckets a grant may be given (its call waits for
/// its time): a throttled worker takes a stretch of grants per acquire
/// instead of asking each time the buckets refill.
const AHEAD_MS: u64 = 1_000;
/// Longest fleet pause a provider's reset hint may cause.
const MAX_PAUSE_MS: u64 = 60_000;
/// Settlements stored together while the last call is on its way (at most
/// this many a call; each still applied as if alone, see `limit_settle.lua`).
const SETTLE_BATCH: usize = 128;
/// How long a settlement that changes nothing at once may wait for others
/// (a grant's tokens come back that much later; its slot is not held up
/// where slots are what limits, see [`Limiter::settle`]).
const SETTLE_LINGER: Duration = Duration::from_millis(250);
/// How long after the fleet's slots last held a grant back its
/// settlements still go at once.
const SLOTS_BOUND_FOR: Duration = Duration::from_secs(10);
/// How long after the rate last paced this worker it is taken for paced
/// ([`Limiter::paced`]).
pub const PACED_FOR: Duration = Duration::from_secs(2);
/// How long a free pass lasts (nothing limits the key: the worker takes its
/// own grants meanwhile, and none is counted in Redis). A pause or a cut
/// that another worker's call brings reaches this one's claims at the end
/// of its pass at the latest.
const PASS_MS: u64 = 250;
/// How many times over the told limits must hold a provider's probes (one
/// call a second at most, fleet-wide) for a probe to go without a grant.
const PROBE_ROOM: u64 = 10;

/// One reservation: a request, its tokens and a concurrency slot, from
/// `at` on (its call waits until then).
#[derive(Debug, Clone)]
pub struct Grant {
    pub id: String,
    pub at: tokio::time::Instant,
    tokens: u64,
    input: u64,
    output: u64,
    /// Taken on a free pass: nothing in Redis holds it.
    free: bool,
}

/// What one acquire gave, and when none (or too few) came, how long until
/// asking again can give more and whether a freed concurrency slot may
/// give one sooner.
#[derive(Debug, Default)]
pub struct Acquired {
    pub grants: Vec<Grant>,
    pub wait: Duration,
    pub bound: Bound,
}

/// The budget of one provider key/model, shared by the fleet.
pub struct Limiter {
    store: RedisStore,
    id: String,
    params: LimitParams,
    prefix: String,
    max_tokens: u64,
    /// How long a timed-out call keeps its concurrency slot.
    timeout_grace: Duration,
    /// Running estimate of a request's prompt tokens (before the task is known).
    prompt_estimate: AtomicU64,
    stats: LimiterStats,
    settler: GroupCommit<Settling, Result<bool, StoreError>>,
    /// When the fleet's concurrency slots last held a grant back.
    slots_bound: Lately,
    /// When the rate last paced this worker with slots to spare (shared:
    /// the job's queue lets its outcomes wait for each other meanwhile).
    paced: std::sync::Arc<Lately>,
    free: std::sync::Arc<FreePass>,
}

/// Numbers this process's limiters apart: each tells the buckets of its
/// own free grants, under a grant id prefix of its own (two jobs on one
/// key and model share the buckets, not the count).
static LIMITERS: AtomicU64 = AtomicU64::new(0);

/// This limiter's free pass, while nothing limits the key: until when, its
/// sequence number (in its grants' ids, as a counted grant's), and what it
/// has to tell the buckets at its next acquire or settlement.
#[derive(Debug, Default)]
struct FreePass {
    until: std::sync::Mutex<Option<(tokio::time::Instant, u64)>>,
    /// How long its word on the grants in flight holds (the slot lease, ms).
    lease_ms: AtomicU64,
    /// Grants taken on passes since the buckets were last told.
    taken: AtomicU64,
    /// Grants taken on passes and not settled yet.
    in_flight: AtomicU64,
    /// The buckets were told of some in flight (told again until they hear 0).
    told: std::sync::atomic::AtomicBool,
}

impl FreePass {
    /// The pass's sequence number, while it lasts.
    fn seq(&self) -> Option<u64> {
        let until = self.until.lock().unwrap_or_else(|e| e.into_inner());
        until
            .filter(|(at, _)| *at > tokio::time::Instant::now())
            .map(|(_, seq)| seq)
    }

    fn start(&self, ms: u64, seq: u64) {
        let until = tokio::time::Instant::now() + Duration::from_millis(ms);
        *self.until.lock().unwrap_or_else(|e| e.into_inner()) = Some((until, seq));
    }

    /// Ends the pass: the next claim asks the buckets.
    fn end(&self) {
        *self.until.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// What to tell the buckets now (the grants taken are told once).
    fn report(&self) -> FreeReport {
        let in_flight = self.in_flight.load(Ordering::Relaxed);
        let tell = in_flight > 0 || self.told.load(Ordering::Relaxed);
        self.told.store(in_flight > 0, Ordering::Relaxed);
        FreeReport {
            taken: self.taken.swap(0, Ordering::Relaxed),
            in_flight: tell.then_some(in_flight),
        }
    }

    /// What to tell the buckets with a settlement (see [`FreePass::report`]).
    fn word<'a>(&self, prefix: &'a str) -> FreeWord<'a> {
        FreeWord {
            prefix,
            report: self.report(),
            lease_ms: self.lease_ms.load(Ordering::Relaxed),
        }
    }

    /// An acquire or a settlement that carried `r` failed: told again at the next.
    fn untold(&self, r: FreeReport) {
        self.taken.fetch_add(r.taken, Ordering::Relaxed);
        if r.in_flight.is_some() {
            self.told.store(true, Ordering::Relaxed);
        }
    }

    /// A free grant is over: settled, or given back unused (not sent: not
    /// counted in the fleet's sending rate, unless told already).
    fn over(&self, sent: bool) {
        let _ = self
            .in_flight
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        if !sent {
            let _ = self
                .taken
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        }
    }
}

/// When something last happened, if it did: read and marked from any task.
#[derive(Debug)]
pub struct Lately {
    born: tokio::time::Instant,
    /// ms since `born`; `u64::MAX`: never.
    at: AtomicU64,
}

impl Lately {
    pub fn new() -> Lately {
        Lately {
            born: tokio::time::Instant::now(),
            at: AtomicU64::new(u64::MAX),
        }
    }

    pub fn mark(&self) {
        self.at.store(self.born.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// Forgets it: it did not happen lately after all.
    pub fn clear(&self) {
        self.at.store(u64::MAX, Ordering::Relaxed);
    }

    /// Whether it happened within the last `d`.
    pub fn within(&self, d: Duration) -> bool {
        let at = self.at.load(Ordering::Relaxed);
        at != u64::MAX && (self.born.elapsed().as_millis() as u64).saturating_sub(at) < d.as_millis() as u64
    }
}

impl Default for Lately {
    fn default() -> Lately {
        Lately::new()
    }
}

/// A grant's settlement on its way to the store, and whether it must go at
/// once: a 429, a timeout or a pause changes what the fleet may send now,
/// and a freed slot is what a fleet held back by its slots waits for (a
/// provider's `remaining` figure may wait: it is applied as of when it
/// was seen, see `limit_settle.lua`).
struct Settling {
    grant: String,
    settlement: Settlement,
    urgent: bool,
}

/// This worker's view of the shared budget, for metrics and the run summary.
#[derive(Debug, Default)]
pub struct LimiterStats {
    /// Times this worker asked the shared buckets for grants.
    pub acquires: AtomicU64,
    pub grants: AtomicU64,
    pub tokens_reserved: AtomicU64,
    /// Tokens given back at settlement (reserved but not used, or unused grants).
    pub tokens_returned: AtomicU64,
    /// 429s from the provider (each paused the fleet).
    pub rate_limited: AtomicU64,
    /// Calls that timed out (their slot kept for the grace, tokens estimated).
    pub timed_out: AtomicU64,
}

/// A snapshot of [`LimiterStats`] and of the shared bucket levels.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct LimiterReport {
    pub acquires: u64,
    pub grants: u64,
    pub tokens_reserved: u64,
    pub tokens_returned: u64,
    pub rate_limited: u64,
    pub timed_out: u64,
    /// Current level of each shared bucket and the limits learned from 429s, from Redis.
    pub budget: std::collections::BTreeMap<String, f64>,
}

/// What the provider's rate-limit headers said.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RateHeaders {
    pub limit_requests: Option<u64>,
    pub limit_tokens: Option<u64>,
    pub remaining_requests: Option<u64>,
    pub remaining_tokens: Option<u64>,
    pub reset_requests_ms: Option<u64>,
    pub reset_tokens_ms: Option<u64>,
    /// When they were read (the answer's headers' arrival).
    pub seen: Option<std::time::Instant>,
}

/// What a call used, as far as it is known.
#[derive(Debug, Clone, Copy, Default)]
pub struct Used {
    /// The provider answered 200 with a `usage` object.
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    /// The provider refused the call for rate limits (nothing was counted).
    pub rate_limited: bool,
    pub retry_after_ms: Option<u64>,
    /// No answer before the timeout: the server may still be generating.
    pub timed_out: bool,
}

impl Limiter {
    /// The limiter of a job: the spec's limits, when it sets any, are its
    /// ceilings. `base_url` is where requests really go; `consumer` prefixes
    /// grant ids.
    /// Its grants' lease is set once the visibility timeout is known ([`Limiter::set_lease`]).
    pub fn for_job(store: &RedisStore, spec: &JobSpec, base_url: &str, consumer: &str) -> Limiter {
        let l = &spec.limits;
        // The budget belongs to the key and model, not to the job.
        let identity = format!(
            "{}|{}|{}",
            base_url.trim_end_matches('/'),
            spec.provider.api_key_env,
            spec.provider.model
        );
        let mut id = hex::encode(Sha256::digest(identity.as_bytes()));
        id.truncate(16);
        let max_tokens = u64::from(spec.provider.max_tokens);
        let system = estimate_tokens(&common::spec::system_prompt(spec));
        let prefix = format!("{consumer}/{}", LIMITERS.fetch_add(1, Ordering::Relaxed));
        let free = std::sync::Arc::new(FreePass::default());
        let (settle_store, settle_id, settle_free, settle_prefix) =
            (store.clone(), id.clone(), free.clone(), prefix.clone());
        let settler = GroupCommit::lingering(
            SETTLE_BATCH,
            SETTLE_LINGER,
            |s: &Settling| s.urgent,
            move |batch: Vec<Settling>| {
                let (store, id, free, prefix) = (
                    settle_store.clone(),
                    settle_id.clone(),
                    settle_free.clone(),
                    settle_prefix.clone(),
                );
                let grants: Vec<(String, Settlement)> = batch.into_iter().map(|s| (s.grant, s.settlement)).collect();
                async move {
                    let word = free.word(&prefix);
                    match store.limit_settle_told(&id, &grants, word).await {
                        Ok(held) => held.into_iter().map(Ok).collect(),
                        Err(e) => {
                            free.untold(word.report);
                            grants.iter().map(|_| Err(e.clone())).collect()
                        }
                    }
                }
            },
        );
        Limiter {
            settler,
            store: store.clone(),
            id,
            params: LimitParams {
                requests: l.requests_per_minute.unwrap_or(0),
                tokens: l.tokens_per_minute.unwrap_or(0),
                input_tokens: l.input_tokens_per_minute.unwrap_or(0),
                output_tokens: l.output_tokens_per_minute.unwrap_or(0),
                max_concurrent: l.max_concurrent.unwrap_or(0),
                need_tokens: 0,
                need_input: 0,
                need_output: 0,
                burst_ms: BURST_MS,
                lease_ms: 0,
                ahead_ms: AHEAD_MS,
                pass_ms: PASS_MS,
            },
            prefix,
            max_tokens,
            timeout_grace: spec.provider.timeout_grace(),
            prompt_estimate: AtomicU64::new(system + 100),
            stats: LimiterStats::default(),
            slots_bound: Lately::new(),
            paced: std::sync::Arc::new(Lately::new()),
            free,
        }
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// How long a grant's concurrency slot lives unless settled (the
    /// visibility timeout, known once every job is loaded).
    pub fn set_lease(&mut self, lease: Duration) {
        self.params.lease_ms = lease.as_millis() as u64;
        self.free.lease_ms.store(self.params.lease_ms, Ordering::Relaxed);
    }

    /// Takes up to `want` grants, each with the moment its call may start;
    /// with fewer, also how long to wait and what held the rest back.
    /// While nothing limits the key, on a free pass: `want` grants at once,
    /// none asked of Redis (the buckets ask for the next pass).
    pub async fn try_acquire(&self, want: usize) -> Result<Acquired, StoreError> {
        if let Some(seq) = self.free.seq() {
            return Ok(self.free_grants(want, seq));
        }
        // A margin over the running average: a longer prompt than usual must
        // not push the fleet over the limit before settlement corrects it.
        let input = self.prompt_estimate.load(Ordering::Relaxed) * 5 / 4;
        let mut p = self.params;
        p.need_input = input;
        p.need_output = self.max_tokens;
        p.need_tokens = input + self.max_tokens;
        self.stats.acquires.fetch_add(1, Ordering::Relaxed);
        let report = self.free.report();
        let got = match self.store.limit_acquire(&self.id, &p, want, &self.prefix, report).await {
            Ok(got) => got,
            Err(e) => {
                self.free.untold(report);
                return Err(e);
            }
        };
        if let Some((ms, seq)) = got.pass {
            self.free.start(ms, seq);
            return Ok(self.free_grants(want, seq));
        }
        let n = got.grants.len() as u64;
        self.stats.grants.fetch_add(n, Ordering::Relaxed);
        if got.bound == Bound::Concurrency {
            self.slots_bound();
        }
        self.stats
            .tokens_reserved
            .fetch_add(n * p.need_tokens, Ordering::Relaxed);
        let now = tokio::time::Instant::now();
        let grants = got
            .grants
            .into_iter()
            .map(|(id, delay_ms)| Grant {
                id,
                at: now + Duration::from_millis(delay_ms),
                tokens: p.need_tokens,
                input,
                output: self.max_tokens,
                free: false,
            })
            .collect();
        Ok(Acquired {
            grants,
            wait: Duration::from_millis(got.wait_ms),
            bound: got.bound,
        })
    }

    /// `want` grants of the free pass `seq`, each to go now.
    fn free_grants(&self, want: usize, seq: u64) -> Acquired {
        let n = want as u64;
        self.stats.grants.fetch_add(n, Ordering::Relaxed);
        self.free.taken.fetch_add(n, Ordering::Relaxed);
        self.free.in_flight.fetch_add(n, Ordering::Relaxed);
        let now = tokio::time::Instant::now();
        let id = format!("{}:{seq}:0", self.prefix);
        let grants = (0..want)
            .map(|_| Grant {
                id: id.clone(),
                at: now,
                tokens: 0,
                input: 0,
                output: 0,
                free: true,
            })
            .collect();
        Acquired {
            grants,
            ..Acquired::default()
        }
    }

    /// Returns an unused grant whole (its settlement may wait a moment for others).
    pub async fn release(&self, g: Grant) -> Result<(), StoreError> {
        if g.free {
            self.free.over(false);
            return Ok(());
        }
        let s = self.returned(&g);
        self.settle_batched(g.id, s).await
    }

    /// Returns unused grants whole, at once, in one settlement call of
    /// their own: a claim round waits for it (its grants are back before
    /// the next round, and it leaves nothing behind it on the tracker).
    pub async fn release_now(&self, grants: Vec<Grant>) -> Result<(), StoreError> {
        let (free, grants): (Vec<Grant>, Vec<Grant>) = grants.into_iter().partition(|g| g.free);
        free.iter().for_each(|_| self.free.over(false));
        if grants.is_empty() {
            return Ok(());
        }
        let all: Vec<(String, Settlement)> = grants.iter().map(|g| (g.id.clone(), self.returned(g))).collect();
        self.store.limit_settle_many(&self.id, &all).await.map(|_| ())
    }

    /// The settlement of a grant given back unused: everything it reserved.
    fn returned(&self, g: &Grant) -> Settlement {
        self.stats.tokens_returned.fetch_add(g.tokens, Ordering::Relaxed);
        Settlement {
            tokens_back: g.tokens as i64,
            input_back: g.input as i64,
            output_back: g.output as i64,
            ..Settlement::default()
        }
    }

    /// Settles a grant after its call: the difference between reserved and
    /// used tokens goes back (usage unknown, e.g. a timeout: counted as used),
    /// headers tighten the shared budget, a 429 pauses the fleet.
    pub async fn settle(&self, g: Grant, used: &Used, headers: &RateHeaders) -> Result<(), StoreError> {
        let mut s = Settlement {
            header_limit_requests: headers.limit_requests,
            header_limit_tokens: headers.limit_tokens,
            header_remaining_requests: headers.remaining_requests,
            header_remaining_tokens: headers.remaining_tokens,
            seen: headers.seen,
            ceiling_requests: self.params.requests,
            ceiling_concurrent: self.params.max_concurrent,
            ceiling_tokens: self.params.tokens,
            ..Settlement::default()
        };
        if used.rate_limited {
            s.call = if used.retry_after_ms.is_some() {
                CallKind::RateLimitedWithHint
            } else {
                CallKind::RateLimited
            };
            self.stats.rate_limited.fetch_add(1, Ordering::Relaxed);
            // Not counted by the provider: everything back, and the fleet waits.
            s.tokens_back = g.tokens as i64;
            s.input_back = g.input as i64;
            s.output_back = g.output as i64;
            s.pause_ms = used.retry_after_ms.unwrap_or(1000).min(MAX_PAUSE_MS);
        } else if let (Some(prompt), Some(completion)) = (used.prompt_tokens, used.completion_tokens) {
            s.call = CallKind::Answered;
            s.tokens_back = g.tokens as i64 - (prompt + completion) as i64;
            s.input_back = g.input as i64 - prompt as i64;
            s.output_back = g.output as i64 - completion as i64;
            // Learn the prompt size for the next reservations (moving average).
            let old = self.prompt_estimate.load(Ordering::Relaxed);
            self.prompt_estimate
                .store((old * 7 + prompt).div_ceil(8), Ordering::Relaxed);
        } else if used.timed_out {
            // The server may still be generating it: its slot stays taken for
            // the grace, and its reserved tokens count as used.
            self.stats.timed_out.fetch_add(1, Ordering::Relaxed);
            s.call = CallKind::TimedOut;
            s.hold_ms = self.timeout_grace.as_millis() as u64;
        }
        // An exhausted budget with a reset time is a real signal; 0 alone is not.
        let exhausted =
            |remaining: Option<u64>, reset: Option<u64>| remaining == Some(0) && reset.is_some_and(|r| r > 0);
        if exhausted(headers.remaining_requests, headers.reset_requests_ms) {
            s.pause_ms = s.pause_ms.max(headers.reset_requests_ms.unwrap_or(0).min(MAX_PAUSE_MS));
        }
        if exhausted(headers.remaining_tokens, headers.reset_tokens_ms) {
            s.pause_ms = s.pause_ms.max(headers.reset_tokens_ms.unwrap_or(0).min(MAX_PAUSE_MS));
        }
        self.stats
            .tokens_returned
            .fetch_add(s.tokens_back.max(0) as u64, Ordering::Relaxed);
        if g.free {
            return self.settle_free(g, s).await;
        }
        self.settle_batched(g.id, s).await
    }

    /// A free grant's settlement: nothing to store (nothing in Redis holds
    /// it), unless its call brought news the fleet must know (a 429, the
    /// provider's limits, a pause; a `remaining` figure alone changes
    /// nothing while no limit is known): then it is stored as a counted
    /// grant's (a 429 or a pause at once), with what this limiter's passes
    /// took and hold (a cut starts from them), and its pass ends, both
    /// before (no more free grants) and once it is stored (a pass taken
    /// meanwhile did not see it).
    async fn settle_free(&self, g: Grant, s: Settlement) -> Result<(), StoreError> {
        self.free.over(true);
        let news = matches!(s.call, CallKind::RateLimited | CallKind::RateLimitedWithHint)
            || s.pause_ms > 0
            || s.header_limit_requests.is_some()
            || s.header_limit_tokens.is_some();
        if !news {
            return Ok(());
        }
        self.free.end();
        let stored = self.settle_batched(g.id, s).await;
        self.free.end();
        stored
    }

    /// The fleet's concurrency slots held a grant back (this worker's, or
    /// another's: a freed slot's wake-up says so): settlements free slots
    /// at once for [`SLOTS_BOUND_FOR`].
    pub fn slots_bound(&self) {
        self.slots_bound.mark();
        // Outcomes waiting for each other would hold slots some worker waits for.
        self.paced.clear();
    }

    /// When the rate last paced this worker (held its grants back, or gave
    /// them ahead of the buckets) while it had slots to spare: marked by
    /// [`crate::fleet::Fleet::grants`]. While it did lately ([`PACED_FOR`])
    /// the worker makes calls at the rate's pace, not its own.
    pub fn paced(&self) -> std::sync::Arc<Lately> {
        self.paced.clone()
    }

    /// Whether concurrency slots may be what limits the fleet: the spec
    /// caps them (`max_concurrent`), or they held a grant back lately. Its
    /// settlements then go at once, and a task frees its slot in the
    /// fleet's budget before its claimer looks for more work.
    pub fn slots_matter(&self) -> bool {
        self.params.max_concurrent > 0 || self.slots_held_back()
    }

    /// Whether the fleet's concurrency slots held a grant back lately
    /// ([`SLOTS_BOUND_FOR`]): a cap in the spec that never binds does not count.
    pub fn slots_held_back(&self) -> bool {
        self.slots_bound.within(SLOTS_BOUND_FOR)
    }

    /// Whether a provider taken for down may be probed without rate grants:
    /// its probes (one call at a time fleet-wide, at most one a second)
    /// fit [`PROBE_ROOM`] times over in the limits the spec tells: a
    /// request limit is told and holds 600 calls a minute, each told token
    /// limit holds 600 of these calls' reservations, a told concurrency cap
    /// is 10 or more, and the fleet's slots held no grant back lately (as
    /// this worker saw: such a probe holds no slot, so a cap that other
    /// jobs of the same key keep full may see one call more). The limits
    /// learned from a provider's answers are not known here: without a
    /// told request limit every probe takes its grant.
    pub fn spares_probes(&self) -> bool {
        let input = self.prompt_estimate.load(Ordering::Relaxed) * 5 / 4;
        probes_fit(&self.params, input, self.max_tokens) && !self.slots_held_back()
    }

    /// One settlement, stored with the others of the moment. One that
    /// changes nothing the fleet must know at once (an answered call, a
    /// call that failed for no reason of load, a grant not used) waits up
    /// to [`SETTLE_LINGER`] for others, unless slots matter
    /// ([`Limiter::slots_matter`]): a fleet under a rate limit then
    /// settles in a few calls a second whatever its pace.
    async fn settle_batched(&self, grant: String, s: Settlement) -> Result<(), StoreError> {
        let urgent = self.slots_matter() || s.pause_ms > 0 || !matches!(s.call, CallKind::Answered | CallKind::Other);
        self.settler
            .call(Settling {
                grant,
                settlement: s,
                urgent,
            })
            .await
            .unwrap_or(Err(StoreError::ShuttingDown))
            .map(|_| ())
    }

    /// Counters of this worker and the shared buckets' current levels.
    pub async fn report(&self) -> Result<LimiterReport, StoreError> {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Ok(LimiterReport {
            acquires: load(&self.stats.acquires),
            grants: load(&self.stats.grants),
            tokens_reserved: load(&self.stats.tokens_reserved),
            tokens_returned: load(&self.stats.tokens_returned),
            rate_limited: load(&self.stats.rate_limited),
            timed_out: load(&self.stats.timed_out),
            budget: self.store.limit_levels(&self.id).await?,
        })
    }
}

/// Whether told limits `p` hold a probe a second (each reserving `input`
/// and `output` tokens) [`PROBE_ROOM`] times over (see [`Limiter::spares_probes`]).
fn probes_fit(p: &LimitParams, input: u64, output: u64) -> bool {
    let calls = 60 * PROBE_ROOM;
    let holds = |limit: u64, need: u64| limit == 0 || limit >= calls * need;
    p.requests >= calls
        && holds(p.tokens, input + output)
        && holds(p.input_tokens, input)
        && holds(p.output_tokens, output)
        && (p.max_concurrent == 0 || p.max_concurrent >= PROBE_ROOM)
}

/// A conservative prompt estimate: about 4 bytes a token, rounded up, plus
/// the chat format's per-message overhead. Settlement corrects it.
pub fn estimate_tokens(text: &str) -> u64 {
    (text.len() as u64).div_ceil(4) + 8
}

/// Reads `x-ratelimit-*` headers. Values that are not plain non-negative
/// numbers (or -1) are unknown, never trusted.
pub fn rate_headers(h: &HeaderMap) -> RateHeaders {
    let get = |k: &str| provider_header(h, k);
    let num = |k: &str| -> Option<u64> { get(k)?.parse().ok() };
    // Go-style durations (`6m0s`), or plain seconds (`60`, `1.5`).
    let dur = |k: &str| -> Option<u64> {
        let v = get(k)?;
        parse_go_duration(v).or_else(|| {
            v.parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && (0.0..=86_400.0).contains(s))
                .map(|s| (s * 1000.0).ceil() as u64)
        })
    };
    RateHeaders {
        limit_requests: num("x-ratelimit-limit-requests").filter(|&n| n > 0),
        limit_tokens: num("x-ratelimit-limit-tokens").filter(|&n| n > 0),
        remaining_requests: num("x-ratelimit-remaining-requests"),
        remaining_tokens: num("x-ratelimit-remaining-tokens"),
        reset_requests_ms: dur("x-ratelimit-reset-requests"),
        reset_tokens_ms: dur("x-ratelimit-reset-tokens"),
        seen: Some(std::time::Instant::now()),
    }
}

/// A header as the provider names it, or as a proxy copies it (LiteLLM
/// prefixes the upstream provider's headers with `llm_provider-`), trimmed.
pub fn provider_header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name)
        .or_else(|| h.get(format!("llm_provider-{name}")))
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
}

/// Parses Go-style durations (`1s`, `6m0s`, `12ms`, `1m30.5s`, `2h`) to ms.
pub fn parse_go_duration(s: &str) -> Option<u64> {
    let s = s.trim();
    if s.is_empty() {
        return None;
    }
    let mut total_ms = 0f64;
    let mut rest = s;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if num_len == 0 {
            return None;
        }
        let n: f64 = rest[..num_len].parse().ok()?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let factor = match &rest[..unit_len] {
            "ms" => 1.0,
            "s" => 1000.0,
            "m" => 60_000.0,
            "h" => 3_600_000.0,
            "us" | "µs" => 0.001,
            "ns" => 0.000_001,
            _ => return None,
        };
        total_ms += n * factor;
        rest = &rest[unit_len..];
    }
    (total_ms.is_finite() && total_ms <= 86_400_000.0).then(|| total_ms.ceil() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    #[test]
    fn probes_fit_only_limits_told_that_hold_them_ten_times_over() {
        let told = |requests, tokens, input_tokens, output_tokens, max_concurrent| LimitParams {
            requests,
            tokens,
            input_tokens,
            output_tokens,
            max_concurrent,
            need_tokens: 0,
            need_input: 0,
            need_output: 0,
            burst_ms: 0,
            lease_ms: 0,
            ahead_ms: 0,
            pass_ms: 0,
        };
        // 600 calls a minute of 300 input and 200 output tokens.
        let fits = |p: LimitParams| probes_fit(&p, 300, 200);
        assert!(fits(told(600, 0, 0, 0, 0)));
        assert!(!fits(told(599, 0, 0, 0, 0)));
        assert!(
            !fits(told(0, 0, 0, 0, 0)),
            "no request limit told: the probe takes its grant"
        );
        assert!(fits(told(10_000, 300_000, 180_000, 120_000, 10)));
        assert!(!fits(told(10_000, 299_999, 0, 0, 0)), "tokens");
        assert!(!fits(told(10_000, 0, 179_999, 0, 0)), "input tokens");
        assert!(!fits(told(10_000, 0, 0, 119_999, 0)), "output tokens");
        assert!(!fits(told(10_000, 0, 0, 0, 9)), "a concurrency cap under 10");
    }

    #[test]
    fn a_free_pass_tells_what_it_took_once_and_what_is_in_flight_until_none_is() {
        let f = FreePass::default();
        let told = |taken, in_flight| FreeReport { taken, in_flight };
        assert_eq!(f.report(), told(0, None), "nothing to tell");
        f.start(250, 7);
        assert_eq!(f.seq(), Some(7));
        f.taken.fetch_add(3, Ordering::Relaxed);
        f.in_flight.fetch_add(3, Ordering::Relaxed);
        f.over(false); // given back unused: not sent
        f.over(true);
        assert_eq!(f.report(), told(2, Some(1)));
        assert_eq!(f.report(), told(0, Some(1)), "what it took is told once");
        f.over(true);
        assert_eq!(f.report(), told(0, Some(0)), "none in flight is told once");
        assert_eq!(f.report(), told(0, None));
        // An acquire that failed: told again at the next.
        f.untold(told(5, Some(0)));
        assert_eq!(f.report(), told(5, Some(0)));
        f.over(true);
        assert_eq!(f.in_flight.load(Ordering::Relaxed), 0, "never below none");
        f.end();
        assert_eq!(f.seq(), None, "ended: the next claim asks the buckets");
        f.start(0, 8);
        assert_eq!(f.seq(), None, "a pass of 0 ms is over at once");
    }

    #[test]
    fn go_durations() {
        assert_eq!(parse_go_duration("1s"), Some(1000));
        assert_eq!(parse_go_duration("6m0s"), Some(360_000));
        assert_eq!(parse_go_duration("12ms"), Some(12));
        assert_eq!(parse_go_duration("1m30.5s"), Some(90_500));
        assert_eq!(parse_go_duration("0.25s"), Some(250));
        for bad in ["", "s", "5", "1x", "-1s", "1s2", "1e9s"] {
            assert_eq!(parse_go_duration(bad), None, "{bad}");
        }
    }

    #[test]
    fn headers_nonsense_is_unknown() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("x-ratelimit-limit-requests", "3000"),
            ("x-ratelimit-remaining-requests", "-1"),
            ("x-ratelimit-limit-tokens", "0"),
            ("x-ratelimit-remaining-tokens", "12abc"),
            ("x-ratelimit-reset-requests", "20ms"),
            ("x-ratelimit-reset-tokens", "soon"),
        ] {
            h.insert(k, HeaderValue::from_static(v));
        }
        let r = rate_headers(&h);
        assert_eq!(r.limit_requests, Some(3000));
        assert_eq!(r.remaining_requests, None);
        assert_eq!(r.limit_tokens, None, "0 is unknown, not a limit");
        assert_eq!(r.remaining_tokens, None);
        assert_eq!(r.reset_requests_ms, Some(20));
        assert_eq!(r.reset_tokens_ms, None);
    }

    #[test]
    fn estimates_round_up() {
        assert_eq!(estimate_tokens(""), 8);
        assert_eq!(estimate_tokens("abcde"), 10);
    }
}

//! Service tiers, as OpenAI, Azure OpenAI, Gemini and Groq sell them: the
//! request's `service_tier` (`auto`, `default` or none: the standard tier;
//! `flex`: cheaper, refused when the provider has no capacity; `priority`),
//! echoed in the answer as the tier that served it. A flex request without
//! capacity gets 429 with code `resource_unavailable` (not a rate limit), or
//! 498 as Groq's flex tier answers; refusals come in bursts at a set share of
//! flex requests. A model with no flex tier answers 400. Each tier's
//! requests, refusals, tokens and cost at its own prices are counted for
//! `/stats` (`by_tier`): the judge of what a routed job paid.

use std::collections::BTreeMap;
use std::sync::Mutex;

use axum::http::StatusCode;
use axum::response::Response;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde_json::{Value, json};

use crate::error_body;

/// How a flex request without capacity is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FlexRefusal {
    /// 429, `code: resource_unavailable` (OpenAI, Azure OpenAI, Gemini).
    Openai,
    /// 498 (Groq's flex tier over capacity).
    Groq,
}

/// What the tiers are told at start (see `Args`).
pub struct TierArgs<'a> {
    pub flex_unavailable: f64,
    pub flex_burst: u32,
    pub refusal: FlexRefusal,
    pub no_flex_models: &'a [String],
    pub prices: &'a [String],
    pub seed: u64,
}

pub struct Tiers {
    /// Share of flex requests refused, and the mean length of a run of refusals.
    share: f64,
    burst: u32,
    refusal: FlexRefusal,
    no_flex: Vec<String>,
    /// USD per million input and output tokens, per tier.
    prices: BTreeMap<String, (f64, f64)>,
    state: Mutex<State>,
}

struct State {
    rng: StdRng,
    /// Refusals left in the burst under way.
    burst_left: u32,
    by_tier: BTreeMap<&'static str, TierStats>,
}

#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct TierStats {
    pub requests: u64,
    pub refused: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cost_usd: f64,
}

/// The tier a request asks for, as the answer names it, or a 400 for a
/// value the API does not know.
pub fn requested(req: &Value) -> Result<&'static str, Box<Response>> {
    match req.get("service_tier") {
        None | Some(Value::Null) => Ok("default"),
        Some(v) => match v.as_str() {
            Some("auto" | "default") => Ok("default"),
            Some("flex") => Ok("flex"),
            Some("priority") => Ok("priority"),
            _ => Err(Box::new(error_body(
                StatusCode::BAD_REQUEST,
                &format!(
                    "Invalid value for 'service_tier': {v}. Supported values are: 'auto', 'default', 'flex' and 'priority'."
                ),
                "invalid_request_error",
                "invalid_value",
            ))),
        },
    }
}

/// `TIER=INPUT:OUTPUT` (USD per million tokens) into the price table.
pub fn parse_prices(specs: &[String]) -> Result<BTreeMap<String, (f64, f64)>, String> {
    let mut out = BTreeMap::new();
    for spec in specs {
        let bad =
            || format!("--tier-price {spec:?}: expected TIER=INPUT:OUTPUT (USD per million tokens), e.g. flex=1.25:5");
        let (tier, prices) = spec.split_once('=').ok_or_else(bad)?;
        let (input, output) = prices.split_once(':').ok_or_else(bad)?;
        let num = |s: &str| s.trim().parse::<f64>().ok().filter(|p| p.is_finite() && *p >= 0.0);
        let (Some(input), Some(output)) = (num(input), num(output)) else {
            return Err(bad());
        };
        if !matches!(tier, "default" | "flex" | "priority") {
            return Err(format!(
                "--tier-price {spec:?}: the tiers are default, flex and priority"
            ));
        }
        out.insert(tier.to_owned(), (input, output));
    }
    Ok(out)
}

impl Tiers {
    pub fn new(a: &TierArgs) -> Result<Tiers, String> {
        if !(0.0..=1.0).contains(&a.flex_unavailable) {
            return Err(format!(
                "--flex-unavailable {}: a share between 0 and 1",
                a.flex_unavailable
            ));
        }
        Ok(Tiers {
            share: a.flex_unavailable,
            burst: a.flex_burst.max(1),
            refusal: a.refusal,
            no_flex: a.no_flex_models.to_vec(),
            prices: parse_prices(a.prices)?,
            state: Mutex::new(State {
                rng: StdRng::seed_from_u64(a.seed ^ 0x7165_7273),
                burst_left: 0,
                by_tier: BTreeMap::new(),
            }),
        })
    }

    /// A refusal of a request for `tier` of `model`, if it meets one: a model
    /// with no flex tier (400), or no flex capacity now (429 / 498).
    pub fn refuse(&self, tier: &'static str, model: &str) -> Option<Response> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.by_tier.entry(tier).or_default().requests += 1;
        if tier != "flex" {
            return None;
        }
        if self.no_flex.iter().any(|m| m == model) {
            s.by_tier.entry(tier).or_default().refused += 1;
            return Some(error_body(
                StatusCode::BAD_REQUEST,
                &format!("The model `{model}` does not support the 'flex' service tier."),
                "invalid_request_error",
                "invalid_value",
            ));
        }
        if !self.draw_refusal(&mut s) {
            return None;
        }
        s.by_tier.entry(tier).or_default().refused += 1;
        Some(match self.refusal {
            FlexRefusal::Openai => error_body(
                StatusCode::TOO_MANY_REQUESTS,
                "Resource unavailable: there is not enough capacity for flex processing right now. Please retry later or use the default service tier.",
                "server_error",
                "resource_unavailable",
            ),
            FlexRefusal::Groq => error_body(
                StatusCode::from_u16(498).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
                "Flex tier capacity exceeded. This is a temporary condition; retry later or use the on_demand tier.",
                "capacity_exceeded",
                "flex_tier_capacity_exceeded",
            ),
        })
    }

    /// Refusals come in runs of `burst`: a request outside a run starts one
    /// with the probability that makes `share` of all flex requests refused.
    fn draw_refusal(&self, s: &mut State) -> bool {
        if s.burst_left > 0 {
            s.burst_left -= 1;
            return true;
        }
        if self.share <= 0.0 {
            return false;
        }
        let b = f64::from(self.burst);
        let start = self.share / (b * (1.0 - self.share) + self.share);
        if s.rng.random_range(0.0..1.0) < start {
            s.burst_left = self.burst - 1;
            return true;
        }
        false
    }

    /// Counts an answer served in `tier`, at the tier's prices.
    pub fn served(&self, tier: &'static str, prompt_tokens: u64, completion_tokens: u64) {
        let (input, output) = self.prices.get(tier).copied().unwrap_or((0.0, 0.0));
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let t = s.by_tier.entry(tier).or_default();
        t.prompt_tokens += prompt_tokens;
        t.completion_tokens += completion_tokens;
        t.cost_usd += (prompt_tokens as f64 * input + completion_tokens as f64 * output) / 1e6;
    }

    pub fn stats(&self) -> Value {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        json!(s.by_tier)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiers(share: f64, burst: u32, no_flex: &[String]) -> Tiers {
        let prices = ["default=2:8".to_owned(), "flex=1:4".to_owned()];
        Tiers::new(&TierArgs {
            flex_unavailable: share,
            flex_burst: burst,
            refusal: FlexRefusal::Openai,
            no_flex_models: no_flex,
            prices: &prices,
            seed: 7,
        })
        .unwrap()
    }

    #[test]
    fn flex_refusals_come_in_bursts_at_the_share_asked() {
        let t = tiers(0.4, 5, &[]);
        let refused: Vec<bool> = (0..20_000).map(|_| t.refuse("flex", "m").is_some()).collect();
        let share = refused.iter().filter(|r| **r).count() as f64 / refused.len() as f64;
        assert!((0.37..=0.43).contains(&share), "{share}");
        // Runs of refusals: about 5 long (a run may follow another).
        let runs = refused.windows(2).filter(|w| !w[0] && w[1]).count().max(1);
        let mean = refused.iter().filter(|r| **r).count() as f64 / runs as f64;
        assert!(mean >= 4.5, "refusals in runs of {mean:.1}, not bursts");
        // The standard tier is never refused for capacity.
        assert!((0..1000).all(|_| t.refuse("default", "m").is_none()));
        let s = t.stats();
        assert_eq!(s["flex"]["requests"], 20_000);
        assert_eq!(s["default"]["refused"], 0);
    }

    #[test]
    fn a_model_without_flex_answers_400_and_each_tier_is_priced_apart() {
        let t = tiers(0.0, 1, &["small".to_owned()]);
        let r = t.refuse("flex", "small").expect("refused");
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        assert!(t.refuse("flex", "big").is_none());
        t.served("default", 1_000_000, 1_000_000);
        t.served("flex", 1_000_000, 1_000_000);
        let s = t.stats();
        assert_eq!(s["default"]["cost_usd"], 10.0);
        assert_eq!(s["flex"]["cost_usd"], 5.0);
    }

    #[test]
    fn the_tier_asked_is_read_as_the_api_reads_it() {
        assert_eq!(requested(&json!({})).ok(), Some("default"));
        assert_eq!(requested(&json!({"service_tier": "auto"})).ok(), Some("default"));
        assert_eq!(requested(&json!({"service_tier": "flex"})).ok(), Some("flex"));
        let bad = requested(&json!({"service_tier": "cheap"})).expect_err("refused");
        assert_eq!(bad.status(), StatusCode::BAD_REQUEST);
        assert!(parse_prices(&["flex=1.25:5".to_owned()]).is_ok());
        for bad in ["flex", "flex=1", "flex=a:b", "cheap=1:2", "flex=-1:2"] {
            assert!(parse_prices(&[bad.to_owned()]).is_err(), "{bad}");
        }
    }
}

//! Routes: the price tiers a record's call can take (`flex`, `standard`),
//! the job's deadline, and the planner's rule that shares the calls
//! between the tiers so the job ends in time at the lowest price.
//!
//! The rule is pure ([`standard_share`]): the worker feeds it what the
//! fleet's counters say (records left, records settled per second) and what
//! its own calls saw (the share of flex calls the provider took), and sends
//! that share of its calls at the standard price, the rest on flex. Without
//! a deadline every call goes flex; past the point where flex alone would
//! end too late, the share grows until the job fits; in the last stretch
//! (the safety margin) every call is standard.

use serde::Serialize;

/// A price tier of the provider's (see `provider.tiers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// `service_tier: "flex"`: about the Batch API's price, answered online,
    /// refused (429 `resource_unavailable`, Groq's 498) when the provider is busy.
    Flex,
    /// The provider's ordinary price (`service_tier: "default"`).
    Standard,
}

impl Tier {
    pub const ALL: [Tier; 2] = [Tier::Flex, Tier::Standard];

    pub fn name(self) -> &'static str {
        match self {
            Tier::Flex => "flex",
            Tier::Standard => "standard",
        }
    }

    pub fn from_name(name: &str) -> Option<Tier> {
        Tier::ALL.into_iter().find(|t| t.name() == name)
    }

    /// What the request's `service_tier` says for this tier.
    pub fn service_tier(self) -> &'static str {
        match self {
            Tier::Flex => "flex",
            Tier::Standard => "default",
        }
    }
}

/// The time now, Unix ms.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A deadline as people write it: a duration from `now_ms` (`90s`, `45m`,
/// `6h`, `2d`, `1h30m`) or an instant (`2026-12-07T18:00:00Z`). Unix ms.
pub fn parse_deadline(text: &str, now_ms: u64) -> Result<u64, String> {
    let text = text.trim();
    if text.contains('T') {
        return parse_instant(text).map(|secs| secs * 1000);
    }
    parse_duration_ms(text).map(|ms| now_ms + ms).ok_or_else(|| {
        format!(
            "`{text}` is neither a duration (`90s`, `45m`, `6h`, `2d`, `1h30m`) nor an instant (`2026-12-07T18:00:00Z`)"
        )
    })
}

/// `90s`, `45m`, `6h`, `2d`, `1h30m` in ms (None: not one, or zero).
pub fn parse_duration_ms(text: &str) -> Option<u64> {
    let mut total: u64 = 0;
    let mut digits = String::new();
    for c in text.chars() {
        if c.is_ascii_digit() {
            digits.push(c);
            continue;
        }
        let unit = match c {
            's' => 1_000,
            'm' => 60_000,
            'h' => 3_600_000,
            'd' => 86_400_000,
            _ => return None,
        };
        let n: u64 = digits.parse().ok()?;
        total = total.checked_add(n.checked_mul(unit)?)?;
        digits.clear();
    }
    (digits.is_empty() && total > 0).then_some(total)
}

/// `YYYY-MM-DDTHH:MM:SSZ` (UTC; a `+HH:MM` offset is applied) in Unix seconds.
fn parse_instant(text: &str) -> Result<u64, String> {
    let bad = || format!("`{text}` is no instant as RFC 3339 writes them (`2026-12-07T18:00:00Z`)");
    let (date, time) = text.split_once('T').ok_or_else(bad)?;
    let (time, offset_secs) = if let Some(t) = time.strip_suffix('Z') {
        (t, 0i64)
    } else {
        let at = time.rfind(['+', '-']).ok_or_else(bad)?;
        let (t, off) = time.split_at(at);
        let sign = if off.starts_with('-') { -1 } else { 1 };
        let (h, m) = off[1..].split_once(':').ok_or_else(bad)?;
        let hm = |s: &str| s.parse::<i64>().map_err(|_| bad());
        (t, sign * (hm(h)? * 3600 + hm(m)? * 60))
    };
    let num = |s: &str| s.parse::<i64>().map_err(|_| bad());
    let d: Vec<&str> = date.split('-').collect();
    let t: Vec<&str> = time.split(':').collect();
    if d.len() != 3 || t.len() != 3 {
        return Err(bad());
    }
    let (y, mo, day) = (num(d[0])?, num(d[1])?, num(d[2])?);
    let second = t[2].split('.').next().unwrap_or("");
    let (h, mi, s) = (num(t[0])?, num(t[1])?, num(second)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&day) || h > 23 || mi > 59 || s > 60 {
        return Err(bad());
    }
    let days = crate::manifest::days_from_civil(y, mo, day);
    let secs = days * 86_400 + h * 3600 + mi * 60 + s - offset_secs;
    u64::try_from(secs).map_err(|_| bad())
}

/// What the planner knows when it shares the calls out.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlanFacts {
    /// Unix ms.
    pub now_ms: u64,
    /// The job's deadline (None: none; every call goes flex).
    pub deadline_ms: Option<u64>,
    /// Records not settled yet, fleet-wide.
    pub remaining: u64,
    /// Records the fleet settled per second lately (None: not measured yet).
    pub rate: Option<f64>,
    /// The share of flex calls the provider answered lately (1.0: all).
    pub flex_acceptance: f64,
    /// The standard share in force while `rate` was measured.
    pub standard_share: f64,
}

/// The last stretch before a deadline, kept for whatever the plan did not
/// foresee: a tenth of the time left, at least 5 s. In it every call is standard.
pub fn margin_ms(left_ms: u64) -> u64 {
    (left_ms / 10).max(5_000)
}

/// Whether `left_ms` to the deadline (None: no deadline) still holds a
/// batch's completion window and the margin: records may go through the Batch API.
pub fn leaves_batch_window(left_ms: Option<u64>, window_ms: u64) -> bool {
    left_ms.is_none_or(|left| left > window_ms + margin_ms(left))
}

/// The share of calls (0.0-1.0) to send at the standard price so the job
/// ends before its deadline, the rest on flex.
///
/// A call slot (a request the limits allow) settles a record on standard,
/// and `flex_acceptance` of one on flex: with a share `p` standard the
/// fleet settles `slots x (p + (1 - p) x acceptance)` records a second.
/// The slots are read off the measured rate at the share in force; the
/// share is the least that settles `remaining` in the time left less the
/// margin.
pub fn standard_share(f: &PlanFacts) -> f64 {
    let Some(deadline) = f.deadline_ms else {
        return 0.0;
    };
    if f.remaining == 0 {
        return 0.0;
    }
    let left = deadline.saturating_sub(f.now_ms);
    let room_ms = left.saturating_sub(margin_ms(left));
    if room_ms == 0 {
        return 1.0;
    }
    let a = f.flex_acceptance.clamp(0.0, 1.0);
    let rate = match f.rate {
        // Nothing measured yet: the share in force until the first figures come.
        None => return f.standard_share,
        // Nothing settled over the window: if flex is refusing, standard
        // is where records settle (at least the share flex refuses).
        Some(r) if r <= 0.0 || !r.is_finite() => return f.standard_share.max(1.0 - a),
        Some(r) => r,
    };
    let per_slot = |p: f64| p + (1.0 - p) * a;
    let slots = rate / per_slot(f.standard_share).max(0.01);
    let needed = f.remaining as f64 / (room_ms as f64 / 1000.0);
    if needed <= slots * a {
        return 0.0;
    }
    if a >= 0.999 || needed >= slots {
        // Flex takes everything (standard is no faster), or even all
        // standard is not fast enough: the fastest there is.
        return if a >= 0.999 { 0.0 } else { 1.0 };
    }
    ((needed / slots - a) / (1.0 - a)).clamp(0.0, 1.0)
}

/// Whether even every call standard would end after the deadline itself
/// (not its margin) at the slots measured: a fallback should take calls
/// too. False until a rate is measured, and without a deadline.
pub fn all_standard_too_slow(f: &PlanFacts) -> bool {
    let (Some(deadline), Some(rate)) = (f.deadline_ms, f.rate) else {
        return false;
    };
    if f.remaining == 0 {
        return false;
    }
    let left_s = deadline.saturating_sub(f.now_ms) as f64 / 1000.0;
    let a = f.flex_acceptance.clamp(0.0, 1.0);
    let slots = rate / (f.standard_share + (1.0 - f.standard_share) * a).max(0.01);
    left_s <= 0.0 || f.remaining as f64 > slots * left_s
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_800_000_000_000;

    fn facts(left_s: u64, remaining: u64, rate: f64, acceptance: f64, share: f64) -> PlanFacts {
        PlanFacts {
            now_ms: NOW,
            deadline_ms: Some(NOW + left_s * 1000),
            remaining,
            rate: Some(rate),
            flex_acceptance: acceptance,
            standard_share: share,
        }
    }

    #[test]
    fn deadlines_read_as_durations_or_instants() {
        assert_eq!(parse_deadline("90s", NOW), Ok(NOW + 90_000));
        assert_eq!(parse_deadline("1h30m", NOW), Ok(NOW + 5_400_000));
        assert_eq!(parse_deadline("2d", NOW), Ok(NOW + 172_800_000));
        assert_eq!(parse_deadline("2026-11-28T19:37:01Z", NOW), Ok(1_795_894_621_000));
        assert_eq!(parse_deadline("2026-11-28T21:37:01+02:00", NOW), Ok(1_795_894_621_000));
        assert_eq!(
            crate::manifest::rfc3339(parse_deadline("2000-02-29T00:00:00Z", 0).unwrap() / 1000),
            "2000-02-29T00:00:00Z"
        );
        for bad in [
            "",
            "6 hours",
            "0s",
            "12",
            "2026-13-01T00:00:00Z",
            "2026-12-01T25:00:00Z",
            "h",
        ] {
            let err = parse_deadline(bad, NOW).unwrap_err();
            assert!(err.contains("2026-12-07T18:00:00Z"), "{bad}: {err}");
        }
    }

    #[test]
    fn without_a_deadline_or_with_room_every_call_is_flex() {
        let none = PlanFacts {
            deadline_ms: None,
            ..facts(60, 1000, 1.0, 0.1, 0.0)
        };
        assert_eq!(standard_share(&none), 0.0);
        // 1,000 left, 10/s at 60% flex acceptance; an hour left: all flex.
        assert_eq!(standard_share(&facts(3600, 1000, 10.0, 0.6, 0.0)), 0.0);
        // Nothing measured yet: the share in force stays.
        let unmeasured = PlanFacts {
            rate: None,
            ..facts(100, 1000, 0.0, 0.6, 0.25)
        };
        assert_eq!(standard_share(&unmeasured), 0.25);
        // Measured, and nothing settled while flex refused nearly everything: standard.
        let stuck = PlanFacts {
            rate: Some(0.0),
            ..facts(3600, 1000, 0.0, 0.05, 0.0)
        };
        assert!((standard_share(&stuck) - 0.95).abs() < 1e-9);
    }

    #[test]
    fn the_share_is_the_least_that_ends_in_time() {
        // 10 records/s all on flex at 60% acceptance: 16.7 slots/s. 1,000
        // left in 100 s (90 s of room): 11.1/s needed, so p = (11.1/16.7 - 0.6) / 0.4.
        let p = standard_share(&facts(100, 1000, 10.0, 0.6, 0.0));
        let needed = 1000.0 / 90.0;
        let slots = 10.0 / 0.6;
        assert!((p - (needed / slots - 0.6) / 0.4).abs() < 1e-9, "{p}");
        assert!(p > 0.1 && p < 0.2, "{p}");
        // The same fleet measured at that share gives the same answer.
        let rate_at_p = slots * (p + (1.0 - p) * 0.6);
        let again = standard_share(&facts(100, 1000, rate_at_p, 0.6, p));
        assert!((again - p).abs() < 1e-9, "{again} vs {p}");
        // Tighter: more standard; too tight for anything: all standard.
        assert!(standard_share(&facts(80, 1000, 10.0, 0.6, 0.0)) > p);
        assert_eq!(standard_share(&facts(40, 1000, 10.0, 0.6, 0.0)), 1.0);
        // The last stretch is standard whatever the figures say.
        assert_eq!(standard_share(&facts(4, 1, 100.0, 1.0, 0.0)), 1.0);
        // Flex that refuses nothing is as fast as standard: no reason to pay more.
        assert_eq!(standard_share(&facts(40, 1000, 10.0, 1.0, 0.0)), 0.0);
    }

    #[test]
    fn a_fallback_is_needed_only_when_all_standard_misses_the_deadline_itself() {
        // 16.7 slots a second: 1,000 records take 60 s all standard.
        assert!(!all_standard_too_slow(&facts(80, 1000, 10.0, 0.6, 0.0)));
        // Inside the margin but on time: no fallback.
        assert!(!all_standard_too_slow(&facts(62, 1000, 10.0, 0.6, 0.0)));
        assert!(all_standard_too_slow(&facts(50, 1000, 10.0, 0.6, 0.0)));
        assert!(all_standard_too_slow(&facts(0, 1, 10.0, 0.6, 0.0)), "passed");
        let unmeasured = PlanFacts {
            rate: None,
            ..facts(1, 1000, 0.0, 0.6, 0.0)
        };
        assert!(!all_standard_too_slow(&unmeasured));
    }
}

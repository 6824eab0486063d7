//! A job's provider outage, shared by the fleet (see `outage.lua`): the
//! streak of calls failing transiently, whether the provider is taken for
//! down, and the lease of the one probe that checks it.

use std::collections::HashMap;
use std::time::Duration;

use redis::AsyncCommands;

use super::{RedisStore, StoreError};
use crate::keys;

/// When the fleet takes its provider for down, and how it probes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutageRules {
    /// Failed calls in a row, fleet-wide, before the provider is down.
    pub min_fails: u32,
    /// And no call answered for this long.
    pub window: Duration,
    /// The same for a streak of 429s only: at its own pace a fleet sees
    /// answers between its 429s; a provider refusing everything does not.
    pub window_429: Duration,
    /// The longest wait between two probes while the outage is young (see
    /// [`OutageRules::probe_wait`]).
    pub probe_every_max: Duration,
}

impl OutageRules {
    /// How long after the `probes`-th failed probe (1 for the first) the
    /// next may start, in an outage `age` old: doubling from 1 s up to
    /// `probe_every_max`, and past it as the outage lasts (a twelfth of its
    /// age, at most six times `probe_every_max`: 30 s by default, reached
    /// after 6 minutes). A long outage costs Redis and the provider less,
    /// and its end is seen at most a twelfth of its length late.
    /// `outage.lua` applies the same rule.
    pub fn probe_wait(&self, probes: u32, age: Duration) -> Duration {
        let max = self.probe_every_max.as_millis() as u64;
        let cap = (age.as_millis() as u64 / 12).clamp(max, 6 * max);
        Duration::from_millis((1000u64 << probes.min(20)).min(cap))
    }
}

impl Default for OutageRules {
    fn default() -> OutageRules {
        OutageRules {
            min_fails: 5,
            window: Duration::from_secs(2),
            window_429: Duration::from_secs(15),
            probe_every_max: Duration::from_secs(5),
        }
    }
}

/// A failed call as the fleet's streak records it.
#[derive(Debug, Clone, Copy)]
pub struct FailedCall<'a> {
    /// How long ago it was sent.
    pub took: Duration,
    /// Its cause code (`connect`, `timeout`, `http_503`, `rate_limited`...).
    pub cause: &'a str,
    pub rate_limited: bool,
    /// The provider's words (scrubbed), if it said any.
    pub message: &'a str,
    /// The redacted base URL it was sent to.
    pub base_url: &'a str,
    pub worker: &'a str,
    /// It was the probe of a provider taken for down.
    pub probe: bool,
    /// The probe's lease: a failed probe's worker holds the next probe's
    /// lease for this long from its start, and sends it without asking.
    pub lease: Duration,
}

/// What a failure made of the provider's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Noted {
    pub state: Provider,
    /// The start of the fleet's streak of failures, and now (Unix ms, Redis's clock).
    pub since_ms: u64,
    pub now_ms: u64,
    /// When the fleet last noted an answer (0: never, or not since a resume).
    pub answered_ms: u64,
    /// After a failed probe of a provider taken for down: when the next
    /// probe may start (Unix ms, Redis's clock; 0 otherwise); it is the
    /// failed probe's worker's to send.
    pub next_probe_ms: u64,
}

/// The provider, as the fleet's streak takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Provider {
    /// Not down (yet).
    Up,
    /// Down from this failure on.
    DownNow,
    /// Down before it.
    Down,
}

/// The job's provider outage as status, metrics and the console show it.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ProviderOutage {
    /// The provider is taken for down: the job waits for it.
    pub down: bool,
    /// Start of the streak of failed calls (Unix ms), 0 without one.
    pub since_ms: u64,
    /// Calls failed in the streak.
    pub failed_calls: u64,
    /// The last failure's cause and the provider's words.
    pub last_error: String,
    pub message: String,
    /// Where the calls went (redacted).
    pub base_url: String,
    /// When the next probe may start (Unix ms; while down).
    pub next_probe_ms: u64,
    /// Outages so far, and how long the last one that ended lasted.
    pub outages: u64,
    pub last_outage_ms: u64,
}

impl ProviderOutage {
    /// One line for people: `provider unavailable since <time>, last error
    /// <cause> from <base_url>: <words>` (None while the provider is up).
    pub fn waiting(&self) -> Option<String> {
        if !self.down {
            return None;
        }
        let mut line = format!(
            "provider unavailable since {} ({} calls failed), last error {} from {}",
            crate::manifest::rfc3339(self.since_ms / 1000),
            self.failed_calls,
            self.last_error,
            if self.base_url.is_empty() { "?" } else { &self.base_url },
        );
        if !self.message.is_empty() {
            line.push_str(&format!(": {}", self.message));
        }
        Some(line)
    }
}

fn num(h: &HashMap<String, String>, k: &str) -> u64 {
    h.get(k).and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// A script call's arguments when there are none beyond its verb.
const NO_ARGS: &[&str] = &[];

impl RedisStore {
    /// Adds a transiently failed call to the fleet's streak; it may take
    /// the provider for down (see `outage.lua`).
    pub async fn outage_failed(
        &self,
        job: &str,
        call: &FailedCall<'_>,
        rules: &OutageRules,
    ) -> Result<Noted, StoreError> {
        let (state, since_ms, now_ms, answered_ms, next_probe_ms): (u8, u64, u64, u64, u64) = self
            .scripts
            .outage
            .key(keys::outage(job))
            .arg("fail")
            .arg(call.took.as_millis() as u64)
            .arg(call.cause)
            .arg(u8::from(call.rate_limited))
            .arg(call.message)
            .arg(call.base_url)
            .arg(call.worker)
            .arg(rules.min_fails)
            .arg(rules.window.as_millis() as u64)
            .arg(rules.window_429.as_millis() as u64)
            .arg(rules.probe_every_max.as_millis() as u64)
            .arg(u8::from(call.probe))
            .arg(call.lease.as_millis() as u64)
            .invoke_async(&mut self.conn.clone())
            .await?;
        let state = match state {
            1 => {
                self.wake(job, super::Wake::Flags).await;
                Provider::DownNow
            }
            2 => Provider::Down,
            _ => Provider::Up,
        };
        Ok(Noted {
            state,
            since_ms,
            now_ms,
            answered_ms,
            next_probe_ms,
        })
    }

    /// Notes an answer: it ends the streak, and an outage (returned: the
    /// streak's start and now, Unix ms), waking the fleet.
    pub async fn outage_answered(&self, job: &str) -> Result<Option<(u64, u64)>, StoreError> {
        let (ended, since_ms, now_ms) = self.outage_verb(job, "ok", NO_ARGS).await?;
        if ended == 1 {
            self.wake(job, super::Wake::Flags).await;
            return Ok(Some((since_ms, now_ms)));
        }
        Ok(None)
    }

    /// Takes the lease of the probe of a provider taken for down, for
    /// `lease`: Ok when `worker` may send it (or the provider is up), else
    /// how long until it may ask again (the next probe's start, or the end
    /// of the lease another worker's failed probe left it).
    pub async fn outage_probe(
        &self,
        job: &str,
        lease: Duration,
        worker: &str,
    ) -> Result<Result<(), Duration>, StoreError> {
        let (granted, at, now) = self
            .outage_verb(job, "probe", (lease.as_millis() as u64, worker))
            .await?;
        Ok(if granted == 1 {
            Ok(())
        } else {
            Err(Duration::from_millis(at.saturating_sub(now)))
        })
    }

    /// A stopping `worker` gives back the next probe's lease its failed
    /// probe left it: true when it held it.
    pub async fn outage_leave(&self, job: &str, worker: &str) -> Result<bool, StoreError> {
        let (held, _, _) = self.outage_verb(job, "leave", worker).await?;
        Ok(held == 1)
    }

    /// Gives back a probe's lease that found nothing to send.
    pub async fn outage_unprobe(&self, job: &str) -> Result<(), StoreError> {
        self.outage_verb(job, "unprobe", NO_ARGS).await?;
        Ok(())
    }

    /// `outage.lua`'s `verb` (other than `fail`) on `job`'s outage with
    /// `args`: its answer `{flag, ms, now}`.
    async fn outage_verb(
        &self,
        job: &str,
        verb: &str,
        args: impl redis::ToRedisArgs,
    ) -> Result<(u8, u64, u64), StoreError> {
        Ok(self
            .scripts
            .outage
            .key(keys::outage(job))
            .arg(verb)
            .arg(args)
            .invoke_async(&mut self.conn.clone())
            .await?)
    }

    /// The job's provider outage as Redis holds it (all zero when no call failed).
    pub async fn provider_outage(&self, job: &str) -> Result<ProviderOutage, StoreError> {
        let h: HashMap<String, String> = self.conn.clone().hgetall(keys::outage(job)).await?;
        let text = |k: &str| h.get(k).cloned().unwrap_or_default();
        let down = h.get("down").is_some_and(|v| v == "1");
        let streak = num(&h, "since_ms") > num(&h, "ok_ms");
        Ok(ProviderOutage {
            down,
            since_ms: if down || streak { num(&h, "since_ms") } else { 0 },
            failed_calls: if down || streak { num(&h, "fails") } else { 0 },
            last_error: text("cause"),
            message: text("message"),
            base_url: text("base_url"),
            next_probe_ms: if down { num(&h, "probe_at") } else { 0 },
            outages: num(&h, "outages"),
            last_outage_ms: num(&h, "last_outage_ms"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_double_to_the_cap_which_grows_with_the_outage_to_six_times() {
        let rules = OutageRules::default();
        let s = |secs| Duration::from_secs(secs);
        let young = s(10);
        let waits: Vec<u64> = (1..=5).map(|p| rules.probe_wait(p, young).as_secs()).collect();
        assert_eq!(waits, [2, 4, 5, 5, 5]);
        // A twelfth of the outage's age once it is past the cap: 2 min -> 10 s.
        assert_eq!(rules.probe_wait(9, s(120)), s(10));
        // At most six times the cap (after 6 minutes), however long it lasts.
        assert_eq!(rules.probe_wait(9, s(360)), s(30));
        assert_eq!(rules.probe_wait(30, s(86_400)), s(30));
        // The doubling still applies first.
        assert_eq!(rules.probe_wait(1, s(86_400)), s(2));
    }
}

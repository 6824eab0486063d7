//! Provider outages: windows in which every chat request is answered the
//! way a real provider answers during an incident (REFERENCE.md, "Outages
//! seen in the wild"): 503s, requests accepted and never answered (an
//! overloaded GPU server), connections reset mid-body (a proxy restarting),
//! or 429s for want of capacity with no hint of when to come back. A
//! listener that is gone altogether is the process stopped (a test kills it
//! by pid and starts it again on the same port).
//!
//! An outage starts from the command line once the server has answered a
//! number of requests (`--outage MODE:AFTER:SECS`: mid-job, after answering),
//! or at once from `POST /admin/outage`; it ends by itself after its
//! seconds, or when `/admin/outage` says so.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

/// How the server fails while an outage lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// 503 `overloaded` with `retry-after: 0.2`, as an incident page says.
    Unavailable,
    /// The request is accepted and never answered (held `--hang-secs`).
    Hang,
    /// A 200's headers and half its body, then the connection is cut.
    Reset,
    /// 429 with no retry hint at all: the provider has no capacity (not a
    /// limit of this client's pace), as a proxy in front of a saturated model says.
    Capacity,
}

impl Mode {
    const ALL: &[Mode] = &[Mode::Unavailable, Mode::Hang, Mode::Reset, Mode::Capacity];

    pub fn name(self) -> &'static str {
        match self {
            Mode::Unavailable => "unavailable",
            Mode::Hang => "hang",
            Mode::Reset => "reset",
            Mode::Capacity => "capacity",
        }
    }

    fn parse(s: &str) -> Result<Mode, String> {
        Mode::ALL.iter().copied().find(|m| m.name() == s).ok_or_else(|| {
            let known: Vec<&str> = Mode::ALL.iter().map(|m| m.name()).collect();
            format!("unknown outage mode `{s}` (known: {})", known.join(", "))
        })
    }
}

/// One outage of `--outage`: its mode, the answers served before it starts, its length.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Plan {
    pub mode: Mode,
    pub after_answers: u64,
    pub secs: f64,
}

/// Parses `MODE:AFTER:SECS[,MODE:AFTER:SECS...]` (each starts once `AFTER`
/// requests were answered in all, and lasts `SECS`).
pub fn parse_plans(spec: &str) -> Result<Vec<Plan>, String> {
    let mut plans = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let fields: Vec<&str> = part.split(':').collect();
        let [mode, after, secs] = fields.as_slice() else {
            return Err(format!("--outage: `{part}` is not MODE:AFTER_ANSWERS:SECS"));
        };
        let mode = Mode::parse(mode).map_err(|e| format!("--outage: {e}"))?;
        let after_answers = after
            .parse()
            .map_err(|_| format!("--outage: `{after}` is not a number of answers"))?;
        let secs: f64 = secs
            .parse()
            .ok()
            .filter(|s: &f64| s.is_finite() && *s > 0.0)
            .ok_or_else(|| format!("--outage: `{secs}` is not a positive number of seconds"))?;
        plans.push(Plan {
            mode,
            after_answers,
            secs,
        });
    }
    plans.sort_by_key(|p| p.after_answers);
    Ok(plans)
}

/// The outages of one server: those planned, the one under way, and what they refused.
#[derive(Default)]
pub struct Outages {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    planned: Vec<Plan>,
    /// The outage under way and when it ends (None: until told).
    active: Option<(Mode, Option<Instant>)>,
    /// Requests refused by outages, by mode.
    refused: BTreeMap<&'static str, u64>,
    /// Outages started so far.
    started: u64,
}

impl Outages {
    pub fn new(planned: Vec<Plan>) -> Outages {
        Outages {
            state: Mutex::new(State {
                planned,
                ..State::default()
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The outage a request arriving now meets (`answered`: requests answered
    /// so far), counted as refused by it.
    pub fn meet(&self, answered: u64) -> Option<Mode> {
        let mut s = self.lock();
        let now = Instant::now();
        if let Some((_, Some(until))) = s.active
            && now >= until
        {
            s.active = None;
        }
        if s.active.is_none() && s.planned.first().is_some_and(|p| answered >= p.after_answers) {
            let plan = s.planned.remove(0);
            s.active = Some((plan.mode, Some(now + Duration::from_secs_f64(plan.secs))));
            s.started += 1;
        }
        let (mode, _) = s.active?;
        *s.refused.entry(mode.name()).or_default() += 1;
        Some(mode)
    }

    /// `POST /admin/outage`: `{"mode": "hang", "secs": 20}` starts one now
    /// (without `secs`: until told), `{"mode": null}` ends the one under way.
    pub fn set(&self, body: &Value) -> Result<(), String> {
        let mut s = self.lock();
        match body["mode"].as_str() {
            None => s.active = None,
            Some(m) => {
                let mode = Mode::parse(m)?;
                let until = body["secs"]
                    .as_f64()
                    .filter(|x| x.is_finite() && *x > 0.0)
                    .map(|x| Instant::now() + Duration::from_secs_f64(x));
                s.active = Some((mode, until));
                s.started += 1;
            }
        }
        Ok(())
    }

    /// For `GET /stats`: the outage under way, how many started, what they refused.
    pub fn stats(&self) -> Value {
        let s = self.lock();
        let active = s
            .active
            .filter(|(_, until)| until.is_none_or(|u| Instant::now() < u))
            .map(|(m, _)| m.name());
        json!({"active": active, "started": s.started, "refused": s.refused})
    }
}

/// The answer a request gets from an outage in `mode`.
pub async fn answer(mode: Mode, hang_secs: u64) -> Response {
    match mode {
        Mode::Unavailable => {
            let mut r = error(
                StatusCode::SERVICE_UNAVAILABLE,
                "The server is temporarily unavailable. Please try again later.",
                "server_error",
                "service_unavailable",
            );
            r.headers_mut().insert("retry-after", HeaderValue::from_static("0.2"));
            r
        }
        Mode::Capacity => error(
            StatusCode::TOO_MANY_REQUESTS,
            "The model is at capacity. Please try again later.",
            "server_error",
            "rate_limit_exceeded",
        ),
        Mode::Hang => {
            // Accepted, never answered: the client must give up first.
            tokio::time::sleep(Duration::from_secs(hang_secs)).await;
            error(StatusCode::GATEWAY_TIMEOUT, "timeout", "server_error", "timeout")
        }
        Mode::Reset => {
            // The status and part of a body, then the connection is dropped
            // (hyper aborts it when the body fails mid-way).
            let half = Bytes::from_static(
                b"{\"id\":\"chatcmpl-reset\",\"object\":\"chat.completion\",\"choices\":[{\"index\":0,",
            );
            // The first half is flushed to the client before the cut.
            let parts = futures_util::stream::unfold(0u8, move |step| {
                let half = half.clone();
                async move {
                    match step {
                        0 => Some((Ok(half), 1)),
                        1 => {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            let cut = std::io::Error::new(
                                std::io::ErrorKind::ConnectionReset,
                                "llm-sim: connection reset mid-body",
                            );
                            Some((Err(cut), 2))
                        }
                        _ => None,
                    }
                }
            });
            let body = Body::from_stream(parts);
            (
                StatusCode::OK,
                [("content-type", "application/json"), ("content-length", "400")],
                body,
            )
                .into_response()
        }
    }
}

fn error(status: StatusCode, message: &str, kind: &str, code: &str) -> Response {
    (
        status,
        axum::Json(json!({"error": {"message": message, "type": kind, "code": code, "param": null}})),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_parse_in_start_order_and_bad_ones_are_named() {
        let p = parse_plans("hang:50:20, unavailable:10:2.5").unwrap();
        assert_eq!(
            p,
            vec![
                Plan {
                    mode: Mode::Unavailable,
                    after_answers: 10,
                    secs: 2.5
                },
                Plan {
                    mode: Mode::Hang,
                    after_answers: 50,
                    secs: 20.0
                }
            ]
        );
        assert!(
            parse_plans("down:1:2")
                .unwrap_err()
                .contains("known: unavailable, hang, reset, capacity")
        );
        assert!(parse_plans("hang:x:2").unwrap_err().contains("`x`"));
        assert!(parse_plans("hang:1:0").unwrap_err().contains("positive"));
        assert!(parse_plans("hang:1").unwrap_err().contains("MODE:AFTER_ANSWERS:SECS"));
    }

    #[test]
    fn a_planned_outage_starts_after_its_answers_and_ends_after_its_seconds() {
        let o = Outages::new(parse_plans("reset:3:0.2").unwrap());
        assert_eq!(o.meet(2), None);
        assert_eq!(o.meet(3), Some(Mode::Reset));
        assert_eq!(o.meet(3), Some(Mode::Reset));
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(o.meet(3), None, "over after its seconds, and not started again");
        assert_eq!(o.stats()["refused"]["reset"], 2);
        assert_eq!(o.stats()["started"], 1);
    }

    #[test]
    fn the_admin_call_starts_and_ends_an_outage() {
        let o = Outages::default();
        o.set(&json!({"mode": "capacity"})).unwrap();
        assert_eq!(o.meet(0), Some(Mode::Capacity));
        assert_eq!(o.stats()["active"], "capacity");
        o.set(&json!({"mode": null})).unwrap();
        assert_eq!(o.meet(0), None);
        assert!(o.set(&json!({"mode": "down"})).is_err());
    }
}

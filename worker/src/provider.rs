//! The OpenAI-compatible chat completions client and the classification of
//! everything it can get back into a [`CallResult`]: HTTP and request forms
//! only. What an answer comes to for the record is [`crate::judge`]'s.

use std::borrow::Cow;
use std::time::{Duration, Instant};

use common::spec::JobSpec;
use common::task::Usage;
use reqwest::StatusCode;
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};
use serde::Serialize;
use serde_json::Value;
use serde_json::value::RawValue;

use crate::limiter::{RateHeaders, rate_headers};

/// What one call returned, before validation.
#[derive(Debug, Clone)]
pub enum CallResult {
    /// A 200 with a message.
    Message {
        /// The provider's id of this completion (`id`), for the audit trail.
        response_id: Option<String>,
        content: String,
        finish_reason: String,
        refusal: Option<String>,
        usage: Option<Usage>,
    },
    /// Anything else, already classified.
    Failed(CallError),
}

/// A failed call and what kind of failure it is.
#[derive(Debug, Clone, PartialEq)]
pub struct CallError {
    pub kind: ErrorKind,
    /// A bounded cause code: `timeout`, `connect`, `http_503`, `insufficient_quota`...
    pub cause: String,
    pub status: Option<u16>,
    pub retry_after_ms: Option<u64>,
    /// The provider's own words (its error message, bounded; secrets were
    /// scrubbed from the body before), kept in the history and review entry.
    pub message: Option<String>,
}

impl CallError {
    /// What identifies the same error on every record: the cause and the
    /// provider's error code (or type, or its message without numbers and quotes).
    pub fn signature(&self) -> String {
        let class: String = self
            .message
            .as_deref()
            .unwrap_or("")
            .chars()
            .filter(|c| !c.is_ascii_digit() && !matches!(c, '\'' | '"' | '`'))
            .take(48)
            .collect();
        format!("{}:{}", self.cause, class.trim())
    }
}

/// Longest provider message kept.
const MESSAGE_CAP: usize = 300;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    Transient,
    RateLimited,
    Permanent,
    FleetHalt,
}

/// The headers that tell a provider's or proxy's log which delivery sent a request.
const RECORD_HEADER: HeaderName = HeaderName::from_static("x-batchfleet-record");
const WORKER_HEADER: HeaderName = HeaderName::from_static("x-batchfleet-worker");

/// A chat request body, its keys in the order they were always sent (the
/// fingerprints of answers already stored hash these bytes).
#[derive(Serialize)]
struct Body<'a> {
    model: &'a str,
    messages: Vec<Message<'a>>,
    max_tokens: u32,
    temperature: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    response_format: Option<&'a Value>,
    /// The tier (`provider.tiers`): last, and only when the job names tiers.
    #[serde(skip_serializing_if = "Option::is_none")]
    service_tier: Option<&'static str>,
}

#[derive(Serialize)]
struct Message<'a> {
    role: &'static str,
    content: Cow<'a, str>,
}

/// One chat request's parts.
pub struct Request<'a> {
    pub system: &'a str,
    /// The rendered user prompt.
    pub user: &'a str,
    /// The validator's feedback on the previous answer, and that answer
    /// (sent as the assistant's message before the feedback).
    pub feedback: Option<&'a str>,
    pub previous: Option<&'a str>,
    /// This attempt's temperature (None: the spec's).
    pub temperature: Option<f64>,
    pub response_format: Option<&'a Value>,
    /// The record and the worker, sent as `x-batchfleet-record` and
    /// `x-batchfleet-worker` (so a provider's or proxy's log can tell which
    /// delivery sent each request).
    pub record: &'a str,
    pub worker: &'a str,
    /// The `service_tier` asked for (None: none named, the provider's default).
    pub service_tier: Option<&'static str>,
}

/// A client for one job's provider settings.
#[derive(Clone)]
pub struct Provider {
    http: reqwest::Client,
    /// The base URL (`.../v1`) and its chat completions endpoint.
    base: String,
    /// The base URL without credentials, query or fragment (every
    /// attempt's trail names it: redacted once, not once a call).
    endpoint: String,
    /// Parsed once (one that does not parse is refused by each call, as
    /// reqwest refuses it).
    url: Result<reqwest::Url, String>,
    /// `Authorization: Bearer <key>`, made once and marked sensitive (None:
    /// no key, and no header, for a server that takes none; or a key that is
    /// no valid header value, and each call fails on it as before).
    auth: Option<HeaderValue>,
    timeout: Duration,
    model: String,
    api_key: String,
    max_tokens: u32,
    temperature: f64,
    /// Removes the API keys and the Redis password from whatever the provider sends back.
    scrubber: common::secret::Scrubber,
}

impl Provider {
    /// `base_url` overrides the spec's (the demo points jobs at llm-sim).
    pub fn new(spec: &JobSpec, base_url: Option<&str>, api_key: String) -> Result<Provider, reqwest::Error> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(spec.provider.timeout_secs))
            .connect_timeout(Duration::from_secs(10))
            .pool_max_idle_per_host(1024)
            // The key goes to the configured base URL and nowhere else: a
            // redirect is an answer (it halts the fleet), never followed.
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        let base = base_url.unwrap_or(&spec.provider.base_url).trim_end_matches('/');
        let url = format!("{base}/chat/completions");
        // A server that takes no key gets no header (an empty key).
        let key = (!api_key.is_empty()).then_some(&api_key);
        let auth = key
            .and_then(|k| HeaderValue::try_from(format!("Bearer {k}")).ok())
            .map(|mut v| {
                v.set_sensitive(true);
                v
            });
        Ok(Provider {
            http,
            base: base.to_owned(),
            endpoint: common::secret::redact_url(base),
            url: reqwest::Url::parse(&url).map_err(|_| url),
            auth,
            timeout: Duration::from_secs(spec.provider.timeout_secs),
            model: spec.provider.model.clone(),
            api_key,
            max_tokens: spec.provider.max_tokens,
            temperature: spec.provider.temperature,
            scrubber: common::secret::Scrubber::default(),
        })
    }

    /// Secrets to remove from every answer before anything reads it (a
    /// provider or proxy may echo the request's Authorization header).
    pub fn set_scrubber(&mut self, scrubber: common::secret::Scrubber) {
        self.scrubber = scrubber;
    }

    /// A client of the same provider's Batch API (batch mode).
    pub fn batch_api(&self) -> Result<crate::batch_api::BatchApi, reqwest::Error> {
        crate::batch_api::BatchApi::new(&self.base, self.api_key.clone(), self.timeout, self.scrubber.clone())
    }

    /// The request body: system and user messages, and after an invalid
    /// answer that answer (as the assistant) and the validator's feedback.
    ///
    /// Serialized once, here: its bytes are what is sent and what the
    /// fingerprint hashes (the response format is written from the form,
    /// never copied).
    pub fn body(&self, req: &Request<'_>) -> Box<RawValue> {
        let message = |role, content| Message { role, content };
        let mut messages = vec![message("system", Cow::Borrowed(req.system))];
        match (req.feedback, req.previous) {
            (Some(f), Some(prev)) => {
                messages.push(message("user", Cow::Borrowed(req.user)));
                messages.push(message("assistant", Cow::Borrowed(prev)));
                messages.push(message("user", Cow::Borrowed(f)));
            }
            (Some(f), None) => messages.push(message("user", Cow::Owned(format!("{}\n\n{f}", req.user)))),
            (None, _) => messages.push(message("user", Cow::Borrowed(req.user))),
        }
        let body = Body {
            model: &self.model,
            messages,
            max_tokens: self.max_tokens,
            temperature: req.temperature.unwrap_or(self.temperature),
            response_format: req.response_format,
            service_tier: req.service_tier,
        };
        serde_json::value::to_raw_value(&body).expect("a request body of strings and numbers serializes")
    }

    /// A request body passed through from the record (`prompt.request_field`):
    /// sent as given, with the provider's `model` and `max_tokens` where it
    /// names none, `stream` off, and after an invalid answer that answer
    /// (as the assistant) and the validator's feedback appended to its
    /// messages; `response_format` (the job's structured output) where it
    /// sets none; `service_tier` (the plan's) where it names none; to a
    /// fallback (`on_fallback`), the fallback's `model` and no tier. Returns
    /// the body, the completion tokens it allows and whether
    /// `response_format` went in; an error names what the record's request lacks.
    pub fn passthrough_body(
        &self,
        request: Option<&Value>,
        field: &str,
        retry: Option<(&str, &str)>,
        response_format: Option<&Value>,
        (service_tier, on_fallback): (Option<&str>, bool),
    ) -> Result<(Box<RawValue>, u64, bool), String> {
        let Some(Value::Object(request)) = request else {
            return Err(format!("request_missing:{field}"));
        };
        let mut body = request.clone();
        let has_messages = body
            .get("messages")
            .and_then(Value::as_array)
            .is_some_and(|a| !a.is_empty());
        if !has_messages {
            return Err(format!("request_without_messages:{field}"));
        }
        if on_fallback {
            // The record's model is the provider's name for it, not the fallback's.
            body.insert("model".into(), Value::from(self.model.as_str()));
            body.remove("service_tier");
        }
        body.entry("model").or_insert_with(|| Value::from(self.model.as_str()));
        if body.get("stream").is_some() {
            body.insert("stream".into(), Value::Bool(false));
        }
        let named = ["max_completion_tokens", "max_tokens"]
            .iter()
            .find_map(|k| body.get(*k).and_then(Value::as_u64));
        let max_tokens = match named {
            Some(n) => n,
            None => {
                body.insert("max_tokens".into(), Value::from(self.max_tokens));
                u64::from(self.max_tokens)
            }
        };
        if let (Some((previous, feedback)), Some(Value::Array(messages))) = (retry, body.get_mut("messages")) {
            messages.push(serde_json::json!({"role": "assistant", "content": previous}));
            messages.push(serde_json::json!({"role": "user", "content": feedback}));
        }
        if let Some(tier) = service_tier {
            body.entry("service_tier").or_insert_with(|| Value::from(tier));
        }
        let formatted = match response_format {
            Some(rf) if !body.contains_key("response_format") => {
                body.insert("response_format".into(), rf.clone());
                true
            }
            _ => false,
        };
        let raw = serde_json::value::to_raw_value(&body).map_err(|e| format!("request_unencodable:{e}"))?;
        Ok((raw, max_tokens, formatted))
    }

    /// Sends one request body (see [`Provider::body`]) for `record`, from
    /// `worker` (its headers). Never returns an error: every failure is
    /// classified. Also returns the rate-limit headers and the response's
    /// body (secrets it echoed replaced), when there was a response.
    pub async fn call(&self, record: &str, worker: &str, body: &RawValue) -> Called {
        let started = Instant::now();
        let request = match &self.url {
            Ok(url) => self.http.post(url.clone()),
            Err(url) => self.http.post(url.as_str()),
        };
        let request = match &self.auth {
            Some(auth) => request.header(AUTHORIZATION, auth.clone()),
            // A server that takes no key gets no header.
            None if self.api_key.is_empty() => request,
            None => request.bearer_auth(&self.api_key),
        };
        let sent = request
            .header(RECORD_HEADER, record)
            .header(WORKER_HEADER, worker)
            .header(CONTENT_TYPE, "application/json")
            .body(body.get().to_owned())
            .send()
            .await;
        let mut limits = RateHeaders::default();
        let mut kept = None;
        let result = match sent {
            Err(e) => CallResult::Failed(transport_error(&e)),
            Ok(resp) => {
                let status = resp.status();
                let headers = resp.headers().clone();
                limits = rate_headers(&headers);
                match resp.text().await {
                    Err(e) => CallResult::Failed(transport_error(&e)),
                    Ok(text) => {
                        let text = self.scrubber.scrub(&text);
                        let result = classify(status, &headers, &text);
                        kept = Some(text);
                        result
                    }
                }
            }
        };
        Called {
            result,
            headers: limits,
            elapsed: started.elapsed(),
            body: kept,
        }
    }

    /// Where the job's calls go, for the audit trail: the base URL without
    /// credentials, query or fragment.
    pub fn endpoint(&self) -> String {
        self.endpoint.clone()
    }

    pub fn model(&self) -> &str {
        &self.model
    }

    /// The key it sends (for the scrubber: never logged).
    pub fn key(&self) -> &str {
        &self.api_key
    }
}

/// What [`Provider::call`] got back.
pub struct Called {
    pub result: CallResult,
    pub headers: RateHeaders,
    pub elapsed: Duration,
    /// The response's body as kept (secrets it echoed replaced).
    pub body: Option<String>,
}

fn transport_error(e: &reqwest::Error) -> CallError {
    let cause = if e.is_timeout() {
        "timeout"
    } else if e.is_connect() {
        "connect"
    } else {
        "transport"
    };
    CallError {
        kind: ErrorKind::Transient,
        cause: cause.into(),
        status: None,
        retry_after_ms: None,
        message: None,
    }
}

/// A request body's fingerprint: two requests with the same one would get
/// the same answer from a deterministic model.
pub fn fingerprint(body: &RawValue) -> String {
    use sha2::{Digest, Sha256};
    let mut h = hex::encode(Sha256::digest(body.get().as_bytes()));
    h.truncate(16);
    h
}

/// Classifies a response by status, then by the body's `error.code`/`type`
/// (two different 429s), with `x-should-retry` overriding.
pub fn classify(status: StatusCode, headers: &HeaderMap, text: &str) -> CallResult {
    let retry_after_ms = retry_after_ms(headers);
    let body: Value = serde_json::from_str(text).unwrap_or(Value::Null);
    let message = (!status.is_success()).then(|| {
        let m = body["error"]["message"]
            .as_str()
            .map(str::to_owned)
            .or_else(|| body["error"].as_str().map(str::to_owned))
            .or_else(|| body["detail"].as_str().map(str::to_owned))
            .unwrap_or_else(|| text.trim().to_owned());
        let m: String = m.chars().filter(|c| !c.is_control()).take(MESSAGE_CAP).collect();
        (!m.is_empty()).then_some(m)
    });
    let message = message.flatten();
    let fail = |kind, cause: String| {
        CallResult::Failed(CallError {
            kind,
            cause,
            status: Some(status.as_u16()),
            retry_after_ms,
            message: message.clone(),
        })
    };
    if status.is_success() {
        if text.trim().is_empty() {
            return fail(ErrorKind::Transient, "empty_body".into());
        }
        // Parsed once, above: a body that is not JSON reads as null.
        if body.is_null() {
            return fail(ErrorKind::Transient, "bad_body".into());
        }
        let v = &body;
        let choice = &v["choices"][0];
        let message = &choice["message"];
        if message.is_null() {
            return fail(ErrorKind::Transient, "no_choices".into());
        }
        return CallResult::Message {
            response_id: v["id"].as_str().map(str::to_owned),
            content: message["content"].as_str().unwrap_or("").to_owned(),
            finish_reason: choice["finish_reason"].as_str().unwrap_or("").to_owned(),
            refusal: message["refusal"].as_str().filter(|r| !r.is_empty()).map(str::to_owned),
            usage: v.get("usage").and_then(Usage::from_provider),
        };
    }
    let code = body["error"]["code"]
        .as_str()
        .or(body["error"]["type"].as_str())
        .unwrap_or("");
    let should_retry = headers.get("x-should-retry").and_then(|v| v.to_str().ok());
    let s = status.as_u16();
    // A flex tier without capacity (OpenAI, Azure, Gemini: 429
    // `resource_unavailable`; Groq: 498) is no rate limit: it must not slow
    // the fleet's pace nor pause it; it waits and is retried as the world's.
    let flex_full = s == 498 || (s == 429 && code == "resource_unavailable");
    let mut kind = match s {
        401 | 403 | 300..=399 => ErrorKind::FleetHalt,
        429 if code == "insufficient_quota" || body["error"]["type"] == "insufficient_quota" => ErrorKind::FleetHalt,
        _ if flex_full => ErrorKind::Transient,
        429 => ErrorKind::RateLimited,
        408 | 409 | 500..=599 => ErrorKind::Transient,
        _ => ErrorKind::Permanent,
    };
    if kind != ErrorKind::FleetHalt {
        match should_retry {
            Some("true") if kind == ErrorKind::Permanent => kind = ErrorKind::Transient,
            Some("false") if kind == ErrorKind::Transient => kind = ErrorKind::Permanent,
            _ => {}
        }
    }
    let cause = match (kind, code) {
        (ErrorKind::FleetHalt, "insufficient_quota") => "insufficient_quota".to_owned(),
        (ErrorKind::FleetHalt, _) if status.is_redirection() => format!("redirect_{s}_refused"),
        (ErrorKind::RateLimited, _) => "rate_limited".to_owned(),
        (ErrorKind::Transient, _) if flex_full => "flex_unavailable".to_owned(),
        _ => format!("http_{s}"),
    };
    fail(kind, cause)
}

/// The retry hint, in the order the official SDK reads them: `retry-after-ms`,
/// then `retry-after` as (fractional) seconds or as an HTTP date; each also
/// as a proxy copies it (`llm_provider-retry-after`, LiteLLM). Nonsense and
/// waits over an hour are ignored.
pub fn retry_after_ms(headers: &HeaderMap) -> Option<u64> {
    let get = |k: &str| crate::limiter::provider_header(headers, k);
    if let Some(ms) = get("retry-after-ms").and_then(|v| v.parse::<f64>().ok())
        && ms.is_finite()
        && (0.0..=3_600_000.0).contains(&ms)
    {
        return Some(ms.ceil() as u64);
    }
    let v = get("retry-after")?;
    if let Ok(s) = v.parse::<f64>() {
        return (s.is_finite() && (0.0..=3600.0).contains(&s)).then(|| (s * 1000.0).ceil() as u64);
    }
    let at = http_date_ms(v)?;
    let now = crate::clock::now_ms();
    Some(at.saturating_sub(now)).filter(|&ms| ms <= 3_600_000)
}

/// Unix ms of an IMF-fixdate (`Wed, 21 Oct 2015 07:28:00 GMT`), the HTTP date form.
fn http_date_ms(v: &str) -> Option<u64> {
    let parts: Vec<&str> = v.split_whitespace().collect();
    let [_, day, month, year, time, "GMT"] = parts.as_slice() else {
        return None;
    };
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let mo = MONTHS.iter().position(|m| m == month)? as i64 + 1;
    let (d, y): (i64, i64) = (day.parse().ok()?, year.parse().ok()?);
    let hms: Vec<i64> = time.split(':').map(|x| x.parse().ok()).collect::<Option<_>>()?;
    let [h, mi, se] = hms.as_slice() else { return None };
    // days from civil (proleptic Gregorian)
    let yy = if mo <= 2 { y - 1 } else { y };
    let era = yy.div_euclid(400);
    let yoe = yy - era * 400;
    let doy = (153 * ((mo + 9) % 12) + 2) / 5 + d - 1;
    let days = era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468;
    u64::try_from((days * 86_400 + h * 3600 + mi * 60 + se) * 1000).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    fn kind_of(status: u16, h: &HeaderMap, body: &str) -> (ErrorKind, String) {
        match classify(StatusCode::from_u16(status).unwrap(), h, body) {
            CallResult::Failed(e) => (e.kind, e.cause),
            other => panic!("{other:?}"),
        }
    }

    /// The body as it was built before it was serialized in one step: a
    /// `Value`, printed. Answers stored before keep their fingerprints.
    fn body_as_value(p: &Provider, req: &Request<'_>) -> String {
        use serde_json::json;
        let mut messages = vec![json!({"role": "system", "content": req.system})];
        match (req.feedback, req.previous) {
            (Some(f), Some(prev)) => {
                messages.push(json!({"role": "user", "content": req.user}));
                messages.push(json!({"role": "assistant", "content": prev}));
                messages.push(json!({"role": "user", "content": f}));
            }
            (Some(f), None) => messages.push(json!({"role": "user", "content": format!("{}\n\n{f}", req.user)})),
            (None, _) => messages.push(json!({"role": "user", "content": req.user})),
        }
        let mut body = json!({
            "model": p.model,
            "messages": messages,
            "max_tokens": p.max_tokens,
            "temperature": req.temperature.unwrap_or(p.temperature),
        });
        if let Some(rf) = req.response_format {
            body["response_format"] = rf.clone();
        }
        body.to_string()
    }

    #[test]
    fn the_body_is_byte_for_byte_what_the_value_form_printed() {
        let text =
            include_str!("../../examples/job.toml").replace("structured_output = true", "structured_output = \"auto\"");
        let spec = JobSpec::parse(&text, "job.toml").unwrap();
        let p = Provider::new(&spec, Some("http://127.0.0.1:9/v1"), "sk-test".into()).unwrap();
        let forms = crate::form::Forms::new(&spec, "http://127.0.0.1:9/v1", None);
        // The spec's fields as a JSON schema: nested objects, arrays, numbers.
        let schema = forms.current().1.cloned();
        assert!(
            schema.as_ref().is_some_and(|s| s["type"] == "json_schema"),
            "{schema:?}"
        );
        let object = serde_json::json!({"type": "json_object"});
        let odd = "quote \" backslash \\ newline \n tab \t control \u{1} emoji \u{1F600} </script>";
        let shapes: [(Option<&str>, Option<&str>); 3] =
            [(None, None), (Some("fix: x"), None), (Some(odd), Some("{\"a\": 1}"))];
        let mut seen = std::collections::HashSet::new();
        for (feedback, previous) in shapes {
            for rf in [None, schema.as_ref(), Some(&object)] {
                for temperature in [None, Some(0.35), Some(1.0), Some(1e-7)] {
                    let req = Request {
                        system: "You label messages.",
                        user: odd,
                        feedback,
                        previous,
                        temperature,
                        response_format: rf,
                        record: "r1",
                        worker: "w1",
                        service_tier: None,
                    };
                    let body = p.body(&req);
                    assert_eq!(body.get(), body_as_value(&p, &req));
                    assert_eq!(fingerprint(&body).len(), 16);
                    seen.insert(fingerprint(&body));
                }
            }
        }
        // Every shape, form and temperature is a request of its own.
        assert_eq!(seen.len(), 3 * 3 * 4);
    }

    #[test]
    fn the_two_429s_are_told_apart_by_the_body() {
        let quota = r#"{"error": {"code": "insufficient_quota", "type": "insufficient_quota"}}"#;
        let rate = r#"{"error": {"code": "rate_limit_exceeded", "type": "requests"}}"#;
        assert_eq!(
            kind_of(429, &HeaderMap::new(), quota),
            (ErrorKind::FleetHalt, "insufficient_quota".into())
        );
        assert_eq!(
            kind_of(429, &HeaderMap::new(), rate),
            (ErrorKind::RateLimited, "rate_limited".into())
        );
        // A flex tier without capacity is no rate limit (the fleet's pace
        // and the learned limits stay): the world's, retried, no attempt.
        let flex = r#"{"error": {"code": "resource_unavailable", "type": "server_error"}}"#;
        assert_eq!(
            kind_of(429, &HeaderMap::new(), flex),
            (ErrorKind::Transient, "flex_unavailable".into())
        );
        assert_eq!(
            kind_of(498, &HeaderMap::new(), "{}"),
            (ErrorKind::Transient, "flex_unavailable".into())
        );
    }

    #[test]
    fn statuses_map_to_kinds() {
        let h = HeaderMap::new();
        assert_eq!(kind_of(401, &h, "").0, ErrorKind::FleetHalt);
        assert_eq!(kind_of(403, &h, "").0, ErrorKind::FleetHalt);
        assert_eq!(kind_of(500, &h, "").0, ErrorKind::Transient);
        assert_eq!(kind_of(503, &h, "").1, "http_503");
        assert_eq!(kind_of(408, &h, "").0, ErrorKind::Transient);
        assert_eq!(kind_of(400, &h, "").0, ErrorKind::Permanent);
        assert_eq!(
            kind_of(400, &headers(&[("x-should-retry", "true")]), "").0,
            ErrorKind::Transient
        );
        assert_eq!(
            kind_of(503, &headers(&[("x-should-retry", "false")]), "").0,
            ErrorKind::Permanent
        );
    }

    #[test]
    fn empty_and_broken_200s_are_transient() {
        assert_eq!(
            kind_of(200, &HeaderMap::new(), "  "),
            (ErrorKind::Transient, "empty_body".into())
        );
        assert_eq!(
            kind_of(200, &HeaderMap::new(), "{not json"),
            (ErrorKind::Transient, "bad_body".into())
        );
    }

    #[test]
    fn a_redirect_halts_instead_of_being_followed() {
        let e = match classify(StatusCode::TEMPORARY_REDIRECT, &HeaderMap::new(), "") {
            CallResult::Failed(e) => e,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            (e.kind, e.cause.as_str()),
            (ErrorKind::FleetHalt, "redirect_307_refused")
        );
    }

    #[test]
    fn a_message_keeps_finish_reason_refusal_and_usage() {
        let body = r#"{"choices":[{"message":{"content":"","refusal":"no"},"finish_reason":"content_filter"}],"usage":{"prompt_tokens":3}}"#;
        let CallResult::Message {
            finish_reason,
            refusal,
            usage,
            ..
        } = classify(StatusCode::OK, &HeaderMap::new(), body)
        else {
            panic!()
        };
        assert_eq!(finish_reason, "content_filter");
        assert_eq!(refusal.as_deref(), Some("no"));
        assert_eq!(usage.unwrap().prompt, 3);
    }

    #[test]
    fn retry_hints_in_the_sdk_order_and_nonsense_ignored() {
        assert_eq!(
            retry_after_ms(&headers(&[("retry-after-ms", "250"), ("retry-after", "9")])),
            Some(250)
        );
        assert_eq!(retry_after_ms(&headers(&[("retry-after", "1.5")])), Some(1500));
        assert_eq!(retry_after_ms(&headers(&[("retry-after", "-3")])), None);
        assert_eq!(retry_after_ms(&headers(&[("retry-after", "soon")])), None);
        assert_eq!(retry_after_ms(&headers(&[("retry-after-ms", "NaN")])), None);
    }

    #[test]
    fn a_proxys_copies_and_http_dates_are_read() {
        // LiteLLM's over-limit 429 carries only its prefixed copy.
        assert_eq!(
            retry_after_ms(&headers(&[("llm_provider-retry-after", "60")])),
            Some(60_000)
        );
        assert_eq!(http_date_ms("Wed, 21 Oct 2015 07:28:00 GMT"), Some(1_445_412_480_000));
        let soon = crate::clock::now_ms() + 30_000;
        let secs = soon / 1000;
        let date = {
            // Format `soon` back as an HTTP date through the inverse of http_date_ms.
            let days = (secs / 86_400) as i64;
            let rem = secs % 86_400;
            let z = days + 719_468;
            let era = z.div_euclid(146_097);
            let doe = z - era * 146_097;
            let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
            let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
            let mp = (5 * doy + 2) / 153;
            let d = doy - (153 * mp + 2) / 5 + 1;
            let m = if mp < 10 { mp + 3 } else { mp - 9 };
            let y = yoe + era * 400 + i64::from(m <= 2);
            let months = [
                "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
            ];
            format!(
                "Thu, {d:02} {} {y} {:02}:{:02}:{:02} GMT",
                months[(m - 1) as usize],
                rem / 3600,
                rem % 3600 / 60,
                rem % 60
            )
        };
        let wait = retry_after_ms(&headers(&[("retry-after", &date)])).unwrap();
        assert!((25_000..=31_000).contains(&wait), "{date}: {wait}");
        assert_eq!(
            retry_after_ms(&headers(&[("retry-after", "Thu, 99 Foo 2026 00:00:00 GMT")])),
            None
        );
        let h = crate::limiter::rate_headers(&headers(&[
            ("llm_provider-x-ratelimit-limit-requests", "300"),
            ("llm_provider-x-ratelimit-remaining-requests", "12"),
            ("x-ratelimit-reset-requests", "60"),
        ]));
        assert_eq!(
            (h.limit_requests, h.remaining_requests, h.reset_requests_ms),
            (Some(300), Some(12), Some(60_000))
        );
    }

    #[test]
    fn a_passed_through_request_keeps_its_own_format_and_gets_the_jobs_otherwise() {
        let spec = JobSpec::parse(include_str!("../../examples/job.toml"), "job.toml").unwrap();
        let p = Provider::new(&spec, Some("http://127.0.0.1:9/v1"), "sk-test".into()).unwrap();
        let schema = serde_json::json!({"type": "json_schema", "json_schema": {"name": "x"}});
        let plain = serde_json::json!({"messages": [{"role": "user", "content": "hi"}], "stream": true});
        let (body, max_tokens, formatted) = p
            .passthrough_body(Some(&plain), "body", None, Some(&schema), (None, false))
            .unwrap();
        let sent: Value = serde_json::from_str(body.get()).unwrap();
        assert!(formatted);
        assert_eq!(sent["response_format"], schema);
        assert_eq!(
            (sent["stream"].clone(), sent["model"].clone()),
            (Value::Bool(false), "gpt-4o-mini".into())
        );
        assert_eq!(max_tokens, u64::from(spec.provider.max_tokens));
        let mut own = plain.clone();
        own["response_format"] = serde_json::json!({"type": "json_object"});
        own["max_tokens"] = 7.into();
        let retry = Some(("{\"a\":1}", "fix: sentiment is required"));
        let (body, max_tokens, formatted) = p
            .passthrough_body(Some(&own), "body", retry, Some(&schema), (None, false))
            .unwrap();
        let sent: Value = serde_json::from_str(body.get()).unwrap();
        assert!(!formatted, "the request's own format is kept");
        assert_eq!(sent["response_format"]["type"], "json_object");
        assert_eq!(max_tokens, 7);
        assert_eq!(sent["messages"].as_array().unwrap().len(), 3, "{sent}");
        assert_eq!(sent["messages"][2]["content"], "fix: sentiment is required");
        let none = serde_json::json!({"messages": []});
        let refused = p
            .passthrough_body(Some(&none), "body", None, None, (None, false))
            .unwrap_err();
        assert_eq!(refused, "request_without_messages:body");
    }
}

//! The provider's Batch API, as OpenAI serves it and OpenAI-compatible
//! servers copy it: upload an input file (`POST /files`, multipart,
//! purpose `batch`), create a batch (`POST /batches`, not idempotent),
//! look at it (`GET /batches/{id}`), find it again by its metadata (`GET
//! /batches?after=&limit=`, newest first), cancel it, and download its
//! output and error files (`GET /files/{id}/content`).
//!
//! Every answer that is not a success is an [`ApiError`], its provider
//! message bounded and scrubbed of secrets.

use std::time::Duration;

use serde_json::{Value, json};

/// A Batch API call that did not succeed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// Worth trying again later: no answer (timeout, connection), a 5xx,
    /// a 429, a 408 or 409.
    #[error("{0}")]
    Transient(String),
    /// The key is refused (401, 403) or a redirect: the job halts.
    #[error("{0}")]
    Refused(String),
    /// Any other 4xx: this request will not succeed as it is.
    #[error("{0}")]
    Permanent(String),
}

/// Longest provider message kept.
const MESSAGE_CAP: usize = 300;

/// Batches a lookup pages through at most, newest first.
const LOOKUP_PAGES: usize = 50;

/// One job's client of the provider's Batch API.
#[derive(Clone)]
pub struct BatchApi {
    /// For the small calls: the provider's timeout.
    http: reqwest::Client,
    /// For the files (up to 200 MB each way).
    files: reqwest::Client,
    base: String,
    api_key: String,
    scrubber: common::secret::Scrubber,
}

impl BatchApi {
    /// `base` is the provider's base URL (`https://api.openai.com/v1`).
    pub fn new(
        base: &str,
        api_key: String,
        timeout: Duration,
        scrubber: common::secret::Scrubber,
    ) -> Result<BatchApi, reqwest::Error> {
        let client = |timeout| {
            reqwest::Client::builder()
                .timeout(timeout)
                .connect_timeout(Duration::from_secs(10))
                // The key goes to the configured base URL and nowhere else.
                .redirect(reqwest::redirect::Policy::none())
                .build()
        };
        Ok(BatchApi {
            http: client(timeout)?,
            files: client(Duration::from_secs(600))?,
            base: base.trim_end_matches('/').to_owned(),
            api_key,
            scrubber,
        })
    }

    /// Uploads a batch input file. Returns its file id.
    pub async fn upload(&self, filename: &str, bytes: Vec<u8>) -> Result<String, ApiError> {
        let boundary = format!("batchfleet-{:016x}", rand::random::<u64>());
        let mut body = Vec::with_capacity(bytes.len() + 512);
        body.extend_from_slice(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n\
                 --{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n\
                 Content-Type: application/jsonl\r\n\r\n"
            )
            .as_bytes(),
        );
        body.extend_from_slice(&bytes);
        body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
        let req = self
            .files
            .post(format!("{}/files", self.base))
            .header("content-type", format!("multipart/form-data; boundary={boundary}"))
            .body(body);
        let v = self.send(req).await?;
        v["id"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| ApiError::Transient("the file upload's answer has no id".into()))
    }

    /// Creates a batch of the input file. Not idempotent: a create whose
    /// answer was lost may have made one ([`BatchApi::find`] before again).
    pub async fn create(&self, file_id: &str, window: &str, metadata: &Value) -> Result<Value, ApiError> {
        let body = json!({
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": window,
            "metadata": metadata,
        });
        self.send(self.http.post(format!("{}/batches", self.base)).json(&body))
            .await
    }

    pub async fn retrieve(&self, batch_id: &str) -> Result<Value, ApiError> {
        self.send(self.http.get(format!("{}/batches/{batch_id}", self.base)))
            .await
    }

    pub async fn cancel(&self, batch_id: &str) -> Result<Value, ApiError> {
        self.send(self.http.post(format!("{}/batches/{batch_id}/cancel", self.base)))
            .await
    }

    /// The batch of input file `file_id` whose metadata holds every pair of
    /// `metadata`, looking through the provider's batches newest first, down
    /// to those created before `since_s` (Unix seconds). Not knowing (more
    /// batches than a lookup pages through) is an error, never "none".
    pub async fn find(&self, file_id: &str, metadata: &Value, since_s: u64) -> Result<Option<Value>, ApiError> {
        let wanted = metadata.as_object().cloned().unwrap_or_default();
        let mut after: Option<String> = None;
        for _ in 0..LOOKUP_PAGES {
            let mut url = format!("{}/batches?limit=100", self.base);
            if let Some(a) = &after {
                url.push_str(&format!("&after={a}"));
            }
            let page = self.send(self.http.get(url)).await?;
            let data = page["data"].as_array().cloned().unwrap_or_default();
            for b in &data {
                if b["input_file_id"] == file_id && wanted.iter().all(|(k, v)| &b["metadata"][k] == v) {
                    return Ok(Some(b.clone()));
                }
            }
            let older = data
                .last()
                .and_then(|b| b["created_at"].as_u64())
                .is_some_and(|at| at < since_s);
            if older || page["has_more"] != true || data.is_empty() {
                return Ok(None);
            }
            after = data.last().and_then(|b| b["id"].as_str()).map(str::to_owned);
        }
        Err(ApiError::Transient(format!(
            "more than {} batches newer than the shard's: its lookup did not reach them all",
            LOOKUP_PAGES * 100
        )))
    }

    /// A file's content (a batch's output or error file).
    pub async fn content(&self, file_id: &str) -> Result<String, ApiError> {
        let resp = self.files.get(format!("{}/files/{file_id}/content", self.base));
        let resp = self.authorized(resp).send().await.map_err(transport)?;
        let status = resp.status();
        let text = resp.text().await.map_err(transport)?;
        if status.is_success() {
            // Answers may carry what a provider echoed back.
            return Ok(self.scrubber.scrub(&text));
        }
        Err(self.failure(status, &text))
    }

    /// The request with the key, unless the server takes none.
    fn authorized(&self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        if self.api_key.is_empty() {
            req
        } else {
            req.bearer_auth(&self.api_key)
        }
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> Result<Value, ApiError> {
        let resp = self.authorized(req).send().await.map_err(transport)?;
        let status = resp.status();
        let text = resp.text().await.map_err(transport)?;
        if !status.is_success() {
            return Err(self.failure(status, &text));
        }
        serde_json::from_str(&self.scrubber.scrub(&text))
            .map_err(|e| ApiError::Transient(format!("the provider's answer is not JSON: {e}")))
    }

    fn failure(&self, status: reqwest::StatusCode, text: &str) -> ApiError {
        let body: Value = serde_json::from_str(text).unwrap_or(Value::Null);
        let message = body["error"]["message"].as_str().unwrap_or(text).trim();
        let message: String = self
            .scrubber
            .scrub(message)
            .chars()
            .filter(|c| !c.is_control())
            .take(MESSAGE_CAP)
            .collect();
        let said = format!("HTTP {}: {message}", status.as_u16());
        match status.as_u16() {
            401 | 403 | 300..=399 => ApiError::Refused(said),
            408 | 409 | 429 | 500..=599 => ApiError::Transient(said),
            _ => ApiError::Permanent(said),
        }
    }
}

fn transport(e: reqwest::Error) -> ApiError {
    let what = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "could not connect"
    } else {
        "transport error"
    };
    ApiError::Transient(format!("no answer from the provider: {what}"))
}

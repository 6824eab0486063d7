//! The Batch API as OpenAI serves it, and as other OpenAI-compatible
//! servers copy it: files (`POST /v1/files` multipart, `GET /v1/files/{id}`,
//! `GET /v1/files/{id}/content`) and batches (`POST /v1/batches`, `GET
//! /v1/batches/{id}`, `GET /v1/batches?after=&limit=` newest first, `POST
//! /v1/batches/{id}/cancel`).
//!
//! A batch is validated (every line a `POST` to `/v1/chat/completions` with
//! a `custom_id` unique in the file), then each line is answered exactly as
//! an online request would be (the same generation, faults and usage; they
//! count in `/stats`), in the background, over `--batch-secs`; then the
//! output file holds the 2xx answers and the error file the others, each
//! line `{id, custom_id, response: {status_code, request_id, body}, error}`.
//!
//! `--batch-faults` injects what users of batch APIs run into. Once, on the
//! first batch created: `file_invalid` (the file fails validation: status
//! `failed`, `errors.data[]` with a line number), `expire` (half the lines
//! are answered, then `expired`, the others in the error file as
//! `batch_expired`), `stuck` (stays `in_progress` past its
//! window until cancelled), `lost_create` (the batch is created but the
//! response is held until the client has given up), `download_fail` (the
//! first download of its output fails with a 500). On every batch:
//! `shuffle` (output lines in another order), `error_lines` (every fifth
//! line in the error file, `error: {code, message}`, no response),
//! `duplicates` (every seventh answer twice, the copy's content broken),
//! `invalid_always` (every batch fails validation). With
//! `--batch-enqueued-tokens` a batch that would pass the limit on tokens in
//! unfinished batches fails validation with `token_limit_exceeded`.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::extract::{Multipart, Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::{Sim, check_auth, error_body, unix_ms};

/// One-time faults hit the first batch; the others every batch.
#[derive(Debug, Clone, Default)]
pub struct BatchFaults {
    pub file_invalid: bool,
    pub expire: bool,
    pub stuck: bool,
    pub lost_create: bool,
    pub download_fail: bool,
    pub shuffle: bool,
    pub error_lines: bool,
    pub duplicates: bool,
    /// Every batch fails validation (a file the server will never take).
    pub invalid_always: bool,
}

impl BatchFaults {
    pub fn parse(spec: &str) -> anyhow::Result<BatchFaults> {
        let mut f = BatchFaults::default();
        for kind in spec.split(',').map(str::trim).filter(|k| !k.is_empty()) {
            match kind {
                "file_invalid" => f.file_invalid = true,
                "expire" => f.expire = true,
                "stuck" => f.stuck = true,
                "lost_create" => f.lost_create = true,
                "download_fail" => f.download_fail = true,
                "shuffle" => f.shuffle = true,
                "error_lines" => f.error_lines = true,
                "duplicates" => f.duplicates = true,
                "invalid_always" => f.invalid_always = true,
                other => anyhow::bail!(
                    "--batch-faults: unknown fault `{other}` (known: file_invalid, expire, stuck, lost_create, \
                     download_fail, shuffle, error_lines, duplicates, invalid_always)"
                ),
            }
        }
        Ok(f)
    }
}

struct File {
    id: String,
    filename: String,
    purpose: String,
    bytes: Vec<u8>,
    created_at: u64,
}

/// The files and batches the simulator holds.
#[derive(Default)]
pub struct Store {
    files: Mutex<HashMap<String, File>>,
    /// In the order they were created.
    batches: Mutex<Vec<Value>>,
    next: AtomicU64,
    pub created: AtomicU64,
    /// Batches cancelled by the client (their processing stops).
    cancelled: Mutex<HashSet<String>>,
    /// Output files whose first download already failed.
    failed_once: Mutex<HashSet<String>>,
    /// Tokens of the batches validated and not ended (`--batch-enqueued-tokens`).
    enqueued: Mutex<HashMap<String, u64>>,
}

impl Store {
    fn id(&self, prefix: &str) -> String {
        format!("{prefix}-{:08}", self.next.fetch_add(1, Ordering::Relaxed))
    }

    fn batch(&self, id: &str) -> Option<Value> {
        let b = self.batches.lock().ok()?;
        b.iter().find(|v| v["id"] == id).cloned()
    }

    fn update(&self, id: &str, f: impl FnOnce(&mut Value)) {
        if let Ok(mut b) = self.batches.lock()
            && let Some(v) = b.iter_mut().find(|v| v["id"] == id)
        {
            f(v);
        }
    }

    fn add_file(&self, filename: &str, purpose: &str, bytes: Vec<u8>) -> Value {
        let file = File {
            id: self.id("file"),
            filename: filename.to_owned(),
            purpose: purpose.to_owned(),
            bytes,
            created_at: unix_ms() / 1000,
        };
        let meta = file_meta(&file);
        if let Ok(mut files) = self.files.lock() {
            files.insert(file.id.clone(), file);
        }
        meta
    }
}

fn file_meta(f: &File) -> Value {
    json!({"id": f.id, "object": "file", "bytes": f.bytes.len(), "created_at": f.created_at,
           "filename": f.filename, "purpose": f.purpose})
}

/// How long a batch may take before it expires: `--batch-window-secs`, else
/// the window the client asked for (`24h`).
fn window_secs(sim: &Sim, asked: &str) -> u64 {
    sim.args.batch_window_secs.unwrap_or_else(|| {
        asked
            .strip_suffix('h')
            .and_then(|h| h.parse::<u64>().ok())
            .map_or(86_400, |h| h * 3600)
    })
}

pub async fn upload(State(sim): State<Arc<Sim>>, headers: HeaderMap, mut form: Multipart) -> Response {
    if let Some(refused) = check_auth(&sim, &headers) {
        return refused;
    }
    let (mut purpose, mut filename, mut bytes) = (String::new(), String::from("upload.jsonl"), None);
    while let Ok(Some(field)) = form.next_field().await {
        match field.name() {
            Some("purpose") => purpose = field.text().await.unwrap_or_default(),
            Some("file") => {
                filename = field.file_name().unwrap_or("upload.jsonl").to_owned();
                bytes = field.bytes().await.ok().map(|b| b.to_vec());
            }
            _ => {}
        }
    }
    let Some(bytes) = bytes else {
        return error_body(
            StatusCode::BAD_REQUEST,
            "no `file` part",
            "invalid_request_error",
            "missing_file",
        );
    };
    if purpose != "batch" {
        return error_body(
            StatusCode::BAD_REQUEST,
            &format!("purpose `{purpose}` is not `batch`"),
            "invalid_request_error",
            "invalid_purpose",
        );
    }
    Json(sim.batch.add_file(&filename, &purpose, bytes)).into_response()
}

pub async fn file(State(sim): State<Arc<Sim>>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    if let Some(refused) = check_auth(&sim, &headers) {
        return refused;
    }
    let files = sim.batch.files.lock().map(|f| f.get(&id).map(file_meta));
    match files {
        Ok(Some(meta)) => Json(meta).into_response(),
        _ => not_found("file", &id),
    }
}

pub async fn content(State(sim): State<Arc<Sim>>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    if let Some(refused) = check_auth(&sim, &headers) {
        return refused;
    }
    // The first download of the first batch's output fails once.
    let fail = sim.batch_faults.download_fail
        && first_batch_output(&sim) == Some(id.clone())
        && sim.batch.failed_once.lock().is_ok_and(|mut f| f.insert(id.clone()));
    if fail {
        return error_body(
            StatusCode::INTERNAL_SERVER_ERROR,
            "The server had an error while processing your request.",
            "server_error",
            "server_error",
        );
    }
    let bytes = sim
        .batch
        .files
        .lock()
        .ok()
        .and_then(|f| f.get(&id).map(|f| f.bytes.clone()));
    match bytes {
        Some(b) => (StatusCode::OK, [("content-type", "application/jsonl")], b).into_response(),
        None => not_found("file", &id),
    }
}

fn first_batch_output(sim: &Sim) -> Option<String> {
    let b = sim.batch.batches.lock().ok()?;
    b.first()?["output_file_id"].as_str().map(str::to_owned)
}

fn not_found(what: &str, id: &str) -> Response {
    error_body(
        StatusCode::NOT_FOUND,
        &format!("No such {what}: {id}"),
        "invalid_request_error",
        "not_found",
    )
}

pub async fn create(State(sim): State<Arc<Sim>>, headers: HeaderMap, body: String) -> Response {
    if let Some(refused) = check_auth(&sim, &headers) {
        return refused;
    }
    let Ok(req) = serde_json::from_str::<Value>(&body) else {
        return error_body(
            StatusCode::BAD_REQUEST,
            "invalid JSON body",
            "invalid_request_error",
            "invalid_json",
        );
    };
    let input = req["input_file_id"].as_str().unwrap_or("").to_owned();
    let known = sim.batch.files.lock().is_ok_and(|f| f.contains_key(&input));
    if !known {
        return not_found("file", &input);
    }
    if req["endpoint"] != "/v1/chat/completions" {
        return error_body(
            StatusCode::BAD_REQUEST,
            "endpoint must be /v1/chat/completions",
            "invalid_request_error",
            "invalid_endpoint",
        );
    }
    let metadata = req["metadata"].clone();
    if metadata.as_object().is_some_and(|m| m.len() > 16) {
        return error_body(
            StatusCode::BAD_REQUEST,
            "metadata holds at most 16 pairs",
            "invalid_request_error",
            "invalid_metadata",
        );
    }
    let id = sim.batch.id("batch");
    let now = unix_ms() / 1000;
    let window = req["completion_window"].as_str().unwrap_or("24h").to_owned();
    let batch = json!({
        "id": id, "object": "batch", "endpoint": "/v1/chat/completions", "errors": null,
        "input_file_id": input, "completion_window": window, "status": "validating",
        "output_file_id": null, "error_file_id": null, "created_at": now,
        "in_progress_at": null, "expires_at": now + window_secs(&sim, &window), "finalizing_at": null,
        "completed_at": null, "failed_at": null, "expired_at": null, "cancelling_at": null, "cancelled_at": null,
        "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata,
    });
    let first = {
        let Ok(mut all) = sim.batch.batches.lock() else {
            return error_body(
                StatusCode::INTERNAL_SERVER_ERROR,
                "lock",
                "server_error",
                "server_error",
            );
        };
        all.push(batch.clone());
        all.len() == 1
    };
    sim.batch.created.fetch_add(1, Ordering::Relaxed);
    // The lines are answered on behalf of the key that created the batch,
    // each one a JSON body (the Batch API reads them so).
    let mut auth = HeaderMap::new();
    if let Some(v) = headers.get("authorization") {
        auth.insert("authorization", v.clone());
    }
    auth.insert("content-type", HeaderValue::from_static("application/json"));
    tokio::spawn(process(sim.clone(), id, first, auth));
    if first && sim.batch_faults.lost_create {
        // Created, but the answer never reaches the client (it gives up first).
        tokio::time::sleep(Duration::from_secs(sim.args.hang_secs)).await;
    }
    Json(batch).into_response()
}

pub async fn retrieve(State(sim): State<Arc<Sim>>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    if let Some(refused) = check_auth(&sim, &headers) {
        return refused;
    }
    match sim.batch.batch(&id) {
        Some(b) => Json(b).into_response(),
        None => not_found("batch", &id),
    }
}

#[derive(serde::Deserialize)]
pub struct ListQuery {
    #[serde(default)]
    after: Option<String>,
    #[serde(default)]
    limit: Option<usize>,
}

/// Newest first, `limit` (default 20, at most 100) after the batch `after`.
pub async fn list(State(sim): State<Arc<Sim>>, headers: HeaderMap, Query(q): Query<ListQuery>) -> Response {
    if let Some(refused) = check_auth(&sim, &headers) {
        return refused;
    }
    let all: Vec<Value> = sim
        .batch
        .batches
        .lock()
        .map(|b| b.iter().rev().cloned().collect())
        .unwrap_or_default();
    let start = match &q.after {
        Some(after) => all
            .iter()
            .position(|b| b["id"] == after.as_str())
            .map_or(all.len(), |i| i + 1),
        None => 0,
    };
    let limit = q.limit.unwrap_or(20).clamp(1, 100);
    let page: Vec<Value> = all.iter().skip(start).take(limit).cloned().collect();
    let has_more = start + page.len() < all.len();
    Json(json!({
        "object": "list", "data": page,
        "first_id": page.first().map(|b| b["id"].clone()), "last_id": page.last().map(|b| b["id"].clone()),
        "has_more": has_more,
    }))
    .into_response()
}

pub async fn cancel(State(sim): State<Arc<Sim>>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    if let Some(refused) = check_auth(&sim, &headers) {
        return refused;
    }
    let Some(b) = sim.batch.batch(&id) else {
        return not_found("batch", &id);
    };
    let status = b["status"].as_str().unwrap_or("");
    if matches!(status, "completed" | "failed" | "expired" | "cancelled") {
        return error_body(
            StatusCode::CONFLICT,
            &format!("Cannot cancel a batch with status {status}"),
            "invalid_request_error",
            "invalid_state",
        );
    }
    if let Ok(mut c) = sim.batch.cancelled.lock() {
        c.insert(id.clone());
    }
    sim.batch.update(&id, |v| {
        v["status"] = json!("cancelling");
        v["cancelling_at"] = json!(unix_ms() / 1000);
    });
    Json(sim.batch.batch(&id).unwrap_or(Value::Null)).into_response()
}

/// A batch from validation to its end, in the background.
async fn process(sim: Arc<Sim>, id: String, first: bool, auth: HeaderMap) {
    let faults = sim.batch_faults.clone();
    let Some(batch) = sim.batch.batch(&id) else { return };
    let input = batch["input_file_id"].as_str().unwrap_or("").to_owned();
    let text = sim
        .batch
        .files
        .lock()
        .ok()
        .and_then(|f| f.get(&input).map(|f| String::from_utf8_lossy(&f.bytes).into_owned()))
        .unwrap_or_default();
    // Validation: each line a POST to the endpoint, custom_ids unique.
    let mut lines = Vec::new();
    let mut errors = Vec::new();
    let mut seen = HashSet::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let n = i + 1;
        match serde_json::from_str::<Value>(line) {
            Ok(v) if v["method"] == "POST" && v["url"] == "/v1/chat/completions" && v["body"].is_object() => {
                let cid = v["custom_id"].as_str().unwrap_or("").to_owned();
                if cid.is_empty() || !seen.insert(cid.clone()) {
                    errors.push(json!({"code": "duplicate_custom_id", "message": format!("The custom_id `{cid}` is empty or not unique in the file."), "param": "custom_id", "line": n}));
                }
                lines.push((cid, v["body"].clone()));
            }
            _ => errors.push(json!({"code": "invalid_request", "message": "The line is not a POST to /v1/chat/completions with a body.", "param": null, "line": n})),
        }
    }
    if (first && faults.file_invalid) || faults.invalid_always {
        errors.push(json!({"code": "invalid_json_line", "message": "This line is not parseable as valid JSON.", "param": null, "line": 1}));
    }
    // The organization's limit on tokens enqueued in unfinished batches:
    // each request's prompt (a token per 4 bytes of its messages) and
    // `max_tokens`, as OpenAI counts them against it.
    let tokens: u64 = lines
        .iter()
        .map(|(_, b)| b["messages"].to_string().len() as u64 / 4 + b["max_tokens"].as_u64().unwrap_or(0))
        .sum();
    if let Some(limit) = sim.args.batch_enqueued_tokens
        && errors.is_empty()
        && let Ok(mut q) = sim.batch.enqueued.lock()
    {
        let queued: u64 = q.values().sum();
        if queued + tokens > limit {
            errors.push(json!({"code": "token_limit_exceeded", "message": format!(
                "Enqueued token limit reached for {}: limit {limit}, {queued} enqueued, this batch {tokens}. \
                 Please try again once some in_progress batches have been completed.", b_model(&lines)),
                "param": null, "line": null}));
        } else {
            q.insert(id.clone(), tokens);
        }
    }
    let now = || unix_ms() / 1000;
    if !errors.is_empty() {
        sim.batch.update(&id, |v| {
            v["status"] = json!("failed");
            v["failed_at"] = json!(now());
            v["errors"] = json!({"object": "list", "data": errors});
        });
        return;
    }
    sim.batch.update(&id, |v| {
        v["status"] = json!("in_progress");
        v["in_progress_at"] = json!(now());
        v["request_counts"]["total"] = json!(lines.len());
    });
    // The answers, over the batch's processing time.
    let total = lines.len();
    let stop_after = if first && faults.expire { total / 2 } else { total };
    let per_line = Duration::from_millis(sim.args.batch_secs * 1000 / total.max(1) as u64);
    // Per line: custom_id, status, body, or the code of its error line.
    let mut answered: Vec<(String, u16, Value, Option<&str>)> = Vec::new();
    let cancelled = |sim: &Sim| sim.batch.cancelled.lock().is_ok_and(|c| c.contains(&id));
    for (i, (cid, body)) in lines.iter().enumerate() {
        if cancelled(&sim) || i >= stop_after {
            break;
        }
        tokio::time::sleep(per_line).await;
        let erred = faults.error_lines && i % 5 == 4;
        if erred {
            answered.push((cid.clone(), 0, Value::Null, Some("server_error")));
            continue;
        }
        let resp = super::chat(State(sim.clone()), auth.clone(), body.to_string()).await;
        let status = resp.status().as_u16();
        let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .unwrap_or_default();
        let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        answered.push((cid.clone(), status, body, None));
    }
    // An expired batch lists the requests it never ran in its error file.
    if !cancelled(&sim) && stop_after < total {
        for (cid, _) in &lines[answered.len()..] {
            answered.push((cid.clone(), 0, Value::Null, Some("batch_expired")));
        }
    }
    // Past its window while stuck: it stays in_progress until cancelled.
    if first && faults.stuck {
        while !cancelled(&sim) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let (mut completed, mut failed) = (0u64, 0u64);
    for (n, (cid, status, body, erred)) in answered.into_iter().enumerate() {
        let line_id = format!("batch_req_{id}_{n}");
        if let Some(code) = erred {
            failed += 1;
            let message = match code {
                "batch_expired" => "This request could not be executed before the completion window expired.",
                _ => "The request could not be completed.",
            };
            err.push(json!({"id": line_id, "custom_id": cid, "response": null,
                            "error": {"code": code, "message": message}}));
            continue;
        }
        let line = json!({"id": line_id, "custom_id": cid,
                          "response": {"status_code": status, "request_id": format!("req_{n}"), "body": body},
                          "error": null});
        if (200..300).contains(&status) {
            completed += 1;
            if faults.duplicates && n % 7 == 3 {
                let mut copy = line.clone();
                copy["response"]["body"]["choices"][0]["message"]["content"] = json!("{\"broken\": ");
                out.push(copy);
            }
            out.push(line);
        } else {
            failed += 1;
            err.push(line);
        }
    }
    if faults.shuffle {
        out.reverse();
        err.reverse();
    }
    let jsonl = |lines: &[Value]| lines.iter().map(|l| format!("{l}\n")).collect::<String>().into_bytes();
    let output = (!out.is_empty()).then(|| {
        sim.batch
            .add_file(&format!("{id}_output.jsonl"), "batch_output", jsonl(&out))
    });
    let error = (!err.is_empty()).then(|| {
        sim.batch
            .add_file(&format!("{id}_error.jsonl"), "batch_output", jsonl(&err))
    });
    let end = if cancelled(&sim) {
        ("cancelled", "cancelled_at")
    } else if answered_all(stop_after, total) {
        ("completed", "completed_at")
    } else {
        ("expired", "expired_at")
    };
    if let Ok(mut q) = sim.batch.enqueued.lock() {
        q.remove(&id);
    }
    sim.batch.update(&id, |v| {
        v["status"] = json!(end.0);
        v[end.1] = json!(now());
        v["finalizing_at"] = json!(now());
        v["output_file_id"] = output.map_or(Value::Null, |f| f["id"].clone());
        v["error_file_id"] = error.map_or(Value::Null, |f| f["id"].clone());
        v["request_counts"] = json!({"total": total, "completed": completed, "failed": failed});
    });
}

fn b_model(lines: &[(String, Value)]) -> String {
    lines
        .first()
        .and_then(|(_, b)| b["model"].as_str())
        .unwrap_or("the model")
        .to_owned()
}

fn answered_all(stop_after: usize, total: usize) -> bool {
    stop_after >= total
}

//! `producer serve-batches`: the OpenAI Batch API in front of the fleet, so
//! code written against `client.files` and `client.batches` runs unchanged
//! with its `base_url` pointed here, and gets the fleet's guarantees
//! (exactly one result a record, validation, review, the budget).
//!
//! - `POST /v1/files` (multipart `file`, `purpose=batch`), `GET /v1/files`,
//!   `GET|DELETE /v1/files/{id}`, `GET /v1/files/{id}/content`;
//! - `POST /v1/batches` (an `Idempotency-Key` header makes a retried create
//!   return the batch it made), `GET /v1/batches`, `GET /v1/batches/{id}`,
//!   `POST /v1/batches/{id}/cancel`.
//!
//! Every request carries `Authorization: Bearer <token>` of a key named in
//! `name:token` lines; a key sees only its own files and batches. A batch
//! is a fleet job (`oai-<batch id>`), run by the workers as any job; see
//! [`lifecycle`] for its way from `validating` to `completed`.

// A handler's helpers return the response that refuses the request.
#![allow(clippy::result_large_err)]

pub mod lifecycle;
pub mod store;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Multipart, Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use common::spec::JobSpec;
use common::store::RedisStore;
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;

use crate::console::auth::Reviewers;
use store::{BatchRow, FileRow};

/// How `serve-batches` runs.
pub struct Config {
    pub bind: SocketAddr,
    /// The API keys (`name:token`).
    pub keys: Reviewers,
    pub provider_spec: JobSpec,
    /// Named templates: `DIR/<name>.toml`, a job spec whose `[output]` validates answers.
    pub templates: Option<PathBuf>,
    pub data_dir: PathBuf,
    pub max_upload_bytes: u64,
    pub redis_url: String,
    pub poll: Duration,
    pub max_backlog: u64,
    pub allow_evicting_redis: bool,
}

/// The server's state, shared by its handlers and its poll.
pub struct Api {
    pub store: RedisStore,
    pub config: Config,
    /// Batches being validated and enqueued now (each by one task).
    pub validating: std::sync::Mutex<std::collections::HashSet<String>>,
    /// When each batch in progress last had its full pass (see `lifecycle::counts`).
    pub full_passes: std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>,
}

type Shared = Arc<Api>;

impl Api {
    /// Where a file's bytes are kept.
    pub fn file_path(&self, id: &str) -> PathBuf {
        self.config.data_dir.join("files").join(id)
    }

    /// A named template (`metadata.template`), checked against the
    /// provider spec, or why it cannot be used.
    pub fn template(&self, name: &str) -> anyhow::Result<lifecycle::Template> {
        let dir = self
            .config
            .templates
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("no templates are served (start serve-batches with --templates DIR)"))?;
        let ok = common::template::is_identifier(&name.replace('-', "_"));
        let path = dir.join(format!("{name}.toml"));
        if !ok || !path.is_file() {
            let mut known: Vec<String> = std::fs::read_dir(dir)
                .map(|d| {
                    d.filter_map(Result::ok)
                        .filter_map(|e| e.file_name().to_string_lossy().strip_suffix(".toml").map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default();
            known.sort();
            anyhow::bail!("no template `{name}`: the templates are {}", known.join(", "));
        }
        let template = lifecycle::Template::load(&path)?;
        if let Some(p) = lifecycle::job_spec(&self.config.provider_spec, Some(&template))
            .problems()
            .first()
        {
            anyhow::bail!("{}: {}: {}", path.display(), p.path, p.message);
        }
        Ok(template)
    }
}

pub fn now_secs() -> u64 {
    crate::status::now_secs()
}

/// Serves until `cancel`; `bound` receives the address listened on.
pub async fn run(
    config: Config,
    store: RedisStore,
    cancel: CancellationToken,
    bound: Option<tokio::sync::oneshot::Sender<SocketAddr>>,
) -> anyhow::Result<()> {
    if config.keys.is_empty() {
        anyhow::bail!(
            "no API key can call this server: give --keys-file FILE or BATCHFLEET_BATCHES_KEYS (`name:token` lines)"
        );
    }
    let derived = lifecycle::job_spec(&config.provider_spec, None);
    if let Some(p) = derived.problems().first() {
        anyhow::bail!("--provider-spec: {}: {}", p.path, p.message);
    }
    store::reopen(&store).await?;
    std::fs::create_dir_all(config.data_dir.join("files"))
        .map_err(|e| anyhow::anyhow!("--data-dir {}: {e}", config.data_dir.display()))?;
    let listener = tokio::net::TcpListener::bind(config.bind)
        .await
        .map_err(|e| anyhow::anyhow!("--bind {}: {e}", config.bind))?;
    let addr = listener.local_addr()?;
    let poll_every = config.poll;
    let api = Arc::new(Api {
        store,
        config,
        validating: Default::default(),
        full_passes: Default::default(),
    });
    let poller = tokio::spawn(poll(api.clone(), poll_every, cancel.clone()));
    let app = router(api);
    common::errln!("serve-batches: serving the Batch API on http://{addr}/v1");
    if let Some(tx) = bound {
        let _ = tx.send(addr);
    }
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { cancel.cancelled().await })
        .await?;
    poller.abort();
    Ok(())
}

/// Moves every unfinished batch along, every `every`.
async fn poll(api: Shared, every: Duration, cancel: CancellationToken) {
    loop {
        if let Err(e) = lifecycle::advance_all(&api).await {
            tracing::warn!(error = %format!("{e:#}"), "batches not advanced: tried again at the next poll");
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
    }
}

pub fn router(api: Shared) -> Router {
    let limit = usize::try_from(api.config.max_upload_bytes)
        .unwrap_or(usize::MAX)
        .saturating_add(64 * 1024);
    Router::new()
        .route("/v1/files", post(upload).get(list_files))
        .route("/v1/files/{id}", get(get_file).delete(delete_file))
        .route("/v1/files/{id}/content", get(file_content))
        .route("/v1/batches", post(create_batch).get(list_batches))
        .route("/v1/batches/{id}", get(get_batch))
        .route("/v1/batches/{id}/cancel", post(cancel_batch))
        .route("/healthz", get(|| async { "ok" }))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(api)
}

/// An error in the API's shape: `{"error": {message, type, param, code}}`.
fn api_error(status: StatusCode, message: impl Into<String>, param: Option<&str>, code: Option<&str>) -> Response {
    let kind = match status {
        StatusCode::UNAUTHORIZED => "authentication_error",
        s if s.is_server_error() => "server_error",
        _ => "invalid_request_error",
    };
    let body = json!({"error": {"message": message.into(), "type": kind, "param": param, "code": code}});
    (status, axum::Json(body)).into_response()
}

fn internal(e: impl std::fmt::Display) -> Response {
    tracing::warn!(error = %e, "batches API request failed");
    api_error(
        StatusCode::SERVICE_UNAVAILABLE,
        format!("the server could not reach its store, try again: {e}"),
        None,
        None,
    )
}

/// The key's name, from `Authorization: Bearer <token>` (the token is never echoed).
fn owner(api: &Api, headers: &HeaderMap) -> Result<String, Response> {
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    token.and_then(|t| api.config.keys.who(t)).ok_or_else(|| {
        api_error(
            StatusCode::UNAUTHORIZED,
            "Incorrect API key provided: use a key of this server's --keys-file or BATCHFLEET_BATCHES_KEYS",
            None,
            Some("invalid_api_key"),
        )
    })
}

fn not_found(kind: &str, id: &str) -> Response {
    api_error(
        StatusCode::NOT_FOUND,
        format!("No such {kind} object: {id}"),
        Some("id"),
        None,
    )
}

fn random_hex() -> String {
    let bytes: [u8; 12] = rand::random();
    hex::encode(bytes)
}

async fn upload(State(api): State<Shared>, headers: HeaderMap, mut form: Multipart) -> Response {
    let who = match owner(&api, &headers) {
        Ok(w) => w,
        Err(r) => return r,
    };
    let id = format!("file-{}", random_hex());
    let path = api.file_path(&id);
    let mut purpose = None;
    let mut stored: Option<(String, u64)> = None;
    loop {
        let mut field = match form.next_field().await {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                let _ = std::fs::remove_file(&path);
                return too_large(&api);
            }
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                let why = format!("the upload is not a multipart form: {e}");
                return api_error(StatusCode::BAD_REQUEST, why, None, None);
            }
        };
        match field.name() {
            Some("purpose") => purpose = field.text().await.ok(),
            Some("file") => {
                let filename = field.file_name().unwrap_or("upload.jsonl").to_owned();
                match save_part(&api, &mut field, &path).await {
                    Ok(bytes) => stored = Some((filename, bytes)),
                    Err(refused) => return refused,
                }
            }
            _ => {}
        }
    }
    let Some((filename, bytes)) = stored else {
        return api_error(
            StatusCode::BAD_REQUEST,
            "the form has no `file` part",
            Some("file"),
            None,
        );
    };
    if purpose.as_deref() != Some("batch") {
        let _ = std::fs::remove_file(&path);
        let why = "purpose must be `batch`: this server serves the Batch API's files only";
        return api_error(StatusCode::BAD_REQUEST, why, Some("purpose"), None);
    }
    let f = FileRow {
        id,
        filename,
        purpose: "batch".into(),
        bytes,
        created_at: now_secs(),
        owner: who,
    };
    match store::put_file(&api.store, &f).await {
        Ok(()) => axum::Json(f.object()).into_response(),
        Err(e) => internal(e),
    }
}

/// Streams a form's file part to `path`, within the upload limit (the
/// partial file removed when refused).
async fn save_part(
    api: &Api,
    field: &mut axum::extract::multipart::Field<'_>,
    path: &std::path::Path,
) -> Result<u64, Response> {
    let mut out = tokio::fs::File::create(path).await.map_err(internal)?;
    let mut bytes = 0u64;
    loop {
        let chunk = match field.chunk().await {
            Ok(Some(chunk)) => chunk,
            Ok(None) => break,
            // The body's limit met inside a chunk.
            Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                let _ = std::fs::remove_file(path);
                return Err(too_large(api));
            }
            Err(e) => {
                let _ = std::fs::remove_file(path);
                let why = format!("the upload broke off: {e}");
                return Err(api_error(StatusCode::BAD_REQUEST, why, Some("file"), None));
            }
        };
        bytes += chunk.len() as u64;
        if bytes > api.config.max_upload_bytes {
            drop(out);
            let _ = std::fs::remove_file(path);
            return Err(too_large(api));
        }
        out.write_all(&chunk).await.map_err(internal)?;
    }
    out.flush().await.map_err(internal)?;
    Ok(bytes)
}

fn too_large(api: &Api) -> Response {
    let why = format!(
        "the file is over this server's upload limit of {} bytes (--max-upload-mb)",
        api.config.max_upload_bytes
    );
    api_error(StatusCode::PAYLOAD_TOO_LARGE, why, Some("file"), Some("file_too_large"))
}

/// The key's own file `id`, or the response that says why not.
async fn own_file(api: &Api, headers: &HeaderMap, id: &str) -> Result<FileRow, Response> {
    let who = owner(api, headers)?;
    match store::file(&api.store, id).await {
        Ok(Some(f)) if f.owner == who => Ok(f),
        Ok(_) => Err(not_found("File", id)),
        Err(e) => Err(internal(e)),
    }
}

#[derive(serde::Deserialize)]
struct ListQuery {
    purpose: Option<String>,
    after: Option<String>,
    limit: Option<usize>,
}

/// A page of a list, newest first, from after the id `after`.
fn page(mut items: Vec<(u64, String, Value)>, q: &ListQuery) -> Value {
    items.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)));
    let start = q
        .after
        .as_ref()
        .and_then(|a| items.iter().position(|(_, id, _)| id == a).map(|i| i + 1))
        .unwrap_or(0);
    let limit = q.limit.unwrap_or(20).clamp(1, 10_000);
    let rest = items.len().saturating_sub(start);
    let data: Vec<Value> = items.into_iter().skip(start).take(limit).map(|(_, _, v)| v).collect();
    json!({
        "object": "list",
        "first_id": data.first().map(|v| v["id"].clone()),
        "last_id": data.last().map(|v| v["id"].clone()),
        "has_more": rest > limit,
        "data": data,
    })
}

async fn list_files(State(api): State<Shared>, headers: HeaderMap, Query(q): Query<ListQuery>) -> Response {
    let who = match owner(&api, &headers) {
        Ok(w) => w,
        Err(r) => return r,
    };
    let files = store::files(&api.store).await;
    listed(files, &q, |f| {
        let shown = f.owner == who && q.purpose.as_ref().is_none_or(|p| *p == f.purpose);
        shown.then(|| (f.created_at, f.id.clone(), f.object()))
    })
}

/// The key's page of a list read from the store (`item` keeps what it
/// shows, as `(created_at, id, object)`), or the error that stopped it.
fn listed<T>(
    all: Result<Vec<T>, common::store::StoreError>,
    q: &ListQuery,
    item: impl Fn(T) -> Option<(u64, String, Value)>,
) -> Response {
    match all {
        Ok(all) => axum::Json(page(all.into_iter().filter_map(item).collect(), q)).into_response(),
        Err(e) => internal(e),
    }
}

async fn get_file(State(api): State<Shared>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    match own_file(&api, &headers, &id).await {
        Ok(f) => axum::Json(f.object()).into_response(),
        Err(r) => r,
    }
}

async fn file_content(State(api): State<Shared>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    if let Err(r) = own_file(&api, &headers, &id).await {
        return r;
    }
    match tokio::fs::File::open(api.file_path(&id)).await {
        Ok(f) => {
            let body = Body::from_stream(tokio_util::io::ReaderStream::new(f));
            ([(header::CONTENT_TYPE, "application/octet-stream")], body).into_response()
        }
        Err(e) => internal(e),
    }
}

async fn delete_file(State(api): State<Shared>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    if let Err(r) = own_file(&api, &headers, &id).await {
        return r;
    }
    // A batch still validating reads it.
    match store::open_batches(&api.store).await {
        Ok(all)
            if all
                .iter()
                .any(|b| !b.enqueued && !b.is_terminal() && b.batch["input_file_id"] == id.as_str()) =>
        {
            let why = "a batch still validating reads this file: delete it once the batch is in_progress";
            return api_error(StatusCode::CONFLICT, why, Some("id"), None);
        }
        Ok(_) => {}
        Err(e) => return internal(e),
    }
    if let Err(e) = store::forget_file(&api.store, &id).await {
        return internal(e);
    }
    let _ = std::fs::remove_file(api.file_path(&id));
    axum::Json(json!({"id": id, "object": "file", "deleted": true})).into_response()
}

#[derive(serde::Deserialize)]
struct CreateBatch {
    input_file_id: Option<String>,
    endpoint: Option<String>,
    completion_window: Option<String>,
    #[serde(default)]
    metadata: Option<serde_json::Map<String, Value>>,
}

/// `24h`-style windows, 1 to 168 hours.
fn window_secs(w: &str) -> Option<u64> {
    let hours: u64 = w.strip_suffix('h')?.parse().ok()?;
    (1..=168).contains(&hours).then_some(hours * 3600)
}

impl CreateBatch {
    /// The request's input file, window and template, checked as the API
    /// checks them; the response that refuses it otherwise.
    async fn check(&self, api: &Api, who: &str) -> Result<Checked, Response> {
        let Some(input) = self.input_file_id.clone() else {
            let why = "input_file_id is required";
            return Err(api_error(StatusCode::BAD_REQUEST, why, Some("input_file_id"), None));
        };
        if self.endpoint.as_deref() != Some(lifecycle::ENDPOINT) {
            let why = format!(
                "endpoint must be {}: the only one this server runs",
                lifecycle::ENDPOINT
            );
            return Err(api_error(StatusCode::BAD_REQUEST, why, Some("endpoint"), None));
        }
        let window = self.window();
        let Some(window_s) = window_secs(&window) else {
            let why = format!("completion_window `{window}`: give hours, 1h to 168h, such as 24h");
            return Err(api_error(StatusCode::BAD_REQUEST, why, Some("completion_window"), None));
        };
        match store::file(&api.store, &input).await {
            Ok(Some(f)) if f.owner == who && f.purpose == "batch" => {}
            Ok(_) => return Err(not_found("File", &input)),
            Err(e) => return Err(internal(e)),
        }
        let template = self
            .metadata
            .as_ref()
            .and_then(|m| m.get("template"))
            .and_then(Value::as_str)
            .map(str::to_owned);
        if let Some(name) = &template
            && let Err(e) = api.template(name)
        {
            let why = format!("metadata.template: {e:#}");
            return Err(api_error(StatusCode::BAD_REQUEST, why, Some("metadata"), None));
        }
        Ok(Checked {
            input,
            window,
            window_s,
            template,
        })
    }

    fn window(&self) -> String {
        self.completion_window.clone().unwrap_or_else(|| "24h".into())
    }
}

/// A create request that passed [`CreateBatch::check`].
struct Checked {
    input: String,
    window: String,
    window_s: u64,
    template: Option<String>,
}

async fn create_batch(State(api): State<Shared>, headers: HeaderMap, body: String) -> Response {
    let who = match owner(&api, &headers) {
        Ok(w) => w,
        Err(r) => return r,
    };
    let req: CreateBatch = match serde_json::from_str(&body) {
        Ok(r) => r,
        Err(e) => {
            let why = format!("the body is not a batch request: {e}");
            return api_error(StatusCode::BAD_REQUEST, why, None, None);
        }
    };
    let checked = match req.check(&api, &who).await {
        Ok(c) => c,
        Err(r) => return r,
    };
    let id = format!("batch_{}", random_hex());
    if let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()) {
        let ttl = checked.window_s + 7 * 24 * 3600;
        match store::claim_idempotency(&api.store, &who, key, &id, ttl).await {
            Ok(None) => {}
            Ok(Some(existing)) => return same_batch(&api, &existing, &req).await,
            Err(e) => return internal(e),
        }
    }
    let row = BatchRow::new(id, who, checked, req.metadata, now_secs());
    match store::put_batch(&api.store, &row).await {
        Ok(_) => axum::Json(row.batch).into_response(),
        Err(e) => internal(e),
    }
}

impl BatchRow {
    /// A batch just created: `validating`, its job `oai-<id>`.
    fn new(
        id: String,
        owner: String,
        c: Checked,
        metadata: Option<serde_json::Map<String, Value>>,
        now: u64,
    ) -> BatchRow {
        let batch = json!({
            "id": id,
            "object": "batch",
            "endpoint": lifecycle::ENDPOINT,
            "errors": null,
            "input_file_id": c.input,
            "completion_window": c.window,
            "status": "validating",
            "output_file_id": null,
            "error_file_id": null,
            "created_at": now,
            "in_progress_at": null,
            "expires_at": now + c.window_s,
            "finalizing_at": null,
            "completed_at": null,
            "failed_at": null,
            "expired_at": null,
            "cancelling_at": null,
            "cancelled_at": null,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": metadata,
        });
        BatchRow {
            owner,
            job: format!("oai-{id}"),
            template: c.template,
            ending: None,
            enqueued: false,
            batch,
        }
    }
}

/// A create retried with the same idempotency key: the batch it made, when
/// asked the same; a conflict when the parameters differ.
async fn same_batch(api: &Api, id: &str, req: &CreateBatch) -> Response {
    // The first create may be writing it at this moment.
    for _ in 0..50 {
        match store::batch(&api.store, id).await {
            Ok(Some(row)) => {
                let b = &row.batch;
                let same = b["input_file_id"].as_str() == req.input_file_id.as_deref()
                    && b["completion_window"].as_str() == Some(req.window().as_str())
                    && b["metadata"] == json!(req.metadata);
                if same {
                    return axum::Json(row.batch).into_response();
                }
                let why = format!(
                    "this Idempotency-Key already created {id} with other parameters: use a new key for a new batch"
                );
                return api_error(StatusCode::CONFLICT, why, None, Some("idempotency_key_reused"));
            }
            Ok(None) => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(e) => return internal(e),
        }
    }
    internal(format!("the batch {id} of this Idempotency-Key is not stored yet"))
}

/// The key's own batch `id`, or the response that says why not.
async fn own_batch(api: &Api, headers: &HeaderMap, id: &str) -> Result<BatchRow, Response> {
    let who = owner(api, headers)?;
    match store::batch(&api.store, id).await {
        Ok(Some(b)) if b.owner == who => Ok(b),
        Ok(_) => Err(not_found("Batch", id)),
        Err(e) => Err(internal(e)),
    }
}

async fn get_batch(State(api): State<Shared>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    match own_batch(&api, &headers, &id).await {
        Ok(b) => axum::Json(b.batch).into_response(),
        Err(r) => r,
    }
}

async fn list_batches(State(api): State<Shared>, headers: HeaderMap, Query(q): Query<ListQuery>) -> Response {
    let who = match owner(&api, &headers) {
        Ok(w) => w,
        Err(r) => return r,
    };
    let batches = store::batches(&api.store).await;
    listed(batches, &q, |b| {
        let created = b.batch["created_at"].as_u64().unwrap_or(0);
        (b.owner == who).then(|| (created, b.id().to_owned(), b.batch))
    })
}

async fn cancel_batch(State(api): State<Shared>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    let mut row = match own_batch(&api, &headers, &id).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    match row.status() {
        "validating" | "in_progress" => {}
        "cancelling" | "cancelled" => return axum::Json(row.batch).into_response(),
        other => {
            let why = format!("batch {id} is {other}: only a validating or in_progress batch can be cancelled");
            return api_error(StatusCode::CONFLICT, why, None, None);
        }
    }
    row.ending = Some("cancelled".into());
    row.set_status("cancelling", now_secs());
    // The cancel is stored before the job's records are dropped: a poll that
    // then finds nothing left to run reads it and ends the batch cancelled.
    match store::put_batch(&api.store, &row).await {
        Ok(store::Put::Stored) => {}
        // It ended meanwhile: it stays as it ended (or another cancel came first).
        Ok(_) => return get_batch(State(api), headers, Path(id)).await,
        Err(e) => return internal(e),
    }
    match lifecycle::cancel_job(&api.store, &row).await {
        Ok(()) => axum::Json(row.batch).into_response(),
        Err(e) => internal(e),
    }
}

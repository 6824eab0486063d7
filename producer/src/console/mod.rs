//! `producer console`: the web console. Server-rendered HTML (askama
//! templates compiled into the binary, one small script and one style sheet
//! served from the binary, charts as SVG drawn here): nothing is fetched from
//! elsewhere at run time.
//!
//! - [`auth`]: reviewer tokens, sessions, the trusted proxy header, CSRF.
//! - [`jobs`]: the jobs page, a job's page (live), cancel and resume.
//! - [`queue`]: the review queue (filters, paging) and an entry's page with
//!   its actions, through the same atomic scripts as `producer review`.
//! - [`audit`]: spot checks of committed results, and the accuracy.
//! - [`chart`]: SVG charts.
//! - [`compare`]: two jobs side by side (`producer compare` as a page).
//!
//! Every page reads Redis through the store's typed verbs. A job's
//! reconciliation (missing, duplicated, unknown records) is a full scan, so
//! it is cached and refreshed in the background; everything else a page
//! shows comes from counters the scripts keep.

pub mod audit;
pub mod auth;
pub mod chart;
pub mod compare;
pub mod form;
pub mod jobs;
pub mod queue;
pub mod rerun;
pub mod workers;

use std::net::SocketAddr;
use std::sync::Arc;

use askama::Template;
use axum::Router;
use axum::extract::{Form, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use common::store::RedisStore;
use tokio_util::sync::CancellationToken;

use auth::{Reviewers, Sessions};

/// How the console runs.
#[derive(Debug, Clone)]
pub struct ConsoleConfig {
    pub bind: SocketAddr,
    /// ` --redis URL` for the commands the pages show (empty for the
    /// default Redis; the variable's name when the URL holds a password).
    pub redis_flag: String,
    pub reviewers: Reviewers,
    /// A header a reverse proxy in front of the console sets to the
    /// signed-in reviewer's name (trusted as is: only for a console the
    /// proxy alone can reach).
    pub trusted_header: Option<String>,
    /// How long an entry a reviewer opened stays held for them.
    pub lease: std::time::Duration,
}

/// What every handler shares.
pub struct Console {
    pub store: RedisStore,
    pub config: ConsoleConfig,
    pub sessions: Sessions,
    pub cache: jobs::StatusCache,
    pub skipped: queue::Skipped,
}

pub type Shared = Arc<Console>;

/// Serves the console until `cancel`; the bound address goes to `bound`
/// (tests bind port 0).
pub async fn run(
    config: ConsoleConfig,
    store: RedisStore,
    cancel: CancellationToken,
    bound: Option<tokio::sync::oneshot::Sender<SocketAddr>>,
) -> anyhow::Result<()> {
    if config.reviewers.is_empty() && config.trusted_header.is_none() {
        anyhow::bail!(
            "no reviewer can sign in: give --tokens-file FILE or BATCHFLEET_CONSOLE_TOKENS (`name:token` lines), \
             or --trusted-header NAME behind a reverse proxy that sets it"
        );
    }
    let listener = tokio::net::TcpListener::bind(config.bind)
        .await
        .map_err(|e| anyhow::anyhow!("--bind {}: {e}", config.bind))?;
    let addr = listener.local_addr()?;
    let console = Arc::new(Console {
        store,
        config,
        sessions: Sessions::default(),
        cache: jobs::StatusCache::default(),
        skipped: queue::Skipped::default(),
    });
    let app = router(console);
    common::errln!("console: serving on http://{addr}");
    if let Some(tx) = bound {
        let _ = tx.send(addr);
    }
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { cancel.cancelled().await })
        .await?;
    Ok(())
}

/// Every route of the console.
pub fn router(console: Shared) -> Router {
    Router::new()
        .route("/", get(jobs::jobs_page))
        .route("/login", get(login_page).post(login))
        .route("/healthz", get(|| async { "ok" }))
        .route("/logout", post(logout))
        .route("/static/console.js", get(script))
        .route("/static/console.css", get(style))
        .route("/compare", get(compare::compare_page))
        .route("/workers", get(workers::workers_page))
        .route("/jobs/{job}", get(jobs::job_page))
        .route("/jobs/{job}/live", get(jobs::job_live))
        .route("/jobs/{job}/confirm", get(jobs::confirm_page))
        .route("/jobs/{job}/cancel", post(jobs::cancel))
        .route("/jobs/{job}/resume", post(jobs::resume))
        .route("/jobs/{job}/delete", post(jobs::delete))
        .route("/jobs/{job}/review", get(queue::queue_page))
        .route("/jobs/{job}/review/next", get(queue::next_entry))
        .route("/jobs/{job}/review-bulk", post(queue::bulk))
        .route("/jobs/{job}/rerun", get(rerun::rerun_page))
        .route("/jobs/{job}/review/{rid}", get(queue::entry_page))
        .route("/jobs/{job}/review/{rid}/accept", post(queue::accept))
        .route("/jobs/{job}/review/{rid}/requeue", post(queue::requeue))
        .route("/jobs/{job}/review/{rid}/reject", post(queue::reject))
        .route("/jobs/{job}/review/{rid}/skip", post(queue::skip))
        .route("/jobs/{job}/audit", get(audit::next))
        .route("/jobs/{job}/audit/{rid}", get(audit::item).post(audit::judge))
        .with_state(console)
}

/// The reviewer a request comes from: the trusted proxy header when the
/// console has one and the request carries it, else the session cookie.
pub fn reviewer(c: &Console, headers: &HeaderMap) -> Option<String> {
    if let Some(name) = &c.config.trusted_header
        && let Some(who) = headers.get(name.as_str()).and_then(|v| v.to_str().ok())
    {
        let who = who.trim();
        return auth::valid_name(who).then(|| who.to_owned());
    }
    auth::cookie(headers, auth::COOKIE).and_then(|id| c.sessions.reviewer(&id))
}

/// The page furniture every page template gets: who is signed in and the
/// token their forms carry.
#[derive(Debug, Clone, Default)]
pub struct Chrome {
    pub reviewer: String,
    pub csrf: String,
}

impl Chrome {
    pub fn of(c: &Console, reviewer: &str) -> Chrome {
        Chrome {
            reviewer: reviewer.to_owned(),
            csrf: c.sessions.csrf(reviewer),
        }
    }
}

/// Why a request ends before its page: each becomes a response of its own.
pub enum Refusal {
    /// Not signed in: to the sign-in page.
    SignIn,
    /// A form without the reviewer's CSRF token, or from another site.
    Forbidden,
    NotFound(String),
    /// A request that names something real but cannot be done as asked.
    Unprocessable(String),
    /// Redis failed: the page says so (never a secret: store errors carry none).
    Store(common::store::StoreError),
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        match self {
            Refusal::SignIn => Redirect::to("/login").into_response(),
            Refusal::Forbidden => message(
                StatusCode::FORBIDDEN,
                "Refused",
                "This form did not come from this console's page (its token is missing or stale). Reload the page and try again.",
            ),
            Refusal::NotFound(what) => message(StatusCode::NOT_FOUND, "Not found", &what),
            Refusal::Unprocessable(what) => message(StatusCode::UNPROCESSABLE_ENTITY, "Not done", &what),
            Refusal::Store(e) => message(StatusCode::SERVICE_UNAVAILABLE, "Redis failed", &e.to_string()),
        }
    }
}

impl From<common::store::StoreError> for Refusal {
    fn from(e: common::store::StoreError) -> Self {
        Refusal::Store(e)
    }
}

/// A review action's failure other than a lost race (those are answered
/// where they happen): Redis, or what it names.
impl From<crate::review::ReviewError> for Refusal {
    fn from(e: crate::review::ReviewError) -> Self {
        match e {
            crate::review::ReviewError::Store(e) => Refusal::Store(e),
            crate::review::ReviewError::NotFound(what) => Refusal::NotFound(what),
            other => Refusal::Unprocessable(other.to_string()),
        }
    }
}

/// A job's spec as enqueued, or a 404 naming the job.
pub async fn job_spec(c: &Console, job: &str) -> Result<common::spec::JobSpec, Refusal> {
    c.store
        .job_spec(job)
        .await?
        .ok_or_else(|| Refusal::NotFound(format!("There is no job `{job}`.")))
}

/// The reviewer of a page request, or to the sign-in page.
pub fn signed_in(c: &Console, headers: &HeaderMap) -> Result<String, Refusal> {
    reviewer(c, headers).ok_or(Refusal::SignIn)
}

/// The reviewer of a state-changing request whose form carries `csrf`.
pub fn may_act(c: &Console, headers: &HeaderMap, csrf: &str) -> Result<String, Refusal> {
    let who = signed_in(c, headers)?;
    if !auth::same_origin(headers) || csrf != c.sessions.csrf(&who) {
        return Err(Refusal::Forbidden);
    }
    Ok(who)
}

#[derive(Template)]
#[template(path = "message.html")]
struct MessagePage<'a> {
    chrome: Chrome,
    title: &'a str,
    text: &'a str,
}

/// A page that only says something, with its status.
pub fn message(status: StatusCode, title: &str, text: &str) -> Response {
    page(
        status,
        &MessagePage {
            chrome: Chrome::default(),
            title,
            text,
        },
    )
}

/// A rendered template with its status (a template that fails to render is a 500).
pub fn page(status: StatusCode, t: &impl Template) -> Response {
    match t.render() {
        Ok(html) => (status, Html(html)).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("template: {e}")).into_response(),
    }
}

#[derive(Template)]
#[template(path = "login.html")]
struct LoginPage<'a> {
    chrome: Chrome,
    error: &'a str,
    proxy: bool,
}

async fn login_page(State(c): State<Shared>) -> Response {
    page(
        StatusCode::OK,
        &LoginPage {
            chrome: Chrome::default(),
            error: "",
            proxy: c.config.trusted_header.is_some() && c.config.reviewers.is_empty(),
        },
    )
}

#[derive(serde::Deserialize)]
struct LoginForm {
    token: String,
}

async fn login(State(c): State<Shared>, Form(f): Form<LoginForm>) -> Response {
    let Some(who) = c.config.reviewers.who(&f.token) else {
        // A little wait makes guessing slow.
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        return page(
            StatusCode::UNAUTHORIZED,
            &LoginPage {
                chrome: Chrome::default(),
                error: "That token is not a reviewer's token.",
                proxy: false,
            },
        );
    };
    let id = c.sessions.open(&who);
    let cookie = format!("{}={id}; Path=/; HttpOnly; SameSite=Strict", auth::COOKIE);
    let mut r = Redirect::to("/").into_response();
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}

#[derive(serde::Deserialize)]
struct CsrfForm {
    csrf: String,
}

async fn logout(State(c): State<Shared>, headers: HeaderMap, Form(f): Form<CsrfForm>) -> Result<Response, Refusal> {
    may_act(&c, &headers, &f.csrf)?;
    if let Some(id) = auth::cookie(&headers, auth::COOKIE) {
        c.sessions.close(&id);
    }
    let mut r = Redirect::to("/login").into_response();
    let gone = format!("{}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0", auth::COOKIE);
    if let Ok(v) = HeaderValue::from_str(&gone) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    Ok(r)
}

async fn script() -> Response {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        include_str!("../../static/console.js"),
    )
        .into_response()
}

async fn style() -> Response {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        include_str!("../../static/console.css"),
    )
        .into_response()
}

/// `1234567` as `1,234,567`.
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn thousands_are_grouped() {
        assert_eq!(super::thousands(0), "0");
        assert_eq!(super::thousands(1234567), "1,234,567");
        assert_eq!(super::thousands(100), "100");
    }
}

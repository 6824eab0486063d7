//! The Workers page: every worker of the fleet as its heartbeat says,
//! dead and stopped ones greyed until their entry expires.

use askama::Template;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;

use super::{Chrome, Refusal, Shared, page, signed_in};

/// One row of the table.
struct WorkerRow {
    id: String,
    host: String,
    version: String,
    state: &'static str,
    gone: bool,
    jobs: String,
    in_flight: u64,
    rate: String,
    started: String,
    last_seen: String,
}

#[derive(Template)]
#[template(path = "workers.html")]
struct WorkersPage {
    chrome: Chrome,
    workers: Vec<WorkerRow>,
    live: usize,
}

pub async fn workers_page(State(c): State<Shared>, headers: HeaderMap) -> Result<Response, Refusal> {
    let who = signed_in(&c, &headers)?;
    let lines = crate::workers::list(&c.store).await?;
    let workers: Vec<WorkerRow> = lines
        .iter()
        .map(|l| WorkerRow {
            id: l.beat.id.clone(),
            host: l.beat.host.clone(),
            version: l.beat.version.clone(),
            state: l.state.name(),
            gone: l.state.gone(),
            jobs: l.beat.jobs.join(", "),
            in_flight: l.beat.in_flight,
            rate: format!("{:.2}/s", l.beat.rate_per_sec),
            started: l.started(),
            last_seen: l.last_seen(),
        })
        .collect();
    let live = workers.iter().filter(|w| !w.gone).count();
    Ok(page(
        StatusCode::OK,
        &WorkersPage {
            chrome: Chrome::of(&c, &who),
            workers,
            live,
        },
    ))
}

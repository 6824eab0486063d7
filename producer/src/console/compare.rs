//! Two jobs side by side, as `producer compare` shows them (usually the same
//! records under two prompt versions), with the failures per error code and
//! field drawn as paired bars.

use askama::Template;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde::Deserialize;

use super::{Chrome, Refusal, Shared, chart, page, signed_in};

#[derive(Debug, Deserialize)]
pub struct Pair {
    #[serde(default)]
    a: String,
    #[serde(default)]
    b: String,
}

#[derive(Template)]
#[template(path = "compare.html")]
struct ComparePage {
    chrome: Chrome,
    jobs: Vec<String>,
    a: String,
    b: String,
    /// None until two jobs are chosen.
    shown: Option<Shown>,
}

struct Shown {
    chain_a: String,
    chain_b: String,
    rows: Vec<(String, String, String)>,
    codes: Vec<(String, String, String)>,
    chart: String,
    regressions: Vec<String>,
    fixed: Vec<String>,
}

pub async fn compare_page(
    State(c): State<Shared>,
    Query(q): Query<Pair>,
    headers: HeaderMap,
) -> Result<Response, Refusal> {
    let who = signed_in(&c, &headers)?;
    let jobs = c.store.jobs().await?;
    let shown = if q.a.is_empty() || q.b.is_empty() {
        None
    } else {
        for job in [&q.a, &q.b] {
            if c.store.load_manifest(job).await?.is_none() {
                return Err(Refusal::NotFound(format!("There is no job `{job}`.")));
            }
        }
        let cmp = crate::compare::compare(&c.store, &q.a, &q.b)
            .await
            .map_err(|e| Refusal::NotFound(format!("{e:#}")))?;
        let codes = crate::compare::code_rows(&cmp);
        Some(Shown {
            chain_a: crate::report::chain_line(&cmp.a.chain),
            chain_b: crate::report::chain_line(&cmp.b.chain),
            rows: crate::compare::rows(&cmp),
            chart: chart::paired_bars(
                &codes
                    .iter()
                    .map(|(k, _, _, a, b)| (k.clone(), *a, *b))
                    .collect::<Vec<_>>(),
                "failed attempts by code and field, share of attempts (A, B)",
            ),
            codes: codes.into_iter().map(|(k, a, b, _, _)| (k, a, b)).collect(),
            regressions: cmp.regressions,
            fixed: cmp.fixed,
        })
    };
    Ok(page(
        StatusCode::OK,
        &ComparePage {
            chrome: Chrome::of(&c, &who),
            jobs,
            a: q.a,
            b: q.b,
            shown,
        },
    ))
}

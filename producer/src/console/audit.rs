//! Spot checks in the browser: one sampled result at a time (its input and
//! its output as it is now); a person marks it correct, or incorrect with the
//! output it should have had (validated; kept as a revision of the result);
//! the job's page shows the accuracy the verdicts estimate.

use askama::Template;
use axum::extract::{Form, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use serde::Deserialize;
use serde_json::Value;

use super::queue::path_part;
use super::{Chrome, Console, Refusal, Shared, job_spec, may_act, page, signed_in};
use crate::audit::Judged;
use crate::review::ReviewError;

/// The skipped set of the audit queue (kept apart from the review queue's).
fn skip_key(job: &str) -> String {
    format!("{job} audit")
}

#[derive(Template)]
#[template(path = "audit.html")]
struct AuditPage {
    chrome: Chrome,
    job: String,
    rid: String,
    key: String,
    model: String,
    human: bool,
    input: String,
    output: String,
    editor: String,
    refused: Vec<String>,
    waiting: u64,
    accuracy: String,
}

#[derive(Template)]
#[template(path = "audit_done.html")]
struct NothingWaits {
    chrome: Chrome,
    job: String,
    accuracy: String,
    labels: Vec<(String, String, String)>,
}

/// The next result waiting for this reviewer's spot check, or the accuracy
/// when none is left.
pub async fn next(State(c): State<Shared>, Path(job): Path<String>, headers: HeaderMap) -> Result<Response, Refusal> {
    let who = signed_in(&c, &headers)?;
    let spec = job_spec(&c, &job).await?;
    let skipped = c.skipped.of(&who, &skip_key(&job));
    match c.store.audit_next(&job, spec.job.partitions, &skipped).await? {
        Some(item) => Ok(Redirect::to(&format!(
            "/jobs/{}/audit/{}",
            path_part(&job),
            path_part(&item.record_id)
        ))
        .into_response()),
        None => {
            let a = c.store.accuracy(&job, spec.job.partitions).await?;
            Ok(page(
                StatusCode::OK,
                &NothingWaits {
                    chrome: Chrome::of(&c, &who),
                    accuracy: a.overall.text(),
                    labels: a
                        .by_label
                        .iter()
                        .map(|(f, v, r)| (f.clone(), v.clone(), r.text()))
                        .collect(),
                    job,
                },
            ))
        }
    }
}

async fn render(
    c: &Console,
    who: &str,
    job: &str,
    rid: &str,
    editor: Option<String>,
    refused: Vec<String>,
) -> Result<Response, Refusal> {
    let spec = job_spec(c, job).await?;
    let p = common::record::partition_of(rid, spec.job.partitions);
    let Some(item) = c.store.audit_item(job, p, rid).await? else {
        return Err(Refusal::NotFound(format!(
            "Record {rid} does not wait for a spot check (any more)."
        )));
    };
    let result = crate::audit::current_result(&c.store, &spec, job, rid)
        .await
        .map_err(|e| match e {
            ReviewError::Store(e) => Refusal::Store(e),
            other => Refusal::NotFound(other.to_string()),
        })?
        .ok_or_else(|| Refusal::NotFound(format!("Record {rid} has no result.")))?;
    let input = result
        .input
        .as_ref()
        .map(|i| i.get().to_owned())
        .or(item.input)
        .map(|t| pretty(&t))
        .unwrap_or_else(|| "(the input was not kept with this result)".to_owned());
    let output = serde_json::to_string_pretty(&Value::Object(result.output.clone())).unwrap_or_default();
    // The fields code fills in (the record id, who made it) are not the reviewer's to edit.
    let mut editable = result.output.clone();
    editable.remove("record_id");
    editable.remove("_model");
    let editable = serde_json::to_string_pretty(&Value::Object(editable)).unwrap_or_default();
    let a = c.store.accuracy(job, spec.job.partitions).await?;
    let status = if refused.is_empty() {
        StatusCode::OK
    } else {
        StatusCode::UNPROCESSABLE_ENTITY
    };
    Ok(page(
        status,
        &AuditPage {
            chrome: Chrome::of(c, who),
            job: job.to_owned(),
            rid: rid.to_owned(),
            key: result.key.clone(),
            model: result.model.clone(),
            human: result.human,
            input,
            editor: editor.unwrap_or(editable),
            output,
            refused,
            waiting: a.waiting,
            accuracy: a.overall.text(),
        },
    ))
}

fn pretty(text: &str) -> String {
    serde_json::from_str::<Value>(text)
        .ok()
        .and_then(|v| serde_json::to_string_pretty(&v).ok())
        .unwrap_or_else(|| text.to_owned())
}

pub async fn item(
    State(c): State<Shared>,
    Path((job, rid)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, Refusal> {
    let who = signed_in(&c, &headers)?;
    render(&c, &who, &job, &rid, None, Vec::new()).await
}

#[derive(Debug, Deserialize)]
pub struct VerdictForm {
    csrf: String,
    /// `correct`, `incorrect` or `skip`.
    verdict: String,
    #[serde(default)]
    output: String,
    #[serde(default)]
    note: String,
}

pub async fn judge(
    State(c): State<Shared>,
    Path((job, rid)): Path<(String, String)>,
    headers: HeaderMap,
    Form(f): Form<VerdictForm>,
) -> Result<Response, Refusal> {
    let who = may_act(&c, &headers, &f.csrf)?;
    let spec = job_spec(&c, &job).await?;
    let next = format!("/jobs/{}/audit", path_part(&job));
    let note = Some(f.note.trim()).filter(|n| !n.is_empty());
    let corrected = match f.verdict.as_str() {
        "skip" => {
            c.skipped.add(&who, &skip_key(&job), &rid);
            return Ok(Redirect::to(&next).into_response());
        }
        "correct" => None,
        "incorrect" => Some(f.output.as_str()),
        other => return Err(Refusal::NotFound(format!("No verdict `{other}`."))),
    };
    match crate::audit::judge(&c.store, &spec, &job, &rid, corrected, note, &who).await {
        Ok(Judged::Recorded(_)) => {
            tracing::info!(job = %job, record_id = %rid, reviewer = %who, correct = corrected.is_none(), "spot check");
            Ok(Redirect::to(&next).into_response())
        }
        Ok(Judged::Already(v)) => {
            let what = match v {
                Some(v) => format!(
                    "Already judged by {} at {} ({}). Nothing was done.",
                    v.by,
                    v.at,
                    if v.correct { "correct" } else { "incorrect" }
                ),
                None => "It does not wait for a spot check. Nothing was done.".to_owned(),
            };
            Ok(super::queue::decided_page(&c, &who, &job, &rid, what, next))
        }
        // Nothing saved: the page again with the correction and its errors.
        Err(ReviewError::Invalid(errors)) => {
            let errors = errors
                .into_iter()
                .map(|e| e.trim_start_matches("  - ").to_owned())
                .collect();
            render(&c, &who, &job, &rid, Some(f.output.clone()), errors).await
        }
        Err(ReviewError::Store(e)) => Err(Refusal::Store(e)),
        Err(e) => Ok(super::message(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Not done",
            &e.to_string(),
        )),
    }
}

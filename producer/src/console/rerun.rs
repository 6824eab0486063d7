//! The Re-run page of a job: the same filter as `producer rerun`, the count
//! of done records it selects and a sample, and, once counted, the command
//! that runs them again in a new job (a new job needs a changed spec, which
//! is a file the operator writes: the console does not take one).

use askama::Template;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde::Deserialize;

use super::{Chrome, Refusal, Shared, page, signed_in};

/// The filter as the page's form sends it.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct RerunQuery {
    code: String,
    field: String,
    text: String,
    min_attempts: String,
    since: String,
    until: String,
    output: String,
    into: String,
}

#[derive(Template)]
#[template(path = "rerun.html")]
struct RerunPage {
    chrome: Chrome,
    job: String,
    q: RerunQuery,
    /// Set once a filter was counted.
    counted: Option<Counted>,
    refused: Option<String>,
}

struct Counted {
    matched: usize,
    /// And those their input decides, read from their dataset line when run
    /// (the input is not kept with their result).
    by_line: usize,
    sample: Vec<String>,
    command: String,
}

impl RerunQuery {
    fn filter(&self) -> Result<crate::filter::Filter, String> {
        let min_attempts = match self.min_attempts.trim() {
            "" => None,
            n => Some(
                n.parse::<u32>()
                    .map_err(|_| format!("at least `{n}` attempts: give a whole number"))?,
            ),
        };
        let f = crate::filter::Filter {
            code: self.code.trim().to_owned(),
            field: self.field.trim().to_owned(),
            text: self.text.trim().to_owned(),
            min_attempts,
            since: self.since.trim().to_owned(),
            until: self.until.trim().to_owned(),
            output: (!self.output.trim().is_empty())
                .then(|| self.output.trim().to_owned())
                .into_iter()
                .collect(),
            ..crate::filter::Filter::default()
        };
        f.check_done()?;
        Ok(f)
    }

    fn asked(&self) -> bool {
        [
            &self.code,
            &self.field,
            &self.text,
            &self.min_attempts,
            &self.since,
            &self.until,
            &self.output,
        ]
        .iter()
        .any(|v| !v.trim().is_empty())
    }

    /// The command line's flags for this filter, quoted for a shell.
    fn flags(&self) -> String {
        let mut out = String::new();
        for (flag, v) in [
            ("--code", &self.code),
            ("--field", &self.field),
            ("--text", &self.text),
            ("--min-attempts", &self.min_attempts),
            ("--since", &self.since),
            ("--until", &self.until),
            ("--output", &self.output),
        ] {
            if !v.trim().is_empty() {
                out.push_str(&format!(" {flag} {}", shell_quote(v.trim())));
            }
        }
        out
    }
}

fn shell_quote(s: &str) -> String {
    if s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.:/@".contains(&b)) {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

pub async fn rerun_page(
    State(c): State<Shared>,
    headers: HeaderMap,
    Path(job): Path<String>,
    Query(q): Query<RerunQuery>,
) -> Result<Response, Refusal> {
    let who = signed_in(&c, &headers)?;
    let spec = c
        .store
        .job_spec(&job)
        .await?
        .ok_or_else(|| Refusal::NotFound(format!("no job `{job}`")))?;
    let mut view = RerunPage {
        chrome: Chrome::of(&c, &who),
        job: job.clone(),
        q: q.clone(),
        counted: None,
        refused: None,
    };
    if q.asked() {
        match q.filter() {
            Err(why) => view.refused = Some(why),
            Ok(f) => {
                let (keep, by_line) = crate::select::done_matching(&c.store, &job, spec.job.partitions, &f)
                    .await
                    .map_err(|e| Refusal::Unprocessable(e.to_string()))?;
                // Of the records that surely match, the first by id.
                let mut sample: Vec<String> = keep.iter().cloned().collect();
                sample.sort();
                sample.truncate(crate::filter::SAMPLE);
                let dataset = c
                    .store
                    .load_manifest(&job)
                    .await?
                    .and_then(|m| m.datasets.first().map(|d| d.dataset.path.clone()))
                    .unwrap_or_else(|| "DATASET.jsonl".into());
                let into = match q.into.trim() {
                    "" => format!("{job}-again"),
                    name => name.to_owned(),
                };
                if into == job {
                    view.refused = Some(format!(
                        "the new job must have another name than `{job}`: both results stay, and compare shows them"
                    ));
                    return Ok(page(StatusCode::OK, &view));
                }
                if let Err(e) = common::store::valid_job_name(&into) {
                    view.refused = Some(format!("the new job's name: {e}"));
                    return Ok(page(StatusCode::OK, &view));
                }
                let command = format!(
                    "producer rerun {} --from-job {job} --job {into} --spec CHANGED-SPEC.toml{}{} --yes",
                    shell_quote(&dataset),
                    q.flags(),
                    c.config.redis_flag,
                );
                view.counted = Some(Counted {
                    matched: keep.len(),
                    by_line: by_line.len(),
                    sample,
                    command,
                });
            }
        }
    }
    Ok(page(StatusCode::OK, &view))
}

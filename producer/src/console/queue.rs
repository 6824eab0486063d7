//! The review queue in the browser: a page of entries at a time (filters by
//! reason, error code, field and text in the input; paging by cursor, so a
//! queue of any length is never read whole), and one entry's page: input,
//! rendered prompt, last raw output with the errors at their fields, the
//! attempt history, and the actions, applied by the same atomic scripts as
//! `producer review` (only to the entry as the page showed it).

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use askama::Template;
use axum::extract::{Form, Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use common::store::ReviewLease;
use common::task::{HistoryItem, ReviewEntry};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{Chrome, Console, Refusal, Shared, job_spec, may_act, page, signed_in, thousands};
use crate::filter::field_of;
use crate::review::ReviewError;

/// Entries a page aims at (a scan step may bring a few more).
const PAGE: usize = 50;
/// Entries one request reads at most looking for matches (a rare filter
/// gives a short page with a link to go on).
const SCAN_BUDGET: usize = 2000;

/// Entries each reviewer skipped, per job, while this console runs: the
/// next entry is never one of them.
#[derive(Default)]
pub struct Skipped(Mutex<HashMap<(String, String), HashSet<String>>>);

impl Skipped {
    pub fn add(&self, reviewer: &str, job: &str, rid: &str) {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.entry((reviewer.to_owned(), job.to_owned()))
            .or_default()
            .insert(rid.to_owned());
    }

    pub fn of(&self, reviewer: &str, job: &str) -> HashSet<String> {
        let m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.get(&(reviewer.to_owned(), job.to_owned()))
            .cloned()
            .unwrap_or_default()
    }

    fn clear(&self, reviewer: &str, job: &str) {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.remove(&(reviewer.to_owned(), job.to_owned()));
    }
}

/// A job name or record id as a URL path part (job names and record ids are
/// plain already; anything else is percent-encoded).
pub fn path_part(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The queue's filters and where the page starts (`c`: `<partition>.<scan
/// cursor>`), as the page's query string carries them.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
pub struct Filters {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub code: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub field: String,
    /// Text the record's input contains (case-insensitive).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub q: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub c: String,
}

impl Filters {
    fn matches(&self, e: &ReviewEntry) -> bool {
        self.bulk().matches(e)
    }

    /// The same selection as the command line's `review bulk` makes.
    pub fn bulk(&self) -> crate::filter::Filter {
        crate::filter::Filter {
            reason: self.reason.clone(),
            code: self.code.clone(),
            field: self.field.clone(),
            text: self.q.clone(),
            ..crate::filter::Filter::default()
        }
    }

    /// The query string (`?...`, or empty).
    pub fn query(&self) -> String {
        let q = serde_urlencoded::to_string(self).unwrap_or_default();
        if q.is_empty() { q } else { format!("?{q}") }
    }

    fn at(&self, c: &Cursor) -> Filters {
        Filters {
            c: c.encode(),
            ..self.clone()
        }
    }

    fn active(&self) -> bool {
        !(self.reason.is_empty() && self.code.is_empty() && self.field.is_empty() && self.q.is_empty())
    }
}

/// Where a page of the queue starts: a partition and its `HSCAN` cursor.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Cursor {
    partition: u32,
    scan: u64,
}

impl Cursor {
    fn parse(s: &str) -> Cursor {
        s.split_once('.')
            .and_then(|(p, c)| {
                Some(Cursor {
                    partition: p.parse().ok()?,
                    scan: c.parse().ok()?,
                })
            })
            .unwrap_or_default()
    }

    fn encode(&self) -> String {
        if *self == Cursor::default() {
            String::new()
        } else {
            format!("{}.{}", self.partition, self.scan)
        }
    }
}

/// One page of matching entries from the filters' cursor, and where the
/// next page starts (None at the end of the queue).
async fn page_of(
    c: &Console,
    job: &str,
    partitions: u32,
    f: &Filters,
    skipped: &HashSet<String>,
) -> Result<(Vec<ReviewEntry>, Option<Cursor>), Refusal> {
    let mut cur = Cursor::parse(&f.c);
    let (mut out, mut scanned) = (Vec::new(), 0);
    while cur.partition < partitions && out.len() < PAGE && scanned < SCAN_BUDGET {
        let (entries, next) = c.store.review_page(job, cur.partition, cur.scan, PAGE / 2).await?;
        scanned += entries.len().max(1);
        out.extend(
            entries
                .into_iter()
                .filter(|e| f.matches(e) && !skipped.contains(&e.record_id)),
        );
        cur = if next == 0 {
            Cursor {
                partition: cur.partition + 1,
                scan: 0,
            }
        } else {
            Cursor {
                partition: cur.partition,
                scan: next,
            }
        };
    }
    Ok((out, (cur.partition < partitions).then_some(cur)))
}

/// An entry as the queue page lists it.
pub struct Row {
    pub href: String,
    pub rid: String,
    pub key: String,
    pub reason: String,
    pub attempts: u32,
    pub codes: String,
    pub created: String,
    pub input: String,
}

#[derive(Template)]
#[template(path = "queue.html")]
struct QueuePage {
    chrome: Chrome,
    job: String,
    f: Filters,
    rows: Vec<Row>,
    depth: String,
    next: Option<String>,
    first: Option<String>,
    skipped: usize,
    filtered: bool,
    /// With filters: how many entries of the whole queue they match, and
    /// their digest (the bulk buttons act on exactly these).
    matching: Option<usize>,
    digest: String,
}

pub async fn queue_page(
    State(c): State<Shared>,
    Path(job): Path<String>,
    Query(f): Query<Filters>,
    headers: HeaderMap,
) -> Result<Response, Refusal> {
    let who = signed_in(&c, &headers)?;
    let spec = job_spec(&c, &job).await?;
    let skipped = c.skipped.of(&who, &job);
    let (entries, next) = page_of(&c, &job, spec.job.partitions, &f, &skipped).await?;
    let base = format!("/jobs/{}/review", path_part(&job));
    // With filters, the whole queue's matches are counted (a read of the
    // whole queue: only then), for the bulk buttons.
    let matching = match f.active() {
        true => Some(crate::filter::select(&c.store, &job, spec.job.partitions, &f.bulk()).await?),
        false => None,
    };
    let rows = entries
        .iter()
        .map(|e| Row {
            href: format!("{base}/{}{}", path_part(&e.record_id), f.query()),
            rid: e.record_id[..16.min(e.record_id.len())].to_owned(),
            key: e.key.clone(),
            reason: e.reason.clone(),
            attempts: e.attempts,
            codes: if e.errors.is_empty() {
                // Not the output's fault: what the last attempt came to.
                e.history
                    .iter()
                    .rev()
                    .find_map(HistoryItem::as_attempt)
                    .map(|a| a.outcome.clone())
                    .unwrap_or_default()
            } else {
                e.errors
                    .iter()
                    .map(|x| format!("{} {}", x.code.as_str(), x.field))
                    .collect::<Vec<_>>()
                    .join(", ")
            },
            created: e.created_at.clone(),
            input: excerpt(e.input.get(), 140),
        })
        .collect();
    Ok(page(
        StatusCode::OK,
        &QueuePage {
            chrome: Chrome::of(&c, &who),
            depth: thousands(c.store.review_depth(&job, spec.job.partitions).await?),
            next: next.map(|n| format!("{base}{}", f.at(&n).query())),
            first: (!f.c.is_empty()).then(|| {
                format!(
                    "{base}{}",
                    Filters {
                        c: String::new(),
                        ..f.clone()
                    }
                    .query()
                )
            }),
            skipped: skipped.len(),
            filtered: f.active(),
            matching: matching.as_ref().map(Vec::len),
            digest: matching.as_deref().map(crate::filter::digest).unwrap_or_default(),
            rows,
            f,
            job,
        },
    ))
}

#[derive(Debug, Deserialize)]
pub struct BulkForm {
    csrf: String,
    /// `requeue` or `reject`.
    action: String,
    /// How many entries the page said the filters match, and their digest:
    /// the action is refused when the set changed meanwhile.
    expected: usize,
    digest: String,
    #[serde(default)]
    note: String,
    #[serde(default)]
    because: String,
    #[serde(flatten)]
    f: Filters,
}

/// Requeues or rejects every entry the queue page's filters match, when
/// they still match as many as the page said; recorded in the job's
/// bulk-action log.
pub async fn bulk(
    State(c): State<Shared>,
    Path(job): Path<String>,
    headers: HeaderMap,
    Form(form): Form<BulkForm>,
) -> Result<Response, Refusal> {
    let who = may_act(&c, &headers, &form.csrf)?;
    let spec = job_spec(&c, &job).await?;
    let action = match form.action.as_str() {
        "requeue" => crate::bulk::Bulk::Requeue {
            note: Some(form.note.trim().to_owned()).filter(|n| !n.is_empty()),
        },
        "reject" if !form.because.trim().is_empty() => crate::bulk::Bulk::Reject {
            reason: form.because.trim().to_owned(),
        },
        "reject" => {
            return Ok(super::message(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Not rejected",
                "A bulk rejection needs a reason. Nothing was done.",
            ));
        }
        other => return Err(Refusal::NotFound(format!("no bulk action `{other}`"))),
    };
    let filter = form.f.bulk();
    if filter == crate::filter::Filter::default() {
        return Ok(super::message(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Nothing done",
            "A bulk action needs a filter (reason, error code, field or text). Nothing was done.",
        ));
    }
    let entries = crate::filter::select(&c.store, &job, spec.job.partitions, &filter).await?;
    if crate::filter::digest(&entries) != form.digest {
        return Ok(super::message(
            StatusCode::CONFLICT,
            "The queue changed",
            &format!(
                "The page counted {} entries matching these filters; the {} matching now are not the same entries. Nothing was done: look at the queue again.",
                form.expected,
                entries.len()
            ),
        ));
    }
    let done = crate::bulk::apply(&c.store, &job, &action, &filter, &entries, &who).await?;
    tracing::info!(job = %job, reviewer = %who, action = action.name(), acted = done.acted, "bulk review action from the console");
    let back = format!("/jobs/{}/review", path_part(&job));
    Ok(super::message(
        StatusCode::OK,
        "Done",
        &format!(
            "{} {} of {} entries ({} decided by someone else meanwhile, {} left to the reviewers who have them open); recorded in the bulk-action log ({}). Back to the queue: {back}",
            action.name(),
            done.acted,
            done.matched,
            done.lost,
            done.held,
            done.log_id
        ),
    ))
}

fn excerpt(text: &str, max: usize) -> String {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    if end < text.len() {
        format!("{}…", &text[..end])
    } else {
        text.to_owned()
    }
}

/// A top-level field of the last output, with the errors about it.
pub struct OutputField {
    pub name: String,
    pub value: String,
    pub errors: Vec<String>,
}

/// One attempt of the history, or a person's action.
pub struct Step {
    pub what: String,
    pub at: String,
    pub outcome: String,
    pub detail: String,
}

#[derive(Template)]
#[template(path = "entry.html")]
struct EntryPage {
    chrome: Chrome,
    job: String,
    rid: String,
    e: ReviewEntry,
    /// `sha256(the entry as shown)`: an action applies only to this.
    version: String,
    input: String,
    /// The last output's top-level fields (when it is a JSON object), else
    /// the raw text.
    fields: Vec<OutputField>,
    raw: String,
    /// Errors about no field of the output (the whole output, a missing one).
    general: Vec<String>,
    steps: Vec<Step>,
    editor: String,
    /// Errors of a submitted output that was refused (nothing was saved).
    refused: Vec<String>,
    query: String,
    next: String,
    base: String,
    /// Another reviewer holds the entry: who (empty: this reviewer holds it).
    held: String,
    /// The edit form, from the field spec.
    form_fields: Vec<super::form::FormField>,
    /// A cross-check's two answers, field by field (field, first, checker, agreed).
    check_rows: Vec<(String, String, String, bool)>,
    check_model: String,
}

#[derive(Debug, Deserialize)]
pub struct EntryQuery {
    #[serde(flatten)]
    f: Filters,
}

pub async fn entry_page(
    State(c): State<Shared>,
    Path((job, rid)): Path<(String, String)>,
    Query(q): Query<EntryQuery>,
    headers: HeaderMap,
) -> Result<Response, Refusal> {
    let who = signed_in(&c, &headers)?;
    let spec = job_spec(&c, &job).await?;
    let (entry, p) = read_entry(&c, &job, &spec, &rid)
        .await?
        .ok_or_else(|| gone(&job, &rid))?;
    let editor = crate::review::editable(&entry);
    let mut view = entry_view(&c, &who, &job, &spec, entry, &q.f, editor, Vec::new());
    // Opening an entry holds it for this reviewer, unless another does.
    if let ReviewLease::HeldBy { reviewer } = c.store.review_lease(&job, p, &rid, &who, c.config.lease).await? {
        view.held = format!(
            "{reviewer} is reviewing this entry (held until they act on it, leave it, or their lease runs out): \
             the next entry button finds a free one."
        );
    }
    Ok(page(StatusCode::OK, &view))
}

fn gone(job: &str, rid: &str) -> Refusal {
    Refusal::NotFound(format!(
        "Record {rid} is not in job {job}'s review queue (any more): someone may have decided it."
    ))
}

/// The entry of a record in review, and its partition.
async fn read_entry(
    c: &Console,
    job: &str,
    spec: &common::spec::JobSpec,
    rid: &str,
) -> Result<Option<(ReviewEntry, u32)>, Refusal> {
    let p = common::record::partition_of(rid, spec.job.partitions);
    Ok(c.store.review_entry(job, p, rid).await?.map(|e| (e, p)))
}

fn version_of(e: &ReviewEntry) -> String {
    use sha2::Digest;
    hex::encode(&sha2::Sha256::digest(e.seen.as_bytes())[..12])
}

#[allow(clippy::too_many_arguments)]
fn entry_view(
    c: &Console,
    who: &str,
    job: &str,
    spec: &common::spec::JobSpec,
    e: ReviewEntry,
    f: &Filters,
    editor: String,
    refused: Vec<String>,
) -> EntryPage {
    let base = format!("/jobs/{}/review", path_part(job));
    let input = serde_json::from_str::<Value>(e.input.get())
        .ok()
        .and_then(|v| serde_json::to_string_pretty(&v).ok())
        .unwrap_or_else(|| e.input.get().to_owned());
    let mut by_field: HashMap<String, Vec<String>> = HashMap::new();
    for err in &e.errors {
        by_field
            .entry(field_of(&err.field).to_owned())
            .or_default()
            .push(err.to_string());
    }
    let mut fields = Vec::new();
    if let Ok(Value::Object(o)) = serde_json::from_str::<Value>(&e.last_raw_output) {
        for (k, v) in o {
            fields.push(OutputField {
                errors: by_field.get(&k).cloned().unwrap_or_default(),
                value: serde_json::to_string_pretty(&v).unwrap_or_default(),
                name: k,
            });
        }
    }
    // The edit form, filled from the output being edited, with the model's
    // errors at their fields.
    let editing = serde_json::from_str::<Value>(&editor).unwrap_or(Value::Null);
    let form_fields = super::form::fields(spec, &editing, &by_field);
    // Errors about fields the output lacks, or about the output as a whole.
    let mut general: Vec<String> = by_field
        .into_iter()
        .filter(|(k, _)| !fields.iter().any(|f| f.name == *k))
        .flat_map(|(_, v)| v)
        .collect();
    general.sort();
    let steps = steps_of(&e);
    let verdict = e
        .history
        .iter()
        .rev()
        .find_map(HistoryItem::as_attempt)
        .and_then(|a| a.check.clone());
    let (check_rows, check_model) = verdict.map(|v| (v.side_by_side(), v.model)).unwrap_or_default();
    let query = f.query();
    let next = format!(
        "{base}/next{}{}after={}",
        query,
        if query.is_empty() { "?" } else { "&" },
        path_part(&e.record_id)
    );
    EntryPage {
        chrome: Chrome::of(c, who),
        job: job.to_owned(),
        rid: e.record_id.clone(),
        version: version_of(&e),
        input,
        fields,
        raw: e.last_raw_output.clone(),
        general,
        steps,
        editor,
        refused,
        next,
        base,
        query,
        e,
        held: String::new(),
        form_fields,
        check_rows,
        check_model,
    }
}

/// The entry's history as the page lists it: attempts and people's actions.
fn steps_of(e: &ReviewEntry) -> Vec<Step> {
    e.history
        .iter()
        .map(|h| match h {
            HistoryItem::Attempt(a) => Step {
                what: format!("attempt {} (call {})", a.attempt, a.call),
                at: a.at.clone(),
                outcome: format!("{} → {}", a.outcome, a.decision),
                detail: {
                    let mut d: Vec<String> = a.errors.iter().map(ToString::to_string).collect();
                    if let Some(u) = &a.usage {
                        d.push(format!("{} + {} tokens", u.prompt, u.completion));
                    }
                    if let Some(m) = &a.error {
                        d.push(m.clone());
                    }
                    d.push(format!("{} ms, {}", a.elapsed_ms, a.worker));
                    d.join("; ")
                },
            },
            HistoryItem::Action(a) => Step {
                what: format!("{} by {}", a.action, a.by),
                at: a.at.clone(),
                outcome: String::new(),
                detail: a.note.clone().or_else(|| a.reason.clone()).unwrap_or_default(),
            },
        })
        .collect()
}

#[derive(Debug, Deserialize)]
pub struct NextQuery {
    #[serde(flatten)]
    f: Filters,
    #[serde(default)]
    after: String,
}

/// Gives a reviewer's lease on an entry back (it expires by itself anyway).
async fn release(c: &Console, job: &str, partitions: u32, rid: &str, who: &str) {
    let p = common::record::partition_of(rid, partitions);
    if let Err(e) = c.store.review_release(job, p, rid, who).await {
        tracing::debug!(error = %e, "a review lease was not given back (it expires by itself)");
    }
}

/// The next entry of the queue (from the page the last one was on, past
/// the reviewer's skipped ones and `after`), or the queue page when none is
/// left.
pub async fn next_entry(
    State(c): State<Shared>,
    Path(job): Path<String>,
    Query(q): Query<NextQuery>,
    headers: HeaderMap,
) -> Result<Response, Refusal> {
    let who = signed_in(&c, &headers)?;
    let spec = job_spec(&c, &job).await?;
    Ok(Redirect::to(&next_href(&c, &who, &job, &spec, &q.f, &q.after).await?).into_response())
}

async fn next_href(
    c: &Console,
    who: &str,
    job: &str,
    spec: &common::spec::JobSpec,
    f: &Filters,
    after: &str,
) -> Result<String, Refusal> {
    let mut skipped = c.skipped.of(who, job);
    skipped.insert(after.to_owned());
    let partitions = spec.job.partitions;
    if !after.is_empty() {
        // The entry this reviewer leaves is free for others again.
        release(c, job, partitions, after, who).await;
    }
    let base = format!("/jobs/{}/review", path_part(job));
    let mut from = f.clone();
    // From the page the last entry was on, then on; then once from the start.
    // The first entry no other reviewer holds is leased to this one.
    for _ in 0..4 {
        let (entries, next) = page_of(c, job, partitions, &from, &skipped).await?;
        for e in &entries {
            let p = common::record::partition_of(&e.record_id, partitions);
            if c.store.review_lease(job, p, &e.record_id, who, c.config.lease).await? == ReviewLease::Mine {
                return Ok(format!("{base}/{}{}", path_part(&e.record_id), from.query()));
            }
        }
        match next {
            Some(n) => from = from.at(&n),
            None if !from.c.is_empty() => from = from.at(&Cursor::default()),
            None => break,
        }
    }
    Ok(format!(
        "{base}{}",
        Filters {
            c: String::new(),
            ..f.clone()
        }
        .query()
    ))
}

#[derive(Debug, Deserialize)]
pub struct ActionForm {
    csrf: String,
    /// The entry's version as the page showed it.
    version: String,
    #[serde(default)]
    output: String,
    /// `fields`: the output comes from the edit form's fields (`field.NAME`);
    /// otherwise from `output` (the JSON editor).
    #[serde(default)]
    mode: String,
    /// The edit form's fields, and anything else the form sent.
    #[serde(flatten)]
    fields: HashMap<String, String>,
    #[serde(default)]
    note: String,
    #[serde(default)]
    reason: String,
    /// The queue's filters and cursor, to go on with.
    #[serde(default)]
    query: String,
}

impl ActionForm {
    fn filters(&self) -> Filters {
        serde_urlencoded::from_str(self.query.trim_start_matches('?')).unwrap_or_default()
    }
}

#[derive(Template)]
#[template(path = "decided.html")]
struct DecidedPage {
    chrome: Chrome,
    job: String,
    rid: String,
    what: String,
    back: String,
}

/// The entry as the form's page showed it, or the answer for a reviewer
/// who came second (409: who decided, and when).
async fn entry_as_shown(
    c: &Console,
    who: &str,
    job: &str,
    spec: &common::spec::JobSpec,
    rid: &str,
    form: &ActionForm,
) -> Result<Result<(ReviewEntry, u32), Response>, Refusal> {
    let back = format!("/jobs/{}/review{}", path_part(job), form.filters().query());
    match read_entry(c, job, spec, rid).await? {
        Some((e, p)) if version_of(&e) == form.version => Ok(Ok((e, p))),
        Some(_) => Ok(Err(decided_page(
            c,
            who,
            job,
            rid,
            "The entry changed since this page showed it (another round of attempts came back to review). Nothing was done: look at it again.".into(),
            back,
        ))),
        None => {
            let what = who_decided(c, job, spec, rid, "It is no longer in review.").await?;
            Ok(Err(decided_page(c, who, job, rid, what, back)))
        }
    }
}

/// Who decided an entry and when, from its archive (else `otherwise`).
async fn who_decided(
    c: &Console,
    job: &str,
    spec: &common::spec::JobSpec,
    rid: &str,
    otherwise: &str,
) -> Result<String, Refusal> {
    let p = common::record::partition_of(rid, spec.job.partitions);
    let last = c
        .store
        .archived_review(job, p, rid)
        .await?
        .and_then(|a| a.actions.last().cloned());
    Ok(match last {
        Some(a) => format!(
            "Already decided by {} at {} ({}). Nothing was done.",
            a.by, a.at, a.action
        ),
        None => format!("{otherwise} Nothing was done."),
    })
}

/// The answer to a reviewer who came second: who decided (409).
pub fn decided_page(c: &Console, who: &str, job: &str, rid: &str, what: String, back: String) -> Response {
    page(
        StatusCode::CONFLICT,
        &DecidedPage {
            chrome: Chrome::of(c, who),
            job: job.to_owned(),
            rid: rid.to_owned(),
            what,
            back,
        },
    )
}

/// Who acts, the job's spec, and the entry as the form's page showed it
/// with its partition; or the answer for a reviewer who came second.
async fn acting(
    c: &Console,
    headers: &HeaderMap,
    job: &str,
    rid: &str,
    form: &ActionForm,
) -> Result<Result<(String, common::spec::JobSpec, ReviewEntry, u32), Response>, Refusal> {
    let who = may_act(c, headers, &form.csrf)?;
    let spec = job_spec(c, job).await?;
    Ok(entry_as_shown(c, &who, job, &spec, rid, form)
        .await?
        .map(|(entry, p)| (who, spec, entry, p)))
}

/// What an action came to: on to the next entry, or the answer for a race lost.
async fn acted(
    c: &Console,
    who: &str,
    job: &str,
    spec: &common::spec::JobSpec,
    rid: &str,
    form: &ActionForm,
    done: Result<String, ReviewError>,
) -> Result<Response, Refusal> {
    let back = format!("/jobs/{}/review{}", path_part(job), form.filters().query());
    match done {
        Ok(_) => {
            tracing::info!(job = %job, record_id = %rid, reviewer = %who, "review action from the console");
            let next = next_href(c, who, job, spec, &form.filters(), rid).await?;
            Ok(Redirect::to(&next).into_response())
        }
        Err(ReviewError::Lost(_)) => {
            let what = who_decided(c, job, spec, rid, "Someone acted on it first.").await?;
            Ok(decided_page(c, who, job, rid, what, back))
        }
        Err(ReviewError::AlreadyDone(_)) => Ok(decided_page(
            c,
            who,
            job,
            rid,
            "The record already has a result. Nothing was done.".into(),
            back,
        )),
        Err(ReviewError::Store(e)) => Err(Refusal::Store(e)),
        Err(e) => Ok(super::message(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Not done",
            &e.to_string(),
        )),
    }
}

pub async fn accept(
    State(c): State<Shared>,
    Path((job, rid)): Path<(String, String)>,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> Result<Response, Refusal> {
    let (who, spec, entry, p) = match acting(&c, &headers, &job, &rid, &form).await? {
        Ok(found) => found,
        Err(answer) => return Ok(answer),
    };
    // The output the form made: its fields, checked again here, or the JSON editor's text.
    let output = if form.mode == "fields" {
        match super::form::output_of(&spec, &form.fields) {
            Ok(output) => output,
            Err(problems) => {
                // The page again, filled with what was sent.
                let sent = super::form::echo(&spec, &form.fields);
                let view = entry_view(&c, &who, &job, &spec, entry, &form.filters(), sent, problems);
                return Ok(page(StatusCode::UNPROCESSABLE_ENTITY, &view));
            }
        }
    } else {
        form.output.clone()
    };
    match crate::review::accept_entry(&c.store, &spec, &job, p, &entry, &output, &who).await {
        // Nothing saved: the page again, with the edit and the errors at it.
        Err(ReviewError::Invalid(errors)) => {
            let errors = errors
                .into_iter()
                .map(|e| e.trim_start_matches("  - ").to_owned())
                .collect();
            Ok(page(
                StatusCode::UNPROCESSABLE_ENTITY,
                &entry_view(&c, &who, &job, &spec, entry, &form.filters(), output, errors),
            ))
        }
        done => acted(&c, &who, &job, &spec, &rid, &form, done).await,
    }
}

pub async fn requeue(
    State(c): State<Shared>,
    Path((job, rid)): Path<(String, String)>,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> Result<Response, Refusal> {
    let (who, spec, entry, p) = match acting(&c, &headers, &job, &rid, &form).await? {
        Ok(found) => found,
        Err(answer) => return Ok(answer),
    };
    let note = Some(form.note.trim()).filter(|n| !n.is_empty());
    let done = crate::review::requeue_entry(&c.store, &job, p, &entry, note, &who).await;
    acted(&c, &who, &job, &spec, &rid, &form, done).await
}

pub async fn reject(
    State(c): State<Shared>,
    Path((job, rid)): Path<(String, String)>,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> Result<Response, Refusal> {
    let reason = form.reason.trim();
    if reason.is_empty() {
        return Ok(super::message(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Not rejected",
            "A rejection needs a reason. Nothing was done.",
        ));
    }
    let (who, spec, entry, p) = match acting(&c, &headers, &job, &rid, &form).await? {
        Ok(found) => found,
        Err(answer) => return Ok(answer),
    };
    let done = crate::review::reject_entry(&c.store, &job, p, &entry, reason, &who).await;
    acted(&c, &who, &job, &spec, &rid, &form, done).await
}

/// Leaves the entry for later: this reviewer's next entries pass it by.
pub async fn skip(
    State(c): State<Shared>,
    Path((job, rid)): Path<(String, String)>,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> Result<Response, Refusal> {
    let who = may_act(&c, &headers, &form.csrf)?;
    let spec = job_spec(&c, &job).await?;
    if rid == "*" {
        c.skipped.clear(&who, &job);
        let back = format!("/jobs/{}/review{}", path_part(&job), form.filters().query());
        return Ok(Redirect::to(&back).into_response());
    }
    c.skipped.add(&who, &job, &rid);
    let next = next_href(&c, &who, &job, &spec, &form.filters(), &rid).await?;
    Ok(Redirect::to(&next).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_travel_in_the_query_and_cursors_round_trip() {
        let f = Filters {
            code: "E_ENUM".into(),
            q: "a&b c".into(),
            ..Filters::default()
        };
        assert_eq!(f.query(), "?code=E_ENUM&q=a%26b+c");
        let back: Filters = serde_urlencoded::from_str(f.query().trim_start_matches('?')).unwrap();
        assert_eq!(back.q, "a&b c");
        let c = Cursor { partition: 2, scan: 77 };
        assert_eq!(Cursor::parse(&c.encode()), c);
        assert_eq!(Cursor::parse("junk"), Cursor::default());
        assert_eq!(Filters::default().query(), "");
        assert_eq!(field_of("items[0].qty"), "items");
        assert_eq!(path_part("a/b c"), "a%2Fb%20c");
    }
}

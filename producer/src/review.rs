//! `producer review`: people drain the review queue. Every action is one
//! atomic script that only applies if the entry is unchanged since it was
//! read, records who and when, and archives the entry with its actions.

use std::path::Path;

use common::spec::JobSpec;
use common::store::{RedisStore, ReviewAction, ReviewOutcome};
use common::task::{Action, HistoryItem, ResultRecord, ReviewEntry, Stamp};
use common::validate::{Validation, validate, validate_record};
use serde_json::Value;
use std::collections::{HashMap, HashSet};
use tokio_util::sync::CancellationToken;

use crate::terminal::Terminal;

/// Why a review command did not apply.
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    #[error("{0}")]
    NotFound(String),
    #[error("the corrected output is invalid:\n{}", .0.join("\n"))]
    Invalid(Vec<String>),
    #[error("record {0} was handled by another reviewer first (or changed meanwhile): nothing was done")]
    Lost(String),
    #[error("record {0} already has a result: nothing was done")]
    AlreadyDone(String),
    #[error(transparent)]
    Store(#[from] common::store::StoreError),
    #[error("{0}")]
    Io(String),
    /// A command that would do something other than what was meant (a
    /// flag missing, a bulk action past its threshold without --yes).
    #[error("{0}")]
    Refused(String),
}

/// A job's spec as enqueued.
pub async fn job_spec(store: &RedisStore, job: &str) -> Result<JobSpec, ReviewError> {
    store
        .job_spec(job)
        .await?
        .ok_or_else(|| ReviewError::NotFound(format!("job `{job}` does not exist")))
}

/// Every review entry of a job, optionally filtered by reason or error code,
/// in record id order.
pub async fn list(
    store: &RedisStore,
    job: &str,
    reason: Option<&str>,
    code: Option<&str>,
) -> Result<Vec<ReviewEntry>, ReviewError> {
    let spec = job_spec(store, job).await?;
    let f = crate::filter::Filter {
        reason: reason.unwrap_or_default().to_owned(),
        code: code.unwrap_or_default().to_owned(),
        ..crate::filter::Filter::default()
    };
    let mut out: Vec<ReviewEntry> = crate::filter::select(store, job, spec.job.partitions, &f)
        .await?
        .into_iter()
        .map(|(e, _)| e)
        .collect();
    out.sort_by(|a, b| a.record_id.cmp(&b.record_id));
    Ok(out)
}

/// Finds an entry by record id, a unique record id prefix, or business key.
/// Returns the entry and its partition.
pub async fn find(store: &RedisStore, job: &str, id: &str) -> Result<(ReviewEntry, u32), ReviewError> {
    let spec = job_spec(store, job).await?;
    let mut found: Vec<(ReviewEntry, u32)> = Vec::new();
    for p in 0..spec.job.partitions {
        store
            .review_entries(job, p, |e| {
                let rid = &e.record_id;
                if rid == id || (id.len() >= 8 && rid.starts_with(id)) || e.key == id {
                    found.push((e, p));
                }
            })
            .await?;
    }
    match found.len() {
        1 => Ok(found.remove(0)),
        0 => Err(ReviewError::NotFound(format!(
            "no review entry for `{id}` in job `{job}`"
        ))),
        n => Err(ReviewError::NotFound(format!(
            "`{id}` matches {n} review entries: give more of the record id"
        ))),
    }
}

/// A record id given as one, or made from the business key it was given as.
pub(crate) fn record_id_of(job: &str, spec: &JobSpec, id: &str) -> String {
    if id.len() == 64 && id.chars().all(|c| c.is_ascii_hexdigit()) {
        id.to_owned()
    } else {
        common::record::IdContext::new(job, spec).record_id(id)
    }
}

/// The archived entry of a record people acted on, by record id or
/// business key, and its partition.
pub async fn find_archived(store: &RedisStore, job: &str, id: &str) -> Result<(ReviewEntry, u32), ReviewError> {
    let spec = job_spec(store, job).await?;
    let rid = record_id_of(job, &spec, id);
    let p = common::record::partition_of(&rid, spec.job.partitions);
    match store.archived_review(job, p, &rid).await? {
        Some(e) => Ok((e, p)),
        None => Err(ReviewError::NotFound(format!(
            "no review entry for `{id}` in job `{job}`, in the queue or among those people acted on"
        ))),
    }
}

/// Accepts a person's output for a record: validated like a model output,
/// then committed as the record's result, marked human-provided.
pub async fn accept(
    store: &RedisStore,
    job: &str,
    id: &str,
    output: &str,
    reviewer: &str,
) -> Result<String, ReviewError> {
    let spec = job_spec(store, job).await?;
    let (entry, p) = find(store, job, id).await?;
    accept_entry(store, &spec, job, p, &entry, output, reviewer).await
}

/// [`accept`] of an entry as it was read (only if it is still exactly that).
pub async fn accept_entry(
    store: &RedisStore,
    spec: &JobSpec,
    job: &str,
    p: u32,
    entry: &ReviewEntry,
    output: &str,
    reviewer: &str,
) -> Result<String, ReviewError> {
    let spec = spec.clone();
    let (out, repairs) = match validate_record(&spec, output, Some(&entry.input.object())) {
        Validation::Valid { output, repairs } => (output, repairs),
        Validation::Invalid { errors, .. } => {
            return Err(ReviewError::Invalid(
                errors.iter().map(|e| format!("  - {e}")).collect(),
            ));
        }
    };
    let mut result = ResultRecord::from_review(entry, out, repairs, &Stamp::now(&spec), reviewer);
    if !spec.sink.is_none() {
        result.input = Some(entry.input.clone());
    }
    let act = Action::new("accept", reviewer);
    apply(store, job, p, entry, act, &ReviewAction::Accept(Box::new(result))).await?;
    Ok(entry.record_id.clone())
}

/// Revises a done record's result: the output, validated like a model
/// output, becomes the result's latest revision and the one it replaces is
/// kept (never a silent overwrite). Where the result is: in Redis for a job
/// without a sink (`revise.lua`: only if nobody revised it since it was
/// read); in the sink once it left Redis (a row of `<table>_revisions` and
/// the results row updated in one transaction, or a revision file the
/// manifest lists). A result still on its way to the sink is refused for the
/// moment: it is written as committed, then revised there. Returns the
/// record id, the revision number and where it was kept.
pub async fn revise(
    store: &RedisStore,
    job: &str,
    id: &str,
    output: &str,
    note: Option<&str>,
    reviewer: &str,
) -> Result<(String, u32, String), ReviewError> {
    let spec = job_spec(store, job).await?;
    let rid = record_id_of(job, &spec, id);
    let p = common::record::partition_of(&rid, spec.job.partitions);
    must_be_done(store.record_state(job, p, &rid).await?, job, id, &rid)?;
    let (kept, now) = Kept::find(store, &spec, job, p, &rid).await?;
    let out = revised_output(&spec, output, &now, kept.input().as_ref(), &rid, reviewer)?;
    let (n, place) = kept.revise(store, &spec, job, p, &rid, out, reviewer, note).await?;
    Ok((rid, n, place))
}

/// Where a done record's result is kept, with what revising it needs.
enum Kept {
    /// In Redis (a job without a sink): the result as read, and its text.
    Redis {
        current: ResultRecord,
        read: String,
    },
    Postgres(common::sink::PgSink),
    Files {
        dir: String,
        written: common::sink::files::Written,
    },
}

impl Kept {
    /// The record's input, where the result keeps it (its rules about the
    /// input judge the revision too).
    fn input(&self) -> Option<serde_json::Map<String, Value>> {
        match self {
            Kept::Redis { current, .. } => current.input.as_ref().map(|i| i.object()),
            _ => None,
        }
    }

    /// Where the record's result is, and its output as it is now. A result
    /// still on its way to the sink is refused for the moment.
    async fn find(
        store: &RedisStore,
        spec: &JobSpec,
        job: &str,
        p: u32,
        rid: &str,
    ) -> Result<(Kept, serde_json::Map<String, Value>), ReviewError> {
        use common::spec::SinkKind;
        let io = |e: common::sink::SinkError| ReviewError::Io(e.to_string());
        let none = || ReviewError::NotFound(format!("record {rid} has no result to revise"));
        let read = store.result_text(job, p, rid).await?;
        let current = read
            .as_deref()
            .map(ResultRecord::decode)
            .transpose()
            .map_err(|e| ReviewError::Io(e.to_string()))?;
        match (spec.sink.kind, current, read) {
            (SinkKind::None, Some(current), Some(read)) => {
                let now = current.output.clone();
                Ok((Kept::Redis { current, read }, now))
            }
            (SinkKind::None, _, _) => Err(none()),
            (_, Some(_), _) => Err(ReviewError::Io(format!(
                "record {rid}'s result is on its way to the sink: revise it once it is written (a few seconds; `producer status` shows the sink's backlog)"
            ))),
            (SinkKind::Files, None, _) => {
                let dir = spec.sink.dir.clone().unwrap_or_default();
                let written = common::sink::files::find_written(Path::new(&dir), job, rid)
                    .map_err(io)?
                    .ok_or_else(none)?;
                match written.current(Path::new(&dir), job).map_err(io)? {
                    Value::Object(now) => Ok((Kept::Files { dir, written }, now)),
                    _ => Err(none()),
                }
            }
            (SinkKind::Postgres, None, _) => {
                let context = format!("record {rid}'s result is in PostgreSQL");
                let sink = crate::sink::connect(spec, &context, "to revise it")
                    .await
                    .map_err(|e| ReviewError::Io(e.to_string()))?;
                match sink.output(job, rid).await.map_err(io)? {
                    Some(Value::Object(now)) => Ok((Kept::Postgres(sink), now)),
                    _ => Err(none()),
                }
            }
        }
    }

    /// Keeps `out` as the result's latest revision where the result is (the
    /// one it replaces is kept): its revision number, and where.
    #[allow(clippy::too_many_arguments)]
    async fn revise(
        self,
        store: &RedisStore,
        spec: &JobSpec,
        job: &str,
        p: u32,
        rid: &str,
        out: serde_json::Map<String, Value>,
        reviewer: &str,
        note: Option<&str>,
    ) -> Result<(u32, String), ReviewError> {
        let io = |e: common::sink::SinkError| ReviewError::Io(e.to_string());
        match self {
            Kept::Redis { current, read } => {
                let revised = current.revised(out, reviewer, note);
                let n = revised.revisions.last().map_or(0, |v| v.revision);
                match store.revise_result(job, p, rid, &read, &revised).await? {
                    1 => Ok((
                        n,
                        "in Redis (the output it replaced is kept in the result's revisions)".into(),
                    )),
                    0 => Err(ReviewError::Lost(rid.to_owned())),
                    _ => Err(ReviewError::NotFound(format!("record {rid} has no result in Redis"))),
                }
            }
            Kept::Postgres(mut db) => {
                let table = spec.sink.table();
                match db
                    .revise(job, rid, &Value::Object(out), reviewer, note)
                    .await
                    .map_err(io)?
                {
                    Some(n) => Ok((
                        u32::try_from(n).unwrap_or(0),
                        format!("in PostgreSQL (the output it replaced is in {table}_revisions)"),
                    )),
                    None => Err(ReviewError::NotFound(format!(
                        "table {table} has no row of record {rid}"
                    ))),
                }
            }
            Kept::Files { dir, written } => {
                let value = Value::Object(out);
                let n =
                    common::sink::files::revise(Path::new(&dir), job, &written, &value, reviewer, note).map_err(io)?;
                Ok((n, format!("in the files sink ({dir}, revisions/)")))
            }
        }
    }
}

/// Only a committed result is revised.
fn must_be_done(state: Option<common::task::RecordState>, job: &str, id: &str, rid: &str) -> Result<(), ReviewError> {
    match state {
        Some(common::task::RecordState::Done) => Ok(()),
        Some(other) => Err(ReviewError::NotFound(format!(
            "record {rid} is {}, not done: only a committed result is revised (a record in review is accepted)",
            other.encode()
        ))),
        None => Err(ReviewError::NotFound(format!("job `{job}` has no record `{id}`"))),
    }
}

/// A reviewer's output for a revision, validated like a model output:
/// fields filled from the input keep what the input gave them (`now`),
/// stamped as a person's.
fn revised_output(
    spec: &common::spec::JobSpec,
    output: &str,
    now: &serde_json::Map<String, Value>,
    input: Option<&serde_json::Map<String, Value>>,
    rid: &str,
    reviewer: &str,
) -> Result<serde_json::Map<String, Value>, ReviewError> {
    let mut given: Value = serde_json::from_str(output)
        .map_err(|e| ReviewError::Invalid(vec![format!("  - the output is not JSON: {e}")]))?;
    if let Value::Object(o) = &mut given {
        for (name, f) in spec.output.fields.iter() {
            if let (Some(_), Some(v)) = (&f.from_input, now.get(name.as_str())) {
                o.insert(name.clone(), v.clone());
            }
        }
    }
    match validate_record(spec, &given.to_string(), input) {
        Validation::Valid { output, .. } => Ok(Stamp::now(spec).human_output(output, rid, reviewer)),
        Validation::Invalid { errors, .. } => Err(ReviewError::Invalid(
            errors.iter().map(|e| format!("  - {e}")).collect(),
        )),
    }
}

/// Puts a record back on the stream for a fresh round of attempts (the
/// attempt count goes on); the note and the earlier attempts stay in its history.
pub async fn requeue(
    store: &RedisStore,
    job: &str,
    id: &str,
    note: Option<&str>,
    reviewer: &str,
) -> Result<String, ReviewError> {
    let (entry, p) = find(store, job, id).await?;
    requeue_entry(store, job, p, &entry, note, reviewer).await
}

/// [`requeue`] of an entry as it was read (only if it is still exactly that).
pub async fn requeue_entry(
    store: &RedisStore,
    job: &str,
    p: u32,
    entry: &ReviewEntry,
    note: Option<&str>,
    reviewer: &str,
) -> Result<String, ReviewError> {
    let act = Action {
        note: note.map(str::to_owned),
        ..Action::new("requeue", reviewer)
    };
    let task = entry.requeue(&act);
    apply(store, job, p, entry, act, &ReviewAction::Requeue(task)).await?;
    Ok(entry.record_id.clone())
}

/// Rejects a record: terminal (`dropped:rejected`), kept in the archive.
pub async fn reject(
    store: &RedisStore,
    job: &str,
    id: &str,
    reason: &str,
    reviewer: &str,
) -> Result<String, ReviewError> {
    let (entry, p) = find(store, job, id).await?;
    reject_entry(store, job, p, &entry, reason, reviewer).await
}

/// [`reject`] of an entry as it was read (only if it is still exactly that).
pub async fn reject_entry(
    store: &RedisStore,
    job: &str,
    p: u32,
    entry: &ReviewEntry,
    reason: &str,
    reviewer: &str,
) -> Result<String, ReviewError> {
    let act = Action {
        reason: Some(reason.to_owned()),
        ..Action::new("reject", reviewer)
    };
    let action = ReviewAction::Reject {
        reason: reason.to_owned(),
    };
    apply(store, job, p, entry, act, &action).await?;
    Ok(entry.record_id.clone())
}

async fn apply(
    store: &RedisStore,
    job: &str,
    p: u32,
    entry: &ReviewEntry,
    act: Action,
    action: &ReviewAction,
) -> Result<(), ReviewError> {
    let archived = entry.archived(act);
    match store.review_act(job, p, entry, &archived, action).await? {
        ReviewOutcome::Applied => Ok(()),
        ReviewOutcome::Lost => Err(ReviewError::Lost(entry.record_id.clone())),
        ReviewOutcome::AlreadyDone => Err(ReviewError::AlreadyDone(entry.record_id.clone())),
    }
}

/// The text a person edits with `--edit`: the last output, pretty when JSON.
pub fn editable(entry: &ReviewEntry) -> String {
    let raw = entry.last_raw_output.as_str();
    serde_json::from_str::<Value>(raw)
        .ok()
        .and_then(|v| serde_json::to_string_pretty(&v).ok())
        .unwrap_or_else(|| raw.to_owned())
}

/// Opens `$EDITOR` (default `vi`) on `text` and returns what was saved.
pub fn edit_in_editor(text: &str, dir: &Path) -> Result<String, ReviewError> {
    let path = dir.join(format!("batchfleet-review-{}.json", std::process::id()));
    std::fs::write(&path, text).map_err(|e| ReviewError::Io(format!("cannot write {}: {e}", path.display())))?;
    let editor = std::env::var("EDITOR").unwrap_or_else(|_| "vi".into());
    let status = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{editor} \"$1\""))
        .arg("sh")
        .arg(&path)
        .status()
        .map_err(|e| ReviewError::Io(format!("cannot run $EDITOR ({editor}): {e}")))?;
    let edited = std::fs::read_to_string(&path).map_err(|e| ReviewError::Io(e.to_string()));
    let _ = std::fs::remove_file(&path);
    if !status.success() {
        return Err(ReviewError::Io(format!(
            "$EDITOR ({editor}) exited with {status}: nothing was done"
        )));
    }
    edited
}

/// One decision of an import file.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ImportLine {
    record_id: String,
    /// accept | requeue | reject | skip (or empty: nothing to do)
    #[serde(default)]
    decision: Option<String>,
    /// For accept: the corrected output (an object, or its JSON text).
    #[serde(default)]
    output: Option<Value>,
    /// For requeue: a note; for reject: the reason.
    #[serde(default)]
    note: Option<String>,
    // Columns the export writes for people to read; accepted and ignored on
    // import (any other unknown column is an error: a typo must not pass).
    #[serde(default)]
    #[allow(dead_code)]
    key: Value,
    #[serde(default)]
    #[allow(dead_code)]
    reason: Value,
    #[serde(default)]
    #[allow(dead_code)]
    errors: Value,
    #[serde(default)]
    #[allow(dead_code)]
    last_raw_output: Value,
    #[serde(default)]
    #[allow(dead_code)]
    input: Value,
}

/// What an import did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ImportSummary {
    pub applied: u64,
    pub skipped: u64,
    /// `line N: why` for every line that changed nothing.
    pub rejected_lines: Vec<String>,
}

/// A line of `review export`: the entry's facts and the columns to fill in.
#[derive(serde::Serialize)]
struct QueueLine<'a> {
    record_id: &'a str,
    key: &'a str,
    reason: &'a str,
    errors: &'a [common::validate::FieldError],
    last_raw_output: &'a str,
    input: &'a common::task::Input,
    decision: Option<&'a str>,
    output: Option<&'a Value>,
    note: Option<&'a str>,
}

/// The review queue as JSONL for people who review in a spreadsheet: one line
/// per entry with empty `decision`, `output` and `note` columns to fill in.
pub async fn export_queue(store: &RedisStore, job: &str, out: &mut impl std::io::Write) -> Result<u64, ReviewError> {
    let entries = list(store, job, None, None).await?;
    for e in &entries {
        let line = QueueLine {
            record_id: &e.record_id,
            key: &e.key,
            reason: &e.reason,
            errors: &e.errors,
            last_raw_output: &e.last_raw_output,
            input: &e.input,
            decision: None,
            output: None,
            note: None,
        };
        let line = serde_json::to_string(&line).map_err(|e| ReviewError::Io(e.to_string()))?;
        writeln!(out, "{line}").map_err(|e| ReviewError::Io(e.to_string()))?;
    }
    Ok(entries.len() as u64)
}

/// Applies the decisions of an import file. Every line is checked first
/// (JSON, decision, output validated against the spec); a bad line is
/// reported with its number and changes nothing, the good ones are applied.
pub async fn import(store: &RedisStore, job: &str, text: &str, who: &str) -> Result<ImportSummary, ReviewError> {
    let spec = job_spec(store, job).await?;
    let mut out = ImportSummary::default();
    let mut good: Vec<(usize, ImportLine, Option<String>)> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let n = i + 1;
        if raw.trim().is_empty() {
            continue;
        }
        let line: ImportLine = match serde_json::from_str(raw) {
            Ok(l) => l,
            Err(e) => {
                out.rejected_lines
                    .push(format!("line {n}: not a valid import line: {e}"));
                continue;
            }
        };
        let decision = line.decision.clone().unwrap_or_default();
        let output = match decision.as_str() {
            "" | "skip" => {
                out.skipped += 1;
                continue;
            }
            "accept" => {
                let text = match &line.output {
                    Some(Value::String(s)) => s.clone(),
                    Some(v @ Value::Object(_)) => v.to_string(),
                    _ => {
                        out.rejected_lines
                            .push(format!("line {n}: accept needs an `output` object"));
                        continue;
                    }
                };
                if let Validation::Invalid { errors, .. } = validate(&spec, &text) {
                    let errs: Vec<String> = errors.iter().map(ToString::to_string).collect();
                    out.rejected_lines
                        .push(format!("line {n}: output is invalid: {}", errs.join("; ")));
                    continue;
                }
                Some(text)
            }
            "requeue" => None,
            "reject" if line.note.as_deref().is_some_and(|r| !r.trim().is_empty()) => None,
            "reject" => {
                out.rejected_lines
                    .push(format!("line {n}: reject needs a reason in `note`"));
                continue;
            }
            other => {
                out.rejected_lines.push(format!(
                    "line {n}: unknown decision `{other}` (accept, requeue, reject, skip)"
                ));
                continue;
            }
        };
        good.push((n, line, output));
    }
    for (n, line, output) in good {
        let id = line.record_id.as_str();
        let done = match (line.decision.as_deref(), output) {
            (Some("accept"), Some(text)) => accept(store, job, id, &text, who).await,
            (Some("requeue"), _) => requeue(store, job, id, line.note.as_deref(), who).await,
            _ => reject(store, job, id, line.note.as_deref().unwrap_or(""), who).await,
        };
        match done {
            Ok(_) => out.applied += 1,
            Err(ReviewError::Store(e)) => return Err(ReviewError::Store(e)),
            Err(e) => out.rejected_lines.push(format!("line {n}: {e}")),
        }
    }
    Ok(out)
}

/// `review next`: one entry at a time at a terminal, one key per decision
/// (see [`crate::terminal`]). The entry is shown as text (its input and last
/// output as indented JSON, or as written; the errors, or for an entry with
/// none what its last attempt came to), with the count left. `e` opens the
/// reviewer's last edit of the entry if there is one (an invalid edit is
/// never lost), and an editor left without a change accepts nothing; `r`
/// and `j` ask for the note (it reaches the model) or the reason (Enter
/// alone: nothing done). Returns how many entries were acted on.
pub async fn next_loop(
    store: &RedisStore,
    job: &str,
    who: &str,
    cancel: &CancellationToken,
    lease: std::time::Duration,
) -> Result<u64, ReviewError> {
    let spec = job_spec(store, job).await?;
    let partitions = spec.job.partitions;
    let io = |e: std::io::Error| ReviewError::Io(e.to_string());
    let mut acted = 0;
    let mut skipped: HashSet<String> = HashSet::new();
    let mut edits: HashMap<String, String> = HashMap::new();
    let mut term = Terminal::enter();
    let mut holding = Holding::new(store, job, who);
    loop {
        let left = store.review_depth(job, partitions).await?;
        let (next, held) = next_free(store, job, partitions, &skipped, &holding.token, lease).await?;
        // The entry shown before, when this is another one, is free again.
        if next.as_ref().is_none_or(|(e, _)| !holding.holds(&e.record_id)) {
            holding.give_back().await;
        }
        let Some((e, p)) = next else {
            term.say(&nothing_left(job, skipped.len(), held, acted)).map_err(io)?;
            return Ok(acted);
        };
        let rid = e.record_id.clone();
        holding.held = Some((rid.clone(), p));
        // Held while it is on screen, however long that is (an editor
        // included); a session that dies stops renewing and the lease lapses.
        let _renewing = Renewal::start(store, job, p, &rid, &holding.token, lease);
        term.say(&entry_screen(&e, left, skipped.len())).map_err(io)?;
        term.say("[a]ccept as is  [e]dit and accept  [r]equeue  re[j]ect  [s]kip  [q]uit > ")
            .map_err(io)?;
        let key = term.key(cancel).map_err(io)?;
        if let Some(k) = key {
            term.say(&format!("{k}\n")).map_err(io)?;
        }
        // Quit, or the session ended (Ctrl-C, a closed terminal).
        let Some(key) = key.filter(|k| *k != 'q') else {
            holding.give_back().await;
            let lead = if key.is_none() { "\n" } else { "" };
            term.say(&format!("{lead}{acted} acted on\n")).map_err(io)?;
            return Ok(acted);
        };
        let result = if key == 's' {
            skipped.insert(rid.clone());
            Ok("skipped")
        } else {
            let entry = Shown {
                store,
                spec: &spec,
                job,
                who,
                p,
                e: &e,
            };
            entry.decide(key, &mut term, &mut edits).await?
        };
        let what = match result {
            Ok(what) => what,
            Err(ReviewError::Store(e)) => return Err(ReviewError::Store(e)),
            // An invalid accept or a lost race: say so, stay on the queue.
            Err(err) => {
                term.say(&format!("{err}\n")).map_err(io)?;
                continue;
            }
        };
        let done = matches!(what, "accepted" | "requeued" | "rejected");
        if done || what == "skipped" {
            holding.give_back().await;
        }
        if done {
            acted += 1;
            edits.remove(&rid);
        }
        term.say(&format!("{what}\n")).map_err(io)?;
    }
}

/// The entry a `review next` session holds a lease on, if any. The lease's
/// token is the session's: another session of the same reviewer is another holder.
struct Holding<'a> {
    store: &'a RedisStore,
    job: &'a str,
    token: String,
    held: Option<(String, u32)>,
}

impl<'a> Holding<'a> {
    fn new(store: &'a RedisStore, job: &'a str, who: &str) -> Holding<'a> {
        let token = format!("{who}#{:08x}", rand::random::<u32>());
        Holding {
            store,
            job,
            token,
            held: None,
        }
    }

    fn holds(&self, rid: &str) -> bool {
        self.held.as_ref().is_some_and(|(r, _)| r == rid)
    }

    /// Gives the held entry's lease back (the next reviewer may have it now).
    async fn give_back(&mut self) {
        let Some((rid, p)) = self.held.take() else { return };
        if let Err(e) = self.store.review_release(self.job, p, &rid, &self.token).await {
            tracing::debug!(error = %e, "a review lease was not given back (it expires by itself)");
        }
    }
}

/// The last words of `review next` when the queue has nothing more for this reviewer.
fn nothing_left(job: &str, skipped: usize, held: u64, acted: u64) -> String {
    let others = if held > 0 {
        format!(", {held} held by other reviewers")
    } else {
        String::new()
    };
    format!("\nreview queue of {job}: nothing left to review ({skipped} skipped{others}): {acted} acted on\n")
}

/// Renews a review lease every third of its time until dropped.
struct Renewal(tokio::task::JoinHandle<()>);

impl Renewal {
    fn start(store: &RedisStore, job: &str, p: u32, rid: &str, token: &str, lease: std::time::Duration) -> Renewal {
        let (store, job, rid, token) = (store.clone(), job.to_owned(), rid.to_owned(), token.to_owned());
        Renewal(tokio::spawn(async move {
            loop {
                tokio::time::sleep(lease / 3).await;
                if let Err(e) = store.review_lease(&job, p, &rid, &token, lease).await {
                    tracing::debug!(error = %e, "a review lease was not renewed");
                }
            }
        }))
    }
}

impl Drop for Renewal {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The entry `review next` shows, and what its keys do to it.
struct Shown<'a> {
    store: &'a RedisStore,
    spec: &'a JobSpec,
    job: &'a str,
    who: &'a str,
    p: u32,
    e: &'a ReviewEntry,
}

impl Shown<'_> {
    /// What `a`, `e`, `r` or `j` did (another key: nothing); Err only when
    /// the terminal failed.
    async fn decide(
        &self,
        key: char,
        term: &mut Terminal,
        edits: &mut HashMap<String, String>,
    ) -> Result<Result<&'static str, ReviewError>, ReviewError> {
        let io = |e: std::io::Error| ReviewError::Io(e.to_string());
        let (store, spec, job, who, p, e) = (self.store, self.spec, self.job, self.who, self.p, self.e);
        Ok(match key {
            'a' => accept_entry(store, spec, job, p, e, &e.last_raw_output, who)
                .await
                .map(|_| "accepted"),
            'e' => {
                let before = edits.get(&e.record_id).cloned().unwrap_or_else(|| editable(e));
                let edited = {
                    let _cooked = term.cooked();
                    edit_in_editor(&before, &std::env::temp_dir())
                };
                match edited {
                    Ok(text) if text.trim() == before.trim() => Ok("unchanged: nothing done"),
                    Ok(text) => {
                        edits.insert(e.record_id.clone(), text.clone());
                        accept_entry(store, spec, job, p, e, &text, who)
                            .await
                            .map(|_| "accepted")
                    }
                    Err(err) => Err(err),
                }
            }
            'r' => match term
                .line("note for the next attempt (the model sees it; Enter alone: nothing done) > ")
                .map_err(io)?
            {
                Some(note) if !note.trim().is_empty() => requeue_entry(store, job, p, e, Some(note.trim()), who)
                    .await
                    .map(|_| "requeued"),
                _ => Ok("nothing done"),
            },
            'j' => match term
                .line("reason for rejecting (Enter alone: nothing done) > ")
                .map_err(io)?
            {
                Some(reason) if !reason.trim().is_empty() => reject_entry(store, job, p, e, reason.trim(), who)
                    .await
                    .map(|_| "rejected"),
                _ => Ok("nothing done"),
            },
            _ => Ok("unknown key: nothing done"),
        })
    }
}

/// The first entry of the queue not skipped that no other reviewer holds,
/// now leased to `who` for `lease`, and its partition; and how many entries
/// other reviewers hold (paged: the queue is never read whole).
async fn next_free(
    store: &RedisStore,
    job: &str,
    partitions: u32,
    skipped: &HashSet<String>,
    token: &str,
    lease: std::time::Duration,
) -> Result<(Option<(ReviewEntry, u32)>, u64), ReviewError> {
    let mut held = 0;
    for p in 0..partitions {
        let mut cursor = 0;
        loop {
            let (entries, next) = store.review_page(job, p, cursor, 100).await?;
            for e in entries.into_iter().filter(|e| !skipped.contains(&e.record_id)) {
                match store.review_lease(job, p, &e.record_id, token, lease).await? {
                    common::store::ReviewLease::Mine => return Ok((Some((e, p)), held)),
                    common::store::ReviewLease::HeldBy { .. } => held += 1,
                }
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    Ok((None, held))
}

/// An entry as `review next` shows it: text, not JSON strings.
pub fn entry_screen(e: &ReviewEntry, left: u64, skipped: usize) -> String {
    let indent = |text: &str| -> String { text.lines().map(|l| format!("  {l}\n")).collect() };
    let pretty = |text: &str| -> String {
        serde_json::from_str::<Value>(text)
            .ok()
            .and_then(|v| serde_json::to_string_pretty(&v).ok())
            .unwrap_or_else(|| text.to_owned())
    };
    let mut s = format!(
        "\n=== {} ({})  {left} entries left{}\n",
        e.key,
        &e.record_id[..16.min(e.record_id.len())],
        if skipped > 0 {
            format!(" ({skipped} skipped)")
        } else {
            String::new()
        }
    );
    s.push_str(&format!("reason    {} · {} attempts\n", e.reason, e.attempts));
    if e.errors.is_empty() {
        // Not the output's fault, or no output at all: what the last attempt came to.
        if let Some(a) = e.history.iter().rev().find_map(HistoryItem::as_attempt) {
            s.push_str(&format!("last call {}", a.outcome));
            if !a.finish_reason.is_empty() {
                s.push_str(&format!(" · finish_reason {}", a.finish_reason));
            }
            if let Some(m) = &a.error {
                s.push_str(&format!(" · {m}"));
            }
            s.push('\n');
        }
    }
    for err in &e.errors {
        s.push_str(&format!("error     {err}\n"));
    }
    if let Some(v) = e
        .history
        .iter()
        .rev()
        .find_map(HistoryItem::as_attempt)
        .and_then(|a| a.check.as_ref())
    {
        s.push_str(&side_by_side(v));
    }
    s.push_str("input\n");
    s.push_str(&indent(&pretty(e.input.get())));
    s.push_str("last output\n");
    if e.last_raw_output.trim().is_empty() {
        s.push_str("  (empty)\n");
    } else {
        s.push_str(&indent(&pretty(&e.last_raw_output)));
    }
    s
}

/// A cross-check's two answers, field by field (`[check]`): what a reviewer
/// decides between. Accepting the entry as it is keeps the first model's.
pub fn side_by_side(v: &common::check::Verdict) -> String {
    let rows = v.side_by_side();
    let wf = rows.iter().map(|r| r.0.chars().count()).max().unwrap_or(0).clamp(5, 40);
    let wa = rows
        .iter()
        .map(|r| r.1.chars().count())
        .max()
        .unwrap_or(0)
        .clamp(11, 40);
    let cut = |t: &str| t.chars().take(40).collect::<String>();
    let mut s = format!("checker   {} disagrees (accepting keeps the first answer)\n", v.model);
    s.push_str(&format!("  {:<wf$}  {:<wa$}  {}\n", "field", "first model", "checker"));
    for (field, first, checker, agree) in &rows {
        let mark = if *agree { "" } else { "   <- differs" };
        s.push_str(&format!(
            "  {:<wf$}  {:<wa$}  {}{mark}\n",
            cut(field),
            cut(first),
            cut(checker)
        ));
    }
    s
}

//! `producer review`: people drain the review queue. Every action is one
//! atomic script that only applies if the entry is unchanged since it was
//! read, records who and when, and archives the entry with its actions.

use std::path::Path;

use common::spec::JobSpec;
use common::store::{RedisStore, ReviewAction, ReviewOutcome};
use common::task::{Action, ResultRecord, ReviewEntry, Stamp};
use common::validate::{Validation, validate, validate_record};
use serde_json::Value;

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
    let mut out = Vec::new();
    for p in 0..spec.job.partitions {
        store
            .review_entries(job, p, |e| {
                let reason_ok = reason.is_none_or(|r| e.reason.starts_with(r));
                let code_ok = code.is_none_or(|c| e.errors.iter().any(|x| x.code.as_str() == c));
                if reason_ok && code_ok {
                    out.push(e);
                }
            })
            .await?;
    }
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
    use common::spec::SinkKind;
    use common::task::RecordState;
    let spec = job_spec(store, job).await?;
    let partitions = spec.job.partitions;
    // A record id, or the business key it is made from.
    let rid = if id.len() == 64 && id.chars().all(|c| c.is_ascii_hexdigit()) {
        id.to_owned()
    } else {
        common::record::IdContext::new(job, &spec).record_id(id)
    };
    let p = common::record::partition_of(&rid, partitions);
    match store.record_state(job, p, &rid).await? {
        Some(RecordState::Done) => {}
        Some(other) => {
            return Err(ReviewError::NotFound(format!(
                "record {rid} is {}, not done: only a committed result is revised (a record in review is accepted)",
                other.encode()
            )));
        }
        None => return Err(ReviewError::NotFound(format!("job `{job}` has no record `{id}`"))),
    }
    let io = |e: common::sink::SinkError| ReviewError::Io(e.to_string());
    let read = store.result_text(job, p, &rid).await?;
    let current = read
        .as_deref()
        .map(ResultRecord::decode)
        .transpose()
        .map_err(|e| ReviewError::Io(e.to_string()))?;
    if current.is_some() && spec.sink.kind != SinkKind::None {
        return Err(ReviewError::Io(format!(
            "record {rid}'s result is on its way to the sink: revise it once it is written (a few seconds; `producer status` shows the sink's backlog)"
        )));
    }
    // The output as it is now, wherever the result is.
    let dir = spec.sink.dir.clone().unwrap_or_default();
    let mut db = None;
    let mut written = None;
    let now: Option<Value> = match (spec.sink.kind, &current) {
        (_, Some(r)) => Some(Value::Object(r.output.clone())),
        (SinkKind::None, None) => None,
        (SinkKind::Files, None) => {
            written = common::sink_files::find_written(Path::new(&dir), job, &rid).map_err(io)?;
            written
                .as_ref()
                .map(|w| w.current(Path::new(&dir), job))
                .transpose()
                .map_err(io)?
        }
        (SinkKind::Postgres, None) => {
            let context = format!("record {rid}'s result is in PostgreSQL");
            let sink = crate::sink::connect(&spec, &context, "to revise it")
                .await
                .map_err(|e| ReviewError::Io(e.to_string()))?;
            let now = sink.output(job, &rid).await.map_err(io)?;
            db = Some(sink);
            now
        }
    };
    let Some(Value::Object(now)) = now else {
        return Err(ReviewError::NotFound(format!("record {rid} has no result to revise")));
    };
    // Fields filled from the input keep what the input gave them.
    let mut given: Value = serde_json::from_str(output)
        .map_err(|e| ReviewError::Invalid(vec![format!("  - the output is not JSON: {e}")]))?;
    if let Value::Object(o) = &mut given {
        for (name, f) in spec.output.fields.iter() {
            if let (Some(_), Some(v)) = (&f.from_input, now.get(name.as_str())) {
                o.insert(name.clone(), v.clone());
            }
        }
    }
    let out = match validate_record(&spec, &given.to_string(), None) {
        Validation::Valid { output, .. } => output,
        Validation::Invalid { errors, .. } => {
            return Err(ReviewError::Invalid(
                errors.iter().map(|e| format!("  - {e}")).collect(),
            ));
        }
    };
    let out = Stamp::now(&spec).output(out, &rid);
    if let (Some(current), Some(read)) = (current, read) {
        let revised = current.revised(out, reviewer, note);
        let n = revised.revisions.last().map_or(0, |v| v.revision);
        return match store.revise_result(job, p, &rid, &read, &revised).await? {
            1 => Ok((
                rid,
                n,
                "in Redis (the output it replaced is kept in the result's revisions)".into(),
            )),
            0 => Err(ReviewError::Lost(rid)),
            _ => Err(ReviewError::NotFound(format!("record {rid} has no result in Redis"))),
        };
    }
    let value = Value::Object(out);
    if let Some(mut db) = db {
        return match db.revise(job, &rid, &value, reviewer, note).await.map_err(io)? {
            Some(n) => Ok((
                rid,
                u32::try_from(n).unwrap_or(0),
                format!(
                    "in PostgreSQL (the output it replaced is in {}_revisions)",
                    spec.sink.table()
                ),
            )),
            None => Err(ReviewError::NotFound(format!(
                "table {} has no row of record {rid}",
                spec.sink.table()
            ))),
        };
    }
    let Some(written) = written else {
        return Err(ReviewError::NotFound(format!(
            "no segment in {dir} holds a result of record {rid}"
        )));
    };
    let n = common::sink_files::revise(Path::new(&dir), job, &written, &value, reviewer, note).map_err(io)?;
    Ok((rid, n, format!("in the files sink ({dir}, revisions/)")))
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

/// `review next`: one entry at a time for a person at a terminal; one key
/// per action. Returns how many entries were acted on.
pub async fn next_loop(store: &RedisStore, job: &str, who: &str) -> Result<u64, ReviewError> {
    let mut acted = 0;
    let mut skipped: std::collections::HashSet<String> = Default::default();
    let _raw = RawMode::enter();
    loop {
        let entries = list(store, job, None, None).await?;
        let Some(e) = entries.into_iter().find(|e| !skipped.contains(&e.record_id)) else {
            crate::outln!("\r\nreview queue of {job} is empty (or every entry was skipped): {acted} acted on\r");
            return Ok(acted);
        };
        let rid = e.record_id.clone();
        let quoted = |s: &str| Value::from(s).to_string();
        let mut screen = String::new();
        screen.push_str(&format!("\r\n=== {} ({})\r\n", e.key, &rid[..16.min(rid.len())]));
        screen.push_str(&format!("reason: {}   attempts: {}\r\n", quoted(&e.reason), e.attempts));
        for err in &e.errors {
            screen.push_str(&format!(
                "error: {} {} {}\r\n",
                quoted(err.code.as_str()),
                quoted(&err.field),
                quoted(&err.message)
            ));
        }
        screen.push_str(&format!("input: {}\r\n", e.input.get()));
        screen.push_str(&format!("last output: {}\r\n", quoted(&e.last_raw_output)));
        screen.push_str("[a]ccept as is  [e]dit and accept  [r]equeue  re[j]ect  [s]kip  [q]uit > ");
        crate::out!("{screen}");
        let key = read_key().map_err(|e| ReviewError::Io(e.to_string()))?;
        crate::outln!("{key}\r");
        let result = match key {
            'a' => accept(store, job, &rid, &e.last_raw_output, who)
                .await
                .map(|_| "accepted"),
            'e' => {
                let edited = {
                    let _cooked = RawMode::leave();
                    edit_in_editor(&editable(&e), &std::env::temp_dir())
                };
                match edited {
                    Ok(text) => accept(store, job, &rid, &text, who).await.map(|_| "accepted"),
                    Err(err) => Err(err),
                }
            }
            'r' => requeue(store, job, &rid, Some("requeued from review next"), who)
                .await
                .map(|_| "requeued"),
            'j' => reject(store, job, &rid, "rejected from review next", who)
                .await
                .map(|_| "rejected"),
            's' => {
                skipped.insert(rid.clone());
                Ok("skipped")
            }
            'q' => {
                crate::outln!("{acted} acted on\r");
                return Ok(acted);
            }
            _ => Ok("unknown key: nothing done"),
        };
        match result {
            Ok(what) => {
                if matches!(what, "accepted" | "requeued" | "rejected") {
                    acted += 1;
                }
                crate::outln!("{what}\r");
            }
            Err(ReviewError::Store(e)) => return Err(ReviewError::Store(e)),
            // An invalid accept or a lost race: say so, stay on the queue.
            Err(err) => crate::outln!("{}\r", err.to_string().replace('\n', "\r\n")),
        }
    }
}

/// Reads one key from standard input.
fn read_key() -> std::io::Result<char> {
    use std::io::Read;
    let mut b = [0u8; 1];
    loop {
        if std::io::stdin().read(&mut b)? == 0 {
            return Ok('q');
        }
        if !b[0].is_ascii_whitespace() {
            return Ok(b[0] as char);
        }
    }
}

/// Single-key input on a terminal (`stty -icanon -echo`), restored on drop.
struct RawMode(bool);

impl RawMode {
    fn enter() -> RawMode {
        RawMode(stty(&["-icanon", "-echo", "min", "1"]))
    }
    fn leave() -> RawModeRestore {
        stty(&["icanon", "echo"]);
        RawModeRestore
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        if self.0 {
            stty(&["icanon", "echo"]);
        }
    }
}

/// Back to raw mode after an editor ran.
struct RawModeRestore;

impl Drop for RawModeRestore {
    fn drop(&mut self) {
        stty(&["-icanon", "-echo", "min", "1"]);
    }
}

fn stty(args: &[&str]) -> bool {
    use std::io::IsTerminal;
    std::io::stdin().is_terminal()
        && std::process::Command::new("stty")
            .args(args)
            .stdin(std::process::Stdio::inherit())
            .status()
            .is_ok_and(|s| s.success())
}

//! A batch from its input file to its output files: `validating` (every
//! line checked, then enqueued as a fleet job), `in_progress` (the workers
//! run it; `request_counts` follow the job), `finalizing` (the output and
//! error files are written from the job's results, review entries and the
//! rest), then `completed`, or `cancelled` / `expired` with the part done.
//! Each step is re-entrant: a restarted server picks each batch up where
//! its record in Redis says it was.

use std::collections::HashSet;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::spec::{JobSpec, PromptSection};
use common::store::RedisStore;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::store::{self as kept, BatchRow, FileRow};
use super::{Api, now_secs};

/// The only endpoint served.
pub const ENDPOINT: &str = "/v1/chat/completions";
/// The most validation errors a failed batch lists.
const MAX_ERRORS: usize = 100;

/// A named template (`metadata={"template": NAME}`, the file
/// `--templates DIR/NAME.toml`): the `[output]` that validates a batch's
/// answers (asked for as structured output when a request sets no
/// `response_format`) and, optionally, the `[retry]` of invalid answers.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Template {
    pub output: common::spec::OutputSection,
    #[serde(default)]
    pub retry: Option<common::spec::RetryPolicy>,
    /// How the fields are asked for (`provider.structured_output`'s
    /// values); default `auto`: the first form the server accepts.
    #[serde(default)]
    pub structured_output: Option<common::spec::StructuredOutput>,
}

impl Template {
    /// Reads a template, naming the file and the key of any mistake.
    pub fn load(path: &Path) -> anyhow::Result<Template> {
        let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let de = toml::Deserializer::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        serde_path_to_error::deserialize(de).map_err(|e| {
            let at = e.path().to_string();
            anyhow::anyhow!("{} at `{at}`: {}", path.display(), e.into_inner().to_string().trim())
        })
    }
}

/// The job spec a batch runs under: the provider spec's provider, limits,
/// prices, budget and sink; the record's `body` sent as the request, its
/// `custom_id` the record's key; answers validated by the template's
/// `[output]` and retried by its `[retry]` (or the provider spec's).
pub fn job_spec(provider: &JobSpec, template: Option<&Template>) -> JobSpec {
    let mut spec = provider.clone();
    spec.job.id_field = "custom_id".into();
    spec.prompt = PromptSection {
        system: String::new(),
        user: String::new(),
        request_field: Some("body".into()),
    };
    if let Some(t) = template {
        spec.output = t.output.clone();
        if let Some(retry) = &t.retry {
            spec.retry = retry.clone();
        }
        spec.provider.structured_output = t.structured_output.unwrap_or(common::spec::StructuredOutput::Auto);
    }
    spec.check = Default::default();
    spec.provider.mode = Default::default();
    spec
}

/// One line's problem, as the Batch API lists it in `errors.data`.
fn line_error(line: u64, code: &str, message: String, param: Option<&str>) -> Value {
    json!({"code": code, "message": message, "param": param, "line": line})
}

/// Checks every line of an input file as OpenAI does: a JSON object with a
/// `custom_id` unique in the file, `method` POST, `url` the batch's
/// endpoint, a `body` object with messages, within the spec's record size.
/// Returns the number of requests, or the errors (with line numbers).
pub fn check_input(path: &Path, max_record_bytes: usize) -> std::io::Result<Result<u64, Vec<Value>>> {
    let reader = std::io::BufReader::new(std::fs::File::open(path)?);
    let mut ids = HashSet::new();
    let mut errors = Vec::new();
    let mut n = 0u64;
    for (i, line) in reader.lines().enumerate() {
        let line = line?;
        let at = i as u64 + 1;
        if line.trim().is_empty() {
            continue;
        }
        if errors.len() >= MAX_ERRORS {
            break;
        }
        if line.len() > max_record_bytes {
            let why = format!(
                "line {at} is {} bytes, over the job's max_record_bytes ({max_record_bytes})",
                line.len()
            );
            errors.push(line_error(at, "line_too_large", why, None));
            continue;
        }
        let Ok(Value::Object(req)) = serde_json::from_str::<Value>(&line) else {
            errors.push(line_error(
                at,
                "invalid_json_line",
                format!("line {at} is not a JSON object"),
                None,
            ));
            continue;
        };
        let id = match req.get("custom_id").and_then(Value::as_str) {
            Some(id) if !id.is_empty() => id,
            _ => {
                let why = format!("line {at} has no custom_id (a non-empty string)");
                errors.push(line_error(at, "missing_required_parameter", why, Some("custom_id")));
                continue;
            }
        };
        if !ids.insert(id.to_owned()) {
            let why = format!("the custom_id `{id}` in line {at} is not unique: each request needs its own");
            errors.push(line_error(at, "duplicate_custom_id", why, Some("custom_id")));
        }
        if req.get("method").and_then(Value::as_str) != Some("POST") {
            let why = format!("line {at}: method must be POST");
            errors.push(line_error(at, "invalid_method", why, Some("method")));
        }
        if req.get("url").and_then(Value::as_str) != Some(ENDPOINT) {
            let why = format!("line {at}: url must be {ENDPOINT}, the batch's endpoint");
            errors.push(line_error(at, "invalid_url", why, Some("url")));
        }
        let has_messages = req
            .get("body")
            .and_then(|b| b.get("messages"))
            .and_then(Value::as_array);
        if has_messages.is_none_or(|m| m.is_empty()) {
            let why = format!("line {at}: body must be a chat request with messages");
            errors.push(line_error(at, "invalid_body", why, Some("body")));
        }
        n += 1;
    }
    if n == 0 && errors.is_empty() {
        errors.push(line_error(
            0,
            "empty_file",
            "the input file holds no request".into(),
            None,
        ));
    }
    Ok(if errors.is_empty() { Ok(n) } else { Err(errors) })
}

/// Moves every unfinished batch one step; called every poll.
pub async fn advance_all(api: &Arc<Api>) -> anyhow::Result<()> {
    for row in kept::open_batches(&api.store).await? {
        if row.is_terminal() {
            continue;
        }
        let id = row.id().to_owned();
        if let Err(e) = advance(api, row).await {
            tracing::warn!(batch = %id, error = %format!("{e:#}"), "batch not advanced: tried again at the next poll");
        }
    }
    Ok(())
}

async fn advance(api: &Arc<Api>, mut row: BatchRow) -> anyhow::Result<()> {
    let now = now_secs();
    if api
        .validating
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .contains(row.id())
    {
        // Its task moves it on (a cancel meanwhile included).
        return Ok(());
    }
    if !row.enqueued {
        if row.status() == "cancelling" {
            row.ending = Some("cancelled".into());
            // Nothing was sent, unless its enqueue ended while the cancel was written.
            row.enqueued = api.store.job_spec(&row.job).await?.is_some();
            cancel_job(&api.store, &row).await?;
        } else {
            validate_in_background(api, row);
            return Ok(());
        }
    }
    let expires_at = row.batch["expires_at"].as_u64().unwrap_or(u64::MAX);
    if row.status() == "in_progress" && row.ending.is_none() && now >= expires_at {
        // Past its window: what is left is not run; the part done is kept.
        row.ending = Some("expired".into());
        cancel_job(&api.store, &row).await?;
    }
    if row.enqueued && row.status() == "cancelling" && !api.store.cancelled(&row.job).await? {
        // The cancel was stored but its job's records were not dropped.
        cancel_job(&api.store, &row).await?;
    }
    let done = if row.enqueued {
        counts(api, &mut row).await?
    } else {
        true
    };
    if done || row.status() == "finalizing" {
        // A cancel stored since this poll read the batch is how it ends.
        adopt_cancel(api, &mut row).await?;
        finalize(api, &mut row, now).await?;
    }
    store_row(api, &mut row).await
}

/// Takes the ending a cancel stored since `row` was read.
async fn adopt_cancel(api: &Api, row: &mut BatchRow) -> anyhow::Result<()> {
    if let Some(stored) = kept::batch(&api.store, row.id()).await?
        && stored.ending.is_some()
        && row.ending.is_none()
    {
        row.ending = stored.ending;
        row.batch["cancelling_at"] = stored.batch["cancelling_at"].clone();
        if !row.is_terminal() {
            row.batch["status"] = stored.batch["status"].clone();
        }
    }
    Ok(())
}

/// Stores a batch this poll moved. The store refuses, atomically, to write
/// over a cancel stored since `row` was read: the cancel is then taken into
/// it and it is stored again. An ended batch stays as it ended.
async fn store_row(api: &Api, row: &mut BatchRow) -> anyhow::Result<()> {
    for _ in 0..5 {
        if kept::put_batch(&api.store, row).await? != kept::Put::Ending {
            return Ok(());
        }
        adopt_cancel(api, row).await?;
    }
    anyhow::bail!("batch {} kept changing while it was stored", row.id())
}

/// How often a batch in progress gets the full pass over its records
/// (`producer status`'s); between, its counts come from the job's counters.
const FULL_PASS_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

/// The job's counts into `request_counts`; true when nothing of it is left
/// to run. Each poll reads the job's outcome counters (a hash a partition,
/// whatever the job's size); the full pass over its records runs when they
/// say it may be over, when it is ending, and once a minute (a person's
/// decision in review is not in the counters).
async fn counts(api: &Api, row: &mut BatchRow) -> anyhow::Result<bool> {
    let partitions = api.store.job_spec(&row.job).await?.map_or(1, |s| s.job.partitions);
    let stats = api.store.stats(&row.job, partitions).await?;
    let (done, failed) = stats
        .timeline
        .values()
        .fold((0, 0), |(d, f), m| (d + m.done, f + m.failed));
    let total = row.batch["request_counts"]["total"].as_u64().unwrap_or(0);
    let due = {
        let mut passes = api.full_passes.lock().unwrap_or_else(|e| e.into_inner());
        let last = passes.get(row.id()).copied();
        let due = row.ending.is_some()
            || done + failed >= total
            || last.is_none_or(|t: std::time::Instant| t.elapsed() >= FULL_PASS_EVERY);
        if due {
            passes.insert(row.id().to_owned(), std::time::Instant::now());
        }
        due
    };
    if !due {
        // Counters only grow (a record a person sent back to work may count
        // twice), and miss what a person accepted in review: the counts
        // never go back below the last full pass's.
        let counted = |k: &str| row.batch["request_counts"][k].as_u64().unwrap_or(0);
        let completed = done.min(total).max(counted("completed"));
        row.batch["request_counts"]["completed"] = json!(completed);
        row.batch["request_counts"]["failed"] = json!(failed.min(total - completed));
        return Ok(false);
    }
    let s = crate::status::status(&api.store, &row.job, false, false).await?;
    row.batch["request_counts"]["completed"] = json!(s.done);
    row.batch["request_counts"]["failed"] = json!(s.review + s.dropped);
    let running = s.queued + s.in_flight + s.delayed + s.batched;
    Ok(s.complete || (row.ending.is_some() && running == 0))
}

pub async fn cancel_job(store: &RedisStore, row: &BatchRow) -> anyhow::Result<()> {
    if row.enqueued {
        let partitions = store.job_spec(&row.job).await?.map_or(1, |s| s.job.partitions);
        store.cancel_job(&row.job, partitions).await?;
    }
    Ok(())
}

/// Validates and enqueues a batch in a task of its own (a large file does
/// not hold up the other batches' polls), one at a time a batch.
fn validate_in_background(api: &Arc<Api>, row: BatchRow) {
    let id = row.id().to_owned();
    if !api
        .validating
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(id.clone())
    {
        return;
    }
    let api = api.clone();
    tokio::spawn(async move {
        if let Err(e) = validate_and_enqueue(&api, row).await {
            tracing::warn!(batch = %id, error = %format!("{e:#}"), "batch not enqueued: tried again at the next poll");
        }
        api.validating.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
    });
}

/// Validates the input file, then enqueues it as the batch's job (resumed
/// where it stopped, when the server restarted meanwhile).
async fn validate_and_enqueue(api: &Api, mut row: BatchRow) -> anyhow::Result<()> {
    let now = now_secs();
    let input_id = row.batch["input_file_id"].as_str().unwrap_or_default().to_owned();
    let template = match &row.template {
        Some(name) => Some(api.template(name)?),
        None => None,
    };
    let spec = job_spec(&api.config.provider_spec, template.as_ref());
    let path = api.file_path(&input_id);
    let checked = match kept::file(&api.store, &input_id).await? {
        None => Err(vec![line_error(
            0,
            "file_not_found",
            format!("the input file {input_id} was deleted"),
            None,
        )]),
        Some(_) => check_input(&path, spec.job.max_record_bytes)?,
    };
    let total = match checked {
        Ok(total) => total,
        Err(errors) => {
            row.batch["errors"] = json!({"object": "list", "data": errors});
            row.set_status("failed", now);
            store_row(api, &mut row).await?;
            return Ok(());
        }
    };
    let spec_path = api.config.data_dir.join("specs").join(format!("{}.toml", row.id()));
    std::fs::create_dir_all(spec_path.parent().unwrap_or(Path::new(".")))?;
    std::fs::write(&spec_path, toml::to_string(&spec)?)?;
    let args = crate::enqueue::EnqueueArgs {
        dataset: path,
        job: row.job.clone(),
        spec_path: spec_path.to_string_lossy().into_owned(),
        redis_url: api.config.redis_url.clone(),
        restart: false,
        sample: None,
        dry_run: false,
        batch_size: 2000,
        idem_ttl_secs: 7 * 24 * 3600,
        progress: false,
        allow_evicting_redis: api.config.allow_evicting_redis,
        max_backlog: api.config.max_backlog,
        selected: None,
    };
    let summary = crate::enqueue::enqueue(&args, CancellationToken::new()).await?;
    anyhow::ensure!(summary.complete, "the enqueue of {} stopped before the end", row.job);
    // A cancel may have come meanwhile: read the record again.
    let mut row = kept::batch(&api.store, row.id()).await?.unwrap_or(row);
    row.enqueued = true;
    row.batch["request_counts"]["total"] = json!(total);
    if row.status() == "cancelling" {
        row.ending = Some("cancelled".into());
        cancel_job(&api.store, &row).await?;
    } else {
        row.set_status("in_progress", now_secs());
    }
    // A cancel stored since the read is kept (the next poll drops the records).
    store_row(api, &mut row).await
}

/// Writes the output and error files from what the job holds, then ends the
/// batch. Re-entrant: the files' ids are the batch's, rewritten whole.
async fn finalize(api: &Api, row: &mut BatchRow, now: u64) -> anyhow::Result<()> {
    if row.status() != "finalizing" && row.ending.is_none() {
        row.set_status("finalizing", now);
        if kept::put_batch(&api.store, row).await? == kept::Put::Ending {
            // A cancel came first: the batch ends as it says.
            adopt_cancel(api, row).await?;
        }
    }
    let (output, errors) = write_files(api, row).await?;
    let id = row.id().to_owned();
    for (field, file) in [("output_file_id", output), ("error_file_id", errors)] {
        row.batch[field] = match file {
            Some((path, bytes)) => {
                let file_id = path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                let f = FileRow {
                    id: file_id.clone(),
                    filename: format!("{id}_{}.jsonl", field.trim_end_matches("_file_id")),
                    purpose: "batch_output".into(),
                    bytes,
                    created_at: now,
                    owner: row.owner.clone(),
                };
                kept::put_file(&api.store, &f).await?;
                json!(file_id)
            }
            None => Value::Null,
        };
    }
    let end = row.ending.clone().unwrap_or_else(|| "completed".into());
    row.set_status(&end, now_secs());
    api.full_passes.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
    Ok(())
}

/// One output line in the official shape.
fn output_line(record_id: &str, custom_id: &str, response: Value, error: Value) -> String {
    let id: String = record_id.chars().take(24).collect();
    json!({"id": format!("batch_req_{id}"), "custom_id": custom_id, "response": response, "error": error}).to_string()
}

type Written = Option<(PathBuf, u64)>;

/// A JSONL file written line by line beside its final name, renamed there
/// whole when it holds any line.
struct Lines {
    path: PathBuf,
    part: PathBuf,
    out: std::io::BufWriter<std::fs::File>,
    n: u64,
    failed: Option<std::io::Error>,
}

impl Lines {
    fn create(path: PathBuf) -> std::io::Result<Lines> {
        let part = path.with_extension("part");
        let out = std::io::BufWriter::new(std::fs::File::create(&part)?);
        Ok(Lines {
            path,
            part,
            out,
            n: 0,
            failed: None,
        })
    }

    fn push(&mut self, line: String) {
        if self.failed.is_none() {
            match writeln!(self.out, "{line}") {
                Ok(()) => self.n += 1,
                Err(e) => self.failed = Some(e),
            }
        }
    }

    fn finish(mut self) -> std::io::Result<Written> {
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        self.out.flush()?;
        if self.n == 0 {
            std::fs::remove_file(&self.part)?;
            return Ok(None);
        }
        std::fs::rename(&self.part, &self.path)?;
        Ok(Some((self.path.clone(), std::fs::metadata(&self.path)?.len())))
    }
}

/// The output file (every done record: the provider's response body) and
/// the error file (review entries with their reason; what was cancelled,
/// expired or dropped), each None when it would be empty.
async fn write_files(api: &Api, row: &BatchRow) -> anyhow::Result<(Written, Written)> {
    let store = &api.store;
    let spec = store.job_spec(&row.job).await?;
    let partitions = spec.as_ref().map_or(1, |s| s.job.partitions);
    let id = row.id();
    let mut seen = HashSet::new();
    let mut out = Lines::create(api.file_path(&format!("file-{id}-output")))?;
    crate::sink::each_result(store, &row.job, spec.as_ref(), partitions, |mut r| {
        // The response as the provider sent it: without the fields the fleet adds to a result.
        r.output
            .retain(|k, _| !common::spec::SYSTEM_FIELDS.contains(&k.as_str()));
        let response = json!({"status_code": 200, "request_id": r.response_id, "body": r.output});
        out.push(output_line(&r.record_id, &r.key, response, Value::Null));
        seen.insert(r.key);
    })
    .await?;
    let mut err = Lines::create(api.file_path(&format!("file-{id}-errors")))?;
    for p in 0..partitions {
        store
            .review_entries(&row.job, p, |e| {
                let message = match e.errors.first() {
                    Some(first) => format!("{} {}: {}", first.code.as_str(), first.field, first.message),
                    None => e.last_raw_output.chars().take(300).collect(),
                };
                let error = json!({"code": e.reason, "message": message});
                err.push(output_line(&e.record_id, &e.key, Value::Null, error));
                seen.insert(e.key);
            })
            .await?;
    }
    // The rest never got an answer: cancelled, expired, or dropped.
    let (code, message) = match row.ending.as_deref() {
        Some("expired") => (
            "batch_expired",
            "the batch expired before this request was run".to_owned(),
        ),
        Some("cancelled") => (
            "batch_cancelled",
            "the batch was cancelled before this request was run".to_owned(),
        ),
        _ => (
            "dropped",
            format!("the request was dropped: `producer dropped --job {}` says why", row.job),
        ),
    };
    let input = api.file_path(row.batch["input_file_id"].as_str().unwrap_or_default());
    if let Ok(file) = std::fs::File::open(&input) {
        for line in std::io::BufReader::new(file).lines().map_while(Result::ok) {
            let Some(custom_id) = serde_json::from_str::<Value>(&line)
                .ok()
                .and_then(|v| v["custom_id"].as_str().map(str::to_owned))
            else {
                continue;
            };
            if seen.insert(custom_id.clone()) {
                let error = json!({"code": code, "message": message});
                let record_id = spec.as_ref().map_or_else(
                    || common::sink::sha256_hex(custom_id.as_bytes()),
                    |s| common::record::IdContext::new(&row.job, s).record_id(&custom_id),
                );
                err.push(output_line(&record_id, &custom_id, Value::Null, error));
            }
        }
    }
    Ok((out.finish()?, err.finish()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn provider() -> JobSpec {
        JobSpec::parse(include_str!("../../../examples/batches/provider.toml"), "provider.toml").unwrap()
    }

    #[test]
    fn a_template_brings_its_fields_retry_and_form_and_names_its_mistakes() {
        let dir = std::env::temp_dir().join(format!("bf-template-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/batches/templates/sentiment.toml");
        let t = Template::load(&example).unwrap();
        let spec = job_spec(&provider(), Some(&t));
        assert!(spec.problems().is_empty(), "{:?}", spec.problems());
        assert_eq!(spec.output.fields.len(), 2);
        assert_eq!(spec.retry.max_attempts, 2);
        assert_eq!(spec.provider.structured_output, common::spec::StructuredOutput::Auto);
        assert_eq!(spec.job.id_field, "custom_id");
        // Without a template: the provider spec's own, nothing asked for.
        let plain = job_spec(&provider(), None);
        assert!(plain.output.fields.is_empty());
        assert_eq!(plain.provider.structured_output, common::spec::StructuredOutput::Off);

        let typo = dir.join("typo.toml");
        std::fs::write(
            &typo,
            "[output.fields.x]\ntype = \"string\"\n\n[retyr]\nmax_attempts = 2\n",
        )
        .unwrap();
        let e = Template::load(&typo).unwrap_err().to_string();
        assert!(e.contains("typo.toml") && e.contains("retyr"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_input_check_names_each_bad_line() {
        let dir = std::env::temp_dir().join(format!("bf-input-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("in.jsonl");
        let good = r#"{"custom_id":"a","method":"POST","url":"/v1/chat/completions","body":{"messages":[{"role":"user","content":"hi"}]}}"#;
        let lines = [
            good,
            "not json",
            r#"{"custom_id":"a","method":"GET","url":"/v1/embeddings","body":{}}"#,
        ];
        std::fs::write(&path, lines.join("\n")).unwrap();
        let errors = check_input(&path, 1 << 20).unwrap().unwrap_err();
        let codes: Vec<(u64, &str)> = errors
            .iter()
            .map(|e| (e["line"].as_u64().unwrap(), e["code"].as_str().unwrap()))
            .collect();
        assert_eq!(
            codes,
            [
                (2, "invalid_json_line"),
                (3, "duplicate_custom_id"),
                (3, "invalid_method"),
                (3, "invalid_url"),
                (3, "invalid_body")
            ]
        );
        std::fs::write(&path, format!("{good}\n\n")).unwrap();
        assert_eq!(check_input(&path, 1 << 20).unwrap().unwrap(), 1);
        assert_eq!(
            check_input(&path, 10).unwrap().unwrap_err()[0]["code"],
            "line_too_large"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

//! `producer enqueue`: a dataset into the job's streams, each record exactly once.
//!
//! Order of work: hash the whole file (its fingerprint is part of the job key),
//! compare with the job's cursor (resume, replay or refuse), then stream the
//! lines in batches. Each batch is confirmed by Redis before the cursor moves
//! past it; the next batch is parsed while the previous one is in flight.

use std::collections::{BTreeMap, BinaryHeap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::manifest::{Counts, Cursor, Dataset, DatasetPass, DroppedLine, Identity, Manifest, Sample, now_rfc3339};
use common::otel::{Span, SpanKind, Traces};
use common::record::{DropReason, IdContext, Line, parse_line, partition_of};
use common::spec::{JobSpec, SpecError, versions_map};
use common::store::{BadJobName, EnqueueOutcome, RedisStore, StoreError, TaskEntry, valid_job_name};
use common::task::Task;
use common::template::Template;
use serde::Serialize;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use crate::progress::Progress;
use crate::reader::{LineReader, file_sha256};

/// Everything `enqueue` needs, already parsed from the command line.
#[derive(Debug, Clone)]
pub struct EnqueueArgs {
    pub dataset: PathBuf,
    pub job: String,
    pub spec_path: String,
    pub redis_url: String,
    /// Start from the first line even when a cursor exists.
    pub restart: bool,
    pub sample: Option<Sample>,
    /// A trial run: the spec is stored without its `[sink]`.
    pub dry_run: bool,
    /// Records per confirmed batch.
    pub batch_size: usize,
    /// TTL of the per-record idempotency keys.
    pub idem_ttl_secs: u64,
    /// Show a progress bar (on a terminal) or periodic log lines.
    pub progress: bool,
    /// Enqueue even into a Redis that may evict keys (tests only).
    pub allow_evicting_redis: bool,
    /// The most tasks the job may hold in Redis (queued, in flight, waiting
    /// to retry): enqueue waits for the workers beyond it. 0: no bound.
    pub max_backlog: u64,
    /// The lines `sample` selects, when the caller has just read them
    /// (`producer rerun` counts before it enqueues): not read again.
    pub selected: Option<(HashSet<u64>, crate::select::FromJobSummary)>,
}

/// What a run did. Counts cover the whole pass over the dataset, including
/// the part confirmed by an earlier run that this one resumed.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub job: String,
    pub job_key: String,
    pub dataset: String,
    pub dataset_sha256: String,
    pub lines: u64,
    pub blank_lines: u64,
    pub enqueued: u64,
    pub already_present: u64,
    pub dropped: u64,
    pub dropped_by_reason: BTreeMap<String, u64>,
    /// Distinct records of this dataset (tasks and template drops).
    pub records: u64,
    /// Distinct records the whole job holds (from Redis), when complete.
    pub job_records: Option<u64>,
    /// The line this run started after (0 for a full pass).
    pub resumed_from_line: u64,
    pub complete: bool,
    pub interrupted: bool,
    pub elapsed_secs: f64,
    pub lines_per_sec: f64,
    /// Time this run waited for the workers (`--max-backlog`).
    pub backlog_wait_secs: f64,
    /// The dataset changed while it was read (grew, or was rewritten): what
    /// was enqueued is the part the manifest's sha256 describes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dataset_changed: Option<DatasetChange>,
    /// What a stratified sample covers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub coverage: Option<crate::select::Coverage>,
    /// What `--from-job` took from the other job.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_job: Option<crate::select::FromJobSummary>,
    pub dry_run: bool,
}

/// How the dataset changed while it was enqueued.
#[derive(Debug, Clone, Serialize)]
pub struct DatasetChange {
    /// It only grew: the first `bytes_enqueued` (hashed) bytes were enqueued.
    pub grew: bool,
    pub bytes_enqueued: u64,
    pub bytes_now: u64,
    pub message: String,
}

#[derive(Debug, thiserror::Error)]
pub enum EnqueueError {
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    JobName(#[from] BadJobName),
    #[error("cannot read dataset {path}: {source}")]
    Dataset { path: String, source: std::io::Error },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    Refused(String),
}

impl From<crate::select::SelectError> for EnqueueError {
    fn from(e: crate::select::SelectError) -> EnqueueError {
        match e {
            crate::select::SelectError::Store(e) => EnqueueError::Store(e),
            crate::select::SelectError::Refused(m) => EnqueueError::Refused(m),
        }
    }
}

/// Enqueues a dataset; stops cleanly (cursor saved) when `cancel` fires.
/// With tracing on (`OTEL_EXPORTER_OTLP_ENDPOINT`), each record added gets an
/// `enqueue` span whose context travels in its task.
pub async fn enqueue(args: &EnqueueArgs, cancel: CancellationToken) -> Result<Summary, EnqueueError> {
    let traces = Traces::from_env("batchfleet-producer").map_err(EnqueueError::Refused)?;
    let summary = enqueue_traced(args, cancel, &traces).await;
    traces.shutdown(Duration::from_secs(5));
    summary
}

async fn enqueue_traced(
    args: &EnqueueArgs,
    cancel: CancellationToken,
    traces: &Traces,
) -> Result<Summary, EnqueueError> {
    let started = Instant::now();
    valid_job_name(&args.job)?;
    let (spec, spec_text) = load_spec(args)?;
    let (identity, modified) = identify(args, &spec)?;
    let bytes = identity.dataset.bytes;
    let job_key = identity.job_key();
    let store = connect(args).await?;
    let start = starting_point(&store, args, &identity, &job_key).await?;
    refuse_changed_spec(&store, &args.job, &spec).await?;
    let Selected {
        lines: sample_lines,
        coverage,
        from_job,
    } = select(&store, args, &spec, &identity).await?;
    store
        .prepare_job(&args.job, &spec_text, spec.job.partitions, !spec.sink.is_none())
        .await?;
    if let Some(cap) = spec.budget.max_cost_usd {
        // Never lowers a cap that `producer resume --budget` raised.
        store.set_budget_cap(&args.job, cap, true).await?;
    }
    if let Some(deadline) = &spec.job.deadline {
        // A duration counts from the first enqueue; a resumed or repeated
        // enqueue (or `producer deadline`) does not move it.
        let at = common::route::parse_deadline(deadline, common::route::now_ms()).unwrap_or(0);
        store.set_deadline(&args.job, at, true).await?;
    }

    let mut pass = Pass::new(&store, args, &spec, &identity, &start, traces).await?;
    let progress = Progress::new(args.progress, bytes, start.offset);
    let interrupted = pass
        .run(
            &args.dataset,
            bytes,
            args.batch_size,
            sample_lines.as_ref(),
            &progress,
            &cancel,
        )
        .await;
    if pass.marked.is_some() {
        store.mark_enqueuing(&args.job, None).await?;
    }
    let interrupted = interrupted?;
    progress.finish();

    let mut job_records = None;
    if !interrupted {
        pass.cursor.complete = true;
        store.save_cursor(&args.job, &pass.cursor).await?;
        let manifest = write_manifest(&store, &args.job, &spec, &pass.cursor, pass.origin_tag, args.dry_run).await?;
        job_records = Some(manifest.expected_records);
    }
    let dataset_changed = if interrupted {
        None
    } else {
        dataset_change(&args.dataset, &identity.dataset, modified, pass.cursor.line)
    };
    Ok(Summary {
        job_records,
        dataset_changed,
        coverage,
        from_job,
        backlog_wait_secs: pass.waited.as_secs_f64(),
        ..Summary::of(args, &pass.cursor, &start, started.elapsed().as_secs_f64())
    })
}

impl Summary {
    /// The summary of a pass from `start` to `cursor` (and no more).
    fn of(args: &EnqueueArgs, cursor: &Cursor, start: &Start, elapsed: f64) -> Summary {
        let c = &cursor.counts;
        Summary {
            job: args.job.clone(),
            job_key: cursor.job_key.clone(),
            dataset: cursor.identity.dataset.path.clone(),
            dataset_sha256: cursor.identity.dataset.sha256.clone(),
            lines: c.lines,
            blank_lines: c.blank,
            enqueued: c.enqueued,
            already_present: c.already_present,
            dropped: c.dropped,
            dropped_by_reason: c.dropped_by_reason.clone(),
            records: c.expected_records(),
            job_records: None,
            resumed_from_line: start.line,
            complete: cursor.complete,
            interrupted: !cursor.complete,
            elapsed_secs: elapsed,
            lines_per_sec: (c.lines - start.counts.lines) as f64 / elapsed.max(1e-9),
            backlog_wait_secs: 0.0,
            dataset_changed: None,
            coverage: None,
            from_job: None,
            dry_run: args.dry_run,
        }
    }
}

/// The spec enqueued, and its text (without its `[sink]` for a dry run).
fn load_spec(args: &EnqueueArgs) -> Result<(JobSpec, String), EnqueueError> {
    let spec = JobSpec::load(&args.spec_path)?;
    let text = std::fs::read_to_string(&args.spec_path).map_err(|source| SpecError::Read {
        path: args.spec_path.clone(),
        source,
    })?;
    if !args.dry_run {
        return Ok((spec, text));
    }
    // The job's stored spec has no sink: no worker writes anything out.
    let mut table: toml::Table = toml::from_str(&text).map_err(|e| EnqueueError::Refused(e.to_string()))?;
    table.remove("sink");
    let text = toml::to_string(&table).map_err(|e| EnqueueError::Refused(e.to_string()))?;
    Ok((JobSpec::parse(&text, &args.spec_path)?, text))
}

fn dataset_error(args: &EnqueueArgs) -> impl Fn(std::io::Error) -> EnqueueError + '_ {
    |source| EnqueueError::Dataset {
        path: args.dataset.display().to_string(),
        source,
    }
}

/// What makes this enqueue the same one again (the dataset's bytes, the
/// spec's versions, the sample), and when the dataset was last modified.
fn identify(args: &EnqueueArgs, spec: &JobSpec) -> Result<(Identity, Option<std::time::SystemTime>), EnqueueError> {
    // A named pipe, a device or a folder would block or be read only once:
    // refused before anything is written.
    let meta = std::fs::metadata(&args.dataset).map_err(dataset_error(args))?;
    if !meta.is_file() {
        return Err(EnqueueError::Refused(format!(
            "dataset {} is not a regular file ({}): batchfleet reads it twice (hash, then records) \
             and resumes at byte offsets; copy it to a file first",
            args.dataset.display(),
            file_kind(&meta)
        )));
    }
    let (sha256, bytes) = file_sha256(&args.dataset).map_err(dataset_error(args))?;
    let identity = Identity {
        dataset: Dataset {
            path: args.dataset.display().to_string(),
            sha256,
            bytes,
        },
        versions: versions_map(spec).into_iter().map(|(k, v)| (k.to_owned(), v)).collect(),
        partitions: spec.job.partitions,
        sample: args.sample.clone(),
    };
    Ok((identity, meta.modified().ok()))
}

/// The Redis to enqueue into, refused when it may evict keys (unless told).
async fn connect(args: &EnqueueArgs) -> Result<RedisStore, EnqueueError> {
    let store = RedisStore::connect(&args.redis_url).await?;
    match store.refuse_eviction().await {
        Err(e @ StoreError::Evicting { .. }) if !args.allow_evicting_redis => Err(EnqueueError::Refused(e.to_string())),
        Err(StoreError::Evicting { .. }) | Ok(()) => Ok(store),
        Err(e) => Err(e.into()),
    }
}

/// The lines a sample takes (none: every line), with what it covers.
struct Selected {
    lines: Option<HashSet<u64>>,
    coverage: Option<crate::select::Coverage>,
    from_job: Option<crate::select::FromJobSummary>,
}

/// The lines `--sample`, `--stratify` or `--from-job` take.
async fn select(
    store: &RedisStore,
    args: &EnqueueArgs,
    spec: &JobSpec,
    identity: &Identity,
) -> Result<Selected, EnqueueError> {
    let mut selected = Selected {
        lines: None,
        coverage: None,
        from_job: None,
    };
    let Some(s) = &args.sample else {
        return Ok(selected);
    };
    if let Some((lines, found)) = &args.selected {
        selected.lines = Some(lines.clone());
        selected.from_job = Some(found.clone());
        return Ok(selected);
    }
    let sha256 = &identity.dataset.sha256;
    let mut forced = HashSet::new();
    if let Some(from) = &s.from_job {
        if from.set.is_some() || s.stratify {
            let (lines, found) = crate::select::lines_from_job(store, from, s.seed, sha256, &args.dataset).await?;
            selected.from_job = Some(found);
            forced = lines;
        }
        if from.set.is_some() {
            selected.lines = Some(forced);
            return Ok(selected);
        }
    }
    if s.stratify {
        let (lines, covered) =
            crate::select::stratified(&args.dataset, spec, s.size, s.seed, &forced).map_err(dataset_error(args))?;
        selected.coverage = Some(covered);
        selected.lines = Some(lines);
    } else {
        selected.lines = Some(sample_line_numbers(&args.dataset, s).map_err(dataset_error(args))?);
    }
    Ok(selected)
}

fn file_kind(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_dir() {
        "a folder"
    } else if t.is_fifo() {
        "a named pipe"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else {
        "not a regular file"
    }
}

/// Whether the dataset changed while it was read: its size, or (same size,
/// newer modification time) its sha256, now against the start of the run.
fn dataset_change(
    path: &Path,
    hashed: &Dataset,
    modified: Option<std::time::SystemTime>,
    lines: u64,
) -> Option<DatasetChange> {
    let meta = std::fs::metadata(path).ok()?;
    let now = meta.len();
    if now == hashed.bytes && meta.modified().ok() == modified {
        return None;
    }
    if now == hashed.bytes && file_sha256(path).is_ok_and(|(sha, _)| sha == hashed.sha256) {
        return None;
    }
    let grew =
        now > hashed.bytes && crate::reader::prefix_sha256(path, hashed.bytes).is_ok_and(|sha| sha == hashed.sha256);
    let message = if grew {
        format!(
            "the dataset grew from {} to {now} bytes while it was enqueued: only its first {} bytes ({lines} lines), \
             whose sha256 the manifest records, were enqueued; enqueue it again with --restart to add the rest",
            hashed.bytes, hashed.bytes
        )
    } else {
        format!(
            "the dataset was rewritten while it was enqueued ({} bytes at the start, {now} now): the records \
             enqueued may not match the sha256 the manifest records; check the file and enqueue it under a new job",
            hashed.bytes
        )
    };
    Some(DatasetChange {
        grew,
        bytes_enqueued: hashed.bytes,
        bytes_now: now,
        message,
    })
}

/// Refuses a spec that differs from the one the job was enqueued with
/// (changing it is `producer spec update`, an explicit and logged step).
async fn refuse_changed_spec(store: &RedisStore, job: &str, spec: &JobSpec) -> Result<(), EnqueueError> {
    let stored = match store.job_spec(job).await {
        Ok(Some(s)) => s,
        Ok(None) => return Ok(()),
        Err(StoreError::Corrupt { .. }) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    let diff = common::spec::spec_diff(&stored, spec);
    if diff.is_empty() {
        return Ok(());
    }
    Err(EnqueueError::Refused(format!(
        "job `{job}` was enqueued with another spec; this one differs in:\n  {}\n\
         Refusing to replace it silently: to change the job's spec, run `producer spec update --job {job} --spec FILE` \
         (recorded in the job's spec history), or use a new --job name",
        diff.join("\n  ")
    )))
}

struct Start {
    offset: u64,
    line: u64,
    counts: Counts,
}

/// Decides where this run starts from the job's cursor, or refuses.
async fn starting_point(
    store: &RedisStore,
    args: &EnqueueArgs,
    identity: &Identity,
    job_key: &str,
) -> Result<Start, EnqueueError> {
    let fresh = Start {
        offset: 0,
        line: 0,
        counts: Counts::default(),
    };
    let Some(cursor) = store.load_cursor(&args.job).await? else {
        return Ok(fresh);
    };
    if !cursor.identity.same_records_as(identity) {
        return Err(EnqueueError::Refused(format!(
            "job `{}` was enqueued with spec versions {:?} and {} partitions; this spec has versions {:?} and {} partitions. \
             Record ids would not match, so this is refused even with --restart: use a new --job name.",
            args.job, cursor.identity.versions, cursor.identity.partitions, identity.versions, identity.partitions
        )));
    }
    if cursor.job_key == job_key && !args.restart {
        // Same dataset and spec: resume an interrupted pass; replay a complete
        // one from the start (every record is found already present).
        return Ok(if cursor.complete {
            fresh
        } else {
            Start {
                offset: cursor.offset,
                line: cursor.line,
                counts: cursor.counts,
            }
        });
    }
    if args.restart {
        return Ok(fresh);
    }
    let before = &cursor.identity;
    let what = if before.dataset.sha256 != identity.dataset.sha256 {
        format!(
            "its dataset was {} (sha256 {}, {} bytes) and {} is different (sha256 {}, {} bytes)",
            before.dataset.path,
            before.dataset.short(),
            before.dataset.bytes,
            identity.dataset.path,
            identity.dataset.short(),
            identity.dataset.bytes
        )
    } else {
        format!(
            "its sample was {:?}, this run asks for {:?}",
            before.sample, identity.sample
        )
    };
    Err(EnqueueError::Refused(format!(
        "job `{}` already exists and {what}. Refusing to mix them silently: use a new --job name, \
         or --restart to add this dataset to the job (records already present are not enqueued again).",
        args.job
    )))
}

struct Pass<'a> {
    store: &'a RedisStore,
    job: &'a str,
    spec: &'a JobSpec,
    user: Template,
    ids: IdContext,
    /// Dropped lines are keyed `<dataset sha12>:<line>`.
    origin_prefix: String,
    /// A record's origin is `<tag>:<line>` (see `dataset_tag.lua`).
    origin_tag: u64,
    cursor: Cursor,
    idem_ttl_secs: u64,
    traces: &'a Traces,
    /// See [`EnqueueArgs::max_backlog`].
    max_backlog: u64,
    /// The job's tasks in Redis as last read, plus those sent since.
    backlog: u64,
    /// When the job's `enqueuing` mark was last renewed.
    marked: Option<Instant>,
    /// Time spent waiting for the backlog to drain.
    waited: Duration,
    /// Whether the wait for the backlog was said already (once a run).
    said_waiting: bool,
}

impl<'a> Pass<'a> {
    /// A pass from `start`, its backlog as Redis holds it now.
    async fn new(
        store: &'a RedisStore,
        args: &'a EnqueueArgs,
        spec: &'a JobSpec,
        identity: &Identity,
        start: &Start,
        traces: &'a Traces,
    ) -> Result<Pass<'a>, EnqueueError> {
        let mut pass = Pass {
            store,
            job: &args.job,
            spec,
            user: Template::parse(&spec.prompt.user).map_err(|e| {
                EnqueueError::Refused(format!("prompt.user: {e}")) // unreachable after validation
            })?,
            ids: IdContext::new(&args.job, spec),
            origin_tag: store.dataset_tag(&args.job, &identity.dataset.sha256).await?,
            origin_prefix: identity.dataset.short().to_owned(),
            cursor: Cursor {
                job_key: identity.job_key(),
                identity: identity.clone(),
                offset: start.offset,
                line: start.line,
                counts: start.counts.clone(),
                complete: false,
            },
            idem_ttl_secs: args.idem_ttl_secs,
            traces,
            max_backlog: args.max_backlog,
            backlog: 0,
            marked: None,
            waited: Duration::ZERO,
            said_waiting: false,
        };
        if args.max_backlog > 0 {
            pass.backlog = store.remaining(&args.job, spec.job.partitions).await?.backlog();
        }
        Ok(pass)
    }
}

/// Lifetime of the job's `enqueuing` mark; renewed every third of it.
const ENQUEUING_TTL_SECS: u64 = 15;

/// Batches sent before the oldest must be confirmed.
const IN_FLIGHT: usize = 3;

type InFlight = tokio::task::JoinHandle<Result<Vec<EnqueueOutcome>, StoreError>>;

/// A parsed batch waiting for Redis: its tasks, its drops, and where it ends.
#[derive(Default)]
struct Batch {
    /// Shared with the task that sends them.
    tasks: Arc<Vec<TaskEntry>>,
    /// Line number of each task, for duplicate reports.
    task_lines: Vec<u64>,
    /// The enqueue span of each task (none when tracing is off), ended on confirmation.
    spans: Vec<Span>,
    dropped: Vec<DroppedLine>,
    counts: Counts,
    /// Offset and line number after the batch's last line (0 when nothing was read).
    end_offset: u64,
    end_line: u64,
}

impl Pass<'_> {
    /// Streams the dataset from the cursor. Returns true when interrupted.
    async fn run(
        &mut self,
        path: &Path,
        end: u64,
        batch_size: usize,
        sample: Option<&HashSet<u64>>,
        progress: &Progress,
        cancel: &CancellationToken,
    ) -> Result<bool, EnqueueError> {
        let limit = self.spec.job.max_record_bytes;
        let mut reader =
            LineReader::open_until(path, self.cursor.offset, self.cursor.line, limit, end).map_err(|source| {
                EnqueueError::Dataset {
                    path: path.display().to_string(),
                    source,
                }
            })?;
        let mut buf = Vec::with_capacity(4096);
        // Up to IN_FLIGHT batches travel at once so Redis never waits for the
        // parser; they are confirmed (and the cursor moved) strictly in order.
        let mut in_flight: VecDeque<(Batch, InFlight)> = VecDeque::with_capacity(IN_FLIGHT);
        let mut eof = false;
        loop {
            let mut batch = Batch::default();
            // Before the bounded backlog is read again, what is on its way
            // is confirmed (so it is in Redis when it is counted).
            while self.max_backlog > 0 && self.backlog + self.want(batch_size) > self.max_backlog {
                let Some(front) = in_flight.pop_front() else { break };
                self.confirm_sent(front, progress).await?;
            }
            let take = if eof { 0 } else { self.room(batch_size, cancel).await? };
            if !eof && !cancel.is_cancelled() && take > 0 {
                eof = self
                    .parse_batch(&mut reader, &mut buf, take, sample, &mut batch)
                    .map_err(|source| EnqueueError::Dataset {
                        path: path.display().to_string(),
                        source,
                    })?;
            }
            let nothing_read = batch.end_line == 0;
            if !nothing_read {
                let (store, job, ttl, tasks) = (
                    self.store.clone(),
                    self.job.to_owned(),
                    self.idem_ttl_secs,
                    batch.tasks.clone(),
                );
                self.backlog += tasks.len() as u64;
                let handle = tokio::spawn(async move { store.enqueue(&job, ttl, &tasks).await });
                in_flight.push_back((batch, handle));
            }
            while in_flight.len() >= IN_FLIGHT || (nothing_read && !in_flight.is_empty()) {
                let Some(front) = in_flight.pop_front() else {
                    break;
                };
                self.confirm_sent(front, progress).await?;
            }
            if nothing_read {
                // End of file, or cancelled with every sent batch confirmed.
                return Ok(!eof);
            }
        }
    }

    /// Waits for a sent batch's answer from Redis and confirms it.
    async fn confirm_sent(
        &mut self,
        (batch, handle): (Batch, InFlight),
        progress: &Progress,
    ) -> Result<(), EnqueueError> {
        let outcomes = handle
            .await
            .map_err(|e| EnqueueError::Refused(format!("enqueue task failed: {e}")))??;
        self.confirm(batch, outcomes).await?;
        progress.set(self.cursor.offset, &self.cursor.counts);
        Ok(())
    }

    /// The least room worth a batch under a bounded backlog: half a batch,
    /// or half the bound.
    fn want(&self, batch_size: usize) -> u64 {
        (batch_size as u64).min(self.max_backlog.div_ceil(2)).max(1)
    }

    /// How many records the next batch may hold: `batch_size`, or with a
    /// bounded backlog what fits under it, once at least half a batch (or
    /// half the bound) fits: waits for the workers to drain the job until
    /// then, keeping the job marked as being enqueued. 0 when cancelled.
    async fn room(&mut self, batch_size: usize, cancel: &CancellationToken) -> Result<usize, EnqueueError> {
        let max = self.max_backlog;
        if max == 0 {
            return Ok(batch_size);
        }
        let want = self.want(batch_size);
        loop {
            if self
                .marked
                .is_none_or(|t| t.elapsed() >= Duration::from_secs(ENQUEUING_TTL_SECS / 3))
            {
                self.store.mark_enqueuing(self.job, Some(ENQUEUING_TTL_SECS)).await?;
                self.marked = Some(Instant::now());
            }
            if self.backlog + want > max {
                // The estimate counts what was sent; workers finished some since.
                self.backlog = self
                    .store
                    .remaining(self.job, self.spec.job.partitions)
                    .await?
                    .backlog();
            }
            if self.backlog + want <= max {
                return Ok((max - self.backlog).min(batch_size as u64) as usize);
            }
            if !self.said_waiting {
                self.said_waiting = true;
                common::errln!(
                    "enqueue waits: job `{}` holds {} tasks in Redis (--max-backlog {max}); it goes on as the workers drain them",
                    self.job,
                    self.backlog
                );
            }
            let t = Instant::now();
            tokio::select! {
                () = cancel.cancelled() => return Ok(0),
                () = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
            self.waited += t.elapsed();
        }
    }

    /// Reads up to `batch_size` lines. Returns true at end of file.
    fn parse_batch(
        &self,
        reader: &mut LineReader,
        buf: &mut Vec<u8>,
        batch_size: usize,
        sample: Option<&HashSet<u64>>,
        batch: &mut Batch,
    ) -> std::io::Result<bool> {
        let mut tasks = Vec::with_capacity(batch_size);
        let eof = loop {
            if batch.counts.lines >= batch_size as u64 {
                break false;
            }
            let Some(pos) = reader.next_line(buf)? else {
                break true;
            };
            batch.end_offset = pos.end;
            batch.end_line = pos.number;
            if sample.is_some_and(|s| !s.contains(&pos.number)) {
                continue;
            }
            batch.counts.lines += 1;
            let origin = format!("{}:{}", self.origin_tag, pos.number);
            match parse_line(buf, pos.oversize, self.spec, &self.user, &self.ids) {
                Line::Blank => batch.counts.blank += 1,
                Line::Dropped { key, reason } => {
                    batch.counts.add_dropped(&reason.code());
                    batch.dropped.push(dropped_line(pos.number, None, key, &reason));
                }
                Line::Record(r) => {
                    let partition = partition_of(&r.id, self.spec.job.partitions);
                    let mut traceparent = String::new();
                    if self.traces.enabled() && r.rendered.is_ok() {
                        let span = self.traces.start("enqueue", SpanKind::Producer, None);
                        span.set("batchfleet.job", self.job.to_owned());
                        span.set("batchfleet.record_id", r.id.clone());
                        span.set("batchfleet.partition", i64::from(partition));
                        span.set("batchfleet.line", pos.number as i64);
                        traceparent = span.traceparent().unwrap_or_default();
                        batch.spans.push(span);
                    }
                    batch.task_lines.push(pos.number);
                    let task = match &r.rendered {
                        Ok(_) => Task::new(&r.id, &r.input, &traceparent).map_err(|e| e.to_string()),
                        Err(missing) => Err(missing.to_string()),
                    };
                    tasks.push(TaskEntry {
                        partition,
                        record_id: r.id,
                        origin,
                        key: r.key,
                        task,
                    });
                }
            }
        };
        batch.tasks = Arc::new(tasks);
        Ok(eof)
    }

    /// Accounts a batch Redis confirmed, stores its drops, then moves the cursor.
    async fn confirm(&mut self, batch: Batch, outcomes: Vec<EnqueueOutcome>) -> Result<(), EnqueueError> {
        let Batch {
            tasks,
            task_lines,
            spans,
            mut dropped,
            mut counts,
            end_offset,
            end_line,
        } = batch;
        let this_dataset = format!("{}:", self.origin_tag);
        let mut spans = spans.into_iter();
        for ((task, &line), outcome) in tasks.iter().zip(&task_lines).zip(outcomes) {
            if task.task.as_ref().is_ok_and(|t| !t.tp.is_empty())
                && let Some(span) = spans.next()
            {
                let added = outcome == EnqueueOutcome::Added;
                span.set("batchfleet.enqueue.outcome", if added { "added" } else { "present" });
            }
            // Present with another line of this same dataset as its origin: a duplicate id.
            let duplicate_of = match &outcome {
                EnqueueOutcome::Present { origin: Some(o) } if *o != task.origin => {
                    o.strip_prefix(&this_dataset).and_then(|l| l.parse::<u64>().ok())
                }
                _ => None,
            };
            let template_missing = task
                .task
                .as_ref()
                .err()
                .and_then(|r| r.strip_prefix("template_missing:"));
            let reason = match (duplicate_of, template_missing) {
                (Some(first_line), _) => Some(DropReason::DuplicateId { first_line }),
                (None, Some(field)) => Some(DropReason::TemplateMissing(field.to_owned())),
                (None, None) => None,
            };
            match (reason, outcome) {
                (Some(reason), _) => {
                    counts.add_dropped(&reason.code());
                    dropped.push(dropped_line(
                        line,
                        Some(task.record_id.clone()),
                        Some(task.key.clone()),
                        &reason,
                    ));
                }
                (None, EnqueueOutcome::Added) => counts.enqueued += 1,
                (None, EnqueueOutcome::Present { .. }) => counts.already_present += 1,
            }
        }
        self.store
            .record_dropped(self.job, &self.origin_prefix, &dropped)
            .await?;
        self.cursor.counts.merge(&counts);
        self.cursor.offset = end_offset;
        self.cursor.line = end_line;
        self.store.save_cursor(self.job, &self.cursor).await?;
        Ok(())
    }
}

fn dropped_line(line: u64, record_id: Option<String>, key: Option<String>, reason: &DropReason) -> DroppedLine {
    DroppedLine {
        line,
        record_id,
        key,
        reason: reason.code(),
        detail: reason.detail(),
    }
}

/// Writes (or extends) the manifest once a pass is complete. Totals come from
/// Redis: the job's records from its state hashes, drops from its drop hash.
async fn write_manifest(
    store: &RedisStore,
    job: &str,
    spec: &JobSpec,
    cursor: &Cursor,
    tag: u64,
    dry_run: bool,
) -> Result<Manifest, EnqueueError> {
    let previous = store.load_manifest(job).await?;
    let c = &cursor.counts;
    let this_pass = DatasetPass {
        dataset: cursor.identity.dataset.clone(),
        tag: Some(tag),
        lines: c.lines,
        blank_lines: c.blank,
        records: c.expected_records(),
        dropped_lines: c.dropped,
    };
    let mut datasets: Vec<DatasetPass> = previous.as_ref().map(|m| m.datasets.clone()).unwrap_or_default();
    datasets.retain(|d| d.dataset.sha256 != this_pass.dataset.sha256);
    datasets.push(this_pass);
    let mut dropped_by_reason = BTreeMap::new();
    let drops = store.dropped_lines(job).await?;
    for d in &drops {
        *dropped_by_reason.entry(d.reason.clone()).or_insert(0u64) += 1;
    }
    let now = now_rfc3339();
    let manifest = Manifest {
        job: job.to_owned(),
        job_key: cursor.job_key.clone(),
        datasets,
        sample: cursor.identity.sample.clone(),
        expected_records: store.count_records(job, spec.job.partitions).await?,
        dropped_lines: drops.len() as u64,
        dropped_by_reason,
        partitions: spec.job.partitions,
        versions: cursor.identity.versions.clone(),
        note: spec.versions.note.clone(),
        dry_run,
        spec_sha256: spec.fingerprint(),
        created_at: previous.map_or_else(|| now.clone(), |m| m.created_at),
        updated_at: now,
    };
    store.save_manifest(job, &manifest).await?;
    Ok(manifest)
}

/// The line numbers of a reproducible sample: the `size` non-blank lines with
/// the smallest `sha256(seed, line)`. Independent of any RNG implementation.
fn sample_line_numbers(path: &Path, sample: &Sample) -> std::io::Result<HashSet<u64>> {
    let mut reader = LineReader::open(path, 0, 0, 64)?;
    let mut heap: BinaryHeap<([u8; 8], u64)> = BinaryHeap::new();
    let mut buf = Vec::new();
    while let Some(pos) = reader.next_line(&mut buf)? {
        if pos.oversize.is_none() && buf.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let mut h = Sha256::new();
        h.update(sample.seed.to_be_bytes());
        h.update(pos.number.to_be_bytes());
        let digest = h.finalize();
        let mut rank = [0u8; 8];
        rank.copy_from_slice(&digest[..8]);
        heap.push((rank, pos.number));
        if heap.len() as u64 > sample.size {
            heap.pop();
        }
    }
    Ok(heap.into_iter().map(|(_, line)| line).collect())
}

//! `producer status`, `jobs`, `export`, `manifest` and `dropped`: where a
//! job's records are, every job a line, and a job's sets written out.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use common::spec::JobSpec;
use common::store::RedisStore;
use tokio_util::sync::CancellationToken;

use super::{EXIT_INCOMPLETE, JobArgs, RedisArgs, job_store, refuse};
use crate::status::JobStatus;

#[derive(Debug, Args)]
pub struct StatusCmd {
    #[arg(long)]
    pub job: String,
    #[command(flatten)]
    pub redis: RedisArgs,
    /// Print one JSON document.
    #[arg(long, conflicts_with = "jsonl")]
    pub json: bool,
    /// JSON Lines: one status object per line (with `--watch`, one per refresh).
    #[arg(long)]
    pub jsonl: bool,
    /// Exit non-zero unless every expected record is in exactly one terminal set.
    #[arg(long)]
    pub require_complete: bool,
    /// Exit non-zero unless every expected record is done (none in
    /// review, dropped or cancelled).
    #[arg(long)]
    pub require_done: bool,
    /// List the record ids of missing, duplicated and unknown records.
    #[arg(long)]
    pub ids: bool,
    /// Refresh every 2 seconds until interrupted (or complete); as a stream
    /// of JSON Lines with `--jsonl`.
    #[arg(long)]
    pub watch: bool,
}

#[derive(Debug, Args)]
pub struct ExportCmd {
    #[arg(long)]
    pub job: String,
    #[command(flatten)]
    pub redis: RedisArgs,
    /// Output file (`-` for stdout).
    #[arg(long)]
    pub out: PathBuf,
    /// Which set: results (`done`), review entries (`review`), dropped
    /// records, or every paid call of the cost ledger (`ledger`).
    #[arg(long, value_enum, default_value_t = crate::status::ExportSet::Done)]
    pub what: crate::status::ExportSet,
}

/// `producer status`: once, or every 2 s with `--watch` until complete.
pub async fn status(cmd: StatusCmd, cancel: CancellationToken) -> anyhow::Result<ExitCode> {
    if cmd.watch && cmd.json {
        return refuse(format!(
            "--watch with --json would print a document every 2 seconds, and --json is one document. \
             For a stream of JSON Lines (one status per line): producer status --job {} --watch --jsonl{}",
            cmd.job,
            common::secret::redis_flag(&cmd.redis.url)
        ));
    }
    let job = cmd.job.as_str();
    let store = job_store(&cmd.redis, job).await?;
    let spec = store.job_spec(job).await.ok().flatten();
    // Completeness is proven from the sink's own rows too.
    let verify = (cmd.require_complete || cmd.require_done) && spec.as_ref().is_some_and(|s| !s.sink.is_none());
    loop {
        let s = status_once(&store, &cmd, spec.as_ref(), verify).await?;
        if cmd.json || cmd.jsonl {
            crate::outln!("{}", serde_json::to_string(&s)?);
        } else {
            if cmd.watch && std::io::IsTerminal::is_terminal(&std::io::stdout()) {
                crate::out!("\x1b[2J\x1b[H"); // clear the screen, cursor home
            }
            crate::status::print(&s);
            if let Some(sink) = &s.sink {
                crate::sink::print(sink);
            }
        }
        if !cmd.watch || s.complete {
            return Ok(exit_code(&cmd, &s));
        }
        tokio::select! {
            _ = tokio::time::sleep(std::time::Duration::from_secs(2)) => {}
            _ = cancel.cancelled() => return Ok(ExitCode::SUCCESS),
        }
    }
}

/// One reading of the job, its sink's included (verified against the done
/// set when `verify`).
async fn status_once(
    store: &RedisStore,
    cmd: &StatusCmd,
    spec: Option<&JobSpec>,
    verify: bool,
) -> anyhow::Result<JobStatus> {
    let mut s = crate::status::status(store, &cmd.job, cmd.ids, verify).await?;
    s.redis_flag = common::secret::redis_flag(&cmd.redis.url);
    if let Some(spec) = spec {
        let done = std::mem::take(&mut s.done_ids);
        s.sink = crate::sink::sink_status(store, &cmd.job, spec, verify.then_some(done)).await?;
        if let Some(sink) = &s.sink
            && verify
        {
            s.complete &= sink.backlog == 0 && sink.verified.as_ref().is_some_and(|v| v.exact);
        }
    }
    Ok(s)
}

/// The last reading's exit code (warning on stderr of what is not done).
fn exit_code(cmd: &StatusCmd, s: &JobStatus) -> ExitCode {
    let job = &cmd.job;
    if s.review + s.dropped + s.cancelled > 0 {
        common::errln!(
            "warning: {} in review, {} dropped, {} cancelled: not every record is done \
             (producer review --job {job} list; producer dropped --job {job})",
            s.review,
            s.dropped,
            s.cancelled
        );
    }
    let all_done = s.complete && s.expected.is_some_and(|e| e == s.done);
    if (cmd.require_complete && !s.complete) || (cmd.require_done && !all_done) {
        ExitCode::from(EXIT_INCOMPLETE)
    } else {
        ExitCode::SUCCESS
    }
}

/// `producer export`: one set of the job as JSONL, to a file or stdout.
pub async fn export(cmd: ExportCmd) -> anyhow::Result<ExitCode> {
    let (job, what, out) = (cmd.job.as_str(), cmd.what, &cmd.out);
    let store = job_store(&cmd.redis, job).await?;
    let Some(manifest) = store.load_manifest(job).await? else {
        return refuse(format_args!(
            "job `{job}` has no manifest (never enqueued to completion)"
        ));
    };
    let n = if out.as_os_str() == "-" {
        crate::status::export(&store, job, manifest.partitions, what, &mut std::io::stdout().lock()).await?
    } else {
        let file = std::fs::File::create(out).map_err(|e| anyhow::anyhow!("cannot create {}: {e}", out.display()))?;
        crate::status::export(
            &store,
            job,
            manifest.partitions,
            what,
            &mut std::io::BufWriter::new(file),
        )
        .await?
    };
    // Records not settled yet: cheap queue counters, not a full reconciliation.
    let mut still_open = 0;
    for p in 0..manifest.partitions {
        let q = store.queue_stats(job, p).await?;
        still_open += q.lag + q.pending + q.delayed;
    }
    common::errln!(
        "exported {n} {} records of job {job} to {} ({still_open} records were still open)",
        what.name(),
        out.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// `producer manifest`: the job's manifest as JSON.
pub async fn manifest(cmd: JobArgs) -> anyhow::Result<ExitCode> {
    let job = cmd.job.as_str();
    let store = job_store(&cmd.redis, job).await?;
    match store.load_manifest(job).await? {
        Some(m) => {
            crate::outln!("{}", serde_json::to_string_pretty(&m)?);
            Ok(ExitCode::SUCCESS)
        }
        None => refuse(format_args!(
            "job `{job}` has no manifest (never enqueued to completion)"
        )),
    }
}

#[derive(Debug, Args)]
pub struct DroppedCmd {
    #[command(flatten)]
    pub job: JobArgs,
    /// One JSON document: `{"dropped": [...], "count": N}`.
    #[arg(long, conflicts_with = "jsonl")]
    pub json: bool,
    /// JSON Lines: one dropped line per line (line, record_id, key, reason, detail).
    #[arg(long)]
    pub jsonl: bool,
}

/// `producer dropped`: the job's dropped lines, a line each (text or JSON
/// Lines), or one document.
pub async fn dropped(cmd: DroppedCmd) -> anyhow::Result<ExitCode> {
    let job = &cmd.job.job;
    let store = job_store(&cmd.job.redis, job).await?;
    let lines = store.dropped_lines(job).await?;
    if cmd.json {
        crate::outln!("{}", serde_json::json!({ "dropped": lines, "count": lines.len() }));
        return Ok(ExitCode::SUCCESS);
    }
    for d in &lines {
        if cmd.jsonl {
            crate::outln!("{}", serde_json::to_string(d)?);
        } else {
            let id = d.key.as_deref().or(d.record_id.as_deref()).unwrap_or("-");
            crate::outln!("line {:<8} {:<24} {:<24} {}", d.line, id, d.reason, d.detail);
        }
    }
    if !cmd.json && !cmd.jsonl {
        common::errln!("{} dropped lines", lines.len());
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Debug, Args)]
pub struct WorkersCmd {
    #[command(flatten)]
    pub redis: RedisArgs,
    /// One JSON document: `{"workers": [...]}`, an object per worker.
    #[arg(long)]
    pub json: bool,
}

/// `producer workers`: the fleet's workers, as their heartbeats say.
pub async fn workers(cmd: WorkersCmd) -> anyhow::Result<ExitCode> {
    let store = RedisStore::connect(&cmd.redis.url).await?;
    let lines = crate::workers::list(&store).await?;
    if cmd.json {
        crate::outln!("{}", serde_json::json!({ "workers": lines }));
    } else if lines.is_empty() {
        common::errln!(
            "no worker has reported to the Redis at {} in the last minutes. Start one with: worker --job NAME{}",
            common::secret::redact_url(&cmd.redis.url),
            common::secret::redis_flag(&cmd.redis.url)
        );
    } else {
        crate::workers::print(&lines);
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Debug, Args)]
pub struct JobsCmd {
    #[command(flatten)]
    pub redis: RedisArgs,
    /// One JSON document: `{"jobs": [...]}`, an object per job.
    #[arg(long)]
    pub json: bool,
}

/// `producer jobs`: every job of the Redis, reconciled now, a line each.
pub async fn jobs(cmd: JobsCmd) -> anyhow::Result<ExitCode> {
    let store = RedisStore::connect(&cmd.redis.url).await?;
    let lines = crate::jobs::list(&store).await?;
    if cmd.json {
        crate::outln!("{}", serde_json::json!({ "jobs": lines }));
    } else if lines.is_empty() {
        common::errln!(
            "no jobs in the Redis at {}. Enqueue one with: producer enqueue DATASET.jsonl --job NAME --spec SPEC.toml{}",
            common::secret::redact_url(&cmd.redis.url),
            common::secret::redis_flag(&cmd.redis.url)
        );
    } else {
        crate::jobs::print(&lines, &common::secret::redis_flag(&cmd.redis.url));
    }
    Ok(ExitCode::SUCCESS)
}

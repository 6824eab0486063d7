//! `producer rerun`: a job's done records, selected by a filter, run again
//! in a new job under a (changed) spec. A bulk action like `review bulk`:
//! `--dry-run` shows the count and a sample, more than
//! [`crate::filter::CONFIRM_ABOVE`] records need `--yes`, and the first job's
//! bulk-action log records it with its filter and count. The new job has
//! its own record ids, so the first job's results stay as they are, and
//! `producer compare` puts the two side by side.

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use common::manifest::{FromJob, Sample};
use tokio_util::sync::CancellationToken;

use super::review::FilterFlags;
use super::{RedisArgs, job_store, refuse};
use crate::enqueue::{EnqueueArgs, enqueue};
use crate::select::FromJobSummary;

#[derive(Debug, Args)]
pub struct RerunCmd {
    /// The dataset the first job was enqueued from (the records' lines are read from it).
    pub dataset: PathBuf,
    /// The job whose done records run again.
    #[arg(long, value_name = "JOB")]
    pub from_job: String,
    /// The new job they run in (A-Z a-z 0-9 . _ -, up to 64).
    #[arg(long)]
    pub job: String,
    /// Its spec (the changed prompt, model or validation).
    #[arg(long)]
    pub spec: PathBuf,
    #[command(flatten)]
    pub redis: RedisArgs,
    #[command(flatten)]
    pub filter: FilterFlags,
    /// Show how many done records match and a sample; do nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Run more than 10 records again.
    #[arg(long)]
    pub yes: bool,
    /// Who runs it (for the bulk-action log).
    #[arg(long, env = "USER", default_value = "operator")]
    pub by: String,
    /// The outcome as one JSON document.
    #[arg(long)]
    pub json: bool,
    /// No progress bar or progress lines.
    #[arg(long)]
    pub no_progress: bool,
}

/// Runs `producer rerun`.
pub async fn run(cmd: RerunCmd, cancel: CancellationToken) -> anyhow::Result<ExitCode> {
    let f = cmd.filter.filter();
    if let Err(why) = f.check_done() {
        return refuse(why);
    }
    if cmd.job == cmd.from_job {
        return refuse(format!(
            "--job names the job the records come from: run them again in a new job (e.g. --job {}-v2), so both \
             results stay and `producer compare` shows them side by side",
            cmd.from_job
        ));
    }
    let store = job_store(&cmd.redis, &cmd.from_job).await?;
    let sha256 = match crate::reader::file_sha256(&cmd.dataset) {
        Ok((sha, _)) => sha,
        Err(e) => return refuse(format!("{}: {e}", cmd.dataset.display())),
    };
    let from = FromJob {
        job: cmd.from_job.clone(),
        set: Some("done".into()),
        plus_passed: 0,
        filter: Some(serde_json::to_value(&f)?),
    };
    let (lines, found) = match crate::select::lines_from_job(&store, &from, 0, &sha256, &cmd.dataset).await {
        Ok(got) => got,
        Err(crate::select::SelectError::Refused(why)) => return refuse(why),
        Err(e) => return Err(e.into()),
    };
    let n = found.records;
    if cmd.dry_run {
        dry_run(&cmd, n, &lines, &found.skipped)?;
        return Ok(ExitCode::SUCCESS);
    }
    if n as usize > crate::filter::CONFIRM_ABOVE && !cmd.yes {
        return refuse(format!(
            "rerun would run {n} done records of job {} again, more than {}: look first with --dry-run, then \
             run it again with --yes ({} --yes)",
            cmd.from_job,
            crate::filter::CONFIRM_ABOVE,
            super::this_command(None, &cmd.redis.url),
        ));
    }
    if n == 0 {
        crate::outln!(
            "rerun: no done record of job {} matches (nothing enqueued; --dry-run shows what a filter selects)",
            cmd.from_job
        );
        return Ok(ExitCode::SUCCESS);
    }
    let args = cmd.enqueue_args(from, (lines, found));
    let summary = match enqueue(&args, cancel).await {
        Ok(summary) => summary,
        Err(e) => return refuse(e),
    };
    let log_id = log(&store, &cmd, &f, n, &summary).await?;
    say_done(&cmd, n, &summary, &log_id);
    Ok(if summary.interrupted {
        ExitCode::from(super::EXIT_INTERRUPTED)
    } else {
        ExitCode::SUCCESS
    })
}

/// Records the rerun in the first job's bulk-action log; returns its entry's id.
async fn log(
    store: &common::store::RedisStore,
    cmd: &RerunCmd,
    f: &crate::filter::Filter,
    n: u64,
    summary: &crate::enqueue::Summary,
) -> anyhow::Result<String> {
    Ok(store
        .bulk_log_add(
            &cmd.from_job,
            &[
                ("action", "rerun".to_owned()),
                ("by", cmd.by.clone()),
                ("at", common::manifest::now_rfc3339()),
                ("filter", f.describe()),
                ("matched", n.to_string()),
                ("acted", (summary.enqueued + summary.already_present).to_string()),
                ("detail", format!("into job {} (spec {})", cmd.job, cmd.spec.display())),
                ("complete", (!summary.interrupted).to_string()),
            ],
        )
        .await?)
}

/// What the rerun did, and what to type next.
fn say_done(cmd: &RerunCmd, n: u64, summary: &crate::enqueue::Summary, log_id: &str) {
    let redis = common::secret::redis_flag(&cmd.redis.url);
    if cmd.json {
        crate::outln!(
            "{}",
            serde_json::json!({"action": "rerun", "from_job": cmd.from_job, "job": cmd.job, "matched": n,
                "enqueued": summary.enqueued, "already_present": summary.already_present, "log_id": log_id})
        );
    } else {
        crate::outln!(
            "rerun: {n} done records of job {} enqueued into job {} ({} new, {} already there); recorded in {}'s \
             bulk-action log as {log_id}. Next: worker --job {}{redis} --drain, then producer compare --job {} \
             --job {}{redis}",
            cmd.from_job,
            cmd.job,
            summary.enqueued,
            summary.already_present,
            cmd.from_job,
            cmd.job,
            cmd.from_job,
            cmd.job,
        );
    }
}

impl RerunCmd {
    /// The enqueue of the selected records into the new job.
    fn enqueue_args(&self, from: FromJob, selected: (HashSet<u64>, FromJobSummary)) -> EnqueueArgs {
        EnqueueArgs {
            dataset: self.dataset.clone(),
            job: self.job.clone(),
            spec_path: self.spec.display().to_string(),
            redis_url: self.redis.url.clone(),
            restart: false,
            sample: Some(Sample {
                size: 0,
                seed: 0,
                stratify: false,
                from_job: Some(from),
            }),
            dry_run: false,
            batch_size: 2000,
            idem_ttl_secs: 7 * 24 * 3600,
            progress: !self.no_progress && !self.json,
            allow_evicting_redis: false,
            max_backlog: 100_000,
            selected: Some(selected),
        }
    }
}

/// `--dry-run`: the count, what was skipped, and the first lines selected.
fn dry_run(
    cmd: &RerunCmd,
    n: u64,
    lines: &std::collections::HashSet<u64>,
    skipped: &std::collections::BTreeMap<String, u64>,
) -> anyhow::Result<()> {
    let mut first: Vec<u64> = lines.iter().copied().collect();
    first.sort_unstable();
    first.truncate(crate::filter::SAMPLE);
    let sample = sample_lines(&cmd.dataset, &first)?;
    if cmd.json {
        let sample: Vec<serde_json::Value> = sample
            .iter()
            .map(|(line, text)| serde_json::json!({"line": line, "record": text}))
            .collect();
        crate::outln!(
            "{}",
            serde_json::json!({"action": "rerun", "dry_run": true, "from_job": cmd.from_job, "matched": n,
                "skipped": skipped, "sample": sample})
        );
        return Ok(());
    }
    crate::outln!(
        "rerun would run {n} done records of job {} again in job {} (dry run: nothing done)",
        cmd.from_job,
        cmd.job
    );
    for (why, k) in skipped {
        crate::outln!("  skipped {k}: {why}");
    }
    for (line, text) in &sample {
        let text: String = text.chars().take(100).collect();
        crate::outln!("  line {line}: {text}");
    }
    if n as usize > crate::filter::SAMPLE {
        crate::outln!("  ... and {} more", n as usize - crate::filter::SAMPLE);
    }
    Ok(())
}

/// The text of these line numbers of the dataset.
fn sample_lines(dataset: &std::path::Path, wanted: &[u64]) -> anyhow::Result<Vec<(u64, String)>> {
    let mut reader = crate::reader::LineReader::open(dataset, 0, 0, 1 << 20)?;
    let mut buf = Vec::new();
    let mut out = Vec::new();
    while let Some(pos) = reader.next_line(&mut buf)? {
        if wanted.contains(&pos.number) {
            out.push((pos.number, String::from_utf8_lossy(&buf).trim().to_owned()));
            if out.len() == wanted.len() {
                break;
            }
        }
    }
    Ok(out)
}

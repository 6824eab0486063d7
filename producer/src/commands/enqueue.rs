//! `producer enqueue`: a dataset (or a sample of it, or another job's
//! records) into a job, exactly once and resumable (see [`crate::enqueue`]).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;
use common::manifest::Sample;
use common::spec::JobSpec;
use tokio_util::sync::CancellationToken;

use super::{EXIT_INPUT, EXIT_INTERRUPTED, RedisArgs, refuse, this_command};
use crate::enqueue::{EnqueueArgs, EnqueueError, Summary, enqueue};

#[derive(Debug, Args)]
pub struct EnqueueCmd {
    /// The JSONL dataset, one record per line.
    pub dataset: PathBuf,
    /// Job name (A-Z a-z 0-9 . _ -, up to 64).
    #[arg(long)]
    pub job: String,
    /// The job spec (TOML).
    #[arg(long)]
    pub spec: PathBuf,
    #[command(flatten)]
    pub redis: RedisArgs,
    /// Start from the first line even when the job has a cursor; with another
    /// dataset, add it to the job (records already present are kept).
    #[arg(long)]
    pub restart: bool,
    /// Enqueue a reproducible sample of N lines instead of the whole file.
    #[arg(long, value_name = "N", requires = "seed", conflicts_with = "set")]
    pub sample: Option<u64>,
    /// Seed of the sample (and of the passed records `--plus-passed` picks).
    #[arg(long, value_name = "S")]
    pub seed: Option<u64>,
    /// With --sample: a sample that covers the shortest and longest rendered
    /// prompts, texts with newlines, quotes and non-ASCII characters, and
    /// every value of the template's fields that have few (with --from-job:
    /// and the records that failed there).
    #[arg(long, requires = "sample")]
    pub stratify: bool,
    /// Records of another job (enqueued from this dataset): with --set, that
    /// set; with --sample --stratify, its failures go into the sample.
    #[arg(long, value_name = "JOB")]
    pub from_job: Option<String>,
    /// With --from-job: which of its records (under this spec: new record ids).
    #[arg(long, value_enum, requires = "from_job")]
    pub set: Option<FromSet>,
    /// With --set: N records that passed there too, as a regression check.
    #[arg(long, value_name = "N", requires = "set", default_value_t = 0)]
    pub plus_passed: u64,
    /// A trial run: the job's spec is stored without its [sink] (nothing is
    /// written to the database or files), and the workers log each attempt.
    #[arg(long)]
    pub dry_run: bool,
    /// Records per batch confirmed by Redis (the cursor moves per batch).
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub batch_size: u64,
    /// Lifetime of each record's idempotency key, in seconds.
    #[arg(long, default_value_t = 7 * 24 * 3600, value_parser = clap::value_parser!(u64).range(60..))]
    pub idem_ttl: u64,
    /// Print the summary as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// No progress bar or progress lines.
    #[arg(long)]
    pub no_progress: bool,
    /// Enqueue even when Redis may evict keys (never in production).
    #[arg(long)]
    pub allow_evicting_redis: bool,
    /// The most tasks the job may hold in Redis (queued, in flight, waiting
    /// to retry): beyond it enqueue waits for the workers, and goes on as
    /// they drain them, so Redis holds a bounded part of a large dataset.
    /// 0: no bound (load a whole job before any worker runs).
    #[arg(long, env = "BATCHFLEET_MAX_BACKLOG", default_value_t = 100_000)]
    pub max_backlog: u64,
}

/// The records `enqueue --from-job JOB --set` takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FromSet {
    Review,
    Dropped,
    Done,
}

/// Runs `producer enqueue`: flags checked, the template against the
/// dataset's first records, then [`enqueue`] and its summary.
pub async fn run(cmd: EnqueueCmd, cancel: CancellationToken) -> anyhow::Result<ExitCode> {
    if cmd.seed.is_some() && cmd.sample.is_none() && cmd.set.is_none() {
        return refuse("--seed goes with --sample N or --from-job JOB --set ...");
    }
    if cmd.from_job.is_some() && cmd.set.is_none() && !cmd.stratify {
        return refuse("--from-job takes --set review|dropped|done, or goes with --sample N --seed S --stratify");
    }
    if let Err(why) = template_fits(&cmd.spec, &cmd.dataset, &cmd.redis.url) {
        return refuse(why);
    }
    let json = cmd.json;
    match enqueue(&cmd.into_args(), cancel).await {
        Ok(summary) => {
            super::print_json_or(json, &summary, print_summary)?;
            if let Some(change) = &summary.dataset_changed {
                common::errln!("{}: {}", if change.grew { "warning" } else { "error" }, change.message);
            }
            Ok(if summary.interrupted {
                ExitCode::from(EXIT_INTERRUPTED)
            } else if summary.dataset_changed.as_ref().is_some_and(|c| !c.grew) {
                ExitCode::from(EXIT_INPUT)
            } else {
                ExitCode::SUCCESS
            })
        }
        Err(
            e @ (EnqueueError::Spec(_)
            | EnqueueError::JobName(_)
            | EnqueueError::Dataset { .. }
            | EnqueueError::Refused(_)),
        ) => refuse(e),
        Err(e) => Err(e.into()),
    }
}

impl EnqueueCmd {
    /// The sample these flags ask for: `--sample N`, or another job's set.
    fn sample(&self) -> Option<Sample> {
        let from_job = self.from_job.clone().map(|job| common::manifest::FromJob {
            job,
            set: self.set.map(|s| s.name().to_owned()),
            plus_passed: self.plus_passed,
            filter: None,
        });
        let seed = self.seed.unwrap_or_default();
        match (self.sample, &from_job) {
            (Some(size), _) => Some(Sample {
                size,
                seed,
                stratify: self.stratify,
                from_job,
            }),
            (None, Some(_)) => Some(Sample {
                size: self.plus_passed,
                seed,
                stratify: false,
                from_job,
            }),
            (None, None) => None,
        }
    }

    fn into_args(self) -> EnqueueArgs {
        EnqueueArgs {
            sample: self.sample(),
            spec_path: self.spec.display().to_string(),
            progress: !self.no_progress && !self.json,
            dataset: self.dataset,
            job: self.job,
            redis_url: self.redis.url,
            restart: self.restart,
            dry_run: self.dry_run,
            batch_size: self.batch_size as usize,
            idem_ttl_secs: self.idem_ttl,
            max_backlog: self.max_backlog,
            allow_evicting_redis: self.allow_evicting_redis,
            selected: None,
        }
    }
}

impl FromSet {
    fn name(self) -> &'static str {
        match self {
            FromSet::Review => "review",
            FromSet::Dropped => "dropped",
            FromSet::Done => "done",
        }
    }
}

/// Refuses an enqueue whose template most of the dataset's first records
/// cannot fill (before anything is written to Redis).
fn template_fits(spec_path: &Path, dataset: &Path, redis_url: &str) -> Result<(), String> {
    let Ok(spec) = JobSpec::load(&spec_path.display().to_string()) else {
        return Ok(()); // enqueue itself reports what is wrong with the spec
    };
    let Ok(c) = crate::precheck::check(&spec, dataset) else {
        return Ok(()); // nor can it read the dataset: enqueue says why
    };
    if c.fatal().is_empty() {
        return Ok(());
    }
    Err(crate::precheck::refusal(
        &c,
        &spec_path.display().to_string(),
        &dataset.display().to_string(),
        &this_command(None, redis_url),
    ))
}

fn print_summary(s: &Summary) {
    let status = if s.interrupted {
        format!(
            "INTERRUPTED after line {} (cursor saved: rerun the same command to resume)",
            s.lines
        )
    } else {
        "complete".to_owned()
    };
    crate::outln!("job {} ({}): {status}", s.job, &s.job_key[..12]);
    crate::outln!("  dataset        {} (sha256 {})", s.dataset, &s.dataset_sha256[..12]);
    if s.resumed_from_line > 0 {
        crate::outln!("  resumed after  line {}", s.resumed_from_line);
    }
    crate::outln!("  lines          {} ({} blank)", s.lines, s.blank_lines);
    crate::outln!("  enqueued       {}", s.enqueued);
    crate::outln!("  already there  {}", s.already_present);
    crate::outln!("  dropped        {}", s.dropped);
    for (reason, n) in &s.dropped_by_reason {
        crate::outln!("    {reason:<28} {n}");
    }
    crate::outln!("  records        {} in this dataset", s.records);
    if let Some(f) = &s.from_job {
        crate::outln!(
            "  from job       {} records of the set, {} that passed there (regression check)",
            f.records,
            f.passed
        );
        for (why, n) in &f.skipped {
            crate::outln!("    not taken: {n} ({why})");
        }
    }
    if let Some(c) = &s.coverage {
        crate::outln!(
            "  sample covers  {} lines for coverage, {} in all: shortest prompt line {}, longest line {}",
            c.covering,
            c.size,
            c.shortest.map_or("-".into(), |l| l.to_string()),
            c.longest.map_or("-".into(), |l| l.to_string())
        );
        for (kind, line) in &c.texts {
            crate::outln!("    {kind:<12} line {line}");
        }
        for (field, values) in &c.values {
            crate::outln!("    {field:<12} every value: {}", values.join(", "));
        }
        if c.failed_before > 0 {
            crate::outln!("    failed before: {} lines", c.failed_before);
        }
    }
    if s.dry_run {
        crate::outln!("  dry run        the job's spec has no sink; the workers log every attempt");
    }
    if let Some(n) = s.job_records {
        crate::outln!("  job records    {n} (expected in the terminal sets)");
    }
    crate::outln!(
        "  elapsed        {:.2}s ({:.0} lines/s)",
        s.elapsed_secs,
        s.lines_per_sec
    );
    if s.dropped > 0 {
        crate::outln!("  see every dropped line with: producer dropped --job {}", s.job);
    }
}

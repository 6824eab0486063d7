//! The command line of `producer`, and `run()`, which `main` calls.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use common::manifest::Sample;
use common::spec::JobSpec;
use common::spec::system_prompt;
use common::store::RedisStore;
use tokio_util::sync::CancellationToken;

use crate::enqueue::{EnqueueArgs, EnqueueError, Summary, enqueue};

/// Exit code when input (spec, dataset, flags) is refused.
pub const EXIT_INPUT: u8 = 2;
/// Exit code of `status --require-complete` for an incomplete job.
pub const EXIT_INCOMPLETE: u8 = 4;
/// Exit code when an enqueue was interrupted (rerun to resume).
pub const EXIT_INTERRUPTED: u8 = 130;

#[derive(Debug, Parser)]
#[command(
    name = "producer",
    version,
    about = "batchfleet producer: enqueue datasets and inspect jobs"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Args, Clone)]
pub struct RedisArgs {
    /// Redis URL (`redis://[user:password@]host:port[/db]`).
    #[arg(
        long = "redis",
        env = "REDIS_URL",
        default_value = "redis://127.0.0.1:6379",
        hide_env_values = true
    )]
    pub url: String,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Enqueue a JSONL dataset into a job: idempotent and resumable.
    Enqueue(EnqueueCmd),
    /// Job specs.
    #[command(subcommand)]
    Spec(SpecCmd),
    /// Print a job's manifest (JSON).
    Manifest {
        #[arg(long)]
        job: String,
        #[command(flatten)]
        redis: RedisArgs,
    },
    /// Where every record of a job is (from Redis, not counters).
    Status {
        #[arg(long)]
        job: String,
        #[command(flatten)]
        redis: RedisArgs,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// Exit non-zero unless every expected record is in exactly one terminal set.
        #[arg(long)]
        require_complete: bool,
        /// Exit non-zero unless every expected record is done (none in
        /// review, dropped or cancelled).
        #[arg(long)]
        require_done: bool,
        /// List the record ids of missing, duplicated and unknown records.
        #[arg(long)]
        ids: bool,
        /// Refresh every 2 seconds until interrupted (or complete).
        #[arg(long)]
        watch: bool,
    },
    /// Failure distribution (error code x field), retries, attempts, tokens, cost.
    Report {
        #[arg(long)]
        job: String,
        #[command(flatten)]
        redis: RedisArgs,
        #[arg(long)]
        json: bool,
    },
    /// Write a job's records as JSONL (one line per record, keyed by record_id).
    Export {
        #[arg(long)]
        job: String,
        #[command(flatten)]
        redis: RedisArgs,
        /// Output file (`-` for stdout).
        #[arg(long)]
        out: PathBuf,
        /// Which set: results (`done`), review entries (`review`), dropped
        /// records, or every paid call of the cost ledger (`ledger`).
        #[arg(long, value_enum, default_value_t = crate::status::ExportSet::Done)]
        what: crate::status::ExportSet,
    },
    /// After a sample run: the full dataset's cost and duration, with a range.
    Estimate {
        #[arg(long)]
        job: String,
        /// Records of the full dataset (default: the non-blank lines of the
        /// dataset the sample was taken from).
        #[arg(long)]
        records: Option<u64>,
        #[command(flatten)]
        redis: RedisArgs,
        #[arg(long)]
        json: bool,
    },
    /// Two jobs side by side (e.g. the same records under two prompt versions).
    Compare {
        /// The two jobs: A, then B.
        #[arg(long = "job", num_args = 1, required = true)]
        jobs: Vec<String>,
        #[command(flatten)]
        redis: RedisArgs,
        #[arg(long)]
        json: bool,
    },
    /// Cancel a job: no new claims, in-flight work finishes, the rest is marked
    /// cancelled (kept for reconciliation; `resume` brings it back).
    Cancel {
        #[arg(long)]
        job: String,
        #[command(flatten)]
        redis: RedisArgs,
    },
    /// Resume a cancelled or halted job: cancelled records go back to the streams.
    Resume {
        #[arg(long)]
        job: String,
        /// A new spend cap in USD for a job halted on its budget (more than
        /// it spent and has in flight).
        #[arg(long)]
        budget: Option<f64>,
        #[command(flatten)]
        redis: RedisArgs,
    },
    /// A new round of attempts for a set of records (ids kept, attempts count on).
    Retry {
        #[arg(long)]
        job: String,
        #[command(flatten)]
        redis: RedisArgs,
        /// review: every record in review; dropped: records rejected by a
        /// reviewer; missing: records reconciliation finds missing (input read
        /// back from their dataset line).
        #[arg(long, value_enum)]
        from: crate::retry::From,
        /// Recorded in each record's history.
        #[arg(long, env = "USER", default_value = "unknown")]
        reviewer: String,
        #[arg(long)]
        json: bool,
    },
    /// Drain the review queue: list, show, accept, requeue, reject.
    Review(ReviewArgs),
    /// Print a job's dropped lines (JSONL: line, id, reason, detail).
    Dropped {
        #[arg(long)]
        job: String,
        #[command(flatten)]
        redis: RedisArgs,
    },
    /// Spot checks: with --sample N, put N more committed results of the job
    /// in its audit queue (people judge them in the console); without, print
    /// the accuracy the verdicts so far estimate.
    Audit {
        #[arg(long)]
        job: String,
        #[command(flatten)]
        redis: RedisArgs,
        /// How many more results to sample.
        #[arg(long, value_name = "N")]
        sample: Option<u64>,
        /// Which ones: the same job and seed always give the same.
        #[arg(long, value_name = "S", default_value_t = 0, requires = "sample")]
        seed: u64,
        #[arg(long)]
        json: bool,
    },
    /// Serve the web console: jobs, their live status, the review queue.
    /// Reviewers sign in with a token of their own: `name:token` lines in
    /// --tokens-file or in the variable BATCHFLEET_CONSOLE_TOKENS.
    Console(ConsoleArgs),
}

#[derive(Debug, Args)]
pub struct ConsoleArgs {
    #[command(flatten)]
    pub redis: RedisArgs,
    /// Where to listen (loopback unless told otherwise).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub bind: std::net::SocketAddr,
    /// A file of `name:token` lines, one per reviewer (tokens of 16
    /// characters or more).
    #[arg(long, value_name = "FILE")]
    pub tokens_file: Option<PathBuf>,
    /// Take the reviewer's name from this request header, set by a reverse
    /// proxy that signs reviewers in (only for a console the proxy alone
    /// can reach).
    #[arg(long, value_name = "HEADER")]
    pub trusted_header: Option<String>,
}

#[derive(Debug, Args)]
pub struct ReviewArgs {
    #[arg(long)]
    pub job: String,
    #[command(flatten)]
    pub redis: RedisArgs,
    /// Who acts (recorded with every action).
    #[arg(long, env = "USER", default_value = "unknown")]
    pub reviewer: String,
    #[command(subcommand)]
    pub action: ReviewCmd,
}

#[derive(Debug, Subcommand)]
pub enum ReviewCmd {
    /// List entries (record id, key, reason, attempts, error codes).
    List {
        /// Only entries whose reason starts with this (attempts_exhausted, refused, poison...).
        #[arg(long)]
        reason: Option<String>,
        /// Only entries with this validation error code (E_ENUM...).
        #[arg(long)]
        code: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Show one entry: input, rendered prompt, last raw output, errors, attempts, history.
    Show { id: String },
    /// Accept a corrected output (validated like a model output) as the record's result.
    Accept {
        id: String,
        /// A file with the output JSON object.
        #[arg(long, conflicts_with = "edit")]
        output: Option<PathBuf>,
        /// Edit the last output in $EDITOR.
        #[arg(long)]
        edit: bool,
    },
    /// Revise a done record's result (by record id or business key): the
    /// output (validated like a model output) becomes its latest revision;
    /// the one it replaces is kept, in Redis or the sink.
    Revise {
        id: String,
        /// A file with the revised output JSON object.
        #[arg(long)]
        output: PathBuf,
        /// Why (recorded with the revision).
        #[arg(long)]
        note: Option<String>,
    },
    /// Put the record back for a fresh round of attempts.
    Requeue {
        id: String,
        #[arg(long)]
        note: Option<String>,
    },
    /// Reject the record: terminal, kept for the record.
    Reject {
        id: String,
        #[arg(long)]
        reason: String,
    },
    /// One entry at a time at a terminal: accept / edit / requeue / reject / skip / quit, one key each.
    Next,
    /// Write the queue as JSONL with empty decision / output / note columns.
    Export {
        /// Output file (`-` for stdout).
        #[arg(long)]
        out: PathBuf,
    },
    /// Apply decisions from a JSONL file (each line checked; bad lines change nothing).
    Import { file: PathBuf },
}

#[derive(Debug, Subcommand)]
pub enum SpecCmd {
    /// Validate a spec and print the system prompt it renders; with
    /// `--data`, also check its template's placeholders and id field against
    /// the first records of a dataset.
    Check {
        spec: PathBuf,
        /// A JSONL dataset: its first records must have what the template reads.
        #[arg(long)]
        data: Option<PathBuf>,
    },
    /// Replace a job's stored spec (workers read it when they start): prints
    /// what differs and records the change, who and when, in the job's spec
    /// history. Versions and partitions cannot change (record ids would).
    Update {
        #[arg(long)]
        job: String,
        #[arg(long)]
        spec: PathBuf,
        #[command(flatten)]
        redis: RedisArgs,
        /// Who makes the change (recorded).
        #[arg(long, env = "USER", default_value = "unknown")]
        by: String,
    },
}

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

/// A `--job` that names no job in the Redis looked in (the message names
/// that Redis, the jobs it has and the nearest name).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct NoSuchJob(String);

/// Connects for a command about an existing job: refuses a name no job has.
pub async fn job_store(redis: &RedisArgs, job: &str) -> anyhow::Result<RedisStore> {
    let store = RedisStore::connect(&redis.url).await?;
    let jobs = store.jobs().await?;
    if jobs.iter().any(|j| j == job) || store.job_spec(job).await.ok().flatten().is_some() {
        return Ok(store);
    }
    let at = common::secret::redact_url(&redis.url);
    let flag = common::secret::redis_flag(&redis.url);
    let message = match common::suggest::nearest(job, jobs.iter().map(String::as_str)) {
        _ if jobs.is_empty() => format!(
            "no job `{job}` in the Redis at {at}: it has no jobs at all. Enqueue one with \
             `producer enqueue DATASET.jsonl --job {job} --spec SPEC.toml{flag}`"
        ),
        Some(near) => format!(
            "no job `{job}` in the Redis at {at} (its jobs: {}). Did you mean `{near}`? Try: {}",
            jobs.join(", "),
            this_command(Some(near), &redis.url)
        ),
        None => format!("no job `{job}` in the Redis at {at} (its jobs: {})", jobs.join(", ")),
    };
    Err(NoSuchJob(message).into())
}

/// This command line again, ready to paste (with `--job` set to `job` when
/// given): its `--redis` as [`common::secret::redis_flag`] writes it (never
/// a password), words quoted for the shell where they need it.
fn this_command(job: Option<&str>, redis_url: &str) -> String {
    let mut words = vec!["producer".to_owned()];
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match (a.as_str(), job) {
            ("--job", Some(job)) => {
                args.next();
                words.push(format!("--job {}", common::suggest::shell_word(job)));
            }
            ("--redis", _) => {
                args.next();
            }
            (a, Some(job)) if a.starts_with("--job=") => words.push(format!("--job={job}")),
            (a, _) if a.starts_with("--redis=") => {}
            (a, _) => words.push(common::suggest::shell_word(a)),
        }
    }
    format!("{}{}", words.join(" "), common::secret::redis_flag(redis_url))
}

/// Runs a parsed command line; `main` only sets up the runtime and signals.
pub async fn run(cli: Cli, cancel: CancellationToken) -> ExitCode {
    match run_inner(cli, cancel).await {
        Ok(code) => code,
        Err(e) if e.downcast_ref::<NoSuchJob>().is_some() => {
            common::errln!("error: {e}");
            ExitCode::from(EXIT_INPUT)
        }
        // The reader of our output went away (`| head`): end quietly.
        Err(e) if crate::out::is_closed_pipe(&e) => ExitCode::from(crate::out::EXIT_CLOSED_PIPE),
        Err(e) => {
            common::errln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run_inner(cli: Cli, cancel: CancellationToken) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Spec(SpecCmd::Check { spec, data }) => match JobSpec::load(&spec.display().to_string()) {
            Ok(s) => {
                if let Some(data) = &data {
                    return check_against_data(&s, &spec, data);
                }
                crate::outln!(
                    "{}: ok ({} output fields, {} partitions)",
                    spec.display(),
                    s.output.fields.len(),
                    s.job.partitions
                );
                crate::outln!("--- system prompt ---\n{}", system_prompt(&s));
                Ok(ExitCode::SUCCESS)
            }
            Err(e) => {
                common::errln!("error: {e}");
                Ok(ExitCode::from(EXIT_INPUT))
            }
        },
        Command::Spec(SpecCmd::Update { job, spec, redis, by }) => update_spec(&job, &spec, &redis, &by).await,
        Command::Manifest { job, redis } => {
            let store = job_store(&redis, &job).await?;
            match store.load_manifest(&job).await? {
                Some(m) => {
                    crate::outln!("{}", serde_json::to_string_pretty(&m)?);
                    Ok(ExitCode::SUCCESS)
                }
                None => {
                    common::errln!("error: job `{job}` has no manifest (never enqueued to completion)");
                    Ok(ExitCode::from(EXIT_INPUT))
                }
            }
        }
        Command::Dropped { job, redis } => {
            let store = job_store(&redis, &job).await?;
            for d in store.dropped_lines(&job).await? {
                crate::outln!("{}", serde_json::to_string(&d)?);
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Status {
            job,
            redis,
            json,
            require_complete,
            require_done,
            ids,
            watch,
        } => {
            let store = job_store(&redis, &job).await?;
            let spec = store.job_spec(&job).await.ok().flatten();
            // Completeness is proven from the sink's own rows too.
            let verify = (require_complete || require_done) && spec.as_ref().is_some_and(|s| !s.sink.is_none());
            loop {
                let mut s = crate::status::status(&store, &job, ids, verify).await?;
                s.redis_flag = common::secret::redis_flag(&redis.url);
                if let Some(spec) = &spec {
                    let done = std::mem::take(&mut s.done_ids);
                    s.sink = crate::sink::sink_status(&store, &job, spec, verify.then_some(done)).await?;
                    if let Some(sink) = &s.sink
                        && verify
                    {
                        s.complete &= sink.backlog == 0 && sink.verified.as_ref().is_some_and(|v| v.exact);
                    }
                }
                if json {
                    crate::outln!("{}", serde_json::to_string(&s)?);
                } else {
                    if watch {
                        crate::out!("\x1b[2J\x1b[H"); // clear the screen, cursor home
                    }
                    crate::status::print(&s);
                    if let Some(sink) = &s.sink {
                        crate::sink::print(sink);
                    }
                }
                if !watch || s.complete {
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
                    return Ok(if (require_complete && !s.complete) || (require_done && !all_done) {
                        ExitCode::from(EXIT_INCOMPLETE)
                    } else {
                        ExitCode::SUCCESS
                    });
                }
                tokio::select! {
                    _ = tokio::time::sleep(std::time::Duration::from_secs(2)) => {}
                    _ = cancel.cancelled() => return Ok(ExitCode::SUCCESS),
                }
            }
        }
        Command::Report { job, redis, json } => {
            let store = job_store(&redis, &job).await?;
            let Some(spec) = spec_or_report(&store, &job).await else {
                return Ok(ExitCode::from(EXIT_INPUT));
            };
            let r = crate::report::report(&store, &job, &spec).await?;
            if json {
                crate::outln!("{}", serde_json::to_string(&r)?);
            } else {
                crate::report::print(&r);
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Export { job, redis, out, what } => {
            let store = job_store(&redis, &job).await?;
            let Some(manifest) = store.load_manifest(&job).await? else {
                common::errln!("error: job `{job}` has no manifest (never enqueued to completion)");
                return Ok(ExitCode::from(EXIT_INPUT));
            };
            let n = if out.as_os_str() == "-" {
                crate::status::export(&store, &job, manifest.partitions, what, &mut std::io::stdout().lock()).await?
            } else {
                let file =
                    std::fs::File::create(&out).map_err(|e| anyhow::anyhow!("cannot create {}: {e}", out.display()))?;
                crate::status::export(
                    &store,
                    &job,
                    manifest.partitions,
                    what,
                    &mut std::io::BufWriter::new(file),
                )
                .await?
            };
            // Records not settled yet: cheap queue counters, not a full reconciliation.
            let mut still_open = 0;
            for p in 0..manifest.partitions {
                let q = store.queue_stats(&job, p).await?;
                still_open += q.lag + q.pending + q.delayed;
            }
            common::errln!(
                "exported {n} {} records of job {job} to {} ({still_open} records were still open)",
                what.name(),
                out.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Cancel { job, redis } => cancel_job(&job, &redis).await,
        Command::Resume { job, budget, redis } => resume(&job, budget, &redis).await,
        Command::Estimate {
            job,
            records,
            redis,
            json,
        } => {
            let store = job_store(&redis, &job).await?;
            let Some(spec) = spec_or_report(&store, &job).await else {
                return Ok(ExitCode::from(EXIT_INPUT));
            };
            match crate::estimate::estimate(&store, &job, &spec, records).await {
                Ok(e) if json => crate::outln!("{}", serde_json::to_string(&e)?),
                Ok(e) => crate::estimate::print(&e),
                Err(e) => {
                    common::errln!("error: {e}");
                    return Ok(ExitCode::from(EXIT_INPUT));
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Compare { jobs, redis, json } => {
            let [a, b] = jobs.as_slice() else {
                common::errln!("error: --job: give exactly two jobs (A, then B), not {}", jobs.len());
                return Ok(ExitCode::from(EXIT_INPUT));
            };
            let store = RedisStore::connect(&redis.url).await?;
            for job in [a, b] {
                if store.load_manifest(job).await?.is_none() {
                    common::errln!("error: --job {job}: no such job (no manifest)");
                    return Ok(ExitCode::from(EXIT_INPUT));
                }
            }
            let c = crate::compare::compare(&store, a, b).await?;
            if json {
                crate::outln!("{}", serde_json::to_string(&c)?);
            } else {
                crate::compare::print(&c);
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Retry {
            job,
            redis,
            from,
            reviewer,
            json,
        } => {
            let store = job_store(&redis, &job).await?;
            match crate::retry::retry(&store, &job, from, &reviewer).await {
                Ok(s) if json => crate::outln!("{}", serde_json::to_string(&s)?),
                Ok(s) => {
                    crate::outln!("job {job}: {} records re-queued for a new round", s.requeued);
                    for (why, n) in &s.skipped {
                        crate::outln!("  not retried: {n} ({why})");
                    }
                }
                Err(crate::review::ReviewError::Store(e)) => return Err(e.into()),
                Err(e) => {
                    common::errln!("error: {e}");
                    return Ok(ExitCode::from(EXIT_INPUT));
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Review(args) => run_review(args, cancel).await,
        Command::Console(args) => run_console(args, cancel).await,
        Command::Audit {
            job,
            redis,
            sample,
            seed,
            json,
        } => {
            let store = job_store(&redis, &job).await?;
            let Some(spec) = spec_or_report(&store, &job).await else {
                return Ok(ExitCode::from(EXIT_INPUT));
            };
            if let Some(n) = sample {
                let s = match crate::audit::sample(&store, &job, n, seed).await {
                    Ok(s) => s,
                    Err(crate::review::ReviewError::Store(e)) => return Err(e.into()),
                    Err(e) => {
                        common::errln!("error: {e}");
                        return Ok(ExitCode::from(EXIT_INPUT));
                    }
                };
                if json {
                    crate::outln!("{}", serde_json::to_string(&s)?);
                } else {
                    crate::outln!(
                        "job {job}: {} results sampled for a spot check ({} waiting, of {} done)",
                        s.sampled,
                        s.waiting,
                        s.done
                    );
                    for (why, n) in &s.skipped {
                        crate::outln!("  not sampled: {n} ({why})");
                    }
                }
                return Ok(ExitCode::SUCCESS);
            }
            let a = store.accuracy(&job, spec.job.partitions).await?;
            if json {
                crate::outln!("{}", serde_json::to_string(&a)?);
            } else {
                crate::report::print_accuracy(&a);
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Enqueue(cmd) => run_enqueue(cmd, cancel).await,
    }
}

/// The records `enqueue --from-job JOB --set` takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FromSet {
    Review,
    Dropped,
    Done,
}

async fn run_enqueue(cmd: EnqueueCmd, cancel: CancellationToken) -> anyhow::Result<ExitCode> {
    if cmd.seed.is_some() && cmd.sample.is_none() && cmd.set.is_none() {
        common::errln!("error: --seed goes with --sample N or --from-job JOB --set ...");
        return Ok(ExitCode::from(EXIT_INPUT));
    }
    if cmd.from_job.is_some() && cmd.set.is_none() && !cmd.stratify {
        common::errln!(
            "error: --from-job takes --set review|dropped|done, or goes with --sample N --seed S --stratify"
        );
        return Ok(ExitCode::from(EXIT_INPUT));
    }
    let from_job = cmd.from_job.clone().map(|job| common::manifest::FromJob {
        job,
        set: cmd.set.map(|s| {
            match s {
                FromSet::Review => "review",
                FromSet::Dropped => "dropped",
                FromSet::Done => "done",
            }
            .to_owned()
        }),
        plus_passed: cmd.plus_passed,
    });
    let sample = match (cmd.sample, &from_job) {
        (Some(size), _) => Some(Sample {
            size,
            seed: cmd.seed.unwrap_or_default(),
            stratify: cmd.stratify,
            from_job,
        }),
        (None, Some(_)) => Some(Sample {
            size: cmd.plus_passed,
            seed: cmd.seed.unwrap_or_default(),
            stratify: false,
            from_job,
        }),
        (None, None) => None,
    };
    if let Err(why) = template_fits(&cmd.spec, &cmd.dataset, &cmd.redis.url) {
        common::errln!("error: {why}");
        return Ok(ExitCode::from(EXIT_INPUT));
    }
    let args = EnqueueArgs {
        dataset: cmd.dataset,
        job: cmd.job,
        spec_path: cmd.spec.display().to_string(),
        redis_url: cmd.redis.url,
        restart: cmd.restart,
        sample,
        dry_run: cmd.dry_run,
        batch_size: cmd.batch_size as usize,
        idem_ttl_secs: cmd.idem_ttl,
        max_backlog: cmd.max_backlog,
        progress: !cmd.no_progress && !cmd.json,
        allow_evicting_redis: cmd.allow_evicting_redis,
    };
    match enqueue(&args, cancel).await {
        Ok(summary) => {
            if cmd.json {
                crate::outln!("{}", serde_json::to_string(&summary)?);
            } else {
                print_summary(&summary);
            }
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
        ) => {
            common::errln!("error: {e}");
            Ok(ExitCode::from(EXIT_INPUT))
        }
        Err(e) => Err(e.into()),
    }
}

/// `spec check SPEC --data FILE`: the template's placeholders and the id
/// field against the dataset's first records.
fn check_against_data(spec: &JobSpec, spec_path: &Path, data: &Path) -> anyhow::Result<ExitCode> {
    let c = match crate::precheck::check(spec, data) {
        Ok(c) => c,
        Err(e) => {
            common::errln!("error: --data {}: {e}", data.display());
            return Ok(ExitCode::from(EXIT_INPUT));
        }
    };
    let problems = crate::precheck::report(&c, spec, &data.display().to_string());
    for p in &problems {
        common::errln!("{p}");
    }
    if c.sampled == 0 {
        common::errln!("error: --data {}: no JSON object in its first lines", data.display());
        return Ok(ExitCode::from(EXIT_INPUT));
    }
    if !c.fatal().is_empty() {
        return Ok(ExitCode::from(EXIT_INPUT));
    }
    crate::outln!(
        "{}: ok against {} ({} records sampled; every placeholder found in most of them)",
        spec_path.display(),
        data.display(),
        c.sampled
    );
    Ok(ExitCode::SUCCESS)
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

/// `producer cancel` or `producer resume` (see [`crate::control`]).
async fn cancel_job(job: &str, redis: &RedisArgs) -> anyhow::Result<ExitCode> {
    let store = job_store(redis, job).await?;
    control_result(crate::control::cancel(&store, job).await)
}

async fn resume(job: &str, budget: Option<f64>, redis: &RedisArgs) -> anyhow::Result<ExitCode> {
    let store = job_store(redis, job).await?;
    control_result(crate::control::resume(&store, job, budget).await)
}

fn control_result(r: Result<String, crate::control::ControlError>) -> anyhow::Result<ExitCode> {
    match r {
        Ok(said) => {
            crate::outln!("{said}");
            Ok(ExitCode::SUCCESS)
        }
        Err(crate::control::ControlError::Refused(why)) => {
            common::errln!("error: {why}");
            Ok(ExitCode::from(EXIT_INPUT))
        }
        Err(crate::control::ControlError::Store(e)) => Err(e.into()),
    }
}

/// The job's spec as enqueued; prints why when there is none.
async fn spec_or_report(store: &RedisStore, job: &str) -> Option<common::spec::JobSpec> {
    match crate::review::job_spec(store, job).await {
        Ok(s) => Some(s),
        Err(e) => {
            common::errln!("error: {e}");
            None
        }
    }
}

/// `producer spec update`: replaces a job's stored spec, refusing a change
/// of versions or partitions, and records the change.
async fn update_spec(job: &str, path: &Path, redis: &RedisArgs, by: &str) -> anyhow::Result<ExitCode> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => {
            common::errln!("error: cannot read {}: {e}", path.display());
            return Ok(ExitCode::from(EXIT_INPUT));
        }
    };
    let new = match JobSpec::parse(&text, &path.display().to_string()) {
        Ok(s) => s,
        Err(e) => {
            common::errln!("error: {e}");
            return Ok(ExitCode::from(EXIT_INPUT));
        }
    };
    let store = RedisStore::connect(&redis.url).await?;
    let Some(old) = spec_or_report(&store, job).await else {
        return Ok(ExitCode::from(EXIT_INPUT));
    };
    if common::spec::versions_map(&old) != common::spec::versions_map(&new) || old.job.partitions != new.job.partitions
    {
        common::errln!(
            "error: the new spec changes the versions or partitions of job `{job}`: record ids would change. \
             Enqueue it under a new --job name instead"
        );
        return Ok(ExitCode::from(EXIT_INPUT));
    }
    let diff = common::spec::spec_diff(&old, &new);
    if diff.is_empty() {
        crate::outln!("job {job}: the spec is unchanged");
        return Ok(ExitCode::SUCCESS);
    }
    let change = serde_json::json!({"by": by, "at": common::manifest::now_rfc3339(), "changes": diff});
    // A changed cap is the operator's: set it (never below what is spent and in flight).
    let new_cap = new.budget.max_cost_usd.filter(|c| Some(*c) != old.budget.max_cost_usd);
    if let Some(cap) = new_cap {
        let b = store.budget(job).await?;
        if cap <= b.spent_usd + b.reserved_usd {
            common::errln!(
                "error: budget.max_cost_usd = {cap}: job {job} already spent {:.6} USD and has {:.6} USD in flight",
                b.spent_usd,
                b.reserved_usd
            );
            return Ok(ExitCode::from(EXIT_INPUT));
        }
    }
    store.replace_spec(job, &text, &change.to_string()).await?;
    if let Some(cap) = new_cap {
        store.set_budget_cap(job, cap, false).await?;
    }
    crate::outln!("job {job}: spec updated by {by}; workers read it when they start:");
    for d in &diff {
        crate::outln!("  {d}");
    }
    Ok(ExitCode::SUCCESS)
}

/// The variable that may hold reviewer tokens (`name:token` lines, or
/// comma-separated), never a flag: flags show in the process list.
pub const TOKENS_ENV: &str = "BATCHFLEET_CONSOLE_TOKENS";

async fn run_console(args: ConsoleArgs, cancel: CancellationToken) -> anyhow::Result<ExitCode> {
    use crate::console::auth::Reviewers;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(common::log::Stderr)
        .log_internal_errors(false)
        .try_init();
    let mut reviewers = Reviewers::default();
    if let Some(path) = &args.tokens_file {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) => {
                common::errln!("error: --tokens-file {}: {e}", path.display());
                return Ok(ExitCode::from(EXIT_INPUT));
            }
        };
        match Reviewers::parse(&text, &format!("--tokens-file {}", path.display())) {
            Ok(r) => reviewers.extend(r),
            Err(e) => {
                common::errln!("error: {e}");
                return Ok(ExitCode::from(EXIT_INPUT));
            }
        }
    }
    if let Ok(text) = std::env::var(TOKENS_ENV) {
        match Reviewers::parse(&text.replace(',', "\n"), TOKENS_ENV) {
            Ok(r) => reviewers.extend(r),
            Err(e) => {
                common::errln!("error: {e}");
                return Ok(ExitCode::from(EXIT_INPUT));
            }
        }
    }
    if let Some(h) = &args.trusted_header
        && axum::http::HeaderName::from_bytes(h.as_bytes()).is_err()
    {
        common::errln!("error: --trusted-header `{h}` is not a header name");
        return Ok(ExitCode::from(EXIT_INPUT));
    }
    let store = RedisStore::connect(&args.redis.url).await?;
    let config = crate::console::ConsoleConfig {
        bind: args.bind,
        reviewers,
        trusted_header: args.trusted_header,
    };
    match crate::console::run(config, store, cancel, None).await {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(e) => {
            common::errln!("error: {e:#}");
            Ok(ExitCode::from(EXIT_INPUT))
        }
    }
}

/// Exit code when another reviewer acted on the entry first.
pub const EXIT_LOST_RACE: u8 = 5;

async fn run_review(args: ReviewArgs, cancel: CancellationToken) -> anyhow::Result<ExitCode> {
    use crate::review::{self, ReviewError};
    let store = job_store(&args.redis, &args.job).await?;
    let job = args.job.as_str();
    let who = args.reviewer.as_str();
    let done = match args.action {
        ReviewCmd::List { reason, code, json } => review::list(&store, job, reason.as_deref(), code.as_deref())
            .await
            .map(|entries| {
                for e in &entries {
                    if json {
                        crate::outln!("{}", e.encode());
                    } else {
                        let codes: Vec<String> = e
                            .errors
                            .iter()
                            .map(|x| format!("{} {}", x.code.as_str(), x.field))
                            .collect();
                        crate::outln!(
                            "{}  {:<24} {:<24} attempts {}  {}",
                            &e.record_id[..16.min(e.record_id.len())],
                            e.key,
                            e.reason,
                            e.attempts,
                            codes.join(", ")
                        );
                    }
                }
                if !json {
                    common::errln!("{} entries in review", entries.len());
                }
            }),
        ReviewCmd::Show { id } => {
            // In the queue, else among the entries people acted on (with their actions).
            let found = match review::find(&store, job, &id).await {
                Err(ReviewError::NotFound(_)) => review::find_archived(&store, job, &id).await,
                other => other,
            };
            found.map(|(entry, _)| {
                let v: serde_json::Value = serde_json::from_str(&entry.seen).unwrap_or_default();
                crate::outln!("{}", serde_json::to_string_pretty(&v).unwrap_or(entry.seen));
            })
        }
        ReviewCmd::Accept { id, output, edit } => {
            let text = match (output, edit) {
                (Some(path), _) => std::fs::read_to_string(&path)
                    .map_err(|e| ReviewError::Io(format!("cannot read {}: {e}", path.display()))),
                (None, true) => match review::find(&store, job, &id).await {
                    Ok((entry, _)) => review::edit_in_editor(&review::editable(&entry), &std::env::temp_dir()),
                    Err(e) => Err(e),
                },
                (None, false) => Err(ReviewError::Io(
                    "give the corrected output with --output FILE or --edit".into(),
                )),
            };
            match text {
                Ok(text) => review::accept(&store, job, &id, &text, who)
                    .await
                    .map(|rid| crate::outln!("accepted {rid}")),
                Err(e) => Err(e),
            }
        }
        ReviewCmd::Revise { id, output, note } => match std::fs::read_to_string(&output) {
            Ok(text) => review::revise(&store, job, &id, &text, note.as_deref(), who)
                .await
                .map(|(rid, n, place)| crate::outln!("revised {rid}: revision {n}, {place}")),
            Err(e) => Err(ReviewError::Io(format!("cannot read {}: {e}", output.display()))),
        },
        ReviewCmd::Requeue { id, note } => review::requeue(&store, job, &id, note.as_deref(), who)
            .await
            .map(|rid| crate::outln!("requeued {rid}")),
        ReviewCmd::Reject { id, reason } => review::reject(&store, job, &id, &reason, who)
            .await
            .map(|rid| crate::outln!("rejected {rid}")),
        ReviewCmd::Next => review::next_loop(&store, job, who, &cancel).await.map(|_| ()),
        ReviewCmd::Export { out } => {
            let written = if out.as_os_str() == "-" {
                review::export_queue(&store, job, &mut std::io::stdout().lock()).await
            } else {
                match std::fs::File::create(&out) {
                    Ok(f) => {
                        let mut w = std::io::BufWriter::new(f);
                        let n = review::export_queue(&store, job, &mut w).await;
                        std::io::Write::flush(&mut w)
                            .map_err(|e| ReviewError::Io(e.to_string()))
                            .and(n)
                    }
                    Err(e) => Err(ReviewError::Io(format!("cannot create {}: {e}", out.display()))),
                }
            };
            written.map(|n| common::errln!("exported {n} review entries of job {job}"))
        }
        ReviewCmd::Import { file } => match std::fs::read_to_string(&file) {
            Err(e) => Err(ReviewError::Io(format!("cannot read {}: {e}", file.display()))),
            Ok(text) => match review::import(&store, job, &text, who).await {
                Ok(s) => {
                    crate::outln!(
                        "{} applied, {} skipped, {} lines rejected",
                        s.applied,
                        s.skipped,
                        s.rejected_lines.len()
                    );
                    for l in &s.rejected_lines {
                        common::errln!("{l}");
                    }
                    if s.rejected_lines.is_empty() {
                        Ok(())
                    } else {
                        Err(ReviewError::Io(format!(
                            "{} lines of {} changed nothing",
                            s.rejected_lines.len(),
                            file.display()
                        )))
                    }
                }
                Err(e) => Err(e),
            },
        },
    };
    Ok(match done {
        Ok(()) => ExitCode::SUCCESS,
        Err(e @ (ReviewError::Lost(_) | ReviewError::AlreadyDone(_))) => {
            common::errln!("error: {e}");
            ExitCode::from(EXIT_LOST_RACE)
        }
        Err(ReviewError::Store(e)) => return Err(e.into()),
        Err(ReviewError::Io(e)) if e.contains("Broken pipe") => ExitCode::from(crate::out::EXIT_CLOSED_PIPE),
        Err(e) => {
            common::errln!("error: {e}");
            ExitCode::from(EXIT_INPUT)
        }
    })
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

//! `producer report`, `estimate`, `compare`, `audit` and `trace`: what a
//! job cost, will cost, how it differs from another, how accurate it is,
//! and what produced one of its rows.

use std::process::ExitCode;

use clap::Args;
use common::store::RedisStore;

use super::{EXIT_INPUT, RedisArgs, job_store, print_json_or, refuse, spec_or_report};

#[derive(Debug, Args)]
pub struct ReportCmd {
    #[arg(long)]
    pub job: String,
    #[command(flatten)]
    pub redis: RedisArgs,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct EstimateCmd {
    #[arg(long)]
    pub job: String,
    /// Records of the full dataset (default: the non-blank lines of the
    /// dataset the sample was taken from).
    #[arg(long)]
    pub records: Option<u64>,
    #[command(flatten)]
    pub redis: RedisArgs,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct CompareCmd {
    /// The two jobs: A, then B.
    #[arg(long = "job", num_args = 1, required = true)]
    pub jobs: Vec<String>,
    #[command(flatten)]
    pub redis: RedisArgs,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct AuditCmd {
    #[arg(long)]
    pub job: String,
    #[command(flatten)]
    pub redis: RedisArgs,
    /// How many more results to sample.
    #[arg(long, value_name = "N")]
    pub sample: Option<u64>,
    /// Which ones: the same job and seed always give the same.
    #[arg(long, value_name = "S", default_value_t = 0, requires = "sample")]
    pub seed: u64,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct TraceCmd {
    #[arg(long)]
    pub job: String,
    /// The record: its record id (or a unique prefix of 8 or more), or its business key.
    pub record: String,
    #[command(flatten)]
    pub redis: RedisArgs,
    /// Print each kept response's bytes too.
    #[arg(long)]
    pub raw: bool,
    #[arg(long)]
    pub json: bool,
}

/// `producer trace`: a record's row back to the bytes that produced it.
/// Exits 1 when a response the trail names is missing or altered in the sink.
pub async fn trace(cmd: TraceCmd) -> anyhow::Result<ExitCode> {
    let store = job_store(&cmd.redis, &cmd.job).await?;
    let Some(spec) = spec_or_report(&store, &cmd.job).await else {
        return Ok(ExitCode::from(EXIT_INPUT));
    };
    let chain = match crate::trace::trace(&store, &spec, &cmd.job, &cmd.record, cmd.raw).await {
        Ok(chain) => chain,
        Err(crate::review::ReviewError::NotFound(_)) => {
            let flag = common::secret::redis_flag(&cmd.redis.url);
            return refuse(format!(
                "record `{}` of job `{}` has no result and no review entry (not done yet, or not in the job): \
                 `producer status --job {}{flag}` shows where its records are",
                cmd.record,
                cmd.job,
                common::suggest::shell_word(&cmd.job)
            ));
        }
        Err(e) => return Err(e.into()),
    };
    print_json_or(cmd.json, &chain, crate::trace::print)?;
    Ok(if chain.holds() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// `producer report`: failures, retries, attempts, tokens and cost.
pub async fn report(cmd: ReportCmd) -> anyhow::Result<ExitCode> {
    let store = job_store(&cmd.redis, &cmd.job).await?;
    let Some(spec) = spec_or_report(&store, &cmd.job).await else {
        return Ok(ExitCode::from(EXIT_INPUT));
    };
    let r = crate::report::report(&store, &cmd.job, &spec).await?;
    print_json_or(cmd.json, &r, crate::report::print)?;
    Ok(ExitCode::SUCCESS)
}

/// `producer estimate`: after a sample, the full dataset's cost and time.
pub async fn estimate(cmd: EstimateCmd) -> anyhow::Result<ExitCode> {
    let store = job_store(&cmd.redis, &cmd.job).await?;
    let Some(spec) = spec_or_report(&store, &cmd.job).await else {
        return Ok(ExitCode::from(EXIT_INPUT));
    };
    match crate::estimate::estimate(&store, &cmd.job, &spec, cmd.records).await {
        Ok(e) => print_json_or(cmd.json, &e, crate::estimate::print)?,
        Err(e) => return refuse(e),
    }
    Ok(ExitCode::SUCCESS)
}

/// `producer compare --job A --job B`.
pub async fn compare(cmd: CompareCmd) -> anyhow::Result<ExitCode> {
    let [a, b] = cmd.jobs.as_slice() else {
        return refuse(format_args!(
            "--job: give exactly two jobs (A, then B), not {}",
            cmd.jobs.len()
        ));
    };
    let store = RedisStore::connect(&cmd.redis.url).await?;
    for job in [a, b] {
        if store.load_manifest(job).await?.is_none() {
            return refuse(format_args!("--job {job}: no such job (no manifest)"));
        }
    }
    let c = crate::compare::compare(&store, a, b).await?;
    print_json_or(cmd.json, &c, crate::compare::print)?;
    Ok(ExitCode::SUCCESS)
}

/// `producer audit`: with `--sample N`, N more results into the audit
/// queue; without, the accuracy the verdicts so far estimate.
pub async fn audit(cmd: AuditCmd) -> anyhow::Result<ExitCode> {
    let job = cmd.job.as_str();
    let store = job_store(&cmd.redis, job).await?;
    let Some(spec) = spec_or_report(&store, job).await else {
        return Ok(ExitCode::from(EXIT_INPUT));
    };
    let Some(n) = cmd.sample else {
        let a = store.accuracy(job, spec.job.partitions).await?;
        print_json_or(cmd.json, &a, crate::report::print_accuracy)?;
        return Ok(ExitCode::SUCCESS);
    };
    let s = match crate::audit::sample(&store, job, n, cmd.seed).await {
        Ok(s) => s,
        Err(crate::review::ReviewError::Store(e)) => return Err(e.into()),
        Err(e) => return refuse(e),
    };
    print_json_or(cmd.json, &s, |s| {
        crate::outln!(
            "job {job}: {} results sampled for a spot check ({} waiting, of {} done)",
            s.sampled,
            s.waiting,
            s.done
        );
        for (why, n) in &s.skipped {
            crate::outln!("  not sampled: {n} ({why})");
        }
    })?;
    Ok(ExitCode::SUCCESS)
}

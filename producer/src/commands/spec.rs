//! `producer spec check` and `producer spec update`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Subcommand;
use common::spec::{JobSpec, system_prompt};
use common::store::RedisStore;

use super::{EXIT_INPUT, RedisArgs, refuse, spec_or_report};

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

/// Runs a `producer spec` command.
pub async fn run(cmd: SpecCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        SpecCmd::Check { spec, data } => check(&spec, data.as_deref()),
        SpecCmd::Update { job, spec, redis, by } => update(&job, &spec, &redis, &by).await,
    }
}

/// `spec check SPEC [--data FILE]`: the spec parses and validates; prints
/// the system prompt it renders.
fn check(path: &Path, data: Option<&Path>) -> anyhow::Result<ExitCode> {
    let spec = match JobSpec::load(&path.display().to_string()) {
        Ok(s) => s,
        Err(e) => return refuse(e),
    };
    if let Some(data) = data {
        return check_against_data(&spec, path, data);
    }
    crate::outln!(
        "{}: ok ({} output fields, {} partitions)",
        path.display(),
        spec.output.fields.len(),
        spec.job.partitions
    );
    match &spec.prompt.request_field {
        Some(field) => crate::outln!("each record's `{field}` is sent as the request, as the record gives it"),
        None => crate::outln!("--- system prompt ---\n{}", system_prompt(&spec)),
    }
    Ok(ExitCode::SUCCESS)
}

/// `spec check SPEC --data FILE`: the template's placeholders and the id
/// field against the dataset's first records.
fn check_against_data(spec: &JobSpec, spec_path: &Path, data: &Path) -> anyhow::Result<ExitCode> {
    let c = match crate::precheck::check(spec, data) {
        Ok(c) => c,
        Err(e) => return refuse(format_args!("--data {}: {e}", data.display())),
    };
    let problems = crate::precheck::report(&c, spec, &data.display().to_string());
    for p in &problems {
        common::errln!("{p}");
    }
    if c.sampled == 0 {
        return refuse(format_args!(
            "--data {}: no JSON object in its first lines",
            data.display()
        ));
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

/// `producer spec update`: replaces a job's stored spec, refusing a change
/// of versions or partitions, and records the change.
async fn update(job: &str, path: &Path, redis: &RedisArgs, by: &str) -> anyhow::Result<ExitCode> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => return refuse(format_args!("cannot read {}: {e}", path.display())),
    };
    let new = match JobSpec::parse(&text, &path.display().to_string()) {
        Ok(s) => s,
        Err(e) => return refuse(e),
    };
    let store = RedisStore::connect(&redis.url).await?;
    let Some(old) = spec_or_report(&store, job).await else {
        return Ok(ExitCode::from(EXIT_INPUT));
    };
    if common::spec::versions_map(&old) != common::spec::versions_map(&new) || old.job.partitions != new.job.partitions
    {
        return refuse(format_args!(
            "the new spec changes the versions or partitions of job `{job}`: record ids would change. \
             Enqueue it under a new --job name instead"
        ));
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
            return refuse(format_args!(
                "budget.max_cost_usd = {cap}: job {job} already spent {:.6} USD and has {:.6} USD in flight",
                b.spent_usd, b.reserved_usd
            ));
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

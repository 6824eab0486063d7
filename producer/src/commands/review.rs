//! `producer review`: people drain the review queue at a terminal (see
//! [`crate::review`]).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Subcommand};
use common::store::RedisStore;
use tokio_util::sync::CancellationToken;

use super::{EXIT_INPUT, EXIT_LOST_RACE, RedisArgs, job_store};
use crate::review::{self, ReviewError};

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
        /// One JSON document: `{"entries": [...], "count": N}`.
        #[arg(long, conflicts_with = "jsonl")]
        json: bool,
        /// JSON Lines: one entry per line, as the review queue encodes it.
        #[arg(long)]
        jsonl: bool,
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
    /// Each entry shown is held for this reviewer (a lease): another
    /// reviewer (here or in the console) gets the next free one.
    Next {
        /// How long an entry stays held while it is on screen; a lease
        /// nobody gives back (a closed terminal) returns the entry then.
        #[arg(long, default_value_t = 600)]
        lease_secs: u64,
    },
    /// Write the queue as JSONL with empty decision / output / note columns.
    Export {
        /// Output file (`-` for stdout).
        #[arg(long)]
        out: PathBuf,
    },
    /// Apply decisions from a JSONL file (each line checked; bad lines change nothing).
    Import { file: PathBuf },
    /// Requeue or reject every entry a filter matches. It says how many
    /// first; --dry-run shows the count and a sample and does nothing; more
    /// than 10 entries need --yes. Each one is recorded in the job's
    /// bulk-action log (`review bulk-log`).
    Bulk(BulkCmd),
    /// The job's bulk actions: when, by whom, the filter, how many.
    BulkLog {
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BulkVerb {
    Requeue,
    Reject,
}

#[derive(Debug, Args)]
pub struct BulkCmd {
    /// requeue (a new round of attempts) or reject (dropped, with --because).
    pub action: BulkVerb,
    #[command(flatten)]
    pub filter: FilterFlags,
    /// requeue: a note the model sees on the next attempts.
    #[arg(long)]
    pub note: Option<String>,
    /// reject: why (required).
    #[arg(long)]
    pub because: Option<String>,
    /// Show how many entries match and a sample; do nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Act on more than 10 entries.
    #[arg(long)]
    pub yes: bool,
    /// What it did as one JSON document.
    #[arg(long)]
    pub json: bool,
}

/// What selects review entries (`review bulk`) or done records (`rerun`).
#[derive(Debug, Args)]
pub struct FilterFlags {
    /// Entries whose reason starts with this (attempts_exhausted, refused, poison...).
    #[arg(long)]
    pub reason: Option<String>,
    /// With this validation error code (E_ENUM...); for done records, in an earlier attempt.
    #[arg(long)]
    pub code: Option<String>,
    /// With an error at this output field; for done records, in an earlier attempt.
    #[arg(long)]
    pub field: Option<String>,
    /// Whose input contains this text (case-insensitive).
    #[arg(long)]
    pub text: Option<String>,
    /// With at least / at most this many attempts.
    #[arg(long)]
    pub min_attempts: Option<u32>,
    #[arg(long)]
    pub max_attempts: Option<u32>,
    /// That came to review (done records: were committed) at or after /
    /// before this UTC time (2026-12-04T18:00:00Z).
    #[arg(long)]
    pub since: Option<String>,
    #[arg(long)]
    pub until: Option<String>,
    /// PATH=VALUE on the record's input (`$.channel=chat`); repeat for more.
    #[arg(long)]
    pub input: Vec<String>,
    /// PATH=VALUE on the last output (done records: the result's; `$.label=other`); repeat for more.
    #[arg(long)]
    pub output: Vec<String>,
}

impl FilterFlags {
    pub fn filter(&self) -> crate::filter::Filter {
        let s = |o: &Option<String>| o.clone().unwrap_or_default();
        crate::filter::Filter {
            reason: s(&self.reason),
            code: s(&self.code),
            field: s(&self.field),
            text: s(&self.text),
            min_attempts: self.min_attempts,
            max_attempts: self.max_attempts,
            since: s(&self.since),
            until: s(&self.until),
            input: self.input.clone(),
            output: self.output.clone(),
        }
    }
}

/// Runs a `producer review` action; another reviewer's earlier action on
/// the same entry exits with [`EXIT_LOST_RACE`].
pub async fn run(args: ReviewArgs, cancel: CancellationToken) -> anyhow::Result<ExitCode> {
    let store = job_store(&args.redis, &args.job).await?;
    let (job, who) = (args.job.as_str(), args.reviewer.as_str());
    let done = match args.action {
        ReviewCmd::List {
            reason,
            code,
            json,
            jsonl,
        } => {
            let form = match (json, jsonl) {
                (true, _) => Form::Json,
                (_, true) => Form::Jsonl,
                _ => Form::Text,
            };
            list(&store, job, reason.as_deref(), code.as_deref(), form).await
        }
        ReviewCmd::Show { id } => show(&store, job, &id).await,
        ReviewCmd::Accept { id, output, edit } => accept(&store, job, &id, output, edit, who).await,
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
        ReviewCmd::Next { lease_secs } => {
            let lease = std::time::Duration::from_secs(lease_secs.max(1));
            review::next_loop(&store, job, who, &cancel, lease).await.map(|_| ())
        }
        ReviewCmd::Export { out } => export(&store, job, &out).await,
        ReviewCmd::Import { file } => import(&store, job, &file, who).await,
        ReviewCmd::Bulk(cmd) => bulk(&store, &args.redis, job, cmd, who).await,
        ReviewCmd::BulkLog { json } => bulk_log(&store, job, json).await,
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

/// How `review list` prints.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Form {
    Text,
    Json,
    Jsonl,
}

/// `review list`: a line per entry (text, or JSON Lines), or one document.
async fn list(
    store: &RedisStore,
    job: &str,
    reason: Option<&str>,
    code: Option<&str>,
    form: Form,
) -> Result<(), ReviewError> {
    let entries = review::list(store, job, reason, code).await?;
    if form == Form::Json {
        let listed: Vec<serde_json::Value> = entries
            .iter()
            .map(|e| serde_json::from_str(&e.encode()).unwrap_or_default())
            .collect();
        crate::outln!("{}", serde_json::json!({ "entries": listed, "count": entries.len() }));
        return Ok(());
    }
    for e in &entries {
        if form == Form::Jsonl {
            crate::outln!("{}", e.encode());
            continue;
        }
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
    if form == Form::Text {
        common::errln!("{} entries in review", entries.len());
    }
    Ok(())
}

/// `review show ID`: in the queue, else among the entries people acted on
/// (with their actions).
async fn show(store: &RedisStore, job: &str, id: &str) -> Result<(), ReviewError> {
    let (entry, _) = match review::find(store, job, id).await {
        Err(ReviewError::NotFound(_)) => review::find_archived(store, job, id).await,
        other => other,
    }?;
    let v: serde_json::Value = serde_json::from_str(&entry.seen).unwrap_or_default();
    crate::outln!("{}", serde_json::to_string_pretty(&v).unwrap_or(entry.seen));
    Ok(())
}

/// `review accept ID --output FILE | --edit`.
async fn accept(
    store: &RedisStore,
    job: &str,
    id: &str,
    output: Option<PathBuf>,
    edit: bool,
    who: &str,
) -> Result<(), ReviewError> {
    let text = match (output, edit) {
        (Some(path), _) => std::fs::read_to_string(&path)
            .map_err(|e| ReviewError::Io(format!("cannot read {}: {e}", path.display())))?,
        (None, true) => {
            let (entry, _) = review::find(store, job, id).await?;
            review::edit_in_editor(&review::editable(&entry), &std::env::temp_dir())?
        }
        (None, false) => {
            return Err(ReviewError::Io(
                "give the corrected output with --output FILE or --edit".into(),
            ));
        }
    };
    let rid = review::accept(store, job, id, &text, who).await?;
    crate::outln!("accepted {rid}");
    Ok(())
}

/// `review export --out FILE|-`: the queue as JSONL with empty decisions.
async fn export(store: &RedisStore, job: &str, out: &Path) -> Result<(), ReviewError> {
    let n = if out.as_os_str() == "-" {
        review::export_queue(store, job, &mut std::io::stdout().lock()).await?
    } else {
        let f =
            std::fs::File::create(out).map_err(|e| ReviewError::Io(format!("cannot create {}: {e}", out.display())))?;
        let mut w = std::io::BufWriter::new(f);
        let n = review::export_queue(store, job, &mut w).await?;
        std::io::Write::flush(&mut w).map_err(|e| ReviewError::Io(e.to_string()))?;
        n
    };
    common::errln!("exported {n} review entries of job {job}");
    Ok(())
}

/// `review import FILE`: decisions applied; a line that changes nothing is
/// named and makes the command fail.
async fn import(store: &RedisStore, job: &str, file: &Path, who: &str) -> Result<(), ReviewError> {
    let text =
        std::fs::read_to_string(file).map_err(|e| ReviewError::Io(format!("cannot read {}: {e}", file.display())))?;
    let s = review::import(store, job, &text, who).await?;
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
        return Ok(());
    }
    Err(ReviewError::Io(format!(
        "{} lines of {} changed nothing",
        s.rejected_lines.len(),
        file.display()
    )))
}

/// `review bulk`: select, say how many, then act (or not).
async fn bulk(store: &RedisStore, redis: &RedisArgs, job: &str, cmd: BulkCmd, who: &str) -> Result<(), ReviewError> {
    let f = cmd.filter.filter();
    f.check().map_err(ReviewError::Refused)?;
    let action = match (cmd.action, &cmd.because) {
        (BulkVerb::Requeue, _) => crate::bulk::Bulk::Requeue { note: cmd.note.clone() },
        (BulkVerb::Reject, Some(because)) if !because.trim().is_empty() => crate::bulk::Bulk::Reject {
            reason: because.trim().to_owned(),
        },
        (BulkVerb::Reject, _) => {
            return Err(ReviewError::Refused(
                "a bulk reject needs a reason: add --because TEXT (the reviewers read it)".into(),
            ));
        }
    };
    let partitions = review::job_spec(store, job).await?.job.partitions;
    let entries = crate::filter::select(store, job, partitions, &f).await?;
    let n = entries.len();
    let verb = action.name();
    if cmd.dry_run {
        let sample: Vec<&common::task::ReviewEntry> =
            entries.iter().take(crate::filter::SAMPLE).map(|(e, _)| e).collect();
        if cmd.json {
            let sample: Vec<serde_json::Value> = sample
                .iter()
                .map(|e| serde_json::json!({"record_id": e.record_id, "key": e.key, "reason": e.reason, "attempts": e.attempts}))
                .collect();
            crate::outln!(
                "{}",
                serde_json::json!({"action": verb, "dry_run": true, "matched": n, "sample": sample})
            );
        } else {
            crate::outln!("{verb} would touch {n} review entries of job {job} (dry run: nothing done)");
            for e in sample {
                let codes: Vec<&str> = e.errors.iter().map(|x| x.code.as_str()).collect();
                crate::outln!(
                    "  {}  {:<24} {:<22} attempts {}  {}",
                    &e.record_id[..16.min(e.record_id.len())],
                    e.key,
                    e.reason,
                    e.attempts,
                    codes.join(",")
                );
            }
            if n > crate::filter::SAMPLE {
                crate::outln!("  ... and {} more", n - crate::filter::SAMPLE);
            }
        }
        return Ok(());
    }
    if n > crate::filter::CONFIRM_ABOVE && !cmd.yes {
        return Err(ReviewError::Refused(format!(
            "{verb} would touch {n} review entries of job {job}, more than {}: look first with --dry-run, \
             then run it again with --yes (producer review --job {job}{} bulk {verb} ... --yes)",
            crate::filter::CONFIRM_ABOVE,
            common::secret::redis_flag(&redis.url)
        )));
    }
    if !cmd.json {
        common::errln!("{verb}: {n} review entries of job {job} match");
    }
    let done = crate::bulk::apply(store, job, &action, &f, &entries, who).await?;
    if cmd.json {
        crate::outln!(
            "{}",
            serde_json::json!({"action": verb, "matched": done.matched, "acted": done.acted, "lost": done.lost,
                "held": done.held, "log_id": done.log_id})
        );
    } else {
        crate::outln!(
            "{verb}: {} of {} entries ({} decided by someone else meanwhile, {} left to the reviewers who have \
             them open); recorded in the bulk-action log as {}",
            done.acted,
            done.matched,
            done.lost,
            done.held,
            done.log_id
        );
    }
    Ok(())
}

/// `review bulk-log`: the job's bulk actions, oldest first.
async fn bulk_log(store: &RedisStore, job: &str, json: bool) -> Result<(), ReviewError> {
    let log = store.bulk_log(job).await?;
    let rows: Vec<serde_json::Value> = log
        .iter()
        .map(|(id, fields)| {
            let mut o = serde_json::Map::new();
            o.insert("id".into(), id.clone().into());
            for (k, v) in fields {
                let value = match k.as_str() {
                    "filter" => serde_json::from_str(v).unwrap_or_else(|_| v.clone().into()),
                    "matched" | "acted" | "lost" => v.parse::<u64>().map_or_else(|_| v.clone().into(), Into::into),
                    _ => v.clone().into(),
                };
                o.insert(k.clone(), value);
            }
            serde_json::Value::Object(o)
        })
        .collect();
    if json {
        crate::outln!("{}", serde_json::json!({ "actions": rows }));
        return Ok(());
    }
    for r in &rows {
        crate::outln!(
            "{}  {:<8} by {:<12} {} of {} entries  filter {}  {}",
            r["at"].as_str().unwrap_or(""),
            r["action"].as_str().unwrap_or(""),
            r["by"].as_str().unwrap_or(""),
            r["acted"],
            r["matched"],
            r["filter"],
            r["detail"].as_str().unwrap_or("")
        );
    }
    if rows.is_empty() {
        common::errln!("no bulk action on job {job} yet");
    }
    Ok(())
}

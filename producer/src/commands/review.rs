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

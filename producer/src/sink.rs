//! What `producer status` says of a job's sink: outcomes written and still
//! waiting in Redis, and, when asked to prove completeness, a check against
//! the sink's own data: the ids in the results table are exactly the job's
//! done records (none missing, none unknown; the primary key makes each one
//! there once).

use std::collections::{BTreeMap, HashSet};

use common::ids::RecordIds;
use common::ledger::PaidCall;
use common::sink::{AnySink, PgSink, ResultSink, Target, files};
use common::spec::{JobSpec, SinkKind};
use common::store::RedisStore;
use common::task::ResultRecord;
use serde::Serialize;

#[derive(Debug, Clone, Default, Serialize)]
pub struct SinkStatus {
    pub kind: &'static str,
    /// The results table, or the files sink's directory.
    pub table: String,
    /// Result rows the workers wrote that were new (a counter; the check
    /// below reads the table itself).
    pub written: u64,
    /// Results that left Redis once the sink held them (their records
    /// stay `done` in Redis; the result is read from the sink).
    pub left_redis: u64,
    /// Outcomes and paid calls in Redis not yet written (the sink lag).
    pub backlog: u64,
    /// From the table, with `--require-complete` / `--require-done`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verified: Option<SinkVerified>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct SinkVerified {
    /// Rows of the job in the results table.
    pub rows: u64,
    /// Done records with no row (up to 20 ids shown).
    pub missing: u64,
    pub missing_ids: Vec<String>,
    /// Rows of the job that are no done record.
    pub unknown: u64,
    pub unknown_ids: Vec<String>,
    /// Unresolved rows of the failures table, by state.
    pub open_failures: BTreeMap<String, u64>,
    /// Files: segments the manifest lists, those whose line count or
    /// sha256 differ from it, and finished ones it does not list.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub segments: Option<u64>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub damaged: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unlisted: Vec<String>,
    /// Record ids with more than one result line (files; a table's primary
    /// key rules them out).
    pub duplicates: u64,
    /// The cost ledger in the sink against the spend counters.
    pub ledger: LedgerCheck,
    /// Every done record has its row and nothing else is there, and every
    /// paid call is in the ledger once.
    pub exact: bool,
}

/// Every paid call the spend counters count is in the sink's ledger or
/// still only in Redis's, once (checked with nothing waiting for the sink).
#[derive(Debug, Clone, Default, Serialize)]
pub struct LedgerCheck {
    /// Paid calls the sink's ledger holds (each once).
    pub in_sink: u64,
    /// Paid calls only Redis holds (not handed to the sink yet, or from
    /// before the job's sink received the ledger).
    pub only_in_redis: u64,
    /// Paid calls the spend counters count.
    pub counted: u64,
    /// Counted calls in neither ledger.
    pub missing: u64,
    /// Calls in the sink's ledger beyond the count: Redis lost writes it
    /// had acknowledged (a restart with `appendfsync everysec`), so its
    /// counters (and the budget) missed calls that were paid.
    pub uncounted: u64,
    /// Files: ledger lines that repeat a call already there.
    pub duplicates: u64,
    /// No counted call missing, none twice.
    pub complete: bool,
}

impl LedgerCheck {
    async fn new(
        store: &RedisStore,
        job: &str,
        partitions: u32,
        in_sink: u64,
        duplicates: u64,
    ) -> anyhow::Result<Self> {
        let counted = store.spend(job, partitions).await?.totals.calls;
        let only_in_redis = store.ledger_unsunk(job, partitions).await?;
        let held = in_sink + only_in_redis;
        let missing = counted.saturating_sub(held);
        Ok(LedgerCheck {
            in_sink,
            only_in_redis,
            counted,
            missing,
            uncounted: held.saturating_sub(counted),
            duplicates,
            complete: missing == 0 && duplicates == 0,
        })
    }
}

/// The sink's status; None when the job has no sink. With `verify` (the
/// job's done record ids), the table is checked against them.
pub async fn sink_status(
    store: &RedisStore,
    job: &str,
    spec: &JobSpec,
    verify: Option<RecordIds>,
) -> anyhow::Result<Option<SinkStatus>> {
    let (kind, table) = match spec.sink.kind {
        SinkKind::None => return Ok(None),
        SinkKind::Postgres => ("postgres", spec.sink.table().to_owned()),
        SinkKind::Files => ("files", files_dir(spec, job)?.display().to_string()),
    };
    let partitions = spec.job.partitions;
    let sunk = store.sunk(job, partitions).await?;
    let mut s = SinkStatus {
        kind,
        table,
        written: sunk.written,
        left_redis: sunk.done,
        backlog: store.sink_backlog(job, partitions).await?.unwrap_or(0),
        verified: None,
    };
    if let Some(done) = verify {
        let sink = open(
            spec,
            job,
            &format!("job `{job}` writes to {}", place(spec, job)),
            "to check the sink",
        )
        .await?;
        let held = sink.holdings(job).await?;
        let mut v = SinkVerified {
            rows: held.result_ids.len() as u64,
            open_failures: held.open_failures,
            segments: held.segments,
            damaged: held.damaged,
            unlisted: held.unlisted,
            ..SinkVerified::default()
        };
        v.ledger = LedgerCheck::new(store, job, partitions, held.ledger_calls, held.ledger_duplicates).await?;
        compare(&done, &held.result_ids, &mut v)?;
        v.exact = v.exact && v.duplicates == 0 && v.damaged.is_empty() && v.unlisted.is_empty() && v.ledger.complete;
        s.verified = Some(v);
    }
    Ok(Some(s))
}

/// The files sink's directory of a job.
fn files_dir(spec: &JobSpec, job: &str) -> anyhow::Result<std::path::PathBuf> {
    Ok(files::job_dir(
        std::path::Path::new(spec.sink.dir.as_deref().unwrap_or_default()),
        job,
    )?)
}

/// The done records against the sink's ids, a bucket of ids at a time:
/// what each lacks, and the sink's repeats.
fn compare(done: &RecordIds, rows: &RecordIds, v: &mut SinkVerified) -> anyhow::Result<()> {
    let (mut missing, mut unknown) = (0, 0);
    let (_, repeats) = done
        .compare(
            rows,
            |id| {
                missing += 1;
                if v.missing_ids.len() < 20 {
                    v.missing_ids.push(id);
                }
            },
            |id| {
                unknown += 1;
                if v.unknown_ids.len() < 20 {
                    v.unknown_ids.push(id);
                }
            },
        )
        .map_err(|e| {
            anyhow::anyhow!(
                "cannot read back the record ids spilled in {}: {e} (set TMPDIR to a writable directory)",
                std::env::temp_dir().display()
            )
        })?;
    v.duplicates = repeats;
    v.missing = missing;
    v.unknown = unknown;
    v.exact = missing == 0 && unknown == 0;
    Ok(())
}

/// Every done result of a job, each once: those still in Redis, then those
/// only the sink holds (a job with a sink: a result leaves Redis once the
/// sink has it). A result moving meanwhile is read in Redis and skipped in
/// the sink. Reading the sink needs its URL (`sink.url_env`); without it,
/// and with results only there, the error says where they are.
pub async fn each_result(
    store: &RedisStore,
    job: &str,
    spec: Option<&JobSpec>,
    partitions: u32,
    mut f: impl FnMut(ResultRecord),
) -> anyhow::Result<()> {
    let sink = spec.filter(|s| s.sink.kind != SinkKind::None);
    let mut seen = HashSet::new();
    for p in 0..partitions {
        store
            .results(job, p, |r| {
                if sink.is_some() {
                    seen.insert(r.record_id.clone());
                }
                f(r)
            })
            .await?;
    }
    let Some(spec) = sink else { return Ok(()) };
    let left = store.sunk(job, partitions).await?.done;
    if left == 0 {
        return Ok(());
    }
    let context = format!("{left} results of job `{job}` are only in {}", place(spec, job));
    let sink = open(spec, job, &context, "to read them").await?;
    sink.results(job, |r| {
        if !seen.contains(&r.record_id) {
            f(r)
        }
    })
    .await
    .map_err(|e| anyhow::anyhow!("{context}: {e}"))?;
    Ok(())
}

/// Every paid call of a job's cost ledger, each once: those still in
/// Redis, then those only the sink holds (a job with a sink: a call leaves
/// Redis a while after the sink has it). Reading the sink needs its URL, as
/// for [`each_result`].
pub async fn each_paid_call(
    store: &RedisStore,
    job: &str,
    spec: Option<&JobSpec>,
    partitions: u32,
    mut f: impl FnMut(PaidCall),
) -> anyhow::Result<()> {
    // A call on the standard route was sent to the job's own model.
    let model = spec.map(|s| s.provider.model.clone()).unwrap_or_default();
    let mut f = move |mut c: PaidCall| {
        if c.model.is_empty() && c.tier == common::route::Tier::Standard.name() {
            c.model.clone_from(&model);
        }
        f(c)
    };
    let sink = spec.filter(|s| s.sink.kind != SinkKind::None);
    let mut seen = HashSet::new();
    for p in 0..partitions {
        store
            .ledger_entries(job, p, |c| {
                if sink.is_some() {
                    seen.insert(c.key());
                }
                f(c)
            })
            .await?;
    }
    let Some(spec) = sink else { return Ok(()) };
    if seen.len() as u64 >= store.spend(job, partitions).await?.totals.calls {
        return Ok(()); // every call is still in Redis
    }
    let unseen = |c: PaidCall| {
        if !seen.contains(&c.key()) {
            f(c)
        }
    };
    let context = format!("the cost ledger of job `{job}` is in {}", place(spec, job));
    let sink = open(spec, job, &context, "to read it").await?;
    sink.ledger(job, unseen)
        .await
        .map_err(|e| anyhow::anyhow!("{context}: {e}"))?;
    Ok(())
}

/// Where the job's sink keeps its rows, in words.
fn place(spec: &JobSpec, job: &str) -> String {
    match spec.sink.kind {
        SinkKind::Files => format!(
            "the files sink ({})",
            files_dir(spec, job).map_or_else(
                |_| spec.sink.dir.clone().unwrap_or_default(),
                |d| d.display().to_string()
            )
        ),
        _ => format!("PostgreSQL, table {}", spec.sink.table()),
    }
}

/// The job's sink, opened to be read: the directory `sink.dir`, or the
/// database at the URL in the variable `sink.url_env` names (without it,
/// the error says what it is needed for: `<context>: set DATABASE_URL
/// (sink.url_env) to the database URL <why>`).
pub async fn open(spec: &JobSpec, job: &str, context: &str, why: &str) -> anyhow::Result<AnySink> {
    let target = match spec.sink.kind {
        SinkKind::Files => Target::Files(spec.sink.dir.clone().unwrap_or_default().into()),
        _ => Target::Postgres(database_url(spec, context, why)?),
    };
    Ok(AnySink::reader(&target, job, spec).await?)
}

pub(crate) fn database_url(spec: &JobSpec, context: &str, why: &str) -> anyhow::Result<String> {
    let var = spec.sink.url_env.as_deref().unwrap_or_default();
    let url = std::env::var(var).unwrap_or_default();
    if url.is_empty() {
        anyhow::bail!("{context}: set {var} (sink.url_env) to the database URL {why}");
    }
    Ok(url)
}

/// The job's PostgreSQL sink, at the URL in the variable `sink.url_env`
/// names; without it, the error says what it is needed for
/// (`<context>: set DATABASE_URL (sink.url_env) to the database URL <why>`).
pub async fn connect(spec: &JobSpec, context: &str, why: &str) -> anyhow::Result<PgSink> {
    Ok(PgSink::connect(&database_url(spec, context, why)?, spec).await?)
}

/// The human lines of a sink status.
pub fn print(s: &SinkStatus) {
    crate::outln!(
        "  sink         {} {} {}: {} written, {} outcomes and paid calls waiting in Redis, {} results only in the sink",
        s.kind,
        if s.kind == "files" { "dir" } else { "table" },
        s.table,
        s.written,
        s.backlog,
        s.left_redis
    );
    if let Some(v) = &s.verified {
        crate::outln!(
            "    checked    {} rows: {} done records missing, {} unknown rows{}{}",
            v.rows,
            v.missing,
            v.unknown,
            match v.segments {
                Some(n) => format!(", {} duplicated, {n} segments", v.duplicates),
                None => String::new(),
            },
            if v.exact { " (exact)" } else { "" }
        );
        for file in &v.damaged {
            crate::outln!("      damaged  {file} (its lines or sha256 differ from manifest.json)");
        }
        for file in &v.unlisted {
            crate::outln!("      unlisted {file} (not in manifest.json)");
        }
        for id in &v.missing_ids {
            crate::outln!("      missing {id}");
        }
        for id in &v.unknown_ids {
            crate::outln!("      unknown {id}");
        }
        for (state, n) in &v.open_failures {
            crate::outln!("    failures   {state} {n}");
        }
        let l = &v.ledger;
        crate::outln!(
            "    ledger     {} paid calls in the sink + {} only in Redis, {} counted: {} missing, {} duplicated{}",
            l.in_sink,
            l.only_in_redis,
            l.counted,
            l.missing,
            l.duplicates,
            if l.uncounted > 0 {
                format!(
                    ", {} paid calls the counters lack (Redis lost acknowledged writes)",
                    l.uncounted
                )
            } else {
                String::new()
            }
        );
    }
}

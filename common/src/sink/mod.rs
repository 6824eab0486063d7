//! The result sinks: where a job's done records (and its failures and paid
//! calls) go once Redis is through with them, each exactly once.
//!
//! [`ResultSink`] is the one seam: the worker's sink writer moves a
//! partition's sink stream into any sink through it, and the producer's
//! checks read any sink back through it. Three implement it and pass the
//! same conformance suite (`tests/tests/sink_conformance.rs`: the same
//! batch stored again, a crash between the write and the acknowledgement,
//! the destination checked at open, reconciliation counts):
//!
//! - [`pg::PgSink`]: PostgreSQL tables, one transaction per batch;
//! - [`files::FileSink`]: JSONL segments in a directory, renamed into place whole;
//! - [`memory::MemorySink`]: rows kept in memory, for in-process tests.
//!
//! [`AnySink`] is the one place a sink is chosen by the kind its job's spec
//! names ([`Target`]); it implements the trait by handing each call on.
//!
//! A dry run has no sink: its results stay in Redis and no writer runs.
//!
//! The arrows point one way: the sinks know the rows ([`rows`]), the spec
//! and the manifest, never the store; the store reads and acknowledges
//! what they hold through the same row types.

mod any;
pub mod files;
pub mod memory;
pub mod pg;
pub mod raw;
mod rows;

use std::collections::BTreeMap;
use std::future::Future;

pub use any::{AnySink, Target};
pub use files::FileSink;
pub use memory::{Memory, MemorySink};
pub use pg::{PgSink, TypedColumn, db_passwords, ddl, typed_columns, typed_ddl};
pub use raw::{RawStore, sha256_hex};
pub use rows::{
    FailureRow, ResultRow, RevisionRow, SinkBatch, SinkEntry, SinkError, SunkResult, Tokens, with_revisions,
};

use crate::ledger::PaidCall;
use crate::manifest::Manifest;
use crate::spec::JobSpec;
use crate::task::ResultRecord;

/// A batch the sink holds durably whose sink stream entries are not
/// acknowledged in Redis yet.
#[derive(Debug, Clone, Copy)]
pub struct Durable<'a> {
    /// The sink stream entries it holds (or skipped as already there).
    pub entries: &'a [SinkEntry],
    /// The results it holds: they leave Redis at the acknowledgement.
    pub sunk: &'a [SunkResult],
    /// The keys of the paid calls it holds.
    pub paid: &'a [String],
    /// Result rows that were new.
    pub written: u64,
    /// Left by a writer that stopped before acknowledging it, and found by
    /// the one that took its partition over (its rows are not counted as
    /// written again).
    pub recovered: bool,
}

/// A durable batch awaiting its acknowledgement, as a sink whose every
/// store is durable at once keeps it (PostgreSQL, memory).
#[derive(Debug, Clone, Default)]
pub struct Unacked {
    entries: Vec<SinkEntry>,
    sunk: Vec<SunkResult>,
    paid: Vec<String>,
    written: u64,
}

impl Unacked {
    /// Adds a stored batch: its entries, the results it holds (those
    /// refused stay in Redis) and its paid calls.
    fn add(&mut self, entries: &[SinkEntry], batch: &SinkBatch, refused: &[(String, String)], written: u64) {
        self.entries.extend_from_slice(entries);
        self.sunk.extend(
            batch
                .sunk
                .iter()
                .filter(|s| !refused.iter().any(|(rid, _)| *rid == s.rid))
                .cloned(),
        );
        self.paid.extend(batch.paid.iter().map(PaidCall::key));
        self.written += written;
    }

    fn durable(&self) -> Durable<'_> {
        Durable {
            entries: &self.entries,
            sunk: &self.sunk,
            paid: &self.paid,
            written: self.written,
            recovered: false,
        }
    }
}

/// What a sink holds of a job, read back for reconciliation.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Holdings {
    /// Every record id with a result (a record there twice is listed
    /// twice; a table's primary key rules that out), spilled to disk past a
    /// few megabytes.
    #[serde(skip)]
    pub result_ids: crate::ids::RecordIds,
    /// Unresolved failures by state (`review`, `dropped`, `cancelled`,
    /// `rejected`): a record's last failure, unless it has a result.
    pub open_failures: BTreeMap<String, u64>,
    /// Paid calls in the sink's ledger (each once), and entries that
    /// repeat a call already there.
    pub ledger_calls: u64,
    pub ledger_duplicates: u64,
    /// Files: segments the manifest lists, listed ones whose line count or
    /// sha256 differ (or that are gone), finished ones it does not list.
    pub segments: Option<u64>,
    pub damaged: Vec<String>,
    pub unlisted: Vec<String>,
}

/// A job's result sink, as one writer (or one reader) sees it.
///
/// Writing a partition's batch: [`take`](Self::take) the partition,
/// [`store`](Self::store) the batch, [`seal`](Self::seal) it, then
/// acknowledge what [`durable`](Self::durable) returns in Redis and tell
/// the sink ([`acknowledged`](Self::acknowledged)). A writer may die
/// between any two steps: what was stored and not acknowledged is stored
/// again (Redis hands the entries over again, or the next writer finds the
/// durable batch), and adds nothing the second time.
pub trait ResultSink: Send + Sync + Sized + 'static {
    /// What the sink is opened on: a database URL, a directory, a memory.
    type Target: Clone + Send + Sync + 'static;

    /// Opens the sink of `job`, creating its tables or directory when
    /// absent and checking them when present (a table lacking a column is a
    /// [`SinkError::Schema`] naming it and the statement that adds it).
    fn open(target: &Self::Target, job: &str, spec: &JobSpec) -> impl Future<Output = Result<Self, SinkError>> + Send;

    /// `postgres`, `files` or `memory`.
    fn kind(&self) -> &'static str;

    /// Whether the sink must be opened again (its connection is gone).
    fn is_closed(&self) -> bool {
        false
    }

    /// Whether a writer holds each partition alone, keeping stored batches
    /// open across rounds (the files sink's segments). It then takes over
    /// whatever any writer left pending in the partition's stream
    /// ([`take_over`](Self::take_over)); otherwise writers share the
    /// partitions through the consumer group.
    fn holds_partitions(&self) -> bool {
        false
    }

    /// Takes partition `p` for this writer: false while another holds it.
    fn take(&mut self, _p: u32) -> Result<bool, SinkError> {
        Ok(true)
    }

    /// A partition held alone: the stream cursor from which entries pending
    /// in Redis that the sink does not hold are taken over (None: none
    /// left to look for).
    fn take_over(&mut self, _p: u32) -> Option<String> {
        None
    }

    /// Where the take-over goes on from (None: done).
    fn taken_over(&mut self, _p: u32, _next: Option<String>) {}

    /// Lets go of a partition after a failure: what was stored and is not
    /// durable is dropped (its entries are still pending in Redis and are
    /// stored again by whoever takes the partition next).
    fn release(&mut self, _p: u32) {}

    /// Stores one batch of partition `p`: the rows Redis holds for
    /// `entries`. Each result and each paid call is held once however often
    /// it comes; a failure is open until the record has a result. Returns
    /// the records the sink refused, each with its message (they go back to
    /// review); the rest of the batch is stored.
    fn store(
        &mut self,
        job: &str,
        p: u32,
        entries: &[SinkEntry],
        batch: &SinkBatch,
    ) -> impl Future<Output = Result<Vec<(String, String)>, SinkError>> + Send;

    /// Makes what the partition stored durable when it is due, or at once
    /// with `now` (the files sink finishes its open segment); a sink whose
    /// every store is durable has nothing to do.
    fn seal(&mut self, _p: u32, _now: bool) -> Result<(), SinkError> {
        Ok(())
    }

    /// The partition's durable batch whose entries are not acknowledged yet.
    fn durable(&self, p: u32) -> Option<Durable<'_>>;

    /// The durable batch of `p` is acknowledged in Redis: the sink forgets it.
    fn acknowledged(&mut self, p: u32) -> Result<(), SinkError>;

    /// Keeps the job's own row (what it expects) as its manifest says.
    fn write_job(&self, manifest: &Manifest) -> impl Future<Output = Result<(), SinkError>> + Send;

    /// What the sink holds of `job`.
    fn holdings(&self, job: &str) -> impl Future<Output = Result<Holdings, SinkError>> + Send;

    /// Every result of `job` the sink holds, as written with its revisions
    /// applied, one at a time. Returns how many.
    fn results(&self, job: &str, f: impl FnMut(ResultRecord)) -> impl Future<Output = Result<u64, SinkError>>;

    /// Every paid call of `job` in the sink's ledger, each once.
    fn ledger(&self, job: &str, f: impl FnMut(PaidCall)) -> impl Future<Output = Result<u64, SinkError>>;
}

/// Runs file work off the async threads when the runtime has others.
pub(crate) fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

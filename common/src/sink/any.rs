//! The sink a job's spec names, whichever it is: the one place a sink is
//! chosen by its kind. Everything else (the worker's writer, the
//! producer's checks and reads) goes through [`ResultSink`].

use std::path::PathBuf;

use super::memory::Memory;
use super::{Durable, FileSink, Holdings, MemorySink, PgSink, ResultSink, SinkBatch, SinkEntry, SinkError};
use crate::ledger::PaidCall;
use crate::manifest::Manifest;
use crate::spec::JobSpec;
use crate::task::ResultRecord;

/// Where a job's results go after Redis.
#[derive(Debug, Clone)]
pub enum Target {
    /// The database URL (from the variable `sink.url_env` names).
    Postgres(String),
    /// `sink.dir`.
    Files(PathBuf),
    /// Rows kept in memory (in-process tests).
    Memory(Memory),
}

/// An open sink of any kind.
#[allow(clippy::large_enum_variant)] // one per writer lane: a few per worker
pub enum AnySink {
    Postgres(PgSink),
    Files(FileSink),
    Memory(MemorySink),
}

/// `$body` with `$s` bound to the sink, whatever its kind.
macro_rules! each {
    ($sink:expr, $s:ident => $body:expr) => {
        match $sink {
            AnySink::Postgres($s) => $body,
            AnySink::Files($s) => $body,
            AnySink::Memory($s) => $body,
        }
    };
}

impl AnySink {
    /// The sink to read only: a files sink's directories are not created
    /// (a job that never wrote reads as empty); the others as [`ResultSink::open`].
    pub async fn reader(target: &Target, job: &str, spec: &JobSpec) -> Result<AnySink, SinkError> {
        match target {
            Target::Files(dir) => Ok(AnySink::Files(FileSink::reader(dir, job, spec.sink.segment_limits())?)),
            other => AnySink::open(other, job, spec).await,
        }
    }
}

impl ResultSink for AnySink {
    type Target = Target;

    async fn open(target: &Target, job: &str, spec: &JobSpec) -> Result<AnySink, SinkError> {
        Ok(match target {
            Target::Postgres(url) => AnySink::Postgres(PgSink::open(url, job, spec).await?),
            Target::Files(dir) => AnySink::Files(<FileSink as ResultSink>::open(dir, job, spec).await?),
            Target::Memory(memory) => AnySink::Memory(MemorySink::open(memory, job, spec).await?),
        })
    }

    fn kind(&self) -> &'static str {
        each!(self, s => s.kind())
    }

    fn is_closed(&self) -> bool {
        each!(self, s => ResultSink::is_closed(s))
    }

    fn holds_partitions(&self) -> bool {
        each!(self, s => s.holds_partitions())
    }

    fn take(&mut self, p: u32) -> Result<bool, SinkError> {
        each!(self, s => ResultSink::take(s, p))
    }

    fn take_over(&mut self, p: u32) -> Option<String> {
        each!(self, s => s.take_over(p))
    }

    fn taken_over(&mut self, p: u32, next: Option<String>) {
        each!(self, s => s.taken_over(p, next))
    }

    fn release(&mut self, p: u32) {
        each!(self, s => ResultSink::release(s, p))
    }

    async fn store(
        &mut self,
        job: &str,
        p: u32,
        entries: &[SinkEntry],
        batch: &SinkBatch,
    ) -> Result<Vec<(String, String)>, SinkError> {
        each!(self, s => s.store(job, p, entries, batch).await)
    }

    fn seal(&mut self, p: u32, now: bool) -> Result<(), SinkError> {
        each!(self, s => s.seal(p, now))
    }

    fn durable(&self, p: u32) -> Option<Durable<'_>> {
        each!(self, s => s.durable(p))
    }

    fn acknowledged(&mut self, p: u32) -> Result<(), SinkError> {
        each!(self, s => ResultSink::acknowledged(s, p))
    }

    async fn write_job(&self, manifest: &Manifest) -> Result<(), SinkError> {
        each!(self, s => ResultSink::write_job(s, manifest).await)
    }

    async fn holdings(&self, job: &str) -> Result<Holdings, SinkError> {
        each!(self, s => s.holdings(job).await)
    }

    async fn results(&self, job: &str, f: impl FnMut(ResultRecord)) -> Result<u64, SinkError> {
        each!(self, s => ResultSink::results(s, job, f).await)
    }

    async fn ledger(&self, job: &str, f: impl FnMut(PaidCall)) -> Result<u64, SinkError> {
        each!(self, s => ResultSink::ledger(s, job, f).await)
    }
}

//! A sink that keeps its rows in memory, shared by every writer opened on
//! the same [`Memory`]: the database of in-process tests. It keeps the
//! promises of the others (each result and paid call once, a failure open
//! until its record has a result, a stored batch durable until it is
//! acknowledged) and passes the same conformance suite.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{Durable, FailureRow, Holdings, ResultRow, ResultSink, SinkBatch, SinkEntry, SinkError, Unacked};
use crate::ledger::PaidCall;
use crate::manifest::Manifest;
use crate::spec::JobSpec;
use crate::task::ResultRecord;

/// The rows of every job, shared by the sinks opened on it.
#[derive(Debug, Clone, Default)]
pub struct Memory(Arc<Mutex<HashMap<String, JobRows>>>);

/// One job's rows.
#[derive(Debug, Clone, Default)]
struct JobRows {
    results: BTreeMap<String, ResultRow>,
    /// Each record's last failure.
    failures: HashMap<String, FailureRow>,
    ledger: BTreeMap<String, PaidCall>,
    expected_records: Option<u64>,
    /// Raw responses by sha256 (see [`super::raw`]).
    raw: HashMap<String, Vec<u8>>,
}

impl Memory {
    fn rows(&self) -> MutexGuard<'_, HashMap<String, JobRows>> {
        // A test that panicked while holding it poisons nothing we rely on.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The records the job expects, as its manifest last said.
    pub fn expected_records(&self, job: &str) -> Option<u64> {
        self.rows().get(job)?.expected_records
    }

    pub(super) fn keep_raw(&self, job: &str, sha: &str, bytes: &[u8]) {
        let mut all = self.rows();
        let rows = all.entry(job.to_owned()).or_default();
        rows.raw.entry(sha.to_owned()).or_insert_with(|| bytes.to_vec());
    }

    pub(super) fn raw(&self, job: &str, sha: &str) -> Option<Vec<u8>> {
        self.rows().get(job)?.raw.get(sha).cloned()
    }
}

/// One writer's (or reader's) view of a [`Memory`].
pub struct MemorySink {
    memory: Memory,
    unacked: HashMap<u32, Unacked>,
}

impl MemorySink {
    pub fn new(memory: &Memory) -> MemorySink {
        MemorySink {
            memory: memory.clone(),
            unacked: HashMap::new(),
        }
    }
}

impl ResultSink for MemorySink {
    type Target = Memory;

    async fn open(memory: &Memory, _job: &str, _spec: &JobSpec) -> Result<MemorySink, SinkError> {
        Ok(MemorySink::new(memory))
    }

    fn kind(&self) -> &'static str {
        "memory"
    }

    async fn store(
        &mut self,
        job: &str,
        p: u32,
        entries: &[SinkEntry],
        batch: &SinkBatch,
    ) -> Result<Vec<(String, String)>, SinkError> {
        let mut written = 0;
        {
            let mut all = self.memory.rows();
            let rows = all.entry(job.to_owned()).or_default();
            for f in &batch.failures {
                if !rows.results.contains_key(&f.record_id) {
                    rows.failures.insert(f.record_id.clone(), f.clone());
                }
            }
            for r in &batch.results {
                if !rows.results.contains_key(&r.record_id) {
                    rows.results.insert(r.record_id.clone(), r.clone());
                    written += 1;
                }
            }
            for call in &batch.paid {
                rows.ledger.entry(call.key()).or_insert_with(|| call.clone());
            }
        }
        self.unacked.entry(p).or_default().add(entries, batch, &[], written);
        Ok(Vec::new())
    }

    fn durable(&self, p: u32) -> Option<Durable<'_>> {
        self.unacked.get(&p).map(Unacked::durable)
    }

    fn acknowledged(&mut self, p: u32) -> Result<(), SinkError> {
        self.unacked.remove(&p);
        Ok(())
    }

    async fn write_job(&self, manifest: &Manifest) -> Result<(), SinkError> {
        let mut all = self.memory.rows();
        all.entry(manifest.job.clone()).or_default().expected_records = Some(manifest.expected_records);
        Ok(())
    }

    async fn holdings(&self, job: &str) -> Result<Holdings, SinkError> {
        let all = self.memory.rows();
        let Some(rows) = all.get(job) else {
            return Ok(Holdings::default());
        };
        let mut open_failures = BTreeMap::new();
        for f in rows
            .failures
            .values()
            .filter(|f| !rows.results.contains_key(&f.record_id))
        {
            *open_failures.entry(f.state.clone()).or_default() += 1;
        }
        Ok(Holdings {
            result_ids: rows.results.keys().map(String::as_str).collect(),
            open_failures,
            ledger_calls: rows.ledger.len() as u64,
            ..Holdings::default()
        })
    }

    async fn results(&self, job: &str, mut f: impl FnMut(ResultRecord)) -> Result<u64, SinkError> {
        let rows: Vec<ResultRow> = self
            .memory
            .rows()
            .get(job)
            .map(|r| r.results.values().cloned().collect())
            .unwrap_or_default();
        let n = rows.len() as u64;
        rows.into_iter().for_each(|r| f(r.into_record()));
        Ok(n)
    }

    async fn ledger(&self, job: &str, mut f: impl FnMut(PaidCall)) -> Result<u64, SinkError> {
        let calls: Vec<PaidCall> = self
            .memory
            .rows()
            .get(job)
            .map(|r| r.ledger.values().cloned().collect())
            .unwrap_or_default();
        let n = calls.len() as u64;
        calls.into_iter().for_each(&mut f);
        Ok(n)
    }
}

//! The sink writer: moves a job's outcomes and paid calls from its
//! partitions' sink streams into PostgreSQL in batches, one transaction
//! each, and acknowledges a batch only after its transaction committed. Every worker runs one per job with
//! a sink; they share the streams through a consumer group, and a batch whose
//! writer died mid-transaction (rolled back by the database) is claimed over
//! once pending longer than the visibility timeout, and written again:
//! `ON CONFLICT (record_id) DO NOTHING` makes the second write add nothing.
//! The acknowledgement also takes the written results out of Redis: from
//! then on the sink is where a done record's result is read. A paid call
//! leaves the ledger hash a while later ([`SinkWriter::hold`]): until then
//! the same call stored again (a retried store call, a call recorded again
//! as lost) is still known there and counted once.
//!
//! The files sink takes the same path into JSONL segments: a writer holds
//! each of its partitions alone (a lock file), appends batches to the
//! partition's open segment and acknowledges them when the segment is
//! finished (renamed into place); see `common::sink::files`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use std::collections::HashMap;

use common::sink::{AnySink, ResultSink, SinkBatch, SinkEntry, SinkError, SunkResult};
use common::task::{ResultRecord, ReviewEntry};

use crate::fleet::Fleet;
use crate::job::JobCtx;
use crate::service::Service;

/// The wait between rounds when every stream is empty.
const IDLE: Duration = Duration::from_millis(200);
/// The longest wait between attempts while the database fails.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// How often the backlog is compared with `sink.max_backlog` (also while
/// the database fails: a backing-off writer still stops the claims).
const BACKLOG_CHECK: Duration = Duration::from_millis(250);

/// Sink stream entries acknowledged per call.
const ACK_CHUNK: usize = 1000;
/// How often an idle writer lets the paid calls whose time has come leave
/// its partitions' ledger hashes (a busy one does with every acknowledgement).
const LEDGER_TRIM: Duration = Duration::from_secs(30);

pub struct SinkWriter<S: ResultSink> {
    fleet: Arc<Fleet>,
    job: Arc<JobCtx>,
    target: S::Target,
    /// This writer's share of the partitions: those with `p % lanes == lane`.
    lane: u32,
    lanes: u32,
    sink: Option<S>,
    /// Entries taken and not stored yet (Redis failed reading what they
    /// name, or the sink failed storing them), by partition: stored first.
    held: HashMap<u32, Vec<SinkEntry>>,
    /// Chunks of a partition's durable batch already acknowledged.
    acked_chunks: HashMap<u32, usize>,
    /// A sink that holds its partitions alone: those whose last round
    /// failed, with when the next try is due and the back-off (the others
    /// go on meanwhile).
    part_wait: HashMap<u32, (Instant, Duration)>,
    /// Make every stored batch durable now (the worker is leaving).
    flushing: bool,
    /// Fault injection for tests (`BATCHFLEET_FAULT=sink_exit_after_rename`):
    /// the process exits at once after its first batch is durable (a
    /// segment renamed into place, a transaction committed) and before it
    /// is acknowledged, as if killed there.
    exit_after_rename: bool,
    backoff: Duration,
    /// The first error of the current failure, for logging it once at ERROR.
    failing: Option<(SinkError, Instant)>,
    /// This consumer's own pending entries are read first (a batch it read
    /// before it was stopped or restarted and never acknowledged).
    own_pending_read: bool,
    /// When entries a dead writer left pending were last looked for.
    stale_checked: Option<Instant>,
    /// When the backlog was last compared with `sink.max_backlog`.
    backlog_checked: Option<Instant>,
    /// While failing: when the next attempt is due (the back-off).
    next_attempt: Option<Instant>,
    /// The manifest's `updated_at` last written into the jobs table, and
    /// when the manifest was last read (lane 0 keeps the job's row).
    job_row: (Option<String>, Option<Instant>),
    /// When the ledger hashes were last trimmed while idle (None: not yet).
    ledger_trimmed: Option<Instant>,
}

/// How often lane 0 reads the job's manifest for the jobs table.
const JOB_ROW_CHECK: Duration = Duration::from_secs(5);

impl SinkWriter<AnySink> {
    /// The writers of a job for one worker, one per lane (`sink.writers`);
    /// none for a job without a sink.
    pub fn for_job(fleet: &Arc<Fleet>, job: &Arc<JobCtx>) -> Vec<SinkWriter<AnySink>> {
        let Some(target) = &job.sink else { return Vec::new() };
        let lanes = job.spec.sink.writers(job.spec.job.partitions);
        (0..lanes)
            .map(|lane| SinkWriter::new(fleet.clone(), job.clone(), target.clone(), lane, lanes))
            .collect()
    }
}

impl<S: ResultSink> SinkWriter<S> {
    pub fn new(fleet: Arc<Fleet>, job: Arc<JobCtx>, target: S::Target, lane: u32, lanes: u32) -> SinkWriter<S> {
        SinkWriter {
            fleet,
            job,
            target,
            lane,
            lanes,
            sink: None,
            held: HashMap::new(),
            acked_chunks: HashMap::new(),
            part_wait: HashMap::new(),
            flushing: false,
            exit_after_rename: std::env::var("BATCHFLEET_FAULT").as_deref() == Ok("sink_exit_after_rename"),
            backoff: Duration::from_millis(200),
            failing: None,
            own_pending_read: false,
            backlog_checked: None,
            stale_checked: None,
            next_attempt: None,
            job_row: (None, None),
            ledger_trimmed: None,
        }
    }

    /// How long a paid call the sink holds stays in the ledger hash: twice
    /// the visibility timeout, past the longest a worker keeps storing an
    /// outcome again (a second before the visibility timeout) with room for
    /// a call recorded as lost right after.
    fn hold(&self) -> Duration {
        self.fleet.visibility * 2
    }

    /// While idle, every [`LEDGER_TRIM`]: the paid calls of this writer's
    /// partitions whose time in the ledger hash is over leave it.
    async fn trim_ledger(&mut self) {
        if self.ledger_trimmed.is_some_and(|t| t.elapsed() < LEDGER_TRIM) {
            return;
        }
        self.ledger_trimmed = Some(Instant::now());
        let (f, hold) = (self.fleet.clone(), self.hold());
        let (lane, lanes) = (self.lane, self.lanes);
        for p in (0..self.job.spec.job.partitions).filter(|p| p % lanes == lane) {
            if let Err(e) = f.store.ledger_trim(&self.job.name, p, hold).await {
                f.store_error(&e).await;
                return;
            }
        }
    }

    /// At the end of a flush (the worker leaves): the ledgers of this
    /// writer's partitions, once the sink holds every call in them, are
    /// left to expire when their last call's hold ends. A drained fleet
    /// never comes back to trim them, and a finished job keeps in Redis only
    /// its records' small state entries; a call recorded later (a
    /// re-enqueue, another worker) makes the ledger persist again.
    async fn leave_ledger(&mut self) {
        let f = self.fleet.clone();
        let (lane, lanes, hold) = (self.lane, self.lanes, self.hold());
        for p in (0..self.job.spec.job.partitions).filter(|p| p % lanes == lane) {
            let left = match f.store.ledger_trim(&self.job.name, p, hold).await {
                Ok(_) => f.store.ledger_expire(&self.job.name, p).await,
                Err(e) => Err(e),
            };
            match left {
                Ok(Some(secs)) if secs > 0 => {
                    tracing::debug!(job = %self.job.name, partition = p, expires_in_s = secs, "the ledger's calls are in the sink: it expires after their hold")
                }
                Ok(_) => {}
                Err(e) => {
                    f.store_error(&e).await;
                    return;
                }
            }
        }
    }

    /// Stops the job's claims while the outcomes waiting for the sink are
    /// at `sink.max_backlog` or more, and lets them resume below it.
    async fn watch_backlog(&mut self) {
        // One lane of the worker watches for all.
        if self.lane != 0 || self.backlog_checked.is_some_and(|t| t.elapsed() < BACKLOG_CHECK) {
            return;
        }
        self.backlog_checked = Some(Instant::now());
        let spec = &self.job.spec;
        let backlog = match self.fleet.store.sink_backlog(&self.job.name, spec.job.partitions).await {
            Ok(b) => b.unwrap_or(0),
            Err(e) => {
                self.fleet.store_error(&e).await;
                return;
            }
        };
        let limit = spec.sink.max_backlog();
        let full = backlog >= limit;
        let was = self.job.sink_full.swap(full, std::sync::atomic::Ordering::Relaxed);
        if full && !was {
            tracing::warn!(job = %self.job.name, backlog, max_backlog = limit,
                "sink backlog at sink.max_backlog: this worker stops claiming the job until the sink catches up");
        } else if was && !full {
            tracing::info!(job = %self.job.name, backlog, "sink backlog below sink.max_backlog: claiming again");
            self.fleet.wake_claimer.notify_one();
        }
    }

    /// One pass over this writer's partitions: at most one batch each.
    /// Returns the entries taken, or the error that stopped the pass (a sink
    /// that holds its partitions alone goes on with the others, each failed
    /// partition waiting for its own back-off).
    pub async fn write_round(&mut self) -> Result<usize, SinkError> {
        if self.sink.as_ref().is_none_or(|s| s.is_closed()) {
            self.sink = Some(S::open(&self.target, &self.job.name, &self.job.spec).await?);
            // A new sink knows nothing of a batch the old one stored and did
            // not see acknowledged: its entries are this consumer's pending
            // ones, read again first (and stored again: nothing new).
            self.acked_chunks.clear();
            self.own_pending_read = false;
        }
        self.write_job_row().await?;
        let alone = self.sink.as_ref().is_some_and(|s| s.holds_partitions());
        if alone {
            // Entries pending for this writer are taken over with the
            // partition, not read separately.
            self.own_pending_read = true;
        }
        let own = !self.own_pending_read;
        // Entries a dead writer left pending are looked for four times per
        // visibility timeout, not every round (one call less per partition).
        let visibility = self.fleet.visibility;
        let stale = (!alone && self.stale_checked.is_none_or(|t| t.elapsed() >= visibility / 4))
            .then_some(visibility.as_millis() as u64);
        if stale.is_some() {
            self.stale_checked = Some(Instant::now());
        }
        let mut moved = 0;
        let mut first_error = None;
        let (lane, lanes) = (self.lane, self.lanes);
        for p in (0..self.job.spec.job.partitions).filter(|p| p % lanes == lane) {
            if self.part_wait.get(&p).is_some_and(|(due, _)| *due > Instant::now()) {
                continue;
            }
            match self.write_partition(p, own, stale).await {
                Ok(n) => {
                    moved += n;
                    self.part_wait.remove(&p);
                }
                Err(e) if alone => {
                    // What the partition stored and did not make durable is
                    // stored again by whoever takes it next (this writer,
                    // after the partition's back-off); the others go on.
                    if let Some(sink) = self.sink.as_mut() {
                        sink.release(p);
                    }
                    self.held.remove(&p);
                    self.acked_chunks.remove(&p);
                    let backoff = self
                        .part_wait
                        .get(&p)
                        .map_or(Duration::from_millis(200), |(_, b)| (*b * 2).min(MAX_BACKOFF));
                    self.part_wait.insert(p, (Instant::now() + backoff, backoff));
                    first_error.get_or_insert(e);
                }
                Err(e) => return Err(e),
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        if own && moved == 0 {
            // Every partition's own pending entries are written (or there were none).
            self.own_pending_read = true;
        }
        if moved == 0 {
            self.trim_ledger().await;
        }
        Ok(moved)
    }

    /// Keeps the job's row in the jobs table as its manifest says (lane 0;
    /// read every few seconds, written when it changed).
    async fn write_job_row(&mut self) -> Result<(), SinkError> {
        if self.lane != 0 || self.job_row.1.is_some_and(|t| t.elapsed() < JOB_ROW_CHECK) {
            return Ok(());
        }
        self.job_row.1 = Some(Instant::now());
        let manifest = match self.fleet.store.load_manifest(&self.job.name).await {
            Ok(Some(m)) => m,
            Ok(None) => return Ok(()),
            Err(e) => {
                self.fleet.store_error(&e).await;
                return Ok(());
            }
        };
        if self.job_row.0.as_deref() == Some(manifest.updated_at.as_str()) {
            return Ok(());
        }
        let Some(sink) = &self.sink else { return Ok(()) };
        sink.write_job(&manifest).await?;
        self.job_row.0 = Some(manifest.updated_at);
        Ok(())
    }

    /// One partition: takes it (unless another writer holds it),
    /// acknowledges a durable batch first, stores the next batch, makes it
    /// durable when due and acknowledges it. Returns the entries taken.
    async fn write_partition(&mut self, p: u32, own: bool, stale: Option<u64>) -> Result<usize, SinkError> {
        let Some(sink) = self.sink.as_mut() else { return Ok(0) };
        if !sink.take(p)? || !self.ack_durable(p).await? {
            return Ok(0);
        }
        let Some(entries) = self.next_entries(p, own, stale).await else {
            return Ok(0);
        };
        let taken = entries.len();
        if !entries.is_empty() {
            let f = self.fleet.clone();
            let job = self.job.name.as_str();
            let read = match f.store.sink_read(job, p, &entries, &self.job.spec.prices).await {
                Ok(r) => r,
                Err(e) => {
                    f.store_error(&e).await;
                    self.held.insert(p, entries);
                    return Ok(0);
                }
            };
            let Some(sink) = self.sink.as_mut() else { return Ok(0) };
            let refused = match sink.store(job, p, &entries, &read).await {
                Ok(refused) => refused,
                Err(e) => {
                    self.held.insert(p, entries);
                    return Err(e);
                }
            };
            if !refused.is_empty() {
                self.refused(p, &read, &refused).await;
            }
        }
        let flushing = self.flushing;
        if let Some(sink) = self.sink.as_mut() {
            sink.seal(p, flushing)?;
        }
        self.ack_durable(p).await?;
        Ok(taken)
    }

    /// The partition's next entries: those held back from an earlier round,
    /// else a batch from its sink stream (None when Redis failed). A sink
    /// that holds the partition alone takes over what any writer left
    /// pending first; the others read their own pending entries (`own`),
    /// then entries pending longer than `stale` ms (their writer died), then
    /// new ones.
    async fn next_entries(&mut self, p: u32, own: bool, stale: Option<u64>) -> Option<Vec<SinkEntry>> {
        if let Some(entries) = self.held.remove(&p) {
            return Some(entries);
        }
        let f = self.fleet.clone();
        let (job, consumer) = (self.job.name.as_str(), f.config.consumer.as_str());
        let batch = self.job.spec.sink.batch_rows();
        let sink = self.sink.as_mut()?;
        let taken = if sink.holds_partitions() {
            let cursor = sink.take_over(p);
            match f.store.sink_take_held(job, p, consumer, batch, cursor.as_deref()).await {
                Ok((entries, next)) => {
                    if cursor.is_some() {
                        sink.taken_over(p, next);
                    }
                    Ok(entries)
                }
                Err(e) => Err(e),
            }
        } else {
            f.store.sink_take(job, p, consumer, batch, stale, own).await
        };
        match taken {
            Ok(entries) => Some(entries),
            Err(e) => {
                f.store_error(&e).await;
                None
            }
        }
    }

    /// Acknowledges the partition's durable batch in Redis (its results
    /// leave Redis), in chunks, then tells the sink. Returns false when
    /// Redis failed (tried again next round).
    async fn ack_durable(&mut self, p: u32) -> Result<bool, SinkError> {
        let f = self.fleet.clone();
        let hold = self.hold();
        let Some(sink) = self.sink.as_mut() else {
            return Ok(true);
        };
        let Some(durable) = sink.durable(p) else {
            return Ok(true);
        };
        if self.exit_after_rename && !durable.recovered {
            tracing::error!(partition = p, "BATCHFLEET_FAULT: exiting before the acknowledgement");
            std::process::exit(137);
        }
        let entries: Vec<&[SinkEntry]> = durable.entries.chunks(ACK_CHUNK).collect();
        let sunk: Vec<&[SunkResult]> = durable.sunk.chunks(ACK_CHUNK).collect();
        let paid: Vec<&[String]> = durable.paid.chunks(ACK_CHUNK).collect();
        let chunks = entries.len().max(sunk.len()).max(paid.len());
        let done = self.acked_chunks.get(&p).copied().unwrap_or(0);
        for i in done..chunks {
            // The rows that were new are counted with the last chunk (and
            // not at all for a batch a previous writer made durable: a lower bound).
            let written = if i + 1 == chunks && !durable.recovered {
                durable.written
            } else {
                0
            };
            let (e, s, k) = (
                entries.get(i).copied().unwrap_or(&[]),
                sunk.get(i).copied().unwrap_or(&[]),
                paid.get(i).copied().unwrap_or(&[]),
            );
            if let Err(err) = f.store.sink_ack(&self.job.name, p, e, written, s, k, hold).await {
                f.store_error(&err).await;
                self.acked_chunks.insert(p, i);
                return Ok(false);
            }
        }
        if !durable.recovered {
            f.metrics
                .sink_written
                .with_label_values(&[self.job.name.as_str()])
                .inc_by(durable.written);
        }
        self.acked_chunks.remove(&p);
        sink.acknowledged(p)?;
        Ok(true)
    }

    /// Records the sink refused (the rest of their batch is stored): counted,
    /// logged, and sent back to review with the sink's message.
    async fn refused(&self, p: u32, read: &SinkBatch, refused: &[(String, String)]) {
        let job = self.job.name.as_str();
        self.fleet
            .metrics
            .sink_errors
            .with_label_values(&[job, "rejected"])
            .inc_by(refused.len() as u64);
        tracing::error!(
            job = %job,
            rejected = refused.len(),
            first_record = refused.first().map_or("", |(rid, _)| rid.as_str()),
            error = %refused.first().map_or("", |(_, m)| m.as_str()),
            "the database rejected rows: the records go back to review (`sink_rejected`), with its message"
        );
        self.back_to_review(p, read, refused).await;
    }

    /// Sends each refused result back to review with the database's
    /// message, so a person can fix it (accepted again, it is written
    /// again). A result without its input (committed by an older version)
    /// stays done, kept as `rejected` in the failures table.
    async fn back_to_review(&self, p: u32, read: &SinkBatch, refused: &[(String, String)]) {
        let f = &self.fleet;
        for (rid, message) in refused {
            // Only a refused result is decoded whole.
            let Some(entry) = read
                .results
                .iter()
                .position(|r| &r.record_id == rid)
                .and_then(|i| ResultRecord::decode(&read.texts[i]).ok())
                .and_then(|r| ReviewEntry::of_refused(&r, message, &f.config.consumer))
            else {
                continue;
            };
            if let Err(e) = f.store.sink_refuse(&self.job.name, p, &entry).await {
                f.store_error(&e).await;
            }
        }
    }

    /// Before the worker leaves: writes its own unacknowledged batch and
    /// what is waiting, until a round finds nothing left for it (entries
    /// other live writers hold are theirs) or `deadline`; every round is
    /// bounded by the deadline, connecting included.
    pub async fn flush(&mut self, deadline: Instant) {
        self.own_pending_read = false;
        self.flushing = true;
        let deadline = tokio::time::Instant::from_std(deadline);
        loop {
            // A round of its own pending entries comes first; an empty one
            // after it ends the flush.
            let own_round = !self.own_pending_read;
            match tokio::time::timeout_at(deadline, self.write_round()).await {
                Ok(Ok(0)) if !own_round => {
                    self.leave_ledger().await;
                    return;
                }
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    self.failed(e);
                    if tokio::time::timeout_at(deadline, tokio::time::sleep(self.backoff))
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
                Err(_) => break,
            }
        }
        tracing::warn!(job = %self.job.name, "drain timeout: some outcomes are not in the sink yet (another worker writes them)");
    }

    fn failed(&mut self, e: SinkError) {
        let job = self.job.name.as_str();
        self.fleet
            .metrics
            .sink_errors
            .with_label_values(&[job, e.cause()])
            .inc();
        if matches!(e, SinkError::Unreachable(_)) {
            self.sink = None;
        }
        let alone = self.sink.as_ref().is_some_and(|s| s.holds_partitions());
        match &self.failing {
            Some((first, _)) if *first == e => {
                tracing::warn!(job, error = %e, retry_in_ms = self.backoff.as_millis() as u64, "sink still failing; outcomes wait in Redis")
            }
            _ => {
                tracing::error!(job, error = %e, cause = e.cause(), "sink failing; outcomes wait in Redis and are written when it recovers");
                self.failing = Some((e, Instant::now()));
            }
        }
        self.fleet
            .health
            .sink_failing
            .store(true, std::sync::atomic::Ordering::Relaxed);
        if alone {
            // Each failing partition waits for its own back-off.
            self.next_attempt = Some(Instant::now() + IDLE);
        } else {
            self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
            self.next_attempt = Some(Instant::now() + self.backoff);
        }
    }

    fn recovered(&mut self) {
        if let Some((_, since)) = self.failing.take() {
            tracing::info!(job = %self.job.name, after_ms = since.elapsed().as_millis() as u64, "sink recovered");
        }
        self.fleet
            .health
            .sink_failing
            .store(false, std::sync::atomic::Ordering::Relaxed);
        self.backoff = Duration::from_millis(200);
        self.next_attempt = None;
    }
}

impl<S: ResultSink> Service for SinkWriter<S> {
    fn name(&self) -> &'static str {
        "sink"
    }

    async fn run_once(&mut self) -> Option<Duration> {
        self.watch_backlog().await;
        // While failing, the next attempt waits for the back-off; the
        // backlog is still watched in between.
        if let Some(due) = self.next_attempt
            && let Some(wait) = due.checked_duration_since(Instant::now())
        {
            return Some(BACKLOG_CHECK.min(wait));
        }
        match self.write_round().await {
            Ok(n) => {
                // Recovered once no partition waits for a retry.
                if self.part_wait.is_empty() {
                    self.recovered();
                }
                Some(if n == 0 { IDLE } else { Duration::ZERO })
            }
            Err(e) => {
                self.failed(e);
                Some(BACKLOG_CHECK.min(self.backoff))
            }
        }
    }
}

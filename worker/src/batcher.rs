//! Provider batch mode's service (`provider.mode = "batch"`): one per job,
//! in every worker. Each round, per partition, it packs the queued tasks
//! into a shard when one is due, and moves every shard it may work on one
//! step along its life (see [`common::shard`]):
//!
//! packed -> uploaded (its JSONL input file at the provider) -> submitting
//! (persisted before the create: after a crash or a lost answer the
//! provider's batches are searched by metadata before any new create, so a
//! shard never has two batches) -> submitted (polled) -> ended (the
//! provider's `completed`, `failed`, `expired` or `cancelled`) ->
//! reconciled (every line joined on `custom_id` and settled through the
//! same validate -> decide -> commit / retry / review path as an online
//! answer; records with no line go back to the stream for a later shard).
//!
//! A shard is leased to the worker working on it (the visibility timeout):
//! any worker takes over a shard whose owner died. Every record leaves its
//! shard in the same atomic step as its outcome, so a line settled twice
//! (a take-over mid-way) moves its record once, and its paid call, keyed by
//! the line, is recorded once.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::ledger::{Fate, PaidCall};
use common::shard::{LineCounts, OutputLine, Shard, ShardState};
use common::store::{Finish, StoreError};
use common::task::{Delivery, RecordState, Task, Usage};
use futures_util::StreamExt;
use serde::Serialize;
use serde_json::Value;
use serde_json::value::RawValue;

use crate::batch_api::{ApiError, BatchApi};
use crate::clock::now_ms;
use crate::fleet::Fleet;
use crate::job::{JobCtx, Settled};
use crate::plan::Route;
use crate::process::{BatchAnswer, prepare, settle_batch_line, settle_unsent};
use crate::provider::{CallError, CallResult, ErrorKind, classify};
use crate::service::Service;

/// Lines settled at once (their outcomes are stored in groups).
const SETTLE_AT_ONCE: usize = 64;

/// Batches failing validation (since the job started or was resumed) before the job halts.
const FAILURES_TO_HALT: u64 = 3;

/// The batch-mode service of one job.
pub struct Batcher {
    fleet: Arc<Fleet>,
    job: Arc<JobCtx>,
    api: BatchApi,
}

/// A step that could not be taken now.
#[derive(Debug, thiserror::Error)]
enum StepError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{what}: {error}")]
    Api { what: &'static str, error: ApiError },
}

type Step = Result<bool, StepError>;

/// A line of a batch's input file: the request body as an online call
/// sends it, byte for byte.
#[derive(Serialize)]
struct InputLine<'a> {
    custom_id: &'a str,
    method: &'static str,
    url: &'static str,
    body: &'a RawValue,
}

fn api(what: &'static str) -> impl FnOnce(ApiError) -> StepError {
    move |error| StepError::Api { what, error }
}

impl Batcher {
    /// The job's batcher, when its spec says `provider.mode = "batch"`.
    pub fn for_job(fleet: &Arc<Fleet>, job: &Arc<JobCtx>) -> Option<Batcher> {
        if job.spec.provider.mode != common::spec::ProviderMode::Batch && !job.plan.has_batch() {
            return None;
        }
        let api = match job.provider.batch_api() {
            Ok(api) => api,
            Err(e) => {
                tracing::error!(job = %job.name, error = %e, "no HTTP client for the Batch API");
                return None;
            }
        };
        Some(Batcher {
            fleet: fleet.clone(),
            job: job.clone(),
            api,
        })
    }

    fn me(&self) -> &str {
        &self.fleet.config.consumer
    }

    /// Whether new shards are packed: always in batch mode; with the batch
    /// tier, while the plan says the deadline leaves the batch's window.
    fn packs(&self) -> bool {
        self.job.spec.provider.mode == common::spec::ProviderMode::Batch || self.job.plan.batch_now()
    }

    /// With the batch tier: the plan says the deadline no longer leaves the
    /// batch's window (the shards' records go online).
    fn too_late(&self) -> bool {
        self.job.spec.provider.mode != common::spec::ProviderMode::Batch && self.job.plan.batch_over()
    }

    fn lease_until(&self) -> u64 {
        now_ms() + self.fleet.visibility.as_millis() as u64
    }

    /// One round over the job's partitions. Returns whether it moved
    /// anything (another round follows at once).
    pub async fn round(&mut self) -> bool {
        let (f, job) = (self.fleet.clone(), self.job.clone());
        let mut busy = false;
        for p in 0..job.spec.job.partitions {
            if !f.is_halted(&job.name) && !f.is_cancelled(&job.name) && self.packs() {
                busy |= self.outcome(self.pack_if_due(p).await).await;
            }
            let shards = match f.store.shards(&job.name, p).await {
                Ok(s) => s,
                Err(e) => {
                    f.store_error(&e).await;
                    continue;
                }
            };
            for (read, shard) in shards {
                if shard.state == ShardState::Reconciled || !shard.free_for(self.me(), now_ms()) {
                    continue;
                }
                let step = self.step(p, read, shard).await;
                busy |= self.outcome(step).await;
            }
        }
        f.health.loop_ok();
        busy
    }

    /// What a step came to: a provider's refusal halts the job; anything
    /// else is tried again next round.
    async fn outcome(&self, step: Step) -> bool {
        let f = &self.fleet;
        let job = &self.job.name;
        match step {
            Ok(busy) => busy,
            Err(StepError::Store(e)) => {
                f.store_error(&e).await;
                false
            }
            Err(StepError::Api {
                what,
                error: ApiError::Transient(m),
            }) => {
                tracing::warn!(job = %job, step = what, error = %m, "the provider's Batch API failed; trying again next round");
                false
            }
            Err(StepError::Api { what, error }) => {
                let reason = format!("provider Batch API, {what}: {error}");
                tracing::error!(job = %job, reason = %reason, "job halted: records stay in their shards and queues");
                if let Err(e) = f.store.halt(job, &reason).await {
                    f.store_error(&e).await;
                }
                f.halted_here(job, &reason);
                false
            }
        }
    }

    /// A task a shard holds, as a delivery fenced by the shard.
    fn delivery(&self, p: u32, shard: &str, task: Task) -> Delivery {
        Delivery {
            partition: p,
            entry_id: String::new(),
            deliveries: 1,
            consumer: self.me().to_owned(),
            claimed_at: tokio::time::Instant::now(),
            task,
            state_at_claim: Some(Some(RecordState::Batched)),
            shard: Some(shard.to_owned()),
        }
    }

    /// Replaces the shard's state if nobody changed it since `read`.
    /// Returns what it now reads, or None when it was changed.
    async fn save(&self, p: u32, read: &str, shard: &Shard) -> Result<Option<String>, StoreError> {
        let saved = self.fleet.store.shard_cas(&self.job.name, p, read, shard).await?;
        Ok(saved.then(|| shard.encode()))
    }

    /// Packs a shard of the partition's queued tasks when one is due: a
    /// full one's worth waits, or the oldest waited `pack_wait_secs`, or
    /// nothing more is coming (enqueued, no retry waiting).
    async fn pack_if_due(&self, p: u32) -> Step {
        let (f, job) = (&self.fleet, &self.job);
        let b = &job.spec.batch;
        let left = f.store.partition_work_left(&job.name, p).await?;
        if left.queued == 0 {
            return Ok(false);
        }
        let due = left.queued >= b.shard_records() as u64
            || f.store
                .stream_oldest_ms(&job.name, p)
                .await?
                .is_some_and(|at| now_ms().saturating_sub(at) >= b.pack_wait().as_millis() as u64)
            || (left.delayed == 0 && !f.store.enqueuing(&job.name).await?);
        if !due {
            return Ok(false);
        }
        let id = f.store.next_shard_id(&job.name, p).await?;
        let shard = Shard::new(id, p, self.me(), now_ms(), self.lease_until());
        // Online retries only as many as this worker has free slots for.
        let slots = f.permits.available_permits();
        let packed = f
            .store
            .shard_pack(&job.name, p, self.me(), (b.shard_records(), slots), &shard)
            .await?;
        let online = packed.online.len();
        for d in packed.online {
            self.run_online(d).await;
        }
        if packed.moved > 0 {
            let read = shard.encode();
            let mut counted = shard.clone();
            counted.records = packed.moved;
            f.store.shard_cas(&job.name, p, &read, &counted).await?;
            tracing::info!(job = %job.name, shard = %counted.id, records = packed.moved, "shard packed");
        }
        Ok(packed.moved > 0 || online > 0)
    }

    /// A retry marked to run online (`[batch] retries = "online"`): called
    /// as the claimer would, under a concurrency slot and the fleet's
    /// budget, waited for apart from the batcher's round.
    async fn run_online(&self, d: Delivery) {
        let (f, job) = (self.fleet.clone(), self.job.clone());
        self.fleet.tracker.spawn(async move {
            let Ok(permit) = f.permits.clone().acquire_owned().await else {
                return;
            };
            loop {
                let (mut grants, wait, _) = f.grants(&job, 1, Route::Primary).await;
                if let Some(grant) = grants.pop() {
                    f.spawn(job, d, permit, (Some(grant), Route::Primary));
                    return;
                }
                tokio::time::sleep(wait.clamp(Duration::from_millis(5), Duration::from_secs(10))).await;
            }
        });
    }

    /// One step of a shard's life, under its lease.
    async fn step(&self, p: u32, read: String, mut shard: Shard) -> Step {
        let now = now_ms();
        let mut read = read;
        let mine = shard.owner.as_deref() == Some(self.me());
        if !mine || shard.lease_until_ms < now + self.fleet.visibility.as_millis() as u64 / 2 {
            if !mine {
                tracing::info!(job = %self.job.name, shard = %shard.id, state = shard.state.name(),
                    owner = shard.owner.as_deref().unwrap_or(""), "taking over a shard");
            }
            shard.owner = Some(self.me().to_owned());
            shard.lease_until_ms = self.lease_until();
            match self.save(p, &read, &shard).await? {
                Some(now_read) => read = now_read,
                None => return Ok(false),
            }
        }
        match shard.state {
            ShardState::Packed => self.build(p, read, shard).await,
            ShardState::Uploaded | ShardState::Submitting => self.submit(p, read, shard).await,
            ShardState::Submitted => self.poll(p, read, shard).await,
            ShardState::Ended => self.settle(p, read, shard).await,
            ShardState::Reconciled => Ok(false),
        }
    }

    /// Every task the shard holds is cancelled (kept for resume): the job
    /// was cancelled before its batch was created.
    async fn cancel_held(&self, p: u32, shard: &Shard) -> Result<u64, StoreError> {
        let (f, job) = (&self.fleet, &self.job);
        let tasks = f.store.shard_tasks(&job.name, p, &shard.id).await?;
        let n = tasks.len() as u64;
        for task in tasks {
            let d = self.delivery(p, &shard.id, task);
            job.finish(&d, &Finish::Cancel(d.task.clone())).await?;
        }
        Ok(n)
    }

    /// Every task the shard holds goes back to the stream, for the online
    /// claimer: the batch tier's deadline no longer leaves the batch's
    /// window, and no batch was created for it.
    async fn release_held(&self, p: u32, shard: &Shard) -> Result<(), StoreError> {
        let (f, job) = (&self.fleet, &self.job);
        let rids: Vec<String> = f
            .store
            .shard_tasks(&job.name, p, &shard.id)
            .await?
            .into_iter()
            .map(|t| t.rid)
            .collect();
        tracing::info!(job = %job.name, shard = %shard.id, records = rids.len(),
            "the deadline no longer leaves the batch's completion window: the shard's records go online");
        f.store.shard_release(&job.name, p, &shard.id, &rids).await?;
        f.wake_claimer.notify_one();
        Ok(())
    }

    /// Marks the shard reconciled once it holds no task.
    async fn close(&self, p: u32, read: &str, mut shard: Shard) -> Step {
        let (f, job) = (&self.fleet, &self.job);
        if f.store.shard_held(&job.name, p, &shard.id).await? > 0 {
            return Ok(false);
        }
        shard.state = ShardState::Reconciled;
        shard.owner = None;
        if self.save(p, read, &shard).await?.is_some() {
            f.store.shard_forget(&job.name, p, &shard.id).await?;
            f.store.batch_tokens_give(&job.name, &shard.id).await?;
            tracing::info!(job = %job.name, shard = %shard.id, batch = shard.batch_id.as_deref().unwrap_or(""),
                settled = shard.lines.settled, duplicates = shard.lines.duplicates, unknown = shard.lines.unknown,
                missing = shard.lines.missing, "shard reconciled");
        }
        Ok(true)
    }

    /// Packed -> uploaded: the shard's input file, each line exactly the
    /// request online mode would send, uploaded.
    async fn build(&self, p: u32, read: String, mut shard: Shard) -> Step {
        let (f, job) = (&self.fleet, &self.job);
        if f.is_cancelled(&job.name) {
            self.cancel_held(p, &shard).await?;
            return self.close(p, &read, shard).await;
        }
        if self.too_late() {
            self.release_held(p, &shard).await?;
            return self.close(p, &read, shard).await;
        }
        let tasks = f.store.shard_tasks(&job.name, p, &shard.id).await?;
        let limit = job.spec.batch.shard_bytes();
        let (mut file, mut lines, mut tokens) = (Vec::new(), 0u64, 0u64);
        let (mut unsent, mut over) = (Vec::new(), Vec::new());
        for task in tasks {
            let d = self.delivery(p, &shard.id, task);
            let prep = match prepare(job, &d, &f.limits, Route::Batch) {
                Ok(prep) if !d.task.answered.iter().any(|a| a == prep.fingerprint()) => prep,
                _ => {
                    unsent.push(d);
                    continue;
                }
            };
            let line = serde_json::to_string(&InputLine {
                custom_id: &d.task.rid,
                method: "POST",
                url: "/v1/chat/completions",
                body: &prep.body,
            })
            .expect("an input line of strings and a body serializes");
            if lines > 0 && (file.len() + line.len() + 1) as u64 > limit {
                over.push(d.task.rid.clone());
                continue;
            }
            file.extend_from_slice(line.as_bytes());
            file.push(b'\n');
            lines += 1;
            tokens += prep.at_most.prompt + prep.at_most.completion;
        }
        for d in unsent {
            let settled = settle_unsent(job, &d, &f.limits).await;
            f.count_settled(&job.name, &settled).await;
            settled?;
        }
        if !over.is_empty() {
            // Past `shard_bytes`: into a later shard.
            f.store.shard_release(&job.name, p, &shard.id, &over).await?;
        }
        if lines == 0 {
            return self.close(p, &read, shard).await;
        }
        let sha = {
            use sha2::Digest;
            hex::encode(sha2::Sha256::digest(&file))
        };
        let name = format!("{}-{}.jsonl", job.name, shard.id);
        let file_id = self
            .api
            .upload(&name, file)
            .await
            .map_err(api("uploading the input file"))?;
        shard.file_id = Some(file_id);
        shard.file_sha256 = Some(sha);
        shard.records = lines;
        shard.tokens = tokens;
        shard.state = ShardState::Uploaded;
        Ok(self.save(p, &read, &shard).await?.is_some())
    }

    /// Uploaded or submitting -> submitted. `submitting` is persisted
    /// before every create; a shard found `submitting` (a create whose
    /// answer was lost, or whose worker died) is looked up by its metadata
    /// first: never two batches for one shard.
    async fn submit(&self, p: u32, read: String, mut shard: Shard) -> Step {
        let (f, job) = (&self.fleet, &self.job);
        let metadata = shard.metadata(&job.name);
        if shard.state == ShardState::Submitting {
            let since = (shard.created_ms / 1000).saturating_sub(3600);
            let file_id = shard.file_id.clone().unwrap_or_default();
            if let Some(batch) = self
                .api
                .find(&file_id, &metadata, since)
                .await
                .map_err(api("looking up a batch by its metadata"))?
            {
                tracing::info!(job = %job.name, shard = %shard.id, batch = batch["id"].as_str().unwrap_or(""),
                    "found the shard's batch created before (its create's answer was lost): not created again");
                return self.submitted(p, &read, shard, &batch).await;
            }
        }
        if f.is_cancelled(&job.name) {
            // Never created: its tasks are kept for resume.
            self.cancel_held(p, &shard).await?;
            return self.close(p, &read, shard).await;
        }
        if self.too_late() {
            self.release_held(p, &shard).await?;
            return self.close(p, &read, shard).await;
        }
        if f.is_halted(&job.name) {
            return Ok(false);
        }
        if let Some(limit) = job.spec.batch.max_enqueued_tokens
            && !f
                .store
                .batch_tokens_take(&job.name, &shard.id, shard.tokens, limit)
                .await?
        {
            // The provider's enqueued-token limit: after a batch ends.
            return Ok(false);
        }
        shard.state = ShardState::Submitting;
        shard.submits += 1;
        // A whole lease for the create (the visibility timeout exceeds the
        // provider's timeout): nobody looks the shard up before its answer.
        shard.lease_until_ms = self.lease_until();
        let Some(read) = self.save(p, &read, &shard).await? else {
            return Ok(false);
        };
        pause_at("submitting").await;
        let file_id = shard.file_id.clone().unwrap_or_default();
        let batch = self
            .api
            .create(&file_id, job.spec.batch.completion_window(), &metadata)
            .await
            .map_err(api("creating a batch"))?;
        self.submitted(p, &read, shard, &batch).await
    }

    async fn submitted(&self, p: u32, read: &str, mut shard: Shard, batch: &Value) -> Step {
        shard.batch_id = batch["id"].as_str().map(str::to_owned);
        shard.provider_status = batch["status"].as_str().map(str::to_owned);
        shard.state = ShardState::Submitted;
        shard.polled_ms = now_ms();
        let id = shard.batch_id.clone().unwrap_or_default();
        if self.save(p, read, &shard).await?.is_some() {
            tracing::info!(job = %self.job.name, shard = %shard.id, batch = %id, records = shard.records, "batch submitted");
            return Ok(true);
        }
        // Another worker took the shard over meanwhile (this one stalled
        // past its lease). If it holds another batch, this one is a second
        // batch for the shard: cancelled, never left running unread.
        let now = self.fleet.store.shards(&self.job.name, p).await?;
        let theirs = now
            .iter()
            .find(|(_, s)| s.id == shard.id)
            .and_then(|(_, s)| s.batch_id.clone());
        if theirs.as_deref() != Some(id.as_str()) {
            tracing::error!(job = %self.job.name, shard = %shard.id, batch = %id, other = theirs.as_deref().unwrap_or(""),
                "a second batch for a shard taken over meanwhile: cancelling it");
            if let Err(e) = self.api.cancel(&id).await {
                tracing::error!(job = %self.job.name, batch = %id, error = %e, "could not cancel the second batch");
            }
        }
        Ok(false)
    }

    /// Submitted -> ended, when the provider says the batch is. A cancelled
    /// job's batches are cancelled; so is a batch still running well past
    /// its window (`expires_at`): either way its partial results are kept.
    async fn poll(&self, p: u32, read: String, mut shard: Shard) -> Step {
        let (f, job) = (&self.fleet, &self.job);
        let poll = job.spec.batch.poll();
        let cancelling = shard.provider_status.as_deref() == Some("cancelling");
        // With the batch tier, a deadline that no longer leaves the batch's
        // window sends its records online: the batch is cancelled, its
        // finished lines kept.
        let too_late = self.too_late();
        let cancel = (f.is_cancelled(&job.name) || too_late) && !cancelling;
        if !cancel && now_ms() < shard.polled_ms + poll.as_millis() as u64 {
            return Ok(false);
        }
        let id = shard.batch_id.clone().unwrap_or_default();
        let batch = self.api.retrieve(&id).await.map_err(api("looking at a batch"))?;
        let status = batch["status"].as_str().unwrap_or("").to_owned();
        shard.polled_ms = now_ms();
        shard.output_file_id = batch["output_file_id"].as_str().map(str::to_owned);
        shard.error_file_id = batch["error_file_id"].as_str().map(str::to_owned);
        let running = matches!(status.as_str(), "validating" | "in_progress" | "finalizing");
        let past_window = batch["expires_at"]
            .as_u64()
            .is_some_and(|at| now_ms() / 1000 > at + 3 * poll.as_secs());
        shard.provider_status = Some(status.clone());
        if running && (cancel || past_window) {
            let why = if f.is_cancelled(&job.name) {
                "the job was cancelled"
            } else if too_late {
                "the deadline no longer leaves the batch's completion window: its records go online"
            } else {
                "still running past its completion window"
            };
            tracing::warn!(job = %job.name, shard = %shard.id, batch = %id, why, "cancelling the batch (its finished lines are kept)");
            match self.api.cancel(&id).await {
                Ok(_) => {
                    shard.notes.push(format!("cancelled: {why}"));
                    shard.provider_status = Some("cancelling".into());
                }
                // It ended meanwhile (a provider refuses to cancel an ended
                // batch): the next poll sees how.
                Err(ApiError::Permanent(m)) => {
                    tracing::info!(job = %job.name, batch = %id, answer = %m, "the batch could not be cancelled: looking again");
                }
                Err(e) => return Err(api("cancelling a batch")(e)),
            }
        }
        if matches!(status.as_str(), "completed" | "failed" | "expired" | "cancelled") {
            if status == "failed" {
                let errors = batch["errors"]["data"].as_array().cloned().unwrap_or_default();
                for e in errors.iter().take(10) {
                    shard.notes.push(format!(
                        "provider: {} (line {}): {}",
                        e["code"].as_str().unwrap_or("error"),
                        e["line"].as_u64().map_or("-".into(), |l| l.to_string()),
                        e["message"].as_str().unwrap_or("")
                    ));
                }
            }
            shard.state = ShardState::Ended;
            // Its tokens no longer count against the provider's limit.
            f.store.batch_tokens_give(&job.name, &shard.id).await?;
            tracing::info!(job = %job.name, shard = %shard.id, batch = %id, status = %status, "batch ended");
        }
        Ok(self.save(p, &read, &shard).await?.is_some() && shard.state == ShardState::Ended)
    }

    /// The shard's output and error files, one after the other, and their
    /// sha256: each is kept whole in the job's raw store first (the
    /// provider deletes them after its retention; the audit trail does not).
    async fn download(&self, shard: &Shard) -> Result<(String, Vec<String>), StepError> {
        let mut text = String::new();
        let mut kept = Vec::new();
        for file in [&shard.output_file_id, &shard.error_file_id].into_iter().flatten() {
            let content = self
                .api
                .content(file)
                .await
                .map_err(api("downloading a batch's results"))?;
            kept.extend(self.archive(file, &content).await);
            text.push_str(&content);
            text.push('\n');
        }
        Ok((text, kept))
    }

    /// Keeps a batch's file whole in the job's raw store: its sha256, to be
    /// named in each answer's trail, when it was kept (None: the job keeps
    /// no responses, or the store did not take it; each answer's own bytes
    /// are kept, or go inline, as an online answer's).
    async fn archive(&self, file: &str, content: &str) -> Option<String> {
        let job = &self.job;
        match job.keep_raw(content.as_bytes(), ARCHIVE_PATIENCE).await {
            crate::job::RawKept::Kept => Some(common::sink::sha256_hex(content.as_bytes())),
            crate::job::RawKept::NoStore => None,
            crate::job::RawKept::Down(why) => {
                self.fleet
                    .limits
                    .metrics
                    .raw_inline
                    .with_label_values(&[&job.name])
                    .inc();
                tracing::warn!(job = %job.name, file = %file, error = %why, "could not keep a batch's file whole for the audit trail: its answers keep their own bytes");
                None
            }
        }
    }

    /// Ended -> reconciled: the output and error files joined on
    /// `custom_id` against the records packed into the shard, each answer
    /// settled as an online one would be.
    async fn settle(&self, p: u32, read: String, mut shard: Shard) -> Step {
        let (f, job) = (&self.fleet, &self.job);
        let status = shard.provider_status.clone().unwrap_or_default();
        if status == "failed" {
            return self.failed(p, read, shard).await;
        }
        let (text, files) = self.download(&shard).await?;
        pause_at("download").await;
        let packed = f.store.shard_packed(&job.name, p, &shard.id).await?;
        let mut held: HashMap<String, Task> = f
            .store
            .shard_tasks(&job.name, p, &shard.id)
            .await?
            .into_iter()
            .map(|t| (t.rid.clone(), t))
            .collect();
        let batch = shard.batch_id.clone().unwrap_or_default();
        let Joined {
            mut answers,
            copies,
            mut counts,
            unreadable,
        } = self.join(p, &shard.id, &batch, &text, &packed, &mut held);
        if !copies.is_empty() {
            // A copy the provider answered (and billed) is recorded, not
            // used: before the answers, so a worker that dies settling them
            // leaves the copies recorded (their keys are the lines': the
            // next worker records nothing twice).
            f.store.record_paid(&job.name, &copies).await?;
        }
        // A fault test stops halfway through.
        let halfway = pausing_at("settle");
        if halfway {
            answers.truncate(answers.len().div_ceil(2));
        }
        // The answers, through the same path as online ones.
        let limits = &f.limits;
        let settled: Vec<Result<Settled, StoreError>> = futures_util::stream::iter(answers)
            .map(|(d, mut answer, name)| {
                answer.batch_files.clone_from(&files);
                async move { settle_batch_line(job, &d, limits, answer, name).await }
            })
            .buffer_unordered(SETTLE_AT_ONCE)
            .collect()
            .await;
        for s in &settled {
            f.count_settled(&job.name, s).await;
        }
        if halfway {
            pause_at("settle").await;
        }
        // Records with no line at all, or never run (expired, cancelled):
        // kept for resume when the job is cancelled, else into a new shard.
        // (An answered one whose outcome could not be stored stays in the
        // shard for the next round.)
        counts.missing = held.len() as u64;
        self.unanswered(p, &shard.id, held.into_values().collect()).await?;
        if settled.iter().any(Result::is_err) {
            return Ok(false);
        }
        for (n, what) in [
            (counts.duplicates, "duplicate lines (the first valid one counted)"),
            (counts.unknown, "lines for records the shard does not hold (ignored)"),
            (counts.missing, "records with no answer (into a later shard)"),
            (unreadable, "unreadable lines"),
        ] {
            if n > 0 {
                tracing::warn!(job = %job.name, shard = %shard.id, batch = %batch, n, what, "batch reconciliation");
                shard.notes.push(format!("{n} {what}"));
            }
        }
        shard.lines = counts;
        self.close(p, &read, shard).await
    }

    /// Joins a batch's output on `custom_id` against the records packed
    /// into the shard: the answer each held record settles with (the first
    /// valid of its lines; the record leaves `held`), and every other line
    /// that was billed (a duplicate, a record the shard does not hold) as a
    /// paid call to record.
    fn join(
        &self,
        p: u32,
        shard_id: &str,
        batch: &str,
        text: &str,
        packed: &std::collections::HashSet<String>,
        held: &mut HashMap<String, Task>,
    ) -> Joined {
        let job = &self.job;
        let ByRecord {
            order,
            mut lines,
            unreadable,
        } = ByRecord::of(text);
        let mut joined = Joined {
            unreadable,
            ..Joined::default()
        };
        for rid in order {
            let ls = lines.remove(&rid).unwrap_or_default();
            if !packed.contains(&rid) {
                joined.counts.unknown += ls.len() as u64;
                // Not ours, but answered and billed all the same: recorded.
                for (i, line) in ls.iter().enumerate() {
                    if let (Some(usage), Ok(task)) = (line_usage(line), Task::new(&rid, "{}", "")) {
                        let call = self.duplicate_call(job, &task, usage, &line_name(batch, line, i));
                        joined.copies.push((p, call));
                    }
                }
                continue;
            }
            joined.counts.duplicates += ls.len().saturating_sub(1) as u64;
            let Some(task) = held.remove(&rid) else {
                // Settled before (a worker that took the shard over).
                joined.counts.settled += 1;
                continue;
            };
            let ran: Vec<&OutputLine> = ls.iter().filter(|l| !l.not_run()).collect();
            if ran.is_empty() {
                held.insert(rid, task);
                continue;
            }
            joined.counts.settled += 1;
            let d = self.delivery(p, shard_id, task);
            let chosen = self.first_valid(&d, &ran);
            for (i, line) in ran.iter().enumerate() {
                let name = line_name(batch, line, i);
                if i == chosen {
                    joined.answers.push((d.clone(), line_answer(line), name));
                } else if let Some(usage) = line_usage(line) {
                    joined.copies.push((p, self.duplicate_call(job, &d.task, usage, &name)));
                }
            }
        }
        joined
    }

    /// Tasks of a shard its batch never answered: cancelled with the job
    /// (kept for resume), or back to the stream for a new shard (not an attempt).
    async fn unanswered(&self, p: u32, shard_id: &str, tasks: Vec<Task>) -> Result<(), StoreError> {
        let (f, job) = (&self.fleet, &self.job);
        if tasks.is_empty() {
            return Ok(());
        }
        if f.is_cancelled(&job.name) {
            for task in tasks {
                let d = self.delivery(p, shard_id, task);
                job.finish(&d, &Finish::Cancel(d.task.clone())).await?;
            }
            return Ok(());
        }
        let rids: Vec<String> = tasks.into_iter().map(|t| t.rid).collect();
        f.store.shard_release(&job.name, p, shard_id, &rids).await?;
        f.wake_claimer.notify_one();
        Ok(())
    }

    /// Of a record's lines, the first whose answer is valid (else the first).
    fn first_valid(&self, d: &Delivery, lines: &[&OutputLine]) -> usize {
        if lines.len() < 2 {
            return 0;
        }
        let input = d.task.input_object();
        let span = common::otel::Span::none();
        lines
            .iter()
            .position(|l| {
                let reply = line_result(l).into_reply(&self.job.spec, &input, &span);
                matches!(reply.outcome, common::decision::Outcome::Valid)
            })
            .unwrap_or(0)
    }

    /// Whether another shard of the job had a batch enqueued at the
    /// provider while `me` was: one still running, or one the provider took
    /// (not refused) that was still seen running after `me` was packed.
    /// Batches of one round often end together, so a batch that ended just
    /// before this one's refusal was read still counts.
    async fn others_running(&self, me: &Shard) -> Result<bool, StoreError> {
        let (f, job) = (&self.fleet, &self.job);
        for p in 0..job.spec.job.partitions {
            let shards = f.store.shards(&job.name, p).await?;
            if shards.iter().any(|(_, s)| enqueued_beside(s, me)) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The paid call of a duplicate line: billed, never used.
    fn duplicate_call(&self, job: &JobCtx, task: &Task, usage: Usage, name: &str) -> PaidCall {
        let prices = &job.spec.prices;
        let mut call = PaidCall::new(
            task,
            task.attempt + 1,
            task.calls + 1,
            1,
            self.me(),
            usage,
            prices,
            now_ms(),
        )
        .batched(&prices.batch(), prices, name)
        .to_model(&job.spec.provider.model);
        call.fate = Fate::Duplicate;
        call
    }

    /// A batch that failed validation: its records go into a new shard,
    /// unless batches keep failing (then the job halts with the provider's
    /// words, its records queued).
    async fn failed(&self, p: u32, read: String, mut shard: Shard) -> Step {
        let (f, job) = (&self.fleet, &self.job);
        let tasks = f.store.shard_tasks(&job.name, p, &shard.id).await?;
        let mut read = read;
        // Counted once, however often this step is taken (a worker that died
        // in it): the count is noted in the shard before its tasks move.
        const NOTED: &str = "failed validation: ";
        if !shard.notes.iter().any(|n| n.starts_with(NOTED)) {
            // The provider's limit on enqueued tokens passes by itself once
            // the job's other batches end; anything else counts, and so does
            // that limit when no other batch of the job was running (the
            // shard alone is over it: lower `shard_records`).
            let codes: Vec<&String> = shard.notes.iter().filter(|n| n.starts_with("provider: ")).collect();
            let limit_only = !codes.is_empty()
                && codes.iter().all(|n| n.starts_with("provider: token_limit_exceeded"))
                && self.others_running(&shard).await?;
            f.store.batch_failed(&job.name, u64::from(!limit_only)).await?;
            shard
                .notes
                .push(format!("{NOTED}{} records into a new shard", tasks.len()));
            shard.lines.missing = tasks.len() as u64;
            match self.save(p, &read, &shard).await? {
                Some(now) => read = now,
                None => return Ok(false),
            }
            tracing::warn!(job = %job.name, shard = %shard.id, batch = shard.batch_id.as_deref().unwrap_or(""),
                notes = ?shard.notes, "a batch failed validation");
        }
        self.unanswered(p, &shard.id, tasks).await?;
        let failures = f.store.batch_failed(&job.name, 0).await?;
        if failures >= FAILURES_TO_HALT {
            let reason = format!(
                "{failures} provider batches failed validation; the last ({}): {}",
                shard.batch_id.as_deref().unwrap_or(""),
                shard.notes.join("; ")
            );
            tracing::error!(job = %job.name, reason = %reason, "job halted");
            f.store.halt(&job.name, &reason).await?;
            f.halted_here(&job.name, &reason);
        }
        self.close(p, &read, shard).await
    }
}

/// Whether `other`'s batch was enqueued at the provider while `me`'s was
/// (see [`Batcher::others_running`]).
fn enqueued_beside(other: &Shard, me: &Shard) -> bool {
    let taken = other.batch_id.is_some() && other.provider_status.as_deref() != Some("failed");
    other.id != me.id
        && taken
        && match other.state {
            ShardState::Submitted => true,
            ShardState::Ended | ShardState::Reconciled => other.polled_ms >= me.created_ms,
            _ => false,
        }
}

impl Service for Batcher {
    fn name(&self) -> &'static str {
        "batch"
    }

    /// A round; at once again when it moved something, else after the
    /// shorter of the poll interval and a second.
    async fn run_once(&mut self) -> Option<Duration> {
        if self.round().await {
            return Some(Duration::ZERO);
        }
        Some(self.job.spec.batch.poll().min(Duration::from_secs(1)))
    }
}

/// A line's own name in the ledger: the batch, the provider's line id (or
/// the record's), and its place among the record's lines (a duplicate may
/// repeat the id): the same each time the same file is settled.
fn line_name(batch: &str, line: &OutputLine, i: usize) -> String {
    format!("{batch}:{}:{i}", line.id.as_deref().unwrap_or(&line.custom_id))
}

/// What one line of a batch's output or error file (OpenAI's JSONL shape)
/// came to, as an online call's result.
pub fn answer_of_line(line: &str) -> Result<BatchAnswer, String> {
    OutputLine::parse(line).map(|l| line_answer(&l))
}

/// A line as [`settle_batch_line`] takes it (the batch's files are named by the caller).
fn line_answer(line: &OutputLine) -> BatchAnswer {
    BatchAnswer {
        result: line_result(line),
        body: line.response.as_ref().map(|(_, body)| body.clone()),
        batch_files: Vec::new(),
    }
}

/// A line as an online call's result: its response classified as an online
/// response would be, or its own error (a request the batch could not run:
/// transient).
fn line_result(line: &OutputLine) -> CallResult {
    match (&line.response, &line.error) {
        (Some((status, body)), _) => {
            let status = reqwest::StatusCode::from_u16(*status).unwrap_or(reqwest::StatusCode::BAD_GATEWAY);
            classify(status, &reqwest::header::HeaderMap::new(), body)
        }
        (None, Some((code, message))) => CallResult::Failed(CallError {
            kind: ErrorKind::Transient,
            cause: format!(
                "batch_{}",
                code.chars()
                    .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .take(40)
                    .collect::<String>()
            ),
            status: None,
            retry_after_ms: None,
            message: Some(message.chars().filter(|c| !c.is_control()).take(300).collect()),
        }),
        (None, None) => CallResult::Failed(CallError {
            kind: ErrorKind::Transient,
            cause: "batch_empty_line".into(),
            status: None,
            retry_after_ms: None,
            message: None,
        }),
    }
}

/// What a line's answer used, when it says.
fn line_usage(line: &OutputLine) -> Option<Usage> {
    let (_, body) = line.response.as_ref()?;
    let v: Value = serde_json::from_str(body).ok()?;
    v.get("usage").and_then(Usage::from_provider)
}

/// Whether a fault test asked this worker to pause at `point`.
fn pausing_at(point: &str) -> bool {
    std::env::var("BATCHFLEET_PAUSE_AT").is_ok_and(|v| v == point)
}

/// How long a batch's file waits for the sink to keep it.
const ARCHIVE_PATIENCE: Duration = Duration::from_secs(30);

/// A fault test's pause (`BATCHFLEET_PAUSE_AT=submitting|download|settle`:
/// before a create, after a download, halfway through settling a shard):
/// the worker stops there (logging it) until it is killed.
async fn pause_at(point: &str) {
    if pausing_at(point) {
        tracing::warn!(point, "paused for a fault test (BATCHFLEET_PAUSE_AT)");
        std::future::pending::<()>().await;
    }
}

/// A batch's output joined against its shard (see `Batcher::join`).
#[derive(Default)]
struct Joined {
    /// Each answered record's delivery, the answer it settles with, and the line's name.
    answers: Vec<(Delivery, BatchAnswer, String)>,
    /// Billed lines not used, as paid calls by partition.
    copies: Vec<(u32, PaidCall)>,
    counts: LineCounts,
    unreadable: u64,
}

/// A batch's output lines by record, in file order.
struct ByRecord {
    order: Vec<String>,
    lines: HashMap<String, Vec<OutputLine>>,
    unreadable: u64,
}

impl ByRecord {
    fn of(text: &str) -> ByRecord {
        let mut by = ByRecord {
            order: Vec::new(),
            lines: HashMap::new(),
            unreadable: 0,
        };
        for raw in text.lines().filter(|l| !l.trim().is_empty()) {
            match OutputLine::parse(raw) {
                Ok(line) => {
                    if !by.lines.contains_key(&line.custom_id) {
                        by.order.push(line.custom_id.clone());
                    }
                    by.lines.entry(line.custom_id.clone()).or_default().push(line);
                }
                Err(_) => by.unreadable += 1,
            }
        }
        by
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(id: &str, created_ms: u64, state: ShardState, status: &str, polled_ms: u64) -> Shard {
        let mut s = Shard::new(id.to_owned(), 0, "w", created_ms, 0);
        s.state = state;
        s.batch_id = Some(format!("batch-{id}"));
        s.provider_status = Some(status.to_owned());
        s.polled_ms = polled_ms;
        s
    }

    #[test]
    fn a_refusal_for_the_enqueued_limit_is_the_fleets_load_only_beside_a_batch_the_provider_took() {
        let me = shard("me", 1_000, ShardState::Ended, "failed", 2_000);
        // Still running, or ended in the same round as this refusal was read.
        assert!(enqueued_beside(
            &shard("a", 900, ShardState::Submitted, "in_progress", 1_500),
            &me
        ));
        assert!(enqueued_beside(
            &shard("b", 900, ShardState::Reconciled, "completed", 1_990),
            &me
        ));
        // Ended before this shard was packed, refused itself, never sent, or itself.
        assert!(!enqueued_beside(
            &shard("c", 100, ShardState::Reconciled, "completed", 900),
            &me
        ));
        assert!(!enqueued_beside(
            &shard("d", 900, ShardState::Reconciled, "failed", 1_990),
            &me
        ));
        let mut packed = shard("e", 900, ShardState::Packed, "", 0);
        packed.batch_id = None;
        assert!(!enqueued_beside(&packed, &me));
        assert!(!enqueued_beside(&me, &me));
    }
}

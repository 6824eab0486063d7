//! The files result sink: JSONL segments in a directory, one set for
//! results and one for failures, each segment fsync'd and renamed into place
//! whole, and a manifest listing every finished segment with its record
//! count and sha256.
//!
//! Layout of `sink.dir` for job J:
//!
//! ```text
//! J/manifest.json                 the job (expected records...) and every finished segment
//! J/results/p003-00000017.jsonl   one line per done record (the results table's columns)
//! J/failures/p003-00000017.jsonl  review, dropped, cancelled records (a log: the last line of a record wins)
//! J/ledger/p003-00000017.jsonl    the cost ledger: one line per paid call
//! J/revisions/<record id>-000001.jsonl  a person's edit of a written result (the output it replaced kept)
//! J/.open/                        segments being written, and a finished batch's pending acknowledgement
//! J/.locks/                       one lock file per partition, and one for the manifest
//! ```
//!
//! One writer holds a partition at a time (an exclusive `flock` on its lock
//! file, held while the writer lives and released by the kernel when its
//! process dies). Finishing a segment: fsync the open files, write the
//! pending acknowledgement (the segments and the sink stream entries they
//! hold), rename the segments into place, add them to the manifest, then
//! acknowledge the entries in Redis and remove the pending file. Whoever
//! takes the partition next rolls a pending file forward (the renamed
//! segments stay, the acknowledgement is repeated) and deletes open segments
//! that never got one: their entries are still pending in Redis and are
//! written again. A line is never counted unless its segment was renamed
//! whole, and the ids of the partition's last segments are kept to skip a
//! record that Redis hands over again (an acknowledgement an AOF restart
//! lost), so each record has exactly one line over all segments (and each
//! paid call one ledger line).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{Durable, FailureRow, Holdings, ResultRow, ResultSink, RevisionRow, SinkBatch, SinkEntry, SinkError};
use super::{SunkResult, blocking};
use crate::ids::RecordIds;
use crate::ledger::PaidCall;
use crate::manifest::Manifest;
use crate::spec::{JobSpec, SegmentLimits};
use crate::task::ResultRecord;

/// How many finished results segments of a partition the writer remembers
/// the ids of, to skip a record handed over again after Redis lost an
/// acknowledgement (at most the last second of them with `appendfsync
/// everysec`): such entries are pending again, and the writer looks for
/// pending entries after every segment it finishes and every
/// [`RESCAN`] while idle, so they are taken while their first lines are
/// still in this window (the window only moves when segments are written).
const RECENT_SEGMENTS: usize = 4;

/// How often a writer holding a partition with no open segment looks for
/// entries pending in Redis that it holds no segment for (a lost reply, an
/// acknowledgement Redis lost in a restart).
pub const RESCAN: Duration = Duration::from_secs(10);

/// The kinds of segments a batch is written into, each a directory.
const KINDS: [&str; 3] = ["results", "failures", "ledger"];

/// One finished segment, as the manifest lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    /// `results`, `failures`, `ledger` or `revisions`.
    pub kind: String,
    /// Relative to the job's directory.
    pub file: String,
    pub partition: u32,
    pub seq: u64,
    pub records: u64,
    pub bytes: u64,
    pub sha256: String,
}

/// `manifest.json`: what the job expects (from its manifest in Redis) and
/// every finished segment.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FilesManifest {
    pub job: String,
    #[serde(default)]
    pub expected_records: u64,
    #[serde(default)]
    pub datasets: serde_json::Value,
    #[serde(default)]
    pub versions: serde_json::Value,
    #[serde(default)]
    pub spec_sha256: String,
    #[serde(default)]
    pub updated_at: String,
    #[serde(default)]
    pub segments: Vec<Segment>,
}

/// A finished batch whose entries are not acknowledged yet
/// (`.open/pNNN.pending`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Pending {
    pub partition: u32,
    pub seq: u64,
    pub segments: Vec<Segment>,
    /// The sink stream entries the segments hold (or skipped as already there).
    pub entries: Vec<SinkEntry>,
    /// The results whose lines the sink holds: they leave Redis at the acknowledgement.
    pub sunk: Vec<SunkResult>,
    /// The keys of the paid calls whose lines the sink holds.
    #[serde(default)]
    pub paid: Vec<String>,
    /// Result lines that were new.
    pub written: u64,
    /// Found by the writer that took the partition over (its rows are not
    /// counted as written again).
    #[serde(skip)]
    pub recovered: bool,
}

/// The outcome of taking a partition.
pub enum Take {
    /// Another writer (another process) holds it.
    Busy,
    /// This writer holds it.
    Held,
}

/// A job's files sink, as one writer sees it.
pub struct FileSink {
    /// `sink.dir`, and the job's directory in it.
    dir: PathBuf,
    root: PathBuf,
    job: String,
    limits: SegmentLimits,
    parts: HashMap<u32, Part>,
}

struct Part {
    /// The partition's lock file, locked while this is alive.
    _lock: File,
    next_seq: u64,
    open: Option<Open>,
    /// A finished batch waiting for its acknowledgement.
    pending: Option<Pending>,
    /// While Some: the entries pending in Redis that no segment holds (a
    /// previous writer's, a lost reply...) are being taken over, from this
    /// cursor; set when the partition is taken, after each finished segment
    /// and every [`RESCAN`] while nothing is open.
    orphans: Option<String>,
    /// When the last take-over pass started.
    scanned: Instant,
    recent: VecDeque<Vec<String>>,
    recent_ids: HashSet<String>,
}

struct Open {
    seq: u64,
    started: Instant,
    results: SegWriter,
    failures: SegWriter,
    ledger: SegWriter,
    entries: Vec<SinkEntry>,
    sunk: Vec<SunkResult>,
    paid: Vec<String>,
    /// The record ids of its result lines and the keys of its ledger lines.
    ids: HashSet<String>,
}

struct SegWriter {
    kind: &'static str,
    tmp: PathBuf,
    file: Option<BufWriter<File>>,
    lines: u64,
    bytes: u64,
    sha: Sha256,
}

fn disk(what: &str, path: &Path, e: std::io::Error) -> SinkError {
    SinkError::Disk(format!("{what} {}: {e}", path.display()))
}

fn segment_name(partition: u32, seq: u64) -> String {
    format!("p{partition:03}-{seq:08}.jsonl")
}

/// Where a segment is written before it is renamed into place.
fn open_path(open_dir: &Path, kind: &str, partition: u32, seq: u64) -> PathBuf {
    open_dir.join(format!("{kind}-{}.tmp", segment_name(partition, seq)))
}

/// The job's directory under `dir`.
pub fn job_dir(dir: &Path, job: &str) -> Result<PathBuf, SinkError> {
    if job.is_empty() || job.starts_with('.') {
        return Err(SinkError::Schema(format!(
            "job name `{job}` cannot name a directory of the files sink (it starts with `.`)"
        )));
    }
    Ok(dir.join(job))
}

/// fsyncs a directory, so a rename in it survives a crash.
fn sync_dir(dir: &Path) -> Result<(), SinkError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| disk("cannot sync directory", dir, e))
}

/// Writes `bytes` to `path` whole: a temporary file of this process's own,
/// fsync'd, renamed over it.
pub(super) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), SinkError> {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("{}-{n}.tmp", std::process::id()));
    let mut f = File::create(&tmp).map_err(|e| disk("cannot create", &tmp, e))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .map_err(|e| disk("cannot write", &tmp, e))?;
    fs::rename(&tmp, path).map_err(|e| disk("cannot rename into place", path, e))?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

impl SegWriter {
    fn new(kind: &'static str, tmp: PathBuf) -> SegWriter {
        SegWriter {
            kind,
            tmp,
            file: None,
            lines: 0,
            bytes: 0,
            sha: Sha256::new(),
        }
    }

    fn append(&mut self, line: &[u8]) -> Result<(), SinkError> {
        if self.file.is_none() {
            let f = File::create(&self.tmp).map_err(|e| disk("cannot create", &self.tmp, e))?;
            self.file = Some(BufWriter::with_capacity(1 << 20, f));
        }
        let f = self.file.as_mut().expect("opened above");
        f.write_all(line)
            .and_then(|_| f.write_all(b"\n"))
            .map_err(|e| disk("cannot write", &self.tmp, e))?;
        self.sha.update(line);
        self.sha.update(b"\n");
        self.lines += 1;
        self.bytes += line.len() as u64 + 1;
        Ok(())
    }

    /// Flushes and fsyncs; the segment as the manifest will list it.
    fn seal(&mut self, partition: u32, seq: u64) -> Result<Option<Segment>, SinkError> {
        let Some(f) = self.file.take() else { return Ok(None) };
        let f = f
            .into_inner()
            .map_err(|e| disk("cannot write", &self.tmp, e.into_error()))?;
        f.sync_all().map_err(|e| disk("cannot sync", &self.tmp, e))?;
        Ok(Some(Segment {
            kind: self.kind.to_owned(),
            file: format!("{}/{}", self.kind, segment_name(partition, seq)),
            partition,
            seq,
            records: self.lines,
            bytes: self.bytes,
            sha256: hex::encode(std::mem::take(&mut self.sha).finalize()),
        }))
    }
}

impl FileSink {
    /// The sink of `job` in `dir` (created when absent).
    pub fn open(dir: &Path, job: &str, limits: SegmentLimits) -> Result<FileSink, SinkError> {
        let root = job_dir(dir, job)?;
        for sub in KINDS.iter().chain(&[".open", ".locks"]) {
            let d = root.join(sub);
            fs::create_dir_all(&d).map_err(|e| disk("cannot create directory", &d, e))?;
        }
        Ok(FileSink {
            dir: dir.to_owned(),
            root,
            job: job.to_owned(),
            limits,
            parts: HashMap::new(),
        })
    }

    /// The sink of `job` in `dir` to read (its holdings, results, ledger):
    /// nothing is created.
    pub fn reader(dir: &Path, job: &str, limits: SegmentLimits) -> Result<FileSink, SinkError> {
        Ok(FileSink {
            dir: dir.to_owned(),
            root: job_dir(dir, job)?,
            job: job.to_owned(),
            limits,
            parts: HashMap::new(),
        })
    }

    /// Takes partition `p` for this writer unless another holds it. Taking
    /// it rolls forward what a previous writer left: a pending
    /// acknowledgement is returned through [`FileSink::pending`], open
    /// segments without one are deleted.
    pub fn take(&mut self, p: u32) -> Result<Take, SinkError> {
        if self.parts.contains_key(&p) {
            return Ok(Take::Held);
        }
        let path = self.root.join(".locks").join(format!("p{p:03}.lock"));
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| disk("cannot open", &path, e))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => return Ok(Take::Busy),
            Err(fs::TryLockError::Error(e)) => return Err(disk("cannot lock", &path, e)),
        }
        let pending = self.roll_forward(p)?;
        let next_seq = self.last_seq(p)? + 1;
        let (recent, recent_ids) = self.recent_ids(p)?;
        self.parts.insert(
            p,
            Part {
                _lock: lock,
                next_seq,
                open: None,
                pending,
                orphans: Some("0-0".into()),
                scanned: Instant::now(),
                recent,
                recent_ids,
            },
        );
        Ok(Take::Held)
    }

    /// Completes what the partition's previous writer left behind.
    fn roll_forward(&self, p: u32) -> Result<Option<Pending>, SinkError> {
        let open = self.root.join(".open");
        let pending_path = open.join(format!("p{p:03}.pending"));
        let pending: Option<Pending> = match fs::read(&pending_path) {
            Ok(bytes) => Some(Pending {
                recovered: true,
                ..serde_json::from_slice(&bytes)
                    .map_err(|e| SinkError::Disk(format!("{} cannot be read: {e}", pending_path.display())))?
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(disk("cannot read", &pending_path, e)),
        };
        if let Some(pend) = &pending {
            for s in &pend.segments {
                let tmp = open_path(&open, &s.kind, p, s.seq);
                let dest = self.root.join(&s.file);
                if tmp.exists() {
                    fs::rename(&tmp, &dest).map_err(|e| disk("cannot rename into place", &dest, e))?;
                }
            }
            for d in KINDS {
                sync_dir(&self.root.join(d))?;
            }
            self.add_to_manifest(&pend.segments)?;
        }
        // Open segments that got no pending file (never counted, their
        // entries are still pending in Redis), and a pending file that was
        // not written whole.
        let (segment, pending_tmp) = (format!("-p{p:03}-"), format!("p{p:03}."));
        for entry in fs::read_dir(&open).map_err(|e| disk("cannot read directory", &open, e))? {
            let entry = entry.map_err(|e| disk("cannot read directory", &open, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.ends_with(".tmp") && (name.contains(&segment) || name.starts_with(&pending_tmp)) {
                let _ = fs::remove_file(entry.path());
            }
        }
        Ok(pending)
    }

    /// The highest segment number of the partition on disk (0 when none).
    fn last_seq(&self, p: u32) -> Result<u64, SinkError> {
        let mut last = 0;
        for d in KINDS {
            for (part, seq, _) in list_segments(&self.root.join(d))? {
                if part == p {
                    last = last.max(seq);
                }
            }
        }
        Ok(last)
    }

    /// The record ids of the partition's last results segments, and the
    /// call keys of its last ledger segments (by segment number).
    fn recent_ids(&self, p: u32) -> Result<(VecDeque<Vec<String>>, HashSet<String>), SinkError> {
        let mut segs: BTreeMap<u64, Vec<PathBuf>> = BTreeMap::new();
        for d in ["results", "ledger"] {
            for (part, seq, path) in list_segments(&self.root.join(d))? {
                if part == p {
                    segs.entry(seq).or_default().push(path);
                }
            }
        }
        let mut recent = VecDeque::new();
        let mut ids = HashSet::new();
        for paths in segs.values().rev().take(RECENT_SEGMENTS).rev() {
            let mut these = Vec::new();
            for path in paths {
                each_line(path, |line| {
                    if let Ok(id) = serde_json::from_str::<IdOnly>(line) {
                        these.push(id.key());
                    }
                })?;
            }
            ids.extend(these.iter().cloned());
            recent.push_back(these);
        }
        Ok((recent, ids))
    }

    /// Lets go of a partition (after a failure): its open segment is
    /// discarded, and whoever takes it next writes its entries again.
    pub fn release(&mut self, p: u32) {
        self.parts.remove(&p);
    }

    /// A finished batch of the partition still to be acknowledged in Redis.
    pub fn pending(&self, p: u32) -> Option<&Pending> {
        self.parts.get(&p)?.pending.as_ref()
    }

    /// The acknowledgement of the pending batch is done: its file goes.
    pub fn acknowledged(&mut self, p: u32) -> Result<(), SinkError> {
        if let Some(part) = self.parts.get_mut(&p) {
            part.pending = None;
        }
        let path = self.root.join(".open").join(format!("p{p:03}.pending"));
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(disk("cannot remove", &path, e)),
        }
    }

    /// The cursor of the take-over of pending entries no segment holds
    /// (None once every one was taken). With no segment open, a new pass
    /// starts every [`RESCAN`].
    pub fn orphans(&mut self, p: u32) -> Option<&str> {
        let part = self.parts.get_mut(&p)?;
        if part.orphans.is_none() && part.open.is_none() && part.scanned.elapsed() >= RESCAN {
            part.orphans = Some("0-0".into());
            part.scanned = Instant::now();
        }
        part.orphans.as_deref()
    }

    pub fn set_orphans(&mut self, p: u32, cursor: Option<String>) {
        if let Some(part) = self.parts.get_mut(&p) {
            part.orphans = cursor;
        }
    }

    /// Appends a batch to the partition's open segments (opened when none
    /// is). A result or paid call already in the sink (in this segment or
    /// the recent ones) gets no second line; it still leaves Redis with the
    /// rest.
    pub fn append(
        &mut self,
        p: u32,
        entries: &[SinkEntry],
        rows: &[ResultRow],
        sunk: &[SunkResult],
        failures: &[FailureRow],
        paid: &[PaidCall],
    ) -> Result<(), SinkError> {
        let open_dir = self.root.join(".open");
        let part = self
            .parts
            .get_mut(&p)
            .ok_or_else(|| SinkError::Disk(format!("partition {p} is not held")))?;
        if part.open.is_none() {
            let seq = part.next_seq;
            part.next_seq += 1;
            let tmp = |kind: &str| open_path(&open_dir, kind, p, seq);
            part.open = Some(Open {
                seq,
                started: Instant::now(),
                results: SegWriter::new("results", tmp("results")),
                failures: SegWriter::new("failures", tmp("failures")),
                ledger: SegWriter::new("ledger", tmp("ledger")),
                entries: Vec::new(),
                sunk: Vec::new(),
                paid: Vec::new(),
                ids: HashSet::new(),
            });
        }
        let Some(open) = part.open.as_mut() else { return Ok(()) };
        for f in failures {
            open.failures.append(&serde_json::to_vec(f).unwrap_or_default())?;
        }
        for (row, s) in rows.iter().zip(sunk) {
            if !part.recent_ids.contains(&row.record_id) && open.ids.insert(row.record_id.clone()) {
                open.results.append(&serde_json::to_vec(row).unwrap_or_default())?;
            }
            open.sunk.push(s.clone());
        }
        for call in paid {
            let key = call.key();
            if !part.recent_ids.contains(&key) && open.ids.insert(key.clone()) {
                open.ledger.append(call.line().as_bytes())?;
            }
            open.paid.push(key);
        }
        open.entries.extend_from_slice(entries);
        Ok(())
    }

    /// Whether the partition's open segment is due to be finished.
    pub fn due(&self, p: u32) -> bool {
        let Some(open) = self.parts.get(&p).and_then(|part| part.open.as_ref()) else {
            return false;
        };
        let l = &self.limits;
        let writers = [&open.results, &open.failures, &open.ledger];
        writers.iter().map(|w| w.lines as usize).sum::<usize>() >= l.records
            || writers.iter().map(|w| w.bytes).sum::<u64>() >= l.bytes
            || open.started.elapsed() >= l.age
    }

    /// Whether the partition has an open segment.
    pub fn is_open(&self, p: u32) -> bool {
        self.parts.get(&p).is_some_and(|part| part.open.is_some())
    }

    /// Finishes the partition's open segment: fsync'd, its pending
    /// acknowledgement written, renamed into place, added to the manifest.
    /// The batch is then [`FileSink::pending`] until acknowledged.
    pub fn finish(&mut self, p: u32) -> Result<(), SinkError> {
        let root = self.root.clone();
        let Some(part) = self.parts.get_mut(&p) else {
            return Ok(());
        };
        let Some(mut open) = part.open.take() else {
            return Ok(());
        };
        let mut segments = Vec::new();
        let mut tmps = Vec::new();
        for w in [&mut open.results, &mut open.failures, &mut open.ledger] {
            if let Some(s) = w.seal(p, open.seq)? {
                tmps.push((w.tmp.clone(), root.join(&s.file)));
                segments.push(s);
            }
        }
        let pending = Pending {
            partition: p,
            seq: open.seq,
            written: open.results.lines,
            segments,
            entries: open.entries,
            sunk: open.sunk,
            paid: open.paid,
            recovered: false,
        };
        let bytes = serde_json::to_vec(&pending).unwrap_or_default();
        write_atomic(&root.join(".open").join(format!("p{p:03}.pending")), &bytes)?;
        for (tmp, dest) in &tmps {
            fs::rename(tmp, dest).map_err(|e| disk("cannot rename into place", dest, e))?;
        }
        for d in KINDS {
            sync_dir(&root.join(d))?;
        }
        let ids: Vec<String> = open.ids.into_iter().collect();
        if !ids.is_empty() {
            part.recent_ids.extend(ids.iter().cloned());
            part.recent.push_back(ids);
            while part.recent.len() > RECENT_SEGMENTS {
                for id in part.recent.pop_front().unwrap_or_default() {
                    part.recent_ids.remove(&id);
                }
            }
        }
        part.pending = Some(pending);
        // Whatever is still pending once this batch is acknowledged, no
        // segment holds: the next rounds take it over.
        part.orphans = Some("0-0".into());
        part.scanned = Instant::now();
        let segments = part.pending.as_ref().map(|p| p.segments.clone()).unwrap_or_default();
        self.add_to_manifest(&segments)
    }

    /// Adds segments to `manifest.json` (each once), under the manifest's lock.
    fn add_to_manifest(&self, segments: &[Segment]) -> Result<(), SinkError> {
        if segments.is_empty() {
            return Ok(());
        }
        self.edit_manifest(|m| {
            for s in segments {
                if !m.segments.iter().any(|have| have.file == s.file) {
                    m.segments.push(s.clone());
                }
            }
        })
    }

    /// Keeps the job's part of `manifest.json` as its manifest in Redis says.
    pub fn write_job(&self, job: &Manifest) -> Result<(), SinkError> {
        self.edit_manifest(|m| {
            m.expected_records = job.expected_records;
            m.datasets = serde_json::to_value(&job.datasets).unwrap_or_default();
            m.versions = serde_json::to_value(&job.versions).unwrap_or_default();
            m.spec_sha256 = job.spec_sha256.clone();
        })
    }

    fn edit_manifest(&self, edit: impl FnOnce(&mut FilesManifest)) -> Result<(), SinkError> {
        let _lock = lock_manifest(&self.root)?;
        edit_manifest_locked(&self.root, &self.job, edit)
    }
}

/// How long a writer waits for the manifest's lock before it gives up
/// (and retries the batch later): a process stopped while holding it must
/// not stop every writer for good.
const MANIFEST_LOCK_WAIT: Duration = Duration::from_secs(30);

/// The manifest's lock, held until it is dropped: within this process a
/// mutex (where `flock` is emulated with per-process locks, as on NFS, the
/// file lock alone would not keep this process's writers apart), across
/// processes the lock file.
struct ManifestLock {
    _file: File,
    _guard: std::sync::MutexGuard<'static, ()>,
}

fn lock_manifest(root: &Path) -> Result<ManifestLock, SinkError> {
    static IN_PROCESS: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let guard = IN_PROCESS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let lock_path = root.join(".locks").join("manifest.lock");
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| disk("cannot open", &lock_path, e))?;
    let since = Instant::now();
    loop {
        match lock.try_lock() {
            Ok(()) => break,
            Err(fs::TryLockError::WouldBlock) if since.elapsed() < MANIFEST_LOCK_WAIT => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(fs::TryLockError::WouldBlock) => {
                return Err(SinkError::Disk(format!(
                    "{} is held by another process for {}s: is a worker stopped?",
                    lock_path.display(),
                    MANIFEST_LOCK_WAIT.as_secs()
                )));
            }
            Err(fs::TryLockError::Error(e)) => return Err(disk("cannot lock", &lock_path, e)),
        }
    }
    Ok(ManifestLock {
        _file: lock,
        _guard: guard,
    })
}

/// Rewrites `manifest.json` whole (the caller holds its lock).
fn edit_manifest_locked(root: &Path, job: &str, edit: impl FnOnce(&mut FilesManifest)) -> Result<(), SinkError> {
    let path = root.join("manifest.json");
    let mut m = read_manifest(root)?.unwrap_or_else(|| FilesManifest {
        job: job.to_owned(),
        ..FilesManifest::default()
    });
    edit(&mut m);
    m.segments
        .sort_by(|a, b| (&a.kind, a.partition, a.seq, &a.file).cmp(&(&b.kind, b.partition, b.seq, &b.file)));
    m.updated_at = crate::manifest::now_rfc3339();
    let bytes = serde_json::to_vec_pretty(&m).unwrap_or_default();
    write_atomic(&path, &bytes)
}

/// Every revision in the manifest, by record, oldest first.
fn revisions_of(root: &Path, m: &FilesManifest) -> Result<HashMap<String, Vec<RevisionRow>>, SinkError> {
    let mut out: HashMap<String, Vec<RevisionRow>> = HashMap::new();
    for s in m.segments.iter().filter(|s| s.kind == "revisions") {
        let path = root.join(&s.file);
        each_line(&path, |line| {
            if let Ok(r) = serde_json::from_str::<RevisionRow>(line) {
                out.entry(r.record_id.clone()).or_default().push(r);
            }
        })?;
    }
    for v in out.values_mut() {
        v.sort_by_key(|r| r.revision);
    }
    Ok(out)
}

/// A person's edit of a result the segments hold, as an explicit revision:
/// a file of its own (`revisions/<record id>-NNNNNN.jsonl`, written whole)
/// with the output it replaces, listed in the manifest; the result's line
/// is never rewritten. Returns the revision number, or None when no
/// segment holds a result for the record.
pub fn revise(
    dir: &Path,
    job: &str,
    written: &Written,
    output: &serde_json::Value,
    reviewer: &str,
    note: Option<&str>,
) -> Result<u32, SinkError> {
    let root = job_dir(dir, job)?;
    let rid = written.rid.as_str();
    let _lock = lock_manifest(&root)?;
    let m = read_manifest(&root)?.unwrap_or_default();
    let before = revisions_of(&root, &m)?.remove(rid).unwrap_or_default();
    let previous = before
        .last()
        .map_or_else(|| written.output.clone(), |last| last.output.clone());
    let revision = before.last().map_or(0, |r| r.revision) + 1;
    let row = RevisionRow {
        record_id: rid.to_owned(),
        revision,
        job: job.to_owned(),
        previous,
        output: output.clone(),
        reviewer: reviewer.to_owned(),
        note: note.map(str::to_owned),
        revised_at: crate::manifest::now_rfc3339(),
    };
    let mut line = serde_json::to_vec(&row).unwrap_or_default();
    line.push(b'\n');
    let revisions = root.join("revisions");
    fs::create_dir_all(&revisions).map_err(|e| disk("cannot create directory", &revisions, e))?;
    let file = format!("revisions/{rid}-{revision:06}.jsonl");
    write_atomic(&root.join(&file), &line)?;
    let segment = Segment {
        kind: "revisions".into(),
        file,
        partition: 0,
        seq: u64::try_from(revision).unwrap_or(0),
        records: 1,
        bytes: line.len() as u64,
        sha256: hex::encode(Sha256::digest(&line)),
    };
    edit_manifest_locked(&root, job, |m| m.segments.push(segment))?;
    Ok(u32::try_from(revision).unwrap_or(0))
}

/// A record's result as its line in the segments holds it (found once:
/// listed segments never change, so no lock is needed to read them).
pub struct Written {
    rid: String,
    output: serde_json::Value,
    /// The whole line, as the result it was written from.
    pub result: ResultRecord,
}

impl Written {
    /// The output as it is now: the latest revision's, else the line's.
    pub fn current(&self, dir: &Path, job: &str) -> Result<serde_json::Value, SinkError> {
        let root = job_dir(dir, job)?;
        let m = read_manifest(&root)?.unwrap_or_default();
        let latest = revisions_of(&root, &m)?
            .remove(&self.rid)
            .and_then(|v| v.last().map(|r| r.output.clone()));
        Ok(latest.unwrap_or_else(|| self.output.clone()))
    }
}

/// The result line of a record (None when no segment holds one).
pub fn find_written(dir: &Path, job: &str, rid: &str) -> Result<Option<Written>, SinkError> {
    let root = job_dir(dir, job)?;
    Ok(written_row(&root, rid)?.and_then(|row| {
        let output = serde_json::from_str::<serde_json::Value>(row.output.get()).ok()?;
        Some(Written {
            rid: rid.to_owned(),
            output,
            result: row.into_record(),
        })
    }))
}

/// The line of a record's result, as its row.
fn written_row(root: &Path, rid: &str) -> Result<Option<ResultRow>, SinkError> {
    if rid.is_empty() || !rid.chars().all(|c| c.is_ascii_alphanumeric()) {
        return Ok(None);
    }
    let m = read_manifest(root)?.unwrap_or_default();
    let mut found = None;
    for s in m.segments.iter().filter(|s| s.kind == "results") {
        each_line(&root.join(&s.file), |line| {
            if found.is_none()
                && serde_json::from_str::<IdOnly>(line).is_ok_and(|id| id.record_id == rid)
                && let Ok(row) = serde_json::from_str::<ResultRow>(line)
            {
                found = Some(row);
            }
        })?;
        if found.is_some() {
            break;
        }
    }
    Ok(found)
}

/// What tells a line of a results segment (its record id) or of a ledger
/// segment (its call key) from any other.
#[derive(Deserialize)]
struct IdOnly {
    record_id: String,
    #[serde(default)]
    call_key: Option<String>,
}

impl IdOnly {
    fn key(self) -> String {
        self.call_key.unwrap_or(self.record_id)
    }
}

/// `(partition, seq, path)` of every finished segment in `dir`.
fn list_segments(dir: &Path) -> Result<Vec<(u32, u64, PathBuf)>, SinkError> {
    let mut out = Vec::new();
    let rd = match fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(disk("cannot read directory", dir, e)),
    };
    for entry in rd {
        let entry = entry.map_err(|e| disk("cannot read directory", dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let parsed = name
            .strip_prefix('p')
            .and_then(|n| n.strip_suffix(".jsonl"))
            .and_then(|n| n.split_once('-'))
            .and_then(|(p, s)| Some((p.parse().ok()?, s.parse().ok()?)));
        if let Some((p, seq)) = parsed {
            out.push((p, seq, entry.path()));
        }
    }
    Ok(out)
}

fn each_line(path: &Path, mut f: impl FnMut(&str)) -> Result<(), SinkError> {
    let file = File::open(path).map_err(|e| disk("cannot read", path, e))?;
    for line in BufReader::new(file).lines() {
        f(&line.map_err(|e| disk("cannot read", path, e))?);
    }
    Ok(())
}

/// The job's `manifest.json` (None before the first segment).
pub fn read_manifest(root: &Path) -> Result<Option<FilesManifest>, SinkError> {
    let path = root.join("manifest.json");
    match fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| SinkError::Disk(format!("{} cannot be read: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(disk("cannot read", &path, e)),
    }
}

impl ResultSink for FileSink {
    type Target = PathBuf;

    async fn open(dir: &PathBuf, job: &str, spec: &JobSpec) -> Result<FileSink, SinkError> {
        FileSink::open(dir, job, spec.sink.segment_limits())
    }

    fn kind(&self) -> &'static str {
        "files"
    }

    fn holds_partitions(&self) -> bool {
        true
    }

    fn take(&mut self, p: u32) -> Result<bool, SinkError> {
        Ok(matches!(blocking(|| FileSink::take(self, p))?, Take::Held))
    }

    fn take_over(&mut self, p: u32) -> Option<String> {
        self.orphans(p).map(str::to_owned)
    }

    fn taken_over(&mut self, p: u32, next: Option<String>) {
        self.set_orphans(p, next);
    }

    fn release(&mut self, p: u32) {
        FileSink::release(self, p);
    }

    /// Appended to the partition's open segments: nothing is refused.
    async fn store(
        &mut self,
        _job: &str,
        p: u32,
        entries: &[SinkEntry],
        batch: &SinkBatch,
    ) -> Result<Vec<(String, String)>, SinkError> {
        let b = batch;
        blocking(|| self.append(p, entries, &b.results, &b.sunk, &b.failures, &b.paid))?;
        Ok(Vec::new())
    }

    fn seal(&mut self, p: u32, now: bool) -> Result<(), SinkError> {
        if self.is_open(p) && (now || self.due(p)) {
            blocking(|| self.finish(p))?;
        }
        Ok(())
    }

    fn durable(&self, p: u32) -> Option<Durable<'_>> {
        self.pending(p).map(|pending| Durable {
            entries: &pending.entries,
            sunk: &pending.sunk,
            paid: &pending.paid,
            written: pending.written,
            recovered: pending.recovered,
        })
    }

    fn acknowledged(&mut self, p: u32) -> Result<(), SinkError> {
        blocking(|| FileSink::acknowledged(self, p))
    }

    async fn write_job(&self, manifest: &Manifest) -> Result<(), SinkError> {
        blocking(|| FileSink::write_job(self, manifest))
    }

    async fn holdings(&self, job: &str) -> Result<Holdings, SinkError> {
        blocking(|| check(&self.dir, job))
    }

    async fn results(&self, job: &str, f: impl FnMut(ResultRecord)) -> Result<u64, SinkError> {
        blocking(|| results(&self.dir, job, f))
    }

    async fn ledger(&self, job: &str, f: impl FnMut(PaidCall)) -> Result<u64, SinkError> {
        blocking(|| ledger(&self.dir, job, f))
    }
}

/// Reads and checks every segment of `job` in `dir`.
pub fn check(dir: &Path, job: &str) -> Result<Holdings, SinkError> {
    let root = job_dir(dir, job)?;
    let manifest = read_manifest(&root)?.unwrap_or_default();
    let mut c = Holdings {
        segments: Some(manifest.segments.len() as u64),
        ..Holdings::default()
    };
    let listed: HashSet<&str> = manifest.segments.iter().map(|s| s.file.as_str()).collect();
    for d in KINDS {
        for (_, _, path) in list_segments(&root.join(d))? {
            let rel = format!("{d}/{}", path.file_name().unwrap_or_default().to_string_lossy());
            if !listed.contains(rel.as_str()) {
                c.unlisted.push(rel);
            }
        }
    }
    c.unlisted.sort();
    // A record's failures are in its partition, oldest first: read in the
    // manifest's order (partition, then segment number), the last line of a
    // record wins. Failures are read before results, and a record with a
    // result is no open failure: the results' ids are never looked up.
    let mut last: HashMap<String, String> = HashMap::new();
    // Each paid call by 16 bytes of its key's sha256 (not the key's text):
    // enough to tell them apart, a sixth of the memory, spilled to disk
    // past a few megabytes as the results' ids are.
    let mut calls = RecordIds::default();
    let mut segments: Vec<_> = manifest.segments.iter().enumerate().collect();
    segments.sort_by_key(|(_, s)| s.kind != "failures");
    let mut damaged = Vec::new();
    for (at, s) in segments {
        let path = root.join(&s.file);
        let mut sha = Sha256::new();
        let mut lines = 0u64;
        let read = each_line(&path, |line| {
            sha.update(line.as_bytes());
            sha.update(b"\n");
            lines += 1;
            if s.kind == "results" {
                if let Ok(id) = serde_json::from_str::<IdOnly>(line) {
                    last.remove(&id.record_id);
                    c.result_ids.push(&id.record_id);
                }
            } else if s.kind == "failures"
                && let Ok(f) = serde_json::from_str::<FailureRow>(line)
            {
                last.insert(f.record_id, f.state);
            } else if s.kind == "ledger"
                && let Ok(id) = serde_json::from_str::<IdOnly>(line)
            {
                calls.push_bytes(&Sha256::digest(id.key().as_bytes())[..16]);
            }
        });
        if read.is_err() || lines != s.records || hex::encode(sha.finalize()) != s.sha256 {
            damaged.push((at, s.file.clone()));
        }
    }
    // In the manifest's order.
    damaged.sort_unstable();
    c.damaged = damaged.into_iter().map(|(_, f)| f).collect();
    (c.ledger_calls, c.ledger_duplicates) = calls.distinct().map_err(|e| {
        disk(
            "cannot read back the ledger's keys spilled in",
            &std::env::temp_dir(),
            e,
        )
    })?;
    for state in last.into_values() {
        *c.open_failures.entry(state).or_default() += 1;
    }
    Ok(c)
}

/// Every result line of `job` in `dir`, as the result it was written from
/// with its revisions (the latest one's output is its output), one at a time.
pub fn results(dir: &Path, job: &str, mut f: impl FnMut(ResultRecord)) -> Result<u64, SinkError> {
    let root = job_dir(dir, job)?;
    let manifest = read_manifest(&root)?.unwrap_or_default();
    let revisions = revisions_of(&root, &manifest)?;
    let mut n = 0;
    for s in manifest.segments.iter().filter(|s| s.kind == "results") {
        let path = root.join(&s.file);
        let mut bad = None;
        each_line(&path, |line| match serde_json::from_str::<ResultRow>(line) {
            Ok(row) => {
                let r = row.into_record();
                f(match revisions.get(&r.record_id) {
                    Some(v) => super::with_revisions(r, v),
                    None => r,
                });
                n += 1;
            }
            Err(e) => bad = Some(e.to_string()),
        })?;
        if let Some(e) = bad {
            return Err(SinkError::Disk(format!(
                "{} holds a line that is no result: {e}",
                path.display()
            )));
        }
    }
    Ok(n)
}

/// Every paid call in the ledger segments of `job` in `dir`, each once,
/// one at a time.
pub fn ledger(dir: &Path, job: &str, mut f: impl FnMut(PaidCall)) -> Result<u64, SinkError> {
    let root = job_dir(dir, job)?;
    let manifest = read_manifest(&root)?.unwrap_or_default();
    let mut seen = HashSet::new();
    let mut n = 0;
    for s in manifest.segments.iter().filter(|s| s.kind == "ledger") {
        let path = root.join(&s.file);
        let mut bad = None;
        each_line(&path, |line| match PaidCall::from_line(line) {
            Ok(call) => {
                if seen.insert(call.key()) {
                    f(call);
                    n += 1;
                }
            }
            Err(e) => bad = Some(e),
        })?;
        if let Some(e) = bad {
            return Err(SinkError::Disk(format!(
                "{} holds a line that is no paid call: {e}",
                path.display()
            )));
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory of its own, removed at the end of the test.
    struct TempDir(PathBuf);

    impl TempDir {
        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn tempdir() -> TempDir {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let d = std::env::temp_dir().join(format!("bf-files-{}-{n}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }

    fn limits() -> SegmentLimits {
        SegmentLimits {
            records: 1000,
            bytes: 1 << 30,
            age: Duration::from_secs(3600),
        }
    }

    fn result(rid: &str) -> ResultRecord {
        ResultRecord {
            record_id: rid.into(),
            key: format!("k-{rid}"),
            output: serde_json::from_str(r#"{"label":"a"}"#).unwrap(),
            attempts: 1,
            calls: 1,
            response_id: None,
            repairs: vec![],
            usage: None,
            history: vec![],
            model: "m".into(),
            versions: BTreeMap::new(),
            human: false,
            reviewer: None,
            worker: None,
            committed_at: "2026-01-01T00:00:00Z".into(),
            input: None,
            revisions: Vec::new(),
        }
    }

    fn entry(n: u32, rid: &str) -> SinkEntry {
        SinkEntry {
            entry_id: format!("{n}-0"),
            rid: rid.into(),
            result: true,
            call: None,
        }
    }

    fn append(sink: &mut FileSink, rids: &[&str]) {
        let (rows, sunk): (Vec<ResultRow>, Vec<SunkResult>) = rids
            .iter()
            .map(|r| ResultRow::parse(&result(r).encode(), &Default::default()).unwrap())
            .unzip();
        let entries: Vec<SinkEntry> = rids.iter().enumerate().map(|(i, r)| entry(i as u32, r)).collect();
        sink.append(0, &entries, &rows, &sunk, &[], &[]).unwrap();
    }

    #[test]
    fn a_finished_segment_is_listed_checked_and_read_back() {
        let dir = tempdir();
        let mut sink = FileSink::open(dir.path(), "j", limits()).unwrap();
        assert!(matches!(sink.take(0).unwrap(), Take::Held));
        append(&mut sink, &["a", "b"]);
        // A record handed over twice in the open segment: one line.
        append(&mut sink, &["b", "c"]);
        sink.finish(0).unwrap();
        let pending = sink.pending(0).unwrap();
        assert_eq!((pending.written, pending.entries.len(), pending.sunk.len()), (3, 4, 4));
        sink.acknowledged(0).unwrap();
        let c = check(dir.path(), "j").unwrap();
        assert_eq!(c.result_ids.to_strings().unwrap(), ["a", "b", "c"]);
        assert!(c.damaged.is_empty() && c.unlisted.is_empty(), "{c:?}");
        let mut read = Vec::new();
        results(dir.path(), "j", |r| read.push((r.record_id, r.key))).unwrap();
        assert_eq!(read[0], ("a".to_owned(), "k-a".to_owned()));
        // Handed over again after a lost acknowledgement: no second line.
        append(&mut sink, &["c", "d"]);
        sink.finish(0).unwrap();
        assert_eq!(
            check(dir.path(), "j").unwrap().result_ids.to_strings().unwrap(),
            ["a", "b", "c", "d"]
        );
    }

    #[test]
    fn a_paid_call_is_one_ledger_line_however_often_it_is_handed_over() {
        let dir = tempdir();
        let mut sink = FileSink::open(dir.path(), "j", limits()).unwrap();
        sink.take(0).unwrap();
        let task: crate::task::Task =
            serde_json::from_value(serde_json::json!({"rid": "a", "input": {"text": "hi"}})).unwrap();
        let usage = crate::task::Usage {
            prompt: 10,
            completion: 2,
            total: 12,
            ..Default::default()
        };
        let call = PaidCall::new(&task, 1, 1, 1, "w", usage, &Default::default(), 5);
        let other = PaidCall::new(&task, 2, 2, 1, "w", usage, &Default::default(), 6);
        let e = |n: u32| SinkEntry {
            call: Some(format!("c{n}")),
            result: false,
            ..entry(n, "a")
        };
        sink.append(0, &[e(1)], &[], &[], &[], std::slice::from_ref(&call))
            .unwrap();
        sink.finish(0).unwrap();
        assert_eq!(sink.pending(0).unwrap().paid, [call.key()]);
        sink.acknowledged(0).unwrap();
        // Handed over again (a lost acknowledgement), with a new call: one line more.
        sink.append(0, &[e(1), e(2)], &[], &[], &[], &[call.clone(), other.clone()])
            .unwrap();
        sink.finish(0).unwrap();
        assert_eq!(sink.pending(0).unwrap().paid.len(), 2, "both leave Redis");
        let c = check(dir.path(), "j").unwrap();
        assert_eq!((c.ledger_calls, c.ledger_duplicates), (2, 0));
        assert!(c.damaged.is_empty() && c.unlisted.is_empty(), "{c:?}");
        // A writer that takes the partition over remembers the calls too.
        drop(sink);
        let mut again = FileSink::open(dir.path(), "j", limits()).unwrap();
        again.take(0).unwrap();
        again.acknowledged(0).unwrap();
        again
            .append(0, &[e(2)], &[], &[], &[], std::slice::from_ref(&other))
            .unwrap();
        again.finish(0).unwrap();
        assert_eq!(check(dir.path(), "j").unwrap().ledger_duplicates, 0);
        let mut read = Vec::new();
        ledger(dir.path(), "j", |c| read.push(c)).unwrap();
        read.sort_by_key(|c| c.call);
        assert_eq!(read, [call, other], "read back as they were");
    }

    #[test]
    fn another_writer_finds_the_partition_busy_until_the_first_is_gone() {
        let dir = tempdir();
        let mut one = FileSink::open(dir.path(), "j", limits()).unwrap();
        let mut two = FileSink::open(dir.path(), "j", limits()).unwrap();
        assert!(matches!(one.take(0).unwrap(), Take::Held));
        assert!(matches!(two.take(0).unwrap(), Take::Busy));
        assert!(matches!(two.take(1).unwrap(), Take::Held));
        drop(one);
        assert!(matches!(two.take(0).unwrap(), Take::Held));
    }

    #[test]
    fn a_writer_that_died_mid_segment_leaves_no_line_and_one_that_died_after_the_rename_is_rolled_forward() {
        let dir = tempdir();
        let mut one = FileSink::open(dir.path(), "j", limits()).unwrap();
        one.take(0).unwrap();
        append(&mut one, &["a"]);
        one.finish(0).unwrap();
        // Died before acknowledging: the next writer gets the pending batch.
        append(&mut one, &["b"]);
        drop(one); // and died mid-segment with `b`
        let mut two = FileSink::open(dir.path(), "j", limits()).unwrap();
        two.take(0).unwrap();
        let pending = two.pending(0).expect("rolled forward");
        assert_eq!(pending.entries.len(), 1);
        assert!(
            fs::read_dir(dir.path().join("j/.open"))
                .unwrap()
                .all(|e| { !e.unwrap().file_name().to_string_lossy().ends_with(".tmp") })
        );
        two.acknowledged(0).unwrap();
        let c = check(dir.path(), "j").unwrap();
        assert_eq!(c.result_ids.to_strings().unwrap(), ["a"]);
        // The next segment number follows the finished one.
        append(&mut two, &["b"]);
        two.finish(0).unwrap();
        let m = read_manifest(&dir.path().join("j")).unwrap().unwrap();
        assert_eq!(m.segments.iter().map(|s| s.seq).collect::<Vec<_>>(), [1, 2]);
    }

    #[test]
    fn a_rename_the_writer_did_not_reach_is_done_by_the_next() {
        let dir = tempdir();
        let mut one = FileSink::open(dir.path(), "j", limits()).unwrap();
        one.take(0).unwrap();
        append(&mut one, &["a"]);
        one.finish(0).unwrap();
        // As if the writer died between the pending file and the rename.
        let seg = dir.path().join("j/results").join(segment_name(0, 1));
        let tmp = open_path(&dir.path().join("j/.open"), "results", 0, 1);
        fs::rename(&seg, &tmp).unwrap();
        drop(one);
        let mut two = FileSink::open(dir.path(), "j", limits()).unwrap();
        two.take(0).unwrap();
        assert!(seg.exists());
        assert_eq!(check(dir.path(), "j").unwrap().result_ids.to_strings().unwrap(), ["a"]);
    }

    #[test]
    fn a_damaged_segment_and_an_unlisted_one_are_found() {
        let dir = tempdir();
        let mut one = FileSink::open(dir.path(), "j", limits()).unwrap();
        one.take(0).unwrap();
        append(&mut one, &["a"]);
        one.finish(0).unwrap();
        let seg = dir.path().join("j/results").join(segment_name(0, 1));
        fs::write(&seg, "{\"record_id\":\"z\"}\n").unwrap();
        fs::write(dir.path().join("j/results").join(segment_name(0, 9)), "").unwrap();
        let c = check(dir.path(), "j").unwrap();
        assert_eq!(c.damaged, ["results/p000-00000001.jsonl"]);
        assert_eq!(c.unlisted, ["results/p000-00000009.jsonl"]);
    }

    #[test]
    fn a_revision_is_a_file_of_its_own_and_keeps_what_it_replaced() {
        let dir = tempdir();
        let mut sink = FileSink::open(dir.path(), "j", limits()).unwrap();
        sink.take(0).unwrap();
        append(&mut sink, &["aa", "bb"]);
        sink.finish(0).unwrap();
        let aa = find_written(dir.path(), "j", "aa").unwrap().unwrap();
        assert!(find_written(dir.path(), "j", "cc").unwrap().is_none(), "no such result");
        let first = serde_json::json!({"label": "b"});
        assert_eq!(revise(dir.path(), "j", &aa, &first, "ann", Some("typo")).unwrap(), 1);
        assert_eq!(
            aa.current(dir.path(), "j").unwrap(),
            first,
            "the latest revision's output"
        );
        let second = serde_json::json!({"label": "c"});
        assert_eq!(revise(dir.path(), "j", &aa, &second, "bob", None).unwrap(), 2);
        let mut read = HashMap::new();
        results(dir.path(), "j", |r| {
            read.insert(r.record_id.clone(), r);
        })
        .unwrap();
        let a = &read["aa"];
        assert_eq!(
            (a.output["label"].as_str(), a.reviewer.as_deref(), a.human),
            (Some("c"), Some("bob"), true)
        );
        let kept: Vec<_> = a
            .revisions
            .iter()
            .map(|v| (v.revision, v.previous["label"].clone()))
            .collect();
        assert_eq!(kept, [(1, "a".into()), (2, "b".into())]);
        assert!(read["bb"].revisions.is_empty());
        let c = check(dir.path(), "j").unwrap();
        assert_eq!(
            c.result_ids.to_strings().unwrap(),
            ["aa", "bb"],
            "a revision is no second result"
        );
        assert!(c.damaged.is_empty() && c.unlisted.is_empty(), "{c:?}");
    }

    #[test]
    fn a_job_name_cannot_climb_out_of_the_directory() {
        let dir = tempdir();
        assert!(FileSink::open(dir.path(), "..", limits()).is_err());
    }
}

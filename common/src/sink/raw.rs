//! The audit trail's bytes: every response body a provider sent for a job,
//! kept in its sink under the sha256 of those bytes, so a result row can be
//! traced to the answer that produced it (`producer trace`).
//!
//! Content-addressed, so keeping the same bytes twice (a redelivered
//! answer, two workers) adds nothing and needs no coordination:
//!
//! - files: `<dir>/<job>/raw/<first two hex digits>/<sha256>`, written to a
//!   temporary file, fsync'd and renamed into place (never half a body);
//! - PostgreSQL: the table `<table>_raw` (`sha256` primary key, `body`
//!   bytea), `ON CONFLICT DO NOTHING`;
//! - memory: beside the job's rows.
//!
//! The bytes are the body as the worker kept it: a secret the provider
//! echoed back was already replaced (nothing secret is ever stored), and the
//! hash is of the bytes kept, so it always verifies. The worker keeps an
//! answer's bytes before it stores the record's outcome.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use super::{Memory, PgSink, SinkError, Target};
use crate::spec::JobSpec;

/// The lowercase hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Where one job's raw responses are kept.
pub enum RawStore {
    /// The job's `raw/` directory.
    Files(PathBuf),
    /// `<table>_raw`, over a connection opened when first needed (and again
    /// after it broke).
    Postgres {
        url: String,
        table: String,
        job: String,
        db: tokio::sync::Mutex<Option<Arc<PgSink>>>,
    },
    Memory(Memory, String),
}

impl RawStore {
    /// The raw store beside `job`'s sink.
    pub fn of(target: &Target, job: &str, spec: &JobSpec) -> Result<RawStore, SinkError> {
        Ok(match target {
            Target::Files(dir) => RawStore::Files(super::files::job_dir(dir, job)?.join("raw")),
            Target::Postgres(url) => RawStore::Postgres {
                url: url.clone(),
                table: spec.sink.table().to_owned(),
                job: job.to_owned(),
                db: tokio::sync::Mutex::new(None),
            },
            Target::Memory(memory) => RawStore::Memory(memory.clone(), job.to_owned()),
        })
    }

    /// Where `sha` is kept, for people: a path relative to the sink's
    /// directory, or the table.
    pub fn place(&self, sha: &str) -> String {
        match self {
            RawStore::Files(dir) => blob_path(dir, sha).display().to_string(),
            RawStore::Postgres { table, .. } => format!("{table}_raw"),
            RawStore::Memory(..) => "memory".to_owned(),
        }
    }

    /// Keeps `bytes` under their sha256 (returned); kept already is kept.
    pub async fn keep(&self, bytes: &[u8]) -> Result<String, SinkError> {
        let sha = sha256_hex(bytes);
        match self {
            RawStore::Files(dir) => {
                let (path, bytes) = (blob_path(dir, &sha), bytes.to_vec());
                tokio::task::spawn_blocking(move || keep_file(&path, &bytes))
                    .await
                    .map_err(|e| SinkError::Disk(format!("raw response writer: {e}")))??;
            }
            RawStore::Postgres { job, .. } => {
                let db = self.db().await?;
                let kept = db.keep_raw(job, &sha, bytes).await;
                self.forget_if_closed(&db).await;
                kept?;
            }
            RawStore::Memory(memory, job) => memory.keep_raw(job, &sha, bytes),
        }
        Ok(sha)
    }

    /// The bytes kept under `sha`, if any.
    pub async fn read(&self, sha: &str) -> Result<Option<Vec<u8>>, SinkError> {
        if sha.len() != 64 || !sha.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Ok(None);
        }
        match self {
            RawStore::Files(dir) => match std::fs::read(blob_path(dir, sha)) {
                Ok(bytes) => Ok(Some(bytes)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(SinkError::Disk(format!(
                    "cannot read {}: {e}",
                    blob_path(dir, sha).display()
                ))),
            },
            RawStore::Postgres { .. } => {
                let db = self.db().await?;
                let read = db.raw(sha).await;
                self.forget_if_closed(&db).await;
                read
            }
            RawStore::Memory(memory, job) => Ok(memory.raw(job, sha)),
        }
    }

    /// Opens what it needs ahead of the first response (PostgreSQL: the
    /// connection and its table), so the first keep is as quick as the rest.
    pub async fn warm(&self) -> Result<(), SinkError> {
        match self {
            RawStore::Postgres { .. } => self.db().await.map(|_| ()),
            RawStore::Files(dir) => std::fs::create_dir_all(dir)
                .map_err(|e| SinkError::Disk(format!("cannot create {}: {e}", dir.display()))),
            RawStore::Memory(..) => Ok(()),
        }
    }

    async fn db(&self) -> Result<Arc<PgSink>, SinkError> {
        let RawStore::Postgres { url, table, db, .. } = self else {
            unreachable!("only a PostgreSQL raw store has a database")
        };
        let mut held = db.lock().await;
        if let Some(db) = held.as_ref().filter(|db| !db.is_closed()) {
            return Ok(db.clone());
        }
        let opened = Arc::new(PgSink::connect_raw(url, table).await?);
        *held = Some(opened.clone());
        Ok(opened)
    }

    async fn forget_if_closed(&self, used: &Arc<PgSink>) {
        if let RawStore::Postgres { db, .. } = self
            && used.is_closed()
        {
            db.lock().await.take();
        }
    }
}

fn blob_path(dir: &Path, sha: &str) -> PathBuf {
    dir.join(&sha[..2]).join(sha)
}

/// Writes a blob whole unless it is there: a temporary file of this
/// process's own, fsync'd, renamed into place, its directory fsync'd.
fn keep_file(path: &Path, bytes: &[u8]) -> Result<(), SinkError> {
    if path.exists() {
        return Ok(());
    }
    let dir = path.parent().expect("a blob has a directory");
    std::fs::create_dir_all(dir).map_err(|e| SinkError::Disk(format!("cannot create {}: {e}", dir.display())))?;
    super::files::write_atomic(path, bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn files_keep_each_body_once_under_its_hash() {
        let dir = std::env::temp_dir().join(format!(
            "batchfleet-raw-{}-{:x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        let store = RawStore::Files(dir.join("raw"));
        let body = br#"{"id":"chatcmpl-1","choices":[]}"#;
        let sha = store.keep(body).await.unwrap();
        assert_eq!(sha, sha256_hex(body));
        assert_eq!(store.keep(body).await.unwrap(), sha, "kept again: the same name");
        assert_eq!(store.read(&sha).await.unwrap().as_deref(), Some(&body[..]));
        let files: Vec<_> = walk(&dir.join("raw"));
        assert_eq!(files.len(), 1, "one file, no temporary left: {files:?}");
        assert!(files[0].ends_with(&format!("{}/{sha}", &sha[..2])));
        assert_eq!(store.read(&"0".repeat(64)).await.unwrap(), None);
        assert_eq!(
            store.read("../../etc/passwd").await.unwrap(),
            None,
            "only a hash names a blob"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn memory_keeps_per_job() {
        let memory = Memory::default();
        let a = RawStore::Memory(memory.clone(), "a".into());
        let b = RawStore::Memory(memory, "b".into());
        let sha = a.keep(b"x").await.unwrap();
        assert_eq!(a.read(&sha).await.unwrap(), Some(b"x".to_vec()));
        assert_eq!(b.read(&sha).await.unwrap(), None);
    }

    fn walk(dir: &Path) -> Vec<String> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            if e.path().is_dir() {
                out.extend(walk(&e.path()));
            } else {
                out.push(e.path().display().to_string());
            }
        }
        out
    }
}

//! What the Batch API server keeps: its files' and batches' records in Redis
//! (one hash each, so a restarted server, or another replica, serves the
//! same ones), the files' bytes on disk under `--data-dir`.

use common::store::{RedisStore, StoreError};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

const FILES: &str = "bf:oai:files";
const BATCHES: &str = "bf:oai:batches";
/// The ids of the batches not ended yet: what each poll reads, however many
/// ended batches the server keeps.
const OPEN: &str = "bf:oai:open";

/// An uploaded (or produced) file, as the Files API shows it, and whose it is.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FileRow {
    pub id: String,
    pub filename: String,
    pub purpose: String,
    pub bytes: u64,
    pub created_at: u64,
    /// The key's name that uploaded it (or whose batch produced it).
    pub owner: String,
}

impl FileRow {
    /// The File object of the API.
    pub fn object(&self) -> Value {
        json!({
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": null,
            "expires_at": null,
        })
    }
}

/// A batch: the Batch object as served, and what only the server knows.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BatchRow {
    pub owner: String,
    /// The fleet job that runs its lines.
    pub job: String,
    /// The named template whose `[output]` validates answers (None: the
    /// provider spec's own).
    pub template: Option<String>,
    /// How it ends once nothing is left to run: `cancelled` or `expired`
    /// (None: `completed`).
    #[serde(default)]
    pub ending: Option<String>,
    /// The custom ids of the input file are validated and the job is enqueued.
    #[serde(default)]
    pub enqueued: bool,
    pub batch: Value,
}

impl BatchRow {
    pub fn id(&self) -> &str {
        self.batch["id"].as_str().unwrap_or_default()
    }

    pub fn status(&self) -> &str {
        self.batch["status"].as_str().unwrap_or_default()
    }

    /// Sets the status and its `<status>_at` time.
    pub fn set_status(&mut self, status: &str, now: u64) {
        self.batch["status"] = json!(status);
        let at = format!("{status}_at");
        if self.batch.get(&at).is_some() {
            self.batch[at] = json!(now);
        }
    }

    pub fn is_terminal(&self) -> bool {
        matches!(self.status(), "completed" | "failed" | "expired" | "cancelled")
    }
}

async fn hset(store: &RedisStore, key: &str, id: &str, value: String) -> Result<(), StoreError> {
    let mut conn = store.connection();
    redis::cmd("HSET")
        .arg(key)
        .arg(id)
        .arg(value)
        .query_async::<()>(&mut conn)
        .await?;
    Ok(())
}

async fn hget<T: for<'de> Deserialize<'de>>(store: &RedisStore, key: &str, id: &str) -> Result<Option<T>, StoreError> {
    let mut conn = store.connection();
    let text: Option<String> = redis::cmd("HGET").arg(key).arg(id).query_async(&mut conn).await?;
    Ok(text.and_then(|t| serde_json::from_str(&t).ok()))
}

async fn hvals<T: for<'de> Deserialize<'de>>(store: &RedisStore, key: &str) -> Result<Vec<T>, StoreError> {
    let mut conn = store.connection();
    let all: Vec<(String, String)> = redis::cmd("HGETALL").arg(key).query_async(&mut conn).await?;
    Ok(all.iter().filter_map(|(_, v)| serde_json::from_str(v).ok()).collect())
}

pub async fn put_file(store: &RedisStore, f: &FileRow) -> Result<(), StoreError> {
    hset(store, FILES, &f.id, serde_json::to_string(f).unwrap_or_default()).await
}

pub async fn file(store: &RedisStore, id: &str) -> Result<Option<FileRow>, StoreError> {
    hget(store, FILES, id).await
}

pub async fn files(store: &RedisStore) -> Result<Vec<FileRow>, StoreError> {
    hvals(store, FILES).await
}

pub async fn forget_file(store: &RedisStore, id: &str) -> Result<(), StoreError> {
    let mut conn = store.connection();
    redis::cmd("HDEL")
        .arg(FILES)
        .arg(id)
        .query_async::<()>(&mut conn)
        .await?;
    Ok(())
}

/// What [`put_batch`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Put {
    Stored,
    /// Not stored: the stored batch has ended, and stays as it ended.
    Ended,
    /// Not stored: the stored batch holds an ending (a cancel) this one
    /// lacks; read it again, take its ending, and store that.
    Ending,
}

/// Stores a batch's record, and whether it is open, together, unless the
/// stored one has ended or holds an ending `b` lacks: whichever of the poll
/// and a cancel writes last, an ended batch stays as it ended and a stored
/// cancel is never written over.
pub async fn put_batch(store: &RedisStore, b: &BatchRow) -> Result<Put, StoreError> {
    const PUT: &str = r#"
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur then
  local ok, row = pcall(cjson.decode, cur)
  if ok and type(row) == 'table' and type(row.batch) == 'table' then
    local s = row.batch.status
    if s == 'completed' or s == 'failed' or s == 'expired' or s == 'cancelled' then return 0 end
    if type(row.ending) == 'string' and ARGV[4] == '0' then return 2 end
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if ARGV[3] == '1' then redis.call('SREM', KEYS[2], ARGV[1]) else redis.call('SADD', KEYS[2], ARGV[1]) end
return 1
"#;
    let mut conn = store.connection();
    let stored: i64 = redis::Script::new(PUT)
        .key(BATCHES)
        .key(OPEN)
        .arg(b.id())
        .arg(serde_json::to_string(b).unwrap_or_default())
        .arg(if b.is_terminal() { "1" } else { "0" })
        .arg(if b.ending.is_some() { "1" } else { "0" })
        .invoke_async(&mut conn)
        .await?;
    Ok(match stored {
        1 => Put::Stored,
        2 => Put::Ending,
        _ => Put::Ended,
    })
}

/// The batches not ended yet.
pub async fn open_batches(store: &RedisStore) -> Result<Vec<BatchRow>, StoreError> {
    let mut conn = store.connection();
    let ids: Vec<String> = redis::cmd("SMEMBERS").arg(OPEN).query_async(&mut conn).await?;
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let texts: Vec<Option<String>> = redis::cmd("HMGET")
        .arg(BATCHES)
        .arg(&ids)
        .query_async(&mut conn)
        .await?;
    Ok(texts
        .iter()
        .flatten()
        .filter_map(|t| serde_json::from_str(t).ok())
        .collect())
}

/// Marks every batch not ended as open (the records of a server that kept
/// no open set yet); run once at start.
pub async fn reopen(store: &RedisStore) -> Result<(), StoreError> {
    let open: Vec<String> = batches(store)
        .await?
        .into_iter()
        .filter(|b| !b.is_terminal())
        .map(|b| b.id().to_owned())
        .collect();
    if !open.is_empty() {
        let mut conn = store.connection();
        redis::cmd("SADD")
            .arg(OPEN)
            .arg(&open)
            .query_async::<()>(&mut conn)
            .await?;
    }
    Ok(())
}

pub async fn batch(store: &RedisStore, id: &str) -> Result<Option<BatchRow>, StoreError> {
    hget(store, BATCHES, id).await
}

pub async fn batches(store: &RedisStore) -> Result<Vec<BatchRow>, StoreError> {
    hvals(store, BATCHES).await
}

/// Claims an idempotency key for `batch_id` (`SET NX`): None when it was
/// free, else the batch it already names.
pub async fn claim_idempotency(
    store: &RedisStore,
    owner: &str,
    key: &str,
    batch_id: &str,
    ttl_secs: u64,
) -> Result<Option<String>, StoreError> {
    let name = format!(
        "bf:oai:idem:{}",
        common::sink::sha256_hex(format!("{owner}\n{key}").as_bytes())
    );
    let mut conn = store.connection();
    let set: Option<String> = redis::cmd("SET")
        .arg(&name)
        .arg(batch_id)
        .arg("NX")
        .arg("EX")
        .arg(ttl_secs)
        .query_async(&mut conn)
        .await?;
    if set.is_some() {
        return Ok(None);
    }
    let held: Option<String> = redis::cmd("GET").arg(&name).query_async(&mut conn).await?;
    Ok(held)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(status: &str) -> BatchRow {
        BatchRow {
            owner: "alice".into(),
            job: "oai-b1".into(),
            template: None,
            ending: None,
            enqueued: true,
            batch: json!({"id": "batch_b1", "status": status}),
        }
    }

    /// The poll and a cancel both write a batch; whichever writes last, an
    /// ended batch stays as it ended, and the open set follows.
    #[tokio::test]
    async fn an_ended_batch_is_never_written_over() {
        let redis = harness::RedisServer::start();
        let store = RedisStore::connect(&redis.url()).await.unwrap();
        assert_eq!(put_batch(&store, &row("in_progress")).await.unwrap(), Put::Stored);
        let mut cancelling = row("cancelling");
        cancelling.ending = Some("cancelled".into());
        assert_eq!(
            put_batch(&store, &cancelling).await.unwrap(),
            Put::Stored,
            "a running batch takes the cancel"
        );
        assert_eq!(open_batches(&store).await.unwrap().len(), 1);
        // A poll that read the batch before the cancel does not write over it.
        assert_eq!(put_batch(&store, &row("in_progress")).await.unwrap(), Put::Ending);
        assert_eq!(put_batch(&store, &row("completed")).await.unwrap(), Put::Ending);
        let mut ended = row("cancelled");
        ended.ending = Some("cancelled".into());
        assert_eq!(put_batch(&store, &ended).await.unwrap(), Put::Stored);
        assert!(open_batches(&store).await.unwrap().is_empty());
        assert_eq!(
            put_batch(&store, &cancelling).await.unwrap(),
            Put::Ended,
            "a cancel after the end"
        );
        let stored = batch(&store, "batch_b1").await.unwrap().unwrap();
        assert_eq!(stored.status(), "cancelled");
        assert!(
            open_batches(&store).await.unwrap().is_empty(),
            "the ended batch reopened"
        );
    }
}

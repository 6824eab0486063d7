//! Wake-ups: whoever puts work on a stream (enqueue, a promoted retry, a
//! requeue, resume) or changes a job's flags (halt, cancel, resume) adds an
//! entry to `bf:wake`; idle workers wait on it with one blocking XREAD
//! instead of polling every partition of every job.

use redis::{AsyncCommands, Value};

use super::worker_ops::{as_array, as_string};
use super::{RedisStore, StoreError};
use crate::keys;

/// Entries `bf:wake` keeps (it is a signal, not a log).
const WAKE_KEEP: usize = 1000;

/// Why a wake-up was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// Tasks were added to a job's streams.
    Work,
    /// A job was halted, cancelled or resumed.
    Flags,
    /// A concurrency slot was freed while someone waited for one.
    Slot,
}

impl Wake {
    fn name(self) -> &'static str {
        match self {
            Wake::Work => "work",
            Wake::Flags => "flags",
            Wake::Slot => "slot",
        }
    }
}

impl RedisStore {
    /// Wakes the idle fleet (`what` about `job`). Best effort: what it
    /// signals is already in Redis, and idle workers look again after their
    /// idle poll anyway, so a failure is logged, never returned.
    pub async fn wake(&self, job: &str, what: Wake) {
        if let Err(e) = self.send_wake(job, what).await {
            tracing::warn!(job, error = %e, "could not wake the idle fleet (it looks again after its idle poll)");
        }
    }

    async fn send_wake(&self, job: &str, what: Wake) -> Result<(), StoreError> {
        let _: Value = redis::cmd("XADD")
            .arg(keys::wake())
            .arg("MAXLEN")
            .arg("~")
            .arg(WAKE_KEEP)
            .arg("*")
            .arg("j")
            .arg(job)
            .arg("k")
            .arg(what.name())
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(())
    }

    /// The id of the last wake-up so far ("0-0" when there was none): a
    /// wait from there misses nothing sent after this call.
    pub async fn wake_cursor(&self) -> Result<String, StoreError> {
        let info: Result<Value, redis::RedisError> = redis::cmd("XINFO")
            .arg("STREAM")
            .arg(keys::wake())
            .query_async(&mut self.conn.clone())
            .await;
        let info = match info {
            Ok(v) => v,
            // No wake-up was ever sent.
            Err(e) if e.code() == Some("ERR") => return Ok("0-0".into()),
            Err(e) => return Err(e.into()),
        };
        Ok(super::worker_ops::info_fields(&info)
            .into_iter()
            .find(|(k, _)| k == "last-generated-id")
            .and_then(|(_, v)| as_string(v))
            .unwrap_or_else(|| "0-0".into()))
    }

    /// Waits up to `block_ms` for wake-ups after `after` (None: none
    /// came). Blocks the connection: a store of its own.
    pub async fn wait_wake(&self, after: &str, block_ms: u64) -> Result<Option<Woken>, StoreError> {
        let reply: Value = redis::cmd("XREAD")
            .arg("COUNT")
            .arg(WAKE_KEEP)
            .arg("BLOCK")
            .arg(block_ms.max(1))
            .arg("STREAMS")
            .arg(keys::wake())
            .arg(after)
            .query_async(&mut self.conn.clone())
            .await?;
        // [[stream, [[id, fields], ...]]] (RESP2) or {stream: [[id, fields], ...]} (RESP3), or nil
        let entries: Vec<&Value> = match &reply {
            Value::Map(m) => m.iter().flat_map(|(_, v)| as_array(v)).collect(),
            other => as_array(other)
                .iter()
                .flat_map(|s| as_array(s).get(1).map(as_array).unwrap_or_default())
                .collect(),
        };
        let Some(last) = entries.last().and_then(|e| as_array(e).first()).and_then(as_string) else {
            return Ok(None);
        };
        let mut woken = Woken {
            last,
            flags: false,
            slots: Vec::new(),
        };
        for e in &entries {
            let fields = as_array(e).get(1).map(as_array).unwrap_or_default();
            let field = |name: &str| {
                fields
                    .chunks_exact(2)
                    .find(|kv| as_string(&kv[0]).as_deref() == Some(name))
                    .and_then(|kv| as_string(&kv[1]))
            };
            match field("k").as_deref() {
                Some(k) if k == Wake::Flags.name() => woken.flags = true,
                Some(k) if k == Wake::Slot.name() => woken.slots.extend(field("j")),
                _ => {}
            }
        }
        Ok(Some(woken))
    }
}

/// What a [`RedisStore::wait_wake`] saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Woken {
    /// The last wake-up's id: the next wait starts after it.
    pub last: String,
    /// Some job's flags changed (a halt, cancel or resume).
    pub flags: bool,
    /// The limiters (ids) of which a worker waited for a concurrency slot
    /// and one came free.
    pub slots: Vec<String>,
}

impl RedisStore {
    /// Redis's clock, in Unix ms: the one clock every worker and reader of
    /// heartbeats agrees on.
    pub async fn server_ms(&self) -> Result<u64, StoreError> {
        let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut self.conn.clone()).await?;
        Ok(secs * 1000 + micros / 1000)
    }

    /// Writes a worker's heartbeat (its field of `bf:workers`); its
    /// `seen_ms` is Redis's clock (the writer keeps a reading of it).
    pub async fn beat(&self, beat: &crate::heartbeat::Heartbeat) -> Result<(), StoreError> {
        let _: () = self.conn.clone().hset(keys::workers(), &beat.id, beat.encode()).await?;
        Ok(())
    }

    /// Every worker's last heartbeat, by id, and Redis's clock now to judge
    /// them by. Entries no version can read are left out (and removed by
    /// [`RedisStore::forget_workers`]).
    pub async fn workers(&self) -> Result<(Vec<crate::heartbeat::Heartbeat>, u64), StoreError> {
        let all: Vec<(String, String)> = self.conn.clone().hgetall(keys::workers()).await?;
        let mut beats: Vec<_> = all
            .iter()
            .filter_map(|(_, v)| crate::heartbeat::Heartbeat::decode(v))
            .collect();
        beats.sort_by(|a, b| a.id.cmp(&b.id));
        Ok((beats, self.server_ms().await?))
    }

    /// Removes the entries of workers whose heartbeat expired (by Redis's
    /// clock), and entries that are no heartbeat; returns how many.
    pub async fn forget_workers(&self) -> Result<usize, StoreError> {
        let all: Vec<(String, String)> = self.conn.clone().hgetall(keys::workers()).await?;
        let now = self.server_ms().await?;
        let gone: Vec<&String> = all
            .iter()
            .filter(|(_, v)| crate::heartbeat::Heartbeat::decode(v).is_none_or(|b| b.expired(now)))
            .map(|(id, _)| id)
            .collect();
        if !gone.is_empty() {
            let _: () = self.conn.clone().hdel(keys::workers(), &gone).await?;
        }
        Ok(gone.len())
    }
}

//! The store's verbs of provider batch mode: pack a partition's queued
//! tasks into a shard (moved out of the stream atomically), keep the
//! shard's state with compare-and-set, read the tasks it holds, give back
//! the ones its batch never answered, and count its tokens against the
//! provider's enqueued-token limit. A shard's records are settled through
//! [`RedisStore::finish_many`] like any outcome, fenced by the shard.

use std::collections::BTreeMap;

use redis::AsyncCommands;

use super::{RedisStore, StoreError};
use crate::keys;
use crate::shard::Shard;
use crate::task::{Delivery, Task};

/// What packing a shard came to.
#[derive(Debug)]
pub struct Packed {
    /// Tasks moved into the shard.
    pub moved: u64,
    /// Tasks marked to run online, delivered to this consumer (pending in
    /// the stream as any claim).
    pub online: Vec<Delivery>,
}

impl RedisStore {
    /// The next shard id of a partition (`p<partition>-<number>`).
    pub async fn next_shard_id(&self, job: &str, partition: u32) -> Result<String, StoreError> {
        let n: u64 = self.conn.clone().hincr(keys::shard_seq(job, partition), "n", 1).await?;
        Ok(format!("p{partition}-{n:06}"))
    }

    /// Moves up to `max` new entries of a partition's stream into `shard`
    /// (registered as it is given when it holds any), in one atomic step;
    /// up to `max_online` entries marked online are delivered to `consumer`
    /// instead (any more go back to the stream's end).
    pub async fn shard_pack(
        &self,
        job: &str,
        partition: u32,
        consumer: &str,
        (max, max_online): (usize, usize),
        shard: &Shard,
    ) -> Result<Packed, StoreError> {
        let reply: Vec<redis::Value> = self
            .scripts
            .shard
            .key(keys::stream(job, partition))
            .key(keys::state(job, partition))
            .key(keys::shards(job, partition))
            .key(keys::shard(job, partition, &shard.id))
            .key(keys::shard_packed(job, partition, &shard.id))
            .arg("pack")
            .arg(keys::GROUP)
            .arg(consumer)
            .arg(max.max(1))
            .arg(&shard.id)
            .arg(shard.encode())
            .arg(max_online)
            .invoke_async(&mut self.conn.clone())
            .await?;
        let text = |v: &redis::Value| match v {
            redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
            redis::Value::SimpleString(s) => s.clone(),
            _ => String::new(),
        };
        let moved = match reply.first() {
            Some(redis::Value::Int(n)) => u64::try_from(*n).unwrap_or(0),
            _ => 0,
        };
        let mut online = Vec::new();
        for e in reply[1.min(reply.len())..].chunks(3) {
            let [id, rid, task] = e else { continue };
            let (id, rid, task) = (text(id), text(rid), text(task));
            let Ok(task) = Task::from_entry_fields([("rid", rid.as_str()), ("task", task.as_str())]) else {
                continue;
            };
            online.push(Delivery {
                partition,
                entry_id: id,
                deliveries: 1,
                consumer: consumer.to_owned(),
                claimed_at: tokio::time::Instant::now(),
                task,
                state_at_claim: None,
                shard: None,
            });
        }
        Ok(Packed { moved, online })
    }

    /// Every shard of a partition, each with its JSON as read (for
    /// [`RedisStore::shard_cas`]).
    pub async fn shards(&self, job: &str, partition: u32) -> Result<Vec<(String, Shard)>, StoreError> {
        let key = keys::shards(job, partition);
        let all: BTreeMap<String, String> = self.conn.clone().hgetall(&key).await?;
        all.into_values()
            .map(|text| {
                Shard::decode(&text)
                    .map(|s| (text, s))
                    .map_err(|reason| StoreError::Corrupt {
                        key: key.clone(),
                        reason,
                    })
            })
            .collect()
    }

    /// Replaces a shard's state if it is still `read`. Returns whether it was.
    pub async fn shard_cas(&self, job: &str, partition: u32, read: &str, new: &Shard) -> Result<bool, StoreError> {
        let n: i64 = self
            .scripts
            .shard
            .key(keys::stream(job, partition))
            .key(keys::state(job, partition))
            .key(keys::shards(job, partition))
            .key(keys::shard(job, partition, &new.id))
            .key(keys::shard_packed(job, partition, &new.id))
            .arg("cas")
            .arg(&new.id)
            .arg(read)
            .arg(new.encode())
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(n == 1)
    }

    /// The tasks a shard holds.
    pub async fn shard_tasks(&self, job: &str, partition: u32, shard_id: &str) -> Result<Vec<Task>, StoreError> {
        let key = keys::shard(job, partition, shard_id);
        let mut out = Vec::new();
        let mut bad = None;
        self.scan_hash(&key, |rid, text| {
            match Task::from_entry_fields([("rid", rid.as_str()), ("task", text.as_str())]) {
                Ok(t) => out.push(t),
                Err(e) => bad = Some(e.to_string()),
            }
        })
        .await?;
        match bad {
            Some(reason) => Err(StoreError::Corrupt { key, reason }),
            None => Ok(out),
        }
    }

    /// The record ids packed into a shard.
    pub async fn shard_packed(
        &self,
        job: &str,
        partition: u32,
        shard_id: &str,
    ) -> Result<std::collections::HashSet<String>, StoreError> {
        Ok(self
            .conn
            .clone()
            .smembers(keys::shard_packed(job, partition, shard_id))
            .await?)
    }

    /// When the oldest entry of a partition's stream was added (Unix ms).
    pub async fn stream_oldest_ms(&self, job: &str, partition: u32) -> Result<Option<u64>, StoreError> {
        let first: redis::streams::StreamRangeReply = self
            .conn
            .clone()
            .xrange_count(keys::stream(job, partition), "-", "+", 1)
            .await?;
        Ok(first.ids.first().and_then(|e| e.id.split('-').next()?.parse().ok()))
    }

    /// Counts `n` more provider batches of the job that failed validation
    /// (0: only reads). Returns how many did since the job started or was
    /// last resumed.
    pub async fn batch_failed(&self, job: &str, n: u64) -> Result<u64, StoreError> {
        Ok(self.conn.clone().hincr(keys::batch_failures(job), "n", n).await?)
    }

    /// A reconciled shard no longer needs its packed set.
    pub async fn shard_forget(&self, job: &str, partition: u32, shard_id: &str) -> Result<(), StoreError> {
        let _: () = self
            .conn
            .clone()
            .del(keys::shard_packed(job, partition, shard_id))
            .await?;
        Ok(())
    }

    /// How many tasks a shard still holds.
    pub async fn shard_held(&self, job: &str, partition: u32, shard_id: &str) -> Result<u64, StoreError> {
        Ok(self.conn.clone().hlen(keys::shard(job, partition, shard_id)).await?)
    }

    /// Gives records a shard holds back to the stream (their batch never
    /// answered them: not an attempt). Returns how many went back.
    pub async fn shard_release(
        &self,
        job: &str,
        partition: u32,
        shard_id: &str,
        rids: &[String],
    ) -> Result<u64, StoreError> {
        let mut n = 0;
        for chunk in rids.chunks(1000) {
            let mut inv = self.scripts.shard.prepare_invoke();
            inv.key(keys::stream(job, partition))
                .key(keys::state(job, partition))
                .key(keys::shards(job, partition))
                .key(keys::shard(job, partition, shard_id))
                .key(keys::shard_packed(job, partition, shard_id))
                .arg("release")
                .arg(shard_id);
            for rid in chunk {
                inv.arg(rid);
            }
            let k: u64 = inv.invoke_async(&mut self.conn.clone()).await?;
            n += k;
        }
        Ok(n)
    }

    /// Calls `f` with every record id the partition's shards hold.
    pub async fn shard_rids(&self, job: &str, partition: u32, mut f: impl FnMut(String)) -> Result<(), StoreError> {
        for (_, s) in self.shards(job, partition).await? {
            self.hash_fields(&keys::shard(job, partition, &s.id), &mut f).await?;
        }
        Ok(())
    }

    /// Counts a shard's tokens against the provider's limit of tokens in
    /// unfinished batches, if they fit. Returns whether they were counted.
    pub async fn batch_tokens_take(
        &self,
        job: &str,
        shard_id: &str,
        tokens: u64,
        limit: u64,
    ) -> Result<bool, StoreError> {
        let n: i64 = self
            .scripts
            .batch_tokens
            .key(keys::batch_tokens(job))
            .arg("take")
            .arg(shard_id)
            .arg(tokens)
            .arg(limit)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(n == 1)
    }

    /// A shard's batch ended: its tokens no longer count.
    pub async fn batch_tokens_give(&self, job: &str, shard_id: &str) -> Result<(), StoreError> {
        let _: i64 = self
            .scripts
            .batch_tokens
            .key(keys::batch_tokens(job))
            .arg("give")
            .arg(shard_id)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(())
    }
}

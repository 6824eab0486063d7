//! Deleting a job: every key it has in Redis, named one by one (no SCAN:
//! on a Redis Cluster each partition's keys live in their own slot, and a
//! key pattern would reach one node only). The sink's rows are not Redis's
//! and are never touched.

use redis::AsyncCommands;

use super::{RedisStore, StoreError};
use crate::keys;

impl RedisStore {
    /// Tasks of the job delivered to a live worker (one whose consumer
    /// lease holds) and not yet acknowledged; a dead worker's are not counted.
    pub async fn held_by_live_workers(&self, job: &str, partitions: u32) -> Result<u64, StoreError> {
        let mut held = 0;
        for p in 0..partitions {
            let reply: redis::Value = redis::cmd("XPENDING")
                .arg(keys::stream(job, p))
                .arg(keys::GROUP)
                .query_async(&mut self.conn.clone())
                .await?;
            for (consumer, n) in pending_by_consumer(&reply) {
                let live: bool = self.conn.clone().exists(keys::consumer_lease(&consumer)).await?;
                if live {
                    held += n;
                }
            }
        }
        Ok(held)
    }

    /// Removes every key of the job (and its name from the jobs set).
    /// Returns the keys removed.
    pub async fn delete_job(&self, job: &str, partitions: u32) -> Result<u64, StoreError> {
        self.may_delete().await?;
        let mut c = self.conn.clone();
        // Out of the list first: a worker or console looking for jobs stops
        // finding it while its keys go.
        let _: () = c.srem(keys::jobs(), job).await?;
        let mut removed = 0;
        for p in 0..partitions {
            removed += self.delete_partition(job, p).await?;
        }
        removed += self.unlink(&job_keys(job)).await?;
        Ok(removed)
    }

    /// A partition's keys: each record's idempotency key (every record has
    /// a state entry), a page of the state hash at a time (memory stays flat
    /// however many records), its shards, then the partition's own keys.
    async fn delete_partition(&self, job: &str, p: u32) -> Result<u64, StoreError> {
        let (state, mut cursor, mut removed) = (keys::state(job, p), "0".to_owned(), 0);
        loop {
            let (next, rids) = self.hash_fields_page(&state, &cursor).await?;
            let idem: Vec<String> = rids.iter().map(|rid| keys::idem(job, p, rid)).collect();
            removed += self.unlink(&idem).await?;
            match next {
                Some(c) => cursor = c,
                None => break,
            }
        }
        let mut own = Vec::new();
        self.hash_fields(&keys::shards(job, p), |id| {
            own.push(keys::shard(job, p, &id));
            own.push(keys::shard_packed(job, p, &id));
        })
        .await?;
        own.extend(partition_keys(job, p));
        Ok(removed + self.unlink(&own).await?)
    }

    /// Only `producer delete` needs SREM and UNLINK (a user without them
    /// runs everything else): both are tried on nothing before anything is
    /// deleted, so a refusal leaves the job whole.
    async fn may_delete(&self) -> Result<(), StoreError> {
        let probe = "bf:{probe}:delete";
        let mut missing = Vec::new();
        for (name, mut cmd) in [("+srem", redis::cmd("SREM")), ("+unlink", redis::cmd("UNLINK"))] {
            if name == "+srem" {
                cmd.arg(keys::jobs()).arg(probe);
            } else {
                cmd.arg(probe);
            }
            match cmd.query_async::<redis::Value>(&mut self.conn.clone()).await {
                Err(e) if e.code() == Some("NOPERM") => missing.push(name.to_owned()),
                Err(e) => return Err(e.into()),
                Ok(_) => {}
            }
        }
        if missing.is_empty() {
            Ok(())
        } else {
            Err(StoreError::Permissions { missing })
        }
    }

    async fn unlink(&self, keys: &[String]) -> Result<u64, StoreError> {
        if keys.is_empty() {
            return Ok(0);
        }
        Ok(redis::cmd("UNLINK")
            .arg(keys)
            .query_async(&mut self.conn.clone())
            .await?)
    }
}

/// The keys of a job as a whole (its hash tag `{job}`).
pub fn job_keys(job: &str) -> Vec<String> {
    vec![
        keys::spec(job),
        keys::spec_changes(job),
        keys::manifest(job),
        keys::cursor(job),
        keys::enqueuing(job),
        keys::datasets(job),
        keys::dropped_lines(job),
        keys::halt(job),
        keys::resumed(job),
        keys::cancel(job),
        keys::deadline(job),
        keys::batch_failures(job),
        keys::batch_tokens(job),
        keys::budget(job),
        keys::budget_held(job),
        keys::counters(job),
        keys::breaker(job),
        keys::outage(job),
        keys::bulk_log(job),
    ]
}

/// The fixed keys of one partition (its hash tag `{job:pN}`); its records'
/// idempotency keys and its shards' keys are named from its hashes.
pub fn partition_keys(job: &str, p: u32) -> Vec<String> {
    vec![
        keys::stream(job, p),
        keys::state(job, p),
        keys::origins(job, p),
        keys::results(job, p),
        keys::ledger(job, p),
        keys::ledger_sunk(job, p),
        keys::spend(job, p),
        keys::stats(job, p),
        keys::shards(job, p),
        keys::shard_seq(job, p),
        keys::audit(job, p),
        keys::audited(job, p),
        keys::sink(job, p),
        keys::sunk(job, p),
        keys::review(job, p),
        keys::reviewed(job, p),
        keys::cancelled(job, p),
        keys::delayed(job, p),
    ]
}

/// The consumers of an XPENDING summary with their pending counts.
fn pending_by_consumer(reply: &redis::Value) -> Vec<(String, u64)> {
    let redis::Value::Array(parts) = reply else {
        return Vec::new();
    };
    let Some(redis::Value::Array(consumers)) = parts.get(3) else {
        return Vec::new();
    };
    consumers
        .iter()
        .filter_map(|c| match c {
            redis::Value::Array(pair) => match (pair.first(), pair.get(1)) {
                (Some(name), Some(n)) => Some((
                    redis::from_redis_value::<String>(name.clone()).ok()?,
                    redis::from_redis_value::<String>(n.clone()).ok()?.parse().ok()?,
                )),
                _ => None,
            },
            _ => None,
        })
        .collect()
}

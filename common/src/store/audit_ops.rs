//! The store's spot-check verbs: sample committed records into the audit
//! queue, find the next one waiting, record a person's verdict (once: a
//! second reviewer finds it judged), read the verdicts.

use std::collections::HashSet;

use redis::AsyncCommands;

use super::{RedisStore, StoreError};
use crate::audit::Verdict;
use crate::keys;

/// A committed record waiting for a spot check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditItem {
    pub record_id: String,
    pub partition: u32,
    /// Its input as sampled (None: its result carries it).
    pub input: Option<String>,
}

impl RedisStore {
    /// Puts done records of a partition in its audit queue, with their
    /// inputs (empty when their results carry them); records already
    /// waiting or judged, and records not done, are left out. Returns how
    /// many joined.
    pub async fn audit_sample(&self, job: &str, partition: u32, items: &[(String, String)]) -> Result<u64, StoreError> {
        let mut added = 0;
        for chunk in items.chunks(500) {
            let mut inv = self.scripts.audit.prepare_invoke();
            inv.key(keys::audit(job, partition))
                .key(keys::audited(job, partition))
                .key(keys::state(job, partition))
                .arg("sample");
            for (rid, input) in chunk {
                inv.arg(rid).arg(input);
            }
            let n: u64 = inv.invoke_async(&mut self.conn.clone()).await?;
            added += n;
        }
        Ok(added)
    }

    /// Records waiting for a spot check, over the job's partitions.
    pub async fn audit_waiting(&self, job: &str, partitions: u32) -> Result<u64, StoreError> {
        let lens: Vec<u64> = self
            .per_partition(partitions, |p| redis::cmd("HLEN").arg(keys::audit(job, p)).clone())
            .await?;
        Ok(lens.iter().sum())
    }

    /// A record waiting for a spot check that is not in `skip`, if any.
    pub async fn audit_next(
        &self,
        job: &str,
        partitions: u32,
        skip: &HashSet<String>,
    ) -> Result<Option<AuditItem>, StoreError> {
        let mut c = self.conn.clone();
        for p in 0..partitions {
            let mut cursor: u64 = 0;
            loop {
                let (next, items): (u64, Vec<String>) = redis::cmd("HSCAN")
                    .arg(keys::audit(job, p))
                    .arg(cursor)
                    .arg("COUNT")
                    .arg(100)
                    .query_async(&mut c)
                    .await?;
                for kv in items.chunks(2) {
                    if let [rid, input] = kv
                        && !skip.contains(rid)
                    {
                        return Ok(Some(AuditItem {
                            record_id: rid.clone(),
                            partition: p,
                            input: (!input.is_empty()).then(|| input.clone()),
                        }));
                    }
                }
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok(None)
    }

    /// The record, when it waits for a spot check.
    pub async fn audit_item(&self, job: &str, partition: u32, rid: &str) -> Result<Option<AuditItem>, StoreError> {
        let v: Option<String> = self.conn.clone().hget(keys::audit(job, partition), rid).await?;
        Ok(v.map(|input| AuditItem {
            record_id: rid.to_owned(),
            partition,
            input: (!input.is_empty()).then_some(input),
        }))
    }

    /// Records a verdict, only while the record still waits (nobody judged
    /// it meanwhile). Returns whether it was recorded.
    pub async fn audit_judge(&self, job: &str, partition: u32, rid: &str, v: &Verdict) -> Result<bool, StoreError> {
        let n: i64 = self
            .scripts
            .audit
            .key(keys::audit(job, partition))
            .key(keys::audited(job, partition))
            .key(keys::state(job, partition))
            .arg("judge")
            .arg(rid)
            .arg(v.encode())
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(n == 1)
    }

    /// The verdict on a record, if it was judged.
    pub async fn audit_verdict(&self, job: &str, partition: u32, rid: &str) -> Result<Option<Verdict>, StoreError> {
        let key = keys::audited(job, partition);
        let text: Option<String> = self.conn.clone().hget(&key, rid).await?;
        text.map(|t| Verdict::decode(&t).map_err(|reason| StoreError::Corrupt { key, reason }))
            .transpose()
    }

    /// Every verdict of the job (undecodable ones skipped).
    pub async fn audit_verdicts(&self, job: &str, partitions: u32) -> Result<Vec<Verdict>, StoreError> {
        let mut out = Vec::new();
        for p in 0..partitions {
            self.scan_hash(&keys::audited(job, p), |_, text| {
                if let Ok(v) = Verdict::decode(&text) {
                    out.push(v);
                }
            })
            .await?;
        }
        Ok(out)
    }

    /// The job's estimated accuracy from its verdicts so far.
    pub async fn accuracy(&self, job: &str, partitions: u32) -> Result<crate::audit::Accuracy, StoreError> {
        let verdicts = self.audit_verdicts(job, partitions).await?;
        let waiting = self.audit_waiting(job, partitions).await?;
        Ok(crate::audit::Accuracy::of(&verdicts, waiting))
    }
}

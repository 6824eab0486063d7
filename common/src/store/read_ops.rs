//! The store's typed read verbs: a job's spec, its records' states, results,
//! review entries and the ids each set holds, paged (flat memory however
//! large the job is). Decoding happens here and nowhere else.

use super::{RedisStore, StoreError};
use crate::keys;
use crate::spec::JobSpec;
use crate::task::{RecordState, ResultRecord, ReviewEntry};

/// A partition's set of records, by what holds them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordSet {
    /// Waiting to retry (the delayed set).
    Delayed,
    /// With a result.
    Results,
    /// In the review queue.
    Review,
    /// Cancelled, kept for resume.
    Cancelled,
}

impl RedisStore {
    /// The spec a job was enqueued with; None when the job does not exist.
    pub async fn job_spec(&self, job: &str) -> Result<Option<JobSpec>, StoreError> {
        let Some(text) = self.load_spec_text(job).await? else {
            return Ok(None);
        };
        JobSpec::parse(&text, &format!("spec of job `{job}`"))
            .map(Some)
            .map_err(|e| StoreError::Corrupt {
                key: keys::spec(job),
                reason: e.to_string(),
            })
    }

    /// Calls `f` with every record the partition knows and its state (None
    /// for a state value no version writes).
    pub async fn record_states(
        &self,
        job: &str,
        partition: u32,
        mut f: impl FnMut(String, Option<RecordState>),
    ) -> Result<(), StoreError> {
        self.scan_hash(&keys::state(job, partition), |rid, state| {
            let s = RecordState::decode(&state);
            f(rid, s)
        })
        .await
    }

    /// Calls `f` with every result of the partition (undecodable ones are skipped).
    pub async fn results(&self, job: &str, partition: u32, f: impl FnMut(ResultRecord)) -> Result<(), StoreError> {
        self.scan_decoded(&keys::results(job, partition), |t| ResultRecord::decode(t).ok(), f)
            .await
    }

    /// Calls `f` with every review entry of the partition (undecodable ones are skipped).
    pub async fn review_entries(
        &self,
        job: &str,
        partition: u32,
        f: impl FnMut(ReviewEntry),
    ) -> Result<(), StoreError> {
        self.scan_decoded(&keys::review(job, partition), |t| ReviewEntry::decode(t).ok(), f)
            .await
    }

    /// Calls `f` with every value of a hash that `decode` reads.
    async fn scan_decoded<T>(
        &self,
        key: &str,
        decode: impl Fn(&str) -> Option<T>,
        mut f: impl FnMut(T),
    ) -> Result<(), StoreError> {
        self.scan_hash(key, |_, text| {
            if let Some(v) = decode(&text) {
                f(v)
            }
        })
        .await
    }

    /// Calls `f` with the record id of every member of one of the partition's sets.
    pub async fn record_ids(
        &self,
        job: &str,
        partition: u32,
        set: RecordSet,
        mut f: impl FnMut(String),
    ) -> Result<(), StoreError> {
        match set {
            RecordSet::Delayed => {
                self.scan_sorted_set(&keys::delayed(job, partition), |member| {
                    f(delayed_record_id(&member).unwrap_or(member))
                })
                .await
            }
            RecordSet::Results => self.hash_fields(&keys::results(job, partition), f).await,
            RecordSet::Review => self.hash_fields(&keys::review(job, partition), f).await,
            RecordSet::Cancelled => self.hash_fields(&keys::cancelled(job, partition), f).await,
        }
    }

    /// The job's outcome counters, summed over its partitions.
    pub async fn stats(&self, job: &str, partitions: u32) -> Result<crate::stats::JobStats, StoreError> {
        let all: Vec<std::collections::BTreeMap<String, u64>> = self
            .per_partition(partitions, |p| redis::cmd("HGETALL").arg(keys::stats(job, p)).clone())
            .await?;
        let mut s = crate::stats::JobStats::default();
        for fields in &all {
            s.add(fields);
        }
        Ok(s)
    }

    /// One page of a partition's review queue from `cursor` (`HSCAN`: 0
    /// starts, and a next cursor of 0 means the end), about `count` entries
    /// (undecodable ones skipped): a queue of any length is paged without
    /// reading it all.
    pub async fn review_page(
        &self,
        job: &str,
        partition: u32,
        cursor: u64,
        count: usize,
    ) -> Result<(Vec<ReviewEntry>, u64), StoreError> {
        let (next, items): (u64, Vec<String>) = redis::cmd("HSCAN")
            .arg(keys::review(job, partition))
            .arg(cursor)
            .arg("COUNT")
            .arg(count.max(1))
            .query_async(&mut self.conn.clone())
            .await?;
        let entries = items
            .chunks(2)
            .filter_map(|kv| ReviewEntry::decode(kv.get(1)?).ok())
            .collect();
        Ok((entries, next))
    }

    /// Entries in the job's review queue (one `HLEN` per partition).
    pub async fn review_depth(&self, job: &str, partitions: u32) -> Result<u64, StoreError> {
        let lens: Vec<u64> = self
            .per_partition(partitions, |p| redis::cmd("HLEN").arg(keys::review(job, p)).clone())
            .await?;
        Ok(lens.iter().sum())
    }

    /// The review entry of a record, if it is in review.
    pub async fn review_entry(
        &self,
        job: &str,
        partition: u32,
        record_id: &str,
    ) -> Result<Option<ReviewEntry>, StoreError> {
        self.entry_at(&keys::review(job, partition), record_id).await
    }

    /// The archived review entry of a record a person acted on.
    pub async fn archived_review(
        &self,
        job: &str,
        partition: u32,
        record_id: &str,
    ) -> Result<Option<ReviewEntry>, StoreError> {
        self.entry_at(&keys::reviewed(job, partition), record_id).await
    }

    async fn entry_at(&self, key: &str, record_id: &str) -> Result<Option<ReviewEntry>, StoreError> {
        let text: Option<String> = redis::AsyncCommands::hget(&mut self.conn.clone(), key, record_id).await?;
        text.map(|t| {
            ReviewEntry::decode(&t).map_err(|e| StoreError::Corrupt {
                key: key.to_owned(),
                reason: e.to_string(),
            })
        })
        .transpose()
    }
}

/// A delayed member is an encoded task: its record id comes first.
fn delayed_record_id(member: &str) -> Option<String> {
    let rest = member.strip_prefix("{\"rid\":\"")?;
    rest.split_once('"').map(|(rid, _)| rid.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::Task;

    #[test]
    fn a_delayed_members_record_id_is_read_from_its_encoding() {
        let t = Task::new("abc123", "{\"x\":\"\\\"rid\\\"\"}", "").unwrap();
        assert_eq!(delayed_record_id(&t.encode()).as_deref(), Some("abc123"));
        assert_eq!(delayed_record_id("not json"), None);
    }
}

//! The job manifest and the producer's resume cursor, as stored in Redis (JSON).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The dataset a job was enqueued from.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Dataset {
    pub path: String,
    pub sha256: String,
    pub bytes: u64,
}

impl Dataset {
    /// The short fingerprint used in record origins (`<sha12>:<line>`).
    pub fn short(&self) -> &str {
        self.sha256.get(..12).unwrap_or(&self.sha256)
    }
}

/// A reproducible selection of lines instead of the whole dataset: a plain
/// sample, a stratified one, or another job's records.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Sample {
    /// Lines of the sample (with `from_job` and a set: passed records added).
    pub size: u64,
    pub seed: u64,
    /// Covers the extremes, kinds of text and rare values (`--stratify`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stratify: bool,
    /// Another job's records (`--from-job`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_job: Option<FromJob>,
}

/// Records of another job to enqueue again (under a new prompt version).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct FromJob {
    pub job: String,
    /// `review`, `dropped` or `done`; None: its failures (review and
    /// dropped), put into a stratified sample.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub set: Option<String>,
    /// Records that passed there, added as a regression check.
    #[serde(default)]
    pub plus_passed: u64,
    /// `producer rerun`: only the records of the set this filter selects
    /// (the producer's bulk filter, as JSON), so a resumed enqueue selects
    /// the same ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filter: Option<serde_json::Value>,
}

/// Per-line counts of one pass over a dataset. All are exact per line, so a
/// pass resumed from a cursor adds up to the same totals as an uninterrupted one.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Counts {
    /// Lines read (blank ones included).
    pub lines: u64,
    /// Empty or whitespace-only lines, ignored.
    pub blank: u64,
    /// Records that became tasks in this pass.
    pub enqueued: u64,
    /// Records that were already in the job (rerun, resume, crash replay).
    pub already_present: u64,
    /// Lines dropped, all reasons together.
    pub dropped: u64,
    /// Lines dropped, by reason code.
    pub dropped_by_reason: BTreeMap<String, u64>,
}

impl Counts {
    /// Distinct records of the dataset: each ends in exactly one terminal set.
    /// Lines dropped before they had an id, and duplicate ids, are not records.
    pub fn expected_records(&self) -> u64 {
        self.enqueued + self.already_present + self.dropped_records()
    }

    /// Dropped lines that still are records (an id, but an input error).
    pub fn dropped_records(&self) -> u64 {
        self.dropped_by_reason
            .iter()
            .filter(|(reason, _)| reason.starts_with("template_missing:"))
            .map(|(_, n)| n)
            .sum()
    }

    /// Adds another part's counts to these.
    pub fn merge(&mut self, other: &Counts) {
        self.lines += other.lines;
        self.blank += other.blank;
        self.enqueued += other.enqueued;
        self.already_present += other.already_present;
        self.dropped += other.dropped;
        for (reason, n) in &other.dropped_by_reason {
            *self.dropped_by_reason.entry(reason.clone()).or_default() += n;
        }
    }

    pub fn add_dropped(&mut self, reason: &str) {
        self.dropped += 1;
        *self.dropped_by_reason.entry(reason.to_owned()).or_default() += 1;
    }
}

/// What makes a job what it is. `job_key` is its hash.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Identity {
    pub dataset: Dataset,
    /// Spec versions, model config version included.
    pub versions: BTreeMap<String, String>,
    pub partitions: u32,
    pub sample: Option<Sample>,
}

impl Identity {
    /// `job_key = sha256(dataset sha256, spec versions, model config, partitions, sample)`.
    /// The dataset path is not part of it: the same bytes elsewhere are the same job.
    pub fn job_key(&self) -> String {
        let canonical = serde_json::json!({
            "dataset_sha256": self.dataset.sha256,
            "versions": self.versions,
            "partitions": self.partitions,
            "sample": self.sample,
        });
        hex::encode(Sha256::digest(canonical.to_string().as_bytes()))
    }

    /// Same spec versions and partitioning: the record ids and partitions agree.
    pub fn same_records_as(&self, other: &Identity) -> bool {
        self.versions == other.versions && self.partitions == other.partitions
    }
}

/// Where an interrupted `enqueue` resumes. Saved only after Redis confirmed
/// every line before `offset`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Cursor {
    pub job_key: String,
    pub identity: Identity,
    /// Byte offset of the first line not yet confirmed.
    pub offset: u64,
    /// Number of lines before `offset`.
    pub line: u64,
    /// Counts of the lines before `offset`.
    pub counts: Counts,
    /// The whole dataset has been confirmed.
    pub complete: bool,
}

/// One dataset enqueued into a job, with its per-line counts.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct DatasetPass {
    pub dataset: Dataset,
    /// The job's tag of the dataset: its records' origins are `<tag>:<line>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<u64>,
    pub lines: u64,
    pub blank_lines: u64,
    /// Distinct records of this dataset (tasks and template drops).
    pub records: u64,
    pub dropped_lines: u64,
}

/// Snapshot of what a job was given, written when an enqueue completes.
/// `expected_records` is counted from the job's state in Redis, not from
/// counters, so it holds whatever runs, crashes and resumes came before.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub job: String,
    /// Key of the latest dataset pass (see [`Identity::job_key`]).
    pub job_key: String,
    /// Every dataset enqueued into the job, oldest first.
    pub datasets: Vec<DatasetPass>,
    pub sample: Option<Sample>,
    /// Distinct records the job holds: each must end in exactly one terminal set.
    pub expected_records: u64,
    /// Lines dropped over all datasets, and by reason.
    pub dropped_lines: u64,
    pub dropped_by_reason: BTreeMap<String, u64>,
    pub partitions: u32,
    pub versions: BTreeMap<String, String>,
    /// The spec's `[versions] note`: what changed in this prompt version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// Enqueued with `--dry-run` (no sink).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dry_run: bool,
    pub spec_sha256: String,
    /// RFC 3339, UTC: the first completed enqueue, and the latest.
    pub created_at: String,
    pub updated_at: String,
}

/// An entry of the dropped-lines hash.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct DroppedLine {
    pub line: u64,
    pub record_id: Option<String>,
    pub key: Option<String>,
    pub reason: String,
    pub detail: String,
}

/// The current UTC time as RFC 3339 (`2026-11-29T19:37:01Z`).
pub fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    rfc3339(secs)
}

/// A duration for people: `850ms`, `12s`, `5m12s`, `2h05m`.
pub fn human_duration(ms: u64) -> String {
    let s = ms / 1000;
    match ms {
        0..1_000 => format!("{ms}ms"),
        1_000..60_000 => format!("{s}s"),
        60_000..3_600_000 => format!("{}m{}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s / 60 % 60),
    }
}

/// Days since 1970-01-01 of a civil date (proleptic Gregorian; `month`
/// 1-12): the inverse of [`rfc3339`]'s days-to-civil.
pub fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Formats Unix seconds as RFC 3339 UTC (days-to-civil, proleptic Gregorian).
pub fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_known_instants() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_795_894_621), "2026-11-28T19:37:01Z");
    }

    #[test]
    fn durations_read_as_people_say_them() {
        assert_eq!(
            [850, 12_400, 312_000, 1_800_000, 7_500_000].map(human_duration),
            ["850ms", "12s", "5m12s", "30m0s", "2h05m"]
        );
    }

    #[test]
    fn expected_records_counts_template_drops_but_not_broken_lines() {
        let mut c = Counts {
            enqueued: 5,
            already_present: 2,
            ..Counts::default()
        };
        c.add_dropped("malformed_json");
        c.add_dropped("duplicate_id");
        c.add_dropped("template_missing:text");
        assert_eq!(c.expected_records(), 8);
        assert_eq!(c.dropped, 3);
    }
}

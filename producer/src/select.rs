//! Which dataset lines a job takes, other than all of them: a stratified
//! sample (`enqueue --sample N --seed S --stratify`), and another job's
//! records (`enqueue --from-job JOB --set review|dropped|done --plus-passed N`).
//!
//! Every choice is reproducible: a line's rank is `sha256(seed, line)` (as in
//! the plain sample), and each stratum takes its lowest-ranked line.

use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};
use std::path::Path;

use common::manifest::FromJob;
use common::spec::JobSpec;
use common::store::{RedisStore, StoreError};
use common::task::RecordState;
use common::template::{Template, lookup};
use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::reader::LineReader;

/// An input field with more distinct values than this is not a stratum.
const FEW_VALUES: usize = 20;

type Rank = [u8; 8];

fn rank(seed: u64, number: u64) -> Rank {
    let mut h = Sha256::new();
    h.update(seed.to_be_bytes());
    h.update(number.to_be_bytes());
    let mut r = [0u8; 8];
    r.copy_from_slice(&h.finalize()[..8]);
    r
}

/// What a stratified sample covers, for the enqueue's summary.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Coverage {
    /// Line numbers of the shortest and longest rendered prompts.
    pub shortest: Option<u64>,
    pub longest: Option<u64>,
    /// Lines picked for a kind of text (`newline`, `quote`, `non_ascii`).
    pub texts: BTreeMap<String, u64>,
    /// Input fields the template uses with few distinct values: each value, covered.
    pub values: BTreeMap<String, Vec<String>>,
    /// Lines of another job's failed records, taken first.
    pub failed_before: u64,
    /// Lines picked for coverage, and in all (coverage first, then by rank).
    pub covering: u64,
    pub size: u64,
}

/// The best (lowest-ranked) line of a stratum.
#[derive(Default)]
struct Best(Option<(Rank, u64)>);

impl Best {
    fn offer(&mut self, r: Rank, line: u64) {
        if self.0.is_none_or(|(b, _)| r < b) {
            self.0 = Some((r, line));
        }
    }
}

/// A stratified sample of `size` lines: the shortest and longest rendered
/// prompts, a line with a newline, one with a quote and one with non-ASCII
/// text in the fields the template uses, one line for every value of each
/// such field with few distinct values, and the lines in `forced` (another
/// job's failures); the rest by rank. Coverage comes first: when it needs
/// more than `size` lines the sample is larger (the summary says so).
pub fn stratified(
    path: &Path,
    spec: &JobSpec,
    size: u64,
    seed: u64,
    forced: &HashSet<u64>,
) -> std::io::Result<(HashSet<u64>, Coverage)> {
    let template = Template::parse(&spec.prompt.user).map_err(|e| std::io::Error::other(e.to_string()))?;
    let fields: Vec<String> = template.fields().into_iter().map(str::to_owned).collect();
    let mut reader = LineReader::open(path, 0, 0, spec.job.max_record_bytes.max(64))?;
    let mut buf = Vec::new();
    let mut strata = Strata::new(&fields, size);
    while let Some(pos) = reader.next_line(&mut buf)? {
        if pos.oversize.is_some() || buf.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let text = String::from_utf8_lossy(&buf);
        let Ok(Value::Object(record)) = serde_json::from_str::<Value>(text.trim_start_matches('\u{feff}')) else {
            continue;
        };
        let Ok(rendered) = template.render(&record) else {
            continue;
        };
        strata.offer(
            &fields,
            &record,
            rendered.chars().count(),
            rank(seed, pos.number),
            pos.number,
        );
    }
    Ok(strata.choose(forced, size))
}

/// The best line of each stratum so far (see [`stratified`]).
struct Strata {
    /// (rendered length, rank, line) of the shortest and the longest prompt.
    shortest: Option<(usize, Rank, u64)>,
    longest: Option<(usize, Rank, u64)>,
    texts: BTreeMap<&'static str, Best>,
    /// Per field: value -> best line, until it has too many values (None).
    values: HashMap<String, Option<BTreeMap<String, Best>>>,
    /// The `size` best-ranked lines, to fill the sample with.
    fill: BinaryHeap<(Rank, u64)>,
    size: u64,
}

/// A field's value as a stratum names it.
fn value_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

impl Strata {
    fn new(fields: &[String], size: u64) -> Strata {
        Strata {
            shortest: None,
            longest: None,
            texts: BTreeMap::new(),
            values: fields.iter().map(|f| (f.clone(), Some(BTreeMap::new()))).collect(),
            fill: BinaryHeap::new(),
            size,
        }
    }

    /// One line: its record, its rendered prompt's length and its rank.
    fn offer(&mut self, fields: &[String], record: &serde_json::Map<String, Value>, len: usize, r: Rank, line: u64) {
        if self.shortest.is_none_or(|(l, b, _)| (len, r) < (l, b)) {
            self.shortest = Some((len, r, line));
        }
        if self.longest.is_none_or(|(l, b, _)| len > l || (len == l && r < b)) {
            self.longest = Some((len, r, line));
        }
        let used: Vec<String> = fields
            .iter()
            .filter_map(|f| lookup(record, f))
            .map(value_text)
            .collect();
        for (kind, hit) in [
            ("newline", used.iter().any(|v| v.contains('\n'))),
            ("quote", used.iter().any(|v| v.contains('"') || v.contains('\''))),
            ("non_ascii", used.iter().any(|v| !v.is_ascii())),
        ] {
            if hit {
                self.texts.entry(kind).or_default().offer(r, line);
            }
        }
        for f in fields {
            let Some(Some(by_value)) = self.values.get_mut(f) else {
                continue;
            };
            let Some(v) = lookup(record, f) else { continue };
            let key = value_text(v);
            if !by_value.contains_key(&key) && by_value.len() == FEW_VALUES {
                self.values.insert(f.clone(), None);
                continue;
            }
            by_value.entry(key).or_default().offer(r, line);
        }
        self.fill.push((r, line));
        if self.fill.len() as u64 > self.size {
            self.fill.pop();
        }
    }

    /// The sample: `forced`, one line per stratum, then the best-ranked up to `size`.
    fn choose(self, forced: &HashSet<u64>, size: u64) -> (HashSet<u64>, Coverage) {
        let mut cov = Coverage {
            shortest: self.shortest.map(|(_, _, l)| l),
            longest: self.longest.map(|(_, _, l)| l),
            failed_before: forced.len() as u64,
            ..Coverage::default()
        };
        let mut chosen: HashSet<u64> = forced.clone();
        chosen.extend(cov.shortest);
        chosen.extend(cov.longest);
        for (kind, best) in &self.texts {
            if let Some((_, line)) = best.0 {
                cov.texts.insert((*kind).to_owned(), line);
                chosen.insert(line);
            }
        }
        for (field, by_value) in self.values {
            // A field with one value for every line is no stratum either.
            let Some(by_value) = by_value.filter(|v| v.len() > 1) else {
                continue;
            };
            for best in by_value.values() {
                chosen.extend(best.0.map(|(_, l)| l));
            }
            cov.values.insert(field, by_value.into_keys().collect());
        }
        cov.covering = chosen.len() as u64;
        let mut by_rank: Vec<(Rank, u64)> = self.fill.into_vec();
        by_rank.sort();
        for (_, line) in by_rank {
            if chosen.len() as u64 >= size {
                break;
            }
            chosen.insert(line);
        }
        cov.size = chosen.len() as u64;
        (chosen, cov)
    }
}

/// What `--from-job` found in the other job.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct FromJobSummary {
    /// Records of the set, and passed ones added as a regression check.
    pub records: u64,
    pub passed: u64,
    /// Records whose dataset line is not recorded, or in another dataset
    /// than the one given.
    pub skipped: BTreeMap<String, u64>,
}

/// The other job's records of `from.set` (or, with no set, its failures:
/// review and dropped) plus `from.plus_passed` done ones (by rank), as line
/// numbers of the dataset whose sha256 is `sha256` (it must be one the other
/// job was enqueued from).
pub async fn lines_from_job(
    store: &RedisStore,
    from: &FromJob,
    seed: u64,
    sha256: &str,
    dataset: &Path,
) -> Result<(HashSet<u64>, FromJobSummary), SelectError> {
    let job = from.job.as_str();
    let manifest = store
        .load_manifest(job)
        .await?
        .ok_or_else(|| SelectError::Refused(format!("--from-job {job}: no such job (no manifest)")))?;
    let Some(pass) = manifest.datasets.iter().find(|d| d.dataset.sha256 == sha256) else {
        return Err(SelectError::Refused(format!(
            "--from-job {job}: the dataset given is not one that job was enqueued from (its sha256 differs: \
             the lines of its records would be others)"
        )));
    };
    let names: HashSet<String> = std::iter::once(pass.dataset.short().to_owned())
        .chain(pass.tag.map(|t| t.to_string()))
        .collect();
    let (mut picked, passed) = pick(store, from, manifest.partitions, seed).await?;
    // `producer rerun`: only the done records its filter selects (those
    // whose input is not kept with their result are judged by their line).
    let filter = done_filter(from)?;
    let mut by_line = HashSet::new();
    if let Some(f) = &filter {
        let (keep, by_input) = done_matching(store, job, manifest.partitions, f).await?;
        picked.retain(|(_, rid)| keep.contains(rid) || by_input.contains(rid));
        by_line = by_input;
    }
    let mut out = FromJobSummary::default();
    let mut lines = HashSet::new();
    // Line -> records of it its input decides; lines a record matched outright.
    let mut judge_by_line: HashMap<u64, u64> = HashMap::new();
    let mut kept_lines = HashSet::new();
    let regression = passed.into_sorted_vec().into_iter().map(|(_, p, rid)| (p, rid, true));
    for (p, rid, is_passed) in picked.into_iter().map(|(p, rid)| (p, rid, false)).chain(regression) {
        if is_passed && out.passed >= from.plus_passed {
            break;
        }
        let origin = store.record_origin(job, p, &rid).await?;
        let line = origin.as_deref().and_then(|o| {
            let (name, line) = o.split_once(':')?;
            names.contains(name).then(|| line.parse::<u64>().ok()).flatten()
        });
        match (origin, line) {
            (None, _) => {
                *out.skipped
                    .entry("its dataset line is not recorded".into())
                    .or_default() += 1
            }
            (Some(_), None) => *out.skipped.entry("from another dataset".into()).or_default() += 1,
            (Some(_), Some(line)) => {
                lines.insert(line);
                if by_line.contains(&rid) {
                    *judge_by_line.entry(line).or_default() += 1;
                } else {
                    kept_lines.insert(line);
                }
                if is_passed {
                    out.passed += 1;
                } else {
                    out.records += 1;
                }
            }
        }
    }
    if let Some(f) = &filter
        && !judge_by_line.is_empty()
    {
        let wanted: HashSet<u64> = judge_by_line.keys().copied().collect();
        for line in lines_not_matching(dataset, &wanted, f)? {
            out.records -= judge_by_line.get(&line).copied().unwrap_or(0);
            if !kept_lines.contains(&line) {
                lines.remove(&line);
            }
        }
    }
    Ok((lines, out))
}

/// The other job's records of `from.set` (by partition), and up to four
/// times `from.plus_passed` done ones, best-ranked first, as spares for the
/// regression check.
#[allow(clippy::type_complexity)]
async fn pick(
    store: &RedisStore,
    from: &FromJob,
    partitions: u32,
    seed: u64,
) -> Result<(Vec<(u32, String)>, BinaryHeap<(Rank, u32, String)>), SelectError> {
    let wanted = |state: &RecordState| {
        matches!(
            (from.set.as_deref(), state),
            (None | Some("review"), RecordState::Review)
                | (None | Some("dropped"), RecordState::Dropped(_))
                | (Some("done"), RecordState::Done)
        )
    };
    let mut picked: Vec<(u32, String)> = Vec::new();
    let mut passed: BinaryHeap<(Rank, u32, String)> = BinaryHeap::new();
    let plus = from.plus_passed;
    for p in 0..partitions {
        store
            .record_states(&from.job, p, |rid, state| {
                let Some(state) = state else { return };
                if wanted(&state) {
                    picked.push((p, rid));
                } else if plus > 0 && state == RecordState::Done {
                    let mut h = Sha256::new();
                    h.update(seed.to_be_bytes());
                    h.update(rid.as_bytes());
                    let mut r = [0u8; 8];
                    r.copy_from_slice(&h.finalize()[..8]);
                    passed.push((r, p, rid));
                    // Spares, for passed records whose line is not found.
                    if passed.len() as u64 > plus.saturating_mul(4) {
                        passed.pop();
                    }
                }
            })
            .await?;
    }
    Ok((picked, passed))
}

/// The bulk filter a `--from-job` set carries (`producer rerun`).
fn done_filter(from: &FromJob) -> Result<Option<crate::filter::Filter>, SelectError> {
    let Some(v) = &from.filter else { return Ok(None) };
    if from.set.as_deref() != Some("done") {
        return Err(SelectError::Refused(
            "a filter selects done records only (--set done)".into(),
        ));
    }
    let f: crate::filter::Filter = serde_json::from_value(v.clone())
        .map_err(|e| SelectError::Refused(format!("the rerun's filter cannot be read: {e}")))?;
    f.check_done().map_err(SelectError::Refused)?;
    Ok(Some(f))
}

/// The done records of `job` the filter selects: those it selects outright,
/// and those whose input decides but is not kept with their result (their
/// dataset line does, when they are run again).
pub async fn done_matching(
    store: &RedisStore,
    job: &str,
    partitions: u32,
    f: &crate::filter::Filter,
) -> Result<(HashSet<String>, HashSet<String>), SelectError> {
    let spec = store.job_spec(job).await?;
    let (mut keep, mut by_input) = (HashSet::new(), HashSet::new());
    crate::sink::each_result(store, job, spec.as_ref(), partitions, |r| {
        if !f.matches_result(&r) {
            return;
        }
        match (&r.input, f.needs_input()) {
            (_, false) => {
                keep.insert(r.record_id);
            }
            (Some(input), true) => {
                if f.matches_input(input.get()) {
                    keep.insert(r.record_id);
                }
            }
            (None, true) => {
                by_input.insert(r.record_id);
            }
        }
    })
    .await
    .map_err(|e| SelectError::Refused(format!("the results of job `{job}` cannot be read: {e:#}")))?;
    Ok((keep, by_input))
}

/// Of `wanted` line numbers of `dataset`, those whose record the filter's
/// input conditions do not select.
fn lines_not_matching(
    dataset: &Path,
    wanted: &HashSet<u64>,
    f: &crate::filter::Filter,
) -> Result<Vec<u64>, SelectError> {
    let read = |e: std::io::Error| SelectError::Refused(format!("{}: {e}", dataset.display()));
    let mut reader = LineReader::open(dataset, 0, 0, 16 << 20).map_err(read)?;
    let mut buf = Vec::new();
    let mut out = Vec::new();
    while let Some(pos) = reader.next_line(&mut buf).map_err(read)? {
        if wanted.contains(&pos.number)
            && !f.matches_input(String::from_utf8_lossy(&buf).trim_start_matches('\u{feff}'))
        {
            out.push(pos.number);
        }
    }
    Ok(out)
}

#[derive(Debug, thiserror::Error)]
pub enum SelectError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    Refused(String),
}

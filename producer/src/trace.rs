//! `producer trace`: a record's chain from its row back to the bytes that
//! produced it. Every attempt names the sha256 of the request body sent,
//! the model and endpoint, and the sha256 of the response received; the
//! response's bytes are read back from the job's sink (`common::sink::raw`)
//! and hashed again, so a row is proven to come from those bytes, or the
//! trace says it is not.

use common::sink::{RawStore, Target, sha256_hex};
use common::spec::{JobSpec, SinkKind};
use common::store::RedisStore;
use common::task::{Attempt, HistoryItem, Trail};
use serde::Serialize;
use serde_json::Value;

use crate::review::{ReviewError, find, find_archived, record_id_of};

/// A record's chain, newest state first, then every attempt in order.
#[derive(Debug, Serialize)]
pub struct Chain {
    pub job: String,
    pub record_id: String,
    pub key: String,
    /// `done` (with a result), `review` (waiting for a person), or what
    /// people did to its entry.
    pub state: String,
    /// Where the record was read: `redis`, `sink`, `review queue`, `review archive`.
    pub read_from: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output: Option<Value>,
    /// A person's output (the row was not produced by a call).
    pub human: bool,
    /// The call whose answer is the row (its number), when one is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub produced_by_call: Option<u32>,
    pub attempts: Vec<Link>,
}

/// One attempt of the chain.
#[derive(Debug, Serialize)]
pub struct Link {
    pub attempt: u32,
    pub call: u32,
    pub at: String,
    pub worker: String,
    pub outcome: String,
    pub decision: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch: Option<String>,
    pub trail: Trail,
    /// The response's bytes, as found: `verified` (kept, and they hash to
    /// the trail's sha256), `altered` (kept, and they do not), `missing`
    /// (said kept, not found), `not kept`, `no response`.
    pub response: &'static str,
    /// Where they are kept.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kept_at: Option<String>,
    /// With `--raw`: the response's bytes (as text).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
    /// A batch line's: the batch's files the trail names (kept whole), as
    /// found: `verified`, `altered` or `missing`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub batch_files: Vec<BatchFile>,
}

/// A provider batch's file named in a trail, read back and hashed again.
#[derive(Debug, Serialize)]
pub struct BatchFile {
    pub sha256: String,
    pub found: &'static str,
}

impl Chain {
    /// Whether every response and batch file the trail says was kept is
    /// there, unaltered.
    pub fn holds(&self) -> bool {
        self.attempts.iter().all(|l| {
            !matches!(l.response, "altered" | "missing") && l.batch_files.iter().all(|f| f.found == "verified")
        })
    }
}

/// The chain of record `id` (its record id, a unique prefix of one, or its
/// business key) of `job`; with `raw`, the responses' bytes too.
pub async fn trace(store: &RedisStore, spec: &JobSpec, job: &str, id: &str, raw: bool) -> Result<Chain, ReviewError> {
    let rid = record_id_of(job, spec, id);
    let mut chain = match crate::audit::current_result(store, spec, job, &rid).await? {
        Some(r) => {
            let p = common::record::partition_of(&rid, spec.job.partitions);
            let in_redis = store.result_text(job, p, &rid).await?.is_some();
            let produced_by_call = (!r.human)
                .then(|| {
                    // The checker's agreeing call commits the first answer, not its own.
                    attempts(&r.history)
                        .rev()
                        .find(|a| a.decision == "commit" && a.check.is_none())
                        .map(|a| a.call)
                })
                .flatten();
            let mut chain = Chain {
                job: job.to_owned(),
                record_id: r.record_id.clone(),
                key: r.key.clone(),
                state: "done".into(),
                read_from: if in_redis { "redis" } else { "sink" }.into(),
                output: Some(Value::Object(r.output.clone())),
                human: r.human,
                produced_by_call,
                attempts: Vec::new(),
            };
            chain.attempts = attempts(&r.history).map(link).collect();
            chain
        }
        None => {
            let (entry, read_from) = match find(store, job, id).await {
                Ok((e, _)) => (e, "review queue"),
                Err(ReviewError::NotFound(_)) => (find_archived(store, job, id).await?.0, "review archive"),
                Err(e) => return Err(e),
            };
            let state = match entry.actions.last() {
                Some(a) => format!("{} by a person", a.action),
                None => format!("review ({})", entry.reason),
            };
            Chain {
                job: job.to_owned(),
                record_id: entry.record_id.clone(),
                key: entry.key.clone(),
                state,
                read_from: read_from.into(),
                output: None,
                human: false,
                produced_by_call: None,
                attempts: attempts(&entry.history).map(link).collect(),
            }
        }
    };
    let store_of = raw_store(spec, job).map_err(|e| ReviewError::Io(e.to_string()))?;
    for l in &mut chain.attempts {
        check(store_of.as_ref(), l, raw).await?;
    }
    Ok(chain)
}

fn attempts(history: &[HistoryItem]) -> impl DoubleEndedIterator<Item = &Attempt> {
    history.iter().filter_map(HistoryItem::as_attempt)
}

fn link(a: &Attempt) -> Link {
    Link {
        attempt: a.attempt,
        call: a.call,
        at: a.at.clone(),
        worker: a.worker.clone(),
        outcome: a.outcome.clone(),
        decision: a.decision.clone(),
        batch: a.batch.clone(),
        trail: a.trail.clone(),
        response: match (&a.trail.response_sha256, a.trail.response_kept, &a.trail.response_body) {
            (None, ..) => "no response",
            // Kept in the history itself (the sink did not take it then).
            (Some(sha), _, Some(body)) if sha256_hex(body.as_bytes()) == *sha => "verified",
            (Some(_), _, Some(_)) => "altered",
            (Some(_), false, None) => "not kept",
            (Some(_), true, None) => "missing",
        },
        kept_at: a
            .trail
            .response_body
            .as_ref()
            .map(|_| "the record's history (inline)".to_owned()),
        body: None,
        batch_files: Vec::new(),
    }
}

/// Reads a kept response (and a batch line's batch files) back and hashes
/// them again.
async fn check(raw: Option<&RawStore>, l: &mut Link, with_body: bool) -> Result<(), ReviewError> {
    for sha in &l.trail.batch_files {
        let bytes = match raw {
            Some(raw) => raw.read(sha).await.map_err(|e| ReviewError::Io(e.to_string()))?,
            None => None,
        };
        let found = match bytes {
            Some(b) if sha256_hex(&b) == *sha => "verified",
            Some(_) => "altered",
            None => "missing",
        };
        l.batch_files.push(BatchFile {
            sha256: sha.clone(),
            found,
        });
    }
    let Some(sha) = l.trail.response_sha256.clone() else {
        return Ok(());
    };
    if let Some(inline) = &l.trail.response_body {
        if with_body {
            l.body = Some(inline.clone());
        }
        return Ok(());
    }
    let Some(raw) = raw else { return Ok(()) };
    let Some(bytes) = raw.read(&sha).await.map_err(|e| ReviewError::Io(e.to_string()))? else {
        return Ok(());
    };
    l.response = if sha256_hex(&bytes) == sha {
        "verified"
    } else {
        "altered"
    };
    l.kept_at = Some(raw.place(&sha));
    if with_body {
        l.body = Some(String::from_utf8_lossy(&bytes).into_owned());
    }
    Ok(())
}

/// The raw store beside the job's sink (None: the job has no sink).
fn raw_store(spec: &JobSpec, job: &str) -> anyhow::Result<Option<RawStore>> {
    let target = match spec.sink.kind {
        SinkKind::None => return Ok(None),
        SinkKind::Files => Target::Files(spec.sink.dir.clone().unwrap_or_default().into()),
        SinkKind::Postgres => Target::Postgres(crate::sink::database_url(
            spec,
            "the responses are kept in PostgreSQL",
            "to read them",
        )?),
    };
    Ok(Some(RawStore::of(&target, job, spec)?))
}

/// The chain for people.
pub fn print(c: &Chain) {
    let key = if c.key.is_empty() {
        String::new()
    } else {
        format!(" (key {})", c.key)
    };
    crate::outln!(
        "record {}{key} of job {}: {} (read from {})",
        c.record_id,
        c.job,
        c.state,
        c.read_from
    );
    if let Some(output) = &c.output {
        let by = if c.human {
            "a person's output".to_owned()
        } else {
            c.produced_by_call
                .map_or("output".into(), |n| format!("output of call {n}"))
        };
        crate::outln!("  {by}: {output}");
    }
    for l in &c.attempts {
        let batch = l.batch.as_ref().map(|b| format!(" in batch {b}")).unwrap_or_default();
        let mark = if c.produced_by_call == Some(l.call) {
            "  <- the row"
        } else {
            ""
        };
        crate::outln!(
            "  call {} (attempt {}) at {} by {}{batch}: {} -> {}{mark}",
            l.call,
            l.attempt,
            l.at,
            l.worker,
            l.outcome,
            l.decision
        );
        let t = &l.trail;
        if t.is_empty() {
            crate::outln!("    no audit trail (made before the trail was kept)");
            continue;
        }
        crate::outln!("    model {} at {}", t.model, t.provider);
        crate::outln!("    request  sha256 {}", t.request_sha256);
        match &t.response_sha256 {
            None => crate::outln!("    response none (no response came)"),
            Some(sha) => {
                let at = l.kept_at.as_ref().map(|p| format!(" in {p}")).unwrap_or_default();
                crate::outln!("    response sha256 {sha}: {}{at}", l.response);
            }
        }
        for f in &l.batch_files {
            crate::outln!("    batch file sha256 {}: {}", f.sha256, f.found);
        }
        if let Some(body) = &l.body {
            crate::outln!("    {body}");
        }
    }
    if !c.holds() {
        common::errln!("error: a response or batch file the trail names is missing or altered in the sink (see above)");
    }
}

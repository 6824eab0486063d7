//! What selects review entries and done records for a bulk action
//! ([`crate::bulk`], `producer rerun`) and for `review list`: reason, error
//! code, field, attempts, time range, text or a JSON path of the input or
//! the output. The CLI and the console select with the same [`Filter`].

use common::store::RedisStore;
use common::task::{HistoryItem, ResultRecord, ReviewEntry};
use serde::Serialize;
use serde_json::Value;

/// Entries a bulk action may touch without `--yes` (or the console's count).
pub const CONFIRM_ABOVE: usize = 10;
/// Entries a dry run shows.
pub const SAMPLE: usize = 5;

/// What selects review entries (or done records, for `producer rerun`);
/// an empty part matches everything.
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize, PartialEq)]
#[serde(default)]
pub struct Filter {
    /// The entry's reason starts with this (`attempts_exhausted`, `refused`...).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// One of its validation errors has this code (`E_ENUM`).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub code: String,
    /// One of its errors is about this output field (`items[0]` is `items`).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub field: String,
    /// Its input contains this text (case-insensitive).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub text: String,
    /// Its attempts are at least / at most this many.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_attempts: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
    /// It came to review at or after / before this time (RFC 3339, UTC).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub since: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub until: String,
    /// `PATH=VALUE` on the input, and on the last output: the value at the
    /// JSON path (`$.a.b[0]`, or a JSON Pointer `/a/b/0`) is VALUE (a
    /// string without quotes; anything else as JSON).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub input: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub output: Vec<String>,
}

impl Filter {
    /// Checks the paths and times before anything is read; a filter that
    /// would select the whole queue is refused (say what to select).
    pub fn check(&self) -> Result<(), String> {
        if *self == Filter::default() {
            return Err(
                "a bulk action needs a filter: --reason, --code, --field, --text, --min-attempts, \
                 --max-attempts, --since, --until, --input or --output (see them all with --dry-run first)"
                    .into(),
            );
        }
        for (flag, conds) in [("--input", &self.input), ("--output", &self.output)] {
            for c in conds {
                let Some((path, _)) = c.split_once('=') else {
                    return Err(format!("{flag} `{c}`: give PATH=VALUE, e.g. {flag} '$.channel=chat'"));
                };
                pointer(path).map_err(|e| format!("{flag} `{c}`: {e}"))?;
            }
        }
        for (flag, t) in [("--since", &self.since), ("--until", &self.until)] {
            if !t.is_empty() && !is_rfc3339(t) {
                return Err(format!("{flag} `{t}`: give a UTC time like 2026-12-04T18:00:00Z"));
            }
        }
        Ok(())
    }

    pub fn matches(&self, e: &ReviewEntry) -> bool {
        (self.reason.is_empty() || e.reason.starts_with(self.reason.as_str()))
            && (self.code.is_empty() || e.errors.iter().any(|x| x.code.as_str() == self.code))
            && (self.field.is_empty() || e.errors.iter().any(|x| field_of(&x.field) == self.field))
            && (self.text.is_empty() || e.input.get().to_lowercase().contains(&self.text.to_lowercase()))
            && self.min_attempts.is_none_or(|n| e.attempts >= n)
            && self.max_attempts.is_none_or(|n| e.attempts <= n)
            && (self.since.is_empty() || e.created_at.as_str() >= self.since.as_str())
            && (self.until.is_empty() || e.created_at.as_str() < self.until.as_str())
            && paths_match(&self.input, || serde_json::from_str(e.input.get()).ok())
            && paths_match(&self.output, || serde_json::from_str(&e.last_raw_output).ok())
    }

    /// [`Filter::check`] for done records: they have no review reason.
    pub fn check_done(&self) -> Result<(), String> {
        if !self.reason.is_empty() {
            return Err(
                "--reason selects review entries; a done record has none: select done records by the errors of \
                 their earlier attempts (--code, --field), --min-attempts, --since/--until (when committed), \
                 --text, --input or --output"
                    .into(),
            );
        }
        self.check()
    }

    /// Whether a done record matches, but for its input (see
    /// [`Filter::needs_input`] and [`Filter::matches_input`]): `--code` and
    /// `--field` look at the errors of its earlier attempts, the times at
    /// when it was committed.
    pub fn matches_result(&self, r: &ResultRecord) -> bool {
        let errors = || {
            r.history
                .iter()
                .filter_map(HistoryItem::as_attempt)
                .flat_map(|a| a.errors.iter())
        };
        (self.code.is_empty() || errors().any(|x| x.code.as_str() == self.code))
            && (self.field.is_empty() || errors().any(|x| field_of(&x.field) == self.field))
            && self.min_attempts.is_none_or(|n| r.attempts >= n)
            && self.max_attempts.is_none_or(|n| r.attempts <= n)
            && (self.since.is_empty() || r.committed_at.as_str() >= self.since.as_str())
            && (self.until.is_empty() || r.committed_at.as_str() < self.until.as_str())
            && paths_match(&self.output, || Some(Value::Object(r.output.clone())))
    }

    /// The filter looks at the input (`--text`, `--input`).
    pub fn needs_input(&self) -> bool {
        !self.text.is_empty() || !self.input.is_empty()
    }

    /// Whether a record's input (its JSON text) matches `--text` and `--input`.
    pub fn matches_input(&self, input: &str) -> bool {
        (self.text.is_empty() || input.to_lowercase().contains(&self.text.to_lowercase()))
            && paths_match(&self.input, || serde_json::from_str(input).ok())
    }

    /// The filter as the log keeps it (JSON of its non-empty parts).
    pub fn describe(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// The top-level output field an error is about (`items[0].qty` -> `items`).
pub fn field_of(path: &str) -> &str {
    let end = path.find(['.', '[']).unwrap_or(path.len());
    &path[..end]
}

fn is_rfc3339(t: &str) -> bool {
    let b = t.as_bytes();
    b.len() >= 20 && b[4] == b'-' && b[7] == b'-' && b[10] == b'T' && b[13] == b':' && t.ends_with('Z')
}

/// Every `PATH=VALUE` holds of the document (read only when there are some).
fn paths_match(conds: &[String], doc: impl FnOnce() -> Option<Value>) -> bool {
    if conds.is_empty() {
        return true;
    }
    let Some(doc) = doc() else { return false };
    conds.iter().all(|c| {
        let Some((path, want)) = c.split_once('=') else {
            return false;
        };
        let Ok(ptr) = pointer(path) else { return false };
        match doc.pointer(&ptr) {
            Some(Value::String(s)) => s == want,
            Some(v) => serde_json::from_str::<Value>(want).is_ok_and(|w| &w == v),
            None => false,
        }
    })
}

/// A JSON Pointer from `$.a.b[0]` (or a pointer given as one).
pub fn pointer(path: &str) -> Result<String, String> {
    if path.starts_with('/') {
        return Ok(path.to_owned());
    }
    let rest = path
        .strip_prefix('$')
        .ok_or_else(|| format!("`{path}` is no JSON path: start it with $ (`$.a.b[0]`) or / (`/a/b/0`)"))?;
    let mut out = String::new();
    let mut chars = rest.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '.' => out.push('/'),
            '[' => {
                out.push('/');
                let mut index = String::new();
                for d in chars.by_ref() {
                    if d == ']' {
                        break;
                    }
                    index.push(d);
                }
                if index.is_empty() || !index.chars().all(|d| d.is_ascii_digit()) {
                    return Err(format!("`{path}`: an index is a number, like [0]"));
                }
                out.push_str(&index);
            }
            '~' => out.push_str("~0"),
            '/' => out.push_str("~1"),
            c => out.push(c),
        }
    }
    if out.is_empty() || out.contains("//") {
        return Err(format!("`{path}` names no field"));
    }
    Ok(out)
}

/// A digest of the selected entries (their record ids): the console's
/// confirmation names exactly the set it counted.
pub fn digest(entries: &[(ReviewEntry, u32)]) -> String {
    use sha2::Digest;
    let mut ids: Vec<&str> = entries.iter().map(|(e, _)| e.record_id.as_str()).collect();
    ids.sort_unstable();
    let mut h = sha2::Sha256::new();
    for id in ids {
        h.update(id.as_bytes());
        h.update(b"\n");
    }
    hex::encode(&h.finalize()[..12])
}

/// The review entries of a job the filter matches, with their partitions.
pub async fn select(
    store: &RedisStore,
    job: &str,
    partitions: u32,
    f: &Filter,
) -> Result<Vec<(ReviewEntry, u32)>, common::store::StoreError> {
    let mut out = Vec::new();
    for p in 0..partitions {
        store
            .review_entries(job, p, |e| {
                if f.matches(&e) {
                    out.push((e, p));
                }
            })
            .await?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_become_json_pointers() {
        assert_eq!(pointer("$.a.b[0]").unwrap(), "/a/b/0");
        assert_eq!(pointer("$.channel").unwrap(), "/channel");
        assert_eq!(pointer("/a/0").unwrap(), "/a/0");
        assert!(pointer("channel").unwrap_err().contains("start it with $"));
        assert!(pointer("$.a[x]").is_err());
        assert!(pointer("$").is_err());
    }

    #[test]
    fn values_at_paths_match_as_text_or_json() {
        let doc = || serde_json::from_str(r#"{"channel": "chat", "n": 3, "tags": ["a", "b"]}"#).ok();
        assert!(paths_match(&["$.channel=chat".into()], doc));
        assert!(paths_match(&["$.n=3".into(), "$.tags[1]=b".into()], doc));
        assert!(!paths_match(&["$.n=4".into()], doc));
        assert!(!paths_match(&["$.missing=x".into()], doc));
        let f = Filter {
            input: vec!["channel=chat".into()],
            ..Filter::default()
        };
        assert!(f.check().unwrap_err().contains("--input `channel=chat`"));
        let f = Filter {
            since: "yesterday".into(),
            ..Filter::default()
        };
        assert!(f.check().unwrap_err().contains("--since"));
    }
}

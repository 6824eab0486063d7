//! A dataset line as a typed record, and its deterministic `record_id`.
//!
//! `record_id = sha256(job namespace, business key, source version, prompt
//! version, model config version)`: never a line number, never random, so a
//! rerun, a resume or a crash replay finds the same ids.

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::spec::JobSpec;
use crate::template::{MissingField, Template, lookup};

/// Why a line did not become a task. `code()` is the stable reason code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DropReason {
    /// The line is longer than `job.max_record_bytes`.
    TooLarge { bytes: u64, limit: usize },
    /// The line is not valid UTF-8.
    InvalidUtf8,
    /// The line is not JSON.
    MalformedJson(String),
    /// The line is JSON but not an object.
    NotObject,
    /// The id field is absent.
    MissingId,
    /// The id field is null or an empty string.
    EmptyId,
    /// The id field is neither a string nor an integer.
    InvalidId,
    /// Another line of the same dataset has this id.
    DuplicateId { first_line: u64 },
    /// A template placeholder has no value in the record.
    TemplateMissing(String),
    /// The record nests deeper than [`crate::json::MAX_DEPTH`] levels.
    TooDeep,
}

impl DropReason {
    /// The reason code stored and counted (`template_missing:<field>` names its field).
    pub fn code(&self) -> String {
        match self {
            DropReason::TooLarge { .. } => "too_large".into(),
            DropReason::InvalidUtf8 => "invalid_utf8".into(),
            DropReason::MalformedJson(_) => "malformed_json".into(),
            DropReason::NotObject => "not_object".into(),
            DropReason::MissingId => "missing_id".into(),
            DropReason::EmptyId => "empty_id".into(),
            DropReason::InvalidId => "invalid_id".into(),
            DropReason::DuplicateId { .. } => "duplicate_id".into(),
            DropReason::TemplateMissing(f) => format!("template_missing:{f}"),
            DropReason::TooDeep => "too_deep".into(),
        }
    }

    /// A human sentence with the details.
    pub fn detail(&self) -> String {
        match self {
            DropReason::TooLarge { bytes, limit } => format!("line is {bytes} bytes, over the {limit}-byte limit"),
            DropReason::InvalidUtf8 => "line is not valid UTF-8".into(),
            DropReason::MalformedJson(e) => format!("not valid JSON: {e}"),
            DropReason::NotObject => "JSON value is not an object".into(),
            DropReason::MissingId => "id field is missing".into(),
            DropReason::EmptyId => "id field is null or empty".into(),
            DropReason::InvalidId => "id field is not a string or an integer".into(),
            DropReason::DuplicateId { first_line } => format!("same id as line {first_line}"),
            DropReason::TemplateMissing(f) => format!("template field `{f}` is missing, null or empty"),
            DropReason::TooDeep => format!("nests deeper than {} levels", crate::json::MAX_DEPTH),
        }
    }
}

/// A line that parsed into a record with an identity.
#[derive(Debug, Clone)]
pub struct Record {
    /// The business key (the id field's value, as text).
    pub key: String,
    /// The deterministic record id (64 hex digits).
    pub id: String,
    /// The record as compact JSON, stored with the task.
    pub input: String,
    /// The rendered user message, or why it could not be rendered.
    pub rendered: Result<String, MissingField>,
}

/// What one line of a dataset is.
#[derive(Debug)]
pub enum Line {
    /// Empty or whitespace only: ignored, not counted as dropped.
    Blank,
    /// A record with an id (its template may still have failed: see `rendered`).
    Record(Record),
    /// Unusable, with the id when one could be read.
    Dropped { key: Option<String>, reason: DropReason },
}

/// What a record's identity depends on, fixed for one job.
#[derive(Debug, Clone)]
pub struct IdContext {
    namespace: String,
    source: String,
    prompt: String,
    model_config: String,
}

impl IdContext {
    pub fn new(namespace: &str, spec: &JobSpec) -> IdContext {
        IdContext {
            namespace: namespace.to_owned(),
            source: spec.versions.source.clone(),
            prompt: spec.versions.prompt.clone(),
            model_config: spec.model_config_version(),
        }
    }

    /// The record id of a business key in this job.
    pub fn record_id(&self, key: &str) -> String {
        let mut h = Sha256::new();
        // Length-prefixed parts: no two different tuples hash the same bytes.
        for part in [
            "batchfleet/record/v1",
            &self.namespace,
            key,
            &self.source,
            &self.prompt,
            &self.model_config,
        ] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part.as_bytes());
        }
        hex::encode(h.finalize())
    }
}

/// `hash(record_id) mod P`, from the id's first 8 bytes.
pub fn partition_of(record_id: &str, partitions: u32) -> u32 {
    let prefix = record_id
        .get(..16)
        .and_then(|h| u64::from_str_radix(h, 16).ok())
        .unwrap_or(0);
    (prefix % u64::from(partitions.max(1))) as u32
}

/// Parses one dataset line (without its line ending) into a [`Line`].
///
/// `oversize` is the real length when the reader cut the line short.
pub fn parse_line(raw: &[u8], oversize: Option<u64>, spec: &JobSpec, user: &Template, ids: &IdContext) -> Line {
    if let Some(bytes) = oversize {
        return Line::Dropped {
            key: None,
            reason: DropReason::TooLarge {
                bytes,
                limit: spec.job.max_record_bytes,
            },
        };
    }
    let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
    let Ok(text) = std::str::from_utf8(raw) else {
        return Line::Dropped {
            key: None,
            reason: DropReason::InvalidUtf8,
        };
    };
    if text.trim().is_empty() {
        return Line::Blank;
    }
    if text.len() > spec.job.max_record_bytes {
        return Line::Dropped {
            key: None,
            reason: DropReason::TooLarge {
                bytes: text.len() as u64,
                limit: spec.job.max_record_bytes,
            },
        };
    }
    let value: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => {
            return Line::Dropped {
                key: None,
                reason: DropReason::MalformedJson(e.to_string()),
            };
        }
    };
    let Value::Object(map) = value else {
        return Line::Dropped {
            key: None,
            reason: DropReason::NotObject,
        };
    };
    if map.values().any(|v| crate::json::depth(v) >= crate::json::MAX_DEPTH) {
        return Line::Dropped {
            key: business_key(&map, &spec.job.id_field).ok(),
            reason: DropReason::TooDeep,
        };
    }
    let key = match business_key(&map, &spec.job.id_field) {
        Ok(k) => k,
        Err(reason) => return Line::Dropped { key: None, reason },
    };
    let id = ids.record_id(&key);
    let rendered = user.render(&map);
    Line::Record(Record {
        key,
        id,
        input: Value::Object(map).to_string(),
        rendered,
    })
}

/// The business key as text: a string as is, an integer in decimal.
fn business_key(map: &Map<String, Value>, id_field: &str) -> Result<String, DropReason> {
    match lookup(map, id_field) {
        None => Err(DropReason::MissingId),
        Some(Value::Null) => Err(DropReason::EmptyId),
        Some(Value::String(s)) if s.trim().is_empty() => Err(DropReason::EmptyId),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => Ok(n.to_string()),
        Some(_) => Err(DropReason::InvalidId),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> JobSpec {
        JobSpec::parse(include_str!("../../examples/job.toml"), "job.toml").unwrap()
    }

    fn parse(line: &str) -> Line {
        let spec = spec();
        let user = Template::parse(&spec.prompt.user).unwrap();
        parse_line(line.as_bytes(), None, &spec, &user, &IdContext::new("job1", &spec))
    }

    fn reason(line: &str) -> String {
        match parse(line) {
            Line::Dropped { reason, .. } => reason.code(),
            other => panic!("expected a drop, got {other:?}"),
        }
    }

    const GOOD: &str = r#"{"message_id": "m1", "channel": "chat", "task_type": "classify", "text": "hello"}"#;

    #[test]
    fn record_ids_are_stable_and_follow_every_version() {
        let spec = spec();
        let base = IdContext::new("job1", &spec).record_id("m1");
        assert_eq!(base, IdContext::new("job1", &spec).record_id("m1"));
        assert_eq!(base.len(), 64);
        assert_ne!(base, IdContext::new("job1", &spec).record_id("m2"));
        assert_ne!(base, IdContext::new("job2", &spec).record_id("m1"));
        let mut changed = spec.clone();
        changed.versions.source = "other".into();
        assert_ne!(base, IdContext::new("job1", &changed).record_id("m1"));
        let mut changed = spec.clone();
        changed.versions.prompt = "v2".into();
        assert_ne!(base, IdContext::new("job1", &changed).record_id("m1"));
        let mut changed = spec.clone();
        changed.provider.model = "other-model".into();
        assert_ne!(base, IdContext::new("job1", &changed).record_id("m1"));
        // Parts are length-prefixed: moving a boundary changes the id.
        assert_ne!(
            IdContext::new("ab", &spec).record_id("c"),
            IdContext::new("a", &spec).record_id("bc")
        );
    }

    #[test]
    fn a_good_line_becomes_a_rendered_record() {
        let Line::Record(r) = parse(GOOD) else {
            panic!("not a record")
        };
        assert_eq!(r.key, "m1");
        assert!(r.rendered.unwrap().contains("Message:\nhello"));
        assert!(
            r.input.starts_with("{\"message_id\":\"m1\""),
            "key order kept: {}",
            r.input
        );
    }

    #[test]
    fn crlf_and_integer_ids_are_accepted() {
        let Line::Record(r) = parse(&format!("{}\r", GOOD.replace("\"m1\"", "42"))) else {
            panic!()
        };
        assert_eq!(r.key, "42");
    }

    #[test]
    fn every_bad_line_class_has_its_reason() {
        assert!(matches!(parse("   "), Line::Blank));
        assert_eq!(reason("{\"message_id\": "), "malformed_json");
        assert_eq!(reason("[1, 2]"), "not_object");
        assert_eq!(reason(r#"{"text": "x"}"#), "missing_id");
        assert_eq!(reason(r#"{"message_id": "", "text": "x"}"#), "empty_id");
        assert_eq!(reason(r#"{"message_id": null, "text": "x"}"#), "empty_id");
        assert_eq!(reason(r#"{"message_id": 1.5, "text": "x"}"#), "invalid_id");
        assert_eq!(reason(r#"{"message_id": true, "text": "x"}"#), "invalid_id");
        let spec = spec();
        let user = Template::parse(&spec.prompt.user).unwrap();
        let ids = IdContext::new("j", &spec);
        assert!(matches!(
            parse_line(b"{\"a\": \"\xff\"}", None, &spec, &user, &ids),
            Line::Dropped {
                reason: DropReason::InvalidUtf8,
                ..
            }
        ));
        assert!(matches!(
            parse_line(b"", Some(1 << 20), &spec, &user, &ids),
            Line::Dropped {
                reason: DropReason::TooLarge { bytes: 1_048_576, .. },
                ..
            }
        ));
    }

    #[test]
    fn a_missing_template_field_keeps_the_identity_but_fails_rendering() {
        let Line::Record(r) = parse(r#"{"message_id": "m9", "channel": "chat", "task_type": "classify"}"#) else {
            panic!()
        };
        assert_eq!(r.rendered.unwrap_err().to_string(), "template_missing:text");
    }

    #[test]
    fn partitions_spread_and_stay_in_range() {
        let spec = spec();
        let ids = IdContext::new("j", &spec);
        let mut seen = [0u32; 4];
        for i in 0..400 {
            seen[partition_of(&ids.record_id(&i.to_string()), 4) as usize] += 1;
        }
        assert!(seen.iter().all(|&n| n > 60), "{seen:?}");
    }
}

//! The cross-check: a second model answers the same prompt for some
//! records, and the fields the spec lists must agree before the first
//! model's answer is committed.
//!
//! `[check]` names the checker (its model, and its endpoint, key and prices
//! when they differ from the job's), which answers it checks (`policy`:
//! `all`, a seeded `sample` of `share`, or `low_confidence`: those whose
//! `confidence_field` is under `below`, or absent), and the `fields` that
//! must agree (exactly, or within `tolerance` for a number). The worker
//! keeps a valid answer it checks in the task (it was paid for), calls the
//! checker in the record's next step, and commits the first answer when
//! they agree or sends the record to review with both side by side when
//! they do not (reason [`DISAGREES`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::spec::{FieldType, OutputSection, Prices};

/// The review reason of a disagreement.
pub const DISAGREES: &str = "checker_disagrees";

/// Which answers are checked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    #[default]
    All,
    Sample,
    LowConfidence,
}

/// `[check]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckSpec {
    /// The checker's model (none: no check).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub model: String,
    /// Its endpoint (default: the job's `provider.base_url`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
    /// The variable holding its key (default: the job's `provider.api_key_env`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
    #[serde(default)]
    pub policy: Policy,
    /// `sample`: the share of valid answers checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share: Option<f64>,
    /// `sample`: which ones (the same seed always picks the same records).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// `low_confidence`: the output field holding the model's confidence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confidence_field: Option<String>,
    /// `low_confidence`: answers under this are checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub below: Option<f64>,
    /// The output fields that must agree.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fields: Vec<String>,
    /// Numeric fields: the largest difference that still agrees.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tolerance: BTreeMap<String, f64>,
    /// The checker's prices (default: the job's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prices: Option<Prices>,
    /// A verification prompt instead of the job's user prompt: a template
    /// over the record's fields and `{{first_answer}}` (the first model's
    /// answer, as JSON). The system prompt and the output spec stay the job's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
}

/// The field a verification prompt reads the first model's answer from.
pub const FIRST_ANSWER: &str = "first_answer";

impl CheckSpec {
    pub fn is_none(&self) -> bool {
        *self == CheckSpec::default()
    }

    /// Whether the job has a checker.
    pub fn is_on(&self) -> bool {
        !self.model.is_empty()
    }

    /// The checker's user prompt for a record: the verification prompt when
    /// the spec has one (with the first answer), else the job's own.
    pub fn prompt_for(
        &self,
        job_prompt: &crate::template::Template,
        input: &Map<String, Value>,
        first: &Map<String, Value>,
    ) -> Result<String, String> {
        let Some(text) = &self.prompt else {
            return job_prompt.render(input).map_err(|e| e.to_string());
        };
        let template = crate::template::Template::parse(text).map_err(|e| format!("check.prompt: {e}"))?;
        let mut fields = input.clone();
        fields.insert(
            FIRST_ANSWER.to_owned(),
            Value::String(serde_json::to_string(first).unwrap_or_default()),
        );
        template.render(&fields).map_err(|e| e.to_string())
    }

    /// Whether a valid answer of `record_id` is checked.
    pub fn selects(&self, record_id: &str, output: &Map<String, Value>) -> bool {
        if !self.is_on() {
            return false;
        }
        match self.policy {
            Policy::All => true,
            Policy::Sample => {
                crate::spec::audit_draw(self.seed.unwrap_or(0) ^ 0x00c4_ec4e, record_id) < self.share.unwrap_or(0.0)
            }
            Policy::LowConfidence => {
                let field = self.confidence_field.as_deref().unwrap_or("confidence");
                match output.get(field).and_then(Value::as_f64) {
                    Some(c) => c < self.below.unwrap_or(0.0),
                    // No confidence given is no confidence.
                    None => true,
                }
            }
        }
    }

    /// Field by field, whether the two answers agree.
    pub fn compare(&self, first: &Map<String, Value>, checker: &Map<String, Value>) -> BTreeMap<String, bool> {
        self.fields
            .iter()
            .map(|f| {
                let (a, b) = (first.get(f), checker.get(f));
                let agree = match (
                    a.and_then(Value::as_f64),
                    b.and_then(Value::as_f64),
                    self.tolerance.get(f),
                ) {
                    (Some(x), Some(y), Some(tol)) => (x - y).abs() <= *tol,
                    _ => a == b,
                };
                (f.clone(), agree)
            })
            .collect()
    }

    /// What is wrong with it: (key, why). `user`: the job's user prompt (a
    /// verification prompt reads no field it does not, so it renders
    /// wherever the job's does).
    pub fn problems(&self, output: &OutputSection, user: &str) -> Vec<(String, String)> {
        let mut p: Vec<(String, String)> = Vec::new();
        let mut add = |k: &str, why: String| p.push((format!("check.{k}"), why));
        if self.is_none() {
            return Vec::new();
        }
        if !self.is_on() {
            add(
                "model",
                "names the checker's model: [check] without it checks nothing".into(),
            );
        }
        if let Some(url) = &self.base_url
            && !(url.starts_with("http://") || url.starts_with("https://"))
        {
            add("base_url", format!("`{url}` is not an http(s) URL"));
        }
        if self.fields.is_empty() {
            add(
                "fields",
                "lists the output fields that must agree, e.g. fields = [\"label\"]".into(),
            );
        }
        let known: Vec<&String> = output.fields.iter().map(|(n, _)| n).collect();
        for f in &self.fields {
            if !known.contains(&f) {
                add(
                    "fields",
                    format!("`{f}` is not an output field (they are: {})", join(&known)),
                );
            }
        }
        for (f, tol) in &self.tolerance {
            let numeric = output
                .fields
                .iter()
                .any(|(n, s)| n == f && matches!(s.kind, FieldType::Number | FieldType::Integer));
            if !self.fields.contains(f) || !numeric {
                add(
                    "tolerance",
                    format!("`{f}` is not a number field listed in check.fields"),
                );
            } else if !(tol.is_finite() && *tol >= 0.0) {
                add("tolerance", format!("`{f}`: {tol} is not a difference (0 or more)"));
            }
        }
        if let Some(text) = &self.prompt {
            let known = crate::template::Template::parse(user)
                .map(|t| t.fields().iter().map(|f| f.to_string()).collect::<Vec<_>>());
            match (crate::template::Template::parse(text), known) {
                (Err(e), _) => add("prompt", e.to_string()),
                (Ok(t), Ok(known)) => {
                    for f in t.fields() {
                        if f != FIRST_ANSWER && !known.iter().any(|k| k == f) {
                            add(
                                "prompt",
                                format!(
                                    "reads `{{{{{f}}}}}`, which prompt.user does not: a record could lack it (the fields it can read: {}, {FIRST_ANSWER})",
                                    known.join(", ")
                                ),
                            );
                        }
                    }
                }
                (Ok(_), Err(_)) => {}
            }
        }
        match self.policy {
            Policy::All => {}
            Policy::Sample => match self.share {
                Some(s) if s.is_finite() && s > 0.0 && s <= 1.0 => {}
                _ => add(
                    "share",
                    "policy = \"sample\" takes share, above 0 and at most 1 (a share of the valid answers)".into(),
                ),
            },
            Policy::LowConfidence => {
                let field = self.confidence_field.as_deref().unwrap_or("confidence");
                let numeric = output
                    .fields
                    .iter()
                    .any(|(n, s)| n == field && matches!(s.kind, FieldType::Number));
                if !numeric {
                    add(
                        "confidence_field",
                        format!("`{field}` is not a number field of the output (policy = \"low_confidence\")"),
                    );
                }
                if !self.below.is_some_and(|b| b.is_finite()) {
                    add(
                        "below",
                        "policy = \"low_confidence\" takes below: answers under it are checked".into(),
                    );
                }
            }
        }
        p
    }
}

fn join(names: &[&String]) -> String {
    names.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
}

/// A valid answer waiting for its check (kept in the task: it was paid for).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Pending {
    pub output: Map<String, Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_id: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub repairs: Vec<crate::validate::Repair>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<crate::task::Usage>,
}

/// What a check came to, kept on the checker's call in the record's history.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    pub model: String,
    /// Field by field: agreed or not.
    pub fields: BTreeMap<String, bool>,
    /// The first model's answer and the checker's (the checker's absent
    /// when it was not valid: its errors are the call's).
    pub first: Map<String, Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checker: Option<Map<String, Value>>,
}

impl Verdict {
    pub fn agrees(&self) -> bool {
        self.checker.is_some() && self.fields.values().all(|a| *a)
    }

    /// The fields side by side, for people: `field  first  checker  agree?`.
    pub fn side_by_side(&self) -> Vec<(String, String, String, bool)> {
        let text = |m: Option<&Map<String, Value>>, f: &str| {
            m.and_then(|m| m.get(f)).map_or("-".to_owned(), |v| match v {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            })
        };
        self.fields
            .iter()
            .map(|(f, agree)| {
                (
                    f.clone(),
                    text(Some(&self.first), f),
                    text(self.checker.as_ref(), f),
                    *agree,
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    fn spec() -> CheckSpec {
        CheckSpec {
            model: "judge".into(),
            fields: vec!["label".into(), "amount".into()],
            tolerance: [("amount".to_owned(), 0.01)].into(),
            ..CheckSpec::default()
        }
    }

    #[test]
    fn fields_agree_exactly_or_within_their_tolerance() {
        let s = spec();
        let a = obj(json!({"label": "billing", "amount": 10.0, "reason": "x"}));
        let same = s.compare(&a, &obj(json!({"label": "billing", "amount": 10.005, "reason": "y"})));
        assert!(same.values().all(|x| *x), "{same:?}");
        let off = s.compare(&a, &obj(json!({"label": "Billing", "amount": 10.5})));
        assert_eq!(off, [("amount".to_owned(), false), ("label".to_owned(), false)].into());
        let missing = s.compare(&a, &obj(json!({"label": "billing"})));
        assert!(!missing["amount"]);
    }

    #[test]
    fn policies_select_all_a_seeded_share_or_the_unsure() {
        let out = obj(json!({"confidence": 0.4}));
        assert!(spec().selects("r1", &out));
        let sample = CheckSpec {
            policy: Policy::Sample,
            share: Some(0.2),
            seed: Some(4),
            ..spec()
        };
        let picked = (0..5000).filter(|i| sample.selects(&format!("r{i}"), &out)).count();
        assert!((900..1100).contains(&picked), "{picked}");
        assert_eq!(sample.selects("r7", &out), sample.clone().selects("r7", &out));
        let unsure = CheckSpec {
            policy: Policy::LowConfidence,
            confidence_field: Some("confidence".into()),
            below: Some(0.5),
            ..spec()
        };
        assert!(unsure.selects("r", &out));
        assert!(!unsure.selects("r", &obj(json!({"confidence": 0.9}))));
        assert!(
            unsure.selects("r", &obj(json!({"confidence": null}))),
            "no confidence is low"
        );
        assert!(!CheckSpec::default().selects("r", &out), "no checker, no check");
    }

    #[test]
    fn spec_check_names_what_is_wrong_with_a_check() {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/job.toml")).unwrap();
        let spec = crate::spec::JobSpec::parse(&text, "job.toml").unwrap();
        let keys = |c: CheckSpec| -> Vec<String> {
            c.problems(&spec.output, &spec.prompt.user)
                .into_iter()
                .map(|(k, _)| k)
                .collect()
        };
        assert!(keys(CheckSpec::default()).is_empty(), "no [check], nothing to say");
        assert!(
            keys(CheckSpec {
                model: "m".into(),
                fields: vec!["label".into()],
                ..CheckSpec::default()
            })
            .is_empty()
        );
        let bad = CheckSpec {
            model: String::new(),
            base_url: Some("ftp://x".into()),
            fields: vec!["nope".into(), "label".into()],
            tolerance: [("label".to_owned(), 1.0)].into(),
            policy: Policy::Sample,
            ..CheckSpec::default()
        };
        assert_eq!(
            keys(bad),
            [
                "check.model",
                "check.base_url",
                "check.fields",
                "check.tolerance",
                "check.share"
            ]
        );
        let unsure = CheckSpec {
            model: "m".into(),
            fields: vec!["label".into()],
            policy: Policy::LowConfidence,
            confidence_field: Some("reason".into()),
            ..CheckSpec::default()
        };
        assert_eq!(keys(unsure), ["check.confidence_field", "check.below"]);
        let verify = |p: &str| CheckSpec {
            model: "m".into(),
            fields: vec!["label".into()],
            prompt: Some(p.into()),
            ..CheckSpec::default()
        };
        assert!(
            keys(verify(
                "Message: {{text}}\nAnswer given: {{first_answer}}\nIs it right?"
            ))
            .is_empty()
        );
        assert_eq!(keys(verify("{{subject}} {{first_answer}}")), ["check.prompt"]);
        assert_eq!(keys(verify("{{unclosed")), ["check.prompt"]);
        let input: Map<String, Value> = obj(json!({"text": "hi"}));
        let first = obj(json!({"label": "billing"}));
        let job_prompt = crate::template::Template::parse("{{text}}").unwrap();
        let rendered = verify("M: {{text}} A: {{first_answer}}")
            .prompt_for(&job_prompt, &input, &first)
            .unwrap();
        assert_eq!(rendered, r#"M: hi A: {"label":"billing"}"#);
        assert_eq!(
            CheckSpec::default().prompt_for(&job_prompt, &input, &first).unwrap(),
            "hi"
        );
    }

    #[test]
    fn a_disagreement_reads_side_by_side() {
        let v = Verdict {
            model: "judge".into(),
            fields: [("label".to_owned(), false)].into(),
            first: obj(json!({"label": "billing"})),
            checker: Some(obj(json!({"label": "shipping"}))),
        };
        assert!(!v.agrees());
        assert_eq!(
            v.side_by_side(),
            [("label".to_owned(), "billing".to_owned(), "shipping".to_owned(), false)]
        );
    }
}

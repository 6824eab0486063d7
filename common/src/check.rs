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

use serde_json::{Map, Value};

pub use crate::spec::{CheckSpec, FIRST_ANSWER, Policy};
pub use crate::task::{Pending, Verdict};

/// The review reason of a disagreement.
pub const DISAGREES: &str = "checker_disagrees";

impl CheckSpec {
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
    fn a_checker_elsewhere_names_its_own_key() {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/job.toml")).unwrap();
        let with = |extra: &str| {
            let spec = format!("{text}\n[check]\nmodel = \"judge\"\nfields = [\"label\"]\n{extra}\n");
            match crate::spec::JobSpec::parse(&spec, "job.toml") {
                Ok(_) => false,
                Err(e) => e.to_string().contains("check.api_key_env"),
            }
        };
        assert!(
            with("base_url = \"https://elsewhere.example/v1\""),
            "the job's key never goes to another host"
        );
        assert!(!with(
            "base_url = \"https://elsewhere.example/v1\"\napi_key_env = \"JUDGE_KEY\""
        ));
        assert!(!with(""), "the job's own server takes the job's key");
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

//! Business rules over a record's input and output together
//! (`[output.rules]`): CEL expressions (the `cel` crate: no parser of our
//! own), compiled once per spec. A rule that does not hold is a validation
//! error with the rule's name (`E_RULE`), fed back to the model on retry
//! like any other.
//!
//! ```toml
//! [output.rules]
//! amount_not_negative = "output.amount >= 0"
//! ends_after_start = { expr = "output.end >= output.start", message = "the end cannot come before the start" }
//! ```

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, OnceLock};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// One rule as a spec writes it: the expression alone, or with the words
/// the model and reviewers are told when it does not hold.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum RuleSpec {
    Expr(String),
    Full(RuleTable),
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RuleTable {
    pub expr: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl RuleSpec {
    pub fn expr(&self) -> &str {
        match self {
            RuleSpec::Expr(e) => e,
            RuleSpec::Full(t) => &t.expr,
        }
    }

    /// What the model and reviewers are told: the message, else the expression.
    pub fn says(&self) -> &str {
        match self {
            RuleSpec::Full(RuleTable { message: Some(m), .. }) => m,
            other => other.expr(),
        }
    }
}

/// A rule an answer breaks.
#[derive(Debug, Clone, PartialEq)]
pub struct Broken {
    pub rule: String,
    /// What the model and reviewers are told.
    pub message: String,
    /// False when the rule could not be evaluated (a field it reads is
    /// absent, a type it compares is another): no other answer can mend that.
    pub evaluated: bool,
}

/// The variables a rule may use.
const VARIABLES: [&str; 2] = ["input", "output"];

/// A spec's rules by name, compiled on first use.
#[derive(Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Rules {
    specs: BTreeMap<String, RuleSpec>,
    #[serde(skip)]
    compiled: OnceLock<Arc<Vec<Compiled>>>,
}

struct Compiled {
    name: String,
    says: String,
    program: cel::Program,
    uses_input: bool,
}

impl Clone for Rules {
    fn clone(&self) -> Rules {
        Rules {
            specs: self.specs.clone(),
            compiled: OnceLock::new(),
        }
    }
}

impl PartialEq for Rules {
    fn eq(&self, other: &Rules) -> bool {
        self.specs == other.specs
    }
}

impl std::fmt::Debug for Rules {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.specs.fmt(f)
    }
}

impl Rules {
    pub fn is_empty(&self) -> bool {
        self.specs.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &RuleSpec)> {
        self.specs.iter()
    }

    /// What is wrong with each rule, by name: an expression that does not
    /// compile, a name that is no identifier, a variable other than `input`
    /// and `output`.
    pub fn problems(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for (name, rule) in &self.specs {
            if !crate::template::is_identifier(name) {
                out.push((
                    name.clone(),
                    "a rule's name is a word like `amount_not_negative`".into(),
                ));
            }
            match cel::Program::compile(rule.expr()) {
                Err(e) => out.push((name.clone(), format!("`{}` does not compile: {e}", rule.expr()))),
                Ok(p) => {
                    let refs = p.references();
                    let unknown: Vec<&str> = refs
                        .variables()
                        .into_iter()
                        .filter(|v| !VARIABLES.contains(v))
                        .collect();
                    if !unknown.is_empty() {
                        out.push((
                            name.clone(),
                            format!(
                                "`{}` uses {}: a rule sees only `input` (the record) and `output` (the answer)",
                                rule.expr(),
                                unknown.join(", ")
                            ),
                        ));
                    }
                }
            }
        }
        out
    }

    /// The rules compiled (a rule that does not compile is left out: the
    /// spec check refuses such a spec before any record is judged).
    fn compiled(&self) -> &[Compiled] {
        self.compiled.get_or_init(|| {
            Arc::new(
                self.specs
                    .iter()
                    .filter_map(|(name, rule)| {
                        let program = cel::Program::compile(rule.expr()).ok()?;
                        let uses_input = program.references().has_variable("input");
                        Some(Compiled {
                            name: name.clone(),
                            says: rule.says().to_owned(),
                            program,
                            uses_input,
                        })
                    })
                    .collect(),
            )
        })
    }

    /// The rules a valid `output` breaks (of `input`, when it is known: a
    /// rule about the input is not judged without it). A rule that cannot
    /// be evaluated is broken too, with the evaluator's words.
    pub fn broken(&self, input: Option<&Map<String, Value>>, output: &Map<String, Value>) -> Vec<Broken> {
        let rules = self.compiled();
        if rules.is_empty() {
            return Vec::new();
        }
        let mut context = cel::Context::default();
        context.add_variable_from_value("output", to_cel(&Value::Object(output.clone())));
        if let Some(input) = input {
            context.add_variable_from_value("input", to_cel(&Value::Object(input.clone())));
        }
        let mut out = Vec::new();
        for rule in rules {
            if rule.uses_input && input.is_none() {
                continue;
            }
            let (message, evaluated) = match rule.program.execute(&context) {
                Ok(cel::Value::Bool(true)) => continue,
                Ok(cel::Value::Bool(false)) => (format!("rule `{}` does not hold: {}", rule.name, rule.says), true),
                Ok(other) => (
                    format!("rule `{}` gave {other:?}, not true or false: {}", rule.name, rule.says),
                    false,
                ),
                Err(e) => (
                    format!("rule `{}` cannot be evaluated ({e}): {}", rule.name, rule.says),
                    false,
                ),
            };
            out.push(Broken {
                rule: rule.name.clone(),
                message,
                evaluated,
            });
        }
        out
    }
}

/// A JSON value as CEL sees it: whole numbers as `int` (or `uint` past
/// i64), others as `double`.
fn to_cel(v: &Value) -> cel::Value {
    match v {
        Value::Null => cel::Value::Null,
        Value::Bool(b) => cel::Value::Bool(*b),
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => cel::Value::Int(i),
            (None, Some(u), _) => cel::Value::UInt(u),
            (_, _, Some(f)) => cel::Value::Float(f),
            _ => cel::Value::Null,
        },
        Value::String(s) => cel::Value::String(Arc::new(s.clone())),
        Value::Array(a) => cel::Value::List(Arc::new(a.iter().map(to_cel).collect())),
        Value::Object(o) => {
            let map: HashMap<String, cel::Value> = o.iter().map(|(k, v)| (k.clone(), to_cel(v))).collect();
            cel::Value::Map(map.into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(toml_text: &str) -> Rules {
        toml::from_str(toml_text).unwrap_or_else(|e| panic!("{e}"))
    }

    fn obj(v: serde_json::Value) -> Map<String, Value> {
        match v {
            Value::Object(o) => o,
            _ => Map::new(),
        }
    }

    #[test]
    fn a_rule_over_input_and_output_holds_or_names_itself() {
        let r = rules(
            r#"
            not_negative = "output.amount >= 0"
            ordered = { expr = "output.end >= output.start", message = "the end comes after the start" }
            lang = 'output.lang in ["en", "de"] || input.region == "other"'
            "#,
        );
        assert!(r.problems().is_empty(), "{:?}", r.problems());
        let input = obj(serde_json::json!({"region": "eu"}));
        let good = obj(serde_json::json!({"amount": 3, "start": 1, "end": 2.5, "lang": "de"}));
        assert!(r.broken(Some(&input), &good).is_empty());
        let bad = obj(serde_json::json!({"amount": -1.5, "start": 3, "end": 2, "lang": "fr"}));
        let broken = r.broken(Some(&input), &bad);
        let names: Vec<&str> = broken.iter().map(|b| b.rule.as_str()).collect();
        assert_eq!(names, ["lang", "not_negative", "ordered"]);
        assert!(broken.iter().all(|b| b.evaluated));
        assert!(
            broken[2].message.contains("the end comes after the start"),
            "{}",
            broken[2].message
        );
        // The input decides the third: judged only with it.
        let other = obj(serde_json::json!({"region": "other"}));
        assert_eq!(r.broken(Some(&other), &bad).len(), 2);
        assert_eq!(r.broken(None, &bad).len(), 2);
        // A field it reads is absent: broken, with the evaluator's words.
        let missing = obj(serde_json::json!({"start": 1, "end": 2, "lang": "en"}));
        let broken = r.broken(Some(&input), &missing);
        assert_eq!(broken.len(), 1);
        assert!(
            broken[0].message.contains("cannot be evaluated"),
            "{}",
            broken[0].message
        );
        assert!(!broken[0].evaluated, "reviewed, not retried");
    }

    #[test]
    fn rules_that_do_not_compile_or_read_other_variables_are_named() {
        let r = rules(
            r#"
            broken = "output.amount >= "
            stray = "record.amount > 0"
            "Bad Name" = "true"
            "#,
        );
        let p = r.problems();
        let named = |n: &str| {
            p.iter()
                .filter(|(k, _)| k == n)
                .map(|(_, m)| m.clone())
                .collect::<Vec<_>>()
        };
        assert!(named("broken")[0].contains("does not compile"), "{p:?}");
        assert!(named("stray")[0].contains("uses record"), "{p:?}");
        assert!(named("Bad Name")[0].contains("a word"), "{p:?}");
    }
}

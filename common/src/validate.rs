//! Model output against the field spec: `Valid` (with the repairs made) or
//! `Invalid` (error codes plus field). Pure: no I/O, no clock.
//!
//! A JSON object wrapped in a code fence or in prose is extracted, and that
//! repair is recorded. Booleans are never numbers. Fields the system knows
//! (record id, model) are filled in by code, never taken from the model.

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::spec::{FieldType, JobSpec, SYSTEM_FIELDS, value_has_type};

/// The error codes of DESIGN.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
pub enum ErrorCode {
    #[serde(rename = "E_JSON")]
    Json,
    #[serde(rename = "E_NOT_OBJECT")]
    NotObject,
    #[serde(rename = "E_MISSING")]
    Missing,
    #[serde(rename = "E_NULL")]
    Null,
    #[serde(rename = "E_TYPE")]
    Type,
    #[serde(rename = "E_ENUM")]
    Enum,
    #[serde(rename = "E_RANGE")]
    Range,
    #[serde(rename = "E_LEN")]
    Len,
}

impl ErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::Json => "E_JSON",
            ErrorCode::NotObject => "E_NOT_OBJECT",
            ErrorCode::Missing => "E_MISSING",
            ErrorCode::Null => "E_NULL",
            ErrorCode::Type => "E_TYPE",
            ErrorCode::Enum => "E_ENUM",
            ErrorCode::Range => "E_RANGE",
            ErrorCode::Len => "E_LEN",
        }
    }
}

/// One problem with an output: a code, the field (empty for the whole
/// output), and a sentence the model can act on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FieldError {
    pub code: ErrorCode,
    pub field: String,
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "{}: {}", self.code.as_str(), self.message)
        } else {
            write!(f, "{} {}: {}", self.code.as_str(), self.field, self.message)
        }
    }
}

/// A repair made to get at the JSON object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Repair {
    /// The object was inside a ``` code fence.
    CodeFence,
    /// The object was surrounded by prose.
    ExtractedFromProse,
    /// Fields the spec does not name were removed.
    ExtraFieldsRemoved,
    /// Fields the system fills in were provided by the model and ignored.
    SystemFieldsIgnored,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Validation {
    /// The output, with only the spec's fields, in spec order.
    Valid {
        output: Map<String, Value>,
        repairs: Vec<Repair>,
    },
    Invalid {
        errors: Vec<FieldError>,
        repairs: Vec<Repair>,
    },
}

/// Validates raw model text against the spec's output fields.
pub fn validate(spec: &JobSpec, raw: &str) -> Validation {
    let mut repairs = Vec::new();
    let value = match extract_json(raw, &mut repairs) {
        Some(v) if crate::json::too_deep(&v) => {
            let why = format!("the answer nests deeper than {} levels", crate::json::MAX_DEPTH);
            return Validation::Invalid {
                errors: vec![err(ErrorCode::Json, "", &why)],
                repairs,
            };
        }
        Some(v) => v,
        None => {
            return Validation::Invalid {
                errors: vec![err(ErrorCode::Json, "", "the answer is not a JSON object")],
                repairs,
            };
        }
    };
    let Value::Object(mut obj) = value else {
        return Validation::Invalid {
            errors: vec![err(ErrorCode::NotObject, "", "the answer must be one JSON object")],
            repairs,
        };
    };
    if SYSTEM_FIELDS.iter().any(|f| obj.remove(*f).is_some()) {
        repairs.push(Repair::SystemFieldsIgnored);
    }
    let fields = &spec.output.fields;
    let mut errors = Vec::new();
    let mut output = Map::new();
    for (name, f) in fields.iter() {
        let required = f.required
            || f.required_if
                .as_ref()
                .is_some_and(|c| obj.get(&c.field) == Some(&c.equals));
        match obj.get(name.as_str()) {
            None => {
                if required {
                    errors.push(err(ErrorCode::Missing, name, "is required"));
                }
            }
            Some(Value::Null) => {
                if f.nullable {
                    output.insert(name.clone(), Value::Null);
                } else if required {
                    errors.push(err(ErrorCode::Null, name, "must not be null"));
                }
                // An optional field sent as null (strict schemas require every
                // property) counts as absent.
            }
            Some(v) => match check_value(v, f) {
                Ok(()) => {
                    output.insert(name.clone(), v.clone());
                }
                Err(e) => errors.push(FieldError {
                    field: name.clone(),
                    ..e
                }),
            },
        }
    }
    if obj.keys().any(|k| fields.get(k).is_none()) {
        repairs.push(Repair::ExtraFieldsRemoved);
    }
    if errors.is_empty() {
        Validation::Valid { output, repairs }
    } else {
        Validation::Invalid { errors, repairs }
    }
}

fn check_value(v: &Value, f: &crate::spec::FieldSpec) -> Result<(), FieldError> {
    if !value_has_type(v, f.kind) {
        return Err(err(
            ErrorCode::Type,
            "",
            &format!("must be a {}, got {}", f.kind.name(), json_type(v)),
        ));
    }
    if let Some(values) = &f.enum_values {
        let found = values
            .iter()
            .any(|e| e == v || (e.as_f64().is_some() && e.as_f64() == v.as_f64()));
        if !found {
            let list: Vec<String> = values.iter().map(Value::to_string).collect();
            return Err(err(
                ErrorCode::Enum,
                "",
                &format!("{v} is not one of {}", list.join(", ")),
            ));
        }
    }
    if let Some(x) = v
        .as_f64()
        .filter(|_| matches!(f.kind, FieldType::Number | FieldType::Integer))
        && (f.min.is_some_and(|min| x < min) || f.max.is_some_and(|max| x > max))
    {
        let lo = f.min.map_or("-inf".to_owned(), |m| m.to_string());
        let hi = f.max.map_or("inf".to_owned(), |m| m.to_string());
        return Err(err(ErrorCode::Range, "", &format!("{x} is outside {lo}..{hi}")));
    }
    if let Some(max) = f.max_len {
        let len = match v {
            Value::String(s) => s.chars().count(),
            Value::Array(a) => a.len(),
            _ => 0,
        };
        if len > max {
            return Err(err(
                ErrorCode::Len,
                "",
                &format!("has length {len}, the maximum is {max}"),
            ));
        }
    }
    Ok(())
}

fn err(code: ErrorCode, field: &str, message: &str) -> FieldError {
    FieldError {
        code,
        field: field.to_owned(),
        message: message.to_owned(),
    }
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// The JSON value in `raw`: the whole text, else a fenced block, else the
/// outermost `{...}` in prose.
fn extract_json(raw: &str, repairs: &mut Vec<Repair>) -> Option<Value> {
    let text = raw.trim();
    if let Ok(v) = serde_json::from_str::<Value>(text) {
        return Some(v);
    }
    if let Some(inner) = fenced(text)
        && let Ok(v) = serde_json::from_str::<Value>(inner.trim())
    {
        repairs.push(Repair::CodeFence);
        return Some(v);
    }
    let (start, end) = (text.find('{')?, text.rfind('}')?);
    if end > start
        && let Ok(v) = serde_json::from_str::<Value>(&text[start..=end])
    {
        repairs.push(Repair::ExtractedFromProse);
        return Some(v);
    }
    None
}

/// The body of the first ``` fence (an optional language tag is skipped).
fn fenced(text: &str) -> Option<&str> {
    let open = text.find("```")?;
    let after = &text[open + 3..];
    let body_start = after.find('\n').map_or(0, |i| i + 1);
    let body = &after[body_start..];
    let close = body.find("```")?;
    Some(&body[..close])
}

/// The feedback for the next attempt: only validation errors, one a line.
pub fn feedback(errors: &[FieldError]) -> String {
    let mut out = String::from("Your previous answer was rejected by the validator:\n");
    for e in errors {
        out.push_str("- ");
        out.push_str(&e.to_string());
        out.push('\n');
    }
    out.push_str("Answer again with one corrected JSON object.");
    out
}

/// The strict JSON schema of the output, for `response_format`. Optional and
/// conditional fields are nullable, as strict mode requires every property.
/// The `response_format` of a form (None for `off`): `json_schema` (strict),
/// or `json_object` with the same schema attached (llama.cpp, vLLM).
pub fn response_format(spec: &JobSpec, form: crate::spec::StructuredOutput) -> Option<Value> {
    use crate::spec::StructuredOutput;
    match form {
        StructuredOutput::JsonSchema => Some(json_schema(spec)),
        StructuredOutput::JsonObject => {
            let schema = json_schema(spec)["json_schema"]["schema"].clone();
            Some(serde_json::json!({"type": "json_object", "schema": schema}))
        }
        StructuredOutput::Off | StructuredOutput::Auto => None,
    }
}

pub fn json_schema(spec: &JobSpec) -> Value {
    let mut properties = Map::new();
    let mut required = Vec::new();
    for (name, f) in spec.output.fields.iter() {
        let optional = f.nullable || !f.required || f.required_if.is_some();
        let ty = if optional {
            serde_json::json!([f.kind.name(), "null"])
        } else {
            serde_json::json!(f.kind.name())
        };
        let mut prop = Map::new();
        prop.insert("type".into(), ty);
        if let Some(d) = &f.description {
            prop.insert("description".into(), Value::String(d.clone()));
        }
        if let Some(values) = &f.enum_values {
            let mut values = values.clone();
            if optional {
                values.push(Value::Null);
            }
            prop.insert("enum".into(), Value::Array(values));
        }
        if let Some(min) = f.min {
            prop.insert("minimum".into(), serde_json::json!(min));
        }
        if let Some(max) = f.max {
            prop.insert("maximum".into(), serde_json::json!(max));
        }
        match f.kind {
            FieldType::Array => {
                prop.insert("items".into(), serde_json::json!({"type": "string"}));
                if let Some(n) = f.max_len {
                    prop.insert("maxItems".into(), serde_json::json!(n));
                }
            }
            FieldType::Object => {
                prop.insert("properties".into(), serde_json::json!({}));
                prop.insert("additionalProperties".into(), Value::Bool(false));
            }
            _ => {}
        }
        properties.insert(name.clone(), Value::Object(prop));
        required.push(Value::String(name.clone()));
    }
    serde_json::json!({
        "type": "json_schema",
        "json_schema": {
            "name": "batchfleet_output",
            "strict": true,
            "schema": {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": false,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> JobSpec {
        JobSpec::parse(include_str!("../../examples/job.toml"), "job.toml").unwrap()
    }

    const GOOD: &str = r#"{"label": "billing", "reason": "double charge", "confidence": 0.9, "task_type": "classify"}"#;

    fn errors(raw: &str) -> Vec<(ErrorCode, String)> {
        match validate(&spec(), raw) {
            Validation::Invalid { errors, .. } => errors.into_iter().map(|e| (e.code, e.field)).collect(),
            Validation::Valid { .. } => vec![],
        }
    }

    fn one(code: ErrorCode, field: &str) -> Vec<(ErrorCode, String)> {
        vec![(code, field.to_owned())]
    }

    #[test]
    fn a_good_answer_is_valid_without_repairs() {
        let Validation::Valid { output, repairs } = validate(&spec(), GOOD) else {
            panic!()
        };
        assert!(repairs.is_empty());
        assert_eq!(output["label"], "billing");
        assert!(!output.contains_key("items"));
    }

    #[test]
    fn fenced_and_prose_wrapped_objects_are_extracted_and_recorded() {
        let fenced = format!("```json\n{GOOD}\n```");
        assert!(
            matches!(validate(&spec(), &fenced), Validation::Valid { ref repairs, .. } if repairs == &[Repair::CodeFence])
        );
        let prose = format!("Sure! Here is the answer: {GOOD} Hope this helps.");
        assert!(
            matches!(validate(&spec(), &prose), Validation::Valid { ref repairs, .. } if repairs == &[Repair::ExtractedFromProse])
        );
    }

    #[test]
    fn each_error_code_names_its_field() {
        assert_eq!(errors("not json at all"), one(ErrorCode::Json, ""));
        assert_eq!(errors(""), one(ErrorCode::Json, ""));
        assert_eq!(errors("[1,2]"), one(ErrorCode::NotObject, ""));
        assert_eq!(
            errors(&GOOD.replace(r#""label": "billing", "#, "")),
            one(ErrorCode::Missing, "label")
        );
        assert_eq!(
            errors(&GOOD.replace(r#""billing""#, "null")),
            one(ErrorCode::Null, "label")
        );
        assert_eq!(
            errors(&GOOD.replace(r#""billing""#, r#""refund""#)),
            one(ErrorCode::Enum, "label")
        );
        assert_eq!(errors(&GOOD.replace("0.9", "1.5")), one(ErrorCode::Range, "confidence"));
        assert_eq!(
            errors(&GOOD.replace("double charge", &"x".repeat(61))),
            one(ErrorCode::Len, "reason")
        );
        assert_eq!(
            errors(&GOOD.replace("0.9", "\"0.9\"")),
            one(ErrorCode::Type, "confidence")
        );
    }

    #[test]
    fn booleans_are_never_numbers() {
        assert_eq!(errors(&GOOD.replace("0.9", "true")), one(ErrorCode::Type, "confidence"));
    }

    #[test]
    fn nullable_accepts_null_and_required_if_follows_its_condition() {
        assert!(errors(&GOOD.replace("0.9", "null")).is_empty());
        let extract = GOOD.replace(r#""classify""#, r#""extract""#);
        assert_eq!(errors(&extract), one(ErrorCode::Missing, "items"));
        let with_items = extract.replace('}', r#", "items": ["A123"]}"#);
        assert!(errors(&with_items).is_empty());
        assert!(
            errors(&GOOD.replace('}', r#", "items": null}"#)).is_empty(),
            "optional null is absent"
        );
        assert_eq!(
            errors(&extract.replace('}', r#", "items": null}"#)),
            one(ErrorCode::Null, "items")
        );
    }

    #[test]
    fn system_fields_and_extras_never_come_from_the_model() {
        let raw = GOOD.replace('}', r#", "record_id": "forged", "mood": "happy"}"#);
        let Validation::Valid { output, repairs } = validate(&spec(), &raw) else {
            panic!()
        };
        assert!(!output.contains_key("record_id") && !output.contains_key("mood"));
        assert_eq!(repairs, vec![Repair::SystemFieldsIgnored, Repair::ExtraFieldsRemoved]);
    }

    #[test]
    fn feedback_lists_every_error() {
        let raw = GOOD.replace(r#""billing""#, r#""refund""#).replace("0.9", "7");
        let Validation::Invalid { errors, .. } = validate(&spec(), &raw) else {
            panic!()
        };
        let text = feedback(&errors);
        assert!(
            text.contains("E_ENUM label") && text.contains("E_RANGE confidence"),
            "{text}"
        );
    }

    #[test]
    fn the_schema_is_strict() {
        let schema = json_schema(&spec());
        let s = &schema["json_schema"]["schema"];
        assert_eq!(s["additionalProperties"], false);
        assert_eq!(s["required"].as_array().unwrap().len(), 5);
        assert_eq!(s["properties"]["items"]["type"], serde_json::json!(["array", "null"]));
        assert_eq!(s["properties"]["label"]["type"], "string");
    }
}

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
    /// The answer was cut off at the output token limit (`finish_reason = length`).
    #[serde(rename = "E_TRUNCATED")]
    Truncated,
    /// The result sink's database refused the row (a constraint of the user's).
    #[serde(rename = "E_SINK")]
    Sink,
    /// A business rule of the spec (`[output.rules]`) does not hold; the
    /// error's field is the rule's name.
    #[serde(rename = "E_RULE")]
    Rule,
    /// A business rule cannot be evaluated on this record (a field it reads
    /// is absent, a type it compares is another): reviewed, not retried.
    #[serde(rename = "E_RULE_UNEVALUABLE")]
    RuleUnevaluable,
    /// The checker model's answer differs on this field (`[check]`): the
    /// record is reviewed with both answers.
    #[serde(rename = "E_CHECK")]
    Check,
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
            ErrorCode::Truncated => "E_TRUNCATED",
            ErrorCode::Sink => "E_SINK",
            ErrorCode::Rule => "E_RULE",
            ErrorCode::RuleUnevaluable => "E_RULE_UNEVALUABLE",
            ErrorCode::Check => "E_CHECK",
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
    /// An enum value given in another case, or a declared synonym, was
    /// mapped to the enum's value (`enum_ignore_case`, `enum_map`).
    EnumMapped,
    /// A field filled from the input (`from_input`) had another value from the model.
    FromInput,
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
    validate_record(spec, raw, None)
}

/// [`validate`] for a record: fields declared `from_input` are filled from
/// `input`, whatever the model said (a difference is recorded as a repair).
pub fn validate_record(spec: &JobSpec, raw: &str, input: Option<&Map<String, Value>>) -> Validation {
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
    if let Some(input) = input {
        for (name, f) in spec.output.fields.iter() {
            let Some(value) = f
                .from_input
                .as_deref()
                .and_then(|path| crate::template::lookup(input, path))
            else {
                continue;
            };
            if obj.get(name.as_str()).is_some_and(|given| given != value) && !repairs.contains(&Repair::FromInput) {
                repairs.push(Repair::FromInput);
            }
            obj.insert(name.clone(), value.clone());
        }
    }
    let (output, mut errors) = check_fields(&spec.output.fields, &obj, "", &mut repairs);
    if errors.is_empty() {
        // The rules judge an answer whose fields hold.
        errors = (spec.output.rules.broken(input, &output).into_iter())
            .map(|b| {
                let code = if b.evaluated {
                    ErrorCode::Rule
                } else {
                    ErrorCode::RuleUnevaluable
                };
                err(code, &b.rule, &b.message)
            })
            .collect();
    }
    if errors.is_empty() {
        Validation::Valid { output, repairs }
    } else {
        Validation::Invalid { errors, repairs }
    }
}

/// A string enum value as the spec spells it: same value in another case
/// (`enum_ignore_case`) or a synonym (`enum_map`), recorded as a repair.
fn map_enum(v: &Value, f: &crate::spec::FieldSpec, repairs: &mut Vec<Repair>) -> Value {
    let (Some(text), Some(values)) = (v.as_str(), &f.enum_values) else {
        return v.clone();
    };
    if values.iter().any(|e| e.as_str() == Some(text)) {
        return v.clone();
    }
    let mapped = f
        .enum_map
        .as_ref()
        .and_then(|m| {
            m.get(text).or_else(|| {
                m.iter()
                    .find(|(k, _)| f.enum_ignore_case && k.eq_ignore_ascii_case(text))
                    .map(|(_, v)| v)
            })
        })
        .cloned()
        .or_else(|| {
            f.enum_ignore_case
                .then(|| {
                    values
                        .iter()
                        .filter_map(Value::as_str)
                        .find(|e| e.eq_ignore_ascii_case(text))
                })
                .flatten()
                .map(str::to_owned)
        });
    match mapped {
        Some(m) => {
            if !repairs.contains(&Repair::EnumMapped) {
                repairs.push(Repair::EnumMapped);
            }
            Value::String(m)
        }
        None => v.clone(),
    }
}

/// Checks an object against a table of fields: the value to keep (only the
/// fields named, in their order) and every error, each naming its field by
/// its path from the output (`address.city`, `items[3].sku`).
fn check_fields(
    fields: &crate::spec::OrderedFields,
    obj: &Map<String, Value>,
    path: &str,
    repairs: &mut Vec<Repair>,
) -> (Map<String, Value>, Vec<FieldError>) {
    let mut errors = Vec::new();
    let mut output = Map::new();
    for (name, f) in fields.iter() {
        let at = format!("{path}{name}");
        let required = f.required
            || f.required_if
                .as_ref()
                .is_some_and(|c| obj.get(&c.field) == Some(&c.equals));
        match obj.get(name.as_str()) {
            None => {
                if required {
                    errors.push(err(ErrorCode::Missing, &at, "is required"));
                }
            }
            Some(Value::Null) => {
                if f.nullable {
                    output.insert(name.clone(), Value::Null);
                } else if required {
                    errors.push(err(ErrorCode::Null, &at, "must not be null"));
                }
                // An optional field sent as null (strict schemas require every
                // property) counts as absent.
            }
            Some(v) => match check_value(&map_enum(v, f, repairs), f, &at, repairs) {
                Ok(kept) => {
                    output.insert(name.clone(), kept);
                }
                Err(mut e) => errors.append(&mut e),
            },
        }
    }
    if obj.keys().any(|k| fields.get(k).is_none()) && !repairs.contains(&Repair::ExtraFieldsRemoved) {
        repairs.push(Repair::ExtraFieldsRemoved);
    }
    (output, errors)
}

/// Checks a value at `at` against its field spec; returns the value to keep.
fn check_value(
    v: &Value,
    f: &crate::spec::FieldSpec,
    at: &str,
    repairs: &mut Vec<Repair>,
) -> Result<Value, Vec<FieldError>> {
    check_scalar(v, f).map_err(|e| {
        vec![FieldError {
            field: at.to_owned(),
            ..e
        }]
    })?;
    match (v, f.kind) {
        (Value::Object(o), FieldType::Object) => match &f.fields {
            Some(own) => {
                let (kept, errors) = check_fields(own, o, &format!("{at}."), repairs);
                if errors.is_empty() {
                    Ok(Value::Object(kept))
                } else {
                    Err(errors)
                }
            }
            None => Ok(v.clone()),
        },
        (Value::Array(items), FieldType::Array) => {
            let spec = f.item_spec();
            let mut kept = Vec::with_capacity(items.len());
            let mut errors = Vec::new();
            for (i, item) in items.iter().enumerate() {
                let item = map_enum(item, &spec, repairs);
                match check_value(&item, &spec, &format!("{at}[{i}]"), repairs) {
                    Ok(k) => kept.push(k),
                    Err(mut e) => errors.append(&mut e),
                }
            }
            if errors.is_empty() {
                Ok(Value::Array(kept))
            } else {
                Err(errors)
            }
        }
        _ => Ok(v.clone()),
    }
}

fn check_scalar(v: &Value, f: &crate::spec::FieldSpec) -> Result<(), FieldError> {
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

/// What the model is told about its previous answer: the validator's
/// errors, and a reviewer's note when a person requeued the record with one
/// (None when there is neither).
pub fn feedback_with_note(errors: &[FieldError], note: Option<&str>) -> Option<String> {
    let note = note.map(str::trim).filter(|n| !n.is_empty());
    match (errors.is_empty(), note) {
        (true, None) => None,
        (false, None) => Some(feedback(errors)),
        (_, Some(note)) => {
            let mut out = format!("A reviewer looked at your previous answer and notes: {note}\n");
            if !errors.is_empty() {
                out.push_str(&feedback(errors));
            } else {
                out.push_str("Answer again with one corrected JSON object.");
            }
            Some(out)
        }
    }
}

/// A field's bounds in a JSON schema: `minimum`, `maximum`, and a string's `maxLength`.
fn bounds(f: &crate::spec::FieldSpec, prop: &mut Map<String, Value>) {
    if let Some(min) = f.min {
        prop.insert("minimum".into(), serde_json::json!(min));
    }
    if let Some(max) = f.max {
        prop.insert("maximum".into(), serde_json::json!(max));
    }
    if let (Some(n), FieldType::String) = (f.max_len, f.kind) {
        prop.insert("maxLength".into(), serde_json::json!(n));
    }
}

/// The `response_format` of a form (None for `off`): `json_schema` (strict),
/// or `json_object` with the same schema attached (llama.cpp, vLLM), its
/// nullable fields spelled so that those servers enforce them (see
/// [`nullable_as_any_of`]).
pub fn response_format(spec: &JobSpec, form: crate::spec::StructuredOutput) -> Option<Value> {
    use crate::spec::StructuredOutput;
    match form {
        StructuredOutput::JsonSchema => Some(json_schema(spec)),
        StructuredOutput::JsonObject => {
            let schema = nullable_as_any_of(&json_schema(spec)["json_schema"]["schema"]);
            Some(serde_json::json!({"type": "json_object", "schema": schema}))
        }
        StructuredOutput::Off | StructuredOutput::Auto => None,
    }
}

/// The schema with every nullable `"type": [T, "null"]` spelled `anyOf: [{T
/// and its constraints}, {"type": "null"}]`. OpenAI's strict mode wants the
/// first spelling; llama.cpp's grammar converter (llama-cpp-python 0.3's
/// `json_schema_to_gbnf`) accepts it but turns it into "any T, or null",
/// dropping the item type, the length and the enum, so answers the schema
/// forbids come back; the `anyOf` spelling it enforces.
pub fn nullable_as_any_of(schema: &Value) -> Value {
    let Value::Object(o) = schema else {
        return schema.clone();
    };
    let mut out = Map::new();
    for (k, v) in o {
        let v = match k.as_str() {
            "properties" => match v {
                Value::Object(props) => Value::Object(
                    props
                        .iter()
                        .map(|(name, p)| (name.clone(), nullable_as_any_of(p)))
                        .collect(),
                ),
                other => other.clone(),
            },
            "items" => nullable_as_any_of(v),
            _ => v.clone(),
        };
        out.insert(k.clone(), v);
    }
    let nullable = match out.get("type") {
        Some(Value::Array(a)) => match a.as_slice() {
            [Value::String(t), Value::String(null)] if null == "null" => Some(t.clone()),
            _ => None,
        },
        _ => None,
    };
    let Some(t) = nullable else {
        return Value::Object(out);
    };
    let description = out.remove("description");
    let mut branch = out;
    branch.insert("type".into(), Value::String(t));
    if let Some(Value::Array(values)) = branch.get_mut("enum") {
        values.retain(|v| !v.is_null());
    }
    let mut any = Map::new();
    if let Some(d) = description {
        any.insert("description".into(), d);
    }
    any.insert(
        "anyOf".into(),
        serde_json::json!([Value::Object(branch), {"type": "null"}]),
    );
    Value::Object(any)
}

/// The strict JSON schema of the output, for `response_format`: generated
/// from the same field spec the validator checks, nested objects and array
/// items included. Optional and conditional fields are nullable, as strict
/// mode requires every property.
pub fn json_schema(spec: &JobSpec) -> Value {
    // Fields code fills from the input are not asked of the model.
    let asked: crate::spec::OrderedFields = spec
        .output
        .fields
        .iter()
        .filter(|(_, f)| f.from_input.is_none())
        .map(|(k, f)| (k.clone(), f.clone()))
        .collect();
    serde_json::json!({
        "type": "json_schema",
        "json_schema": {
            "name": "batchfleet_output",
            "strict": true,
            "schema": Value::Object(object_schema(&asked)),
        }
    })
}

/// A strict object of these fields: every one listed in `required`, no others.
fn object_schema(fields: &crate::spec::OrderedFields) -> Map<String, Value> {
    let mut properties = Map::new();
    let mut required = Vec::new();
    for (name, f) in fields.iter() {
        let optional = f.nullable || !f.required || f.required_if.is_some();
        properties.insert(name.clone(), field_schema(f, optional));
        required.push(Value::String(name.clone()));
    }
    let mut o = Map::new();
    o.insert("type".into(), Value::String("object".into()));
    o.insert("properties".into(), Value::Object(properties));
    o.insert("required".into(), Value::Array(required));
    o.insert("additionalProperties".into(), Value::Bool(false));
    o
}

/// The schema of one field or array item (`optional`: null allowed too).
fn field_schema(f: &crate::spec::FieldSpec, optional: bool) -> Value {
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
    bounds(f, &mut prop);
    match f.kind {
        FieldType::Array => {
            prop.insert("items".into(), field_schema(&f.item_spec(), false));
            if let Some(n) = f.max_len {
                prop.insert("maxItems".into(), serde_json::json!(n));
            }
        }
        FieldType::Object => match &f.fields {
            Some(own) => {
                for (k, v) in object_schema(own).into_iter().filter(|(k, _)| k != "type") {
                    prop.insert(k, v);
                }
            }
            None => {
                prop.insert("properties".into(), serde_json::json!({}));
                prop.insert("additionalProperties".into(), Value::Bool(false));
            }
        },
        _ => {}
    }
    Value::Object(prop)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small evaluator of the schema subset `json_schema` generates (type,
    /// enum, minimum, maximum, maxLength, maxItems, items, required,
    /// additionalProperties): an independent reading of what the schema says.
    fn schema_accepts(schema: &Value, v: &Value) -> bool {
        if let Some(any) = schema["anyOf"].as_array() {
            return any.iter().any(|branch| schema_accepts(branch, v));
        }
        let types: Vec<&str> = match &schema["type"] {
            Value::String(t) => vec![t.as_str()],
            Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
            _ => vec![],
        };
        let type_ok = types.iter().any(|t| match *t {
            "string" => v.is_string(),
            "number" => v.is_number(),
            "integer" => v.as_f64().is_some_and(|x| x.fract() == 0.0) && v.is_number(),
            "boolean" => v.is_boolean(),
            "array" => v.is_array(),
            "object" => v.is_object(),
            "null" => v.is_null(),
            _ => false,
        });
        if !type_ok {
            return false;
        }
        if v.is_null() {
            return true;
        }
        if let Some(e) = schema["enum"].as_array()
            && !e
                .iter()
                .any(|x| x == v || (x.as_f64().is_some() && x.as_f64() == v.as_f64()))
        {
            return false;
        }
        if let (Some(x), Some(min)) = (v.as_f64(), schema["minimum"].as_f64())
            && x < min
        {
            return false;
        }
        if let (Some(x), Some(max)) = (v.as_f64(), schema["maximum"].as_f64())
            && x > max
        {
            return false;
        }
        if let (Some(s), Some(n)) = (v.as_str(), schema["maxLength"].as_u64())
            && s.chars().count() as u64 > n
        {
            return false;
        }
        if let Some(a) = v.as_array() {
            if schema["maxItems"].as_u64().is_some_and(|n| a.len() as u64 > n) {
                return false;
            }
            if !schema["items"].is_null() && !a.iter().all(|i| schema_accepts(&schema["items"], i)) {
                return false;
            }
        }
        if let (Some(o), Some(props)) = (v.as_object(), schema["properties"].as_object()) {
            let required: Vec<&str> = schema["required"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            if required.iter().any(|r| !o.contains_key(*r)) {
                return false;
            }
            for (k, x) in o {
                match props.get(k) {
                    Some(s) if !schema_accepts(s, x) => return false,
                    Some(_) => {}
                    None if schema["additionalProperties"] == false => return false,
                    None => {}
                }
            }
        }
        true
    }

    #[test]
    fn the_schema_sent_and_the_validator_agree_on_a_corpus() {
        let text = include_str!("../../examples/job.toml").replace(
            "description = \"order numbers or product names mentioned\"",
            "description = \"order numbers or product names mentioned\"\nitems = { type = \"string\", max_len = 12 }",
        );
        let spec = JobSpec::parse(&text, "job.toml").unwrap();
        let schema = json_schema(&spec)["json_schema"]["schema"].clone();
        let base = serde_json::json!({"label": "billing", "reason": "r", "confidence": 0.5, "task_type": "classify", "items": null});
        let with = |k: &str, v: Value| {
            let mut o = base.clone();
            o[k] = v;
            o
        };
        let corpus = [
            base.clone(),
            with("items", serde_json::json!(["A-1", "B-2"])),
            with("items", serde_json::json!([2])),
            with("items", serde_json::json!([{"sku": "x"}])),
            with("items", serde_json::json!(["a very long product name"])),
            with("items", Value::Array(vec![Value::from("x"); 21])),
            with("label", serde_json::json!("refunds")),
            with("label", serde_json::json!(3)),
            with("confidence", serde_json::json!(1.5)),
            with("confidence", serde_json::json!(true)),
            with("confidence", Value::Null),
            with("reason", Value::String("x".repeat(61))),
            with("task_type", serde_json::json!("summarise")),
        ];
        for answer in corpus {
            let valid = matches!(validate(&spec, &answer.to_string()), Validation::Valid { .. });
            assert_eq!(valid, schema_accepts(&schema, &answer), "disagree on {answer}");
        }
        // An item of the wrong type is named by its index.
        let Validation::Invalid { errors, .. } =
            validate(&spec, &with("items", serde_json::json!(["ok", 7])).to_string())
        else {
            panic!("an item of the wrong type passed")
        };
        assert_eq!(
            (errors[0].code, errors[0].field.as_str()),
            (ErrorCode::Type, "items[1]")
        );
    }

    /// The example spec plus an object field with its own fields and an
    /// array of objects with theirs.
    fn nested_spec() -> JobSpec {
        let text = format!(
            "{}{}",
            include_str!("../../examples/job.toml"),
            r#"
[output.fields.address]
type = "object"
required = false

[output.fields.address.fields.city]
type = "string"
max_len = 20

[output.fields.address.fields.zip]
type = "integer"
required = false

[output.fields.lines]
type = "array"
required = false
items = { type = "object", fields = { sku = { type = "string" }, qty = { type = "integer", min = 1 } } }
"#
        );
        JobSpec::parse(&text, "job.toml").unwrap()
    }

    #[test]
    fn nested_objects_are_checked_as_the_schema_declares_them() {
        let spec = nested_spec();
        let schema = json_schema(&spec)["json_schema"]["schema"].clone();
        assert_eq!(
            schema["properties"]["address"]["required"],
            serde_json::json!(["city", "zip"]),
            "strict: every nested property listed"
        );
        assert_eq!(schema["properties"]["lines"]["items"]["additionalProperties"], false);
        let base = serde_json::json!({"label": "billing", "reason": "r", "confidence": 0.5, "task_type": "classify", "items": null, "address": null, "lines": null});
        let with = |k: &str, v: Value| {
            let mut o = base.clone();
            o[k] = v;
            o
        };
        let corpus = [
            with("address", serde_json::json!({"city": "Lyon", "zip": 69001})),
            with("address", serde_json::json!({"city": "Lyon", "zip": null})),
            with("address", serde_json::json!({"zip": 69001})),
            with("address", serde_json::json!({"city": 7, "zip": 1})),
            with("address", serde_json::json!({"city": "x".repeat(21), "zip": 1})),
            with("address", serde_json::json!({"city": "Lyon", "zip": 1.5})),
            with("address", serde_json::json!("Lyon")),
            with("lines", serde_json::json!([{"sku": "A", "qty": 2}])),
            with("lines", serde_json::json!([{"sku": "A", "qty": 0}])),
            with("lines", serde_json::json!([{"sku": "A"}])),
            with("lines", serde_json::json!(["A"])),
            with(
                "lines",
                serde_json::json!([{"sku": "A", "qty": 1}, {"sku": 3, "qty": 1}]),
            ),
        ];
        for answer in corpus {
            let valid = matches!(validate(&spec, &answer.to_string()), Validation::Valid { .. });
            assert_eq!(valid, schema_accepts(&schema, &answer), "disagree on {answer}");
        }
        // Every error names its field by its path; extra nested keys are dropped.
        let answer = with("address", serde_json::json!({"city": 7, "zip": null}));
        let mut answer = answer;
        answer["lines"] = serde_json::json!([{"sku": "A", "qty": 1}, {"sku": "B", "qty": 0}]);
        let Validation::Invalid { errors, .. } = validate(&spec, &answer.to_string()) else {
            panic!("passed: {answer}")
        };
        let named: Vec<(ErrorCode, &str)> = errors.iter().map(|e| (e.code, e.field.as_str())).collect();
        assert_eq!(
            named,
            vec![(ErrorCode::Type, "address.city"), (ErrorCode::Range, "lines[1].qty")]
        );
        let extra = with(
            "address",
            serde_json::json!({"city": "Lyon", "zip": null, "street": "Rue X"}),
        );
        let Validation::Valid { output, repairs } = validate(&spec, &extra.to_string()) else {
            panic!("an extra nested key is removed, not an error")
        };
        // (an optional field sent as null counts as absent, as at the top)
        assert_eq!(output["address"], serde_json::json!({"city": "Lyon"}));
        assert!(repairs.contains(&Repair::ExtraFieldsRemoved));
        // The model is told about the nested fields too.
        let prompt = crate::spec::system_prompt(&spec);
        assert!(
            prompt.contains("- address (object, optional): with these fields\n  - city (string, required)"),
            "{prompt}"
        );
        assert!(prompt.contains("  - qty (integer, required): at least 1"), "{prompt}");
    }

    #[test]
    fn nested_fields_are_checked_at_spec_time_with_their_path() {
        let text = format!(
            "{}{}",
            include_str!("../../examples/job.toml"),
            "\n[output.fields.address]\ntype = \"object\"\nrequired = false\n\n[output.fields.address.fields.city]\ntype = \"string\"\nmin = 3\nfrom_input = \"channel\"\n"
        );
        let e = JobSpec::parse(&text, "job.toml").unwrap_err().to_string();
        assert!(e.contains("output.fields.address.fields.city.min"), "{e}");
        assert!(e.contains("output.fields.address.fields.city.from_input"), "{e}");
        let text = include_str!("../../examples/job.toml").replace(
            "description = \"order numbers or product names mentioned\"",
            "description = \"order numbers or product names mentioned\"\nfields = { a = { type = \"string\" } }",
        );
        let e = JobSpec::parse(&text, "job.toml").unwrap_err().to_string();
        assert!(
            e.contains("output.fields.items.fields: applies to object fields"),
            "{e}"
        );
    }

    #[test]
    fn a_field_code_knows_is_filled_from_the_input_and_switches_required_if() {
        let text = include_str!("../../examples/job.toml").replace(
            "description = \"copy the task type from the input\"",
            "description = \"copy the task type from the input\"\nfrom_input = \"task_type\"",
        );
        let spec = JobSpec::parse(&text, "job.toml").unwrap();
        assert!(
            json_schema(&spec)["json_schema"]["schema"]["properties"]
                .get("task_type")
                .is_none(),
            "not asked"
        );
        let input: Map<String, Value> =
            serde_json::from_value(serde_json::json!({"message_id": "m1", "task_type": "extract", "text": "x"}))
                .unwrap();
        // The model says `classify`, which would switch off `items`' requirement.
        let answer = serde_json::json!({"label": "billing", "reason": "r", "confidence": 0.5, "task_type": "classify"})
            .to_string();
        let Validation::Invalid { errors, repairs } = validate_record(&spec, &answer, Some(&input)) else {
            panic!("the model's task_type was trusted")
        };
        assert_eq!(
            (errors[0].code, errors[0].field.as_str()),
            (ErrorCode::Missing, "items")
        );
        assert!(repairs.contains(&Repair::FromInput));
        let fixed =
            serde_json::json!({"label": "billing", "reason": "r", "confidence": 0.5, "items": ["A-1"]}).to_string();
        let Validation::Valid { output, .. } = validate_record(&spec, &fixed, Some(&input)) else {
            panic!()
        };
        assert_eq!(output["task_type"], "extract");
    }

    #[test]
    fn enum_values_are_mapped_by_code_and_the_mapping_recorded() {
        let text = include_str!("../../examples/job.toml").replace(
            "description = \"the message's main topic\"",
            "description = \"the message's main topic\"\nenum_ignore_case = true\nenum_map = { refund = \"billing\" }",
        );
        let spec = JobSpec::parse(&text, "job.toml").unwrap();
        let answer = |label: &str| {
            serde_json::json!({"label": label, "reason": "r", "confidence": 0.5, "task_type": "classify"}).to_string()
        };
        for (given, kept) in [("Billing", "billing"), ("refund", "billing"), ("REFUND", "billing")] {
            let Validation::Valid { output, repairs } = validate(&spec, &answer(given)) else {
                panic!("{given} was not mapped")
            };
            assert_eq!(output["label"], kept);
            assert!(repairs.contains(&Repair::EnumMapped), "{given}: {repairs:?}");
        }
        let Validation::Valid { repairs, .. } = validate(&spec, &answer("billing")) else {
            panic!()
        };
        assert!(
            !repairs.contains(&Repair::EnumMapped),
            "nothing to map, nothing recorded"
        );
        assert!(matches!(
            validate(&spec, &answer("nonsense")),
            Validation::Invalid { .. }
        ));
        let bad = text.replace(
            "enum_map = { refund = \"billing\" }",
            "enum_map = { refund = \"money\" }",
        );
        let problems: Vec<String> = JobSpec::parse(&bad, "job.toml")
            .err()
            .map(|e| e.to_string())
            .into_iter()
            .collect();
        assert!(
            problems
                .iter()
                .any(|p| p.contains("maps to `money`, which is not in the enum")),
            "{problems:?}"
        );
    }

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

    #[test]
    fn the_json_object_form_spells_nullable_fields_as_any_of() {
        let rf = response_format(&spec(), crate::spec::StructuredOutput::JsonObject).unwrap();
        let s = &rf["schema"];
        assert_eq!(rf["type"], "json_object");
        assert!(!rf.to_string().contains(r#"["array","null"]"#), "{rf}");
        let items = &s["properties"]["items"];
        assert_eq!(items["anyOf"][1], serde_json::json!({"type": "null"}));
        let array = &items["anyOf"][0];
        assert_eq!(array["type"], "array");
        assert_eq!(array["items"]["type"], "string", "the item type is kept: {items}");
        assert_eq!(array["maxItems"], 20);
        let confidence = &s["properties"]["confidence"];
        assert_eq!(confidence["anyOf"][0]["minimum"], 0.0);
        assert_eq!(confidence["anyOf"][0]["type"], "number");
        assert!(
            confidence["description"].is_string(),
            "described once, outside: {confidence}"
        );
        // Required fields are as they were; the whole is still strict.
        assert_eq!(s["properties"]["label"]["type"], "string");
        assert_eq!(s["additionalProperties"], false);
        // Every value the strict schema accepts, this one accepts too (and
        // the other way round): the same contract, spelled otherwise.
        let strict = &json_schema(&spec())["json_schema"]["schema"];
        for v in [
            serde_json::json!({"label": "billing", "reason": "x", "confidence": null, "task_type": "classify", "items": null}),
            serde_json::json!({"label": "billing", "reason": "x", "confidence": 0.5, "task_type": "extract", "items": ["a"]}),
            serde_json::json!({"label": "billing", "reason": "x", "confidence": 2.0, "task_type": "extract", "items": [1]}),
        ] {
            assert_eq!(schema_accepts(strict, &v), schema_accepts(s, &v), "{v}");
        }
    }
}

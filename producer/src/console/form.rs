//! The console's edit form, generated from the job's field spec: an enum or
//! a boolean is a select, a number an input with its bounds, a string a
//! text input with its length, an array or object a JSON box. The browser
//! checks what it can before submitting (the inputs' constraints, the JSON
//! boxes parsed); the server turns the fields back into the output and
//! validates it against the spec again, like any output.

use std::collections::HashMap;

use common::spec::{FieldSpec, FieldType, JobSpec};
use serde_json::{Map, Value};

/// The name of a field's input in the form (`field.label`).
pub const PREFIX: &str = "field.";

/// One field of the form.
pub struct FormField {
    pub name: String,
    pub help: String,
    /// `select`, `number`, `text` or `json`.
    pub kind: &'static str,
    /// `select`: its choices (the first is the empty one, when the field may be left out or null).
    pub options: Vec<Choice>,
    pub value: String,
    /// `number`: bounds and step (empty: none).
    pub min: String,
    pub max: String,
    pub step: &'static str,
    /// `text`: the longest accepted (empty: no limit); `json`: `array` or `object`.
    pub max_len: String,
    pub json_kind: &'static str,
    /// The browser must have a value (the field is required and not nullable).
    pub required: bool,
    pub errors: Vec<String>,
}

pub struct Choice {
    pub value: String,
    pub label: String,
    pub selected: bool,
}

/// How a JSON value is written into a text input or a choice.
fn text_of(v: &Value) -> String {
    match v {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The form of `spec`'s output fields, filled from `current` (the output
/// being edited, when it is an object), with `errors` at their fields.
pub fn fields(spec: &JobSpec, current: &Value, errors: &HashMap<String, Vec<String>>) -> Vec<FormField> {
    spec.output
        .fields
        .iter()
        .map(|(name, f)| {
            let value = current.get(name).unwrap_or(&Value::Null);
            let mut field = FormField {
                name: name.clone(),
                help: f.description.clone().unwrap_or_default(),
                kind: "text",
                options: Vec::new(),
                value: text_of(value),
                min: f.min.map(|m| m.to_string()).unwrap_or_default(),
                max: f.max.map(|m| m.to_string()).unwrap_or_default(),
                step: if f.kind == FieldType::Integer { "1" } else { "any" },
                max_len: f.max_len.map(|m| m.to_string()).unwrap_or_default(),
                json_kind: "",
                required: f.required && !f.nullable,
                errors: errors.get(name).cloned().unwrap_or_default(),
            };
            let choices: Option<Vec<Value>> = match f.kind {
                FieldType::Boolean => Some(vec![Value::Bool(true), Value::Bool(false)]),
                _ => f.enum_values.clone(),
            };
            if let Some(choices) = choices {
                field.kind = "select";
                if !field.required {
                    field.options.push(Choice {
                        value: String::new(),
                        label: if f.nullable {
                            "(null)".into()
                        } else {
                            "(left out)".into()
                        },
                        selected: value.is_null(),
                    });
                }
                field.options.extend(choices.iter().map(|c| Choice {
                    value: text_of(c),
                    label: text_of(c),
                    selected: c == value,
                }));
            } else {
                match f.kind {
                    FieldType::Number | FieldType::Integer => field.kind = "number",
                    FieldType::Array | FieldType::Object => {
                        field.kind = "json";
                        field.json_kind = if f.kind == FieldType::Array { "array" } else { "object" };
                        field.value = if value.is_null() {
                            String::new()
                        } else {
                            serde_json::to_string_pretty(value).unwrap_or_default()
                        };
                    }
                    _ => {}
                }
            }
            field
        })
        .collect()
}

/// The output the submitted fields make (`field.NAME` -> text), as JSON
/// text; or what cannot be read, field by field. What the spec then says
/// of the output is the accept's own validation.
pub fn output_of(spec: &JobSpec, form: &HashMap<String, String>) -> Result<String, Vec<String>> {
    let mut out = Map::new();
    let mut problems = Vec::new();
    for (name, f) in spec.output.fields.iter() {
        let text = form.get(&format!("{PREFIX}{name}")).map_or("", |t| t.trim());
        match value_of(f, text) {
            Ok(Some(v)) => {
                out.insert(name.clone(), v);
            }
            Ok(None) => {}
            Err(why) => problems.push(format!("{name}: {why}")),
        }
    }
    if problems.is_empty() {
        Ok(Value::Object(out).to_string())
    } else {
        Err(problems)
    }
}

/// The submitted fields as an output to fill the form again with: each
/// value read as its field's type where it can be, else kept as the text
/// typed (so a refused form comes back as the reviewer left it).
pub fn echo(spec: &JobSpec, form: &HashMap<String, String>) -> String {
    let mut out = Map::new();
    for (name, f) in spec.output.fields.iter() {
        let text = form.get(&format!("{PREFIX}{name}")).map_or("", |t| t.trim());
        let value = match value_of(f, text) {
            Ok(Some(v)) => v,
            Ok(None) => continue,
            Err(_) => Value::String(text.to_owned()),
        };
        out.insert(name.clone(), value);
    }
    Value::Object(out).to_string()
}

/// A field's value from its text: None leaves the field out.
fn value_of(f: &FieldSpec, text: &str) -> Result<Option<Value>, String> {
    if text.is_empty() {
        return Ok(if f.nullable {
            Some(Value::Null)
        } else if !f.required {
            None
        } else if f.kind == FieldType::String && f.enum_values.is_none() {
            Some(Value::String(String::new()))
        } else {
            return Err("a value is required".into());
        });
    }
    if let Some(choices) = &f.enum_values {
        return choices
            .iter()
            .find(|c| text_of(c) == text)
            .cloned()
            .map(Some)
            .ok_or_else(|| format!("`{text}` is not one of its choices"));
    }
    match f.kind {
        FieldType::String => Ok(Some(Value::String(text.to_owned()))),
        FieldType::Boolean => match text {
            "true" => Ok(Some(Value::Bool(true))),
            "false" => Ok(Some(Value::Bool(false))),
            _ => Err(format!("`{text}` is not true or false")),
        },
        // `3`, `3.0` and `3e0` are all the whole number 3 (as the validator counts them).
        FieldType::Integer => text
            .parse::<f64>()
            .ok()
            .filter(|n| n.fract() == 0.0 && n.abs() < 9.0e15)
            .map(|n| Some(Value::from(n as i64)))
            .ok_or_else(|| format!("`{text}` is not a whole number")),
        FieldType::Number => text
            .parse::<f64>()
            .ok()
            .and_then(serde_json::Number::from_f64)
            .map(|n| Some(Value::Number(n)))
            .ok_or_else(|| format!("`{text}` is not a number")),
        FieldType::Array | FieldType::Object => serde_json::from_str::<Value>(text)
            .map(Some)
            .map_err(|e| format!("not JSON: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> JobSpec {
        JobSpec::parse(include_str!("../../../examples/job.toml"), "example").unwrap()
    }

    fn form(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (format!("{PREFIX}{k}"), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn each_kind_of_field_gets_its_control_filled_from_the_output() {
        let current = serde_json::json!({"label": "bug", "confidence": 0.5, "items": ["a"]});
        let f = fields(&spec(), &current, &HashMap::new());
        let by = |n: &str| f.iter().find(|x| x.name == n).unwrap();
        let label = by("label");
        assert_eq!(label.kind, "select");
        assert!(label.required, "required, not nullable: no empty choice");
        assert_eq!(label.options.len(), 6);
        assert!(label.options.iter().any(|o| o.value == "bug" && o.selected));
        let conf = by("confidence");
        assert_eq!(
            (conf.kind, conf.min.as_str(), conf.max.as_str(), conf.value.as_str()),
            ("number", "0", "1", "0.5")
        );
        assert!(!conf.required, "nullable: may be left empty (null)");
        assert_eq!((by("reason").kind, by("reason").max_len.as_str()), ("text", "60"));
        assert_eq!((by("items").kind, by("items").json_kind), ("json", "array"));
    }

    #[test]
    fn the_fields_make_the_output_with_its_types_and_say_what_they_cannot_read() {
        let out = output_of(
            &spec(),
            &form(&[
                ("label", "billing"),
                ("reason", "x"),
                ("confidence", ""),
                ("task_type", "extract"),
                ("items", "[\"A-1\"]"),
            ]),
        )
        .unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"label": "billing", "reason": "x", "confidence": null, "task_type": "extract", "items": ["A-1"]})
        );
        let bad = output_of(
            &spec(),
            &form(&[("label", "nope"), ("confidence", "high"), ("items", "[oops")]),
        )
        .unwrap_err();
        assert_eq!(bad.len(), 4, "{bad:?}");
        assert!(bad[0].starts_with("label: `nope` is not one of its choices"), "{bad:?}");
        assert!(bad.iter().any(|b| b.starts_with("confidence: `high` is not a number")));
        assert!(bad.iter().any(|b| b.starts_with("task_type: a value is required")));
        assert!(bad.iter().any(|b| b.starts_with("items: not JSON")));
    }

    #[test]
    fn a_refused_form_comes_back_as_sent_and_whole_numbers_are_integers() {
        let text = include_str!("../../../examples/job.toml").replacen(
            "[output.fields.reason]",
            "[output.fields.count]\ntype = \"integer\"\nrequired = false\n\n[output.fields.reason]",
            1,
        );
        let spec = JobSpec::parse(&text, "example").unwrap();
        for (typed, want) in [("3", 3), ("3.0", 3), ("3e0", 3)] {
            let out = output_of(
                &spec,
                &form(&[("label", "bug"), ("task_type", "classify"), ("count", typed)]),
            )
            .unwrap();
            assert_eq!(serde_json::from_str::<Value>(&out).unwrap()["count"], want, "{typed}");
        }
        assert!(
            output_of(&spec, &form(&[("count", "3.5")]))
                .unwrap_err()
                .iter()
                .any(|p| p.contains("`3.5` is not a whole number"))
        );
        let sent = form(&[
            ("label", "bug"),
            ("count", "3.5"),
            ("confidence", "high"),
            ("reason", "why"),
        ]);
        let back: Value = serde_json::from_str(&echo(&spec, &sent)).unwrap();
        assert_eq!(back["label"], "bug");
        assert_eq!(back["count"], "3.5", "kept as typed");
        assert_eq!(back["confidence"], "high");
        assert_eq!(back["reason"], "why");
        let refilled = fields(&spec, &back, &HashMap::new());
        assert_eq!(refilled.iter().find(|f| f.name == "confidence").unwrap().value, "high");
    }
}

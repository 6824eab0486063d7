//! Strict `{{field}}` rendering.
//!
//! A placeholder whose field is missing, null or empty is an input error
//! (`template_missing:<field>`): a half-rendered prompt is never sent. (The
//! system prompt, with the field list generated from the output spec, is
//! [`crate::spec::system_prompt`].)

use serde_json::Value;

/// A parsed template: literal text and placeholders, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct Template {
    parts: Vec<Part>,
}

#[derive(Debug, Clone, PartialEq)]
enum Part {
    Text(String),
    Field(String),
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TemplateError {
    #[error("unclosed `{{{{` at byte {0}")]
    Unclosed(usize),
    #[error("placeholder `{{{{{0}}}}}` is not a field name (letters, digits, `_`, `-`, dots for nesting)")]
    BadName(String),
}

/// The record lacks a value the template needs.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("template_missing:{field}")]
pub struct MissingField {
    pub field: String,
}

impl Template {
    pub fn parse(text: &str) -> Result<Template, TemplateError> {
        let mut parts = Vec::new();
        let mut rest = text;
        let mut offset = 0;
        while let Some(start) = rest.find("{{") {
            if start > 0 {
                parts.push(Part::Text(rest[..start].to_owned()));
            }
            let after = &rest[start + 2..];
            let end = after.find("}}").ok_or(TemplateError::Unclosed(offset + start))?;
            let name = after[..end].trim();
            if !is_field_path(name) {
                return Err(TemplateError::BadName(name.to_owned()));
            }
            parts.push(Part::Field(name.to_owned()));
            let consumed = start + 2 + end + 2;
            offset += consumed;
            rest = &rest[consumed..];
        }
        if !rest.is_empty() {
            parts.push(Part::Text(rest.to_owned()));
        }
        Ok(Template { parts })
    }

    /// The distinct fields the template reads, in first-use order.
    pub fn fields(&self) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        for p in &self.parts {
            if let Part::Field(f) = p
                && !out.contains(&f.as_str())
            {
                out.push(f);
            }
        }
        out
    }

    /// Renders against a record object; the first missing field is the error.
    pub fn render(&self, record: &serde_json::Map<String, Value>) -> Result<String, MissingField> {
        let mut out = String::new();
        for p in &self.parts {
            match p {
                Part::Text(t) => out.push_str(t),
                Part::Field(name) => {
                    let missing = || MissingField { field: name.clone() };
                    match lookup(record, name).ok_or_else(missing)? {
                        Value::Null => return Err(missing()),
                        Value::String(s) if s.trim().is_empty() => return Err(missing()),
                        Value::String(s) => out.push_str(s),
                        Value::Array(a) if a.is_empty() => return Err(missing()),
                        other => out.push_str(&other.to_string()),
                    }
                }
            }
        }
        Ok(out)
    }
}

/// `a`, `a.b`, `a_b.c1`: a field or a dotted path into nested objects.
pub fn is_field_path(s: &str) -> bool {
    !s.is_empty()
        && s.split('.')
            .all(|part| !part.is_empty() && part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-'))
}

/// Follows a dotted path (`meta.id`) through nested objects.
pub fn lookup<'a>(record: &'a serde_json::Map<String, Value>, path: &str) -> Option<&'a Value> {
    let mut parts = path.split('.');
    let mut current = record.get(parts.next()?)?;
    for part in parts {
        current = current.as_object()?.get(part)?;
    }
    Some(current)
}

/// A field's (or a rule's) name: a letter, then letters, digits and `_`, at most 64.
pub fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && s.len() <= 64
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> serde_json::Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn renders_strings_numbers_and_nested_fields() {
        let t = Template::parse("Hi {{ name }}, {{n}} items, from {{meta.src}}.").unwrap();
        let out = t
            .render(&obj(json!({"name": "Ann", "n": 3, "meta": {"src": "web"}})))
            .unwrap();
        assert_eq!(out, "Hi Ann, 3 items, from web.");
        assert_eq!(t.fields(), vec!["name", "n", "meta.src"]);
    }

    #[test]
    fn missing_null_and_empty_fields_are_errors_not_half_prompts() {
        let t = Template::parse("{{a}} and {{b}}").unwrap();
        for record in [
            json!({"a": "x"}),
            json!({"a": "x", "b": null}),
            json!({"a": "x", "b": "  "}),
        ] {
            let err = t.render(&obj(record)).unwrap_err();
            assert_eq!(err.to_string(), "template_missing:b");
        }
        assert_eq!(t.render(&obj(json!({"b": "y"}))).unwrap_err().field, "a");
    }

    #[test]
    fn falsy_but_present_values_render() {
        let t = Template::parse("{{a}}|{{b}}|{{c}}").unwrap();
        assert_eq!(
            t.render(&obj(json!({"a": 0, "b": false, "c": "0"}))).unwrap(),
            "0|false|0"
        );
    }

    #[test]
    fn malformed_templates_are_rejected() {
        assert_eq!(Template::parse("x {{a").unwrap_err(), TemplateError::Unclosed(2));
        assert!(matches!(Template::parse("{{a b}}"), Err(TemplateError::BadName(_))));
        assert!(matches!(Template::parse("{{}}"), Err(TemplateError::BadName(_))));
    }

    #[test]
    fn braces_in_text_stay_literal() {
        let t = Template::parse("json like {\"k\": 1} then {{v}}").unwrap();
        assert_eq!(
            t.render(&obj(json!({"v": "ok"}))).unwrap(),
            "json like {\"k\": 1} then ok"
        );
    }
}

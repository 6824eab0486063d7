//! Structured-output negotiation: which `response_format` a job sends. With
//! `structured_output = "auto"` the first request tries a strict JSON schema;
//! a server that refuses it (llama.cpp's server answers HTTP 500 `Input
//! should be 'text' or 'json_object'`) gets `json_object` with the schema
//! attached, then the prompt alone. What an endpoint and model accept is
//! remembered in Redis for the whole fleet and logged once, so no job burns
//! attempts on a form the server refuses.

use std::sync::Mutex;

use common::spec::{JobSpec, StructuredOutput};
use common::validate::response_format;
use serde_json::Value;
use sha2::{Digest, Sha256};

/// A job's structured-output form, as configured and as learned.
#[derive(Debug)]
pub struct Forms {
    configured: StructuredOutput,
    /// The form sent now (for `auto`, what the endpoint was found to accept).
    current: Mutex<StructuredOutput>,
    /// `hash(base URL, model)`: what the learned form is remembered under.
    pub endpoint: String,
    json_schema: Option<Value>,
    json_object: Option<Value>,
    /// Their bytes as sent (a call's reservation counts them).
    json_schema_bytes: u64,
    json_object_bytes: u64,
}

impl Forms {
    pub fn new(spec: &JobSpec, base_url: &str, remembered: Option<&str>) -> Forms {
        let configured = spec.provider.structured_output;
        let learned = remembered.and_then(|r| match r {
            "json_schema" => Some(StructuredOutput::JsonSchema),
            "json_object" => Some(StructuredOutput::JsonObject),
            "off" => Some(StructuredOutput::Off),
            _ => None,
        });
        let current = match configured {
            StructuredOutput::Auto => learned.unwrap_or(StructuredOutput::JsonSchema),
            fixed => fixed,
        };
        let json_schema = response_format(spec, StructuredOutput::JsonSchema);
        let json_object = response_format(spec, StructuredOutput::JsonObject);
        let id = format!("{}|{}", base_url.trim_end_matches('/'), spec.provider.model);
        let mut endpoint = hex::encode(Sha256::digest(id.as_bytes()));
        endpoint.truncate(16);
        Forms {
            configured,
            current: Mutex::new(current),
            endpoint,
            json_schema_bytes: encoded_len(&json_schema),
            json_object_bytes: encoded_len(&json_object),
            json_schema,
            json_object,
        }
    }

    /// The bytes of `form`'s `response_format` as sent (0 for none).
    pub fn format_bytes(&self, form: StructuredOutput) -> u64 {
        match form {
            StructuredOutput::JsonSchema => self.json_schema_bytes,
            StructuredOutput::JsonObject => self.json_object_bytes,
            _ => 0,
        }
    }

    /// The form to send now, and its `response_format`.
    pub fn current(&self) -> (StructuredOutput, Option<&Value>) {
        let form = *self.current.lock().unwrap_or_else(|e| e.into_inner());
        let rf = match form {
            StructuredOutput::JsonSchema => self.json_schema.as_ref(),
            StructuredOutput::JsonObject => self.json_object.as_ref(),
            _ => None,
        };
        (form, rf)
    }

    /// A request sent with `used` was refused for its form: with `auto`, the
    /// next form to try (None when there is none, or without `auto`). The
    /// first worker to see it moves the job on; the others find it moved.
    pub fn refused(&self, used: StructuredOutput) -> Option<StructuredOutput> {
        if self.configured != StructuredOutput::Auto {
            return None;
        }
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        if *current != used {
            return Some(*current);
        }
        let next = used.fallback()?;
        *current = next;
        Some(next)
    }

    /// Another worker learned the form (read from Redis).
    pub fn learned(&self, form: &str) {
        if self.configured != StructuredOutput::Auto {
            return;
        }
        let f = match form {
            "json_object" => StructuredOutput::JsonObject,
            "off" => StructuredOutput::Off,
            _ => return,
        };
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = f;
    }
}

/// Whether a provider's error message says the request itself was refused
/// (its shape, a parameter), not that the server had a passing problem.
pub fn refuses_request(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    [
        "input should be",
        "validation error",
        "unrecognized request argument",
        "response_format",
        "json_schema",
        "not supported",
        "invalid value",
    ]
    .iter()
    .any(|k| m.contains(k))
}

fn encoded_len(format: &Option<Value>) -> u64 {
    format.as_ref().map_or(0, |f| f.to_string().len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(form: &str) -> JobSpec {
        let text = include_str!("../../examples/job.toml")
            .replace("structured_output = \"auto\"", &format!("structured_output = {form}"));
        JobSpec::parse(&text, "t").unwrap()
    }

    #[test]
    fn auto_steps_down_once_per_refusal_and_fixed_forms_never() {
        let f = Forms::new(&spec("\"auto\""), "http://h/v1", None);
        assert_eq!(f.current().0, StructuredOutput::JsonSchema);
        assert!(f.current().1.is_some());
        assert_eq!(
            f.refused(StructuredOutput::JsonSchema),
            Some(StructuredOutput::JsonObject)
        );
        // A second refusal of the old form (in flight meanwhile) does not skip a form.
        assert_eq!(
            f.refused(StructuredOutput::JsonSchema),
            Some(StructuredOutput::JsonObject)
        );
        let (form, rf) = f.current();
        assert_eq!(form, StructuredOutput::JsonObject);
        assert_eq!(rf.unwrap()["type"], "json_object");
        assert!(
            rf.unwrap()["schema"]["properties"]["label"].is_object(),
            "the schema is attached"
        );
        assert_eq!(f.refused(StructuredOutput::JsonObject), Some(StructuredOutput::Off));
        assert_eq!(f.refused(StructuredOutput::Off), None);
        let fixed = Forms::new(&spec("true"), "http://h/v1", Some("off"));
        assert_eq!(fixed.current().0, StructuredOutput::JsonSchema, "only auto learns");
        assert_eq!(fixed.refused(StructuredOutput::JsonSchema), None);
        let remembered = Forms::new(&spec("\"auto\""), "http://h/v1", Some("json_object"));
        assert_eq!(remembered.current().0, StructuredOutput::JsonObject);
    }

    #[test]
    fn request_refusals_are_told_from_passing_errors() {
        assert!(refuses_request(
            "[{'loc': ['body', 'response_format', 'type'], 'msg': \"Input should be 'text' or 'json_object'\"}]"
        ));
        assert!(refuses_request("Unrecognized request argument supplied: schema"));
        assert!(!refuses_request(
            "The server had an error while processing your request."
        ));
        assert!(!refuses_request("overloaded"));
    }
}

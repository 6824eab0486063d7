//! The job spec: one TOML file per job, its serde types, defaults, and `validate()`.
//!
//! Every key is documented here because these comments are the operator's
//! reference. Unknown keys are refused (`deny_unknown_fields`), and every error
//! names the key path it is about (`output.fields.confidence.max`).

use std::collections::BTreeMap;
use std::fmt;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::template::{Template, is_field_path};

/// A whole job spec, as loaded from `job.toml`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// How records are identified and split.
    pub job: JobSection,
    /// Declared versions; any change makes new record ids.
    pub versions: Versions,
    /// The input template: system and user messages.
    pub prompt: PromptSection,
    /// The output field spec the validator enforces (none for a request
    /// passed through as the record gives it, see [`PromptSection::request_field`]).
    #[serde(default)]
    pub output: OutputSection,
    /// The OpenAI-compatible endpoint and model settings.
    pub provider: Provider,
    /// Fleet-wide rate limits of the provider key.
    #[serde(default)]
    pub limits: Limits,
    /// How failed attempts are retried.
    #[serde(default)]
    pub retry: RetryPolicy,
    /// Prices in USD per million tokens, for cost reports and the budget.
    #[serde(default)]
    pub prices: Prices,
    /// Spend caps (`[budget]`; none by default).
    #[serde(default, skip_serializing_if = "Budget::is_none")]
    pub budget: Budget,
    /// Where committed results are written after Redis (`[sink]`; none by default).
    #[serde(default, skip_serializing_if = "Sink::is_none")]
    pub sink: Sink,
    /// Spot checks of committed results by people (`[audit]`; none by default).
    #[serde(default, skip_serializing_if = "Audit::is_none")]
    pub audit: Audit,
    /// Provider batch mode's shards (`[batch]`, with `provider.mode = "batch"`).
    #[serde(default, skip_serializing_if = "BatchSection::is_default")]
    pub batch: BatchSection,
    /// When a field's failure rate jumps enough to pause the job (`[drift]`; on by default).
    #[serde(default, skip_serializing_if = "DriftSpec::is_default")]
    pub drift: DriftSpec,
    /// A second model that cross-checks answers (`[check]`; none by default).
    #[serde(default, skip_serializing_if = "CheckSpec::is_none")]
    pub check: CheckSpec,
}

/// How requests reach the provider.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProviderMode {
    /// One chat request per attempt, answered within `timeout_secs`.
    #[default]
    Online,
    /// Shards of requests through the provider's Batch API (`/v1/files`,
    /// `/v1/batches`), answered within the completion window at batch prices.
    Batch,
}

/// Where the retries of a batch-mode job go after invalid output.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BatchRetries {
    /// Into a later shard, with the validator's feedback.
    #[default]
    Batch,
    /// To the model online (one request each), with the feedback.
    Online,
}

/// `[batch]`: the shards of `provider.mode = "batch"` (see docs/providers.md,
/// "Provider batch mode").
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BatchSection {
    /// Requests per shard (one input file, one provider batch); at most
    /// 50,000 (OpenAI's limit per file). Default 50,000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard_records: Option<usize>,
    /// Bytes per shard file; at most 200 MB (OpenAI's limit). Default 100 MB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard_bytes: Option<u64>,
    /// The completion window asked for (`24h`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_window: Option<String>,
    /// How often a submitted batch is looked at, in seconds (default 60).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub poll_secs: Option<u64>,
    /// A shard is packed when it can be full, or once tasks waited this
    /// long in a partition, in seconds (default 30).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pack_wait_secs: Option<u64>,
    /// Where a retry after invalid output goes (`batch`, the default, or `online`).
    #[serde(default)]
    pub retries: BatchRetries,
    /// The provider's limit on tokens enqueued in unfinished batches (prompt
    /// and `max_tokens` of every request), for the model: no shard is
    /// submitted that would pass it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_enqueued_tokens: Option<u64>,
}

impl BatchSection {
    pub fn is_default(&self) -> bool {
        *self == BatchSection::default()
    }

    pub fn shard_records(&self) -> usize {
        self.shard_records.unwrap_or(50_000)
    }

    pub fn shard_bytes(&self) -> u64 {
        self.shard_bytes.unwrap_or(100_000_000)
    }

    pub fn completion_window(&self) -> &str {
        self.completion_window.as_deref().unwrap_or("24h")
    }

    /// The completion window in ms (`24h`; checked to be hours).
    pub fn completion_window_ms(&self) -> u64 {
        let hours = self
            .completion_window()
            .strip_suffix('h')
            .and_then(|h| h.parse::<u64>().ok());
        hours.unwrap_or(24) * 3_600_000
    }

    pub fn poll(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.poll_secs.unwrap_or(60))
    }

    pub fn pack_wait(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.pack_wait_secs.unwrap_or(30))
    }
}

/// `[audit]`: a seeded share of the committed results goes to the audit
/// queue, for people to judge (see docs/console.md, "Spot checks").
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Audit {
    /// The share of committed results sampled, above 0 and at most 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<f64>,
    /// Which records: the same seed always samples the same ones (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
}

impl Audit {
    pub fn is_none(&self) -> bool {
        *self == Audit::default()
    }

    /// Whether a committed record is in the sample: the first 8 bytes of
    /// sha256(seed, record id), as a fraction, fall under the rate.
    pub fn sampled(&self, record_id: &str) -> bool {
        let Some(rate) = self.rate else { return false };
        audit_draw(self.seed.unwrap_or(0), record_id) < rate
    }
}

/// A record's draw in `[0, 1)` for a seed (the spec's sample, and the rank
/// of `producer audit --sample`).
pub fn audit_draw(seed: u64, record_id: &str) -> f64 {
    use sha2::Digest;
    let d = sha2::Sha256::digest(format!("{seed}:{record_id}").as_bytes());
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    (u64::from_be_bytes(b) >> 11) as f64 / (1u64 << 53) as f64
}

/// `[budget]`: what the job may spend (see docs/operations.md, "Spend control"),
/// costed at `[prices]`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Budget {
    /// The job's cap: the fleet stops calling before what it spent plus the
    /// calls in flight (each reserved at its most: prompt and `max_tokens`)
    /// would pass it, and halts the job with reason `budget`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cost_usd: Option<f64>,
    /// A record whose next call could pass this many tokens (prompt +
    /// completion, over all its calls) goes to review as `budget` instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens_per_record: Option<u64>,
    /// The same for a record's cost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cost_per_record: Option<f64>,
}

impl Budget {
    pub fn is_none(&self) -> bool {
        *self == Budget::default()
    }
}

/// `[sink]`: where committed results go (see docs/sink.md).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Sink {
    #[serde(default)]
    pub kind: SinkKind,
    /// `postgres`: the NAME of the environment variable holding the database
    /// URL (like `provider.api_key_env`, never the URL itself).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url_env: Option<String>,
    /// `postgres`: the results table (`name` or `schema.name`; default
    /// `batchfleet_results`); its failures table is `<table>_failures`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table: Option<String>,
    /// `files`: the directory of the JSONL segments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dir: Option<String>,
    /// Rows per write (one transaction each); default 500.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_rows: Option<usize>,
    /// Sink stream entries (outcomes committed in Redis, and paid calls)
    /// not yet in the sink at which the fleet stops claiming (Redis does not grow without bound while the
    /// sink is down or slow); claims resume as the sink catches up.
    /// Default 100,000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_backlog: Option<u64>,
    /// Sink writers per worker (each with its own database connection, for
    /// its share of the partitions); default 4, at most `job.partitions`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writers: Option<u32>,
    /// `postgres`: each top-level output field also as a column of its own,
    /// typed from the field spec (`out_<field>`: text, bigint, double
    /// precision, boolean, jsonb), beside the `output` jsonb.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub typed_columns: bool,
    /// `files`: a segment is finished at this many lines (default 10,000)...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub segment_records: Option<usize>,
    /// ...or this many bytes (default 64 MiB)...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub segment_bytes: Option<u64>,
    /// ...or this many seconds after its first line (default 5): results
    /// are acknowledged, and leave Redis, when their segment is finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub segment_secs: Option<u64>,
}

/// See [`Sink::kind`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SinkKind {
    /// A dry run: results stay in Redis, nothing is written downstream.
    #[default]
    None,
    Postgres,
    Files,
}

impl Sink {
    pub const DEFAULT_TABLE: &str = "batchfleet_results";

    pub fn is_none(&self) -> bool {
        self.kind == SinkKind::None
    }

    /// The results table, as configured or the default.
    pub fn table(&self) -> &str {
        self.table.as_deref().unwrap_or(Self::DEFAULT_TABLE)
    }

    pub fn batch_rows(&self) -> usize {
        self.batch_rows.unwrap_or(500)
    }

    pub fn max_backlog(&self) -> u64 {
        self.max_backlog.unwrap_or(100_000)
    }

    /// Sink writers per worker for a job of `partitions` partitions.
    pub fn writers(&self, partitions: u32) -> u32 {
        self.writers.unwrap_or(4).clamp(1, partitions.max(1))
    }

    /// When a files sink finishes a segment.
    pub fn segment_limits(&self) -> SegmentLimits {
        SegmentLimits {
            records: self.segment_records.unwrap_or(10_000),
            bytes: self.segment_bytes.unwrap_or(64 << 20),
            age: std::time::Duration::from_secs(self.segment_secs.unwrap_or(5)),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct JobSection {
    /// The input field that holds the record's business key (string or integer).
    pub id_field: String,
    /// Number of stream partitions the job's work is split over.
    #[serde(default = "default_partitions")]
    pub partitions: u32,
    /// A dataset line longer than this many bytes is dropped as `too_large`.
    #[serde(default = "default_max_record_bytes")]
    pub max_record_bytes: usize,
    /// When the job must be done: a duration from its first enqueue (`6h`,
    /// `1h30m`, `2d`) or an instant (`2026-12-07T18:00:00Z`). With flex
    /// among `provider.tiers`, the planner moves calls to standard as it nears.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Versions {
    /// Version of the source data (bump when the dataset's meaning changes).
    pub source: String,
    /// Version of the prompt (bump when the template changes).
    pub prompt: String,
    /// Version of the output spec / validator.
    pub output: String,
    /// The prompt changelog: what changed in this version and which error
    /// codes it targets (`"v3: label enum spelled out; targets E_ENUM label"`).
    /// Not part of record ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PromptSection {
    /// System message; the output field list is appended to it by code.
    #[serde(default)]
    pub system: String,
    /// User message with `{{field}}` placeholders filled from the record.
    #[serde(default)]
    pub user: String,
    /// Instead of `system` and `user`: the record's field that holds the
    /// whole chat request body (an OpenAI Batch API line's `body`), sent as
    /// the record gives it. Its `model` and `max_tokens` default to the
    /// provider's; `stream` is turned off. Output fields are then optional:
    /// without them any answer is valid; the result's output is the
    /// provider's whole response body either way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_field: Option<String>,
}

impl PromptSection {
    /// The request comes whole from the record (see `request_field`).
    pub fn passthrough(&self) -> bool {
        self.request_field.is_some()
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct OutputSection {
    /// Fields of the JSON object the model must return, in prompt order.
    #[serde(default)]
    pub fields: OrderedFields,
    /// Business rules over the record's input and output together (CEL
    /// expressions by name, see [`crate::rules`]).
    #[serde(default, skip_serializing_if = "crate::rules::Rules::is_empty")]
    pub rules: crate::rules::Rules,
}

/// The type of one output field. Booleans are never numbers.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum FieldType {
    String,
    Number,
    Integer,
    Boolean,
    Array,
    Object,
}

impl FieldType {
    pub fn name(self) -> &'static str {
        match self {
            FieldType::String => "string",
            FieldType::Number => "number",
            FieldType::Integer => "integer",
            FieldType::Boolean => "boolean",
            FieldType::Array => "array",
            FieldType::Object => "object",
        }
    }
}

/// One output field's rules.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FieldSpec {
    /// The JSON type the value must have.
    #[serde(rename = "type")]
    pub kind: FieldType,
    /// A short description, rendered into the system prompt.
    #[serde(default)]
    pub description: Option<String>,
    /// The field must be present (default true).
    #[serde(default = "default_true")]
    pub required: bool,
    /// `null` is an accepted value.
    #[serde(default)]
    pub nullable: bool,
    /// The value must be one of these (strings, numbers or integers).
    #[serde(default, rename = "enum")]
    pub enum_values: Option<Vec<serde_json::Value>>,
    /// Smallest accepted number.
    #[serde(default)]
    pub min: Option<f64>,
    /// Largest accepted number.
    #[serde(default)]
    pub max: Option<f64>,
    /// Longest accepted string (in characters) or array (in items).
    #[serde(default)]
    pub max_len: Option<usize>,
    /// The field is required when another field has a given value.
    #[serde(default)]
    pub required_if: Option<RequiredIf>,
    /// For an array: what each item must be (`items = { type = "string",
    /// enum = [...], max_len = 40 }`); strings when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub items: Option<Box<FieldSpec>>,
    /// For a string enum: accept a value that differs only in case (mapped
    /// to the enum's spelling, recorded as a repair).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub enum_ignore_case: bool,
    /// For a string enum: synonyms mapped to enum values (`{ refund = "billing" }`),
    /// applied after the call and recorded as a repair.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enum_map: Option<BTreeMap<String, String>>,
    /// Filled by code from this input field (a dotted path), never taken
    /// from the model: not asked for, and a model's differing value is
    /// recorded as the repair `from_input`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_input: Option<String>,
    /// For an object (a field, or an array's items): its own fields, checked
    /// like the output's (`[output.fields.address.fields.city]`); the schema
    /// sent declares them. An object without them may hold anything.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fields: Option<OrderedFields>,
}

impl FieldSpec {
    /// What each item of an array field must be (strings unless declared).
    pub fn item_spec(&self) -> std::borrow::Cow<'_, FieldSpec> {
        match &self.items {
            Some(i) => std::borrow::Cow::Borrowed(i),
            None => std::borrow::Cow::Owned(FieldSpec {
                kind: FieldType::String,
                description: None,
                required: true,
                nullable: false,
                enum_values: None,
                min: None,
                max: None,
                max_len: None,
                required_if: None,
                items: None,
                enum_ignore_case: false,
                enum_map: None,
                from_input: None,
                fields: None,
            }),
        }
    }
}

/// `required_if = { field = "task_type", equals = "extract" }`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RequiredIf {
    pub field: String,
    pub equals: serde_json::Value,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Provider {
    /// Base URL of the OpenAI-compatible API, e.g. `https://api.openai.com/v1`.
    pub base_url: String,
    /// Model name sent in each request.
    pub model: String,
    /// Name of the environment variable that holds the API key (never the key itself).
    #[serde(default = "default_api_key_env")]
    pub api_key_env: String,
    /// false: the server takes no key (llama.cpp, vLLM or Ollama started
    /// without one): no `Authorization` header is sent and `api_key_env`
    /// need not be set.
    #[serde(default = "default_true")]
    pub needs_key: bool,
    /// Per-request timeout in seconds.
    #[serde(default = "default_timeout_secs")]
    pub timeout_secs: u64,
    /// How long a timed-out call still holds its concurrency slot: a
    /// self-hosted server keeps generating after the client gave up, and the
    /// next request would queue behind it. Default: `timeout_secs`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_grace_secs: Option<u64>,
    /// `max_tokens` sent with each request; also reserved against the output budget.
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u32,
    /// Sampling temperature.
    #[serde(default)]
    pub temperature: f64,
    /// The `response_format` sent, generated from the output spec: `"json_schema"`
    /// (`true`: a strict JSON schema), `"json_object"` (with the schema
    /// attached: llama.cpp's and vLLM's form), `"off"` (`false`: the prompt
    /// alone), or `"auto"`: the first form the server accepts, in that order,
    /// learned once for the fleet.
    #[serde(default)]
    pub structured_output: StructuredOutput,
    /// `online` (the default) or `batch`: shards through the provider's
    /// Batch API (see `[batch]`).
    #[serde(default, skip_serializing_if = "is_online")]
    pub mode: ProviderMode,
    /// The routes records may take (`"batch"`, `"flex"`, `"standard"`);
    /// empty: the provider's default, and no `service_tier` is sent. The
    /// planner sends batch shards while the deadline leaves the batch's
    /// window, and online what the deadline allows on flex (see [`crate::route`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tiers: Vec<String>,
    /// Other providers or models under the same output contract (the same
    /// prompt, fields and validation), each with its own limits and prices:
    /// the first takes the calls while this provider is down (the fleet's
    /// outage state) or too slow for the job's deadline.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fallbacks: Vec<Fallback>,
}

/// A fallback provider (`[[provider.fallbacks]]`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Fallback {
    /// The route's name in the ledger, `status` and `report` (`backup`).
    pub name: String,
    pub base_url: String,
    pub model: String,
    #[serde(default = "default_api_key_env")]
    pub api_key_env: String,
    #[serde(default = "default_true")]
    pub needs_key: bool,
    /// Its own limits (its key's).
    #[serde(default)]
    pub limits: Limits,
    /// Its prices (default: the job's `[prices]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prices: Option<Prices>,
}

/// Names a fallback may not take: the tiers' and the primary's.
const RESERVED_ROUTES: &[&str] = &["standard", "flex", "batch", "primary", "default"];

fn is_online(m: &ProviderMode) -> bool {
    *m == ProviderMode::Online
}

impl JobSpec {
    /// The spec a fallback's calls are made under: the job's, with the
    /// fallback's endpoint, model, key, limits and prices (one tier, no
    /// fallbacks of its own).
    pub fn as_fallback(&self, f: &Fallback) -> JobSpec {
        let mut spec = self.clone();
        spec.provider.base_url = f.base_url.clone();
        spec.provider.model = f.model.clone();
        spec.provider.api_key_env = f.api_key_env.clone();
        spec.provider.needs_key = f.needs_key;
        spec.provider.tiers.clear();
        spec.provider.fallbacks.clear();
        spec.limits = f.limits.clone();
        if let Some(p) = &f.prices {
            spec.prices = p.clone();
        }
        spec
    }
}

impl Provider {
    /// The tiers the job's calls may take (standard alone when none are named).
    pub fn tiers(&self) -> Vec<crate::route::Tier> {
        let named: Vec<_> = self
            .tiers
            .iter()
            .filter_map(|t| crate::route::Tier::from_name(t))
            .collect();
        if named.is_empty() {
            vec![crate::route::Tier::Standard]
        } else {
            named
        }
    }

    /// Whether calls name a `service_tier` (the job lists its tiers).
    pub fn routed(&self) -> bool {
        !self.tiers.is_empty()
    }

    /// Whether records may go through the Batch API beside online calls
    /// (`"batch"` among the tiers): while the deadline leaves the batch's
    /// completion window.
    pub fn batch_tier(&self) -> bool {
        self.tiers.iter().any(|t| t == "batch")
    }

    /// How long a timed-out call keeps its concurrency slot.
    pub fn timeout_grace(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.timeout_grace_secs.unwrap_or(self.timeout_secs))
    }
}

/// How the output's shape is asked for (see [`Provider::structured_output`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum StructuredOutput {
    #[default]
    Off,
    JsonSchema,
    JsonObject,
    Auto,
}

impl StructuredOutput {
    pub fn name(self) -> &'static str {
        match self {
            StructuredOutput::Off => "off",
            StructuredOutput::JsonSchema => "json_schema",
            StructuredOutput::JsonObject => "json_object",
            StructuredOutput::Auto => "auto",
        }
    }

    /// The form to fall back to when a server refuses this one (`auto` tries
    /// json_schema, then json_object with the schema, then the prompt alone).
    pub fn fallback(self) -> Option<StructuredOutput> {
        match self {
            StructuredOutput::JsonSchema => Some(StructuredOutput::JsonObject),
            StructuredOutput::JsonObject => Some(StructuredOutput::Off),
            _ => None,
        }
    }
}

/// `true`/`false` stay what they always meant, so record ids do not change.
impl Serialize for StructuredOutput {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            StructuredOutput::Off => s.serialize_bool(false),
            StructuredOutput::JsonSchema => s.serialize_bool(true),
            other => s.serialize_str(other.name()),
        }
    }
}

impl<'de> Deserialize<'de> for StructuredOutput {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<StructuredOutput, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = StructuredOutput;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(r#"true, false, "auto", "json_schema", "json_object" or "off""#)
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<StructuredOutput, E> {
                Ok(if v {
                    StructuredOutput::JsonSchema
                } else {
                    StructuredOutput::Off
                })
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<StructuredOutput, E> {
                match v {
                    "auto" => Ok(StructuredOutput::Auto),
                    "json_schema" => Ok(StructuredOutput::JsonSchema),
                    "json_object" => Ok(StructuredOutput::JsonObject),
                    "off" => Ok(StructuredOutput::Off),
                    other => Err(E::invalid_value(serde::de::Unexpected::Str(other), &self)),
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// Fleet-wide limits of the provider key; each is optional.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    pub requests_per_minute: Option<u64>,
    /// Total tokens per minute (prompt + `max_tokens` reserved, as OpenAI counts TPM).
    pub tokens_per_minute: Option<u64>,
    pub input_tokens_per_minute: Option<u64>,
    pub output_tokens_per_minute: Option<u64>,
    /// Requests in flight across the whole fleet.
    pub max_concurrent: Option<u64>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Jitter {
    /// Delay drawn uniformly from 0..=exponential delay (AWS "full jitter").
    Full,
    /// The exponential delay itself.
    None,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RetryPolicy {
    /// Attempts per record, the first included.
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    /// Delay before the second attempt; doubles each attempt.
    #[serde(default = "default_base_delay_ms")]
    pub base_delay_ms: u64,
    /// Upper bound of any delay.
    #[serde(default = "default_max_delay_ms")]
    pub max_delay_ms: u64,
    #[serde(default = "default_jitter")]
    pub jitter: Jitter,
    /// Temperature of each attempt of a round (the last one repeats), e.g.
    /// `[0.0, 0.3, 0.7]`: a retry then asks differently instead of sending
    /// the same request again. Empty: `provider.temperature` every time.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub temperatures: Vec<f64>,
    /// How long the provider may fail every call (refused, reset, timed
    /// out, 5xx, 429 for want of capacity) before the job halts (resumed
    /// with `producer resume`). Until then records wait in the queue: a
    /// transient failure never sends a record to review by itself, and is
    /// not an attempt. A record whose own calls alone fail this long goes
    /// to review (`transient_exhausted`). Default: 1800 (30 minutes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outage_budget_secs: Option<u64>,
}

impl RetryPolicy {
    /// See [`RetryPolicy::outage_budget_secs`].
    pub fn outage_budget_ms(&self) -> u64 {
        self.outage_budget_secs
            .unwrap_or(DEFAULT_OUTAGE_BUDGET_SECS)
            .saturating_mul(1000)
    }

    /// The temperature of attempt `n` of a round (1-based), or None for the provider's.
    pub fn temperature(&self, n: u32) -> Option<f64> {
        let i = (n.max(1) as usize - 1).min(self.temperatures.len().checked_sub(1)?);
        self.temperatures.get(i).copied()
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: default_max_attempts(),
            base_delay_ms: default_base_delay_ms(),
            max_delay_ms: default_max_delay_ms(),
            temperatures: Vec::new(),
            jitter: default_jitter(),
            outage_budget_secs: None,
        }
    }
}

/// USD per million tokens.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Prices {
    #[serde(default)]
    pub input_per_mtok: f64,
    /// Cached prompt tokens; defaults to the input price when absent.
    #[serde(default)]
    pub cached_input_per_mtok: Option<f64>,
    #[serde(default)]
    pub output_per_mtok: f64,
    /// Through the Batch API (`provider.mode = "batch"`); each defaults to
    /// half its online price.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_input_per_mtok: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_cached_input_per_mtok: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_output_per_mtok: Option<f64>,
    /// On the flex tier (`provider.tiers`); each defaults to its batch price.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flex_input_per_mtok: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flex_cached_input_per_mtok: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flex_output_per_mtok: Option<f64>,
}

impl Prices {
    /// The prices of a call through the Batch API, as a price list of its own.
    pub fn batch(&self) -> Prices {
        let cached = self.cached_input_per_mtok.unwrap_or(self.input_per_mtok);
        Prices {
            input_per_mtok: self.batch_input_per_mtok.unwrap_or(self.input_per_mtok / 2.0),
            cached_input_per_mtok: Some(self.batch_cached_input_per_mtok.unwrap_or(cached / 2.0)),
            output_per_mtok: self.batch_output_per_mtok.unwrap_or(self.output_per_mtok / 2.0),
            ..Prices::default()
        }
    }

    /// The prices of a call on the flex tier, as a price list of its own.
    pub fn flex(&self) -> Prices {
        let batch = self.batch();
        Prices {
            input_per_mtok: self.flex_input_per_mtok.unwrap_or(batch.input_per_mtok),
            cached_input_per_mtok: self.flex_cached_input_per_mtok.or(batch.cached_input_per_mtok),
            output_per_mtok: self.flex_output_per_mtok.unwrap_or(batch.output_per_mtok),
            ..Prices::default()
        }
    }

    /// The prices of a call on `tier`.
    pub fn of_tier(&self, tier: crate::route::Tier) -> Prices {
        match tier {
            crate::route::Tier::Flex => self.flex(),
            crate::route::Tier::Standard => self.clone(),
        }
    }

    /// USD for one call: uncached prompt, cached prompt and completion tokens.
    pub fn cost(&self, prompt: u64, cached: u64, completion: u64) -> f64 {
        let cached = cached.min(prompt);
        let cached_price = self.cached_input_per_mtok.unwrap_or(self.input_per_mtok);
        ((prompt - cached) as f64 * self.input_per_mtok
            + cached as f64 * cached_price
            + completion as f64 * self.output_per_mtok)
            / 1_000_000.0
    }
}

/// How long a job waits out a provider that fails every call, by default.
pub const DEFAULT_OUTAGE_BUDGET_SECS: u64 = 1800;

/// The longest a retry may wait: a day.
pub const MAX_RETRY_DELAY_MS: u64 = 24 * 3600 * 1000;

fn default_partitions() -> u32 {
    4
}
fn default_max_record_bytes() -> usize {
    64 * 1024
}
fn default_true() -> bool {
    true
}
fn default_api_key_env() -> String {
    "OPENAI_API_KEY".to_owned()
}
fn default_timeout_secs() -> u64 {
    60
}
fn default_max_tokens() -> u32 {
    512
}
fn default_max_attempts() -> u32 {
    4
}
fn default_base_delay_ms() -> u64 {
    1000
}
fn default_max_delay_ms() -> u64 {
    60_000
}
fn default_jitter() -> Jitter {
    Jitter::Full
}

/// Output field names the system fills in itself; the model never provides them.
pub const SYSTEM_FIELDS: &[&str] = &["record_id", "_model", "_reviewer", "_attempt"];

/// A spec that cannot be used. Each problem names its key path.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("cannot read spec {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("spec {path}: {message}")]
    Parse { path: String, message: String },
    #[error("spec {path} is invalid:\n{}", problems.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
    Invalid { path: String, problems: Vec<Problem> },
}

/// One validation problem: the key path and what is wrong there.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    pub path: String,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

impl JobSpec {
    /// `provider.mode = "batch"` and its `[batch]` section.
    fn check_batch(&self, p: &mut Problems) {
        let b = &self.batch;
        if self.provider.mode == ProviderMode::Online && !self.provider.batch_tier() {
            if !b.is_default() {
                p.add(
                    "batch",
                    "applies to provider.mode = \"batch\" or \"batch\" among provider.tiers",
                );
            }
            return;
        }
        let budget = &self.budget;
        if budget.max_cost_usd.is_some()
            || budget.max_cost_per_record.is_some()
            || budget.max_tokens_per_record.is_some()
        {
            p.add(
                "budget",
                "is not enforced through the Batch API (provider.mode = \"batch\", or \"batch\" among provider.tiers: a shard's calls are not reserved one by one): leave [budget] out",
            );
        }
        if b.shard_records.is_some_and(|n| !(1..=50_000).contains(&n)) {
            p.add(
                "batch.shard_records",
                "must be between 1 and 50000 (requests per batch file)",
            );
        }
        if b.shard_bytes.is_some_and(|n| !(1_000..=200_000_000).contains(&n)) {
            p.add(
                "batch.shard_bytes",
                "must be between 1000 and 200000000 (bytes per batch file)",
            );
        }
        if let Some(w) = &b.completion_window
            && !w
                .strip_suffix('h')
                .and_then(|h| h.parse::<u32>().ok())
                .is_some_and(|h| (1..=168).contains(&h))
        {
            p.add("batch.completion_window", "must be hours, like \"24h\"");
        }
        if b.poll_secs.is_some_and(|n| !(1..=3600).contains(&n)) {
            p.add("batch.poll_secs", "must be between 1 and 3600");
        }
        if b.pack_wait_secs.is_some_and(|n| n > 3600) {
            p.add("batch.pack_wait_secs", "must be at most 3600");
        }
        if b.max_enqueued_tokens == Some(0) {
            p.add("batch.max_enqueued_tokens", "must be at least 1");
        }
    }
    /// Reads and validates a spec file.
    pub fn load(path: &str) -> Result<JobSpec, SpecError> {
        let text = std::fs::read_to_string(path).map_err(|source| SpecError::Read {
            path: path.to_owned(),
            source,
        })?;
        JobSpec::parse(&text, path)
    }

    /// Parses and validates spec text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<JobSpec, SpecError> {
        let parse_err = |message: String| SpecError::Parse {
            path: origin.to_owned(),
            message,
        };
        let de = toml::Deserializer::parse(text).map_err(|e| parse_err(e.to_string()))?;
        let spec: JobSpec = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner().to_string();
            parse_err(format!("at `{path}`: {}", inner.trim()))
        })?;
        let problems = spec.problems();
        if problems.is_empty() {
            Ok(spec)
        } else {
            Err(SpecError::Invalid {
                path: origin.to_owned(),
                problems,
            })
        }
    }

    /// Every impossible or inconsistent value in the spec; empty when usable.
    pub fn problems(&self) -> Vec<Problem> {
        let mut p = Problems::default();
        if !is_field_path(&self.job.id_field) {
            p.add("job.id_field", "must be a field name like `message_id` or `meta.id`");
        }
        if !(1..=1024).contains(&self.job.partitions) {
            p.add("job.partitions", format!("{} is outside 1..=1024", self.job.partitions));
        }
        if !(64..=16 * 1024 * 1024).contains(&self.job.max_record_bytes) {
            p.add("job.max_record_bytes", "must be between 64 bytes and 16 MiB");
        }
        for (key, value) in [
            ("versions.source", &self.versions.source),
            ("versions.prompt", &self.versions.prompt),
            ("versions.output", &self.versions.output),
        ] {
            if value.trim().is_empty() {
                p.add(key, "must not be empty");
            }
        }
        self.prompt_problems(&mut p);
        self.output_problems(&mut p);
        self.provider_problems(&mut p);
        self.limit_problems(&mut p);
        self.sink_problems(&mut p);
        p.0
    }

    fn prompt_problems(&self, p: &mut Problems) {
        if let Some(field) = &self.prompt.request_field {
            if !is_field_path(field) {
                p.add(
                    "prompt.request_field",
                    "must be a field name like `body` or `request.body`",
                );
            }
            if !self.prompt.system.is_empty() || !self.prompt.user.is_empty() {
                p.add(
                    "prompt.request_field",
                    "the request comes whole from the record: remove prompt.system and prompt.user",
                );
            }
            if self.provider.mode == ProviderMode::Batch {
                p.add(
                    "prompt.request_field",
                    "is sent online only: remove provider.mode = \"batch\"",
                );
            }
            if self.provider.batch_tier() {
                p.add(
                    "prompt.request_field",
                    "is sent online only: remove \"batch\" from provider.tiers",
                );
            }
            if !self.check.is_none() {
                p.add(
                    "prompt.request_field",
                    "a passed-through request is not cross-checked: remove [check]",
                );
            }
            return;
        }
        for (key, text) in [
            ("prompt.system", &self.prompt.system),
            ("prompt.user", &self.prompt.user),
        ] {
            match Template::parse(text) {
                Ok(t) if key == "prompt.user" && t.fields().is_empty() => p.add(
                    key,
                    "has no {{field}} placeholder: every record would get the same prompt",
                ),
                // The system prompt is the same for every record: it is not filled in.
                Ok(t) if key == "prompt.system" && !t.fields().is_empty() => p.add(
                    key,
                    format!(
                        "placeholders are only filled in prompt.user; move {} there (the system prompt is the same for every record)",
                        t.fields().iter().map(|f| format!("{{{{{f}}}}}")).collect::<Vec<_>>().join(", ")
                    ),
                ),
                Ok(_) => {}
                Err(e) => p.add(key, e.to_string()),
            }
        }
    }

    fn output_problems(&self, p: &mut Problems) {
        // A passed-through request's answer may be free text: fields are optional.
        if !(self.prompt.passthrough() && self.output.fields.is_empty()) {
            Self::field_problems(&self.output.fields, "output.fields", true, p);
        }
        for (name, why) in self.output.rules.problems() {
            p.add(format!("output.rules.{name}"), why);
        }
    }

    /// The problems of a table of fields at `path` (`output.fields`, or an
    /// object's own `output.fields.address.fields`); `top`: the output's own.
    fn field_problems(fields: &OrderedFields, path: &str, top: bool, p: &mut Problems) {
        if fields.is_empty() {
            p.add(path.to_owned(), "must define at least one field");
        }
        for (name, f) in fields.iter() {
            let at = |k: &str| {
                if k.is_empty() {
                    format!("{path}.{name}")
                } else {
                    format!("{path}.{name}.{k}")
                }
            };
            if !crate::template::is_identifier(name) {
                p.add(
                    at(""),
                    "field names are letters, digits and `_`, starting with a letter",
                );
            }
            if SYSTEM_FIELDS.contains(&name.as_str()) {
                p.add(
                    at(""),
                    "is filled in by batchfleet itself and cannot be asked of the model",
                );
            }
            Self::value_problems(f, &at, p);
            if let Some(items) = &f.items {
                Self::items_problems(f, items, &at, p);
            }
            if let Some(own) = &f.fields {
                if f.kind != FieldType::Object {
                    p.add(
                        at("fields"),
                        format!("applies to object fields, not to a {} field", f.kind.name()),
                    );
                }
                Self::field_problems(own, &at("fields"), false, p);
            }
            if !top && f.from_input.is_some() {
                p.add(
                    at("from_input"),
                    "applies to the output's own fields, not to a nested one",
                );
            }
            if let Some(cond) = &f.required_if {
                Self::required_if_problems(fields, name, f, cond, &at, p);
            }
        }
    }

    /// A field's own values: enum, enum_map, min and max, max_len.
    fn value_problems(f: &FieldSpec, at: &dyn Fn(&str) -> String, p: &mut Problems) {
        let numeric = matches!(f.kind, FieldType::Number | FieldType::Integer);
        if let Some(values) = &f.enum_values {
            if values.is_empty() {
                p.add(at("enum"), "has no values");
            }
            if !matches!(f.kind, FieldType::String | FieldType::Number | FieldType::Integer) {
                p.add(at("enum"), format!("is not allowed on a {} field", f.kind.name()));
            }
            for v in values {
                if !value_has_type(v, f.kind) {
                    p.add(at("enum"), format!("value {v} is not a {}", f.kind.name()));
                }
            }
        }
        if (f.min.is_some() || f.max.is_some()) && !numeric {
            p.add(
                at("min"),
                format!("min/max apply to numbers, not to a {} field", f.kind.name()),
            );
        }
        if let (Some(min), Some(max)) = (f.min, f.max)
            && min > max
        {
            p.add(at("max"), format!("max ({max}) is less than min ({min})"));
        }
        if (f.enum_ignore_case || f.enum_map.is_some()) && (f.kind != FieldType::String || f.enum_values.is_none()) {
            p.add(
                at("enum_map"),
                "enum_map and enum_ignore_case apply to string fields with an enum",
            );
        }
        if let (Some(map), Some(values)) = (&f.enum_map, &f.enum_values) {
            for (from, to) in map {
                if !values.iter().any(|v| v.as_str() == Some(to)) {
                    p.add(
                        at("enum_map"),
                        format!("`{from}` maps to `{to}`, which is not in the enum"),
                    );
                }
            }
        }
        for (k, v) in [("min", f.min), ("max", f.max)] {
            if v.is_some_and(|v| !v.is_finite()) {
                p.add(at(k), "must be a finite number");
            }
        }
        if let Some(n) = f.max_len {
            if !matches!(f.kind, FieldType::String | FieldType::Array) {
                p.add(
                    at("max_len"),
                    format!("applies to strings and arrays, not to a {} field", f.kind.name()),
                );
            }
            if n == 0 {
                p.add(at("max_len"), "must be at least 1");
            }
        }
    }

    /// An array field's `items`.
    fn items_problems(f: &FieldSpec, items: &FieldSpec, at: &dyn Fn(&str) -> String, p: &mut Problems) {
        if f.kind != FieldType::Array {
            p.add(
                at("items"),
                format!("applies to arrays, not to a {} field", f.kind.name()),
            );
        }
        if items.kind == FieldType::Array {
            p.add(
                at("items.type"),
                "items are strings, numbers, integers, booleans or objects",
            );
        }
        if items.required_if.is_some() || items.items.is_some() || items.from_input.is_some() {
            p.add(
                at("items"),
                "takes type, enum, min, max, max_len, fields and description only",
            );
        }
        if let Some(item_fields) = &items.fields {
            if items.kind != FieldType::Object {
                p.add(at("items.fields"), "applies to object items");
            }
            Self::field_problems(item_fields, &at("items.fields"), false, p);
        }
        if let Some(values) = &items.enum_values {
            for v in values {
                if !value_has_type(v, items.kind) {
                    p.add(at("items.enum"), format!("value {v} is not a {}", items.kind.name()));
                }
            }
        }
    }

    /// `required_if`: names another output field, with a value it can have.
    fn required_if_problems(
        fields: &OrderedFields,
        name: &str,
        f: &FieldSpec,
        cond: &RequiredIf,
        at: &dyn Fn(&str) -> String,
        p: &mut Problems,
    ) {
        match fields.get(&cond.field) {
            None => p.add(
                at("required_if.field"),
                format!("`{}` is not an output field", cond.field),
            ),
            Some(_) if cond.field == *name => p.add(at("required_if.field"), "a field cannot depend on itself"),
            Some(other) => {
                if !value_has_type(&cond.equals, other.kind) {
                    p.add(
                        at("required_if.equals"),
                        format!("{} is not a {}", cond.equals, other.kind.name()),
                    );
                } else if let Some(values) = &other.enum_values
                    && !values.contains(&cond.equals)
                {
                    p.add(
                        at("required_if.equals"),
                        format!("{} is not in `{}`'s enum", cond.equals, cond.field),
                    );
                }
            }
        }
        if f.required {
            p.add(
                at("required_if"),
                "set `required = false` on a conditionally required field",
            );
        }
    }

    fn sink_problems(&self, p: &mut Problems) {
        let s = &self.sink;
        match s.kind {
            SinkKind::None => {
                for (key, set) in [
                    ("sink.url_env", s.url_env.is_some()),
                    ("sink.table", s.table.is_some()),
                    ("sink.dir", s.dir.is_some()),
                ] {
                    if set {
                        p.add(
                            key,
                            "is set but sink.kind is \"none\" (set kind = \"postgres\" or \"files\")",
                        );
                    }
                }
            }
            SinkKind::Files => {
                match s.dir.as_deref() {
                    None | Some("") => p.add("sink.dir", "is required: the directory of the JSONL segments"),
                    Some(_) => {}
                }
                for (key, set) in [("sink.url_env", s.url_env.is_some()), ("sink.table", s.table.is_some())] {
                    if set {
                        p.add(key, "applies to kind = \"postgres\"");
                    }
                }
            }
            SinkKind::Postgres => postgres_sink_problems(s, p),
        }
        if s.batch_rows.is_some_and(|n| !(1..=5000).contains(&n)) {
            p.add("sink.batch_rows", "must be between 1 and 5000");
        }
        if s.max_backlog.is_some_and(|n| !(1..=100_000_000).contains(&n)) {
            p.add("sink.max_backlog", "must be between 1 and 100000000");
        }
        if s.writers.is_some_and(|n| !(1..=64).contains(&n)) {
            p.add("sink.writers", "must be between 1 and 64");
        }
        if s.segment_records.is_some_and(|n| !(1..=1_000_000).contains(&n)) {
            p.add("sink.segment_records", "must be between 1 and 1000000");
        }
        if s.segment_bytes.is_some_and(|n| !(4096..=(4 << 30)).contains(&n)) {
            p.add("sink.segment_bytes", "must be between 4096 and 4294967296");
        }
        if s.segment_secs.is_some_and(|n| !(1..=3600).contains(&n)) {
            p.add("sink.segment_secs", "must be between 1 and 3600");
        }
        if s.typed_columns {
            self.typed_column_problems(p);
        }
        let files_only = [
            ("sink.segment_records", s.segment_records.is_some()),
            ("sink.segment_bytes", s.segment_bytes.is_some()),
            ("sink.segment_secs", s.segment_secs.is_some()),
        ];
        if s.kind != SinkKind::Files {
            for (key, set) in files_only {
                if set {
                    p.add(key, "applies to kind = \"files\"");
                }
            }
        }
    }

    /// `sink.typed_columns`: each output field its own column, no two alike.
    fn typed_column_problems(&self, p: &mut Problems) {
        if self.sink.kind != SinkKind::Postgres {
            p.add("sink.typed_columns", "applies to kind = \"postgres\"");
        }
        let mut seen: BTreeMap<String, &str> = BTreeMap::new();
        for (name, _) in self.output.fields.iter() {
            let column = column_name(name);
            if let Some(other) = seen.insert(column.clone(), name) {
                p.add(
                    "sink.typed_columns",
                    format!("output fields `{other}` and `{name}` would both be column {column}: rename one"),
                );
            }
        }
    }

    fn provider_problems(&self, p: &mut Problems) {
        let pr = &self.provider;
        if !(pr.base_url.starts_with("http://") || pr.base_url.starts_with("https://")) {
            p.add("provider.base_url", "must start with http:// or https://");
        } else {
            match url::Url::parse(&pr.base_url) {
                Err(e) => p.add("provider.base_url", format!("`{}` is not a URL: {e}", pr.base_url)),
                Ok(u) if u.host_str().is_none_or(str::is_empty) => p.add("provider.base_url", "has no host"),
                Ok(u) if u.password().is_some() || !u.username().is_empty() => p.add(
                    "provider.base_url",
                    "must not hold credentials (the key comes from provider.api_key_env)",
                ),
                Ok(_) => {}
            }
        }
        if pr.model.trim().is_empty() {
            p.add("provider.model", "must not be empty");
        }
        if !is_env_name(&pr.api_key_env) {
            p.add(
                "provider.api_key_env",
                "must be the NAME of an environment variable (A-Z, 0-9, _), never the key",
            );
        }
        if !(1..=600).contains(&pr.timeout_secs) {
            p.add("provider.timeout_secs", "must be between 1 and 600");
        }
        if pr.timeout_grace_secs.is_some_and(|g| g > 600) {
            p.add("provider.timeout_grace_secs", "must be between 0 and 600");
        }
        if !(1..=1_000_000).contains(&pr.max_tokens) {
            p.add("provider.max_tokens", "must be between 1 and 1000000");
        }
        if !(0.0..=2.0).contains(&pr.temperature) {
            p.add("provider.temperature", "must be between 0 and 2");
        }
        self.route_problems(p);
    }

    fn route_problems(&self, p: &mut Problems) {
        let pr = &self.provider;
        for (i, t) in pr.tiers.iter().enumerate() {
            if t != "batch" && crate::route::Tier::from_name(t).is_none() {
                p.add(
                    "provider.tiers",
                    format!("`{t}` is no tier: list \"batch\", \"flex\" and/or \"standard\""),
                );
            } else if pr.tiers[..i].contains(t) {
                p.add("provider.tiers", format!("`{t}` is listed twice"));
            }
        }
        if pr.routed() && pr.mode == ProviderMode::Batch {
            p.add(
                "provider.tiers",
                "a job through the Batch API takes no online tiers: remove provider.tiers or provider.mode = \"batch\"",
            );
        }
        if let Some(d) = &self.job.deadline
            && let Err(why) = crate::route::parse_deadline(d, 0)
        {
            p.add("job.deadline", why);
        }
        for (i, f) in pr.fallbacks.iter().enumerate() {
            let key = |k: &str| format!("provider.fallbacks[{i}].{k}");
            let named = !f.name.is_empty()
                && f.name.chars().next().is_some_and(|c| c.is_ascii_lowercase())
                && f.name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-');
            if !named || f.name.len() > 32 {
                p.add(
                    key("name"),
                    format!(
                        "`{}` is no route name: a-z first, then a-z, 0-9, _ or -, at most 32",
                        f.name
                    ),
                );
            } else if RESERVED_ROUTES.contains(&f.name.as_str()) {
                p.add(
                    key("name"),
                    format!(
                        "`{}` names a tier: call the fallback by its provider, e.g. \"backup\"",
                        f.name
                    ),
                );
            } else if pr.fallbacks[..i].iter().any(|o| o.name == f.name) {
                p.add(key("name"), format!("`{}` is listed twice", f.name));
            }
            if !(f.base_url.starts_with("http://") || f.base_url.starts_with("https://")) {
                p.add(key("base_url"), "must start with http:// or https://");
            }
            if f.model.trim().is_empty() {
                p.add(key("model"), "must not be empty");
            }
            if !is_env_name(&f.api_key_env) {
                p.add(
                    key("api_key_env"),
                    "must be the NAME of an environment variable (A-Z, 0-9, _), never the key",
                );
            }
        }
        if !pr.fallbacks.is_empty() && pr.mode == ProviderMode::Batch {
            p.add(
                "provider.fallbacks",
                "a job through the Batch API takes no online fallback: remove one or the other",
            );
        }
    }

    fn limit_problems(&self, p: &mut Problems) {
        self.rate_limit_problems(p);
        self.retry_problems(p);
        self.money_problems(p);
        self.check_batch(p);
        match self.audit.rate {
            Some(r) if !(r.is_finite() && r > 0.0 && r <= 1.0) => {
                p.add(
                    "audit.rate",
                    "must be above 0 and at most 1 (a share of the committed results)",
                );
            }
            None if self.audit.seed.is_some() => p.add("audit.seed", "goes with audit.rate"),
            _ => {}
        }
        for (key, why) in self.drift.problems() {
            p.add(key, why);
        }
        for (key, why) in self.check.problems(&self.output, &self.prompt.user) {
            p.add(key, why);
        }
        let elsewhere = self
            .check
            .base_url
            .as_ref()
            .is_some_and(|u| *u != self.provider.base_url);
        if elsewhere && self.check.api_key_env.is_none() && self.provider.needs_key {
            p.add(
                "check.api_key_env",
                "names the variable of the checker's key: its base_url is another server, and the job's key \
                 is never sent anywhere but provider.base_url",
            );
        }
    }

    /// `[limits]`: every limit lets at least one request through.
    fn rate_limit_problems(&self, p: &mut Problems) {
        let l = &self.limits;
        for (key, v) in [
            ("limits.requests_per_minute", l.requests_per_minute),
            ("limits.tokens_per_minute", l.tokens_per_minute),
            ("limits.input_tokens_per_minute", l.input_tokens_per_minute),
            ("limits.output_tokens_per_minute", l.output_tokens_per_minute),
            ("limits.max_concurrent", l.max_concurrent),
        ] {
            if v == Some(0) {
                p.add(key, "must be at least 1 (leave it out for no limit)");
            }
        }
        for (key, v) in [
            ("limits.output_tokens_per_minute", l.output_tokens_per_minute),
            ("limits.tokens_per_minute", l.tokens_per_minute),
        ] {
            if let Some(tpm) = v
                && tpm < u64::from(self.provider.max_tokens)
            {
                let max = self.provider.max_tokens;
                p.add(
                    key,
                    format!("{tpm} is below provider.max_tokens ({max}): no request could ever be sent"),
                );
            }
        }
        if let Some(itpm) = l.input_tokens_per_minute {
            // The system prompt alone is sent with every request.
            let system = (system_prompt(self).len() as u64).div_ceil(4);
            if itpm < system {
                p.add(
                    "limits.input_tokens_per_minute",
                    format!(
                        "{itpm} is below the system prompt alone (about {system} tokens): no request could ever be sent"
                    ),
                );
            }
        }
    }

    /// `[retry]`: attempts, delays, temperatures, the outage budget.
    fn retry_problems(&self, p: &mut Problems) {
        let r = &self.retry;
        if r.temperatures.iter().any(|t| !(0.0..=2.0).contains(t)) {
            p.add("retry.temperatures", "every temperature must be between 0 and 2");
        }
        if !(1..=100).contains(&r.max_attempts) {
            p.add("retry.max_attempts", "must be between 1 and 100");
        }
        for (key, v) in [
            ("retry.base_delay_ms", r.base_delay_ms),
            ("retry.max_delay_ms", r.max_delay_ms),
        ] {
            if v > MAX_RETRY_DELAY_MS {
                p.add(
                    key,
                    format!("{v} ms is over the 24 h a retry may wait ({MAX_RETRY_DELAY_MS} ms)"),
                );
            }
        }
        if let Some(budget) = r.outage_budget_secs
            && !(1..=7 * 24 * 3600).contains(&budget)
        {
            p.add(
                "retry.outage_budget_secs",
                format!("{budget} is outside 1..=604800 (a week): how long the job waits out a provider that fails every call"),
            );
        }
        if r.base_delay_ms > r.max_delay_ms {
            p.add(
                "retry.max_delay_ms",
                format!(
                    "{} is less than retry.base_delay_ms ({})",
                    r.max_delay_ms, r.base_delay_ms
                ),
            );
        }
    }

    /// `[prices]` and `[budget]`: numbers that can be counted against.
    fn money_problems(&self, p: &mut Problems) {
        let pr = &self.prices;
        for (key, v) in [
            ("prices.input_per_mtok", Some(pr.input_per_mtok)),
            ("prices.cached_input_per_mtok", pr.cached_input_per_mtok),
            ("prices.output_per_mtok", Some(pr.output_per_mtok)),
            ("prices.batch_input_per_mtok", pr.batch_input_per_mtok),
            ("prices.batch_cached_input_per_mtok", pr.batch_cached_input_per_mtok),
            ("prices.batch_output_per_mtok", pr.batch_output_per_mtok),
            ("prices.flex_input_per_mtok", pr.flex_input_per_mtok),
            ("prices.flex_cached_input_per_mtok", pr.flex_cached_input_per_mtok),
            ("prices.flex_output_per_mtok", pr.flex_output_per_mtok),
        ] {
            if v.is_some_and(|v| !(v.is_finite() && v >= 0.0)) {
                p.add(key, "must be a non-negative number");
            }
        }
        let b = &self.budget;
        for (key, v) in [
            ("budget.max_cost_usd", b.max_cost_usd),
            ("budget.max_cost_per_record", b.max_cost_per_record),
        ] {
            if v.is_some_and(|v| !(v.is_finite() && v > 0.0)) {
                p.add(key, "must be a positive number of USD");
            }
        }
        if let Some(cap) = b.max_tokens_per_record
            && cap <= u64::from(self.provider.max_tokens)
        {
            p.add(
                "budget.max_tokens_per_record",
                format!(
                    "{cap} is not more than provider.max_tokens ({}): no call could fit (each is counted at its most: its prompt and max_tokens)",
                    self.provider.max_tokens
                ),
            );
        }
        if (b.max_cost_usd.is_some() || b.max_cost_per_record.is_some())
            && pr.input_per_mtok == 0.0
            && pr.output_per_mtok == 0.0
        {
            p.add(
                "budget",
                "a cost cap needs [prices] (input_per_mtok, output_per_mtok): every call would cost 0",
            );
        }
    }

    /// Version of the model configuration: what changes the model's answers.
    /// Part of every record id, so changing it makes a new set of results.
    pub fn model_config_version(&self) -> String {
        let canonical = serde_json::json!({
            "model": self.provider.model,
            "temperature": self.provider.temperature,
            "max_tokens": self.provider.max_tokens,
            "structured_output": self.provider.structured_output,
        });
        short_sha(canonical.to_string().as_bytes())
    }

    /// sha256 of the spec's canonical JSON form: edits of any kind change it.
    pub fn fingerprint(&self) -> String {
        let canonical = serde_json::to_vec(self).unwrap_or_default();
        hex::encode(Sha256::digest(&canonical))
    }
}

/// First 12 hex digits of a sha256: a short, stable version tag.
pub fn short_sha(bytes: &[u8]) -> String {
    let mut h = hex::encode(Sha256::digest(bytes));
    h.truncate(12);
    h
}

#[derive(Default)]
struct Problems(Vec<Problem>);

impl Problems {
    fn add(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(Problem {
            path: path.into(),
            message: message.into(),
        });
    }
}
/// A PostgreSQL sink: the variable's name (never the URL) and a table name.
fn postgres_sink_problems(s: &Sink, p: &mut Problems) {
    match &s.url_env {
        None => p.add(
            "sink.url_env",
            "is required: the NAME of the variable holding the database URL",
        ),
        Some(v) if !is_env_name(v) => p.add(
            "sink.url_env",
            "must be the NAME of an environment variable (A-Z, 0-9, _), never the URL",
        ),
        Some(_) => {}
    }
    let table_ok = {
        let parts: Vec<&str> = s.table().split('.').collect();
        parts.len() <= 2
            && parts.iter().all(|t| {
                t.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
                    && t.chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
                    && t.len() <= 53
            })
    };
    if !table_ok {
        p.add(
            "sink.table",
            "must be `name` or `schema.name`: lowercase letters, digits and `_`, at most 53 each (`_revisions` is added for a table of its own, within PostgreSQL's 63)",
        );
    }
    if s.dir.is_some() {
        p.add("sink.dir", "applies to kind = \"files\"");
    }
}

/// `OPENAI_API_KEY`: an environment variable's name (A-Z, 0-9, `_`, not a digit first).
fn is_env_name(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        && !s.starts_with(|c: char| c.is_ascii_digit())
}

/// Whether a JSON value has the given field type. Booleans are never numbers.
pub fn value_has_type(v: &serde_json::Value, kind: FieldType) -> bool {
    use serde_json::Value;
    match kind {
        FieldType::String => v.is_string(),
        FieldType::Number => v.is_number(),
        FieldType::Integer => match v {
            Value::Number(n) => {
                n.is_i64() || n.is_u64() || n.as_f64().is_some_and(|f| f.fract() == 0.0 && f.abs() < 9.0e15)
            }
            _ => false,
        },
        FieldType::Boolean => v.is_boolean(),
        FieldType::Array => v.is_array(),
        FieldType::Object => v.is_object(),
    }
}

/// An ordered map of output fields: TOML table order is the prompt's order.
pub use ordered_fields::OrderedFields;
mod ordered_fields {
    use super::FieldSpec;
    use serde::de::{MapAccess, Visitor};
    use serde::ser::SerializeMap;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use std::fmt;

    #[derive(Debug, Clone, Default, PartialEq)]
    pub struct OrderedFields(Vec<(String, FieldSpec)>);

    impl OrderedFields {
        pub fn iter(&self) -> impl Iterator<Item = (&String, &FieldSpec)> {
            self.0.iter().map(|(k, v)| (k, v))
        }
        pub fn get(&self, name: &str) -> Option<&FieldSpec> {
            self.0.iter().find(|(k, _)| k == name).map(|(_, v)| v)
        }
        pub fn is_empty(&self) -> bool {
            self.0.is_empty()
        }
        pub fn len(&self) -> usize {
            self.0.len()
        }
    }

    impl FromIterator<(String, FieldSpec)> for OrderedFields {
        fn from_iter<I: IntoIterator<Item = (String, FieldSpec)>>(iter: I) -> Self {
            OrderedFields(iter.into_iter().collect())
        }
    }

    impl Serialize for OrderedFields {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            let mut map = s.serialize_map(Some(self.0.len()))?;
            for (k, v) in &self.0 {
                map.serialize_entry(k, v)?;
            }
            map.end()
        }
    }

    impl<'de> Deserialize<'de> for OrderedFields {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = OrderedFields;
                fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                    f.write_str("a table of output fields")
                }
                fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<OrderedFields, A::Error> {
                    let mut out = Vec::new();
                    while let Some((k, v)) = map.next_entry::<String, FieldSpec>()? {
                        out.push((k, v));
                    }
                    Ok(OrderedFields(out))
                }
            }
            d.deserialize_map(V)
        }
    }
}

/// Maps each version name to its value, for manifests and reports.
/// What differs between two specs: `key.path: old -> new`, one a line, in
/// key order (empty when they mean the same, whatever their comments or layout).
pub fn spec_diff(before: &JobSpec, after: &JobSpec) -> Vec<String> {
    fn walk(path: &str, a: &serde_json::Value, b: &serde_json::Value, out: &mut Vec<String>) {
        use serde_json::Value;
        match (a, b) {
            (Value::Object(x), Value::Object(y)) => {
                let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
                keys.sort();
                keys.dedup();
                for k in keys {
                    let p = if path.is_empty() {
                        k.clone()
                    } else {
                        format!("{path}.{k}")
                    };
                    let null = Value::Null;
                    walk(&p, x.get(k).unwrap_or(&null), y.get(k).unwrap_or(&null), out);
                }
            }
            _ if a == b => {}
            _ => out.push(format!("{path}: {a} -> {b}")),
        }
    }
    let mut out = Vec::new();
    let a = serde_json::to_value(before).unwrap_or_default();
    let b = serde_json::to_value(after).unwrap_or_default();
    walk("", &a, &b, &mut out);
    out
}

pub fn versions_map(spec: &JobSpec) -> BTreeMap<&'static str, String> {
    BTreeMap::from([
        ("source", spec.versions.source.clone()),
        ("prompt", spec.versions.prompt.clone()),
        ("output", spec.versions.output.clone()),
        ("model_config", spec.model_config_version()),
    ])
}

/// When a segment is finished: whichever comes first.
#[derive(Debug, Clone, Copy)]
pub struct SegmentLimits {
    pub records: usize,
    pub bytes: u64,
    pub age: std::time::Duration,
}

/// The column of an output field with `sink.typed_columns`: `out_` and the
/// field's name in lowercase, anything but letters, digits and `_` as `_`.
pub fn column_name(field: &str) -> String {
    let mut c = String::from("out_");
    c.extend(field.chars().map(|ch| match ch.to_ascii_lowercase() {
        ch @ ('a'..='z' | '0'..='9' | '_') => ch,
        _ => '_',
    }));
    c.truncate(63);
    c
}

/// The system message: the spec's own text, then the output contract.
pub fn system_prompt(spec: &JobSpec) -> String {
    let mut out = spec.prompt.system.trim_end().to_owned();
    out.push_str("\n\nAnswer with exactly one JSON object and nothing else (no prose, no code fence). Its fields:\n");
    describe_fields(&mut out, &spec.output.fields, "");
    if !spec.output.rules.is_empty() {
        out.push_str("The answer must also satisfy these rules (`input` is the record, `output` the answer):\n");
        for (name, rule) in spec.output.rules.iter() {
            let _ = writeln!(out, "- {name}: {}", rule.says());
        }
    }
    out
}

/// One line per field, `indent`ed; an object's own fields (or its items')
/// follow it, indented further.
fn describe_fields(out: &mut String, fields: &OrderedFields, indent: &str) {
    // Fields code fills from the input are not asked of the model.
    for (name, f) in fields.iter().filter(|(_, f)| f.from_input.is_none()) {
        let mut ty = f.kind.name().to_owned();
        if f.nullable {
            ty.push_str(" or null");
        }
        let presence = if f.required_if.is_some() {
            "conditional"
        } else if f.required {
            "required"
        } else {
            "optional"
        };
        let _ = write!(out, "{indent}- {name} ({ty}, {presence})");
        let mut rules = Vec::new();
        if let Some(d) = &f.description {
            rules.push(d.trim().to_owned());
        }
        if let Some(values) = &f.enum_values {
            let list: Vec<String> = values.iter().map(serde_json::Value::to_string).collect();
            rules.push(format!("one of {}", list.join(", ")));
        }
        match (f.min, f.max) {
            (Some(lo), Some(hi)) => rules.push(format!("from {lo} to {hi}")),
            (Some(lo), None) => rules.push(format!("at least {lo}")),
            (None, Some(hi)) => rules.push(format!("at most {hi}")),
            (None, None) => {}
        }
        if let Some(n) = f.max_len {
            let unit = if f.kind == FieldType::Array {
                "items"
            } else {
                "characters"
            };
            rules.push(format!("at most {n} {unit}"));
        }
        if f.kind == FieldType::Array {
            let item = f.item_spec();
            let mut what = format!("each item a {}", item.kind.name());
            if let Some(values) = &item.enum_values {
                let list: Vec<String> = values.iter().map(serde_json::Value::to_string).collect();
                what.push_str(&format!(" (one of {})", list.join(", ")));
            }
            if let (Some(n), FieldType::String) = (item.max_len, item.kind) {
                what.push_str(&format!(" of at most {n} characters"));
            }
            rules.push(what);
        }
        if let Some(cond) = &f.required_if {
            rules.push(format!("required when {} is {}", cond.field, cond.equals));
        }
        let own = f.fields.as_ref().or(f.items.as_ref().and_then(|i| i.fields.as_ref()));
        if own.is_some() {
            rules.push("with these fields".to_owned());
        }
        if !rules.is_empty() {
            let _ = write!(out, ": {}", rules.join("; "));
        }
        out.push('\n');
        if let Some(own) = own {
            describe_fields(out, own, &format!("{indent}  "));
        }
    }
}

// ---- [check] ----

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
                    format!("`{f}` is not an output field (they are: {})", join_names(&known)),
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

fn join_names(names: &[&String]) -> String {
    names.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
}

// ---- [drift] ----

/// `[drift]`: when a field's failure rate counts as drift.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DriftSpec {
    /// false: never pause the job on drift.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// The recent answers compared with the earlier ones (per worker).
    #[serde(default = "default_window")]
    pub window: u32,
    /// How many times the earlier failure rate the window's must pass.
    #[serde(default = "default_factor")]
    pub factor: f64,
    /// Failures on the field in the window before an alarm can sound.
    #[serde(default = "default_min_failures")]
    pub min_failures: u32,
    /// Earlier answers needed before an alarm can sound (default: `window`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline: Option<u32>,
}

fn yes() -> bool {
    true
}
fn default_window() -> u32 {
    200
}
fn default_factor() -> f64 {
    3.0
}
fn default_min_failures() -> u32 {
    20
}

impl Default for DriftSpec {
    fn default() -> DriftSpec {
        DriftSpec {
            enabled: true,
            window: default_window(),
            factor: default_factor(),
            min_failures: default_min_failures(),
            baseline: None,
        }
    }
}

impl DriftSpec {
    pub fn is_default(&self) -> bool {
        *self == DriftSpec::default()
    }

    pub fn baseline(&self) -> u32 {
        self.baseline.unwrap_or(self.window)
    }

    /// What is wrong with it: (key, why).
    pub fn problems(&self) -> Vec<(&'static str, String)> {
        let mut p = Vec::new();
        if !(20..=1_000_000).contains(&self.window) {
            p.push(("drift.window", "must be between 20 and 1000000 answers".to_owned()));
        }
        if !(self.factor.is_finite() && self.factor > 1.0) {
            p.push((
                "drift.factor",
                "must be above 1 (times the earlier failure rate)".to_owned(),
            ));
        }
        if self.min_failures == 0 || self.min_failures > self.window {
            p.push((
                "drift.min_failures",
                format!("must be between 1 and drift.window ({})", self.window),
            ));
        }
        if self.baseline.is_some_and(|b| b == 0) {
            p.push(("drift.baseline", "must be at least 1 answer".to_owned()));
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = include_str!("../../examples/job.toml");

    /// The example spec with one edit: `replace` swapped for `with`.
    fn edited(replace: &str, with: &str) -> String {
        assert!(EXAMPLE.contains(replace), "example spec lacks {replace:?}");
        EXAMPLE.replacen(replace, with, 1)
    }

    /// Adds `from`'s keys to `into`, table by table.
    fn merge(into: &mut toml::Table, from: toml::Table) {
        for (k, v) in from {
            match (into.get_mut(&k), v) {
                (Some(toml::Value::Table(a)), toml::Value::Table(b)) => merge(a, b),
                (_, v) => {
                    into.insert(k, v);
                }
            }
        }
    }

    #[test]
    fn the_readmes_spec_example_is_valid_in_the_example_spec() {
        let readme = include_str!("../../README.md");
        let blocks: Vec<&str> = readme
            .split("```toml\n")
            .skip(1)
            .filter_map(|b| b.split("```").next())
            .collect();
        assert!(!blocks.is_empty(), "the README shows a spec");
        for block in blocks {
            let mut spec: toml::Table = toml::from_str(EXAMPLE).unwrap();
            merge(&mut spec, toml::from_str(block).unwrap());
            let text = toml::to_string(&spec).unwrap();
            let parsed = JobSpec::parse(&text, "README.md").unwrap_or_else(|e| panic!("{e}\n{block}"));
            assert_eq!(parsed.provider.fallbacks.len(), 1);
            assert!(parsed.provider.batch_tier() && parsed.job.deadline.is_some());
        }
    }

    #[test]
    fn tiers_deadlines_and_fallbacks_are_checked_with_their_path() {
        let tiers = |t: &str| {
            edited(
                "structured_output = \"auto\"",
                &format!("structured_output = \"auto\"\ntiers = {t}"),
            )
        };
        let ok = JobSpec::parse(&tiers("[\"flex\", \"standard\"]"), "job.toml").unwrap();
        assert_eq!(
            ok.provider.tiers(),
            vec![crate::route::Tier::Flex, crate::route::Tier::Standard]
        );
        // Flex defaults to the batch price: half the standard one.
        assert_eq!(ok.prices.flex().output_per_mtok, ok.prices.output_per_mtok / 2.0);
        assert!(
            JobSpec::parse(&tiers("[\"batch\", \"flex\", \"standard\"]"), "job.toml")
                .unwrap()
                .provider
                .batch_tier()
        );
        assert_problem(
            &tiers("[\"batch\"]").replace("[retry]", "[budget]\nmax_cost_usd = 5.0\n\n[retry]"),
            "budget: is not enforced through the Batch API",
        );
        assert_problem(&tiers("[\"flexx\"]"), "provider.tiers: `flexx` is no tier");
        assert_problem(&tiers("[\"flex\", \"flex\"]"), "provider.tiers: `flex` is listed twice");
        let passthrough = tiers("[\"batch\", \"standard\"]").replace("[prompt]", "[prompt]\nrequest_field = \"body\"");
        assert_problem(
            &passthrough,
            "prompt.request_field: is sent online only: remove \"batch\" from provider.tiers",
        );
        let deadline = |d: &str| edited("partitions = 4 ", &format!("partitions = 4\ndeadline = \"{d}\" "));
        assert_eq!(
            JobSpec::parse(&deadline("6h"), "job.toml")
                .unwrap()
                .job
                .deadline
                .as_deref(),
            Some("6h")
        );
        assert_problem(&deadline("tomorrow"), "job.deadline: `tomorrow` is neither a duration");
        let fallback = |body: &str| edited("\n[limits]", &format!("\n[[provider.fallbacks]]\n{body}\n\n[limits]"));
        let good = "name = \"backup\"\nbase_url = \"https://api.example.com/v1\"\nmodel = \"m\"";
        let spec = JobSpec::parse(&fallback(good), "job.toml").unwrap();
        let as_fallback = spec.as_fallback(&spec.provider.fallbacks[0]);
        assert_eq!(
            (
                as_fallback.provider.model.as_str(),
                as_fallback.limits.requests_per_minute
            ),
            ("m", None)
        );
        assert_eq!(
            as_fallback.prices, spec.prices,
            "the job's prices unless it names its own"
        );
        assert_problem(
            &fallback(&good.replace("backup", "flex")),
            "provider.fallbacks[0].name: `flex` names a tier",
        );
        assert_problem(
            &fallback(&good.replace("backup", "Backup 2")),
            "provider.fallbacks[0].name: `Backup 2` is no route name",
        );
        assert_problem(
            &fallback(&good.replace("https://", "ftp://")),
            "provider.fallbacks[0].base_url: must start with http",
        );
        assert_problem(
            &fallback(&format!("{good}\napi_key_env = \"sk-123\"")),
            "provider.fallbacks[0].api_key_env: must be the NAME",
        );
    }

    #[test]
    fn a_sink_is_checked_field_by_field() {
        let with = |sink: &str| edited("[retry]", &format!("[sink]\n{sink}\n\n[retry]"));
        let ok = JobSpec::parse(&with("kind = \"postgres\"\nurl_env = \"DATABASE_URL\""), "job.toml").unwrap();
        assert_eq!(ok.sink.table(), "batchfleet_results");
        assert_eq!(ok.sink.batch_rows(), 500);
        let files = JobSpec::parse(&with("kind = \"files\"\ndir = \"out\"\nsegment_secs = 2"), "job.toml").unwrap();
        let l = files.sink.segment_limits();
        assert_eq!((l.records, l.bytes, l.age.as_secs()), (10_000, 64 << 20, 2));
        assert_eq!(
            (ok.sink.max_backlog(), ok.sink.writers(4), ok.sink.writers(2)),
            (100_000, 4, 2)
        );
        assert!(
            JobSpec::parse(EXAMPLE, "job.toml").unwrap().sink.is_none(),
            "none by default"
        );
        for (sink, needle) in [
            ("kind = \"postgres\"", "sink.url_env: is required"),
            (
                "kind = \"postgres\"\nurl_env = \"postgres://u:p@h/db\"",
                "sink.url_env: must be the NAME",
            ),
            (
                "kind = \"postgres\"\nurl_env = \"D\"\ntable = \"Results; DROP\"",
                "sink.table: must be `name` or `schema.name`",
            ),
            (
                "kind = \"postgres\"\nurl_env = \"D\"\nbatch_rows = 0",
                "sink.batch_rows: must be between 1 and 5000",
            ),
            (
                "kind = \"postgres\"\nurl_env = \"D\"\nwriters = 0",
                "sink.writers: must be between 1 and 64",
            ),
            (
                "kind = \"postgres\"\nurl_env = \"D\"\nmax_backlog = 0",
                "sink.max_backlog: must be between 1 and 100000000",
            ),
            ("kind = \"files\"", "sink.dir: is required"),
            (
                "kind = \"files\"\ndir = \"out\"\ntyped_columns = true",
                "sink.typed_columns: applies to kind = \"postgres\"",
            ),
            (
                "kind = \"files\"\ndir = \"out\"\ntable = \"t\"",
                "sink.table: applies to kind = \"postgres\"",
            ),
            (
                "kind = \"files\"\ndir = \"out\"\nsegment_records = 0",
                "sink.segment_records: must be between 1 and 1000000",
            ),
            (
                "kind = \"postgres\"\nurl_env = \"D\"\nsegment_secs = 5",
                "sink.segment_secs: applies to kind = \"files\"",
            ),
            ("url_env = \"D\"", "sink.url_env: is set but sink.kind is \"none\""),
            ("kind = \"mysql\"", "unknown variant `mysql`"),
        ] {
            let problems = problems_of(&with(sink)).join("\n");
            assert!(problems.contains(needle), "{sink}: {problems}");
        }
    }

    fn problems_of(text: &str) -> Vec<String> {
        match JobSpec::parse(text, "job.toml") {
            Ok(_) => vec![],
            Err(SpecError::Invalid { problems, .. }) => problems.iter().map(ToString::to_string).collect(),
            Err(e) => vec![e.to_string()],
        }
    }

    fn assert_problem(text: &str, needle: &str) {
        let problems = problems_of(text);
        assert!(
            problems.iter().any(|p| p.contains(needle)),
            "expected a problem containing {needle:?}, got {problems:?}"
        );
    }

    #[test]
    fn the_example_spec_is_valid_and_keeps_field_order() {
        let spec = JobSpec::parse(EXAMPLE, "examples/job.toml").unwrap();
        let names: Vec<&String> = spec.output.fields.iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["label", "reason", "confidence", "task_type", "items"]);
        assert_eq!(spec.job.partitions, 4);
        assert!(spec.output.fields.get("confidence").unwrap().nullable);
    }

    #[test]
    fn an_audit_rate_is_a_share_and_its_sample_is_seeded() {
        let with = |a: &str| edited("[prices]", &format!("[audit]\n{a}\n\n[prices]"));
        assert_problem(&with("rate = 0"), "audit.rate");
        assert_problem(&with("rate = 1.5"), "audit.rate");
        assert_problem(&with("seed = 3"), "audit.seed");
        assert_problem(&with("rate = 0.1\nsample = 3"), "sample");
        let ok = JobSpec::parse(&with("rate = 0.25\nseed = 7"), "t").unwrap();
        let sampled = (0..4000).filter(|i| ok.audit.sampled(&format!("r{i}"))).count();
        assert!((850..1150).contains(&sampled), "about a quarter: {sampled}");
        let again = JobSpec::parse(&with("rate = 0.25\nseed = 7"), "t").unwrap();
        assert!((0..100).all(|i| ok.audit.sampled(&format!("r{i}")) == again.audit.sampled(&format!("r{i}"))));
        let other = JobSpec::parse(&with("rate = 0.25\nseed = 8"), "t").unwrap();
        assert!((0..100).any(|i| ok.audit.sampled(&format!("r{i}")) != other.audit.sampled(&format!("r{i}"))));
        assert!(
            !JobSpec::parse(&edited("[prices]", "[prices]"), "t")
                .unwrap()
                .audit
                .sampled("r1")
        );
    }

    #[test]
    fn a_budget_is_checked_field_by_field() {
        let with = |b: &str| edited("[prices]", &format!("[budget]\n{b}\n\n[prices]"));
        assert_problem(&with("max_cost_usd = -1"), "budget.max_cost_usd");
        assert_problem(&with("max_tokens_per_record = 150"), "no call could fit");
        assert_problem(&with("max_cost_typo = 1"), "unknown field `max_cost_typo`");
        let free = edited("input_per_mtok = 0.15", "input_per_mtok = 0.0").replacen(
            "output_per_mtok = 0.60",
            "output_per_mtok = 0.0",
            1,
        );
        assert_problem(
            &free.replacen("[prices]", "[budget]\nmax_cost_usd = 1.0\n\n[prices]", 1),
            "a cost cap needs [prices]",
        );
        let ok = JobSpec::parse(&with("max_cost_usd = 2.5\nmax_tokens_per_record = 5000"), "t").unwrap();
        assert_eq!(ok.budget.max_cost_usd, Some(2.5));
    }

    #[test]
    fn batch_mode_is_checked_field_by_field() {
        let batch = |b: &str| {
            edited("temperature = 0.0", "temperature = 0.0\nmode = \"batch\"").replacen(
                "[retry]",
                &format!("[batch]\n{b}\n\n[retry]"),
                1,
            )
        };
        let ok = JobSpec::parse(&batch("shard_records = 1000\nretries = \"online\""), "t").unwrap();
        assert_eq!(ok.provider.mode, ProviderMode::Batch);
        assert_eq!(
            (ok.batch.shard_records(), ok.batch.retries),
            (1000, BatchRetries::Online)
        );
        assert_eq!(ok.batch.completion_window(), "24h");
        assert_problem(&batch("shard_records = 50001"), "batch.shard_records");
        assert_problem(&batch("shard_bytes = 300000000"), "batch.shard_bytes");
        assert_problem(&batch("completion_window = \"1d\""), "batch.completion_window");
        assert_problem(&batch("poll_secs = 0"), "batch.poll_secs");
        assert_problem(&batch("max_enqueued_tokens = 0"), "batch.max_enqueued_tokens");
        assert_problem(&batch("retries = \"later\""), "retries");
        assert_problem(
            &batch("").replacen("[prices]", "[budget]\nmax_cost_usd = 5.0\n\n[prices]", 1),
            "not enforced through the Batch API",
        );
        // [batch] without batch mode is a mistake, not a silent no-op.
        assert_problem(
            &edited("[retry]", "[batch]\nshard_records = 10\n\n[retry]"),
            "applies to provider.mode",
        );
        // Batch prices: half the online ones unless set.
        let p = ok.prices.batch();
        assert!((p.input_per_mtok - 0.075).abs() < 1e-12 && (p.output_per_mtok - 0.30).abs() < 1e-12);
        let set = JobSpec::parse(
            &batch("").replacen("[prices]", "[prices]\nbatch_output_per_mtok = 0.5", 1),
            "t",
        )
        .unwrap();
        assert!((set.prices.batch().output_per_mtok - 0.5).abs() < 1e-12);
    }

    #[test]
    fn unknown_keys_are_refused_with_their_path() {
        assert_problem(
            &edited("timeout_secs = 30", "timeout_secs = 30\ntimeout_sec = 3"),
            "at `provider.timeout_sec`",
        );
        assert_problem(
            &edited("timeout_secs = 30", "timeout_secs = 30\ntimeout_sec = 3"),
            "unknown field `timeout_sec`",
        );
        assert_problem(
            &edited("max_len = 60", "max_len = 60\nmaxlen = 3"),
            "output.fields.reason",
        );
        assert_problem(&format!("{EXAMPLE}\n[extra]\nx = 1\n"), "unknown field `extra`");
    }

    #[test]
    fn bad_types_name_the_key() {
        assert_problem(
            &edited("partitions = 4", "partitions = \"four\""),
            "at `job.partitions`",
        );
        assert_problem(
            &edited("type = \"number\"", "type = \"float\""),
            "output.fields.confidence.type",
        );
        assert_problem(&edited("max_tokens = 200", "max_tokens = -1"), "provider.max_tokens");
    }

    #[test]
    fn missing_sections_are_named() {
        let without_provider = EXAMPLE.split("[provider]").next().unwrap().to_owned();
        assert_problem(&without_provider, "missing field `provider`");
    }

    #[test]
    fn impossible_values_are_refused() {
        assert_problem(
            &edited("max = 1.0", "max = -1.0"),
            "output.fields.confidence.max: max (-1) is less than min (0)",
        );
        assert_problem(
            &edited("enum = [\"classify\", \"extract\"]", "enum = []"),
            "output.fields.task_type.enum: has no values",
        );
        assert_problem(
            &edited("enum = [\"classify\", \"extract\"]", "enum = [\"classify\", 3]"),
            "value 3 is not a string",
        );
        assert_problem(
            &edited("max_len = 60", "max_len = 0"),
            "output.fields.reason.max_len: must be at least 1",
        );
        assert_problem(&edited("partitions = 4", "partitions = 0"), "job.partitions");
        assert_problem(&edited("max_attempts = 4", "max_attempts = 0"), "retry.max_attempts");
        assert_problem(
            &edited("max_delay_ms = 30000", "max_delay_ms = 10"),
            "retry.max_delay_ms",
        );
        assert_problem(
            &edited("base_url = \"http://127.0.0.1:8089/v1\"", "base_url = \"ftp://x\""),
            "provider.base_url",
        );
        assert_problem(
            &edited(
                "base_url = \"http://127.0.0.1:8089/v1\"",
                "base_url = \"http://exa mple.com\"",
            ),
            "provider.base_url: `http://exa mple.com` is not a URL",
        );
        assert_problem(
            &edited(
                "base_url = \"http://127.0.0.1:8089/v1\"",
                "base_url = \"https://u:p@x.com/v1\"",
            ),
            "provider.base_url: must not hold credentials",
        );
        assert_problem(
            &edited("max_delay_ms = 30000", "max_delay_ms = 9223372036854775807"),
            "retry.max_delay_ms: 9223372036854775807 ms is over the 24 h",
        );
        assert_problem(
            &edited("input_tokens_per_minute = 2000000", "input_tokens_per_minute = 1"),
            "limits.input_tokens_per_minute: 1 is below the system prompt alone",
        );
        assert_problem(
            &edited("system = \"\"\"", "system = \"\"\"Channel {{channel}}. "),
            "prompt.system: placeholders are only filled in prompt.user; move {{channel}} there",
        );
        assert_problem(
            &edited("api_key_env = \"OPENAI_API_KEY\"", "api_key_env = \"sk-abc123\""),
            "provider.api_key_env",
        );
        assert_problem(
            &edited("temperature = 0.0", "temperature = 3.5"),
            "provider.temperature",
        );
        assert_problem(
            &edited("requests_per_minute = 10000", "requests_per_minute = 0"),
            "limits.requests_per_minute",
        );
        assert_problem(
            &edited("output_tokens_per_minute = 500000", "output_tokens_per_minute = 100"),
            "below provider.max_tokens",
        );
        assert_problem(
            &edited("output_per_mtok = 0.60", "output_per_mtok = -1.0"),
            "prices.output_per_mtok",
        );
    }

    #[test]
    fn rules_on_the_wrong_type_are_refused() {
        assert_problem(
            &edited("max_len = 60", "max_len = 60\nmin = 1"),
            "output.fields.reason.min: min/max apply to numbers",
        );
        assert_problem(
            &edited("max = 1.0", "max = 1.0\nmax_len = 3"),
            "output.fields.confidence.max_len",
        );
        assert_problem(
            &edited("type = \"array\"", "type = \"boolean\"\nenum = [true]"),
            "output.fields.items.enum",
        );
    }

    #[test]
    fn required_if_must_point_at_a_real_value() {
        assert_problem(
            &edited("field = \"task_type\"", "field = \"tasktype\""),
            "`tasktype` is not an output field",
        );
        assert_problem(
            &edited("equals = \"extract\"", "equals = \"summarize\""),
            "is not in `task_type`'s enum",
        );
        assert_problem(&edited("required = false\n", ""), "set `required = false`");
    }

    #[test]
    fn templates_and_system_fields_are_checked() {
        assert_problem(&edited("{{text}}", "{{text"), "prompt.user: unclosed");
        assert_problem(
            &edited(
                "Task type: {{task_type}}\nChannel: {{channel}}\nMessage:\n{{text}}",
                "no placeholders",
            ),
            "prompt.user: has no {{field}}",
        );
        assert_problem(
            &edited("[output.fields.reason]", "[output.fields.record_id]"),
            "filled in by batchfleet",
        );
        assert_problem(
            &edited("id_field = \"message_id\"", "id_field = \"a b\""),
            "job.id_field",
        );
    }

    #[test]
    fn syntax_errors_are_reported_with_a_position() {
        let text = edited("partitions = 4", "partitions = = 4");
        let err = JobSpec::parse(&text, "job.toml").unwrap_err().to_string();
        assert!(err.contains("job.toml") && err.contains("line"), "{err}");
    }

    #[test]
    fn model_config_version_follows_the_model_settings_only() {
        let a = JobSpec::parse(EXAMPLE, "a").unwrap();
        let b = JobSpec::parse(&edited("temperature = 0.0", "temperature = 0.5"), "b").unwrap();
        let c = JobSpec::parse(&edited("timeout_secs = 30", "timeout_secs = 31"), "c").unwrap();
        assert_ne!(a.model_config_version(), b.model_config_version());
        assert_eq!(a.model_config_version(), c.model_config_version());
        assert_ne!(a.fingerprint(), c.fingerprint());
    }
}

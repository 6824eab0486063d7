//! batchfleet's shared core. Producer and worker depend on it; it knows
//! nothing of HTTP servers or command lines.
//!
//! - [`spec`]: the job spec (TOML): serde types, defaults, `validate()`; the
//!   system prompt with its field list.
//! - [`template`]: strict `{{field}}` rendering.
//! - [`record`]: a dataset line as a typed record; `record_id`; partitioning.
//! - [`route`]: price tiers (flex, standard), deadlines, and the planner's share rule.
//! - [`task`]: a record's lifecycle as types (task, state, attempt, usage,
//!   result, review entry), each with one encoding.
//! - [`keys`]: every Redis key, stream, group and consumer name.
//! - [`manifest`]: the job manifest and the producer's resume cursor.
//! - [`json`]: the one depth limit for every JSON value taken from outside.
//! - [`validate`]: model output vs the field spec -> valid (with repairs) or errors.
//! - [`decision`]: (attempt, outcome, policy) -> commit | retry | review | drop | halt.
//! - [`heartbeat`]: what a worker says of itself every few seconds; alive, draining, stopped or dead.
//! - [`store`]: job state in Redis, in queue verbs; its Lua scripts.
//! - [`stats`]: a job's outcome counters (errors, retries, attempts, per minute).
//! - [`audit`]: spot checks: verdicts and the accuracy they estimate.
//! - [`batch`]: group commit: calls that queue up while one runs go together.
//! - [`secret`]: Redis URLs shown without passwords; secrets scrubbed from
//!   what providers send back; unusable API keys refused.
//! - [`shard`]: provider batch mode's shards, their states and output lines.
//! - [`sink`]: the result sinks behind one trait (PostgreSQL, JSONL segments, memory).
//! - [`otel`]: OTLP traces (off unless an endpoint is configured).
//! - [`suggest`]: the nearest existing name to a mistyped one.
//! - [`log`]: standard error that never blocks or panics (lines dropped and counted).

pub mod audit;
pub mod batch;
pub mod check;
pub mod decision;
pub mod drift;
pub mod heartbeat;
pub mod ids;
pub mod json;
pub mod keys;
pub mod ledger;
pub mod log;
pub mod manifest;
pub mod otel;
pub mod record;
pub mod route;
pub mod rules;
pub mod secret;
pub mod shard;
pub mod sink;
pub mod spec;
pub mod stats;
pub mod store;
pub mod suggest;
pub mod task;
pub mod template;
pub mod validate;

//! The `worker`: claims tasks, calls the model, validates, decides, commits.
//!
//! - [`run`]: the claim / reclaim / promote loop and the shutdown order.
//! - [`process`]: one task from delivery to its single atomic outcome.
//! - [`provider`]: the OpenAI-compatible client and failure classification.
//! - [`limiter`]: fleet-wide rate limits shared in Redis; header parsing.
//! - [`telemetry`]: metric declarations; [`http`]: `/metrics`, `/healthz`, `/readyz`.

pub mod http;
pub mod limiter;
pub mod process;
pub mod provider;
pub mod run;
pub mod telemetry;

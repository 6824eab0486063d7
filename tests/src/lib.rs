//! Test harness: a real `redis-server` on a free port, paths to the built
//! binaries, temporary folders and datasets.
//!
//! Every server the harness starts binds to 127.0.0.1, is owned by the test
//! (a child process, killed by pid when dropped), and keeps nothing on disk
//! outside its temporary folder.
//!
//! Module map (everything is re-exported here, as `harness::NAME`):
//!
//! - [`paths`]: the workspace root, built binaries, temporary folders.
//! - [`servers`]: `redis-server` (alone or a cluster) and `llm-sim` child processes.
//! - [`process`]: spawning, signalling and waiting for child processes.
//! - [`commands`]: `producer` and `worker` commands against the test's servers.
//! - [`dataset`]: record lines, record files, the example spec.
//! - [`client`]: HTTP requests to local servers.
//! - [`otlp`]: a real OTLP receiver for trace tests.
//! - [`browser`]: headless Chromium over WebDriver, and `producer console`.

pub mod browser;
pub mod client;
pub mod commands;
pub mod dataset;
pub mod otlp;
pub mod paths;
pub mod process;
pub mod servers;

pub use client::{Answer, http_get, http_get_json, http_send};
pub use commands::{
    enqueue, enqueue_cmd, enqueue_cmd_url, example_job, export_done_env, export_env, exported_ledger, helm, producer,
    producer_with_env, status_json, status_json_env, status_json_url, typed, worker_cmd, worker_cmd_all,
    worker_cmd_url,
};
pub use dataset::{example_spec, record_line, result_for, sink_section, spec_with, write_records};
pub use paths::{TempDir, bin, workspace};
pub use process::{Running, signal, stderr, stdout, thread_names, wait_exit, wait_for, wait_until, worker_summary};
pub use servers::{LlmSim, PgServer, RedisCluster, RedisServer, TEST_PG_PASSWORD, TEST_REDIS_PASSWORD, free_port};

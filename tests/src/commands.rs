//! batchfleet's own binaries as commands a test runs: `producer`
//! (enqueue, status) and `worker`, pointed at the test's servers.

use std::path::Path;
use std::process::{Command, Output};

use crate::paths::bin;
use crate::process::{stderr, stdout};
use crate::servers::{LlmSim, RedisServer};

/// Runs `producer` with arguments and returns its output.
pub fn producer(args: &[&str]) -> Output {
    producer_with_env(args, &[])
}

/// [`producer`] with environment variables set (a sink's database URL).
pub fn producer_with_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(bin("producer"));
    c.args(args).env_remove("REDIS_URL");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run producer")
}

/// A `worker` command for one job against a test Redis and simulator.
pub fn worker_cmd(redis: &RedisServer, job: &str, sim: &LlmSim, extra: &[&str]) -> Command {
    worker_cmd_url(&redis.url(), job, sim, extra)
}

/// [`worker_cmd`] for any Redis URL (a TLS server, a cluster's seed list).
pub fn worker_cmd_url(redis_url: &str, job: &str, sim: &LlmSim, extra: &[&str]) -> Command {
    let mut c = worker_of(redis_url, sim, extra);
    c.args(["--job", job]);
    c
}

/// A `worker` command without `--job`: it serves every job in Redis.
pub fn worker_cmd_all(redis: &RedisServer, sim: &LlmSim, extra: &[&str]) -> Command {
    worker_of(&redis.url(), sim, extra)
}

fn worker_of(redis_url: &str, sim: &LlmSim, extra: &[&str]) -> Command {
    let mut c = Command::new(bin("worker"));
    c.args([
        "--redis",
        redis_url,
        "--base-url",
        &sim.base_url(),
        "--log-format",
        "json",
    ])
    // Tests poll often unless they test the idle worker.
    .args(if extra.contains(&"--idle-poll-ms") {
        &[][..]
    } else {
        &["--idle-poll-ms", "20"][..]
    })
    // Each worker on its own free port, unless the test picks one.
    .args(if extra.contains(&"--metrics-addr") {
        &[][..]
    } else {
        &["--metrics-addr", "127.0.0.1:0"][..]
    })
    .args(extra)
    .env("OPENAI_API_KEY", "sk-test-key")
    .env_remove("REDIS_URL")
    .env_remove("BATCHFLEET_BASE_URL")
    .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
    .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
    c
}

/// `producer enqueue DATASET --job JOB --spec SPEC --redis URL` as a command,
/// for tests that watch or kill it.
pub fn enqueue_cmd(redis: &RedisServer, dataset: &Path, job: &str, spec: &Path) -> Command {
    enqueue_cmd_url(&redis.url(), dataset, job, spec)
}

/// [`enqueue_cmd`] for any Redis URL.
pub fn enqueue_cmd_url(redis_url: &str, dataset: &Path, job: &str, spec: &Path) -> Command {
    let mut c = Command::new(bin("producer"));
    c.arg("enqueue")
        .arg(dataset)
        .args(["--job", job, "--spec"])
        .arg(spec)
        .args(["--redis", redis_url])
        .env_remove("REDIS_URL")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
    c
}

/// Enqueues a dataset quietly and asserts it worked.
pub fn enqueue(redis: &RedisServer, dataset: &Path, job: &str, spec: &Path) {
    let out = enqueue_cmd(redis, dataset, job, spec)
        .arg("--no-progress")
        .output()
        .expect("run producer");
    assert!(out.status.success(), "enqueue failed: {}", stderr(&out));
}

/// `producer status --json --ids --require-complete` of a job: (exit code, status).
pub fn status_json(redis: &RedisServer, job: &str) -> (Option<i32>, serde_json::Value) {
    status_json_url(&redis.url(), job)
}

/// [`status_json`] for any Redis URL.
pub fn status_json_url(redis_url: &str, job: &str) -> (Option<i32>, serde_json::Value) {
    status_json_env(redis_url, job, &[])
}

/// [`status_json_url`] with environment variables set (a sink's database
/// URL: completeness is then proven from the sink's table too).
pub fn status_json_env(redis_url: &str, job: &str, env: &[(&str, &str)]) -> (Option<i32>, serde_json::Value) {
    let out = producer_with_env(
        &[
            "status",
            "--job",
            job,
            "--redis",
            redis_url,
            "--json",
            "--ids",
            "--require-complete",
        ],
        env,
    );
    let status =
        serde_json::from_str(&stdout(&out)).unwrap_or_else(|e| panic!("status is not JSON ({e}): {}", stdout(&out)));
    (out.status.code(), status)
}

/// `producer export --what done --out -` with environment variables set:
/// its output (the caller checks the exit status).
pub fn export_done_env(redis_url: &str, job: &str, env: &[(&str, &str)]) -> Output {
    export_env(redis_url, job, "done", env)
}

/// `producer export --what WHAT --out -` of a job, with `env` set.
pub fn export_env(redis_url: &str, job: &str, what: &str, env: &[(&str, &str)]) -> Output {
    producer_with_env(
        &[
            "export", "--job", job, "--redis", redis_url, "--what", what, "--out", "-",
        ],
        env,
    )
}

/// The paid calls `producer export --what ledger` writes, each as JSON,
/// checked to be each once; with their total cost in nano-USD.
pub fn exported_ledger(redis_url: &str, job: &str, env: &[(&str, &str)]) -> (Vec<serde_json::Value>, u64) {
    let out = export_env(redis_url, job, "ledger", env);
    assert!(out.status.success(), "{}", crate::stderr(&out));
    let calls: Vec<serde_json::Value> = crate::stdout(&out)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a ledger line is JSON"))
        .collect();
    let keys: std::collections::HashSet<&str> = calls.iter().filter_map(|c| c["call_key"].as_str()).collect();
    assert_eq!(keys.len(), calls.len(), "each paid call once");
    let nusd = calls.iter().map(|c| c["cost_nusd"].as_u64().expect("cost_nusd")).sum();
    (calls, nusd)
}

/// helm from the project's `.tools/bin` (make installs it there) or PATH.
pub fn helm(args: &[&str]) -> (bool, String) {
    let local = crate::workspace().join(".tools/bin/helm");
    let bin = if local.exists() { local } else { "helm".into() };
    let home = crate::TempDir::new("helm-home");
    let out = Command::new(&bin)
        .args(args)
        .current_dir(crate::workspace())
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"))
        .output()
        .expect("helm must be installed (make test installs it into .tools/bin)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// Runs a command line as a person would type it (the words a message
/// suggested), in `sh`, with batchfleet's binaries first on `PATH` and these
/// variables set.
pub fn typed(command: &str, env: &[(&str, &str)]) -> Output {
    let dir = crate::paths::bin("producer");
    let path = format!(
        "{}:{}",
        dir.parent().map(|d| d.display().to_string()).unwrap_or_default(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut c = Command::new("/bin/sh");
    c.args(["-c", command]).env("PATH", path).env_remove("REDIS_URL");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run a typed command")
}

/// A job of `n` records (`msg-0`...) under the example spec, enqueued into
/// `redis` as `name`; the folder holding its files.
pub fn example_job(redis: &RedisServer, name: &str, n: u64) -> crate::paths::TempDir {
    let dir = crate::paths::TempDir::new(name);
    let data = dir.join("d.jsonl");
    crate::dataset::write_records(&data, 0, n);
    enqueue(redis, &data, name, &crate::dataset::spec_with(&dir, &[]));
    dir
}

//! `producer serve-batches` driven by the official `openai` Python SDK
//! (tests/sdk/batches_sdk.py), as code written for `client.batches` would:
//! upload, create, a retried create (the same batch), the same key with other
//! parameters (409), the serving process killed and started again mid-batch,
//! the output file in the official shape with each record once, a cancel
//! mid-way (partial output, the rest in the error file), a file with a
//! duplicate custom_id (failed, with its line), and a key that sees only its
//! own batches. Real Redis, llm-sim and a worker serving every job.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use harness::{LlmSim, RedisServer, Running, TempDir, bin, free_port, producer, stdout, worker_cmd_all, workspace};
use serde_json::Value;

const ALICE: &str = "alice-key-0123456789abcdef";
const BOB: &str = "bob-key-0123456789abcdef00";

/// The provider spec of docs/batches.md, pointed at the test's llm-sim.
fn provider_spec(dir: &TempDir, sim: &LlmSim) -> PathBuf {
    let text = std::fs::read_to_string(workspace().join("examples/batches/provider.toml")).unwrap();
    let text = text.replace("http://127.0.0.1:8089/v1", &sim.base_url());
    let path = dir.join("provider.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn serve(redis: &RedisServer, dir: &TempDir, spec: &PathBuf, port: u16) -> Running {
    let mut c = Command::new(bin("producer"));
    c.args([
        "serve-batches",
        "--bind",
        &format!("127.0.0.1:{port}"),
        "--provider-spec",
    ])
    .arg(spec)
    .arg("--data-dir")
    .arg(dir.join("data"))
    .args(["--poll-ms", "200"])
    .env("REDIS_URL", redis.url())
    .env("BATCHFLEET_BATCHES_KEYS", format!("alice:{ALICE},bob:{BOB}"));
    let running = Running::spawn(c);
    harness::wait_for("serve-batches to listen", Duration::from_secs(20), || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    running
}

/// Runs one phase of the SDK script and returns the JSON line it printed last.
fn sdk(phase: &str, port: u16, key: &str, dir: &TempDir, env: &[(&str, &str)]) -> Value {
    let out = Command::new("python3")
        .arg(workspace().join("tests/sdk/batches_sdk.py"))
        .arg(phase)
        .env("BASE_URL", format!("http://127.0.0.1:{port}/v1"))
        .env("API_KEY", key)
        .env("WORK_DIR", dir.path())
        .envs(env.iter().copied())
        .output()
        .expect("python3");
    let text = stdout(&out);
    assert!(
        out.status.success(),
        "sdk {phase}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(text.lines().last().unwrap_or_default()).unwrap_or_else(|e| panic!("{e}: {text}"))
}

fn served(sim: &LlmSim) -> u64 {
    sim.stats()["served"].as_u64().unwrap()
}

#[test]
fn the_openai_sdk_runs_a_batch_through_the_fleet_across_a_restart_a_retry_and_a_cancel() {
    let dir = TempDir::new("batches-api");
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--latency-ms", "200"]);
    let spec = provider_spec(&dir, &sim);
    let port = free_port();
    let mut server = serve(&redis, &dir, &spec, port);
    let _worker = Running::spawn(worker_cmd_all(&redis, &sim, &["--concurrency", "4"]));

    // Upload and create; the create retried with its key is the same batch.
    let submitted = sdk("submit", port, ALICE, &dir, &[("N", "30")]);
    let batch = submitted["batch"].as_str().unwrap().to_owned();
    assert_eq!(
        submitted["again"], submitted["batch"],
        "a retried create made a second batch"
    );
    assert_eq!(submitted["conflict"], 409, "{submitted}");
    assert_eq!(submitted["file_listed"], true);

    // The serving process dies mid-batch (by its pid) and comes back.
    drop(server);
    std::thread::sleep(Duration::from_millis(500));
    server = serve(&redis, &dir, &spec, port);

    let done = sdk("wait", port, ALICE, &dir, &[("BATCH", &batch)]);
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["counts"]["total"], 30, "{done}");
    assert_eq!(done["counts"]["completed"], 30, "{done}");
    assert_eq!(done["counts"]["failed"], 0, "{done}");
    let ids: Vec<&str> = done["output_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    let unique: BTreeSet<&str> = ids.iter().copied().collect();
    let expected: BTreeSet<String> = (0..30).map(|i| format!("req-{i}")).collect();
    assert_eq!(ids.len(), 30, "each request once in the output file");
    assert_eq!(unique, expected.iter().map(String::as_str).collect());
    assert_eq!(done["shapes_ok"], true, "{done}");
    assert_eq!(done["errors"], 0);
    assert_eq!(done["listed"], true);
    // Never paid twice: one model call a request, across the restart and the retried create.
    assert_eq!(served(&sim), 30, "calls served for 30 requests");
    let status = producer(&[
        "status",
        "--job",
        &format!("oai-{batch}"),
        "--redis",
        &redis.url(),
        "--json",
    ]);
    let status: Value = serde_json::from_str(&stdout(&status)).unwrap();
    assert_eq!(status["complete"], true, "{status}");
    assert_eq!(status["done"], 30);

    // Another key sees none of it.
    let other = sdk("isolation", port, BOB, &dir, &[("BATCH", &batch)]);
    assert_eq!(other["retrieve"], 404, "{other}");
    assert_eq!(other["batches"], 0, "{other}");

    // A duplicate custom_id fails validation, naming its line; nothing is sent.
    let invalid = sdk("invalid", port, ALICE, &dir, &[]);
    assert_eq!(invalid["status"], "failed", "{invalid}");
    assert_eq!(invalid["errors"][0]["code"], "duplicate_custom_id", "{invalid}");
    assert_eq!(invalid["errors"][0]["line"], 3, "{invalid}");
    assert_eq!(served(&sim), 30);

    // Cancelled mid-way: what was answered is in the output file, the rest in
    // the error file as cancelled, each request in exactly one of them.
    let cancelled = sdk("cancel", port, ALICE, &dir, &[("N", "200")]);
    assert_eq!(cancelled["cancelling"], "cancelling", "{cancelled}");
    assert_eq!(cancelled["status"], "cancelled", "{cancelled}");
    let out: Vec<String> = serde_json::from_value(cancelled["output_ids"].clone()).unwrap();
    let err: Vec<String> = serde_json::from_value(cancelled["error_ids"].clone()).unwrap();
    assert!(out.len() >= 5 && out.len() < 200, "partial output: {}", out.len());
    assert_eq!(
        cancelled["error_codes"],
        serde_json::json!(["batch_cancelled"]),
        "{cancelled}"
    );
    let all: BTreeSet<&String> = out.iter().chain(&err).collect();
    assert_eq!(all.len(), 200, "each request in one file");
    assert_eq!(out.len() + err.len(), 200, "no request in both files");
    // Every paid answer is in the output file: nothing paid was thrown away.
    assert_eq!(served(&sim), 30 + out.len() as u64, "calls served vs answers kept");
    drop(server);
}

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
    serve_with(redis, dir, spec, port, &[])
}

fn serve_with(redis: &RedisServer, dir: &TempDir, spec: &PathBuf, port: u16, extra: &[&str]) -> Running {
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
    .args(extra)
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
    let status = job_status(&redis, &batch);
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
    let out = partial(&cancelled, 200, "batch_cancelled");
    // Every paid answer is in the output file: nothing paid was thrown away.
    assert_eq!(served(&sim), 30 + out.len() as u64, "calls served vs answers kept");
    drop(server);
}

/// A batch ended part way (cancelled, expired): its output file holds a
/// part, the error file the rest with `code`, each of the `n` requests in
/// exactly one of them. Returns the output's custom ids.
fn partial(ended: &Value, n: usize, code: &str) -> Vec<String> {
    let (out, err) = (strings(&ended["output_ids"]), strings(&ended["error_ids"]));
    assert!(out.len() >= 5 && out.len() < n, "partial output: {}", out.len());
    assert_eq!(ended["error_codes"], serde_json::json!([code]), "{ended}");
    let all: BTreeSet<&String> = out.iter().chain(&err).collect();
    assert_eq!((all.len(), out.len() + err.len()), (n, n), "each request in one file");
    out
}

fn job_status(redis: &RedisServer, batch: &str) -> Value {
    let out = producer(&[
        "status",
        "--job",
        &format!("oai-{batch}"),
        "--redis",
        &redis.url(),
        "--json",
    ]);
    serde_json::from_str(&stdout(&out)).unwrap()
}

fn strings(v: &Value) -> Vec<String> {
    serde_json::from_value(v.clone()).unwrap()
}

/// Time passes while the server is down: the batch's window ends now (its
/// record in Redis, as the server keeps it, with `expires_at` moved back).
fn end_window(redis: &RedisServer, batch: &str) {
    let mut conn = redis.conn();
    let text: String = redis::cmd("HGET")
        .arg("bf:oai:batches")
        .arg(batch)
        .query(&mut conn)
        .unwrap();
    let mut row: Value = serde_json::from_str(&text).unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    row["batch"]["expires_at"] = serde_json::json!(now - 1);
    let _: () = redis::cmd("HSET")
        .arg("bf:oai:batches")
        .arg(batch)
        .arg(row.to_string())
        .query(&mut conn)
        .unwrap();
}

#[test]
fn templates_send_the_invalid_to_the_error_file_windows_expire_uploads_are_bounded_lists_page() {
    let dir = TempDir::new("batches-api-more");
    let redis = RedisServer::start();
    // A model that misses a field of the asked format in 70% of its answers, feedback or not.
    let sim = LlmSim::start(&["--latency-ms", "100", "--faults", "missing_field=0.7", "--stubborn"]);
    let spec = provider_spec(&dir, &sim);
    let port = free_port();
    let templates = workspace().join("examples/batches/templates");
    let extra = ["--templates", templates.to_str().unwrap(), "--max-upload-mb", "1"];
    let mut server = serve_with(&redis, &dir, &spec, port, &extra);
    let _worker = Running::spawn(worker_cmd_all(&redis, &sim, &["--concurrency", "4"]));

    // An upload over --max-upload-mb is refused whole; nothing is kept.
    let big = sdk("too_large", port, ALICE, &dir, &[("BYTES", "1200000")]);
    assert_eq!(big["refused"]["status"], 413, "{big}");
    assert_eq!(big["refused"]["code"], "file_too_large", "{big}");
    assert_eq!(big["files"], serde_json::json!([]), "{big}");

    // A template validates the answers: each request is in exactly one file,
    // the valid answers in the output, the ones that stayed invalid (two
    // attempts, the template's [retry]) in the error file with their reason.
    let t = sdk("template", port, ALICE, &dir, &[("N", "24")]);
    assert_eq!(t["status"], "completed", "{t}");
    let unknown = t["unknown_template"].as_str().unwrap_or_default();
    assert!(unknown.contains("sentimnet") && unknown.contains("sentiment"), "{t}");
    let (out, err) = (strings(&t["output_ids"]), strings(&t["error_ids"]));
    // Plain chat requests: asked for the template's fields as structured output.
    let forms = sim.stats()["by_form"].clone();
    assert_eq!(
        forms["text"],
        Value::Null,
        "a template batch's request went without a format: {forms}"
    );
    assert!(forms["json_schema"].as_u64().unwrap_or(0) >= 24, "{forms}");
    assert!(
        !out.is_empty() && !err.is_empty(),
        "both kinds expected at a 70% fault rate: {t}"
    );
    let all: BTreeSet<&String> = out.iter().chain(&err).collect();
    assert_eq!((all.len(), out.len() + err.len()), (24, 24), "{t}");
    for answer in t["answers"].as_array().unwrap() {
        let sentiment = answer["sentiment"].as_str().unwrap_or_default();
        assert!(["positive", "neutral", "negative"].contains(&sentiment), "{answer}");
        assert!(answer["reason"].is_string(), "{answer}");
    }
    for e in t["errors"].as_array().unwrap() {
        // The review reason, and the first validation error with its field.
        assert_eq!(e["code"], "attempts_exhausted", "{e}");
        let message = e["message"].as_str().unwrap();
        assert!(
            message.starts_with("E_MISSING sentiment") || message.starts_with("E_MISSING reason"),
            "{e}"
        );
    }
    assert_eq!(t["counts"]["failed"], err.len(), "{t}");
    let status = job_status(&redis, t["batch"].as_str().unwrap_or_default());
    assert_eq!(
        status["review"],
        err.len(),
        "the error file's lines are the job's review entries: {status}"
    );

    // The window ends while the server is down: back up, it expires the
    // batch, keeping what was answered; the rest is `batch_expired`.
    let before = served(&sim);
    let started = sdk("started", port, ALICE, &dir, &[("N", "300")]);
    let batch = started["batch"].as_str().unwrap().to_owned();
    drop(server);
    end_window(&redis, &batch);
    server = serve_with(&redis, &dir, &spec, port, &extra);
    let expired = sdk("wait", port, ALICE, &dir, &[("BATCH", &batch)]);
    assert_eq!(expired["status"], "expired", "{expired}");
    let out = partial(&expired, 300, "batch_expired");
    let status = job_status(&redis, &batch);
    assert_eq!(status["done"], out.len(), "{status}");
    assert_eq!(served(&sim) - before, out.len() as u64, "calls served vs answers kept");

    // Lists page newest first, with limit and after, each batch once.
    let invalid = sdk("invalid", port, ALICE, &dir, &[]);
    assert_eq!(invalid["status"], "failed", "{invalid}");
    let pages = sdk("pages", port, ALICE, &dir, &[]);
    assert_eq!(pages["all"].as_array().unwrap().len(), 3, "{pages}");
    assert_eq!(pages["paged"], pages["all"], "{pages}");
    assert_eq!(pages["has_more"], serde_json::json!([true, false]), "{pages}");
    assert_eq!(pages["newest_first"], true, "{pages}");
    // Every batch ended: the polls read none of them again.
    let open: u64 = redis::cmd("SCARD").arg("bf:oai:open").query(&mut redis.conn()).unwrap();
    assert_eq!(open, 0, "ended batches are still polled");
    drop(server);
}

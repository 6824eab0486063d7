//! The worker's /metrics, /healthz and /readyz, scraped mid-job; the
//! exposition checked by the real `promtool`.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::keys;
use harness::{
    LlmSim, RedisServer, Running, TempDir, enqueue, example_spec, free_port, http_get, wait_for, worker_cmd,
    write_records,
};
use redis::Commands;

#[test]
fn metrics_scraped_mid_job_pass_promtool_and_readiness_follows_the_breaker() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[
        "--latency-ms",
        "300",
        "--faults",
        "bad_enum=0.2,server_error=0.05",
        "--seed",
        "2",
    ]);
    let dir = TempDir::new("metrics");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 400);
    enqueue(&redis, &data, "obs", &example_spec());
    let addr = format!("127.0.0.1:{}", free_port());
    let worker = Running::spawn(worker_cmd(
        &redis,
        "obs",
        &sim,
        &["--concurrency", "8", "--metrics-addr", &addr],
    ));
    let url = format!("http://{addr}");
    wait_for("metrics endpoint", Duration::from_secs(20), || {
        std::net::TcpStream::connect(&addr).is_ok()
    });
    wait_for("some committed records", Duration::from_secs(60), || {
        http_get(&url, "/metrics")
            .1
            .contains("batchfleet_records_total{job=\"obs\",outcome=\"commit\"}")
    });
    assert_eq!(http_get(&url, "/healthz").0, 200);
    wait_for("ready", Duration::from_secs(10), || http_get(&url, "/readyz").0 == 200);

    // Every kind of event shows up once the mix has produced one.
    let expected = [
        "batchfleet_records_total",
        "batchfleet_attempts_total",
        "batchfleet_validation_errors_total{code=\"E_ENUM\",field=\"label\",job=\"obs\"}",
        "batchfleet_provider_requests_total{job=\"obs\",status_class=\"5xx\"}",
        "batchfleet_model_latency_seconds_bucket{job=\"obs\",result=\"2xx\",le=\"120\"}",
        "batchfleet_rate_limit_wait_seconds_bucket",
        "batchfleet_tokens_total{job=\"obs\",kind=\"prompt\"}",
        "batchfleet_cost_usd_total{job=\"obs\"}",
        "batchfleet_in_flight_requests",
        "batchfleet_queue_lag{job=\"obs\",partition=\"0\"}",
        "batchfleet_queue_pending{job=\"obs\",partition=\"3\"}",
        "batchfleet_queue_oldest_pending_age_seconds",
        "batchfleet_queue_delayed",
        "batchfleet_review_depth",
        "batchfleet_halted{job=\"obs\"} 0",
    ];
    wait_for("every metric", Duration::from_secs(60), || {
        let text = http_get(&url, "/metrics").1;
        expected.iter().all(|name| text.contains(name))
    });
    let (status, text) = http_get(&url, "/metrics");
    assert_eq!(status, 200);
    for name in expected {
        assert!(text.contains(name), "missing {name} in:\n{text}");
    }
    // Bounded labels: no record id (64 hex digits) anywhere in the exposition.
    let hex_run = text.split(|c: char| !c.is_ascii_hexdigit()).any(|w| w.len() >= 64);
    assert!(!hex_run, "a record id leaked into a label");

    // The real promtool judges the names and the format.
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool must be installed (make test installs it)");
    promtool.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = promtool.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // An open circuit breaker makes the worker not ready, and says so.
    let _: () = redis.conn().set(keys::halt("obs"), "http_401").unwrap();
    wait_for("not ready while halted", Duration::from_secs(10), || {
        let (code, body) = http_get(&url, "/readyz");
        code == 503 && body.contains("circuit breaker")
    });
    wait_for("halted gauge", Duration::from_secs(10), || {
        http_get(&url, "/metrics")
            .1
            .contains("batchfleet_halted{job=\"obs\"} 1")
    });
    let _: () = redis.conn().del(keys::halt("obs")).unwrap();
    wait_for("ready again", Duration::from_secs(10), || {
        http_get(&url, "/readyz").0 == 200
    });
    drop(worker);
}

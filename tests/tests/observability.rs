//! The worker's /metrics, /healthz and /readyz, scraped mid-job; the
//! exposition checked by the real `promtool`.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::keys;
use harness::{
    LlmSim, RedisServer, Running, TempDir, enqueue, example_spec, free_port, http_get, producer, stderr, wait_for,
    worker_cmd, write_records,
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
    // Halted as the fleet halts a job: the flag, and a wake-up for every worker.
    let _: () = redis.conn().set(keys::halt("obs"), "http_401").unwrap();
    let _: String = redis
        .conn()
        .xadd(keys::wake(), "*", &[("j", "obs"), ("k", "flags")])
        .unwrap();
    wait_for("not ready while halted", Duration::from_secs(10), || {
        let (code, body) = http_get(&url, "/readyz");
        code == 503 && body.contains("circuit breaker")
    });
    wait_for("halted gauge", Duration::from_secs(10), || {
        http_get(&url, "/metrics")
            .1
            .contains("batchfleet_halted{job=\"obs\"} 1")
    });
    let out = producer(&["resume", "--job", "obs", "--redis", &redis.url()]);
    assert!(out.status.success(), "{}", stderr(&out));
    wait_for("ready again", Duration::from_secs(10), || {
        http_get(&url, "/readyz").0 == 200
    });
    drop(worker);
}

/// Percent-encodes a query parameter.
fn encode(q: &str) -> String {
    q.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[test]
fn every_dashboard_query_parses_and_returns_data_from_a_real_prometheus() {
    // The dashboard's queries, with Grafana's variables substituted.
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(harness::workspace().join("deploy/grafana/batchfleet.json")).unwrap(),
    )
    .unwrap();
    let exprs: Vec<String> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| {
            p["targets"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t["expr"].as_str().unwrap().to_owned())
        })
        .map(|e| e.replace("$__rate_interval", "1m").replace("$job", ".*"))
        .collect();
    assert!(exprs.len() >= 12, "{exprs:?}");
    let dir = TempDir::new("dashboard");
    let rules: String = exprs
        .iter()
        .enumerate()
        .map(|(i, e)| {
            format!(
                "      - record: dashboard:q{i}\n        expr: '{}'\n",
                e.replace('\'', "''")
            )
        })
        .collect();
    std::fs::write(
        dir.join("rules.yml"),
        format!("groups:\n  - name: dashboard\n    rules:\n{rules}"),
    )
    .unwrap();
    let out = Command::new("promtool")
        .args(["check", "rules"])
        .arg(dir.join("rules.yml"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "promtool: {}",
        String::from_utf8_lossy(&out.stdout)
    );

    // A running job with every kind of event, scraped by a real Prometheus.
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[
        "--latency-ms",
        "100",
        "--faults",
        "rate_limit=0.05,bad_enum=0.2,server_error=0.05",
    ]);
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 3000);
    // The job writes to a real PostgreSQL, so the sink panels have data too.
    let pg = harness::PgServer::start();
    let spec = harness::spec_with(&dir, &[("[retry]", &harness::sink_section("BF_DASH_DB", ""))]);
    enqueue(&redis, &data, "dash", &spec);
    let addr = format!("127.0.0.1:{}", free_port());
    let mut cmd = worker_cmd(&redis, "dash", &sim, &["--concurrency", "8", "--metrics-addr", &addr]);
    cmd.env("BF_DASH_DB", pg.url());
    let _worker = Running::spawn(cmd);
    let prom_port = free_port();
    std::fs::write(
        dir.join("prometheus.yml"),
        format!("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: worker\n    static_configs:\n      - targets: ['{addr}']\n"),
    )
    .unwrap();
    let mut prom = Command::new("prometheus");
    prom.arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("tsdb").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"));
    let _prom = Running::spawn(prom);
    let prom_url = format!("http://127.0.0.1:{prom_port}");
    wait_for("prometheus scraping the worker", Duration::from_secs(60), || {
        std::net::TcpStream::connect(("127.0.0.1", prom_port)).is_ok()
            && http_get(&prom_url, "/api/v1/targets").1.contains("\"health\":\"up\"")
    });
    let mut empty: Vec<String> = exprs.clone();
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    while !empty.is_empty() && std::time::Instant::now() < deadline {
        empty.retain(|e| {
            let (_, body) = http_get(&prom_url, &format!("/api/v1/query?query={}", encode(e)));
            let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            assert_ne!(v["status"], "error", "query failed: {e}: {body}");
            v["data"]["result"].as_array().is_none_or(|r| r.is_empty())
        });
        std::thread::sleep(Duration::from_secs(1));
    }
    assert!(empty.is_empty(), "dashboard queries returning no data: {empty:#?}");
}

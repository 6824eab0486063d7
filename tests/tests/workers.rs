//! Workers are visible: each keeps a heartbeat; `producer workers` and the
//! console's Workers page list them, a killed one dead (greyed) until its
//! entry expires, one that exits stopped; `producer status` says the
//! fleet's rate and when the remaining records should be done.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::time::Duration;

use harness::browser::{Browser, ConsoleServer};
use harness::{
    LlmSim, RedisServer, Running, TempDir, enqueue, producer, signal, spec_with, status_json, stderr, stdout, wait_for,
    worker_cmd, write_records,
};
use serde_json::Value;

const ANN: (&str, &str) = ("ann", "ann-token-0123456789abcdef");

/// `producer workers --json`: the workers by id.
fn workers(url: &str) -> Vec<Value> {
    let out = producer(&["workers", "--redis", url, "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc: Value = serde_json::from_str(&stdout(&out)).unwrap();
    doc["workers"].as_array().unwrap().clone()
}

fn worker<'a>(all: &'a [Value], id: &str) -> Option<&'a Value> {
    all.iter().find(|w| w["id"] == id)
}

#[test]
fn workers_are_listed_alive_dead_and_stopped_and_status_gives_the_rate_and_an_eta() {
    let redis = RedisServer::start();
    let url = redis.url();
    let none = producer(&["workers", "--redis", &url]);
    assert!(none.status.success());
    assert!(
        stderr(&none).contains("Start one with: worker --job NAME"),
        "{}",
        stderr(&none)
    );

    let sim = LlmSim::start(&["--latency-ms", "150"]);
    let dir = TempDir::new("workers");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 60);
    // A 3 s provider timeout: the killed worker's tasks are taken over soon.
    enqueue(
        &redis,
        &data,
        "wk",
        &spec_with(&dir, &[("timeout_secs = 30", "timeout_secs = 3")]),
    );

    // A worker that will be killed: a fast heartbeat, so it is soon dead
    // (after 3 beats, 1.5 s) and its entry stays 60 beats (30 s: longer
    // than the rest of the test takes on a loaded machine).
    let killed = Running::spawn(worker_cmd(
        &redis,
        "wk",
        &sim,
        &["--consumer", "w-killed", "--heartbeat-ms", "500", "--concurrency", "2"],
    ));
    wait_for("w-killed settles records", Duration::from_secs(30), || {
        worker(&workers(&url), "w-killed").is_some_and(|w| w["settled"].as_u64() >= Some(5))
    });
    let all = workers(&url);
    let w = worker(&all, "w-killed").unwrap();
    assert_eq!(w["state"], "alive", "{w}");
    assert_eq!(w["jobs"], serde_json::json!(["wk"]));
    assert_eq!(w["version"], env!("CARGO_PKG_VERSION"));
    assert!(!w["host"].as_str().unwrap().is_empty());
    assert!(w["rate_per_sec"].as_f64().unwrap() > 0.0, "{w}");
    assert!(w["in_flight"].as_u64().unwrap() <= 2, "{w}");
    assert!(w["started_ms"].as_u64().unwrap() <= w["seen_ms"].as_u64().unwrap());

    // Mid-run, status says how fast the fleet goes and when it should be done.
    let (_, s) = status_json(&redis, "wk");
    let remaining = s["remaining"].as_u64().unwrap();
    assert!(remaining > 0 && remaining < 60, "{s}");
    assert!(s["rate_per_sec"].as_f64().unwrap() > 0.0, "{s}");
    assert!(s["eta_secs"].as_u64().unwrap() > 0, "{s}");
    let text = stdout(&producer(&["status", "--job", "wk", "--redis", &url]));
    assert!(
        text.contains("records/s over the last minute") && text.contains("remaining, about"),
        "{text}"
    );

    signal(killed.pid(), "KILL");
    wait_for("w-killed taken for dead", Duration::from_secs(10), || {
        worker(&workers(&url), "w-killed").is_some_and(|w| w["state"] == "dead")
    });

    // Another worker finishes the job and exits: stopped.
    let (exit, log) = Running::spawn(worker_cmd(
        &redis,
        "wk",
        &sim,
        &["--consumer", "w-drain", "--drain", "--visibility-timeout-ms", "4000"],
    ))
    .finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    let all = workers(&url);
    let done = worker(&all, "w-drain").unwrap();
    assert_eq!(done["state"], "stopped", "{done}");
    assert!(done["drain_mode"].as_bool().unwrap());
    assert_eq!(worker(&all, "w-killed").unwrap()["state"], "dead");
    let text = stdout(&producer(&["workers", "--redis", &url]));
    let rows: Vec<&str> = text.lines().collect();
    assert!(rows[0].starts_with("worker") && rows[0].contains("last seen"), "{text}");
    assert!(
        rows.iter().any(|r| r.starts_with("w-killed") && r.contains(" dead ")),
        "{text}"
    );
    assert!(!text.contains('\u{1b}'), "no colour into a pipe");

    let (_, s) = status_json(&redis, "wk");
    assert_eq!(
        (s["remaining"].as_u64(), s["eta_secs"].as_u64()),
        (Some(0), Some(0)),
        "{s}"
    );

    // The console lists both, the gone ones greyed.
    let console = ConsoleServer::start(&url, &[ANN], &[]);
    let b = Browser::start();
    b.goto(&console.url("/login"));
    b.fill("#token", ANN.1);
    b.click("#sign-in");
    b.wait("signed in", Duration::from_secs(10), |b| b.find("#reviewer").is_some());
    b.click("#workers-link");
    b.wait("the Workers page", Duration::from_secs(10), |b| {
        b.find("#workers").is_some()
    });
    assert_eq!(b.text("tr[data-worker=w-killed] .state"), "dead");
    assert_eq!(b.text("tr[data-worker=w-drain] .state"), "stopped");
    let grey = |id: &str| {
        b.script(&format!(
            "return getComputedStyle(document.querySelector('tr[data-worker={id}] td')).color"
        ))
    };
    assert_eq!(grey("w-killed"), "rgb(153, 153, 153)", "greyed");
    assert_eq!(grey("w-drain"), "rgb(153, 153, 153)", "greyed");

    // Its entry expires after sixty beats (30 s at 500 ms) and it leaves the list.
    wait_for("w-killed's entry expires", Duration::from_secs(45), || {
        worker(&workers(&url), "w-killed").is_none()
    });
}

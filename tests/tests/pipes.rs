//! Logging never stalls or kills a process: each binary runs with its
//! output pipe closed early (the reader gone, as after `2>&1 | head -1`) or
//! full (a reader that never reads), finishes its work, and honours SIGTERM.
//! Lines it could not write are dropped and counted, never waited for.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use harness::{
    LlmSim, RedisServer, TempDir, bin, free_port, http_get, signal, spec_with, status_json, wait_exit, wait_for,
    worker_cmd, write_records,
};

/// Spawns `cmd` with stdout and stderr on one pipe whose reading end is
/// closed at once (`2>&1 | head -0`).
fn with_closed_output(cmd: Command) -> Child {
    let (child, reader) = with_full_output(cmd);
    drop(reader);
    child
}

/// Spawns `cmd` with stdout and stderr on one pipe nobody reads (it fills);
/// returns the child and the reading end, kept open.
fn with_full_output(mut cmd: Command) -> (Child, std::io::PipeReader) {
    let (reader, writer) = std::io::pipe().unwrap();
    let child = cmd
        .stdout(writer.try_clone().unwrap())
        .stderr(writer)
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    (child, reader)
}

fn metric(addr: &str, name: &str) -> Option<f64> {
    let (_, text) = http_get(addr, "/metrics");
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
}

#[test]
fn a_worker_whose_log_pipe_closed_finishes_its_work_and_stops_on_sigterm() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    let _dir = harness::example_job(&redis, "closed", 300);
    let addr = format!("127.0.0.1:{}", free_port());
    let mut worker = with_closed_output(worker_cmd(&redis, "closed", &sim, &["--metrics-addr", &addr]));
    wait_for("every record done", Duration::from_secs(60), || {
        status_json(&redis, "closed").1["done"] == 300
    });
    // Its lines had nowhere to go: dropped and counted, never a stall.
    let dropped = metric(&addr, "batchfleet_log_lines_dropped_total").unwrap();
    assert!(dropped >= 300.0, "{dropped} lines counted as dropped");
    let (_, s) = status_json(&redis, "closed");
    assert_eq!(s["in_flight"], 0, "nothing stuck in flight: {s}");
    signal(worker.id(), "TERM");
    let stopped = Instant::now();
    let exit = wait_exit(&mut worker, Duration::from_secs(20));
    assert!(exit.success(), "{exit:?}");
    // Idle, it stops at once (no claim round's grace to wait out).
    assert!(stopped.elapsed() < Duration::from_secs(3), "{:?}", stopped.elapsed());
}

#[test]
fn a_worker_whose_log_pipe_is_full_is_not_held_up_by_it() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    // Each record logs a line of ~300 bytes: far more than a pipe holds.
    let _dir = harness::example_job(&redis, "full", 1000);
    let (mut worker, reader) = with_full_output(worker_cmd(&redis, "full", &sim, &["--drain"]));
    let exit = wait_exit(&mut worker, Duration::from_secs(90));
    assert!(exit.success(), "{exit:?}");
    assert_eq!(status_json(&redis, "full").1["done"], 1000);
    drop(reader);
}

#[test]
fn the_producer_and_the_console_survive_closed_and_full_pipes() {
    let redis = RedisServer::start();
    let dir = TempDir::new("pipes-producer");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 2000);
    let spec = spec_with(&dir, &[]);
    let enqueue = |closed: bool| {
        let mut c = Command::new(bin("producer"));
        c.args(["enqueue", data.to_str().unwrap(), "--job", "pp", "--spec"])
            .arg(&spec)
            .args(["--redis", &redis.url()])
            .env_remove("REDIS_URL");
        if closed {
            wait_exit(&mut with_closed_output(c), Duration::from_secs(60))
        } else {
            let (mut child, reader) = with_full_output(c);
            let exit = wait_exit(&mut child, Duration::from_secs(60));
            drop(reader);
            exit
        }
    };
    // Its summary goes to a closed pipe: the records are in, it ends quietly.
    let exit = enqueue(true);
    assert!(matches!(exit.code(), Some(0 | 141)), "{exit:?}");
    assert_eq!(status_json(&redis, "pp").1["queued"], 2000);
    assert!(enqueue(false).success(), "a full pipe: the rerun adds nothing and ends");
    // A mistyped job with stderr closed: exit 2, no panic (101).
    let mut c = Command::new(bin("producer"));
    c.args(["status", "--job", "pq", "--redis", &redis.url()]);
    assert_eq!(
        wait_exit(&mut with_closed_output(c), Duration::from_secs(30)).code(),
        Some(2)
    );

    // The console logs on stderr: closed, it serves on and stops on SIGTERM.
    let port = free_port();
    let mut c = Command::new(bin("producer"));
    c.args([
        "console",
        "--redis",
        &redis.url(),
        "--bind",
        &format!("127.0.0.1:{port}"),
    ])
    .env("BATCHFLEET_CONSOLE_TOKENS", "ann:ann-token-0123456789abcdef")
    .env("RUST_LOG", "debug");
    let mut console = with_closed_output(c);
    let addr = format!("127.0.0.1:{port}");
    wait_for("the console", Duration::from_secs(30), || {
        std::net::TcpStream::connect(&addr).is_ok()
    });
    for _ in 0..200 {
        assert_eq!(http_get(&addr, "/healthz").0, 200);
    }
    signal(console.id(), "TERM");
    let exit = wait_exit(&mut console, Duration::from_secs(20));
    assert!(exit.code().is_some(), "ended by itself, not killed: {exit:?}");
}

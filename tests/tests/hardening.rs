//! Bad inputs found by an outside test, each refused or kept exactly: deep
//! nesting, big numbers, a changed spec, absurd settings, a named pipe, a
//! file that grows while it is read, duplicates after the idempotency keys
//! expired, a closed pipe, an evicting Redis.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::keys;
use harness::{
    LlmSim, RedisServer, Running, TempDir, bin, enqueue, enqueue_cmd, example_spec, producer, record_line, spec_with,
    stderr, stdout, wait_for, worker_cmd, write_records,
};
use redis::Commands;
use serde_json::Value;

fn json_summary(out: &std::process::Output) -> Value {
    serde_json::from_str(&stdout(out)).unwrap_or_else(|e| panic!("not JSON ({e}): {}{}", stdout(out), stderr(out)))
}

fn nested(depth: usize) -> String {
    format!("{}1{}", "[".repeat(depth), "]".repeat(depth))
}

#[test]
fn what_the_producer_accepts_every_tool_can_read_and_deep_nesting_is_refused_by_name() {
    let redis = RedisServer::start();
    // The model answers an object nested 126 deep for one record.
    let sim = LlmSim::start(&[]);
    let dir = TempDir::new("deep");
    let data = dir.join("d.jsonl");
    let deep_ok = format!(
        r#"{{"message_id":"ok-deep","channel":"chat","task_type":"classify","text":"x","extra":{}}}"#,
        nested(60)
    );
    let too_deep = format!(
        r#"{{"message_id":"too-deep","channel":"chat","task_type":"classify","text":"x","extra":{}}}"#,
        nested(126)
    );
    std::fs::write(
        &data,
        format!("{deep_ok}\n{too_deep}\n{}\n", record_line("plain", "hi")),
    )
    .unwrap();
    let out = enqueue_cmd(&redis, &data, "deep", &example_spec())
        .args(["--json", "--no-progress"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let s = json_summary(&out);
    assert_eq!(s["enqueued"], 2, "{s}");
    assert_eq!(s["dropped_by_reason"]["too_deep"], 1, "{s}");
    let dropped = producer(&["dropped", "--job", "deep", "--redis", &redis.url()]);
    assert!(stdout(&dropped).contains("too_deep"), "{}", stdout(&dropped));
    assert!(
        stdout(&dropped).contains("nests deeper than 64 levels"),
        "{}",
        stdout(&dropped)
    );

    // Everything accepted goes through review and back, and every tool reads it.
    let (exit, log) = Running::spawn(worker_cmd(&redis, "deep", &sim, &["--drain"])).finish(Duration::from_secs(30));
    assert!(exit.success(), "{log}");
    let ids = producer(&["status", "--job", "deep", "--json", "--redis", &redis.url()]);
    let st = json_summary(&ids);
    assert_eq!(st["done"], 2, "{st}");
    let export = producer(&["export", "--job", "deep", "--out", "-", "--redis", &redis.url()]);
    let lines: Vec<Value> = stdout(&export)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "export reads every result");
    let report = producer(&["report", "--job", "deep", "--json", "--redis", &redis.url()]);
    assert_eq!(json_summary(&report)["done"], 2);
}

#[test]
fn a_deep_model_answer_is_invalid_by_name_and_its_review_entry_readable() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--faults", "deep=1.0"]);
    let dir = TempDir::new("deep-answer");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 2);
    let spec = spec_with(
        &dir,
        &[
            ("max_attempts = 4", "max_attempts = 1"),
            ("base_delay_ms = 500", "base_delay_ms = 10"),
        ],
    );
    enqueue(&redis, &data, "deepa", &spec);
    let (exit, log) = Running::spawn(worker_cmd(&redis, "deepa", &sim, &["--drain"])).finish(Duration::from_secs(30));
    assert!(exit.success(), "{log}");
    let list = producer(&["review", "--job", "deepa", "--redis", &redis.url(), "list", "--jsonl"]);
    let entries: Vec<Value> = stdout(&list)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(entries.len(), 2, "review list shows every entry: {}", stdout(&list));
    assert!(
        entries[0]["errors"][0]["message"]
            .as_str()
            .unwrap()
            .contains("nests deeper than 64"),
        "{}",
        entries[0]
    );
    let report = producer(&["report", "--job", "deepa", "--json", "--redis", &redis.url()]);
    assert_eq!(json_summary(&report)["review_by_reason"]["attempts_exhausted"], 2);
}

#[test]
fn numbers_reach_the_model_and_the_review_queue_exactly_as_written() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--faults", "bad_enum=1.0"]);
    let dir = TempDir::new("numbers");
    let spec = spec_with(
        &dir,
        &[
            (
                "Message:\n{{text}}",
                "Message:\n{{text}}\nAmount: {{amount}} Rate: {{rate}}",
            ),
            ("max_attempts = 4", "max_attempts = 1"),
        ],
    );
    let data = dir.join("d.jsonl");
    let line = r#"{"message_id":"n1","channel":"chat","task_type":"classify","text":"t","amount":12345678901234567890123,"rate":9007199254740993.0}"#;
    std::fs::write(&data, format!("{line}\n")).unwrap();
    enqueue(&redis, &data, "num", &spec);
    let (exit, log) = Running::spawn(worker_cmd(&redis, "num", &sim, &["--drain"])).finish(Duration::from_secs(30));
    assert!(exit.success(), "{log}");
    let seen = sim.log_containing("Amount:");
    let user = seen[0]["user"].as_str().unwrap();
    assert!(
        user.contains("Amount: 12345678901234567890123 Rate: 9007199254740993.0"),
        "{user}"
    );
    let show = producer(&["review", "--job", "num", "--redis", &redis.url(), "show", "n1"]);
    let text = stdout(&show);
    assert!(
        text.contains("12345678901234567890123") && text.contains("9007199254740993.0"),
        "{text}"
    );
    let export = producer(&[
        "export",
        "--job",
        "num",
        "--what",
        "review",
        "--out",
        "-",
        "--redis",
        &redis.url(),
    ]);
    assert!(
        stdout(&export).contains(r#""amount":12345678901234567890123"#),
        "{}",
        stdout(&export)
    );
}

#[test]
fn a_changed_spec_under_the_same_job_is_refused_and_changed_only_by_spec_update() {
    let redis = RedisServer::start();
    let dir = TempDir::new("spec-change");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 5);
    enqueue(&redis, &data, "sc", &example_spec());
    let stored = |redis: &RedisServer| -> String { redis.conn().get(keys::spec("sc")).unwrap() };
    let before = stored(&redis);
    let other = spec_with(
        &dir,
        &[
            ("max_attempts = 4", "max_attempts = 100"),
            (
                "base_url = \"http://127.0.0.1:8089/v1\"",
                "base_url = \"https://elsewhere.example/v1\"",
            ),
        ],
    );
    let out = enqueue_cmd(&redis, &data, "sc", &other)
        .arg("--no-progress")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("retry.max_attempts: 4 -> 100"), "{err}");
    assert!(err.contains("provider.base_url"), "{err}");
    assert!(err.contains("producer spec update --job sc"), "{err}");
    assert_eq!(stored(&redis), before, "the stored spec is untouched");
    // Comments and layout alone are no change.
    let commented = dir.join("commented.toml");
    std::fs::write(
        &commented,
        format!("# a comment\n{}", std::fs::read_to_string(example_spec()).unwrap()),
    )
    .unwrap();
    let out = enqueue_cmd(&redis, &data, "sc", &commented)
        .arg("--no-progress")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));

    let upd = |spec: &std::path::Path| {
        producer(&[
            "spec",
            "update",
            "--job",
            "sc",
            "--spec",
            spec.to_str().unwrap(),
            "--by",
            "ops-ana",
            "--redis",
            &redis.url(),
        ])
    };
    let out = upd(&other);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("retry.max_attempts: 4 -> 100"),
        "{}",
        stdout(&out)
    );
    assert!(stored(&redis).contains("max_attempts = 100"));
    let log: std::collections::HashMap<String, String> = redis.conn().hgetall(keys::spec_changes("sc")).unwrap();
    assert_eq!(log.len(), 1);
    assert!(log.values().next().unwrap().contains("ops-ana"), "{log:?}");
    // Versions cannot change under a job.
    let versions = spec_with(&dir, &[("prompt = \"v1\"", "prompt = \"v2\"")]);
    let out = upd(&versions);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("record ids would change"), "{}", stderr(&out));
}

#[test]
fn absurd_worker_settings_are_refused_at_start() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    let dir = TempDir::new("absurd");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 2);
    enqueue(&redis, &data, "ab", &example_spec());
    let (exit, log) = Running::spawn(worker_cmd(&redis, "ab", &sim, &["--drain", "--max-deliveries", "0"]))
        .finish(Duration::from_secs(20));
    assert_eq!(exit.code(), Some(2), "{log}");
    assert!(log.contains("--max-deliveries must be at least 1"), "{log}");
    let bad = spec_with(&dir, &[("max_delay_ms = 30000", "max_delay_ms = 9223372036854775807")]);
    let out = producer(&["spec", "check", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("retry.max_delay_ms"), "{}", stderr(&out));
}

#[test]
fn a_named_pipe_is_refused_before_anything_is_written() {
    let redis = RedisServer::start();
    let dir = TempDir::new("fifo");
    let fifo = dir.join("d.jsonl");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let mut child = enqueue_cmd(&redis, &fifo, "fifo", &example_spec())
        .arg("--no-progress")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = harness::wait_exit(&mut child, Duration::from_secs(10));
    let out = child.wait_with_output().unwrap();
    assert_eq!(status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("is not a regular file (a named pipe)"),
        "{}",
        stderr(&out)
    );
    let keys: Vec<String> = redis.conn().keys("bf:*fifo*").unwrap();
    assert!(keys.is_empty(), "nothing may be written: {keys:?}");
}

#[test]
fn a_file_that_grows_while_it_is_enqueued_is_enqueued_as_hashed_and_said_so() {
    let redis = RedisServer::start();
    let dir = TempDir::new("grow");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 20_000);
    let (sha_before, bytes_before) = {
        let bytes = std::fs::read(&data).unwrap();
        (
            hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&bytes)),
            bytes.len() as u64,
        )
    };
    let child = enqueue_cmd(&redis, &data, "grow", &example_spec())
        .args(["--json", "--no-progress", "--batch-size", "200"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Once the first batch is confirmed, the file grows by 300 lines.
    wait_for("the first batch", Duration::from_secs(30), || {
        redis.conn().exists::<_, bool>(keys::cursor("grow")).unwrap_or(false)
    });
    harness::signal(child.id(), "STOP");
    {
        let mut f = std::fs::OpenOptions::new().append(true).open(&data).unwrap();
        for i in 20_000..20_300 {
            writeln!(f, "{}", record_line(&format!("msg-{i}"), "late")).unwrap();
        }
    }
    harness::signal(child.id(), "CONT");
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("warning: the dataset grew from"),
        "{}",
        stderr(&out)
    );
    let summary = json_summary(&out);
    assert_eq!(summary["enqueued"], 20_000, "only what was hashed: {summary}");
    assert_eq!(summary["dataset_changed"]["grew"], true, "{summary}");
    let manifest = producer(&["manifest", "--job", "grow", "--redis", &redis.url()]);
    let m: Value = serde_json::from_str(&stdout(&manifest)).unwrap();
    assert_eq!(m["expected_records"], 20_000, "{m}");
    assert_eq!(m["datasets"][0]["dataset"]["sha256"], sha_before, "{m}");
    assert_eq!(m["datasets"][0]["dataset"]["bytes"], bytes_before, "{m}");
}

#[test]
fn a_duplicate_id_is_reported_after_the_idempotency_keys_expired() {
    let redis = RedisServer::start();
    let dir = TempDir::new("dup-ttl");
    let data = dir.join("d.jsonl");
    let mut text = String::new();
    for i in 0..30 {
        text.push_str(&record_line(&format!("m{i}"), "x"));
        text.push('\n');
    }
    text.push_str(&record_line("m3", "the same id again"));
    text.push('\n');
    std::fs::write(&data, text).unwrap();
    let run = || {
        let out = enqueue_cmd(&redis, &data, "dupttl", &example_spec())
            .args(["--json", "--no-progress"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
        json_summary(&out)
    };
    let first = run();
    assert_eq!(first["dropped_by_reason"]["duplicate_id"], 1, "{first}");
    // Every idempotency key expires (as after --idem-ttl).
    let mut c = redis.conn();
    let idem: Vec<String> = c.keys("bf:{dupttl:p*}:idem:*").unwrap();
    assert_eq!(idem.len(), 30);
    let _: () = c.del(&idem).unwrap();
    let again = run();
    assert_eq!(
        again["dropped_by_reason"]["duplicate_id"], 1,
        "still a duplicate: {again}"
    );
    assert_eq!(again["already_present"], 30, "{again}");
    assert_eq!(again["enqueued"], 0, "{again}");
}

#[test]
fn every_command_survives_a_closed_pipe() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--faults", "bad_enum=1.0"]);
    let dir = TempDir::new("pipe");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 40);
    let spec = spec_with(&dir, &[("max_attempts = 4", "max_attempts = 1")]);
    enqueue(&redis, &data, "pipe", &spec);
    let (exit, log) = Running::spawn(worker_cmd(&redis, "pipe", &sim, &["--drain"])).finish(Duration::from_secs(30));
    assert!(exit.success(), "{log}");
    let url = redis.url();
    for args in [
        vec!["status", "--job", "pipe", "--redis", &url],
        vec!["report", "--job", "pipe", "--redis", &url],
        vec!["review", "--job", "pipe", "--redis", &url, "list"],
        vec!["review", "--job", "pipe", "--redis", &url, "list", "--jsonl"],
        vec![
            "export", "--job", "pipe", "--what", "review", "--out", "-", "--redis", &url,
        ],
        vec!["dropped", "--job", "pipe", "--redis", &url],
    ] {
        // The reader reads nothing and goes away at once (`| true`).
        let mut child = Command::new(bin("producer"))
            .args(&args)
            .env_remove("REDIS_URL")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let err = stderr(&out);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_ne!(out.status.code(), Some(101), "{args:?}: {err}");
        assert!(err.trim().is_empty() || !err.contains("Broken pipe"), "{args:?}: {err}");
    }
}

#[test]
fn the_producer_refuses_a_redis_that_can_evict() {
    let redis = RedisServer::start_with(&["--save", "", "--appendonly", "no", "--maxmemory-policy", "allkeys-lru"]);
    let dir = TempDir::new("evict");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 3);
    let out = enqueue_cmd(&redis, &data, "ev", &example_spec())
        .arg("--no-progress")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("maxmemory-policy is `allkeys-lru`"),
        "{}",
        stderr(&out)
    );
    let keys: Vec<String> = redis.conn().keys("bf:*").unwrap();
    assert!(
        keys.iter().all(|k| k.starts_with("bf:{probe}")),
        "nothing written: {keys:?}"
    );
}

//! A person's mistakes stop early with a way out: a mistyped job name
//! (`producer`, `worker`), a worker started before its job, a template
//! placeholder no record has; a Redis given as `host:port`. Each message
//! names what is wrong and what exists, and every command it suggests works
//! when typed as written.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::time::Duration;

use harness::{
    LlmSim, RedisServer, Running, TEST_REDIS_PASSWORD, TempDir, producer, signal, spec_with, status_json, stderr,
    typed, wait_for, worker_cmd, worker_cmd_all, write_records,
};

/// The command a message suggests after `marker`, up to the end of its line.
fn suggested<'a>(text: &'a str, marker: &str) -> &'a str {
    text.split(marker)
        .nth(1)
        .and_then(|rest| rest.lines().next())
        .unwrap_or_else(|| panic!("{marker:?} in {text}"))
        .trim()
}

#[test]
fn a_mistyped_job_name_fails_naming_the_redis_and_the_jobs_that_exist() {
    let redis = RedisServer::start();
    let _a = harness::example_job(&redis, "orders-2026", 3);
    let _b = harness::example_job(&redis, "reviews", 3);
    let url = redis.url();
    for command in [
        &["status", "--job", "orders-2062", "--redis", &url][..],
        &["report", "--job", "orders-2062", "--redis", &url],
        &["export", "--job", "orders-2062", "--out", "/dev/null", "--redis", &url],
        &["resume", "--job", "orders-2062", "--redis", &url],
        &["review", "--job", "orders-2062", "--redis", &url, "list"],
    ] {
        let out = producer(command);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{command:?}: {err}");
        assert!(
            err.contains("no job `orders-2062` in the Redis at redis://batchfleet:***@127.0.0.1:"),
            "{err}"
        );
        assert!(err.contains("(its jobs: orders-2026, reviews)"), "{err}");
        assert!(err.contains("Did you mean `orders-2026`?"), "{err}");
        assert!(!err.contains(TEST_REDIS_PASSWORD), "{err}");
    }
    // What it suggests works as typed (the password stays in the variable).
    let out = producer(&["status", "--job", "orders-2062", "--json", "--redis", &redis.url()]);
    let err = stderr(&out);
    let fix = suggested(&err, "Try: ");
    assert_eq!(fix, "producer status --job orders-2026 --json --redis \"$REDIS_URL\"");
    let out = typed(fix, &[("REDIS_URL", &redis.url())]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["done"],
        0
    );
}

#[test]
fn a_worker_started_before_its_job_waits_for_it_and_with_drain_refuses() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    let (exit, log) = Running::spawn(worker_cmd(&redis, "later", &sim, &["--drain"])).finish(Duration::from_secs(30));
    assert_eq!(exit.code(), Some(2), "{log}");
    assert!(
        log.contains("job `later` does not exist in the Redis at redis://batchfleet:***@"),
        "{log}"
    );
    assert!(log.contains("producer enqueue DATASET.jsonl --job later"), "{log}");
    assert!(!log.contains(TEST_REDIS_PASSWORD), "{log}");

    // Without --drain it says so once and waits; the job comes; it runs it.
    let worker = Running::spawn(worker_cmd(&redis, "later", &sim, &[]));
    std::thread::sleep(Duration::from_secs(3));
    let _dir = harness::example_job(&redis, "later", 20);
    wait_for("the job done", Duration::from_secs(30), || {
        status_json(&redis, "later").1["done"] == 20
    });
    signal(worker.pid(), "TERM");
    let (exit, log) = worker.finish(Duration::from_secs(30));
    assert!(exit.success(), "{log}");
    let said = log
        .lines()
        .filter(|l| l.contains("does not exist") && l.contains("\"level\":\"WARN\""))
        .count();
    assert_eq!(said, 1, "said once, not per poll: {log}");

    // Without --job: it says it serves every job.
    let (exit, log) = Running::spawn(worker_cmd_all(&redis, &sim, &["--drain"])).finish(Duration::from_secs(30));
    assert!(exit.success(), "{log}");
    assert!(log.contains("serving every job in Redis"), "{log}");
    assert!(log.contains("\"jobs\":\"later\""), "{log}");
}

#[test]
fn a_placeholder_no_record_has_stops_before_anything_is_enqueued_and_the_fix_works_as_typed() {
    let redis = RedisServer::start();
    let dir = TempDir::new("typo");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 50);
    // The records have `text`; the template asks for `{{txt}}`.
    let spec = spec_with(&dir, &[("{{text}}", "{{ txt }}")]);
    let (spec_s, data_s) = (spec.to_str().unwrap(), data.to_str().unwrap());

    let check = producer(&["spec", "check", spec_s, "--data", data_s]);
    assert_eq!(check.status.code(), Some(2), "{}", stderr(&check));
    assert!(
        stderr(&check).contains("error: placeholder {{txt}} is missing (or empty) in 50 of 50 records sampled"),
        "{}",
        stderr(&check)
    );

    let out = producer(&[
        "enqueue",
        data_s,
        "--job",
        "typo",
        "--spec",
        spec_s,
        "--redis",
        &redis.url(),
    ]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("the placeholder {{txt}} is missing (or empty) in 50 of the first 50 records"),
        "{err}"
    );
    assert!(err.contains("they have: channel, message_id, task_type, text"), "{err}");
    assert!(err.contains("Did you mean {{text}}?"), "{err}");
    // Nothing reached Redis.
    let keys: Vec<String> = redis::Commands::keys(&mut redis.conn(), "bf:*typo*").unwrap();
    assert!(keys.is_empty(), "{keys:?}");

    // Each suggested command, typed as written, in order.
    let fixes: Vec<&str> = err
        .lines()
        .skip_while(|l| !l.contains("Fix the spec"))
        .skip(1)
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    assert_eq!(fixes.len(), 3, "sed, spec check, enqueue: {err}");
    for fix in fixes {
        let out = typed(fix, &[("REDIS_URL", &redis.url())]);
        assert!(out.status.success(), "{fix}: {}", stderr(&out));
    }
    let (_, s) = status_json(&redis, "typo");
    assert_eq!(
        (s["queued"].as_u64(), s["dropped"].as_u64()),
        (Some(50), Some(0)),
        "{s}"
    );
}

/// `--redis host:port`, as people type it, is a plain `redis://` server for
/// every command: enqueue, the worker, status (here with the ACL user's
/// credentials in front, still without a scheme).
#[test]
fn a_redis_given_as_host_and_port_is_a_plain_redis_url() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    let bare = redis.url().trim_start_matches("redis://").to_owned();
    assert!(!bare.contains("://"));
    let dir = TempDir::new("bare-redis");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 10);
    let spec = spec_with(&dir, &[]);
    let enqueued = producer(&[
        "enqueue",
        data.to_str().unwrap(),
        "--job",
        "bare",
        "--spec",
        spec.to_str().unwrap(),
        "--redis",
        &bare,
        "--no-progress",
    ]);
    assert!(enqueued.status.success(), "{}", stderr(&enqueued));
    let worker = harness::worker_cmd_url(&bare, "bare", &sim, &["--drain"]);
    let (exit, log) = Running::spawn(worker).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    let status = producer(&["status", "--job", "bare", "--redis", &bare, "--require-done"]);
    assert!(status.status.success(), "{}", stderr(&status));
    assert!(!stderr(&status).contains(TEST_REDIS_PASSWORD));
}

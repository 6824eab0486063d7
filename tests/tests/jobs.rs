//! Deleting a job: after a confirmation (`--yes`, or its name typed at a
//! terminal), refused while workers hold its tasks unless `--force`, every
//! key of the job gone from Redis (counted), the other jobs' keys and the
//! sink's rows untouched. Real Redis, llm-sim and workers.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use harness::{
    LlmSim, RedisServer, Running, TEST_REDIS_PASSWORD, TempDir, enqueue, producer, spec_with, status_json, stderr,
    stdout, worker_cmd, worker_cmd_all, write_records,
};
use redis::Commands;

/// Every key of the Redis (one server: KEYS is fine in a test).
fn all_keys(redis: &RedisServer) -> Vec<String> {
    let mut keys: Vec<String> = redis.conn().keys("*").unwrap();
    keys.sort();
    keys
}

fn keys_of<'a>(keys: &'a [String], job: &str) -> Vec<&'a String> {
    let (whole, part) = (format!("{{{job}}}"), format!("{{{job}:p"));
    keys.iter()
        .filter(|k| k.contains(&whole) || k.contains(&part))
        .collect()
}

/// Lines of every file under `dir`, recursively.
fn lines_under(dir: &Path) -> usize {
    let mut n = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            n += lines_under(&path);
        } else if path.extension().is_some_and(|e| e == "jsonl") {
            n += std::fs::read_to_string(&path).unwrap().lines().count();
        }
    }
    n
}

/// The command a refusal tells people to type (after `what`), run as
/// written by a shell with the Redis URL in `REDIS_URL` (a refusal never
/// writes a password: it writes `--redis "$REDIS_URL"`).
fn run_suggested(refusal: &str, what: &str, redis: &RedisServer) -> std::process::Output {
    let line = refusal
        .split(what)
        .nth(1)
        .unwrap_or_else(|| panic!("{what} in {refusal}"));
    let command = line.lines().next().unwrap().trim();
    assert!(command.starts_with("producer "), "{refusal}");
    harness::typed(command, &[("REDIS_URL", &redis.url())])
}

#[test]
fn a_deleted_job_leaves_no_key_and_the_others_and_the_sink_rows_stay() {
    let redis = RedisServer::start();
    let url = redis.url();
    let sim = LlmSim::start(&["--faults", "bad_enum=0.2", "--seed", "3"]);
    let (keep_dir, gone_dir) = (TempDir::new("jobs-keep"), TempDir::new("jobs-gone"));
    let out = gone_dir.join("sink");
    let data = keep_dir.join("d.jsonl");
    write_records(&data, 0, 120);
    let one_try = ("max_attempts = 4", "max_attempts = 1");
    enqueue(&redis, &data, "keep", &spec_with(&keep_dir, &[one_try]));
    let files = format!(
        "[sink]\nkind = \"files\"\ndir = \"{}\"\nsegment_secs = 1\n\n[budget]\nmax_cost_usd = 5.0\n\n[retry]",
        out.display()
    );
    enqueue(
        &redis,
        &data,
        "gone",
        &spec_with(&gone_dir, &[one_try, ("[retry]", &files)]),
    );
    let (exit, log) = Running::spawn(worker_cmd_all(&redis, &sim, &["--drain"])).finish(Duration::from_secs(90));
    assert!(exit.success(), "{log}");
    // A reviewer acted on one entry of each job (the archive of actions is a key too).
    for job in ["keep", "gone"] {
        let list = producer(&["review", "--job", job, "--redis", &url, "list", "--jsonl"]);
        let entry = stdout(&list).lines().next().map(str::to_owned);
        let entry = entry.unwrap_or_else(|| panic!("no review entry in {job}: {}", stderr(&list)));
        let first: serde_json::Value = serde_json::from_str(&entry).unwrap();
        let id = first["record_id"].as_str().unwrap();
        let rejected = producer(&[
            "review", "--job", job, "--redis", &url, "reject", id, "--reason", "test",
        ]);
        assert!(rejected.status.success(), "{}", stderr(&rejected));
    }
    let rows = lines_under(&out);
    assert!(rows > 0, "the files sink holds the job's rows");
    let before = all_keys(&redis);
    let keep_before: Vec<String> = keys_of(&before, "keep").into_iter().cloned().collect();
    assert!(!keys_of(&before, "gone").is_empty());

    // Without --yes and without a terminal: nothing deleted, and the way to confirm.
    let asked = std::process::Command::new(harness::bin("producer"))
        .args(["delete", "--job", "gone", "--redis", &url])
        .env_remove("REDIS_URL")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(asked.status.code(), Some(2), "{}", stderr(&asked));
    assert_eq!(all_keys(&redis), before, "nothing deleted before the confirmation");
    let refusal = stderr(&asked);
    assert!(!refusal.contains(TEST_REDIS_PASSWORD), "{refusal}");
    let deleted = run_suggested(&refusal, "or add --yes:", &redis);
    assert!(deleted.status.success(), "{}", stderr(&deleted));
    assert!(stdout(&deleted).contains("job gone deleted"), "{}", stdout(&deleted));

    let after = all_keys(&redis);
    assert_eq!(
        keys_of(&after, "gone"),
        Vec::<&String>::new(),
        "no key of the deleted job is left"
    );
    let jobs: Vec<String> = redis.conn().smembers(common::keys::jobs()).unwrap();
    assert_eq!(jobs, ["keep"]);
    let keep_after: Vec<String> = keys_of(&after, "keep").into_iter().cloned().collect();
    assert_eq!(keep_after, keep_before, "the other job's keys are untouched");
    assert_eq!(lines_under(&out), rows, "the sink's rows are kept");
    let (_, s) = status_json(&redis, "keep");
    assert_eq!(s["complete"], true, "{s}");
    // The job is gone for every command: a mistyped-name refusal names the job left.
    let status = producer(&["status", "--job", "gone", "--redis", &url]);
    assert_eq!(status.status.code(), Some(2));
    assert!(stderr(&status).contains("its jobs: keep"), "{}", stderr(&status));
}

#[test]
fn a_job_whose_tasks_workers_hold_is_deleted_only_with_force() {
    let redis = RedisServer::start();
    let url = redis.url();
    let sim = LlmSim::start(&["--latency-ms", "30000"]);
    let dir = TempDir::new("jobs-busy");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 20);
    enqueue(&redis, &data, "busy", &spec_with(&dir, &[]));
    let worker = Running::spawn(worker_cmd(&redis, "busy", &sim, &["--concurrency", "4"]));
    harness::wait_for("tasks in flight", Duration::from_secs(20), || {
        status_json(&redis, "busy").1["in_flight"].as_u64().unwrap_or(0) > 0
    });
    let refused = producer(&["delete", "--job", "busy", "--yes", "--redis", &url]);
    assert_eq!(refused.status.code(), Some(2), "{}", stderr(&refused));
    let refusal = stderr(&refused);
    assert!(refusal.contains("held by workers"), "{refusal}");
    assert!(!keys_of(&all_keys(&redis), "busy").is_empty(), "nothing deleted");
    // The worker is killed (its lease still holds for a while): --force,
    // typed as the refusal wrote it, deletes all the same.
    drop(worker);
    let forced = run_suggested(&refusal, "or delete anyway with:", &redis);
    assert!(forced.status.success(), "{}", stderr(&forced));
    assert_eq!(keys_of(&all_keys(&redis), "busy"), Vec::<&String>::new());
}

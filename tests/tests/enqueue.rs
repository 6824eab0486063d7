//! `producer enqueue` against a real redis-server: idempotency, resumption
//! after kill -9, every bad-line class, refusals, samples.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::keys;
use common::record::partition_of;
use harness::{RedisServer, TempDir, enqueue_cmd, example_spec, producer, record_line, stderr, stdout, write_records};
use redis::Commands;
use serde_json::Value;

const PARTITIONS: u32 = 4;

fn enqueue_json(redis: &RedisServer, dataset: &Path, job: &str, extra: &[&str]) -> Value {
    let spec = example_spec();
    let mut args = vec![
        "enqueue",
        dataset.to_str().unwrap(),
        "--job",
        job,
        "--spec",
        spec.to_str().unwrap(),
        "--json",
    ];
    let url = redis.url();
    args.extend(["--redis", &url]);
    args.extend(extra);
    let out = producer(&args);
    assert!(
        out.status.success(),
        "enqueue failed: {}\n{}",
        stderr(&out),
        stdout(&out)
    );
    serde_json::from_str(&stdout(&out)).unwrap_or_else(|e| panic!("summary is not JSON ({e}): {}", stdout(&out)))
}

/// Every task in the job's streams: (partition, record id, business key, input).
fn tasks(redis: &RedisServer, job: &str) -> Vec<(u32, String, String, String)> {
    let mut c = redis.conn();
    let mut out = Vec::new();
    for p in 0..PARTITIONS {
        let reply: redis::streams::StreamRangeReply = c.xrange_all(keys::stream(job, p)).unwrap();
        for entry in reply.ids {
            let field = |k: &str| -> String { entry.get(k).unwrap_or_default() };
            // The entry carries the encoded task; its input is embedded as enqueued.
            let input = common::task::Task::decode(&field("task"))
                .map(|t| t.input.get().to_owned())
                .unwrap_or_default();
            let key = serde_json::from_str::<Value>(&input).unwrap()["message_id"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            out.push((p, field("rid"), key, input));
        }
    }
    out
}

fn state_count(redis: &RedisServer, job: &str) -> u64 {
    let mut c = redis.conn();
    (0..PARTITIONS)
        .map(|p| c.hlen::<_, u64>(keys::state(job, p)).unwrap())
        .sum()
}

fn assert_unique(tasks: &[(u32, String, String, String)]) {
    let ids: HashSet<&String> = tasks.iter().map(|t| &t.1).collect();
    assert_eq!(ids.len(), tasks.len(), "a record id is in the streams twice");
}

#[test]
fn enqueue_twice_adds_nothing_the_second_time() {
    let redis = RedisServer::start();
    let dataset = harness::workspace().join("examples/dataset.jsonl");
    let first = enqueue_json(&redis, &dataset, "idem", &[]);
    assert_eq!(first["enqueued"], 1200);
    assert_eq!(first["already_present"], 0);
    assert_eq!(first["dropped"], 5);
    assert_eq!(first["lines"], 1206);
    assert_eq!(first["records"], 1201, "1200 tasks + 1 record dropped for its template");
    let t = tasks(&redis, "idem");
    assert_eq!(t.len(), 1200);
    assert_unique(&t);
    for (p, rid, _, _) in &t {
        assert_eq!(partition_of(rid, PARTITIONS), *p, "task in the wrong partition");
    }
    let partitions_used: HashSet<u32> = t.iter().map(|t| t.0).collect();
    assert_eq!(partitions_used.len(), PARTITIONS as usize);

    let second = enqueue_json(&redis, &dataset, "idem", &[]);
    assert_eq!(second["enqueued"], 0);
    assert_eq!(second["already_present"], 1200);
    assert_eq!(second["dropped"], 5);
    assert_eq!(tasks(&redis, "idem").len(), 1200);
    assert_eq!(state_count(&redis, "idem"), 1201);
    let manifest: Value = serde_json::from_str(&stdout(&producer(&[
        "manifest",
        "--job",
        "idem",
        "--redis",
        &redis.url(),
    ])))
    .unwrap();
    assert_eq!(manifest["expected_records"], 1201);
    assert_eq!(manifest["dropped_lines"], 5);
    assert_eq!(manifest["datasets"].as_array().unwrap().len(), 1);
}

#[test]
fn overlapping_files_share_their_records() {
    let redis = RedisServer::start();
    let dir = TempDir::new("overlap");
    let (a, b) = (dir.join("a.jsonl"), dir.join("b.jsonl"));
    write_records(&a, 0, 600);
    write_records(&b, 300, 600);
    enqueue_json(&redis, &a, "ov", &[]);

    // Another file under the same job is refused unless asked for.
    let url = redis.url();
    let refused = producer(&[
        "enqueue",
        b.to_str().unwrap(),
        "--job",
        "ov",
        "--spec",
        example_spec().to_str().unwrap(),
        "--redis",
        &url,
    ]);
    assert_eq!(refused.status.code(), Some(2));
    assert!(
        stderr(&refused).contains("--restart") && stderr(&refused).contains("different"),
        "{}",
        stderr(&refused)
    );
    assert_eq!(tasks(&redis, "ov").len(), 600, "a refused run must add nothing");

    let added = enqueue_json(&redis, &b, "ov", &["--restart"]);
    assert_eq!(added["enqueued"], 300);
    assert_eq!(added["already_present"], 300);
    assert_eq!(added["dropped"], 0, "records from another dataset are not duplicates");
    let t = tasks(&redis, "ov");
    assert_eq!(t.len(), 900);
    assert_unique(&t);
    let manifest: Value =
        serde_json::from_str(&stdout(&producer(&["manifest", "--job", "ov", "--redis", &url]))).unwrap();
    assert_eq!(manifest["expected_records"], 900);
    assert_eq!(manifest["datasets"].as_array().unwrap().len(), 2);
}

#[test]
fn kill_9_mid_file_then_rerun_enqueues_each_record_exactly_once() {
    let redis = RedisServer::start();
    let dir = TempDir::new("kill");
    let dataset = dir.join("big.jsonl");
    let n = 60_000;
    write_records(&dataset, 0, n);
    let mut child = enqueue_cmd(&redis, &dataset, "k9", &example_spec())
        .args(["--batch-size", "200", "--no-progress"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Wait until at least one batch is confirmed, then kill -9 by pid.
    let mut c = redis.conn();
    let deadline = Instant::now() + Duration::from_secs(60);
    let killed_at = loop {
        let cursor: Option<String> = c.get(keys::cursor("k9")).unwrap();
        let line = cursor
            .map(|t| serde_json::from_str::<Value>(&t).unwrap()["line"].as_u64().unwrap())
            .unwrap_or(0);
        if line > 0 {
            child.kill().unwrap(); // SIGKILL
            break line;
        }
        assert!(Instant::now() < deadline, "producer never saved a cursor");
        std::thread::sleep(Duration::from_millis(5));
    };
    child.wait().unwrap();
    assert!(
        killed_at < n,
        "the producer finished before it could be killed; make the dataset bigger"
    );
    let partial = tasks(&redis, "k9").len() as u64;
    assert!(partial < n, "kill came too late to test a resume ({partial} tasks)");

    let resumed = enqueue_json(&redis, &dataset, "k9", &["--batch-size", "200"]);
    assert!(resumed["resumed_from_line"].as_u64().unwrap() >= killed_at);
    assert_eq!(resumed["complete"], true);
    assert_eq!(resumed["dropped"], 0, "a crash replay is not a duplicate: {resumed}");
    assert_eq!(
        resumed["enqueued"].as_u64().unwrap() + resumed["already_present"].as_u64().unwrap(),
        n,
        "every line counted exactly once: {resumed}"
    );
    let t = tasks(&redis, "k9");
    assert_eq!(t.len() as u64, n);
    assert_unique(&t);
    let keys_seen: HashSet<&String> = t.iter().map(|t| &t.2).collect();
    assert_eq!(keys_seen.len() as u64, n);
    assert_eq!(state_count(&redis, "k9"), n);
}

#[test]
fn sigterm_stops_cleanly_and_the_rerun_resumes() {
    let redis = RedisServer::start();
    let dir = TempDir::new("term");
    let dataset = dir.join("big.jsonl");
    let n = 60_000;
    write_records(&dataset, 0, n);
    let child = enqueue_cmd(&redis, &dataset, "t1", &example_spec())
        .args(["--batch-size", "200", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut c = redis.conn();
    let deadline = Instant::now() + Duration::from_secs(60);
    while c.get::<_, Option<String>>(keys::cursor("t1")).unwrap().is_none() {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    let pid = child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(130),
        "interrupted exit code; stderr: {}",
        stderr(&out)
    );
    let summary: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(summary["interrupted"], true);
    let stopped_at = summary["lines"].as_u64().unwrap();
    assert_eq!(
        tasks(&redis, "t1").len() as u64,
        stopped_at,
        "a clean stop confirms exactly what it counted"
    );

    let resumed = enqueue_json(&redis, &dataset, "t1", &[]);
    assert_eq!(resumed["resumed_from_line"].as_u64().unwrap(), stopped_at);
    assert_eq!(resumed["enqueued"].as_u64().unwrap(), n, "{resumed}");
    assert_eq!(resumed["already_present"], 0);
    assert_eq!(tasks(&redis, "t1").len() as u64, n);
}

#[test]
fn every_bad_line_is_dropped_with_its_line_number_and_reason() {
    let redis = RedisServer::start();
    let dir = TempDir::new("bad");
    let path = dir.join("bad.jsonl");
    let mut f = std::fs::File::create(&path).unwrap();
    let big = record_line("big", &"x".repeat(20_000));
    let lines: Vec<Vec<u8>> = vec![
        [b"\xEF\xBB\xBF".as_slice(), record_line("r1", "with a BOM").as_bytes()].concat(), // 1 ok (BOM)
        format!("{}\r", record_line("r2", "crlf")).into_bytes(),                           // 2 ok (CRLF)
        b"".to_vec(),                                                                      // 3 blank
        b"{\"message_id\": \"r3\", ".to_vec(),                                             // 4 malformed_json
        b"[1, 2, 3]".to_vec(),                                                             // 5 not_object
        br#"{"channel": "chat", "task_type": "classify", "text": "x"}"#.to_vec(),          // 6 missing_id
        br#"{"message_id": "", "channel": "chat", "task_type": "classify", "text": "x"}"#.to_vec(), // 7 empty_id
        br#"{"message_id": {"a": 1}, "text": "x"}"#.to_vec(),                              // 8 invalid_id
        record_line("r1", "again").into_bytes(),                                           // 9 duplicate_id of 1
        br#"{"message_id": "r4", "channel": "chat", "task_type": "classify"}"#.to_vec(),   // 10 template_missing:text
        big.into_bytes(),                                                                  // 11 too_large
        b"{\"message_id\": \"r5\", \"text\": \"\xff\xfe\"}".to_vec(),                      // 12 invalid_utf8
        b"   \t".to_vec(),                                                                 // 13 blank
        record_line("r6", "last line, no newline").into_bytes(),                           // 14 ok
    ];
    for (i, l) in lines.iter().enumerate() {
        f.write_all(l).unwrap();
        if i + 1 < lines.len() {
            f.write_all(b"\n").unwrap();
        }
    }
    drop(f);
    let s = enqueue_json(&redis, &path, "bad", &[]);
    assert_eq!(s["lines"], 14);
    assert_eq!(s["blank_lines"], 2);
    assert_eq!(s["enqueued"], 3);
    assert_eq!(s["dropped"], 9);
    let want: BTreeMap<u64, &str> = BTreeMap::from([
        (4, "malformed_json"),
        (5, "not_object"),
        (6, "missing_id"),
        (7, "empty_id"),
        (8, "invalid_id"),
        (9, "duplicate_id"),
        (10, "template_missing:text"),
        (11, "too_large"),
        (12, "invalid_utf8"),
    ]);
    let listed = producer(&["dropped", "--job", "bad", "--redis", &redis.url(), "--jsonl"]);
    let got: BTreeMap<u64, String> = stdout(&listed)
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (v["line"].as_u64().unwrap(), v["reason"].as_str().unwrap().to_owned())
        })
        .collect();
    assert_eq!(
        got,
        want.iter()
            .map(|(k, v)| (*k, (*v).to_owned()))
            .collect::<BTreeMap<_, _>>()
    );
    for (reason, n) in s["dropped_by_reason"].as_object().unwrap() {
        assert_eq!(n, 1, "{reason}");
    }
    assert!(stdout(&listed).contains("same id as line 1"));
    // The template-dropped record is a record: in the dropped state, never a task.
    let keys_in_streams: HashSet<String> = tasks(&redis, "bad").into_iter().map(|t| t.2).collect();
    assert_eq!(
        keys_in_streams,
        HashSet::from(["r1".to_owned(), "r2".to_owned(), "r6".to_owned()])
    );
    assert_eq!(state_count(&redis, "bad"), 4);
}

#[test]
fn a_changed_file_or_spec_under_the_same_job_is_refused() {
    let redis = RedisServer::start();
    let dir = TempDir::new("changed");
    let path = dir.join("d.jsonl");
    write_records(&path, 0, 100);
    enqueue_json(&redis, &path, "ch", &[]);
    write_records(&path, 0, 101);
    let url = redis.url();
    let spec = example_spec();
    let out = producer(&[
        "enqueue",
        path.to_str().unwrap(),
        "--job",
        "ch",
        "--spec",
        spec.to_str().unwrap(),
        "--redis",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("is different"), "{}", stderr(&out));

    let spec2 = dir.join("job2.toml");
    std::fs::write(
        &spec2,
        std::fs::read_to_string(&spec)
            .unwrap()
            .replace("prompt = \"v1\"", "prompt = \"v2\""),
    )
    .unwrap();
    for extra in [&[][..], &["--restart"][..]] {
        let mut args = vec![
            "enqueue",
            path.to_str().unwrap(),
            "--job",
            "ch",
            "--spec",
            spec2.to_str().unwrap(),
            "--redis",
            &url,
        ];
        args.extend(extra);
        let out = producer(&args);
        assert_eq!(out.status.code(), Some(2));
        assert!(stderr(&out).contains("new --job name"), "{}", stderr(&out));
    }
    assert_eq!(tasks(&redis, "ch").len(), 100, "refused runs add nothing");
}

#[test]
fn samples_are_reproducible() {
    let redis = RedisServer::start();
    let dir = TempDir::new("sample");
    let path = dir.join("d.jsonl");
    write_records(&path, 0, 1000);
    let keys_of = |job: &str| -> HashSet<String> { tasks(&redis, job).into_iter().map(|t| t.2).collect() };
    let a = enqueue_json(&redis, &path, "s1", &["--sample", "50", "--seed", "3"]);
    enqueue_json(&redis, &path, "s2", &["--sample", "50", "--seed", "3"]);
    enqueue_json(&redis, &path, "s3", &["--sample", "50", "--seed", "4"]);
    assert_eq!(a["enqueued"], 50);
    assert_eq!(keys_of("s1").len(), 50);
    assert_eq!(keys_of("s1"), keys_of("s2"));
    assert_ne!(keys_of("s1"), keys_of("s3"));
}

#[test]
fn unusable_inputs_fail_with_clear_messages() {
    let redis = RedisServer::start();
    let dir = TempDir::new("errors");
    let path = dir.join("d.jsonl");
    write_records(&path, 0, 10);
    let spec = example_spec();
    let url = redis.url();
    let run = |dataset: &str, job: &str, spec: &str, url: &str| {
        producer(&["enqueue", dataset, "--job", job, "--spec", spec, "--redis", url])
    };

    let missing = run("/nonexistent/x.jsonl", "e", spec.to_str().unwrap(), &url);
    assert_eq!(missing.status.code(), Some(2));
    assert!(
        stderr(&missing).contains("cannot read dataset /nonexistent/x.jsonl"),
        "{}",
        stderr(&missing)
    );

    let bad_spec = dir.join("bad.toml");
    std::fs::write(
        &bad_spec,
        std::fs::read_to_string(&spec)
            .unwrap()
            .replace("partitions = 4", "partitions = 0"),
    )
    .unwrap();
    let out = run(path.to_str().unwrap(), "e", bad_spec.to_str().unwrap(), &url);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("job.partitions"), "{}", stderr(&out));

    let out = run(path.to_str().unwrap(), "bad name", spec.to_str().unwrap(), &url);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("job name `bad name` is invalid"));

    let dead = format!("redis://:hunter2secret@127.0.0.1:{}", harness::free_port());
    let out = run(path.to_str().unwrap(), "e", spec.to_str().unwrap(), &dead);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("cannot reach Redis"), "{}", stderr(&out));
    assert!(
        !stderr(&out).contains("hunter2secret"),
        "password leaked: {}",
        stderr(&out)
    );

    let check = producer(&["spec", "check", bad_spec.to_str().unwrap()]);
    assert_eq!(check.status.code(), Some(2));
    let ok = producer(&["spec", "check", spec.to_str().unwrap()]);
    assert!(ok.status.success());
    assert!(stdout(&ok).contains("- label (string, required)"), "{}", stdout(&ok));
}

/// The job's tasks in Redis: stream entries (queued and in flight) and retries waiting.
fn backlog(redis: &RedisServer, job: &str) -> u64 {
    let mut c = redis.conn();
    (0..PARTITIONS)
        .map(|p| {
            let n: u64 = c.xlen(keys::stream(job, p)).unwrap();
            let z: u64 = c.zcard(keys::delayed(job, p)).unwrap();
            n + z
        })
        .sum()
}

#[test]
fn a_bounded_backlog_keeps_the_job_small_in_redis_and_drain_workers_wait_for_the_rest() {
    let redis = RedisServer::start();
    let sim = harness::LlmSim::start(&["--latency-ms", "10"]);
    let dir = TempDir::new("bounded");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 400);
    let mut cmd = enqueue_cmd(&redis, &data, "bounded", &example_spec());
    cmd.args(["--max-backlog", "40", "--json", "--no-progress"]);
    let enqueue = harness::Running::spawn(cmd);
    // No worker yet: the producer stops at the bound, and waits.
    harness::wait_for("the first 40 records", Duration::from_secs(20), || {
        state_count(&redis, "bounded") == 40
    });
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(state_count(&redis, "bounded"), 40, "enqueue waits at --max-backlog");

    // A --drain worker started now finds short moments with nothing queued,
    // but the job is still being enqueued: it waits for the rest.
    let worker = harness::Running::spawn(harness::worker_cmd(
        &redis,
        "bounded",
        &sim,
        &["--concurrency", "4", "--drain"],
    ));
    let mut peak = 0;
    let started = Instant::now();
    while state_count(&redis, "bounded") < 400 && started.elapsed() < Duration::from_secs(60) {
        peak = peak.max(backlog(&redis, "bounded"));
        std::thread::sleep(Duration::from_millis(10));
    }
    let (exit, log) = enqueue.finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    assert!(
        log.contains("enqueue waits: job `bounded` holds 40 tasks in Redis (--max-backlog 40)"),
        "{log}"
    );
    assert!(peak <= 40, "at most 40 tasks in Redis at once, saw {peak}");
    let (exit, log) = worker.finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    let (code, s) = harness::status_json(&redis, "bounded");
    assert_eq!(code, Some(0), "the job completes: {s}");
    assert_eq!(s["done"], 400, "{s}");
    let mark: bool = redis.conn().exists(keys::enqueuing("bounded")).unwrap();
    assert!(!mark, "the enqueuing mark is gone with the producer");
}

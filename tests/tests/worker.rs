//! Workers end to end: real redis-server, real llm-sim over HTTP, real
//! processes killed for real (by pid).

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::collections::{BTreeMap, HashMap};
use std::process::Stdio;
use std::time::Duration;

use common::keys;
use common::spec::JobSpec;
use common::validate::{Validation, validate};
use harness::{
    LlmSim, RedisServer, Running, TempDir, enqueue, producer, spec_with, wait_for, worker_cmd, write_records,
};
use redis::Commands;
use serde_json::Value;

const P: u32 = 4;
const FULL_FAULT_MIX: &str = "rate_limit=0.02,server_error=0.02,unavailable=0.02,empty=0.01,broken_json=0.03,fence=0.03,\
prose=0.02,missing_field=0.03,bad_enum=0.03,bool_number=0.03,content_filter=0.01,length=0.02,hang=0.005";

/// Fast retries and short timeouts for tests.
fn test_spec(dir: &TempDir, timeout_secs: &str) -> std::path::PathBuf {
    spec_with(
        dir,
        &[
            ("timeout_secs = 30", &format!("timeout_secs = {timeout_secs}")),
            ("base_delay_ms = 500", "base_delay_ms = 20"),
            ("max_delay_ms = 30000", "max_delay_ms = 200"),
        ],
    )
}

/// Everything Redis holds about a job's records.
struct JobView {
    states: HashMap<String, String>,
    results: HashMap<String, Value>,
    reviews: HashMap<String, Value>,
    in_streams: u64,
    delayed: u64,
    pending: u64,
}

impl JobView {
    fn read(redis: &RedisServer, job: &str) -> JobView {
        let mut c = redis.conn();
        let mut v = JobView {
            states: HashMap::new(),
            results: HashMap::new(),
            reviews: HashMap::new(),
            in_streams: 0,
            delayed: 0,
            pending: 0,
        };
        for p in 0..P {
            v.states
                .extend(c.hgetall::<_, HashMap<String, String>>(keys::state(job, p)).unwrap());
            for (k, json) in c.hgetall::<_, HashMap<String, String>>(keys::results(job, p)).unwrap() {
                v.results.insert(k, serde_json::from_str(&json).unwrap());
            }
            for (k, json) in c.hgetall::<_, HashMap<String, String>>(keys::review(job, p)).unwrap() {
                v.reviews.insert(k, serde_json::from_str(&json).unwrap());
            }
            v.in_streams += c.xlen::<_, u64>(keys::stream(job, p)).unwrap();
            v.delayed += c.zcard::<_, u64>(keys::delayed(job, p)).unwrap();
            let summary: redis::Value = redis::cmd("XPENDING")
                .arg(keys::stream(job, p))
                .arg(keys::GROUP)
                .query(&mut c)
                .unwrap();
            if let redis::Value::Array(parts) = summary
                && let Some(redis::Value::Int(n)) = parts.first()
            {
                v.pending += *n as u64;
            }
        }
        v
    }

    fn count(&self) -> BTreeMap<String, usize> {
        let mut out = BTreeMap::new();
        for s in self.states.values() {
            let class = s.split(':').next().unwrap_or("").to_owned();
            *out.entry(class).or_default() += 1;
        }
        out
    }

    /// The DESIGN guarantees: every record in exactly one terminal set, one
    /// result per done record, no result or review for a record not in that set.
    fn assert_complete(&self, expected: usize) {
        assert_eq!(self.states.len(), expected, "records known to the job");
        for (rid, s) in &self.states {
            let terminal = s == "done" || s == "review" || s.starts_with("dropped:");
            assert!(terminal, "record {rid} is not terminal: {s}");
            assert_eq!(
                self.results.contains_key(rid),
                s == "done",
                "result vs state for {rid} ({s})"
            );
            assert_eq!(
                self.reviews.contains_key(rid),
                s == "review",
                "review vs state for {rid} ({s})"
            );
        }
        assert_eq!(self.results.len(), self.count().get("done").copied().unwrap_or(0));
        assert!(
            self.results.keys().all(|k| self.states.contains_key(k)),
            "a result for an unknown record"
        );
        assert_eq!(
            (self.in_streams, self.delayed, self.pending),
            (0, 0, 0),
            "work left over"
        );
    }
}

/// Longest a worker may take in these tests.
const WORKER_DEADLINE: Duration = Duration::from_secs(120);

fn spawn(cmd: std::process::Command) -> Running {
    Running::spawn(cmd)
}

fn output(r: Running) -> (std::process::ExitStatus, String) {
    r.finish(WORKER_DEADLINE)
}

#[test]
fn two_workers_with_the_full_fault_mix_account_for_every_record() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[
        "--latency-ms",
        "5",
        "--faults",
        FULL_FAULT_MIX,
        "--seed",
        "11",
        "--hang-secs",
        "5",
    ]);
    let dir = TempDir::new("e2e");
    let spec_path = test_spec(&dir, "1");
    let dataset = harness::workspace().join("examples/dataset.jsonl");
    enqueue(&redis, &dataset, "e2e", &spec_path);
    let workers: Vec<Running> = (0..2)
        .map(|_| {
            spawn(worker_cmd(
                &redis,
                "e2e",
                &sim,
                &["--drain", "--concurrency", "16", "--visibility-timeout-ms", "3000"],
            ))
        })
        .collect();
    let mut grants = 0;
    for w in workers {
        let (status, err) = output(w);
        assert!(status.success(), "worker failed: {err}");
        let summary: Value = harness::worker_summary(&err).expect("a worker summary");
        grants += summary["limiters"]["e2e"]["grants"].as_u64().unwrap();
    }
    // Rate-limit grants follow the work: no block taken and given back on every idle poll.
    let requests = sim.stats()["requests"].as_u64().unwrap();
    assert!(
        grants >= requests && grants <= requests * 3 / 2 + 100,
        "{grants} grants for {requests} requests"
    );
    let view = JobView::read(&redis, "e2e");
    view.assert_complete(1201);
    let counts = view.count();
    assert_eq!(
        counts.get("dropped"),
        Some(&1),
        "the template-missing record: {counts:?}"
    );
    assert!(counts.get("done").copied().unwrap_or(0) > 1100, "{counts:?}");

    let spec = JobSpec::parse(&std::fs::read_to_string(&spec_path).unwrap(), "spec").unwrap();
    for (rid, r) in &view.results {
        assert_eq!(r["record_id"], rid.as_str());
        assert_eq!(r["output"]["record_id"], rid.as_str(), "system field filled by code");
        let mut model_part = r["output"].as_object().unwrap().clone();
        model_part.remove("record_id");
        model_part.remove("_model");
        let check = validate(&spec, &Value::Object(model_part).to_string());
        assert!(
            matches!(check, Validation::Valid { .. }),
            "stored result does not validate: {r}"
        );
        assert!(r["attempts"].as_u64().unwrap() >= 1);
        assert!(r["usage"]["prompt_tokens"].as_u64().unwrap() > 0, "usage kept: {r}");
    }
    for (rid, e) in &view.reviews {
        assert_eq!(e["record_id"], rid.as_str());
        assert!(e["input"]["message_id"].is_string(), "review keeps the input: {e}");
        assert!(e["reason"].is_string() && e["attempts"].is_u64());
        assert!(e.get("last_raw_output").is_some() && e["errors"].is_array() && e["history"].is_array());
    }
    // Repairs happened and were recorded (the mix wraps answers in fences and prose).
    let repaired = view
        .results
        .values()
        .filter(|r| !r["repairs"].as_array().unwrap().is_empty())
        .count();
    assert!(repaired > 0, "no repair recorded");
    let status = producer(&[
        "status",
        "--job",
        "e2e",
        "--redis",
        &redis.url(),
        "--json",
        "--require-complete",
    ]);
    assert!(
        status.status.success(),
        "status --require-complete: {}",
        harness::stdout(&status)
    );
    let s: Value = serde_json::from_str(&harness::stdout(&status)).unwrap();
    assert_eq!(s["done"].as_u64().unwrap() as usize, view.results.len());
    assert_eq!(s["missing"], 0);
    assert!(s["tokens"]["prompt"].as_u64().unwrap() > 0);
    // llm-sim is the judge: every result is backed by an answer it served.
    let stats = sim.stats();
    assert!(
        stats["served"].as_u64().unwrap() >= view.results.len() as u64,
        "{stats}"
    );
}

#[test]
fn invalid_output_is_retried_with_validation_feedback_only() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--faults", "bad_enum=0.5,server_error=0.3", "--seed", "5"]);
    let dir = TempDir::new("feedback");
    let spec = test_spec(&dir, "5");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 60);
    enqueue(&redis, &data, "fb", &spec);
    let (status, err) = output(spawn(worker_cmd(
        &redis,
        "fb",
        &sim,
        &["--drain", "--concurrency", "8"],
    )));
    assert!(status.success(), "{err}");
    let view = JobView::read(&redis, "fb");
    view.assert_complete(60);
    let with_feedback = sim.log_containing("rejected by the validator");
    assert!(!with_feedback.is_empty(), "no retry carried feedback");
    for entry in &with_feedback {
        let user = entry["user"].as_str().unwrap();
        assert!(
            user.contains("E_ENUM label"),
            "feedback names the error and field: {user}"
        );
        assert!(
            !user.contains("http_") && !user.contains("500"),
            "a transport error was fed back: {user}"
        );
    }
    // Records retried after an invalid answer show it in their history.
    let retried = view
        .results
        .values()
        .filter(|r| {
            r["history"]
                .as_array()
                .unwrap()
                .iter()
                .any(|h| h["outcome"] == "invalid_output")
        })
        .count();
    assert_eq!(retried, with_feedback.len(), "one feedback request per invalid answer");
    // The feedback the model saw is kept in the history of the call that carried it.
    let recorded = view
        .results
        .values()
        .flat_map(|r| r["history"].as_array().unwrap().clone())
        .filter(|h| h["feedback"].as_str().is_some_and(|f| f.contains("E_ENUM label")))
        .count();
    assert_eq!(recorded, with_feedback.len(), "every feedback sent is in a history");
}

#[test]
fn kill_9_with_requests_in_flight_is_recovered_without_a_second_result() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--latency-ms", "800"]);
    let dir = TempDir::new("kill9");
    let spec = test_spec(&dir, "3");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 150);
    enqueue(&redis, &data, "k", &spec);
    let mut victim = worker_cmd(
        &redis,
        "k",
        &sim,
        &[
            "--concurrency",
            "100",
            "--visibility-timeout-ms",
            "4000",
            "--consumer",
            "victim",
        ],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    wait_for("requests in flight", Duration::from_secs(30), || {
        sim.stats()["requests"].as_u64().unwrap() >= 50
    });
    victim.kill().unwrap(); // SIGKILL, by pid
    victim.wait().unwrap();
    let before = JobView::read(&redis, "k");
    assert!(before.pending > 0, "the victim died holding tasks");
    let (status, err) = output(spawn(worker_cmd(
        &redis,
        "k",
        &sim,
        &[
            "--drain",
            "--concurrency",
            "100",
            "--visibility-timeout-ms",
            "4000",
            "--consumer",
            "rescuer",
        ],
    )));
    assert!(status.success(), "{err}");
    assert!(err.contains("reclaimed a task"), "the rescuer reclaimed nothing");
    let view = JobView::read(&redis, "k");
    view.assert_complete(150);
    assert_eq!(view.count().get("done"), Some(&150));
    // Attempts lost with the victim are counted, not hidden.
    assert!(
        view.results.values().any(|r| r["attempts"].as_u64().unwrap() >= 2),
        "lost attempts not counted"
    );
}

#[test]
fn sigterm_stops_claiming_and_finishes_in_flight_work() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--latency-ms", "300"]);
    let dir = TempDir::new("term");
    let spec = test_spec(&dir, "5");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 400);
    enqueue(&redis, &data, "t", &spec);
    let child = spawn(worker_cmd(
        &redis,
        "t",
        &sim,
        &["--concurrency", "10", "--drain-timeout-secs", "20"],
    ));
    wait_for("some commits", Duration::from_secs(30), || {
        JobView::read(&redis, "t").results.len() >= 20
    });
    assert!(
        std::process::Command::new("kill")
            .args(["-TERM", &child.pid().to_string()])
            .status()
            .unwrap()
            .success()
    );
    let (status, err) = output(child);
    assert!(status.success(), "drained worker exits 0: {err}");
    let view = JobView::read(&redis, "t");
    assert_eq!(
        view.pending, 0,
        "in-flight tasks were finished and acked, not abandoned"
    );
    let incomplete = producer(&["status", "--job", "t", "--redis", &redis.url(), "--require-complete"]);
    assert_eq!(incomplete.status.code(), Some(4), "an unfinished job is not complete");
    assert!(view.in_streams > 0, "it stopped claiming: work is left for others");
    let (status, err) = output(spawn(worker_cmd(
        &redis,
        "t",
        &sim,
        &["--drain", "--concurrency", "50"],
    )));
    assert!(status.success(), "{err}");
    JobView::read(&redis, "t").assert_complete(400);
}

#[test]
fn a_task_delivered_too_often_goes_to_review_as_poison() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    let dir = TempDir::new("poison");
    let spec = test_spec(&dir, "1");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 3);
    enqueue(&redis, &data, "poison", &spec);
    // A "ghost" consumer takes every task, then one entry's delivery count is
    // pushed past the limit, as repeated crashes on it would.
    let mut c = redis.conn();
    let mut poisoned = None;
    for p in 0..P {
        let stream = keys::stream("poison", p);
        let reply: redis::streams::StreamReadReply = c
            .xread_options(
                &[&stream],
                &[">"],
                &redis::streams::StreamReadOptions::default().group(keys::GROUP, "ghost"),
            )
            .unwrap();
        for key in reply.keys {
            for id in key.ids {
                if poisoned.is_none() {
                    let _: redis::Value = redis::cmd("XCLAIM")
                        .arg(&stream)
                        .arg(keys::GROUP)
                        .arg("ghost")
                        .arg(0)
                        .arg(&id.id)
                        .arg("RETRYCOUNT")
                        .arg(9)
                        .query(&mut c)
                        .unwrap();
                    poisoned = Some(id.get::<String>("rid").unwrap());
                }
            }
        }
    }
    let poisoned = poisoned.expect("a task to poison");
    std::thread::sleep(Duration::from_millis(1600));
    let (status, err) = output(spawn(worker_cmd(
        &redis,
        "poison",
        &sim,
        &["--drain", "--visibility-timeout-ms", "1500"],
    )));
    assert!(status.success(), "{err}");
    let view = JobView::read(&redis, "poison");
    view.assert_complete(3);
    assert_eq!(view.states[&poisoned], "review");
    assert_eq!(view.reviews[&poisoned]["reason"], "poison");
    assert_eq!(view.count().get("done"), Some(&2));
    let sent = sim.log_containing("message number").len();
    assert_eq!(sent, 2, "only the two healthy tasks were sent to the model");
}

#[test]
fn a_401_halts_the_fleet_and_leaves_every_task_queued() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--api-key", "sk-the-right-one"]);
    let dir = TempDir::new("halt");
    let spec = test_spec(&dir, "5");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 200);
    enqueue(&redis, &data, "h", &spec);
    let (status, err) =
        spawn(worker_cmd(&redis, "h", &sim, &["--drain", "--concurrency", "4"])).finish(Duration::from_secs(30));
    assert_eq!(status.code(), Some(3), "halted exit code: {err}");
    assert!(err.contains("halted") && err.contains("http_401"), "{err}");
    let view = JobView::read(&redis, "h");
    assert!(view.results.is_empty() && view.reviews.is_empty());
    assert!(
        view.states.values().all(|s| s == "queued"),
        "every record stays queued: {:?}",
        view.count()
    );
    assert_eq!(view.in_streams, 200, "no task was acked or lost");
    let halt: Option<String> = redis.conn().get(keys::halt("h")).unwrap();
    assert_eq!(halt.as_deref(), Some("http_401"));
    let sent = sim.stats()["requests"].as_u64().unwrap();
    assert!(sent <= 8, "the fleet kept calling after a 401: {sent} requests");
    assert!(!err.contains("sk-test-key"), "the API key leaked into logs");
}

#[test]
fn a_redelivered_commit_is_a_no_op() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    let dir = TempDir::new("redeliver");
    let spec = test_spec(&dir, "5");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 5);
    enqueue(&redis, &data, "r", &spec);
    let (status, err) = output(spawn(worker_cmd(&redis, "r", &sim, &["--drain"])));
    assert!(status.success(), "{err}");
    let first = JobView::read(&redis, "r");
    first.assert_complete(5);
    // Put a copy of every task back, as a crash between commit and ack would.
    let mut c = redis.conn();
    for p in 0..P {
        let results: HashMap<String, String> = c.hgetall(keys::results("r", p)).unwrap();
        for rid in results.keys() {
            let _: String = c
                .xadd(keys::stream("r", p), "*", &[("rid", rid.as_str()), ("input", "{}")])
                .unwrap();
        }
    }
    let requests_before = sim.stats()["requests"].as_u64().unwrap();
    let (status, err) = output(spawn(worker_cmd(&redis, "r", &sim, &["--drain"])));
    assert!(status.success(), "{err}");
    assert!(err.contains("\"already_settled\":5"), "{err}");
    let second = JobView::read(&redis, "r");
    second.assert_complete(5);
    assert_eq!(second.results, first.results, "results unchanged");
    assert_eq!(
        sim.stats()["requests"].as_u64().unwrap(),
        requests_before,
        "no model call for a settled record"
    );
}

#[test]
fn the_worker_refuses_a_redis_that_can_evict() {
    let redis = RedisServer::start_with(&["--save", "", "--appendonly", "no", "--maxmemory-policy", "allkeys-lru"]);
    let sim = LlmSim::start(&[]);
    let dir = TempDir::new("evict");
    let spec = test_spec(&dir, "5");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 2);
    // The producer refuses such a Redis too; the worker's own check is what is tested here.
    let enqueued = harness::enqueue_cmd(&redis, &data, "ev", &spec)
        .args(["--no-progress", "--allow-evicting-redis"])
        .output()
        .unwrap();
    assert!(enqueued.status.success(), "{}", harness::stderr(&enqueued));
    let (status, err) = output(spawn(worker_cmd(&redis, "ev", &sim, &["--drain"])));
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(
        err.contains("maxmemory-policy is `allkeys-lru`") && err.contains("noeviction"),
        "{err}"
    );
}

#[test]
fn a_consumer_name_a_live_worker_holds_is_refused_and_a_dead_ones_taken_over() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--latency-ms", "200"]);
    let dir = TempDir::new("same-name");
    let spec = test_spec(&dir, "5");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 400);
    enqueue(&redis, &data, "same", &spec);
    let first = spawn(worker_cmd(
        &redis,
        "same",
        &sim,
        &["--consumer", "twin", "--concurrency", "4"],
    ));
    wait_for("the first worker calls", Duration::from_secs(20), || {
        sim.stats()["requests"].as_u64().unwrap_or(0) > 0
    });
    // A second worker under the same name would re-run the first one's tasks.
    let (status, err) = output(spawn(worker_cmd(
        &redis,
        "same",
        &sim,
        &["--consumer", "twin", "--drain"],
    )));
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(err.contains("consumer name `twin` is in use by a live worker"), "{err}");
    // Once the first one is dead, its lease expires and the name can be used
    // again: its own pending tasks are read back first.
    let mut first = first;
    let _ = first.child.kill();
    let _ = first.child.wait();
    let (status, err) = output(spawn(worker_cmd(
        &redis,
        "same",
        &sim,
        &["--consumer", "twin", "--drain", "--concurrency", "32"],
    )));
    assert!(status.success(), "{err}");
    assert!(err.contains("waiting for its lease to expire"), "{err}");
    JobView::read(&redis, "same").assert_complete(400);
}

#[test]
fn a_paid_answer_is_kept_through_a_redis_outage() {
    let mut redis = RedisServer::start_with(&["--save", "", "--appendonly", "yes", "--appendfsync", "always"]);
    let sim = LlmSim::start(&["--latency-ms", "1500"]);
    let dir = TempDir::new("outage");
    let spec = test_spec(&dir, "5");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 20);
    enqueue(&redis, &data, "out", &spec);
    let worker = spawn(worker_cmd(
        &redis,
        "out",
        &sim,
        &["--drain", "--concurrency", "32", "--visibility-timeout-ms", "20000"],
    ));
    wait_for("every record in flight", Duration::from_secs(20), || {
        sim.stats()["in_flight"].as_u64().unwrap_or(0) >= 15
    });
    // Redis goes away while the answers come in, and comes back 2.5 s later.
    redis.kill9_and_restart_after(Duration::from_millis(2500));
    let (status, err) = output(worker);
    assert!(status.success(), "{err}");
    JobView::read(&redis, "out").assert_complete(20);
    assert_eq!(sim.stats()["requests"], 20, "an answer was paid for twice: {err}");
    assert!(
        err.contains("cannot store a paid answer yet; retrying"),
        "the outage hit no answer: {err}"
    );
    let summary = harness::worker_summary(&err).unwrap();
    assert!(summary["outcomes"].get("answer_lost").is_none(), "{summary}");
}

/// Commands Redis has run so far (script-inner ones included).
fn commands_processed(redis: &RedisServer) -> u64 {
    let info: String = redis::cmd("INFO").arg("stats").query(&mut redis.conn()).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("total_commands_processed:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap()
}

#[test]
fn an_idle_worker_waits_on_wake_ups_and_new_work_starts_without_waiting_for_its_poll() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--seed", "4"]);
    let dir = TempDir::new("idle");
    let spec = dir.join("job.toml");
    std::fs::write(&spec, include_str!("../../examples/job.toml")).unwrap();
    let first = dir.join("a.jsonl");
    write_records(&first, 0, 5);
    enqueue(&redis, &first, "idle", &spec);
    // The idle poll is the default's 60 s: without wake-ups, new work would wait for it.
    let worker = Running::spawn(worker_cmd(&redis, "idle", &sim, &["--idle-poll-ms", "60000"]));
    wait_for("the first records", Duration::from_secs(30), || {
        redis.hlen_sum("idle", keys::results) == 5
    });

    // Idle: no polling of every partition (it was ~180 commands/s).
    std::thread::sleep(Duration::from_secs(2));
    let before = commands_processed(&redis);
    std::thread::sleep(Duration::from_secs(20));
    let idle = commands_processed(&redis) - before - 1;
    assert!(idle <= 60, "{idle} Redis commands in 20 s from one idle worker");

    // New work is started at once (well inside the 60 s poll).
    let second = dir.join("b.jsonl");
    write_records(&second, 5, 1);
    let out = harness::enqueue_cmd(&redis, &second, "idle", &spec)
        .args(["--no-progress", "--restart"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", harness::stderr(&out));
    let enqueued = std::time::Instant::now();
    wait_for("the new record", Duration::from_secs(20), || {
        redis.hlen_sum("idle", keys::results) == 6
    });
    assert!(
        enqueued.elapsed() < Duration::from_secs(10),
        "a new task waited {:?}: it was not woken",
        enqueued.elapsed()
    );
    drop(worker);
}

/// Two workers (consumers `<job>0` and `<job>1`, the idle poll of 60 s a
/// worker has by default, not the harness's short one)
/// that finished the 5 records of `job`, the example spec's: its folder
/// (the spec is `job.toml` there) and the workers.
fn two_workers_done(redis: &RedisServer, sim: &LlmSim, job: &str) -> (TempDir, Vec<Running>) {
    let dir = TempDir::new(job);
    let spec = dir.join("job.toml");
    std::fs::write(&spec, include_str!("../../examples/job.toml")).unwrap();
    let data = dir.join("a.jsonl");
    write_records(&data, 0, 5);
    enqueue(redis, &data, job, &spec);
    let workers = (0..2)
        .map(|i| {
            let name = format!("{job}{i}");
            Running::spawn(worker_cmd(
                redis,
                job,
                sim,
                &["--idle-poll-ms", "60000", "--consumer", &name],
            ))
        })
        .collect();
    wait_for("the records", Duration::from_secs(30), || {
        redis.hlen_sum(job, keys::results) == 5
    });
    (dir, workers)
}

/// Idle is free: two workers with nothing to do (the job done), then with
/// the job halted, each cost Redis at most 2 commands a second per worker
/// (`INFO` deltas, the commands scripts run included, over a window that
/// holds every periodic round whole: the idle poll's 60 s, then 30 s halted,
/// when no claim round reads the job).
#[test]
fn an_idle_and_a_halted_fleet_cost_redis_at_most_two_commands_a_second_per_worker() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--seed", "4"]);
    let (_dir, workers) = two_workers_done(&redis, &sim, "quiet");
    let per_worker_second = |what: &str, window: u64| {
        std::thread::sleep(Duration::from_secs(3));
        let before = commands_processed(&redis);
        std::thread::sleep(Duration::from_secs(window));
        // Less this test's own INFO.
        let n = commands_processed(&redis) - before - 1;
        let rate = n as f64 / window as f64 / workers.len() as f64;
        eprintln!("{what}: {rate:.2} Redis commands a second per worker");
        assert!(
            rate <= 2.0,
            "{what}: {rate:.2} Redis commands a second per worker ({n} in {window} s)"
        );
    };
    per_worker_second("idle", 60);
    // A quiet worker (nothing settled for a minute) beats three times less
    // often and says so: it is dead after three of its own intervals.
    let beat = || -> Value {
        let beat: String = redis.conn().hget(keys::workers(), "quiet0").unwrap();
        serde_json::from_str(&beat).unwrap()
    };
    wait_for("a quiet beat", Duration::from_secs(20), || beat()["every_ms"] == 15_000);
    assert_eq!(beat()["in_flight"], 0, "{}", beat());
    // Halted as the fleet halts a job (a key refused, the quota gone): the
    // flag, and a wake-up for every worker.
    let _: () = redis::cmd("SET")
        .arg(keys::halt("quiet"))
        .arg("insufficient_quota")
        .query(&mut redis.conn())
        .unwrap();
    let _: String = redis
        .conn()
        .xadd(keys::wake(), "*", &[("j", "quiet"), ("k", "flags")])
        .unwrap();
    // (Seen at once; the measure starts 3 s later.)
    per_worker_second("halted", 30);
    drop(workers);
}

/// Waiting out an outage costs what idle costs (#32: "idle is free"): two
/// workers whose provider has been down for an hour (its start moved back
/// in Redis, so a probe goes out every 30 s) cost Redis at most 2 commands
/// a second per worker (`INFO` deltas over 60 s: two probes' spacing, so
/// the window holds as many probes as the fleet sends on average, and the
/// idle fleet's rounds of the minute), and only probes reach the provider;
/// so do they just after it went down (a probe every 5 s once the first
/// few went 1, 2 and 4 s apart).
#[test]
fn a_fleet_waiting_out_an_outage_costs_redis_at_most_two_commands_a_second_per_worker() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--latency-ms", "20"]);
    let (dir, workers) = two_workers_done(&redis, &sim, "waiting");
    let spec = dir.join("job.toml");
    sim.fail_all(Some("503:overloaded:the engine is overloaded"));
    let more = dir.join("b.jsonl");
    write_records(&more, 100, 40);
    let out = harness::enqueue_cmd(&redis, &more, "waiting", &spec)
        .arg("--restart")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let outage = keys::outage("waiting");
    wait_for("the provider taken for down", Duration::from_secs(60), || {
        redis
            .conn()
            .hget::<_, _, Option<String>>(&outage, "down")
            .unwrap()
            .as_deref()
            == Some("1")
    });
    let calls = || sim.stats()["requests"].as_u64().unwrap();
    let per_worker_second = |what: &str, probes: std::ops::RangeInclusive<u64>, most: f64| {
        let (before, calls_before) = (commands_processed(&redis), calls());
        std::thread::sleep(Duration::from_secs(60));
        let n = commands_processed(&redis) - before - 1;
        let sent = calls() - calls_before;
        let rate = n as f64 / 60.0 / workers.len() as f64;
        eprintln!("{what}: {rate:.2} Redis commands a second per worker, {sent} probes in 60 s");
        assert!(
            rate <= most,
            "{what}: {rate:.2} Redis commands a second per worker ({n} in 60 s), over {most}"
        );
        assert!(
            probes.contains(&sent),
            "{what}: {sent} calls in 60 s, not {probes:?}: only probes"
        );
    };
    // The probes reach their young spacing (1, 2, 4, then 5 s and a little
    // more past the outage's first minute). With two workers a probe every
    // 5 s costs each about 0.45 commands a second besides the idle fleet's
    // 0.9: 4 a probe (its failure), and every third one the renewal of the
    // delivery its worker kept from its last one (4 more). Before the
    // failed probe's worker kept the next one's lease and probed without a
    // rate grant, 29 a probe (3.4-3.7 a second per worker); before it kept
    // the delivery, 13 (2.1); before it sent it without renewing it while
    // fresh, and the rescuers looked at its pending entry only when it
    // could be overdue, 8 (1.7-1.8).
    std::thread::sleep(Duration::from_secs(8));
    per_worker_second("a young outage", 9..=13, 1.6);
    let down_ms: u64 = redis.conn().hget(&outage, "down_ms").unwrap();
    let _: () = redis.conn().hset(&outage, "down_ms", down_ms - 3_600_000).unwrap();
    // The next failed probes set the long spacing.
    std::thread::sleep(Duration::from_secs(35));
    per_worker_second("an hour-old outage", 1..=3, 2.0);
    assert_eq!(redis.hlen_sum("waiting", keys::results), 5, "the job waits");
    drop(workers);
}

/// A worker serving every job takes up each job enqueued after it started
/// (it finishes what it holds, then starts again with the new job among
/// its own), and keeps serving its metrics on the port it was given, their
/// counters running on: a scraper's target and totals stay, and a rebind
/// racing the old listener's close neither kills the worker nor moves it.
#[test]
fn a_worker_serving_every_job_takes_up_new_ones_on_the_same_metrics_port() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--latency-ms", "20"]);
    let dir = TempDir::new("rejoin");
    let spec = dir.join("job.toml");
    std::fs::write(&spec, include_str!("../../examples/job.toml")).unwrap();
    let first = dir.join("first.jsonl");
    write_records(&first, 0, 5);
    enqueue(&redis, &first, "first", &spec);
    let addr = format!("127.0.0.1:{}", harness::free_port());
    let mut worker = Running::spawn(harness::worker_cmd_all(&redis, &sim, &["--metrics-addr", &addr]));
    wait_for("the first job", Duration::from_secs(30), || {
        redis.hlen_sum("first", keys::results) == 5
    });
    for (i, job) in ["second", "third", "fourth"].into_iter().enumerate() {
        let data = dir.join(&format!("{job}.jsonl"));
        write_records(&data, 100 * (i as u64 + 1), 5);
        enqueue(&redis, &data, job, &spec);
        wait_for(job, Duration::from_secs(30), || redis.hlen_sum(job, keys::results) == 5);
        assert!(
            worker.child.try_wait().unwrap().is_none(),
            "the worker left on taking up {job}"
        );
        wait_for("the metrics after the rejoin", Duration::from_secs(10), || {
            harness::http_get(&format!("http://{addr}"), "/metrics").0 == 200
        });
        let (_, metrics) = harness::http_get(&format!("http://{addr}"), "/metrics");
        assert!(
            metrics.contains(&format!("job=\"{job}\"")),
            "{job} is not in the metrics on {addr}"
        );
        // The counters run on across the rejoins: the first job's are still there.
        let first_done = metrics
            .lines()
            .find(|l| {
                l.starts_with("batchfleet_records_total{")
                    && l.contains("job=\"first\"")
                    && l.contains("outcome=\"commit\"")
            })
            .unwrap_or_else(|| panic!("the first job's records counter is gone after taking up {job}"));
        assert!(first_done.ends_with(" 5"), "{first_done}");
    }
}

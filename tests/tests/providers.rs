//! Real servers' behaviours, imitated by llm-sim: a proxy that answers a
//! wrong key with 400, a model the server does not serve, a server that
//! takes only `application/json` bodies, a local server that takes no key,
//! and resuming a halted job without waiting for a visibility timeout.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::time::{Duration, Instant};

use harness::{
    LlmSim, RedisServer, Running, TempDir, enqueue, producer, spec_with, status_json, wait_for, worker_cmd,
    write_records,
};

fn job(redis: &RedisServer, name: &str, n: u64) -> TempDir {
    let dir = TempDir::new(name);
    let data = dir.join("d.jsonl");
    write_records(&data, 0, n);
    let spec = spec_with(&dir, &[("base_delay_ms = 500", "base_delay_ms = 50")]);
    enqueue(redis, &data, name, &spec);
    dir
}

fn assert_halted_with_records_queued(redis: &RedisServer, job: &str, n: u64, needle: &str) {
    let (_, s) = status_json(redis, job);
    assert!(s["halted"].as_str().unwrap_or("").contains(needle), "{s}");
    assert_eq!(s["review"], 0, "no record goes to review for the job's fault: {s}");
    assert_eq!(
        s["queued"].as_u64().unwrap() + s["delayed"].as_u64().unwrap() + s["in_flight"].as_u64().unwrap(),
        n,
        "every record waits: {s}"
    );
    let text = producer(&["status", "--job", job, "--redis", &redis.url()]);
    assert!(harness::stdout(&text).contains("HALTED"), "{}", harness::stdout(&text));
}

#[test]
fn a_wrong_key_answered_with_400_halts_the_job_after_a_few_calls_with_the_providers_message() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--fail-all", "400:no_db_connection:No connected db."]);
    let _dir = job(&redis, "nodb", 50);
    let (exit, log) = Running::spawn(worker_cmd(&redis, "nodb", &sim, &["--drain", "--concurrency", "32"]))
        .finish(Duration::from_secs(60));
    assert_eq!(exit.code(), Some(3), "{log}");
    let requests = sim.stats()["requests"].as_u64().unwrap();
    assert!(
        requests <= 3,
        "{requests} calls for a job every call of which fails the same way"
    );
    assert!(
        log.contains("\"level\":\"ERROR\"") && log.contains("No connected db."),
        "{log}"
    );
    assert_halted_with_records_queued(&redis, "nodb", 50, "No connected db.");
}

#[test]
fn a_model_the_server_does_not_serve_halts_the_job() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--models", "some-other-model"]);
    let _dir = job(&redis, "nomodel", 20);
    let (exit, log) = Running::spawn(worker_cmd(&redis, "nomodel", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert_eq!(exit.code(), Some(3), "{log}");
    assert!(sim.stats()["requests"].as_u64().unwrap() <= 3);
    assert_halted_with_records_queued(&redis, "nomodel", 20, "Invalid model name passed in model=gpt-4o-mini");
}

#[test]
fn a_single_records_400_still_goes_to_review_once_the_provider_answered() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    let _dir = job(&redis, "one400", 10);
    // The provider answers validly first; then one kind of request fails.
    let (exit, log) = Running::spawn(worker_cmd(&redis, "one400", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    let dir2 = TempDir::new("one400b");
    let data = dir2.join("d.jsonl");
    write_records(&data, 100, 1);
    let spec = spec_with(&dir2, &[("base_delay_ms = 500", "base_delay_ms = 50")]);
    let out = harness::enqueue_cmd(&redis, &data, "one400", &spec)
        .args(["--no-progress", "--restart"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", harness::stderr(&out));
    sim.fail_all(Some("400:context_length_exceeded:This input is too long."));
    let (exit, log) = Running::spawn(worker_cmd(&redis, "one400", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(
        exit.success(),
        "a proven job does not halt on one record's error: {log}"
    );
    let (_, s) = status_json(&redis, "one400");
    assert_eq!((s["done"].as_u64(), s["review"].as_u64()), (Some(10), Some(1)), "{s}");
    let show = producer(&["review", "--job", "one400", "--redis", &redis.url(), "list", "--json"]);
    assert!(
        harness::stdout(&show).contains("This input is too long."),
        "the provider's message is kept"
    );
}

#[test]
fn resuming_a_halted_job_commits_at_once() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--fail-all", "400:no_db_connection:No connected db."]);
    let _dir = job(&redis, "resume", 30);
    // A long-running worker (no --drain), with a visibility timeout far away.
    let worker = Running::spawn(worker_cmd(
        &redis,
        "resume",
        &sim,
        &["--visibility-timeout-ms", "120000"],
    ));
    wait_for("the job halted", Duration::from_secs(30), || {
        status_json(&redis, "resume").1["halted"].is_string()
    });
    sim.fail_all(None);
    let out = producer(&["resume", "--job", "resume", "--redis", &redis.url()]);
    assert!(out.status.success(), "{}", harness::stderr(&out));
    let resumed = Instant::now();
    wait_for("a commit after resume", Duration::from_secs(10), || {
        status_json(&redis, "resume").1["done"].as_u64().unwrap_or(0) > 0
    });
    let took = resumed.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "the first commit came {took:?} after resume"
    );
    wait_for("the job complete", Duration::from_secs(60), || {
        status_json(&redis, "resume").0 == Some(0)
    });
    harness::signal(worker.pid(), "TERM");
    let (exit, log) = worker.finish(Duration::from_secs(30));
    // 3: it saw a halt during its run (its summary says so); never a crash.
    assert!(matches!(exit.code(), Some(0 | 3)), "{exit:?}: {log}");
}

#[test]
fn workers_on_one_host_share_the_default_metrics_address_and_an_explicit_busy_one_is_refused() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    let _dir = job(&redis, "ports", 5);
    // Whoever holds the default port (another worker on this host), it is busy.
    let _held = std::net::TcpListener::bind(worker::run::DEFAULT_METRICS_ADDR);
    let mut cmd = std::process::Command::new(harness::bin("worker"));
    cmd.args([
        "--redis",
        &redis.url(),
        "--job",
        "ports",
        "--base-url",
        &sim.base_url(),
        "--drain",
    ])
    .args(["--log-format", "json"])
    .env("OPENAI_API_KEY", "sk-test-key")
    .env_remove("BATCHFLEET_METRICS_ADDR")
    .env_remove("REDIS_URL");
    let (exit, log) = Running::spawn(cmd).finish(Duration::from_secs(30));
    assert!(exit.success(), "{log}");
    assert!(log.contains("the default metrics address is in use"), "{log}");
    // An address given explicitly must be free.
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    let (exit, log) = Running::spawn(worker_cmd(&redis, "ports", &sim, &["--drain", "--metrics-addr", &addr]))
        .finish(Duration::from_secs(30));
    assert_eq!(exit.code(), Some(2), "{log}");
    assert!(log.contains(&format!("cannot serve metrics on {addr}")), "{log}");
}

#[test]
fn status_warns_when_records_are_not_done_and_require_done_says_so() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--faults", "content_filter=0.5", "--seed", "3"]);
    let _dir = job(&redis, "notdone", 20);
    let (exit, log) = Running::spawn(worker_cmd(&redis, "notdone", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    let out = producer(&[
        "status",
        "--job",
        "notdone",
        "--redis",
        &redis.url(),
        "--require-complete",
    ]);
    assert!(out.status.success(), "complete: every record is in a terminal set");
    assert!(harness::stderr(&out).contains("in review"), "{}", harness::stderr(&out));
    let out = producer(&["status", "--job", "notdone", "--redis", &redis.url(), "--require-done"]);
    assert_eq!(out.status.code(), Some(4), "not every record is done (EXIT_INCOMPLETE)");
    let report = producer(&["report", "--job", "notdone", "--redis", &redis.url()]);
    let text = harness::stdout(&report);
    assert!(text.contains("first call to last outcome"), "{text}");
}

#[test]
fn auto_negotiates_the_structured_output_form_a_server_accepts_once_for_the_fleet() {
    let redis = RedisServer::start();
    // llama-cpp-python's server: json_object with a schema, never json_schema.
    let sim = LlmSim::start(&["--accept-forms", "json_object,text"]);
    let dir = TempDir::new("forms");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 40);
    // The example spec asks for `auto`, the setting that works on the servers users run.
    let spec = spec_with(
        &dir,
        &[("structured_output = \"auto\"", "structured_output = \"auto\"")],
    );
    let spec_check = producer(&["spec", "check", spec.to_str().unwrap()]);
    assert!(spec_check.status.success(), "{}", harness::stderr(&spec_check));
    enqueue(&redis, &data, "forms", &spec);
    let (exit, log) = Running::spawn(worker_cmd(&redis, "forms", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    let (_, s) = status_json(&redis, "forms");
    assert_eq!((s["done"].as_u64(), s["review"].as_u64()), (Some(40), Some(0)), "{s}");
    let by_form = &sim.stats()["by_form"];
    assert_eq!(
        by_form["json_schema"], 1,
        "one refused call, then the fallback: {by_form}"
    );
    assert_eq!(by_form["json_object"], 40, "{by_form}");
    assert!(log.contains("the server refuses this structured-output form"), "{log}");
    // Another worker, later, sends the learned form at once.
    let more = dir.join("more.jsonl");
    write_records(&more, 100, 5);
    let out = harness::enqueue_cmd(&redis, &more, "forms", &spec)
        .args(["--no-progress", "--restart"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", harness::stderr(&out));
    let (exit, log) = Running::spawn(worker_cmd(&redis, "forms", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    assert_eq!(sim.stats()["by_form"]["json_schema"], 1, "the fleet remembered");
}

#[test]
fn a_refused_form_without_auto_halts_instead_of_burning_attempts_and_names_the_setting_that_fixes_it() {
    let redis = RedisServer::start();
    // Like llama-cpp-python's server: json_schema is answered with HTTP 500.
    let sim = LlmSim::start(&["--accept-forms", "json_object,text"]);
    let dir = TempDir::new("strict");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 30);
    let spec = spec_with(
        &dir,
        &[
            ("base_delay_ms = 500", "base_delay_ms = 50"),
            ("structured_output = \"auto\"", "structured_output = true"),
        ],
    );
    enqueue(&redis, &data, "strict", &spec);
    let (exit, log) = Running::spawn(worker_cmd(&redis, "strict", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert_eq!(exit.code(), Some(3), "{log}");
    assert!(sim.stats()["requests"].as_u64().unwrap() <= 3);
    assert_halted_with_records_queued(&redis, "strict", 30, "Input should be 'text' or 'json_object'");
    let (_, s) = status_json(&redis, "strict");
    let halted = s["halted"].as_str().unwrap();
    for words in [
        "from http://127.0.0.1:",
        "refuses the structured-output form `json_schema` (provider.structured_output = true)",
        "set provider.structured_output = \"auto\"",
        "under a new --job name",
    ] {
        assert!(halted.contains(words), "{words:?} in {halted}");
    }
    // The setting it names works: the same records under a new job, with "auto".
    let fixed = spec_with(&dir, &[("base_delay_ms = 500", "base_delay_ms = 50")]);
    enqueue(&redis, &data, "strict-auto", &fixed);
    let (exit, log) =
        Running::spawn(worker_cmd(&redis, "strict-auto", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    assert_eq!(status_json(&redis, "strict-auto").1["done"], 30);
}

#[test]
fn a_schema_sent_with_json_object_is_spelled_so_the_server_enforces_it() {
    // llm-sim's json_object mode enforces a schema as llama.cpp's grammar
    // converter does: a nullable field spelled `"type": ["array", "null"]`
    // would come back with items of any kind; spelled with `anyOf`, as sent,
    // every answer holds.
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--accept-forms", "json_object,text"]);
    let dir = TempDir::new("object-form");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 40);
    let spec = spec_with(
        &dir,
        &[("structured_output = \"auto\"", "structured_output = \"json_object\"")],
    );
    enqueue(&redis, &data, "object", &spec);
    let (exit, log) = Running::spawn(worker_cmd(&redis, "object", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    let (_, s) = status_json(&redis, "object");
    assert_eq!((s["done"].as_u64(), s["review"].as_u64()), (Some(40), Some(0)), "{s}");
    assert_eq!(
        s["attempts_histogram"],
        serde_json::json!({"1": 40}),
        "valid at the first answer: {s}"
    );
    assert_eq!(sim.stats()["by_form"]["json_object"], 40, "{}", sim.stats());
}

#[test]
fn no_request_is_sent_twice_for_a_record_and_a_temperature_schedule_varies_retries() {
    let redis = RedisServer::start();
    let dir = TempDir::new("same-request");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 10);
    let fast = ("base_delay_ms = 500", "base_delay_ms = 20");

    // A model that ignores what it is told, at temperature 0: the same wrong
    // answer every time. The first retry shows it its answer and the errors
    // (a new request); the next would repeat that one byte for byte.
    let sim = LlmSim::start(&["--deterministic", "--stubborn", "--faults", "bad_enum=1.0"]);
    let spec = spec_with(&dir, &[fast]);
    enqueue(&redis, &data, "same", &spec);
    let (exit, log) = Running::spawn(worker_cmd(&redis, "same", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    assert_eq!(
        sim.stats()["requests"],
        20,
        "two calls per record: a third would repeat the second byte for byte"
    );
    assert_eq!(sim.stats()["with_feedback"], 10, "{}", sim.stats());
    let (_, s) = status_json(&redis, "same");
    assert_eq!(s["review"], 10, "{s}");
    let list = producer(&[
        "review",
        "--job",
        "same",
        "--redis",
        &redis.url(),
        "list",
        "--reason",
        "no_new_attempt",
    ]);
    assert!(
        harness::stderr(&list).contains("10 entries in review"),
        "{}",
        harness::stderr(&list)
    );

    // With a schedule, each retry asks at another temperature, until the
    // schedule's last one repeats.
    let sim = LlmSim::start(&["--deterministic", "--stubborn", "--faults", "bad_enum=1.0"]);
    let spec = spec_with(
        &dir,
        &[
            fast,
            ("jitter = \"full\"", "jitter = \"full\"\ntemperatures = [0.0, 0.4, 0.8]"),
        ],
    );
    enqueue(&redis, &data, "sched", &spec);
    let (exit, log) = Running::spawn(worker_cmd(&redis, "sched", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    assert_eq!(
        sim.stats()["requests"],
        30,
        "three temperatures, three calls per record"
    );
    let (_, s) = status_json(&redis, "sched");
    assert_eq!(s["review"], 10, "{s}");

    // A cut-off answer is retried with what went wrong, so the retry is a
    // new request (without it, the one already paid for, and the record
    // would go to review as a repeat); told, the model answers in full.
    let sim = LlmSim::start(&["--deterministic", "--faults", "length=1.0"]);
    let spec = spec_with(&dir, &[fast]);
    enqueue(&redis, &data, "cut", &spec);
    let (exit, log) = Running::spawn(worker_cmd(&redis, "cut", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    assert_eq!(sim.stats()["requests"], 20, "two calls per record");
    assert_eq!(sim.stats()["with_feedback"], 10, "{}", sim.stats());
    let (_, s) = status_json(&redis, "cut");
    assert_eq!((s["done"].as_u64(), s["review"].as_u64()), (Some(10), Some(0)), "{s}");
}

/// A provider that throttles nine requests in ten (its 429s spelled as
/// `limit_headers` says), a spec that knows no limits, `n` records: the
/// job's status and how many 429s llm-sim sent.
fn throttled(limit_headers: &str, n: u64) -> (serde_json::Value, u64) {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[
        "--faults",
        "rate_limit=0.9",
        "--seed",
        "4",
        "--limit-headers",
        limit_headers,
    ]);
    let dir = TempDir::new("throttled");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, n);
    let spec = spec_with(
        &dir,
        &[
            ("requests_per_minute = 10000\n", ""),
            ("input_tokens_per_minute = 2000000\n", ""),
            ("output_tokens_per_minute = 500000\n", ""),
            ("max_concurrent = 64\n", ""),
            ("base_delay_ms = 500", "base_delay_ms = 10"),
            ("max_delay_ms = 30000", "max_delay_ms = 50"),
        ],
    );
    enqueue(&redis, &data, "throttled", &spec);
    let (exit, log) =
        Running::spawn(worker_cmd(&redis, "throttled", &sim, &["--drain"])).finish(Duration::from_secs(90));
    assert!(exit.success(), "{log}");
    let (_, s) = status_json(&redis, "throttled");
    (s, sim.stats()["by_status"]["429"].as_u64().unwrap_or(0))
}

#[test]
fn a_429_never_sends_a_record_to_review() {
    // OpenAI's `retry-after`, and LiteLLM's `llm_provider-retry-after` alone.
    for (limit_headers, n) in [("openai", 8), ("litellm", 4)] {
        let (s, throttled) = throttled(limit_headers, n);
        assert_eq!(
            (s["done"].as_u64(), s["review"].as_u64()),
            (Some(n), Some(0)),
            "--limit-headers {limit_headers}: {s}"
        );
        assert!(
            throttled > n * 3,
            "--limit-headers {limit_headers}: the provider throttled only {throttled} times \
             (the old bound, review after 20 calls, is a unit test of decide)"
        );
    }
}

/// A self-hosted server (llm-sim `--slots`: llama.cpp-style generation
/// slots; a request whose client left is still generated to its end) at
/// 1.5 s a request, a spec allowing one request at a time with a 1 s
/// timeout. Returns llm-sim's stats, the worker's limiter summary and the
/// job's report.
fn timing_out(grace_secs: u64) -> (serde_json::Value, serde_json::Value, serde_json::Value) {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--slots", "4", "--latency-ms", "1500", "--steady-latency"]);
    let dir = TempDir::new("grace");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 3);
    let spec = spec_with(
        &dir,
        &[
            (
                "timeout_secs = 30",
                &format!("timeout_secs = 1\ntimeout_grace_secs = {grace_secs}"),
            ),
            ("max_concurrent = 64", "max_concurrent = 1"),
            ("base_delay_ms = 500", "base_delay_ms = 10"),
            // Every call times out: the world's fault, never the records'.
            // The job waits it out for 6 s, then halts.
            ("jitter = \"full\"", "jitter = \"full\"\noutage_budget_secs = 6"),
        ],
    );
    enqueue(&redis, &data, "grace", &spec);
    let (exit, log) = Running::spawn(worker_cmd(
        &redis,
        "grace",
        &sim,
        &["--drain", "--visibility-timeout-ms", "5000"],
    ))
    .finish(Duration::from_secs(90));
    assert_eq!(
        exit.code(),
        Some(3),
        "halted once the outage outlasted its budget: {log}"
    );
    let (_, status) = status_json(&redis, "grace");
    assert_eq!(status["review"], 0, "no record reviewed for timeouts: {status}");
    assert!(
        status["halted"].as_str().unwrap().contains("last error timeout"),
        "{status}"
    );
    let limiter = harness::worker_summary(&log).unwrap()["limiters"]["grace"].clone();
    let report = producer(&["report", "--job", "grace", "--redis", &redis.url(), "--json"]);
    assert!(report.status.success(), "{}", harness::stderr(&report));
    let report: serde_json::Value = serde_json::from_str(&harness::stdout(&report)).unwrap();
    // Let the abandoned generations finish before reading the server's counts.
    std::thread::sleep(Duration::from_millis(1600));
    (sim.stats(), limiter, report)
}

#[test]
fn a_timed_out_call_keeps_its_slot_while_the_server_still_generates_and_its_tokens_are_estimated() {
    let (stats, limiter, report) = timing_out(1);
    let calls = stats["requests"].as_u64().unwrap();
    assert!(calls >= 3, "every record was called: {stats}");
    assert_eq!(
        stats["abandoned"], calls,
        "the server generated each after the client left: {stats}"
    );
    assert_eq!(
        stats["max_generating"], 1,
        "max_concurrent = 1 holds at the server, abandoned generations included: {stats}"
    );
    assert_eq!(limiter["timed_out"], calls, "{limiter}");
    // Each timed-out call is counted, marked as an estimate, in the cost figures.
    let total = &report["total"];
    assert_eq!(total["calls"], calls, "{report}");
    assert_eq!(total["estimated_calls"], calls, "{report}");
    let max_tokens = 200; // the example spec's `max_tokens`
    assert!(
        total["estimated_tokens"].as_u64().unwrap() > calls * max_tokens,
        "prompt estimate + max_tokens per call: {report}"
    );
    assert!(total["estimated_cost_usd"].as_f64().unwrap() > 0.0, "{report}");
    assert_eq!(total["completion_tokens"], calls * max_tokens, "{report}");
}

#[test]
fn without_a_grace_the_next_call_queues_behind_an_abandoned_one() {
    // What the grace prevents, as the real server showed it: more
    // generations at once than the spec allows.
    let (stats, limiter, _) = timing_out(0);
    assert_eq!(limiter["timed_out"], stats["requests"], "{limiter}");
    assert!(
        stats["max_generating"].as_u64().unwrap() >= 2,
        "with no grace the slot is free while the server still works: {stats}"
    );
}

#[test]
fn a_body_not_sent_as_json_is_refused_with_415_and_every_request_of_the_worker_is_json() {
    let sim = LlmSim::start(&[]);
    let body = r#"{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hello"}]}"#;
    // As vLLM's OpenAI server: the media type decides, whatever the body holds.
    for content_type in [None, Some("text/plain"), Some("application/x-www-form-urlencoded")] {
        let (status, text) = sim.chat_as(body, content_type);
        assert_eq!(status, 415, "{content_type:?}: {text}");
        assert!(text.contains("Only 'application/json' is allowed"), "{text}");
    }
    for content_type in [
        "application/json",
        "application/json; charset=utf-8",
        "Application/JSON",
    ] {
        let (status, text) = sim.chat_as(body, Some(content_type));
        assert_eq!(status, 200, "{content_type}: {text}");
    }
    let redis = RedisServer::start();
    let _dir = job(&redis, "media", 20);
    let (exit, log) = Running::spawn(worker_cmd(&redis, "media", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert_eq!(exit.code(), Some(0), "{log}");
    let (_, s) = status_json(&redis, "media");
    assert_eq!(s["done"], 20, "{s}");
    // What llm-sim saw: our own three refusals and no other; every call of the worker answered.
    let stats = sim.stats();
    assert_eq!(stats["by_status"]["415"], 3, "{stats}");
    assert!(stats["by_status"]["200"].as_u64().unwrap() >= 3 + 20, "{stats}");
}

/// A draining worker without `OPENAI_API_KEY`, for `job` against `base_url`.
fn keyless_worker(redis: &RedisServer, job: &str, base_url: &str) -> (std::process::ExitStatus, String) {
    let mut cmd = std::process::Command::new(harness::bin("worker"));
    cmd.args(["--redis", &redis.url(), "--base-url", base_url, "--job", job, "--drain"])
        .args([
            "--metrics-addr",
            "127.0.0.1:0",
            "--idle-poll-ms",
            "20",
            "--log-format",
            "json",
        ])
        .env_remove("OPENAI_API_KEY")
        .env_remove("REDIS_URL")
        .env_remove("BATCHFLEET_BASE_URL");
    Running::spawn(cmd).finish(Duration::from_secs(60))
}

/// Local servers started without a key (llama.cpp, vLLM, Ollama), imitated
/// by llm-sim `--no-auth`: a spec saying `needs_key = false` sends no key at
/// all and says nothing; a loopback server with the variable unset is called
/// without one after a one-line notice; any other server with the variable
/// unset is refused at start, naming the setting.
#[test]
fn a_server_that_takes_no_key_is_called_without_one() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--no-auth"]);
    let dir = TempDir::new("keyless");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 20);
    let key_line = "api_key_env = \"OPENAI_API_KEY\"";
    let said = spec_with(
        &dir,
        &[(key_line, "api_key_env = \"OPENAI_API_KEY\"\nneeds_key = false")],
    );
    enqueue(&redis, &data, "said", &said);
    let (exit, log) = keyless_worker(&redis, "said", &sim.base_url());
    assert!(exit.success(), "{log}");
    assert_eq!(status_json(&redis, "said").1["done"], 20);
    let stats = sim.stats();
    assert!(stats["requests"].as_u64().unwrap() >= 20, "{stats}");
    assert_eq!(
        stats["without_key"], stats["requests"],
        "no Authorization header at all: {stats}"
    );
    assert!(!log.contains("without a key"), "needs_key = false says nothing: {log}");

    let unsaid = TempDir::new("keyless-loopback");
    enqueue(&redis, &data, "loopback", &spec_with(&unsaid, &[]));
    let before = sim.stats()["without_key"].as_u64().unwrap();
    let (exit, log) = keyless_worker(&redis, "loopback", &sim.base_url());
    assert!(exit.success(), "{log}");
    assert_eq!(status_json(&redis, "loopback").1["done"], 20);
    assert!(sim.stats()["without_key"].as_u64().unwrap() >= before + 20);
    assert_eq!(
        log.matches("OPENAI_API_KEY is not set: calling a server on this machine without a key")
            .count(),
        1,
        "one notice: {log}"
    );

    let far = TempDir::new("keyless-far");
    enqueue(&redis, &data, "far", &spec_with(&far, &[]));
    let (exit, log) = keyless_worker(&redis, "far", "http://192.0.2.1:9/v1");
    assert_eq!(exit.code(), Some(2), "{log}");
    assert!(
        log.contains("OPENAI_API_KEY (provider.api_key_env) is not set")
            && log.contains("set provider.needs_key = false"),
        "{log}"
    );
    assert_eq!(status_json(&redis, "far").1["done"], 0);
}

/// A flex tier without capacity (llm-sim refusing 40% of flex requests in
/// bursts, as OpenAI's 429 `resource_unavailable` and as Groq's 498) is the
/// world's: every record is done, none reviewed, none used an attempt for it,
/// and the fleet's pace is untouched: no refusal counted as a rate limit, no
/// limit learned, no pause.
#[test]
fn flex_refusals_are_waited_out_without_attempts_and_without_slowing_the_fleet() {
    for refusal in ["openai", "groq"] {
        let redis = RedisServer::start();
        let sim = LlmSim::start(&[
            "--flex-unavailable",
            "0.4",
            "--flex-burst",
            "3",
            "--flex-refusal",
            refusal,
            "--seed",
            "5",
        ]);
        let dir = TempDir::new("flex");
        // A Batch API line's body, sent whole: the way a request asks for flex.
        let example = include_str!("../../examples/job.toml");
        let (head, rest) = example.split_once("[prompt]").unwrap();
        let provider = &rest[rest.find("[provider]").unwrap()..];
        let text = format!(
            "{}[prompt]\nrequest_field = \"body\"\n\n{}",
            head.replace("id_field = \"message_id\"", "id_field = \"custom_id\""),
            provider
                .replace("base_delay_ms = 500", "base_delay_ms = 10")
                .replace("max_delay_ms = 30000", "max_delay_ms = 50")
        );
        let spec = dir.join("flex.toml");
        std::fs::write(&spec, text).unwrap();
        let n = 30u64;
        let lines: Vec<String> = (0..n)
            .map(|i| {
                serde_json::json!({"custom_id": format!("f{i}"), "body": {
                    "messages": [{"role": "user", "content": format!("message {i}: where is my order?")}],
                    "service_tier": "flex"}})
                .to_string()
            })
            .collect();
        let data = dir.join("d.jsonl");
        std::fs::write(&data, lines.join("\n") + "\n").unwrap();
        enqueue(&redis, &data, "flex", &spec);
        let (exit, log) =
            Running::spawn(worker_cmd(&redis, "flex", &sim, &["--drain"])).finish(Duration::from_secs(90));
        assert!(exit.success(), "{refusal}: {log}");
        let (_, s) = status_json(&redis, "flex");
        assert_eq!(
            (s["done"].as_u64(), s["review"].as_u64()),
            (Some(n), Some(0)),
            "{refusal}: {s}"
        );
        // What llm-sim saw: every request asked for flex (none fell back to
        // another tier), some were refused, and each record was answered once.
        let by_tier = &sim.stats()["by_tier"];
        let tiers = &by_tier["flex"];
        assert!(by_tier.get("default").is_none(), "{refusal}: {by_tier}");
        let (requests, refused) = (tiers["requests"].as_u64().unwrap(), tiers["refused"].as_u64().unwrap());
        assert!(refused >= 5, "{refusal}: {tiers}");
        assert_eq!(requests - refused, n, "{refusal}: {tiers}");
        let mut c = redis.conn();
        for p in 0..4 {
            let results: Vec<String> = redis::cmd("HVALS")
                .arg(common::keys::results("flex", p))
                .query(&mut c)
                .unwrap();
            for r in results {
                let r: serde_json::Value = serde_json::from_str(&r).unwrap();
                assert_eq!(r["attempts"], 1, "{refusal}: a refusal used an attempt: {r}");
            }
        }
        let limiter = &harness::worker_summary(&log).unwrap()["limiters"]["flex"];
        assert_eq!(limiter["rate_limited"], 0, "{refusal}: {limiter}");
        let budget = &limiter["budget"];
        assert!(
            budget.get("learned_requests_per_minute").is_none() && budget.get("learned_concurrency").is_none(),
            "{refusal}: a flex refusal taught the fleet a limit: {budget}"
        );
    }
}

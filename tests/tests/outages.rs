//! The world fails, not the job: a provider that goes away (its process
//! killed by pid and started again on the same port), storms 503s, hangs
//! after it has answered, resets connections mid-body, or refuses every
//! call with 429 for want of capacity. Each run ends with every record done
//! and none in review; while the outage lasts it is visible in `producer
//! status` (text and JSON) and in the workers' metrics, only probes reach
//! the provider, and each worker logs it once when it starts and once when
//! it ends. An outage longer than the job's budget halts the job, and
//! `producer resume` finishes it.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::time::{Duration, Instant};

use harness::{
    LlmSim, RedisServer, Running, TempDir, enqueue, free_port, http_get, producer, spec_with, status_json, stdout,
    wait_for, worker_cmd, write_records,
};

/// A job of `n` records with short retry delays (and `extra` replacements of the example spec).
fn job(redis: &RedisServer, name: &str, n: u64, extra: &[(&str, &str)]) -> TempDir {
    let dir = TempDir::new(name);
    let data = dir.join("d.jsonl");
    write_records(&data, 0, n);
    let mut edits = vec![("base_delay_ms = 500", "base_delay_ms = 50")];
    edits.extend_from_slice(extra);
    let spec = spec_with(&dir, &edits);
    enqueue(redis, &data, name, &spec);
    dir
}

/// A running worker and where its metrics are.
struct Worker {
    run: Running,
    metrics: String,
}

fn start_workers(redis: &RedisServer, job: &str, sim: &LlmSim, n: usize) -> Vec<Worker> {
    (0..n)
        .map(|i| {
            let metrics = format!("127.0.0.1:{}", free_port());
            let consumer = format!("{job}-w{i}");
            let cmd = worker_cmd(
                redis,
                job,
                sim,
                &[
                    "--drain",
                    "--concurrency",
                    "8",
                    "--metrics-addr",
                    &metrics,
                    "--consumer",
                    &consumer,
                ],
            );
            Worker {
                run: Running::spawn(cmd),
                metrics,
            }
        })
        .collect()
}

/// A gauge of a worker's `/metrics` for the job.
fn gauge(metrics_addr: &str, name: &str, job: &str) -> Option<f64> {
    let (_, text) = http_get(metrics_addr, "/metrics");
    let prefix = format!("{name}{{job=\"{job}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
}

fn done(redis: &RedisServer, job: &str) -> u64 {
    status_json(redis, job).1["done"].as_u64().unwrap_or(0)
}

/// Waits until the fleet has taken the provider for down, and checks that
/// every way of looking shows it: `status` text and JSON, the metric.
/// Returns the JSON status's `waiting` line.
fn outage_visible(redis: &RedisServer, job: &str, worker: &Worker, cause: &str) -> String {
    wait_for("the outage in status", Duration::from_secs(60), || {
        status_json(redis, job).1["waiting"].is_string()
    });
    let (_, s) = status_json(redis, job);
    let waiting = s["waiting"].as_str().unwrap().to_owned();
    assert!(waiting.starts_with("provider unavailable since 20"), "{waiting}");
    assert!(waiting.contains(&format!("last error {cause}")), "{waiting}");
    assert!(waiting.contains("from http://127.0.0.1:"), "{waiting}");
    assert_eq!(s["provider"]["down"], true, "{s}");
    assert_eq!(s["review"], 0, "no record goes to review for the world's fault: {s}");
    let text = stdout(&producer(&["status", "--job", job, "--redis", &redis.url()]));
    assert!(text.contains("  waiting: provider unavailable since"), "{text}");
    wait_for("provider_up 0 in the metrics", Duration::from_secs(20), || {
        gauge(&worker.metrics, "batchfleet_provider_up", job) == Some(0.0)
    });
    waiting
}

fn failed_calls(redis: &RedisServer, job: &str) -> u64 {
    status_json(redis, job).1["provider"]["failed_calls"]
        .as_u64()
        .unwrap_or(0)
}

/// Lets the workers drain and checks the run: every record done, none in
/// review, nothing missing or twice, the outage over; each worker exited 0
/// and logged the outage's start and end once each at WARN.
fn finished_clean(redis: &RedisServer, job: &str, n: u64, workers: Vec<Worker>) {
    for w in workers {
        let (exit, log) = w.run.finish(Duration::from_secs(120));
        assert!(exit.success(), "{exit:?}: {log}");
        let warns = |needle: &str| {
            log.lines()
                .filter(|l| l.contains("\"level\":\"WARN\"") && l.contains(needle))
                .count()
        };
        assert_eq!(warns("provider unavailable:"), 1, "once when it starts: {log}");
        assert_eq!(warns("provider back:"), 1, "once when it ends: {log}");
    }
    let (code, s) = status_json(redis, job);
    assert_eq!(code, Some(0), "complete: {s}");
    assert_eq!(
        (
            s["done"].as_u64(),
            s["review"].as_u64(),
            s["missing"].as_u64(),
            s["duplicates"].as_u64()
        ),
        (Some(n), Some(0), Some(0), Some(0)),
        "{s}"
    );
    assert!(s["waiting"].is_null(), "{s}");
    assert_eq!(s["provider"]["outages"], 1, "{s}");
}

/// A 20 s outage started by `begin` once a fifth of the records are done and ended by
/// `end`: the job loses nothing but time, and only probes are sent once the
/// provider is taken for down. Returns the time from the end of the outage
/// to the next record done.
fn ride_out(
    name: &str,
    sim: &mut LlmSim,
    spec: &[(&str, &str)],
    cause: &str,
    begin: impl FnOnce(&mut LlmSim),
    end: impl FnOnce(&mut LlmSim),
) -> Duration {
    // 16 calls in flight of 300 ms each: the job takes about 12 s without
    // an outage, so the outage comes mid-job however busy the machine is.
    let n = 600;
    let redis = RedisServer::start();
    let _dir = job(&redis, name, n, spec);
    let workers = start_workers(&redis, name, sim, 2);
    wait_for("a fifth of the records done", Duration::from_secs(60), || {
        done(&redis, name) >= n / 5
    });
    let began = Instant::now();
    begin(sim);
    assert!(done(&redis, name) < n, "the outage began before the end");
    let waiting = outage_visible(&redis, name, &workers[0], cause);
    eprintln!("{name}: {waiting}");
    // Once taken for down, the provider sees one probe at a time, at most
    // one a second (doubling to every 5 s): no storm of retries. Calls sent
    // before the fleet knew may still fail for up to their timeout (2 s
    // here, when the provider hangs): counted from 3 s on.
    std::thread::sleep(Duration::from_secs(3));
    let settled = failed_calls(&redis, name);
    let watched = Instant::now();
    std::thread::sleep(
        Duration::from_secs(20)
            .saturating_sub(began.elapsed())
            .max(Duration::from_secs(5)),
    );
    let probes = failed_calls(&redis, name) - settled;
    let window = watched.elapsed().as_secs();
    assert!(
        probes <= window / 2 + 4,
        "{probes} calls in {window} s while the provider was down: only probes may go out"
    );
    let done_before = done(&redis, name);
    assert!(done_before < n, "the outage came before the end");
    end(sim);
    let back = Instant::now();
    wait_for("a record done after the outage", Duration::from_secs(30), || {
        done(&redis, name) > done_before
    });
    let resumed = back.elapsed();
    eprintln!("{name}: first record done {resumed:?} after the provider came back");
    finished_clean(&redis, name, n, workers);
    resumed
}

#[test]
fn a_provider_killed_mid_job_and_back_after_20_s_loses_nothing_but_time() {
    let mut sim = LlmSim::start(&["--latency-ms", "300", "--steady-latency"]);
    let resumed = ride_out("killed", &mut sim, &[], "connect", LlmSim::kill9, LlmSim::restart);
    assert!(
        resumed < Duration::from_secs(10),
        "{resumed:?}: probes come at least every 5 s"
    );
    let stats = sim.stats();
    assert!(
        stats["served"].as_u64().unwrap() > 0,
        "the restarted provider served the rest: {stats}"
    );
}

#[test]
fn twenty_seconds_of_503s_wait_in_the_queue_instead_of_filling_review() {
    let mut sim = LlmSim::start(&["--latency-ms", "300", "--steady-latency"]);
    ride_out(
        "storm",
        &mut sim,
        &[],
        "http_503",
        |s| s.outage(Some("unavailable"), None),
        |s| s.outage(None, None),
    );
    let refused = sim.stats()["outage"]["refused"]["unavailable"].as_u64().unwrap();
    // Before: 922 calls in 20 s, none of them a probe.
    assert!(refused < 400, "{refused} calls refused in a 20 s storm of 503s");
}

#[test]
fn a_provider_that_hangs_after_it_answered_is_waited_out() {
    let mut sim = LlmSim::start(&["--latency-ms", "300", "--steady-latency", "--hang-secs", "600"]);
    let resumed = ride_out(
        "hangs",
        &mut sim,
        &[("timeout_secs = 30", "timeout_secs = 2")],
        "timeout",
        |s| s.outage(Some("hang"), None),
        |s| s.outage(None, None),
    );
    // A probe in flight when it ends still hangs: the next one gets through.
    assert!(resumed < Duration::from_secs(25), "{resumed:?}");
}

#[test]
fn connections_reset_mid_body_are_waited_out() {
    let mut sim = LlmSim::start(&["--latency-ms", "300", "--steady-latency"]);
    ride_out(
        "resets",
        &mut sim,
        &[],
        "transport",
        |s| s.outage(Some("reset"), None),
        |s| s.outage(None, None),
    );
    let stats = sim.stats();
    assert!(stats["outage"]["refused"]["reset"].as_u64().unwrap() > 0, "{stats}");
}

#[test]
fn a_provider_refusing_every_call_with_429_is_an_outage_too() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--limit-headers", "none"]);
    sim.outage(Some("capacity"), None);
    let _dir = job(&redis, "capacity", 30, &[]);
    let workers = start_workers(&redis, "capacity", &sim, 1);
    let waiting = outage_visible(&redis, "capacity", &workers[0], "rate_limited");
    assert!(
        waiting.contains("The model is at capacity."),
        "the provider's words: {waiting}"
    );
    sim.outage(None, None);
    finished_clean(&redis, "capacity", 30, workers);
}

#[test]
fn an_outage_longer_than_the_budget_halts_the_job_and_resume_finishes_it() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    sim.outage(Some("unavailable"), None);
    let _dir = job(
        &redis,
        "budget",
        40,
        &[("jitter = \"full\"", "jitter = \"full\"\noutage_budget_secs = 6")],
    );
    let worker = Running::spawn(worker_cmd(&redis, "budget", &sim, &["--drain"]));
    let (exit, log) = worker.finish(Duration::from_secs(90));
    assert_eq!(exit.code(), Some(3), "a halted job: {log}");
    let (_, s) = status_json(&redis, "budget");
    let halted = s["halted"].as_str().unwrap();
    for words in [
        "provider unavailable for ",
        "retry.outage_budget_secs is 6",
        "last error http_503 from http://127.0.0.1:",
        "The server is temporarily unavailable.",
    ] {
        assert!(halted.contains(words), "{words:?} in {halted}");
    }
    assert_eq!(s["review"], 0, "halted, not reviewed: {s}");
    assert!(
        log.contains("producer resume --job budget"),
        "the exit says what to type: {log}"
    );
    let text = stdout(&producer(&["status", "--job", "budget", "--redis", &redis.url()]));
    let typed = text
        .split("Once the cause is fixed: ")
        .nth(1)
        .and_then(|rest| rest.lines().next())
        .unwrap_or_else(|| panic!("status says how to resume: {text}"));
    // The test Redis has a password: the command names the variable, never the password.
    assert_eq!(typed, "producer resume --job budget --redis \"$REDIS_URL\"");
    assert!(!text.contains(harness::TEST_REDIS_PASSWORD), "{text}");
    sim.outage(None, None);
    // Typed as written, with REDIS_URL set to the URL.
    let out = harness::typed(typed, &[("REDIS_URL", &redis.url())]);
    assert!(out.status.success(), "{}", harness::stderr(&out));
    let (exit, log) = Running::spawn(worker_cmd(&redis, "budget", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    let (code, s) = status_json(&redis, "budget");
    assert_eq!(
        (code, s["done"].as_u64(), s["review"].as_u64()),
        (Some(0), Some(40), Some(0)),
        "{s}"
    );
}

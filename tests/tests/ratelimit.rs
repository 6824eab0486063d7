//! Fleet-wide rate limits against llm-sim enforcing its own limits. llm-sim's
//! `/stats` is the judge, never the workers' own counters.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::path::PathBuf;
use std::time::{Duration, Instant};

use harness::{LlmSim, RedisServer, Running, TempDir, enqueue, spec_with, worker_cmd, write_records};
use redis::Commands;
use serde_json::Value;

const RPM: u64 = 3000;

struct Fleet {
    redis: RedisServer,
    sim: LlmSim,
    _dir: TempDir,
    workers: Vec<Running>,
}

/// A job of many records, a simulator enforcing `rpm`/`tpm`, and a spec that
/// tells the fleet the same limits.
fn fleet(rpm: u64, tpm: Option<u64>) -> Fleet {
    let redis = RedisServer::start();
    let mut sim_args = vec!["--latency-ms".to_owned(), "50".into(), "--rpm".into(), rpm.to_string()];
    if let Some(t) = tpm {
        sim_args.extend(["--tpm".into(), t.to_string()]);
    }
    let sim = LlmSim::start(&sim_args.iter().map(String::as_str).collect::<Vec<_>>());
    let dir = TempDir::new("ratelimit");
    let tokens = tpm.map_or("# no total token limit".to_owned(), |t| {
        format!("tokens_per_minute = {t}")
    });
    let spec: PathBuf = spec_with(
        &dir,
        &[
            ("requests_per_minute = 10000", &format!("requests_per_minute = {rpm}")),
            ("input_tokens_per_minute = 2000000", &tokens),
            ("output_tokens_per_minute = 500000", ""),
            ("max_concurrent = 64", ""),
        ],
    );
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 6000);
    enqueue(&redis, &data, "rl", &spec);
    Fleet {
        redis,
        sim,
        _dir: dir,
        workers: Vec::new(),
    }
}

impl Fleet {
    fn add_workers(&mut self, n: usize) {
        self.add_workers_of(n, 64);
    }

    fn add_workers_of(&mut self, n: usize, concurrency: usize) {
        for _ in 0..n {
            let cmd = worker_cmd(
                &self.redis,
                "rl",
                &self.sim,
                &["--concurrency", &concurrency.to_string()],
            );
            self.workers.push(Running::spawn(cmd));
        }
    }

    /// SIGTERM every worker; each must drain and exit 0. Returns their summaries.
    fn stop(&mut self) -> Vec<Value> {
        for w in &self.workers {
            let pid = w.pid().to_string();
            assert!(
                std::process::Command::new("kill")
                    .args(["-TERM", &pid])
                    .status()
                    .unwrap()
                    .success()
            );
        }
        let mut summaries = Vec::new();
        for w in self.workers.drain(..) {
            let (status, err) = w.finish(Duration::from_secs(60));
            assert!(status.success(), "worker: {err}");
            summaries.push(harness::worker_summary(&err).expect("a worker summary"));
        }
        summaries
    }

    fn snapshot(&self) -> Snapshot {
        let s = self.sim.stats();
        let get = |code: &str| s["by_status"][code].as_u64().unwrap_or(0);
        Snapshot {
            at: Instant::now(),
            accepted: get("200"),
            rejected: get("429"),
            tokens: s["prompt_tokens"].as_u64().unwrap() + s["completion_tokens"].as_u64().unwrap(),
        }
    }

    /// Commands Redis has processed so far (those scripts run included).
    fn commands(&self) -> u64 {
        let info: String = redis::cmd("INFO").arg("stats").query(&mut self.redis.conn()).unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix("total_commands_processed:"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    /// The shared buckets' `reserved` and `settled` token counters.
    fn reservations(&self) -> (i64, i64) {
        let mut c = self.redis.conn();
        let keys: Vec<String> = c.keys("bf:{rl:*}:buckets").unwrap();
        assert_eq!(keys.len(), 1, "one budget for one provider key/model: {keys:?}");
        let reserved: Option<i64> = c.hget(&keys[0], "reserved").unwrap();
        let settled: Option<i64> = c.hget(&keys[0], "settled").unwrap();
        (reserved.unwrap_or(0), settled.unwrap_or(0))
    }
}

struct Snapshot {
    at: Instant,
    accepted: u64,
    rejected: u64,
    tokens: u64,
}

struct Window {
    minutes: f64,
    accepted: u64,
    rejected: u64,
    tokens: u64,
}

fn window(a: &Snapshot, b: &Snapshot) -> Window {
    Window {
        minutes: b.at.duration_since(a.at).as_secs_f64() / 60.0,
        accepted: b.accepted - a.accepted,
        rejected: b.rejected - a.rejected,
        tokens: b.tokens - a.tokens,
    }
}

impl Window {
    fn request_utilization(&self, rpm: u64) -> f64 {
        self.accepted as f64 / (rpm as f64 * self.minutes)
    }
    fn rate_429(&self) -> f64 {
        self.rejected as f64 / (self.accepted + self.rejected).max(1) as f64
    }
}

fn run_for(secs: u64) {
    std::thread::sleep(Duration::from_secs(secs));
}

fn assert_fleet_within(w: &Window, utilization: f64, what: &str) {
    assert!(
        utilization >= 0.90,
        "{what}: utilization {utilization:.3} < 0.90 ({} accepted)",
        w.accepted
    );
    assert!(
        w.rate_429() <= 0.01,
        "{what}: 429 rate {:.4} > 1% ({} of {})",
        w.rate_429(),
        w.rejected,
        w.accepted + w.rejected
    );
}

#[test]
fn one_worker_uses_the_request_budget_without_429s() {
    let mut f = fleet(RPM, None);
    let a = f.snapshot();
    f.add_workers(1);
    run_for(40);
    let b = f.snapshot();
    let summaries = f.stop();
    let w = window(&a, &b);
    assert_fleet_within(&w, w.request_utilization(RPM), "1 worker");
    // The worker's own limiter metrics agree with what the provider saw.
    let l = &summaries[0]["limiters"]["rl"];
    assert!(l["grants"].as_u64().unwrap() >= w.accepted, "{l}");
    assert_eq!(l["rate_limited"], 0, "{l}");
    assert!(l["budget"]["requests"].is_number(), "current budget reported: {l}");
    let (reserved, settled) = f.reservations();
    assert!(reserved > 0);
    assert_eq!(reserved - settled, 0, "every reservation settled after the run");
}

#[test]
fn three_workers_share_one_token_budget() {
    // Tokens bind before requests: ~200 tokens a request, 200,000 a minute.
    let tpm = 200_000;
    let mut f = fleet(RPM, Some(tpm));
    let a = f.snapshot();
    f.add_workers(3);
    run_for(40);
    let b = f.snapshot();
    f.stop();
    let w = window(&a, &b);
    let token_utilization = w.tokens as f64 / (tpm as f64 * w.minutes);
    assert_fleet_within(&w, token_utilization, "3 workers, tokens/min-bound");
    assert!(
        w.request_utilization(RPM) < 0.5,
        "the token limit, not the request limit, was binding"
    );
    let (reserved, settled) = f.reservations();
    assert_eq!(
        reserved - settled,
        0,
        "reserved minus settled tokens is zero after the run"
    );
}

#[test]
fn scaling_from_one_to_four_workers_keeps_429s_down() {
    let mut f = fleet(RPM, None);
    let a = f.snapshot();
    f.add_workers(1);
    run_for(15);
    f.add_workers(3);
    run_for(20);
    let b = f.snapshot();
    let summaries = f.stop();
    let w = window(&a, &b);
    assert_fleet_within(&w, w.request_utilization(RPM), "1 -> 4 workers");
    // A throttled worker takes a stretch of the budget per ask and waits its
    // turn: the fleet asks far less than once per call, however many workers
    // (each ask on every refill or every call ended made 3-6 per call).
    let sum = |k: &str| -> u64 { summaries.iter().map(|s| s["limiters"]["rl"][k].as_u64().unwrap()).sum() };
    let (acquires, grants) = (sum("acquires"), sum("grants"));
    assert!(grants >= w.accepted, "{grants} grants, {} accepted", w.accepted);
    assert!(
        acquires as f64 <= 0.4 * grants as f64,
        "{acquires} acquires for {grants} grants: the fleet polls its budget"
    );
}

/// A worker whose slots hold less than the second of the rate grants may
/// be given ahead (32 slots, 50 calls a second) does not fill them all with
/// tasks waiting for their grants, then ask for one grant (and claim one
/// task) each time a call ends and frees a slot: it did, one acquire a call.
#[test]
fn a_worker_with_fewer_slots_than_a_second_of_the_rate_asks_for_stretches_of_it() {
    let mut f = fleet(RPM, None);
    f.add_workers_of(1, 32);
    run_for(5);
    let (a, commands_a) = (f.snapshot(), f.commands());
    run_for(20);
    let (b, commands_b) = (f.snapshot(), f.commands());
    let summaries = f.stop();
    let w = window(&a, &b);
    assert_fleet_within(&w, w.request_utilization(RPM), "1 worker of 32 slots");
    // Redis's own count, per call llm-sim accepted (asking once a call:
    // about 24; in stretches: under 10).
    let per_call = (commands_b - commands_a) as f64 / w.accepted.max(1) as f64;
    assert!(per_call <= 12.0, "{per_call:.1} Redis commands a model call");
    let l = &summaries[0]["limiters"]["rl"];
    let (acquires, grants) = (l["acquires"].as_u64().unwrap(), l["grants"].as_u64().unwrap());
    assert!(
        acquires as f64 <= 0.4 * grants as f64,
        "{acquires} acquires for {grants} grants: the worker asks once a call"
    );
}

#[test]
fn a_lowered_provider_limit_is_followed_within_seconds() {
    let mut f = fleet(RPM, None);
    f.add_workers(2);
    run_for(8);
    f.sim.set_limits(&serde_json::json!({"rpm": 1200}));
    run_for(4); // "within seconds"
    let a = f.snapshot();
    run_for(16);
    let b = f.snapshot();
    f.stop();
    let w = window(&a, &b);
    let rate = w.accepted as f64 / w.minutes;
    assert!(rate <= 1200.0 * 1.05, "still above the lowered limit: {rate:.0}/min");
    assert!(rate >= 1200.0 * 0.85, "the lowered limit is not used: {rate:.0}/min");
    assert!(w.rate_429() <= 0.01, "429 rate {:.4} after the change", w.rate_429());
    let stats: Value = f.sim.stats();
    assert!(stats["requests"].as_u64().unwrap() > 0);
}

/// What one fleet without `[limits]` did between its first minute and the end.
struct Learned {
    mode: &'static str,
    window: Window,
    review: u64,
    summaries: Vec<Value>,
    /// One worker's `/metrics` at the end.
    exposition: String,
}

/// The example spec with no `[limits]` at all.
fn spec_without_limits(dir: &TempDir) -> PathBuf {
    let spec = spec_with(
        dir,
        &[
            ("requests_per_minute = 10000", ""),
            ("input_tokens_per_minute = 2000000", ""),
            ("output_tokens_per_minute = 500000", ""),
            ("max_concurrent = 64", ""),
        ],
    );
    assert!(
        !std::fs::read_to_string(&spec).unwrap().contains("_per_minute ="),
        "the spec sets no limit"
    );
    spec
}

/// A job whose spec says nothing about limits, against llm-sim enforcing
/// `LEARN_RPM` and telling it only as `mode` does (`--limit-headers`): two
/// workers, a minute to learn, then 40 s measured.
fn learn(mode: &'static str) -> Learned {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[
        "--latency-ms",
        "50",
        "--rpm",
        &LEARN_RPM.to_string(),
        "--limit-headers",
        mode,
    ]);
    let dir = TempDir::new("learn");
    let spec = spec_without_limits(&dir);
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 4000);
    enqueue(&redis, &data, "rl", &spec);
    let mut f = Fleet {
        redis,
        sim,
        _dir: dir,
        workers: Vec::new(),
    };
    let metrics = format!("127.0.0.1:{}", harness::free_port());
    let cmd = worker_cmd(
        &f.redis,
        "rl",
        &f.sim,
        &["--concurrency", "64", "--metrics-addr", &metrics],
    );
    f.workers.push(Running::spawn(cmd));
    f.add_workers(1);
    run_for(60);
    let a = f.snapshot();
    run_for(40);
    let b = f.snapshot();
    let exposition = harness::http_get(&format!("http://{metrics}"), "/metrics").1;
    let summaries = f.stop();
    let (_, status) = harness::status_json(&f.redis, "rl");
    Learned {
        mode,
        window: window(&a, &b),
        review: status["review"].as_u64().unwrap(),
        summaries,
        exposition,
    }
}

const LEARN_RPM: u64 = 1200;

/// No `[limits]` at all: the fleet learns llm-sim's limit from whatever it
/// is told — LiteLLM's headers (limit and remaining, no reset; a 429 with
/// only `llm_provider-retry-after`), or nothing but bare 429s. Both run at
/// once; after the first minute 429s stay at most 2% of the requests, the
/// limit is used, and no record went to review for rate limits.
#[test]
fn without_limits_the_fleet_learns_them_from_headers_or_bare_429s() {
    let runs: Vec<_> = ["none", "litellm"]
        .into_iter()
        .map(|m| std::thread::spawn(move || learn(m)))
        .collect();
    let learned: Vec<Learned> = runs.into_iter().map(|h| h.join().unwrap()).collect();
    for l in &learned {
        let w = &l.window;
        let what = format!("--limit-headers {}", l.mode);
        assert!(
            w.rate_429() <= 0.02,
            "{what}: 429 rate {:.4} > 2% after the first minute ({} of {})",
            w.rate_429(),
            w.rejected,
            w.accepted + w.rejected
        );
        let util = w.request_utilization(LEARN_RPM);
        assert!(
            util >= 0.75,
            "{what}: utilization {util:.3} < 0.75 ({} accepted)",
            w.accepted
        );
        assert_eq!(l.review, 0, "{what}: no record in review (llm-sim injects no fault)");
        let budget = &l.summaries[0]["limiters"]["rl"]["budget"];
        if l.mode == "none" {
            // Nothing told it the limit: it learned one from the 429s.
            let learned = budget["learned_requests_per_minute"].as_f64();
            assert!(learned.is_some(), "{what}: a learned rate: {budget}");
            assert!(
                l.exposition
                    .contains("batchfleet_limit_learned{job=\"rl\",kind=\"requests_per_minute\"}"),
                "{what}: the learned rate is a metric"
            );
        }
        eprintln!(
            "{what}: utilization {util:.3}, 429 rate {:.4}, budget {budget}",
            w.rate_429()
        );
    }
}

/// A job whose spec sets no limit, against a provider that tells none (a
/// self-hosted server): nothing limits the key, so the worker runs on free
/// passes. It asks the buckets a few times a second, not once a claim
/// round, and no grant is counted in Redis (no slot, no reserved tokens,
/// no settlement), while every record is done.
#[test]
fn a_key_nothing_limits_costs_redis_nothing_per_grant() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    let dir = TempDir::new("free");
    let spec = spec_without_limits(&dir);
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 2000);
    enqueue(&redis, &data, "free", &spec);
    let cmd = worker_cmd(&redis, "free", &sim, &["--concurrency", "32", "--drain"]);
    let started = Instant::now();
    let (status, err) = Running::spawn(cmd).finish(Duration::from_secs(300));
    assert!(status.success(), "worker: {err}");
    let l = &harness::worker_summary(&err).expect("a worker summary")["limiters"]["free"];
    let (acquires, grants) = (l["acquires"].as_u64().unwrap(), l["grants"].as_u64().unwrap());
    assert!(grants >= 2000, "{l}");
    // A pass lasts 250 ms: at most four asks a second, and the first.
    let most = started.elapsed().as_secs_f64() * 4.0 + 2.0;
    assert!(
        acquires as f64 <= most,
        "a few asks a second, not one a claim round: {acquires} (at most {most:.0}) for {grants} grants"
    );
    let mut c = redis.conn();
    let keys: Vec<String> = c.keys("bf:{rl:*}:buckets").unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    let (reserved, settled): (Option<u64>, Option<u64>) = redis::cmd("HMGET")
        .arg(&keys[0])
        .arg("reserved")
        .arg("settled")
        .query(&mut c)
        .unwrap();
    assert_eq!((reserved, settled), (None, None), "no grant counted, none settled");
    let slots: u64 = c.zcard(keys[0].replace(":buckets", ":slots")).unwrap();
    assert_eq!(slots, 0);
    let (_, status) = harness::status_json(&redis, "free");
    assert_eq!(status["done"].as_u64(), Some(2000), "{status}");
    // What the provider saw: every record's call answered, none refused,
    // and no call without its grant.
    let seen = sim.stats();
    let answered = seen["by_status"]["200"].as_u64().unwrap_or(0);
    assert!((2000..=grants).contains(&answered), "{seen}");
    assert_eq!(seen["by_status"]["429"].as_u64().unwrap_or(0), 0, "{seen}");
}

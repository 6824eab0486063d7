//! Routes (`provider.tiers`, `job.deadline`): a job with the flex tier
//! sends its calls flex while the deadline leaves room, through llm-sim's
//! bursts of flex refusals, and moves calls to standard when the deadline
//! tightens; every call is in the ledger with its tier, model and price,
//! and no record is paid for twice.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use harness::{
    LlmSim, RedisServer, Running, TempDir, enqueue, producer, spec_with, status_json, worker_cmd, write_records,
};

/// A job of `n` records whose calls may go flex or standard.
fn routed_job(redis: &RedisServer, name: &str, n: u64, deadline: &str, rpm: &str) -> TempDir {
    let dir = TempDir::new(name);
    let data = dir.join("d.jsonl");
    write_records(&data, 0, n);
    let spec = spec_with(
        &dir,
        &[
            (
                "partitions = 4 ",
                &format!("partitions = 4\ndeadline = \"{deadline}\" "),
            ),
            (
                "structured_output = \"auto\"",
                "structured_output = \"auto\"\ntiers = [\"flex\", \"standard\"]",
            ),
            ("requests_per_minute = 10000", &format!("requests_per_minute = {rpm}")),
            ("base_delay_ms = 500", "base_delay_ms = 10"),
            ("max_delay_ms = 30000", "max_delay_ms = 50"),
        ],
    );
    enqueue(redis, &data, name, &spec);
    dir
}

/// llm-sim refusing 40% of flex requests in bursts of 3.
fn flex_refusing() -> LlmSim {
    LlmSim::start(&["--flex-unavailable", "0.4", "--flex-burst", "3", "--seed", "7"])
}

/// Every paid call of the job (`export --what ledger`), and the calls per record.
fn ledger(redis: &RedisServer, job: &str) -> (Vec<serde_json::Value>, BTreeMap<String, u64>) {
    let out = producer(&[
        "export",
        "--job",
        job,
        "--what",
        "ledger",
        "--out",
        "-",
        "--redis",
        &redis.url(),
    ]);
    assert!(out.status.success(), "{}", harness::stderr(&out));
    let calls: Vec<serde_json::Value> = harness::stdout(&out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut per_record = BTreeMap::new();
    for c in &calls {
        *per_record
            .entry(c["record_id"].as_str().unwrap().to_owned())
            .or_default() += 1;
    }
    (calls, per_record)
}

/// llm-sim's counts of one tier: requests and refusals.
fn tier_seen(sim: &LlmSim, tier: &str) -> (u64, u64) {
    let t = &sim.stats()["by_tier"][tier];
    (t["requests"].as_u64().unwrap_or(0), t["refused"].as_u64().unwrap_or(0))
}

#[test]
fn with_room_before_the_deadline_every_record_goes_flex_through_refusals_at_the_flex_price() {
    let redis = RedisServer::start();
    let sim = flex_refusing();
    let n = 120;
    let _dir = routed_job(&redis, "roomy", n, "1h", "10000");
    let (exit, log) = Running::spawn(worker_cmd(&redis, "roomy", &sim, &["--drain"])).finish(Duration::from_secs(90));
    assert!(exit.success(), "{log}");

    let (_, s) = status_json(&redis, "roomy");
    assert_eq!((s["done"].as_u64(), s["review"].as_u64()), (Some(n), Some(0)), "{s}");
    // llm-sim saw flex alone, refusals included, and one answer per record.
    let (requests, refused) = tier_seen(&sim, "flex");
    assert!(refused >= 10, "llm-sim refused {refused} of {requests}");
    assert_eq!(requests - refused, n);
    assert_eq!(
        tier_seen(&sim, "default"),
        (0, 0),
        "nothing went standard with an hour to spare"
    );
    // The status: every record through flex, at half the standard price.
    let routes = &s["routes"];
    assert_eq!(routes["records"], serde_json::json!({"flex": n}), "{routes}");
    assert_eq!(routes["spend"]["flex"]["calls"], n, "{routes}");
    let ratio = routes["cost_ratio_vs_standard"].as_f64().unwrap();
    assert!(
        (ratio - 0.5).abs() < 1e-4,
        "flex costs the batch price, half (to the nano-dollar): {ratio}"
    );
    assert_eq!(s["deadline"]["holds"], true, "{s}");
    // The ledger: one paid call per record (a refusal is not billed), each
    // with its tier, model and prices.
    let (calls, per_record) = ledger(&redis, "roomy");
    assert_eq!(calls.len() as u64, n);
    assert!(per_record.values().all(|&c| c == 1), "{per_record:?}");
    for c in &calls {
        assert_eq!(
            (c["tier"].as_str(), c["model"].as_str()),
            (Some("flex"), Some("gpt-4o-mini")),
            "{c}"
        );
    }
    let report = producer(&["report", "--job", "roomy", "--redis", &redis.url()]);
    let text = harness::stdout(&report);
    assert!(text.contains("by route") && text.contains("flex"), "{text}");
    // The estimate's plan for a dataset ten times the size: flex, at about half.
    let estimate = producer(&[
        "estimate",
        "--job",
        "roomy",
        "--records",
        "1200",
        "--json",
        "--redis",
        &redis.url(),
    ]);
    assert!(estimate.status.success(), "{}", harness::stderr(&estimate));
    let plan = serde_json::from_str::<serde_json::Value>(&harness::stdout(&estimate)).unwrap()["plan"].clone();
    let acceptance = plan["flex_acceptance"].as_f64().unwrap();
    assert!(acceptance > 0.4 && acceptance < 0.95, "the sample's refusals: {plan}");
    assert_eq!(plan["standard_share"], 0.0, "{plan}");
    let ratio = plan["cost_usd"].as_f64().unwrap() / plan["all_standard_cost_usd"].as_f64().unwrap();
    assert!((ratio - 0.5).abs() < 0.01, "{plan}");
    let text = harness::stdout(&producer(&[
        "estimate",
        "--job",
        "roomy",
        "--records",
        "1200",
        "--redis",
        &redis.url(),
    ]));
    assert!(text.contains("plan cost") && text.contains("of all-standard"), "{text}");
}

#[test]
fn a_tightened_deadline_moves_calls_to_standard_and_the_job_ends_in_time_paying_once_per_record() {
    let redis = RedisServer::start();
    let sim = flex_refusing();
    let n = 400;
    // 20 calls a second: flex alone settles ~12 records a second.
    let _dir = routed_job(&redis, "tight", n, "1h", "1200");
    let metrics = format!("127.0.0.1:{}", harness::free_port());
    let worker = Running::spawn(worker_cmd(
        &redis,
        "tight",
        &sim,
        &["--drain", "--metrics-addr", &metrics],
    ));
    let started = Instant::now();
    harness::wait_for("the first records", Duration::from_secs(30), || {
        status_json(&redis, "tight").1["done"].as_u64().unwrap_or(0) >= 40
    });
    let standard_before = tier_seen(&sim, "default").0;
    // Flex alone would take ~30 s more, past the margin; all standard ~18 s.
    let moved = producer(&["deadline", "--job", "tight", "30s", "--redis", &redis.url()]);
    assert!(moved.status.success(), "{}", harness::stderr(&moved));
    assert!(
        harness::stdout(&moved).contains("re-plan"),
        "{}",
        harness::stdout(&moved)
    );
    let (_, s) = status_json(&redis, "tight");
    let deadline_ms = s["deadline"]["at_ms"].as_u64().unwrap();
    // The dashboard sees the plan move: a share of the calls standard.
    let gauge = |figure: &str| {
        let text = harness::http_get(&format!("http://{metrics}"), "/metrics").1;
        let line = format!("batchfleet_plan{{figure=\"{figure}\",job=\"tight\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(line.as_str())?.parse::<f64>().ok())
    };
    harness::wait_for("the plan's standard share on /metrics", Duration::from_secs(20), || {
        gauge("standard_share").is_some_and(|share| share > 0.0)
    });
    let left = gauge("deadline_left_seconds").unwrap();
    assert!(left > 0.0 && left <= 30.0, "{left}");
    assert!(gauge("flex_acceptance").is_some_and(|a| a > 0.3 && a < 0.95));
    let (exit, log) = worker.finish(Duration::from_secs(120));
    let ended_ms = common::route::now_ms();
    assert!(exit.success(), "{log}");
    assert!(
        ended_ms <= deadline_ms,
        "ended {} ms past the deadline ({:?} after the start)",
        ended_ms - deadline_ms,
        started.elapsed()
    );
    assert!(log.contains("the plan changed"), "{log}");

    let (_, s) = status_json(&redis, "tight");
    assert_eq!(
        (s["done"].as_u64(), s["complete"].as_bool()),
        (Some(n), Some(true)),
        "{s}"
    );
    assert_eq!(standard_before, 0, "with an hour left every call was flex");
    let (standard, _) = tier_seen(&sim, "default");
    let (flex, refused) = tier_seen(&sim, "flex");
    assert!(
        standard > 0 && flex - refused > 0,
        "standard {standard}, flex {flex} ({refused} refused)"
    );
    assert_eq!(standard + flex - refused, n, "one answer per record");
    let routes = &s["routes"];
    let records = &routes["records"];
    assert_eq!(
        records["flex"].as_u64().unwrap() + records["standard"].as_u64().unwrap(),
        n,
        "{routes}"
    );
    let ratio = routes["cost_ratio_vs_standard"].as_f64().unwrap();
    assert!(ratio > 0.5 && ratio < 1.0, "part flex, part standard: {ratio}");
    eprintln!(
        "ended {} s before the deadline; {standard} standard, {flex} flex ({refused} refused); cost {ratio:.3} of all-standard",
        (deadline_ms - ended_ms) / 1000
    );
    assert_eq!(s["deadline"]["holds"], true, "{s}");
    let (calls, per_record) = ledger(&redis, "tight");
    assert_eq!(calls.len() as u64, n, "never paid twice");
    assert!(per_record.values().all(|&c| c == 1));
    let tiers: BTreeMap<&str, u64> = calls.iter().fold(BTreeMap::new(), |mut m, c| {
        *m.entry(c["tier"].as_str().unwrap()).or_default() += 1;
        m
    });
    assert_eq!(tiers.get("standard").copied(), Some(standard), "{tiers:?}");
    let text = harness::stdout(&producer(&["status", "--job", "tight", "--redis", &redis.url()]));
    assert!(
        text.contains("deadline") && text.contains("holds") && text.contains("vs standard"),
        "{text}"
    );

    // A deadline already passed is refused, with the command to type.
    let passed = producer(&[
        "deadline",
        "--job",
        "tight",
        "2020-01-01T00:00:00Z",
        "--redis",
        &redis.url(),
    ]);
    assert_eq!(passed.status.code(), Some(2), "{}", harness::stderr(&passed));
    let err = harness::stderr(&passed);
    assert!(
        err.contains("has passed") && err.contains("producer deadline --job tight 30m"),
        "{err}"
    );
    let nonsense = producer(&["deadline", "--job", "tight", "soon", "--redis", &redis.url()]);
    assert!(
        harness::stderr(&nonsense).contains("neither a duration"),
        "{}",
        harness::stderr(&nonsense)
    );
}

/// A job with a fallback provider (`[[provider.fallbacks]]`, a second
/// llm-sim at its own prices): the primary goes down mid-job (30 s of
/// 503s); the fleet takes it for down and the fallback answers the rest,
/// while one probe at a time asks the primary. Nothing waits out the
/// outage, nothing is paid twice, and each call is in the ledger under its
/// route, model and prices.
#[test]
fn while_the_primary_is_down_the_fallback_answers_and_every_record_is_paid_once() {
    let redis = RedisServer::start();
    let primary = LlmSim::start(&["--outage", "unavailable:40:30"]);
    let backup = LlmSim::start(&[]);
    let n = 300;
    let prices = "model = \"gpt-4o\"\n[provider.fallbacks.prices]\ninput_per_mtok = 2.5\noutput_per_mtok = 10.0";
    let _dir = fallback_job(&redis, ("fb", n), &backup, (prices, ""));
    let started = Instant::now();
    let (exit, log) = Running::spawn(worker_cmd(&redis, "fb", &primary, &["--drain"])).finish(Duration::from_secs(120));
    assert!(exit.success(), "{log}");
    let took = started.elapsed();

    let (_, s) = status_json(&redis, "fb");
    assert_eq!(
        (s["done"].as_u64(), s["review"].as_u64(), s["complete"].as_bool()),
        (Some(n), Some(0), Some(true)),
        "{s}"
    );
    let (by_primary, by_backup) = (
        primary.stats()["served"].as_u64().unwrap(),
        backup.stats()["served"].as_u64().unwrap(),
    );
    assert!(
        by_backup >= 100,
        "the fallback answered {by_backup}, the primary {by_primary}"
    );
    assert_eq!(by_primary + by_backup, n, "one answer per record");
    assert!(
        took < Duration::from_secs(30),
        "the job waited out the primary's outage: {took:?}"
    );
    let records = &s["routes"]["records"];
    assert_eq!(records["backup"].as_u64(), Some(by_backup), "{s}");
    assert_eq!(records["standard"].as_u64(), Some(by_primary), "{s}");
    let (calls, per_record) = ledger(&redis, "fb");
    assert_eq!(calls.len() as u64, n, "never paid twice");
    assert!(per_record.values().all(|&c| c == 1));
    for c in &calls {
        let expected = if c["tier"] == "backup" { "gpt-4o" } else { "gpt-4o-mini" };
        assert_eq!(c["model"].as_str(), Some(expected), "{c}");
    }
    // The fallback's calls cost its prices: more than standard, compared in the status.
    let backup_spend = &s["routes"]["spend"]["backup"];
    assert!(
        backup_spend["cost_usd"].as_f64().unwrap() > 10.0 * backup_spend["standard_cost_usd"].as_f64().unwrap(),
        "{backup_spend}"
    );
    assert!(s["routes"]["cost_ratio_vs_standard"].as_f64().unwrap() > 1.0, "{s}");
    for c in results_attempts(&redis, "fb") {
        assert_eq!(c, 1, "an outage used an attempt");
    }
}

/// A provider down from the job's first call (never proven, so one call
/// at a time to it): the fallback still takes all the work at its own
/// pace, and the job does not halt when the outage outlasts its budget.
#[test]
fn a_provider_down_from_the_start_leaves_the_whole_job_to_the_fallback_past_the_outage_budget() {
    let redis = RedisServer::start();
    let primary = LlmSim::start(&["--outage", "unavailable:0:120"]);
    let backup = LlmSim::start(&[]);
    let n = 150;
    let _dir = fallback_job(
        &redis,
        ("fbs", n),
        &backup,
        ("model = \"gpt-4o-mini\"", "\noutage_budget_secs = 2"),
    );
    let (exit, log) =
        Running::spawn(worker_cmd(&redis, "fbs", &primary, &["--drain"])).finish(Duration::from_secs(120));
    assert!(exit.success(), "{log}");
    let (_, s) = status_json(&redis, "fbs");
    assert_eq!((s["done"].as_u64(), s["halted"].as_str()), (Some(n), None), "{s}");
    assert_eq!(primary.stats()["served"], 0);
    assert_eq!(backup.stats()["served"].as_u64(), Some(n), "one answer per record");
    assert_eq!(s["routes"]["records"]["backup"].as_u64(), Some(n), "{s}");
    // More than one call at a time went to the fallback.
    assert!(
        backup.stats()["max_in_flight"].as_u64().unwrap() > 1,
        "{}",
        backup.stats()
    );
}

/// A job `name` of `n` records with `backup` as its fallback
/// (`fallback`: its model and prices; `retry`: more `[retry]` keys), retries
/// quick.
fn fallback_job(
    redis: &RedisServer,
    (name, n): (&str, u64),
    backup: &LlmSim,
    (fallback, retry): (&str, &str),
) -> TempDir {
    let dir = TempDir::new(name);
    let data = dir.join("d.jsonl");
    write_records(&data, 0, n);
    let section = format!(
        "\n[[provider.fallbacks]]\nname = \"backup\"\nbase_url = \"{}\"\n{fallback}\n\n[limits]",
        backup.base_url()
    );
    let spec = spec_with(
        &dir,
        &[
            ("\n[limits]", &section),
            ("base_delay_ms = 500", "base_delay_ms = 10"),
            ("max_delay_ms = 30000", &format!("max_delay_ms = 200{retry}")),
        ],
    );
    enqueue(redis, &data, name, &spec);
    dir
}

/// Attempts of every committed result of a job.
fn results_attempts(redis: &RedisServer, job: &str) -> Vec<u64> {
    let mut c = redis.conn();
    let mut out = Vec::new();
    for p in 0..4 {
        let results: Vec<String> = redis::cmd("HVALS")
            .arg(common::keys::results(job, p))
            .query(&mut c)
            .unwrap();
        out.extend(results.iter().map(|r| {
            serde_json::from_str::<serde_json::Value>(r).unwrap()["attempts"]
                .as_u64()
                .unwrap()
        }));
    }
    out
}

/// The batch tier (`"batch"` among the tiers): with days to the deadline,
/// records go into batch shards; the deadline tightened to a minute no
/// longer leaves the batch's window, so the running batches are cancelled,
/// the lines they answered settle at the batch price, and the rest go
/// online (flex, then standard as needed) and end in time. No record is
/// both answered in a batch and sent online: one paid call per record.
#[test]
fn a_deadline_that_no_longer_leaves_the_batch_window_cancels_the_shards_mid_way_and_sends_the_rest_online() {
    let redis = RedisServer::start();
    // Each batch answers its lines evenly over 40 s.
    let sim = LlmSim::start(&["--batch-secs", "40", "--flex-unavailable", "0.2", "--seed", "3"]);
    let dir = TempDir::new("batch-tier");
    let data = dir.join("d.jsonl");
    let n = 200;
    write_records(&data, 0, n);
    let spec = spec_with(
        &dir,
        &[
            ("partitions = 4 ", "partitions = 4\ndeadline = \"3d\" "),
            (
                "structured_output = \"auto\"",
                "structured_output = \"auto\"\ntiers = [\"batch\", \"flex\", \"standard\"]",
            ),
            (
                "[retry]",
                "[batch]\nshard_records = 50\npoll_secs = 1\npack_wait_secs = 1\n\n[retry]",
            ),
            ("base_delay_ms = 500", "base_delay_ms = 10"),
            ("max_delay_ms = 30000", "max_delay_ms = 50"),
        ],
    );
    enqueue(&redis, &data, "bt", &spec);
    let worker = Running::spawn(worker_cmd(&redis, "bt", &sim, &["--drain"]));
    // The shards are submitted and their batches have answered some lines.
    harness::wait_for("batches under way", Duration::from_secs(60), || {
        let s = status_json(&redis, "bt").1;
        let submitted = s["shards"]
            .as_array()
            .is_some_and(|a| !a.is_empty() && a.iter().all(|sh| sh["state"] == "submitted"));
        submitted && sim.stats()["served"].as_u64().unwrap_or(0) >= 30
    });
    let (_, s) = status_json(&redis, "bt");
    assert_eq!(
        (s["done"].as_u64(), s["batched"].as_u64()),
        (Some(0), Some(n)),
        "every record in a shard: {s}"
    );
    assert_eq!(tier_seen(&sim, "flex"), (0, 0), "nothing online while the batches run");
    let moved = producer(&["deadline", "--job", "bt", "60s", "--redis", &redis.url()]);
    assert!(moved.status.success(), "{}", harness::stderr(&moved));
    let deadline_ms = status_json(&redis, "bt").1["deadline"]["at_ms"].as_u64().unwrap();
    let (exit, log) = worker.finish(Duration::from_secs(120));
    let ended_ms = common::route::now_ms();
    assert!(exit.success(), "{log}");
    assert!(
        ended_ms <= deadline_ms,
        "ended {} ms past the deadline",
        ended_ms - deadline_ms
    );
    assert!(
        log.contains("the deadline no longer leaves the batch's completion window"),
        "{log}"
    );

    let (_, s) = status_json(&redis, "bt");
    assert_eq!(
        (s["done"].as_u64(), s["complete"].as_bool()),
        (Some(n), Some(true)),
        "{s}"
    );
    let records = &s["routes"]["records"];
    let per = |t: &str| records[t].as_u64().unwrap_or(0);
    assert!(per("batch") >= 30, "the batches' answered lines settled: {records}");
    assert!(per("flex") + per("standard") > 0, "the rest went online: {records}");
    assert_eq!(per("batch") + per("flex") + per("standard"), n, "{records}");
    // Every shard's batch was cancelled mid-way, its answered lines kept.
    let shards = s["shards"].to_string();
    assert!(shards.contains("cancelled"), "{shards}");
    let (calls, per_record) = ledger(&redis, "bt");
    assert_eq!(calls.len() as u64, n, "never paid twice");
    assert!(per_record.values().all(|&c| c == 1), "{per_record:?}");
    let batch_calls = calls.iter().filter(|c| c["tier"] == "batch").count() as u64;
    assert_eq!(batch_calls, per("batch"));
    for a in results_attempts(&redis, "bt") {
        assert_eq!(a, 1);
    }
}

//! Spend control (#13): the cost ledger (every paid call, recorded once,
//! never changed by what people do with the records afterwards), the job's
//! cap (never passed; halts with reason `budget`; `resume --budget` raises
//! it) and a record's own caps (to review as `budget` instead of another
//! paid call). Against llm-sim, whose `/stats` counts every answer it
//! generated.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::io::Write;
use std::process::Command;
use std::time::Duration;

use common::keys;
use harness::{
    LlmSim, RedisServer, Running, TempDir, bin, enqueue, free_port, http_get, producer, spec_with, status_json, stderr,
    stdout, worker_cmd, write_records,
};
use serde_json::Value;

const P: u32 = 4;

fn report(redis: &RedisServer, job: &str) -> Value {
    let out = producer(&["report", "--job", job, "--redis", &redis.url(), "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn review(redis: &RedisServer, job: &str, args: &[&str]) -> std::process::Output {
    Command::new(bin("producer"))
        .args(["review", "--job", job, "--redis", &redis.url(), "--reviewer", "alice"])
        .args(args)
        .output()
        .unwrap()
}

fn drain(redis: &RedisServer, job: &str, sim: &LlmSim, extra: &[&str]) -> (Option<i32>, String) {
    let mut args = vec!["--drain"];
    args.extend_from_slice(extra);
    let (status, log) = Running::spawn(worker_cmd(redis, job, sim, &args)).finish(Duration::from_secs(120));
    (status.code(), log)
}

fn ledger_len(redis: &RedisServer, job: &str) -> u64 {
    let mut c = redis.conn();
    (0..P)
        .map(|p| {
            redis::cmd("HLEN")
                .arg(keys::ledger(job, p))
                .query::<u64>(&mut c)
                .unwrap()
        })
        .sum()
}

/// The job's outcome counters, as the store reads them.
fn job_stats(redis: &RedisServer, job: &str) -> common::stats::JobStats {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let store = common::store::RedisStore::connect(&redis.url()).await.unwrap();
        store.stats(job, P).await.unwrap()
    })
}

fn nano(usd: &Value) -> i64 {
    (usd.as_f64().unwrap() * 1e9).round() as i64
}

#[test]
fn the_ledger_keeps_every_paid_call_by_cause_and_review_never_changes_the_past() {
    let redis = RedisServer::start();
    let dir = TempDir::new("ledger");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 40);
    // One line the enqueue refuses: status counts it apart from the records.
    writeln!(
        std::fs::OpenOptions::new().append(true).open(&data).unwrap(),
        "{{not json"
    )
    .unwrap();
    let spec = spec_with(&dir, &[("max_attempts = 4", "max_attempts = 2")]);
    enqueue(&redis, &data, "led", &spec);
    // Refusals go to review at once; 5xx answers wait and retry (no attempt).
    let sim = LlmSim::start(&[
        "--faults",
        "missing_field=0.4,server_error=0.15,content_filter=0.3",
        "--seed",
        "4",
    ]);
    let (code, log) = drain(&redis, "led", &sim, &[]);
    assert_eq!(code, Some(0), "{log}");

    let r1 = report(&redis, "led");
    let spend = &r1["spend"];
    // Every answer llm-sim generated is one ledger entry; 5xx answers bill nothing.
    assert_eq!(spend["calls"], sim.stats()["served"], "{r1}");
    assert_eq!(spend["calls"].as_u64().unwrap(), ledger_len(&redis, "led"));
    assert_eq!(spend["estimated_calls"], 0);
    let bucket = |s: &Value, b: &str| s["by_bucket"][b]["calls"].as_u64().unwrap_or(0);
    assert!(
        bucket(spend, "first") > 0 && bucket(spend, "validation_retry") > 0,
        "{spend}"
    );
    assert!(bucket(spend, "transient_retry") > 0, "a retry after a 5xx: {spend}");
    assert_eq!(
        bucket(spend, "first") + bucket(spend, "transient_retry") + bucket(spend, "validation_retry"),
        spend["calls"].as_u64().unwrap()
    );
    let by_bucket_cost: i64 = spend["by_bucket"]
        .as_object()
        .unwrap()
        .values()
        .map(|b| nano(&b["cost_usd"]))
        .sum();
    assert_eq!(by_bucket_cost, nano(&spend["cost_usd"]));
    assert_eq!(r1["total"]["calls"], spend["calls"]);
    // The ledger itself, one line per paid call: its costs add up to the counters.
    let out_file = dir.join("ledger.jsonl");
    let out = producer(&[
        "export",
        "--job",
        "led",
        "--redis",
        &redis.url(),
        "--out",
        out_file.to_str().unwrap(),
        "--what",
        "ledger",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let calls: Vec<Value> = std::fs::read_to_string(&out_file)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(calls.len() as u64, spend["calls"].as_u64().unwrap());
    assert_eq!(
        calls.iter().map(|c| nano(&c["cost_usd"])).sum::<i64>(),
        nano(&spend["cost_usd"])
    );
    assert!(
        calls
            .iter()
            .all(|c| c["fate"] == "settled" && c["usage"]["prompt_tokens"].as_u64().unwrap() > 0)
    );

    // Status shows the same spend (every paid call, the records in review too)
    // and the refused line apart from the records.
    let (_, s) = status_json(&redis, "led");
    // The outcome counters (what a page shows of a job of any size) agree
    // with the scan of every record's history.
    let st = job_stats(&redis, "led");
    assert_eq!(
        serde_json::to_value(&st.errors).unwrap(),
        r1["validation_errors"],
        "{st:?}"
    );
    assert!(!st.errors.is_empty() && !st.retries.is_empty(), "{st:?}");
    assert_eq!(serde_json::to_value(&st.retries).unwrap(), r1["retries_by_cause"]);
    assert_eq!(serde_json::to_value(&st.attempts).unwrap(), s["attempts_histogram"]);
    let minutes = st.timeline.values();
    let (done, failed, calls, nusd) = minutes.fold((0, 0, 0, 0), |t, m| {
        (t.0 + m.done, t.1 + m.failed, t.2 + m.calls, t.3 + m.nusd)
    });
    assert_eq!((Some(done), Some(calls)), (s["done"].as_u64(), spend["calls"].as_u64()));
    assert_eq!(
        Some(failed),
        s["review"].as_u64().map(|r| r + s["dropped"].as_u64().unwrap())
    );
    assert_eq!(nusd as i64, nano(&spend["cost_usd"]));
    assert_eq!(s["tokens"]["prompt"], spend["prompt_tokens"], "{s}");
    assert_eq!(s["tokens"]["completion"], spend["completion_tokens"], "{s}");
    assert_eq!(nano(&s["cost_usd"]), nano(&spend["cost_usd"]));
    assert_eq!(s["dropped_at_enqueue"], 1, "{s}");
    assert_eq!(s["expected"], 40);

    // People act on the review queue: what was spent does not change.
    let listed = review(&redis, "led", &["list", "--jsonl"]);
    let entries: Vec<Value> = stdout(&listed)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(entries.len() >= 3, "{} in review", entries.len());
    let id = |i: usize| entries[i]["record_id"].as_str().unwrap().to_owned();
    let good = dir.join("good.json");
    std::fs::write(
        &good,
        r#"{"label": "billing", "reason": "checked by a person", "confidence": 1.0, "task_type": "classify"}"#,
    )
    .unwrap();
    for args in [
        vec!["reject", &id(0), "--reason", "spam"],
        vec!["requeue", &id(1), "--note", "try again"],
        vec!["accept", &id(2), "--output", good.to_str().unwrap()],
    ] {
        let out = review(&redis, "led", &args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
    }
    let r2 = report(&redis, "led");
    assert_eq!(r2["spend"], r1["spend"], "review never changes what was spent");
    assert_eq!(r2["total"], r1["total"]);
    assert_eq!(r2["human_accepted"], 1);
    assert!(r2["accepted_by_people"]["calls"].as_u64().unwrap() >= 1, "{r2}");

    // The requeued record's new calls are human remediation, on top.
    let (code, log) = drain(&redis, "led", &sim, &[]);
    assert_eq!(code, Some(0), "{log}");
    let r3 = report(&redis, "led");
    let human = bucket(&r3["spend"], "human");
    assert!(human >= 1, "{}", r3["spend"]);
    assert_eq!(
        r3["spend"]["calls"].as_u64().unwrap(),
        r1["spend"]["calls"].as_u64().unwrap() + human
    );
    assert!(nano(&r3["spend"]["cost_usd"]) > nano(&r1["spend"]["cost_usd"]));
    assert_eq!(r3["spend"]["calls"], sim.stats()["served"]);
}

fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
}

#[test]
fn a_job_budget_is_never_passed_halts_the_job_and_resume_raises_it() {
    let redis = RedisServer::start();
    let dir = TempDir::new("budget");
    let data = dir.join("d.jsonl");
    let records = 200;
    write_records(&data, 0, records);
    let cap = 0.004;
    let spec = spec_with(
        &dir,
        &[("[prices]", &format!("[budget]\nmax_cost_usd = {cap}\n\n[prices]"))],
    );
    enqueue(&redis, &data, "bud", &spec);
    let sim = LlmSim::start(&["--latency-ms", "50"]);

    // Two workers share the cap; halted before it would pass: each exits 3 (halted).
    let workers: Vec<Running> = (0..2)
        .map(|_| Running::spawn(worker_cmd(&redis, "bud", &sim, &["--drain", "--concurrency", "4"])))
        .collect();
    let logs: Vec<(Option<i32>, String)> = workers
        .into_iter()
        .map(|w| {
            let (status, log) = w.finish(Duration::from_secs(120));
            (status.code(), log)
        })
        .collect();
    for (code, log) in &logs {
        assert_eq!(*code, Some(3), "{log}");
    }
    assert!(
        logs.iter().any(|(_, log)| log.contains("job halted on its budget")),
        "{}",
        logs[0].1
    );
    let (_, s) = status_json(&redis, "bud");
    assert!(s["halted"].as_str().unwrap().starts_with("budget: "), "{s}");
    let done = s["done"].as_u64().unwrap();
    assert!(done > 10 && done < records, "{s}");
    let r = report(&redis, "bud");
    let spent = r["spend"]["cost_usd"].as_f64().unwrap();
    assert!(spent <= cap, "spent {spent} of {cap}");
    assert!(spent > cap / 2.0, "stopped only near the cap: {spent} of {cap}");
    // The fleet's count against the cap is the ledger's, exactly; nothing is left reserved.
    let b = &s["budget"];
    assert_eq!(nano(&b["spent_usd"]), nano(&r["spend"]["cost_usd"]), "{s}");
    assert_eq!(b["reserved_usd"], 0.0, "{s}");
    assert_eq!(b["cap_usd"], cap);
    assert_eq!(r["spend"]["calls"], sim.stats()["served"]);

    // The halt shows in the metrics.
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut w = Running::spawn(worker_cmd(&redis, "bud", &sim, &["--metrics-addr", &addr]));
    harness::wait_for("worker metrics", Duration::from_secs(10), || {
        std::net::TcpStream::connect(&addr).is_ok()
    });
    let (_, text) = http_get(&addr, "/metrics");
    assert_eq!(
        metric(&text, "batchfleet_halted_on_budget{job=\"bud\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "batchfleet_spend_usd{job=\"bud\",kind=\"budget\"}"),
        Some(cap)
    );
    let spent_metric = metric(&text, "batchfleet_spend_usd{job=\"bud\",kind=\"spent\"}").unwrap();
    assert!((spent_metric - spent).abs() < 1e-12, "{text}");
    harness::signal(w.pid(), "TERM");
    harness::wait_exit(&mut w.child, Duration::from_secs(30));

    // Resume needs a new cap, above what was spent.
    let url = redis.url();
    let out = producer(&["resume", "--job", "bud", "--redis", &url]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--budget"), "{}", stderr(&out));
    let out = producer(&["resume", "--job", "bud", "--redis", &url, "--budget", "0.001"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("already spent"), "{}", stderr(&out));
    let out = producer(&["resume", "--job", "bud", "--redis", &url, "--budget", "1.0"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let (code, log) = drain(&redis, "bud", &sim, &["--concurrency", "4"]);
    assert_eq!(code, Some(0), "{log}");
    let (_, s) = status_json(&redis, "bud");
    assert_eq!(s["complete"], true, "{s}");
    assert_eq!(s["done"], records, "{s}");
    let r = report(&redis, "bud");
    assert!(r["spend"]["cost_usd"].as_f64().unwrap() <= 1.0);
    assert_eq!(nano(&s["budget"]["spent_usd"]), nano(&r["spend"]["cost_usd"]), "{s}");
    assert_eq!(
        r["spend"]["calls"],
        sim.stats()["served"],
        "no call paid twice, none lost"
    );
}

#[test]
fn a_record_whose_next_call_could_pass_its_cap_goes_to_review_as_budget() {
    let redis = RedisServer::start();
    let dir = TempDir::new("record-budget");
    let data = dir.join("d.jsonl");
    let records = 30;
    write_records(&data, 0, records);
    // The first call of each record, at its most (every byte a token and
    // max_tokens), fits under the cap; a second one never does.
    let example = common::spec::JobSpec::load(harness::example_spec().to_str().unwrap()).unwrap();
    let system = common::spec::system_prompt(&example);
    let user = common::template::Template::parse(&example.prompt.user).unwrap();
    let forms = worker::form::Forms::new(&example, "http://sim/v1", None);
    let first_call_at_most = (0..records)
        .map(|i| {
            let line: Value = serde_json::from_str(&harness::record_line(
                &format!("msg-{i}"),
                &format!("message number {i}"),
            ))
            .unwrap();
            let rendered = user.render(line.as_object().unwrap()).unwrap();
            let most = worker::budget::at_most(
                &example,
                &[&system, &rendered, ""],
                forms.format_bytes(forms.current().0),
            );
            most.prompt + most.completion
        })
        .max()
        .unwrap();
    let cap = first_call_at_most + 100;
    let spec = spec_with(
        &dir,
        &[(
            "[prices]",
            &format!("[budget]\nmax_tokens_per_record = {cap}\n\n[prices]"),
        )],
    );
    enqueue(&redis, &data, "rec", &spec);
    let sim = LlmSim::start(&["--faults", "missing_field=0.5", "--seed", "8"]);
    let (code, log) = drain(&redis, "rec", &sim, &[]);
    assert_eq!(code, Some(0), "{log}");
    let (_, s) = status_json(&redis, "rec");
    assert_eq!(s["complete"], true, "{s}");
    let r = report(&redis, "rec");
    let in_review = s["review"].as_u64().unwrap();
    assert!(in_review > 0, "{s}");
    assert_eq!(r["review_by_reason"]["budget"], in_review, "{r}");
    // One call per record, never a second past the cap.
    assert_eq!(r["spend"]["calls"], records, "{r}");
    assert_eq!(r["attempts_histogram"]["1"], records, "{r}");
    let listed = review(&redis, "rec", &["list", "--jsonl"]);
    for line in stdout(&listed).lines() {
        let e: Value = serde_json::from_str(line).unwrap();
        let tokens: u64 = e["history"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|h| h.get("usage"))
            .map(|u| u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap())
            .sum();
        assert!(tokens <= cap, "{e}");
    }
}

#[test]
fn answers_without_usage_are_estimated_in_the_ledger_and_keep_their_whole_reservation() {
    let redis = RedisServer::start();
    let dir = TempDir::new("no-usage");
    let data = dir.join("d.jsonl");
    let records = 20;
    write_records(&data, 0, records);
    let spec = spec_with(&dir, &[("[prices]", "[budget]\nmax_cost_usd = 1.0\n\n[prices]")]);
    enqueue(&redis, &data, "nou", &spec);
    // A server (or proxy) that never says what an answer used.
    let sim = LlmSim::start(&["--no-usage"]);
    let (code, log) = drain(&redis, "nou", &sim, &[]);
    assert_eq!(code, Some(0), "{log}");
    let served = sim.stats()["served"].as_u64().unwrap();
    assert_eq!(served, records, "{}", sim.stats());
    let r = report(&redis, "nou");
    let spend = &r["spend"];
    // Every answer is a paid call, estimated: completion counted as max_tokens.
    assert_eq!(spend["calls"], served, "{r}");
    assert_eq!(spend["estimated_calls"], served, "{r}");
    assert_eq!(spend["completion_tokens"], served * 200, "{r}");
    assert!(spend["cost_usd"].as_f64().unwrap() > 0.0);
    // Against the cap each keeps its reservation at its most: more than the estimate.
    let (_, s) = status_json(&redis, "nou");
    assert_eq!(s["done"], records, "{s}");
    assert!(
        nano(&s["budget"]["spent_usd"]) > nano(&spend["cost_usd"]),
        "budget {} vs ledger {}",
        s["budget"],
        spend
    );
    assert_eq!(s["budget"]["reserved_usd"], 0.0);
}

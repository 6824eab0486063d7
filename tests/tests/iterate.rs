//! Iterating on a prompt with evidence (#13): a stratified sample, a rerun
//! of one job's failures under a new prompt version with a regression set,
//! `compare` between the two runs, a dry run without the sink, the prompt
//! changelog, and `estimate` after a sample.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use common::keys;
use harness::{LlmSim, RedisServer, Running, TempDir, producer, spec_with, status_json, stderr, worker_cmd};
use serde_json::{Value, json};

/// `enqueue DATA --job JOB --spec SPEC --redis URL EXTRA...` as JSON.
fn enqueue_into(data: &Path, job: &str, spec: &Path, url: &str, extra: &[&str]) -> Value {
    let (data, spec) = (data.to_str().unwrap(), spec.to_str().unwrap());
    enqueue_json(&[&[data, "--job", job, "--spec", spec, "--redis", url][..], extra].concat())
}

fn enqueue_json(args: &[&str]) -> Value {
    let out = producer(&[&["enqueue"][..], args, &["--json", "--no-progress"]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The business keys of the tasks a job holds in its streams.
fn queued_keys(redis: &RedisServer, job: &str) -> BTreeSet<String> {
    let mut c = redis.conn();
    let mut keys_seen = BTreeSet::new();
    for p in 0..4 {
        let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
            .arg(keys::stream(job, p))
            .arg("-")
            .arg("+")
            .query(&mut c)
            .unwrap();
        for (_, fields) in entries {
            let task = &fields.iter().find(|(k, _)| k == "task").unwrap().1;
            let t: Value = serde_json::from_str(task).unwrap();
            keys_seen.insert(t["input"]["message_id"].as_str().unwrap().to_owned());
        }
    }
    keys_seen
}

fn write_lines(path: &Path, lines: &[Value]) {
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(path, text).unwrap();
}

fn line(id: usize, channel: &str, task_type: &str, text: &str) -> Value {
    json!({"message_id": format!("m-{id}"), "channel": channel, "task_type": task_type, "text": text})
}

#[test]
fn a_stratified_sample_covers_the_extremes_kinds_of_text_and_every_rare_value() {
    let redis = RedisServer::start();
    let dir = TempDir::new("stratify");
    let mut lines = Vec::new();
    for i in 0..300 {
        let channel = ["chat", "email", "phone"][i % 3];
        lines.push(line(
            i,
            channel,
            "classify",
            &format!("an ordinary message, number {i:04}"),
        ));
    }
    lines[17] = line(17, "chat", "classify", "hi");
    lines[42] = line(42, "email", "classify", &"a very long complaint ".repeat(40));
    lines[99] = line(99, "chat", "classify", "first line\nsecond line");
    lines[123] = line(123, "phone", "classify", "she said \"refund\" twice");
    lines[200] = line(200, "email", "classify", "Lieferung verspätet, bitte prüfen");
    lines[250] = line(250, "forum", "extract", "order 1234 never came");
    let data = dir.join("d.jsonl");
    write_lines(&data, &lines);
    let spec = harness::example_spec();
    let url = redis.url();
    let args = |job: &'static str| {
        vec![
            data.to_str().unwrap().to_owned(),
            "--job".into(),
            job.into(),
            "--spec".into(),
            spec.to_str().unwrap().into(),
            "--redis".into(),
            url.clone(),
            "--sample".into(),
            "12".into(),
            "--seed".into(),
            "3".into(),
            "--stratify".into(),
        ]
    };
    let a = args("strat");
    let s = enqueue_json(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let c = &s["coverage"];
    // Line numbers count from 1.
    assert_eq!(c["shortest"], 18, "{s}");
    assert_eq!(c["longest"], 43, "{s}");
    assert_eq!(c["texts"]["newline"], 100, "{s}");
    assert_eq!(c["texts"]["quote"], 124, "{s}");
    assert_eq!(c["texts"]["non_ascii"], 201, "{s}");
    assert_eq!(
        c["values"]["channel"],
        json!(["chat", "email", "forum", "phone"]),
        "{s}"
    );
    assert_eq!(c["values"]["task_type"], json!(["classify", "extract"]), "{s}");
    assert!(
        c["values"].get("text").is_none(),
        "a field with many values is no stratum: {s}"
    );
    assert_eq!(c["size"], 12);
    let got = queued_keys(&redis, "strat");
    assert_eq!(got.len(), 12);
    for must in ["m-17", "m-42", "m-99", "m-123", "m-200", "m-250"] {
        assert!(got.contains(must), "{must} not in {got:?}");
    }
    let (_, st) = status_json(&redis, "strat");
    assert_eq!(st["expected"], 12);
    // Reproducible: the same seed picks the same lines.
    let again = args("strat2");
    enqueue_json(&again.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(queued_keys(&redis, "strat2"), got);
}

fn report(redis: &RedisServer, job: &str) -> Value {
    let out = producer(&["report", "--job", job, "--redis", &redis.url(), "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn drain(redis: &RedisServer, job: &str, sim: &LlmSim) -> String {
    let (status, log) = Running::spawn(worker_cmd(redis, job, sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(status.success(), "{log}");
    log
}

#[test]
fn failures_rerun_under_a_new_prompt_with_a_regression_set_and_compare_shows_the_difference() {
    let redis = RedisServer::start();
    let dir = TempDir::new("rerun");
    let data = dir.join("d.jsonl");
    harness::write_records(&data, 0, 400);
    let url = redis.url();
    let v1 = spec_with(&dir, &[("max_attempts = 4", "max_attempts = 1")]);
    // A sample of 40 under v1, against a model that gets the enum wrong.
    let a = enqueue_into(&data, "a", &v1, &url, &["--sample", "40", "--seed", "1"]);
    assert_eq!(a["enqueued"], 40);
    let wrong = LlmSim::start(&["--faults", "bad_enum=0.3", "--seed", "2"]);
    drain(&redis, "a", &wrong);
    let (_, sa) = status_json(&redis, "a");
    let failed = sa["review"].as_u64().unwrap();
    assert!(failed > 0 && failed < 40, "{sa}");

    // The failures plus 5 records that passed, under v2 (new record ids), as
    // a dry run: v2's spec has a sink whose database is not even configured.
    let v2_dir = TempDir::new("rerun-v2");
    let v2 = spec_with(
        &v2_dir,
        &[
            ("max_attempts = 4", "max_attempts = 1"),
            (
                "prompt = \"v1\"",
                "prompt = \"v2\"\nnote = \"the label enum spelled out; targets E_ENUM label\"",
            ),
            ("[retry]", &harness::sink_section("NOT_SET_ANYWHERE", "")),
        ],
    );
    let b = enqueue_into(
        &data,
        "b",
        &v2,
        &url,
        &["--from-job", "a", "--set", "review", "--plus-passed", "5", "--dry-run"],
    );
    assert_eq!(b["from_job"]["records"], failed, "{b}");
    assert_eq!(b["from_job"]["passed"], 5, "{b}");
    assert_eq!(b["enqueued"], failed + 5, "{b}");
    assert_eq!(b["dry_run"], true);
    let fixed_model = LlmSim::start(&["--seed", "2"]);
    let log = drain(&redis, "b", &fixed_model);
    // One log line per attempt, with the versions.
    let attempts: Vec<&str> = log.lines().filter(|l| l.contains("\"message\":\"attempt\"")).collect();
    assert_eq!(attempts.len() as u64, failed + 5, "{log}");
    assert!(attempts.iter().all(|l| l.contains("prompt=v2")), "{log}");
    let (_, sb) = status_json(&redis, "b");
    assert_eq!(sb["done"], failed + 5, "{sb}");
    assert!(sb.get("sink").is_none_or(Value::is_null), "a dry run has no sink: {sb}");

    let out = producer(&["compare", "--job", "a", "--job", "b", "--redis", &url, "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let c: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(c["a"]["review"], failed);
    assert_eq!(c["b"]["review"], 0);
    assert_eq!(c["fixed"].as_array().unwrap().len() as u64, failed, "{c}");
    assert_eq!(c["regressions"], json!([]), "{c}");
    assert!(c["a"]["codes"]["E_ENUM label"].as_u64().unwrap() > 0, "{c}");
    assert_eq!(c["b"]["first_attempt_valid"], 1.0);
    assert_eq!(
        c["b"]["chain"][0]["note"],
        "the label enum spelled out; targets E_ENUM label"
    );
    assert_eq!(c["b"]["chain"][1]["job"], "a", "B's history goes back to A: {c}");
    assert_eq!(c["b"]["chain"][1]["versions"]["prompt"], "v1");
    let human = producer(&["compare", "--job", "a", "--job", "b", "--redis", &url]);
    let text = String::from_utf8_lossy(&human.stdout);
    assert!(
        text.contains("E_ENUM label") && text.contains("regressions (done in A, in review in B): none"),
        "{text}"
    );
    let r = report(&redis, "b");
    assert_eq!(r["chain"].as_array().unwrap().len(), 2, "{r}");

    // A regression: the records that passed in A, rerun against a model
    // that now gets them all wrong, show by business key.
    let v3_dir = TempDir::new("rerun-v3");
    let c_spec = spec_with(
        &v3_dir,
        &[
            ("max_attempts = 4", "max_attempts = 1"),
            ("prompt = \"v1\"", "prompt = \"v3\""),
        ],
    );
    enqueue_into(&data, "c", &c_spec, &url, &["--from-job", "a", "--set", "done"]);
    let broken = LlmSim::start(&["--faults", "bad_enum=1.0"]);
    drain(&redis, "c", &broken);
    let out = producer(&["compare", "--job", "a", "--job", "c", "--redis", &url, "--json"]);
    let c: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(c["regressions"].as_array().unwrap().len() as u64, 40 - failed, "{c}");
    assert!(
        c["regressions"]
            .as_array()
            .unwrap()
            .iter()
            .all(|k| k.as_str().unwrap().starts_with("msg-"))
    );

    // Another dataset than the one A was enqueued from is refused.
    let other = dir.join("other.jsonl");
    harness::write_records(&other, 1000, 10);
    let out = producer(&[
        "enqueue",
        other.to_str().unwrap(),
        "--job",
        "d",
        "--spec",
        v2.to_str().unwrap(),
        "--redis",
        &url,
        "--from-job",
        "a",
        "--set",
        "review",
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("not one that job was enqueued from"),
        "{}",
        stderr(&out)
    );

    // The estimate of the whole dataset from A's sample.
    let out = producer(&["estimate", "--job", "a", "--redis", &url, "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let e: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(e["records"], 400, "{e}");
    assert_eq!(e["sample_records"], 40);
    let per_record = e["cost_usd"]["mean"].as_f64().unwrap();
    let (lo, mid, hi) = (
        e["total_cost_usd"][0].as_f64().unwrap(),
        e["total_cost_usd"][1].as_f64().unwrap(),
        e["total_cost_usd"][2].as_f64().unwrap(),
    );
    assert!((mid - 400.0 * per_record).abs() < 1e-9 && lo <= mid && mid <= hi, "{e}");
    // The example's limits: 500,000 output tokens a minute at max_tokens 200 bind first.
    assert_eq!(e["bound_by"], "limits.output_tokens_per_minute", "{e}");
    let minutes = 400.0 * e["calls"]["mean"].as_f64().unwrap() / 2500.0;
    assert!(
        (e["duration_secs"][1].as_f64().unwrap() - minutes * 60.0).abs() < 1e-6,
        "{e}"
    );
}

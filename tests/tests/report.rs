//! `producer report` and `export` checked against what llm-sim itself counted.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::time::Duration;

use harness::{
    LlmSim, RedisServer, Running, TempDir, enqueue, producer, spec_with, stderr, stdout, worker_cmd, write_records,
};
use serde_json::Value;

#[test]
fn report_tokens_and_failures_match_the_providers_own_counts() {
    let redis = RedisServer::start();
    // Only faults that still answer 200 with usage, so every call is accounted.
    let sim = LlmSim::start(&["--faults", "bad_enum=0.3,content_filter=0.1,fence=0.1", "--seed", "9"]);
    let dir = TempDir::new("report");
    let spec = spec_with(
        &dir,
        &[
            ("base_delay_ms = 500", "base_delay_ms = 10"),
            ("max_delay_ms = 30000", "max_delay_ms = 50"),
        ],
    );
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 120);
    enqueue(&redis, &data, "rep", &spec);
    let (status, err) = Running::spawn(worker_cmd(&redis, "rep", &sim, &["--drain"])).finish(Duration::from_secs(120));
    assert!(status.success(), "{err}");

    let out = producer(&["report", "--job", "rep", "--redis", &redis.url(), "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let r: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let s = sim.stats();
    assert_eq!(
        r["total"]["prompt_tokens"], s["prompt_tokens"],
        "prompt tokens: report vs llm-sim"
    );
    assert_eq!(
        r["total"]["completion_tokens"], s["completion_tokens"],
        "completion tokens: report vs llm-sim"
    );
    assert_eq!(r["total"]["calls"], s["requests"], "calls: report vs llm-sim");
    let bad_enum = s["by_fault"]["bad_enum"].as_u64().unwrap();
    let refused = s["by_fault"]["content_filter"].as_u64().unwrap();
    assert!(bad_enum > 0 && refused > 0, "{s}");
    assert_eq!(r["validation_errors"]["E_ENUM label"].as_u64(), Some(bad_enum));
    assert_eq!(r["retries_by_cause"]["invalid_output"].as_u64(), Some(bad_enum));
    assert_eq!(r["review_by_reason"]["refused:content_filter"].as_u64(), Some(refused));
    // The three cost parts add up to the total, and the total is priced.
    let parts: f64 = ["first_attempt_successes", "done_after_retries", "ended_in_review"]
        .iter()
        .map(|k| r[k]["cost_usd"].as_f64().unwrap())
        .sum();
    let total = r["total"]["cost_usd"].as_f64().unwrap();
    assert!(total > 0.0 && (parts - total).abs() < 1e-9, "{parts} vs {total}");
    assert!(r["versions"]["prompt"].is_string());

    // Export each set: the counts agree with the report.
    for (what, expected) in [("done", r["done"].as_u64().unwrap()), ("review", refused)] {
        let file = dir.join(&format!("{what}.jsonl"));
        let out = producer(&[
            "export",
            "--job",
            "rep",
            "--redis",
            &redis.url(),
            "--out",
            file.to_str().unwrap(),
            "--what",
            what,
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(stderr(&out).contains("0 records were still open"), "{}", stderr(&out));
        let lines: Vec<Value> = std::fs::read_to_string(&file)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len() as u64, expected, "{what}");
        assert!(
            lines
                .iter()
                .all(|l| l["record_id"].as_str().is_some_and(|id| id.len() == 64) && l["key"].is_string())
        );
    }
}

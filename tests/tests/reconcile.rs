//! Reconciliation from the data in Redis: a job with every kind of outcome is
//! complete; deliberately corrupted state is reported exactly.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::collections::{BTreeSet, HashMap};

use common::keys;
use harness::{
    LlmSim, RedisServer, Running, TempDir, enqueue, producer, spec_with, status_json, stdout, worker_cmd, write_records,
};
use redis::Commands;
use serde_json::Value;

fn ids(v: &Value, kind: &str) -> BTreeSet<String> {
    v["anomalies"][kind]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["record_id"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn a_job_with_every_outcome_reconciles_and_corruption_is_named() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--faults", "content_filter=0.1,bad_enum=0.1", "--seed", "4"]);
    let dir = TempDir::new("reconcile");
    let spec = spec_with(
        &dir,
        &[
            ("base_delay_ms = 500", "base_delay_ms = 10"),
            ("max_delay_ms = 30000", "max_delay_ms = 50"),
        ],
    );
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 200);
    // One record with a missing template field: the dropped set.
    let mut text = std::fs::read_to_string(&data).unwrap();
    text.push_str("{\"message_id\": \"no-text\", \"channel\": \"chat\", \"task_type\": \"classify\"}\n");
    std::fs::write(&data, text).unwrap();
    enqueue(&redis, &data, "rc", &spec);
    let (code, err) =
        Running::spawn(worker_cmd(&redis, "rc", &sim, &["--drain"])).finish(std::time::Duration::from_secs(120));
    assert!(code.success(), "{err}");

    let (code, s) = status_json(&redis, "rc");
    assert_eq!(code, Some(0), "{s}");
    assert_eq!(s["complete"], true);
    assert!(
        s["done"].as_u64().unwrap() > 0 && s["review"].as_u64().unwrap() > 0 && s["dropped"] == 1,
        "{s}"
    );
    assert_eq!(
        (s["missing"].as_u64(), s["duplicates"].as_u64(), s["unknown"].as_u64()),
        (Some(0), Some(0), Some(0))
    );

    // Corrupt it: a stray result, a record with both a result and a review
    // entry, and a result deleted from under a done record.
    let mut c = redis.conn();
    let results: HashMap<String, String> = c.hgetall(keys::results("rc", 0)).unwrap();
    let mut done = results.keys().cloned().collect::<Vec<_>>();
    done.sort();
    let (twice, lost) = (done[0].clone(), done[1].clone());
    let stray = "f".repeat(64);
    let _: () = c.hset(keys::results("rc", 0), &stray, "{}").unwrap();
    let _: () = c.hset(keys::review("rc", 0), &twice, "{}").unwrap();
    let _: () = c.hdel(keys::results("rc", 0), &lost).unwrap();

    let (code, s) = status_json(&redis, "rc");
    assert_eq!(code, Some(4), "a corrupted job is not complete");
    assert_eq!(s["complete"], false);
    assert_eq!(ids(&s, "unknown"), BTreeSet::from([stray]));
    assert_eq!(ids(&s, "duplicates"), BTreeSet::from([twice]));
    assert_eq!(ids(&s, "missing"), BTreeSet::from([lost]));
    assert_eq!(
        (s["missing"].as_u64(), s["duplicates"].as_u64(), s["unknown"].as_u64()),
        (Some(1), Some(1), Some(1))
    );
}

/// Status reads a partition's stream and hashes in pages of 1,000, each
/// read while the one before is counted: records on both sides of a page's
/// edge, and past the last full page, are all found.
#[test]
fn records_across_page_edges_are_all_read() {
    let redis = RedisServer::start();
    let dir = TempDir::new("reconcile-pages");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 5000);
    enqueue(&redis, &data, "pg", &harness::example_spec());
    let (_, s) = status_json(&redis, "pg");
    assert_eq!(
        (
            s["queued"].as_u64(),
            s["missing"].as_u64(),
            s["duplicates"].as_u64(),
            s["unknown"].as_u64()
        ),
        (Some(5000), Some(0), Some(0), Some(0)),
        "{s}"
    );

    // The last entry of the first page and the first of the second go; a
    // copy of the first comes back at the end, past the last full page.
    let mut c = redis.conn();
    let stream = keys::stream("pg", 2);
    let entries: redis::streams::StreamRangeReply = c.xrange_count(&stream, "-", "+", 1001).unwrap();
    assert!(entries.ids.len() == 1001, "partition 2 holds more than a page");
    let rid = |i: usize| entries.ids[i].get::<String>("rid").unwrap();
    let _: () = c.xdel(&stream, &[&entries.ids[999].id, &entries.ids[1000].id]).unwrap();
    let _: String = c
        .xadd(&stream, "*", &[("rid", rid(0).as_str()), ("task", "{}")])
        .unwrap();
    // 2,500 strays in a review hash: read in pages of its fields.
    let strays: Vec<(String, &str)> = (0..2500).map(|i| (format!("{i:064x}"), "{}")).collect();
    let _: () = c.hset_multiple(keys::review("pg", 3), &strays).unwrap();

    let (_, s) = status_json(&redis, "pg");
    assert_eq!(ids(&s, "missing"), BTreeSet::from([rid(999), rid(1000)]));
    assert_eq!(ids(&s, "duplicates"), BTreeSet::from([rid(0)]));
    assert_eq!(ids(&s, "unknown"), strays.into_iter().map(|(id, _)| id).collect());
}

#[test]
fn a_lost_task_and_a_duplicated_task_are_reported_before_any_worker_runs() {
    let redis = RedisServer::start();
    let dir = TempDir::new("reconcile-q");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 50);
    enqueue(&redis, &data, "q", &harness::example_spec());
    let (code, s) = status_json(&redis, "q");
    assert_eq!(code, Some(4), "queued work is not complete");
    assert_eq!(
        (s["missing"].as_u64(), s["duplicates"].as_u64(), s["unknown"].as_u64()),
        (Some(0), Some(0), Some(0)),
        "{s}"
    );

    let mut c = redis.conn();
    let stream = keys::stream("q", 1);
    let entries: redis::streams::StreamRangeReply = c.xrange_count(&stream, "-", "+", 2).unwrap();
    let lost = entries.ids[0].clone();
    let copied = entries.ids[1].clone();
    let _: () = c.xdel(&stream, &[&lost.id]).unwrap();
    let copied_rid: String = copied.get("rid").unwrap();
    let _: String = c
        .xadd(&stream, "*", &[("rid", copied_rid.as_str()), ("input", "{}")])
        .unwrap();

    let (_, s) = status_json(&redis, "q");
    assert_eq!(ids(&s, "missing"), BTreeSet::from([lost.get::<String>("rid").unwrap()]));
    assert_eq!(ids(&s, "duplicates"), BTreeSet::from([copied_rid]));
    assert!(ids(&s, "unknown").is_empty());
}

#[test]
fn cancel_stops_the_job_keeps_every_record_and_resume_finishes_it() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--latency-ms", "200"]);
    let dir = TempDir::new("cancel");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 300);
    enqueue(&redis, &data, "cx", &harness::example_spec());
    let worker = Running::spawn(worker_cmd(&redis, "cx", &sim, &["--drain", "--concurrency", "10"]));
    harness::wait_for("some results", std::time::Duration::from_secs(30), || {
        status_json(&redis, "cx").1["done"].as_u64().unwrap() >= 20
    });
    let out = producer(&["cancel", "--job", "cx", "--redis", &redis.url()]);
    assert!(out.status.success(), "{}", harness::stderr(&out));
    // The draining worker finishes its in-flight tasks, claims nothing more, exits.
    let (code, err) = worker.finish(std::time::Duration::from_secs(60));
    assert!(code.success(), "{err}");
    let (_, s) = status_json(&redis, "cx");
    let (done, cancelled) = (s["done"].as_u64().unwrap(), s["cancelled"].as_u64().unwrap());
    assert!(cancelled > 0 && done >= 20, "{s}");
    assert_eq!(done + cancelled, 300, "every record is done or cancelled: {s}");
    assert_eq!(
        (s["queued"].as_u64(), s["in_flight"].as_u64(), s["missing"].as_u64()),
        (Some(0), Some(0), Some(0)),
        "{}",
        &s["anomalies"]["missing"][0]
    );
    assert_eq!(
        s["complete"], true,
        "cancelled is a terminal set, kept for reconciliation"
    );
    let requests_at_cancel = sim.stats()["requests"].as_u64().unwrap();
    assert!(requests_at_cancel < 300, "calls stopped at the cancel");

    let out = producer(&["resume", "--job", "cx", "--redis", &redis.url()]);
    assert!(out.status.success(), "{}", harness::stderr(&out));
    assert!(
        stdout(&out).contains(&format!("{cancelled} cancelled records re-queued")),
        "{}",
        stdout(&out)
    );
    let (code, err) = Running::spawn(worker_cmd(&redis, "cx", &sim, &["--drain", "--concurrency", "50"]))
        .finish(std::time::Duration::from_secs(60));
    assert!(code.success(), "{err}");
    let (code, s) = status_json(&redis, "cx");
    assert_eq!(code, Some(0), "{s}");
    assert_eq!((s["done"].as_u64(), s["cancelled"].as_u64()), (Some(300), Some(0)));
}

//! `producer rerun`: a job's done records, selected by a filter, run again
//! in a new job: counted first, `--yes` past ten, logged in the first job's
//! bulk-action log, and the first job's results left as they were.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::process::Command;
use std::time::Duration;

use common::keys;
use harness::{
    LlmSim, RedisServer, Running, TempDir, bin, enqueue, spec_with, stderr, stdout, worker_cmd, write_records,
};
use redis::Commands;
use serde_json::Value;

const P: u32 = 4;

fn producer(args: &[&str]) -> std::process::Output {
    Command::new(bin("producer")).args(args).output().unwrap()
}

fn json_out(out: &std::process::Output) -> Value {
    assert!(out.status.success(), "{}", stderr(out));
    serde_json::from_str(&stdout(out)).unwrap()
}

/// The done results of a job without a sink, as Redis holds them.
fn results(redis: &RedisServer, job: &str) -> Vec<Value> {
    let mut c = redis.conn();
    (0..P)
        .flat_map(|p| c.hvals::<_, Vec<String>>(keys::results(job, p)).unwrap())
        .map(|t| serde_json::from_str(&t).unwrap())
        .collect()
}

fn records(redis: &RedisServer, job: &str) -> usize {
    let mut c = redis.conn();
    (0..P).map(|p| c.hlen::<_, usize>(keys::state(job, p)).unwrap()).sum()
}

#[test]
fn done_records_run_again_by_filter_in_a_new_job_counted_first_and_logged() {
    let redis = RedisServer::start();
    let dir = TempDir::new("rerun");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 40);
    enqueue(&redis, &data, "first", &harness::example_spec());
    // About half the first answers have a wrong label: those records are
    // done after a feedback retry, with E_ENUM in their history.
    let sim = LlmSim::start(&["--faults", "bad_enum=0.5", "--seed", "5"]);
    let (status, err) = Running::spawn(worker_cmd(&redis, "first", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(status.success(), "{err}");
    let done = results(&redis, "first");
    assert_eq!(done.len(), 40, "every record done");
    let retried = done.iter().filter(|r| r["attempts"] == 2).count();
    assert!(retried > 10 && retried < 40, "{retried}");
    let billing = done.iter().filter(|r| r["output"]["label"] == "billing").count();
    let v2 = spec_with(&dir, &[("prompt = \"v1\"", "prompt = \"v2\"")]);
    let (url, data_s, v2_s) = (redis.url(), data.display().to_string(), v2.display().to_string());
    let rerun = |extra: &[&str]| {
        let mut args = vec![
            "rerun",
            data_s.as_str(),
            "--from-job",
            "first",
            "--job",
            "second",
            "--spec",
            v2_s.as_str(),
            "--redis",
            url.as_str(),
            "--no-progress",
        ];
        args.extend_from_slice(extra);
        producer(&args)
    };

    // Counted first: by the errors of earlier attempts, the output, the input.
    let dry = json_out(&rerun(&["--code", "E_ENUM", "--dry-run", "--json"]));
    assert_eq!(dry["matched"], retried, "{dry}");
    assert_eq!(dry["sample"].as_array().unwrap().len(), 5);
    let dry = json_out(&rerun(&["--output", "$.label=billing", "--dry-run", "--json"]));
    assert_eq!(dry["matched"], billing, "{dry}");
    // msg-1 and msg-10..msg-19 ("message number 1..."): judged by their dataset line.
    let dry = json_out(&rerun(&["--text", "number 1", "--dry-run", "--json"]));
    assert_eq!(dry["matched"], 11, "{dry}");
    let dry = json_out(&rerun(&["--min-attempts", "3", "--dry-run", "--json"]));
    assert_eq!(dry["matched"], 0, "{dry}");
    assert_eq!(records(&redis, "second"), 0, "a dry run enqueues nothing");

    // Refusals that say what to type.
    let refused = rerun(&["--code", "E_ENUM"]);
    assert_eq!(refused.status.code(), Some(2), "{}", stderr(&refused));
    assert!(
        stderr(&refused).contains("--dry-run") && stderr(&refused).contains("--yes"),
        "{}",
        stderr(&refused)
    );
    let refused = rerun(&["--reason", "refused", "--dry-run"]);
    assert!(
        stderr(&refused).contains("--reason selects review entries"),
        "{}",
        stderr(&refused)
    );
    let refused = rerun(&["--dry-run"]);
    assert!(stderr(&refused).contains("needs a filter"), "{}", stderr(&refused));
    let same = producer(&[
        "rerun",
        &data_s,
        "--from-job",
        "first",
        "--job",
        "first",
        "--spec",
        &v2_s,
        "--redis",
        &url,
        "--code",
        "E_ENUM",
    ]);
    assert!(stderr(&same).contains("a new job"), "{}", stderr(&same));
    assert_eq!(records(&redis, "second"), 0);

    // Run: exactly the matching records, under new record ids.
    let out = json_out(&rerun(&["--code", "E_ENUM", "--yes", "--json"]));
    assert_eq!(out["matched"], retried);
    assert_eq!(out["enqueued"], retried);
    assert_eq!(records(&redis, "second"), retried);
    let log = json_out(&producer(&[
        "review", "--job", "first", "--redis", &url, "bulk-log", "--json",
    ]));
    let entry = log["actions"]
        .as_array()
        .and_then(|a| a.iter().find(|e| e["action"] == "rerun"))
        .unwrap_or_else(|| panic!("no rerun in the bulk log: {log}"))
        .clone();
    assert_eq!(entry["matched"], retried, "{entry}");
    assert_eq!(entry["filter"]["code"], "E_ENUM", "{entry}");
    assert!(entry["detail"].as_str().unwrap().contains("second"), "{entry}");
    // Again: the same records, nothing new (enqueue is idempotent).
    let again = json_out(&rerun(&["--code", "E_ENUM", "--yes", "--json"]));
    assert_eq!(again["enqueued"], 0);
    assert_eq!(records(&redis, "second"), retried);

    // The new job runs; the first job's results are as they were.
    let (status, err) =
        Running::spawn(worker_cmd(&redis, "second", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(status.success(), "{err}");
    assert_eq!(results(&redis, "second").len(), retried);
    let after = results(&redis, "first");
    assert_eq!(after.len(), 40);
    let ids = |rs: &[Value]| {
        let mut v: Vec<String> = rs.iter().map(|r| r["record_id"].as_str().unwrap().to_owned()).collect();
        v.sort();
        v
    };
    assert_eq!(ids(&after), ids(&done));
    let second_ids = ids(&results(&redis, "second"));
    assert!(second_ids.iter().all(|id| !ids(&done).contains(id)), "new record ids");
}

//! The files result sink: exactly one line per done record over all
//! segments through a writer that exits between a segment's rename and its
//! acknowledgement, a writer killed -9 mid-segment, and Redis killed -9 and
//! restarted from its AOF (`appendfsync everysec`: the last second of
//! acknowledgements can be lost and their records handed over again); the
//! manifest lists every segment with its line count and sha256, and
//! `status --require-complete` proves the job from the segments.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::keys;
use harness::{
    LlmSim, RedisServer, Running, TempDir, enqueue, producer, spec_with, wait_for, worker_cmd, write_records,
};
use serde_json::Value;

const JOB: &str = "files";

fn files_spec(dir: &TempDir, out: &Path) -> PathBuf {
    files_spec_with(dir, out, "")
}

/// [`files_spec`] with more `[sink]` settings.
fn files_spec_with(dir: &TempDir, out: &Path, extra: &str) -> PathBuf {
    spec_with(
        dir,
        &[
            (
                "[retry]",
                &format!(
                    "[sink]\nkind = \"files\"\ndir = \"{}\"\nbatch_rows = 50\nsegment_records = 200\nsegment_secs = 1\n{extra}\n[retry]",
                    out.display()
                ),
            ),
            ("timeout_secs = 30", "timeout_secs = 3"),
        ],
    )
}

/// Every line of every finished results segment: record id -> lines.
fn result_lines(job_dir: &Path) -> HashMap<String, u32> {
    let mut ids = HashMap::new();
    let Ok(rd) = std::fs::read_dir(job_dir.join("results")) else {
        return ids;
    };
    for entry in rd {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        assert!(
            text.is_empty() || text.ends_with('\n'),
            "a segment ends with a whole line"
        );
        for line in text.lines() {
            let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("a partial line {line:?}: {e}"));
            *ids.entry(v["record_id"].as_str().unwrap().to_owned()).or_default() += 1;
        }
    }
    ids
}

fn open_files(job_dir: &Path, suffix: &str) -> Vec<String> {
    std::fs::read_dir(job_dir.join(".open"))
        .map(|rd| {
            rd.filter_map(|e| {
                let name = e.ok()?.file_name().to_string_lossy().into_owned();
                name.ends_with(suffix).then_some(name)
            })
            .collect()
        })
        .unwrap_or_default()
}

/// A job of `n` records drained by one worker into the files sink in
/// `<dir>/out`: its Redis, its directory and the worker's log.
fn drained(name: &str, n: u64) -> (RedisServer, TempDir, String) {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--latency-ms", "0"]);
    let dir = TempDir::new(name);
    let data = dir.join("d.jsonl");
    write_records(&data, 0, n);
    enqueue(&redis, &data, JOB, &files_spec(&dir, &dir.join("out")));
    let (exit, log) = Running::spawn(worker_cmd(&redis, JOB, &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    (redis, dir, log)
}

#[test]
fn every_done_record_is_one_line_through_kills_of_the_writer_and_redis() {
    let mut redis = RedisServer::start_with(&["--save", "", "--appendonly", "yes", "--appendfsync", "everysec"]);
    let sim = LlmSim::start(&["--latency-ms", "20", "--faults", "bad_enum=0.05", "--seed", "5"]);
    let dir = TempDir::new("sink-files");
    let out = dir.join("out");
    let job_dir = out.join(JOB);
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 1500);
    enqueue(&redis, &data, JOB, &files_spec(&dir, &out));
    let fast = [
        "--concurrency",
        "8",
        "--visibility-timeout-ms",
        "4000",
        "--drain-timeout-secs",
        "5",
    ];

    // A: exits right after its first segment is renamed into place, before
    // acknowledging it: the segment is listed, its entries are not acknowledged.
    let mut a = worker_cmd(&redis, JOB, &sim, &fast);
    a.env("BATCHFLEET_FAULT", "sink_exit_after_rename");
    let (exit, log) = Running::spawn(a).finish(Duration::from_secs(60));
    assert_eq!(exit.code(), Some(137), "{log}");
    // (Its other writers may have finished a segment at the same moment.)
    assert!(
        !open_files(&job_dir, ".pending").is_empty(),
        "its acknowledgement is pending"
    );
    let first = result_lines(&job_dir);
    assert!(!first.is_empty());

    // B rolls that forward, writes more, and is killed -9 mid-segment.
    let b = Running::spawn(worker_cmd(&redis, JOB, &sim, &fast));
    wait_for("more lines", Duration::from_secs(60), || {
        result_lines(&job_dir).len() > first.len() + 300
    });
    wait_for("an open segment", Duration::from_secs(30), || {
        !open_files(&job_dir, ".tmp").is_empty()
    });
    harness::signal(b.pid(), "KILL");
    let _ = b.finish(Duration::from_secs(10));
    assert!(!open_files(&job_dir, ".tmp").is_empty(), "B died with a segment open");

    // Redis dies too, and replays its AOF.
    redis.kill9_and_restart();

    // C drains the job and the sink.
    let (exit, log) = Running::spawn(worker_cmd(&redis, JOB, &sim, &[&fast[..], &["--drain"]].concat()))
        .finish(Duration::from_secs(120));
    assert!(exit.success(), "{log}");

    let (code, s) = harness::status_json(&redis, JOB);
    assert_eq!(code, Some(0), "complete, proven from the segments: {s}");
    let v = &s["sink"]["verified"];
    assert_eq!(v["exact"], true, "{s}");
    assert_eq!(v["duplicates"], 0, "{s}");
    assert_eq!(s["sink"]["backlog"], 0, "{s}");
    let done = s["done"].as_u64().unwrap();
    assert!(done > 1300, "{s}");
    let lines = result_lines(&job_dir);
    assert_eq!(lines.len() as u64, done, "one record per done record: {s}");
    assert!(lines.values().all(|n| *n == 1), "no record twice");
    for id in first.keys() {
        assert_eq!(lines.get(id), Some(&1), "A's segment stays, once");
    }
    assert!(open_files(&job_dir, ".tmp").is_empty(), "no open segment left");
    assert!(open_files(&job_dir, ".pending").is_empty(), "every batch acknowledged");

    // The manifest lists every segment with its lines and sha256.
    let m: Value = serde_json::from_str(&std::fs::read_to_string(job_dir.join("manifest.json")).unwrap()).unwrap();
    let listed: u64 = m["segments"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["kind"] == "results")
        .map(|s| s["records"].as_u64().unwrap())
        .sum();
    assert_eq!(listed, done);
    assert_eq!(m["expected_records"], 1500, "{m}");
    // What is in review is in the failures segments.
    let review = s["review"].as_u64().unwrap();
    assert_eq!(v["open_failures"]["review"].as_u64().unwrap_or(0), review, "{s}");

    // Every paid call is one ledger line, or still in Redis; Redis may have
    // lost acknowledged counts in its restart (everysec), never a line.
    let l = &v["ledger"];
    assert_eq!(
        (l["missing"].as_u64(), l["duplicates"].as_u64()),
        (Some(0), Some(0)),
        "{s}"
    );
    assert!(l["in_sink"].as_u64().unwrap() >= done, "{s}");
    let ledger_lines: u64 = m["segments"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["kind"] == "ledger")
        .map(|s| s["records"].as_u64().unwrap())
        .sum();
    assert_eq!(ledger_lines, l["in_sink"].as_u64().unwrap(), "one line per call: {m}");
    let (calls, _) = harness::exported_ledger(&redis.url(), JOB, &[]);
    assert_eq!(
        calls.len() as u64,
        l["in_sink"].as_u64().unwrap() + l["only_in_redis"].as_u64().unwrap()
    );

    // Export reads the results back from the segments, each once.
    let export = harness::export_done_env(&redis.url(), JOB, &[]);
    assert!(export.status.success(), "{}", harness::stderr(&export));
    let exported: Vec<Value> = String::from_utf8_lossy(&export.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(exported.len() as u64, done);
}

#[test]
fn a_segment_changed_on_disk_makes_the_check_fail() {
    let (redis, dir, log) = drained("sink-files-damage", 100);
    let out = dir.join("out");
    let (code, s) = harness::status_json(&redis, JOB);
    assert_eq!(
        (code, &s["sink"]["verified"]["exact"]),
        (Some(0), &Value::Bool(true)),
        "{s}\n{log}"
    );
    // A line removed from a segment: the manifest's count and sha256 disagree.
    let seg = std::fs::read_dir(out.join(JOB).join("results"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let text = std::fs::read_to_string(&seg).unwrap();
    let cut: String = text.lines().skip(1).map(|l| format!("{l}\n")).collect();
    std::fs::write(&seg, cut).unwrap();
    let (code, s) = harness::status_json(&redis, JOB);
    assert_ne!(code, Some(0), "{s}");
    let v = &s["sink"]["verified"];
    assert_eq!(v["exact"], false, "{s}");
    assert_eq!(v["missing"], 1, "{s}");
    assert_eq!(v["damaged"].as_array().map(Vec::len), Some(1), "{s}");
}

#[test]
fn a_directory_that_cannot_be_written_pauses_the_sink_and_loses_nothing() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--latency-ms", "20"]);
    let dir = TempDir::new("sink-files-disk");
    let out = dir.join("out");
    let job_dir = out.join(JOB);
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 3000);
    enqueue(&redis, &data, JOB, &files_spec(&dir, &out));
    let w = Running::spawn(worker_cmd(&redis, JOB, &sim, &["--concurrency", "8", "--drain"]));
    wait_for("a first segment", Duration::from_secs(60), || {
        !result_lines(&job_dir).is_empty()
    });
    // `results/` becomes a file: no segment can be renamed into it.
    let results = job_dir.join("results");
    std::fs::rename(&results, dir.join("results-aside")).unwrap();
    std::fs::write(&results, "not a directory").unwrap();
    std::thread::sleep(Duration::from_secs(3));
    std::fs::remove_file(&results).unwrap();
    std::fs::rename(dir.join("results-aside"), &results).unwrap();
    let (exit, log) = w.finish(Duration::from_secs(120));
    assert!(exit.success(), "{log}");
    assert!(
        log.contains("sink failing") && log.contains("\"cause\":\"disk\""),
        "the failure is logged with its cause: {log}"
    );
    // Whatever the first worker could not write in its drain, a second writes.
    let (exit, log) = Running::spawn(worker_cmd(&redis, JOB, &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    let (code, s) = harness::status_json(&redis, JOB);
    assert_eq!(code, Some(0), "{s}");
    assert_eq!(s["sink"]["verified"]["exact"], true, "{s}");
    let lines = result_lines(&job_dir);
    assert_eq!(lines.len() as u64, s["done"].as_u64().unwrap(), "{s}");
    assert!(lines.values().all(|n| *n == 1), "no record twice");
}

#[test]
fn a_revision_of_a_written_result_is_a_file_of_its_own_and_export_shows_it() {
    let (redis, dir, _) = drained("sink-files-revise", 20);
    let out = dir.join("out");
    let revised = dir.join("revised.json");
    std::fs::write(
        &revised,
        r#"{"label": "account", "reason": "checked by a person", "confidence": 1.0, "task_type": "classify"}"#,
    )
    .unwrap();
    let before = result_lines(&out.join(JOB));
    let r = producer(&[
        "review",
        "--job",
        JOB,
        "--redis",
        &redis.url(),
        "--reviewer",
        "carol",
        "revise",
        "msg-3",
        "--output",
        &revised.display().to_string(),
        "--note",
        "spot check",
    ]);
    assert!(r.status.success(), "{}", harness::stderr(&r));
    assert!(harness::stdout(&r).contains("revision 1"), "{}", harness::stdout(&r));
    assert_eq!(
        result_lines(&out.join(JOB)),
        before,
        "no result line is rewritten or added"
    );
    let export = harness::export_done_env(&redis.url(), JOB, &[]);
    let rows: Vec<Value> = String::from_utf8_lossy(&export.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 20);
    let r3 = rows.iter().find(|r| r["key"] == "msg-3").unwrap();
    assert_eq!(
        (&r3["output"]["label"], &r3["reviewer"]),
        (&Value::from("account"), &Value::from("carol"))
    );
    assert_eq!(r3["revisions"][0]["note"], "spot check");
    assert!(r3["revisions"][0]["previous"]["label"].is_string(), "{r3}");
    let (code, s) = harness::status_json(&redis, JOB);
    assert_eq!(
        (code, &s["sink"]["verified"]["exact"]),
        (Some(0), &Value::Bool(true)),
        "{s}"
    );
}

#[test]
fn a_partition_that_cannot_be_taken_holds_back_only_itself() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--latency-ms", "0"]);
    let dir = TempDir::new("sink-files-one-bad");
    let out = dir.join("out");
    let job_dir = out.join(JOB);
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 200);
    // One writer for all four partitions.
    enqueue(&redis, &data, JOB, &files_spec_with(&dir, &out, "writers = 1\n"));
    // A pending acknowledgement no version wrote: partition 1 cannot be rolled forward.
    std::fs::create_dir_all(job_dir.join(".open")).unwrap();
    let bad = job_dir.join(".open/p001.pending");
    std::fs::write(&bad, "not json").unwrap();
    let w = Running::spawn(worker_cmd(&redis, JOB, &sim, &[]));
    let partition_of = |rid: &str| common::record::partition_of(rid, 4);
    // Every other partition's records reach the segments.
    wait_for("the other partitions written", Duration::from_secs(60), || {
        let (_, s) = harness::status_json(&redis, JOB);
        let written = result_lines(&job_dir);
        let backlog = s["sink"]["backlog"].as_u64().unwrap_or(0);
        assert!(
            written.keys().all(|rid| partition_of(rid) != 1),
            "nothing of partition 1 is written"
        );
        // Each record waits as its outcome and its one paid call (no faults here).
        s["done"] == 200 && written.len() >= 100 && written.len() as u64 + backlog / 2 == 200
    });
    let (_, s) = harness::status_json(&redis, JOB);
    let held_back = s["sink"]["backlog"].as_u64().unwrap() / 2;
    assert!(
        held_back > 20 && held_back < 100,
        "only partition 1's records wait: {s}"
    );
    // Fixed by hand: the partition is taken and written.
    std::fs::remove_file(&bad).unwrap();
    wait_for("partition 1 written", Duration::from_secs(60), || {
        result_lines(&job_dir).len() == 200
    });
    harness::signal(w.pid(), "TERM");
    let (exit, log) = w.finish(Duration::from_secs(30));
    assert!(exit.success(), "{log}");
    assert!(
        log.contains("\"cause\":\"disk\"") && log.contains("p001.pending"),
        "{log}"
    );
    let (code, s) = harness::status_json(&redis, JOB);
    assert_eq!(
        (code, &s["sink"]["verified"]["exact"]),
        (Some(0), &Value::Bool(true)),
        "{s}"
    );
}

/// `producer trace` follows a row back to the bytes: each call's request and
/// response sha256, the model and endpoint, and the response read back from
/// the sink's `raw/` folder and hashed again. A response altered or removed
/// there is named and the command fails; a record that is not there says
/// which command shows where the job's records are, and that command works.
#[test]
fn trace_proves_a_row_from_the_kept_response_and_catches_an_altered_one() {
    let (redis, dir, _log) = drained("trace", 20);
    let url = redis.url();
    let trace = |args: &[&str]| {
        let mut all = vec!["trace", "--job", JOB, "--redis", url.as_str()];
        all.extend_from_slice(args);
        producer(&all)
    };
    // By business key.
    let out = trace(&["msg-7"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        text.contains("(key msg-7)") && text.contains("done (read from sink)"),
        "{text}"
    );
    assert!(text.contains("<- the row") && text.contains(": verified in "), "{text}");
    let out = trace(&["msg-7", "--json", "--raw"]);
    assert!(out.status.success());
    let chain: Value = serde_json::from_slice(&out.stdout).unwrap();
    let call = &chain["attempts"][0];
    let sha = call["trail"]["response_sha256"].as_str().unwrap().to_owned();
    assert_eq!(call["response"], "verified");
    assert_eq!(call["trail"]["request_sha256"].as_str().unwrap().len(), 64);
    assert!(
        call["trail"]["provider"]
            .as_str()
            .unwrap()
            .starts_with("http://127.0.0.1:")
    );
    // The row's output is the kept response's content.
    let body: Value = serde_json::from_str(call["body"].as_str().unwrap()).unwrap();
    let answered: Value = serde_json::from_str(body["choices"][0]["message"]["content"].as_str().unwrap()).unwrap();
    assert_eq!(chain["output"]["label"], answered["label"]);
    let blob = dir.join("out").join(JOB).join("raw").join(&sha[..2]).join(&sha);
    assert!(blob.exists(), "{}", blob.display());

    // Altered in the sink: named, and the command fails.
    std::fs::write(&blob, b"{\"not\": \"what was answered\"}").unwrap();
    let out = trace(&["msg-7"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains(&format!("response sha256 {sha}: altered")), "{text}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing or altered"));
    std::fs::remove_file(&blob).unwrap();
    let out = trace(&["msg-7"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains(": missing"));

    // Not a record of the job: what to type next, and it works.
    let out = trace(&["no-such-record"]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{err}");
    let next = err
        .split('`')
        .find(|s| s.starts_with("producer status"))
        .unwrap_or_else(|| panic!("{err}"));
    let out = harness::typed(next, &[("REDIS_URL", &url)]);
    assert!(out.status.success(), "{next}: {}", harness::stderr(&out));
    assert!(!err.contains(harness::TEST_REDIS_PASSWORD), "{err}");
}

/// A finished job leaves Redis small when no worker stays: the last writer
/// of a drained fleet leaves each partition's ledger (every paid call in
/// it already in the sink's ledger segments) to expire when the calls'
/// hold ends. Once it has, the job's keys hold at most 150 bytes a record,
/// every key counted: its records' state entries and little else.
#[test]
fn a_drained_job_leaves_redis_small_once_its_calls_hold_ended() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--latency-ms", "0"]);
    let dir = TempDir::new("files-small");
    let data = dir.join("d.jsonl");
    let records = 2000;
    write_records(&data, 0, records);
    enqueue(&redis, &data, JOB, &files_spec(&dir, &dir.join("out")));
    // A visibility timeout of 4 s (past the 3 s provider timeout): the
    // calls are held 8 s.
    let (exit, log) = Running::spawn(worker_cmd(
        &redis,
        JOB,
        &sim,
        &["--drain", "--visibility-timeout-ms", "4000"],
    ))
    .finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    let mut c = redis.conn();
    let job_bytes = |c: &mut redis::Connection| -> u64 {
        let keys: Vec<String> = redis::cmd("KEYS").arg("bf:*").query(c).unwrap();
        keys.iter()
            .map(|k| {
                redis::cmd("MEMORY")
                    .arg("USAGE")
                    .arg(k)
                    .query::<Option<u64>>(c)
                    .unwrap()
                    .unwrap_or(0)
            })
            .sum()
    };
    let held = job_bytes(&mut c);
    for p in 0..4 {
        for key in [keys::ledger(JOB, p), keys::ledger_sunk(JOB, p)] {
            let ttl: i64 = redis::cmd("TTL").arg(&key).query(&mut c).unwrap();
            assert!((1..=9).contains(&ttl), "{key} expires after the hold: TTL {ttl}");
        }
    }
    wait_for("the ledger's hold to end", Duration::from_secs(15), || {
        redis.hlen_sum(JOB, keys::ledger) == 0
    });
    let left = job_bytes(&mut c);
    assert!(
        left <= 150 * records,
        "{} bytes a record stay in Redis ({} while the calls were held)",
        left / records,
        held / records
    );
    eprintln!(
        "Redis per finished record: {} bytes while the calls were held, {} after",
        held / records,
        left / records
    );
    // The spend counters keep what left; the sink's ledger has every call.
    let out = producer(&[
        "status",
        "--job",
        JOB,
        "--redis",
        &redis.url(),
        "--require-complete",
        "--json",
    ]);
    assert!(out.status.success(), "{}", harness::stderr(&out));
    let s: Value = serde_json::from_slice(&out.stdout).unwrap();
    let l = &s["sink"]["verified"]["ledger"];
    assert_eq!(
        (l["complete"].as_bool(), l["missing"].as_u64()),
        (Some(true), Some(0)),
        "{s}"
    );
}

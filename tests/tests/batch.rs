//! Provider batch mode (#17): whole jobs through llm-sim's Batch API, under
//! each of its batch faults, with a worker killed -9 between "submitting
//! persisted" and "create answered" and during a download, a job cancelled
//! mid-batch, and retries into later shards or online. What must hold every
//! time: the job completes with nothing missing, duplicated or unknown, the
//! provider made exactly one batch per shard (llm-sim's own count), and every
//! answer it generated is one paid call, priced at batch prices.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use harness::{
    LlmSim, RedisServer, Running, TempDir, enqueue, producer, signal, spec_with, status_json, stderr, stdout, wait_for,
    worker_cmd, write_records,
};
use serde_json::Value;

/// A batch-mode spec: small shards, quick polls, a short provider timeout
/// (a lost create is given up on quickly), and `extra` lines in `[batch]`.
fn batch_spec(dir: &TempDir, extra: &str) -> PathBuf {
    let batch = format!("[batch]\nshard_records = 30\npoll_secs = 1\npack_wait_secs = 1\n{extra}\n\n[retry]");
    spec_with(
        dir,
        &[
            (
                "structured_output = \"auto\"",
                "structured_output = \"auto\"\nmode = \"batch\"",
            ),
            ("timeout_secs = 30", "timeout_secs = 3"),
            ("[retry]", &batch),
        ],
    )
}

/// A test's Redis and folder, with a batch-mode job `name` of `n` records
/// enqueued.
fn batch_job(tag: &str, name: &str, n: u64) -> (RedisServer, TempDir) {
    let redis = RedisServer::start();
    let dir = TempDir::new(tag);
    let spec = batch_spec(&dir, "");
    job(&redis, &dir, name, &spec, n);
    (redis, dir)
}

/// A job of `n` records enqueued with `spec`.
fn job(redis: &RedisServer, dir: &TempDir, name: &str, spec: &Path, n: u64) {
    let data = dir.join(&format!("{name}.jsonl"));
    write_records(&data, 0, n);
    enqueue(redis, &data, name, spec);
}

fn drain(redis: &RedisServer, job: &str, sim: &LlmSim) -> String {
    let log = std::env::temp_dir().join(format!("batch-drain-{}-{job}.log", std::process::id()));
    let mut w = spawn_logged(
        &mut worker_cmd(redis, job, sim, &["--drain", "--visibility-timeout-ms", "8000"]),
        &log,
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = w.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = w.kill();
            let text = read(&log);
            let tail: Vec<&str> = text.lines().rev().take(30).collect();
            panic!("the worker did not drain; its last lines:\n{}", tail.join("\n"));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = read(&log);
    let _ = std::fs::remove_file(&log);
    assert_eq!(status.code(), Some(0), "{text}");
    text
}

fn report(redis: &RedisServer, job: &str) -> Value {
    let out = producer(&["report", "--job", job, "--redis", &redis.url(), "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The job is complete, nothing missing, duplicated or unknown; each
/// shard had exactly one provider batch. Returns the status.
fn assert_complete(redis: &RedisServer, job: &str, n: u64, sim: &LlmSim) -> Value {
    let (code, s) = status_json(redis, job);
    assert_eq!(code, Some(0), "{s}");
    assert_eq!(s["done"].as_u64().unwrap() + s["review"].as_u64().unwrap(), n, "{s}");
    for k in ["missing", "duplicates", "unknown", "batched", "queued", "delayed"] {
        assert_eq!(s[k], 0, "{k}: {s}");
    }
    let shards = s["shards"].as_array().unwrap();
    assert!(!shards.is_empty(), "{s}");
    assert!(shards.iter().all(|sh| sh["state"] == "reconciled"), "{s}");
    let with_batch = shards.iter().filter(|sh| sh["batch_id"].is_string()).count() as u64;
    assert_eq!(
        sim.stats()["batches_created"].as_u64().unwrap(),
        with_batch,
        "one provider batch per shard: {s}"
    );
    let mut ids: Vec<&str> = shards.iter().filter_map(|sh| sh["batch_id"].as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len() as u64, with_batch, "no batch serves two shards: {s}");
    s
}

/// Every answer llm-sim generated is one paid call (plus each duplicate
/// line it wrote), all through the Batch API at half the online price.
fn assert_paid_once(redis: &RedisServer, job: &str, sim: &LlmSim, copies: u64) -> Value {
    let r = report(redis, job);
    let spend = &r["spend"];
    assert_eq!(
        spend["calls"].as_u64().unwrap(),
        sim.stats()["served"].as_u64().unwrap() + copies,
        "{r}"
    );
    assert_eq!(spend["batch"]["calls"], spend["calls"], "{r}");
    let (cost, online) = (
        spend["batch"]["cost_usd"].as_f64().unwrap(),
        spend["batch"]["online_cost_usd"].as_f64().unwrap(),
    );
    assert!(cost > 0.0 && (online - 2.0 * cost).abs() < 1e-6, "{r}");
    assert!((spend["cost_usd"].as_f64().unwrap() - cost).abs() < 1e-9, "{r}");
    r
}

fn shard_notes(s: &Value) -> String {
    s["shards"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|sh| sh["notes"].as_array().cloned().unwrap_or_default())
        .map(|n| n.as_str().unwrap_or("").to_owned())
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn a_batch_job_completes_under_each_batch_fault_with_one_batch_per_shard() {
    // (fault, what the shards' notes say about it, what the worker logs)
    let cases = [
        ("", "", "shard reconciled"),
        ("file_invalid", "failed validation", "a batch failed validation"),
        ("expire", "into a later shard", "status\":\"expired"),
        ("stuck", "past its completion window", "cancelling the batch"),
        ("lost_create", "", "its create's answer was lost"),
        ("download_fail", "", "downloading a batch's results"),
        (
            "shuffle,error_lines,duplicates",
            "duplicate lines",
            "batch_server_error",
        ),
    ];
    for (fault, note, logged) in cases {
        let redis = RedisServer::start();
        let dir = TempDir::new("batch-fault");
        let spec = batch_spec(&dir, "");
        let n = 90;
        job(&redis, &dir, "bj", &spec, n);
        let sim = LlmSim::start(&[
            "--batch-faults",
            fault,
            "--batch-secs",
            "1",
            "--batch-window-secs",
            "2",
            "--hang-secs",
            "8",
        ]);
        let log = drain(&redis, "bj", &sim);
        let s = assert_complete(&redis, "bj", n, &sim);
        assert_eq!(s["done"], n, "{fault}: {s}");
        assert!(shard_notes(&s).contains(note), "{fault}: {}", shard_notes(&s));
        // Each duplicate line is a copy the provider wrote (and billed).
        let copies = if fault.contains("duplicates") {
            duplicate_lines(&s)
        } else {
            0
        };
        assert!(!fault.contains("duplicates") || copies > 0, "{s}");
        assert_paid_once(&redis, "bj", &sim, copies);
        assert!(log.contains(logged), "{fault}: {log}");
    }
}

/// A worker whose stderr goes to a file the test reads while it runs.
fn spawn_logged(cmd: &mut Command, log: &Path) -> std::process::Child {
    let file = std::fs::File::create(log).unwrap();
    cmd.stdout(Stdio::null()).stderr(file).spawn().unwrap()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

#[test]
fn a_worker_killed_after_persisting_submitting_never_leads_to_a_second_batch() {
    let redis = RedisServer::start();
    let dir = TempDir::new("batch-kill-submit");
    // The first create is performed by the provider, but its answer never
    // reaches the worker.
    let spec = batch_spec(&dir, "");
    job(&redis, &dir, "bk", &spec, 25);
    let sim = LlmSim::start(&["--batch-faults", "lost_create", "--hang-secs", "30"]);
    let log = dir.join("a.log");
    let mut a = spawn_logged(
        &mut worker_cmd(&redis, "bk", &sim, &["--visibility-timeout-ms", "5000"]),
        &log,
    );
    wait_for("the first create performed", Duration::from_secs(30), || {
        sim.stats()["batches_created"].as_u64().unwrap() >= 1
    });
    // The create is in flight: the shard is `submitting` in Redis.
    let (_, s) = status_json(&redis, "bk");
    assert!(
        s["shards"]
            .as_array()
            .unwrap()
            .iter()
            .any(|sh| sh["state"] == "submitting"),
        "{s}"
    );
    signal(a.id(), "KILL");
    a.wait().unwrap();
    let log_b = drain(&redis, "bk", &sim);
    assert!(log_b.contains("its create's answer was lost"), "{log_b}");
    assert!(log_b.contains("taking over a shard"), "{log_b}");
    assert_complete(&redis, "bk", 25, &sim);
    assert_paid_once(&redis, "bk", &sim, 0);

    // Killed before its create was sent: the next worker finds no batch
    // for the shard and creates the only one.
    let redis = RedisServer::start();
    job(&redis, &dir, "bp", &spec, 25);
    let sim = LlmSim::start(&[]);
    let mut cmd = worker_cmd(&redis, "bp", &sim, &["--visibility-timeout-ms", "5000"]);
    cmd.env("BATCHFLEET_PAUSE_AT", "submitting");
    let mut a = spawn_logged(&mut cmd, &log);
    wait_for("paused at submitting", Duration::from_secs(30), || {
        read(&log).contains("paused for a fault test")
    });
    signal(a.id(), "KILL");
    a.wait().unwrap();
    assert_eq!(sim.stats()["batches_created"], 0);
    drain(&redis, "bp", &sim);
    assert_complete(&redis, "bp", 25, &sim);
    assert_paid_once(&redis, "bp", &sim, 0);
}

#[test]
fn a_worker_killed_during_a_download_leaves_each_answer_settled_and_paid_once() {
    let (redis, dir) = batch_job("batch-kill-download", "bd", 60);
    let sim = LlmSim::start(&["--batch-faults", "shuffle"]);
    let log = dir.join("a.log");
    let mut cmd = worker_cmd(&redis, "bd", &sim, &["--visibility-timeout-ms", "5000"]);
    cmd.env("BATCHFLEET_PAUSE_AT", "download");
    kill_where_paused(cmd, &log);
    let (_, s) = status_json(&redis, "bd");
    assert!(s["batched"].as_u64().unwrap() > 0, "{s}");
    // With no worker left, the autoscaler still sees the shards to poll.
    let open = s["shards"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|sh| sh["state"] != "reconciled")
        .count();
    assert!(open > 0, "{s}");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let work = rt.block_on(async {
        let store = common::store::RedisStore::connect(&redis.url()).await.unwrap();
        store.work_left("bd", 4).await.unwrap()
    });
    assert_eq!(work.iter().map(|w| w.shards).sum::<u64>(), open as u64, "{work:?}");
    assert!(work.iter().map(|w| w.total()).sum::<u64>() >= open as u64);
    let log_b = drain(&redis, "bd", &sim);
    assert!(log_b.contains("taking over a shard"), "{log_b}");
    assert_complete(&redis, "bd", 60, &sim);
    assert_paid_once(&redis, "bd", &sim, 0);
}

/// Runs a worker until it logs its fault-test pause, then kills it -9.
fn kill_where_paused(mut cmd: Command, log: &Path) {
    let mut a = spawn_logged(&mut cmd, log);
    wait_for("the worker's pause", Duration::from_secs(60), || {
        read(log).contains("paused for a fault test")
    });
    signal(a.id(), "KILL");
    a.wait().unwrap();
}

/// Duplicate output lines the shards of a status counted (each a paid copy).
fn duplicate_lines(s: &Value) -> u64 {
    s["shards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|sh| sh["lines"]["duplicates"].as_u64().unwrap())
        .sum()
}

#[test]
fn a_worker_killed_halfway_through_settling_a_shard_leaves_each_answer_and_copy_paid_once() {
    let (redis, dir) = batch_job("batch-kill-settle", "bs", 60);
    let sim = LlmSim::start(&["--batch-faults", "duplicates,shuffle"]);
    let mut cmd = worker_cmd(&redis, "bs", &sim, &["--visibility-timeout-ms", "5000"]);
    cmd.env("BATCHFLEET_PAUSE_AT", "settle");
    kill_where_paused(cmd, &dir.join("a.log"));
    let (_, s) = status_json(&redis, "bs");
    let done = s["done"].as_u64().unwrap();
    assert!((1..60).contains(&done), "half settled: {s}");
    let log_b = drain(&redis, "bs", &sim);
    assert!(log_b.contains("taking over a shard"), "{log_b}");
    let s = assert_complete(&redis, "bs", 60, &sim);
    let copies = duplicate_lines(&s);
    assert!(copies > 0, "{s}");
    assert_paid_once(&redis, "bs", &sim, copies);
}

#[test]
fn two_workers_share_a_batch_job_with_one_batch_per_shard() {
    let (redis, _dir) = batch_job("batch-two", "b2", 150);
    let sim = LlmSim::start(&["--batch-faults", "duplicates,error_lines", "--batch-secs", "2"]);
    let workers: Vec<_> = (0..2)
        .map(|_| {
            Running::spawn(worker_cmd(
                &redis,
                "b2",
                &sim,
                &["--drain", "--visibility-timeout-ms", "8000"],
            ))
        })
        .collect();
    for w in workers {
        let (status, log) = w.finish(Duration::from_secs(120));
        assert_eq!(status.code(), Some(0), "{log}");
    }
    let s = assert_complete(&redis, "b2", 150, &sim);
    let copies = duplicate_lines(&s);
    assert_paid_once(&redis, "b2", &sim, copies);
}

#[test]
fn cancel_mid_batch_keeps_its_partial_results_and_resume_finishes_the_rest() {
    let (redis, _dir) = batch_job("batch-cancel", "bc", 30);
    // Slow batches: the cancel comes while lines are being answered.
    let sim = LlmSim::start(&["--batch-secs", "12"]);
    let w = Running::spawn(worker_cmd(&redis, "bc", &sim, &["--visibility-timeout-ms", "8000"]));
    wait_for("some lines answered", Duration::from_secs(60), || {
        sim.stats()["served"].as_u64().unwrap() >= 8
    });
    let out = producer(&["cancel", "--job", "bc", "--redis", &redis.url()]);
    assert!(out.status.success(), "{}", stderr(&out));
    wait_for("the batch cancelled and settled", Duration::from_secs(60), || {
        let (_, s) = status_json(&redis, "bc");
        s["batched"] == 0
            && s["shards"]
                .as_array()
                .unwrap()
                .iter()
                .all(|sh| sh["state"] == "reconciled")
    });
    let (_, s) = status_json(&redis, "bc");
    let served = sim.stats()["served"].as_u64().unwrap();
    let done = s["done"].as_u64().unwrap();
    assert!((8..30).contains(&done), "the partial results are kept: {s}");
    assert_eq!(done, served, "every answered line is a result: {s}");
    assert_eq!(s["cancelled"].as_u64().unwrap(), 30 - done, "{s}");
    assert!(shard_notes(&s).contains("the job was cancelled"), "{s}");
    signal(w.pid(), "TERM");
    let (status, log) = w.finish(Duration::from_secs(30));
    assert!(status.success(), "{log}");

    let out = producer(&["resume", "--job", "bc", "--redis", &redis.url()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let sim2_served_before = sim.stats()["served"].as_u64().unwrap();
    drain(&redis, "bc", &sim);
    assert_complete(&redis, "bc", 30, &sim);
    let after = sim.stats()["served"].as_u64().unwrap();
    assert_eq!(
        after - sim2_served_before,
        30 - done,
        "only the cancelled records are called again"
    );
    assert_paid_once(&redis, "bc", &sim, 0);
}

#[test]
fn invalid_answers_retry_in_later_shards_or_online_as_the_spec_says() {
    for retries in ["batch", "online"] {
        let redis = RedisServer::start();
        let dir = TempDir::new("batch-retries");
        let spec = batch_spec(&dir, &format!("retries = \"{retries}\""));
        job(&redis, &dir, "br", &spec, 60);
        let sim = LlmSim::start(&["--faults", "missing_field=0.3", "--seed", "7"]);
        drain(&redis, "br", &sim);
        let s = assert_complete(&redis, "br", 60, &sim);
        let r = report(&redis, "br");
        let spend = &r["spend"];
        let (calls, batch) = (
            spend["calls"].as_u64().unwrap(),
            spend["batch"]["calls"].as_u64().unwrap(),
        );
        assert_eq!(calls, sim.stats()["served"].as_u64().unwrap(), "{r}");
        let retried = spend["by_bucket"]["validation_retry"]["calls"].as_u64().unwrap();
        assert!(retried > 0, "{r}");
        // The retries carried the validator's feedback to the model.
        assert!(
            sim.stats()["with_feedback"].as_u64().unwrap() >= retried,
            "{}",
            sim.stats()
        );
        match retries {
            "batch" => {
                assert_eq!(batch, calls, "every call in a batch: {r}");
                assert!(
                    s["shards"].as_array().unwrap().len() > 2,
                    "retries in later shards: {s}"
                );
            }
            _ => assert_eq!(calls - batch, retried, "the retries went online: {r}"),
        }
    }
}

#[test]
fn the_enqueued_token_limit_is_kept_fleet_wide_and_a_provider_refusal_of_it_re_shards() {
    // The provider takes at most one shard's tokens at a time. A spec that
    // says so submits one shard at a time (its own count is the messages'
    // bytes plus max_tokens, above the provider's); one that does not has
    // batches refused with `token_limit_exceeded`, which re-shard (not
    // failures that halt the job).
    for limited in [true, false] {
        let redis = RedisServer::start();
        let dir = TempDir::new("batch-tokens");
        // Each shard is some 11,000 tokens as llm-sim counts them, some
        // 50,000 as the worker does (a token per byte).
        let extra = if limited { "max_enqueued_tokens = 70000" } else { "" };
        let spec = batch_spec(&dir, extra);
        job(&redis, &dir, "bt", &spec, 100);
        let sim = LlmSim::start(&["--batch-enqueued-tokens", "20000", "--batch-secs", "1"]);
        drain(&redis, "bt", &sim);
        let s = assert_complete(&redis, "bt", 100, &sim);
        let shards = s["shards"].as_array().unwrap();
        let refused = shards.iter().filter(|sh| sh["provider_status"] == "failed").count();
        if limited {
            assert_eq!(refused, 0, "{s}");
            // The tokens counted against the limit are given back: none left.
            let mut c = redis.conn();
            let held: u64 = redis::cmd("HLEN")
                .arg(common::keys::batch_tokens("bt"))
                .query(&mut c)
                .unwrap();
            assert_eq!(held, 0);
        } else {
            assert!(refused > 0, "{s}");
            assert!(shard_notes(&s).contains("token_limit_exceeded"), "{}", shard_notes(&s));
        }
        assert!(s["halted"].is_null(), "{s}");
        assert_paid_once(&redis, "bt", &sim, 0);
    }
}

#[test]
fn batches_that_keep_failing_validation_halt_the_job_with_the_providers_words_and_lose_nothing() {
    let (redis, _dir) = batch_job("batch-invalid", "bi", 40);
    let sim = LlmSim::start(&["--batch-faults", "invalid_always"]);
    let w = Running::spawn(worker_cmd(
        &redis,
        "bi",
        &sim,
        &["--drain", "--visibility-timeout-ms", "8000"],
    ));
    let (status, log) = w.finish(Duration::from_secs(120));
    assert_eq!(status.code(), Some(3), "halted: {log}");
    let (code, s) = status_json(&redis, "bi");
    assert_ne!(code, Some(0), "{s}");
    let reason = s["halted"].as_str().unwrap_or_default();
    assert!(
        reason.contains("3 provider batches failed validation") && reason.contains("invalid_json_line"),
        "{s}"
    );
    // Nothing is lost: every record is queued again (or still in a shard).
    assert_eq!(
        s["queued"].as_u64().unwrap() + s["batched"].as_u64().unwrap(),
        40,
        "{s}"
    );
    assert_eq!(s["missing"], 0, "{s}");
    assert_eq!(sim.stats()["served"], 0);
    assert_eq!(
        report(&redis, "bi")["spend"]["calls"],
        0,
        "a failed batch bills nothing"
    );
}

/// A batch's output file is kept whole in the sink before its answers are
/// settled (the provider deletes it after its retention; the trail does
/// not): each answer's trail names it, and the line that answered the
/// record is in it, its response kept and verified by `producer trace`.
#[test]
fn a_batch_s_output_file_is_archived_and_each_answer_traces_to_it() {
    let redis = RedisServer::start();
    let dir = TempDir::new("batch-trail");
    let out = dir.join("out");
    let sink = format!(
        "[sink]\nkind = \"files\"\ndir = \"{}\"\nsegment_secs = 1\n\n[batch]",
        out.display()
    );
    let spec = spec_with(&dir, &[]);
    let text = std::fs::read_to_string(batch_spec(&dir, ""))
        .unwrap()
        .replace("[batch]", &sink);
    std::fs::write(&spec, text).unwrap();
    job(&redis, &dir, "bt", &spec, 40);
    let sim = LlmSim::start(&["--batch-secs", "1"]);
    drain(&redis, "bt", &sim);
    assert_complete(&redis, "bt", 40, &sim);
    let out_trace = producer(&["trace", "--job", "bt", "--redis", &redis.url(), "msg-3", "--json"]);
    assert!(out_trace.status.success(), "{}", stderr(&out_trace));
    let chain: Value = serde_json::from_slice(&out_trace.stdout).unwrap();
    let call = &chain["attempts"][0];
    assert!(call["batch"].is_string(), "{chain}");
    assert_eq!(call["response"], "verified", "{chain}");
    let files = call["trail"]["batch_files"].as_array().unwrap();
    assert!(!files.is_empty(), "{chain}");
    let raw = out.join("bt").join("raw");
    let kept: Vec<String> = files
        .iter()
        .map(|f| {
            let sha = f.as_str().unwrap();
            std::fs::read_to_string(raw.join(&sha[..2]).join(sha)).unwrap_or_else(|e| panic!("{sha}: {e}"))
        })
        .collect();
    let rid = chain["record_id"].as_str().unwrap();
    assert!(
        kept.iter().any(|file| file.lines().any(|l| l.contains(rid))),
        "the record's line is in a kept file"
    );
    // `trace` reads each file back and hashes it again: a file altered or
    // gone in the sink breaks the chain, and says which.
    let found = |chain: &Value| -> Vec<String> {
        chain["attempts"][0]["batch_files"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["found"].as_str().unwrap().to_owned())
            .collect()
    };
    assert!(found(&chain).iter().all(|f| f == "verified"), "{chain}");
    let first = files[0].as_str().unwrap();
    let place = raw.join(&first[..2]).join(first);
    for (change, expected) in [("altered", "altered"), ("removed", "missing")] {
        if change == "altered" {
            std::fs::write(&place, "not the provider's file").unwrap();
        } else {
            std::fs::remove_file(&place).unwrap();
        }
        let broken = producer(&["trace", "--job", "bt", "--redis", &redis.url(), "msg-3", "--json"]);
        assert_eq!(broken.status.code(), Some(1), "a {change} batch file breaks the chain");
        let chain: Value = serde_json::from_slice(&broken.stdout).unwrap();
        assert_eq!(found(&chain)[0], expected, "{chain}");
        let told = producer(&["trace", "--job", "bt", "--redis", &redis.url(), "msg-3"]);
        assert_eq!(told.status.code(), Some(1));
        assert!(
            stdout(&told).contains(&format!("batch file sha256 {first}: {expected}"))
                && stderr(&told).contains("batch file the trail names is missing or altered"),
            "{}{}",
            stdout(&told),
            stderr(&told)
        );
    }
}

/// A batch job cross-checked by a second model: the answers come through the
/// Batch API, each checked one goes to the checker online (the check is
/// the record's next step, marked to run online), and the records commit
/// once it agrees; its calls are cause `check`, the others batch ones.
#[test]
fn a_batch_job_s_answers_are_cross_checked_online() {
    let redis = RedisServer::start();
    let dir = TempDir::new("batch-check");
    let checker = LlmSim::start(&[]);
    let check = format!(
        "[check]\nmodel = \"judge-model\"\nbase_url = \"{}\"\napi_key_env = \"OPENAI_API_KEY\"\nfields = [\"task_type\"]\n\n[batch]",
        checker.base_url()
    );
    let spec = spec_with(&dir, &[]);
    let text = std::fs::read_to_string(batch_spec(&dir, ""))
        .unwrap()
        .replace("[batch]", &check);
    std::fs::write(&spec, text).unwrap();
    job(&redis, &dir, "bc", &spec, 40);
    let sim = LlmSim::start(&["--batch-secs", "1"]);
    drain(&redis, "bc", &sim);
    let (code, s) = status_json(&redis, "bc");
    assert_eq!((code, s["done"].as_u64()), (Some(0), Some(40)), "{s}");
    assert_eq!(checker.stats()["served"], 40, "every answer checked online");
    let r = report(&redis, "bc");
    assert_eq!(r["spend"]["by_bucket"]["check"]["calls"], 40, "{}", r["spend"]);
    assert_eq!(r["spend"]["batch"]["calls"], 40, "{}", r["spend"]);
    assert_eq!(r["agreement"]["task_type"]["agreed"], 40, "{}", r["agreement"]);
}

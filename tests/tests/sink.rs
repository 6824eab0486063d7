//! The PostgreSQL result sink against a real PostgreSQL server the harness
//! starts itself (127.0.0.1, a free port): exactly one row per done record
//! through a writer killed mid-transaction, the database and Redis killed and
//! restarted, and redelivered batches; and the clear errors of a mistyped
//! table, a wrong password and a stopped server.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::keys;
use harness::{
    LlmSim, PgServer, RedisServer, Running, TEST_PG_PASSWORD, TempDir, enqueue, producer, spec_with, wait_for,
    worker_cmd, write_records,
};
use serde_json::Value;

const URL_ENV: &str = "BF_TEST_DATABASE_URL";

/// The example spec writing to `results` in the database `URL_ENV` names
/// (a 3 s provider timeout, so the tests' visibility timeout can be short).
fn sink_spec(dir: &TempDir) -> PathBuf {
    spec_with(
        dir,
        &[
            (
                "[retry]",
                &harness::sink_section(URL_ENV, "table = \"results\"\nbatch_rows = 50\n"),
            ),
            ("timeout_secs = 30", "timeout_secs = 3"),
        ],
    )
}

fn worker(redis: &RedisServer, sim: &LlmSim, db_url: &str, extra: &[&str]) -> Command {
    let mut c = worker_cmd(redis, "sink", sim, extra);
    c.env(URL_ENV, db_url);
    c
}

/// `producer status --json --require-complete`, with the database URL set.
fn status(redis: &RedisServer, db_url: &str) -> (Option<i32>, Value) {
    harness::status_json_env(&redis.url(), "sink", &[(URL_ENV, db_url)])
}

/// What the job spent, from `producer report`, in nano-USD.
fn spend_nusd(redis: &RedisServer, db_url: &str) -> u64 {
    let out = harness::producer_with_env(
        &["report", "--job", "sink", "--redis", &redis.url(), "--json"],
        &[(URL_ENV, db_url)],
    );
    assert!(out.status.success(), "{}", harness::stderr(&out));
    let r: Value = serde_json::from_str(&harness::stdout(&out)).unwrap();
    (r["spend"]["cost_usd"].as_f64().unwrap() * 1e9).round() as u64
}

/// The job's rows in the results table (its primary key makes each record once).
fn rows(pg: &PgServer) -> u64 {
    pg.query("SELECT count(*) FROM results WHERE job = 'sink'")
        .parse()
        .unwrap()
}

#[test]
fn every_done_record_is_one_row_through_kills_of_the_writer_the_database_and_redis() {
    let pg = PgServer::start();
    let mut pg = pg;
    let mut redis = RedisServer::start_with(&["--save", "", "--appendonly", "yes", "--appendfsync", "always"]);
    let sim = LlmSim::start(&[
        "--latency-ms",
        "50",
        "--faults",
        "bad_enum=0.05,content_filter=0.02",
        "--seed",
        "3",
    ]);
    let dir = TempDir::new("sink");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 2000);
    enqueue(&redis, &data, "sink", &sink_spec(&dir));
    let url = pg.url();
    let fast = [
        "--concurrency",
        "4",
        "--visibility-timeout-ms",
        "4000",
        "--drain-timeout-secs",
        "5",
    ];

    // A: writes some rows, then its next write blocks on a lock mid-transaction
    // and it is killed -9 there: the database rolls that transaction back.
    let a = Running::spawn(worker(&redis, &sim, &url, &fast));
    wait_for("rows in the table", Duration::from_secs(60), || {
        pg.query("SELECT to_regclass('results') IS NOT NULL") == "t" && rows(&pg) >= 100
    });
    let mut lock = Command::new("psql")
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &pg.port().to_string(),
            "-U",
            "bf",
            "-d",
            "postgres",
        ])
        .args([
            "-c",
            "BEGIN; LOCK TABLE results IN ACCESS EXCLUSIVE MODE; SELECT pg_sleep(3); COMMIT;",
        ])
        .env("PGPASSWORD", TEST_PG_PASSWORD)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let blocked = pg.query("SELECT count(*) FROM pg_locks WHERE NOT granted");
    assert_ne!(blocked.trim(), "0", "the writer waits on the lock mid-transaction");
    harness::signal(a.pid(), "KILL");
    let _ = a.finish(Duration::from_secs(10));
    assert!(lock.wait().unwrap().success());

    // B: takes over A's batch once it is stale; meanwhile the database is
    // killed -9 and restarted, then Redis (replaying its AOF).
    let b = Running::spawn(worker(&redis, &sim, &url, &fast));
    let before = rows(&pg);
    wait_for("more rows", Duration::from_secs(60), || rows(&pg) > before + 100);
    pg.kill9_and_restart_after(Duration::from_secs(2));
    wait_for("rows again after the database restart", Duration::from_secs(60), || {
        rows(&pg) > before + 200
    });
    redis.kill9_and_restart();

    // C drains the job (and the sink) and exits; B is stopped.
    let (exit, log) = Running::spawn(worker(&redis, &sim, &url, &[&fast[..], &["--drain"]].concat()))
        .finish(Duration::from_secs(120));
    assert!(exit.success(), "{log}");
    harness::signal(b.pid(), "TERM");
    let (exit_b, log_b) = b.finish(Duration::from_secs(60));
    assert!(exit_b.success(), "{log_b}");

    let (code, s) = status(&redis, &url);
    let done = s["done"].as_u64().unwrap();
    assert_eq!(code, Some(0), "complete, proven from the table: {s}");
    assert_eq!(s["sink"]["verified"]["exact"], true, "{s}");
    assert_eq!(s["sink"]["backlog"], 0, "{s}");
    assert_eq!(rows(&pg), done, "one row per done record: {s}");
    assert!(done > 1800, "{s}");
    // What is in review is in the failures table, unresolved.
    let review = s["review"].as_u64().unwrap();
    let failures = pg.query("SELECT count(*) FROM results_failures WHERE resolved_at IS NULL AND state = 'review'");
    assert_eq!(failures.trim().parse::<u64>().unwrap(), review, "{s}");
    let orphans = pg
        .query("SELECT count(*) FROM results_failures f JOIN results r USING (record_id) WHERE f.resolved_at IS NULL");
    assert_eq!(orphans.trim(), "0", "no done record is an open failure");

    // The results left Redis once the table held them; their records stay
    // done there, and every reader finds them in the table.
    let mut c = redis.conn();
    for p in 0..4 {
        let left: u64 = redis::cmd("HLEN").arg(keys::results("sink", p)).query(&mut c).unwrap();
        assert_eq!(left, 0, "partition {p} still holds results");
    }
    assert_eq!(s["sink"]["left_redis"], done, "{s}");
    // Their idempotency keys left with them; the state entries still keep
    // the records from being enqueued again.
    let idem: Vec<String> = redis::cmd("KEYS").arg("bf:{sink:p*}:idem:*").query(&mut c).unwrap();
    let review = s["review"].as_u64().unwrap();
    assert_eq!(idem.len() as u64, review, "only records not in the sink keep their key");
    // Their origins moved into their state entries: `d@<dataset tag>:<line>`.
    let origins: u64 = redis.hlen_sum("sink", keys::origins);
    assert_eq!(origins, review, "only records not in the sink keep an origins entry");
    let states: std::collections::HashMap<String, String> =
        redis::cmd("HGETALL").arg(keys::state("sink", 0)).query(&mut c).unwrap();
    let sunk: Vec<&String> = states.values().filter(|v| v.starts_with("d@")).collect();
    assert!(
        !sunk.is_empty() && sunk.iter().all(|v| v.starts_with("d@1:") && v.len() <= 14),
        "the dataset's tag and the line, in at most 14 bytes: {sunk:?}"
    );
    let again = harness::producer(&[
        "enqueue",
        data.to_str().unwrap(),
        "--job",
        "sink",
        "--spec",
        sink_spec(&dir).to_str().unwrap(),
        "--redis",
        &redis.url(),
        "--json",
        "--restart",
    ]);
    assert!(again.status.success(), "{}", harness::stderr(&again));
    let again: Value = serde_json::from_str(&harness::stdout(&again)).unwrap();
    assert_eq!(
        (again["enqueued"].as_u64(), again["already_present"].as_u64()),
        (Some(0), Some(2000)),
        "{again}"
    );
    let export = |env: &[(&str, &str)]| harness::export_done_env(&redis.url(), "sink", env);
    let out = export(&[]);
    assert!(!out.status.success());
    assert!(
        harness::stderr(&out).contains("only in PostgreSQL, table results: set BF_TEST_DATABASE_URL"),
        "{}",
        harness::stderr(&out)
    );
    let out = export(&[(URL_ENV, &url)]);
    assert!(out.status.success(), "{}", harness::stderr(&out));
    let lines: Vec<Value> = harness::stdout(&out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len() as u64, done, "export reads the table");
    let sample = &lines[0];
    let in_table = pg.query(&format!(
        "SELECT output::text FROM results WHERE record_id = '{}'",
        sample["record_id"].as_str().unwrap()
    ));
    assert_eq!(serde_json::from_str::<Value>(&in_table).unwrap(), sample["output"]);
    assert!(sample["history"].as_array().is_some_and(|h| !h.is_empty()), "{sample}");
    assert!(
        sample["input"]["message_id"].is_string(),
        "the input is kept beside the result: {sample}"
    );
    // Every paid call is in the ledger table once, or still in Redis (the
    // check proves it against the spend counters); export reads both, each
    // call once, and they add up to what was spent.
    let l = &s["sink"]["verified"]["ledger"];
    assert_eq!(
        (l["complete"].as_bool(), l["missing"].as_u64()),
        (Some(true), Some(0)),
        "{s}"
    );
    let in_sink = l["in_sink"].as_u64().unwrap();
    assert!(in_sink >= done, "{s}");
    let table: u64 = pg
        .query("SELECT count(*) FROM results_ledger WHERE job = 'sink'")
        .parse()
        .unwrap();
    assert_eq!(table, in_sink);
    let spent = spend_nusd(&redis, &url);
    let (calls, nusd) = harness::exported_ledger(&redis.url(), "sink", &[(URL_ENV, &url)]);
    assert_eq!(calls.len() as u64, l["counted"].as_u64().unwrap(), "{s}");
    assert_eq!(nusd, spent);
    let table_nusd: u64 = pg
        .query("SELECT sum(cost_nusd) FROM results_ledger WHERE job = 'sink'")
        .parse()
        .unwrap();
    assert!(table_nusd > 0 && table_nusd <= spent);
    // Once held twice the visibility timeout, the calls the table holds
    // leave Redis; the counters keep them.
    std::thread::sleep(Duration::from_secs(8));
    let (exit, log) =
        Running::spawn(worker(&redis, &sim, &url, &[&fast[..], &["--drain"]].concat())).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    assert_eq!(l["only_in_redis"], 0, "every call was handed to the table: {s}");
    assert_eq!(redis.hlen_sum("sink", keys::ledger), 0, "the calls left Redis");
    let held: u64 = (0..4)
        .map(|p| {
            redis::cmd("ZCARD")
                .arg(keys::ledger_sunk("sink", p))
                .query::<u64>(&mut c)
                .unwrap()
        })
        .sum();
    assert_eq!(held, 0);
    assert_eq!(spend_nusd(&redis, &url), spent, "spend never shrinks");
    let (calls, nusd) = harness::exported_ledger(&redis.url(), "sink", &[(URL_ENV, &url)]);
    assert_eq!((calls.len() as u64, nusd), (l["counted"].as_u64().unwrap(), spent));

    let report = harness::producer_with_env(
        &["report", "--job", "sink", "--redis", &redis.url(), "--json"],
        &[(URL_ENV, &url)],
    );
    assert!(report.status.success(), "{}", harness::stderr(&report));
    let report: Value = serde_json::from_str(&harness::stdout(&report)).unwrap();
    assert_eq!(report["done"], done, "report reads the table: {report}");
    let prompt: u64 = pg
        .query("SELECT sum((a->'usage'->>'prompt_tokens')::bigint) FROM results, jsonb_array_elements(history) a WHERE job = 'sink'")
        .parse()
        .unwrap();
    // Status counts every paid call (the cost ledger), what left Redis
    // for the table included.
    assert_eq!(s["tokens"]["prompt"], report["spend"]["prompt_tokens"], "{s}");
    assert!(
        s["tokens"]["prompt"].as_u64().unwrap() >= prompt,
        "status still counts what left Redis: {s}"
    );

    // A redelivered batch adds nothing: 100 results of partition 0 as a
    // writer that died after its transaction and before its acknowledgement
    // leaves them (still in Redis, handed to the sink again).
    let ids: Vec<String> = lines
        .iter()
        .filter(|l| common::record::partition_of(l["record_id"].as_str().unwrap(), 4) == 0)
        .take(100)
        .map(|l| {
            let rid = l["record_id"].as_str().unwrap().to_owned();
            let _: () = redis::cmd("HSET")
                .arg(keys::results("sink", 0))
                .arg(&rid)
                .arg(l.to_string())
                .query(&mut c)
                .unwrap();
            rid
        })
        .collect();
    assert!(ids.len() > 10);
    // And a record handed over twice in one batch, as a result and as a
    // failure (review, then rejected): one row each, nothing stuck.
    let reviewed: Vec<String> = redis::cmd("HKEYS").arg(keys::review("sink", 0)).query(&mut c).unwrap();
    assert!(!reviewed.is_empty(), "content_filter sent records of p0 to review");
    let twice: Vec<(&str, &str)> = reviewed
        .iter()
        .take(1)
        .map(|r| (r.as_str(), "f"))
        .chain(ids.iter().take(1).map(|r| (r.as_str(), "r")))
        .flat_map(|e| [e, e])
        .collect();
    let again = twice.into_iter().chain(ids.iter().map(|r| (r.as_str(), "r")));
    for (id, k) in again {
        let _: String = redis::cmd("XADD")
            .arg(keys::sink("sink", 0))
            .arg("*")
            .arg("rid")
            .arg(id)
            .arg("k")
            .arg(k)
            .query(&mut c)
            .unwrap();
    }
    let (exit, log) =
        Running::spawn(worker(&redis, &sim, &url, &[&fast[..], &["--drain"]].concat())).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    assert_eq!(rows(&pg), done, "the redelivered batch added no row");
    // The whole reconciliation from SQL alone: what the job expects (its
    // jobs row, from the manifest) is in the results or, open, the failures.
    assert_eq!(
        pg.query("SELECT expected_records FROM results_jobs WHERE job = 'sink'"),
        "2000"
    );
    let accounted = pg.query(
        "SELECT (SELECT count(*) FROM results WHERE job = 'sink') \
         + (SELECT count(*) FROM results_failures WHERE job = 'sink' AND resolved_at IS NULL)",
    );
    assert_eq!(accounted, "2000", "every expected record is a row or an open failure");
    let left: u64 = redis::cmd("HLEN").arg(keys::results("sink", 0)).query(&mut c).unwrap();
    assert_eq!(left, 0, "the redelivered results left Redis again");
    let failure_rows = pg.query(&format!(
        "SELECT count(*) FROM results_failures WHERE record_id = '{}'",
        reviewed[0]
    ));
    assert_eq!(failure_rows, "1", "a failure handed over twice is one row");
    let (code, s) = status(&redis, &url);
    assert_eq!((code, &s["sink"]["backlog"]), (Some(0), &Value::from(0)), "{s}");
    // The database password appears in no log and no status.
    for text in [&log, &log_b, &s.to_string()] {
        assert!(!text.contains(TEST_PG_PASSWORD));
    }
}

/// Runs a worker for a job whose sink cannot write (the database URL as
/// given), checks every outcome waits in Redis, and returns the worker's log.
fn failing_sink(db_url: &str) -> String {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    let dir = TempDir::new("sinkfail");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 20);
    enqueue(&redis, &data, "sink", &sink_spec(&dir));
    let w = Running::spawn(worker(&redis, &sim, db_url, &["--drain-timeout-secs", "1"]));
    let job_status = || {
        let out = producer(&["status", "--job", "sink", "--redis", &redis.url(), "--json"]);
        serde_json::from_str::<Value>(&harness::stdout(&out)).unwrap()
    };
    wait_for("the records committed in Redis", Duration::from_secs(30), || {
        job_status()["done"] == 20
    });
    std::thread::sleep(Duration::from_millis(500));
    harness::signal(w.pid(), "TERM");
    let (exit, log) = w.finish(Duration::from_secs(30));
    assert!(exit.success(), "the worker keeps working while its sink fails: {log}");
    let s = job_status();
    assert_eq!(
        s["sink"]["backlog"], 40,
        "every outcome and its paid call wait in Redis: {s}"
    );
    log
}

#[test]
fn a_mistyped_table_a_wrong_password_and_a_stopped_server_each_say_so() {
    let pg = PgServer::start();
    pg.query(
        "CREATE TABLE results (record_id text PRIMARY KEY, job text, business_key text, versions jsonb, \
         output jsonb, attempts text, calls integer)",
    );
    let log = failing_sink(&pg.url());
    assert!(
        log.contains("table results: column `attempts` is text, batchfleet writes integer"),
        "{log}"
    );
    assert_eq!(
        pg.query("SELECT count(*) FROM results"),
        "0",
        "nothing written into a table of another shape"
    );

    let wrong = pg.url().replace(TEST_PG_PASSWORD, "not-the-password-123");
    let log = failing_sink(&wrong);
    assert!(log.contains("the database refused the connection"), "{log}");
    assert!(log.contains("password authentication failed"), "{log}");
    assert!(!log.contains("not-the-password-123"), "the password is never printed");

    let stopped = format!(
        "postgres://bf:{TEST_PG_PASSWORD}@127.0.0.1:{}/postgres",
        harness::free_port()
    );
    let log = failing_sink(&stopped);
    assert!(log.contains("cannot reach the database"), "{log}");
    assert!(!log.contains(TEST_PG_PASSWORD), "the password is never printed");
}

#[test]
fn a_row_the_database_rejects_goes_back_to_review_with_its_message_and_the_others_are_written() {
    let pg = PgServer::start();
    // The user's own rule on their table: no record labelled `bug`.
    pg.query(&common::sink::ddl("results"));
    pg.query("ALTER TABLE results ADD CONSTRAINT no_bugs_here CHECK (output->>'label' <> 'bug')");
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--seed", "5"]);
    let dir = TempDir::new("sinkreject");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 120);
    // And one record whose input lacks a field the prompt uses: dropped at enqueue.
    let mut text = std::fs::read_to_string(&data).unwrap();
    text.push_str("{\"message_id\":\"no-text\",\"channel\":\"chat\",\"task_type\":\"classify\"}\n");
    std::fs::write(&data, text).unwrap();
    enqueue(&redis, &data, "sink", &sink_spec(&dir));
    let url = pg.url();
    let (exit, log) = Running::spawn(worker(&redis, &sim, &url, &["--drain"])).finish(Duration::from_secs(120));
    assert!(exit.success(), "{log}");
    let (code, s) = status(&redis, &url);
    let done = s["done"].as_u64().unwrap();
    // Each refused record is back in review, with the database's message,
    // in Redis and in the failures table; its result left the results hash.
    let bugs: u64 = pg
        .query(
            "SELECT count(*) FROM results_failures WHERE state = 'review' AND reason = 'sink_rejected' \
             AND errors::text LIKE '%no_bugs_here%' AND resolved_at IS NULL",
        )
        .parse()
        .unwrap();
    assert!(bugs > 0, "llm-sim labelled some records `bug`: {s}");
    assert!(log.contains("the database rejected rows"), "{log}");
    assert_eq!(s["review"], bugs, "{s}");
    assert_eq!(s["done"].as_u64().unwrap() + bugs, 120, "{s}");
    assert_eq!(s["dropped"], 1, "{s}");
    let dropped =
        pg.query("SELECT state || ' ' || reason FROM results_failures WHERE business_key = '' AND state = 'dropped'");
    assert_eq!(
        dropped, "dropped template_missing:text",
        "a record dropped at enqueue is a failure row too"
    );
    let accounted = pg.query(
        "SELECT j.expected_records - (SELECT count(*) FROM results r WHERE r.job = j.job) \
         - (SELECT count(*) FROM results_failures f WHERE f.job = j.job AND f.resolved_at IS NULL) \
         FROM results_jobs j WHERE j.job = 'sink'",
    );
    assert_eq!(accounted, "0", "reconciled from SQL alone");
    assert_eq!(code, Some(0), "every record is done (in the table) or in review: {s}");
    assert_eq!(s["sink"]["verified"]["exact"], true, "{s}");
    assert_eq!(rows(&pg), done, "every other done record is written: {s}");
    let kept: u64 = redis.hlen_sum("sink", keys::results);
    assert_eq!(kept, 0, "no result waits in Redis");
    let key = pg.query("SELECT business_key FROM results_failures WHERE reason = 'sink_rejected' LIMIT 1");
    let show = producer(&["review", "--job", "sink", "--redis", &redis.url(), "show", &key]);
    let entry: Value = serde_json::from_str(&harness::stdout(&show)).unwrap();
    assert_eq!(entry["errors"][0]["code"], "E_SINK", "{entry}");
    assert!(
        entry["errors"][0]["message"].as_str().unwrap().contains("no_bugs_here"),
        "{entry}"
    );

    // A person fixes one: accepted, it is done again and written.
    let mut fixed: Value = serde_json::from_str(entry["last_raw_output"].as_str().unwrap()).unwrap();
    fixed["label"] = Value::from("other");
    let file = dir.join("fixed.json");
    std::fs::write(&file, fixed.to_string()).unwrap();
    let accept = producer(&[
        "review",
        "--job",
        "sink",
        "--redis",
        &redis.url(),
        "--reviewer",
        "ann",
        "accept",
        &key,
        "--output",
        file.to_str().unwrap(),
    ]);
    assert!(accept.status.success(), "{}", harness::stderr(&accept));
    let (exit, log) = Running::spawn(worker(&redis, &sim, &url, &["--drain"])).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    assert_eq!(rows(&pg), done + 1, "the fixed record is written");
    let resolved = pg.query(&format!(
        "SELECT resolved_at IS NOT NULL FROM results_failures WHERE business_key = '{key}'"
    ));
    assert_eq!(resolved, "t", "its failure is resolved");
}

#[test]
fn claims_stop_at_the_sink_backlog_limit_and_resume_when_the_database_is_back() {
    let mut pg = PgServer::start();
    let url = pg.url();
    pg.kill9();
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--latency-ms", "100"]);
    let dir = TempDir::new("sinkfull");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 60);
    let spec = spec_with(
        &dir,
        &[
            (
                "[retry]",
                &harness::sink_section(URL_ENV, "table = \"results\"\nmax_backlog = 10\n"),
            ),
            ("timeout_secs = 30", "timeout_secs = 3"),
        ],
    );
    enqueue(&redis, &data, "sink", &spec);
    let w = Running::spawn(worker(&redis, &sim, &url, &["--concurrency", "2", "--drain"]));
    let done = || {
        let out = producer(&["status", "--job", "sink", "--redis", &redis.url(), "--json"]);
        serde_json::from_str::<Value>(&harness::stdout(&out)).unwrap()["done"]
            .as_u64()
            .unwrap()
    };
    // 10 entries: each record's outcome and its paid call.
    wait_for("the backlog limit reached", Duration::from_secs(30), || done() >= 5);
    std::thread::sleep(Duration::from_secs(3));
    let held = done();
    // The limit, plus what was in flight or finished before it was seen
    // (checked 4 times a second; at most 20 records a second here).
    assert!(held < 25, "claims stopped at the backlog limit: {held} done of 60");
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(done(), held, "nothing more is claimed while the sink is down");

    // The database is back: the backlog drains, claims resume, the job completes.
    pg.start_again();
    let (exit, log) = w.finish(Duration::from_secs(120));
    assert!(exit.success(), "{log}");
    assert!(
        log.contains("stops claiming the job until the sink catches up"),
        "{log}"
    );
    assert!(log.contains("claiming again"), "{log}");
    let (code, s) = status(&redis, &url);
    assert_eq!(code, Some(0), "{s}");
    assert_eq!(rows(&pg), 60, "{s}");
}

#[test]
fn a_revision_of_a_written_row_keeps_the_previous_output_in_the_revisions_table() {
    let pg = PgServer::start();
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    let dir = TempDir::new("sinkrevise");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 20);
    enqueue(&redis, &data, "sink", &sink_spec(&dir));
    let url = pg.url();
    let (exit, log) = Running::spawn(worker(&redis, &sim, &url, &["--drain"])).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    let old = pg.query("SELECT output->>'label' FROM results WHERE business_key = 'msg-4'");
    let file = dir.join("revised.json");
    let label = if old == "account" { "billing" } else { "account" };
    std::fs::write(
        &file,
        format!(r#"{{"label": "{label}", "reason": "checked", "confidence": 1.0, "task_type": "classify"}}"#),
    )
    .unwrap();
    let path = file.display().to_string();
    let args = [
        "review",
        "--job",
        "sink",
        "--redis",
        &redis.url(),
        "--reviewer",
        "dave",
        "revise",
        "msg-4",
        "--output",
        &path,
    ];
    let without = producer(&args);
    assert!(
        !without.status.success() && harness::stderr(&without).contains(URL_ENV),
        "the database URL is needed: {}",
        harness::stderr(&without)
    );
    for n in 1..=2 {
        let r = harness::producer_with_env(&args, &[(URL_ENV, &url)]);
        assert!(r.status.success(), "{}", harness::stderr(&r));
        assert!(
            harness::stdout(&r).contains(&format!("revision {n}")),
            "{}",
            harness::stdout(&r)
        );
    }
    assert_eq!(rows(&pg), 20, "a revision adds no row");
    assert_eq!(
        pg.query(
            "SELECT output->>'label' || ' ' || human || ' ' || reviewer FROM results WHERE business_key = 'msg-4'"
        ),
        format!("{label} true dave")
    );
    assert_eq!(
        pg.query(
            "SELECT string_agg(revision || ':' || (v.previous->>'label') || '>' || (v.output->>'label'), ',' ORDER BY v.revision) \
             FROM results_revisions v JOIN results r USING (record_id) WHERE r.business_key = 'msg-4'"
        ),
        format!("1:{old}>{label},2:{label}>{label}"),
        "every revision keeps the output it replaced"
    );
    let export = harness::export_done_env(&redis.url(), "sink", &[(URL_ENV, &url)]);
    let r4: Value = String::from_utf8_lossy(&export.stdout)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|r| r["key"] == "msg-4")
        .unwrap();
    assert_eq!(r4["output"]["label"], label);
    assert_eq!(r4["revisions"].as_array().map(Vec::len), Some(2), "{r4}");
}

#[test]
fn typed_columns_hold_each_output_field_with_its_type_and_a_table_without_one_says_so() {
    let pg = PgServer::start();
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--seed", "9"]);
    let dir = TempDir::new("sinktyped");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 40);
    let spec = spec_with(
        &dir,
        &[(
            "[retry]",
            &harness::sink_section(URL_ENV, "table = \"typed\"\ntyped_columns = true\n"),
        )],
    );
    enqueue(&redis, &data, "sink", &spec);
    let url = pg.url();
    let (exit, log) = Running::spawn(worker(&redis, &sim, &url, &["--drain"])).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    assert_eq!(
        pg.query(
            "SELECT string_agg(column_name || ' ' || data_type, ', ' ORDER BY column_name) FROM information_schema.columns \
             WHERE table_name = 'typed' AND column_name LIKE 'out\\_%'"
        ),
        "out_confidence double precision, out_items jsonb, out_label text, out_reason text, out_task_type text"
    );
    let done: u64 = pg.query("SELECT count(*) FROM typed").parse().unwrap();
    assert!(done >= 30, "{done}");
    assert_eq!(
        pg.query(
            "SELECT count(*) FROM typed WHERE out_label IS DISTINCT FROM output->>'label' \
             OR out_confidence IS DISTINCT FROM (output->>'confidence')::float8 \
             OR out_task_type IS DISTINCT FROM output->>'task_type' \
             OR out_items IS DISTINCT FROM NULLIF(output->'items', 'null'::jsonb)"
        ),
        "0",
        "each typed column holds its field"
    );
    assert_ne!(pg.query("SELECT count(*) FROM typed WHERE out_label IS NOT NULL"), "0");

    // A table of the user's without one of the columns: the error names it.
    pg.query(&common::sink::ddl("typed2"));
    let spec2 = spec_with(
        &dir,
        &[(
            "[retry]",
            &harness::sink_section(URL_ENV, "table = \"typed2\"\ntyped_columns = true\n"),
        )],
    );
    let redis2 = RedisServer::start();
    enqueue(&redis2, &data, "sink", &spec2);
    // A short drain: the sink cannot write, so the flush waits it out.
    let w = Running::spawn(worker(&redis2, &sim, &url, &["--drain-timeout-secs", "5"]));
    std::thread::sleep(Duration::from_secs(3));
    harness::signal(w.pid(), "TERM");
    let (_, log) = w.finish(Duration::from_secs(30));
    assert!(
        log.contains("table typed2 has no column `out_label` (text) for output field `label` (sink.typed_columns)"),
        "{log}"
    );
}

/// The audit trail in PostgreSQL: every response the fleet received is a row
/// of `results_raw` under its sha256 (a retry's wrong answer too), and
/// `producer trace` proves a row from it, or names the one altered there.
#[test]
fn responses_are_kept_in_the_raw_table_and_trace_reads_them_back() {
    let pg = PgServer::start();
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--faults", "bad_enum=0.3", "--seed", "3"]);
    let dir = TempDir::new("sinkraw");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 30);
    enqueue(&redis, &data, "sink", &sink_spec(&dir));
    let url = pg.url();
    let (exit, log) = Running::spawn(worker(&redis, &sim, &url, &["--drain"])).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    let answered: u64 = pg
        .query("SELECT count(*) FROM results_ledger WHERE job = 'sink'")
        .parse()
        .unwrap();
    let kept: u64 = pg
        .query("SELECT count(*) FROM results_raw WHERE job = 'sink' AND encode(sha256(body), 'hex') = sha256")
        .parse()
        .unwrap();
    assert!(answered > 30, "some answers were wrong and retried: {answered} calls");
    assert_eq!(kept, answered, "one kept response per paid call, each under its hash");
    let retried =
        pg.query("SELECT business_key FROM results WHERE job = 'sink' AND calls > 1 ORDER BY business_key LIMIT 1");
    let redis_url = redis.url();
    let trace = |json: bool| {
        let mut args = vec![
            "trace",
            "--job",
            "sink",
            "--redis",
            redis_url.as_str(),
            retried.as_str(),
        ];
        if json {
            args.push("--json");
        }
        harness::producer_with_env(&args, &[(URL_ENV, &url)])
    };
    let out = trace(true);
    assert!(out.status.success(), "{}", harness::stderr(&out));
    let chain: Value = serde_json::from_slice(&out.stdout).unwrap();
    let calls = chain["attempts"].as_array().unwrap();
    assert!(calls.len() >= 2, "{chain}");
    assert!(calls.iter().all(|c| c["response"] == "verified"), "{chain}");
    assert_eq!(calls[0]["outcome"], "invalid_output");
    assert_eq!(chain["read_from"], "sink");
    assert_eq!(chain["produced_by_call"], calls.last().unwrap()["call"]);
    let first = calls[0]["trail"]["response_sha256"].as_str().unwrap();
    pg.query(&format!("UPDATE results_raw SET body = 'x' WHERE sha256 = '{first}'"));
    let out = trace(false);
    assert_eq!(out.status.code(), Some(1));
    assert!(harness::stdout(&out).contains(&format!("response sha256 {first}: altered in results_raw")));

    // A raw table that refuses every row: the records are not held up, the
    // bytes go inline into their histories, and trace proves them from there.
    pg.query(
        "CREATE FUNCTION no_raw() RETURNS trigger AS $$ BEGIN RAISE EXCEPTION 'raw store refuses'; END $$ LANGUAGE plpgsql",
    );
    pg.query("CREATE TRIGGER no_raw BEFORE INSERT ON results_raw FOR EACH ROW EXECUTE FUNCTION no_raw()");
    let more = dir.join("more.jsonl");
    write_records(&more, 100, 20);
    enqueue(&redis, &more, "inline", &sink_spec(&dir));
    let mut w = worker_cmd(&redis, "inline", &sim, &["--drain"]);
    w.env(URL_ENV, &url);
    let (exit, log) = Running::spawn(w).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    assert!(log.contains("the sink does not take the responses' bytes"), "{log}");
    assert_eq!(pg.query("SELECT count(*) FROM results WHERE job = 'inline'"), "20");
    assert_eq!(pg.query("SELECT count(*) FROM results_raw WHERE job = 'inline'"), "0");
    let out = harness::producer_with_env(
        &["trace", "--job", "inline", "--redis", &redis_url, "msg-105", "--json"],
        &[(URL_ENV, &url)],
    );
    assert!(out.status.success(), "{}", harness::stderr(&out));
    let chain: Value = serde_json::from_slice(&out.stdout).unwrap();
    let call = &chain["attempts"][0];
    assert_eq!(call["response"], "verified", "{chain}");
    assert_eq!(call["kept_at"], "the record's history (inline)", "{chain}");
}

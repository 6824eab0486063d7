//! The web console in a real headless Chromium, driven over WebDriver: the
//! jobs and job pages of a running job (live, without reloading), draining
//! the review queue with the keyboard, an invalid edit refused inline, two
//! reviewers racing on one entry, hostile model output kept as text, sign-in
//! and CSRF refusals; `producer jobs` lists what the jobs page lists; a job
//! deleted from its page with its name typed. Every server (Redis, llm-sim, the console, the
//! browser's driver) is a child process on 127.0.0.1 the test stops.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::time::Duration;

use common::keys;
use harness::browser::{Browser, ConsoleServer};
use harness::{
    LlmSim, RedisServer, Running, TEST_REDIS_PASSWORD, TempDir, enqueue, http_send, producer, spec_with, status_json,
    stderr, stdout, worker_cmd, write_records,
};
use redis::Commands;
use reqwest::Method;
use serde_json::Value;

const ANN: (&str, &str) = ("ann", "ann-token-0123456789abcdef");
const BOB: (&str, &str) = ("bob", "bob-token-0123456789abcdef");
/// A valid output of the example spec.
const GOOD: &str =
    r#"{"label": "billing", "reason": "checked by a person", "confidence": 1.0, "task_type": "classify"}"#;

/// A job of `n` records whose model answers go wrong as `faults` say, with
/// one attempt each: drained, so its failures wait in review.
struct Reviewed {
    redis: RedisServer,
    _sim: LlmSim,
    _dir: TempDir,
    console: ConsoleServer,
}

fn reviewed(job: &str, n: u64, faults: &str) -> Reviewed {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--faults", faults, "--seed", "11"]);
    let dir = TempDir::new("console");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, n);
    enqueue(
        &redis,
        &data,
        job,
        &spec_with(&dir, &[("max_attempts = 4", "max_attempts = 1")]),
    );
    let (exit, log) = Running::spawn(worker_cmd(&redis, job, &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    let console = ConsoleServer::start(&redis.url(), &[ANN, BOB], &[]);
    Reviewed {
        redis,
        _sim: sim,
        _dir: dir,
        console,
    }
}

fn sign_in(b: &Browser, console: &ConsoleServer, (_, token): (&str, &str)) {
    b.goto(&console.url("/login"));
    b.fill("#token", token);
    b.click("#sign-in");
    b.wait("signed in", Duration::from_secs(10), |b| b.find("#reviewer").is_some());
}

/// Records of a job in a set, from `producer status`.
fn count(redis: &RedisServer, job: &str, set: &str) -> u64 {
    status_json(redis, job).1[set].as_u64().unwrap()
}

/// The archived review entry of a record (after a person acted on it).
fn archived(redis: &RedisServer, job: &str, rid: &str) -> Value {
    let p = common::record::partition_of(rid, 4);
    let text: String = redis.conn().hget(keys::reviewed(job, p), rid).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn rid_on_page(b: &Browser) -> String {
    b.text("#rid")
}

/// `producer jobs`, text and JSON, against the console's jobs page: the same
/// jobs, states and figures (a finished job with failures in review, a
/// cancelled one, one queued with no worker yet).
#[test]
fn producer_jobs_lists_every_job_as_the_jobs_page_does() {
    let redis = RedisServer::start();
    let url = redis.url();
    let empty = producer(&["jobs", "--redis", &url]);
    assert!(empty.status.success(), "{}", stderr(&empty));
    assert!(stdout(&empty).is_empty());
    assert!(
        stderr(&empty).contains("no jobs in the Redis at")
            && stderr(&empty).contains("producer enqueue DATASET.jsonl --job NAME --spec SPEC.toml"),
        "{}",
        stderr(&empty)
    );
    assert!(!stderr(&empty).contains(TEST_REDIS_PASSWORD));
    let none = producer(&["jobs", "--json", "--redis", &url]);
    assert_eq!(stdout(&none).trim(), r#"{"jobs":[]}"#, "{}", stderr(&none));

    let sim = LlmSim::start(&["--faults", "bad_enum=0.3", "--seed", "11"]);
    let dir = TempDir::new("console-jobs");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 60);
    let spec = spec_with(&dir, &[("max_attempts = 4", "max_attempts = 1")]);
    for job in ["finished", "idle", "queued"] {
        enqueue(&redis, &data, job, &spec);
    }
    let (exit, log) =
        Running::spawn(worker_cmd(&redis, "finished", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    let cancel = producer(&["cancel", "--job", "idle", "--redis", &url]);
    assert!(cancel.status.success(), "{}", stderr(&cancel));

    let out = producer(&["jobs", "--json", "--redis", &url]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let lines: Vec<Value> = doc["jobs"].as_array().unwrap().clone();
    let names: Vec<&str> = lines.iter().map(|l| l["job"].as_str().unwrap()).collect();
    assert_eq!(names, ["finished", "idle", "queued"]);
    let (finished, idle, queued) = (&lines[0], &lines[1], &lines[2]);
    assert_eq!(finished["state"], "complete", "{finished}");
    assert_eq!(finished["records"], 60);
    assert!(
        finished["review"].as_u64().unwrap() > 0,
        "bad_enum answers wait in review: {finished}"
    );
    assert_eq!(
        finished["done"].as_u64().unwrap() + finished["review"].as_u64().unwrap(),
        60
    );
    assert_eq!(finished["remaining"], 0);
    assert!(finished["spent_usd"].as_f64().unwrap() > 0.0, "{finished}");
    assert!(
        finished["created"].as_str().is_some_and(|c| c.starts_with("20")),
        "{finished}"
    );
    assert_eq!(idle["state"], "cancelled", "{idle}");
    assert_eq!(idle["cancelled"], 60);
    assert_eq!(queued["state"], "running", "{queued}");
    assert_eq!(
        (queued["done"].as_u64(), queued["remaining"].as_u64()),
        (Some(0), Some(60))
    );
    // `status` of each job says the same.
    for l in &lines {
        let (_, s) = status_json(&redis, l["job"].as_str().unwrap());
        for set in ["done", "review", "dropped", "cancelled"] {
            assert_eq!(l[set], s[set], "{set} of {}", l["job"]);
        }
    }
    let text = stdout(&producer(&["jobs", "--redis", &url]));
    let rows: Vec<&str> = text.lines().collect();
    assert!(
        rows[0].starts_with("JOB") && rows[0].contains("REMAINING") && rows[0].ends_with("STATE"),
        "{text}"
    );
    for (row, l) in rows[1..].iter().zip(&lines) {
        let words: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(words[0], l["job"], "{text}");
        assert!(row.ends_with(l["state"].as_str().unwrap()), "{text}");
        assert!(words.contains(&l["done"].to_string().as_str()), "{text}");
    }

    // The console's jobs page lists the same jobs with the same figures.
    let console = ConsoleServer::start(&url, &[ANN], &[]);
    let b = Browser::start();
    sign_in(&b, &console, ANN);
    for l in &lines {
        let row = format!("tr[data-job={}]", l["job"].as_str().unwrap());
        b.wait("the job's reconciliation on the page", Duration::from_secs(20), |b| {
            b.goto(&console.url("/"));
            b.text(&format!("{row} td:nth-child(4)")) != "…"
        });
        assert_eq!(b.text(&format!("{row} .state")), l["state"].as_str().unwrap());
        for (cell, set) in [(4, "done"), (5, "review"), (6, "dropped")] {
            let shown = b.text(&format!("{row} td:nth-child({cell})")).replace(',', "");
            assert_eq!(shown, l[set].to_string(), "{set} of {}", l["job"]);
        }
        let cost = b.text(&format!("{row} td:nth-child(8)"));
        assert_eq!(cost, format!("{:.4}", l["spent_usd"].as_f64().unwrap()), "{}", l["job"]);
    }
}

/// A job is deleted from its page only with its name typed: a wrong name
/// deletes nothing; the right one removes every key and the jobs page no
/// longer lists it.
#[test]
fn a_job_is_deleted_from_its_page_only_with_its_name_typed() {
    let redis = RedisServer::start();
    let dir = TempDir::new("console-delete");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 30);
    for job in ["old", "kept"] {
        enqueue(&redis, &data, job, &spec_with(&dir, &[]));
    }
    let keys_of = |job: &str| -> usize {
        let keys: Vec<String> = redis.conn().keys("*").unwrap();
        let (whole, part) = (format!("{{{job}}}"), format!("{{{job}:p"));
        keys.iter().filter(|k| k.contains(&whole) || k.contains(&part)).count()
    };
    let (old_keys, kept_keys) = (keys_of("old"), keys_of("kept"));
    assert!(old_keys > 0);
    let console = ConsoleServer::start(&redis.url(), &[ANN], &[]);
    let b = Browser::start();
    sign_in(&b, &console, ANN);
    b.goto(&console.url("/jobs/old"));
    b.click("#delete");
    b.wait("the confirmation", Duration::from_secs(10), |b| {
        b.find("#confirm-name").is_some()
    });
    assert!(
        b.text("#confirm-form").contains("Type the job's name"),
        "{}",
        b.text("#confirm-form")
    );
    b.fill("#confirm-name", "olx");
    b.click("#confirm");
    b.wait("the refusal", Duration::from_secs(10), |b| {
        b.source().contains("Not deleted")
    });
    assert!(b.source().contains("type `old` to delete it"), "{}", b.source());
    assert_eq!(keys_of("old"), old_keys, "a wrong name deletes nothing");

    b.goto(&console.url("/jobs/old/confirm?action=delete"));
    b.fill("#confirm-name", "old");
    b.click("#confirm");
    b.wait("the jobs page", Duration::from_secs(10), |b| {
        b.find("tr[data-job=kept]").is_some()
    });
    assert!(b.find("tr[data-job=old]").is_none(), "the deleted job is still listed");
    assert_eq!(keys_of("old"), 0, "every key of the deleted job is gone");
    assert_eq!(keys_of("kept"), kept_keys, "the other job's keys stay");

    // While a live worker holds tasks of a job, the page says so and only
    // "delete anyway" deletes it.
    let sim = LlmSim::start(&["--latency-ms", "30000"]);
    let worker = Running::spawn(worker_cmd(&redis, "kept", &sim, &["--concurrency", "2"]));
    harness::wait_for("tasks in flight", Duration::from_secs(20), || {
        status_json(&redis, "kept").1["in_flight"].as_u64().unwrap_or(0) > 0
    });
    b.goto(&console.url("/jobs/kept/confirm?action=delete"));
    assert!(b.text("#held").contains("held by live workers"), "{}", b.text("#held"));
    let busy_keys = keys_of("kept");
    b.fill("#confirm-name", "kept");
    b.click("#confirm");
    b.wait("the refusal", Duration::from_secs(10), |b| {
        b.source().contains("Not deleted")
    });
    assert!(b.source().contains("held by workers"), "{}", b.source());
    assert!(keys_of("kept") >= busy_keys, "nothing deleted");
    drop(worker);
    b.goto(&console.url("/jobs/kept/confirm?action=delete"));
    b.fill("#confirm-name", "kept");
    b.click("#force");
    b.click("#confirm");
    b.wait("the jobs page", Duration::from_secs(10), |b| {
        b.source().contains("No job yet")
    });
    assert_eq!(keys_of("kept"), 0);
}

#[test]
fn the_jobs_and_job_pages_follow_a_running_job_live_and_cancel_and_resume_ask_first() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--latency-ms", "150", "--faults", "bad_enum=0.2", "--seed", "5"]);
    let dir = TempDir::new("console-live");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 400);
    enqueue(&redis, &data, "live", &spec_with(&dir, &[]));
    let console = ConsoleServer::start(&redis.url(), &[ANN], &[]);
    let worker = Running::spawn(worker_cmd(&redis, "live", &sim, &["--concurrency", "4"]));
    let b = Browser::start();
    sign_in(&b, &console, ANN);
    assert_eq!(b.text("#reviewer"), "ann");
    b.wait("the job listed as running", Duration::from_secs(20), |b| {
        b.goto(&console.url("/"));
        b.text("tr[data-job=live] .state") == "running"
    });
    b.click("tr[data-job=live] a");
    b.wait("the job page", Duration::from_secs(10), |b| b.find("#live").is_some());
    // The page refreshes its live part by itself: a mark set on the page
    // stays (no reload) while the figures move on.
    b.script("window.__mark = 42; return null;");
    let done = |b: &Browser| b.text("#done").replace(",", "").parse::<u64>().unwrap_or(0);
    let before = done(&b);
    b.wait(
        "the done count to grow without a reload",
        Duration::from_secs(30),
        |b| b.find("#live[data-refreshed]").is_some() && done(b) > before,
    );
    assert_eq!(
        b.script("return window.__mark;"),
        Value::from(42),
        "the page was not reloaded"
    );
    assert!(b.source().matches("<svg").count() >= 3, "the charts are drawn");

    // Cancel asks first; the job then says so, and its records wait as cancelled.
    b.click("#cancel");
    b.wait("the confirmation", Duration::from_secs(10), |b| {
        b.find("#confirm").is_some()
    });
    assert!(
        b.text("#confirm-form").contains("Cancel job live?"),
        "{}",
        b.text("#confirm-form")
    );
    b.click("#confirm");
    b.wait("the cancelled job", Duration::from_secs(10), |b| {
        b.find("#state").is_some_and(|_| b.text("#state") == "cancelled")
    });
    assert!(count(&redis, "live", "cancelled") > 0);
    b.click("#resume");
    b.wait("the confirmation", Duration::from_secs(10), |b| {
        b.find("#confirm").is_some()
    });
    b.click("#confirm");
    b.wait("the job running again", Duration::from_secs(10), |b| {
        b.find("#state").is_some_and(|_| b.text("#state") != "cancelled")
    });
    assert_eq!(count(&redis, "live", "cancelled"), 0);

    // It completes: the page says so from its reconciliation.
    b.wait("the job complete", Duration::from_secs(90), |b| {
        b.text("#state") == "complete"
    });
    assert!(
        b.text("#verdict")
            .contains("every expected record is in exactly one terminal set")
    );
    let (_, s) = status_json(&redis, "live");
    assert_eq!(b.text("#done").replace(',', ""), s["done"].to_string());
    assert_eq!(b.text("#review").replace(',', ""), s["review"].to_string());
    assert!(b.find("#errors").is_some(), "validation errors by code x field");
    assert!(b.text("#errors").contains("E_ENUM"), "{}", b.text("#errors"));
    // Nothing secret reached the pages.
    b.goto(&console.url("/"));
    assert!(!b.source().contains(TEST_REDIS_PASSWORD));
    drop(worker);
}

#[test]
fn a_provider_outage_shows_on_the_job_page_while_it_lasts() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    sim.outage(Some("unavailable"), None);
    let dir = TempDir::new("console-outage");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 20);
    let spec = spec_with(&dir, &[("base_delay_ms = 500", "base_delay_ms = 50")]);
    enqueue(&redis, &data, "down", &spec);
    let console = ConsoleServer::start(&redis.url(), &[ANN], &[]);
    let worker = Running::spawn(worker_cmd(&redis, "down", &sim, &["--drain"]));
    let b = Browser::start();
    sign_in(&b, &console, ANN);
    b.goto(&console.url("/jobs/down"));
    b.wait("the outage on the job page", Duration::from_secs(30), |b| {
        b.find("#waiting").is_some()
    });
    assert_eq!(b.text("#state"), "waiting: provider unavailable");
    let waiting = b.text("#waiting");
    for words in [
        "provider unavailable since 20",
        "last error http_503 from http://127.0.0.1:",
        "The server is temporarily unavailable.",
    ] {
        assert!(waiting.contains(words), "{words:?} in {waiting}");
    }
    assert_eq!(count(&redis, "down", "review"), 0);
    sim.outage(None, None);
    b.wait("the job complete", Duration::from_secs(60), |b| {
        b.text("#state") == "complete"
    });
    assert!(b.find("#waiting").is_none(), "the outage is over");
    let (exit, log) = worker.finish(Duration::from_secs(30));
    assert!(exit.success(), "{log}");
    assert_eq!(count(&redis, "down", "done"), 20);
}

#[test]
fn a_reviewer_drains_the_queue_with_the_keyboard() {
    let r = reviewed("keys", 30, "bad_enum=1.0");
    assert_eq!(count(&r.redis, "keys", "review"), 30);
    let b = Browser::start();
    sign_in(&b, &r.console, ANN);
    b.goto(&r.console.url("/jobs/keys/review"));
    assert!(b.text("#depth").starts_with("30 entries"), "{}", b.text("#depth"));
    // j/k move the selection; Enter opens it.
    b.press("jjk");
    let selected = b.script("return document.querySelector('tr.selected').getAttribute('data-href');");
    assert!(selected.as_str().unwrap().contains("/jobs/keys/review/"), "{selected}");
    b.press("\u{E007}");
    b.wait("the entry page", Duration::from_secs(10), |b| b.find("#rid").is_some());
    assert_eq!(b.url(), r.console.url(selected.as_str().unwrap()));

    // x: reject with a reason (Enter submits), then the next entry opens.
    let first = rid_on_page(&b);
    b.press("x");
    b.press("spam");
    b.press("\u{E007}");
    b.wait("the next entry", Duration::from_secs(10), |b| {
        b.find("#rid").is_some_and(|_| rid_on_page(b) != first)
    });
    // r: requeue with a note.
    let second = rid_on_page(&b);
    b.press("rlook at the label");
    b.press("\u{E007}");
    b.wait("the next entry", Duration::from_secs(10), |b| rid_on_page(b) != second);
    // s: skip (it stays in review, and does not come back this session).
    let third = rid_on_page(&b);
    b.press("s");
    b.wait("the next entry", Duration::from_secs(10), |b| rid_on_page(b) != third);
    // e: edit; Esc leaves the editor; a: accept.
    let fourth = rid_on_page(&b);
    b.press("e");
    assert_eq!(b.script("return document.activeElement.id;"), Value::from("editor"));
    b.fill("#editor", GOOD);
    b.press("\u{E00C}a");
    b.wait("the next entry", Duration::from_secs(10), |b| rid_on_page(b) != fourth);

    let (_, s) = status_json(&r.redis, "keys");
    assert_eq!(s["dropped_by_reason"]["rejected"], 1, "{s}");
    assert_eq!(s["done"], 1, "{s}");
    assert_eq!(s["review"], 27, "one requeued, one rejected, one accepted: {s}");
    let rejected = archived(&r.redis, "keys", &first);
    assert_eq!(rejected["actions"][0]["by"], "ann");
    assert_eq!(rejected["actions"][0]["reason"], "spam");
    assert_eq!(
        archived(&r.redis, "keys", &second)["actions"][0]["note"],
        "look at the label"
    );
    assert_eq!(archived(&r.redis, "keys", &fourth)["actions"][0]["action"], "accept");
    // The skipped entry is still in review, and is not offered again.
    let p = common::record::partition_of(&third, 4);
    let still: bool = r.redis.conn().hexists(keys::review("keys", p), &third).unwrap();
    assert!(still);
    assert_ne!(rid_on_page(&b), third);
}

#[test]
fn an_invalid_edit_is_refused_inline_and_nothing_is_saved_until_it_is_fixed() {
    let r = reviewed("edit", 6, "bad_enum=1.0");
    let b = Browser::start();
    sign_in(&b, &r.console, ANN);
    b.goto(&r.console.url("/jobs/edit/review"));
    b.click("#queue tbody tr a");
    b.wait("the entry page", Duration::from_secs(10), |b| {
        b.find("#editor").is_some()
    });
    let rid = rid_on_page(&b);
    // The errors are shown at their field.
    assert!(
        b.find("tr.has-error[data-field=label] .field-error").is_some(),
        "{}",
        b.source()
    );
    b.fill(
        "#editor",
        r#"{"label": "not-a-label", "reason": "x", "confidence": 3, "task_type": "classify"}"#,
    );
    b.click("#accept");
    b.wait("the refusal", Duration::from_secs(10), |b| b.find("#refused").is_some());
    let refused = b.text("#refused");
    assert!(refused.contains("label") && refused.contains("confidence"), "{refused}");
    assert_eq!(rid_on_page(&b), rid, "the same entry, with the edit kept");
    assert!(
        b.script("return document.getElementById('editor').value;")
            .as_str()
            .unwrap()
            .contains("not-a-label")
    );
    let p = common::record::partition_of(&rid, 4);
    let in_review: bool = r.redis.conn().hexists(keys::review("edit", p), &rid).unwrap();
    assert!(in_review, "nothing was saved");
    assert_eq!(count(&r.redis, "edit", "done"), 0);
    // Fixed: accepted, as the reviewer's.
    b.fill("#editor", GOOD);
    b.click("#accept");
    b.wait("the next entry", Duration::from_secs(10), |b| {
        b.find("#rid").is_some_and(|_| rid_on_page(b) != rid)
    });
    let result: String = r.redis.conn().hget(keys::results("edit", p), &rid).unwrap();
    let result: Value = serde_json::from_str(&result).unwrap();
    assert_eq!(
        (result["human"].as_bool(), result["reviewer"].as_str()),
        (Some(true), Some("ann"))
    );
    assert_eq!(result["output"]["reason"], "checked by a person");
}

#[test]
fn the_edit_form_follows_the_field_spec_and_is_checked_in_the_page_and_again_on_the_server() {
    let r = reviewed("form", 3, "bad_enum=1.0");
    let b = Browser::start();
    sign_in(&b, &r.console, ANN);
    b.goto(&r.console.url("/jobs/form/review"));
    b.click("#queue tbody tr a");
    b.wait("the entry page", Duration::from_secs(10), |b| {
        b.find("#fields").is_some()
    });
    let rid = rid_on_page(&b);
    let js = |code: &str| b.script(code);
    // Each field's control follows its spec (examples/job.toml).
    assert_eq!(
        js("return Array.from(document.querySelectorAll('#field-label option')).map(o => o.value);"),
        serde_json::json!(["billing", "shipping", "bug", "feature_request", "account", "other"])
    );
    let attrs = |id: &str, names: &[&str]| -> Vec<Value> {
        names
            .iter()
            .map(|n| js(&format!("return document.getElementById('{id}').getAttribute('{n}');")))
            .collect()
    };
    assert_eq!(
        attrs("field-confidence", &["type", "min", "max", "step"]),
        ["number", "0", "1", "any"]
    );
    assert_eq!(attrs("field-reason", &["type", "maxlength"]), ["text", "60"]);
    assert_eq!(attrs("field-items", &["data-json", "data-max-len"]), ["array", "20"]);
    assert_eq!(
        js("return Array.from(document.querySelectorAll('#field-task_type option')).map(o => o.value);"),
        serde_json::json!(["classify", "extract"])
    );
    let set = |id: &str, v: &str| {
        js(&format!(
            "var e = document.getElementById('{id}'); e.value = {}; e.dispatchEvent(new Event('input'));",
            serde_json::to_string(v).unwrap()
        ));
    };
    let invalid = |id: &str| js(&format!("return !document.getElementById('{id}').checkValidity();"));
    let done = || status_json(&r.redis, "form").1["done"].as_u64().unwrap();

    // In the page: a number out of its bounds, a JSON box that is not JSON:
    // the browser does not submit.
    set("field-label", "billing");
    set("field-reason", "checked by a person");
    set("field-task_type", "classify");
    set("field-confidence", "3");
    set("field-items", "[\"A-1\"");
    assert_eq!(invalid("field-confidence"), Value::Bool(true));
    assert_eq!(invalid("field-items"), Value::Bool(true));
    assert!(
        js("return document.getElementById('field-items').validationMessage;")
            .as_str()
            .unwrap()
            .starts_with("not JSON"),
    );
    b.click("#accept-fields");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(rid_on_page(&b), rid, "not submitted");
    assert!(b.find("#refused").is_none());
    assert_eq!(done(), 0);

    // Past the page's checks (the bound removed), the server refuses it again.
    js("document.getElementById('field-confidence').removeAttribute('max');");
    set("field-items", "[\"A-1\"]");
    b.click("#accept-fields");
    b.wait("the refusal", Duration::from_secs(10), |b| b.find("#refused").is_some());
    let refused = b.text("#refused");
    assert!(refused.contains("confidence"), "{refused}");
    assert_eq!(rid_on_page(&b), rid);
    assert_eq!(done(), 0, "nothing saved");
    // The form comes back filled with what was sent.
    assert_eq!(js("return document.getElementById('field-label').value;"), "billing");

    set("field-confidence", "0.5");
    b.click("#accept-fields");
    b.wait("the next entry", Duration::from_secs(10), |b| {
        b.find("#rid").is_none() || rid_on_page(b) != rid
    });
    assert_eq!(done(), 1);
    let p = common::record::partition_of(&rid, 4);
    let result: String = r.redis.conn().hget(keys::results("form", p), &rid).unwrap();
    let result: Value = serde_json::from_str(&result).unwrap();
    assert_eq!(
        result["output"],
        serde_json::json!({"label": "billing", "reason": "checked by a person", "confidence": 0.5,
                           "task_type": "classify", "items": ["A-1"], "record_id": rid, "_reviewer": "ann"}),
        "typed as the spec says: {result}"
    );
}

#[test]
fn a_filtered_queue_is_counted_before_its_bulk_buttons_act_and_a_changed_queue_is_refused() {
    let r = reviewed("bulk", 16, "bad_enum=0.5,content_filter=0.5");
    let url = r.redis.url();
    let dry = |args: &[&str]| -> u64 {
        let mut a = vec![
            "review",
            "--job",
            "bulk",
            "--redis",
            &url,
            "bulk",
            "requeue",
            "--dry-run",
            "--json",
        ];
        a.extend(args);
        let out = producer(&a);
        serde_json::from_str::<Value>(&stdout(&out)).unwrap()["matched"]
            .as_u64()
            .unwrap()
    };
    let (enums, refused) = (dry(&["--code", "E_ENUM"]), dry(&["--reason", "refused"]));
    assert!(enums > 0 && refused > 0, "{enums} {refused}");
    let b = Browser::start();
    sign_in(&b, &r.console, ANN);
    // No filter: no bulk buttons.
    b.goto(&r.console.url("/jobs/bulk/review"));
    assert!(b.find("#bulk").is_none());
    // Filtered: the count of the whole queue, before any button.
    b.goto(&r.console.url("/jobs/bulk/review?code=E_ENUM"));
    assert_eq!(
        b.text("#matching"),
        enums.to_string(),
        "the same count as the command line"
    );
    assert_eq!(b.text("#bulk-requeue-button"), format!("requeue all {enums}"));
    b.fill("#bulk-requeue input[name=note]", "look at the label");
    b.click("#bulk-requeue-button");
    b.wait("the answer", Duration::from_secs(10), |b| {
        b.source().contains("bulk-action log")
    });
    assert!(
        b.source().contains(&format!("requeue {enums} of {enums} entries")),
        "{}",
        b.source()
    );
    assert_eq!(
        count(&r.redis, "bulk", "review"),
        refused,
        "the E_ENUM entries left review"
    );

    // The page counted; then someone decided one entry: the bulk action is refused.
    b.goto(&r.console.url("/jobs/bulk/review?reason=refused"));
    assert_eq!(b.text("#matching"), refused.to_string());
    let listed = producer(&["review", "--job", "bulk", "--redis", &url, "list", "--jsonl"]);
    let first: Value = serde_json::from_str(stdout(&listed).lines().next().unwrap()).unwrap();
    let rid = first["record_id"].as_str().unwrap();
    let out = producer(&[
        "review", "--job", "bulk", "--redis", &url, "reject", rid, "--reason", "spam",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    b.fill("#bulk-reject input[name=because]", "refused by the model");
    b.click("#bulk-reject-button");
    b.wait("the answer", Duration::from_secs(10), |b| {
        b.source().contains("The queue changed")
    });
    assert!(
        b.source().contains(&format!("counted {refused} entries")),
        "{}",
        b.source()
    );
    assert_eq!(count(&r.redis, "bulk", "review"), refused - 1, "nothing done");
    // The action that ran is in the log; the refused one is not.
    let log = producer(&["review", "--job", "bulk", "--redis", &url, "bulk-log", "--json"]);
    let log: Value = serde_json::from_str(&stdout(&log)).unwrap();
    let actions = log["actions"].as_array().unwrap();
    assert_eq!(actions.len(), 1, "{log}");
    assert_eq!(
        (actions[0]["by"].as_str(), actions[0]["action"].as_str()),
        (Some("ann"), Some("requeue"))
    );
    assert_eq!(actions[0]["filter"], serde_json::json!({"code": "E_ENUM"}));
}

#[test]
fn two_reviewers_race_on_one_entry_and_the_second_is_told_who_decided() {
    let r = reviewed("race", 4, "bad_enum=1.0");
    let (ann, bob) = (Browser::start(), Browser::start());
    sign_in(&ann, &r.console, ANN);
    sign_in(&bob, &r.console, BOB);
    ann.goto(&r.console.url("/jobs/race/review"));
    ann.click("#queue tbody tr a");
    ann.wait("the entry page", Duration::from_secs(10), |b| b.find("#rid").is_some());
    let entry = ann.url();
    let rid = rid_on_page(&ann);
    bob.goto(&entry);
    assert_eq!(rid_on_page(&bob), rid);
    // Ann opened it first: she holds it, and Bob's page says so.
    let held = bob.text("#held");
    assert!(held.contains("ann is reviewing this entry"), "{held}");
    assert!(ann.find("#held").is_none(), "ann holds it herself");
    // Ann accepts first; Bob's rejection then finds the entry decided.
    ann.fill("#editor", GOOD);
    ann.click("#accept");
    ann.wait("ann's next entry", Duration::from_secs(10), |b| {
        b.find("#rid").is_some_and(|_| rid_on_page(b) != rid)
    });
    bob.fill("#reject-reason", "duplicate");
    bob.click("#reject");
    bob.wait("the answer", Duration::from_secs(10), |b| b.find("#decided").is_some());
    let said = bob.text("#decided");
    assert!(
        said.contains("Already decided by ann at") && said.contains("accept"),
        "{said}"
    );
    let (_, s) = status_json(&r.redis, "race");
    assert_eq!((s["done"].as_u64(), s["dropped"].as_u64()), (Some(1), Some(0)), "{s}");
    let a = archived(&r.redis, "race", &rid);
    assert_eq!(a["actions"].as_array().unwrap().len(), 1, "one decision: {a}");

    // Ann's next entry is leased to her: Bob's next is another one.
    let anns = rid_on_page(&ann);
    for _ in 0..2 {
        bob.goto(&r.console.url("/jobs/race/review/next"));
        bob.wait("bob's next entry", Duration::from_secs(10), |b| {
            b.find("#rid").is_some()
        });
        assert_ne!(rid_on_page(&bob), anns, "ann holds {anns}");
        assert!(bob.find("#held").is_none(), "bob was handed a free entry");
    }
}

#[test]
fn hostile_model_output_is_shown_as_text_and_never_runs() {
    let r = reviewed("xss", 3, "hostile=1.0");
    let b = Browser::start();
    sign_in(&b, &r.console, ANN);
    b.goto(&r.console.url("/jobs/xss/review"));
    assert_eq!(b.script("return window.__bf_xss === undefined;"), Value::from(true));
    b.click("#queue tbody tr a");
    b.wait("the entry page", Duration::from_secs(10), |b| {
        b.find("#output").is_some()
    });
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(b.script("return window.__bf_xss === undefined;"), Value::from(true));
    assert!(
        b.text("#output")
            .contains("<script>window.__bf_xss=1</script><img src=x"),
        "{}",
        b.text("#output")
    );
    assert!(b.text("#output").contains("Ignore all previous instructions"));
    assert_eq!(
        b.script("return document.querySelectorAll('#output b, #output img, #output script').length;"),
        Value::from(0),
        "no markup from the model became elements"
    );
    assert!(
        b.script("return document.getElementById('editor').value;")
            .as_str()
            .unwrap()
            .contains("<script>")
    );
}

#[test]
fn a_wrong_token_a_missing_csrf_token_and_another_site_are_refused() {
    let r = reviewed("auth", 2, "bad_enum=1.0");
    let b = Browser::start();
    b.goto(&r.console.url("/"));
    b.wait("the sign-in page", Duration::from_secs(10), |b| {
        b.find("#token").is_some()
    });
    b.fill("#token", "not-anyones-token-at-all");
    b.click("#sign-in");
    b.wait("the refusal", Duration::from_secs(10), |b| {
        b.find("#login-error").is_some()
    });
    assert!(b.text("#login-error").contains("not a reviewer's token"));
    b.goto(&r.console.url("/jobs/auth/review"));
    assert!(b.url().ends_with("/login"), "still signed out: {}", b.url());

    // A session's form without its CSRF token, or from another site, changes nothing.
    let addr = r.console.addr.clone();
    let login = http_send(&addr, Method::POST, "/login", &[], Some(&format!("token={}", ANN.1)));
    assert_eq!(login.status, 303);
    let cookie = login.set_cookie.unwrap();
    let cookie = cookie.split(';').next().unwrap();
    let forged = http_send(
        &addr,
        Method::POST,
        "/jobs/auth/cancel",
        &[("cookie", cookie)],
        Some("csrf=guess"),
    );
    assert_eq!(forged.status, 403);
    let page = http_send(
        &addr,
        Method::GET,
        "/jobs/auth/confirm?action=cancel",
        &[("cookie", cookie)],
        None,
    );
    let csrf = page
        .body
        .split("name=\"csrf\" value=\"")
        .nth(1)
        .unwrap()
        .split('"')
        .next()
        .unwrap()
        .to_owned();
    let elsewhere = http_send(
        &addr,
        Method::POST,
        "/jobs/auth/cancel",
        &[("cookie", cookie), ("origin", "http://evil.example")],
        Some(&format!("csrf={csrf}")),
    );
    assert_eq!(elsewhere.status, 403);
    let redis = &r.redis;
    let cancelled: bool = redis.conn().exists(keys::cancel("auth")).unwrap();
    assert!(!cancelled, "nothing was done");
    // With its token, from the page: done.
    let done = http_send(
        &addr,
        Method::POST,
        "/jobs/auth/cancel",
        &[("cookie", cookie)],
        Some(&format!("csrf={csrf}")),
    );
    assert_eq!(done.status, 303, "{}", done.body);
    let cancelled: bool = redis.conn().exists(keys::cancel("auth")).unwrap();
    assert!(cancelled);
    assert!(!page.body.contains(TEST_REDIS_PASSWORD));

    // Behind a reverse proxy: the reviewer is the proxy's header.
    let proxied = ConsoleServer::start(&redis.url(), &[], &["--trusted-header", "X-Forwarded-User"]);
    let me = http_send(&proxied.addr, Method::GET, "/", &[("x-forwarded-user", "carol")], None);
    assert_eq!(me.status, 200);
    assert!(me.body.contains(">carol<"), "{}", me.body);
    let anonymous = http_send(&proxied.addr, Method::GET, "/", &[], None);
    assert_eq!(anonymous.status, 303, "no header, no reviewer");
}

/// `make console-shots`: a PNG of each page under `.bench/console/` (or
/// `$CONSOLE_SHOTS`), from a job with a mix of faults: the jobs page, the
/// job page, the review queue, an entry, an entry with an invalid edit
/// refused, the answer to a reviewer who came second, the sign-in page.
#[test]
#[ignore = "writes pictures: run by make console-shots"]
fn console_shots() {
    let out = std::env::var("CONSOLE_SHOTS")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| harness::workspace().join(".bench/console"));
    std::fs::create_dir_all(&out).unwrap();
    let r = reviewed(
        "example",
        300,
        "bad_enum=0.15,missing_field=0.1,hostile=0.02,server_error=0.05",
    );
    let (ann, bob) = (Browser::start(), Browser::start());
    let shot = |b: &Browser, name: &str| b.screenshot(&out.join(format!("{name}.png")));
    shot(&ann, "blank");
    ann.goto(&r.console.url("/login"));
    shot(&ann, "sign-in");
    sign_in(&ann, &r.console, ANN);
    sign_in(&bob, &r.console, BOB);
    ann.goto(&r.console.url("/"));
    shot(&ann, "jobs");
    ann.goto(&r.console.url("/jobs/example"));
    shot(&ann, "job");
    ann.goto(&r.console.url("/jobs/example/review"));
    shot(&ann, "review-queue");
    ann.click("#queue tbody tr a");
    ann.wait("the entry page", Duration::from_secs(10), |b| {
        b.find("#editor").is_some()
    });
    shot(&ann, "review-entry");
    bob.goto(&ann.url());
    ann.fill("#editor", r#"{"label": "nope", "confidence": 7}"#);
    ann.click("#accept");
    ann.wait("the refusal", Duration::from_secs(10), |b| b.find("#refused").is_some());
    shot(&ann, "review-entry-refused");
    ann.fill("#editor", GOOD);
    ann.click("#accept");
    bob.fill("#reject-reason", "duplicate");
    bob.click("#reject");
    bob.wait("the answer", Duration::from_secs(10), |b| b.find("#decided").is_some());
    shot(&bob, "already-decided");
    let out_cmd = harness::producer(&["audit", "--job", "example", "--redis", &r.redis.url(), "--sample", "20"]);
    assert!(out_cmd.status.success(), "{}", harness::stderr(&out_cmd));
    ann.goto(&r.console.url("/jobs/example/audit"));
    ann.wait("a result to judge", Duration::from_secs(10), |b| {
        b.find("#rid").is_some()
    });
    for _ in 0..6 {
        let rid = rid_on_page(&ann);
        ann.press("c");
        ann.wait("the next one", Duration::from_secs(10), |b| {
            b.find("#rid").is_some_and(|_| rid_on_page(b) != rid)
        });
    }
    shot(&ann, "spot-check");
    ann.goto(&r.console.url("/compare?a=example&b=example"));
    shot(&ann, "compare");
    ann.goto(&r.console.url("/jobs/example"));
    shot(&ann, "job");
    let _ = std::fs::remove_file(out.join("blank.png"));
    eprintln!("console shots in {}", out.display());
}

#[test]
fn a_sample_of_results_is_spot_checked_and_the_accuracy_is_shown() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--seed", "2"]);
    let dir = TempDir::new("console-audit");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 40);
    let spec_path = spec_with(&dir, &[("[retry]", "[audit]\nrate = 0.3\nseed = 9\n\n[retry]")]);
    enqueue(&redis, &data, "spot", &spec_path);
    let (exit, log) = Running::spawn(worker_cmd(&redis, "spot", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    // The spec's sample: exactly the committed records whose draw falls under the rate.
    let spec = common::spec::JobSpec::load(spec_path.to_str().unwrap()).unwrap();
    let mut c = redis.conn();
    let keys_of = |c: &mut redis::Connection, key: fn(&str, u32) -> String| -> std::collections::BTreeSet<String> {
        (0..4)
            .flat_map(|p| c.hkeys::<_, Vec<String>>(key("spot", p)).unwrap())
            .collect()
    };
    let done = keys_of(&mut c, keys::results);
    assert_eq!(done.len(), 40);
    let by_rate: std::collections::BTreeSet<String> = done.iter().filter(|r| spec.audit.sampled(r)).cloned().collect();
    assert!(!by_rate.is_empty() && by_rate.len() < 25, "{}", by_rate.len());
    assert_eq!(keys_of(&mut c, keys::audit), by_rate, "the rate's sample, and only it");
    // Five more, picked afterwards; their inputs read back from the dataset.
    let out = harness::producer(&[
        "audit",
        "--job",
        "spot",
        "--redis",
        &redis.url(),
        "--sample",
        "5",
        "--seed",
        "3",
        "--json",
    ]);
    assert!(out.status.success(), "{}", harness::stderr(&out));
    let s: Value = serde_json::from_str(&harness::stdout(&out)).unwrap();
    let waiting = by_rate.len() as u64 + 5;
    assert_eq!(
        (s["sampled"].as_u64(), s["waiting"].as_u64()),
        (Some(5), Some(waiting)),
        "{s}"
    );
    for p in 0..4 {
        let items: std::collections::HashMap<String, String> = c.hgetall(keys::audit("spot", p)).unwrap();
        for (rid, input) in items {
            if !by_rate.contains(&rid) {
                assert!(
                    input.contains("message_id"),
                    "the input of {rid} from its dataset line: {input}"
                );
            }
        }
    }

    // People judge them all: two are wrong (a correction refused once, then saved).
    let console = ConsoleServer::start(&redis.url(), &[ANN], &[]);
    let b = Browser::start();
    sign_in(&b, &console, ANN);
    b.goto(&console.url("/jobs/spot/audit"));
    let mut wrong = Vec::new();
    for i in 0..waiting {
        b.wait("a result to judge", Duration::from_secs(10), |b| {
            b.find("#rid").is_some()
        });
        let rid = rid_on_page(&b);
        assert!(b.text("#input").contains("message_id"), "{}", b.text("#input"));
        if i < 2 {
            b.fill("#editor", r#"{"label": "nonsense"}"#);
            b.click("#incorrect");
            b.wait("the refusal", Duration::from_secs(10), |b| b.find("#refused").is_some());
            assert_eq!(rid_on_page(&b), rid, "nothing saved");
            b.fill("#editor", GOOD);
            b.click("#incorrect");
            wrong.push(rid.clone());
        } else {
            b.press("c");
        }
        b.wait("the next one", Duration::from_secs(10), |b| {
            b.find("#rid").is_none_or(|_| rid_on_page(b) != rid)
        });
    }
    let expected = common::audit::Rate::of(waiting - 2, waiting).text();
    assert_eq!(b.text("#accuracy"), expected);
    assert!(b.text("#by-label").contains("label"), "{}", b.text("#by-label"));
    b.goto(&console.url("/jobs/spot"));
    assert_eq!(b.text("#job-accuracy"), expected);
    // The corrections are revisions of their results; report says the same.
    for rid in &wrong {
        let p = common::record::partition_of(rid, 4);
        let r: String = c.hget(keys::results("spot", p), rid).unwrap();
        let r: Value = serde_json::from_str(&r).unwrap();
        assert_eq!(r["revisions"][0]["by"], "ann", "{r}");
        assert_eq!(r["output"]["reason"], "checked by a person");
    }
    let out = harness::producer(&["report", "--job", "spot", "--redis", &redis.url(), "--json"]);
    let report: Value = serde_json::from_str(&harness::stdout(&out)).unwrap();
    let a = &report["accuracy"]["overall"];
    assert_eq!(
        (a["correct"].as_u64(), a["audited"].as_u64()),
        (Some(waiting - 2), Some(waiting)),
        "{report}"
    );
    assert_eq!(report["accuracy"]["waiting"], 0);
}

#[test]
fn two_jobs_are_compared_side_by_side_as_the_command_line_compares_them() {
    let redis = RedisServer::start();
    let dir = TempDir::new("console-compare");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 12);
    // A: every answer has a wrong enum, one attempt each; B: the same records, all valid.
    let bad = LlmSim::start(&["--faults", "bad_enum=1.0", "--seed", "4"]);
    let good = LlmSim::start(&["--seed", "4"]);
    let spec_a = spec_with(&dir, &[("max_attempts = 4", "max_attempts = 1")]);
    enqueue(&redis, &data, "cmp-a", &spec_a);
    let spec_b_dir = TempDir::new("console-compare-b");
    let spec_b = spec_with(&spec_b_dir, &[("prompt = \"v1\"", "prompt = \"v2\"")]);
    enqueue(&redis, &data, "cmp-b", &spec_b);
    for (job, sim) in [("cmp-a", &bad), ("cmp-b", &good)] {
        let (exit, log) = Running::spawn(worker_cmd(&redis, job, sim, &["--drain"])).finish(Duration::from_secs(60));
        assert!(exit.success(), "{log}");
    }
    let cli = harness::producer(&[
        "compare",
        "--job",
        "cmp-a",
        "--job",
        "cmp-b",
        "--redis",
        &redis.url(),
        "--json",
    ]);
    assert!(cli.status.success(), "{}", harness::stderr(&cli));
    let cli: Value = serde_json::from_str(&harness::stdout(&cli)).unwrap();
    assert_eq!(cli["fixed"].as_array().unwrap().len(), 12, "{cli}");
    let console = ConsoleServer::start(&redis.url(), &[ANN], &[]);
    let b = Browser::start();
    sign_in(&b, &console, ANN);
    b.click("#compare");
    b.wait("the compare page", Duration::from_secs(10), |b| {
        b.find("#pick").is_some()
    });
    b.script(
        "document.getElementById('a').value = 'cmp-a'; document.getElementById('b').value = 'cmp-b'; return null;",
    );
    b.click("#go");
    b.wait("the comparison", Duration::from_secs(20), |b| {
        b.find("#figures").is_some()
    });
    let figures = b.text("#figures");
    assert!(figures.contains("review rate 100.0% 0.0%"), "{figures}");
    assert!(figures.contains("done 0 12"), "{figures}");
    assert_eq!(
        b.script("return document.querySelectorAll('#fixed li').length;"),
        Value::from(12)
    );
    assert_eq!(b.text("#regressions"), "None.");
    let codes = b.text("#codes");
    let a_enum = cli["a"]["codes"].as_object().unwrap().iter().next().unwrap();
    assert!(
        codes.contains(a_enum.0.as_str()) && codes.contains(&a_enum.1.to_string()),
        "{codes}"
    );
    assert!(b.find("svg rect.col").is_some(), "the paired bars are drawn");
}

/// The Re-run page selects done records with `producer rerun`'s filter and
/// counts them as `rerun --dry-run` does before it offers the command; a
/// filter that selects nothing leaves the command's button off; the
/// command it gives (with the changed spec written) runs as shown.
#[test]
fn done_records_are_counted_for_a_rerun_before_the_page_offers_its_command() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--faults", "bad_enum=0.5", "--seed", "5"]);
    let dir = TempDir::new("console-rerun");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 30);
    enqueue(&redis, &data, "again", &harness::example_spec());
    let (exit, log) = Running::spawn(worker_cmd(&redis, "again", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    let v2 = spec_with(&dir, &[("prompt = \"v1\"", "prompt = \"v2\"")]);
    let (url, data_s) = (redis.url(), data.display().to_string());
    let cli = producer(&[
        "rerun",
        &data_s,
        "--from-job",
        "again",
        "--job",
        "x",
        "--spec",
        &v2.display().to_string(),
        "--redis",
        &url,
        "--code",
        "E_ENUM",
        "--dry-run",
        "--json",
    ]);
    assert!(cli.status.success(), "{}", stderr(&cli));
    let matched = serde_json::from_str::<Value>(&stdout(&cli)).unwrap()["matched"]
        .as_u64()
        .unwrap();
    assert!(matched > 0, "some records needed a second answer");

    let console = ConsoleServer::start(&url, &[ANN], &[]);
    let b = Browser::start();
    sign_in(&b, &console, ANN);
    b.goto(&console.url("/jobs/again"));
    b.click("#open-rerun");
    b.wait("the rerun page", Duration::from_secs(10), |b| {
        b.find("#rerun-filter").is_some()
    });
    assert!(b.find("#copy-command").is_none(), "no command before a count");
    b.fill("#rerun-filter input[name=code]", "E_ENUM");
    b.fill("#rerun-filter input[name=into]", "again-v2");
    b.click("#count");
    b.wait("the count", Duration::from_secs(10), |b| b.find("#matched").is_some());
    assert_eq!(
        b.script("return document.getElementById('matched').dataset.matched;"),
        Value::from(matched.to_string())
    );
    assert_eq!(
        b.script("return document.getElementById('copy-command').disabled;"),
        Value::from(false)
    );
    let command = b.text("#command");
    assert!(
        command.contains("--from-job again --job again-v2")
            && command.contains("--code E_ENUM")
            && command.contains("--redis")
            && command.ends_with("--yes"),
        "{command}"
    );
    // Nothing selected: the button stays off. A bad number: said, not counted.
    b.goto(&console.url("/jobs/again/rerun?min_attempts=9"));
    assert_eq!(b.text("#matched").split_whitespace().next(), Some("0"));
    assert_eq!(
        b.script("return document.getElementById('copy-command').disabled;"),
        Value::from(true)
    );
    b.goto(&console.url("/jobs/again/rerun?min_attempts=two"));
    assert!(b.text("#refused").contains("whole number"), "{}", b.text("#refused"));
    assert!(b.find("#matched").is_none());
    b.goto(&console.url("/jobs/again/rerun?code=E_ENUM&into=again"));
    assert!(b.text("#refused").contains("another name"), "{}", b.text("#refused"));
    b.goto(&console.url("/jobs/again/rerun?code=E_ENUM&into=no%20spaces"));
    assert!(b.text("#refused").contains("new job's name"), "{}", b.text("#refused"));

    // The command as shown, with the changed spec: it runs those records again.
    let shown = command.replace("CHANGED-SPEC.toml", &v2.display().to_string()).replace(
        "producer rerun",
        &format!("{} rerun", harness::bin("producer").display()),
    );
    let run = std::process::Command::new("sh")
        .args(["-c", &format!("{shown} --no-progress")])
        .env("REDIS_URL", &url)
        .current_dir(harness::workspace())
        .output()
        .unwrap();
    assert!(run.status.success(), "{shown}: {}", stderr(&run));
    assert_eq!(status_json(&redis, "again-v2").1["expected"].as_u64(), Some(matched));
}

/// A record the checker model answered otherwise shows both answers side by
/// side on its entry page, the differing field marked; accepting it as it is
/// keeps the first model's answer.
#[test]
fn a_checker_disagreement_shows_both_answers_side_by_side() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--seed", "11"]);
    let checker = LlmSim::start(&["--seed", "11", "--contrary", "1"]);
    let dir = TempDir::new("console-check");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 2);
    let check = format!(
        "[check]\nmodel = \"judge-model\"\nbase_url = \"{}\"\napi_key_env = \"OPENAI_API_KEY\"\nfields = [\"label\"]\n\n[retry]",
        checker.base_url()
    );
    enqueue(&redis, &data, "chk", &spec_with(&dir, &[("[retry]", &check)]));
    let (exit, log) = Running::spawn(worker_cmd(&redis, "chk", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    assert_eq!(count(&redis, "chk", "review"), 2);
    let console = ConsoleServer::start(&redis.url(), &[ANN], &[]);
    let b = Browser::start();
    sign_in(&b, &console, ANN);
    b.goto(&console.url("/jobs/chk/review"));
    b.click("#queue tbody tr a");
    b.wait("the entry page", Duration::from_secs(10), |b| {
        b.find("#check").is_some()
    });
    let first = b.text("#check tr[data-field=label] td.first");
    let second = b.text("#check tr[data-field=label] td.checker");
    assert!(
        !first.is_empty() && !second.is_empty() && first != second,
        "{first} / {second}"
    );
    assert_eq!(
        b.script("return document.querySelector('#check tr[data-field=label]').className;"),
        Value::from("has-error")
    );
    assert!(b.text("body").contains("The checker (judge-model) answered otherwise"));
    assert!(
        b.text("#output").contains(&first),
        "the output shown is the first model's"
    );
}

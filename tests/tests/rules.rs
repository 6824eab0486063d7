//! Business rules (`[output.rules]`, CEL over input and output together)
//! in a real run against llm-sim: `spec check` names a broken rule, the
//! system prompt lists the rules, an answer that breaks one is retried with
//! feedback naming it, and no committed result breaks one.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::time::Duration;

use common::keys;
use harness::{
    LlmSim, RedisServer, Running, TempDir, enqueue, producer, spec_with, stderr, stdout, worker_cmd, write_records,
};
use redis::Commands;
use serde_json::Value;

/// The example spec with one more section after `[output.fields.items]`.
const ITEMS: &str = "description = \"order numbers or product names mentioned\"\n";

fn with_rules(dir: &TempDir, rules: &str) -> std::path::PathBuf {
    spec_with(dir, &[(ITEMS, &format!("{ITEMS}\n[output.rules]\n{rules}\n"))])
}

#[test]
fn spec_check_names_a_rule_that_does_not_compile_or_reads_another_variable() {
    let dir = TempDir::new("rules-check");
    let spec = with_rules(
        &dir,
        "same_task = \"output.task_type == \"\nknows_more = \"record.channel == 'chat'\"",
    );
    let out = producer(&["spec", "check", &spec.display().to_string()]);
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    let err = stderr(&out);
    assert!(
        err.contains("output.rules.same_task") && err.contains("does not compile"),
        "{err}"
    );
    assert!(
        err.contains("output.rules.knows_more") && err.contains("uses record"),
        "{err}"
    );

    let good = TempDir::new("rules-check-good");
    let spec = with_rules(
        &good,
        "same_task = { expr = \"output.task_type == input.task_type\", message = \"copy task_type from the input\" }",
    );
    let out = producer(&["spec", "check", &spec.display().to_string()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("- same_task: copy task_type from the input"),
        "the system prompt lists the rule: {}",
        stdout(&out)
    );
}

#[test]
fn an_answer_that_breaks_a_rule_is_retried_with_its_name_and_no_result_breaks_one() {
    let redis = RedisServer::start();
    let dir = TempDir::new("rules-run");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 40);
    // The records all say task_type "classify"; llm-sim answers either
    // value of the enum at random, so about half the answers break the rule.
    let spec = with_rules(
        &dir,
        "same_task = { expr = \"output.task_type == input.task_type\", message = \"copy task_type from the input\" }",
    );
    enqueue(&redis, &data, "rules", &spec);
    let sim = LlmSim::start(&["--seed", "3"]);
    let (status, err) = Running::spawn(worker_cmd(&redis, "rules", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(status.success(), "{err}");

    let read = |key: fn(&str, u32) -> String| -> Vec<Value> {
        let mut c = redis.conn();
        (0..4)
            .flat_map(|p| c.hvals::<_, Vec<String>>(key("rules", p)).unwrap())
            .map(|t| serde_json::from_str(&t).unwrap())
            .collect()
    };
    let (results, reviews) = (read(keys::results), read(keys::review));
    assert_eq!(results.len() + reviews.len(), 40);
    assert!(
        results.len() >= 30,
        "most records get a right answer within 4 attempts: {}",
        results.len()
    );
    for r in &results {
        assert_eq!(
            r["output"]["task_type"], "classify",
            "a committed result breaks the rule: {r}"
        );
    }
    // Some answers broke it first: their attempts say so, by the rule's name.
    let broke: Vec<&Value> = results
        .iter()
        .flat_map(|r| r["history"].as_array().unwrap())
        .flat_map(|h| {
            h["errors"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .collect::<Vec<_>>()
        })
        .filter(|e| e["code"] == "E_RULE")
        .map(|_| &Value::Null)
        .collect();
    assert!(broke.len() >= 5, "{} attempts broke the rule", broke.len());
    let first_errors: Vec<Value> = results
        .iter()
        .flat_map(|r| r["history"].as_array().unwrap().clone())
        .flat_map(|h| h["errors"].as_array().cloned().unwrap_or_default())
        .filter(|e| e["code"] == "E_RULE")
        .collect();
    assert!(
        first_errors.iter().all(|e| e["field"] == "same_task"),
        "{first_errors:?}"
    );
    // The retries told the model which rule, in its own words.
    let told = sim.log_containing("rule `same_task` does not hold: copy task_type from the input");
    assert!(!told.is_empty(), "no retry carried the rule's feedback");
    for e in &reviews {
        let codes: Vec<&str> = e["errors"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|x| x["code"].as_str())
            .collect();
        assert!(codes.contains(&"E_RULE"), "{e}");
    }
    // The report counts them with the other validation errors.
    let report = producer(&["report", "--job", "rules", "--redis", &redis.url(), "--json"]);
    assert!(report.status.success(), "{}", stderr(&report));
    let report: Value = serde_json::from_str(&stdout(&report)).unwrap();
    assert!(
        report["validation_errors"].to_string().contains("E_RULE"),
        "{}",
        report["validation_errors"]
    );
}

/// Drift: llm-sim's model starts getting `label` wrong half the time in the
/// middle of a job that had it wrong 2% of the time. The job halts (not a
/// flood of reviews) with the field, the rates and the latest examples;
/// `producer resume` goes on (the new rate is the baseline from then on),
/// and the job completes with every record accounted for.
#[test]
fn a_field_that_drifts_mid_job_halts_it_with_examples_and_resume_goes_on() {
    let redis = RedisServer::start();
    let dir = TempDir::new("drift");
    let sim = LlmSim::start(&["--faults", "bad_enum=0.02", "--seed", "11", "--latency-ms", "3"]);
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 1200);
    let spec = spec_with(
        &dir,
        &[("[retry]", "[drift]\nwindow = 100\nmin_failures = 15\n\n[retry]")],
    );
    enqueue(&redis, &data, "drift", &spec);
    let worker = Running::spawn(worker_cmd(&redis, "drift", &sim, &["--concurrency", "8"]));
    let status = || harness::status_json(&redis, "drift").1;
    harness::wait_for("300 records done", Duration::from_secs(60), || {
        status()["done"].as_u64().unwrap_or(0) >= 300
    });
    assert!(status()["halted"].is_null(), "a steady 2% is no drift: {}", status());
    sim.set_faults("bad_enum=0.5");
    harness::wait_for("the job halted on drift", Duration::from_secs(60), || {
        status()["halted"].is_string()
    });
    let s = status();
    let reason = s["halted"].as_str().unwrap();
    assert!(reason.starts_with("quality drift: field `label` failed on"), "{reason}");
    assert!(
        reason.contains("latest: msg-") && reason.contains("E_ENUM label"),
        "{reason}"
    );
    let review = s["review"].as_u64().unwrap();
    assert!(
        review < 20,
        "the drift paused the job instead of reviewing its records: {s}"
    );
    // Halted: nothing more is claimed.
    std::thread::sleep(Duration::from_secs(2));
    let still = status();
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(status()["done"], still["done"], "no claims while halted");
    let remaining = still["queued"].as_u64().unwrap_or(0) + still["delayed"].as_u64().unwrap_or(0);
    assert!(remaining > 100, "the job paused well before its end: {still}");

    let out = producer(&["resume", "--job", "drift", "--redis", &redis.url()]);
    assert!(out.status.success(), "{}", stderr(&out));
    harness::wait_for("the job complete", Duration::from_secs(120), || {
        harness::status_json(&redis, "drift").0 == Some(0)
    });
    let s = status();
    assert!(
        s["halted"].is_null(),
        "the same drift after resume is the new normal: {s}"
    );
    assert_eq!(s["done"].as_u64().unwrap() + s["review"].as_u64().unwrap(), 1200, "{s}");
    harness::signal(worker.pid(), "TERM");
    let (_, log) = worker.finish(Duration::from_secs(30));
    assert_eq!(log.matches("quality drift: halting the job").count(), 1, "one alarm");
}

/// The cross-check in a real run: a second llm-sim is the checker and
/// answers another label for a known share of records. Half the valid
/// answers are checked (a seeded sample); each checked record whose checker
/// answer differs is in review with both answers side by side, every other
/// one is committed; the report counts the checker's calls (cause `check`)
/// and the agreement per field; a reviewer sees both in `review next` and
/// accepting keeps the first answer.
#[test]
fn a_checker_that_disagrees_on_a_known_share_sends_exactly_those_records_to_review() {
    let redis = RedisServer::start();
    let dir = TempDir::new("check");
    let sim = LlmSim::start(&["--seed", "5"]);
    let checker = LlmSim::start(&["--seed", "5", "--contrary", "0.3"]);
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 200);
    let check = format!(
        "[check]\nmodel = \"judge-model\"\nbase_url = \"{}\"\napi_key_env = \"OPENAI_API_KEY\"\npolicy = \"sample\"\nshare = 0.5\nseed = 9\nfields = [\"label\", \"confidence\"]\ntolerance = {{ confidence = 0.5 }}\n\n[retry]",
        checker.base_url()
    );
    let spec = spec_with(&dir, &[("[retry]", &check)]);
    let out = producer(&["spec", "check", &spec.display().to_string()]);
    assert!(out.status.success(), "{}", stderr(&out));
    enqueue(&redis, &data, "chk", &spec);
    let (exit, log) = Running::spawn(worker_cmd(&redis, "chk", &sim, &["--drain"])).finish(Duration::from_secs(90));
    assert!(exit.success(), "{log}");
    let (code, s) = harness::status_json(&redis, "chk");
    assert_eq!(code, Some(0), "{s}");
    let (checked, contrary) = (
        checker.stats()["served"].as_u64().unwrap(),
        checker.stats()["contrary"].as_u64().unwrap(),
    );
    assert!((70..=130).contains(&checked), "about half checked: {checked}");
    assert!(contrary > 10 && contrary < checked, "{contrary} of {checked}");
    assert_eq!(
        s["review"].as_u64().unwrap(),
        contrary,
        "exactly the contrary answers are reviewed: {s}"
    );
    assert_eq!(s["done"].as_u64().unwrap(), 200 - contrary, "{s}");

    let out = producer(&["report", "--job", "chk", "--redis", &redis.url(), "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        r["spend"]["by_bucket"]["check"]["calls"].as_u64(),
        Some(checked),
        "{}",
        r["spend"]
    );
    assert_eq!(
        r["agreement"]["label"]["checked"].as_u64(),
        Some(checked),
        "{}",
        r["agreement"]
    );
    assert_eq!(r["agreement"]["label"]["agreed"].as_u64(), Some(checked - contrary));
    assert_eq!(
        r["agreement"]["confidence"]["agreed"].as_u64(),
        Some(checked),
        "within the tolerance"
    );
    assert_eq!(r["review_by_reason"]["checker_disagrees"].as_u64(), Some(contrary));
    let text = stdout(&producer(&["report", "--job", "chk", "--redis", &redis.url()]));
    assert!(
        text.contains("the checker's calls (cross-check)") && text.contains("cross-check: the checker agreed"),
        "{text}"
    );

    // The reviewer sees both answers and keeps the first.
    let drive = harness::workspace().join("tests/pty/drive.py");
    let out = std::process::Command::new("python3")
        .arg(&drive)
        .args(["a", "q"])
        .arg("--")
        .arg(harness::bin("producer"))
        .args([
            "review",
            "--job",
            "chk",
            "--redis",
            &redis.url(),
            "--reviewer",
            "ann",
            "next",
        ])
        .output()
        .unwrap();
    let screen = stdout(&out);
    assert!(out.status.success(), "{screen}\n{}", stderr(&out));
    assert!(screen.contains("checker   judge-model disagrees"), "{screen}");
    assert!(
        screen.contains("<- differs") && screen.contains("E_CHECK label"),
        "{screen}"
    );
    assert!(screen.contains("accepted"), "{screen}");
    let (_, s) = harness::status_json(&redis, "chk");
    assert_eq!(s["review"].as_u64().unwrap(), contrary - 1, "{s}");
}

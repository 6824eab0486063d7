//! People draining the review queue: every action, validation on accept, and
//! two reviewers racing for one entry.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::collections::HashMap;
use std::process::Command;
use std::time::Duration;

use common::keys;
use harness::{
    LlmSim, RedisServer, Running, TempDir, bin, enqueue, example_spec, stderr, stdout, worker_cmd, write_records,
};
use redis::Commands;
use serde_json::Value;

const P: u32 = 4;

/// `review --job rv --redis URL --reviewer WHO ARGS...` as producer arguments.
fn review_args(redis: &RedisServer, who: &str, args: &[&str]) -> Vec<String> {
    ["review", "--job", "rv", "--redis", &redis.url(), "--reviewer", who]
        .iter()
        .chain(args)
        .map(|a| (*a).to_owned())
        .collect()
}

fn review(redis: &RedisServer, args: &[&str]) -> std::process::Output {
    Command::new(bin("producer"))
        .args(review_args(redis, "alice", args))
        .output()
        .unwrap()
}

fn states(redis: &RedisServer) -> HashMap<String, String> {
    let mut c = redis.conn();
    (0..P)
        .flat_map(|p| c.hgetall::<_, HashMap<String, String>>(keys::state("rv", p)).unwrap())
        .collect()
}

fn hash_entry(redis: &RedisServer, key: fn(&str, u32) -> String, rid: &str) -> Option<Value> {
    let mut c = redis.conn();
    (0..P).find_map(|p| {
        c.hget::<_, _, Option<String>>(key("rv", p), rid)
            .unwrap()
            .map(|s| serde_json::from_str(&s).unwrap())
    })
}

/// A job "rv" of `n` records, every one in review (every answer refused).
fn all_in_review(n: u64) -> (RedisServer, TempDir) {
    let redis = RedisServer::start();
    let dir = TempDir::new("review");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, n);
    enqueue(&redis, &data, "rv", &example_spec());
    let sim = LlmSim::start(&["--faults", "content_filter=1.0"]);
    let (status, err) = Running::spawn(worker_cmd(&redis, "rv", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(status.success(), "{err}");
    (redis, dir)
}

const GOOD: &str =
    r#"{"label": "billing", "reason": "checked by a person", "confidence": 1.0, "task_type": "classify"}"#;

#[test]
fn review_actions_validate_record_who_and_cannot_both_win() {
    let (redis, dir) = all_in_review(8);
    // --json: one document; --jsonl: the same entries, one per line.
    let listed = review(&redis, &["list", "--json"]);
    assert!(listed.status.success(), "{}", stderr(&listed));
    let doc: Value = serde_json::from_str(&stdout(&listed)).unwrap();
    let entries = doc["entries"].as_array().unwrap().clone();
    assert_eq!((entries.len(), doc["count"].as_u64()), (8, Some(8)));
    let lines: Vec<Value> = stdout(&review(&redis, &["list", "--jsonl"]))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines, entries, "the same entries as JSON Lines");
    assert!(entries.iter().all(|e| e["reason"] == "refused:content_filter"));
    assert_eq!(
        serde_json::from_str::<Value>(&stdout(&review(&redis, &["list", "--json", "--reason", "poison"]))).unwrap()["count"],
        0
    );

    // show, by business key: input, prompt, last output, history.
    let shown = review(&redis, &["show", "msg-3"]);
    let e: Value = serde_json::from_str(&stdout(&shown)).unwrap();
    assert_eq!(e["input"]["message_id"], "msg-3");
    assert!(e["prompt"].as_str().unwrap().contains("message number 3"));
    assert!(e["last_raw_output"].is_string() && e["history"].as_array().unwrap().len() == 1);

    // accept: an invalid correction is refused and changes nothing.
    let bad = dir.join("bad.json");
    std::fs::write(&bad, GOOD.replace("billing", "refund")).unwrap();
    let out = review(&redis, &["accept", "msg-0", "--output", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("E_ENUM label"), "{}", stderr(&out));
    let rid0 = entries.iter().find(|e| e["key"] == "msg-0").unwrap()["record_id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(states(&redis)[&rid0], "review");

    // accept: a valid one becomes the result, marked human, with the reviewer.
    let good = dir.join("good.json");
    std::fs::write(&good, GOOD).unwrap();
    let out = review(&redis, &["accept", "msg-0", "--output", good.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(states(&redis)[&rid0], "done");
    let result = hash_entry(&redis, keys::results, &rid0).unwrap();
    assert_eq!(result["human"], true);
    assert_eq!(result["reviewer"], "alice");
    assert_eq!(result["output"]["record_id"], rid0.as_str());
    let archived = hash_entry(&redis, keys::reviewed, &rid0).unwrap();
    assert_eq!(archived["actions"][0]["action"], "accept");
    assert_eq!(archived["actions"][0]["by"], "alice");

    // accept --edit: $EDITOR writes the corrected output.
    let editor = format!("cp {}", good.display());
    let out = Command::new(bin("producer"))
        .args(review_args(&redis, "bob", &["accept", "msg-1", "--edit"]))
        .env("EDITOR", editor)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));

    // reject: terminal, kept in the archive with the reason.
    let out = review(&redis, &["reject", "msg-2", "--reason", "spam"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let rid2 = entries.iter().find(|e| e["key"] == "msg-2").unwrap()["record_id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(states(&redis)[&rid2], "dropped:rejected");
    assert_eq!(
        hash_entry(&redis, keys::reviewed, &rid2).unwrap()["actions"][0]["reason"],
        "spam"
    );

    // Two reviewers accept the same entry at once: exactly one wins.
    let racers: Vec<_> = (0..2)
        .map(|_| {
            Command::new(bin("producer"))
                .args(review_args(&redis, "racer", &["accept", "msg-4", "--output"]))
                .arg(&good)
                .spawn()
                .unwrap()
        })
        .collect();
    let codes: Vec<Option<i32>> = racers
        .into_iter()
        .map(|c| c.wait_with_output().unwrap().status.code())
        .collect();
    assert_eq!(
        codes.iter().filter(|c| **c == Some(0)).count(),
        1,
        "exactly one reviewer wins: {codes:?}"
    );
    assert!(
        codes.iter().any(|c| matches!(c, Some(5) | Some(2))),
        "the other is told: {codes:?}"
    );

    // requeue with a note: back to the stream, then a worker finishes it.
    let out = review(&redis, &["requeue", "msg-5", "--note", "provider fixed the filter"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let rid5 = entries.iter().find(|e| e["key"] == "msg-5").unwrap()["record_id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(states(&redis)[&rid5], "queued");
    {
        let sim = LlmSim::start(&[]);
        let (status, err) =
            Running::spawn(worker_cmd(&redis, "rv", &sim, &["--drain"])).finish(Duration::from_secs(60));
        assert!(status.success(), "{err}");
    }
    assert_eq!(states(&redis)[&rid5], "done");
    let history = hash_entry(&redis, keys::results, &rid5).unwrap()["history"].clone();
    assert!(history.to_string().contains("provider fixed the filter"), "{history}");

    // And the job still reconciles: every record in exactly one terminal set.
    let (code, s) = harness::status_json(&redis, "rv");
    assert_eq!(code, Some(0), "{s}");
    assert_eq!(
        (s["done"].as_u64(), s["review"].as_u64(), s["dropped"].as_u64()),
        (Some(4), Some(3), Some(1)),
        "{s}"
    );
}

#[test]
fn retry_builds_a_new_round_from_review_rejected_and_missing_records() {
    let redis = RedisServer::start();
    let dir = TempDir::new("retry");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 20);
    // One record whose template field is empty: an input error, never retried.
    let mut text = std::fs::read_to_string(&data).unwrap();
    text.push_str(
        "{\"message_id\": \"no-text\", \"channel\": \"chat\", \"task_type\": \"classify\", \"text\": \"\"}\n",
    );
    std::fs::write(&data, text).unwrap();
    enqueue(&redis, &data, "rv", &example_spec());
    let drain = |faults: &str| {
        let sim = LlmSim::start(&["--faults", faults]);
        let (status, err) =
            Running::spawn(worker_cmd(&redis, "rv", &sim, &["--drain"])).finish(Duration::from_secs(60));
        assert!(status.success(), "{err}");
    };
    let retry = |from: &str| -> Value {
        let out = Command::new(bin("producer"))
            .args([
                "retry",
                "--job",
                "rv",
                "--redis",
                &redis.url(),
                "--from",
                from,
                "--json",
                "--reviewer",
                "ops",
            ])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
        serde_json::from_str(&stdout(&out)).unwrap()
    };
    drain("content_filter=1.0");
    assert!(
        review(&redis, &["reject", "msg-0", "--reason", "looks wrong"])
            .status
            .success()
    );

    // From review: 19 records, attempts count on (the refusal was attempt 1).
    let r = retry("review");
    assert_eq!(r["requeued"], 19, "{r}");
    drain("");
    let s = states(&redis);
    assert_eq!(s.values().filter(|v| *v == "done").count(), 19);
    let result = hash_entry(&redis, keys::results, s.iter().find(|(_, v)| *v == "done").unwrap().0).unwrap();
    assert_eq!(result["attempts"], 2, "attempts count on across rounds: {result}");
    assert!(result["history"].to_string().contains("\"by\":\"ops\""));

    // From dropped: the rejected record comes back; the input error does not.
    let r = retry("dropped");
    assert_eq!(r["requeued"], 1, "{r}");
    assert_eq!(
        r["skipped"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_u64().unwrap())
            .sum::<u64>(),
        1,
        "{r}"
    );
    drain("");
    assert_eq!(states(&redis).values().filter(|v| *v == "done").count(), 20);

    // From missing: results lost from Redis are rebuilt from the dataset lines.
    let mut c = redis.conn();
    let mut lost = Vec::new();
    for p in 0..P {
        let ids: Vec<String> = c.hkeys(keys::results("rv", p)).unwrap();
        if let Some(id) = ids.first() {
            let _: () = c.hdel(keys::results("rv", p), id).unwrap();
            lost.push(id.clone());
        }
    }
    let r = retry("missing");
    assert_eq!(r["requeued"].as_u64().unwrap(), lost.len() as u64, "{r}");
    drain("");
    for id in &lost {
        assert!(
            hash_entry(&redis, keys::results, id).is_some(),
            "result rebuilt for {id}"
        );
    }
    let (code, s) = harness::status_json(&redis, "rv");
    assert_eq!(code, Some(0), "{s}");
}

#[test]
fn the_queue_round_trips_through_a_spreadsheet_and_a_terminal() {
    let (redis, dir) = all_in_review(6);
    let exported = dir.join("queue.jsonl");
    let out = review(&redis, &["export", "--out", exported.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let mut lines: Vec<Value> = std::fs::read_to_string(&exported)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 6);
    lines.sort_by_key(|l| l["key"].as_str().unwrap().to_owned());
    let rid = |i: usize| lines[i]["record_id"].as_str().unwrap().to_owned();
    // People fill in decisions; lines 3, 4 and 5 are wrong and must change nothing.
    let good: Value = serde_json::from_str(GOOD).unwrap();
    let mut bad_output = good.clone();
    bad_output["confidence"] = Value::Bool(true);
    let mut filled = vec![
        serde_json::json!({"record_id": rid(0), "decision": "accept", "output": good}),
        serde_json::json!({"record_id": rid(1), "decision": "reject", "note": "duplicate ticket"}),
        serde_json::json!({"record_id": rid(2), "decision": "accept", "output": bad_output}),
        serde_json::json!({"record_id": rid(3), "decision": "approve"}),
        serde_json::json!({"record_id": rid(4), "decison": "requeue"}),
    ]
    .into_iter()
    .map(|v| v.to_string())
    .collect::<Vec<_>>();
    filled.push(lines[5].to_string()); // untouched row: skipped
    let import = dir.join("decisions.jsonl");
    std::fs::write(&import, filled.join("\n")).unwrap();
    let out = review(&redis, &["import", import.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "bad lines make the import fail loudly");
    assert!(
        stdout(&out).contains("2 applied, 1 skipped, 3 lines rejected"),
        "{}",
        stdout(&out)
    );
    let err = stderr(&out);
    assert!(err.contains("line 3: output is invalid: E_TYPE confidence"), "{err}");
    assert!(err.contains("line 4: unknown decision `approve`"), "{err}");
    assert!(err.contains("line 5: not a valid import line"), "{err}");
    let s = states(&redis);
    assert_eq!(s[&rid(0)], "done");
    assert_eq!(s[&rid(1)], "dropped:rejected");
    for i in 2..6 {
        assert_eq!(s[&rid(i)], "review", "line {} changed nothing", i + 1);
    }

    // review next, driven through a pseudo-terminal: requeue (with a note),
    // skip, reject (with a reason), quit.
    let drive = harness::workspace().join("tests/pty/drive.py");
    let out = Command::new("python3")
        .arg(&drive)
        .args(["r", "look at the label\n", "s", "j", "spam\n", "q"])
        .arg("--")
        .arg(bin("producer"))
        .args(review_args(&redis, "carol", &["next"]))
        .output()
        .unwrap();
    let screen = stdout(&out);
    assert!(out.status.success(), "{screen}\n{}", stderr(&out));
    assert!(
        screen.contains("requeued") && screen.contains("skipped") && screen.contains("rejected"),
        "{screen}"
    );
    assert!(screen.contains("2 acted on"), "{screen}");
    let s = states(&redis);
    let counts = |state: &str| s.values().filter(|v| *v == state).count();
    assert_eq!(
        (counts("queued"), counts("dropped:rejected"), counts("review")),
        (1, 2, 2),
        "{s:?}"
    );
}

/// `producer review ... revise KEY --output FILE [--note N]` as `who`.
fn revise(
    redis: &RedisServer,
    dir: &TempDir,
    who: &str,
    key: &str,
    output: &str,
    note: Option<&str>,
) -> std::process::Output {
    let file = dir.join(&format!("revise-{who}.json"));
    std::fs::write(&file, output).unwrap();
    let path = file.display().to_string();
    let mut args = vec!["revise", key, "--output", &path];
    if let Some(n) = note {
        args.extend(["--note", n]);
    }
    Command::new(bin("producer"))
        .args(review_args(redis, who, &args))
        .output()
        .unwrap()
}

#[test]
fn a_revision_of_a_done_result_keeps_what_it_replaced_and_is_validated() {
    let redis = RedisServer::start();
    let dir = TempDir::new("revise");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 5);
    // `task_type` is filled from the input: a revision cannot change it.
    let spec = harness::spec_with(
        &dir,
        &[(
            "description = \"copy the task type from the input\"",
            "description = \"copy the task type from the input\"\nfrom_input = \"task_type\"",
        )],
    );
    enqueue(&redis, &data, "rv", &spec);
    let sim = LlmSim::start(&[]);
    let (status, err) = Running::spawn(worker_cmd(&redis, "rv", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(status.success(), "{err}");
    let rid = states(&redis).into_keys().min().unwrap();
    let before = hash_entry(&redis, keys::results, &rid).unwrap();
    let key = before["key"].as_str().unwrap().to_owned();

    // Invalid: refused, naming the field; nothing changes.
    let bad = revise(&redis, &dir, "alice", &key, r#"{"label": "nonsense"}"#, None);
    assert!(!bad.status.success());
    assert!(stderr(&bad).contains("label"), "{}", stderr(&bad));
    assert_eq!(hash_entry(&redis, keys::results, &rid).unwrap(), before);

    // By business key: revision 1, the model's output kept in it.
    let out = revise(&redis, &dir, "alice", &key, GOOD, Some("wrong label"));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("revision 1"), "{}", stdout(&out));
    // By record id, by another reviewer: revision 2 (its task_type is the input's).
    let other = GOOD.replace("billing", "account").replace("classify", "extract");
    let out = revise(&redis, &dir, "bob", &rid, &other, None);
    assert!(out.status.success(), "{}", stderr(&out));
    let after = hash_entry(&redis, keys::results, &rid).unwrap();
    assert_eq!(after["output"]["label"], "account");
    assert_eq!(
        after["output"]["task_type"], "classify",
        "from the input, not the reviewer"
    );
    assert_eq!(after["output"]["record_id"], rid.as_str());
    assert_eq!(
        (&after["human"], &after["reviewer"]),
        (&Value::Bool(true), &Value::from("bob"))
    );
    let revisions = after["revisions"].as_array().unwrap();
    assert_eq!(revisions.len(), 2);
    assert_eq!(revisions[0]["previous"], before["output"], "the model's output is kept");
    assert_eq!(
        (
            &revisions[0]["by"],
            &revisions[0]["note"],
            &revisions[1]["previous"]["label"]
        ),
        (
            &Value::from("alice"),
            &Value::from("wrong label"),
            &Value::from("billing")
        )
    );
    let actions: Vec<&Value> = after["history"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|h| h["action"] == "revise")
        .collect();
    assert_eq!(actions.len(), 2, "each revision is in the history");
    // Still one result per record.
    let (code, s) = harness::status_json(&redis, "rv");
    assert_eq!((code, &s["done"]), (Some(0), &Value::from(5)), "{s}");
    // A record the job does not have.
    let none = revise(&redis, &dir, "alice", "msg-999", GOOD, None);
    assert!(
        !none.status.success() && stderr(&none).contains("has no record"),
        "{}",
        stderr(&none)
    );
}

/// `review next` in a pseudo-terminal with these inputs and `$EDITOR`: the screen.
fn drive_next(redis: &RedisServer, inputs: &[&str], editor: &str) -> String {
    let out = Command::new("python3")
        .arg(harness::workspace().join("tests/pty/drive.py"))
        .args(inputs)
        .arg("--")
        .arg(bin("producer"))
        .args(review_args(redis, "carol", &["next"]))
        .env("EDITOR", editor)
        .output()
        .unwrap();
    let screen = stdout(&out);
    assert!(out.status.success(), "{screen}\n{}", stderr(&out));
    screen
}

#[test]
fn the_terminal_reviewer_shows_text_keeps_an_edit_asks_before_acting_and_the_note_reaches_the_model() {
    let redis = RedisServer::start();
    let dir = TempDir::new("review-next");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 8);
    let spec = harness::spec_with(&dir, &[("max_attempts = 4", "max_attempts = 1")]);
    enqueue(&redis, &data, "rv", &spec);
    let sim = LlmSim::start(&["--faults", "bad_enum=0.6,length=0.4", "--seed", "8"]);
    let (status, err) = Running::spawn(worker_cmd(&redis, "rv", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(status.success(), "{err}");
    assert_eq!(states(&redis).values().filter(|s| *s == "review").count(), 8);
    // An editor that writes an invalid output marked MARK, and given that back, a valid one.
    let editor = dir.join("editor.sh");
    std::fs::write(
        &editor,
        format!(
            "#!/bin/sh\nif grep -q MARK \"$1\"; then printf '%s' '{GOOD}' > \"$1\"; else printf '%s' '{{\"label\": \"nope\", \"reason\": \"MARK\"}}' > \"$1\"; fi\n"
        ),
    )
    .unwrap();
    std::process::Command::new("chmod")
        .arg("+x")
        .arg(&editor)
        .status()
        .unwrap();
    // e: the invalid edit is refused; e again reopens it (not the model's
    // output), and the fixed one is accepted.
    let screen = drive_next(&redis, &["e", "e", "q"], editor.to_str().unwrap());
    assert!(screen.contains("8 entries left"), "{screen}");
    assert!(
        screen.contains("the corrected output is invalid") && screen.contains("accepted"),
        "{screen}"
    );
    assert!(!screen.contains("\\\""), "no escaped JSON strings: {screen}");
    assert!(
        screen.contains("\"message_id\": \"msg-"),
        "the input as indented JSON: {screen}"
    );
    let accepted: Vec<String> = states(&redis)
        .into_iter()
        .filter(|(_, s)| s == "done")
        .map(|(r, _)| r)
        .collect();
    assert_eq!(accepted.len(), 1, "{screen}");
    let result = hash_entry(&redis, keys::results, &accepted[0]).unwrap();
    assert_eq!(result["output"]["_reviewer"], "carol", "{result}");
    assert!(
        result["output"].get("_model").is_none(),
        "a person's output is not the model's: {result}"
    );

    // An editor left without a change accepts nothing; r and j ask first
    // (Enter alone: nothing done); then requeue with a note and reject with a reason.
    let screen = drive_next(
        &redis,
        &[
            "e",
            "r",
            "\n",
            "r",
            "the label must be billing\n",
            "j",
            "duplicate ticket\n",
            "q",
        ],
        "true",
    );
    assert!(screen.contains("7 entries left"), "{screen}");
    assert!(
        screen.contains("unchanged: nothing done") && screen.contains("nothing done"),
        "{screen}"
    );
    assert!(
        screen.contains("requeued") && screen.contains("rejected") && screen.contains("2 acted on"),
        "{screen}"
    );
    let s = states(&redis);
    let of = |state: &str| {
        s.iter()
            .filter(|(_, v)| *v == state)
            .map(|(r, _)| r.clone())
            .collect::<Vec<_>>()
    };
    let (requeued, rejected) = (of("queued"), of("dropped:rejected"));
    assert_eq!((requeued.len(), rejected.len(), of("review").len()), (1, 1, 5), "{s:?}");

    // Every entry left, shown: a truncated one says how its last call ended.
    let screen = drive_next(&redis, &["s", "s", "s", "s", "s"], "true");
    let truncated = (0..P)
        .flat_map(|p| redis.conn().hvals::<_, Vec<String>>(keys::review("rv", p)).unwrap())
        .filter(|e| e.contains("\"finish_reason\":\"length\""))
        .count();
    assert!(truncated > 0, "the seed gives a truncated entry");
    assert!(screen.contains("finish_reason length"), "{screen}");

    // The rejected entry can still be shown (from the archive), and its
    // export names who, why and the record.
    let shown = review(&redis, &["show", &rejected[0]]);
    assert!(shown.status.success(), "{}", stderr(&shown));
    let shown: Value = serde_json::from_str(&stdout(&shown)).unwrap();
    assert_eq!(shown["actions"][0]["reason"], "duplicate ticket");
    let out = harness::producer(&[
        "export",
        "--job",
        "rv",
        "--redis",
        &redis.url(),
        "--what",
        "dropped",
        "--out",
        "-",
    ]);
    let line: Value = serde_json::from_str(stdout(&out).lines().next().unwrap()).unwrap();
    assert_eq!(
        (
            line["reviewer"].as_str(),
            line["reason_text"].as_str(),
            line["key"].as_str()
        ),
        (Some("carol"), Some("duplicate ticket"), shown["key"].as_str()),
        "{line}"
    );
    assert!(line["input"]["message_id"].is_string(), "{line}");

    // The requeued record's next call shows the model the note (and its last answer).
    let sim = LlmSim::start(&["--seed", "9"]);
    let (status, err) = Running::spawn(worker_cmd(&redis, "rv", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(status.success(), "{err}");
    let told = sim.log_containing("A reviewer looked at your previous answer and notes: the label must be billing");
    assert_eq!(told.len(), 1, "the requeued record's one call: {told:?}");
    assert!(
        hash_entry(&redis, keys::results, &requeued[0]).is_some(),
        "and it is done now"
    );
}

/// A `review next` session left open: what it shows, read as it comes.
struct Session {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Session {
    fn start(redis: &RedisServer, who: &str, lease_secs: &str) -> Session {
        use std::io::BufRead;
        use std::process::Stdio;
        let mut child = Command::new(bin("producer"))
            .args(review_args(redis, who, &["next", "--lease-secs", lease_secs]))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let err = child.stderr.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        let tx_err = tx.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        // What it says on stderr comes in the same stream, marked.
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
                if tx_err.send(format!("stderr: {line}")).is_err() {
                    break;
                }
            }
        });
        Session { child, lines }
    }

    /// The business key of the entry on screen (`=== KEY (rid)`), or None
    /// when the session found nothing left for it.
    fn shown(&self) -> Option<String> {
        loop {
            let line = self.lines.recv_timeout(Duration::from_secs(20)).expect("a screen");
            assert!(!line.starts_with("stderr: error"), "{line}");
            if let Some(rest) = line.strip_prefix("=== ") {
                return rest.split_whitespace().next().map(str::to_owned);
            }
            if line.contains("nothing left to review") {
                return None;
            }
        }
    }

    /// Ends the session as a closed terminal does (its lease given back).
    fn close(mut self) {
        drop(self.child.stdin.take());
        let status = harness::wait_exit(&mut self.child, Duration::from_secs(20));
        assert!(status.success());
    }
}

#[test]
fn two_reviewers_are_never_handed_the_same_entry_while_a_lease_holds() {
    let (redis, _dir) = all_in_review(3);
    // Rounds of two sessions started at once: never the same entry.
    for round in 0..4 {
        let (a, b) = (
            Session::start(&redis, "ann", "600"),
            Session::start(&redis, "bob", "600"),
        );
        let (ka, kb) = (a.shown().unwrap(), b.shown().unwrap());
        assert_ne!(ka, kb, "round {round}: both were handed {ka}");
        // A third gets the last free one; a fourth, nothing while three hold.
        let c = Session::start(&redis, "cy", "600");
        let kc = c.shown().unwrap();
        assert!(kc != ka && kc != kb, "round {round}: {kc}");
        let d = Session::start(&redis, "dee", "600");
        assert_eq!(d.shown(), None, "every entry is held");
        d.close();
        // A session that ends gives its entry back at once.
        c.close();
        let d = Session::start(&redis, "dee", "600");
        assert_eq!(d.shown(), Some(kc), "the entry cy left");
        for s in [a, b, d] {
            s.close();
        }
    }
    // Two sessions of one reviewer are two holders.
    let (a, b) = (
        Session::start(&redis, "ann", "600"),
        Session::start(&redis, "ann", "600"),
    );
    assert_ne!(a.shown().unwrap(), b.shown().unwrap());
    a.close();
    b.close();
    // A session that sits on an entry keeps it, past its lease time (it
    // renews it); one that dies (killed) lets the lease lapse, and the
    // entry comes back.
    let mut quiet = Session::start(&redis, "ann", "1");
    let held = quiet.shown().unwrap();
    let (b, c) = (
        Session::start(&redis, "bob", "600"),
        Session::start(&redis, "cy", "600"),
    );
    let others = [b.shown().unwrap(), c.shown().unwrap()];
    assert!(!others.contains(&held), "{held} is ann's");
    std::thread::sleep(Duration::from_millis(2500));
    let d = Session::start(&redis, "dee", "600");
    assert_eq!(d.shown(), None, "ann still has {held} open: renewed");
    d.close();
    quiet.child.kill().unwrap();
    quiet.child.wait().unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let d = Session::start(&redis, "dee", "600");
    assert_eq!(
        d.shown(),
        Some(held),
        "ann's session died: its lease lapsed and the entry is free"
    );
    for s in [b, c, d] {
        s.close();
    }
}

/// A job "rv" of 30 records in review after one attempt each: about half
/// with a wrong label (E_ENUM), the rest refused by the model.
fn mixed_review() -> (RedisServer, TempDir) {
    let redis = RedisServer::start();
    let dir = TempDir::new("bulk");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 30);
    let spec = harness::spec_with(&dir, &[("max_attempts = 4", "max_attempts = 1")]);
    enqueue(&redis, &data, "rv", &spec);
    let sim = LlmSim::start(&["--faults", "bad_enum=0.5,content_filter=0.5", "--seed", "5"]);
    let (status, err) = Running::spawn(worker_cmd(&redis, "rv", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(status.success(), "{err}");
    (redis, dir)
}

fn json_out(out: &std::process::Output) -> Value {
    assert!(out.status.success(), "{}", stderr(out));
    serde_json::from_str(&stdout(out)).unwrap()
}

#[test]
fn bulk_actions_select_by_filter_say_how_many_first_and_are_logged() {
    let (redis, _dir) = mixed_review();
    let listed = json_out(&review(&redis, &["list", "--json"]));
    let entries = listed["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 30);
    let enum_ids: Vec<&str> = entries
        .iter()
        .filter(|e| {
            e["errors"]
                .as_array()
                .is_some_and(|x| x.iter().any(|x| x["code"] == "E_ENUM"))
        })
        .map(|e| e["record_id"].as_str().unwrap())
        .collect();
    assert!(enum_ids.len() > 10 && enum_ids.len() < 30, "{}", enum_ids.len());

    // A dry run: the count and a sample, nothing done.
    let dry = json_out(&review(
        &redis,
        &[
            "bulk",
            "reject",
            "--code",
            "E_ENUM",
            "--because",
            "x",
            "--dry-run",
            "--json",
        ],
    ));
    assert_eq!(dry["matched"], enum_ids.len());
    assert_eq!(dry["sample"].as_array().unwrap().len(), 5);
    assert!(enum_ids.contains(&dry["sample"][0]["record_id"].as_str().unwrap()));
    // Past ten entries, it wants --yes, and says so.
    let refused = review(&redis, &["bulk", "reject", "--code", "E_ENUM", "--because", "x"]);
    assert_eq!(refused.status.code(), Some(2));
    let err = stderr(&refused);
    assert!(
        err.contains(&format!("would touch {} review entries", enum_ids.len())) && err.contains("--yes"),
        "{err}"
    );
    assert!(err.contains("--dry-run"), "{err}");
    assert_eq!(
        states(&redis).values().filter(|s| *s == "review").count(),
        30,
        "nothing done"
    );
    // Mistyped filters are refused, naming the flag.
    let bad = review(&redis, &["bulk", "requeue", "--since", "yesterday"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(stderr(&bad).contains("--since `yesterday`"), "{}", stderr(&bad));
    let bad = review(&redis, &["bulk", "requeue"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        stderr(&bad).contains("needs a filter"),
        "the whole queue is never one keystroke away"
    );
    let bad = review(&redis, &["bulk", "reject", "--code", "E_ENUM"]);
    assert!(stderr(&bad).contains("--because TEXT"), "{}", stderr(&bad));
    for (flags, n) in [
        (vec!["--min-attempts", "2"], 0),
        (vec!["--since", "2999-01-01T00:00:00Z"], 0),
        (vec!["--until", "2999-01-01T00:00:00Z"], 30),
        (vec!["--reason", "refused"], 30 - enum_ids.len()),
        (vec!["--field", "label", "--max-attempts", "1"], enum_ids.len()),
    ] {
        let mut args = vec!["bulk", "requeue", "--dry-run", "--json"];
        args.extend(&flags);
        assert_eq!(json_out(&review(&redis, &args))["matched"], n, "{flags:?}");
    }

    // A JSON path on the input: one record, requeued with a note.
    let one = entries.iter().find(|e| e["record_id"] == enum_ids[0]).unwrap();
    let text = serde_json::from_str::<Value>(one["input"].to_string().as_str()).unwrap()["text"]
        .as_str()
        .unwrap()
        .to_owned();
    let path = format!("$.text={text}");
    let done = json_out(&review(
        &redis,
        &["bulk", "requeue", "--input", &path, "--note", "use billing", "--json"],
    ));
    assert_eq!(
        (done["matched"].as_u64(), done["acted"].as_u64()),
        (Some(1), Some(1)),
        "{done}"
    );
    assert_eq!(states(&redis)[enum_ids[0]], "queued");
    // The rest of the wrong labels, rejected.
    let done = json_out(&review(
        &redis,
        &[
            "bulk",
            "reject",
            "--code",
            "E_ENUM",
            "--because",
            "bad labels",
            "--yes",
            "--json",
        ],
    ));
    assert_eq!(done["acted"], enum_ids.len() - 1);
    let s = states(&redis);
    assert_eq!(
        s.values().filter(|v| *v == "dropped:rejected").count(),
        enum_ids.len() - 1
    );
    assert_eq!(
        hash_entry(&redis, keys::reviewed, enum_ids[1]).unwrap()["actions"][0]["reason"],
        "bad labels"
    );

    // The log holds both, with their filters and counts.
    let log = json_out(&review(&redis, &["bulk-log", "--json"]));
    let actions = log["actions"].as_array().unwrap();
    assert_eq!(actions.len(), 2, "{log}");
    assert_eq!(actions[0]["action"], "requeue");
    assert_eq!(actions[0]["filter"]["input"][0], path.as_str());
    assert_eq!(
        (actions[0]["matched"].as_u64(), actions[0]["by"].as_str()),
        (Some(1), Some("alice"))
    );
    assert_eq!(actions[0]["detail"], "use billing");
    assert_eq!(actions[1]["action"], "reject");
    assert_eq!(actions[1]["filter"], serde_json::json!({"code": "E_ENUM"}));
    assert_eq!(actions[1]["acted"], enum_ids.len() - 1);
    let text = stdout(&review(&redis, &["bulk-log"]));
    assert_eq!(text.lines().count(), 2, "{text}");
}

#[test]
fn a_closed_terminal_gives_its_entry_back_at_once() {
    let (redis, _dir) = all_in_review(2);
    let out = Command::new("python3")
        .arg(harness::workspace().join("tests/pty/drive.py"))
        .arg("<HUP>")
        .arg("--")
        .arg(bin("producer"))
        .args(review_args(&redis, "ann", &["next", "--lease-secs", "600"]))
        .output()
        .unwrap();
    let screen = stdout(&out);
    assert!(out.status.success(), "{screen}\n{}", stderr(&out));
    let first = screen
        .lines()
        .find_map(|l| l.strip_prefix("=== "))
        .and_then(|l| l.split_whitespace().next())
        .unwrap()
        .to_owned();
    // Ann's window closed while her first entry was on screen: it is free
    // at once (not in ten minutes), so the next reviewer is handed it.
    let bob = Session::start(&redis, "bob", "600");
    assert_eq!(bob.shown(), Some(first));
    bob.close();
}

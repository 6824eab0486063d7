//! Habits of a command-line tool: colours only on a terminal and never with
//! `NO_COLOR`; `--json` one document, JSON Lines only behind `--jsonl`;
//! shell completions and man pages from the command's own definition.
//! A terminal is a real pseudo-terminal (`script` from util-linux).

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::process::Command;

use harness::{LlmSim, RedisServer, TempDir, bin, enqueue, producer, spec_with, stderr, stdout, write_records};

/// A shell word of `s` (single-quoted).
fn quoted(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// Runs `program args` with its output on a pseudo-terminal; returns what
/// the terminal showed.
fn on_terminal(program: &str, args: &[&str], env: &[(&str, &str)]) -> String {
    let line = std::iter::once(program)
        .chain(args.iter().copied())
        .map(quoted)
        .collect::<Vec<_>>()
        .join(" ");
    let mut cmd = Command::new("script");
    cmd.args(["-qec", &line, "/dev/null"]).env_remove("NO_COLOR");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn logs_are_in_colour_only_on_a_terminal_and_never_with_no_color() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    let dir = TempDir::new("colour");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 3);
    enqueue(&redis, &data, "colour", &spec_with(&dir, &[]));
    let worker = bin("worker");
    let (url, base) = (redis.url(), sim.base_url());
    let args = [
        "--redis",
        &url,
        "--base-url",
        &base,
        "--job",
        "colour",
        "--drain",
        "--metrics-addr",
        "127.0.0.1:0",
        "--log-format",
        "text",
    ];
    let env = [("OPENAI_API_KEY", "sk-test-colour-0000")];
    let escape = '\u{1b}';

    let piped = Command::new(&worker)
        .args(args)
        .envs(env)
        .env_remove("NO_COLOR")
        .output()
        .unwrap();
    assert!(piped.status.success(), "{}", stderr(&piped));
    let text = stderr(&piped);
    assert!(text.contains("INFO"), "text logs: {text}");
    assert!(!text.contains(escape), "no colour into a pipe: {text:?}");

    let shown = on_terminal(worker.to_str().unwrap(), &args, &env);
    assert!(shown.contains("INFO"), "{shown}");
    assert!(shown.contains(escape), "colour on a terminal: {shown:?}");

    let shown = on_terminal(worker.to_str().unwrap(), &args, &[env[0], ("NO_COLOR", "1")]);
    assert!(shown.contains("INFO"), "{shown}");
    assert!(!shown.contains(escape), "NO_COLOR: none at all: {shown:?}");
}

#[test]
fn json_is_one_document_and_streams_are_json_lines_only_with_jsonl() {
    let redis = RedisServer::start();
    let dir = TempDir::new("jsonl");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 4);
    enqueue(&redis, &data, "lines", &spec_with(&dir, &[]));
    let url = redis.url();

    // --watch --json would be a stream of documents: refused, with the line to type.
    let out = producer(&["status", "--job", "lines", "--redis", &url, "--watch", "--json"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    let hint = "producer status --job lines --watch --jsonl --redis";
    assert!(err.contains("--json is one document") && err.contains(hint), "{err}");
    assert!(stdout(&out).is_empty());

    // --json: one document (pretty or not, it parses whole).
    let out = producer(&["status", "--job", "lines", "--redis", &url, "--json"]);
    let doc: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(doc["expected"], 4, "{doc}");

    // --jsonl: a line per status; into a pipe, no screen-clearing escapes.
    let out = producer(&["status", "--job", "lines", "--redis", &url, "--jsonl"]);
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1, "{lines:?}");
    let one: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
    assert_eq!(one["expected"], 4);
    assert!(!stdout(&out).contains('\u{1b}'));
}

#[test]
fn completions_and_man_pages_come_from_the_commands_own_definition() {
    for shell in ["bash", "zsh", "fish"] {
        let out = producer(&["completions", shell]);
        assert!(out.status.success(), "{shell}: {}", stderr(&out));
        let script = stdout(&out);
        for word in ["enqueue", "status", "review", "require-complete"] {
            assert!(script.contains(word), "{shell} completes {word}");
        }
    }
    // bash loads the script and completes `producer sta` to `status`.
    let script = stdout(&producer(&["completions", "bash"]));
    let dir = TempDir::new("compl");
    let file = dir.join("producer.bash");
    std::fs::write(&file, script).unwrap();
    let probe = format!(
        ". {}; COMP_WORDS=(producer sta); COMP_CWORD=1; COMP_LINE='producer sta'; COMP_POINT=12; \
         _producer producer sta producer; printf '%s\\n' \"${{COMPREPLY[@]}}\"",
        quoted(file.to_str().unwrap())
    );
    let out = Command::new("bash").args(["-c", &probe]).output().unwrap();
    let offered = stdout(&out);
    assert!(offered.lines().any(|l| l == "status"), "{offered} {}", stderr(&out));

    let out = producer(&["completions", "tcsh"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("bash"),
        "names the shells it knows: {}",
        stderr(&out)
    );

    // Man pages: one per command, in roff, readable by man.
    let mandir = dir.join("man1");
    let out = producer(&["man", "--dir", mandir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    for page in [
        "producer.1",
        "producer-status.1",
        "producer-review.1",
        "producer-enqueue.1",
    ] {
        let text = std::fs::read_to_string(mandir.join(page)).unwrap_or_else(|e| panic!("{page}: {e}"));
        assert!(text.contains(".TH"), "{page} is roff");
    }
    let status_page = std::fs::read_to_string(mandir.join("producer-status.1")).unwrap();
    assert!(status_page.contains("require\\-complete"), "the flags are documented");
    let out = producer(&["man"]);
    assert!(
        stdout(&out).starts_with(".ie") || stdout(&out).contains(".TH producer"),
        "the main page on stdout"
    );
}

//! Every `sh` block of the README, ARCHITECTURE.md and docs/ runs as written:
//! in order, one file at a time, from a folder that holds the repository's
//! `examples/`, against a real redis-server and llm-sim (`REDIS_URL`,
//! `BATCHFLEET_BASE_URL` and `OPENAI_API_KEY` set, batchfleet's binaries first
//! on `PATH`), each block under `sh -e`. `python` blocks run the same way
//! under `python3`, with `producer serve-batches` listening where the docs
//! say (127.0.0.1:8090, the key `alice:alice-0123456789abcdef`). `text`
//! blocks are synopses; a code block with no language, or a shell under
//! another name, is refused, so no command goes untested by accident.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::path::PathBuf;
use std::process::Command;

use harness::{LlmSim, RedisServer, Running, TempDir, bin, stderr, stdout, workspace};

/// Where the docs' Python finds `producer serve-batches`, and its key.
const BATCHES_BIND: &str = "127.0.0.1:8090";
const BATCHES_KEYS: &str = "alice:alice-0123456789abcdef";

/// `producer serve-batches` as docs/batches.md starts it.
fn serve_batches(redis: &RedisServer, dir: &TempDir) -> Running {
    let mut c = Command::new(bin("producer"));
    c.args(["serve-batches", "--bind", BATCHES_BIND, "--provider-spec"])
        .arg(workspace().join("examples/batches/provider.toml"))
        .arg("--data-dir")
        .arg(dir.join("batches"))
        .env("REDIS_URL", redis.url())
        .env("BATCHFLEET_BATCHES_KEYS", BATCHES_KEYS);
    let mut running = Running::spawn(c);
    harness::wait_for("serve-batches to listen", std::time::Duration::from_secs(20), || {
        std::net::TcpStream::connect(BATCHES_BIND).is_ok()
    });
    // What listens is this server, not another process on the docs' port.
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert!(
        running.child.try_wait().unwrap().is_none(),
        "serve-batches left at once: is {BATCHES_BIND} taken by another process?"
    );
    running
}

/// A fenced block: the line it opens on, its language, its text.
struct Block {
    line: usize,
    lang: String,
    body: String,
}

fn blocks(markdown: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut open: Option<Block> = None;
    for (i, l) in markdown.lines().enumerate() {
        match (&mut open, l.strip_prefix("```")) {
            (None, Some(lang)) => {
                open = Some(Block {
                    line: i + 1,
                    lang: lang.trim().to_owned(),
                    body: String::new(),
                })
            }
            (Some(_), Some(_)) => out.extend(open.take()),
            (Some(b), None) => {
                b.body.push_str(l);
                b.body.push('\n');
            }
            (None, None) => {}
        }
    }
    out
}

fn documents() -> Vec<PathBuf> {
    let root = workspace();
    let mut files = vec![root.join("README.md"), root.join("ARCHITECTURE.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

#[test]
fn every_code_block_says_what_it_is() {
    for file in documents() {
        let text = std::fs::read_to_string(&file).unwrap();
        for b in blocks(&text) {
            assert!(
                !b.lang.is_empty() && !["bash", "shell", "console", "zsh"].contains(&b.lang.as_str()),
                "{}:{}: a block must be `sh` (it runs in this test) or say what else it is, not `{}`",
                file.display(),
                b.line,
                b.lang
            );
        }
    }
}

#[test]
fn every_sh_block_of_the_readme_and_docs_runs_as_written() {
    let path = format!(
        "{}:{}",
        bin("producer").parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut ran = 0;
    for file in documents() {
        let text = std::fs::read_to_string(&file).unwrap();
        let runnable: Vec<Block> = blocks(&text)
            .into_iter()
            .filter(|b| b.lang == "sh" || b.lang == "python")
            .collect();
        if runnable.is_empty() {
            continue;
        }
        // Each document its own servers and folder, its blocks in order.
        let redis = RedisServer::start();
        let sim = LlmSim::start(&[]);
        let dir = TempDir::new("docs");
        std::os::unix::fs::symlink(workspace().join("examples"), dir.join("examples")).unwrap();
        let _batches = runnable
            .iter()
            .any(|b| b.lang == "python")
            .then(|| serve_batches(&redis, &dir));
        for b in runnable {
            let mut cmd = match b.lang.as_str() {
                "python" => Command::new("python3"),
                _ => Command::new("/bin/sh"),
            };
            if b.lang == "sh" {
                cmd.arg("-e");
            }
            let out = cmd
                .args(["-c", &b.body])
                .current_dir(dir.path())
                .env("PATH", &path)
                .env("REDIS_URL", redis.url())
                .env("BATCHFLEET_BASE_URL", sim.base_url())
                .env("OPENAI_API_KEY", "sk-test-key")
                // What a block installs (completions, man pages) stays in its folder.
                .env("XDG_DATA_HOME", dir.join("share"))
                .env_remove("BATCHFLEET_JOBS")
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}:{} did not run as written ({}):\n{}\n--- stdout\n{}\n--- stderr\n{}",
                file.display(),
                b.line,
                out.status,
                b.body,
                stdout(&out),
                stderr(&out)
            );
            ran += 1;
        }
    }
    assert!(ran >= 5, "only {ran} blocks ran");
}

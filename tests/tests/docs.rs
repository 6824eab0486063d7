//! Every `sh` block of the README, ARCHITECTURE.md and docs/ runs as written:
//! in order, one file at a time, from a folder that holds the repository's
//! `examples/`, against a real redis-server and llm-sim (`REDIS_URL`,
//! `BATCHFLEET_BASE_URL` and `OPENAI_API_KEY` set, batchfleet's binaries first
//! on `PATH`), each block under `sh -e`. `text` blocks are synopses; a code
//! block with no language, or a shell under another name, is refused, so no
//! command goes untested by accident.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::path::PathBuf;
use std::process::Command;

use harness::{LlmSim, RedisServer, TempDir, bin, stderr, stdout, workspace};

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
        let runnable: Vec<Block> = blocks(&text).into_iter().filter(|b| b.lang == "sh").collect();
        if runnable.is_empty() {
            continue;
        }
        // Each document its own servers and folder, its blocks in order.
        let redis = RedisServer::start();
        let sim = LlmSim::start(&[]);
        let dir = TempDir::new("docs");
        std::os::unix::fs::symlink(workspace().join("examples"), dir.join("examples")).unwrap();
        for b in runnable {
            let out = Command::new("/bin/sh")
                .args(["-e", "-c", &b.body])
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

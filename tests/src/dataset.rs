//! Datasets and job specs: synthetic record lines, record files, and the
//! example spec (as is or with replacements).

use std::path::{Path, PathBuf};

use crate::paths::{TempDir, workspace};

/// The example job spec.
pub fn example_spec() -> PathBuf {
    workspace().join("examples/job.toml")
}

/// A delivery's result as a model's answer commits it (one call, no
/// output fields), stamped under `spec`.
pub fn result_for(d: &common::task::Delivery, spec: &common::spec::JobSpec) -> common::task::ResultRecord {
    let answer = common::task::Answer {
        key: d.task.rid.clone(),
        output: serde_json::Map::new(),
        attempts: 1,
        calls: 1,
        response_id: Some(format!("resp-{}", d.entry_id)),
        repairs: vec![],
        usage: None,
    };
    common::task::ResultRecord::from_model(&d.task, answer, vec![], &common::task::Stamp::now(spec), "w")
}

/// A synthetic record line for the example spec.
pub fn record_line(id: &str, text: &str) -> String {
    serde_json::json!({
        "message_id": id,
        "channel": "chat",
        "task_type": "classify",
        "text": text,
    })
    .to_string()
}

/// Writes `n` good records `msg-<from>`..`msg-<from+n-1>` to `path`.
pub fn write_records(path: &Path, from: u64, n: u64) {
    use std::io::Write;
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).expect("create dataset"));
    for i in from..from + n {
        writeln!(
            f,
            "{}",
            record_line(&format!("msg-{i}"), &format!("message number {i}"))
        )
        .expect("write dataset");
    }
    f.flush().expect("flush dataset");
}

/// The replacement that gives the example spec a `[sink]` writing to
/// PostgreSQL (the URL in the variable `url_env`), with `extra` lines
/// (`table = ...`, `batch_rows = ...`): use as `("[retry]", &text)`.
pub fn sink_section(url_env: &str, extra: &str) -> String {
    format!("[sink]\nkind = \"postgres\"\nurl_env = \"{url_env}\"\n{extra}\n[retry]")
}

/// The example spec with replacements, written to `dir/job.toml`.
pub fn spec_with(dir: &TempDir, replacements: &[(&str, &str)]) -> PathBuf {
    let mut text = std::fs::read_to_string(example_spec()).expect("read example spec");
    for (from, to) in replacements {
        assert!(text.contains(from), "example spec lacks {from:?}");
        text = text.replacen(from, to, 1);
    }
    let path = dir.join("job.toml");
    std::fs::write(&path, text).expect("write spec");
    path
}

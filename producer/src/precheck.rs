//! A spec's template against the first records of a dataset, before
//! anything is enqueued: a placeholder that most records lack (`{{titel}}`
//! where the records have `title`) would drop nearly every record as
//! `template_missing`. `spec check --data FILE` reports each placeholder;
//! `enqueue` refuses to start (nothing written to Redis) when most of the
//! first records would drop for the same placeholder, and says how to fix it
//! in commands that work as typed.

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::Path;

use common::spec::JobSpec;
use common::suggest::{nearest, shell_word};
use common::template::{Template, lookup};
use serde_json::{Map, Value};

/// Records of the dataset's start the check reads.
pub const SAMPLE_LINES: usize = 300;

/// A placeholder and how many of the sampled records lack it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placeholder {
    pub name: String,
    pub missing: usize,
    /// The records' own field name closest to it.
    pub nearest: Option<String>,
}

/// What the first records of a dataset make of a spec's template.
#[derive(Debug, Clone, Default)]
pub struct Check {
    /// JSON objects read (other lines are refused at enqueue anyway).
    pub sampled: usize,
    pub placeholders: Vec<Placeholder>,
    /// The id field, and how many sampled records lack it.
    pub id_missing: usize,
    /// Fields of the sampled records (top-level, dotted below), by how many have them.
    pub fields: BTreeMap<String, usize>,
}

impl Check {
    /// Placeholders most of the sampled records lack: enqueue would drop
    /// nearly every record for them.
    pub fn fatal(&self) -> Vec<&Placeholder> {
        self.placeholders
            .iter()
            .filter(|p| self.sampled > 0 && p.missing * 2 > self.sampled)
            .collect()
    }

    /// The fields most records have, commonest first (then by name).
    pub fn common_fields(&self) -> Vec<&str> {
        let mut v: Vec<(&str, usize)> = self.fields.iter().map(|(k, n)| (k.as_str(), *n)).collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        v.into_iter().take(20).map(|(k, _)| k).collect()
    }
}

fn collect_fields(prefix: &str, obj: &Map<String, Value>, into: &mut BTreeMap<String, usize>) {
    for (k, v) in obj {
        let name = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        if let Value::Object(inner) = v
            && prefix.is_empty()
        {
            collect_fields(&name, inner, into);
        }
        *into.entry(name).or_default() += 1;
    }
}

/// Reads up to [`SAMPLE_LINES`] records of `dataset` and checks the
/// template's placeholders and the id field against each.
pub fn check(spec: &JobSpec, dataset: &Path) -> std::io::Result<Check> {
    let user = Template::parse(&spec.prompt.user).map_err(|e| std::io::Error::other(e.to_string()))?;
    // Each placeholder alone, judged as rendering judges it (missing, null or empty).
    let mut singles = Vec::new();
    for name in user.fields() {
        let one = Template::parse(&format!("{{{{{name}}}}}")).map_err(|e| std::io::Error::other(e.to_string()))?;
        singles.push((name, one));
    }
    // A named pipe or a device would block, or be read only once (enqueue
    // refuses it by name).
    if !std::fs::metadata(dataset)?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    let mut c = Check::default();
    let mut missing: BTreeMap<&str, usize> = BTreeMap::new();
    let file = std::io::BufReader::new(std::fs::File::open(dataset)?);
    for line in file.lines().take(SAMPLE_LINES) {
        let Ok(Value::Object(record)) = serde_json::from_str::<Value>(&line?) else {
            continue;
        };
        c.sampled += 1;
        collect_fields("", &record, &mut c.fields);
        for (name, one) in &singles {
            if one.render(&record).is_err() {
                *missing.entry(name).or_default() += 1;
            }
        }
        if lookup(&record, &spec.job.id_field).is_none_or(Value::is_null) {
            c.id_missing += 1;
        }
    }
    let names: Vec<&str> = c.fields.keys().map(String::as_str).collect();
    c.placeholders = user
        .fields()
        .into_iter()
        .map(|name| Placeholder {
            name: name.to_owned(),
            missing: missing.get(name).copied().unwrap_or(0),
            nearest: nearest(name, names.iter().copied()).map(str::to_owned),
        })
        .collect();
    Ok(c)
}

/// The sed line that renames placeholder `from` to `to` in the spec file.
fn rename_command(spec_path: &str, from: &str, to: &str) -> String {
    let pattern = format!("{{{{ *{} *}}}}", from.replace('.', "\\."));
    format!(
        "sed -i {} {}",
        shell_word(&format!("s/{pattern}/{{{{{to}}}}}/g")),
        shell_word(spec_path)
    )
}

/// Why enqueue will not start, and what to type: one line per placeholder
/// most records lack, then the commands that fix and check it.
pub fn refusal(c: &Check, spec_path: &str, dataset: &str, enqueue_again: &str) -> String {
    let fatal = c.fatal();
    let mut out = String::new();
    let fields = c.common_fields().join(", ");
    for p in &fatal {
        out.push_str(&format!(
            "prompt.user in {spec_path}: the placeholder {{{{{}}}}} is missing (or empty) in {} of the first {} records of {dataset}; \
             they have: {fields}",
            p.name, p.missing, c.sampled
        ));
        if let Some(near) = &p.nearest {
            out.push_str(&format!(". Did you mean {{{{{near}}}}}?"));
        }
        out.push('\n');
    }
    out.push_str("Nothing was enqueued (every such record would be dropped as template_missing). ");
    let renames: Vec<String> = fatal
        .iter()
        .filter_map(|p| p.nearest.as_ref().map(|n| rename_command(spec_path, &p.name, n)))
        .collect();
    if renames.len() == fatal.len() {
        out.push_str("Fix the spec, check it against the data, then enqueue again:\n");
        for r in renames {
            out.push_str(&format!("  {r}\n"));
        }
    } else {
        out.push_str(&format!(
            "Change prompt.user in {spec_path} to use fields the records have, check it against the data, then enqueue again:\n"
        ));
    }
    out.push_str(&format!(
        "  producer spec check {} --data {}\n  {enqueue_again}",
        shell_word(spec_path),
        shell_word(dataset)
    ));
    out
}

/// `spec check --data`: one line per placeholder (and the id field) that
/// some sampled records lack.
pub fn report(c: &Check, spec: &JobSpec, dataset: &str) -> Vec<String> {
    let mut lines = Vec::new();
    for p in &c.placeholders {
        if p.missing == 0 {
            continue;
        }
        let severity = if p.missing * 2 > c.sampled { "error" } else { "warning" };
        let mut line = format!(
            "{severity}: placeholder {{{{{}}}}} is missing (or empty) in {} of {} records sampled from {dataset} (those are dropped as template_missing:{})",
            p.name, p.missing, c.sampled, p.name
        );
        if let Some(near) = &p.nearest {
            line.push_str(&format!("; did you mean {{{{{near}}}}}?"));
        }
        lines.push(line);
    }
    if c.id_missing > 0 {
        lines.push(format!(
            "warning: job.id_field `{}` is missing in {} of {} sampled records (those are dropped as missing_id)",
            spec.job.id_field, c.id_missing, c.sampled
        ));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(user: &str) -> JobSpec {
        let text = include_str!("../../examples/job.toml").replace(
            "Task type: {{task_type}}\nChannel: {{channel}}\nMessage:\n{{text}}",
            user,
        );
        JobSpec::parse(&text, "job.toml").unwrap()
    }

    fn data(lines: &[&str]) -> (tempfile_path::Guard, std::path::PathBuf) {
        tempfile_path::write(&lines.join("\n"))
    }

    /// A throwaway file for the tests (no tempfile crate).
    mod tempfile_path {
        pub struct Guard(pub std::path::PathBuf);
        impl Drop for Guard {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(&self.0);
            }
        }
        pub fn write(text: &str) -> (Guard, std::path::PathBuf) {
            static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let p = std::env::temp_dir().join(format!("bf-precheck-{}-{n}.jsonl", std::process::id()));
            std::fs::write(&p, text).unwrap();
            (Guard(p.clone()), p)
        }
    }

    #[test]
    fn a_mistyped_placeholder_is_fatal_and_its_nearest_field_named() {
        let (_g, path) = data(&[
            r#"{"message_id": "a", "title": "x", "body": "y"}"#,
            r#"{"message_id": "b", "title": "x", "body": ""}"#,
            "not json",
            r#"{"message_id": "c", "title": "x", "body": "z"}"#,
        ]);
        let c = check(&spec("{{titel}}: {{body}}"), &path).unwrap();
        assert_eq!(c.sampled, 3);
        assert_eq!(
            c.placeholders,
            vec![
                Placeholder {
                    name: "titel".into(),
                    missing: 3,
                    nearest: Some("title".into())
                },
                Placeholder {
                    name: "body".into(),
                    missing: 1,
                    nearest: None
                },
            ]
        );
        assert_eq!(c.fatal().len(), 1, "a third of the records lack body: not fatal");
        let text = refusal(
            &c,
            "my job.toml",
            "d.jsonl",
            "producer enqueue d.jsonl --job j --spec 'my job.toml'",
        );
        assert!(
            text.contains("the placeholder {{titel}} is missing (or empty) in 3 of the first 3 records"),
            "{text}"
        );
        assert!(
            text.contains("they have: body, message_id, title. Did you mean {{title}}?"),
            "{text}"
        );
        assert!(
            text.contains("  sed -i 's/{{ *titel *}}/{{title}}/g' 'my job.toml'\n"),
            "{text}"
        );
        assert!(
            text.contains("  producer spec check 'my job.toml' --data d.jsonl\n"),
            "{text}"
        );
        let lines = report(&c, &spec("{{titel}}: {{body}}"), "d.jsonl");
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines[0].starts_with("error: placeholder {{titel}}"), "{lines:?}");
        assert!(
            lines[1].starts_with("warning: placeholder {{body}} is missing (or empty) in 1 of 3"),
            "{lines:?}"
        );
    }
}

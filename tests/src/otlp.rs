//! A real OTLP receiver for trace tests: the `rotel` agent (pip package
//! `rotel`), printing every span it receives, parsed back into [`ReceivedSpan`]s.

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::{TempDir, free_port, wait_for};

/// A `rotel-agent` child process on 127.0.0.1 (gRPC and HTTP ports), its
/// debug output written to a file of its own temporary folder.
pub struct OtlpReceiver {
    child: Child,
    /// `http://127.0.0.1:PORT`: what `OTEL_EXPORTER_OTLP_ENDPOINT` is set to.
    pub http_endpoint: String,
    out: std::path::PathBuf,
    _dir: TempDir,
}

/// One span as the receiver printed it.
#[derive(Debug, Clone, Default)]
pub struct ReceivedSpan {
    pub service: String,
    pub trace_id: String,
    /// Empty for a root span.
    pub parent_id: String,
    pub span_id: String,
    pub name: String,
    pub kind: String,
    pub status: String,
    /// Values as printed without their type: `Str(x)` -> `x`, `Int(3)` -> `3`.
    pub attributes: BTreeMap<String, String>,
}

impl OtlpReceiver {
    pub fn start() -> OtlpReceiver {
        let agent = rotel_agent();
        let dir = TempDir::new("otlp");
        let (grpc, http) = (free_port(), free_port());
        let out = dir.join("spans.txt");
        let log = std::fs::File::create(&out).expect("create rotel output");
        let child = Command::new(&agent)
            .arg("start")
            .args(["--otlp-grpc-endpoint", &format!("127.0.0.1:{grpc}")])
            .args(["--otlp-http-endpoint", &format!("127.0.0.1:{http}")])
            .args(["--exporter", "blackhole", "--debug-log", "traces"])
            .args(["--debug-log-verbosity", "detailed"])
            .arg("--pid-file")
            .arg(dir.join("rotel.pid"))
            .arg("--log-file")
            .arg(dir.join("rotel.log"))
            .env("NO_COLOR", "1")
            .stdout(log.try_clone().expect("dup"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", agent.display()));
        let addr = format!("127.0.0.1:{http}");
        wait_for("the OTLP receiver", Duration::from_secs(20), || {
            std::net::TcpStream::connect(&addr).is_ok()
        });
        OtlpReceiver {
            child,
            http_endpoint: format!("http://{addr}"),
            out,
            _dir: dir,
        }
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        parse_spans(&std::fs::read_to_string(&self.out).unwrap_or_default())
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The agent binary inside the installed `rotel` Python package.
fn rotel_agent() -> std::path::PathBuf {
    let out = Command::new("python3")
        .args(["-c", "import os, rotel; print(os.path.dirname(rotel.__file__))"])
        .stderr(Stdio::null())
        .output()
        .expect("run python3");
    let dir = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert!(
        out.status.success() && !dir.is_empty(),
        "the OTLP receiver is missing: pip install rotel==0.0.1a15 (make test installs it)"
    );
    std::path::Path::new(&dir).join("rotel-agent")
}

/// Parses rotel's `--debug-log-verbosity detailed` output.
pub fn parse_spans(text: &str) -> Vec<ReceivedSpan> {
    let mut spans: Vec<ReceivedSpan> = Vec::new();
    let mut service = String::new();
    let mut in_span = false;
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with("ResourceSpans #") {
            in_span = false;
            service.clear();
        } else if line.starts_with("Span #") {
            in_span = true;
            spans.push(ReceivedSpan {
                service: service.clone(),
                ..Default::default()
            });
        } else if let Some(attr) = line.strip_prefix("-> ") {
            let Some((k, v)) = attr.split_once(": ") else { continue };
            let v = v
                .split_once('(')
                .and_then(|(_, rest)| rest.strip_suffix(')'))
                .unwrap_or(v)
                .to_owned();
            match spans.last_mut() {
                Some(s) if in_span => {
                    s.attributes.insert(k.to_owned(), v);
                }
                _ if k == "service.name" => service = v,
                _ => {}
            }
        } else if in_span && let Some((k, v)) = line.split_once(':') {
            let Some(s) = spans.last_mut() else { continue };
            let v = v.trim().to_owned();
            match k.trim() {
                "Trace ID" => s.trace_id = v,
                "Parent ID" => s.parent_id = v,
                "ID" => s.span_id = v,
                "Name" => s.name = v,
                "Kind" => s.kind = v,
                "Status code" => s.status = v,
                _ => {}
            }
        }
    }
    spans
}

//! OTLP traces, received by a real collector (rotel): a record's enqueue
//! span and the spans of all its attempts form one trace; with no endpoint
//! configured nothing is started and nothing is said.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::collections::BTreeMap;
use std::time::Duration;

use common::keys;
use harness::otlp::{OtlpReceiver, ReceivedSpan};
use harness::{
    LlmSim, RedisServer, Running, TempDir, enqueue, enqueue_cmd, example_spec, signal, status_json, stderr,
    thread_names, wait_for, worker_cmd, write_records,
};
use redis::Commands;

const RECORDS: usize = 20;
/// The SDK's batch exporter thread (names are cut to 15 bytes in /proc).
const EXPORTER_THREAD: &str = "OpenTelemetry.T";

#[test]
fn a_records_enqueue_and_its_attempts_form_one_trace() {
    let otlp = OtlpReceiver::start();
    let redis = RedisServer::start();
    // Invalid answers make retries, so some records have several attempts.
    let sim = LlmSim::start(&["--latency-ms", "20", "--faults", "bad_enum=0.4", "--seed", "5"]);
    let dir = TempDir::new("traces");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, RECORDS as u64);
    let out = enqueue_cmd(&redis, &data, "tr", &example_spec())
        .arg("--no-progress")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp.http_endpoint)
        .output()
        .unwrap();
    assert!(out.status.success(), "enqueue: {}", stderr(&out));

    let mut cmd = worker_cmd(&redis, "tr", &sim, &["--concurrency", "4"]);
    cmd.env("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp.http_endpoint);
    let worker = Running::spawn(cmd);
    wait_for("every record settled", Duration::from_secs(60), || {
        status_json(&redis, "tr").0 == Some(0)
    });
    assert!(
        thread_names(worker.pid()).iter().any(|n| n == EXPORTER_THREAD),
        "tracing on: the exporter thread runs"
    );
    // SIGTERM: the worker drains and flushes its last spans before it exits.
    signal(worker.pid(), "TERM");
    let (exit, log) = worker.finish(Duration::from_secs(30));
    assert!(exit.success(), "worker: {log}");

    let terminal = |s: &ReceivedSpan| {
        s.name == "attempt"
            && matches!(
                s.attributes.get("batchfleet.settled").map(String::as_str),
                Some("commit" | "review")
            )
    };
    wait_for("every record's last attempt exported", Duration::from_secs(20), || {
        otlp.spans().iter().filter(|s| terminal(s)).count() == RECORDS
    });
    let spans = otlp.spans();
    let by_id: BTreeMap<&str, &ReceivedSpan> = spans.iter().map(|s| (s.span_id.as_str(), s)).collect();
    let children = |parent: &ReceivedSpan, name: &str| -> Vec<&ReceivedSpan> {
        spans
            .iter()
            .filter(|s| s.parent_id == parent.span_id && s.name == name)
            .inspect(|s| assert_eq!(s.trace_id, parent.trace_id, "{name} left its trace"))
            .collect()
    };

    let enqueues: Vec<&ReceivedSpan> = spans.iter().filter(|s| s.name == "enqueue").collect();
    assert_eq!(enqueues.len(), RECORDS, "one enqueue span per record");
    let mut traces = std::collections::HashSet::new();
    let (mut retried, mut invalid_seen) = (0, 0);
    for enq in &enqueues {
        assert_eq!(enq.service, "batchfleet-producer");
        assert_eq!(enq.kind, "SPAN_KIND_PRODUCER");
        assert!(enq.parent_id.is_empty(), "the enqueue span starts the record's trace");
        assert_eq!(enq.attributes["batchfleet.enqueue.outcome"], "added");
        assert!(traces.insert(enq.trace_id.clone()), "one trace per record");
        let rid = &enq.attributes["batchfleet.record_id"];

        // Every attempt of this record, retries included, is a child of its enqueue span.
        let attempts: Vec<&ReceivedSpan> = spans
            .iter()
            .filter(|s| s.name == "attempt" && s.attributes.get("batchfleet.record_id") == Some(rid))
            .collect();
        assert!(!attempts.is_empty(), "record {rid} has no attempt span");
        for a in &attempts {
            assert_eq!(a.service, "batchfleet-worker");
            assert_eq!(a.trace_id, enq.trace_id, "attempt of {rid} in another trace");
            assert_eq!(a.parent_id, enq.span_id, "attempt of {rid} not under its enqueue span");
            assert_eq!(children(a, "model_call").len(), 1, "model_call of {rid}");
            assert_eq!(children(a, "commit").len(), 1, "commit of {rid}");
            let validate = children(a, "validate");
            assert_eq!(validate.len(), 1, "validate of {rid}");
            if validate[0].attributes["batchfleet.valid"] == "false" {
                invalid_seen += 1;
                assert!(validate[0].attributes["batchfleet.errors"].contains("E_ENUM"));
                assert_eq!(a.attributes["batchfleet.decision"], "retry");
            }
        }
        assert_eq!(
            attempts.iter().filter(|a| terminal(a)).count(),
            1,
            "{rid}: one final attempt"
        );
        if attempts.len() > 1 {
            retried += 1;
        }
    }
    assert!(retried > 0 && invalid_seen > 0, "the fault mix made no retry to follow");
    // No orphan: every parent named by a worker span was received.
    for s in spans.iter().filter(|s| s.service == "batchfleet-worker") {
        assert!(by_id.contains_key(s.parent_id.as_str()), "orphan {} span", s.name);
    }
}

#[test]
fn tracing_off_starts_no_exporter_and_adds_nothing_to_tasks() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--latency-ms", "20"]);
    let dir = TempDir::new("traces-off");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, RECORDS as u64);
    enqueue(&redis, &data, "off", &example_spec());
    // The tasks carry no trace context.
    let mut conn = redis.conn();
    for p in 0..4 {
        let entries: redis::streams::StreamRangeReply = conn.xrange_all(keys::stream("off", p)).unwrap();
        for e in entries.ids {
            assert!(
                e.map.contains_key("rid") && !e.map.contains_key("tp"),
                "{:?}",
                e.map.keys()
            );
        }
    }
    let worker = Running::spawn(worker_cmd(&redis, "off", &sim, &["--concurrency", "4"]));
    wait_for("every record settled", Duration::from_secs(60), || {
        status_json(&redis, "off").0 == Some(0)
    });
    let threads = thread_names(worker.pid());
    assert!(!threads.is_empty(), "could not read the worker's threads");
    assert!(!threads.iter().any(|n| n.starts_with("OpenTelemetry")), "{threads:?}");
    signal(worker.pid(), "TERM");
    let (exit, log) = worker.finish(Duration::from_secs(30));
    assert!(exit.success(), "worker: {log}");
    let lower = log.to_lowercase();
    assert!(
        !lower.contains("opentelemetry") && !lower.contains("otlp"),
        "tracing off, yet the log speaks of it:\n{log}"
    );
}

#[test]
fn a_protocol_this_build_cannot_speak_is_refused_by_name() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    let out = worker_cmd(&redis, "any", &sim, &["--drain"])
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("OTEL_EXPORTER_OTLP_PROTOCOL=grpc"),
        "{}",
        stderr(&out)
    );
}

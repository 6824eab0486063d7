//! The whole pipeline against a local 3-master Redis Cluster: enqueue,
//! workers, status, review, export; partitions spread over several nodes;
//! a node kill -9d and restarted mid-run; the job deleted from every node.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::collections::BTreeSet;
use std::time::Duration;

use common::keys;
use harness::{
    LlmSim, RedisCluster, Running, TempDir, enqueue_cmd_url, example_spec, producer, status_json_url, stderr, stdout,
    wait_for, worker_cmd_url, write_records,
};

const RECORDS: u64 = 400;

#[test]
fn a_job_runs_end_to_end_on_a_cluster_and_survives_a_node_restart() {
    let mut cluster = RedisCluster::start();
    let url = cluster.url();
    let sim = LlmSim::start(&[
        "--latency-ms",
        "100",
        "--faults",
        "content_filter=0.05,bad_enum=0.1",
        "--seed",
        "3",
    ]);
    let dir = TempDir::new("cluster");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, RECORDS);
    let out = enqueue_cmd_url(&url, &data, "cl", &example_spec())
        .args(["--no-progress", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "enqueue on a cluster: {}", stderr(&out));
    let summary: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(summary["enqueued"], RECORDS);

    // The job's partitions live on several nodes (else this proves little).
    let nodes: BTreeSet<usize> = (0..4).map(|p| cluster.node_of(&keys::stream("cl", p))).collect();
    assert!(nodes.len() >= 2, "every partition on one node: {nodes:?}");

    let workers: Vec<Running> = (0..2)
        .map(|_| {
            Running::spawn(worker_cmd_url(
                &url,
                "cl",
                &sim,
                &["--concurrency", "8", "--visibility-timeout-ms", "40000"],
            ))
        })
        .collect();
    wait_for("a quarter of the job done", Duration::from_secs(60), || {
        status_json_url(&url, "cl").1["done"].as_u64().unwrap_or(0) >= RECORDS / 4
    });
    // kill -9 the node holding partition 0, restart it from its AOF.
    let victim = cluster.node_of(&keys::stream("cl", 0));
    cluster.nodes[victim].kill9_and_restart();
    cluster.wait_ok();
    wait_for(
        "the job complete after the node restart",
        Duration::from_secs(120),
        || status_json_url(&url, "cl").0 == Some(0),
    );
    for w in workers {
        harness::signal(w.pid(), "TERM");
        let (exit, log) = w.finish(Duration::from_secs(30));
        assert!(exit.success(), "worker on a cluster: {log}");
    }
    let (code, status) = status_json_url(&url, "cl");
    assert_eq!(code, Some(0), "{status}");
    let n = |k: &str| status[k].as_u64().unwrap();
    assert_eq!((n("missing"), n("duplicates"), n("unknown")), (0, 0, 0), "{status}");
    assert_eq!(n("done") + n("review") + n("dropped"), RECORDS);
    assert!(n("review") > 0, "the fault mix sent nothing to review: {status}");

    // Review and export work on the cluster too.
    let listed = producer(&["review", "--job", "cl", "--redis", &url, "list", "--jsonl"]);
    assert!(listed.status.success(), "{}", stderr(&listed));
    let first: serde_json::Value = serde_json::from_str(stdout(&listed).lines().next().unwrap()).unwrap();
    let rid = first["record_id"].as_str().unwrap();
    let rejected = producer(&[
        "review",
        "--job",
        "cl",
        "--redis",
        &url,
        "--reviewer",
        "ci",
        "reject",
        rid,
        "--reason",
        "checked by hand",
    ]);
    assert!(rejected.status.success(), "{}", stderr(&rejected));
    let file = dir.join("done.jsonl");
    let exported = producer(&[
        "export",
        "--job",
        "cl",
        "--redis",
        &url,
        "--out",
        file.to_str().unwrap(),
    ]);
    assert!(exported.status.success(), "{}", stderr(&exported));
    let lines = std::fs::read_to_string(&file).unwrap().lines().count() as u64;
    assert_eq!(lines, n("done"));
    let report = producer(&["report", "--job", "cl", "--redis", &url]);
    assert!(report.status.success(), "{}", stderr(&report));
    // Reads over every partition are one command per slot (no pipeline spans two).
    let audit = producer(&["audit", "--job", "cl", "--redis", &url, "--sample", "3", "--json"]);
    assert!(audit.status.success(), "{}", stderr(&audit));
    let audit: serde_json::Value = serde_json::from_slice(&audit.stdout).unwrap();
    assert_eq!(
        (audit["sampled"].as_u64(), audit["waiting"].as_u64()),
        (Some(3), Some(3)),
        "{audit}"
    );

    // Deleted, the job leaves no key on any node (its keys are named one by
    // one from its hashes, slot by slot: no key pattern reaching one node).
    let deleted = producer(&["delete", "--job", "cl", "--redis", &url, "--yes"]);
    assert!(deleted.status.success(), "{}", stderr(&deleted));
    for node in &cluster.nodes {
        let keys: Vec<String> = redis::Commands::keys(&mut node.conn(), "*").unwrap();
        let left: Vec<&String> = keys
            .iter()
            .filter(|k| k.contains("{cl}") || k.contains("{cl:p"))
            .collect();
        assert!(
            left.is_empty(),
            "keys of the deleted job on node {}: {left:?}",
            node.port
        );
    }
}

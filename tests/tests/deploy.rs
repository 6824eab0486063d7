//! Deployment artefacts checked with the real tools: Prometheus alert rules
//! (`promtool check rules` and their unit tests with `promtool test rules`).

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::process::Command;

use harness::helm;

fn promtool(args: &[&str]) -> (bool, String) {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(harness::workspace().join("deploy/prometheus"))
        .output()
        .expect("promtool must be installed (make test installs it)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn alert_rules_are_valid_and_their_unit_tests_pass() {
    let (ok, text) = promtool(&["check", "rules", "alerts.yml"]);
    assert!(ok, "{text}");
    assert!(text.contains("SUCCESS: 14 rules found"), "{text}");
    let (ok, text) = promtool(&["test", "rules", "alerts_test.yml"]);
    assert!(ok, "{text}");
}

const CHART: &str = "helm/batchfleet";
const PROD: &[&str] = &[
    "-f",
    "helm/batchfleet/values-production.yaml",
    "--set-file",
    "spec=examples/job.toml",
];

#[test]
fn the_chart_lints_renders_and_validates_against_kubernetes_1_30() {
    let (ok, text) = helm(&["lint", "--strict", CHART]);
    assert!(ok, "{text}");
    let (ok, text) = helm(&[&["lint", "--strict", CHART][..], PROD].concat());
    assert!(ok, "{text}");
    let files: Vec<&str> = [PROD, &["--set", "sinkFiles.claimName=results"]].concat();
    for (name, extra) in [("default", &[][..]), ("production", PROD), ("files sink", &files[..])] {
        let (ok, rendered) = helm(&[&["template", "bf", CHART][..], extra].concat());
        assert!(ok, "{name}: {rendered}");
        let dir = harness::TempDir::new("chart");
        let file = dir.join("rendered.yaml");
        std::fs::write(&file, &rendered).unwrap();
        let out = Command::new("python3")
            .args(["-m", "kubernetes_validate", "--strict", "-k", "1.30.0"])
            .arg(&file)
            .output()
            .expect("kubernetes-validate must be installed (make test installs it)");
        let report = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{name}: {report}");
        assert!(!report.contains("ERROR"), "{name}: {report}");
        // Unique consumer names from the pod name; probes on both endpoints;
        // non-root, read-only root filesystem; secrets only by reference.
        for must in [
            "fieldPath: metadata.name",
            "path: /healthz",
            "path: /readyz",
            "runAsNonRoot: true",
            "readOnlyRootFilesystem: true",
            "secretKeyRef:",
            "kind: PodDisruptionBudget",
            "kind: ServiceMonitor",
        ] {
            assert!(rendered.contains(must), "{name}: rendered chart lacks {must}");
        }
    }
    // The files sink's volume beside the Redis CA's, at the spec's sink.dir.
    let (_, with_files) = helm(&[&["template", "bf", CHART][..], &files].concat());
    assert!(
        with_files.contains("claimName: results")
            && with_files.contains("mountPath: /var/lib/batchfleet/results")
            && with_files.contains("secretName: redis-ca"),
        "{with_files}"
    );
    let (_, default) = helm(&["template", "bf", CHART]);
    assert!(default.contains("kind: ScaledObject") && default.contains("type: redis-streams"));
    assert_eq!(
        default.matches("type: redis-streams").count(),
        8,
        "two triggers per partition: its lag and its pending entries"
    );
    assert_eq!(default.matches("lagCount: \"100\"").count(), 4);
    assert_eq!(
        default.matches("pendingEntriesCount: \"8\"").count(),
        4,
        "in flight per worker and partition: concurrency 32 over 4 partitions"
    );
    assert!(default.contains("minReplicaCount: 0"));
    // The work left (queued + in flight + delayed) from the always-on scaler.
    assert_eq!(default.matches("type: metrics-api").count(), 1);
    assert!(default.contains("url: \"http://bf-batchfleet-scaler.default.svc:9465/remaining\""));
    assert!(default.contains("valueLocation: remaining"));
    assert!(default.contains("command: [\"/usr/local/bin/scaler\"]") && default.contains("name: bf-batchfleet-scaler"));
    let (_, prod) = helm(&[&["template", "bf", CHART][..], PROD].concat());
    assert!(prod.contains("kind: HorizontalPodAutoscaler") && !prod.contains("kind: ScaledObject"));
    assert!(
        prod.contains("name: batchfleet_remaining_work") && prod.contains("command: [\"/usr/local/bin/scaler\"]"),
        "the HPA scales on the scaler's work left"
    );
    assert!(prod.contains("kind: Job") && prod.contains("kind: ConfigMap"));
    // The console (off by default): its Deployment and Service, the
    // reviewers' tokens and the workers' Secrets by reference.
    assert!(!default.contains("bf-batchfleet-console"));
    assert!(
        prod.contains("name: bf-batchfleet-console")
            && prod.contains("command: [\"/usr/local/bin/producer\", \"console\", \"--bind\", \"0.0.0.0:8080\"]")
            && prod.contains("name: BATCHFLEET_CONSOLE_TOKENS")
            && prod.contains("name: console-reviewers"),
        "{prod}"
    );
    let (ok, text) = helm(&["template", "bf", CHART, "--set", "console.enabled=true"]);
    assert!(!ok && text.contains("console.tokensSecret.name"), "{text}");
    let (ok, text) = helm(&[
        "template",
        "bf",
        CHART,
        "--set",
        "console.enabled=true",
        "--set",
        "console.trustedHeader=X-Forwarded-User",
    ]);
    assert!(
        ok && text.contains("args: [\"--trusted-header\", \"X-Forwarded-User\"]"),
        "{text}"
    );
    assert!(
        prod.contains("- --max-backlog\n            - \"100000\""),
        "the producer Job bounds the job's backlog in Redis"
    );
    assert!(
        prod.contains("rediss://$(REDIS_USERNAME):$(REDIS_PASSWORD)@"),
        "the ACL user and its password come from the Secret at run time"
    );
    assert!(prod.contains("BATCHFLEET_REDIS_CA_CERT") && prod.contains("secretName: redis-ca"));
    assert!(
        prod.contains("name: BATCHFLEET_BASE_URL") && prod.contains("value: \"https://api.openai.com/v1\""),
        "production pins the provider endpoint"
    );

    // A cluster: every seed in the URL, KEDA's cluster scaler on the same nodes.
    let (ok, cluster) = helm(&[
        "template",
        "bf",
        CHART,
        "--set",
        "redis.clusterNodes={r0:6379,r1:6379,r2:6379}",
        "--set",
        "redis.passwordSecret.name=redis-auth",
    ]);
    assert!(ok, "{cluster}");
    assert!(
        cluster.contains(
            "redis://:$(REDIS_PASSWORD)@r0:6379,redis://:$(REDIS_PASSWORD)@r1:6379,redis://:$(REDIS_PASSWORD)@r2:6379"
        ),
        "{cluster}"
    );
    assert_eq!(cluster.matches("type: redis-cluster-streams").count(), 8);
    assert!(cluster.contains("addresses: \"r0:6379,r1:6379,r2:6379\""));
    let (ok, text) = helm(&["template", "bf", CHART, "--set", "redis.clusterNodes={redis://r0:6379}"]);
    assert!(!ok, "a seed must be host:port: {text}");
}

#[test]
fn the_chart_refuses_a_drain_shorter_than_a_call_a_grace_period_shorter_than_the_drain_and_secrets_in_values() {
    let (ok, text) = helm(&[
        "template",
        "bf",
        CHART,
        "--set",
        "worker.terminationGracePeriodSeconds=20",
    ]);
    assert!(
        !ok && text.contains("must be larger than worker.drainTimeoutSeconds"),
        "{text}"
    );
    // The drain covers every job's provider timeout (given per job, or in the spec).
    let (ok, text) = helm(&["template", "bf", CHART, "--set", "worker.drainTimeoutSeconds=30"]);
    assert!(
        !ok && text.contains("must be at least job demo's provider timeout (60 s"),
        "{text}"
    );
    let (ok, text) = helm(&[
        "template",
        "bf",
        CHART,
        "--set",
        "jobs[0].name=demo",
        "--set",
        "jobs[0].partitions=4",
        "--set",
        "jobs[0].providerTimeoutSeconds=600",
        "--set",
        "worker.drainTimeoutSeconds=600",
        "--set",
        "worker.terminationGracePeriodSeconds=630",
    ]);
    assert!(!ok && text.contains("(600 s"), "{text}");
    let dir = harness::TempDir::new("slow-spec");
    let slow = dir.join("job.toml");
    let spec = std::fs::read_to_string(harness::workspace().join("examples/job.toml")).unwrap();
    assert!(spec.contains("timeout_secs = 30"));
    std::fs::write(&slow, spec.replace("timeout_secs = 30", "timeout_secs = 300")).unwrap();
    let spec_arg = format!("spec={}", slow.display());
    let (ok, text) = helm(&["template", "bf", CHART, "--set-file", &spec_arg]);
    assert!(
        !ok && text.contains("the spec's provider.timeout_secs (300) + 5"),
        "{text}"
    );
    let (ok, text) = helm(&[
        "template",
        "bf",
        CHART,
        "--set-file",
        &spec_arg,
        "--set",
        "worker.drainTimeoutSeconds=305",
        "--set",
        "worker.terminationGracePeriodSeconds=320",
    ]);
    assert!(ok, "{text}");
    let (ok, text) = helm(&["template", "bf", CHART, "--set", "redis.password=hunter2"]);
    assert!(!ok && text.contains("password"), "{text}");
    let (ok, text) = helm(&["template", "bf", CHART, "--set", "autoscaling.hpa.enabled=true"]);
    assert!(!ok && text.contains("exclusive"), "{text}");
}

//! Deployment artefacts checked with the real tools: Prometheus alert rules
//! (`promtool check rules` and their unit tests with `promtool test rules`).

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::process::Command;

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
    assert!(text.contains("SUCCESS: 7 rules found"), "{text}");
    let (ok, text) = promtool(&["test", "rules", "alerts_test.yml"]);
    assert!(ok, "{text}");
}

//! What the make targets install: `make demo` only what the demo runs
//! (Redis, and PostgreSQL for its sink), `make test` everything the tests
//! start besides (Prometheus's promtool, openssl, the OTLP receiver,
//! Chromium and its WebDriver, Helm's tools).

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::collections::BTreeSet;
use std::process::Command;

use harness::{TempDir, workspace};

/// What `scripts/ensure-deps.sh SET` finds missing on a machine with no
/// tool at all (an empty PATH), without installing anything.
fn missing(set: &str) -> BTreeSet<String> {
    let empty = TempDir::new("no-tools");
    let out = Command::new("/bin/bash")
        .arg(workspace().join("scripts/ensure-deps.sh"))
        .arg(set)
        .env("PATH", empty.path())
        .env("ENSURE_DEPS_DRY_RUN", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let line = text.lines().find_map(|l| l.strip_prefix("missing: ")).unwrap_or("");
    line.split_whitespace().map(str::to_owned).collect()
}

#[test]
fn make_demo_installs_only_what_the_demo_runs() {
    let demo = missing("demo");
    let allowed: BTreeSet<String> = ["redis-server", "redis-tools", "postgresql", "postgresql-client"]
        .map(str::to_owned)
        .into();
    assert!(demo.contains("redis-server"), "Redis is found missing: {demo:?}");
    assert!(demo.is_subset(&allowed), "the demo installs only {allowed:?}: {demo:?}");
    let test = missing("test");
    for tool in [
        "prometheus",
        "openssl",
        "rotel",
        "chromium",
        "chromium-driver",
        "redis-server",
    ] {
        assert!(test.contains(tool), "the tests need {tool}: {test:?}");
    }

    // The demo's recipe asks for the demo's set, and not for Helm's tools.
    let out = Command::new("make")
        .args(["-n", "demo"])
        .current_dir(workspace())
        .output()
        .unwrap();
    let recipe = String::from_utf8_lossy(&out.stdout);
    assert!(recipe.contains("scripts/ensure-deps.sh demo"), "{recipe}");
    assert!(!recipe.contains("ensure-chart-tools"), "{recipe}");
    let out = Command::new("make")
        .args(["-n", "test"])
        .current_dir(workspace())
        .output()
        .unwrap();
    let recipe = String::from_utf8_lossy(&out.stdout);
    assert!(
        recipe.contains("scripts/ensure-deps.sh test") && recipe.contains("ensure-chart-tools"),
        "{recipe}"
    );
}

#[test]
fn an_unknown_set_is_refused_with_the_two_that_exist() {
    let out = Command::new("/bin/bash")
        .arg(workspace().join("scripts/ensure-deps.sh"))
        .arg("everything")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("unknown set `everything`") && err.contains("scripts/ensure-deps.sh demo"),
        "{err}"
    );
}

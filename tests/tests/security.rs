//! Redis security and secrets: TLS with a CA the test makes, the ACL user's
//! permissions checked at start, recognisable secrets searched for in
//! everything batchfleet produces, and a provider that tries to send the key
//! elsewhere.
//!
//! Every other test already runs as the restricted `batchfleet` ACL user of
//! `deploy/redis/users.acl` (the harness gives its URL to every process).

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::keys;
use harness::otlp::OtlpReceiver;
use harness::{
    LlmSim, RedisServer, Running, TEST_REDIS_PASSWORD, TempDir, bin, enqueue, example_spec, free_port, http_get,
    stderr, stdout, wait_for, worker_cmd, write_records,
};
use redis::Commands;

/// Runs openssl in `dir`, failing the test with its output when it fails.
fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl");
    assert!(out.status.success(), "openssl {args:?}: {}", stderr(&out));
}

/// Makes a self-signed CA `<name>.pem` / `<name>.key` in `dir`.
fn make_ca(dir: &Path, name: &str) -> PathBuf {
    let (key, pem) = (format!("{name}.key"), format!("{name}.pem"));
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &pem,
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
        ],
    );
    dir.join(pem)
}

/// A server certificate for 127.0.0.1 signed by the CA `ca`: (cert, key).
fn sign_server_cert(dir: &Path, ca: &str) -> (PathBuf, PathBuf) {
    std::fs::write(dir.join("ext.cnf"), "subjectAltName=IP:127.0.0.1,DNS:localhost\n").unwrap();
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=127.0.0.1",
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-out",
            "server.pem",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
        ],
    );
    (dir.join("server.pem"), dir.join("server.key"))
}

#[test]
fn tls_with_the_right_ca_runs_a_job_and_a_wrong_ca_fails_clearly() {
    let certs = TempDir::new("tls-certs");
    let ca = make_ca(certs.path(), "test-ca");
    let other_ca = make_ca(certs.path(), "other-ca");
    let (cert, key) = sign_server_cert(certs.path(), "test-ca");
    let tls_port = free_port();
    let _redis = RedisServer::start_with(&[
        "--save",
        "",
        "--tls-port",
        &tls_port.to_string(),
        "--tls-cert-file",
        cert.to_str().unwrap(),
        "--tls-key-file",
        key.to_str().unwrap(),
        "--tls-ca-cert-file",
        ca.to_str().unwrap(),
        "--tls-auth-clients",
        "no",
    ]);
    let url = format!("rediss://batchfleet:{TEST_REDIS_PASSWORD}@127.0.0.1:{tls_port}");
    let sim = LlmSim::start(&[]);
    let dir = TempDir::new("tls");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 30);
    let producer = |ca: Option<&Path>, args: &[&str]| {
        let mut c = Command::new(bin("producer"));
        c.args(args).args(["--redis", &url]).env_remove("REDIS_URL");
        match ca {
            Some(p) => c.env("BATCHFLEET_REDIS_CA_CERT", p),
            None => c.env_remove("BATCHFLEET_REDIS_CA_CERT"),
        };
        c.output().unwrap()
    };
    let spec = example_spec();
    let enqueue_args = [
        "enqueue",
        data.to_str().unwrap(),
        "--job",
        "tls",
        "--spec",
        spec.to_str().unwrap(),
    ];
    let out = producer(Some(&ca), &[&enqueue_args[..], &["--no-progress"]].concat());
    assert!(out.status.success(), "enqueue over TLS: {}", stderr(&out));

    let mut worker = harness::worker_cmd_url(&url, "tls", &sim, &["--drain"]);
    worker.env("BATCHFLEET_REDIS_CA_CERT", &ca);
    let (exit, log) = Running::spawn(worker).finish(Duration::from_secs(60));
    assert!(exit.success(), "worker over TLS: {log}");
    let out = producer(Some(&ca), &["status", "--job", "tls", "--json", "--require-complete"]);
    assert!(
        out.status.success(),
        "status over TLS: {}{}",
        stdout(&out),
        stderr(&out)
    );
    let status: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(status["done"], 30);

    // A CA that did not sign the server's certificate, or none (system roots): refused, and said so.
    for ca in [Some(other_ca.as_path()), None] {
        let out = producer(ca, &["status", "--job", "tls"]);
        assert!(!out.status.success());
        let err = stderr(&out);
        assert!(
            err.contains("TLS: the server's certificate is not trusted") && err.contains("BATCHFLEET_REDIS_CA_CERT"),
            "unclear TLS error: {err}"
        );
        assert!(!err.contains(TEST_REDIS_PASSWORD), "the password leaked: {err}");
    }
    // A CA file that is not there names the variable and the path.
    let out = producer(Some(Path::new("/nonexistent/ca.pem")), &["status", "--job", "tls"]);
    assert!(
        stderr(&out).contains("BATCHFLEET_REDIS_CA_CERT=/nonexistent/ca.pem"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_user_without_the_permissions_fails_at_start_naming_them() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    let dir = TempDir::new("acl");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 5);
    enqueue(&redis, &data, "acl", &example_spec());
    let line = std::fs::read_to_string(harness::workspace().join("deploy/redis/users.acl")).unwrap();
    let rules: Vec<&str> = line
        .split_whitespace()
        .skip(2) // "user batchfleet"
        .filter(|r| !r.starts_with('>') && !matches!(*r, "+xclaim" | "+evalsha" | "+eval" | "+script|load"))
        .collect();
    let mut admin = redis.conn();
    let mut setuser = redis::cmd("ACL");
    setuser.arg("SETUSER").arg("weak").arg(">weak-SECRET-pw").arg(&rules);
    let _: () = setuser.query(&mut admin).unwrap();
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("elsewhere")
        .arg(">weak-SECRET-pw")
        .arg(
            line.split_whitespace()
                .skip(2)
                .filter(|r| !r.starts_with('>') && !r.starts_with('~'))
                .collect::<Vec<_>>(),
        )
        .arg("~other:*")
        .query(&mut admin)
        .unwrap();
    let weak = format!("redis://weak:weak-SECRET-pw@127.0.0.1:{}", redis.port);
    let elsewhere = format!("redis://elsewhere:weak-SECRET-pw@127.0.0.1:{}", redis.port);

    let cmd = harness::worker_cmd_url(&weak, "acl", &sim, &["--drain"]);
    let (exit, log) = Running::spawn(cmd).finish(Duration::from_secs(30));
    assert!(!exit.success(), "a worker started without the permissions it needs");
    for missing in ["+xclaim", "+evalsha", "+eval", "+script|load", "deploy/redis/users.acl"] {
        assert!(log.contains(missing), "the error does not name {missing}: {log}");
    }
    assert!(!log.contains("+hset"), "named a permission the user has: {log}");
    assert!(!log.contains("weak-SECRET-pw"), "the password leaked: {log}");

    let out = Command::new(bin("producer"))
        .args(["status", "--job", "acl", "--redis", &elsewhere])
        .env_remove("REDIS_URL")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(stderr(&out).contains("keys ~bf:*"), "{}", stderr(&out));
    assert!(!stderr(&out).contains("weak-SECRET-pw"));

    // Nothing was consumed by the refused worker.
    let pending: usize = (0..4)
        .map(|p| {
            let r: redis::streams::StreamPendingReply = admin.xpending(keys::stream("acl", p), keys::GROUP).unwrap();
            r.count()
        })
        .sum();
    assert_eq!(pending, 0);

    // Upgrading (docs/deployment.md): a user from before `+zmscore` joined
    // the line is refused, the permission named; the commands the docs give
    // let the worker start.
    let acl = |args: &[&str]| -> redis::Value { redis::cmd("ACL").arg(args).query(&mut redis.conn()).unwrap() };
    acl(&["SETUSER", "batchfleet", "-zmscore"]);
    let (exit, log) =
        Running::spawn(harness::worker_cmd(&redis, "acl", &sim, &["--drain"])).finish(Duration::from_secs(30));
    assert!(!exit.success(), "a worker started without +zmscore");
    assert!(log.contains("+zmscore"), "the error does not name +zmscore: {log}");
    acl(&["SETUSER", "batchfleet", "+zmscore"]);
    acl(&["SAVE"]);
    let (exit, log) =
        Running::spawn(harness::worker_cmd(&redis, "acl", &sim, &["--drain"])).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    assert_eq!(redis.hlen_sum("acl", keys::results), 5, "the job done once granted");
}

#[test]
fn secrets_never_appear_in_logs_metrics_traces_reviews_exports_or_errors() {
    const API_KEY: &str = "sk-SECRET-api-key-4b1d";
    const WRONG_KEY: &str = "sk-SECRET-wrong-key-9d2e";
    let secrets = [API_KEY, WRONG_KEY, TEST_REDIS_PASSWORD];
    let otlp = OtlpReceiver::start();
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[
        "--api-key",
        API_KEY,
        "--latency-ms",
        "20",
        "--faults",
        "content_filter=0.2,bad_enum=0.2,server_error=0.1",
        "--seed",
        "9",
    ]);
    let dir = TempDir::new("secrets");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 40);
    // Short timeouts: the halted worker's tasks are taken over soon after.
    let spec = harness::spec_with(&dir, &[("timeout_secs = 30", "timeout_secs = 2")]);
    let vis = ["--visibility-timeout-ms", "3000"];
    let mut produced: Vec<(String, String)> = vec![];
    let out = harness::enqueue_cmd(&redis, &data, "sec", &spec)
        .args(["--no-progress"])
        .env("RUST_LOG", "trace")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp.http_endpoint)
        .output()
        .unwrap();
    assert!(out.status.success());
    produced.push(("enqueue output".into(), stdout(&out) + &stderr(&out)));

    // A wrong key first: the provider quotes it back in its 401; the fleet halts.
    let mut wrong = worker_cmd(&redis, "sec", &sim, &[&["--drain"][..], &vis].concat());
    wrong.env("OPENAI_API_KEY", WRONG_KEY).env("RUST_LOG", "trace");
    let (exit, log) = Running::spawn(wrong).finish(Duration::from_secs(30));
    assert_eq!(exit.code(), Some(3), "a refused key halts: {log}");
    produced.push(("worker log (wrong key, trace level)".into(), log));
    let _: () = redis.conn().del(keys::halt("sec")).unwrap();

    let addr = format!("127.0.0.1:{}", free_port());
    let mut right = worker_cmd(&redis, "sec", &sim, &[&["--metrics-addr", &addr][..], &vis].concat());
    right
        .env("OPENAI_API_KEY", API_KEY)
        .env("RUST_LOG", "trace")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp.http_endpoint);
    let worker = Running::spawn(right);
    let url = format!("http://{addr}");
    wait_for("the job settled", Duration::from_secs(60), || {
        harness::status_json(&redis, "sec").0 == Some(0)
    });
    produced.push(("/metrics".into(), http_get(&url, "/metrics").1));
    produced.push(("/readyz".into(), http_get(&url, "/readyz").1));
    harness::signal(worker.pid(), "TERM");
    let (exit, log) = worker.finish(Duration::from_secs(30));
    assert!(exit.success(), "{log}");
    produced.push(("worker log (trace level)".into(), log));

    let run = |args: &[&str]| {
        let out = harness::producer(&[args, &["--redis", &redis.url()]].concat());
        (format!("producer {}", args.join(" ")), stdout(&out) + &stderr(&out))
    };
    produced.push(run(&["status", "--job", "sec", "--json", "--ids"]));
    produced.push(run(&["report", "--job", "sec"]));
    produced.push(run(&["review", "--job", "sec", "list"]));
    for what in ["done", "review", "dropped"] {
        let file = dir.join(&format!("{what}.jsonl"));
        let (name, text) = run(&[
            "export",
            "--job",
            "sec",
            "--what",
            what,
            "--out",
            file.to_str().unwrap(),
        ]);
        produced.push((name, text + &std::fs::read_to_string(&file).unwrap_or_default()));
    }
    let review: Vec<String> = (0..4)
        .flat_map(|p| redis.conn().hvals::<_, Vec<String>>(keys::review("sec", p)).unwrap())
        .collect();
    assert!(!review.is_empty(), "the fault mix sent nothing to review");
    let first = serde_json::from_str::<serde_json::Value>(&review[0]).unwrap()["record_id"]
        .as_str()
        .unwrap()
        .to_owned();
    produced.push(run(&["review", "--job", "sec", "show", &first]));
    produced.push(("review entries".into(), review.join("\n")));
    // Error messages that quote the URL: a server that is not there, a wrong password.
    let dead = format!("redis://batchfleet:{TEST_REDIS_PASSWORD}@127.0.0.1:{}", free_port());
    let out = harness::producer(&["status", "--job", "sec", "--redis", &dead]);
    assert!(!out.status.success());
    produced.push(("unreachable Redis error".into(), stderr(&out)));
    let wrong_pw = format!("redis://batchfleet:{WRONG_KEY}@127.0.0.1:{}", redis.port);
    let out = harness::producer(&["status", "--job", "sec", "--redis", &wrong_pw]);
    assert!(!out.status.success());
    produced.push(("wrong Redis password error".into(), stderr(&out)));
    // Traces, and everything stored in Redis.
    wait_for("spans exported", Duration::from_secs(20), || !otlp.spans().is_empty());
    produced.push(("traces".into(), format!("{:?}", otlp.spans())));
    produced.push(("redis contents".into(), dump_redis(&redis)));

    for (what, text) in &produced {
        assert!(!text.is_empty() || what == "/readyz", "{what}: nothing captured");
        for s in secrets {
            assert!(!text.contains(s), "{what} contains the secret {s}:\n{text}");
        }
    }
    // The 401 really quoted the key back (else the wrong-key part proves nothing).
    assert!(sim.stats()["by_status"]["401"].as_u64().unwrap_or(0) > 0);
}

#[test]
fn a_provider_that_echoes_the_key_leaves_it_nowhere() {
    const API_KEY: &str = "sk-ECHOED-api-key-77c1";
    let redis = RedisServer::start();
    let sim = LlmSim::start(&["--api-key", API_KEY, "--echo-auth"]);
    let dir = TempDir::new("echo");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 12);
    // With a files sink: the responses' bytes are kept there too.
    let sink_dir = dir.join("sink");
    let sink = format!(
        "[sink]\nkind = \"files\"\ndir = \"{}\"\nsegment_secs = 1\n\n[retry]",
        sink_dir.display()
    );
    let spec = harness::spec_with(
        &dir,
        &[
            ("max_attempts = 4", "max_attempts = 2"),
            ("base_delay_ms = 500", "base_delay_ms = 20"),
            ("[retry]", &sink),
        ],
    );
    enqueue(&redis, &data, "echo", &spec);
    let mut w = worker_cmd(&redis, "echo", &sim, &["--drain"]);
    w.env("OPENAI_API_KEY", API_KEY).env("RUST_LOG", "trace");
    let (exit, log) = Running::spawn(w).finish(Duration::from_secs(60));
    assert!(exit.success(), "{log}");
    let (_, s) = harness::status_json(&redis, "echo");
    assert!(
        s["done"].as_u64().unwrap() > 0 && s["review"].as_u64().unwrap() > 0,
        "both paths ran: {s}"
    );
    let mut seen = vec![
        ("worker log".to_owned(), log),
        ("redis contents".into(), dump_redis(&redis)),
    ];
    for what in ["done", "review"] {
        let out = harness::producer(&[
            "export",
            "--job",
            "echo",
            "--what",
            what,
            "--out",
            "-",
            "--redis",
            &redis.url(),
        ]);
        seen.push((format!("export {what}"), stdout(&out)));
    }
    let out = harness::producer(&[
        "review",
        "--job",
        "echo",
        "--redis",
        &redis.url(),
        "export",
        "--out",
        "-",
    ]);
    seen.push(("review export".into(), stdout(&out)));
    let mut kept = String::new();
    for bucket in std::fs::read_dir(sink_dir.join("echo").join("raw")).unwrap() {
        for blob in std::fs::read_dir(bucket.unwrap().path()).unwrap() {
            kept.push_str(&std::fs::read_to_string(blob.unwrap().path()).unwrap());
        }
    }
    assert!(
        kept.contains("Authorization: Bearer ***"),
        "the audit trail kept the echoes: {kept}"
    );
    seen.push(("the audit trail's raw responses".into(), kept));
    for (what, text) in &seen {
        assert!(!text.contains(API_KEY), "{what} holds the key:\n{text}");
    }
    // The echo really came back, with the key scrubbed out of it.
    let done = &seen[2].1;
    assert!(done.contains("Authorization: Bearer ***"), "{done}");
    assert!(seen[4].1.contains("Authorization: Bearer ***"), "{}", seen[4].1);
}

#[test]
fn a_redis_password_is_hidden_in_every_form_the_client_accepts() {
    let port = free_port();
    for (url, secret) in [
        (
            format!("redis://batchfleet:pa55,word-c0mma@127.0.0.1:{port}"),
            "pa55,word-c0mma",
        ),
        (format!("redis://batchfleet:p@ss,w@rd-r4w@127.0.0.1:{port}"), "w@rd-r4w"),
        (
            format!("redis://127.0.0.1:{port}/?password=hunter2-qu3ry"),
            "hunter2-qu3ry",
        ),
        (
            format!(
                "redis://bf:s3cr3t-se3d@127.0.0.1:{port},redis://bf:s3cr3t-se3d@127.0.0.1:{}",
                free_port()
            ),
            "s3cr3t-se3d",
        ),
    ] {
        let out = harness::producer(&["status", "--job", "x", "--redis", &url]);
        assert!(!out.status.success());
        let text = stdout(&out) + &stderr(&out);
        assert!(!text.contains(secret), "{url} -> {text}");
        assert!(text.contains("127.0.0.1"), "the message still names the server: {text}");
    }
}

#[test]
fn a_key_that_cannot_be_sent_is_refused_at_start_without_showing_it() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    let dir = TempDir::new("badkey");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 3);
    enqueue(&redis, &data, "bk", &example_spec());
    let key = "sk-newline-at-end-5e1a";
    let mut w = worker_cmd(&redis, "bk", &sim, &["--drain"]);
    w.env("OPENAI_API_KEY", format!("{key}\n"));
    let (exit, log) = Running::spawn(w).finish(Duration::from_secs(30));
    assert_eq!(exit.code(), Some(2), "{log}");
    assert!(log.contains("OPENAI_API_KEY holds a line break at its end"), "{log}");
    assert!(!log.contains(key), "{log}");
    assert_eq!(sim.stats()["requests"], 0, "nothing was sent");
    let (_, s) = harness::status_json(&redis, "bk");
    assert_eq!(s["queued"], 3, "every record stays queued: {s}");
}

/// `INFO errorstats` lines, read on a connection that skips `CLIENT SETINFO`
/// (which Redis before 7.2 answers with an error).
fn error_stats(redis: &RedisServer) -> Vec<String> {
    use redis::IntoConnectionInfo;
    let info = redis.admin_url().into_connection_info().unwrap();
    let settings = info.redis_settings().clone().set_skip_set_lib_name();
    let mut admin = redis::Client::open(info.set_redis_settings(settings))
        .unwrap()
        .get_connection()
        .unwrap();
    let text: String = redis::cmd("INFO").arg("errorstats").query(&mut admin).unwrap();
    text.lines()
        .filter(|l| l.starts_with("errorstat_"))
        .map(str::to_owned)
        .collect()
}

#[test]
fn starting_leaves_nothing_in_the_servers_error_statistics() {
    let redis = RedisServer::start();
    let before = error_stats(&redis);
    let sim = LlmSim::start(&[]);
    let dir = TempDir::new("errstats");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 5);
    enqueue(&redis, &data, "es", &example_spec());
    let (exit, log) = Running::spawn(worker_cmd(&redis, "es", &sim, &["--drain"])).finish(Duration::from_secs(30));
    assert!(exit.success(), "{log}");
    // With JSON logs, every line is JSON, the summary included.
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        assert!(
            serde_json::from_str::<serde_json::Value>(line).is_ok(),
            "not JSON: {line}"
        );
    }
    assert_eq!(harness::worker_summary(&log).unwrap()["outcomes"]["commit"], 5, "{log}");
    let out = harness::producer(&["status", "--job", "es", "--redis", &redis.url()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        error_stats(&redis),
        before,
        "the permission probe or the run left errors"
    );
    let mut probes: Vec<String> = redis.conn().keys("bf:{probe}*").unwrap();
    probes.sort();
    assert!(probes.is_empty(), "probe keys left behind: {probes:?}");
}

/// Every key and value in the server, as text.
fn dump_redis(redis: &RedisServer) -> String {
    let mut c = redis.conn();
    let keys: Vec<String> = c.keys("*").unwrap();
    let mut out = String::new();
    for k in keys {
        let t: String = redis::cmd("TYPE").arg(&k).query(&mut c).unwrap();
        let v = match t.as_str() {
            "string" => c.get::<_, String>(&k).unwrap_or_default(),
            "hash" => format!("{:?}", c.hgetall::<_, Vec<(String, String)>>(&k).unwrap()),
            "set" => format!("{:?}", c.smembers::<_, Vec<String>>(&k).unwrap()),
            "zset" => format!("{:?}", c.zrange::<_, Vec<String>>(&k, 0, -1).unwrap()),
            "stream" => format!(
                "{:?}",
                c.xrange_all::<_, redis::streams::StreamRangeReply>(&k).unwrap().ids
            ),
            _ => String::new(),
        };
        out.push_str(&format!("{k} {v}\n"));
    }
    out
}

#[test]
fn a_provider_redirect_is_never_followed_with_the_key() {
    let redis = RedisServer::start();
    // The host the redirect points at: it must never see a request.
    let elsewhere = LlmSim::start(&[]);
    let target = format!("{}/v1/chat/completions", elsewhere.addr);
    let sim = LlmSim::start(&["--redirect-to", &target]);
    let dir = TempDir::new("redirect");
    let data = dir.join("d.jsonl");
    write_records(&data, 0, 5);
    enqueue(&redis, &data, "rd", &example_spec());
    let (exit, log) = Running::spawn(worker_cmd(&redis, "rd", &sim, &["--drain"])).finish(Duration::from_secs(30));
    assert_eq!(exit.code(), Some(3), "a redirect halts the fleet: {log}");
    assert!(log.contains("redirect_307_refused"), "{log}");
    assert!(sim.stats()["requests"].as_u64().unwrap() >= 1);
    assert_eq!(elsewhere.stats()["requests"], 0, "the worker followed the redirect");
}

#[test]
fn a_spec_cannot_point_the_worker_at_files() {
    let dir = TempDir::new("spec-file");
    let spec = harness::spec_with(
        &dir,
        &[(
            "base_url = \"http://127.0.0.1:8089/v1\"",
            "base_url = \"file:///etc/passwd\"",
        )],
    );
    let out = harness::producer(&["spec", "check", spec.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("provider.base_url"), "{}", stderr(&out));
}

#[test]
fn the_docs_give_the_exact_acl_line_the_tests_run_with() {
    let line = std::fs::read_to_string(harness::workspace().join("deploy/redis/users.acl")).unwrap();
    let doc = std::fs::read_to_string(harness::workspace().join("docs/deployment.md")).unwrap();
    assert_eq!(line.lines().count(), 1, "users.acl is one ACL line");
    assert!(
        doc.contains(line.trim()),
        "docs/deployment.md's ACL line differs from deploy/redis/users.acl"
    );
}

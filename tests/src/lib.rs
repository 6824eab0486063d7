//! Test harness: a real `redis-server` on a free port, paths to the built
//! binaries, temporary folders and datasets.
//!
//! Every server the harness starts binds to 127.0.0.1, is owned by the test
//! (a child process, killed by pid when dropped), and keeps nothing on disk
//! outside its temporary folder.

pub mod otlp;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A temporary folder removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static N: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "batchfleet-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create temp dir");
        TempDir(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free port")
}

/// The password of the `batchfleet` ACL user every test server has.
pub const TEST_REDIS_PASSWORD: &str = "bf-test-SECRET-redis-pw";

/// A `redis-server` child process on 127.0.0.1 and a free port.
///
/// The server has the ACL user `batchfleet` of `deploy/redis/users.acl` (the
/// line the README documents), and [`RedisServer::url`] logs in as that user:
/// every test runs the producer and the workers with exactly those permissions.
/// Test assertions use the unrestricted default user ([`RedisServer::conn`]).
pub struct RedisServer {
    child: Child,
    pub port: u16,
    args: Vec<String>,
    dir: TempDir,
}

impl RedisServer {
    /// Starts a throwaway server (no persistence) and waits until it answers.
    pub fn start() -> RedisServer {
        Self::start_with(&["--save", "", "--appendonly", "no"])
    }

    /// Starts a server with extra configuration arguments.
    pub fn start_with(extra: &[&str]) -> RedisServer {
        for _ in 0..5 {
            let dir = TempDir::new("redis");
            let port = free_port();
            let acl = std::fs::read_to_string(workspace().join("deploy/redis/users.acl"))
                .expect("read deploy/redis/users.acl")
                .replace(">CHANGE-ME", &format!(">{TEST_REDIS_PASSWORD}"));
            std::fs::write(dir.join("users.acl"), acl).expect("write users.acl");
            let mut args: Vec<String> = vec!["--aclfile".into(), dir.join("users.acl").display().to_string()];
            args.extend(extra.iter().map(|a| (*a).to_owned()));
            let child = spawn_redis(port, &dir, &args);
            let mut server = RedisServer { child, port, args, dir };
            if server.wait_ready(Duration::from_secs(10)) {
                return server;
            }
            // Lost a race for the port: try another.
            drop(server);
        }
        panic!("redis-server did not start");
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// kill -9, then a new server on the same port, folder and configuration
    /// (with `appendonly yes` it replays its AOF). Returns when it answers.
    pub fn kill9_and_restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for _ in 0..50 {
            self.child = spawn_redis(self.port, &self.dir, &self.args);
            if self.wait_ready(Duration::from_secs(30)) {
                return;
            }
            // The port may still be held for a moment: try again.
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("redis-server did not come back on port {}", self.port);
    }

    fn wait_ready(&mut self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            if let Ok(mut c) = redis::Client::open(self.admin_url()).and_then(|c| c.get_connection())
                && redis::cmd("PING").query::<String>(&mut c).is_ok()
            {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// The URL batchfleet's processes get: the `batchfleet` ACL user.
    pub fn url(&self) -> String {
        format!("redis://batchfleet:{TEST_REDIS_PASSWORD}@127.0.0.1:{}", self.port)
    }

    /// The unrestricted default user, for set-up and assertions.
    pub fn admin_url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A synchronous connection (default user) for assertions.
    pub fn conn(&self) -> redis::Connection {
        redis::Client::open(self.admin_url())
            .and_then(|c| c.get_connection())
            .expect("connect to test redis")
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A local Redis Cluster of three masters (no replicas), each a
/// [`RedisServer`] with `cluster-enabled yes`, AOF on, and the same ACL user.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        let nodes: Vec<RedisServer> = (0..3)
            .map(|_| {
                RedisServer::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                    "--save",
                    "",
                    "--appendonly",
                    "yes",
                    "--appendfsync",
                    "always",
                ])
            })
            .collect();
        let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("redis-cli must be installed (the Makefile installs it)");
        assert!(out.status.success(), "cluster create: {}{}", stdout(&out), stderr(&out));
        let cluster = RedisCluster { nodes };
        cluster.wait_ok();
        cluster
    }

    /// Waits until every node says `cluster_state:ok`.
    pub fn wait_ok(&self) {
        wait_for("cluster_state:ok on every node", Duration::from_secs(60), || {
            self.nodes.iter().all(|n| {
                redis::Client::open(n.admin_url())
                    .and_then(|c| c.get_connection())
                    .and_then(|mut c| redis::cmd("CLUSTER").arg("INFO").query::<String>(&mut c))
                    .is_ok_and(|info| info.contains("cluster_state:ok"))
            })
        });
    }

    /// The seed list batchfleet is given: every node, as the ACL user.
    pub fn url(&self) -> String {
        self.nodes.iter().map(RedisServer::url).collect::<Vec<_>>().join(",")
    }

    /// The node that holds `key` (by asking each whether the key's slot is its own).
    pub fn node_of(&self, key: &str) -> usize {
        let mut c = self.nodes[0].conn();
        let slot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(&mut c)
            .expect("keyslot");
        let shards: Vec<(u16, u16, Vec<redis::Value>)> = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query::<Vec<redis::Value>>(&mut c)
            .expect("cluster slots")
            .into_iter()
            .map(|v| {
                redis::from_redis_value::<(u16, u16, Vec<redis::Value>)>(v.clone()).unwrap_or_else(|_| {
                    let parts: Vec<redis::Value> = redis::from_redis_value(v).expect("slot range");
                    let start = redis::from_redis_value(parts[0].clone()).expect("start");
                    let end = redis::from_redis_value(parts[1].clone()).expect("end");
                    let node = redis::from_redis_value(parts[2].clone()).expect("node");
                    (start, end, node)
                })
            })
            .collect();
        let (_, _, node) = shards
            .into_iter()
            .find(|(a, b, _)| (*a..=*b).contains(&slot))
            .expect("a node for the slot");
        let port: u16 = redis::from_redis_value(node[1].clone()).expect("node port");
        self.nodes.iter().position(|n| n.port == port).expect("a known node")
    }
}

fn spawn_redis(port: u16, dir: &TempDir, extra: &[String]) -> Child {
    Command::new(redis_server_binary())
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--dir"])
        .arg(dir.path())
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server must be installed (the Makefile installs it)")
}

fn redis_server_binary() -> String {
    std::env::var("REDIS_SERVER_BIN").unwrap_or_else(|_| "redis-server".to_owned())
}

/// The workspace root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

/// Path of a binary built by `cargo build` next to the running test
/// (`target/<profile>/<name>`). The Makefile builds all binaries first.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    // target/<profile>/deps/<test>-<hash> -> target/<profile>/<name>
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is not built: run `cargo build --workspace --bins` (make test does)",
        path.display()
    );
    path
}

/// The example job spec.
pub fn example_spec() -> PathBuf {
    workspace().join("examples/job.toml")
}

/// Runs `producer` with arguments and returns its output.
pub fn producer(args: &[&str]) -> Output {
    Command::new(bin("producer"))
        .args(args)
        .env_remove("REDIS_URL")
        .output()
        .expect("run producer")
}

/// stdout as text.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// stderr as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
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

/// An `llm-sim` child process on 127.0.0.1 and a free port.
pub struct LlmSim {
    child: Child,
    /// `http://127.0.0.1:PORT`
    pub addr: String,
}

impl LlmSim {
    /// Starts llm-sim with extra flags and waits for its address line.
    pub fn start(args: &[&str]) -> LlmSim {
        use std::io::BufRead;
        let mut child = Command::new(bin("llm-sim"))
            .args(["--port", "0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start llm-sim");
        let stdout = child.stdout.take().expect("llm-sim stdout");
        let mut line = String::new();
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .expect("llm-sim address line");
        let addr = line
            .trim()
            .strip_prefix("llm-sim listening on ")
            .unwrap_or_else(|| panic!("unexpected llm-sim output: {line}"))
            .to_owned();
        LlmSim { child, addr }
    }

    /// The base URL a worker uses (`.../v1`).
    pub fn base_url(&self) -> String {
        format!("{}/v1", self.addr)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `GET /stats` -> the `stats` object.
    pub fn stats(&self) -> serde_json::Value {
        http_get_json(&self.addr, "/stats")["stats"].clone()
    }

    /// User messages of recent requests containing `needle`.
    pub fn log_containing(&self, needle: &str) -> Vec<serde_json::Value> {
        let q: String = needle
            .bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() {
                    (b as char).to_string()
                } else {
                    format!("%{b:02X}")
                }
            })
            .collect();
        match http_get_json(&self.addr, &format!("/log?contains={q}")) {
            serde_json::Value::Array(a) => a,
            other => panic!("unexpected /log reply: {other}"),
        }
    }

    /// `POST /admin/limits`.
    pub fn set_limits(&self, body: &serde_json::Value) {
        http_request(&self.addr, "POST", "/admin/limits", Some(&body.to_string()));
    }
}

impl Drop for LlmSim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `GET` on a local HTTP server: (status code, body).
pub fn http_get(addr: &str, path: &str) -> (u16, String) {
    let raw = http_raw(addr, "GET", path, None);
    let status = raw.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (
        status,
        raw.split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default(),
    )
}

/// A minimal HTTP/1.0 client for the simulator's own endpoints: the body.
fn http_request(addr: &str, method: &str, path: &str, body: Option<&str>) -> String {
    let out = http_raw(addr, method, path, body);
    out.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default()
}

/// The whole HTTP/1.0 response, headers included (no extra crates).
fn http_raw(addr: &str, method: &str, path: &str, body: Option<&str>) -> String {
    use std::io::{Read, Write};
    let host = addr.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(host).expect("connect llm-sim");
    let body = body.unwrap_or("");
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("write request");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read response");
    out
}

pub fn http_get_json(addr: &str, path: &str) -> serde_json::Value {
    let body = http_request(addr, "GET", path, None);
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("bad JSON from llm-sim {path}: {e}: {body}"))
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

/// A `worker` command for one job against a test Redis and simulator.
pub fn worker_cmd(redis: &RedisServer, job: &str, sim: &LlmSim, extra: &[&str]) -> Command {
    worker_cmd_url(&redis.url(), job, sim, extra)
}

/// [`worker_cmd`] for any Redis URL (a TLS server, a cluster's seed list).
pub fn worker_cmd_url(redis_url: &str, job: &str, sim: &LlmSim, extra: &[&str]) -> Command {
    let mut c = Command::new(bin("worker"));
    c.args([
        "--redis",
        redis_url,
        "--job",
        job,
        "--base-url",
        &sim.base_url(),
        "--log-format",
        "json",
    ])
    .args(["--idle-poll-ms", "20"])
    // Each worker on its own free port, unless the test picks one.
    .args(if extra.contains(&"--metrics-addr") {
        &[][..]
    } else {
        &["--metrics-addr", "127.0.0.1:0"][..]
    })
    .args(extra)
    .env("OPENAI_API_KEY", "sk-test-key")
    .env_remove("REDIS_URL")
    .env_remove("BATCHFLEET_BASE_URL")
    .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
    .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
    c
}

/// Sends a signal (`KILL`, `TERM`, `STOP`, `CONT`) to one process the test started, by pid.
pub fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .expect("run kill")
        .success();
    assert!(ok, "kill -{sig} {pid} failed");
}

/// Names of a running process's threads (from /proc).
pub fn thread_names(pid: u32) -> Vec<String> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return vec![];
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_owned())
        .collect()
}

/// Waits for a condition, panicking with `what` after `within`.
pub fn wait_for(what: &str, within: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for a child to exit, killing it (and failing) after `within`.
pub fn wait_exit(child: &mut Child, within: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("process {} did not exit within {within:?}", child.id());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A child whose stderr is read on a thread (so a chatty process never blocks
/// on a full pipe), with a deadline for its exit.
pub struct Running {
    pub child: Child,
    stderr: Option<std::thread::JoinHandle<String>>,
}

impl Running {
    /// Spawns `cmd` with stdout discarded and stderr captured.
    pub fn spawn(mut cmd: Command) -> Running {
        use std::io::Read;
        let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("spawn");
        let mut pipe = child.stderr.take().expect("stderr");
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = pipe.read_to_string(&mut s);
            s
        });
        Running {
            child,
            stderr: Some(stderr),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the exit (killing the process and failing after `within`),
    /// and returns its status and stderr.
    pub fn finish(mut self, within: Duration) -> (std::process::ExitStatus, String) {
        let status = wait_exit(&mut self.child, within);
        let err = self
            .stderr
            .take()
            .map(|h| h.join().unwrap_or_default())
            .unwrap_or_default();
        (status, err)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `producer enqueue DATASET --job JOB --spec SPEC --redis URL` as a command,
/// for tests that watch or kill it.
pub fn enqueue_cmd(redis: &RedisServer, dataset: &Path, job: &str, spec: &Path) -> Command {
    enqueue_cmd_url(&redis.url(), dataset, job, spec)
}

/// [`enqueue_cmd`] for any Redis URL.
pub fn enqueue_cmd_url(redis_url: &str, dataset: &Path, job: &str, spec: &Path) -> Command {
    let mut c = Command::new(bin("producer"));
    c.arg("enqueue")
        .arg(dataset)
        .args(["--job", job, "--spec"])
        .arg(spec)
        .args(["--redis", redis_url])
        .env_remove("REDIS_URL")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
    c
}

/// Enqueues a dataset quietly and asserts it worked.
pub fn enqueue(redis: &RedisServer, dataset: &Path, job: &str, spec: &Path) {
    let out = enqueue_cmd(redis, dataset, job, spec)
        .arg("--no-progress")
        .output()
        .expect("run producer");
    assert!(out.status.success(), "enqueue failed: {}", stderr(&out));
}

/// `producer status --json --ids --require-complete` of a job: (exit code, status).
pub fn status_json(redis: &RedisServer, job: &str) -> (Option<i32>, serde_json::Value) {
    status_json_url(&redis.url(), job)
}

/// [`status_json`] for any Redis URL.
pub fn status_json_url(redis_url: &str, job: &str) -> (Option<i32>, serde_json::Value) {
    let out = producer(&[
        "status",
        "--job",
        job,
        "--redis",
        redis_url,
        "--json",
        "--ids",
        "--require-complete",
    ]);
    let status =
        serde_json::from_str(&stdout(&out)).unwrap_or_else(|e| panic!("status is not JSON ({e}): {}", stdout(&out)));
    (out.status.code(), status)
}

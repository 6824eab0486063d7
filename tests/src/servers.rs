//! The servers a test starts and owns: `redis-server` (alone or as a
//! cluster) and `llm-sim`, each a child process on 127.0.0.1 and a free port.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use reqwest::Method;

use crate::client::{http_get_json, http_post_as, http_request};
use crate::paths::{TempDir, bin, workspace};
use crate::process::{stderr, stdout, wait_for};

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
/// line docs/deployment.md documents), and [`RedisServer::url`] logs in as that user:
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
        self.kill9_and_restart_after(Duration::ZERO);
    }

    /// [`RedisServer::kill9_and_restart`], staying down for `down` first (an outage).
    pub fn kill9_and_restart_after(&mut self, down: Duration) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::thread::sleep(down);
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

    /// (owner, idle ms, deliveries) of the entry `id` pending in `stream`
    /// (group [`common::keys::GROUP`]), None when it is not pending.
    pub fn pending_entry(&self, stream: &str, id: &str) -> Option<(String, u64, u64)> {
        let rows: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
            .arg(stream)
            .arg(common::keys::GROUP)
            .arg(id)
            .arg(id)
            .arg(1)
            .query(&mut self.conn())
            .expect("XPENDING");
        rows.into_iter().next().map(|(_, owner, idle, n)| (owner, idle, n))
    }

    /// How many times the server has run `command` (lower case, e.g.
    /// `evalsha`, `xinfo|groups`) so far, script-inner calls included.
    pub fn calls_of(&self, command: &str) -> u64 {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut self.conn())
            .expect("INFO commandstats");
        info.lines()
            .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
            .and_then(|v| v.split(',').next()?.parse().ok())
            .unwrap_or(0)
    }

    /// HLEN of one of a job's partition hashes (`key`, e.g. `keys::results`),
    /// summed over its 4 partitions (the example spec's).
    pub fn hlen_sum(&self, job: &str, key: fn(&str, u32) -> String) -> u64 {
        let mut c = self.conn();
        (0..4)
            .map(|p| redis::cmd("HLEN").arg(key(job, p)).query::<u64>(&mut c).expect("HLEN"))
            .sum()
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

/// An `llm-sim` child process on 127.0.0.1 and a free port.
pub struct LlmSim {
    child: Child,
    /// `http://127.0.0.1:PORT`
    pub addr: String,
    /// The flags it was started with (a restart uses them again).
    args: Vec<String>,
}

impl LlmSim {
    /// Starts llm-sim with extra flags and waits for its address line.
    pub fn start(args: &[&str]) -> LlmSim {
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        let (child, addr) = Self::spawn(0, &args);
        LlmSim { child, addr, args }
    }

    fn spawn(port: u16, args: &[String]) -> (Child, String) {
        use std::io::BufRead;
        let mut child = Command::new(bin("llm-sim"))
            .args(["--port", &port.to_string()])
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
        (child, addr)
    }

    /// Kills this llm-sim (by its pid): its port refuses connections until
    /// [`LlmSim::restart`].
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts it again on the same port with the same flags (a provider
    /// back from an outage; its counters start from zero).
    pub fn restart(&mut self) {
        let port: u16 = self
            .addr
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("llm-sim's port");
        let (child, addr) = Self::spawn(port, &self.args);
        assert_eq!(addr, self.addr, "restarted on the same address");
        self.child = child;
    }

    /// `POST /admin/outage`: starts an outage in `mode` (for `secs`, or
    /// until told), or (None) ends the one under way.
    pub fn outage(&self, mode: Option<&str>, secs: Option<f64>) {
        let body = serde_json::json!({ "mode": mode, "secs": secs });
        http_request(&self.addr, Method::POST, "/admin/outage", Some(body.to_string()));
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

    /// A chat request of our own, sent with this `Content-Type` (None: no
    /// such header) and the key `sk-test-key`: (status code, body).
    pub fn chat_as(&self, body: &str, content_type: Option<&str>) -> (u16, String) {
        http_post_as(
            &self.addr,
            "/v1/chat/completions",
            body,
            content_type,
            &[("authorization", "Bearer sk-test-key")],
        )
    }

    /// `POST /admin/limits`.
    pub fn set_limits(&self, body: &serde_json::Value) {
        http_request(&self.addr, Method::POST, "/admin/limits", Some(body.to_string()));
    }

    /// `POST /admin/script`: the next calls for `record` meet `faults` in
    /// order (`ok`: a clean answer), then draw as usual.
    pub fn script(&self, record: &str, faults: &[&str]) {
        let body = serde_json::json!({ "record": record, "faults": faults });
        let (status, text) = http_request(&self.addr, Method::POST, "/admin/script", Some(body.to_string()));
        assert_eq!(status, 204, "llm-sim refused the script for {record}: {text}");
    }

    /// `POST /admin/faults`: the `--faults` mix from now on (a model that drifts).
    pub fn set_faults(&self, mix: &str) {
        let body = serde_json::json!({ "faults": mix });
        let (status, text) = http_request(&self.addr, Method::POST, "/admin/faults", Some(body.to_string()));
        assert_eq!(status, 204, "llm-sim refused the faults {mix}: {text}");
    }

    /// Makes every chat request fail with `STATUS:CODE:MESSAGE`, or (None) stops it.
    pub fn fail_all(&self, spec: Option<&str>) {
        let body = serde_json::json!({ "fail": spec });
        http_request(&self.addr, Method::POST, "/admin/fail", Some(body.to_string()));
    }
}

impl Drop for LlmSim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The password of the `bf` role every test PostgreSQL server has.
pub const TEST_PG_PASSWORD: &str = "bf-test-SECRET-pg-pw";

/// A throwaway PostgreSQL server (`initdb` into a temp dir, `pg_ctl start`)
/// on 127.0.0.1 and a free port, password authentication for the role `bf`.
/// Run as the `postgres` user when the tests run as root (PostgreSQL
/// refuses root). Stopped by its postmaster's pid on drop.
pub struct PgServer {
    dir: TempDir,
    port: u16,
    bin: std::path::PathBuf,
}

impl PgServer {
    pub fn start() -> PgServer {
        let dir = TempDir::new("pg");
        let bin = pg_bin_dir();
        let pwfile = dir.join("pw");
        std::fs::write(&pwfile, TEST_PG_PASSWORD).expect("write pwfile");
        as_pg_owner(&dir);
        let out = pg_command(&bin.join("initdb"))
            .arg("-D")
            .arg(dir.join("data"))
            .args(["-U", "bf", "-A", "scram-sha-256", "--no-sync", "--pwfile"])
            .arg(&pwfile)
            .output()
            .expect("run initdb");
        assert!(out.status.success(), "initdb: {}", stderr(&out));
        let mut pg = PgServer {
            dir,
            port: free_port(),
            bin,
        };
        // A free port can be taken by another test's server before this one
        // binds it: a new port then, a few times.
        for _ in 0..3 {
            if pg.try_start().is_ok() {
                return pg;
            }
            pg.port = free_port();
        }
        pg.start_again();
        pg
    }

    /// Starts the server on its port (after kill9 too: crash recovery).
    pub fn start_again(&mut self) {
        if let Err(why) = self.try_start() {
            panic!("pg_ctl start: {why}");
        }
    }

    fn try_start(&mut self) -> Result<(), String> {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port,
            self.dir.path().display()
        );
        let out = pg_command(&self.bin.join("pg_ctl"))
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-o", &options, "-l"])
            .arg(self.dir.join("log"))
            .args(["-w", "start"])
            .output()
            .expect("run pg_ctl");
        if out.status.success() {
            return Ok(());
        }
        Err(format!(
            "{}{}",
            stdout(&out),
            std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
        ))
    }

    /// `postgres://bf:PASSWORD@127.0.0.1:PORT/postgres` (no TLS).
    pub fn url(&self) -> String {
        format!(
            "postgres://bf:{TEST_PG_PASSWORD}@127.0.0.1:{}/postgres?sslmode=disable",
            self.port
        )
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The postmaster's pid (first line of `postmaster.pid`).
    pub fn pid(&self) -> Option<u32> {
        std::fs::read_to_string(self.dir.join("data/postmaster.pid"))
            .ok()?
            .lines()
            .next()?
            .trim()
            .parse()
            .ok()
    }

    /// kill -9 of the postmaster (its backends exit with it), then a start
    /// after `down`: crash recovery from the write-ahead log.
    pub fn kill9_and_restart_after(&mut self, down: Duration) {
        self.kill9();
        std::thread::sleep(down);
        self.start_again();
    }

    /// kill -9 of the postmaster; it stays down.
    pub fn kill9(&mut self) {
        if let Some(pid) = self.pid() {
            // The postmaster and its backends, by pid: the whole server dies at once.
            let mut pids = vec![pid.to_string()];
            pids.extend(children_of(pid));
            let _ = Command::new("kill").arg("-9").args(&pids).status();
            wait_for("postgres to die", Duration::from_secs(10), || {
                std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() && pids.iter().all(|p| !alive(p))
            });
            // A dead postmaster not yet reaped (a zombie) still answers
            // kill(pid, 0): its lock file would stop the next start. Every
            // process of the server is gone, so the lock guards nothing.
            let _ = std::fs::remove_file(self.dir.join("data/postmaster.pid"));
            let socket = self.dir.join(&format!(".s.PGSQL.{}", self.port));
            let _ = std::fs::remove_file(socket.with_extension(format!("{}.lock", self.port)));
            let _ = std::fs::remove_file(&socket);
        }
    }

    /// One SQL statement through `psql`; its rows, `|`-separated.
    pub fn query(&self, sql: &str) -> String {
        let out = Command::new("psql")
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "bf",
                "-d",
                "postgres",
            ])
            .args(["-At", "-v", "ON_ERROR_STOP=1", "-c", sql])
            .env("PGPASSWORD", TEST_PG_PASSWORD)
            .output()
            .expect("run psql");
        assert!(out.status.success(), "psql {sql}: {}", stderr(&out));
        stdout(&out).trim().to_owned()
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
    }
}

/// Where PostgreSQL's server binaries are: on PATH, or Debian's folder.
fn pg_bin_dir() -> std::path::PathBuf {
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .find(|d| d.join("initdb").exists() && d.join("pg_ctl").exists());
    if let Some(d) = on_path {
        return d;
    }
    let mut found: Vec<std::path::PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin"))
        .filter(|b| b.join("initdb").exists())
        .collect();
    found.sort();
    found
        .pop()
        .expect("PostgreSQL's server binaries (initdb, pg_ctl) are not installed: `make test` installs them")
}

/// The pids whose parent is `pid` (from /proc: no tool needed).
fn children_of(pid: u32) -> Vec<String> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{name}/stat")).ok()?;
            // `pid (comm) state ppid ...`: the fields after the last `)`.
            let ppid: u32 = stat.rsplit_once(") ")?.1.split_whitespace().nth(1)?.parse().ok()?;
            (ppid == pid).then_some(name)
        })
        .collect()
}

/// Whether a process is running (a zombie waiting to be reaped is not).
fn alive(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| !rest.starts_with('Z')))
        .unwrap_or(false)
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// A PostgreSQL command, as the `postgres` user when we are root.
fn pg_command(program: &std::path::Path) -> Command {
    if running_as_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

/// Hands a folder to the `postgres` user when we are root.
fn as_pg_owner(dir: &TempDir) {
    if running_as_root() {
        let ok = Command::new("chown")
            .args(["-R", "postgres"])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "chown postgres {}", dir.path().display());
    }
}

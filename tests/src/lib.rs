//! Test harness: a real `redis-server` on a free port, paths to the built
//! binaries, temporary folders and datasets.
//!
//! Every server the harness starts binds to 127.0.0.1, is owned by the test
//! (a child process, killed by pid when dropped), and keeps nothing on disk
//! outside its temporary folder.

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

/// A `redis-server` child process on 127.0.0.1 and a free port.
pub struct RedisServer {
    child: Child,
    pub port: u16,
    _dir: TempDir,
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
            let child = Command::new(redis_server_binary())
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--dir"])
                .arg(dir.path())
                .args(extra)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server must be installed (the Makefile installs it)");
            let mut server = RedisServer { child, port, _dir: dir };
            if server.wait_ready(Duration::from_secs(10)) {
                return server;
            }
            // Lost a race for the port: try another.
            drop(server);
        }
        panic!("redis-server did not start");
    }

    fn wait_ready(&mut self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            if let Ok(mut c) = redis::Client::open(self.url()).and_then(|c| c.get_connection())
                && redis::cmd("PING").query::<String>(&mut c).is_ok()
            {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A synchronous connection for assertions.
    pub fn conn(&self) -> redis::Connection {
        redis::Client::open(self.url())
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

fn redis_server_binary() -> String {
    std::env::var("REDIS_SERVER_BIN").unwrap_or_else(|_| "redis-server".to_owned())
}

/// The workspace root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

/// Path of a binary built by `cargo build` next to the running test
/// (`target/<profile>/<name>`). The Makefile builds all binaries first.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    // target/<profile>/deps/<test>-<hash> -> target/<profile>/<name>
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let path = dir.join(name);
    assert!(path.exists(), "{} is not built: run `cargo build --workspace --bins` (make test does)", path.display());
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
        writeln!(f, "{}", record_line(&format!("msg-{i}"), &format!("message number {i}"))).expect("write dataset");
    }
    f.flush().expect("flush dataset");
}

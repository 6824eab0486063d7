//! Child processes: spawning with captured stderr, signals, waiting for a
//! condition or an exit, and reading a process's output and threads.

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// stdout as text.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// stderr as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
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
pub fn wait_for(what: &str, within: Duration, f: impl FnMut() -> bool) {
    assert!(wait_until(within, f), "timed out waiting for {what}");
}

/// Waits up to `within` for a condition; whether it came.
pub fn wait_until(within: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while !f() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
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

/// The summary a worker prints last: from its JSON log line
/// (`fields.summary`) or its text line (`worker summary: {...}`).
pub fn worker_summary(log: &str) -> Option<serde_json::Value> {
    log.lines().rev().find_map(|l| {
        if let Some(text) = l.strip_prefix("worker summary: ") {
            return serde_json::from_str(text).ok();
        }
        let v: serde_json::Value = serde_json::from_str(l).ok()?;
        (v["fields"]["message"] == "worker summary").then(|| v["fields"]["summary"].clone())
    })
}

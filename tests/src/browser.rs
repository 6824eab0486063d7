//! A real headless Chromium, driven over WebDriver (the W3C protocol, JSON
//! over HTTP) by a `chromedriver` child process on 127.0.0.1 and a free
//! port. A few verbs, enough for the console's tests: open a page, find by
//! CSS selector, click, type, press keys, run a script, take a screenshot.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{Value, json};

use crate::client::http_request;
use crate::paths::TempDir;
use crate::servers::free_port;

/// The key WebDriver names an element by.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A browser session; the browser and its driver stop when it is dropped.
pub struct Browser {
    driver: Child,
    addr: String,
    session: String,
    _profile: TempDir,
}

impl Browser {
    /// Starts chromedriver and a headless Chromium with a profile of its
    /// own (no background networking: this machine has no internet).
    pub fn start() -> Browser {
        let chromium =
            which("chromium").expect("chromium is not installed (make test installs it: apt-get install chromium)");
        let driver_bin = which("chromedriver")
            .expect("chromedriver is not installed (make test installs it: apt-get install chromium-driver)");
        let profile = TempDir::new("chromium");
        let port = free_port();
        let driver = Command::new(driver_bin)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let addr = format!("127.0.0.1:{port}");
        let mut b = Browser {
            driver,
            addr,
            session: String::new(),
            _profile: profile,
        };
        let started = Instant::now();
        while std::net::TcpStream::connect(&b.addr).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "chromedriver did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium,
                "args": ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                         "--disable-background-networking", "--disable-component-update", "--disable-sync",
                         "--disable-dev-shm-usage", "--window-size=1280,1000",
                         format!("--user-data-dir={}", b._profile.join("profile").display())]
            }
        }}});
        let v = b.call(Method::POST, "/session", Some(caps));
        b.session = v["sessionId"].as_str().expect("a session id").to_owned();
        b
    }

    fn raw(&self, method: Method, path: &str, body: Option<Value>) -> (u16, String) {
        http_request(&self.addr, method, path, body.map(|b| b.to_string()))
    }

    /// A WebDriver command; its `value`. Panics on a WebDriver error.
    fn call(&self, method: Method, path: &str, body: Option<Value>) -> Value {
        let (code, text) = self.raw(method.clone(), path, body);
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        assert!(code == 200, "WebDriver {method} {path}: {code} {text}");
        v["value"].clone()
    }

    fn session_path(&self, rest: &str) -> String {
        format!("/session/{}{rest}", self.session)
    }

    pub fn goto(&self, url: &str) {
        self.call(Method::POST, &self.session_path("/url"), Some(json!({ "url": url })));
    }

    pub fn url(&self) -> String {
        self.call(Method::GET, &self.session_path("/url"), None)
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// The page's HTML as the browser holds it now.
    pub fn source(&self) -> String {
        self.call(Method::GET, &self.session_path("/source"), None)
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// The first element matching a CSS selector, if any.
    pub fn find(&self, css: &str) -> Option<String> {
        let (code, text) = self.raw(
            Method::POST,
            &self.session_path("/element"),
            Some(json!({"using": "css selector", "value": css})),
        );
        if code != 200 {
            return None;
        }
        let v: Value = serde_json::from_str(&text).ok()?;
        v["value"][ELEMENT].as_str().map(str::to_owned)
    }

    fn element(&self, css: &str) -> String {
        self.find(css)
            .unwrap_or_else(|| panic!("no element `{css}` on {}:\n{}", self.url(), self.source()))
    }

    /// The rendered text of the first element matching `css` (found again
    /// while the page that held it is being replaced).
    pub fn text(&self, css: &str) -> String {
        for _ in 0..50 {
            if let Some(id) = self.find(css) {
                let (code, text) = self.raw(Method::GET, &self.session_path(&format!("/element/{id}/text")), None);
                if code == 200 {
                    let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
                    return v["value"].as_str().unwrap_or_default().to_owned();
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("no element `{css}` on {}:\n{}", self.url(), self.source())
    }

    pub fn click(&self, css: &str) {
        let id = self.element(css);
        self.call(
            Method::POST,
            &self.session_path(&format!("/element/{id}/click")),
            Some(json!({})),
        );
    }

    /// Replaces the text of an input or textarea.
    pub fn fill(&self, css: &str, text: &str) {
        let id = self.element(css);
        self.call(
            Method::POST,
            &self.session_path(&format!("/element/{id}/clear")),
            Some(json!({})),
        );
        self.call(
            Method::POST,
            &self.session_path(&format!("/element/{id}/value")),
            Some(json!({ "text": text })),
        );
    }

    /// Presses keys on the page, one after another, as a person would
    /// (`\u{E00C}` is Escape, `\u{E007}` Enter).
    pub fn press(&self, keys: &str) {
        let mut actions = Vec::new();
        for k in keys.chars() {
            actions.push(json!({"type": "keyDown", "value": k.to_string()}));
            actions.push(json!({"type": "keyUp", "value": k.to_string()}));
        }
        self.call(
            Method::POST,
            &self.session_path("/actions"),
            Some(json!({"actions": [{"type": "key", "id": "keyboard", "actions": actions}]})),
        );
    }

    /// Runs a script in the page; its return value.
    pub fn script(&self, js: &str) -> Value {
        self.call(
            Method::POST,
            &self.session_path("/execute/sync"),
            Some(json!({"script": js, "args": []})),
        )
    }

    /// Deletes the browser's cookies (signed out).
    pub fn clear_cookies(&self) {
        self.call(Method::DELETE, &self.session_path("/cookie"), None);
    }

    /// A PNG of the whole page (the window made as tall as the page first).
    pub fn screenshot(&self, path: &std::path::Path) {
        use base64_png::decode;
        let height = self
            .script("return Math.min(4000, document.documentElement.scrollHeight);")
            .as_u64()
            .unwrap_or(1000)
            .max(600);
        self.call(
            Method::POST,
            &self.session_path("/window/rect"),
            Some(json!({"width": 1280, "height": height + 140})),
        );
        let v = self.call(Method::GET, &self.session_path("/screenshot"), None);
        self.call(
            Method::POST,
            &self.session_path("/window/rect"),
            Some(json!({"width": 1280, "height": 1000})),
        );
        let png = decode(v.as_str().unwrap_or_default());
        std::fs::write(path, png).expect("write the screenshot");
    }

    /// Waits until `f` holds (checked every 100 ms) or panics after `timeout`.
    pub fn wait(&self, what: &str, timeout: Duration, mut f: impl FnMut(&Browser) -> bool) {
        let started = Instant::now();
        while !f(self) {
            assert!(
                started.elapsed() < timeout,
                "timed out waiting for {what} on {}:\n{}",
                self.url(),
                self.source()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.raw(Method::DELETE, &self.session_path(""), None)
            }));
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

fn which(name: &str) -> Option<String> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
            .map(|p| p.display().to_string())
    })
}

/// Base64 (standard alphabet) for the screenshots WebDriver sends.
mod base64_png {
    pub fn decode(text: &str) -> Vec<u8> {
        let value = |c: u8| -> Option<u32> {
            Some(match c {
                b'A'..=b'Z' => c - b'A',
                b'a'..=b'z' => c - b'a' + 26,
                b'0'..=b'9' => c - b'0' + 52,
                b'+' => 62,
                b'/' => 63,
                _ => return None,
            } as u32)
        };
        let mut out = Vec::with_capacity(text.len() * 3 / 4);
        let (mut acc, mut bits) = (0u32, 0u32);
        for v in text.bytes().filter_map(value) {
            acc = (acc << 6) | v;
            bits += 6;
            if bits >= 8 {
                bits -= 8;
                out.push((acc >> bits) as u8);
                acc &= (1 << bits) - 1;
            }
        }
        out
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn decodes_base64() {
            assert_eq!(super::decode("aGVsbG8gd29ybGQ="), b"hello world");
        }
    }
}

/// `producer console` as a child process on 127.0.0.1 and a free port, with
/// a tokens file of its own; stopped (by pid) when dropped.
pub struct ConsoleServer {
    process: crate::process::Running,
    pub addr: String,
    _dir: TempDir,
}

impl ConsoleServer {
    /// Serves the jobs of `redis_url` for these `(reviewer, token)` pairs,
    /// with extra arguments (`--trusted-header ...`).
    pub fn start(redis_url: &str, reviewers: &[(&str, &str)], extra: &[&str]) -> ConsoleServer {
        let dir = TempDir::new("console");
        let tokens = dir.join("tokens");
        let lines: String = reviewers.iter().map(|(n, t)| format!("{n}:{t}\n")).collect();
        std::fs::write(&tokens, lines).expect("write the tokens file");
        let port = free_port();
        let addr = format!("127.0.0.1:{port}");
        let mut cmd = Command::new(crate::paths::bin("producer"));
        cmd.args(["console", "--redis", redis_url, "--bind", &addr, "--tokens-file"])
            .arg(&tokens)
            .args(extra)
            .env_remove("BATCHFLEET_CONSOLE_TOKENS");
        let process = crate::process::Running::spawn(cmd);
        let started = Instant::now();
        while std::net::TcpStream::connect(&addr).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "the console did not start on {addr}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        ConsoleServer {
            process,
            addr,
            _dir: dir,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }
}

//! HTTP requests to the local servers a test started (llm-sim's own
//! endpoints, a worker's metrics endpoint, Prometheus): blocking, one fresh
//! connection per request, no redirects followed, no proxy, no timeout.

use std::sync::OnceLock;

use reqwest::Method;
use reqwest::blocking::Client;

/// `GET` on a local HTTP server: (status code, body).
pub fn http_get(addr: &str, path: &str) -> (u16, String) {
    http_request(addr, Method::GET, path, None)
}

/// `GET` of a JSON document from llm-sim.
pub fn http_get_json(addr: &str, path: &str) -> serde_json::Value {
    let (_, body) = http_request(addr, Method::GET, path, None);
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("bad JSON from llm-sim {path}: {e}: {body}"))
}

/// One request to `addr` (`HOST:PORT` or `http://HOST:PORT`), with an
/// optional JSON body: (status code, body). Panics when the server cannot be
/// reached or the answer cannot be read.
pub(crate) fn http_request(addr: &str, method: Method, path: &str, json_body: Option<String>) -> (u16, String) {
    let url = format!("http://{}{path}", addr.trim_start_matches("http://"));
    // A blocking reqwest client panics on a thread that runs an async
    // runtime: every request runs on a thread of its own, so a test may call
    // this from anywhere.
    let sent = std::thread::scope(|s| {
        s.spawn(|| send(method.clone(), &url, json_body))
            .join()
            .expect("the HTTP request thread panicked")
    });
    sent.unwrap_or_else(|e| panic!("{method} {url}: {}", error_chain(&e)))
}

fn send(method: Method, url: &str, json_body: Option<String>) -> reqwest::Result<(u16, String)> {
    let mut request = client().request(method, url);
    if let Some(body) = json_body {
        request = request.header("content-type", "application/json").body(body);
    }
    let response = request.send()?;
    let status = response.status().as_u16();
    Ok((status, response.text()?))
}

/// The one client of the harness: like the hand-written HTTP/1.0 client it
/// replaced, it opens a connection per request (no pool), follows no
/// redirect, ignores proxy settings and waits as long as the server takes.
fn client() -> &'static Client {
    static CLIENT: OnceLock<Client> = OnceLock::new();
    CLIENT.get_or_init(|| {
        Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .pool_max_idle_per_host(0)
            .timeout(None)
            .build()
            .expect("build the harness HTTP client")
    })
}

/// An error and its causes, `: `-separated (reqwest's own message names only the URL).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(&format!(": {c}"));
        cause = c.source();
    }
    text
}

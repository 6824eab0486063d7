//! HTTP requests to the local servers a test started (llm-sim's own
//! endpoints, a worker's metrics endpoint, Prometheus).

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
pub(crate) fn http_request(addr: &str, method: &str, path: &str, body: Option<&str>) -> String {
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

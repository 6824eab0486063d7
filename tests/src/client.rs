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
    request(
        addr,
        method,
        path,
        json_body.map(|b| (b, Some("application/json"))),
        &[],
    )
}

/// `POST` of `body` to `path` with this `Content-Type` (None: no such
/// header) and these other headers: (status code, body).
pub(crate) fn http_post_as(
    addr: &str,
    path: &str,
    body: &str,
    content_type: Option<&str>,
    headers: &[(&str, &str)],
) -> (u16, String) {
    request(addr, Method::POST, path, Some((body.to_owned(), content_type)), headers)
}

fn request(
    addr: &str,
    method: Method,
    path: &str,
    body: Option<(String, Option<&str>)>,
    headers: &[(&str, &str)],
) -> (u16, String) {
    let url = format!("http://{}{path}", addr.trim_start_matches("http://"));
    // A blocking reqwest client panics on a thread that runs an async
    // runtime: every request runs on a thread of its own, so a test may call
    // this from anywhere.
    let sent = std::thread::scope(|s| {
        s.spawn(|| send(method.clone(), &url, body, headers))
            .join()
            .expect("the HTTP request thread panicked")
    });
    sent.unwrap_or_else(|e| panic!("{method} {url}: {}", error_chain(&e)))
}

/// `body`: the body and its `Content-Type` (None: no such header).
fn send(
    method: Method,
    url: &str,
    body: Option<(String, Option<&str>)>,
    headers: &[(&str, &str)],
) -> reqwest::Result<(u16, String)> {
    let mut request = client().request(method, url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    if let Some((body, content_type)) = body {
        if let Some(content_type) = content_type {
            request = request.header("content-type", content_type);
        }
        request = request.body(body);
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

/// What a server answered: status, the headers a test looks at, body.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub location: Option<String>,
    pub set_cookie: Option<String>,
    pub body: String,
}

/// A request with headers of the test's choosing and an optional form body
/// (`application/x-www-form-urlencoded`): the server's [`Answer`].
pub fn http_send(addr: &str, method: Method, path: &str, headers: &[(&str, &str)], form: Option<&str>) -> Answer {
    let url = format!("http://{}{path}", addr.trim_start_matches("http://"));
    let sent = std::thread::scope(|s| {
        s.spawn(|| -> reqwest::Result<Answer> {
            let mut request = client().request(method.clone(), &url);
            for (k, v) in headers {
                request = request.header(*k, *v);
            }
            if let Some(body) = form {
                request = request
                    .header("content-type", "application/x-www-form-urlencoded")
                    .body(body.to_owned());
            }
            let response = request.send()?;
            let header = |name: &str| {
                response
                    .headers()
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned)
            };
            let (location, set_cookie) = (header("location"), header("set-cookie"));
            Ok(Answer {
                status: response.status().as_u16(),
                location,
                set_cookie,
                body: response.text()?,
            })
        })
        .join()
        .expect("the HTTP request thread panicked")
    });
    sent.unwrap_or_else(|e| panic!("{method} {url}: {}", error_chain(&e)))
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

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpListener;

    use super::*;

    /// A one-shot HTTP server: answers one connection with `response` and
    /// returns the request it read. It then stops listening, so a client that
    /// came back (a followed redirect) would fail to connect.
    fn answer_once(response: &'static str) -> (String, std::thread::JoinHandle<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("local addr").to_string();
        let server = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().expect("accept");
            let mut request = Vec::new();
            let mut buf = [0u8; 4096];
            loop {
                let n = stream.read(&mut buf).expect("read request");
                request.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&request).into_owned();
                if let Some((head, body)) = text.split_once("\r\n\r\n") {
                    let length = head
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length:")
                                .map(str::to_owned)
                        })
                        .map_or(0, |v| v.trim().parse::<usize>().expect("content-length"));
                    if body.len() >= length {
                        break;
                    }
                }
                assert!(n > 0, "request cut short: {text}");
            }
            stream.write_all(response.as_bytes()).expect("write response");
            String::from_utf8_lossy(&request).into_owned()
        });
        (addr, server)
    }

    #[test]
    fn a_get_returns_the_status_and_the_body() {
        let (addr, server) = answer_once("HTTP/1.1 503 Service Unavailable\r\ncontent-length: 5\r\n\r\nhalt!");
        assert_eq!(
            http_get(&format!("http://{addr}"), "/readyz?x=%20"),
            (503, "halt!".to_owned())
        );
        let request = server.join().expect("server");
        assert!(request.starts_with("GET /readyz?x=%20 HTTP/1.1\r\n"), "{request}");
    }

    #[test]
    fn a_redirect_is_returned_not_followed() {
        let (addr, server) =
            answer_once("HTTP/1.1 307 Temporary Redirect\r\nlocation: /elsewhere\r\ncontent-length: 0\r\n\r\n");
        assert_eq!(http_get(&addr, "/v1"), (307, String::new()));
        server.join().expect("server");
    }

    #[test]
    fn a_post_sends_its_json_body() {
        let (addr, server) = answer_once("HTTP/1.1 204 No Content\r\n\r\n");
        let body = serde_json::json!({"rpm": 1200}).to_string();
        assert_eq!(
            http_request(&addr, Method::POST, "/admin/limits", Some(body)),
            (204, String::new())
        );
        let request = server.join().expect("server").to_ascii_lowercase();
        assert!(request.starts_with("post /admin/limits http/1.1\r\n"), "{request}");
        assert!(request.contains("\r\ncontent-type: application/json\r\n"), "{request}");
        assert!(request.ends_with("\r\n\r\n{\"rpm\":1200}"), "{request}");
    }

    #[test]
    fn a_request_works_from_inside_an_async_runtime() {
        let (addr, server) = answer_once("HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\n{\"ok\":true}");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let got = runtime.block_on(async { http_get_json(&addr, "/stats") });
        assert_eq!(got, serde_json::json!({"ok": true}));
        server.join().expect("server");
    }
}

//! Who may use the console, and proof that a request is theirs.
//!
//! A reviewer signs in with a token of their own (from a file or an
//! environment variable, `name:token` per line) and gets a session cookie
//! (HttpOnly, SameSite=Strict); or, when the console is configured with a
//! trusted reverse-proxy header, the proxy's header names the reviewer. The
//! name is what every action records. Every state-changing request carries
//! a CSRF token bound to the reviewer and to this console process, and a
//! cross-site `Origin` is refused.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use sha2::{Digest, Sha256};

/// The cookie that holds a session id.
pub const COOKIE: &str = "bf_console";
/// How long a session lasts.
const SESSION_TTL: Duration = Duration::from_secs(12 * 3600);
/// The shortest token accepted (a guessable token is refused at start).
const MIN_TOKEN_LEN: usize = 16;

/// The reviewers and their tokens (kept as sha256 digests).
#[derive(Debug, Clone, Default)]
pub struct Reviewers {
    tokens: Vec<(String, [u8; 32])>,
}

impl Reviewers {
    /// Reads `name:token` lines (blank lines and `#` comments skipped);
    /// `origin` names the file or variable in errors, with the line number,
    /// never the token.
    pub fn parse(text: &str, origin: &str) -> Result<Reviewers, String> {
        let mut r = Reviewers::default();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let n = i + 1;
            let Some((name, token)) = line.split_once(':') else {
                return Err(format!("{origin} line {n}: expected `name:token`"));
            };
            let (name, token) = (name.trim(), token.trim());
            if !valid_name(name) {
                return Err(format!(
                    "{origin} line {n}: reviewer name `{name}`: use 1 to 64 of A-Z a-z 0-9 . _ @ -"
                ));
            }
            if token.len() < MIN_TOKEN_LEN {
                return Err(format!(
                    "{origin} line {n}: the token of `{name}` is shorter than {MIN_TOKEN_LEN} characters"
                ));
            }
            let digest = digest(token);
            if r.tokens.iter().any(|(_, d)| *d == digest) {
                return Err(format!(
                    "{origin} line {n}: the token of `{name}` is already someone else's"
                ));
            }
            r.tokens.push((name.to_owned(), digest));
        }
        Ok(r)
    }

    /// Adds the reviewers of another source.
    pub fn extend(&mut self, other: Reviewers) {
        self.tokens.extend(other.tokens);
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The reviewer a token belongs to (every digest compared in full, so
    /// the time taken says nothing of how close a guess was).
    pub fn who(&self, token: &str) -> Option<String> {
        let d = digest(token.trim());
        let mut found = None;
        for (name, known) in &self.tokens {
            let same = known.iter().zip(d.iter()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
            if same && found.is_none() {
                found = Some(name.clone());
            }
        }
        found
    }
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// A reviewer name as recorded with actions.
pub fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '@' | '-'))
}

/// Live sessions, and the secret CSRF tokens are made from.
pub struct Sessions {
    secret: [u8; 32],
    live: Mutex<HashMap<String, (String, Instant)>>,
}

impl Default for Sessions {
    fn default() -> Self {
        Sessions {
            secret: rand::random(),
            live: Mutex::new(HashMap::new()),
        }
    }
}

impl Sessions {
    /// A new session for `reviewer`: its id, for the cookie.
    pub fn open(&self, reviewer: &str) -> String {
        let id = hex::encode(rand::random::<[u8; 32]>());
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        live.retain(|_, (_, expires)| *expires > Instant::now());
        live.insert(id.clone(), (reviewer.to_owned(), Instant::now() + SESSION_TTL));
        id
    }

    pub fn close(&self, id: &str) {
        self.live.lock().unwrap_or_else(|e| e.into_inner()).remove(id);
    }

    /// The reviewer of a live session.
    pub fn reviewer(&self, id: &str) -> Option<String> {
        let live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        live.get(id)
            .filter(|(_, expires)| *expires > Instant::now())
            .map(|(who, _)| who.clone())
    }

    /// The CSRF token of a reviewer's forms (valid while this console runs).
    pub fn csrf(&self, reviewer: &str) -> String {
        let mut h = Sha256::new();
        h.update(self.secret);
        h.update(b"csrf:");
        h.update(reviewer.as_bytes());
        hex::encode(&h.finalize()[..16])
    }
}

/// The value of a cookie in a request.
pub fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|pair| {
            let (k, v) = pair.trim().split_once('=')?;
            (k == name).then(|| v.to_owned())
        })
}

/// Whether a state-changing request may come from this page: the CSRF
/// token is the reviewer's, and an `Origin` header, when the browser sends
/// one, names this console's host.
pub fn same_origin(headers: &HeaderMap) -> bool {
    let Some(origin) = headers.get(axum::http::header::ORIGIN).and_then(|v| v.to_str().ok()) else {
        return true;
    };
    let host = headers
        .get(axum::http::header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let origin_host = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"))
        .unwrap_or(origin);
    !host.is_empty() && origin_host == host
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_name_their_reviewer_and_bad_lines_are_named() {
        let r = Reviewers::parse(
            "# reviewers\nann: token-of-ann-0123456\n\nbob:token-of-bob-0123456\n",
            "tokens",
        )
        .unwrap();
        assert_eq!(r.who("token-of-ann-0123456").as_deref(), Some("ann"));
        assert_eq!(r.who("token-of-bob-0123456").as_deref(), Some("bob"));
        assert_eq!(r.who("token-of-bob-0123457"), None);
        assert_eq!(r.who(""), None);
        let e = Reviewers::parse("ann:short\n", "F").unwrap_err();
        assert!(e.contains("F line 1") && !e.contains("short\""), "{e}");
        let e = Reviewers::parse("ok:token-of-ann-0123456\nno colon here\n", "F").unwrap_err();
        assert!(e.starts_with("F line 2"), "{e}");
        let e = Reviewers::parse("<b>:token-of-ann-0123456\n", "F").unwrap_err();
        assert!(e.contains("reviewer name"), "{e}");
        let e = Reviewers::parse("a:token-of-ann-0123456\nb:token-of-ann-0123456\n", "F").unwrap_err();
        assert!(e.contains("line 2") && !e.contains("token-of-ann"), "{e}");
    }

    #[test]
    fn a_session_names_its_reviewer_until_closed_and_csrf_is_per_reviewer() {
        let s = Sessions::default();
        let id = s.open("ann");
        assert_eq!(s.reviewer(&id).as_deref(), Some("ann"));
        assert_eq!(s.reviewer("forged"), None);
        assert_ne!(s.csrf("ann"), s.csrf("bob"));
        assert_ne!(s.csrf("ann"), Sessions::default().csrf("ann"), "per console process");
        s.close(&id);
        assert_eq!(s.reviewer(&id), None);
        let mut h = HeaderMap::new();
        h.insert("cookie", "a=1; bf_console=abc; b=2".parse().unwrap());
        assert_eq!(cookie(&h, COOKIE).as_deref(), Some("abc"));
        h.insert("host", "127.0.0.1:8080".parse().unwrap());
        assert!(same_origin(&h));
        h.insert("origin", "http://127.0.0.1:8080".parse().unwrap());
        assert!(same_origin(&h));
        h.insert("origin", "http://evil.example".parse().unwrap());
        assert!(!same_origin(&h));
    }
}

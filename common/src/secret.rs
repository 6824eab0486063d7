//! Secrets never leave the process: Redis URLs are shown with their
//! passwords replaced by `***` (parsed with a real URL parser, every form the
//! client accepts), and a [`Scrubber`] removes the API keys and the Redis
//! password from anything a provider sends back before it is stored, logged
//! or printed. An API key that cannot be sent as an HTTP header is refused
//! at start, without printing it.

/// The schemes a `--redis` URL may have.
const SCHEMES: &[&str] = &["redis://", "rediss://", "redis+unix://", "unix://"];

/// The seed URLs of a `--redis` value: several URLs separated by commas. A
/// comma splits only where a URL starts after it, so a password may hold one.
pub fn split_seeds(url: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, _) in url.match_indices(',') {
        let rest = url[i + 1..].trim_start();
        if SCHEMES.iter().any(|s| rest.starts_with(s)) {
            out.push(url[start..i].trim());
            start = i + 1;
        }
    }
    out.push(url[start..].trim());
    out.retain(|s| !s.is_empty());
    out
}

/// The seed nodes of a cluster: `--redis` holds several URLs separated by commas.
pub fn cluster_seeds(url: &str) -> Option<Vec<&str>> {
    let seeds = split_seeds(url);
    (seeds.len() > 1).then_some(seeds)
}

/// The URL (or comma-separated seed URLs) with every password replaced by
/// `***`, for messages and logs.
pub fn redact_url(url: &str) -> String {
    split_seeds(url)
        .into_iter()
        .map(redact_one)
        .collect::<Vec<_>>()
        .join(",")
}

/// Query parameters that carry a credential (`api-key`, as Azure's take it, too).
fn is_secret_param(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    n.contains("pass") || n.contains("token") || n.contains("secret") || n.contains("key") || n == "auth"
}

/// The default Redis URL of every command.
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";

/// The `--redis` part of a command suggested to a person, so that it works
/// as typed: nothing for the default URL or the one `REDIS_URL` holds; the
/// URL itself when it holds no password; else `--redis "$REDIS_URL"` (a
/// password is never printed: the person sets the variable).
pub fn redis_flag(url: &str) -> String {
    let from_env = std::env::var("REDIS_URL").is_ok_and(|v| v == url);
    if from_env || (url == DEFAULT_REDIS_URL && std::env::var_os("REDIS_URL").is_none()) {
        String::new()
    } else if url_passwords(url).is_empty() && redact_url(url) == url {
        format!(" --redis {url}")
    } else {
        " --redis \"$REDIS_URL\"".to_owned()
    }
}

fn redact_one(url: &str) -> String {
    let scheme = SCHEMES.iter().find(|s| url.starts_with(*s)).copied();
    match url::Url::parse(url) {
        Ok(mut u) => {
            if u.password().is_some() {
                let _ = u.set_password(Some("***"));
            }
            let pairs: Vec<(String, String)> = u
                .query_pairs()
                .map(|(k, v)| {
                    let v = if is_secret_param(&k) {
                        "***".to_owned()
                    } else {
                        v.into_owned()
                    };
                    (k.into_owned(), v)
                })
                .collect();
            if pairs.is_empty() {
                u.set_query(None);
            } else {
                u.query_pairs_mut().clear().extend_pairs(pairs);
            }
            // A fragment is never part of a Redis address: it can only be a
            // piece of a password holding a raw `#`.
            u.set_fragment(None);
            u.to_string().replace("%2A%2A%2A", "***")
        }
        // Unparseable: show only what cannot be a secret.
        Err(_) => {
            let scheme = scheme.unwrap_or("");
            match url.rsplit_once('@') {
                Some((_, host)) if !host.contains(['/', '?', '#', ':']) || host_like(host) => {
                    format!("{scheme}***@{host}")
                }
                _ => format!("{scheme}*** (unparseable URL)"),
            }
        }
    }
}

/// `host[:port][/db]` with nothing else in it.
fn host_like(s: &str) -> bool {
    s.chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '/' | '[' | ']'))
}

/// The password of a Redis URL, if it has one (for the scrubber).
pub fn url_passwords(url: &str) -> Vec<String> {
    split_seeds(url)
        .into_iter()
        .filter_map(|u| url::Url::parse(u).ok())
        .flat_map(|u| {
            let mut found: Vec<String> = u
                .query_pairs()
                .filter(|(k, _)| is_secret_param(k))
                .map(|(_, v)| v.into_owned())
                .collect();
            if let Some(p) = u.password() {
                found.push(p.to_owned());
                if let Ok(decoded) = percent_decode(p) {
                    found.push(decoded);
                }
            }
            found
        })
        .filter(|p| !p.is_empty())
        .collect()
}

fn percent_decode(s: &str) -> Result<String, std::string::FromUtf8Error> {
    let mut out = Vec::with_capacity(s.len());
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && let Some(hex) = b.get(i + 1..i + 3)
            && let Ok(v) = u8::from_str_radix(std::str::from_utf8(hex).unwrap_or("zz"), 16)
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8(out)
}

/// Secrets shorter than this are not scrubbed from text (they would match
/// ordinary words); such keys are refused by [`check_api_key`] anyway.
pub const MIN_SCRUBBED_LEN: usize = 8;

/// Removes known secret values from text a provider sent back.
#[derive(Debug, Clone, Default)]
pub struct Scrubber {
    secrets: Vec<String>,
}

impl Scrubber {
    pub fn new(secrets: impl IntoIterator<Item = String>) -> Scrubber {
        let mut secrets: Vec<String> = secrets.into_iter().filter(|s| s.len() >= MIN_SCRUBBED_LEN).collect();
        // Longest first, so a secret that contains another is removed whole.
        secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
        secrets.dedup();
        Scrubber { secrets }
    }

    /// `text` with every secret replaced by `***`.
    pub fn scrub(&self, text: &str) -> String {
        let mut out = text.to_owned();
        for s in &self.secrets {
            if out.contains(s.as_str()) {
                out = out.replace(s.as_str(), "***");
            }
        }
        out
    }

    /// Whether `text` holds a secret.
    pub fn holds_secret(&self, text: &str) -> bool {
        self.secrets.iter().any(|s| text.contains(s.as_str()))
    }
}
/// Whether a URL's host is this machine (`localhost`, 127.0.0.0/8, `::1`).
pub fn is_loopback_url(url: &str) -> bool {
    let Some(rest) = url.split_once("://").map(|(_, r)| r) else {
        return false;
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host_port = authority.rsplit('@').next().unwrap_or_default();
    let host = match host_port.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => host_port.split(':').next().unwrap_or_default(),
    };
    host.eq_ignore_ascii_case("localhost") || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Why an API key cannot be used, in words that never show the key.
pub fn check_api_key(var: &str, key: &str) -> Result<(), String> {
    if key.is_empty() {
        return Err(format!("the environment variable {var} is empty"));
    }
    if let Some((i, c)) = key.char_indices().find(|(_, c)| !c.is_ascii_graphic()) {
        let what = match c {
            '\n' | '\r' => "a line break",
            ' ' | '\t' => "whitespace",
            c if c.is_control() => "a control character",
            _ => "a character outside printable ASCII",
        };
        let place = if i + c.len_utf8() == key.len() {
            "at its end".to_owned()
        } else if i == 0 {
            "at its start".to_owned()
        } else {
            format!("at byte {i}")
        };
        return Err(format!(
            "the API key in {var} holds {what} {place}: an HTTP header cannot carry it \
             (check how the variable was set, e.g. a file with a trailing newline)"
        ));
    }
    if key.len() < MIN_SCRUBBED_LEN {
        return Err(format!(
            "the API key in {var} is shorter than {MIN_SCRUBBED_LEN} characters: too short to be a real key"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_urls_are_this_machine_and_no_other() {
        for url in [
            "http://127.0.0.1:8080/v1",
            "http://localhost:11434/v1",
            "http://LOCALHOST/v1",
            "http://[::1]:8000/v1",
            "http://127.1.2.3/v1",
            "http://user:pw@127.0.0.1:8080/v1",
        ] {
            assert!(is_loopback_url(url), "{url}");
        }
        for url in [
            "https://api.openai.com/v1",
            "http://10.0.0.5:8000/v1",
            "http://127.0.0.1.example.com/v1",
            "http://localhost.example.com/v1",
            "http://evil@example.com/?u=127.0.0.1",
            "127.0.0.1:8080",
            "http://[::2]/v1",
        ] {
            assert!(!is_loopback_url(url), "{url}");
        }
    }

    /// Passwords that break hand-written parsing.
    const NASTY: &[&str] = &[
        "pa55,word-xyz",
        "p@ss,w@rd-xyz",
        "hunter2-xyz?x=1",
        "sl/ash-xyz",
        "h#sh-xyz",
        "c:olon-xyz",
        "per%25cent-xyz",
        "sp ace-xyz",
        "uni\u{e9}code-xyz",
        ",redis-xyz",
        "***-xyz",
    ];

    /// Percent-encoding of everything but unreserved characters.
    fn encode(pw: &str) -> String {
        pw.bytes()
            .map(|b| match b {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
                _ => format!("%{b:02X}"),
            })
            .collect()
    }

    fn forms(pw: &str) -> Vec<String> {
        let enc = encode(pw);
        vec![
            format!("redis://:{pw}@h:6379"),
            format!("redis://bf:{pw}@h:6379/0"),
            format!("rediss://bf:{enc}@h:6380"),
            format!("redis://h:6379/?password={enc}"),
            format!("redis://h:6379/?protocol=resp3&pass={enc}"),
            format!("redis://bf:{pw}@a:1,redis://bf:{pw}@b:2"),
            format!("redis://bf:{enc}@a:1, rediss://bf:{enc}@b:2"),
        ]
    }

    #[test]
    fn no_form_of_a_nasty_password_survives_redaction() {
        for pw in NASTY {
            let secret_part = pw.trim_end_matches("-xyz");
            let enc = encode(pw);
            for url in forms(pw) {
                let shown = redact_url(&url);
                for leaked in [*pw, enc.as_str()] {
                    assert!(!shown.contains(leaked), "{url} -> {shown}");
                }
                assert!(!shown.contains("xyz"), "{url} -> {shown} (part of {secret_part:?})");
            }
        }
    }

    #[test]
    fn hosts_users_and_plain_urls_stay_readable() {
        assert_eq!(redact_url("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(redact_url("redis://:pw-long@h:1"), "redis://:***@h:1");
        assert_eq!(redact_url("rediss://bf:p@w@h:1"), "rediss://bf:***@h:1");
        assert_eq!(
            redact_url("redis://bf:s1@a:1,redis://bf:s2@b:2"),
            "redis://bf:***@a:1,redis://bf:***@b:2"
        );
        assert_eq!(
            redact_url("redis://h:1/?password=x&db=2"),
            "redis://h:1/?password=***&db=2"
        );
    }

    #[test]
    fn seeds_split_only_where_a_url_starts() {
        assert_eq!(cluster_seeds("redis://a:1"), None);
        assert_eq!(cluster_seeds("redis://a:1,"), None);
        assert_eq!(cluster_seeds("redis://:pa55,word@a:1"), None, "a comma in a password");
        assert_eq!(
            cluster_seeds("redis://a:1, redis://b:2"),
            Some(vec!["redis://a:1", "redis://b:2"])
        );
        assert_eq!(
            cluster_seeds("redis://:x,y@a:1,rediss://:x,y@b:2"),
            Some(vec!["redis://:x,y@a:1", "rediss://:x,y@b:2"])
        );
    }

    #[test]
    fn passwords_are_found_for_the_scrubber_in_every_form() {
        for pw in NASTY {
            let enc = encode(pw);
            let url = format!("redis://bf:{enc}@h:1");
            assert!(
                url_passwords(&url).iter().any(|p| p == pw),
                "{url}: {:?}",
                url_passwords(&url)
            );
            let q = format!("redis://h:1/?password={enc}");
            assert!(url_passwords(&q).iter().any(|p| p == pw), "{q}");
        }
    }

    #[test]
    fn the_scrubber_removes_every_secret_and_nothing_else() {
        let s = Scrubber::new(["sk-live-0123456789".to_owned(), "short".to_owned()]);
        assert_eq!(
            s.scrub("Authorization: Bearer sk-live-0123456789 ok"),
            "Authorization: Bearer *** ok"
        );
        assert_eq!(s.scrub("a short word"), "a short word", "too short to scrub");
        assert!(!s.holds_secret(&s.scrub("x sk-live-0123456789 y sk-live-0123456789")));
    }

    #[test]
    fn unusable_keys_are_refused_without_showing_them() {
        let key = "sk-abcdefgh12345";
        let with_newline = format!("{key}\n");
        let e = check_api_key("OPENAI_API_KEY", &with_newline).unwrap_err();
        assert!(e.contains("a line break at its end"), "{e}");
        assert!(!e.contains(key), "{e}");
        assert!(
            check_api_key("K", " sk-abcdefgh")
                .unwrap_err()
                .contains("whitespace at its start")
        );
        assert!(
            check_api_key("K", "sk-ab\u{7}cdefgh")
                .unwrap_err()
                .contains("control character at byte 5")
        );
        assert!(check_api_key("K", "abc").unwrap_err().contains("shorter than"));
        assert!(check_api_key("K", "").is_err());
        assert!(check_api_key("K", key).is_ok());
    }
}

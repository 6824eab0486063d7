//! The Redis permissions batchfleet needs, checked once at connect.
//!
//! Every command the producer and the workers send, directly or from their
//! Lua scripts (Redis checks a script's calls against the same user), is tried
//! once on a probe key of batchfleet's namespace. The probe key holds a string,
//! so data commands of other types fail with WRONGTYPE after the ACL check has
//! passed, and nothing is written but the probe key itself (removed at once).
//! A NOPERM answer names a missing permission. `deploy/redis/users.acl` holds
//! the ACL line that grants exactly these.

use redis::{Cmd, cmd};

use super::{RedisStore, StoreError};

/// The probe key: inside `~bf:*`, one slot (hash tag `{probe}`).
const PROBE: &str = "bf:{probe}:acl";

/// `(command as the ACL names it, a harmless invocation)`.
fn probes() -> Vec<(&'static str, Cmd)> {
    let k = PROBE;
    let c = |name: &str, args: &[&str]| {
        let mut c = cmd(name);
        for a in args {
            c.arg(*a);
        }
        c
    };
    vec![
        ("set", c("SET", &[k, "probe", "EX", "60"])),
        ("get", c("GET", &[k])),
        ("exists", c("EXISTS", &[k])),
        ("expire", c("EXPIRE", &[k, "60"])),
        ("ping", c("PING", &[])),
        ("time", c("TIME", &[])),
        ("info", c("INFO", &["memory"])),
        ("sadd", c("SADD", &[k, "m"])),
        ("smembers", c("SMEMBERS", &[k])),
        ("hget", c("HGET", &[k, "f"])),
        ("hset", c("HSET", &[k, "f", "v"])),
        ("hmset", c("HMSET", &[k, "f", "v"])),
        ("hsetnx", c("HSETNX", &[k, "f", "v"])),
        ("hmget", c("HMGET", &[k, "f"])),
        ("hgetall", c("HGETALL", &[k])),
        ("hlen", c("HLEN", &[k])),
        ("hdel", c("HDEL", &[k, "f"])),
        ("hscan", c("HSCAN", &[k, "0"])),
        ("hincrby", c("HINCRBY", &[k, "f", "1"])),
        ("zadd", c("ZADD", &[k, "1", "m"])),
        ("zcard", c("ZCARD", &[k])),
        ("zrange", c("ZRANGE", &[k, "0", "0"])),
        ("zrangebyscore", c("ZRANGEBYSCORE", &[k, "0", "0"])),
        ("zrem", c("ZREM", &[k, "m"])),
        ("zscan", c("ZSCAN", &[k, "0"])),
        ("zremrangebyscore", c("ZREMRANGEBYSCORE", &[k, "0", "0"])),
        ("xadd", c("XADD", &[k, "NOMKSTREAM", "*", "f", "v"])),
        ("xlen", c("XLEN", &[k])),
        ("xrange", c("XRANGE", &[k, "-", "+", "COUNT", "1"])),
        ("xack", c("XACK", &[k, "g", "0-1"])),
        ("xdel", c("XDEL", &[k, "0-1"])),
        ("xgroup|create", c("XGROUP", &["CREATE", k, "g", "0"])),
        ("xinfo|groups", c("XINFO", &["GROUPS", k])),
        ("xinfo|stream", c("XINFO", &["STREAM", k])),
        ("xpending", c("XPENDING", &[k, "g"])),
        ("xclaim", c("XCLAIM", &[k, "g", "c", "0", "0-1"])),
        (
            "xreadgroup",
            c("XREADGROUP", &["GROUP", "g", "c", "COUNT", "1", "STREAMS", k, ">"]),
        ),
        ("script|load", c("SCRIPT", &["LOAD", "return 1"])),
        ("eval", c("EVAL", &["return 1", "0"])),
        (
            "evalsha",
            c("EVALSHA", &["0000000000000000000000000000000000000000", "0"]),
        ),
        ("del", c("DEL", &[k])),
        // Last: an acknowledgement is XACK + XDEL in one MULTI/EXEC.
        ("multi", c("MULTI", &[])),
        ("exec", c("EXEC", &[])),
    ]
}

impl RedisStore {
    /// Fails with [`StoreError::Permissions`] naming every command or key the
    /// connected user may not use.
    pub async fn check_permissions(&self) -> Result<(), StoreError> {
        let probes = probes();
        let mut pipe = redis::pipe();
        for (_, c) in &probes {
            pipe.add_command(c.clone());
        }
        let replies: Vec<redis::RedisResult<redis::Value>> =
            pipe.ignore_errors().query_async(&mut self.conn.clone()).await?;
        let mut missing = Vec::new();
        for ((name, _), reply) in probes.iter().zip(replies) {
            if let Err(e) = reply
                && e.code() == Some("NOPERM")
            {
                let what = e.detail().unwrap_or_default().to_owned();
                // Access to the key itself (not the command) is what is missing.
                if what.contains("key") {
                    missing.push(format!("keys ~bf:* (denied on {name})"));
                } else {
                    missing.push(format!("+{name}"));
                }
            }
        }
        if missing.is_empty() {
            Ok(())
        } else {
            Err(StoreError::Permissions { missing })
        }
    }
}

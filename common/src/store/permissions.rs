//! The Redis permissions batchfleet needs, checked once at connect.
//!
//! Every command the producer and the workers send, directly or from their
//! Lua scripts (Redis checks a script's calls against the same user), is sent
//! once to probe keys of batchfleet's namespace, each of the type its
//! commands expect (a string, a set, a hash, a sorted set, a stream with a
//! group), so for a user who holds the permissions every probe succeeds: a
//! start leaves nothing in Redis's error statistics, which operators alert
//! on. The probe keys are this process's own (a random name in one slot) and
//! are deleted at the end. A NOPERM answer names a missing permission.
//! `deploy/redis/users.acl` holds the ACL line that grants these, and the two
//! that only `producer delete` needs (checked by it: `store::delete_ops`).

use redis::{Cmd, cmd};

use super::{RedisStore, StoreError};

/// SHA1 of the script `return 1`, loaded by the `script|load` probe just before.
const RETURN_1_SHA: &str = "e0e1f9fabfc9d4800c877a703b823ac0578ff8db";

/// `(command as the ACL names it, an invocation that succeeds when permitted)`,
/// in order: each one's key exists, with its type, when it runs.
fn probes(tag: &str) -> Vec<(&'static str, Cmd)> {
    // Inside `~bf:*`, one slot (hash tag `{probe}`), unique to this process.
    let key = |kind: &str| format!("bf:{{probe}}:{tag}:{kind}");
    let (string, set, hash, zset, stream) = (key("s"), key("set"), key("h"), key("z"), key("x"));
    let c = |name: &str, args: &[&str]| {
        let mut c = cmd(name);
        for a in args {
            c.arg(*a);
        }
        c
    };
    vec![
        ("ping", c("PING", &[])),
        ("time", c("TIME", &[])),
        ("info", c("INFO", &["memory"])),
        ("set", c("SET", &[&string, "probe", "EX", "60"])),
        ("get", c("GET", &[&string])),
        ("mget", c("MGET", &[&string])),
        ("exists", c("EXISTS", &[&string])),
        ("expire", c("EXPIRE", &[&string, "60"])),
        ("persist", c("PERSIST", &[&string])),
        ("sadd", c("SADD", &[&set, "m"])),
        ("smembers", c("SMEMBERS", &[&set])),
        ("hset", c("HSET", &[&hash, "f", "v"])),
        ("hget", c("HGET", &[&hash, "f"])),
        ("hmset", c("HMSET", &[&hash, "f", "v"])),
        ("hsetnx", c("HSETNX", &[&hash, "f", "v"])),
        ("hmget", c("HMGET", &[&hash, "f"])),
        ("hgetall", c("HGETALL", &[&hash])),
        ("hlen", c("HLEN", &[&hash])),
        ("hscan", c("HSCAN", &[&hash, "0"])),
        ("hincrby", c("HINCRBY", &[&hash, "n", "1"])),
        ("hdel", c("HDEL", &[&hash, "f"])),
        ("zadd", c("ZADD", &[&zset, "1", "m"])),
        ("zcard", c("ZCARD", &[&zset])),
        ("zrange", c("ZRANGE", &[&zset, "0", "0"])),
        ("zrangebyscore", c("ZRANGEBYSCORE", &[&zset, "0", "0"])),
        ("zscan", c("ZSCAN", &[&zset, "0"])),
        ("zmscore", c("ZMSCORE", &[&zset, "m"])),
        ("zrem", c("ZREM", &[&zset, "m"])),
        ("zremrangebyscore", c("ZREMRANGEBYSCORE", &[&zset, "0", "0"])),
        ("xgroup|create", c("XGROUP", &["CREATE", &stream, "g", "0", "MKSTREAM"])),
        ("xadd", c("XADD", &[&stream, "*", "f", "v"])),
        ("xlen", c("XLEN", &[&stream])),
        ("xrange", c("XRANGE", &[&stream, "-", "+", "COUNT", "1"])),
        ("xinfo|groups", c("XINFO", &["GROUPS", &stream])),
        ("xinfo|stream", c("XINFO", &["STREAM", &stream])),
        (
            "xreadgroup",
            c(
                "XREADGROUP",
                &["GROUP", "g", "c", "COUNT", "1", "STREAMS", &stream, ">"],
            ),
        ),
        ("xread", c("XREAD", &["COUNT", "1", "STREAMS", &stream, "0"])),
        ("xpending", c("XPENDING", &[&stream, "g"])),
        ("xclaim", c("XCLAIM", &[&stream, "g", "c", "0", "0-1"])),
        ("xack", c("XACK", &[&stream, "g", "0-1"])),
        ("xdel", c("XDEL", &[&stream, "0-1"])),
        ("script|load", c("SCRIPT", &["LOAD", "return 1"])),
        ("eval", c("EVAL", &["return 1", "0"])),
        ("evalsha", c("EVALSHA", &[RETURN_1_SHA, "0"])),
        ("del", c("DEL", &[&string, &set, &hash, &zset, &stream])),
        // Last: an acknowledgement is XACK + XDEL in one MULTI/EXEC.
        ("multi", c("MULTI", &[])),
        ("exec", c("EXEC", &[])),
    ]
}

impl RedisStore {
    /// Fails with [`StoreError::Permissions`] naming every command or key the
    /// connected user may not use.
    pub async fn check_permissions(&self) -> Result<(), StoreError> {
        let tag = format!(
            "{}-{:x}",
            std::process::id(),
            std::time::UNIX_EPOCH.elapsed().map_or(0, |d| d.as_nanos())
        );
        let probes = probes(&tag);
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

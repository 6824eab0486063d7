//! The Redis implementation of the store.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{AsyncCommands, Script};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::StoreError;
use super::worker_ops::{as_array, as_string};
use crate::keys;
use crate::manifest::{Cursor, DroppedLine, Manifest};
use crate::secret::{cluster_seeds, redact_url};
use crate::task::{RecordState, Task};

const ENQUEUE_LUA: &str = include_str!("scripts/enqueue.lua");
/// Records per enqueue script call: bounds Lua's `unpack` and each call's latency.
const MAX_RECORDS_PER_CALL: usize = 1000;

/// One record to enqueue: a task, or a record dropped for an input error.
#[derive(Debug, Clone)]
pub struct TaskEntry {
    pub partition: u32,
    pub record_id: String,
    /// `<dataset sha12>:<line>`: where the record came from.
    pub origin: String,
    /// Business key, for the producer's reports (the task carries it inside its input).
    pub key: String,
    /// The record's first task; None with the reason when it is not sent
    /// (it is only recorded, as `dropped:<reason>`).
    pub task: Result<Task, String>,
}

impl TaskEntry {
    fn state(&self) -> RecordState {
        match &self.task {
            Ok(_) => RecordState::Queued,
            Err(reason) => RecordState::Dropped(reason.clone()),
        }
    }
}

/// What happened to one [`TaskEntry`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnqueueOutcome {
    /// Newly added.
    Added,
    /// Already in the job; carries the origin that added it, when still known.
    Present { origin: Option<String> },
}

/// A connection to one Redis server (reconnecting), or to a Redis Cluster
/// (routing each command and script by its keys' slot).
#[derive(Clone)]
pub enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// Reads pages one ahead: the request for the next page is on its way (and
/// Redis works on it) while `each` goes through the current one. `fetch`
/// returns a page and the cursor of the next (None: this was the last).
/// The caller holds at most two pages.
pub(super) async fn read_ahead<T, Fut>(
    first: String,
    fetch: impl Fn(String) -> Fut,
    mut each: impl FnMut(T),
) -> Result<(), StoreError>
where
    T: Send + 'static,
    Fut: std::future::Future<Output = Result<(Option<String>, T), StoreError>> + Send + 'static,
{
    let mut next = Some(tokio::spawn(fetch(first)));
    while let Some(page) = next.take() {
        let (cursor, page) = match page.await {
            Ok(read) => read?,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // The runtime is shutting down.
            Err(_) => return Err(StoreError::ShuttingDown),
        };
        next = cursor.map(|c| tokio::spawn(fetch(c)));
        each(page);
    }
    Ok(())
}

/// A stream entry's `rid` field (an entry without one gives None).
fn stream_rid(fields: &redis::Value) -> Option<String> {
    as_array(fields)
        .chunks_exact(2)
        .find(|kv| matches!(&kv[0], redis::Value::BulkString(k) if k == b"rid"))
        .and_then(|kv| as_string(&kv[1]))
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// Job state in one Redis server, or in a Redis Cluster: every multi-key
/// step touches keys of one hash tag, so of one slot.
#[derive(Clone)]
pub struct RedisStore {
    pub(super) conn: Conn,
    /// Shared by every clone: a store is cloned for each group commit and
    /// settlement, and the scripts' code is about 100 KB.
    pub(super) scripts: Arc<Scripts>,
}

/// The Lua scripts, loaded on first use (and again after a server restart).
pub(super) struct Scripts {
    pub enqueue: Script,
    pub finish: Script,
    pub drift_halt: Script,
    pub ledger_expire: Script,
    pub promote: Script,
    pub limit_acquire: Script,
    pub limit_settle: Script,
    pub review_action: Script,
    pub cancel_page: Script,
    pub resume_page: Script,
    pub retry_record: Script,
    pub lease: Script,
    pub sink_ack: Script,
    pub sink_refuse: Script,
    pub revise: Script,
    pub dataset_tag: Script,
    pub ids_page: Script,
    pub ledger: Script,
    pub budget: Script,
    pub audit: Script,
    pub shard: Script,
    pub batch_tokens: Script,
    pub outage: Script,
    pub renew: Script,
}

/// The PEM file of the CA that signed the Redis server's certificate, for
/// `rediss://` URLs (the system's roots when unset).
pub const CA_CERT_ENV: &str = "BATCHFLEET_REDIS_CA_CERT";

/// The CA of [`CA_CERT_ENV`] for a `rediss://` URL (None: the system's roots).
fn tls_certificates(url: &str) -> Result<Option<redis::TlsCertificates>, StoreError> {
    let Some(path) = std::env::var_os(CA_CERT_ENV).filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    if !url.starts_with("rediss://") {
        return Ok(None);
    }
    let pem = std::fs::read(&path).map_err(|e| StoreError::Unreachable {
        url: redact_url(url),
        reason: format!("cannot read {CA_CERT_ENV}={}: {e}", path.to_string_lossy()),
    })?;
    Ok(Some(redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(pem),
    }))
}

/// A URL's connection settings, without the `CLIENT SETINFO` handshake:
/// servers before 7.2 answer it with an error, which shows in their error
/// statistics (operators alert on those).
/// A URL, or `host:port` as people type it (a plain `redis://` server).
fn connection_info(url: &str) -> redis::RedisResult<redis::ConnectionInfo> {
    use redis::IntoConnectionInfo;
    let info = if url.contains("://") {
        url.into_connection_info()?
    } else {
        format!("redis://{url}").as_str().into_connection_info()?
    };
    let settings = info.redis_settings().clone().set_skip_set_lib_name();
    Ok(info.set_redis_settings(settings))
}

/// Says what a failed TLS handshake means, in words an operator can act on.
fn explain(url: &str, e: &redis::RedisError) -> String {
    let text = e.to_string();
    if url.starts_with("rediss://") && (text.contains("certificate") || text.contains("Certificate")) {
        let ca = std::env::var(CA_CERT_ENV).unwrap_or_else(|_| "the system's roots".into());
        format!("TLS: the server's certificate is not trusted ({text}); checked against {ca} (set {CA_CERT_ENV})")
    } else {
        text
    }
}

impl RedisStore {
    /// Connects, checks the server answers and that the user holds every
    /// permission batchfleet needs.
    pub async fn connect(url: &str) -> Result<RedisStore, StoreError> {
        let unreachable = |e: redis::RedisError| StoreError::Unreachable {
            url: redact_url(url),
            reason: explain(url, &e),
        };
        let certs = tls_certificates(url)?;
        let mut conn = match cluster_seeds(url) {
            Some(seeds) => {
                let infos = seeds
                    .iter()
                    .map(|s| connection_info(s))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(unreachable)?;
                let mut builder = redis::cluster::ClusterClientBuilder::new(infos)
                    .connection_timeout(Duration::from_secs(5))
                    .response_timeout(Duration::from_secs(30))
                    .retries(8);
                if let Some(c) = certs {
                    builder = builder.certs(c);
                }
                let client = builder.build().map_err(unreachable)?;
                Conn::Cluster(client.get_async_connection().await.map_err(unreachable)?)
            }
            None => {
                let info = connection_info(url).map_err(unreachable)?;
                let client = match certs {
                    Some(c) => redis::Client::build_with_tls(info, c),
                    None => redis::Client::open(info),
                }
                .map_err(unreachable)?;
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(Duration::from_secs(5)))
                    .set_response_timeout(Some(Duration::from_secs(30)))
                    .set_number_of_retries(2)
                    .set_max_delay(Duration::from_secs(2));
                Conn::Single(
                    client
                        .get_connection_manager_with_config(config)
                        .await
                        .map_err(unreachable)?,
                )
            }
        };
        let _: String = redis::cmd("PING").query_async(&mut conn).await.map_err(unreachable)?;
        let store = RedisStore {
            conn,
            scripts: Arc::new(Scripts {
                enqueue: Script::new(ENQUEUE_LUA),
                finish: Script::new(concat!(
                    include_str!("scripts/counters.lua"),
                    include_str!("scripts/finish.lua")
                )),
                drift_halt: Script::new(include_str!("scripts/drift_halt.lua")),
                ledger_expire: Script::new(include_str!("scripts/ledger_expire.lua")),
                ledger: Script::new(concat!(
                    include_str!("scripts/counters.lua"),
                    include_str!("scripts/ledger.lua")
                )),
                budget: Script::new(include_str!("scripts/budget.lua")),
                audit: Script::new(include_str!("scripts/audit.lua")),
                shard: Script::new(include_str!("scripts/shard.lua")),
                batch_tokens: Script::new(include_str!("scripts/batch_tokens.lua")),
                outage: Script::new(include_str!("scripts/outage.lua")),
                renew: Script::new(include_str!("scripts/renew.lua")),
                promote: Script::new(include_str!("scripts/promote.lua")),
                limit_acquire: Script::new(concat!(
                    include_str!("scripts/limit_free.lua"),
                    include_str!("scripts/limit_acquire.lua")
                )),
                limit_settle: Script::new(concat!(
                    include_str!("scripts/limit_free.lua"),
                    include_str!("scripts/limit_settle.lua")
                )),
                review_action: Script::new(include_str!("scripts/review_action.lua")),
                cancel_page: Script::new(include_str!("scripts/cancel_page.lua")),
                resume_page: Script::new(include_str!("scripts/resume_page.lua")),
                retry_record: Script::new(include_str!("scripts/retry_record.lua")),
                lease: Script::new(include_str!("scripts/lease.lua")),
                sink_ack: Script::new(include_str!("scripts/sink_ack.lua")),
                sink_refuse: Script::new(include_str!("scripts/sink_refuse.lua")),
                revise: Script::new(include_str!("scripts/revise.lua")),
                dataset_tag: Script::new(include_str!("scripts/dataset_tag.lua")),
                ids_page: Script::new(include_str!("scripts/ids_page.lua")),
            }),
        };
        store.check_permissions().await?;
        store.load_scripts().await?;
        Ok(store)
    }

    /// Loads every Lua script, so the first EVALSHA of each finds it (a
    /// NOSCRIPT answer would show in the server's error statistics). After a
    /// server restart the client loads them again on first use.
    async fn load_scripts(&self) -> Result<(), StoreError> {
        let s = &self.scripts;
        for script in [
            &s.enqueue,
            &s.finish,
            &s.promote,
            &s.limit_acquire,
            &s.limit_settle,
            &s.review_action,
            &s.cancel_page,
            &s.resume_page,
            &s.retry_record,
            &s.lease,
            &s.sink_ack,
            &s.sink_refuse,
            &s.revise,
            &s.dataset_tag,
            &s.ids_page,
            &s.ledger,
            &s.budget,
            &s.audit,
            &s.shard,
            &s.batch_tokens,
            &s.outage,
            &s.renew,
        ] {
            script.load_async(&mut self.conn.clone()).await?;
        }
        Ok(())
    }

    /// Whether the server answers a PING now.
    pub async fn ping(&self) -> bool {
        redis::cmd("PING")
            .query_async::<String>(&mut self.conn.clone())
            .await
            .is_ok()
    }

    /// A connection for callers that need raw commands (tests, status).
    pub fn connection(&self) -> Conn {
        self.conn.clone()
    }

    /// Registers the job, stores its spec, and creates every partition's stream
    /// and consumer group (from id 0, so no task added later is missed); with
    /// `sink`, also every partition's sink stream and its group.
    pub async fn prepare_job(&self, job: &str, spec_toml: &str, partitions: u32, sink: bool) -> Result<(), StoreError> {
        let mut c = self.conn.clone();
        let _: () = c.sadd(keys::jobs(), job).await?;
        let _: () = c.set(keys::spec(job), spec_toml).await?;
        for p in 0..partitions {
            let mut groups = vec![(keys::stream(job, p), keys::GROUP)];
            if sink {
                groups.push((keys::sink(job, p), keys::SINK_GROUP));
            }
            for (stream, group) in groups {
                let created: Result<(), redis::RedisError> = redis::cmd("XGROUP")
                    .arg("CREATE")
                    .arg(stream)
                    .arg(group)
                    .arg("0")
                    .arg("MKSTREAM")
                    .query_async(&mut c)
                    .await;
                match created {
                    Ok(()) => {}
                    Err(e) if e.code() == Some("BUSYGROUP") => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
        Ok(())
    }

    /// Adds records, each exactly once. Entries are grouped by partition and
    /// each group is one atomic script call; the calls of a batch are pipelined
    /// over the multiplexed connection. Outcomes come back in input order.
    pub async fn enqueue(
        &self,
        job: &str,
        idem_ttl_secs: u64,
        entries: &[TaskEntry],
    ) -> Result<Vec<EnqueueOutcome>, StoreError> {
        let mut by_partition: std::collections::BTreeMap<u32, Vec<usize>> = Default::default();
        for (i, e) in entries.iter().enumerate() {
            by_partition.entry(e.partition).or_default().push(i);
        }
        let mut calls = Vec::with_capacity(by_partition.len());
        let chunks = by_partition.into_iter().flat_map(|(p, idx)| {
            idx.chunks(MAX_RECORDS_PER_CALL)
                .map(|c| (p, c.to_vec()))
                .collect::<Vec<_>>()
        });
        for (partition, idx) in chunks {
            let mut inv = self.scripts.enqueue.prepare_invoke();
            inv.key(keys::stream(job, partition))
                .key(keys::state(job, partition))
                .key(keys::origins(job, partition))
                .key(keys::sink(job, partition));
            inv.arg(idem_ttl_secs);
            for &i in &idx {
                let e = &entries[i];
                inv.key(keys::idem(job, partition, &e.record_id));
                inv.arg(&e.record_id)
                    .arg(&e.origin)
                    .arg(e.state().encode().as_ref())
                    .arg(e.task.as_ref().map(Task::encode_entry).unwrap_or_default());
            }
            let mut conn = self.conn.clone();
            let call = async move {
                let replies: Vec<redis::Value> = inv.invoke_async(&mut conn).await?;
                Ok::<_, StoreError>((idx, replies))
            };
            calls.push(call);
        }
        let mut out = vec![EnqueueOutcome::Added; entries.len()];
        for (idx, replies) in futures_util::future::try_join_all(calls).await? {
            if replies.len() != idx.len() {
                return Err(StoreError::Corrupt {
                    key: "enqueue.lua".into(),
                    reason: format!("{} replies for {} records", replies.len(), idx.len()),
                });
            }
            for (i, reply) in idx.into_iter().zip(replies) {
                out[i] = match reply {
                    redis::Value::Int(1) => EnqueueOutcome::Added,
                    redis::Value::BulkString(b) if b.is_empty() => EnqueueOutcome::Present { origin: None },
                    redis::Value::BulkString(b) => EnqueueOutcome::Present {
                        origin: Some(String::from_utf8_lossy(&b).into_owned()),
                    },
                    _ => EnqueueOutcome::Present { origin: None },
                };
            }
        }
        if out.contains(&EnqueueOutcome::Added) {
            self.wake(job, super::Wake::Work).await;
        }
        Ok(out)
    }

    /// Stores dropped lines, keyed by `<dataset sha12>:<line>` so a replay rewrites, never duplicates.
    pub async fn record_dropped(
        &self,
        job: &str,
        dataset_short: &str,
        lines: &[DroppedLine],
    ) -> Result<(), StoreError> {
        if lines.is_empty() {
            return Ok(());
        }
        let items: Vec<(String, String)> = lines
            .iter()
            .map(|d| {
                (
                    format!("{dataset_short}:{}", d.line),
                    serde_json::to_string(d).unwrap_or_default(),
                )
            })
            .collect();
        let _: () = self
            .conn
            .clone()
            .hset_multiple(keys::dropped_lines(job), &items)
            .await?;
        Ok(())
    }

    /// Every dropped line of the job, in line order.
    pub async fn dropped_lines(&self, job: &str) -> Result<Vec<DroppedLine>, StoreError> {
        let all: Vec<(String, String)> = self.conn.clone().hgetall(keys::dropped_lines(job)).await?;
        let mut out = Vec::with_capacity(all.len());
        for (field, json) in all {
            out.push(
                serde_json::from_str::<DroppedLine>(&json).map_err(|e| StoreError::Corrupt {
                    key: format!("{} {field}", keys::dropped_lines(job)),
                    reason: e.to_string(),
                })?,
            );
        }
        out.sort_by_key(|d| d.line);
        Ok(out)
    }

    pub async fn load_cursor(&self, job: &str) -> Result<Option<Cursor>, StoreError> {
        self.get_json(&keys::cursor(job)).await
    }

    pub async fn save_cursor(&self, job: &str, cursor: &Cursor) -> Result<(), StoreError> {
        self.set_json(&keys::cursor(job), cursor).await
    }

    pub async fn load_manifest(&self, job: &str) -> Result<Option<Manifest>, StoreError> {
        self.get_json(&keys::manifest(job)).await
    }

    pub async fn save_manifest(&self, job: &str, manifest: &Manifest) -> Result<(), StoreError> {
        self.set_json(&keys::manifest(job), manifest).await
    }

    /// The spec TOML stored for a job at enqueue.
    pub async fn load_spec_text(&self, job: &str) -> Result<Option<String>, StoreError> {
        Ok(self.conn.clone().get(keys::spec(job)).await?)
    }

    /// Distinct records the job holds: the sum of its state hashes' sizes.
    /// Records a partition's state hash holds.
    pub async fn record_count(&self, job: &str, partition: u32) -> Result<u64, StoreError> {
        Ok(redis::AsyncCommands::hlen(&mut self.conn.clone(), keys::state(job, partition)).await?)
    }

    pub async fn count_records(&self, job: &str, partitions: u32) -> Result<u64, StoreError> {
        let mut c = self.conn.clone();
        let mut total = 0u64;
        for p in 0..partitions {
            let n: u64 = c.hlen(keys::state(job, p)).await?;
            total += n;
        }
        Ok(total)
    }

    /// Calls `f` for every field and value of a hash, scanning in pages
    /// (HSCAN): memory stays flat however large the hash is.
    /// One command per partition, each on its own (a Redis Cluster puts the
    /// partitions in different slots: no pipeline may span them), sent
    /// together over the multiplexed connection; the replies in partition order.
    pub(super) async fn per_partition<T: redis::FromRedisValue>(
        &self,
        partitions: u32,
        cmd: impl Fn(u32) -> redis::Cmd,
    ) -> Result<Vec<T>, StoreError> {
        let calls = (0..partitions).map(|p| {
            let (cmd, mut c) = (cmd(p), self.conn.clone());
            async move { cmd.query_async::<T>(&mut c).await }
        });
        Ok(futures_util::future::try_join_all(calls).await?)
    }

    pub(super) async fn scan_hash(&self, key: &str, f: impl FnMut(String, String)) -> Result<(), StoreError> {
        self.scan_pairs("HSCAN", key, f).await
    }

    /// Calls `f` for every member of a sorted set (ZSCAN): flat memory.
    pub(super) async fn scan_sorted_set(&self, key: &str, mut f: impl FnMut(String)) -> Result<(), StoreError> {
        self.scan_pairs("ZSCAN", key, |member, _score| f(member)).await
    }

    /// HSCAN / ZSCAN in pages of 1,000: both reply with flat pairs.
    async fn scan_pairs(&self, command: &str, key: &str, mut f: impl FnMut(String, String)) -> Result<(), StoreError> {
        let (conn, command, key) = (self.conn.clone(), command.to_owned(), key.to_owned());
        let fetch = move |cursor: String| {
            let mut cmd = redis::cmd(&command);
            cmd.arg(&key).arg(&cursor).arg("COUNT").arg(1000);
            let mut c = conn.clone();
            async move {
                let (next, items): (String, Vec<String>) = cmd.query_async(&mut c).await?;
                Ok(((next != "0").then_some(next), items))
            }
        };
        read_ahead("0".to_owned(), fetch, |items| {
            let mut it = items.into_iter();
            while let (Some(first), Some(second)) = (it.next(), it.next()) {
                f(first, second);
            }
        })
        .await
    }

    /// Calls `f` with the record id of every entry in a partition stream,
    /// paging through it with XRANGE: flat memory. The entries' ids are
    /// picked out of each page while the caller goes through the one
    /// before (in Lua, turning each entry into a table cost Redis five
    /// times what the XRANGE did).
    pub async fn scan_stream_rids(
        &self,
        job: &str,
        partition: u32,
        mut f: impl FnMut(String),
    ) -> Result<(), StoreError> {
        const PAGE: usize = 1000;
        let (conn, key) = (self.conn.clone(), keys::stream(job, partition));
        let fetch = move |after: String| {
            let start = if after.is_empty() {
                "-".to_owned()
            } else {
                format!("({after}")
            };
            let (mut cmd, mut c, key) = (redis::cmd("XRANGE"), conn.clone(), key.clone());
            cmd.arg(&key).arg(start).arg("+").arg("COUNT").arg(PAGE);
            async move {
                let reply: redis::Value = cmd.query_async(&mut c).await?;
                let entries = as_array(&reply);
                let mut last = None;
                let mut rids = Vec::with_capacity(entries.len());
                for entry in entries {
                    let entry = as_array(entry);
                    // The next page starts after this id: without it, paging cannot go on.
                    last = Some(entry.first().and_then(as_string).ok_or_else(|| StoreError::Corrupt {
                        key: key.clone(),
                        reason: "an XRANGE entry without an id".to_owned(),
                    })?);
                    rids.push(entry.get(1).and_then(stream_rid).unwrap_or_default());
                }
                Ok((last.filter(|_| entries.len() == PAGE), rids))
            }
        };
        read_ahead(String::new(), fetch, |rids| rids.into_iter().for_each(&mut f)).await
    }

    /// Calls `f` with every record id a hash holds (its fields), without
    /// reading the values: flat memory, and only the ids cross the wire.
    /// (`ids_page.lua`, in pages of 1,000.)
    pub(super) async fn hash_fields(&self, key: &str, mut f: impl FnMut(String)) -> Result<(), StoreError> {
        let (conn, script, key) = (self.conn.clone(), self.scripts.ids_page.clone(), key.to_owned());
        let fetch = move |cursor: String| {
            let (script, key, mut c) = (script.clone(), key.clone(), conn.clone());
            async move {
                let page: Vec<String> = script.key(key).arg(cursor).arg(1000).invoke_async(&mut c).await?;
                let mut page = page.into_iter();
                let next = page.next().filter(|n| n != "0");
                Ok((next, page))
            }
        };
        read_ahead("0".to_owned(), fetch, |page| page.for_each(&mut f)).await
    }

    /// One page of a hash's fields (up to 1,000) and the cursor of the next
    /// (None: this was the last), for a caller that acts on each page.
    pub(super) async fn hash_fields_page(
        &self,
        key: &str,
        cursor: &str,
    ) -> Result<(Option<String>, Vec<String>), StoreError> {
        let page: Vec<String> = self
            .scripts
            .ids_page
            .key(key)
            .arg(cursor)
            .arg(1000)
            .invoke_async(&mut self.conn.clone())
            .await?;
        let mut page = page.into_iter();
        let next = page.next().filter(|n| n != "0");
        Ok((next, page.collect()))
    }

    /// Entries delivered but not yet acknowledged, per the consumer group.
    pub async fn pending_count(&self, job: &str, partition: u32) -> Result<u64, StoreError> {
        let reply: redis::Value = redis::cmd("XPENDING")
            .arg(keys::stream(job, partition))
            .arg(keys::GROUP)
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(match reply {
            redis::Value::Array(parts) => match parts.first() {
                Some(redis::Value::Int(n)) => *n as u64,
                _ => 0,
            },
            _ => 0,
        })
    }

    /// Number of tasks in each partition stream (entries not yet deleted).
    pub async fn stream_lengths(&self, job: &str, partitions: u32) -> Result<Vec<u64>, StoreError> {
        let mut c = self.conn.clone();
        let mut out = Vec::with_capacity(partitions as usize);
        for p in 0..partitions {
            out.push(c.xlen(keys::stream(job, p)).await?);
        }
        Ok(out)
    }

    async fn get_json<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>, StoreError> {
        let text: Option<String> = self.conn.clone().get(key).await?;
        text.map(|t| {
            serde_json::from_str(&t).map_err(|e| StoreError::Corrupt {
                key: key.to_owned(),
                reason: e.to_string(),
            })
        })
        .transpose()
    }

    async fn set_json<T: Serialize>(&self, key: &str, value: &T) -> Result<(), StoreError> {
        let text = serde_json::to_string(value).map_err(|e| StoreError::Corrupt {
            key: key.to_owned(),
            reason: e.to_string(),
        })?;
        let _: () = self.conn.clone().set(key, text).await?;
        Ok(())
    }
}

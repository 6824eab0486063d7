//! Autoscaling without a cluster (#19). A simulated KEDA reads the chart's
//! rendered `ScaledObject` and evaluates every trigger as KEDA's scalers
//! compute it — `redis-streams` with `lagCount`: `XINFO GROUPS` lag (a NULL
//! lag read as 0, as go-redis does; `XLEN` before the group exists); with
//! `pendingEntriesCount`: `XPENDING`'s count; `metrics-api`: GET `url`, the
//! number at `valueLocation` — is active while any metric is above its
//! activation value, sizes the workers as the HPA does (the largest
//! ceil(metric / target), 10% tolerance; without its 300 s scale-down
//! stabilisation, so it scales down sooner than a cluster would), scales to
//! zero once no trigger was active for `cooldownPeriod` (never while a
//! trigger fails, as KEDA), and starts and SIGTERMs real worker processes
//! to match (SIGKILL after the pod's grace period).
//!
//! Each scenario runs one job twice over: first under the chart as it was
//! before (lag triggers only, no scaler, any drain below the grace period),
//! where the job stalls with work left and no worker; then under the chart as
//! it is, which finishes the same job with nothing missing, duplicated or
//! unknown and every paid call in the cost ledger.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::time::{Duration, Instant};

use common::keys;
use harness::{
    LlmSim, RedisServer, Running, TempDir, bin, enqueue, free_port, helm, http_get, producer, signal, spec_with,
    status_json, worker_cmd, worker_summary, write_records,
};
use serde::Deserialize;
use serde_json::Value;

const JOB: &str = "scale";
const PARTITIONS: u32 = 4;

enum Metric {
    Lag(String),
    Pending(String),
    Api { path: String, location: String },
}

struct Trigger {
    metric: Metric,
    target: f64,
    activation: f64,
}

/// What the simulated KEDA and kubelet need from the rendered chart.
struct Chart {
    triggers: Vec<Trigger>,
    min: u32,
    max: u32,
    polling: Duration,
    cooldown: Duration,
    grace: Duration,
    /// The worker container's BATCHFLEET_* settings (drain, concurrency...).
    env: Vec<(String, String)>,
    scaler: bool,
}

fn number(v: &Value) -> f64 {
    match v {
        Value::String(s) => s.parse().unwrap(),
        other => other.as_f64().unwrap(),
    }
}

/// `helm template` with `sets`, read back as KEDA and Kubernetes would.
fn render(sets: &[&str]) -> Chart {
    let mut args = vec!["template", "bf", "helm/batchfleet"];
    let job = [
        format!("jobs[0].name={JOB}"),
        format!("jobs[0].partitions={PARTITIONS}"),
    ];
    for s in job.iter().map(String::as_str).chain(sets.iter().copied()) {
        args.extend(["--set", s]);
    }
    let (ok, text) = helm(&args);
    assert!(ok, "{text}");
    let docs: Vec<Value> = serde_yaml::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap())
        .filter(|d| !d.is_null())
        .collect();
    let so = docs
        .iter()
        .find(|d| d["kind"] == "ScaledObject")
        .expect("a ScaledObject");
    let spec = &so["spec"];
    let triggers = spec["triggers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let m = &t["metadata"];
            let activation = |k: &str| m.get(k).map_or(0.0, number);
            match t["type"].as_str().unwrap() {
                "redis-streams" => {
                    let stream = m["stream"].as_str().unwrap().to_owned();
                    if let Some(lag) = m.get("lagCount") {
                        Trigger {
                            metric: Metric::Lag(stream),
                            target: number(lag),
                            activation: activation("activationLagCount"),
                        }
                    } else {
                        Trigger {
                            metric: Metric::Pending(stream),
                            target: m.get("pendingEntriesCount").map_or(5.0, number),
                            activation: activation("activationLagCount"),
                        }
                    }
                }
                "metrics-api" => {
                    let url = m["url"].as_str().unwrap();
                    let path = &url[url["http://".len()..].find('/').unwrap() + "http://".len()..];
                    Trigger {
                        metric: Metric::Api {
                            path: path.to_owned(),
                            location: m["valueLocation"].as_str().unwrap().to_owned(),
                        },
                        target: number(&m["targetValue"]),
                        activation: activation("activationTargetValue"),
                    }
                }
                other => panic!("no simulation of a {other} trigger"),
            }
        })
        .collect();
    let deployment = |name: &str| {
        docs.iter()
            .find(|d| d["kind"] == "Deployment" && d["metadata"]["name"] == name)
            .map(|d| &d["spec"]["template"]["spec"])
    };
    let worker = deployment("bf-batchfleet-worker").expect("the worker Deployment");
    let env = worker["containers"][0]["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| Some((e["name"].as_str()?.to_owned(), e.get("value")?.as_str()?.to_owned())))
        .filter(|(k, _)| {
            [
                "BATCHFLEET_DRAIN_TIMEOUT_SECS",
                "BATCHFLEET_CONCURRENCY",
                "BATCHFLEET_MAX_DELIVERIES",
                "BATCHFLEET_VISIBILITY_TIMEOUT_MS",
            ]
            .contains(&k.as_str())
        })
        .collect();
    let scaler =
        deployment("bf-batchfleet-scaler").is_some_and(|s| s["containers"][0]["command"][0] == "/usr/local/bin/scaler");
    Chart {
        triggers,
        min: spec["minReplicaCount"].as_u64().unwrap() as u32,
        max: spec["maxReplicaCount"].as_u64().unwrap() as u32,
        polling: Duration::from_secs(spec["pollingInterval"].as_u64().unwrap()),
        cooldown: Duration::from_secs(spec["cooldownPeriod"].as_u64().unwrap()),
        grace: Duration::from_secs(worker["terminationGracePeriodSeconds"].as_u64().unwrap()),
        env,
        scaler,
    }
}

impl Chart {
    /// The chart before #19: the group's lag alone, a drain of `drain_secs`.
    fn before_19(mut self, drain_secs: &str) -> Chart {
        self.triggers.retain(|t| matches!(t.metric, Metric::Lag(_)));
        for (k, v) in &mut self.env {
            if k == "BATCHFLEET_DRAIN_TIMEOUT_SECS" {
                *v = drain_secs.to_owned();
            }
        }
        self.scaler = false;
        self
    }
}

fn redis_value_u64(v: &redis::Value) -> Option<u64> {
    match v {
        redis::Value::Int(n) => u64::try_from(*n).ok(),
        redis::Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

/// KEDA's `lagCount` metric: the group's lag from XINFO GROUPS.
fn keda_lag(c: &mut redis::Connection, stream: &str) -> f64 {
    let groups: redis::Value = match redis::cmd("XINFO").arg("GROUPS").arg(stream).query(c) {
        Ok(v) => v,
        Err(e) if e.to_string().contains("no such key") => return 0.0,
        Err(e) => panic!("XINFO GROUPS {stream}: {e}"),
    };
    let redis::Value::Array(groups) = groups else {
        panic!("XINFO GROUPS reply")
    };
    for g in &groups {
        let fields: Vec<redis::Value> = match g {
            redis::Value::Array(a) => a.clone(),
            redis::Value::Map(m) => m.iter().flat_map(|(k, v)| [k.clone(), v.clone()]).collect(),
            _ => continue,
        };
        let get = |name: &str| {
            fields
                .chunks(2)
                .find(|kv| matches!(&kv[0], redis::Value::BulkString(b) if b == name.as_bytes()))
                .map(|kv| kv[1].clone())
        };
        if get("name").is_some_and(|n| matches!(n, redis::Value::BulkString(b) if b == b"workers")) {
            // go-redis reads a NULL lag as 0.
            return get("lag").and_then(|v| redis_value_u64(&v)).unwrap_or(0) as f64;
        }
    }
    redis::cmd("XLEN").arg(stream).query::<u64>(c).unwrap() as f64
}

/// KEDA's `pendingEntriesCount` metric: XPENDING's count.
fn keda_pending(c: &mut redis::Connection, stream: &str) -> f64 {
    let reply: redis::Value = redis::cmd("XPENDING").arg(stream).arg("workers").query(c).unwrap();
    match reply {
        redis::Value::Array(a) => a.first().and_then(redis_value_u64).unwrap_or(0) as f64,
        _ => 0.0,
    }
}

/// KEDA's `metrics-api` metric: None when the endpoint fails (the trigger
/// is then not active and has no metric).
fn keda_api(addr: Option<&str>, path: &str, location: &str) -> Option<f64> {
    let (status, body) = http_get(addr?, path);
    if status != 200 {
        return None;
    }
    let doc: Value = serde_json::from_str(&body).ok()?;
    location.split('.').try_fold(&doc, |v, k| v.get(k))?.as_f64()
}

struct Pod {
    run: Running,
    consumer: String,
    terminated_at: Option<Instant>,
}

/// Worker processes as the Deployment's replicas, sized by the simulated KEDA.
struct Fleet<'a> {
    redis: &'a RedisServer,
    conn: redis::Connection,
    pods: Vec<Pod>,
    next_pod: u32,
    replicas: u32,
    last_active: Option<Instant>,
    /// When a lag or pending trigger was last active.
    last_stream_active: Option<Instant>,
    /// Exited workers' stderr.
    exited: Vec<String>,
    /// Pods SIGTERMed while they held calls in flight (their pending entries).
    terminated_with_calls: u64,
    /// Polls that left no worker while work was left (after the first poll).
    zero_with_work: u32,
    /// Polls that kept a worker only through the scaler's metric: no lag
    /// or pending trigger active for longer than the cooldown.
    only_scaler_saw: u32,
    log: Vec<String>,
}

impl<'a> Fleet<'a> {
    fn new(redis: &'a RedisServer) -> Fleet<'a> {
        Fleet {
            redis,
            conn: redis.conn(),
            pods: Vec::new(),
            next_pod: 0,
            replicas: 0,
            last_active: None,
            last_stream_active: None,
            exited: Vec::new(),
            terminated_with_calls: 0,
            zero_with_work: 0,
            only_scaler_saw: 0,
            log: Vec::new(),
        }
    }

    /// Tasks in the streams (queued and pending) and retries waiting: the
    /// work left, read by the test itself.
    fn work_left(&mut self) -> u64 {
        (0..PARTITIONS)
            .map(|p| {
                let len: u64 = redis::cmd("XLEN")
                    .arg(keys::stream(JOB, p))
                    .query(&mut self.conn)
                    .unwrap();
                let delayed: u64 = redis::cmd("ZCARD")
                    .arg(keys::delayed(JOB, p))
                    .query(&mut self.conn)
                    .unwrap();
                len + delayed
            })
            .sum()
    }

    fn finished(&self) -> u64 {
        self.redis.hlen_sum(JOB, keys::results) + self.redis.hlen_sum(JOB, keys::review)
    }

    /// Calls in flight of one consumer (its pending entries).
    fn pending_of(&mut self, consumer: &str) -> u64 {
        (0..PARTITIONS)
            .map(|p| {
                let reply: redis::Value = redis::cmd("XPENDING")
                    .arg(keys::stream(JOB, p))
                    .arg("workers")
                    .arg("-")
                    .arg("+")
                    .arg(10_000)
                    .arg(consumer)
                    .query(&mut self.conn)
                    .unwrap();
                match reply {
                    redis::Value::Array(a) => a.len() as u64,
                    _ => 0,
                }
            })
            .sum()
    }

    fn reap(&mut self) {
        let mut i = 0;
        while i < self.pods.len() {
            if let Ok(Some(_)) = self.pods[i].run.child.try_wait() {
                let pod = self.pods.remove(i);
                let (_, err) = pod.run.finish(Duration::from_secs(5));
                self.exited.push(err);
            } else {
                i += 1;
            }
        }
    }

    /// One polling round of KEDA and the HPA, then the pods to match.
    fn poll(&mut self, chart: &Chart, scaler: Option<&str>, sim: &LlmSim, first: bool) {
        self.reap();
        let metrics: Vec<Option<f64>> = chart
            .triggers
            .iter()
            .map(|t| match &t.metric {
                Metric::Lag(s) => Some(keda_lag(&mut self.conn, s)),
                Metric::Pending(s) => Some(keda_pending(&mut self.conn, s)),
                Metric::Api { path, location } => keda_api(scaler, path, location),
            })
            .collect();
        let active = chart
            .triggers
            .iter()
            .zip(&metrics)
            .any(|(t, m)| m.is_some_and(|m| m > t.activation));
        let now = Instant::now();
        let stream_active = chart
            .triggers
            .iter()
            .zip(&metrics)
            .any(|(t, m)| !matches!(t.metric, Metric::Api { .. }) && m.is_some_and(|m| m > t.activation));
        if stream_active {
            self.last_stream_active = Some(now);
        }
        // A failing trigger keeps KEDA from scaling to zero.
        let failing = metrics.iter().any(Option::is_none);
        // The HPA: each metric proposes ceil(metric / target) unless within
        // 10% of the current size; the largest proposal wins.
        let hpa = |current: u32| {
            let current = current.max(1);
            let proposal = chart
                .triggers
                .iter()
                .zip(&metrics)
                .filter_map(|(t, m)| {
                    let m = (*m)?;
                    let ratio = m / (t.target * f64::from(current));
                    Some(if (ratio - 1.0).abs() <= 0.1 {
                        current
                    } else {
                        (m / t.target).ceil() as u32
                    })
                })
                .max()
                .unwrap_or(1);
            proposal.clamp(chart.min.max(1), chart.max)
        };
        if active {
            self.last_active = Some(now);
            self.replicas = hpa(self.replicas);
        } else if self.replicas > 0 {
            let cooled = !failing && self.last_active.is_none_or(|t| now.duration_since(t) >= chart.cooldown);
            self.replicas = if cooled { chart.min } else { hpa(self.replicas) };
        }
        let work = self.work_left();
        let streams_cooled = self
            .last_stream_active
            .is_none_or(|t| now.duration_since(t) > chart.cooldown);
        if work > 0 && streams_cooled && self.replicas > 0 {
            self.only_scaler_saw += 1;
        }
        if work > 0 && self.replicas == 0 && !first {
            self.zero_with_work += 1;
        }
        self.log.push(format!(
            "active={active} replicas={} work_left={work} metrics={metrics:?}",
            self.replicas
        ));
        self.converge(chart, sim);
    }

    fn converge(&mut self, chart: &Chart, sim: &LlmSim) {
        let live = |pods: &[Pod]| pods.iter().filter(|p| p.terminated_at.is_none()).count() as u32;
        while live(&self.pods) < self.replicas {
            let consumer = format!("pod-{}", self.next_pod);
            self.next_pod += 1;
            let mut cmd = worker_cmd(self.redis, JOB, sim, &["--consumer", &consumer]);
            cmd.envs(chart.env.iter().map(|(k, v)| (k, v)));
            self.pods.push(Pod {
                run: Running::spawn(cmd),
                consumer,
                terminated_at: None,
            });
        }
        while live(&self.pods) > self.replicas {
            // The pod holding the most calls: the worst case for a scale-down.
            let mut held: Vec<(usize, u64)> = Vec::new();
            for i in 0..self.pods.len() {
                if self.pods[i].terminated_at.is_none() {
                    let consumer = self.pods[i].consumer.clone();
                    held.push((i, self.pending_of(&consumer)));
                }
            }
            let (i, calls) = held.into_iter().max_by_key(|&(i, n)| (n, i)).unwrap();
            self.terminated_with_calls += calls;
            signal(self.pods[i].run.pid(), "TERM");
            self.pods[i].terminated_at = Some(Instant::now());
        }
        for pod in &self.pods {
            if pod.terminated_at.is_some_and(|t| t.elapsed() > chart.grace) {
                signal(pod.run.pid(), "KILL");
            }
        }
    }

    /// Polls until `done` holds (true) or `within` passes (false).
    fn drive(
        &mut self,
        chart: &Chart,
        scaler: Option<&str>,
        sim: &LlmSim,
        within: Duration,
        mut done: impl FnMut(&mut Fleet) -> bool,
    ) -> bool {
        let start = Instant::now();
        let mut first = true;
        loop {
            self.poll(chart, scaler, sim, first);
            first = false;
            if done(self) {
                return true;
            }
            if start.elapsed() > within {
                return false;
            }
            std::thread::sleep(chart.polling);
        }
    }

    /// A new chart takes over: its counters start again (the log goes on).
    fn next_phase(&mut self) {
        self.exited.clear();
        self.terminated_with_calls = 0;
        self.zero_with_work = 0;
        self.only_scaler_saw = 0;
        self.log.push("--- the chart as it is now".into());
    }

    /// Retries waiting in the job's delayed sets.
    fn delayed(&mut self) -> u64 {
        (0..PARTITIONS)
            .map(|p| {
                redis::cmd("ZCARD")
                    .arg(keys::delayed(JOB, p))
                    .query::<u64>(&mut self.conn)
                    .unwrap()
            })
            .sum()
    }

    /// Under a chart that cannot see the work left: the fleet scales to
    /// zero with work left.
    fn scale_to_zero_with_work(&mut self, chart: &Chart, sim: &LlmSim) {
        let stalled = self.drive(chart, None, sim, Duration::from_secs(30), |f| f.idle_with_work());
        assert!(
            stalled,
            "the lag-only chart was expected to scale to zero:\n{}",
            self.history()
        );
    }

    /// Then nothing moves for `hold` and after (no worker comes back, nothing
    /// finishes). Returns the records finished.
    fn stays_stalled(&mut self, chart: &Chart, sim: &LlmSim, hold: Duration) -> u64 {
        let finished = self.finished();
        std::thread::sleep(hold);
        assert!(!self.drive(chart, None, sim, Duration::from_secs(2), |f| f.replicas > 0));
        assert_eq!(self.finished(), finished, "stalled: nothing finishes with no worker");
        finished
    }

    /// Under the chart as it is (and the scaler at `addr`): the job finishes
    /// and the fleet scales to zero, never leaving work without a worker.
    fn finishes(&mut self, chart: &Chart, addr: &str, sim: &LlmSim, records: u64) {
        self.next_phase();
        let done = self.drive(chart, Some(addr), sim, Duration::from_secs(120), |f| {
            f.finished() == records && f.replicas == 0 && f.pods.is_empty()
        });
        assert!(done, "the job did not finish and scale to zero:\n{}", self.history());
        assert_eq!(
            self.zero_with_work,
            0,
            "no worker while work was left:\n{}",
            self.history()
        );
    }

    fn idle_with_work(&mut self) -> bool {
        self.replicas == 0 && self.pods.is_empty() && self.work_left() > 0
    }

    fn history(&self) -> String {
        self.log.join("\n")
    }
}

/// The scaler on a free port, for the chart's `metrics-api` trigger.
fn start_scaler(redis: &RedisServer) -> (Running, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let mut cmd = std::process::Command::new(bin("scaler"));
    cmd.args([
        "--redis",
        &redis.url(),
        "--job",
        JOB,
        "--bind",
        &addr,
        "--max-sleep-ms",
        "500",
        "--log-format",
        "json",
    ])
    .env_remove("REDIS_URL");
    let run = Running::spawn(cmd);
    harness::wait_for("the scaler", Duration::from_secs(10), || {
        std::net::TcpStream::connect(&addr).is_ok() && http_get(&addr, "/readyz").0 == 200
    });
    (run, addr)
}

fn report(redis: &RedisServer) -> Value {
    let out = producer(&["report", "--job", JOB, "--redis", &redis.url(), "--json"]);
    assert!(out.status.success(), "{}", harness::stderr(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn assert_complete(redis: &RedisServer, records: u64, sims: &[&LlmSim]) -> Value {
    let (_, s) = status_json(redis, JOB);
    assert_eq!(s["complete"], true, "{s}");
    for k in ["missing", "duplicates", "unknown"] {
        assert_eq!(s[k], 0, "{k}: {s}");
    }
    assert_eq!(
        s["done"].as_u64().unwrap() + s["review"].as_u64().unwrap(),
        records,
        "{s}"
    );
    // Every answer the provider generated is in the cost ledger (beside
    // the calls with estimated tokens: cut off, timed out).
    let r = report(redis);
    let answered: u64 = sims.iter().map(|s| s.stats()["served"].as_u64().unwrap()).sum();
    let t = &r["total"];
    assert_eq!(
        t["calls"].as_u64().unwrap() - t["estimated_calls"].as_u64().unwrap(),
        answered,
        "{r}"
    );
    assert_eq!(r["paid_answers_lost"], 0, "{r}");
    r
}

#[test]
fn slow_calls_with_no_lag_keep_their_workers_and_a_scale_down_never_cuts_a_call() {
    let redis = RedisServer::start();
    let dir = TempDir::new("autoscale-slow");
    let spec = spec_with(&dir, &[("timeout_secs = 30", "timeout_secs = 10")]);
    let data = dir.join("data.jsonl");
    let records = 8;
    write_records(&data, 0, records);
    enqueue(&redis, &data, JOB, &spec);
    let chart_args = |concurrency: &str| {
        vec![
            "jobs[0].providerTimeoutSeconds=10".to_owned(),
            "worker.drainTimeoutSeconds=15".to_owned(),
            "worker.terminationGracePeriodSeconds=20".to_owned(),
            "worker.visibilityTimeoutMs=11000".to_owned(),
            format!("worker.concurrency={concurrency}"),
            "autoscaling.keda.pollingInterval=1".to_owned(),
            "autoscaling.keda.cooldownPeriod=2".to_owned(),
            "autoscaling.keda.remainingPerWorker=2".to_owned(),
            "autoscaling.keda.maxReplicaCount=4".to_owned(),
        ]
    };
    let render_with = |concurrency: &str| {
        let sets = chart_args(concurrency);
        render(&sets.iter().map(String::as_str).collect::<Vec<_>>())
    };

    // Before: calls of 8 s, lag 0 once they are all claimed (after the first
    // call proved the provider). Scaled to zero after the 2 s cooldown, the
    // worker drains 2 s and cuts its calls off; their tasks stay pending
    // with no worker to take them over.
    let slow = LlmSim::start(&["--latency-ms", "8000", "--steady-latency"]);
    let old = render_with("8").before_19("2");
    let mut fleet = Fleet::new(&redis);
    fleet.scale_to_zero_with_work(&old, &slow);
    let finished = fleet.stays_stalled(&old, &slow, Duration::from_secs(3));
    let cut: u64 = fleet
        .exited
        .iter()
        .map(|log| {
            worker_summary(log).expect("summary")["calls_abandoned"]
                .as_u64()
                .unwrap()
        })
        .sum();
    // The first call proved the provider before the others went out; every
    // call still running was cut off.
    assert!(
        cut > 0 && cut == records - finished,
        "calls in flight were cut off at the short drain ({cut} of {}):\n{}",
        records - finished,
        fleet.history()
    );

    // Now: the pending trigger keeps workers while calls are in flight, the
    // drain covers the provider timeout. Calls take 0.4, 3 or 6 s in turn:
    // any four of the seven include two that end seconds apart, so the HPA
    // scales down while other calls are still running, whatever order the
    // pods send them in.
    let varied = LlmSim::start(&["--latency-cycle-ms", "400,3000,6000"]);
    let now = render_with("2");
    assert!(now.scaler && now.triggers.len() == 2 * PARTITIONS as usize + 1);
    let (mut scaler, addr) = start_scaler(&redis);
    // The scaler sees the dead worker's tasks as in flight, from Redis alone.
    let (code, body) = http_get(&addr, &format!("/remaining?job={JOB}"));
    let left: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(code, 200, "{body}");
    assert_eq!(left["in_flight"], cut, "{left}");
    assert_eq!(left["remaining"], cut, "{left}");
    assert_eq!(
        left["jobs"][JOB]["partitions"].as_array().unwrap().len(),
        PARTITIONS as usize
    );
    fleet.finishes(&now, &addr, &varied, records);
    assert!(
        fleet.terminated_with_calls > 0,
        "a scale-down came while the pod held calls:\n{}",
        fleet.history()
    );
    for log in &fleet.exited {
        let s = worker_summary(log).expect("summary");
        assert_eq!(s["abandoned"], 0, "{s}");
        assert_eq!(s["calls_abandoned"], 0, "{s}");
    }
    let r = assert_complete(&redis, records, &[&slow, &varied]);
    // The calls cut off before are paid without a result, estimated: never dropped.
    let paid = &r["spend"]["by_bucket"]["no_result"];
    assert_eq!(paid["calls"], cut, "{r}");
    assert!(r["spend"]["estimated_calls"].as_u64().unwrap() >= cut, "{r}");
    assert!(paid["cost_usd"].as_f64().unwrap() > 0.0, "{r}");
    signal(scaler.pid(), "TERM");
    let status = harness::wait_exit(&mut scaler.child, Duration::from_secs(10));
    assert!(status.success(), "the scaler stops on SIGTERM");
}

#[test]
fn a_retry_tail_longer_than_the_cooldown_keeps_a_worker_and_due_retries_are_promoted() {
    let redis = RedisServer::start();
    let dir = TempDir::new("autoscale-retries");
    // Every retry waits 4 s: longer than the 2 s cooldown.
    let spec = spec_with(
        &dir,
        &[
            ("base_delay_ms = 500", "base_delay_ms = 4000"),
            ("max_delay_ms = 30000", "max_delay_ms = 4000"),
            ("jitter = \"full\"", "jitter = \"none\""),
        ],
    );
    let data = dir.join("data.jsonl");
    let records = 40;
    write_records(&data, 0, records);
    enqueue(&redis, &data, JOB, &spec);
    let sim = LlmSim::start(&["--faults", "server_error=0.4", "--seed", "11"]);
    let sets = [
        "worker.concurrency=8",
        "autoscaling.keda.pollingInterval=1",
        "autoscaling.keda.cooldownPeriod=2",
    ];

    // Before: once every record is done or waiting to retry, lag and pending
    // are 0; scaled to zero, nobody promotes the retries when they come due.
    let old = render(&sets).before_19("25");
    let mut fleet = Fleet::new(&redis);
    fleet.scale_to_zero_with_work(&old, &sim);
    let waiting = fleet.delayed();
    assert!(waiting > 0, "retries wait in the delayed sets:\n{}", fleet.history());
    // Past every retry's due time (4 s), nothing moves.
    fleet.stays_stalled(&old, &sim, Duration::from_secs(4));
    let still = fleet.delayed();
    assert_eq!(
        still, waiting,
        "due retries stay in the delayed sets: nobody promotes them"
    );

    // Now: the scaler promotes the due retries at once (lag again) and its
    // work left (delayed included) keeps a worker through the retry waits.
    let chart = render(&sets);
    let (scaler, addr) = start_scaler(&redis);
    // Promoted at once: the stalled retries are queued again.
    let (_, body) = http_get(&addr, "/remaining");
    let left: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(left["queued"], waiting, "{left}");
    assert_eq!(left["delayed"], 0, "{left}");
    assert_eq!(http_get(&addr, "/remaining?job=nope").0, 404);
    fleet.finishes(&chart, &addr, &sim, records);
    assert!(
        fleet.only_scaler_saw > 0,
        "a retry wait that only the scaler's metric saw kept the worker:\n{}",
        fleet.history()
    );
    let (_, metrics) = http_get(&addr, "/metrics");
    let promoted: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix(&format!("batchfleet_scaler_promoted_total{{job=\"{JOB}\"}} ")))
        .map(|n| n.parse().unwrap())
        .unwrap_or(0);
    assert!(
        promoted >= waiting,
        "the scaler promoted the stalled retries: {metrics}"
    );
    assert!(
        metrics.contains(&format!("batchfleet_remaining_work{{job=\"{JOB}\"}} 0")),
        "{metrics}"
    );
    assert_complete(&redis, records, &[&sim]);
    drop(scaler);
}

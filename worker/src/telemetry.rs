//! Metrics, declared once, with bounded labels (outcome, error code, field,
//! job, partition — never record ids). Counters end in `_total`, durations are
//! `_seconds` histograms with explicit buckets. Queue gauges are read from
//! Redis at scrape time and cached briefly.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::store::RedisStore;
use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

/// Model latencies: from fast cached answers to long generations.
const LATENCY_BUCKETS: &[f64] = &[0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0];
/// Waits for the fleet's rate-limit budget.
const WAIT_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
/// How long queue gauges read from Redis are reused.
const QUEUE_CACHE: Duration = Duration::from_secs(2);

pub struct Metrics {
    registry: Registry,
    pub records: IntCounterVec,
    pub attempts: IntCounterVec,
    pub validation_errors: IntCounterVec,
    pub provider_requests: IntCounterVec,
    pub model_latency: HistogramVec,
    pub rate_limit_wait: Histogram,
    pub rate_limited: IntCounterVec,
    pub tokens: IntCounterVec,
    pub cost: prometheus::CounterVec,
    pub in_flight: IntGauge,
    pub halted: IntGaugeVec,
    pub store_errors: prometheus::IntCounter,
    queue_lag: IntGaugeVec,
    queue_pending: IntGaugeVec,
    queue_oldest_pending: GaugeVec,
    queue_delayed: IntGaugeVec,
    queue_review: IntGaugeVec,
    /// Batch mode: records held by provider batch shards, and the shards by state.
    queue_batched: IntGaugeVec,
    batch_shards: IntGaugeVec,
    last_queue_read: Mutex<Option<Instant>>,
    pub up: Gauge,
    /// The spec's limits per job, so dashboards can draw usage against them.
    pub limit_per_minute: IntGaugeVec,
    /// The limits the fleet learned from bare 429s, while it has them.
    limit_learned: GaugeVec,
    /// Result rows new in the sink, and the sink's errors by cause.
    pub sink_written: IntCounterVec,
    pub sink_errors: IntCounterVec,
    /// Outcomes and paid calls in Redis not yet in the sink (sink stream entries).
    sink_lag: IntGaugeVec,
    /// What the job spent (the ledger), its cap and what is reserved in flight.
    spend_usd: GaugeVec,
    /// 1 while the job is halted on its budget.
    halted_on_budget: IntGaugeVec,
    /// 0 while the job's provider is taken for down (fleet-wide), and since when.
    provider_up: IntGaugeVec,
    provider_down_since: GaugeVec,
    /// Log lines dropped because standard error was closed or full.
    log_lines_dropped: prometheus::IntCounter,
}

/// A job as the metrics endpoint watches it.
#[derive(Debug, Clone)]
pub struct Watched {
    pub job: String,
    pub partitions: u32,
    /// Its limiter's id (the provider key/model budget).
    pub limiter: Option<String>,
}

fn counter(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    registry.register(Box::new(c.clone())).expect("metric registered once");
    c
}

fn gauge(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
    registry.register(Box::new(g.clone())).expect("metric registered once");
    g
}

impl Metrics {
    #[allow(clippy::expect_used)] // static metric definitions: a failure is a programming error
    pub fn new() -> Metrics {
        let r = Registry::new();
        let p = "batchfleet_";
        let model_latency = HistogramVec::new(
            HistogramOpts::new(
                format!("{p}model_latency_seconds"),
                "Time of one model call, by outcome class.",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["job", "result"],
        )
        .expect("valid metric");
        r.register(Box::new(model_latency.clone()))
            .expect("metric registered once");
        let rate_limit_wait = Histogram::with_opts(
            HistogramOpts::new(
                format!("{p}rate_limit_wait_seconds"),
                "Time the claim loop waited for the fleet's rate-limit budget.",
            )
            .buckets(WAIT_BUCKETS.to_vec()),
        )
        .expect("valid metric");
        r.register(Box::new(rate_limit_wait.clone()))
            .expect("metric registered once");
        let cost = prometheus::CounterVec::new(
            Opts::new(
                format!("{p}cost_usd_total"),
                "Cost of model calls in USD, from the spec's prices.",
            ),
            &["job"],
        )
        .expect("valid metric");
        r.register(Box::new(cost.clone())).expect("metric registered once");
        let in_flight = IntGauge::new(
            format!("{p}in_flight_requests"),
            "Model calls in flight in this worker.",
        )
        .expect("valid metric");
        r.register(Box::new(in_flight.clone())).expect("metric registered once");
        let store_errors = prometheus::IntCounter::new(
            format!("{p}store_errors_total"),
            "Redis calls that failed (then retried).",
        )
        .expect("valid metric");
        r.register(Box::new(store_errors.clone()))
            .expect("metric registered once");
        let queue_oldest_pending = GaugeVec::new(
            Opts::new(
                format!("{p}queue_oldest_pending_age_seconds"),
                "Idle time of the oldest delivered, unacknowledged task.",
            ),
            &["job", "partition"],
        )
        .expect("valid metric");
        r.register(Box::new(queue_oldest_pending.clone()))
            .expect("metric registered once");
        let up = Gauge::new(format!("{p}worker_up"), "1 while this worker runs.").expect("valid metric");
        r.register(Box::new(up.clone())).expect("metric registered once");
        up.set(1.0);
        Metrics {
            records: counter(
                &r,
                &format!("{p}records_total"),
                "Records settled by this worker, by outcome.",
                &["job", "outcome"],
            ),
            attempts: counter(
                &r,
                &format!("{p}attempts_total"),
                "Model attempts, by outcome.",
                &["job", "outcome"],
            ),
            validation_errors: counter(
                &r,
                &format!("{p}validation_errors_total"),
                "Validation errors of model outputs, by error code and field.",
                &["job", "code", "field"],
            ),
            provider_requests: counter(
                &r,
                &format!("{p}provider_requests_total"),
                "Requests to the model provider, by HTTP status class (2xx, 4xx, 429, 5xx, none).",
                &["job", "status_class"],
            ),
            rate_limited: counter(
                &r,
                &format!("{p}rate_limited_total"),
                "429 rate_limit_exceeded answers from the provider.",
                &["job"],
            ),
            tokens: counter(
                &r,
                &format!("{p}tokens_total"),
                "Tokens reported by the provider, by kind.",
                &["job", "kind"],
            ),
            provider_up: gauge(
                &r,
                &format!("{p}provider_up"),
                "0 while the job's provider fails every call fleet-wide (only probes are sent), else 1.",
                &["job"],
            ),
            provider_down_since: {
                let g = GaugeVec::new(
                    Opts::new(
                        format!("{p}provider_down_since_seconds"),
                        "Unix time the job's provider began failing every call (0 while it answers).",
                    ),
                    &["job"],
                )
                .expect("valid metric");
                r.register(Box::new(g.clone())).expect("metric registered once");
                g
            },
            log_lines_dropped: {
                let c = prometheus::IntCounter::new(
                    format!("{p}log_lines_dropped_total"),
                    "Log lines dropped because standard error was closed or full (logging never stalls a worker).",
                )
                .expect("valid metric");
                r.register(Box::new(c.clone())).expect("metric registered once");
                c
            },
            halted: gauge(
                &r,
                &format!("{p}halted"),
                "1 while the job's fleet is halted (circuit breaker open).",
                &["job"],
            ),
            queue_lag: gauge(
                &r,
                &format!("{p}queue_lag"),
                "Tasks in the stream not yet delivered to a worker.",
                &["job", "partition"],
            ),
            queue_pending: gauge(
                &r,
                &format!("{p}queue_pending"),
                "Tasks delivered and not yet acknowledged.",
                &["job", "partition"],
            ),
            queue_delayed: gauge(
                &r,
                &format!("{p}queue_delayed"),
                "Tasks waiting to retry.",
                &["job", "partition"],
            ),
            queue_review: gauge(
                &r,
                &format!("{p}review_depth"),
                "Entries in the review queue.",
                &["job", "partition"],
            ),
            queue_batched: gauge(
                &r,
                &format!("{p}queue_batched"),
                "Batch mode: tasks held by provider batch shards (submitted, or on their way).",
                &["job", "partition"],
            ),
            batch_shards: gauge(
                &r,
                &format!("{p}batch_shards"),
                "Batch mode: the job's shards by state (packed, uploaded, submitting, submitted, ended, reconciled).",
                &["job", "state"],
            ),
            queue_oldest_pending,
            model_latency,
            rate_limit_wait,
            cost,
            in_flight,
            store_errors,
            last_queue_read: Mutex::new(None),
            limit_per_minute: gauge(
                &r,
                &format!("{p}limit_per_minute"),
                "The job spec's fleet-wide limit per minute, by kind (requests, tokens, input_tokens, output_tokens).",
                &["job", "kind"],
            ),
            spend_usd: {
                let g = GaugeVec::new(
                    Opts::new(
                        format!("{p}spend_usd"),
                        "USD by kind: spent (every paid call, from the cost ledger; only grows), \
                         budget (the job's cap, when it has one), in_flight (reserved against it).",
                    ),
                    &["job", "kind"],
                )
                .expect("valid metric");
                r.register(Box::new(g.clone())).expect("metric registered once");
                g
            },
            halted_on_budget: gauge(
                &r,
                &format!("{p}halted_on_budget"),
                "1 while the job is halted because its next call could pass its budget (producer resume --budget).",
                &["job"],
            ),
            limit_learned: {
                let g = GaugeVec::new(
                    Opts::new(
                        format!("{p}limit_learned"),
                        "A limit the fleet learned from the provider's bare 429s (AIMD), by kind \
                         (requests_per_minute, concurrency); absent while none is learned.",
                    ),
                    &["job", "kind"],
                )
                .expect("valid metric");
                r.register(Box::new(g.clone())).expect("metric registered once");
                g
            },
            sink_written: counter(
                &r,
                &format!("{p}sink_written_total"),
                "Result rows this worker wrote to the job's sink that were new there.",
                &["job"],
            ),
            sink_errors: counter(
                &r,
                &format!("{p}sink_errors_total"),
                "Failed sink writes, by cause (unreachable, refused, schema, rejected).",
                &["job", "cause"],
            ),
            sink_lag: gauge(
                &r,
                &format!("{p}sink_lag"),
                "Sink stream entries (committed outcomes and paid calls) not yet written to the job's sink.",
                &["job"],
            ),
            up,
            registry: r,
        }
    }

    /// Publishes a job's configured limits.
    pub fn set_limits(&self, job: &str, limits: &common::spec::Limits) {
        for (kind, v) in [
            ("requests", limits.requests_per_minute),
            ("tokens", limits.tokens_per_minute),
            ("input_tokens", limits.input_tokens_per_minute),
            ("output_tokens", limits.output_tokens_per_minute),
        ] {
            if let Some(v) = v {
                self.limit_per_minute.with_label_values(&[job, kind]).set(v as i64);
            }
        }
    }

    /// Reads the queue gauges from Redis unless they are fresh enough.
    pub async fn refresh_queues(&self, store: &RedisStore, jobs: &[Watched]) {
        let stale = self
            .last_queue_read
            .lock()
            .map(|t| t.is_none_or(|t| t.elapsed() >= QUEUE_CACHE))
            .unwrap_or(true);
        if !stale {
            return;
        }
        for Watched {
            job,
            partitions,
            limiter,
        } in jobs
        {
            if let Some(id) = limiter
                && let Ok(levels) = store.limit_levels(id).await
            {
                for (kind, key) in [
                    ("requests_per_minute", "learned_requests_per_minute"),
                    ("concurrency", "learned_concurrency"),
                ] {
                    match levels.get(key) {
                        Some(v) => self.limit_learned.with_label_values(&[job.as_str(), kind]).set(*v),
                        None => {
                            let _ = self.limit_learned.remove_label_values(&[job.as_str(), kind]);
                        }
                    }
                }
            }
            let mut by_state: std::collections::BTreeMap<&str, i64> = Default::default();
            for p in 0..*partitions {
                let Ok(q) = store.queue_stats(job, p).await else {
                    self.store_errors.inc();
                    continue;
                };
                let part = p.to_string();
                let labels = [job.as_str(), part.as_str()];
                self.queue_lag.with_label_values(&labels).set(q.lag as i64);
                self.queue_pending.with_label_values(&labels).set(q.pending as i64);
                self.queue_oldest_pending
                    .with_label_values(&labels)
                    .set(q.oldest_pending_ms as f64 / 1000.0);
                self.queue_delayed.with_label_values(&labels).set(q.delayed as i64);
                self.queue_review.with_label_values(&labels).set(q.review as i64);
                if let Ok(shards) = store.shards(job, p).await {
                    let mut held = 0;
                    for (_, s) in &shards {
                        *by_state.entry(s.state.name()).or_default() += 1;
                        if s.state != common::shard::ShardState::Reconciled {
                            held += store.shard_held(job, p, &s.id).await.unwrap_or(0);
                        }
                    }
                    if !shards.is_empty() {
                        self.queue_batched.with_label_values(&labels).set(held as i64);
                    }
                }
            }
            for (state, n) in &by_state {
                self.batch_shards.with_label_values(&[job.as_str(), state]).set(*n);
            }
            if let Ok(Some(backlog)) = store.sink_backlog(job, *partitions).await {
                self.sink_lag.with_label_values(&[job.as_str()]).set(backlog as i64);
            }
            let halt = store.halted(job).await.ok().flatten();
            self.halted
                .with_label_values(&[job.as_str()])
                .set(i64::from(halt.is_some()));
            if let Ok(o) = store.provider_outage(job).await {
                self.provider_up
                    .with_label_values(&[job.as_str()])
                    .set(i64::from(!o.down));
                let since = if o.down { o.since_ms as f64 / 1000.0 } else { 0.0 };
                self.provider_down_since.with_label_values(&[job.as_str()]).set(since);
            }
            let on_budget = halt.as_deref().is_some_and(|r| r.starts_with("budget"));
            self.halted_on_budget
                .with_label_values(&[job.as_str()])
                .set(i64::from(on_budget));
            if let Ok(spend) = store.spend(job, *partitions).await {
                self.spend_usd
                    .with_label_values(&[job.as_str(), "spent"])
                    .set(spend.totals.cost_usd);
            }
            if let Ok(b) = store.budget(job).await
                && let Some(cap) = b.cap_usd
            {
                self.spend_usd.with_label_values(&[job.as_str(), "budget"]).set(cap);
                self.spend_usd
                    .with_label_values(&[job.as_str(), "in_flight"])
                    .set(b.reserved_usd);
            }
        }
        if let Ok(mut t) = self.last_queue_read.lock() {
            *t = Some(Instant::now());
        }
    }

    /// The exposition in Prometheus text format.
    pub fn encode(&self) -> String {
        let dropped = common::log::dropped();
        self.log_lines_dropped
            .inc_by(dropped.saturating_sub(self.log_lines_dropped.get()));
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// The status class label of a provider answer.
pub fn status_class(status: Option<u16>) -> &'static str {
    match status {
        None => "none",
        Some(429) => "429",
        Some(s) if s < 300 => "2xx",
        Some(s) if s < 500 => "4xx",
        Some(_) => "5xx",
    }
}

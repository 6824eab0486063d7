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
    /// Responses whose bytes the sink did not take at once (kept inline).
    pub raw_inline: IntCounterVec,
    /// Each field's (and rule's) failure rate in this worker's drift
    /// window and before it, and the drift alarms that halted the job.
    pub drift_failure_ratio: GaugeVec,
    /// The planner's figures of a job with tiers or a fallback (see [`crate::plan`]).
    pub plan: GaugeVec,
    pub drift_alarms: IntCounterVec,
    /// Outcomes and paid calls in Redis not yet in the sink (sink stream entries).
    sink_lag: IntGaugeVec,
    /// What the job spent (the ledger), its cap and what is reserved in flight.
    spend_usd: GaugeVec,
    /// 1 while the job is halted on its budget.
    halted_on_budget: IntGaugeVec,
    /// 1 while the job is halted on a quality drift alarm.
    halted_on_drift: IntGaugeVec,
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

/// Declares metrics in one registry, their names prefixed `batchfleet_`.
struct Declare(Registry);

#[allow(clippy::expect_used)] // static metric definitions: a failure is a programming error
impl Declare {
    fn add<M: prometheus::core::Collector + Clone + 'static>(&self, metric: prometheus::Result<M>) -> M {
        let metric = metric.expect("valid metric");
        self.0
            .register(Box::new(metric.clone()))
            .expect("metric registered once");
        metric
    }

    fn counter(&self, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
        self.add(IntCounterVec::new(opts(name, help), labels))
    }

    fn gauge(&self, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
        self.add(IntGaugeVec::new(opts(name, help), labels))
    }

    /// A gauge of fractional values (seconds, dollars, learned rates).
    fn real_gauge(&self, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
        self.add(GaugeVec::new(opts(name, help), labels))
    }
}

fn opts(name: &str, help: &str) -> Opts {
    Opts::new(format!("batchfleet_{name}"), help)
}

fn histogram(name: &str, help: &str, buckets: &[f64]) -> HistogramOpts {
    HistogramOpts::from(opts(name, help)).buckets(buckets.to_vec())
}

impl Metrics {
    pub fn new() -> Metrics {
        let d = Declare(Registry::new());
        let up = d.add(Gauge::with_opts(opts("worker_up", "1 while this worker runs.")));
        up.set(1.0);
        let job = &["job"][..];
        let partition = &["job", "partition"][..];
        Metrics {
            records: d.counter(
                "records_total",
                "Records settled by this worker, by outcome.",
                &["job", "outcome"],
            ),
            attempts: d.counter("attempts_total", "Model attempts, by outcome.", &["job", "outcome"]),
            validation_errors: d.counter(
                "validation_errors_total",
                "Validation errors of model outputs, by error code and field.",
                &["job", "code", "field"],
            ),
            provider_requests: d.counter(
                "provider_requests_total",
                "Requests to the model provider, by HTTP status class (2xx, 4xx, 429, 5xx, none).",
                &["job", "status_class"],
            ),
            model_latency: d.add(HistogramVec::new(
                histogram(
                    "model_latency_seconds",
                    "Time of one model call, by outcome class.",
                    LATENCY_BUCKETS,
                ),
                &["job", "result"],
            )),
            rate_limit_wait: d.add(Histogram::with_opts(histogram(
                "rate_limit_wait_seconds",
                "Time the claim loop waited for the fleet's rate-limit budget.",
                WAIT_BUCKETS,
            ))),
            rate_limited: d.counter(
                "rate_limited_total",
                "429 rate_limit_exceeded answers from the provider.",
                job,
            ),
            tokens: d.counter(
                "tokens_total",
                "Tokens reported by the provider, by kind.",
                &["job", "kind"],
            ),
            cost: d.add(prometheus::CounterVec::new(
                opts("cost_usd_total", "Cost of model calls in USD, from the spec's prices."),
                job,
            )),
            in_flight: d.add(IntGauge::with_opts(opts(
                "in_flight_requests",
                "Model calls in flight in this worker.",
            ))),
            halted: d.gauge(
                "halted",
                "1 while the job's fleet is halted (circuit breaker open).",
                job,
            ),
            store_errors: d.add(prometheus::IntCounter::with_opts(opts(
                "store_errors_total",
                "Redis calls that failed (then retried).",
            ))),
            queue_lag: d.gauge(
                "queue_lag",
                "Tasks in the stream not yet delivered to a worker.",
                partition,
            ),
            queue_pending: d.gauge("queue_pending", "Tasks delivered and not yet acknowledged.", partition),
            queue_oldest_pending: d.real_gauge(
                "queue_oldest_pending_age_seconds",
                "Idle time of the oldest delivered, unacknowledged task.",
                partition,
            ),
            queue_delayed: d.gauge("queue_delayed", "Tasks waiting to retry.", partition),
            queue_review: d.gauge("review_depth", "Entries in the review queue.", partition),
            queue_batched: d.gauge(
                "queue_batched",
                "Batch mode: tasks held by provider batch shards (submitted, or on their way).",
                partition,
            ),
            batch_shards: d.gauge(
                "batch_shards",
                "Batch mode: the job's shards by state (packed, uploaded, submitting, submitted, ended, reconciled).",
                &["job", "state"],
            ),
            last_queue_read: Mutex::new(None),
            limit_per_minute: d.gauge(
                "limit_per_minute",
                "The job spec's fleet-wide limit per minute, by kind (requests, tokens, input_tokens, output_tokens).",
                &["job", "kind"],
            ),
            limit_learned: d.real_gauge(
                "limit_learned",
                "A limit the fleet learned from the provider's bare 429s (AIMD), by kind \
                 (requests_per_minute, concurrency); absent while none is learned.",
                &["job", "kind"],
            ),
            sink_written: d.counter(
                "sink_written_total",
                "Result rows this worker wrote to the job's sink that were new there.",
                job,
            ),
            sink_errors: d.counter(
                "sink_errors_total",
                "Failed sink writes, by cause (unreachable, refused, schema, rejected).",
                &["job", "cause"],
            ),
            raw_inline: d.counter(
                "raw_inline_total",
                "Provider responses (or batch files) whose bytes the job's sink did not take at once for the audit trail: \
                 a response's go inline into the record's history (and with it into the sink).",
                job,
            ),
            drift_failure_ratio: d.real_gauge(
                "drift_failure_ratio",
                "Share of this worker's recent validated answers (over=window: the drift window; over=before: \
                 every earlier one) that failed on the field or rule (field=rule:<name>).",
                &["job", "field", "over"],
            ),
            plan: d.real_gauge(
                "plan",
                "The planner's figures of a job with tiers or a fallback, as this worker holds them: \
                 standard_share (share of online calls sent standard), flex_acceptance (share of flex calls \
                 the provider took), batch (1: records go into batch shards), fallback (1: the fallback takes \
                 calls beyond the provider's limits), deadline_left_seconds.",
                &["job", "figure"],
            ),
            drift_alarms: d.counter(
                "drift_alarms_total",
                "Quality drift alarms: a field or rule failing far more often than before; each halted the job.",
                &["job", "field"],
            ),
            sink_lag: d.gauge(
                "sink_lag",
                "Sink stream entries (committed outcomes and paid calls) not yet written to the job's sink.",
                job,
            ),
            spend_usd: d.real_gauge(
                "spend_usd",
                "USD by kind: spent (every paid call, from the cost ledger; only grows), \
                 budget (the job's cap, when it has one), in_flight (reserved against it).",
                &["job", "kind"],
            ),
            halted_on_budget: d.gauge(
                "halted_on_budget",
                "1 while the job is halted because its next call could pass its budget (producer resume --budget).",
                job,
            ),
            halted_on_drift: d.gauge(
                "halted_on_drift",
                "1 while the job is halted because a field or rule fails far more often than before ([drift]; producer resume goes on).",
                job,
            ),
            provider_up: d.gauge(
                "provider_up",
                "0 while the job's provider fails every call fleet-wide (only probes are sent), else 1.",
                job,
            ),
            provider_down_since: d.real_gauge(
                "provider_down_since_seconds",
                "Unix time the job's provider began failing every call (0 while it answers).",
                job,
            ),
            log_lines_dropped: d.add(prometheus::IntCounter::with_opts(opts(
                "log_lines_dropped_total",
                "Log lines dropped because standard error was closed or full (logging never stalls a worker).",
            ))),
            up,
            registry: d.0,
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
        for w in jobs {
            if let Some(id) = &w.limiter {
                self.refresh_learned(store, &w.job, id).await;
            }
            self.refresh_partitions(store, w).await;
            self.refresh_job(store, w).await;
        }
        if let Ok(mut t) = self.last_queue_read.lock() {
            *t = Some(Instant::now());
        }
    }

    /// The limits the job's limiter learned from bare 429s (absent: none).
    async fn refresh_learned(&self, store: &RedisStore, job: &str, limiter: &str) {
        let Ok(levels) = store.limit_levels(limiter).await else {
            return;
        };
        for (kind, key) in [
            ("requests_per_minute", "learned_requests_per_minute"),
            ("concurrency", "learned_concurrency"),
        ] {
            match levels.get(key) {
                Some(v) => self.limit_learned.with_label_values(&[job, kind]).set(*v),
                None => {
                    let _ = self.limit_learned.remove_label_values(&[job, kind]);
                }
            }
        }
    }

    /// Each partition's queue, and the batch shards by state.
    async fn refresh_partitions(&self, store: &RedisStore, w: &Watched) {
        let job = w.job.as_str();
        let mut by_state: std::collections::BTreeMap<&str, i64> = Default::default();
        for p in 0..w.partitions {
            let Ok(q) = store.queue_stats(job, p).await else {
                self.store_errors.inc();
                continue;
            };
            let part = p.to_string();
            let labels = [job, part.as_str()];
            self.queue_lag.with_label_values(&labels).set(q.lag as i64);
            self.queue_pending.with_label_values(&labels).set(q.pending as i64);
            self.queue_oldest_pending
                .with_label_values(&labels)
                .set(q.oldest_pending_ms as f64 / 1000.0);
            self.queue_delayed.with_label_values(&labels).set(q.delayed as i64);
            self.queue_review.with_label_values(&labels).set(q.review as i64);
            let Ok(shards) = store.shards(job, p).await else {
                continue;
            };
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
        for (state, n) in &by_state {
            self.batch_shards.with_label_values(&[job, state]).set(*n);
        }
    }

    /// The job as a whole: sink lag, halt, provider outage, spend.
    async fn refresh_job(&self, store: &RedisStore, w: &Watched) {
        let job = w.job.as_str();
        if let Ok(Some(backlog)) = store.sink_backlog(job, w.partitions).await {
            self.sink_lag.with_label_values(&[job]).set(backlog as i64);
        }
        let halt = store.halted(job).await.ok().flatten();
        self.halted.with_label_values(&[job]).set(i64::from(halt.is_some()));
        if let Ok(o) = store.provider_outage(job).await {
            self.provider_up.with_label_values(&[job]).set(i64::from(!o.down));
            let since = if o.down { o.since_ms as f64 / 1000.0 } else { 0.0 };
            self.provider_down_since.with_label_values(&[job]).set(since);
        }
        let on_budget = halt.as_deref().is_some_and(|r| r.starts_with("budget"));
        self.halted_on_budget
            .with_label_values(&[job])
            .set(i64::from(on_budget));
        let on_drift = halt.as_deref().is_some_and(|r| r.starts_with(common::drift::REASON));
        self.halted_on_drift.with_label_values(&[job]).set(i64::from(on_drift));
        if let Ok(spend) = store.spend(job, w.partitions).await {
            self.spend_usd
                .with_label_values(&[job, "spent"])
                .set(spend.totals.cost_usd);
        }
        if let Ok(b) = store.budget(job).await
            && let Some(cap) = b.cap_usd
        {
            self.spend_usd.with_label_values(&[job, "budget"]).set(cap);
            self.spend_usd
                .with_label_values(&[job, "in_flight"])
                .set(b.reserved_usd);
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

//! The pipeline in process: each record's whole story (claim, call,
//! validate, decide, apply) through `worker::process` over the in-memory
//! queue (`worker::queue::MemoryQueue`, the same rules as the Redis scripts)
//! and a real llm-sim over HTTP, whose `/admin/script` gives every record
//! the exact faults it meets. No worker process, no Redis: hundreds of
//! stories in seconds.
//!
//! Time: the pipeline never sleeps on a decision (a retry is a due time in
//! the queue), so a story runs at the speed of its HTTP calls; the queue's
//! clock is moved forward to make a retry due or a reservation expire.
//! What does wait (a paid answer's store retried while Redis is away, up
//! to the visibility timeout) runs under paused tokio time, with answers as
//! a provider batch's output lines: no HTTP call, whose timeouts a paused
//! clock would fire at once.

use std::sync::Arc;
use std::time::Duration;

use common::spec::JobSpec;
use common::store::OutageRules;
use common::task::{RecordState, Task};
use harness::{LlmSim, example_spec, record_line};
use worker::job::{JobCtx, Limits, Settled};
use worker::plan::Route;
use worker::process::process;
use worker::provider::Provider;
use worker::queue::MemoryQueue;

const WORKER: &str = "w1";

/// The example job, pointed at `sim`, changed by `change`, over `queue`.
fn job(sim: &LlmSim, queue: &MemoryQueue, change: impl FnOnce(&mut JobSpec)) -> JobCtx {
    job_at(&sim.base_url(), queue, change)
}

/// The example job at `base_url` (batch answers come as lines: no call is made).
fn job_at(base_url: &str, queue: &MemoryQueue, change: impl FnOnce(&mut JobSpec)) -> JobCtx {
    let text = std::fs::read_to_string(example_spec()).expect("example spec");
    let mut spec = JobSpec::parse(&text, "examples/job.toml").expect("example spec parses");
    spec.provider.base_url = base_url.to_owned();
    change(&mut spec);
    let provider = Provider::new(&spec, None, "sk-test-key".to_owned()).expect("HTTP client");
    JobCtx::new("pipeline", spec, provider, Arc::new(queue.clone()), None, 3).expect("job context")
}

fn limits() -> Limits {
    Limits {
        max_deliveries: 5,
        worker: WORKER.to_owned(),
        metrics: Arc::new(worker::telemetry::Metrics::new()),
        traces: common::otel::Traces::off(),
        visibility: Duration::from_secs(60),
        retry_scheduled: tokio::sync::Notify::new(),
        calls: worker::calls::CallsInFlight::default(),
    }
}

fn task(rid: &str) -> Task {
    Task::new(rid, &record_line(rid, &format!("text of {rid}")), "").expect("task")
}

/// Runs the queue's tasks to their ends (retries made due at once, as the
/// promoter would once their time came), at most `steps` deliveries.
/// Returns each delivery's settlement, in order.
async fn drain(queue: &MemoryQueue, job: &JobCtx, limits: &Limits, steps: usize) -> Vec<(String, Settled)> {
    let mut seen = Vec::new();
    for _ in 0..steps {
        let d = match queue.deliver(WORKER) {
            Some(d) => d,
            None => {
                let Some(due) = queue.next_due() else { break };
                queue.advance(due.saturating_sub(queue.now_ms()));
                queue.promote();
                continue;
            }
        };
        let rid = d.task.rid.clone();
        let mut report = None;
        let settled = process(job, d, limits, &mut report, Route::Primary)
            .await
            .expect("the memory queue never fails");
        let halted = matches!(settled, Settled::Halted(_));
        seen.push((rid, settled));
        if halted {
            break;
        }
    }
    seen
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// What every story must leave, whatever its faults: one outcome at most,
/// every paid call in the ledger once, spend equal to the ledger's sum,
/// nothing left in the stream for a settled record.
fn invariants(queue: &MemoryQueue, rid: &str, calls_made: usize) {
    let paid: Vec<_> = queue.paid().into_iter().filter(|c| c.rid == rid).collect();
    assert!(
        paid.len() <= calls_made,
        "{rid}: {} paid calls recorded for {calls_made} calls made",
        paid.len()
    );
    let mut keys: Vec<String> = paid.iter().map(|c| c.key()).collect();
    keys.dedup();
    assert_eq!(keys.len(), paid.len(), "{rid}: a paid call recorded twice");
    let numbers: std::collections::BTreeSet<u32> = paid.iter().map(|c| c.call).collect();
    assert_eq!(
        numbers.len(),
        paid.len(),
        "{rid}: two paid calls with the same call number"
    );
    match queue.state(rid) {
        Some(RecordState::Done) => {
            let r = queue.result(rid).expect("a done record has its result");
            assert!(r.attempts >= 1, "{rid}: a result of no attempt");
            assert!(queue.review_entry(rid).is_none(), "{rid}: done and in review");
        }
        Some(RecordState::Review) => assert!(queue.result(rid).is_none(), "{rid}: in review with a result"),
        _ => {}
    }
}

/// Every fault llm-sim can inject, met once, twice or on every call, for
/// jobs of 1 to 3 attempts: each story ends, its record is settled the way
/// its faults say, and the money rules hold.
#[test]
fn every_fault_on_any_call_ends_in_one_outcome_and_no_call_is_paid_twice() {
    let sim = LlmSim::start(&["--record-served"]);
    let mut cases = Vec::new();
    for attempts in 1..=3u32 {
        let kinds = [&RECORD_FAULTS[..], &REPAIRED, &WORLD_FAULTS, &REFUSALS];
        for fault in kinds.concat() {
            for times in [1usize, 2, 4] {
                cases.push((attempts, fault, times));
            }
        }
    }
    let started = std::time::Instant::now();
    rt().block_on(async {
        let mut stories = Vec::new();
        for (i, (attempts, fault, times)) in cases.iter().enumerate() {
            let rid = format!("f{i}-{fault}-x{times}-a{attempts}");
            let faults = vec![*fault; *times];
            sim.script(&rid, &faults);
            stories.push((rid, *attempts, *fault, *times));
        }
        let stories = futures_util::future::join_all(stories.into_iter().map(|(rid, attempts, fault, times)| {
            let sim = &sim;
            async move {
                let queue = MemoryQueue::new();
                let job = job(sim, &queue, |s| {
                    s.retry.max_attempts = attempts;
                    s.retry.base_delay_ms = 10;
                });
                let limits = limits();
                queue.enqueue(task(&rid));
                let seen = drain(&queue, &job, &limits, 40).await;
                (rid, attempts, fault, times, queue, seen)
            }
        }))
        .await;
        // What llm-sim saw, per record: each call's HTTP status.
        let mut served: std::collections::HashMap<String, Vec<u64>> = std::collections::HashMap::new();
        for c in harness::http_get_json(&sim.addr, "/calls")
            .as_array()
            .expect("calls")
            .iter()
        {
            let rid = c["record"].as_str().unwrap_or_default().to_owned();
            served.entry(rid).or_default().push(c["status"].as_u64().unwrap_or(0));
        }
        let mut wrong = Vec::new();
        for (rid, attempts, fault, times, queue, seen) in &stories {
            invariants(queue, rid, seen.len());
            // One request per delivery, as the provider saw them; an HTTP
            // failure only as often as the script said.
            let statuses = served.get(rid).cloned().unwrap_or_default();
            if statuses.len() != seen.len() {
                wrong.push(format!(
                    "{rid}: llm-sim saw {} requests for {} deliveries",
                    statuses.len(),
                    seen.len()
                ));
            }
            let failed = statuses.iter().filter(|s| **s != 200).count();
            if ["rate_limit", "server_error", "unavailable"].contains(fault) && failed != (*times).min(seen.len()) {
                wrong.push(format!("{rid}: llm-sim answered {failed} failures, {times} scripted"));
            }
            if let Err(why) = story_ends_as_its_faults_say(queue, rid, *attempts, fault, *times, seen) {
                wrong.push(why);
            }
        }
        assert!(
            wrong.is_empty(),
            "{} of {} stories ended wrong:\n{}",
            wrong.len(),
            stories.len(),
            wrong.join("\n")
        );
        assert!(stories.len() >= 100, "{} stories", stories.len());
    });
    eprintln!("{} stories in {:?}", cases.len(), started.elapsed());
}

/// Faults that are the record's (they count as attempts), that the
/// validator repairs, that are the world's (never an attempt, never a
/// review), and refusals (reviewed at once).
const RECORD_FAULTS: [&str; 7] = [
    "broken_json",
    "missing_field",
    "bad_enum",
    "bool_number",
    "length",
    "deep",
    "hostile",
];
const REPAIRED: [&str; 2] = ["fence", "prose"];
/// (`empty`: a 200 with an empty body, which says no usage: nothing to bill.)
const WORLD_FAULTS: [&str; 4] = ["rate_limit", "server_error", "unavailable", "empty"];
const REFUSALS: [&str; 1] = ["content_filter"];

/// Whether a story ended as its faults say it must (Err: how it did not).
fn story_ends_as_its_faults_say(
    queue: &MemoryQueue,
    rid: &str,
    attempts: u32,
    fault: &str,
    times: usize,
    seen: &[(String, Settled)],
) -> Result<(), String> {
    let calls = seen.len();
    let state = queue.state(rid);
    let story = format!(
        "{rid}: {:?} -> {state:?}",
        seen.iter().map(|(_, s)| s.label()).collect::<Vec<_>>()
    );
    let fails = times.min(calls);
    let result_attempts = queue.result(rid).map(|r| r.attempts);
    let expect = |ok: bool, what: &str| if ok { Ok(()) } else { Err(format!("{story}: {what}")) };
    if WORLD_FAULTS.contains(&fault) {
        expect(
            state == Some(RecordState::Done),
            "the world's faults wait, then the record commits",
        )?;
        expect(result_attempts == Some(1), "the world's faults are no attempt")?;
    } else if REPAIRED.contains(&fault) {
        expect(
            state == Some(RecordState::Done) && result_attempts == Some(1),
            "repaired on its first attempt",
        )?;
    } else if REFUSALS.contains(&fault) {
        expect(
            state == Some(RecordState::Review) && calls == 1,
            "a refusal is reviewed at once",
        )?;
    } else if times as u32 >= attempts {
        let entry = queue.review_entry(rid);
        expect(
            state == Some(RecordState::Review),
            "wrong on every attempt allowed: review",
        )?;
        expect(
            entry.map(|e| e.attempts) == Some(attempts),
            "reviewed after exactly its attempts",
        )?;
    } else {
        expect(
            state == Some(RecordState::Done),
            "wrong fewer times than allowed: the retry commits",
        )?;
        expect(
            result_attempts == Some(times as u32 + 1),
            "one attempt per wrong answer, and the right one",
        )?;
    }
    // Every answered call is in the ledger (a 429 or a 5xx is not billed).
    let paid = queue.paid().iter().filter(|c| c.rid == rid).count();
    let answered = if WORLD_FAULTS.contains(&fault) {
        calls - fails
    } else {
        calls
    };
    expect(paid == answered, &format!("{paid} paid calls for {answered} answered"))
}

/// A delivery taken over by another worker (this one hung past the
/// visibility timeout) stores nothing: its paid call is in the ledger, the
/// record has the one result the live delivery stored.
#[test]
fn a_delivery_taken_over_mid_call_applies_nothing_and_its_call_stays_paid() {
    let sim = LlmSim::start(&["--latency-ms", "400", "--steady-latency"]);
    rt().block_on(async {
        let queue = MemoryQueue::new();
        let job = Arc::new(job(&sim, &queue, |_| {}));
        let limits = Arc::new(limits());
        queue.enqueue(task("r1"));
        let first = queue.deliver(WORKER).expect("delivered");
        let (j, l) = (job.clone(), limits.clone());
        let late = tokio::spawn(async move { process(&j, first, &l, &mut None, Route::Primary).await });
        // Taken over while its call is on its way.
        tokio::time::sleep(Duration::from_millis(150)).await;
        let second = queue.take_over("r1", "w2").expect("taken over");
        let late = late.await.expect("task").expect("process");
        assert_eq!(late, Settled::Stale);
        assert_eq!(queue.state("r1"), Some(RecordState::Queued), "nothing applied");
        assert_eq!(queue.paid().len(), 1, "the late call was paid and is recorded");
        let live = process(&job, second, &limits, &mut None, Route::Primary)
            .await
            .expect("process");
        assert_eq!(live, Settled::Committed);
        assert_eq!(queue.state("r1"), Some(RecordState::Done));
        assert_eq!(queue.paid().len(), 2, "both calls, each once");
        assert_eq!(queue.spend().0, 2, "spend counts each paid call once");
        // Enqueued again: nothing new (the record is known).
        assert!(!queue.enqueue(task("r1")));
        assert_eq!(queue.in_stream(), 0);
    });
}

/// A delivery whose record is already settled (a redelivery, a late copy):
/// acknowledged, not called.
#[test]
fn a_settled_record_delivered_again_is_acknowledged_without_a_call() {
    let sim = LlmSim::start(&[]);
    rt().block_on(async {
        let queue = MemoryQueue::new();
        let job = job(&sim, &queue, |_| {});
        let limits = limits();
        queue.enqueue(task("s1"));
        let d = queue.deliver(WORKER).expect("delivered");
        let copy = d.clone();
        assert_eq!(
            process(&job, d, &limits, &mut None, Route::Primary)
                .await
                .expect("process"),
            Settled::Committed
        );
        let again = process(&job, copy, &limits, &mut None, Route::Primary)
            .await
            .expect("process");
        assert!(matches!(again, Settled::AlreadySettled | Settled::Stale), "{again:?}");
        assert_eq!(sim.stats()["requests"].as_u64(), Some(1), "one call");
        assert_eq!(queue.paid().len(), 1);
    });
}

/// A record whose template cannot be filled is dropped without a call; a
/// task delivered too often goes to review as poison without a call.
#[test]
fn input_errors_and_poison_are_decided_without_a_call() {
    let sim = LlmSim::start(&[]);
    rt().block_on(async {
        let queue = MemoryQueue::new();
        let job = job(&sim, &queue, |_| {});
        let limits = limits();
        let bad = Task::new("no-text", r#"{"message_id": "no-text", "channel": "chat"}"#, "").expect("task");
        queue.enqueue(bad);
        let seen = drain(&queue, &job, &limits, 5).await;
        assert_eq!(seen.len(), 1);
        assert!(
            matches!(queue.state("no-text"), Some(RecordState::Dropped(ref why)) if why.contains("task_type") || why.contains("text")),
            "{:?}",
            queue.state("no-text")
        );
        queue.enqueue(task("poison"));
        let mut d = queue.deliver(WORKER).expect("delivered");
        for n in 2..=6 {
            d = queue.take_over("poison", &format!("w{n}")).expect("again");
        }
        assert_eq!(d.deliveries, 6);
        let settled = process(&job, d, &limits, &mut None, Route::Primary).await.expect("process");
        assert_eq!(settled, Settled::Reviewed);
        let entry = queue.review_entry("poison").expect("in review");
        assert!(entry.reason.contains("poison"), "{}", entry.reason);
        assert!(queue.paid().is_empty(), "neither made a call");
        assert_eq!(sim.stats()["requests"].as_u64().unwrap_or(0), 0, "llm-sim saw no request");
    });
}

/// The job's cap: a call that could pass it halts the job before it is
/// sent, the task goes back to the stream, nothing is paid; resumed with a
/// higher cap it runs.
#[test]
fn a_call_that_could_pass_the_job_s_cap_halts_the_job_before_it_is_sent() {
    let sim = LlmSim::start(&[]);
    rt().block_on(async {
        let queue = MemoryQueue::new();
        let job = job(&sim, &queue, |s| s.budget.max_cost_usd = Some(1e-9));
        queue.set_budget_cap(1e-9);
        let limits = limits();
        queue.enqueue(task("b1"));
        let seen = drain(&queue, &job, &limits, 5).await;
        assert!(
            matches!(&seen[..], [(_, Settled::Halted(why))] if why.starts_with("budget")),
            "{seen:?}"
        );
        assert!(
            queue
                .halt_reason()
                .is_some_and(|r| r.contains("producer resume --budget"))
        );
        assert_eq!(queue.state("b1"), Some(RecordState::Queued), "handed back");
        assert_eq!(queue.in_stream(), 1);
        assert!(queue.paid().is_empty());
        let (spent, reserved) = queue.budget();
        assert_eq!((spent, reserved), (0, 0));
        // Raised and resumed: the record runs and its spend settles.
        queue.set_budget_cap(10.0);
        queue.resume();
        let seen = drain(&queue, &job, &limits, 5).await;
        assert_eq!(seen.last().map(|(_, s)| s.clone()), Some(Settled::Committed));
        let (spent, reserved) = queue.budget();
        assert!(spent > 0 && reserved == 0, "spent {spent}, reserved {reserved}");
    });
}

/// A provider that fails every call: the fleet's streak takes it for down
/// (records wait, no attempt is used), and past the job's outage budget the
/// job halts with the provider's words; records are never reviewed for it.
#[test]
fn a_provider_down_past_the_outage_budget_halts_the_job_and_reviews_nothing() {
    let sim = LlmSim::start(&[]);
    sim.fail_all(Some("503:overloaded:the engine is overloaded"));
    rt().block_on(async {
        let queue = MemoryQueue::new();
        let mut job = job(&sim, &queue, |s| {
            s.retry.base_delay_ms = 1;
            s.retry.outage_budget_secs = Some(1);
        });
        let rules = OutageRules {
            min_fails: 3,
            window: Duration::ZERO,
            window_429: Duration::ZERO,
            probe_every_max: Duration::from_secs(1),
        };
        job.outage = worker::outage::OutageWatch::with_rules(0, &sim.base_url(), rules);
        let limits = limits();
        for i in 0..4 {
            queue.enqueue(task(&format!("o{i}")));
        }
        let seen = drain(&queue, &job, &limits, 20).await;
        let last = seen.last().map(|(_, s)| s.clone());
        assert!(
            matches!(&last, Some(Settled::Halted(why)) if why.contains("provider unavailable") && why.contains("overloaded")),
            "{seen:?}"
        );
        assert_eq!(queue.outages(), 1, "one outage");
        for i in 0..4 {
            let rid = format!("o{i}");
            assert!(
                matches!(queue.state(&rid), Some(RecordState::Queued | RecordState::Delayed)),
                "{rid}: {:?} {seen:?}",
                queue.state(&rid)
            );
            assert!(queue.review_entry(&rid).is_none());
        }
        assert!(seen.iter().all(|(_, s)| !matches!(s, Settled::Reviewed)));
        // Back: resumed, every record commits on its first attempt.
        sim.fail_all(None);
        queue.resume();
        let seen = drain(&queue, &job, &limits, 40).await;
        for i in 0..4 {
            let rid = format!("o{i}");
            assert_eq!(queue.state(&rid), Some(RecordState::Done), "{rid}: {seen:?}");
            assert_eq!(queue.result(&rid).map(|r| r.attempts), Some(1), "{rid}: the outage used no attempt");
        }
        assert!(!queue.is_down(), "the first answer ended the outage");
    });
}

/// A wrong key (401 on every call) before the provider ever answered: the
/// breaker halts the job after its threshold instead of reviewing records.
#[test]
fn a_systematic_provider_error_halts_the_job_instead_of_reviewing_records() {
    let sim = LlmSim::start(&[]);
    sim.fail_all(Some("401:invalid_api_key:Incorrect API key provided"));
    rt().block_on(async {
        let queue = MemoryQueue::new();
        let job = job(&sim, &queue, |_| {});
        let limits = limits();
        for i in 0..5 {
            queue.enqueue(task(&format!("k{i}")));
        }
        let seen = drain(&queue, &job, &limits, 20).await;
        let last = seen.last().map(|(_, s)| s.clone());
        assert!(
            matches!(&last, Some(Settled::Halted(why)) if why.contains("invalid_api_key") || why.contains("401")),
            "{seen:?}"
        );
        for i in 0..5 {
            assert!(
                queue.review_entry(&format!("k{i}")).is_none(),
                "k{i} reviewed: {seen:?}"
            );
        }
    });
}

/// A valid output of the example spec.
const GOOD: &str = r#"{"label": "billing", "reason": "a refund", "confidence": 0.9, "task_type": "classify"}"#;

/// One line of a provider batch's output file, as OpenAI writes it, whose
/// chat completion says `content` (with its usage).
fn batch_line(rid: &str, content: &str) -> String {
    serde_json::json!({
        "id": format!("batch_req_{rid}"),
        "custom_id": rid,
        "response": {"status_code": 200, "request_id": "req_1", "body": {
            "id": "chatcmpl-1", "object": "chat.completion", "model": "gpt-4o-mini",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 120, "completion_tokens": 30, "total_tokens": 150}
        }},
        "error": null
    })
    .to_string()
}

/// A batch's answer settled while the queue refuses outcomes for a while
/// (Redis away), under paused time: the paid answer is not given up, it is
/// stored once Redis takes it, after the back-off's waits (50 ms doubling),
/// and its paid call (at batch prices) is in the ledger once.
#[tokio::test(start_paused = true)]
async fn a_paid_answer_waits_out_a_short_redis_outage_and_is_stored_once() {
    let queue = MemoryQueue::new();
    let job = job_at("http://127.0.0.1:9/v1", &queue, |_| {});
    let limits = limits();
    queue.enqueue(task("p1"));
    let d = queue.deliver(WORKER).expect("delivered");
    queue.refuse_outcomes(5);
    let answer = worker::batcher::answer_of_line(&batch_line("p1", GOOD)).expect("a batch line");
    let started = tokio::time::Instant::now();
    let settled = worker::process::settle_batch_line(&job, &d, &limits, answer, "batch_1:batch_req_p1".into())
        .await
        .expect("settled");
    assert_eq!(settled, Settled::Committed);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(50 + 100 + 200 + 400 + 800),
        "five refusals, five waits: {waited:?}"
    );
    assert_eq!(queue.state("p1"), Some(RecordState::Done));
    let paid = queue.paid();
    assert_eq!(paid.len(), 1, "{paid:?}");
    let online = common::ledger::nano_usd(paid[0].usage.cost(&job.spec.prices));
    assert!(
        paid[0].cost_nusd < online,
        "batch prices: {} < {online}",
        paid[0].cost_nusd
    );
    assert_eq!(paid[0].online_nusd, Some(online));
}

/// A task's concurrency slot goes back as soon as its call's outcome goes to
/// be stored: while the store waits (Redis refuses it, then takes it), the
/// slot is free for another task's call, the outcome holding a storing slot
/// instead; with no storing slot free, the task keeps its own.
#[tokio::test(start_paused = true)]
async fn an_outcome_waiting_to_be_stored_gives_its_call_slot_to_another_task() {
    use tokio::sync::Semaphore;
    use worker::slot::Slot;
    let queue = MemoryQueue::new();
    let (calls, storing) = (Arc::new(Semaphore::new(2)), Arc::new(Semaphore::new(1)));
    let mut slots = Vec::new();
    let mut settling = Vec::new();
    for rid in ["s1", "s2"] {
        let job = job_at("http://127.0.0.1:9/v1", &queue, |_| {});
        queue.enqueue(task(rid));
        let d = queue.deliver(WORKER).expect("delivered");
        let answer = worker::batcher::answer_of_line(&batch_line(rid, GOOD)).expect("a batch line");
        let slot = Slot::new(calls.clone().try_acquire_owned().unwrap(), storing.clone());
        slots.push(slot.clone());
        settling.push(tokio::spawn(async move {
            let line = format!("batch_1:batch_req_{rid}");
            let limits = limits();
            slot.scope(worker::process::settle_batch_line(&job, &d, &limits, answer, line))
                .await
        }));
    }
    queue.refuse_outcomes(2);
    // Both outcomes go to be stored; each first store is refused (a 50 ms wait).
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(
        ["s1", "s2"]
            .iter()
            .all(|rid| queue.state(rid) != Some(RecordState::Done)),
        "both outcomes still wait to be stored"
    );
    assert_eq!(
        calls.available_permits(),
        1,
        "one outcome waits on the storing slot and gave its call's slot back"
    );
    assert_eq!(storing.available_permits(), 0);
    assert_eq!(
        slots.iter().filter(|s| s.holds_call()).count(),
        1,
        "the other keeps its own"
    );
    for t in settling {
        assert_eq!(t.await.unwrap().unwrap(), Settled::Committed);
    }
    for s in &slots {
        s.release();
    }
    assert_eq!((calls.available_permits(), storing.available_permits()), (2, 1));
    assert_eq!(queue.state("s1"), Some(RecordState::Done));
    assert_eq!(queue.state("s2"), Some(RecordState::Done));
}

/// Redis never takes the outcome before the visibility timeout: the paid
/// answer is counted lost (kept for the ledger as such), the record is left
/// for the worker that takes the task over, and nothing was stored twice.
#[tokio::test(start_paused = true)]
async fn a_paid_answer_redis_never_takes_is_counted_lost_at_the_visibility_timeout() {
    let queue = MemoryQueue::new();
    let job = job_at("http://127.0.0.1:9/v1", &queue, |_| {});
    let limits = limits();
    queue.enqueue(task("p2"));
    let d = queue.deliver(WORKER).expect("delivered");
    queue.refuse_outcomes(u64::MAX);
    let answer = worker::batcher::answer_of_line(&batch_line("p2", GOOD)).expect("a batch line");
    let started = tokio::time::Instant::now();
    let settled = worker::process::settle_batch_line(&job, &d, &limits, answer, "batch_1:batch_req_p2".into())
        .await
        .expect("settled");
    assert_eq!(settled, Settled::AnswerLost);
    let waited = started.elapsed();
    assert!(
        waited < limits.visibility && waited >= limits.visibility - Duration::from_secs(3),
        "gave up just before the visibility timeout: {waited:?}"
    );
    let lost = limits.calls.take_lost();
    assert_eq!(lost.get("pipeline").map(Vec::len), Some(1), "{lost:?}");
    assert!(
        queue.paid().is_empty(),
        "nothing reached the ledger through the refused outcome"
    );
    assert_eq!(queue.state("p2"), Some(RecordState::Queued));
    // Redis is back: the worker that takes the task over stores its own outcome once.
    queue.refuse_outcomes(0);
    let again = queue.take_over("p2", "w2").expect("taken over");
    let answer = worker::batcher::answer_of_line(&batch_line("p2", GOOD)).expect("a batch line");
    let settled = worker::process::settle_batch_line(&job, &again, &limits, answer, "batch_2:batch_req_p2".into())
        .await
        .expect("settled");
    assert_eq!(settled, Settled::Committed);
    assert_eq!(queue.paid().len(), 1);
}

/// Invalid batch answers are decided as online ones: feedback and a retry
/// (online, when `[batch] retries = "online"`), review once the attempts
/// are used; a refusal is reviewed at once. No sleeps: paused time ends
/// each at once.
#[tokio::test(start_paused = true)]
async fn batch_answers_are_decided_as_online_ones() {
    let queue = MemoryQueue::new();
    let job = job_at("http://127.0.0.1:9/v1", &queue, |s| {
        s.retry.max_attempts = 2;
        s.provider.mode = common::spec::ProviderMode::Batch;
        s.batch.retries = common::spec::BatchRetries::Online;
    });
    let limits = limits();
    let wrong = r#"{"label": "refund", "reason": "a refund", "confidence": 0.9, "task_type": "classify"}"#;
    queue.enqueue(task("b1"));
    let d = queue.deliver(WORKER).expect("delivered");
    let answer = worker::batcher::answer_of_line(&batch_line("b1", wrong)).expect("a batch line");
    let settled = worker::process::settle_batch_line(&job, &d, &limits, answer, "batch_1:l1".into())
        .await
        .expect("settled");
    assert_eq!(settled, Settled::Retried);
    assert_eq!(queue.state("b1"), Some(RecordState::Delayed));
    queue.advance(3_600_000);
    queue.promote();
    let d = queue.deliver(WORKER).expect("the retry");
    assert!(d.task.online, "the retry calls online");
    assert!(
        d.task.feedback.iter().any(|e| e.code.as_str() == "E_ENUM"),
        "{:?}",
        d.task.feedback
    );
    let answer = worker::batcher::answer_of_line(&batch_line("b1", wrong)).expect("a batch line");
    let settled = worker::process::settle_batch_line(&job, &d, &limits, answer, "batch_2:l1".into())
        .await
        .expect("settled");
    assert_eq!(settled, Settled::Reviewed);
    assert_eq!(queue.review_entry("b1").map(|e| e.attempts), Some(2));
    assert_eq!(queue.paid().len(), 2, "both answers were billed");
}

/// A business rule that cannot be evaluated on a record (it reads an input
/// field the record lacks) sends the record to review after one paid call:
/// another answer cannot mend it, so none is bought.
#[test]
fn a_rule_that_cannot_be_evaluated_reviews_the_record_after_one_call() {
    let sim = LlmSim::start(&["--record-served"]);
    rt().block_on(async {
        let queue = MemoryQueue::new();
        let job = job(&sim, &queue, |s| {
            let rules: common::rules::Rules =
                serde_json::from_value(serde_json::json!({"region_known": "input.region == 'eu'"})).expect("rules");
            s.output.rules = rules;
        });
        let limits = limits();
        sim.script("u1", &["ok"]);
        queue.enqueue(task("u1"));
        let seen = drain(&queue, &job, &limits, 10).await;
        let entry = queue
            .review_entry("u1")
            .unwrap_or_else(|| panic!("not in review: {seen:?}"));
        assert_eq!(entry.reason, "rule_unevaluable");
        assert!(
            entry
                .errors
                .iter()
                .any(|e| e.code.as_str() == "E_RULE_UNEVALUABLE" && e.field == "region_known")
        );
        assert_eq!(queue.paid().len(), 1, "one paid call");
        let calls = harness::http_get_json(&sim.addr, "/calls");
        let for_u1 = calls
            .as_array()
            .expect("calls")
            .iter()
            .filter(|c| c["record"] == "u1")
            .count();
        assert_eq!(for_u1, 1, "llm-sim was asked once");
    });
}

/// The audit trail: every call's history item names the sha256 of the exact
/// body llm-sim received, the model and endpoint, and the sha256 of the
/// body it answered, whose bytes are in the job's sink (memory here) and
/// hold the answer the record kept. A 503 is a response too (kept); the
/// wrong answer before the right one is kept as well.
#[test]
fn every_call_s_request_and_response_are_named_by_hash_and_the_responses_kept() {
    use common::sink::{Memory, RawStore, Target, sha256_hex};
    let sim = LlmSim::start(&["--record-served"]);
    rt().block_on(async {
        let queue = MemoryQueue::new();
        let memory = Memory::default();
        let mut job = job(&sim, &queue, |_| {});
        job.set_sink(Target::Memory(memory.clone())).expect("memory sink");
        let limits = limits();
        sim.script("t1", &["server_error", "missing_field", "ok"]);
        queue.enqueue(task("t1"));
        let seen = drain(&queue, &job, &limits, 10).await;
        let result = queue.result("t1").unwrap_or_else(|| panic!("no result: {seen:?}"));
        let trails: Vec<common::task::Trail> = result
            .history
            .iter()
            .filter_map(common::task::HistoryItem::as_attempt)
            .map(|a| a.trail.clone())
            .collect();
        let sent: Vec<String> = harness::http_get_json(&sim.addr, "/calls")
            .as_array()
            .expect("calls")
            .iter()
            .filter(|c| c["record"] == "t1")
            .map(|c| c["request_sha256"].as_str().expect("request_sha256").to_owned())
            .collect();
        assert_eq!(trails.len(), 3, "three calls: {seen:?}");
        assert_eq!(
            trails.iter().map(|t| t.request_sha256.clone()).collect::<Vec<_>>(),
            sent,
            "each call names the body llm-sim received"
        );
        assert_ne!(sent[1], sent[2], "the retry carried the validator's feedback");
        let raw = RawStore::of(&Target::Memory(memory), "pipeline", &job.spec).expect("raw store");
        for t in &trails {
            assert_eq!(t.model, job.spec.provider.model);
            assert_eq!(t.provider, sim.base_url());
            assert!(t.response_kept, "{t:?}");
            let sha = t.response_sha256.as_deref().expect("every call here got a response");
            let bytes = raw.read(sha).await.expect("read").expect("kept");
            assert_eq!(sha256_hex(&bytes), sha);
        }
        // The last response is the committed answer, byte for byte what llm-sim served.
        let last = raw
            .read(trails[2].response_sha256.as_deref().expect("sha"))
            .await
            .expect("read")
            .expect("kept");
        let body: serde_json::Value = serde_json::from_slice(&last).expect("a JSON body");
        let served = harness::http_get_json(&sim.addr, "/served");
        let id = body["id"].as_str().expect("a completion id");
        assert_eq!(Some(id), result.response_id.as_deref());
        assert_eq!(body["choices"][0]["message"]["content"], served[id]);
        let content: serde_json::Value =
            serde_json::from_str(served[id].as_str().expect("served content")).expect("JSON output");
        for (field, value) in content.as_object().expect("an object") {
            assert_eq!(
                result.output.get(field),
                Some(value),
                "the row's {field} is the answer's"
            );
        }
    });
}

/// A job with no sink keeps the hashes, not the bytes.
#[test]
fn without_a_sink_the_trail_names_the_bytes_and_says_they_were_not_kept() {
    let sim = LlmSim::start(&[]);
    rt().block_on(async {
        let queue = MemoryQueue::new();
        let job = job(&sim, &queue, |_| {});
        let limits = limits();
        queue.enqueue(task("n1"));
        drain(&queue, &job, &limits, 5).await;
        let result = queue.result("n1").expect("a result");
        let a = result
            .history
            .iter()
            .find_map(common::task::HistoryItem::as_attempt)
            .expect("an attempt");
        assert_eq!(a.trail.request_sha256.len(), 64);
        assert!(a.trail.response_sha256.is_some());
        assert!(!a.trail.response_kept);
    });
}

/// The example job checked by a second model at `checker`, on `fields`.
fn checked_job(sim: &LlmSim, checker: &LlmSim, queue: &MemoryQueue) -> JobCtx {
    let mut job = job(sim, queue, |s| {
        s.check = common::check::CheckSpec {
            model: "judge-model".into(),
            base_url: Some(checker.base_url()),
            fields: vec!["label".into()],
            ..Default::default()
        };
    });
    let mut as_checker = job.spec.clone();
    as_checker.provider.model = "judge-model".into();
    as_checker.provider.base_url = checker.base_url();
    job.checker = Some(Provider::new(&as_checker, None, "sk-test-key".to_owned()).expect("HTTP client"));
    job
}

/// The cross-check: a checked answer is committed only once the checker
/// agrees on the listed fields; a checker that answers otherwise sends the
/// record to review with both answers (E_CHECK on the field, the first
/// answer as the one a reviewer accepts); a checker's 5xx waits and keeps
/// the paid answer. Each checker call is one paid call of cause `check`.
#[test]
fn a_checked_answer_commits_on_agreement_and_reviews_both_on_disagreement() {
    let sim = LlmSim::start(&["--record-served"]);
    let agrees = LlmSim::start(&["--record-served"]);
    let disagrees = LlmSim::start(&["--contrary", "1"]);
    rt().block_on(async {
        let limits = limits();
        // Agreeing, after one 5xx from the checker.
        let queue = MemoryQueue::new();
        let job = checked_job(&sim, &agrees, &queue);
        agrees.script("k1", &["server_error", "ok"]);
        queue.enqueue(task("k1"));
        let seen = drain(&queue, &job, &limits, 10).await;
        let labels: Vec<&str> = seen.iter().map(|(_, s)| s.label()).collect();
        assert_eq!(labels, ["check", "retry", "commit"], "{seen:?}");
        let r = queue.result("k1").expect("committed");
        let calls: Vec<_> = r
            .history
            .iter()
            .filter_map(common::task::HistoryItem::as_attempt)
            .collect();
        assert_eq!(calls.len(), 3);
        assert_eq!(calls[2].outcome, "check_agrees");
        let v = calls[2].check.as_ref().expect("a verdict");
        assert!(v.agrees() && v.model == "judge-model", "{v:?}");
        assert_eq!(calls[2].trail.model, "judge-model");
        assert_eq!(serde_json::Value::Object(v.first.clone())["label"], r.output["label"]);
        let paid = queue.paid();
        let causes: Vec<&str> = paid.iter().map(|c| c.cause.name()).collect();
        assert_eq!(causes, ["first", "check"], "the 5xx is not billed: {paid:?}");
        assert_eq!(r.attempts, 1, "the check is no attempt");

        // Disagreeing: review, both answers kept.
        let queue = MemoryQueue::new();
        let job = checked_job(&sim, &disagrees, &queue);
        queue.enqueue(task("k2"));
        let seen = drain(&queue, &job, &limits, 10).await;
        let e = queue
            .review_entry("k2")
            .unwrap_or_else(|| panic!("not reviewed: {seen:?}"));
        assert_eq!(e.reason, common::check::DISAGREES);
        assert_eq!(e.errors.len(), 1, "{:?}", e.errors);
        assert_eq!(
            (e.errors[0].code.as_str(), e.errors[0].field.as_str()),
            ("E_CHECK", "label")
        );
        let first: serde_json::Value = serde_json::from_str(&e.last_raw_output).expect("the first answer");
        let v = e
            .history
            .iter()
            .rev()
            .find_map(common::task::HistoryItem::as_attempt)
            .unwrap()
            .check
            .clone()
            .unwrap();
        let side = v.side_by_side();
        assert_eq!(side[0].1, first["label"].as_str().unwrap());
        assert_ne!(side[0].1, side[0].2, "the checker said otherwise: {side:?}");
        assert_eq!(queue.paid().len(), 2);
        assert_eq!(disagrees.stats()["contrary"], 1);
    });
}

/// The record's own cost cap holds for the checker's call too, at the
/// checker's prices: a first answer that fits the cap, and a checker 100
/// times dearer whose call could pass it, is not sent. The record is
/// reviewed (reason `budget`) with the first answer, kept and paid once.
#[test]
fn a_checker_call_that_could_pass_the_record_s_cap_is_not_sent() {
    let sim = LlmSim::start(&[]);
    let checker = LlmSim::start(&[]);
    rt().block_on(async {
        let limits = limits();
        let queue = MemoryQueue::new();
        let mut job = checked_job(&sim, &checker, &queue);
        job.spec.budget.max_cost_per_record = Some(0.002);
        job.spec.check.prices = Some(common::spec::Prices {
            input_per_mtok: 15.0,
            output_per_mtok: 60.0,
            ..job.spec.prices.clone()
        });
        queue.enqueue(task("c1"));
        let seen = drain(&queue, &job, &limits, 5).await;
        let labels: Vec<&str> = seen.iter().map(|(_, s)| s.label()).collect();
        assert_eq!(labels, ["check", "review"], "{seen:?}");
        assert_eq!(checker.stats()["requests"], 0, "the checker was not called");
        let e = queue.review_entry("c1").expect("in review");
        assert_eq!(e.reason, "budget");
        assert!(
            e.last_raw_output.contains("label"),
            "the first answer: {}",
            e.last_raw_output
        );
        let causes: Vec<&str> = queue.paid().iter().map(|c| c.cause.name()).collect();
        assert_eq!(causes, ["first"]);
    });
}

/// A check whose every delivery died (the worker killed mid-call, again and
/// again) is reviewed as poison with the kept first answer, not called again.
#[test]
fn a_check_delivered_too_often_is_reviewed_with_the_first_answer() {
    let sim = LlmSim::start(&[]);
    let checker = LlmSim::start(&[]);
    rt().block_on(async {
        let limits = limits();
        let queue = MemoryQueue::new();
        let job = checked_job(&sim, &checker, &queue);
        let mut t = task("p1");
        t.check = Some(Box::new(common::check::Pending {
            output: serde_json::from_str(r#"{"label":"billing"}"#).unwrap(),
            response_id: None,
            repairs: vec![],
            usage: None,
        }));
        queue.enqueue(t);
        let mut d = queue.deliver(WORKER).expect("delivered");
        for n in 2..=6 {
            d = queue.take_over("p1", &format!("w{n}")).expect("again");
        }
        let settled = process(&job, d, &limits, &mut None, Route::Primary)
            .await
            .expect("process");
        assert_eq!(settled, Settled::Reviewed);
        let e = queue.review_entry("p1").expect("in review");
        assert_eq!(e.reason, "poison");
        assert!(e.last_raw_output.contains("billing"));
        assert_eq!(checker.stats()["requests"], 0, "the checker was not called again");
    });
}

/// The checker's own answer not valid: nothing to agree with, reviewed as
/// `checker_invalid` (not counted as a disagreement); a checker failing for
/// longer than the job waits out an outage: the record is reviewed with the
/// kept first answer instead of waiting forever (and its calls say so).
#[test]
fn a_checker_that_answers_nothing_valid_or_stays_down_reviews_the_record() {
    let sim = LlmSim::start(&[]);
    let checker = LlmSim::start(&[]);
    rt().block_on(async {
        let limits = limits();
        let queue = MemoryQueue::new();
        let job = checked_job(&sim, &checker, &queue);
        checker.script("i1", &["missing_field"]);
        queue.enqueue(task("i1"));
        drain(&queue, &job, &limits, 5).await;
        let e = queue.review_entry("i1").expect("reviewed");
        assert_eq!(e.reason, "checker_invalid");
        let last = e
            .history
            .iter()
            .rev()
            .find_map(common::task::HistoryItem::as_attempt)
            .unwrap();
        assert_eq!(last.outcome, "check_invalid");
        assert!(last.check.as_ref().is_some_and(|v| v.checker.is_none()));

        let queue = MemoryQueue::new();
        let mut job = checked_job(&sim, &checker, &queue);
        job.spec.retry.outage_budget_secs = Some(1);
        checker.script("o1", &["server_error", "server_error", "server_error"]);
        queue.enqueue(task("o1"));
        let before = checker.stats()["requests"].as_u64().unwrap();
        drain(&queue, &job, &limits, 3).await;
        assert_eq!(queue.state("o1"), Some(RecordState::Delayed), "the first failure waits");
        assert_eq!(checker.stats()["requests"].as_u64().unwrap(), before + 1);
        tokio::time::sleep(Duration::from_millis(1100)).await;
        drain(&queue, &job, &limits, 3).await;
        let e = queue
            .review_entry("o1")
            .expect("reviewed once the outage budget is spent");
        assert_eq!(e.reason, "checker_transient_exhausted");
        assert!(
            e.last_raw_output.contains("label"),
            "the first answer is before the reviewer"
        );
        let causes: Vec<&str> = queue.paid().iter().map(|c| c.cause.name()).collect();
        assert_eq!(causes, ["first"], "the checker's 5xx are not billed");
    });
}

/// Drift across a resume: another worker's alarm halted the job and a
/// person resumed it before this worker's watcher saw the halt. This
/// worker's watch, still over the rates from before, sounds its own alarm
/// next: it halts nothing (the person already said to go on), starts over
/// and forgets its gauges. Under the new resume mark, a new drift halts.
#[test]
fn a_drift_alarm_over_rates_from_before_a_resume_halts_nothing() {
    use common::decision::Outcome;
    use common::validate::{ErrorCode, FieldError};
    let queue = MemoryQueue::new();
    let job = job_at("http://127.0.0.1:9", &queue, |s| {
        s.drift.window = 10;
        s.drift.min_failures = 3;
    });
    let limits = limits();
    let wrong = Outcome::Invalid(vec![FieldError {
        code: ErrorCode::Enum,
        field: "label".into(),
        message: "must be one of billing, bug".into(),
    }]);
    let gauged = |limits: &Limits| {
        limits
            .metrics
            .encode()
            .lines()
            .any(|l| l.starts_with("batchfleet_drift_failure_ratio{") && l.contains("field=\"label\""))
    };
    rt().block_on(async {
        let feed = |valid: usize, invalid: usize| {
            let (job, limits, wrong) = (&job, &limits, &wrong);
            async move {
                for i in 0..valid {
                    job.drift_watch(&limits.metrics)
                        .observe(&format!("ok-{i}"), &Outcome::Valid)
                        .await;
                }
                for i in 0..invalid {
                    job.drift_watch(&limits.metrics)
                        .observe(&format!("bad-{i}"), wrong)
                        .await;
                }
            }
        };
        // The watcher read the mark; 20 good answers, then 2 wrong ones.
        let mark = job.queue.resume_mark().await.unwrap();
        job.drift_watch(&limits.metrics).resume_mark(mark);
        feed(20, 2).await;
        assert!(gauged(&limits), "{}", limits.metrics.encode());
        // Halted elsewhere and resumed, unseen here; the third wrong answer alarms.
        queue.resume();
        feed(0, 1).await;
        assert_eq!(
            queue.halt_reason(),
            None,
            "an alarm from before the resume halts nothing"
        );
        assert!(!gauged(&limits), "the watch started over, its gauges gone");
        // The same answers again, under the new mark: the drift halts.
        let mark = job.queue.resume_mark().await.unwrap();
        job.drift_watch(&limits.metrics).resume_mark(mark);
        feed(20, 3).await;
        let reason = queue.halt_reason().expect("halted on the new drift");
        assert!(reason.starts_with("quality drift: field `label`"), "{reason}");
    });
}

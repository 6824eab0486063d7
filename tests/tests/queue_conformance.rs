//! One suite, two queues: the same cases against the Redis store (a real
//! redis-server) and the in-memory queue the pipeline's in-process tests
//! run on, through the pipeline's seam (`worker::queue::JobQueue`). What
//! the memory queue answers is what Redis answers, so a story proven over
//! it holds in a fleet.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::time::Duration;

use common::ledger::PaidCall;
use common::store::{FailedCall, Finish, Finished, IdleEntry, OutageRules, Provider, RedisStore, Reserved, TaskEntry};
use common::task::{Delivery, RecordState, Task, Usage};
use harness::RedisServer;
use worker::queue::{JobQueue, MemoryQueue, RedisQueue};

const JOB: &str = "seam";

/// A queue under test, and the parts a fleet's services play on it.
#[allow(clippy::large_enum_variant)] // two values a test makes once
enum Bed {
    Redis {
        _server: RedisServer,
        store: RedisStore,
        queue: RedisQueue,
    },
    Memory(MemoryQueue),
}

impl Bed {
    async fn redis() -> Bed {
        let server = RedisServer::start();
        let store = RedisStore::connect(&server.url()).await.unwrap();
        store.prepare_job(JOB, "", 1, false).await.unwrap();
        let queue = RedisQueue::new(&store, JOB);
        Bed::Redis {
            _server: server,
            store,
            queue,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Bed::Redis { .. } => "redis",
            Bed::Memory(_) => "memory",
        }
    }

    fn queue(&self) -> &dyn JobQueue {
        match self {
            Bed::Redis { queue, .. } => queue,
            Bed::Memory(q) => q,
        }
    }

    async fn enqueue(&self, rid: &str) {
        let task = Task::new(rid, "{}", "").unwrap();
        match self {
            Bed::Redis { store, .. } => {
                let entry = TaskEntry {
                    partition: 0,
                    record_id: rid.to_owned(),
                    origin: format!("ds:{rid}"),
                    key: rid.to_owned(),
                    task: Ok(task),
                };
                store.enqueue(JOB, 60, &[entry]).await.unwrap();
            }
            Bed::Memory(q) => {
                q.enqueue(task);
            }
        }
    }

    async fn deliver(&self, consumer: &str) -> Delivery {
        match self {
            Bed::Redis { store, .. } => store.claim(JOB, 0, consumer, 1, false).await.unwrap().remove(0),
            Bed::Memory(q) => q.deliver(consumer).unwrap(),
        }
    }

    async fn take_over(&self, d: &Delivery, consumer: &str) -> Delivery {
        match self {
            Bed::Redis { store, .. } => {
                let idle = [IdleEntry {
                    entry_id: d.entry_id.clone(),
                    deliveries: d.deliveries,
                    idle_ms: 0,
                }];
                store.reclaim(JOB, 0, consumer, 0, &idle).await.unwrap().remove(0)
            }
            Bed::Memory(q) => q.take_over(&d.task.rid, consumer).unwrap(),
        }
    }

    async fn state(&self, rid: &str) -> Option<RecordState> {
        match self {
            Bed::Redis { store, .. } => store.record_state(JOB, 0, rid).await.unwrap(),
            Bed::Memory(q) => q.state(rid),
        }
    }

    /// Paid calls counted in the spend.
    async fn paid_calls(&self) -> u64 {
        match self {
            Bed::Redis { store, .. } => store.spend(JOB, 1).await.unwrap().totals.calls,
            Bed::Memory(q) => q.spend().0,
        }
    }

    async fn set_cap(&self, usd: f64) {
        match self {
            Bed::Redis { store, .. } => store.set_budget_cap(JOB, usd, false).await.unwrap(),
            Bed::Memory(q) => q.set_budget_cap(usd),
        }
    }
}

/// Runs `case` against both queues.
macro_rules! both {
    ($case:ident) => {
        $case(&Bed::redis().await).await;
        $case(&Bed::Memory(MemoryQueue::new())).await;
    };
}

fn paid(d: &Delivery) -> PaidCall {
    let usage = Usage {
        prompt: 100,
        completion: 20,
        ..Usage::default()
    };
    PaidCall::new(
        &d.task,
        1,
        1,
        d.deliveries,
        &d.consumer,
        usage,
        &common::spec::Prices::default(),
        1,
    )
}

async fn first_writer_wins_and_a_late_or_repeated_outcome_changes_nothing(bed: &Bed) {
    let (q, name) = (bed.queue(), bed.name());
    bed.enqueue("a").await;
    let d = bed.deliver("w1").await;
    assert_eq!(q.check(&d).await.unwrap(), (Some(RecordState::Queued), true), "{name}");
    let retry = Finish::Retry {
        due_ms: 1,
        task: d.task.next(1, 1, vec![], vec![]),
    };
    assert_eq!(
        q.finish(&d, &retry, None, false).await.unwrap(),
        Finished::Moved,
        "{name}"
    );
    assert_eq!(bed.state("a").await, Some(RecordState::Delayed), "{name}");
    // The same delivery again (a retried store call): acknowledged already.
    let drop = Finish::Drop { reason: "x".into() };
    assert_eq!(
        q.finish(&d, &drop, None, false).await.unwrap(),
        Finished::Stale,
        "{name}"
    );
    assert_eq!(bed.state("a").await, Some(RecordState::Delayed), "{name}");
    assert!(!q.check(&d).await.unwrap().1, "{name}: no longer live");
}

/// A retry due at once (a probe that failed while the provider is down) is
/// back on the stream as a new entry, its task the new one, deliverable
/// again at once: no trip through the delayed set and the promoter.
async fn a_retry_due_at_once_is_back_on_the_stream(bed: &Bed) {
    let (q, name) = (bed.queue(), bed.name());
    bed.enqueue("now").await;
    let d = bed.deliver("w1").await;
    let retry = Finish::Retry {
        due_ms: 0,
        task: d.task.next(1, 1, vec![], vec![]),
    };
    assert_eq!(
        q.finish(&d, &retry, None, false).await.unwrap(),
        Finished::Moved,
        "{name}"
    );
    assert_eq!(bed.state("now").await, Some(RecordState::Queued), "{name}");
    assert!(
        !q.check(&d).await.unwrap().1,
        "{name}: the first delivery is acknowledged"
    );
    let again = bed.deliver("w2").await;
    assert_eq!((again.task.rid.as_str(), again.task.calls), ("now", 1), "{name}");
    assert_ne!(again.entry_id, d.entry_id, "{name}: a new entry");
}

async fn a_delivery_taken_over_is_stale_but_its_paid_call_counts_once(bed: &Bed) {
    let (q, name) = (bed.queue(), bed.name());
    bed.enqueue("b").await;
    let first = bed.deliver("w1").await;
    let second = bed.take_over(&first, "w2").await;
    assert_eq!(second.deliveries, 2, "{name}");
    assert_eq!(
        q.check(&first).await.unwrap(),
        (Some(RecordState::Queued), false),
        "{name}"
    );
    let call = paid(&first);
    let late = Finish::Drop { reason: "late".into() };
    assert_eq!(
        q.finish(&first, &late, Some(&call), false).await.unwrap(),
        Finished::Stale,
        "{name}"
    );
    assert_eq!(
        bed.state("b").await,
        Some(RecordState::Queued),
        "{name}: nothing applied"
    );
    assert_eq!(bed.paid_calls().await, 1, "{name}: the late call was paid");
    // The live delivery releases its task back to the stream with the same
    // call (a retried store): counted once.
    let release = Finish::Release(second.task.clone());
    assert_eq!(
        q.finish(&second, &release, Some(&call), false).await.unwrap(),
        Finished::Moved,
        "{name}"
    );
    assert_eq!(bed.paid_calls().await, 1, "{name}: one key, one count");
    let third = bed.deliver("w3").await;
    assert_eq!(third.task.rid, "b", "{name}: released to the stream");
    let done = Finish::Drop { reason: "input".into() };
    assert_eq!(
        q.finish(&third, &done, None, false).await.unwrap(),
        Finished::Moved,
        "{name}"
    );
    assert!(
        matches!(bed.state("b").await, Some(RecordState::Dropped(r)) if r == "input"),
        "{name}"
    );
}

async fn the_halt_keeps_its_first_reason(bed: &Bed) {
    let (q, name) = (bed.queue(), bed.name());
    assert_eq!(q.halted().await.unwrap(), None, "{name}");
    q.halt("first").await.unwrap();
    q.halt("second").await.unwrap();
    assert_eq!(q.halted().await.unwrap().as_deref(), Some("first"), "{name}");
}

/// A drift alarm halts under the resume mark its watch began with, and
/// halts nothing once the job was resumed since.
async fn a_drift_alarm_halts_only_under_the_latest_resume_mark(bed: &Bed) {
    let (q, name) = (bed.queue(), bed.name());
    let before = q.resume_mark().await.unwrap();
    match bed {
        Bed::Redis { store, .. } => {
            store.resume_job(JOB, 1).await.unwrap();
        }
        Bed::Memory(m) => m.resume(),
    }
    let now = q.resume_mark().await.unwrap();
    assert_ne!(before, now, "{name}: a resume changes the mark");
    assert!(!q.halt_on_drift("quality drift: old", &before).await.unwrap(), "{name}");
    assert_eq!(q.halted().await.unwrap(), None, "{name}");
    assert!(q.halt_on_drift("quality drift: new", &now).await.unwrap(), "{name}");
    assert_eq!(
        q.halted().await.unwrap().as_deref(),
        Some("quality drift: new"),
        "{name}"
    );
}

async fn the_budget_grants_waits_and_halts_as_budget_lua_does(bed: &Bed) {
    let (q, name) = (bed.queue(), bed.name());
    bed.set_cap(1e-6).await; // 1,000 nano-USD
    let calls = |v: &[(&str, u64)]| v.iter().map(|(i, a)| ((*i).to_owned(), *a)).collect::<Vec<_>>();
    assert_eq!(
        q.budget_reserve(60_000, &calls(&[("a", 400), ("b", 400), ("c", 300)]))
            .await
            .unwrap(),
        [Reserved::Granted, Reserved::Granted, Reserved::Wait],
        "{name}"
    );
    // a cost 100, b was never made: room for c now.
    q.budget_settle(&[("a".into(), 400, 100), ("b".into(), 400, 0)])
        .await
        .unwrap();
    assert_eq!(
        q.budget_reserve(60_000, &calls(&[("c", 300)])).await.unwrap(),
        [Reserved::Granted],
        "{name}"
    );
    assert_eq!(q.halted().await.unwrap(), None, "{name}");
    // 950 could never fit (100 spent): the job halts, and every later call is refused.
    assert_eq!(
        q.budget_reserve(60_000, &calls(&[("d", 950), ("e", 1)])).await.unwrap(),
        [Reserved::Halted, Reserved::Halted],
        "{name}"
    );
    let why = q.halted().await.unwrap().unwrap_or_default();
    assert!(
        why.starts_with("budget: spent 0.000000 USD (0.000000 USD more in flight) of the job's 0.000001 USD"),
        "{name}: {why}"
    );
    assert!(why.contains("producer resume --budget"), "{name}: {why}");
}

async fn the_outage_streak_takes_the_provider_down_and_one_answer_ends_it(bed: &Bed) {
    let (q, name) = (bed.queue(), bed.name());
    let rules = OutageRules {
        min_fails: 3,
        window: Duration::ZERO,
        window_429: Duration::from_secs(3600),
        probe_every_max: Duration::from_secs(5),
    };
    let failed = |rate_limited: bool| FailedCall {
        took: Duration::from_millis(5),
        cause: if rate_limited { "rate_limited" } else { "http_503" },
        rate_limited,
        message: "busy",
        base_url: "http://127.0.0.1:1/v1",
        worker: "w1",
        probe: false,
        lease: Duration::from_secs(40),
    };
    // 429s only: their own, longer window.
    for _ in 0..4 {
        let noted = q.provider_failed(&failed(true), &rules).await.unwrap();
        assert_eq!(noted.state, Provider::Up, "{name}: 429s alone within their window");
    }
    // A 503 makes it a plain streak, past its failures and window: down now, then down.
    assert_eq!(
        q.provider_failed(&failed(false), &rules).await.unwrap().state,
        Provider::DownNow,
        "{name}"
    );
    let noted = q.provider_failed(&failed(false), &rules).await.unwrap();
    assert_eq!(noted.state, Provider::Down, "{name}");
    assert_eq!(noted.answered_ms, 0, "{name}: never answered");
    let ended = q.provider_answered().await.unwrap();
    assert!(ended.is_some_and(|(since, now)| since <= now), "{name}: {ended:?}");
    assert_eq!(q.provider_answered().await.unwrap(), None, "{name}: up already");
    // A new streak starts after the answer.
    let noted = q.provider_failed(&failed(false), &rules).await.unwrap();
    assert_eq!(noted.state, Provider::Up, "{name}");
    assert!(
        noted.answered_ms > 0 && noted.since_ms > noted.answered_ms,
        "{name}: {noted:?}"
    );
}

async fn the_breaker_counts_each_signature_fleet_wide(bed: &Bed) {
    let (q, name) = (bed.queue(), bed.name());
    assert_eq!(q.breaker_count("401:invalid_api_key").await.unwrap(), 1, "{name}");
    assert_eq!(q.breaker_count("401:invalid_api_key").await.unwrap(), 2, "{name}");
    assert_eq!(q.breaker_count("404:model_not_found").await.unwrap(), 1, "{name}");
}

#[tokio::test]
async fn first_writer_wins() {
    both!(first_writer_wins_and_a_late_or_repeated_outcome_changes_nothing);
}

#[tokio::test]
async fn retry_at_once() {
    both!(a_retry_due_at_once_is_back_on_the_stream);
}

#[tokio::test]
async fn taken_over_and_paid() {
    both!(a_delivery_taken_over_is_stale_but_its_paid_call_counts_once);
}

#[tokio::test]
async fn halt() {
    both!(the_halt_keeps_its_first_reason);
}

#[tokio::test]
async fn drift_halt() {
    both!(a_drift_alarm_halts_only_under_the_latest_resume_mark);
}

#[tokio::test]
async fn budget() {
    both!(the_budget_grants_waits_and_halts_as_budget_lua_does);
}

#[tokio::test]
async fn outage() {
    both!(the_outage_streak_takes_the_provider_down_and_one_answer_ends_it);
}

#[tokio::test]
async fn breaker() {
    both!(the_breaker_counts_each_signature_fleet_wide);
}

/// A ledger a drained fleet left to expire (`ledger_expire.lua`) persists
/// again as soon as a call is new to it, recorded with an outcome
/// (`finish.lua`) or without one (`ledger.lua`): no paid call ever leaves
/// Redis before the sink holds it.
#[tokio::test]
async fn a_ledger_left_to_expire_persists_again_when_a_call_is_recorded() {
    let bed = Bed::redis().await;
    let Bed::Redis {
        _server: server, store, ..
    } = &bed
    else {
        unreachable!()
    };
    let mut c = server.conn();
    let (ledger, sunk) = (common::keys::ledger(JOB, 0), common::keys::ledger_sunk(JOB, 0));
    let left_to_expire = |c: &mut redis::Connection| {
        let _: () = redis::cmd("HSET").arg(&ledger).arg("old").arg("x").query(c).unwrap();
        let _: () = redis::cmd("ZADD").arg(&sunk).arg(1).arg("old").query(c).unwrap();
        for k in [&ledger, &sunk] {
            let _: () = redis::cmd("EXPIRE").arg(k).arg(100).query(c).unwrap();
        }
    };
    let ttls = |c: &mut redis::Connection| -> Vec<i64> {
        [&ledger, &sunk]
            .iter()
            .map(|k| redis::cmd("TTL").arg(k).query(c).unwrap())
            .collect()
    };
    left_to_expire(&mut c);
    assert_eq!(ttls(&mut c), [100, 100]);
    bed.enqueue("e").await;
    let d = bed.deliver("w1").await;
    let how = Finish::Drop { reason: "x".into() };
    let call = paid(&d);
    assert_eq!(
        bed.queue().finish(&d, &how, Some(&call), false).await.unwrap(),
        Finished::Moved
    );
    assert_eq!(ttls(&mut c), [-1, -1], "an outcome's new call: both persist");
    left_to_expire(&mut c);
    let mut lost = paid(&d);
    lost.call = 2;
    store.record_paid(JOB, &[(0, lost)]).await.unwrap();
    assert_eq!(
        ttls(&mut c),
        [-1, -1],
        "a call recorded without an outcome: both persist"
    );
}

/// A delivery's result, as a call that answered it commits it.
fn result_for(d: &Delivery) -> common::task::ResultRecord {
    let spec = common::spec::JobSpec::parse(include_str!("../../examples/job.toml"), "example").unwrap();
    harness::result_for(d, &spec)
}

/// While the provider's rate paces the worker, a call's outcomes that
/// settle their records for good (results, with their paid calls) wait a
/// moment for each other and share one script call (one record's call runs
/// the counters and the ack alone); one that puts a record back on the
/// stream goes at once and takes the waiting ones with it, and so does an
/// outcome with no call (a drop, a cancel: loops store those one after
/// another). A worker the rate does not hold back stores each at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paced_workers_results_share_a_call_and_a_retry_sends_them_at_once() {
    use std::sync::Arc;
    use worker::limiter::Lately;
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    store.prepare_job(JOB, "", 1, false).await.unwrap();
    let bed = Bed::Redis {
        _server: server,
        store: store.clone(),
        queue: RedisQueue::new(&store, JOB),
    };
    for rid in ["p1", "p2", "p3", "p4", "p5"] {
        bed.enqueue(rid).await;
    }
    let mut delivered = Vec::new();
    for _ in 0..5 {
        delivered.push(bed.deliver("w1").await);
    }
    let paced = Arc::new(Lately::new());
    paced.mark();
    let queue = Arc::new(RedisQueue::paced(&store, JOB, paced));
    let Bed::Redis { _server: server, .. } = &bed else {
        unreachable!()
    };
    let commit = |q: &Arc<RedisQueue>, d: Delivery| {
        let q = q.clone();
        tokio::spawn(async move {
            let (how, call) = (Finish::Commit(result_for(&d)), paid(&d));
            q.finish(&d, &how, Some(&call), false).await
        })
    };
    let scripts = server.calls_of("evalsha");
    let first = commit(&queue, delivered[0].clone());
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        bed.state("p1").await,
        Some(RecordState::Queued),
        "a paced result waits for others"
    );
    // The second result and a retry at once, queued in that order.
    let (d2, d3) = (&delivered[1], &delivered[2]);
    let (how, call) = (Finish::Commit(result_for(d2)), paid(d2));
    let retry = Finish::Retry {
        due_ms: 0,
        task: d3.task.next(1, 1, vec![], vec![]),
    };
    let (second, retried) = tokio::join!(
        queue.finish(d2, &how, Some(&call), false),
        queue.finish(d3, &retry, None, false)
    );
    assert_eq!((second.unwrap(), retried.unwrap()), (Finished::Moved, Finished::Moved));
    assert_eq!(first.await.unwrap().unwrap(), Finished::Moved);
    assert_eq!(bed.state("p1").await, Some(RecordState::Done));
    assert_eq!(bed.state("p3").await, Some(RecordState::Queued), "back on the stream");
    assert_eq!(
        server.calls_of("evalsha"),
        scripts + 1,
        "the retry went at once, with both results, in one call"
    );
    assert_eq!(bed.paid_calls().await, 2);

    // An outcome with no call goes at once, paced or not.
    let dropped = Finish::Drop { reason: "x".into() };
    let d4 = &delivered[3];
    assert_eq!(queue.finish(d4, &dropped, None, false).await.unwrap(), Finished::Moved);
    assert_eq!(server.calls_of("evalsha"), scripts + 2);

    // Not paced: a result at once.
    let unpaced = Arc::new(RedisQueue::paced(&store, JOB, Arc::new(Lately::new())));
    let alone = commit(&unpaced, delivered[4].clone());
    let soon = tokio::time::Instant::now() + Duration::from_millis(150);
    while bed.state("p5").await == Some(RecordState::Queued) && tokio::time::Instant::now() < soon {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(bed.state("p5").await, Some(RecordState::Done), "not paced: at once");
    alone.await.unwrap().unwrap();
}

//! The worker's services one round at a time (`run_once` bodies called
//! directly), against a real redis-server and llm-sim: the claimer reads its
//! own pending tasks first and holds back for halted jobs and for a reclaim
//! backlog; the rescuer takes a dead consumer's task over exactly once and
//! leaves a busy one's alone. Idle times are injected (`XCLAIM ... IDLE`).

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::keys;
use harness::{LlmSim, RedisServer, TempDir, enqueue, spec_with, write_records};
use redis::Commands;
use worker::claim::Claimer;
use worker::fleet::Fleet;
use worker::reclaim::Rescuer;
use worker::run::{Config, start};
use worker::watch::Watcher;

const JOB: &str = "svc";
const VISIBILITY: Duration = Duration::from_secs(60);

/// A job of `n` records in one partition.
fn job(redis: &RedisServer, n: u64) -> TempDir {
    job_with(redis, n, &[])
}

/// A job of `n` records in one partition, its spec further changed.
fn job_with(redis: &RedisServer, n: u64, changes: &[(&str, &str)]) -> TempDir {
    let dir = TempDir::new("services");
    // The worker runs in this test process, which cannot set variables
    // (unsafe code is forbidden): the key is read from one that is always set.
    let mut all = vec![
        ("partitions = 4", "partitions = 1"),
        ("api_key_env = \"OPENAI_API_KEY\"", "api_key_env = \"PATH\""),
    ];
    all.extend_from_slice(changes);
    let spec = spec_with(&dir, &all);
    let data = dir.join("d.jsonl");
    write_records(&data, 0, n);
    enqueue(redis, &data, JOB, &spec);
    dir
}

fn config(redis: &RedisServer, sim: &LlmSim, consumer: &str) -> Config {
    Config {
        redis_url: redis.url(),
        jobs: vec![JOB.into()],
        concurrency: 4,
        consumer: consumer.into(),
        drain: false,
        drain_timeout: Some(Duration::from_secs(10)),
        visibility_timeout: Some(VISIBILITY),
        max_deliveries: 5,
        breaker_errors: 3,
        idle_poll: Duration::from_millis(20),
        heartbeat: Duration::from_secs(5),
        base_url: Some(sim.base_url()),
        allow_evicting_redis: false,
        metrics_addr: None,
        metrics_fallback: false,
        traces: common::otel::Traces::off(),
    }
}

async fn fleet(redis: &RedisServer, sim: &LlmSim, consumer: &str) -> Arc<Fleet> {
    start(
        config(redis, sim, consumer),
        Arc::new(worker::telemetry::Metrics::new()),
    )
    .await
    .expect("worker starts")
    .0
}

/// Reads `count` new entries as `consumer` (a worker that then dies or stays busy).
fn read_as(redis: &RedisServer, consumer: &str, count: usize) -> Vec<String> {
    let reply: redis::streams::StreamReadReply = redis
        .conn()
        .xread_options(
            &[keys::stream(JOB, 0)],
            &[">"],
            &redis::streams::StreamReadOptions::default()
                .group(keys::GROUP, consumer)
                .count(count),
        )
        .unwrap();
    reply.keys.into_iter().flat_map(|k| k.ids).map(|e| e.id).collect()
}

/// Makes an entry look idle for `ms`, keeping its owner (time injection).
fn set_idle(redis: &RedisServer, consumer: &str, id: &str, ms: u64) {
    let _: redis::Value = redis::cmd("XCLAIM")
        .arg(keys::stream(JOB, 0))
        .arg(keys::GROUP)
        .arg(consumer)
        .arg(0)
        .arg(id)
        .arg("IDLE")
        .arg(ms)
        .arg("JUSTID")
        .query(&mut redis.conn())
        .unwrap();
}

/// (owner, deliveries) of a pending entry, None when it is not pending.
fn pending_entry(redis: &RedisServer, id: &str) -> Option<(String, u64)> {
    redis
        .pending_entry(&keys::stream(JOB, 0), id)
        .map(|(owner, _, n)| (owner, n))
}

fn states(redis: &RedisServer) -> std::collections::HashMap<String, String> {
    redis.conn().hgetall(keys::state(JOB, 0)).unwrap()
}

async fn settle(fleet: &Fleet) {
    fleet.tracker.close();
    tokio::time::timeout(Duration::from_secs(20), fleet.tracker.wait())
        .await
        .expect("tasks finish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_consumers_task_is_taken_over_exactly_once_and_a_busy_ones_is_not() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    let _dir = job(&redis, 2);
    let dead = read_as(&redis, "dead", 1).remove(0);
    let busy = read_as(&redis, "busy", 1).remove(0);
    // The dead one has been silent past the visibility timeout; the busy one not.
    set_idle(&redis, "dead", &dead, VISIBILITY.as_millis() as u64 + 5_000);
    set_idle(&redis, "busy", &busy, 1_000);

    let a = fleet(&redis, &sim, "a").await;
    let b = fleet(&redis, &sim, "b").await;
    let (mut ra, mut rb) = (Rescuer::new(a.clone()), Rescuer::new(b.clone()));
    // Before the claimer read its own pending entries, the rescuer waits.
    assert_eq!(ra.rescue_round().await, 0);
    a.own_pending_read.store(true, Ordering::Relaxed);
    b.own_pending_read.store(true, Ordering::Relaxed);
    // Both look at once: XCLAIM re-checks the idle time, so one wins.
    let (ta, tb) = tokio::join!(ra.rescue_round(), rb.rescue_round());
    assert_eq!(ta + tb, 1, "taken over exactly once (a: {ta}, b: {tb})");
    settle(&a).await;
    settle(&b).await;
    let s = states(&redis);
    let done: Vec<&String> = s.iter().filter(|(_, v)| *v == "done").map(|(k, _)| k).collect();
    assert_eq!(done.len(), 1, "{s:?}");
    assert_eq!(sim.stats()["requests"], 1, "one model call, for the dead worker's task");
    assert_eq!(pending_entry(&redis, &dead), None, "settled and acknowledged");
    assert_eq!(
        pending_entry(&redis, &busy),
        Some(("busy".to_owned(), 1)),
        "a busy worker's task stays with it, delivered once"
    );
    // And again later: still nothing to take.
    assert_eq!(ra.rescue_round().await + rb.rescue_round().await, 0);
    assert_eq!(a.reclaim_backlog.load(Ordering::Relaxed), 0);
}

/// An idle poll (a claimer's wait that ended with no wake-up) asks whether
/// a partition may hold undelivered tasks (`XINFO GROUPS`, its lag) before
/// it asks the limiter for a grant: with none, no script runs. The lag
/// says so once tasks are enqueued, and not once they are delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_poll_asks_no_grant_unless_a_partition_may_hold_work() {
    use worker::service::Service;
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    let _dir = job(&redis, 2);
    let f = fleet(&redis, &sim, "a").await;
    assert!(
        f.store.may_have_undelivered("nothing-here", 0).await.unwrap(),
        "no stream: the claimer reads as usual"
    );
    assert!(f.store.may_have_undelivered(JOB, 0).await.unwrap(), "two enqueued");
    let mut claimer = Claimer::new(f.clone(), tokio_util::sync::CancellationToken::new());
    claim_all(&mut claimer, 2).await;
    assert!(!f.store.may_have_undelivered(JOB, 0).await.unwrap(), "both delivered");
    settle(&f).await;
    // Rounds that claim nothing; their waits (the idle poll, 20 ms here)
    // end with no wake-up once the tasks' own wake-ups are spent.
    for _ in 0..3 {
        claimer.run_once().await;
    }
    let (scripts, lags) = (redis.calls_of("evalsha"), redis.calls_of("xinfo|groups"));
    claimer.run_once().await;
    assert_eq!(redis.calls_of("evalsha"), scripts, "no grant asked for nothing");
    assert_eq!(redis.calls_of("xinfo|groups"), lags + 1, "the lag of the one partition");
}

/// The watcher reads the flags on a wake-up and otherwise every
/// `FLAGS_PERIOD` (30 s), not every round: a round without one renews the
/// lease only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watcher_reads_the_flags_on_a_wake_up_not_every_round() {
    use worker::service::Service;
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    let _dir = job(&redis, 1);
    let f = fleet(&redis, &sim, "a").await;
    let mut watcher = Watcher::new(f.clone());
    let flags = || redis.calls_of("mget");
    let before = flags();
    // Reads them, then waits its period (10 s) for a wake-up that does not come.
    watcher.run_once().await;
    assert_eq!(flags(), before + 1, "the first round reads the flags");
    // A round with none due: the lease only; a wake-up cuts its wait short.
    f.wake_watcher.notify_one();
    watcher.run_once().await;
    assert_eq!(flags(), before + 1, "not read again within 30 s without a wake-up");
    // The wake-up asked for them: read at the next round.
    let _: () = redis.conn().set(keys::halt(JOB), "http_401").unwrap();
    f.wake_watcher.notify_one();
    watcher.run_once().await;
    assert_eq!(flags(), before + 2, "read after the wake-up");
    assert!(f.is_halted(JOB));
}

/// A partition with nothing pending is looked at once (one `XPENDING`),
/// then not again for a visibility timeout: nothing delivered after that
/// look can be overdue sooner. One with tasks pending, all read by the
/// look with their idle times, is looked at again when the most idle could
/// be overdue, and its task is taken over then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rescuer_looks_at_a_partition_again_only_when_a_task_there_could_be_overdue() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    let _dir = job(&redis, 2);
    let f = fleet(&redis, &sim, "a").await;
    f.own_pending_read.store(true, Ordering::Relaxed);
    let mut rescuer = Rescuer::new(f.clone());
    let before = redis.calls_of("xpending");
    assert_eq!(rescuer.rescue_round().await, 0);
    assert_eq!(redis.calls_of("xpending") - before, 1, "one look at the one partition");
    assert_eq!(rescuer.rescue_round().await, 0);
    assert_eq!(redis.calls_of("xpending") - before, 1, "not looked at again");

    // Another rescuer (another worker) finds a task pending, 1.5 s short of
    // overdue: it takes nothing, and looks again only once it could be.
    let busy = read_as(&redis, "busy", 1).remove(0);
    set_idle(&redis, "busy", &busy, VISIBILITY.as_millis() as u64 - 1_500);
    let mut other = Rescuer::new(f.clone());
    let before = redis.calls_of("xpending");
    assert_eq!(other.rescue_round().await, 0);
    assert_eq!(other.rescue_round().await, 0);
    assert_eq!(
        redis.calls_of("xpending") - before,
        1,
        "one look (the entries with their idle times), not one a round"
    );
    assert_eq!(f.reclaim_backlog.load(Ordering::Relaxed), 0);
    tokio::time::sleep(Duration::from_millis(1_600)).await;
    assert_eq!(
        other.rescue_round().await,
        1,
        "overdue now: looked at again, and taken over"
    );
    settle(&f).await;
    assert_eq!(pending_entry(&redis, &busy), None, "settled and acknowledged");
    assert_eq!(
        sim.stats()["requests"],
        1,
        "one model call, for the stuck worker's task"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rescuer_without_a_free_slot_holds_new_claims_back() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    let _dir = job(&redis, 3);
    let dead = read_as(&redis, "dead", 1).remove(0);
    set_idle(&redis, "dead", &dead, VISIBILITY.as_millis() as u64 + 5_000);
    let f = fleet(&redis, &sim, "a").await;
    let mut claimer = Claimer::new(f.clone(), tokio_util::sync::CancellationToken::new());
    assert_eq!(claimer.claim_round().await.claimed, 0, "no pending entries of its own");
    assert!(f.own_pending_read.load(Ordering::Relaxed));
    // Every slot is taken.
    let held = f.permits.clone().acquire_many_owned(4).await.unwrap();
    let mut rescuer = Rescuer::new(f.clone());
    assert_eq!(rescuer.rescue_round().await, 0);
    assert_eq!(
        f.reclaim_backlog.load(Ordering::Relaxed),
        1,
        "one task waits to be taken over"
    );
    assert_eq!(rescuer.period(), Duration::from_millis(100), "looked at again soon");
    drop(held);
    let round = claimer.claim_round().await;
    assert_eq!(round.claimed, 0, "no new claims while a dead worker's task waits");
    assert_eq!(rescuer.rescue_round().await, 1);
    assert_eq!(f.reclaim_backlog.load(Ordering::Relaxed), 0);
    claim_all(&mut claimer, 2).await;
    settle(&f).await;
    assert!(states(&redis).values().all(|v| v == "done"), "{:?}", states(&redis));
    assert_eq!(sim.stats()["requests"], 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claimer_reads_its_own_pending_tasks_first_and_skips_halted_jobs() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    let _dir = job(&redis, 5);
    // A worker named "c" died holding one task; it restarts under the same name.
    let own = read_as(&redis, "c", 1).remove(0);
    let f = fleet(&redis, &sim, "c").await;
    let mut claimer = Claimer::new(f.clone(), tokio_util::sync::CancellationToken::new());
    let first = claimer.claim_round().await;
    assert_eq!(first.claimed, 1, "the first round reads only its own pending entry");
    assert!(f.own_pending_read.load(Ordering::Relaxed));
    settle_some(&f, 1).await;
    assert_eq!(pending_entry(&redis, &own), None);

    // A halted job is not claimed from.
    let _: () = redis.conn().set(keys::halt(JOB), "http_401").unwrap();
    Watcher::new(f.clone()).watch_round().await;
    assert!(f.is_halted(JOB));
    assert_eq!(claimer.claim_round().await.claimed, 0);
    let _: () = redis.conn().del(keys::halt(JOB)).unwrap();
    Watcher::new(f.clone()).watch_round().await;
    assert!(!f.is_halted(JOB));
    let rounds = claim_all(&mut claimer, 4).await;
    assert_eq!(rounds[0], 1, "after an empty round, grants follow the work: {rounds:?}");
    settle(&f).await;
    assert_eq!(states(&redis).values().filter(|v| *v == "done").count(), 5);
    assert_eq!(sim.stats()["requests"], 5);
}

/// Claim rounds until `n` tasks were claimed (for at most 10 s; until the
/// provider has answered once, a worker runs one call of a job at a time);
/// what each round that claimed something claimed.
async fn claim_all(claimer: &mut Claimer, n: usize) -> Vec<usize> {
    let mut rounds = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while rounds.iter().sum::<usize>() < n {
        assert!(tokio::time::Instant::now() < deadline, "claimed only {rounds:?} of {n}");
        match claimer.claim_round().await.claimed {
            0 => tokio::time::sleep(Duration::from_millis(10)).await,
            c => rounds.push(c),
        }
    }
    assert_eq!(rounds.iter().sum::<usize>(), n, "{rounds:?}");
    rounds
}

/// Waits until `n` tasks have finished (the tracker stays open).
async fn settle_some(f: &Fleet, n: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while f.summary.lock().await.outcomes.values().sum::<u64>() < n as u64 {
        assert!(tokio::time::Instant::now() < deadline, "tasks did not finish");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Settles `g` on a task of its own (a settlement may wait for others).
fn settle_in_background(
    limiter: &Arc<worker::limiter::Limiter>,
    g: worker::limiter::Grant,
    used: worker::limiter::Used,
    headers: worker::limiter::RateHeaders,
) -> tokio::task::JoinHandle<Result<(), common::store::StoreError>> {
    let limiter = limiter.clone();
    tokio::spawn(async move { limiter.settle(g, &used, &headers).await })
}

/// The grants of `limiter` that hold a slot in Redis.
fn grants_in_flight(redis: &RedisServer, limiter: &worker::limiter::Limiter) -> u64 {
    redis.conn().zcard(keys::limit_inflight(limiter.id())).unwrap()
}

/// Polls until `in_flight` falls to `n`, for well under the 250 ms a
/// settlement may wait for others.
async fn freed_within_150ms(in_flight: &impl Fn() -> u64, n: u64) {
    let soon = tokio::time::Instant::now() + Duration::from_millis(150);
    while in_flight() > n && tokio::time::Instant::now() < soon {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A fleet of one worker (4 slots) on a job of 60 requests a minute (its
/// buckets hold two grants; a third comes a second later), with the
/// example's concurrency cap of 64 (one that never binds here).
async fn paced_fleet(redis: &RedisServer, sim: &LlmSim) -> (TempDir, Arc<Fleet>) {
    let dir = job_with(redis, 8, &[("requests_per_minute = 10000", "requests_per_minute = 60")]);
    (dir, fleet(redis, sim, "a").await)
}

/// A worker the rate paces (its grants held back, or given ahead of the
/// buckets) while it has slots to spare is marked paced, and its job's
/// outcomes may then wait for each other (`RedisQueue::paced`); one whose
/// slots are mostly taken is not (a lingering outcome holds its slot), nor
/// one the rate does not hold back. A cap on the fleet's slots that does
/// not bind changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_the_rate_paces_with_slots_to_spare_is_marked_paced() {
    use worker::limiter::PACED_FOR;
    use worker::plan::Route;
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    let (_dir, f) = paced_fleet(&redis, &sim).await;
    let job = f.jobs[0].clone();
    let paced = f.limiter(&job).paced();
    let (first, ..) = f.grants(&job, 2, Route::Primary).await;
    assert_eq!(first.len(), 2);
    assert!(!paced.within(PACED_FOR), "two grants the buckets held: not paced");
    // Three of the four slots taken: the rate binds, but slots are short.
    let taken = f.permits.clone().acquire_many_owned(3).await.unwrap();
    let (ahead, ..) = f.grants(&job, 1, Route::Primary).await;
    assert_eq!(ahead.len(), 1, "given ahead of the buckets");
    assert!(!paced.within(PACED_FOR), "slots are short: not paced");
    drop(taken);
    let (later, _, bound) = f.grants(&job, 1, Route::Primary).await;
    assert_eq!((later.len(), bound), (0, common::store::Bound::Rate), "held back");
    assert!(paced.within(PACED_FOR), "paced by the rate with slots to spare");
    for held in [first, ahead, later] {
        held.release(&f).await;
    }
}

/// Where the fleet's slots held a grant back lately, a worker the rate
/// paces is not marked paced (and one marked stops being): a lingering
/// outcome would hold a slot some worker waits for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_is_not_paced_while_the_fleets_slots_hold_grants_back() {
    use worker::limiter::PACED_FOR;
    use worker::plan::Route;
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    let (_dir, f) = paced_fleet(&redis, &sim).await;
    let job = f.jobs[0].clone();
    let limiter = f.limiter(&job);
    // Paced a moment ago; then a freed slot's wake-up said the fleet's
    // slots held a grant back: outcomes no longer wait.
    limiter.paced().mark();
    limiter.slots_bound();
    assert!(!limiter.paced().within(PACED_FOR), "no longer paced");
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(f.grants(&job, 2, Route::Primary).await.0);
    }
    assert_eq!(held.iter().map(|h| h.len()).sum::<usize>(), 3, "two now, one ahead");
    assert!(!limiter.paced().within(PACED_FOR));
    for h in held {
        h.release(&f).await;
    }
}

/// A grant's settlement that changes nothing at once (an answered call,
/// even one whose headers say the provider's budget is nearly spent)
/// waits a moment for others and shares their script call; a 429 goes at
/// once and takes the waiting ones with it. Once a freed slot's wake-up
/// says the fleet's slots hold some worker back, every settlement goes at
/// once (a slot is what that worker waits for).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answered_settlements_share_a_call_and_a_429_or_held_slots_send_them_at_once() {
    use worker::limiter::{RateHeaders, Used};
    use worker::service::Service;
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    // No concurrency cap in the spec (with one, every settlement goes at once: below).
    let _dir = job_with(&redis, 1, &[("max_concurrent = 64", "")]);
    let f = fleet(&redis, &sim, "a").await;
    let limiter = f.all_limiters().next().unwrap().clone();
    let in_flight = || grants_in_flight(&redis, &limiter);
    let mut grants = limiter.try_acquire(4).await.unwrap().grants;
    assert_eq!((grants.len(), in_flight()), (4, 4));
    let answered = Used {
        prompt_tokens: Some(20),
        completion_tokens: Some(5),
        ..Used::default()
    };
    let scripts = redis.calls_of("evalsha");
    let first = settle_in_background(&limiter, grants.pop().unwrap(), answered, RateHeaders::default());
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(in_flight(), 4, "an answered call's settlement waits for others");
    let refused = Used {
        rate_limited: true,
        ..Used::default()
    };
    let g = grants.pop().unwrap();
    limiter.settle(g, &refused, &RateHeaders::default()).await.unwrap();
    first.await.unwrap().unwrap();
    assert_eq!(in_flight(), 2, "the 429's settlement went at once with the waiting one");
    assert_eq!(redis.calls_of("evalsha"), scripts + 1, "in one script call");

    // The provider's headers say its budget is nearly spent (under the 2 s
    // of its limit the buckets may hold): the figure waits with the rest,
    // and is applied as of when it was seen (see `scripts.rs`).
    let nearly_spent = RateHeaders {
        limit_requests: Some(1200),
        remaining_requests: Some(3),
        ..RateHeaders::default()
    };
    let settling = settle_in_background(&limiter, grants.pop().unwrap(), answered, nearly_spent);
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        in_flight(),
        2,
        "a nearly spent budget's settlement waits for others too"
    );
    settling.await.unwrap().unwrap();
    assert_eq!(in_flight(), 1);

    // Another worker waited for a slot and a settlement freed one: its wake-up.
    let cursor = f.store.wake_cursor().await.unwrap();
    let own = common::store::RedisStore::connect(&redis.url()).await.unwrap();
    let mut listener = worker::wake::Listener::new(f.clone(), own, cursor);
    f.store.wake(limiter.id(), common::store::Wake::Slot).await;
    listener.run_once().await;
    let scripts = redis.calls_of("evalsha");
    let settling = settle_in_background(&limiter, grants.pop().unwrap(), answered, RateHeaders::default());
    freed_within_150ms(&in_flight, 0).await;
    assert_eq!(
        in_flight(),
        0,
        "with slots holding the fleet back, an answered call's slot is freed at once"
    );
    settling.await.unwrap().unwrap();
    assert_eq!(redis.calls_of("evalsha"), scripts + 1);
}

/// A claim round gives the grants it did not use back at once, together
/// (one script call, not one each: a rejoining worker's round once waited
/// 250 ms a grant), before it returns: none is left running behind it (a
/// draining worker waits for an empty tracker).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_round_gives_its_unused_grants_back_at_once_in_one_call() {
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    let _dir = job(&redis, 2);
    let f = fleet(&redis, &sim, "a").await;
    let limiter = f.all_limiters().next().unwrap().clone();
    let in_flight = || grants_in_flight(&redis, &limiter);
    let mut claimer = Claimer::new(f.clone(), tokio_util::sync::CancellationToken::new());
    claim_all(&mut claimer, 2).await;
    settle_some(&f, 2).await;
    // The tasks end once their grants are settled: on a busy machine a
    // task may still be on the tracker a moment after its settlement
    // reached Redis (the round below must find it empty to tell its own).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while in_flight() > 0 || !f.tracker.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the tasks' grants left in flight, or the tasks still running"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (granted, scripts) = (limiter.report().await.unwrap().grants, redis.calls_of("evalsha"));
    // Nothing left to claim: the round's grants all go back.
    assert_eq!(claimer.claim_round().await.claimed, 0);
    let taken = limiter.report().await.unwrap().grants - granted;
    assert!(taken > 1, "the round took {taken} grants");
    assert_eq!(in_flight(), 0, "the round returned with its grants back");
    assert!(f.tracker.is_empty(), "nothing of the round left on the tracker");
    assert_eq!(
        redis.calls_of("evalsha"),
        scripts + 2,
        "one acquire, and one settle for all of them"
    );
}

/// With a concurrency cap in the spec, slots may be what limits the fleet:
/// an answered call's settlement frees its slot at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_concurrency_cap_an_answered_calls_slot_is_freed_at_once() {
    use worker::limiter::{RateHeaders, Used};
    let redis = RedisServer::start();
    let sim = LlmSim::start(&[]);
    let _dir = job(&redis, 1);
    let f = fleet(&redis, &sim, "a").await;
    let limiter = f.all_limiters().next().unwrap().clone();
    assert!(limiter.slots_matter(), "the example spec caps concurrency at 64");
    let in_flight = || grants_in_flight(&redis, &limiter);
    let mut grants = limiter.try_acquire(1).await.unwrap().grants;
    let answered = Used {
        prompt_tokens: Some(20),
        completion_tokens: Some(5),
        ..Used::default()
    };
    let settling = settle_in_background(&limiter, grants.pop().unwrap(), answered, RateHeaders::default());
    freed_within_150ms(&in_flight, 0).await;
    assert_eq!(in_flight(), 0, "the slot is freed at once");
    settling.await.unwrap().unwrap();
}

/// A worker "a" of a job of two records whose provider (every call a 500
/// after 400 ms: a probe stays out a while) is down since now, as Redis and
/// the worker see it; its spec changed by `changes`.
async fn fleet_of_a_down_provider(
    redis: &RedisServer,
    sim: &LlmSim,
    changes: &[(&str, &str)],
) -> (TempDir, Arc<Fleet>, Arc<worker::job::JobCtx>, u64) {
    let dir = job_with(redis, 2, changes);
    let f = fleet(redis, sim, "a").await;
    let (secs, _): (u64, u64) = redis::cmd("TIME").query(&mut redis.conn()).unwrap();
    let down_ms = secs * 1000;
    let _: () = redis
        .conn()
        .hset_multiple(
            keys::outage(JOB),
            &[
                ("down", 1),
                ("down_ms", down_ms),
                ("since_ms", down_ms),
                ("probe_at", 0),
                ("probes", 0),
            ],
        )
        .unwrap();
    let job = f.jobs[0].clone();
    // The provider answered before it went down (its breaker is proven).
    job.breaker.set_proven();
    job.outage.from_redis(
        JOB,
        &common::store::ProviderOutage {
            down: true,
            since_ms: down_ms,
            ..Default::default()
        },
    );
    (dir, f, job, down_ms)
}

/// How many times this worker asked the job's rate buckets for grants.
async fn acquires(f: &Fleet, job: &worker::job::JobCtx) -> u64 {
    f.limiter(job).report().await.unwrap().acquires
}

/// llm-sim answering every call with a 500 after 400 ms (and listing the
/// calls it got, by record, at `/calls`).
fn failing_sim() -> LlmSim {
    LlmSim::start(&[
        "--faults",
        "server_error=1",
        "--latency-ms",
        "400",
        "--steady-latency",
        "--record-served",
    ])
}

/// While the provider is taken for down one probe at a time goes out, and
/// a failed probe costs Redis no more than it must (#32 item 6): the
/// claimer does not ask for the probe's lease while its own probe is out,
/// learns when the next may start from the failure's own answer (not by
/// asking again), and keeps the failed probe's delivery for that probe,
/// its own (no claim, nothing back on the stream, no one woken) until the
/// provider is back: then the record goes back on its stream, its failed
/// calls in its history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_probe_says_when_the_next_may_start_and_wakes_no_one() {
    let redis = RedisServer::start();
    let sim = failing_sim();
    let (_dir, f, job, down_ms) = fleet_of_a_down_provider(&redis, &sim, &[]).await;
    let outage = keys::outage(JOB);
    let wakes = || -> u64 { redis.conn().xlen(keys::wake()).unwrap() };
    let mut claimer = Claimer::new(f.clone(), tokio_util::sync::CancellationToken::new());
    // Its first round reads its own pending tasks (none): the lease goes back.
    assert_eq!(claimer.claim_round().await.claimed, 0);
    let _: () = redis.conn().hset(&outage, "probe_at", 0).unwrap();
    let before = acquires(&f, &job).await;
    let round = claimer.claim_round().await;
    assert_eq!(round.claimed, 1, "the probe, alone");
    let (scripts, woken) = (redis.calls_of("evalsha"), wakes());
    let granted = acquires(&f, &job).await;
    assert_eq!(
        granted,
        before + 1,
        "the probe on a lease asked for took its rate grant"
    );

    // Its own probe is out: the lease is its own, Redis is not asked.
    let round = claimer.claim_round().await;
    assert_eq!(round.claimed, 0);
    assert!(round.probe_wait.is_some(), "{:?}", round.probe_wait);
    assert_eq!(
        redis.calls_of("evalsha"),
        scripts,
        "no lease asked while its own probe is out"
    );

    settle_some(&f, 1).await;
    let probe_at: u64 = redis.conn().hget(&outage, "probe_at").unwrap();
    let probes: u64 = redis.conn().hget(&outage, "probes").unwrap();
    assert_eq!(probes, 1, "the probe failed");
    // Its delivery is kept for the next probe (its own): still pending for
    // it, delivered once, and nothing added to the stream.
    let kept = pending_of(&redis, "a");
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert_eq!(kept[0].1, 1, "{kept:?}");
    let kept_rid = tasks_in_stream(&redis)
        .into_iter()
        .find(|(id, _)| *id == kept[0].0)
        .map(|(_, t)| t.rid)
        .expect("the kept entry is in the stream");
    let stream: u64 = redis.conn().xlen(keys::stream(JOB, 0)).unwrap();
    assert_eq!(stream, 2, "the probe's entry, beside the one never claimed");
    assert_eq!(wakes(), woken, "and wakes no one");

    // The failure said when the next probe may start (2 s after it): the
    // next round waits for that without asking.
    let scripts = redis.calls_of("evalsha");
    let round = claimer.claim_round().await;
    assert_eq!(round.claimed, 0);
    let wait = round.probe_wait.expect("waits for the next probe");
    assert!(
        wait > Duration::from_millis(1_000) && wait <= Duration::from_millis(2_000),
        "{wait:?} (the next probe at {probe_at}, the outage down since {down_ms})"
    );
    assert_eq!(
        redis.calls_of("evalsha"),
        scripts,
        "the next probe's time was not asked for"
    );
    // Then it is the next probe's turn, on the same record or the other:
    // this worker's, whose probe failed, without asking for the lease (the
    // failure gave it: the lease Redis holds is still the one it set).
    tokio::time::sleep(wait).await;
    let (reads, renewals) = (redis.calls_of("xreadgroup"), redis.calls_of("xclaim"));
    let round = claimer.claim_round().await;
    assert_eq!(round.claimed, 1, "the next probe");
    assert_eq!(
        (redis.calls_of("xreadgroup"), pending_of(&redis, "a")),
        (reads, kept.clone()),
        "the next probe claimed nothing: it sent the kept delivery (its count unchanged)"
    );
    assert_eq!(
        redis.calls_of("xclaim"),
        renewals,
        "its claim, 2 s old, still fresh: sent without a renewal"
    );
    let held = |c: &mut redis::Connection| -> (u64, u64, String) {
        let (at, held, prober): (u64, u64, String) = redis::cmd("HMGET")
            .arg(&outage)
            .arg(&["probe_at", "held_ms", "prober"])
            .query(c)
            .unwrap();
        (at, held, prober)
    };
    let (at, held_ms, prober) = held(&mut redis.conn());
    assert_eq!(
        (at, prober.as_str()),
        (probe_at, "a"),
        "the probe was sent on the lease its failure gave, not asked for"
    );
    // Another worker is told to wait until that lease ends (the probe's
    // call and its margin past when it was due), not to probe beside it;
    // unless the probe failed meanwhile: then until the next is due.
    let other = f.store.outage_probe(JOB, Duration::from_secs(40), "b").await.unwrap();
    let other = other.expect_err("another worker's probe is out");
    let (after_at, ..) = held(&mut redis.conn());
    let (secs, _): (u64, u64) = redis::cmd("TIME").query(&mut redis.conn()).unwrap();
    let until = if after_at == probe_at { held_ms } else { after_at };
    assert!(
        other.as_millis() as u64 + 1_000 >= until.saturating_sub(secs * 1000) && other > Duration::from_secs(1),
        "{other:?} (the lease held until {held_ms}, the probe due at {probe_at}, now {after_at})"
    );
    assert_eq!(
        acquires(&f, &job).await,
        granted,
        "the example's limits hold a probe a second ten times over: the probe on the lease its \
         failed probe (a 500) left it takes no rate grant"
    );
    settle_some(&f, 2).await;
    assert_eq!(sim.stats()["requests"], 2, "two probes, nothing else called");
    let calls: Vec<serde_json::Value> = serde_json::from_value(harness::http_get_json(&sim.addr, "/calls")).unwrap();
    let records: Vec<&str> = calls.iter().filter_map(|c| c["record"].as_str()).collect();
    assert_eq!(
        records,
        vec![kept_rid.as_str(); 2],
        "llm-sim got both probes for the kept record"
    );
    // Its second probe failed too: the third is its own. Stopping, it gives
    // that lease back: another worker's ask waits only for the probe's time.
    let (next_at, held_ms, prober) = held(&mut redis.conn());
    assert_eq!(prober, "a");
    job.outage.leave(&f.store, JOB, "a").await.unwrap();
    let (at, left, no_one) = held(&mut redis.conn());
    assert_eq!(
        (at, left, no_one.as_str()),
        (next_at, 0, ""),
        "the lease until {held_ms} given back"
    );
    let other = f.store.outage_probe(JOB, Duration::from_secs(40), "b").await.unwrap();
    assert!(
        other.is_ok() || other.is_err_and(|wait| wait <= Duration::from_secs(5)),
        "{other:?}: the next probe's time, not its lease's end"
    );
    // Kept again after its second failure. The provider back, the next
    // round gives it back to the stream first (a new entry whose task
    // holds both failed calls), then claims work: with one slot free, the
    // oldest entry, the record never claimed (the other stays to be read).
    assert_eq!(pending_of(&redis, "a"), kept, "kept again after its second failure");
    let _: () = redis.conn().hdel(&outage, "down").unwrap();
    job.outage.from_redis(JOB, &common::store::ProviderOutage::default());
    let busy = f.permits.clone().try_acquire_many_owned(3).unwrap();
    let round = claimer.claim_round().await;
    assert_eq!(round.claimed, 1, "the record never claimed, as work");
    let pending = pending_of(&redis, "a");
    assert!(
        pending.len() == 1 && !pending.contains(&kept[0]),
        "the kept delivery given back, not sent: {pending:?}"
    );
    drop(busy);
    let back: Vec<u32> = tasks_in_stream(&redis)
        .into_iter()
        .filter(|(_, t)| t.rid == kept_rid)
        .map(|(_, t)| t.calls)
        .collect();
    assert_eq!(
        back,
        vec![2],
        "the probes' record back on the stream with its two failed calls"
    );
}

/// A kept probe delivery of a job that is then halted goes back to its
/// stream at the next round (no probe goes while the job is halted; the
/// rescuers skip a halted job, so it would stay pending until the halt is lifted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_halted_job_s_kept_probe_delivery_goes_back_to_its_stream() {
    let redis = RedisServer::start();
    let sim = failing_sim();
    let (_dir, f, _job, _) = fleet_of_a_down_provider(&redis, &sim, &[]).await;
    let mut claimer = Claimer::new(f.clone(), tokio_util::sync::CancellationToken::new());
    assert_eq!(
        claimer.claim_round().await.claimed,
        0,
        "its own pending tasks read first"
    );
    let _: () = redis.conn().hset(keys::outage(JOB), "probe_at", 0).unwrap();
    assert_eq!(claimer.claim_round().await.claimed, 1, "the probe");
    settle_some(&f, 1).await;
    let kept = pending_of(&redis, "a");
    assert_eq!(kept.len(), 1, "kept for the next probe: {kept:?}");
    f.halted_here(JOB, "a test halts the job");
    assert_eq!(claimer.claim_round().await.claimed, 0);
    assert_eq!(pending_of(&redis, "a"), vec![], "given back");
    let calls: Vec<u32> = tasks_in_stream(&redis).into_iter().map(|(_, t)| t.calls).collect();
    assert_eq!(
        calls,
        vec![0, 1],
        "the other record, and the probe's with its failed call"
    );
}

/// Each entry of the job's stream and its task.
fn tasks_in_stream(redis: &RedisServer) -> Vec<(String, common::task::Task)> {
    let entries: redis::streams::StreamRangeReply = redis.conn().xrange_all(keys::stream(JOB, 0)).unwrap();
    entries
        .ids
        .into_iter()
        .map(|e| {
            let fields: Vec<(String, String)> = e
                .map
                .into_iter()
                .map(|(k, v)| (k, redis::from_redis_value(v).unwrap()))
                .collect();
            let task = common::task::Task::from_entry_fields(fields.iter().map(|(k, v)| (k.as_str(), v.as_str())));
            (e.id, task.unwrap())
        })
        .collect()
}

/// (entry id, deliveries) of each task pending for `consumer`.
fn pending_of(redis: &RedisServer, consumer: &str) -> Vec<(String, u64)> {
    let reply: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg(keys::stream(JOB, 0))
        .arg(keys::GROUP)
        .arg("-")
        .arg("+")
        .arg(10)
        .arg(consumer)
        .query(&mut redis.conn())
        .unwrap();
    reply.into_iter().map(|(id, _, _, n)| (id, n)).collect()
}

/// Where the told limits do not hold a probe a second ten times over (300
/// requests a minute), the probe on the lease a failed probe left its
/// worker takes its rate grant all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_takes_its_grant_where_the_told_limits_do_not_spare_it() {
    let redis = RedisServer::start();
    let sim = failing_sim();
    let tight = [("requests_per_minute = 10000", "requests_per_minute = 300")];
    let (_dir, f, job, _) = fleet_of_a_down_provider(&redis, &sim, &tight).await;
    let mut claimer = Claimer::new(f.clone(), tokio_util::sync::CancellationToken::new());
    let (mut probes, mut asked, mut due) = (0, Vec::new(), Vec::new());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while probes < 2 {
        assert!(tokio::time::Instant::now() < deadline, "two probes did not go");
        let due_before: u64 = redis.conn().hget(keys::outage(JOB), "probe_at").unwrap();
        let round = claimer.claim_round().await;
        probes += round.claimed;
        if round.claimed == 1 {
            asked.push(acquires(&f, &job).await);
            let due_after: u64 = redis.conn().hget(keys::outage(JOB), "probe_at").unwrap();
            due.push((due_before, due_after));
            settle_some(&f, probes).await;
        } else {
            let wait = round.probe_wait.unwrap_or(Duration::from_millis(50));
            tokio::time::sleep(wait.min(Duration::from_secs(3))).await;
        }
    }
    assert_eq!(sim.stats()["requests"], 2, "two probes, nothing else called");
    assert_eq!(
        due[1].0, due[1].1,
        "the second probe went on the lease its failed probe left, not asked for"
    );
    assert_eq!(asked[1], asked[0] + 1, "each probe took its rate grant: {asked:?}");
}

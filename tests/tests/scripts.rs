//! The Lua scripts on their own, through the store's verbs, against a real
//! redis-server: what each does on a settled record, a missing task and a
//! redelivery, and that every encoded task passes through unchanged.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use common::keys;
use common::spec::JobSpec;
use common::store::{
    Acquired, Bound, CallKind, EnqueueOutcome, Finish, Finished, Finishing, FreeReport, FreeWord, IdleEntry,
    LimitParams, RecordSet, RedisStore, ReviewAction, ReviewOutcome, Settlement, SunkResult, TaskEntry,
};
use common::task::{
    Action, Attempt, Delivery, HistoryItem, RecordState, ResultRecord, ReviewEntry, ReviewFacts, Stamp, Task,
};
use harness::RedisServer;
use redis::Commands;
use std::collections::HashMap;
use std::time::Duration;

const JOB: &str = "lua";

fn spec() -> JobSpec {
    JobSpec::parse(include_str!("../../examples/job.toml"), "example").unwrap()
}

/// A store on a fresh server with the job prepared (one partition).
async fn store(redis: &RedisServer) -> RedisStore {
    let store = RedisStore::connect(&redis.url()).await.unwrap();
    store.prepare_job(JOB, "", 1, false).await.unwrap();
    store
}

/// An acquire's grant ids and its wait (ms), the delays of the grants aside.
fn acquired(a: Acquired) -> (Vec<String>, u64) {
    (a.grants.into_iter().map(|(id, _)| id).collect(), a.wait_ms)
}

/// Limits of `requests`/min and `max_concurrent` calls, grants of 10 tokens
/// (5 in, 5 out), a 2 s burst, a minute's lease, nothing given ahead.
fn limits(requests: u64, max_concurrent: u64) -> LimitParams {
    LimitParams {
        requests,
        tokens: 0,
        input_tokens: 0,
        output_tokens: 0,
        max_concurrent,
        need_tokens: 10,
        need_input: 5,
        need_output: 5,
        burst_ms: 2000,
        lease_ms: 60_000,
        ahead_ms: 0,
        pass_ms: 0,
    }
}

fn entry(rid: &str, input: &str) -> TaskEntry {
    TaskEntry {
        partition: 0,
        record_id: rid.to_owned(),
        origin: format!("ds:{rid}"),
        key: rid.to_owned(),
        task: Ok(Task::new(rid, input, "").unwrap()),
    }
}

async fn state(store: &RedisStore, rid: &str) -> Option<RecordState> {
    store.record_state(JOB, 0, rid).await.unwrap()
}

async fn claim(store: &RedisStore, consumer: &str) -> Vec<Delivery> {
    store.claim(JOB, 0, consumer, 100, false).await.unwrap()
}

/// Records a, b, c and d enqueued and claimed by w1, in that order.
async fn four_claimed(store: &RedisStore) -> Vec<Delivery> {
    let entries: Vec<TaskEntry> = ["a", "b", "c", "d"].iter().map(|r| entry(r, "{}")).collect();
    store.enqueue(JOB, 60, &entries).await.unwrap();
    claim(store, "w1").await
}

fn stream_len(redis: &RedisServer) -> u64 {
    redis.conn().xlen(keys::stream(JOB, 0)).unwrap()
}

fn pending(redis: &RedisServer) -> u64 {
    let reply: redis::Value = redis::cmd("XPENDING")
        .arg(keys::stream(JOB, 0))
        .arg(keys::GROUP)
        .query(&mut redis.conn())
        .unwrap();
    match reply {
        redis::Value::Array(parts) => match parts.first() {
            Some(redis::Value::Int(n)) => *n as u64,
            _ => 0,
        },
        _ => 0,
    }
}

fn result_for(d: &Delivery) -> ResultRecord {
    harness::result_for(d, &spec())
}

#[tokio::test]
async fn enqueue_adds_each_record_once_and_passes_the_task_through() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    // Inputs with what a re-encoding would change: big integers, trailing zeros, escapes.
    let input = r#"{"id":"a","n":12345678901234567890123,"x":1.50,"t":"q\"uote\nline"}"#;
    let dropped = TaskEntry {
        task: Err("template_missing:text".into()),
        ..entry("b", "{}")
    };
    let out = store
        .enqueue(JOB, 60, &[entry("a", input), dropped.clone()])
        .await
        .unwrap();
    assert_eq!(out, vec![EnqueueOutcome::Added, EnqueueOutcome::Added]);
    // Again: nothing added, the origin of the first run is named.
    let again = store.enqueue(JOB, 60, &[entry("a", "{}"), dropped]).await.unwrap();
    assert!(
        again
            .iter()
            .all(|o| matches!(o, EnqueueOutcome::Present { origin: Some(_) })),
        "{again:?}"
    );
    assert_eq!(
        stream_len(&redis),
        1,
        "a dropped record gets no task; a known one no second"
    );
    assert_eq!(state(&store, "a").await, Some(RecordState::Queued));
    assert_eq!(
        state(&store, "b").await,
        Some(RecordState::Dropped("template_missing:text".into()))
    );
    let d = claim(&store, "w1").await;
    assert_eq!(d.len(), 1);
    assert_eq!(
        d[0].task.input.get(),
        input,
        "the input reaches the worker byte for byte"
    );
    assert_eq!((d[0].task.attempt, d[0].task.calls, d[0].deliveries), (0, 0, 1));
}

#[tokio::test]
async fn finish_moves_a_record_once_and_a_late_copy_only_acknowledges() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    store
        .enqueue(JOB, 60, &[entry("a", "{}"), entry("b", "{}")])
        .await
        .unwrap();
    let mut d = claim(&store, "w1").await;
    let b = d.pop().unwrap();
    let a = d.pop().unwrap();
    assert_eq!(
        store.finish(JOB, &a, &Finish::Commit(result_for(&a))).await.unwrap(),
        Finished::Moved
    );
    assert_eq!(state(&store, "a").await, Some(RecordState::Done));
    // A redelivered copy of a settled record (a crash between commit and ack
    // leaves one): acknowledged, nothing moves.
    let _: String = redis
        .conn()
        .xadd(
            keys::stream(JOB, 0),
            "*",
            &[("rid", "a"), ("task", a.task.encode().as_str())],
        )
        .unwrap();
    let copy = claim(&store, "w1").await.remove(0);
    let late = ResultRecord {
        worker: Some("late".into()),
        ..result_for(&copy)
    };
    assert_eq!(
        store.finish(JOB, &copy, &Finish::Commit(late)).await.unwrap(),
        Finished::AlreadySettled
    );
    let mut results = Vec::new();
    store.results(JOB, 0, |r| results.push(r)).await.unwrap();
    assert_eq!(results.len(), 1);
    assert_eq!(results[0].worker.as_deref(), Some("w"), "first writer wins");
    for late in [
        Finish::Review(review_of(&a, "attempts_exhausted")),
        Finish::Drop { reason: "x".into() },
        Finish::Retry {
            due_ms: 0,
            task: a.task.clone(),
        },
        Finish::Cancel(a.task.clone()),
    ] {
        assert_ne!(store.finish(JOB, &a, &late).await.unwrap(), Finished::Moved, "{late:?}");
    }
    assert_eq!(state(&store, "a").await, Some(RecordState::Done));
    let mut reviews = 0;
    store
        .record_ids(JOB, 0, RecordSet::Review, |_| reviews += 1)
        .await
        .unwrap();
    assert_eq!(reviews, 0);

    // A retry of a record already waiting to retry keeps the one it has.
    let next = b.task.next(1, 1, vec![], vec![]);
    let retry = |task: &Task| Finish::Retry {
        due_ms: 1,
        task: task.clone(),
    };
    assert_eq!(store.finish(JOB, &b, &retry(&next)).await.unwrap(), Finished::Moved);
    assert_ne!(store.finish(JOB, &b, &retry(&next)).await.unwrap(), Finished::Moved);
    let mut delayed = Vec::new();
    store
        .record_ids(JOB, 0, RecordSet::Delayed, |rid| delayed.push(rid))
        .await
        .unwrap();
    assert_eq!(delayed, vec!["b".to_owned()]);
    // Every finish acknowledged and deleted its entry.
    assert_eq!((stream_len(&redis), pending(&redis)), (0, 0));
}

#[tokio::test]
async fn a_late_outcome_of_a_task_taken_over_changes_nothing() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    store.enqueue(JOB, 60, &[entry("a", "{}")]).await.unwrap();
    let stale = claim(&store, "w1").await.remove(0);
    // w1 stops; w2 takes the task over (its idle time is past the timeout).
    let idle = [IdleEntry {
        entry_id: stale.entry_id.clone(),
        deliveries: 1,
        idle_ms: 0,
    }];
    let live = store.reclaim(JOB, 0, "w2", 0, &idle).await.unwrap().remove(0);
    assert_eq!((live.consumer.as_str(), live.deliveries), ("w2", 2));
    // w1 wakes up and schedules a retry: not applied, nothing acknowledged.
    let retry = Finish::Retry {
        due_ms: 1,
        task: stale.task.next(1, 1, vec![], vec![]),
    };
    assert_eq!(store.finish(JOB, &stale, &retry).await.unwrap(), Finished::Stale);
    assert_eq!(state(&store, "a").await, Some(RecordState::Queued));
    assert_eq!(pending(&redis), 1, "the entry is still w2's");
    let mut delayed = 0;
    store
        .record_ids(JOB, 0, RecordSet::Delayed, |_| delayed += 1)
        .await
        .unwrap();
    assert_eq!(delayed, 0, "no second live task for the record");
    // The same consumer name with another delivery count is stale too.
    let older = Delivery {
        consumer: "w2".into(),
        deliveries: 1,
        ..live.clone()
    };
    assert_eq!(
        store
            .finish(JOB, &older, &Finish::Commit(result_for(&older)))
            .await
            .unwrap(),
        Finished::Stale
    );
    assert_eq!(
        store.check_delivery(JOB, &stale).await.unwrap(),
        (Some(RecordState::Queued), false)
    );
    assert_eq!(
        store.check_delivery(JOB, &live).await.unwrap(),
        (Some(RecordState::Queued), true)
    );
    // The live one applies.
    assert_eq!(
        store
            .finish(JOB, &live, &Finish::Commit(result_for(&live)))
            .await
            .unwrap(),
        Finished::Moved
    );
    assert_eq!((stream_len(&redis), pending(&redis)), (0, 0));
}

/// A delivery kept for a later call (a failed probe's, for the next probe)
/// is renewed only while it is the live one: its idle time starts over and
/// its delivery count stays; one another worker took over is left as it is.
#[tokio::test]
async fn a_kept_delivery_is_renewed_only_while_it_is_the_live_one() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    store.enqueue(JOB, 60, &[entry("a", "{}")]).await.unwrap();
    let mut kept = claim(&store, "w1").await.remove(0);
    let idle_of = |id: &str| redis.pending_entry(&keys::stream(JOB, 0), id).expect("pending");
    std::thread::sleep(Duration::from_millis(300));
    let claimed_at = kept.claimed_at;
    assert!(idle_of(&kept.entry_id).1 >= 300);
    let state = store.renew(JOB, &mut kept).await.unwrap();
    assert_eq!(state, Some(Some(RecordState::Queued)));
    let (owner, idle, count) = idle_of(&kept.entry_id);
    assert_eq!(
        (owner.as_str(), count),
        ("w1", 1),
        "still w1's, its delivery count unchanged"
    );
    assert!(idle < 300, "its idle time started over: {idle} ms");
    assert!(kept.claimed_at > claimed_at, "and the delivery is as fresh as a claim");
    assert_eq!(kept.state_at_claim, Some(Some(RecordState::Queued)));

    // w2 takes it over (w1 hung past the timeout): w1's renewal changes nothing.
    let idle = [IdleEntry {
        entry_id: kept.entry_id.clone(),
        deliveries: 1,
        idle_ms: 0,
    }];
    let live = store.reclaim(JOB, 0, "w2", 0, &idle).await.unwrap().remove(0);
    std::thread::sleep(Duration::from_millis(300));
    let before = kept.claimed_at;
    assert_eq!(store.renew(JOB, &mut kept).await.unwrap(), None);
    let (owner, idle, count) = idle_of(&live.entry_id);
    assert_eq!((owner.as_str(), count), ("w2", 2), "still w2's");
    assert!(idle >= 300, "w2's idle time untouched: {idle} ms");
    assert_eq!(kept.claimed_at, before);
}

#[tokio::test]
async fn finish_of_a_task_whose_entry_is_gone_still_settles_the_record() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    store.enqueue(JOB, 60, &[entry("a", "{}")]).await.unwrap();
    let d = claim(&store, "w1").await.remove(0);
    let _: () = redis.conn().xdel(keys::stream(JOB, 0), &[&d.entry_id]).unwrap();
    assert_eq!(
        store.finish(JOB, &d, &Finish::Commit(result_for(&d))).await.unwrap(),
        Finished::Moved
    );
    assert_eq!(state(&store, "a").await, Some(RecordState::Done));
    // A record the job does not know is never moved.
    store.enqueue(JOB, 60, &[entry("b", "{}")]).await.unwrap();
    let b = claim(&store, "w1").await.remove(0);
    let stranger = Delivery {
        task: Task::new("zz", "{}", "").unwrap(),
        ..b.clone()
    };
    assert_eq!(
        store
            .finish(JOB, &stranger, &Finish::Commit(result_for(&stranger)))
            .await
            .unwrap(),
        Finished::AlreadySettled
    );
    assert_eq!(state(&store, "zz").await, None);
}

fn review_of(d: &Delivery, reason: &str) -> ReviewEntry {
    let facts = ReviewFacts {
        key: &d.task.rid,
        prompt: "p",
        last_raw_output: "{}",
        errors: &[],
        attempts: 2,
        reason,
    };
    let history = vec![HistoryItem::Attempt(Attempt {
        attempt: 1,
        call: 1,
        at: String::new(),
        worker: "w".into(),
        elapsed_ms: 1,
        status: Some(200),
        response_id: None,
        finish_reason: "stop".into(),
        outcome: "invalid_output".into(),
        errors: vec![],
        repairs: vec![],
        usage: None,
        decision: "review".into(),
        error: None,
        feedback: None,
        batch: None,
        tier: None,
        trail: Default::default(),
        check: None,
    })];
    ReviewEntry::new(d, facts, history, &Stamp::now(&spec()), "w")
}

#[tokio::test]
async fn promote_moves_only_due_retries_of_records_still_waiting() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    store
        .enqueue(JOB, 60, &[entry("a", "{}"), entry("b", "{}")])
        .await
        .unwrap();
    let mut d = claim(&store, "w1").await;
    let b = d.pop().unwrap();
    let a = d.pop().unwrap();
    let history = vec![HistoryItem::Action(Action::new("requeue", "ana"))];
    let a_next = a.task.next(2, 3, vec![], history);
    let due = 1_000_000;
    store
        .finish(
            JOB,
            &a,
            &Finish::Retry {
                due_ms: due,
                task: a_next.clone(),
            },
        )
        .await
        .unwrap();
    store
        .finish(
            JOB,
            &b,
            &Finish::Retry {
                due_ms: due,
                task: b.task.next(1, 1, vec![], vec![]),
            },
        )
        .await
        .unwrap();
    // b settles meanwhile (a late commit wins): its retry must not come back.
    let _: () = redis.conn().hset(keys::state(JOB, 0), "b", "done").unwrap();
    // Time is injected: nothing is due a millisecond early.
    // The promoter is told when to come back.
    assert_eq!(store.promote_due(JOB, 0, due - 1, 100).await.unwrap(), (0, Some(due)));
    let woken = store.wake_cursor().await.unwrap();
    assert_eq!(store.promote_due(JOB, 0, due, 100).await.unwrap(), (1, None));
    assert!(
        store
            .wait_wake(&woken, 1)
            .await
            .unwrap()
            .is_some_and(|w| !w.flags && w.slots.is_empty()),
        "a promoted retry wakes the idle fleet"
    );
    assert_eq!(state(&store, "a").await, Some(RecordState::Queued));
    let mut delayed = 0;
    store
        .record_ids(JOB, 0, RecordSet::Delayed, |_| delayed += 1)
        .await
        .unwrap();
    assert_eq!(delayed, 0, "b's stale retry was removed, not re-queued");
    let back = claim(&store, "w2").await;
    assert_eq!(back.len(), 1);
    assert_eq!(back[0].task, a_next, "the task came back exactly as it was scheduled");
}

#[tokio::test]
async fn cancel_keeps_undelivered_and_waiting_work_and_resume_puts_it_back_unchanged() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    store
        .enqueue(JOB, 60, &[entry("a", "{}"), entry("b", "{}"), entry("c", "{}")])
        .await
        .unwrap();
    // a is delivered and waits to retry; b is in flight; c was never delivered.
    let mut first = store.claim(JOB, 0, "w1", 2, false).await.unwrap();
    let b = first.pop().unwrap();
    let a = first.pop().unwrap();
    let a_next = a.task.next(1, 1, vec![], vec![]);
    store
        .finish(
            JOB,
            &a,
            &Finish::Retry {
                due_ms: u64::MAX / 2,
                task: a_next.clone(),
            },
        )
        .await
        .unwrap();
    assert_eq!(
        store.cancel_job(JOB, 1).await.unwrap(),
        2,
        "the retry and the undelivered task"
    );
    assert_eq!(state(&store, "a").await, Some(RecordState::Cancelled));
    assert_eq!(
        state(&store, "b").await,
        Some(RecordState::Queued),
        "in-flight work finishes"
    );
    assert_eq!(state(&store, "c").await, Some(RecordState::Cancelled));
    assert!(store.cancelled(JOB).await.unwrap());
    // The in-flight task of a cancelled job is kept for resume too.
    assert_eq!(
        store.finish(JOB, &b, &Finish::Cancel(b.task.clone())).await.unwrap(),
        Finished::Moved
    );
    assert_eq!(store.resume_job(JOB, 1).await.unwrap(), 3);
    assert!(!store.cancelled(JOB).await.unwrap());
    let mut back = claim(&store, "w2").await;
    back.sort_by(|x, y| x.task.rid.cmp(&y.task.rid));
    let rids: Vec<&str> = back.iter().map(|d| d.task.rid.as_str()).collect();
    assert_eq!(rids, ["a", "b", "c"]);
    assert_eq!(
        back[0].task, a_next,
        "attempt counts and history survive cancel and resume"
    );
}

#[tokio::test]
async fn review_actions_apply_once_and_only_to_the_entry_as_read() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    store
        .enqueue(JOB, 60, &[entry("a", "{}"), entry("b", "{}")])
        .await
        .unwrap();
    for d in claim(&store, "w1").await {
        let review = review_of(&d, "attempts_exhausted");
        assert_eq!(
            store.finish(JOB, &d, &Finish::Review(review)).await.unwrap(),
            Finished::Moved
        );
    }
    let a = store.review_entry(JOB, 0, "a").await.unwrap().unwrap();
    let b = store.review_entry(JOB, 0, "b").await.unwrap().unwrap();
    // Two reviewers read the same entry: the first action wins, the second is lost.
    let requeue = Action::new("requeue", "ana");
    let outcome = store
        .review_act(
            JOB,
            0,
            &a,
            &a.archived(requeue.clone()),
            &ReviewAction::Requeue(a.requeue(&requeue)),
        )
        .await
        .unwrap();
    assert_eq!(outcome, ReviewOutcome::Applied);
    let reject = ReviewAction::Reject { reason: "no".into() };
    let lost = store
        .review_act(JOB, 0, &a, &a.archived(Action::new("reject", "bob")), &reject)
        .await
        .unwrap();
    assert_eq!(lost, ReviewOutcome::Lost);
    assert_eq!(state(&store, "a").await, Some(RecordState::Queued));
    let again = claim(&store, "w2").await.remove(0);
    assert_eq!(
        (again.task.attempt, again.task.base),
        (2, 2),
        "a new round counts attempts on"
    );
    assert_eq!(
        store.archived_review(JOB, 0, "a").await.unwrap().unwrap().actions.len(),
        1
    );

    // Accepting a record that has a result meanwhile changes nothing.
    let _: () = redis.conn().hset(keys::results(JOB, 0), "b", "{}").unwrap();
    let human = ResultRecord::from_review(&b, serde_json::Map::new(), vec![], &Stamp::now(&spec()), "ana");
    let done = store
        .review_act(
            JOB,
            0,
            &b,
            &b.archived(Action::new("accept", "ana")),
            &ReviewAction::Accept(Box::new(human)),
        )
        .await
        .unwrap();
    assert_eq!(done, ReviewOutcome::AlreadyDone);
    assert_eq!(state(&store, "b").await, Some(RecordState::Review));
}

#[tokio::test]
async fn retry_record_requeues_only_from_the_state_the_operator_saw() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    store.enqueue(JOB, 60, &[entry("a", "{}")]).await.unwrap();
    let d = claim(&store, "w1").await.remove(0);
    store
        .finish(
            JOB,
            &d,
            &Finish::Drop {
                reason: RecordState::REJECTED.into(),
            },
        )
        .await
        .unwrap();
    let task = d.task.next(3, 4, vec![], vec![]);
    assert!(!store.retry_record(JOB, 0, &RecordState::Review, &task).await.unwrap());
    let rejected = RecordState::Dropped(RecordState::REJECTED.into());
    assert!(store.retry_record(JOB, 0, &rejected, &task).await.unwrap());
    assert!(
        !store.retry_record(JOB, 0, &rejected, &task).await.unwrap(),
        "only once"
    );
    assert_eq!(claim(&store, "w2").await.remove(0).task, task);
}

#[tokio::test]
async fn tasks_of_earlier_versions_are_still_delivered() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let _: () = redis.conn().hset(keys::state(JOB, 0), "old", "queued").unwrap();
    let _: String = redis
        .conn()
        .xadd(
            keys::stream(JOB, 0),
            "*",
            &[
                ("rid", "old"),
                ("input", "{\"id\":\"m1\"}"),
                ("attempt", "2"),
                ("calls", "3"),
                ("base", "1"),
                ("feedback", "[]"),
                ("history", "[]"),
                ("tp", ""),
            ],
        )
        .unwrap();
    let d = claim(&store, "w1").await.remove(0);
    assert_eq!(
        (d.task.rid.as_str(), d.task.attempt, d.task.calls, d.task.base),
        ("old", 2, 3, 1)
    );
    assert_eq!(d.task.input.get(), "{\"id\":\"m1\"}");
}

#[tokio::test]
async fn sink_ack_takes_written_results_out_of_redis_once_and_keeps_the_origin_in_the_state() {
    let redis = RedisServer::start();
    let store = RedisStore::connect(&redis.url()).await.unwrap();
    store.prepare_job(JOB, "", 1, true).await.unwrap();
    // More than one Lua chunk (1,000) of everything the script passes on.
    let n = 2500;
    let entries: Vec<TaskEntry> = (0..n).map(|i| entry(&format!("r{i}"), "{}")).collect();
    for chunk in entries.chunks(1000) {
        store.enqueue(JOB, 3600, chunk).await.unwrap();
    }
    let (mut results, mut calls) = (Vec::new(), Vec::new());
    loop {
        let batch = claim(&store, "w").await;
        if batch.is_empty() {
            break;
        }
        for d in batch {
            let r = result_for(&d);
            let call = common::ledger::PaidCall::new(&d.task, 1, 1, 1, "w", Default::default(), &spec().prices, 0);
            let commit = Finishing::new(&d, &Finish::Commit(r.clone())).paid(Some(&call));
            assert_eq!(
                store.finish_many(JOB, &[commit]).await[0].as_ref().unwrap(),
                &Finished::Moved
            );
            results.push(r);
            calls.push(call.key());
        }
    }
    assert_eq!(results.len(), n);
    let taken = store.sink_take(JOB, 0, "s", 10_000, Some(60_000), false).await.unwrap();
    assert_eq!(taken.len(), 2 * n, "every commit and its paid call handed to the sink");
    let refs: Vec<SunkResult> = results.iter().map(SunkResult::of).collect();
    let hold = std::time::Duration::ZERO;
    assert_eq!(
        store
            .sink_ack(JOB, 0, &taken, n as u64, &refs, &calls, hold)
            .await
            .unwrap(),
        n as u64
    );
    // Every paid call's time in the ledger is over: all leave, 1,000 a call.
    assert_eq!(store.ledger_trim(JOB, 0, hold).await.unwrap(), n as u64);
    assert_eq!(store.spend(JOB, 1).await.unwrap().totals.calls, n as u64);
    let mut c = redis.conn();
    let left: u64 = c.hlen(keys::results(JOB, 0)).unwrap();
    let origins: u64 = c.hlen(keys::origins(JOB, 0)).unwrap();
    let idem: Vec<String> = c.keys(format!("bf:{{{JOB}:p0}}:idem:*")).unwrap();
    let stream: u64 = c.xlen(keys::sink(JOB, 0)).unwrap();
    let ledger: u64 = c.hlen(keys::ledger(JOB, 0)).unwrap();
    assert_eq!((left, origins, idem.len(), stream, ledger), (0, 0, 0, 0, 0));
    let st: String = c.hget(keys::state(JOB, 0), "r7").unwrap();
    assert_eq!(st, "d@ds:r7", "the origin moved into the state entry");
    assert_eq!(state(&store, "r7").await, Some(RecordState::Done));
    let sunk = store.sunk(JOB, 1).await.unwrap();
    assert_eq!(
        (sunk.written, sunk.done, sunk.attempts_histogram.get(&1)),
        (n as u64, n as u64, Some(&(n as u64)))
    );
    // Acknowledged again (a writer that lost the reply): nothing counted twice.
    assert_eq!(store.sink_ack(JOB, 0, &taken, 0, &refs, &calls, hold).await.unwrap(), 0);
    assert_eq!(store.sunk(JOB, 1).await.unwrap().done, n as u64);
    let held: u64 = c.zcard(keys::ledger_sunk(JOB, 0)).unwrap();
    assert_eq!(held, 0, "a call that left is not held again");
    // A re-enqueue adds nothing and names the origin the state entry keeps.
    let again = store.enqueue(JOB, 3600, &entries[7..8]).await.unwrap();
    assert_eq!(
        again,
        vec![EnqueueOutcome::Present {
            origin: Some("ds:r7".into())
        }]
    );
}

/// The outcomes of `items` settled in one `finish_many`.
async fn finished(store: &RedisStore, items: &[Finishing]) -> Vec<Finished> {
    store
        .finish_many(JOB, items)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect()
}

#[tokio::test]
async fn outcomes_finished_together_are_each_decided_as_if_alone() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let ds = four_claimed(&store).await;
    assert_eq!(ds.len(), 4);
    // Claimed fresh: the state came with the claim.
    assert!(ds.iter().all(|d| d.state_at_claim == Some(Some(RecordState::Queued))));
    let (a, b, c, d) = (&ds[0], &ds[1], &ds[2], &ds[3]);
    let stranger = Delivery {
        consumer: "w9".into(),
        ..b.clone()
    };
    let retry = Finish::Retry {
        due_ms: 1,
        task: c.task.next(1, 1, vec![], vec![]),
    };
    let items = [
        Finishing::new(a, &Finish::Commit(result_for(a))),
        Finishing::new(&stranger, &Finish::Commit(result_for(&stranger))),
        Finishing::new(c, &retry),
        // The same delivery again in the same call: acknowledged by the first.
        Finishing::new(a, &Finish::Commit(result_for(a))),
        Finishing::new(d, &Finish::Drop { reason: "bad".into() }),
        // A retry after the drop of the same record: the drop stands.
        Finishing::new(
            d,
            &Finish::Retry {
                due_ms: 1,
                task: d.task.next(1, 1, vec![], vec![]),
            },
        ),
    ];
    let done = finished(&store, &items).await;
    assert_eq!(
        done,
        [
            Finished::Moved,
            Finished::Stale,
            Finished::Moved,
            Finished::Stale,
            Finished::Moved,
            Finished::Stale
        ]
    );
    assert_eq!(state(&store, "a").await, Some(RecordState::Done));
    assert_eq!(
        state(&store, "b").await,
        Some(RecordState::Queued),
        "a stale delivery moves nothing"
    );
    assert_eq!(state(&store, "c").await, Some(RecordState::Delayed));
    assert_eq!(state(&store, "d").await, Some(RecordState::Dropped("bad".into())));
    assert_eq!(pending(&redis), 1, "only b's entry is left, still pending for w1");
    assert_eq!(stream_len(&redis), 1);
    // Claimed again after a record moved, the claim reads the new state.
    store.enqueue(JOB, 60, &[entry("e", "{}")]).await.unwrap();
    let e = claim(&store, "w1").await.remove(0);
    assert_eq!(e.state_at_claim, Some(Some(RecordState::Queued)));
}

/// A worker's call settling several of its own deliveries reads their
/// fences together (one `XPENDING` over their range, for that consumer),
/// and each is still decided as if alone: one taken over by another worker
/// is stale, one with another delivery count is stale, one given twice
/// counts once; when the range holds more of the consumer's entries than
/// the read returns, an entry left out is read alone, never taken for stale.
#[tokio::test]
async fn a_workers_deliveries_settled_together_are_fenced_in_one_read_each_as_if_alone() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let entries: Vec<TaskEntry> = (0..100).map(|i| entry(&format!("r{i:03}"), "{}")).collect();
    store.enqueue(JOB, 200, &entries).await.unwrap();
    let ds = claim(&store, "w1").await;
    assert_eq!(ds.len(), 100);
    // w1's delivery of r003 was taken over by w2.
    let idle = [IdleEntry {
        entry_id: ds[3].entry_id.clone(),
        deliveries: 1,
        idle_ms: 0,
    }];
    let taken = store.reclaim(JOB, 0, "w2", 0, &idle).await.unwrap().remove(0);
    let recounted = Delivery {
        deliveries: 2,
        ..ds[2].clone()
    };
    let commit = |d: &Delivery| Finishing::new(d, &Finish::Commit(result_for(d)));
    let items = [
        commit(&ds[1]),
        commit(&recounted),
        commit(&ds[3]),
        commit(&ds[1]),
        commit(&ds[4]),
    ];
    let fences = redis.calls_of("xpending");
    let done = finished(&store, &items).await;
    assert_eq!(
        done,
        [
            Finished::Moved,
            Finished::Stale,
            Finished::Stale,
            Finished::Stale,
            Finished::Moved
        ]
    );
    assert_eq!(redis.calls_of("xpending") - fences, 1, "one read for the call's fences");
    assert_eq!(state(&store, "r001").await, Some(RecordState::Done));
    assert_eq!(
        state(&store, "r002").await,
        Some(RecordState::Queued),
        "another delivery count"
    );
    assert_eq!(state(&store, "r003").await, Some(RecordState::Queued), "w2's now");
    assert_eq!(state(&store, "r004").await, Some(RecordState::Done));
    // The first and the last of w1's entries: 95 still its own lie between
    // them, more than the read returns for two; the last is read alone.
    let fences = redis.calls_of("xpending");
    let items = [commit(&ds[0]), commit(&ds[99])];
    let done = finished(&store, &items).await;
    assert_eq!(done, [Finished::Moved, Finished::Moved]);
    assert_eq!(
        redis.calls_of("xpending") - fences,
        2,
        "the range, then the one it left out"
    );
    assert_eq!(state(&store, "r099").await, Some(RecordState::Done));
    // w2's delivery is still live.
    assert_eq!(
        store
            .finish(JOB, &taken, &Finish::Commit(result_for(&taken)))
            .await
            .unwrap(),
        Finished::Moved
    );
    assert_eq!(
        pending(&redis),
        100 - 5,
        "the settled ones acknowledged, the rest still w1's"
    );
}

#[tokio::test]
async fn a_budget_reserves_within_its_cap_waits_for_room_and_halts_only_when_nothing_could_make_room() {
    use common::store::Reserved;
    let redis = RedisServer::start();
    let store = store(&redis).await;
    store.set_budget_cap(JOB, 1e-6, true).await.unwrap(); // 1,000 nano-USD
    store.set_budget_cap(JOB, 5.0, true).await.unwrap(); // only if unset: still 1,000
    let reserve = |calls: Vec<(&'static str, u64)>, lease: u64| {
        let store = store.clone();
        let calls: Vec<(String, u64)> = calls.into_iter().map(|(i, a)| (i.to_owned(), a)).collect();
        async move { store.budget_reserve(JOB, lease, &calls).await.unwrap() }
    };
    // 400 + 400 fit; 300 more does not while they are in flight, but could after.
    assert_eq!(
        reserve(vec![("a", 400), ("b", 400), ("c", 300)], 60_000).await,
        [Reserved::Granted, Reserved::Granted, Reserved::Wait]
    );
    let b = store.budget(JOB).await.unwrap();
    assert_eq!((b.cap_usd, b.reserved_usd, b.spent_usd), (Some(1e-6), 8e-7, 0.0));
    assert!(store.halted(JOB).await.unwrap().is_none());
    // a cost 100, b was never made (its reply lost: released with 0); an unknown one is ignored.
    let settle = vec![
        ("a".to_owned(), 400, 100),
        ("b".to_owned(), 400, 0),
        ("zz".to_owned(), 50, 0),
    ];
    store.budget_settle(JOB, &settle).await.unwrap();
    let b = store.budget(JOB).await.unwrap();
    assert_eq!((b.reserved_usd, b.spent_usd), (0.0, 1e-7));
    // 950 could pass the cap whatever was in flight: the job halts, and later calls are refused.
    assert_eq!(
        reserve(vec![("d", 950), ("e", 10)], 60_000).await,
        [Reserved::Halted, Reserved::Halted]
    );
    let why = store.halted(JOB).await.unwrap().unwrap();
    assert!(why.starts_with("budget: spent 0.000000 USD"), "{why}");
    // A reservation whose worker vanished is charged in full when its lease runs out.
    store.set_budget_cap(JOB, 1.0, false).await.unwrap();
    assert_eq!(reserve(vec![("f", 700)], 1).await, [Reserved::Granted]);
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    assert_eq!(reserve(vec![], 60_000).await, []);
    let b = store.budget(JOB).await.unwrap();
    assert_eq!((b.reserved_usd, b.spent_usd), (0.0, 8e-7));
    // Its late settlement adds only what it cost beyond the charge.
    store.budget_settle(JOB, &[("f".to_owned(), 700, 900)]).await.unwrap();
    assert!((store.budget(JOB).await.unwrap().spent_usd - 1e-6).abs() < 1e-15);
}

#[tokio::test]
async fn a_paid_call_is_recorded_once_however_often_its_outcome_is_stored() {
    use common::ledger::{Fate, PaidCall};
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let entries: Vec<TaskEntry> = ["a", "b"].iter().map(|r| entry(r, "{}")).collect();
    store.enqueue(JOB, 60, &entries).await.unwrap();
    let ds = claim(&store, "w1").await;
    let (a, b) = (&ds[0], &ds[1]);
    let usage = common::task::Usage {
        prompt: 1000,
        completion: 100,
        total: 1100,
        ..Default::default()
    };
    let paid = |d: &Delivery| PaidCall::new(&d.task, 1, 1, d.deliveries, "w1", usage, &spec().prices, 0);
    let (pa, pb) = (paid(a), paid(b));
    let commit_a = Finishing::new(a, &Finish::Commit(result_for(a))).paid(Some(&pa));
    // Stored, then stored again (a retry after a lost reply): the second
    // is stale, and the call is not counted again.
    let first = store.finish_many(JOB, std::slice::from_ref(&commit_a)).await;
    let again = store.finish_many(JOB, std::slice::from_ref(&commit_a)).await;
    assert_eq!(first[0].as_ref().unwrap(), &Finished::Moved);
    assert_eq!(again[0].as_ref().unwrap(), &Finished::Stale);
    // A stale delivery's call was still paid: recorded (once).
    let stranger = Delivery {
        consumer: "w9".into(),
        ..b.clone()
    };
    let late = Finishing::new(&stranger, &Finish::Commit(result_for(&stranger))).paid(Some(&pb));
    assert_eq!(
        store.finish_many(JOB, &[late]).await[0].as_ref().unwrap(),
        &Finished::Stale
    );
    // The same calls recorded again as lost (Redis came back): nothing new.
    let lost = |mut c: PaidCall| {
        c.fate = Fate::Lost;
        c
    };
    let (la, lb) = (lost(pa.clone()), lost(pb.clone()));
    let p_of = |d: &Delivery| d.partition;
    store.record_paid(JOB, &[(p_of(a), la), (p_of(b), lb)]).await.unwrap();
    let spend = store.spend(JOB, spec().job.partitions).await.unwrap();
    assert_eq!(spend.totals.calls, 2, "{spend:?}");
    assert_eq!(spend.totals.prompt_tokens, 2000);
    assert_eq!(spend.by_bucket["first"].calls, 2);
    let want = 2.0 * spec().prices.cost(1000, 0, 100);
    assert!((spend.totals.cost_usd - want).abs() < 1e-12, "{spend:?}");
    let mut calls = Vec::new();
    for p in 0..spec().job.partitions {
        store.ledger_entries(JOB, p, |c| calls.push(c)).await.unwrap();
    }
    calls.sort_by(|x, y| x.rid.cmp(&y.rid));
    assert_eq!(calls, vec![pa, pb], "the first record of each call stands");
}

#[tokio::test]
async fn spend_and_stats_counters_add_up_exactly_in_two_commands_a_hash() {
    use common::ledger::PaidCall;
    let redis = RedisServer::start();
    let store = store(&redis).await;
    store.enqueue(JOB, 60, &[entry("a", "{}")]).await.unwrap();
    let d = claim(&store, "w1").await.remove(0);
    let (spend_key, stats_key) = (keys::spend(JOB, d.partition), keys::stats(JOB, d.partition));
    // Counters already there: small ones, one just under what a double holds
    // exactly once added to (15 digits), and one past 2^53 (16 digits).
    let mut conn = redis.conn();
    let before: [(&str, &str); 3] = [
        ("calls", "5"),
        ("prompt", "999999999999999"),
        ("nusd", "9007199254740993"),
    ];
    let _: () = conn.hset_multiple(&spend_key, &before).unwrap();
    let usage = common::task::Usage {
        prompt: 1000,
        completion: 100,
        total: 1100,
        ..Default::default()
    };
    let paid = PaidCall::new(&d.task, 1, 1, d.deliveries, "w1", usage, &spec().prices, 0);
    let (hincrby, hset, hsetnx) = (
        redis.calls_of("hincrby"),
        redis.calls_of("hset"),
        redis.calls_of("hsetnx"),
    );
    let commit = Finishing::new(&d, &Finish::Commit(result_for(&d))).paid(Some(&paid));
    assert_eq!(
        store.finish_many(JOB, &[commit]).await[0].as_ref().unwrap(),
        &Finished::Moved
    );
    let spend: HashMap<String, String> = conn.hgetall(&spend_key).unwrap();
    let nusd: u128 = spend["nusd:first"].parse().unwrap();
    assert!(nusd > 0, "{spend:?}");
    assert_eq!(spend["calls"], "6");
    assert_eq!(spend["calls:first"], "1");
    assert_eq!(spend["prompt"], "1000000000000999", "added to exactly");
    assert_eq!(spend["completion"], "100");
    assert_eq!(
        spend["nusd"],
        (9_007_199_254_740_993u128 + nusd).to_string(),
        "added to exactly past 2^53"
    );
    let stats: HashMap<String, String> = conn.hgetall(&stats_key).unwrap();
    let per_minute = |kind: &str| {
        let v: Vec<&String> = stats
            .iter()
            .filter(|(f, _)| f.starts_with('t') && f.ends_with(kind))
            .map(|(_, v)| v)
            .collect();
        v
    };
    assert_eq!(per_minute(":c"), vec!["1"], "{stats:?}");
    assert_eq!(per_minute(":d"), vec!["1"], "{stats:?}");
    assert_eq!(per_minute(":u"), vec![&nusd.to_string()], "{stats:?}");
    assert!(stats.len() >= 4, "the attempts' count too: {stats:?}");
    // One HSET a hash (the ledger's, the result's, the state's, the spend's
    // and the stats'), no HSETNX, and an HINCRBY only for the counter a
    // double cannot hold.
    assert_eq!(redis.calls_of("hincrby") - hincrby, 1);
    assert_eq!(redis.calls_of("hset") - hset, 5);
    assert_eq!(redis.calls_of("hsetnx") - hsetnx, 0);
}

/// A call settling many outcomes reads and writes each hash once (the
/// ledger, the results, the states), yet decides each as if alone: a paid
/// call met twice in the call is recorded and counted once, calls of the
/// same spend line are counted together to the exact sum, and a record that
/// somehow has a result already keeps it.
#[tokio::test]
async fn outcomes_stored_together_touch_each_hash_once_and_count_each_paid_call_once() {
    use common::ledger::PaidCall;
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let ds = four_claimed(&store).await;
    let (a, b, c, d) = (&ds[0], &ds[1], &ds[2], &ds[3]);
    let mut conn = redis.conn();
    let _: () = conn.hset(keys::results(JOB, 0), "d", "kept").unwrap();
    let usage = |prompt: u64| common::task::Usage {
        prompt,
        completion: 100,
        total: prompt + 100,
        ..Default::default()
    };
    let paid =
        |d: &Delivery, prompt| PaidCall::new(&d.task, 1, 1, d.deliveries, "w1", usage(prompt), &spec().prices, 0);
    // a and b: the same spend line; c another; d's call the same as b's line.
    let (pa, pb, pc, pd) = (paid(a, 1000), paid(b, 1000), paid(c, 3000), paid(d, 1000));
    let commit = |d: &Delivery, p: &PaidCall| Finishing::new(d, &Finish::Commit(result_for(d))).paid(Some(p));
    let items = [
        commit(a, &pa),
        commit(b, &pb),
        commit(a, &pa),
        commit(c, &pc),
        commit(d, &pd),
    ];
    let (hset, hmget, hsetnx) = (
        redis.calls_of("hset"),
        redis.calls_of("hmget"),
        redis.calls_of("hsetnx"),
    );
    let done = finished(&store, &items).await;
    assert_eq!(
        done,
        [
            Finished::Moved,
            Finished::Moved,
            Finished::Stale,
            Finished::Moved,
            Finished::AlreadySettled
        ]
    );
    // HSETs: the ledger, the results, the states, the spend, the stats;
    // HMGETs: the ledger, the states, the results, the spend, the stats.
    assert_eq!(redis.calls_of("hset") - hset, 5);
    assert_eq!(redis.calls_of("hmget") - hmget, 5);
    assert_eq!(redis.calls_of("hsetnx") - hsetnx, 0);
    let ledger: HashMap<String, String> = conn.hgetall(keys::ledger(JOB, 0)).unwrap();
    assert_eq!(ledger.len(), 4, "each paid call recorded once: {:?}", ledger.keys());
    let results: HashMap<String, String> = conn.hgetall(keys::results(JOB, 0)).unwrap();
    assert_eq!(results["d"], "kept", "a result is never written over");
    assert_eq!(results.len(), 4);
    assert_eq!(state(&store, "d").await, Some(RecordState::Queued));
    let spend = store.spend(JOB, 1).await.unwrap();
    assert_eq!(spend.totals.calls, 4, "{spend:?}");
    assert_eq!(spend.totals.prompt_tokens, 6000);
    assert_eq!(spend.totals.completion_tokens, 400);
    let nusd: HashMap<String, u128> = conn.hgetall(keys::spend(JOB, 0)).unwrap();
    let one = |p: &PaidCall| p.cost_nusd as u128;
    assert_eq!(nusd["nusd"], one(&pa) + one(&pb) + one(&pc) + one(&pd));
    assert_eq!(nusd["calls:first"], 4);
    let stats: HashMap<String, String> = conn.hgetall(keys::stats(JOB, 0)).unwrap();
    let minute = |kind: &str| {
        stats
            .iter()
            .find(|(f, _)| f.starts_with('t') && f.ends_with(kind))
            .map(|(_, v)| v.clone())
    };
    assert_eq!(minute(":c").as_deref(), Some("4"), "{stats:?}");
    assert_eq!(minute(":d").as_deref(), Some("3"), "{stats:?}");
    assert_eq!(minute(":u"), Some(nusd["nusd"].to_string()));
    assert_eq!(stats["a:1"], "3", "each commit's attempts, counted once a moved record");
}

#[tokio::test]
async fn a_paid_call_goes_to_the_sink_once_and_leaves_the_ledger_only_after_its_hold() {
    use common::ledger::{Fate, PaidCall};
    let redis = RedisServer::start();
    let store = RedisStore::connect(&redis.url()).await.unwrap();
    store.prepare_job(JOB, "", 1, true).await.unwrap();
    store
        .enqueue(JOB, 60, &[entry("a", "{}"), entry("b", "{}")])
        .await
        .unwrap();
    let ds = claim(&store, "w1").await;
    let (a, b) = (&ds[0], &ds[1]);
    let usage = common::task::Usage {
        prompt: 1000,
        completion: 100,
        total: 1100,
        ..Default::default()
    };
    let paid = |d: &Delivery| PaidCall::new(&d.task, 1, 1, d.deliveries, "w1", usage, &spec().prices, 7);
    let (pa, pb) = (paid(a), paid(b));
    let commit_a = Finishing::new(a, &Finish::Commit(result_for(a))).paid(Some(&pa));
    assert_eq!(
        store.finish_many(JOB, &[commit_a]).await[0].as_ref().unwrap(),
        &Finished::Moved
    );
    // b's call is cut off at a drain: recorded on its own, handed over too.
    let mut cut = pb.clone();
    cut.fate = Fate::Abandoned;
    store.record_paid(JOB, &[(0, cut.clone())]).await.unwrap();
    let taken = store.sink_take(JOB, 0, "s", 100, None, false).await.unwrap();
    let calls: Vec<Option<&str>> = taken.iter().map(|e| e.call.as_deref()).collect();
    assert_eq!(
        calls,
        [Some(pa.key().as_str()), None, Some(cut.key().as_str())],
        "the call, the result, then the cut-off call: {taken:?}"
    );
    assert_eq!(taken[2].rid, "b", "the record id from the call's key");
    assert!(taken[0].rid == "a" && !taken[0].is_failure() && taken[1].result);
    let batch = store.sink_read(JOB, 0, &taken, &spec().prices).await.unwrap();
    assert_eq!(batch.paid, vec![pa.clone(), cut.clone()]);
    assert!(
        batch.failures.is_empty(),
        "a paid call is no failure: {:?}",
        batch.failures
    );
    let sunk: Vec<SunkResult> = batch.results.iter().map(|_| SunkResult::of(&result_for(a))).collect();
    let keys_held: Vec<String> = batch.paid.iter().map(PaidCall::key).collect();
    let hold = std::time::Duration::from_millis(1500);
    store
        .sink_ack(JOB, 0, &taken, 1, &sunk, &keys_held, hold)
        .await
        .unwrap();
    let hlen = |c: &mut redis::Connection| -> (u64, u64) {
        (
            c.hlen(keys::ledger(JOB, 0)).unwrap(),
            c.zcard(keys::ledger_sunk(JOB, 0)).unwrap(),
        )
    };
    let mut c = redis.conn();
    assert_eq!(hlen(&mut c), (2, 2), "in the sink, and still in the ledger for a while");
    assert_eq!(store.ledger_unsunk(JOB, 1).await.unwrap(), 0);
    // Stored again meanwhile (a lost reply, recorded as lost): counted once, not handed over again.
    let mut lost = pa.clone();
    lost.fate = Fate::Lost;
    store.record_paid(JOB, &[(0, lost)]).await.unwrap();
    let xlen: u64 = c.xlen(keys::sink(JOB, 0)).unwrap();
    assert_eq!(xlen, 0);
    assert_eq!(store.spend(JOB, 1).await.unwrap().totals.calls, 2);
    // Before its time, a trim leaves them; after it, they leave.
    assert_eq!(store.ledger_trim(JOB, 0, hold).await.unwrap(), 0);
    assert_eq!(hlen(&mut c), (2, 2));
    std::thread::sleep(std::time::Duration::from_millis(1600));
    assert_eq!(store.ledger_trim(JOB, 0, hold).await.unwrap(), 2);
    assert_eq!(hlen(&mut c), (0, 0), "the sink holds them now");
    let spend = store.spend(JOB, 1).await.unwrap();
    assert_eq!(
        (spend.totals.calls, spend.totals.prompt_tokens),
        (2, 2000),
        "the counters keep them"
    );
}

/// The bucket hash of limiter `id` after settling `grants` of it, one call
/// each or all in one call.
async fn settled_buckets(
    store: &RedisStore,
    redis: &RedisServer,
    id: &str,
    grants: &[(String, Settlement)],
    together: bool,
) -> (Vec<bool>, std::collections::BTreeMap<String, String>) {
    let mut c = redis.conn();
    let buckets = keys::limit_buckets(id);
    let _: () = c
        .hset_multiple(
            &buckets,
            &[
                ("r", "50"),
                ("t", "9000"),
                ("i", "5000"),
                ("o", "4000"),
                ("ac", "8"),
                ("cb", "99999999999999"),
                ("pr", "600"),
                ("wn", "0"),
                ("seq", "20"),
            ],
        )
        .unwrap();
    // Every grant is held, but one that expired (`:expired:`).
    for (g, _) in grants.iter().filter(|(g, _)| !g.contains(":expired:")) {
        let _: () = c.zadd(keys::limit_inflight(id), g, -99_999_999_999_999_i64).unwrap();
    }
    let held = if together {
        store.limit_settle_many(id, grants).await.unwrap()
    } else {
        let mut held = Vec::new();
        for (g, s) in grants {
            held.push(store.limit_settle(id, g, s).await.unwrap());
        }
        held
    };
    let mut h: std::collections::BTreeMap<String, String> = c.hgetall(&buckets).unwrap();
    // When things happened (the server's clock) differs between the two runs.
    for field in ["bt", "hat", "ws"] {
        h.remove(field);
    }
    (held, h)
}

#[tokio::test]
async fn grants_settled_together_leave_the_budget_as_settled_one_by_one() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let s = |call, tokens_back, remaining_tokens| Settlement {
        tokens_back,
        input_back: tokens_back / 2,
        output_back: tokens_back / 2,
        header_limit_tokens: Some(90_000),
        header_remaining_tokens: remaining_tokens,
        call,
        ceiling_concurrent: 9,
        ..Settlement::default()
    };
    let grants = |prefix: &str| {
        vec![
            (format!("{prefix}:11:300"), s(CallKind::Answered, 120, None)),
            (format!("{prefix}:12:300"), s(CallKind::RateLimited, 300, None)),
            (format!("{prefix}:13:300"), s(CallKind::Answered, -40, Some(7000))),
            (format!("{prefix}:14:300"), s(CallKind::RateLimited, 300, None)),
            (format!("{prefix}:21:300"), s(CallKind::RateLimited, 300, None)),
            (format!("{prefix}:22:300"), s(CallKind::Other, 300, None)),
            (format!("{prefix}:23:300"), s(CallKind::Answered, 10, Some(100))),
            // Settled twice (held only the first time), and one expired.
            (format!("{prefix}:13:300"), s(CallKind::RateLimited, 300, None)),
            (format!("{prefix}:expired:300"), s(CallKind::RateLimited, 300, None)),
        ]
    };
    let (held, alone) = settled_buckets(&store, &redis, "one", &grants("w"), false).await;
    let zrem = redis.calls_of("zrem");
    let (held_together, together) = settled_buckets(&store, &redis, "two", &grants("w"), true).await;
    assert_eq!(alone, together);
    assert_eq!(held, held_together);
    assert_eq!(held, [vec![true; 7], vec![false; 2]].concat());
    assert_eq!(redis.calls_of("zrem") - zrem, 1, "the grants freed in one ZREM");
    // The calls did what they say: tokens came back, the 429s cut the learned limits.
    assert_eq!(alone.get("settled").map(String::as_str), Some("2100"));
    assert!(
        alone.contains_key("ar") && alone.get("dseq").map(String::as_str) == Some("20"),
        "{alone:?}"
    );
    assert_eq!(
        alone.get("t").map(String::as_str),
        Some("100"),
        "the lowest remaining the headers told"
    );
}

/// A provider's `remaining` figure tightens the shared buckets as of the
/// moment it was seen, however long its settlement waited for others: the
/// level the next acquire computes (the stored one refilled from the
/// buckets' last refill `at`, at the rate the acquire applies) is the
/// figure plus what that rate refilled since it was seen, not plus
/// everything since `at` (a fresh figure taken as if seen at `at`), nor
/// minus what refilled while it waited (an old figure taken as if seen
/// now), nor refilled at the provider's limit when the spec's is lower.
#[tokio::test]
async fn a_remaining_figure_tightens_the_buckets_as_of_when_it_was_seen() {
    use std::time::{Duration, Instant};
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let mut c = redis.conn();
    let now_ms = |c: &mut redis::Connection| -> f64 {
        let (s, us): (u64, u64) = redis::cmd("TIME").query(c).unwrap();
        (s * 1000) as f64 + us as f64 / 1000.0
    };
    // The provider's limit 1,200 requests a minute; the spec's none, or 600.
    for (id, age_ms, spec_rpm) in [("fresh", 0u64, 0u64), ("waited", 500, 0), ("spec", 500, 600)] {
        let per_ms = if spec_rpm > 0 { spec_rpm } else { 1200 } as f64 / 60_000.0;
        let buckets = keys::limit_buckets(id);
        // The buckets last refilled a second ago, full.
        let at = now_ms(&mut c) as u64 - 1000;
        let _: () = c
            .hset_multiple(&buckets, &[("r", "40".to_owned()), ("at", at.to_string())])
            .unwrap();
        let told = Settlement {
            header_limit_requests: Some(1200),
            header_remaining_requests: Some(3),
            seen: Instant::now().checked_sub(Duration::from_millis(age_ms)),
            call: CallKind::Answered,
            ceiling_requests: spec_rpm,
            ..Settlement::default()
        };
        store.limit_settle(id, &format!("{id}:1:0"), &told).await.unwrap();
        let (r, at): (f64, f64) = (c.hget(&buckets, "r").unwrap(), c.hget(&buckets, "at").unwrap());
        let level_now = r + (now_ms(&mut c) - at) * per_ms;
        let expected = 3.0 + age_ms as f64 * per_ms;
        assert!(
            (level_now - expected).abs() < 2.5,
            "{id}: the level now is {level_now:.2}, the figure as of now {expected:.2} (r {r}, at {at})"
        );
    }
}

/// Outage rules that take the provider for down at its first failure.
fn outage_at_once() -> common::store::OutageRules {
    common::store::OutageRules {
        min_fails: 1,
        window: std::time::Duration::ZERO,
        ..Default::default()
    }
}

/// A 503 of worker `w`'s call (its `probe`, or not), the probe's lease 40 s.
fn failed_call_of_w(probe: bool) -> common::store::FailedCall<'static> {
    common::store::FailedCall {
        took: std::time::Duration::from_millis(5),
        cause: "http_503",
        rate_limited: false,
        message: "down",
        base_url: "http://127.0.0.1:1/v1",
        worker: "w",
        probe,
        lease: std::time::Duration::from_secs(40),
    }
}

/// A long outage is probed less often: each failed probe's wait doubles to
/// `probe_every_max` while the outage is young, then grows with its age (a
/// twelfth of it, at most six times the cap), as `OutageRules::probe_wait` says.
#[tokio::test]
async fn a_long_outage_is_probed_less_often_as_the_rules_say() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let rules = outage_at_once();
    let call = failed_call_of_w;
    let mut c = redis.conn();
    let field = |c: &mut redis::Connection, f: &str| -> u64 {
        let v: Option<u64> = c.hget(keys::outage(JOB), f).unwrap();
        v.unwrap_or(0)
    };
    store.outage_failed(JOB, &call(false), &rules).await.unwrap();
    assert_eq!(field(&mut c, "down"), 1);
    // w holds the probe's lease (each failed probe of its own then leaves
    // it the next one's).
    let _: () = c.hset(keys::outage(JOB), "probe_at", 0).unwrap();
    let lease = std::time::Duration::from_secs(40);
    assert_eq!(store.outage_probe(JOB, lease, "w").await.unwrap(), Ok(()));
    // Young: the third failed probe waits 5 s (2, 4, then the 5 s cap).
    let mut noted = None;
    for _ in 0..3 {
        noted = Some(store.outage_failed(JOB, &call(true), &rules).await.unwrap());
    }
    let now = noted.unwrap().now_ms;
    assert_eq!(field(&mut c, "probe_at") - now, 5_000);
    // Down for 2 minutes: a twelfth of that (10 s, not the 16 s of the
    // doubling); for an hour: 30 s (not 32).
    for (age_s, wait_s) in [(120u64, 10u64), (3600, 30)] {
        let down_ms = field(&mut c, "down_ms");
        let _: () = c.hset(keys::outage(JOB), "down_ms", down_ms - age_s * 1000).unwrap();
        let n = store.outage_failed(JOB, &call(true), &rules).await.unwrap();
        let (probe_at, down_ms) = (field(&mut c, "probe_at"), field(&mut c, "down_ms"));
        let age = std::time::Duration::from_millis(n.now_ms - down_ms);
        let probes = field(&mut c, "probes") as u32;
        assert_eq!(probe_at - n.now_ms, rules.probe_wait(probes, age).as_millis() as u64);
        let wait = (probe_at - n.now_ms) / 1000;
        assert!(
            wait == wait_s || wait + 1 == wait_s,
            "{age_s} s down: {wait} s, not {wait_s}"
        );
    }
}

/// The worker whose probe failed while it held the lease holds the next
/// probe's lease, from when it may start for the probe's whole lease: it
/// sends it without asking, the others are told to wait until that lease
/// ends; asked by itself, it is granted; a stopping worker gives it back;
/// given back (nothing to send), any worker may take it a second on. A
/// probe of a worker that did not hold the lease changes nothing of it.
#[tokio::test]
async fn a_failed_probe_s_worker_holds_the_next_probe_s_lease() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let rules = outage_at_once();
    let lease = std::time::Duration::from_secs(40);
    let call = failed_call_of_w;
    let mut c = redis.conn();
    store.outage_failed(JOB, &call(false), &rules).await.unwrap();
    // A probe of a worker that does not hold the lease (it ran out, another
    // took it) changes nothing of it: no turn for it.
    let _: () = c.hset(keys::outage(JOB), "probe_at", 0).unwrap();
    assert_eq!(store.outage_probe(JOB, lease, "v").await.unwrap(), Ok(()));
    let stray = store.outage_failed(JOB, &call(true), &rules).await.unwrap();
    assert_eq!(stray.next_probe_ms, 0, "w held no lease");
    let (v_at, v): (u64, String) = redis::cmd("HMGET")
        .arg(keys::outage(JOB))
        .arg(&["probe_at", "prober"])
        .query(&mut c)
        .unwrap();
    assert!(
        v_at > stray.now_ms + 30_000 && v == "v",
        "v's lease stands: {v_at}, {v}"
    );
    // w takes the lease, and its probe fails.
    let _: () = c.hset(keys::outage(JOB), "probe_at", 0).unwrap();
    assert_eq!(store.outage_probe(JOB, lease, "w").await.unwrap(), Ok(()));
    let noted = store.outage_failed(JOB, &call(true), &rules).await.unwrap();
    let (at, held, prober): (u64, u64, String) = redis::cmd("HMGET")
        .arg(keys::outage(JOB))
        .arg(&["probe_at", "held_ms", "prober"])
        .query(&mut c)
        .unwrap();
    assert_eq!((at, held, prober.as_str()), (noted.next_probe_ms, at + 40_000, "w"));
    let ask = |who: &'static str| {
        let store = store.clone();
        async move { store.outage_probe(JOB, lease, who).await.unwrap() }
    };
    let wait = ask("x").await.expect_err("not yet");
    assert!(wait <= std::time::Duration::from_millis(at - noted.now_ms), "{wait:?}");
    // Its time came: the lease is w's.
    let _: () = c.hset(keys::outage(JOB), "probe_at", at - 2_000).unwrap();
    let _: () = c.hset(keys::outage(JOB), "held_ms", held - 2_000).unwrap();
    let wait = ask("x").await.expect_err("w's lease");
    assert!(
        wait > std::time::Duration::from_secs(30),
        "until w's lease ends: {wait:?}"
    );
    // A stopping worker gives back only its own lease.
    assert!(!store.outage_leave(JOB, "x").await.unwrap(), "x holds no lease");
    let wait = ask("x").await.expect_err("still w's lease");
    assert!(wait > std::time::Duration::from_secs(30), "{wait:?}");
    assert_eq!(ask("w").await, Ok(()), "w asking for its own lease gets it");
    let wait = ask("x").await.expect_err("w's probe is out");
    assert!(wait > std::time::Duration::from_secs(30), "{wait:?}");
    // w's probe failed again, and w stops: its lease is given back, the next
    // probe is anyone's when due.
    let noted = store.outage_failed(JOB, &call(true), &rules).await.unwrap();
    assert!(store.outage_leave(JOB, "w").await.unwrap());
    let wait = ask("x").await.expect_err("not yet due");
    assert!(
        wait <= std::time::Duration::from_millis(noted.next_probe_ms - noted.now_ms),
        "{wait:?}"
    );
    let _: () = c.hset(keys::outage(JOB), "probe_at", 0).unwrap();
    assert_eq!(ask("x").await, Ok(()), "anyone's when due");
    // Given back: anyone, a second on.
    store.outage_unprobe(JOB).await.unwrap();
    let wait = ask("x").await.expect_err("a second on");
    assert!(wait <= std::time::Duration::from_secs(1), "{wait:?}");
    let _: () = c.hset(keys::outage(JOB), "probe_at", 0).unwrap();
    assert_eq!(ask("x").await, Ok(()), "anyone's once the lease is given back");
}

/// A throttled worker takes a stretch of the budget per acquire: grants the
/// buckets cannot give yet come with the delay until they can (at most the
/// window ahead), spaced at the limit's pace. The workers held back are told
/// to come back one at a time, half a window apart, the first once half the
/// window is free: each then finds a stretch to take, whatever their number.
#[tokio::test]
async fn grants_are_given_ahead_at_the_limits_pace_and_the_workers_held_back_come_back_in_turn() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let mut c = redis.conn();
    // 600 requests/min (one every 100 ms), a burst of 1 s (10), 1 s ahead.
    let p = LimitParams {
        burst_ms: 1000,
        ahead_ms: 1000,
        ..limits(600, 0)
    };
    let a = store
        .limit_acquire("ahead", &p, 30, "a", FreeReport::default())
        .await
        .unwrap();
    let delays: Vec<u64> = a.grants.iter().map(|(_, d)| *d).collect();
    assert_eq!(delays.len(), 20, "the burst now and one window ahead: {delays:?}");
    assert!(delays[..10].iter().all(|&d| d == 0), "{delays:?}");
    for (k, d) in delays[10..].iter().enumerate() {
        // The clock moves between TIME and here: a few ms of refill at most.
        let due = 100 * (k as u64 + 1);
        assert!(
            *d <= due && d + 20 >= due,
            "grant {} waits {d} ms, not ~{due}: {delays:?}",
            k + 10
        );
    }
    // The 21st would wait 1,100 ms: come back when 500 ms of the window are free.
    assert_eq!(a.bound, Bound::Rate);
    assert!((550..=600).contains(&a.wait_ms), "{a:?}");
    // Two more workers ask at once: nothing, each told its own turn, and
    // only that turn written (a refusal leaves the levels alone).
    let before: std::collections::HashMap<String, String> = c.hgetall(keys::limit_buckets("ahead")).unwrap();
    let b = store
        .limit_acquire("ahead", &p, 30, "b", FreeReport::default())
        .await
        .unwrap();
    let c2 = store
        .limit_acquire("ahead", &p, 30, "c", FreeReport::default())
        .await
        .unwrap();
    assert!(b.grants.is_empty() && b.bound == Bound::Rate, "{b:?}");
    assert!(c2.grants.is_empty() && c2.bound == Bound::Rate, "{c2:?}");
    assert!((1050..=1100).contains(&b.wait_ms), "{b:?}");
    assert!((1550..=1600).contains(&c2.wait_ms), "{c2:?}");
    let mut after: std::collections::HashMap<String, String> = c.hgetall(keys::limit_buckets("ahead")).unwrap();
    let mut before = before;
    assert_ne!(before.remove("qt"), after.remove("qt"));
    assert_eq!(before, after, "a refusal wrote more than the turn");
    // At its turn (A did not come back), B finds the window's stretch.
    tokio::time::sleep(std::time::Duration::from_millis(b.wait_ms)).await;
    let later = store
        .limit_acquire("ahead", &p, 30, "b", FreeReport::default())
        .await
        .unwrap();
    let delays: Vec<u64> = later.grants.iter().map(|(_, d)| *d).collect();
    assert!((10..=12).contains(&delays.len()), "{delays:?}");
    assert!(delays.iter().all(|&d| d <= 1000), "{delays:?}");
    // A rate learned from 429s only (no limit told): nothing given ahead.
    let _: () = c.hset(keys::limit_buckets("learned"), "ar", 600).unwrap();
    let learned = store
        .limit_acquire(
            "learned",
            &LimitParams { requests: 0, ..p },
            30,
            "d",
            FreeReport::default(),
        )
        .await
        .unwrap();
    assert_eq!(learned.grants.len(), 10, "{learned:?}");
    assert!(learned.grants.iter().all(|(_, d)| *d == 0), "{learned:?}");
    // Without a window ahead (0): only what the buckets hold now.
    let now_only = store
        .limit_acquire(
            "ahead-0",
            &LimitParams { ahead_ms: 0, ..p },
            30,
            "c",
            FreeReport::default(),
        )
        .await
        .unwrap();
    assert_eq!(now_only.grants.len(), 10);
    assert!(now_only.wait_ms > 0 && now_only.wait_ms <= 100, "{now_only:?}");
}

#[tokio::test]
async fn a_slot_freed_while_a_worker_waits_for_one_wakes_the_fleet() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let p = limits(0, 1);
    let (held, _) = acquired(
        store
            .limit_acquire("slot", &p, 1, "a", FreeReport::default())
            .await
            .unwrap(),
    );
    assert_eq!(held.len(), 1);
    // Settled with nobody waiting: no wake-up.
    let quiet = store.wake_cursor().await.unwrap();
    assert!(
        store
            .limit_settle("slot", &held[0], &Settlement::default())
            .await
            .unwrap()
    );
    assert_eq!(store.wait_wake(&quiet, 1).await.unwrap(), None);
    let (held, _) = acquired(
        store
            .limit_acquire("slot", &p, 1, "a", FreeReport::default())
            .await
            .unwrap(),
    );
    // Another worker is refused (the slot is taken) and told to wait long: it will be woken.
    let (none, wait_ms) = acquired(
        store
            .limit_acquire("slot", &p, 1, "b", FreeReport::default())
            .await
            .unwrap(),
    );
    assert!(none.is_empty());
    assert!(wait_ms >= 1000, "{wait_ms}");
    let before = store.wake_cursor().await.unwrap();
    assert!(
        store
            .limit_settle("slot", &held[0], &Settlement::default())
            .await
            .unwrap()
    );
    assert!(
        store
            .wait_wake(&before, 1)
            .await
            .unwrap()
            .is_some_and(|w| w.slots == ["slot"] && !w.flags),
        "the waiting worker is woken, told which limiter's slot came free"
    );
    let (got, _) = acquired(
        store
            .limit_acquire("slot", &p, 1, "b", FreeReport::default())
            .await
            .unwrap(),
    );
    assert_eq!(got.len(), 1, "and gets the slot");
}

#[tokio::test]
async fn a_dead_workers_slots_expire_oldest_first_and_their_tokens_count_as_used() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let mut c = redis.conn();
    let p = |lease_ms| LimitParams {
        lease_ms,
        ..limits(0, 3)
    };
    // A worker that dies holding two short slots, then one holding a long one.
    let (dead, _) = acquired(
        store
            .limit_acquire("exp", &p(300), 2, "dead", FreeReport::default())
            .await
            .unwrap(),
    );
    let (alive, _) = acquired(
        store
            .limit_acquire("exp", &p(60_000), 1, "alive", FreeReport::default())
            .await
            .unwrap(),
    );
    assert_eq!((dead.len(), alive.len()), (2, 1));
    let (none, _) = acquired(
        store
            .limit_acquire("exp", &p(60_000), 1, "new", FreeReport::default())
            .await
            .unwrap(),
    );
    assert!(none.is_empty(), "all three slots are taken");
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    // The two expired slots come back (the live one does not), and their
    // reserved tokens count as settled.
    let (got, _) = acquired(
        store
            .limit_acquire("exp", &p(60_000), 3, "new", FreeReport::default())
            .await
            .unwrap(),
    );
    assert_eq!(got.len(), 2, "{got:?}");
    let slots: Vec<String> = c.zrange(keys::limit_inflight("exp"), 0, -1).unwrap();
    assert_eq!(slots.len(), 3);
    assert!(
        slots.contains(&alive[0]) && !dead.iter().any(|d| slots.contains(d)),
        "{slots:?}"
    );
    let h: std::collections::HashMap<String, u64> = c.hgetall(keys::limit_buckets("exp")).unwrap();
    assert_eq!((h["reserved"], h["settled"]), (50, 20), "{h:?}");
    // A settled slot is no longer held; an expired one settles as not held.
    assert!(
        store
            .limit_settle("exp", &alive[0], &Settlement::default())
            .await
            .unwrap()
    );
    assert!(
        !store
            .limit_settle("exp", &dead[0], &Settlement::default())
            .await
            .unwrap()
    );
}

#[tokio::test]
async fn only_done_records_join_the_audit_queue_and_each_is_judged_once() {
    use common::audit::Verdict;
    let redis = RedisServer::start();
    let store = store(&redis).await;
    store
        .enqueue(JOB, 60, &[entry("a", "{}"), entry("b", "{}")])
        .await
        .unwrap();
    let ds = claim(&store, "w1").await;
    let a = ds.iter().find(|d| d.task.rid == "a").unwrap();
    assert_eq!(
        store.finish(JOB, a, &Finish::Commit(result_for(a))).await.unwrap(),
        Finished::Moved
    );
    // b is still in flight: not done, not sampled.
    let items = [("a".to_owned(), "in-a".to_owned()), ("b".to_owned(), String::new())];
    assert_eq!(store.audit_sample(JOB, 0, &items).await.unwrap(), 1);
    assert_eq!(store.audit_sample(JOB, 0, &items).await.unwrap(), 0, "not twice");
    let item = store.audit_item(JOB, 0, "a").await.unwrap().unwrap();
    assert_eq!(item.input.as_deref(), Some("in-a"));
    let v = |by: &str| Verdict {
        correct: true,
        by: by.into(),
        at: "t".into(),
        labels: Default::default(),
        revision: None,
        note: None,
    };
    assert!(store.audit_judge(JOB, 0, "a", &v("ann")).await.unwrap());
    assert!(
        !store.audit_judge(JOB, 0, "a", &v("bob")).await.unwrap(),
        "judged already"
    );
    assert_eq!(store.audit_verdict(JOB, 0, "a").await.unwrap().unwrap().by, "ann");
    assert_eq!(
        store.audit_sample(JOB, 0, &items).await.unwrap(),
        0,
        "a judged record is not sampled again"
    );
    assert_eq!(store.audit_waiting(JOB, 1).await.unwrap(), 0);
    // A commit in the spec's sample joins the queue in the same step.
    let b = ds.iter().find(|d| d.task.rid == "b").unwrap();
    let commit = Finishing::new(b, &Finish::Commit(result_for(b))).audit(true);
    assert_eq!(
        store.finish_many(JOB, &[commit]).await[0].as_ref().unwrap(),
        &Finished::Moved
    );
    let b_item = store.audit_item(JOB, 0, "b").await.unwrap().unwrap();
    assert_eq!(b_item.input, None, "its result carries its input");
    let acc = store.accuracy(JOB, 1).await.unwrap();
    assert_eq!((acc.overall.correct, acc.overall.audited, acc.waiting), (1, 1, 1));
}

/// A proxy such as LiteLLM answers "retry after 60" to any request over its
/// per-minute window: a fleet that paces itself under a limit it knows takes
/// one as that request's (it goes on, 5% slower); a storm of them pauses it
/// until the next whole minute at most, one with no limit known as long as
/// the hint says.
#[tokio::test]
async fn a_hinted_429_under_a_known_limit_slows_the_fleet_and_only_a_storm_pauses_it() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let p = |requests| LimitParams {
        burst_ms: 60_000,
        ..limits(requests, 0)
    };
    let hinted = |ceiling| Settlement {
        tokens_back: 10,
        pause_ms: 60_000,
        call: CallKind::RateLimitedWithHint,
        ceiling_requests: ceiling,
        ..Settlement::default()
    };
    let field = |id: &str, f: &str| -> Option<f64> {
        let v: Option<String> = redis.conn().hget(keys::limit_buckets(id), f).unwrap();
        v.and_then(|v| v.parse().ok())
    };
    let take = |id: &'static str, requests| {
        let store = store.clone();
        async move {
            acquired(
                store
                    .limit_acquire(id, &p(requests), 1, "w", FreeReport::default())
                    .await
                    .unwrap(),
            )
        }
    };

    // The spec says 300/min: one 429 is that request's; the fleet goes on at 285.
    let (first, _) = take("told", 300).await;
    let (in_flight, _) = take("told", 300).await;
    store.limit_settle("told", &first[0], &hinted(300)).await.unwrap();
    assert_eq!(field("told", "pause"), None, "an occasional 429 paused the fleet");
    assert_eq!(field("told", "ar"), Some(285.0));
    let (next, wait) = take("told", 300).await;
    assert_eq!((next.len(), wait), (1, 0), "the fleet goes on");
    // One on a grant taken before that cut is the same event: no second cut.
    store.limit_settle("told", &in_flight[0], &hinted(300)).await.unwrap();
    assert_eq!(field("told", "ar"), Some(285.0));
    // A storm: a third fresh one within 10 s pauses the fleet for the hint.
    store.limit_settle("told", &next[0], &hinted(300)).await.unwrap();
    assert_eq!(field("told", "pause"), None, "two are not a storm");
    let (third, _) = take("told", 300).await;
    store.limit_settle("told", &third[0], &hinted(300)).await.unwrap();
    let (none, wait) = take("told", 300).await;
    assert!(none.is_empty() && wait > 0, "a storm pauses the fleet");
    // For the hint (60 s), at most until the next whole minute and a second:
    // a window counted per calendar minute is new then.
    let until = field("told", "pause").unwrap() as u64;
    assert!(wait <= 61_000 && until % 60_000 == 1_000, "{wait} ms, until {until}");

    // No limit known (no spec limit, no header, none learned): the hint pauses the fleet.
    let (g, _) = take("untold", 0).await;
    store.limit_settle("untold", &g[0], &hinted(0)).await.unwrap();
    let (none, wait) = take("untold", 0).await;
    assert!(none.is_empty() && wait > 55_000, "{wait} ms");

    // Limits told by the provider's headers count as known.
    let (g, _) = take("headers", 0).await;
    let told = Settlement {
        header_limit_requests: Some(300),
        call: CallKind::Answered,
        ..Settlement::default()
    };
    store.limit_settle("headers", &g[0], &told).await.unwrap();
    let (g, _) = take("headers", 0).await;
    store.limit_settle("headers", &g[0], &hinted(0)).await.unwrap();
    let (next, wait) = take("headers", 0).await;
    assert_eq!((next.len(), wait), (1, 0));
    assert_eq!(field("headers", "ar"), Some(285.0));
}

/// A key nothing limits (no limit in the spec, none in fresh headers, none
/// learned, no pause) gets a free pass: no grant is counted in Redis (no
/// slot, no reserved tokens), each pass a sequence number of its own. Any
/// limit, a pause or a worker that does not want one gets counted grants.
#[tokio::test]
async fn a_key_nothing_limits_gets_a_free_pass_and_nothing_is_counted_per_grant() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let mut c = redis.conn();
    let free = LimitParams {
        pass_ms: 250,
        ..limits(0, 0)
    };
    let none = FreeReport::default();
    let a = store.limit_acquire("free", &free, 30, "a", none).await.unwrap();
    let b = store.limit_acquire("free", &free, 30, "b", none).await.unwrap();
    let (pa, pb) = (a.pass.expect("a free pass"), b.pass.expect("a free pass"));
    assert_eq!((pa.0, pb.0), (250, 250));
    assert!(pb.1 > pa.1, "each pass its own sequence number: {pa:?} {pb:?}");
    assert!(a.grants.is_empty() && b.grants.is_empty());
    let slots: u64 = c.zcard(keys::limit_inflight("free")).unwrap();
    let reserved: Option<u64> = c.hget(keys::limit_buckets("free"), "reserved").unwrap();
    assert_eq!((slots, reserved), (0, None), "nothing counted per grant");
    // Not wanted: counted grants, as before.
    let counted = store
        .limit_acquire("free", &LimitParams { pass_ms: 0, ..free }, 3, "c", none)
        .await
        .unwrap();
    assert_eq!((counted.pass, counted.grants.len()), (None, 3));
    // Whatever limits the key: a told request or concurrency limit, a pause,
    // a provider's header limit while fresh, a learned rate.
    for (id, p) in [
        ("rpm", LimitParams { requests: 600, ..free }),
        (
            "conc",
            LimitParams {
                max_concurrent: 9,
                ..free
            },
        ),
        ("tpm", LimitParams { tokens: 90_000, ..free }),
    ] {
        let got = store.limit_acquire(id, &p, 3, "a", none).await.unwrap();
        assert_eq!((got.pass, got.grants.len()), (None, 3), "{id}");
    }
    let paused = Settlement {
        pause_ms: 60_000,
        call: CallKind::RateLimitedWithHint,
        ..Settlement::default()
    };
    store.limit_settle("paused", "x:1:0", &paused).await.unwrap();
    let headers = Settlement {
        header_limit_requests: Some(6000),
        call: CallKind::Answered,
        ..Settlement::default()
    };
    store.limit_settle("headers", "x:1:0", &headers).await.unwrap();
    let _: () = c.hset(keys::limit_buckets("learned"), "ar", "120").unwrap();
    for id in ["paused", "headers", "learned"] {
        let got = store.limit_acquire(id, &free, 3, "a", none).await.unwrap();
        assert_eq!(got.pass, None, "{id}: {got:?}");
    }
}

/// A worker on free passes tells the buckets what it took (the fleet's
/// sending rate, which a bare 429 cuts from, counts it) and what it has in
/// flight (the concurrency a cut starts from counts it with the slots,
/// while the worker's word holds: a dead worker's expires).
#[tokio::test]
async fn a_cut_counts_what_the_free_passes_sent_and_hold_in_flight() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let mut c = redis.conn();
    let free = |lease_ms| LimitParams {
        pass_ms: 250,
        lease_ms,
        ..limits(0, 0)
    };
    let told = |taken, in_flight| FreeReport {
        taken,
        in_flight: Some(in_flight),
    };
    let buckets = keys::limit_buckets("cut");
    store
        .limit_acquire("cut", &free(60_000), 1, "a", FreeReport::default())
        .await
        .unwrap();
    store
        .limit_acquire("cut", &free(60_000), 1, "a", told(40, 10))
        .await
        .unwrap();
    store
        .limit_acquire("cut", &free(60_000), 1, "b", told(20, 20))
        .await
        .unwrap();
    // A worker that told of 50 in flight and died (its word lasts its lease).
    store
        .limit_acquire("cut", &free(100), 1, "dead", told(0, 50))
        .await
        .unwrap();
    let wn: u64 = c.hget(&buckets, "wn").unwrap();
    assert_eq!(wn, 60, "the grants taken on passes count in the sending rate");
    let a: String = c.hget(keys::limit_free("cut"), "a").unwrap();
    assert!(a.starts_with("10:"), "{a}");
    tokio::time::sleep(std::time::Duration::from_millis(150)).await;
    // Two bare 429s on grants of a pass: the cut.
    let bare = Settlement {
        call: CallKind::RateLimited,
        pause_ms: 1000,
        ..Settlement::default()
    };
    let seq: u64 = c.hget(&buckets, "seq").unwrap();
    let id = format!("a:{seq}:0");
    let held = store
        .limit_settle_many("cut", &[(id.clone(), bare), (id, bare)])
        .await
        .unwrap();
    assert_eq!(held, [false, false], "nothing in Redis holds a free grant");
    let ac: f64 = c.hget(&buckets, "ac").unwrap();
    assert!(
        (ac - 21.0).abs() < 1e-9,
        "0.7 of the 30 in flight, not of the dead worker's: {ac}"
    );
    let ar: f64 = c.hget(&buckets, "ar").unwrap();
    assert!(ar > 0.0, "{ar}");
    let dead: Option<String> = c.hget(keys::limit_free("cut"), "dead").unwrap();
    assert_eq!(dead, None, "the dead worker's word is dropped");
    // A 429 on a free grant whose limiter never told anything at an acquire:
    // its settlement carries its word, and the cut starts from it.
    let word = FreeWord {
        prefix: "w",
        report: told(64, 64),
        lease_ms: 60_000,
    };
    let first = store
        .limit_settle_told("cut-first", &[("w:1:0".into(), bare), ("w:1:0".into(), bare)], word)
        .await
        .unwrap();
    assert_eq!(first, [false, false]);
    let first = keys::limit_buckets("cut-first");
    let (ac, ar): (f64, f64) = (c.hget(&first, "ac").unwrap(), c.hget(&first, "ar").unwrap());
    assert!((ac - 44.8).abs() < 1e-9, "0.7 of the 64 told in flight: {ac}");
    assert!(
        (ar - 0.7 * 64.0 * 60.0).abs() < 1e-6,
        "0.7 of 64 sent within the first second: {ar}"
    );
    // Under the learned concurrency, an acquire counts the free grants
    // still out with the slots: 44 allowed, 40 told in flight (the request
    // bucket, emptied by the cut, refilled and the 429s' pause lifted for
    // the test).
    let _: () = c.hset(&first, "r", 100).unwrap();
    let _: () = c.hdel(&first, "pause").unwrap();
    let got = store
        .limit_acquire("cut-first", &free(60_000), 10, "w", told(0, 40))
        .await
        .unwrap();
    assert_eq!((got.pass, got.grants.len()), (None, 4), "{got:?}");
    // A worker with none in flight any more says so once, and is forgotten;
    // what it took is counted even while the cut's pause answers it.
    let paused = store
        .limit_acquire("cut", &free(60_000), 1, "b", told(5, 0))
        .await
        .unwrap();
    assert_eq!((paused.bound, paused.grants.len()), (Bound::Rate, 0), "{paused:?}");
    let wn: u64 = c.hget(&buckets, "wn").unwrap();
    assert_eq!(wn, 65);
    let b: Option<String> = c.hget(keys::limit_free("cut"), "b").unwrap();
    assert_eq!(b, None);
}

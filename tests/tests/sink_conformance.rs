//! One conformance suite for every result sink: the same cases, through the
//! [`ResultSink`] trait alone, against PostgreSQL (a real server the
//! harness starts on 127.0.0.1), the files sink (a real directory) and the
//! in-memory sink. A sink passes when:
//!
//! - the same batch stored again (Redis handing the entries over again
//!   after a lost acknowledgement) adds no row, no ledger line, no count;
//! - a writer that dies before its acknowledgement, or before its batch
//!   was durable, loses nothing and duplicates nothing once the next writer
//!   takes the partition;
//! - `seal(now)` makes a stored batch durable, and `durable` returns
//!   exactly what the acknowledgement needs;
//! - its destination is checked when it is opened (a table lacking a
//!   column, a directory that cannot be one), with an error naming it;
//! - what it holds reads back as reconciliation counts it: each result
//!   once, failures open until their record has a result, each paid call
//!   once, one job's rows apart from another's.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::collections::BTreeMap;

use common::ledger::PaidCall;
use common::sink::{AnySink, FailureRow, Memory, ResultRow, ResultSink, SinkBatch, SinkEntry, SunkResult, Target};
use common::spec::{JobSpec, Prices};
use harness::{PgServer, TempDir};

/// A sink under test: what it is opened on, and with which spec.
struct Subject {
    target: Target,
    spec: JobSpec,
    /// A destination its open must refuse, the spec to open it with, and
    /// words the error must hold (None: nothing to check, as in memory).
    bad: Option<(Target, JobSpec, &'static str)>,
}

impl Subject {
    async fn open(&self, job: &str) -> AnySink {
        AnySink::open(&self.target, job, &self.spec).await.unwrap()
    }
}

/// The example spec with a `[sink]` section (`sink` is its body).
fn spec(sink: &str) -> JobSpec {
    let text = std::fs::read_to_string(harness::example_spec()).unwrap();
    let text = text.replacen("[retry]", &format!("[sink]\n{sink}\n\n[retry]"), 1);
    JobSpec::parse(&text, "job.toml").unwrap()
}

/// A committed result of record `rid`, as Redis holds it.
fn result_text(rid: &str) -> String {
    serde_json::json!({
        "record_id": rid, "key": format!("k-{rid}"), "output": {"label": "billing"},
        "attempts": 1, "calls": 1, "response_id": "resp", "repairs": [],
        "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120},
        "history": [{"attempt": 1, "call": 1, "outcome": "valid",
                     "usage": {"prompt_tokens": 100, "completion_tokens": 20}}],
        "model": "m", "versions": {"prompt": "1"}, "human": false, "worker": "w1",
        "committed_at": "2026-01-01T00:00:01Z", "input": {"id": rid}
    })
    .to_string()
}

/// One paid call of `rid`.
fn call(rid: &str, n: u32) -> PaidCall {
    let value = "[1,1,\"w1\",\"first\",\"settled\",100,0,20,0,\"p1\",1500,1767225600000]";
    PaidCall::decode(&format!("{rid}:{n}:00000000000{n}"), value).unwrap()
}

/// A batch: done records `done` (each with one paid call), records in
/// `failed` as (record, state); its sink stream entries numbered from `first`.
fn batch(first: u64, done: &[&str], failed: &[(&str, &str)]) -> (Vec<SinkEntry>, SinkBatch) {
    let mut entries = Vec::new();
    let mut b = SinkBatch::default();
    let mut id = first;
    let mut entry = |rid: &str, result: bool, call: Option<String>| {
        entries.push(SinkEntry {
            entry_id: format!("{id}-0"),
            rid: rid.to_owned(),
            result,
            call,
        });
        id += 1;
    };
    for rid in done {
        let text = result_text(rid);
        let (row, sunk): (ResultRow, SunkResult) = ResultRow::parse(&text, &Prices::default()).unwrap();
        b.results.push(row);
        b.sunk.push(sunk);
        b.texts.push(text);
        let paid = call(rid, 1);
        entry(rid, true, None);
        entry(rid, false, Some(paid.key()));
        b.paid.push(paid);
    }
    for (rid, state) in failed {
        b.failures.push(FailureRow::of_state(rid, state, "why"));
        entry(rid, false, None);
    }
    (entries, b)
}

/// Stores a batch, makes it durable and acknowledges it, as a writer does;
/// returns the result rows that were new.
async fn write(sink: &mut AnySink, job: &str, p: u32, entries: &[SinkEntry], b: &SinkBatch) -> u64 {
    assert!(sink.take(p).unwrap(), "{}: partition {p} free", sink.kind());
    let refused = sink.store(job, p, entries, b).await.unwrap();
    assert!(refused.is_empty(), "{}: nothing refused: {refused:?}", sink.kind());
    sink.seal(p, true).unwrap();
    let d = sink.durable(p).expect("sealed now: durable");
    assert_eq!(
        d.entries,
        entries,
        "{}: the durable batch names its entries",
        sink.kind()
    );
    assert_eq!(d.sunk.len(), b.sunk.len(), "{}: its results leave Redis", sink.kind());
    assert_eq!(
        d.paid,
        b.paid.iter().map(PaidCall::key).collect::<Vec<_>>(),
        "{}: its paid calls",
        sink.kind()
    );
    assert!(!d.recovered, "{}: its own batch", sink.kind());
    let written = d.written;
    sink.acknowledged(p).unwrap();
    assert!(sink.durable(p).is_none(), "{}: acknowledged, forgotten", sink.kind());
    written
}

/// The record ids of the job's results, and its paid calls' keys, read back.
async fn read_back(sink: &AnySink, job: &str) -> (Vec<String>, Vec<String>) {
    let mut ids = Vec::new();
    let n = sink.results(job, |r| ids.push(r.record_id)).await.unwrap();
    assert_eq!(n as usize, ids.len());
    ids.sort();
    let mut calls = Vec::new();
    sink.ledger(job, |c| calls.push(c.key())).await.unwrap();
    calls.sort();
    (ids, calls)
}

fn ids(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// The same batch stored again adds nothing.
async fn stored_again_adds_nothing(s: &Subject) {
    let job = "again";
    let mut sink = s.open(job).await;
    let kind = sink.kind();
    let (entries, b) = batch(1, &["r1", "r2", "r3"], &[("f1", "review")]);
    assert_eq!(
        write(&mut sink, job, 0, &entries, &b).await,
        3,
        "{kind}: three new rows"
    );
    assert_eq!(
        write(&mut sink, job, 0, &entries, &b).await,
        0,
        "{kind}: again, none new"
    );
    let held = sink.holdings(job).await.unwrap();
    assert_eq!(
        held.result_ids.to_strings().unwrap(),
        ids(&["r1", "r2", "r3"]),
        "{kind}: each result once"
    );
    assert_eq!(
        (held.ledger_calls, held.ledger_duplicates),
        (3, 0),
        "{kind}: each call once"
    );
    assert_eq!(held.open_failures, BTreeMap::from([("review".to_owned(), 1)]), "{kind}");
    let (results, calls) = read_back(&sink, job).await;
    assert_eq!(results, ids(&["r1", "r2", "r3"]), "{kind}: read back once each");
    assert_eq!(
        calls,
        ids(&["r1:1:000000000001", "r2:1:000000000001", "r3:1:000000000001"]),
        "{kind}"
    );
}

/// A writer that dies after its batch is durable and before the
/// acknowledgement, or before the batch is durable, loses nothing and
/// duplicates nothing.
async fn a_crash_loses_nothing_and_duplicates_nothing(s: &Subject) {
    let job = "crash";
    let (entries, b) = batch(1, &["a1", "a2"], &[]);
    {
        let mut dying = s.open(job).await;
        assert!(dying.take(0).unwrap());
        dying.store(job, 0, &entries, &b).await.unwrap();
        dying.seal(0, true).unwrap();
        assert!(dying.durable(0).is_some());
        // Dropped here: the process died before acknowledging.
    }
    let mut next = s.open(job).await;
    let kind = next.kind();
    assert!(next.take(0).unwrap(), "{kind}: the dead writer's partition is free");
    match next.durable(0) {
        // The next writer found the durable batch: it repeats the acknowledgement.
        Some(d) => {
            assert!(d.recovered, "{kind}: found, not its own");
            assert_eq!(d.entries, entries.as_slice(), "{kind}: the same entries");
            next.acknowledged(0).unwrap();
        }
        // Redis hands the entries over again: stored again, nothing new.
        None => assert_eq!(write(&mut next, job, 0, &entries, &b).await, 0, "{kind}: nothing new"),
    }
    // Partition 1: the writer dies before its batch is durable.
    let (entries, b) = batch(10, &["b1", "b2"], &[("b3", "dropped")]);
    {
        let mut dying = s.open(job).await;
        assert!(dying.take(1).unwrap());
        dying.store(job, 1, &entries, &b).await.unwrap();
    }
    assert!(next.take(1).unwrap(), "{kind}: free again");
    assert!(next.durable(1).is_none(), "{kind}: nothing durable to acknowledge");
    write(&mut next, job, 1, &entries, &b).await;
    let held = next.holdings(job).await.unwrap();
    assert_eq!(
        held.result_ids.to_strings().unwrap(),
        ids(&["a1", "a2", "b1", "b2"]),
        "{kind}: each once"
    );
    assert_eq!((held.ledger_calls, held.ledger_duplicates), (4, 0), "{kind}");
    assert_eq!(
        held.open_failures,
        BTreeMap::from([("dropped".to_owned(), 1)]),
        "{kind}"
    );
    assert!(held.damaged.is_empty() && held.unlisted.is_empty(), "{kind}: {held:?}");
}

/// `seal` without `now` may keep a batch open (a segment not due yet);
/// with `now` the batch is durable.
async fn sealing_now_makes_a_batch_durable(s: &Subject) {
    let job = "seal";
    let mut sink = s.open(job).await;
    let (entries, b) = batch(1, &["s1"], &[]);
    assert!(sink.take(2).unwrap());
    sink.store(job, 2, &entries, &b).await.unwrap();
    sink.seal(2, false).unwrap();
    if sink.durable(2).is_none() {
        sink.seal(2, true).unwrap();
    }
    let d = sink.durable(2).expect("durable once sealed now");
    assert_eq!((d.entries.len(), d.written), (2, 1), "{}", sink.kind());
}

/// Reconciliation's counts: failures resolved by a later result, and one
/// job's rows apart from another's.
async fn holdings_count_what_reconciliation_needs(s: &Subject) {
    let job = "counts";
    let mut sink = s.open(job).await;
    let kind = sink.kind();
    let (entries, b) = batch(1, &["c1"], &[("c2", "review"), ("c3", "dropped"), ("c4", "cancelled")]);
    write(&mut sink, job, 0, &entries, &b).await;
    // c2 is accepted in review: its result comes later and resolves it.
    let (entries, b) = batch(20, &["c2"], &[]);
    write(&mut sink, job, 0, &entries, &b).await;
    // Another job in the same sink.
    let mut other = s.open("other").await;
    let (entries, b) = batch(1, &["o1", "o3"], &[("o2", "review")]);
    write(&mut other, "other", 0, &entries, &b).await;
    let held = sink.holdings(job).await.unwrap();
    assert_eq!(held.result_ids.to_strings().unwrap(), ids(&["c1", "c2"]), "{kind}");
    assert_eq!(
        held.open_failures,
        BTreeMap::from([("cancelled".to_owned(), 1), ("dropped".to_owned(), 1)]),
        "{kind}: the review resolved by its result"
    );
    assert_eq!(held.ledger_calls, 2, "{kind}");
    let (results, _) = read_back(&sink, job).await;
    assert_eq!(results, ids(&["c1", "c2"]), "{kind}: only its own job");
    let (results, calls) = read_back(&other, "other").await;
    assert_eq!((results.len(), calls.len()), (2, 2), "{kind}");
    let none = sink.holdings("never-written").await.unwrap();
    assert!(none.result_ids.is_empty() && none.ledger_calls == 0, "{kind}: {none:?}");
}

/// The destination is checked at open.
async fn a_bad_destination_is_refused_at_open(s: &Subject) {
    let Some((target, spec, words)) = &s.bad else { return };
    match AnySink::open(target, "bad", spec).await {
        Ok(sink) => panic!("{}: opened a bad destination", sink.kind()),
        Err(e) => assert!(e.to_string().contains(words), "{e}: names {words:?}"),
    }
}

/// A paid call off the standard route keeps its route and model in the
/// sink, and reads back as it was.
async fn a_paid_call_keeps_its_route_and_model(s: &Subject) {
    let mut sink = s.open("routes").await;
    let flex = call("rf", 1).on_tier(
        common::route::Tier::Flex,
        &Prices {
            input_per_mtok: 1.0,
            output_per_mtok: 4.0,
            ..Prices::default()
        },
    );
    let flex = flex.to_model("gpt-4o-mini");
    let (mut entries, mut b) = batch(1, &[], &[]);
    entries.push(SinkEntry {
        entry_id: "1-0".into(),
        rid: "rf".into(),
        result: false,
        call: Some(flex.key()),
    });
    b.paid.push(flex.clone());
    write(&mut sink, "routes", 0, &entries, &b).await;
    let mut back = Vec::new();
    sink.ledger("routes", |c| back.push(c)).await.unwrap();
    assert_eq!(back.len(), 1, "{}", sink.kind());
    assert_eq!(
        (back[0].tier.as_str(), back[0].model.as_str()),
        ("flex", "gpt-4o-mini"),
        "{}",
        sink.kind()
    );
    assert_eq!(back[0].cost_nusd, flex.cost_nusd, "{}", sink.kind());
}

async fn conformance(s: &Subject) {
    a_paid_call_keeps_its_route_and_model(s).await;
    stored_again_adds_nothing(s).await;
    a_crash_loses_nothing_and_duplicates_nothing(s).await;
    sealing_now_makes_a_batch_durable(s).await;
    holdings_count_what_reconciliation_needs(s).await;
    a_bad_destination_is_refused_at_open(s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_keeps_the_sink_contract() {
    let pg = PgServer::start();
    // A table someone made without the `output` column.
    pg.query("CREATE TABLE lacking (record_id text PRIMARY KEY, job text)");
    let s = Subject {
        target: Target::Postgres(pg.url()),
        spec: spec("kind = \"postgres\"\nurl_env = \"BF_UNUSED\"\ntable = \"conform\""),
        bad: Some((
            Target::Postgres(pg.url()),
            spec("kind = \"postgres\"\nurl_env = \"BF_UNUSED\"\ntable = \"lacking\""),
            "table lacking has no column",
        )),
    };
    conformance(&s).await;

    // A ledger table of a version before routes gains `tier` and `model`
    // when a sink opens it, its rows read back as standard calls.
    pg.query("ALTER TABLE conform_ledger DROP COLUMN tier, DROP COLUMN model");
    let sink = s.open("upgraded").await;
    let mut back = Vec::new();
    sink.ledger("routes", |c| back.push(c)).await.unwrap();
    assert_eq!(back.len(), 1);
    assert_eq!(back[0].tier, "standard", "a row written before routes");

    // PostgreSQL alone can refuse a row (a constraint someone added): the
    // row comes back with the database's message, the rest is stored.
    pg.query("ALTER TABLE conform ADD CONSTRAINT no_r9 CHECK (record_id <> 'r9')");
    let mut sink = s.open("refuse").await;
    let (entries, b) = batch(1, &["r8", "r9"], &[]);
    let refused = sink.store("refuse", 0, &entries, &b).await.unwrap();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0].0, "r9");
    assert!(
        refused[0].1.contains("no_r9"),
        "the database's message: {}",
        refused[0].1
    );
    let d = sink.durable(0).unwrap();
    assert_eq!(d.written, 1);
    assert_eq!(
        d.sunk.iter().map(|s| s.rid.as_str()).collect::<Vec<_>>(),
        ["r8"],
        "the refused result stays in Redis"
    );
    let held = sink.holdings("refuse").await.unwrap();
    assert_eq!(held.result_ids.to_strings().unwrap(), ids(&["r8"]));
    assert_eq!(held.open_failures, BTreeMap::from([("rejected".to_owned(), 1)]));

    // The check reads the table's ids a page at a time: every page, each id
    // once, another job's left out (the crash test wrote a1, a2, b1, b2).
    let pg_sink = common::sink::PgSink::connect(&pg.url(), &s.spec).await.unwrap();
    for page in [1, 2, 3, 50_000] {
        let read = pg_sink.result_ids_by("crash", page).await.unwrap();
        assert_eq!(
            read.to_strings().unwrap(),
            ids(&["a1", "a2", "b1", "b2"]),
            "pages of {page}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_keep_the_sink_contract() {
    let dir = TempDir::new("conform");
    let root = dir.join("sink");
    // A job directory that cannot be one: a file stands where it goes.
    let blocked = dir.join("blocked");
    std::fs::create_dir_all(&blocked).unwrap();
    std::fs::write(blocked.join("bad"), "not a directory").unwrap();
    let files = |d: &std::path::Path| spec(&format!("kind = \"files\"\ndir = \"{}\"", d.display()));
    let s = Subject {
        target: Target::Files(root.clone()),
        spec: files(&root),
        bad: Some((
            Target::Files(blocked.clone()),
            files(&blocked),
            "cannot create directory",
        )),
    };
    conformance(&s).await;
    // Read only (status, report, export): a job that never wrote reads as
    // empty, and nothing is created.
    let reader = AnySink::reader(&s.target, "never", &s.spec).await.unwrap();
    let held = reader.holdings("never").await.unwrap();
    assert!(held.result_ids.is_empty() && held.ledger_calls == 0, "{held:?}");
    assert_eq!(read_back(&reader, "never").await, (vec![], vec![]));
    assert!(!root.join("never").exists(), "reading created the job's folder");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_keeps_the_sink_contract() {
    let s = Subject {
        target: Target::Memory(Memory::default()),
        spec: spec("kind = \"none\""),
        bad: None,
    };
    conformance(&s).await;
}

//! Every Redis key, stream, group and consumer name batchfleet uses.
//!
//! Job-level keys share the hash tag `{job}`; each partition's keys share
//! `{job:pN}`, so every multi-key script runs in one Redis Cluster slot.
//! Job names are restricted (see [`valid_job_name`]) so they can never break
//! a hash tag.

/// The consumer group every worker of every job reads through.
pub const GROUP: &str = "workers";

/// The consumer group that writes a partition's outcomes to the job's sink.
pub const SINK_GROUP: &str = "sink";

/// Why a job name was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("job name `{0}` is invalid: use 1-64 characters from A-Z a-z 0-9 . _ -")]
pub struct BadJobName(pub String);

/// Checks a human job name: it becomes part of every key.
pub fn valid_job_name(name: &str) -> Result<(), BadJobName> {
    let ok = (1..=64).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok { Ok(()) } else { Err(BadJobName(name.to_owned())) }
}

/// Set of all job names ever enqueued.
pub fn jobs() -> String {
    "bf:jobs".to_owned()
}

/// The fleet's workers: consumer name -> its last heartbeat (JSON, see
/// `crate::heartbeat`); a worker's field leaves once it expired.
pub fn workers() -> String {
    "bf:workers".to_owned()
}

/// The fleet's wake-up stream (capped): an entry says "new work for job J"
/// or "job J's flags changed"; idle workers block on it (XREAD) instead of
/// polling every partition.
pub fn wake() -> String {
    "bf:wake".to_owned()
}

/// The job's spec as TOML text; workers run exactly what was enqueued.
pub fn spec(job: &str) -> String {
    format!("bf:{{{job}}}:spec")
}

/// The job's manifest (JSON): dataset, expected records, drops, versions.
pub fn manifest(job: &str) -> String {
    format!("bf:{{{job}}}:manifest")
}

/// The producer's resume cursor (JSON): offset, line, counters, file fingerprint.
pub fn cursor(job: &str) -> String {
    format!("bf:{{{job}}}:cursor")
}

/// Set (with a short TTL, renewed) while a producer is enqueueing the job
/// with a bounded backlog: more tasks are coming, so a `--drain` worker
/// does not take an empty stream for the end of the job. A producer that
/// died leaves it to expire.
pub fn enqueuing(job: &str) -> String {
    format!("bf:{{{job}}}:enqueuing")
}

/// Hash of the job's dataset tags: sha256 -> tag (see `dataset_tag.lua`).
pub fn datasets(job: &str) -> String {
    format!("bf:{{{job}}}:datasets")
}

/// Hash of dropped dataset lines: `<dataset sha12>:<line>` -> JSON entry.
pub fn dropped_lines(job: &str) -> String {
    format!("bf:{{{job}}}:dropped_lines")
}

/// Changes at every `producer resume` (a unique mark): a worker's drift
/// watch that began under an older mark halts nothing (see `drift_halt.lua`).
pub fn resumed(job: &str) -> String {
    format!("bf:{{{job}}}:resumed")
}

/// Set while the job's fleet is halted (401/403, insufficient quota): the reason.
/// Workers claim nothing for the job while it exists; deleting it resumes.
pub fn halt(job: &str) -> String {
    format!("bf:{{{job}}}:halt")
}

/// Fleet-wide token buckets of one provider key/model (`limiter` is its id):
/// levels, last refill, pause, limits learned from headers.
pub fn limit_buckets(limiter: &str) -> String {
    format!("bf:{{rl:{limiter}}}:buckets")
}

/// Grants in flight for one provider key/model: a sorted set of grant ids
/// scored by minus their expiry, Unix ms (concurrency slots of dead workers
/// expire). Minus: a new grant expires last, and a small set (a listpack)
/// inserts at its head what it would otherwise walk and parse every score to
/// append; the expired are found from its tail.
pub fn limit_inflight(limiter: &str) -> String {
    format!("bf:{{rl:{limiter}}}:slots")
}

/// Grants of free passes in flight, per worker, for one provider key/model
/// (nothing limits it, and no grant is counted: see `limit_acquire.lua`): a
/// hash from the worker's grant id prefix to `count:expiry ms`.
pub fn limit_free(limiter: &str) -> String {
    format!("bf:{{rl:{limiter}}}:free")
}

/// The job's deadline, Unix ms (see [`crate::route`]): set at its first
/// enqueue from `job.deadline`, changed by `producer deadline`.
pub fn deadline(job: &str) -> String {
    format!("bf:{{{job}}}:deadline")
}

/// Set while the job is cancelled: workers claim nothing for it.
pub fn cancel(job: &str) -> String {
    format!("bf:{{{job}}}:cancel")
}

/// The hash tag shared by all keys of one partition.
fn partition_tag(job: &str, partition: u32) -> String {
    format!("{{{job}:p{partition}}}")
}

/// The partition's task stream, read through [`GROUP`].
pub fn stream(job: &str, partition: u32) -> String {
    format!("bf:{}:tasks", partition_tag(job, partition))
}

/// Hash record_id -> state (`queued`, `done`, `review`, `dropped:<reason>`, `cancelled`).
pub fn state(job: &str, partition: u32) -> String {
    format!("bf:{}:state", partition_tag(job, partition))
}

/// Hash record_id -> result JSON; written once (first writer wins).
pub fn results(job: &str, partition: u32) -> String {
    format!("bf:{}:results", partition_tag(job, partition))
}

/// Hash of a partition's paid calls (see [`crate::ledger`]): the call's key
/// (record id, call number, nonce) -> the encoded call; written once per key
/// (only when new to it) by the script that settles the record. For a job without a sink
/// never deleted from; with one, a call leaves it a while after the sink
/// holds it (see [`ledger_sunk`]).
pub fn ledger(job: &str, partition: u32) -> String {
    format!("bf:{}:paid", partition_tag(job, partition))
}

/// Sorted set of a partition's paid calls the sink holds, scored by when
/// they may leave the ledger hash (Unix ms): kept until then so that the
/// same call stored again (a store call retried after a lost reply, a call
/// recorded again as lost) is still known and not counted twice.
pub fn ledger_sunk(job: &str, partition: u32) -> String {
    format!("bf:{}:paid:sunk", partition_tag(job, partition))
}

/// A partition's spend counters (see [`crate::ledger`]): they only grow.
pub fn spend(job: &str, partition: u32) -> String {
    format!("bf:{}:spend", partition_tag(job, partition))
}

/// Hash of a partition's outcome counters (see `finish.lua`; they only
/// grow): `e:<CODE> <field>` failed attempts by validation error,
/// `r:<outcome>` retries by cause, `a:<N>` records done in N attempts, and
/// per Unix minute `t<minute>:d` records done, `t<minute>:f` to review or
/// dropped, `t<minute>:c` paid calls, `t<minute>:u` their nano-USD.
pub fn stats(job: &str, partition: u32) -> String {
    format!("bf:{}:stats", partition_tag(job, partition))
}

/// Hash of a partition's provider batch shards (batch mode): shard id ->
/// the shard as JSON (see [`crate::shard`]).
pub fn shards(job: &str, partition: u32) -> String {
    format!("bf:{}:shards", partition_tag(job, partition))
}

/// Hash of the tasks one shard holds: record id -> the task (its stream
/// entry encoding).
pub fn shard(job: &str, partition: u32, shard_id: &str) -> String {
    format!("bf:{}:shard:{shard_id}", partition_tag(job, partition))
}

/// Set of the record ids packed into one shard (its batch's answers are
/// joined on them: a line for any other record is unknown).
pub fn shard_packed(job: &str, partition: u32, shard_id: &str) -> String {
    format!("bf:{}:shard:{shard_id}:packed", partition_tag(job, partition))
}

/// Counter of a partition's shard numbers (a hash: field `n`).
pub fn shard_seq(job: &str, partition: u32) -> String {
    format!("bf:{}:shard_seq", partition_tag(job, partition))
}

/// Counter (a hash: field `n`) of the job's provider batches that failed
/// validation (batch mode: at 3 the job halts; a resume resets it).
pub fn batch_failures(job: &str) -> String {
    format!("bf:{{{job}}}:batch_failures")
}

/// Tokens the job's unfinished provider batches may use at most (against
/// `[batch] max_enqueued_tokens`): a counter, with a field per shard.
pub fn batch_tokens(job: &str) -> String {
    format!("bf:{{{job}}}:batch_tokens")
}

/// Hash of a partition's committed records waiting for a person's spot
/// check (see [`crate::audit`]): record id -> its input as sampled (empty
/// when its result carries it).
pub fn audit(job: &str, partition: u32) -> String {
    format!("bf:{}:audit", partition_tag(job, partition))
}

/// Hash of a partition's spot-check verdicts: record id -> verdict.
pub fn audited(job: &str, partition: u32) -> String {
    format!("bf:{}:audited", partition_tag(job, partition))
}

/// Stream of outcomes to hand to the job's sink (only for a job with one):
/// `rid` and `k` (`r` a committed result, `f` a record in review or
/// dropped, `l` a paid call of the record, its key in `c`), added by the
/// same script that settles the record or records the call; read through
/// [`SINK_GROUP`], acknowledged and deleted once the sink's transaction is
/// durable. It exists exactly when the job has a sink.
pub fn sink(job: &str, partition: u32) -> String {
    format!("bf:{}:sink", partition_tag(job, partition))
}

/// Hash of what has left Redis for the sink, per partition: `written` (rows
/// that were new in the sink), `done` (results removed from `results` once
/// the sink held them), the tokens of their calls (`prompt`, `completion`,
/// `cached`) and their attempts (`a<N>`: results that took N attempts), so
/// status figures keep counting what is no longer in Redis.
pub fn sunk(job: &str, partition: u32) -> String {
    format!("bf:{}:sunk", partition_tag(job, partition))
}

/// Hash record_id -> review entry JSON: what people drain.
pub fn review(job: &str, partition: u32) -> String {
    format!("bf:{}:review", partition_tag(job, partition))
}

/// A reviewer's lease on one review entry (its name; expires by itself).
pub fn review_lease(job: &str, partition: u32, rid: &str) -> String {
    format!("bf:{}:rlease:{rid}", partition_tag(job, partition))
}

/// Hash record_id -> review entry after a person acted on it (with its actions).
pub fn reviewed(job: &str, partition: u32) -> String {
    format!("bf:{}:reviewed", partition_tag(job, partition))
}

/// Hash record_id -> task JSON of a record cancelled before it ran (for resume).
pub fn cancelled(job: &str, partition: u32) -> String {
    format!("bf:{}:cancelled", partition_tag(job, partition))
}

/// Sorted set of tasks waiting to retry, scored by due time (Unix ms).
pub fn delayed(job: &str, partition: u32) -> String {
    format!("bf:{}:delayed", partition_tag(job, partition))
}

/// Where each record of a partition came from (`<dataset sha12>:<line>`),
/// kept as long as the job: the duplicate check and `retry --from missing`
/// must not depend on the idempotency keys' TTL.
pub fn origins(job: &str, partition: u32) -> String {
    format!("bf:{}:origin", partition_tag(job, partition))
}

/// Hash of the job's spend cap (`cap`, `spent`, `reserved`, nano-USD; see
/// budget.lua), and its zset of reservations in flight.
pub fn budget(job: &str) -> String {
    format!("bf:{{{job}}}:budget")
}

pub fn budget_held(job: &str) -> String {
    format!("bf:{{{job}}}:budget:held")
}

/// A job's counters of what left no record: `answers_lost` (paid answers
/// whose outcome Redis could not store in time).
pub fn counters(job: &str) -> String {
    format!("bf:{{{job}}}:counters")
}

/// The job's circuit breaker for systematic provider errors: `proven` once
/// the provider answered; per error signature, how many calls failed with it.
pub fn breaker(job: &str) -> String {
    format!("bf:{{{job}}}:breaker")
}

/// The job's provider outage (see `outage.lua`): the streak of calls
/// failing transiently fleet-wide (since when, how many, the last error),
/// whether the provider is taken for down, and the probe's lease.
pub fn outage(job: &str) -> String {
    format!("bf:{{{job}}}:outage")
}

/// Stream: every bulk action people took on the job (who, what, the
/// filter, how many entries it touched); append-only.
pub fn bulk_log(job: &str) -> String {
    format!("bf:{{{job}}}:bulk")
}

/// The structured-output form an endpoint and model accept, learned by
/// `structured_output = "auto"` (`endpoint` is a hash of base URL and model).
pub fn accepted_form(endpoint: &str) -> String {
    format!("bf:{{forms}}:{endpoint}")
}

/// A worker's lease on its consumer name (no two live workers share one).
pub fn consumer_lease(consumer: &str) -> String {
    format!("bf:{{consumers}}:{consumer}")
}

/// Changes made to a job's stored spec with `producer spec update`: time -> change.
pub fn spec_changes(job: &str) -> String {
    format!("bf:{{{job}}}:spec_changes")
}

/// Idempotency key of one record (`SET NX EX`); its value is the record's origin.
pub fn idem(job: &str, partition: u32, record_id: &str) -> String {
    format!("bf:{}:idem:{record_id}", partition_tag(job, partition))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(key: &str) -> &str {
        let start = key.find('{').unwrap_or(0);
        let end = key[start..].find('}').map_or(key.len(), |e| start + e);
        &key[start + 1..end]
    }

    #[test]
    fn partition_keys_share_one_hash_tag() {
        let keys = [
            stream("j1", 3),
            state("j1", 3),
            idem("j1", 3, "ab12"),
            results("j1", 3),
            review("j1", 3),
            delayed("j1", 3),
            sink("j1", 3),
            sunk("j1", 3),
            ledger("j1", 3),
            ledger_sunk("j1", 3),
            spend("j1", 3),
            stats("j1", 3),
            audit("j1", 3),
            audited("j1", 3),
            shards("j1", 3),
            shard("j1", 3, "p3-000001"),
            shard_packed("j1", 3, "p3-000001"),
            shard_seq("j1", 3),
        ];
        assert!(keys.iter().all(|k| tag(k) == "j1:p3"), "{keys:?}");
        assert_ne!(tag(&stream("j1", 2)), tag(&stream("j1", 3)));
    }

    #[test]
    fn job_keys_share_the_job_tag() {
        for k in [
            spec("a.b"),
            manifest("a.b"),
            cursor("a.b"),
            enqueuing("a.b"),
            dropped_lines("a.b"),
            datasets("a.b"),
            halt("a.b"),
            resumed("a.b"),
            outage("a.b"),
        ] {
            assert_eq!(tag(&k), "a.b");
        }
    }

    #[test]
    fn job_names_that_could_break_a_tag_are_refused() {
        for bad in ["", "a{b", "a}b", "a b", "a:b", &"x".repeat(65)] {
            assert!(valid_job_name(bad).is_err(), "{bad}");
        }
        for good in ["demo", "run-2026.11_a"] {
            assert!(valid_job_name(good).is_ok());
        }
    }
}

#!/usr/bin/env bash
# `make demo`: the example job end to end on this machine.
# Starts a throwaway redis-server (unless REDIS_URL is set) and llm-sim with a
# realistic fault mix (unless OPENAI_API_KEY and BATCHFLEET_BASE_URL are set,
# then that endpoint is used), enqueues examples/dataset.jsonl, runs two
# workers until the job is drained, writing the results into a throwaway
# PostgreSQL (when its server binaries are installed; `make demo` installs
# them), and prints the job status, a psql query and its first rows; where
# PostgreSQL cannot be installed, into the files sink (JSONL segments in
# .demo/sink), and says so. MODE=batch (`make demo MODE=batch`) runs the
# same job in provider batch mode: shards through llm-sim's Batch API.
# Everything it starts binds to 127.0.0.1 and is stopped at exit.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
bin=target/release
work=.demo
rm -rf "$work"; mkdir -p "$work"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  stop_redis
  stop_postgres
}
trap cleanup EXIT

if [ -n "${REDIS_URL:-}" ]; then
  echo "using the Redis in REDIS_URL"
else
  start_redis "$work/redis"
  export REDIS_URL="redis://127.0.0.1:$REDIS_PORT"
  echo "started a throwaway redis-server on 127.0.0.1:$REDIS_PORT"
fi

if [ -n "${OPENAI_API_KEY:-}" ] && [ -n "${BATCHFLEET_BASE_URL:-}" ]; then
  echo "using the model endpoint in BATCHFLEET_BASE_URL"
else
  faults="rate_limit=0.02,server_error=0.01,unavailable=0.01,empty=0.005,broken_json=0.02,fence=0.03,prose=0.02,missing_field=0.02,bad_enum=0.02,bool_number=0.02,content_filter=0.005,length=0.01"
  # Batch mode: each batch takes 3 s, its output lines shuffled.
  $bin/llm-sim --latency-ms 150 --rpm 10000 --faults "$faults" --seed 7 --batch-secs 3 --batch-faults shuffle \
    >"$work/llm-sim.out" 2>"$work/llm-sim.log" &
  pids+=($!)
  for _ in $(seq 1 100); do grep -q listening "$work/llm-sim.out" 2>/dev/null && break; sleep 0.05; done
  addr=$(sed -n 's/^llm-sim listening on //p' "$work/llm-sim.out")
  export BATCHFLEET_BASE_URL="$addr/v1" OPENAI_API_KEY="sk-demo-not-a-real-key"
  echo "started llm-sim on $addr (150 ms mean latency, 10000 requests/min, fault mix: $faults)"
fi

spec=examples/job.toml
# DEMO_SINK=files: the files sink even where PostgreSQL is installed.
if [ "${DEMO_SINK:-}" != files ] && start_postgres; then
  export DEMO_DATABASE_URL="$PG_URL"
  spec="$work/job.toml"
  sed 's/^\[retry\]$/[sink]\nkind = "postgres"\nurl_env = "DEMO_DATABASE_URL"\ntable = "results"\n\n[retry]/' examples/job.toml >"$spec"
  echo "started a throwaway PostgreSQL on 127.0.0.1:$PG_PORT: results go to its table \`results\` ($spec adds [sink])"
else
  spec="$work/job.toml"
  sed "s|^\[retry\]\$|[sink]\nkind = \"files\"\ndir = \"$PWD/$work/sink\"\n\n[retry]|" examples/job.toml >"$spec"
  echo "PostgreSQL's server binaries are not installed (or DEMO_SINK=files): results go to the files sink instead, JSONL segments in $work/sink ($spec adds [sink])"
fi

case "${MODE:-online}" in
  online) ;;
  batch)
    # Shards of up to 200 requests, looked at every second; a shard is
    # packed once its tasks waited 2 s.
    sed -i 's/^\(structured_output = .*\)$/\1\nmode = "batch"/; s/^\[retry\]$/[batch]\nshard_records = 200\npoll_secs = 1\npack_wait_secs = 2\n\n[retry]/' "$spec"
    echo "MODE=batch: $spec sets provider.mode = \"batch\" and [batch] (shards of 200 requests)"
    ;;
  *) echo "MODE must be online or batch, not ${MODE}" >&2; exit 2 ;;
esac

job=demo-$(date +%Y%m%d-%H%M%S)
echo
echo "== producer enqueue examples/dataset.jsonl --job $job --spec $spec"
$bin/producer enqueue examples/dataset.jsonl --job "$job" --spec "$spec" --no-progress
echo
echo "== two workers, until the job is drained (logs in $work/worker-*.log)"
for i in 1 2; do
  $bin/worker --job "$job" --drain --concurrency 32 --log-format json --metrics-addr 127.0.0.1:0 2>"$work/worker-$i.log" &
  pids+=($!)
done
worker_pids=("${pids[@]: -2}")
for p in "${worker_pids[@]}"; do wait "$p"; done
for i in 1 2; do echo "worker $i: $(tail -1 "$work/worker-$i.log")"; done
echo
echo "== producer status --job $job --require-complete"
$bin/producer status --job "$job" --require-complete
echo
echo "== producer report --job $job"
$bin/producer report --job "$job"
echo
$bin/producer export --job "$job" --out "$work/results.jsonl"
echo "results: $work/results.jsonl ($(wc -l <"$work/results.jsonl") records); one of them:"
head -1 "$work/results.jsonl" | python3 -c 'import json,sys; r=json.load(sys.stdin); print(json.dumps({k: r[k] for k in ("record_id","key","output","attempts")}, indent=2))'
if [ -n "${DEMO_DATABASE_URL:-}" ]; then
  query="SELECT business_key, output->>'label' AS label, attempts, committed_at FROM results WHERE job = '$job' ORDER BY business_key LIMIT 5"
  echo
  echo "== psql -c \"$query\""
  PGPASSWORD="$PG_PASSWORD" psql -h 127.0.0.1 -p "$PG_PORT" -U bf -d postgres -c "$query"
  PGPASSWORD="$PG_PASSWORD" psql -h 127.0.0.1 -p "$PG_PORT" -U bf -d postgres -Atc \
    "SELECT j.expected_records || ' expected: ' || r.n || ' rows in results, ' || f.n || ' open failures, '
            || (j.expected_records - r.n - f.n) || ' unaccounted'
       FROM results_jobs j,
            (SELECT count(*) AS n FROM results WHERE job = '$job') r,
            (SELECT count(*) AS n FROM results_failures WHERE job = '$job' AND resolved_at IS NULL) f
      WHERE j.job = '$job'"
else
  echo
  echo "== $work/sink/$job: segments and manifest.json"
  ls "$work/sink/$job/results" | head -5
  python3 - "$work/sink/$job" <<'PY'
import json, sys
root = sys.argv[1]
m = json.load(open(root + "/manifest.json"))
done, last = set(), {}
for seg in m["segments"]:  # a record's failure lines oldest first: the last one wins
    for line in open(f"{root}/{seg['file']}"):
        r = json.loads(line)
        if seg["kind"] == "results":
            done.add(r["record_id"])
        else:
            last[r["record_id"]] = r["state"]
open_failures = sum(1 for rid in last if rid not in done)
n = m["expected_records"]
print(f"{n} expected: {len(done)} result lines, {open_failures} open failures, {n - len(done) - open_failures} unaccounted "
      f"({len(m['segments'])} segments in manifest.json)")
PY
fi
echo "review queue: producer review --job $job list   (then show / accept / requeue / reject)"
echo "dropped lines: producer dropped --job $job"

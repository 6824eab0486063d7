#!/usr/bin/env bash
# `make bench-enqueue`: producer enqueue of N records (default 1,000,000, ~300
# bytes each) against a raw baseline measured in the same run on the same
# server: the same records as pipelined SET NX EX + XADD through redis-cli --pipe.
# Prints records/s of both, their ratio, and the producer's peak RSS.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
N=${N:-1000000}
need_gnu_time
work=.bench/enqueue
bench_records "$N"
data=$BENCH_DATA; proto=$BENCH_PROTO
start_redis "$work/redis"
trap stop_redis EXIT
now() { date +%s.%N; }

echo "baseline: redis-cli --pipe (SET NX EX + XADD per record)"
t0=$(now)
redis-cli -p "$REDIS_PORT" --pipe <"$proto" >"$work/pipe.log"
t1=$(now)
tail -1 "$work/pipe.log"
base=$(python3 -c "print($N / ($t1 - $t0))")
redis-cli -p "$REDIS_PORT" flushall >/dev/null

echo "producer enqueue (release build)"
t0=$(now)
/usr/bin/time -f '%M' -o "$work/rss.txt" target/release/producer enqueue "$data" --job bench \
  --spec examples/job.toml --redis "redis://127.0.0.1:$REDIS_PORT" --json --max-backlog 0 >"$work/summary.json"
t1=$(now)
ours=$(python3 -c "print($N / ($t1 - $t0))")
rss_kb=$(cat "$work/rss.txt")
python3 - "$work/summary.json" "$N" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
assert s["enqueued"] == int(sys.argv[2]), f"expected {sys.argv[2]} enqueued, got {s['enqueued']}"
PY
python3 - "$base" "$ours" "$rss_kb" "$N" <<'PY'
import sys
base, ours, rss_kb, n = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
print()
print(f"| records | baseline (redis-cli --pipe) | producer enqueue | ratio | producer peak RSS |")
print(f"|---|---|---|---|---|")
print(f"| {n:,} | {base:,.0f} rec/s | {ours:,.0f} rec/s | {ours/base:.2f} | {rss_kb/1024:.1f} MiB |")
print()
ok = ours / base >= 0.5 and rss_kb < 64 * 1024
print("targets (>= 0.50 of baseline, RSS < 64 MiB):", "met" if ok else "NOT met")
PY

#!/usr/bin/env bash
# `make bench-enqueue`: producer enqueue of N records (default 1,000,000, ~300
# bytes each) against a raw baseline measured in the same run on the same
# server: the same records as pipelined SET NX EX + XADD through redis-cli --pipe.
# Prints records/s of both, their ratio, Redis CPU per record of both (INFO
# cpu deltas), the producer's own CPU per record and its peak RSS.
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
c0=$(redis_cpu); t0=$(now)
redis-cli -p "$REDIS_PORT" --pipe <"$proto" >"$work/pipe.log"
t1=$(now); c1=$(redis_cpu)
tail -1 "$work/pipe.log"
base=$(python3 -c "print($N / ($t1 - $t0))")
base_cpu=$(python3 -c "print(($c1 - $c0) / $N * 1e6)")
redis-cli -p "$REDIS_PORT" flushall >/dev/null

echo "producer enqueue (release build)"
c0=$(redis_cpu); t0=$(now)
/usr/bin/time -f '%M %U %S' -o "$work/rss.txt" target/release/producer enqueue "$data" --job bench \
  --spec examples/job.toml --redis "redis://127.0.0.1:$REDIS_PORT" --json --max-backlog 0 >"$work/summary.json"
t1=$(now); c1=$(redis_cpu)
ours=$(python3 -c "print($N / ($t1 - $t0))")
ours_cpu=$(python3 -c "print(($c1 - $c0) / $N * 1e6)")
read -r rss_kb user_s sys_s <"$work/rss.txt"
producer_cpu=$(python3 -c "print(($user_s + $sys_s) / $N * 1e6)")
python3 - "$work/summary.json" "$N" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
assert s["enqueued"] == int(sys.argv[2]), f"expected {sys.argv[2]} enqueued, got {s['enqueued']}"
PY
python3 - "$base" "$ours" "$rss_kb" "$N" "$base_cpu" "$ours_cpu" "$producer_cpu" <<'PY'
import sys
base, ours, rss_kb, n = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
base_cpu, ours_cpu, producer_cpu = float(sys.argv[5]), float(sys.argv[6]), float(sys.argv[7])
print()
print(f"| records | baseline (redis-cli --pipe) | producer enqueue | ratio | Redis CPU per record: baseline, producer "
      f"| the producer's own CPU per record | producer peak RSS |")
print(f"|---|---|---|---|---|---|---|")
print(f"| {n:,} | {base:,.0f} rec/s | {ours:,.0f} rec/s | {ours/base:.2f} | {base_cpu:.1f} us, {ours_cpu:.1f} us "
      f"| {producer_cpu:.1f} us | {rss_kb/1024:.1f} MiB |")
print()
ok = ours / base >= 0.5 and rss_kb < 64 * 1024
print("targets (>= 0.50 of baseline, RSS < 64 MiB):", "met" if ok else "NOT met")
ok = ours / base >= 0.7 and ours_cpu <= 6
print("#15 hot-path targets (>= 0.70 of baseline, <= 6 us of Redis CPU per record):", "met" if ok else "NOT met")
PY

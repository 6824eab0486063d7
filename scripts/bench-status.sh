#!/usr/bin/env bash
# `make bench-status`: `producer status` (with its full reconciliation) on a
# job of N records (default 1,000,000), against the enqueue of the same
# records measured in the same run on the same server.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
N=${N:-1000000}
need_gnu_time
work=.bench/enqueue
bench_records "$N"
data=$BENCH_DATA; proto=$BENCH_PROTO
start_redis "$work/redis-status"
trap stop_redis EXIT
url="redis://127.0.0.1:$REDIS_PORT"
now() { date +%s.%N; }
c0=$(redis_cpu); t0=$(now)
target/release/producer enqueue "$data" --job status-bench --spec examples/job.toml --redis "$url" --no-progress --max-backlog 0 >/dev/null
t1=$(now); c1=$(redis_cpu)
/usr/bin/time -f '%M' -o "$work/status-rss.txt" target/release/producer status --job status-bench --redis "$url" --json >"$work/status.json"
t2=$(now); c2=$(redis_cpu)
python3 - "$work/status.json" "$N" "$t0" "$t1" "$t2" "$(cat "$work/status-rss.txt")" "$c0" "$c1" "$c2" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
n = int(sys.argv[2]); t0, t1, t2 = map(float, sys.argv[3:6]); rss = int(sys.argv[6])
c0, c1, c2 = map(float, sys.argv[7:10])
assert s["queued"] == n and s["missing"] == 0 and s["duplicates"] == 0 and s["unknown"] == 0, s
enq, st = t1 - t0, t2 - t1
print(f"| records | enqueue (baseline) | status with reconciliation | ratio | Redis CPU per record: enqueue, status | status peak RSS |")
print(f"|---|---|---|---|---|---|")
print(f"| {n:,} | {n/enq:,.0f} rec/s | {n/st:,.0f} rec/s | {st/enq:.2f} of the enqueue time "
      f"| {(c1 - c0) / n * 1e6:.1f} us, {(c2 - c1) / n * 1e6:.1f} us | {rss/1024:.1f} MiB |")
print()
ok = st / enq <= 0.3 and rss < 64 * 1024
print("targets (<= 0.30 of the enqueue time, RSS < 64 MiB):", "met" if ok else "NOT met")
PY

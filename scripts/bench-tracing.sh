#!/usr/bin/env bash
# `make bench-tracing`: what tracing costs the producer. The same N records
# (default 200,000) enqueued with tracing off and with tracing on (an OTLP
# receiver, rotel, on 127.0.0.1 that drops what it gets), alternating, three
# runs each, into a flushed throwaway redis-server. Prints the median records/s
# of each and their ratio. PRODUCER=path compares another producer build with
# tracing off (e.g. an older commit's) instead.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
N=${N:-200000}
RUNS=${RUNS:-3}
work=.bench/tracing
mkdir -p "$work"
bench_records "$N"
data=$BENCH_DATA
start_redis "$work/redis"
agent="$(python3 -c 'import os, rotel; print(os.path.dirname(rotel.__file__))')/rotel-agent"
grpc=$(free_port); http=$(free_port)
"$agent" start --otlp-grpc-endpoint "127.0.0.1:$grpc" --otlp-http-endpoint "127.0.0.1:$http" \
  --exporter blackhole --pid-file "$work/rotel.pid" --log-file "$work/rotel.log" >"$work/rotel.out" 2>&1 &
ROTEL_PID=$!
trap 'stop_redis; kill $ROTEL_PID 2>/dev/null || true; wait $ROTEL_PID 2>/dev/null || true' EXIT
now() { date +%s.%N; }
run() { # run LABEL PRODUCER [ENV...]: one enqueue, prints records/s
  local label=$1 bin=$2; shift 2
  redis-cli -p "$REDIS_PORT" flushall >/dev/null
  local t0 t1
  t0=$(now)
  env BATCHFLEET_MAX_BACKLOG=0 "$@" "$bin" enqueue "$data" --job bench --spec examples/job.toml \
    --redis "redis://127.0.0.1:$REDIS_PORT" --json --no-progress >"$work/$label.json"
  t1=$(now)
  python3 -c "import json; assert json.load(open('$work/$label.json'))['enqueued'] == $N"
  python3 -c "print($N / ($t1 - $t0))"
}
other=${PRODUCER:-}
a=(); b=()
for _ in $(seq 1 "$RUNS"); do
  a+=("$(run off target/release/producer -u OTEL_EXPORTER_OTLP_ENDPOINT)")
  if [ -n "$other" ]; then
    b+=("$(run other "$other" -u OTEL_EXPORTER_OTLP_ENDPOINT)")
  else
    b+=("$(run on target/release/producer OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:$http")")
  fi
done
python3 - "$N" "${other:+other build, tracing off}" "${a[*]}" "${b[*]}" <<'PY'
import statistics, sys
n, other, a, b = int(sys.argv[1]), sys.argv[2], list(map(float, sys.argv[3].split())), list(map(float, sys.argv[4].split()))
ma, mb = statistics.median(a), statistics.median(b)
label = other or "tracing on (every record an enqueue span, exported)"
print()
print(f"| records | this build, tracing off | {label} | ratio |")
print("|---|---|---|---|")
print(f"| {n:,} | {ma:,.0f} rec/s | {mb:,.0f} rec/s | {mb/ma:.2f} |")
PY

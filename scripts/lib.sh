# Shared shell helpers for the demo and benchmarks (sourced, not run).

# A TCP port on 127.0.0.1 that nobody listens on right now.
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# start_redis DIR: starts a throwaway redis-server on 127.0.0.1 and a free port,
# sets REDIS_PORT and REDIS_PID; stop it with stop_redis.
start_redis() {
  local dir=$1; shift
  mkdir -p "$dir"
  REDIS_PORT=$(free_port)
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no --dir "$dir" \
    --maxmemory-policy noeviction "$@" >"$dir/redis.log" 2>&1 &
  REDIS_PID=$!
  for _ in $(seq 1 100); do
    redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && return 0
    sleep 0.05
  done
  echo "error: redis-server did not start (see $dir/redis.log)" >&2
  return 1
}

stop_redis() {
  if [ -n "${REDIS_PID:-}" ]; then
    kill "$REDIS_PID" 2>/dev/null || true
    wait "$REDIS_PID" 2>/dev/null || true
    REDIS_PID=
  fi
}

# need_gnu_time: /usr/bin/time measures peak RSS; install it when missing.
need_gnu_time() {
  [ -x /usr/bin/time ] && return 0
  echo "installing GNU time (apt-get install -y time) to measure peak RSS" >&2
  apt-get install -y -qq time >/dev/null || { echo "error: /usr/bin/time missing: sudo apt-get install -y time" >&2; return 1; }
}

# bench_records N: the benchmark dataset of N records and its raw-baseline
# protocol file under .bench/enqueue (made once); sets BENCH_DATA and BENCH_PROTO.
bench_records() {
  local n=$1 dir=.bench/enqueue
  mkdir -p "$dir"
  BENCH_DATA="$dir/records-$n.jsonl"; BENCH_PROTO="$dir/baseline-$n.resp"
  if [ ! -f "$BENCH_DATA" ] || [ ! -f "$BENCH_PROTO" ]; then
    echo "generating $n records..."
    python3 scripts/gen_bench_data.py "$n" "$BENCH_DATA" "$BENCH_PROTO"
  fi
}

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

# redis_cpu: the CPU seconds (user + system) the redis-server of start_redis
# has used so far; a difference over a step, divided by its records, is
# Redis CPU per record.
redis_cpu() {
  redis-cli -p "$REDIS_PORT" info cpu | tr -d '\r' |
    awk -F: '/^used_cpu_(sys|user):/ { s += $2 } END { printf "%.6f\n", s }'
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

# start_postgres: a throwaway PostgreSQL (initdb into a temp dir, pg_ctl) on
# 127.0.0.1 and a free port, as the `postgres` user when run as root; sets
# PG_PORT, PG_DIR and PG_URL (role bf, password in PG_PASSWORD). Returns 1
# when PostgreSQL's server binaries are not installed. Stop it with stop_postgres.
start_postgres() {
  local bindir
  bindir=$(dirname "$(command -v initdb 2>/dev/null || ls /usr/lib/postgresql/*/bin/initdb 2>/dev/null | sort | tail -1)" 2>/dev/null) || return 1
  [ -x "$bindir/initdb" ] && [ -x "$bindir/pg_ctl" ] || return 1
  PG_BIN=$bindir
  PG_DIR=$(mktemp -d /tmp/batchfleet-demo-pg.XXXXXX)
  PG_PORT=$(free_port)
  PG_PASSWORD="demo-$(od -An -N6 -tx1 /dev/urandom | tr -d ' \n')"
  printf '%s' "$PG_PASSWORD" >"$PG_DIR/pw"
  local as=()
  if [ "$(id -u)" = 0 ]; then chown -R postgres "$PG_DIR"; as=(runuser -u postgres --); fi
  "${as[@]}" "$PG_BIN/initdb" -D "$PG_DIR/data" -U bf -A scram-sha-256 --pwfile "$PG_DIR/pw" >"$PG_DIR/initdb.log" 2>&1 || return 1
  "${as[@]}" "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/log" -w \
    -o "-p $PG_PORT -k $PG_DIR -c listen_addresses=127.0.0.1" start >/dev/null || return 1
  PG_URL="postgres://bf:$PG_PASSWORD@127.0.0.1:$PG_PORT/postgres?sslmode=disable"
}

stop_postgres() {
  if [ -n "${PG_DIR:-}" ]; then
    local pid
    pid=$(head -1 "$PG_DIR/data/postmaster.pid" 2>/dev/null || true)
    # Its own pid file names it: a fast shutdown of exactly that server.
    [ -n "$pid" ] && kill -INT "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
    rm -rf "$PG_DIR"
    PG_DIR=
  fi
}

#!/usr/bin/env bash
# `make demo`: enqueues the example dataset into a throwaway Redis (or the one
# REDIS_URL names) and prints the summary and the job manifest.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
bin=target/release
work=.demo
rm -rf "$work"; mkdir -p "$work"
if [ -n "${REDIS_URL:-}" ]; then
  echo "using Redis from REDIS_URL"
else
  start_redis "$work/redis"
  trap stop_redis EXIT
  export REDIS_URL="redis://127.0.0.1:$REDIS_PORT"
  echo "started a throwaway redis-server on 127.0.0.1:$REDIS_PORT (pid $REDIS_PID)"
fi
job=demo-$(date +%Y%m%d-%H%M%S)
echo
echo "== producer spec check examples/job.toml"
$bin/producer spec check examples/job.toml | head -1
echo
echo "== producer enqueue examples/dataset.jsonl --job $job --spec examples/job.toml"
$bin/producer enqueue examples/dataset.jsonl --job "$job" --spec examples/job.toml
echo
echo "== again: an idempotent rerun enqueues nothing new"
$bin/producer enqueue examples/dataset.jsonl --job "$job" --spec examples/job.toml --no-progress | sed -n '1p;5,7p'
echo
echo "== producer dropped --job $job"
$bin/producer dropped --job "$job"
echo
echo "== producer manifest --job $job"
$bin/producer manifest --job "$job"

#!/usr/bin/env python3
"""`make bench-queues`: the per-record path against the queue users would
pick instead (#32 item 4), on one redis-server in one run, alternating.

- batchfleet: N records enqueued (`--max-backlog 0`, no limits, no sink),
  then one worker (`--concurrency` CONCURRENCY, default 50) drains them
  against llm-sim at zero latency: HTTP, validation, the fenced commit, the
  ledger;
- BullMQ (BULLMQ_VERSION, default 6.7, with ioredis 5, installed with npm
  under .bench/bullmq on first use): the same N records added as jobs, then its
  worker with a processor that does nothing, same concurrency.

Each side's drain is timed from its worker's start to its last record
(polled every 50 ms on one connection) and costed from `INFO` deltas over
the same span: Redis CPU (user + system), commands (script-inner ones
included) and round trips (reads of a client's socket) per record; and
the CPU the side itself spent a record over the span (its worker from
`/proc`, its start included; for batchfleet llm-sim's too, which answers
its calls): on two cores what the clients use, Redis and the other side
do not get. The server is emptied (FLUSHALL) before each run; each side
first drains WARMUP_RECORDS (default 2,000) unmeasured, then ROUNDS
(default 2) rounds of the pair. Reported: those figures, and this
project's records/s and Redis CPU as ratios of BullMQ's in the same
round. Ends with one JSON line. 127.0.0.1 only; everything stopped.
"""
import json
import os
import shutil
import subprocess
import tempfile
import time

from benchlib import (BIN, ROOT, Poll, proc_cpu, redis_cli, redis_commands, redis_cpu, redis_reads, start_redis, start_sim,
                      write_records)

N = int(os.environ.get("N", "20000"))
# Each side drains this many records once, unmeasured, before the rounds:
# BullMQ's first drain on a fresh server was the slower in every run (node
# warming up), which made the first round's pair unfair.
WARMUP = int(os.environ.get("WARMUP_RECORDS", "2000"))
CONC = int(os.environ.get("CONCURRENCY", "50"))
ROUNDS = int(os.environ.get("ROUNDS", "2"))
BULLMQ = os.environ.get("BULLMQ_VERSION", "6.7")
NODE_DIR = os.path.join(ROOT, ".bench", "bullmq")


def install_bullmq():
    """BullMQ under .bench/bullmq (npm, once), and its no-op script beside it."""
    if not os.path.isdir(os.path.join(NODE_DIR, "node_modules", "ioredis")):
        os.makedirs(NODE_DIR, exist_ok=True)
        subprocess.run(["npm", "install", "--prefix", NODE_DIR, "--no-audit", "--no-fund", f"bullmq@{BULLMQ}",
                        "ioredis@5"], check=True, stdout=subprocess.DEVNULL)
    script = os.path.join(NODE_DIR, "noop.mjs")
    shutil.copy(os.path.join(ROOT, "scripts", "bullmq-noop.mjs"), script)
    return script


def spec(tmp):
    """The example spec without limits (the worker, not the fleet's limits)."""
    text = open(os.path.join(ROOT, "examples", "job.toml")).read()
    text = text[:text.index("[limits]")] + text[text.index("[retry]"):]
    path = os.path.join(tmp, "job.toml")
    open(path, "w").write(text)
    return path


def done(poll):
    return sum(poll.ints(*(f"HLEN bf:{{q:p{p}}}:results" for p in range(4))))


def measured(url, start, finished, helpers=()):
    """(seconds, Redis CPU s, commands, round trips, client CPU s) from
    `start()` until `finished()`: the client CPU is the started process's
    (its own start included) and that of the running `helpers` over the
    same span, read as the last record is seen."""
    helper_cpu = lambda: sum(proc_cpu(p.pid) for p in helpers)
    cpu0, cmd0, reads0, help0 = redis_cpu(url), redis_commands(url), redis_reads(url), helper_cpu()
    t0 = time.monotonic()
    proc = start()
    while not finished(proc):
        time.sleep(0.05)
    t1, client = time.monotonic(), proc_cpu(proc.pid) + helper_cpu() - help0
    cpu1, cmd1, reads1 = redis_cpu(url), redis_commands(url), redis_reads(url)
    # The INFO and poll requests of the measure itself are left out.
    return proc, (t1 - t0, cpu1 - cpu0, cmd1 - cmd0 - 3, reads1 - reads0 - 3, client)


def ours(tmp, url, sim, addr, data, job_spec, n=N):
    subprocess.run([os.path.join(BIN, "producer"), "enqueue", data, "--job", "q", "--spec", job_spec,
                    "--redis", url, "--no-progress", "--max-backlog", "0"], check=True, stdout=subprocess.DEVNULL)
    env = dict(os.environ, OPENAI_API_KEY="sk-bench", RUST_LOG="warn")
    log = open(os.path.join(tmp, "worker.log"), "a")
    start = lambda: subprocess.Popen([os.path.join(BIN, "worker"), "--redis", url, "--job", "q", "--drain",
                                      "--concurrency", str(CONC), "--base-url", addr + "/v1",
                                      "--metrics-addr", "127.0.0.1:0"], env=env, stdout=subprocess.DEVNULL, stderr=log)
    poll = Poll(url)
    try:
        proc, cost = measured(url, start, lambda p: done(poll) >= n or p.poll() is not None, helpers=(sim,))
        assert done(poll) >= n, f"the worker stopped before the end, see {log.name}"
    finally:
        poll.close()
    proc.wait()
    return cost


def bullmq(url, data, script, n=N):
    port = url.rsplit(":", 1)[1]
    subprocess.run(["node", script, "add", port, str(n), data], check=True, cwd=NODE_DIR)
    start = lambda: subprocess.Popen(["node", script, "work", port, str(n), str(CONC)], cwd=NODE_DIR,
                                     stdout=subprocess.PIPE, text=True)
    proc, cost = measured(url, start, lambda p: p.stdout.readline().strip() == "done" or p.poll() is not None)
    assert proc.wait() == 0, "the BullMQ worker failed"
    return cost


def main():
    script = install_bullmq()
    tmp = tempfile.mkdtemp(prefix="bf-bench-queues-")
    redis, url = start_redis(tmp)
    sim, addr = start_sim("--seed", "3")
    rows = []
    try:
        data = os.path.join(tmp, "data.jsonl")
        write_records(data, N, "q-")
        job_spec = spec(tmp)
        if WARMUP:
            warm = os.path.join(tmp, "warm.jsonl")
            write_records(warm, WARMUP, "w-")
            for run in (lambda: ours(tmp, url, sim, addr, warm, job_spec, WARMUP),
                        lambda: bullmq(url, warm, script, WARMUP)):
                redis_cli(url, "flushall")
                run()
        for r in range(ROUNDS):
            for name, run in (("batchfleet", lambda: ours(tmp, url, sim, addr, data, job_spec)),
                              ("bullmq", lambda: bullmq(url, data, script))):
                redis_cli(url, "flushall")
                secs, cpu, cmds, trips, client = run()
                rows.append((r, name, N / secs, cpu / N * 1e6, cmds / N, trips / N, client / N * 1e6))
                print(f"  round {r + 1}, {name}: {N / secs:,.0f} records/s, {cpu / N * 1e6:.1f} us of Redis CPU, "
                      f"{cmds / N:.1f} commands and {trips / N:.2f} round trips a record; "
                      f"{client / N * 1e6:.0f} us of client CPU a record", flush=True)
    finally:
        for p in (sim, redis):
            p.terminate()
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print("| round | queue | records/s | Redis CPU a record | Redis commands a record | round trips a record "
          "| client CPU a record |")
    print("|---|---|---|---|---|---|---|")
    for r, name, rate, us, cmds, trips, client in rows:
        print(f"| {r + 1} | {name} | {rate:,.0f} | {us:.1f} us | {cmds:.1f} | {trips:.2f} | {client:.0f} us |")
    ratios = []
    for r in range(ROUNDS):
        (_, _, rate_a, us_a, *_), (_, _, rate_b, us_b, *_) = [x for x in rows if x[0] == r]
        ratios.append((rate_a / rate_b, us_a / us_b))
    print()
    for r, (rate, cpu) in enumerate(ratios):
        print(f"round {r + 1}: batchfleet {rate:.2f}x BullMQ's records/s, {cpu:.2f}x its Redis CPU a record")
    print("goal (>= 1.0x the records/s, <= 0.4x the Redis CPU a record):",
          "met" if all(rate >= 1.0 and cpu <= 0.4 for rate, cpu in ratios) else "NOT met")
    print(json.dumps({"records": N, "concurrency": CONC, "bullmq": BULLMQ,
                      "rec_s_ratio": [round(a, 2) for a, _ in ratios],
                      "redis_cpu_ratio": [round(b, 2) for _, b in ratios]}))


if __name__ == "__main__":
    main()

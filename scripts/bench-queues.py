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

- floor (not a queue): the same records enqueued by the producer, then
  taken and stored as batchfleet's path stores them, by a client that sends
  Redis's own commands and no script: claim rounds of 16 (`XREADGROUP`,
  the states' `HMGET`), then for every 10 records one `MULTI` of what
  `finish.lua` reads and writes (the ledger's `HMGET` and `HSET` of the
  paid calls, the fence's `XPENDING`, the states' and results' `HMGET`,
  the results' and states' `HSET`, `XACK`, `XDEL`, the spend and stats
  counters' `HMGET` and `HSET`), with a result, a paid call and counter
  fields taken from batchfleet's own drain. It checks nothing: what the
  data this design keeps costs Redis with no Lua at all, the least any
  script for it could cost. Its records/s are those of this Python client
  calling no model, not a queue's.

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
import socket
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


class Resp:
    """A bare RESP client: commands sent together, their replies read back."""

    def __init__(self, url):
        host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.replies = self.sock.makefile("rb")

    def send(self, *commands):
        out = bytearray()
        for c in commands:
            out += b"*%d\r\n" % len(c)
            for a in c:
                a = a if isinstance(a, bytes) else str(a).encode()
                out += b"$%d\r\n%s\r\n" % (len(a), a)
        self.sock.sendall(out)
        return [self.reply() for _ in commands]

    def reply(self):
        line = self.replies.readline()
        kind, rest = line[:1], line[1:-2]
        if kind == b"-":
            raise RuntimeError(rest.decode())
        if kind == b"+":
            return rest.decode()
        if kind == b":":
            return int(rest)
        n = int(rest)
        if n < 0:
            return None
        if kind == b"$":
            return self.replies.read(n + 2)[:-2].decode()
        return [self.reply() for _ in range(n)]

    def close(self):
        self.replies.close()
        self.sock.close()


def sample(url):
    """What batchfleet's drain stored, for the floor to store alike: a
    result, a paid call, and the spend and stats counters' fields."""
    r = Resp(url)
    try:
        _, result = r.send(["HRANDFIELD", "bf:{q:p0}:results", 1, "WITHVALUES"])[0]
        _, paid = r.send(["HRANDFIELD", "bf:{q:p0}:paid", 1, "WITHVALUES"])[0]
        spend, stats = r.send(["HKEYS", "bf:{q:p0}:spend"], ["HKEYS", "bf:{q:p0}:stats"])
    finally:
        r.close()
    return result, paid, spend, stats


def floor_drain(url, payload, n):
    """Takes and stores the n records batchfleet's producer enqueued (see
    the module's doc); returns how many it stored."""
    result, paid, spend, stats = payload
    r = Resp(url)
    group = r.send(["XINFO", "GROUPS", "bf:{q:p0}:tasks"])[0][0][1]
    pairs = lambda fields, value: [x for f in fields for x in (f, value)]
    stored = 0
    try:
        while stored < n:
            before = stored
            for p in range(4):
                key = lambda name: f"bf:{{q:p{p}}}:{name}"
                got = r.send(["XREADGROUP", "GROUP", group, "floor", "COUNT", 16, "STREAMS", key("tasks"), ">"])[0]
                entries = got[0][1] if got else []
                if not entries:
                    continue
                ids, rids = [e[0] for e in entries], [e[1][1] for e in entries]
                r.send(["HMGET", key("state"), *rids])
                for a in range(0, len(ids), 10):
                    some, rs = ids[a:a + 10], rids[a:a + 10]
                    calls = [f"{rid}:1:floor" for rid in rs]
                    r.send(["MULTI"], ["HMGET", key("paid"), *calls], ["HSET", key("paid"), *pairs(calls, paid)],
                           ["XPENDING", key("tasks"), group, some[0], some[-1], 2 * len(some) + 64, "floor"],
                           ["HMGET", key("state"), *rs], ["HMGET", key("results"), *rs],
                           ["HSET", key("results"), *pairs(rs, result)], ["HSET", key("state"), *pairs(rs, "done")],
                           ["XACK", key("tasks"), group, *some], ["XDEL", key("tasks"), *some],
                           ["HMGET", key("spend"), *spend], ["HSET", key("spend"), *pairs(spend, 1)],
                           ["HMGET", key("stats"), *stats], ["HSET", key("stats"), *pairs(stats, 1)], ["EXEC"])
                stored += len(ids)
            if stored == before:
                break
    finally:
        r.close()
    return stored


def floor(url, data, job_spec, payload, n=N):
    subprocess.run([os.path.join(BIN, "producer"), "enqueue", data, "--job", "q", "--spec", job_spec,
                    "--redis", url, "--no-progress", "--max-backlog", "0"], check=True, stdout=subprocess.DEVNULL)
    stored = []

    class Done:
        """The floor's client runs in this process: `measured` waits on it."""
        pid = os.getpid()

        def poll(self):
            return 0

    def start():
        stored.append(floor_drain(url, payload, n))
        return Done()

    _, (secs, cpu, cmds, trips, _) = measured(url, start, lambda p: True)
    assert stored == [n], f"the floor stored {stored} of {n}"
    return secs, cpu, cmds, trips, 0.0


def main():
    script = install_bullmq()
    tmp = tempfile.mkdtemp(prefix="bf-bench-queues-")
    redis, url = start_redis(tmp)
    sim, addr = start_sim("--seed", "3")
    rows, payload = [], []
    try:
        data = os.path.join(tmp, "data.jsonl")
        write_records(data, N, "q-")
        job_spec = spec(tmp)

        def batchfleet(records, n):
            cost = ours(tmp, url, sim, addr, records, job_spec, n)
            if not payload:
                payload.append(sample(url))
            return cost

        if WARMUP:
            warm = os.path.join(tmp, "warm.jsonl")
            write_records(warm, WARMUP, "w-")
            for run in (lambda: batchfleet(warm, WARMUP), lambda: bullmq(url, warm, script, WARMUP)):
                redis_cli(url, "flushall")
                run()
        for r in range(ROUNDS):
            for name, run in (("batchfleet", lambda: batchfleet(data, N)),
                              ("floor", lambda: floor(url, data, job_spec, payload[0])),
                              ("bullmq", lambda: bullmq(url, data, script))):
                redis_cli(url, "flushall")
                secs, cpu, cmds, trips, client = run()
                rows.append((r, name, N / secs, cpu / N * 1e6, cmds / N, trips / N, client / N * 1e6))
                own = f"; {client / N * 1e6:.0f} us of client CPU a record" if name != "floor" else ""
                print(f"  round {r + 1}, {name}: {N / secs:,.0f} records/s, {cpu / N * 1e6:.1f} us of Redis CPU, "
                      f"{cmds / N:.1f} commands and {trips / N:.2f} round trips a record{own}", flush=True)
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
        cpu = f"{client:.0f} us" if name != "floor" else "-"
        print(f"| {r + 1} | {name} | {rate:,.0f} | {us:.1f} us | {cmds:.1f} | {trips:.2f} | {cpu} |")
    ratios = []
    for r in range(ROUNDS):
        side = {name: (rate, us) for (k, name, rate, us, *_) in rows if k == r}
        (rate_a, us_a), (_, us_f), (rate_b, us_b) = side["batchfleet"], side["floor"], side["bullmq"]
        ratios.append((rate_a / rate_b, us_a / us_b, us_f / us_b))
    print()
    for r, (rate, cpu, floor_cpu) in enumerate(ratios):
        print(f"round {r + 1}: batchfleet {rate:.2f}x BullMQ's records/s, {cpu:.2f}x its Redis CPU a record; "
              f"the floor (this design's data, native commands, no script) {floor_cpu:.2f}x")
    print("goal (>= 1.0x the records/s, <= 0.4x the Redis CPU a record):",
          "met" if all(rate >= 1.0 and cpu <= 0.4 for rate, cpu, _ in ratios) else "NOT met")
    print(json.dumps({"records": N, "concurrency": CONC, "bullmq": BULLMQ,
                      "rec_s_ratio": [round(a, 2) for a, _, _ in ratios],
                      "redis_cpu_ratio": [round(b, 2) for _, b, _ in ratios],
                      "floor_redis_cpu_ratio": [round(c, 2) for _, _, c in ratios]}))


if __name__ == "__main__":
    main()

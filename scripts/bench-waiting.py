#!/usr/bin/env python3
"""`make bench-waiting`: what a fleet costs Redis while it has nothing to do
and while its job waits out a provider outage (#32 item 6: "idle is free").

WORKERS workers (default 2; release build) finish 5 records against llm-sim, then:
- idle: the job done, nothing to do;
- outage, young: 40 more records enqueued, llm-sim answering 503 to every
  call; measured once the fleet took the provider for down (probes 1 s apart,
  doubling to 5 s);
- outage, long: the same outage as if it had begun an hour ago (its start in
  Redis moved back: probes every 30 s).
Each phase: Redis commands (those scripts run inside included) over WINDOW
seconds (default 60: the idle fleet's rounds of a minute, the idle poll's
included; idle over IDLE_WINDOW, default 60) from `INFO` deltas, per
worker per second, and the probes llm-sim saw. Ends with one JSON line. 127.0.0.1 only; all stopped.
"""
import json
import os
import subprocess
import tempfile
import time
import urllib.request

from benchlib import (BIN, ROOT, redis_cli, redis_commands, sim_stats, start_redis, start_sim, stop_all,
                      write_records)

WINDOW = float(os.environ.get("WINDOW", "60"))
IDLE_WINDOW = float(os.environ.get("IDLE_WINDOW", "60"))
WORKERS = int(os.environ.get("WORKERS", "2"))


def admin_fail(addr, spec):
    req = urllib.request.Request(addr + "/admin/fail", data=json.dumps({"fail": spec}).encode(),
                                 headers={"content-type": "application/json"}, method="POST")
    urllib.request.urlopen(req).read()


def enqueue(url, data, spec, *more):
    subprocess.run([os.path.join(BIN, "producer"), "enqueue", data, "--job", "wait", "--spec", spec,
                    "--redis", url, "--no-progress", *more], check=True, stdout=subprocess.DEVNULL)


def outage_field(url, field):
    return redis_cli(url, "hget", "bf:{wait}:outage", field).strip()


def measure(url, addr, what, window=WINDOW):
    """Commands per worker per second and calls llm-sim saw, over `window` s."""
    calls = lambda: sum(sim_stats(addr)["by_status"].values())
    c0, s0, t0 = redis_commands(url), calls(), time.monotonic()
    time.sleep(window)
    # Less the INFO calls of this measure (2) and the stats reads (none reach Redis).
    c1, s1, t1 = redis_commands(url) - 1, calls(), time.monotonic()
    rate = (c1 - c0) / (t1 - t0) / WORKERS
    print(f"  {what}: {rate:.2f} Redis commands a second per worker, {s1 - s0} provider calls in {window:.0f} s",
          flush=True)
    return rate, s1 - s0


def main():
    with tempfile.TemporaryDirectory(prefix="bench-waiting-") as tmp:
        redis, url = start_redis(tmp)
        sim, addr = start_sim("--latency-ms", "20")
        workers = []
        try:
            spec = os.path.join(tmp, "job.toml")
            open(spec, "w").write(open(os.path.join(ROOT, "examples", "job.toml")).read())
            first, more = os.path.join(tmp, "a.jsonl"), os.path.join(tmp, "b.jsonl")
            write_records(first, 5, "w-a-")
            write_records(more, 40, "w-b-")
            enqueue(url, first, spec)
            env = dict(os.environ, OPENAI_API_KEY="sk-bench-not-a-real-key", RUST_LOG="warn")
            for i in range(WORKERS):
                workers.append(subprocess.Popen(
                    [os.path.join(BIN, "worker"), "--redis", url, "--job", "wait", "--base-url", addr + "/v1",
                     "--consumer", f"w{i}", "--metrics-addr", "127.0.0.1:0"],
                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            deadline = time.monotonic() + 60
            while sum(int(redis_cli(url, "hlen", f"bf:{{wait:p{p}}}:results") or 0) for p in range(4)) < 5:
                assert time.monotonic() < deadline, "the first records were not done"
                time.sleep(0.2)
            time.sleep(10)  # the job's last writes (sink, ledger) done: idle as it stays
            idle = measure(url, addr, "idle", IDLE_WINDOW)
            admin_fail(addr, "503:overloaded:the engine is overloaded")
            enqueue(url, more, spec, "--restart")
            deadline = time.monotonic() + 60
            while outage_field(url, "down") != "1":
                assert time.monotonic() < deadline, "the provider was not taken for down"
                time.sleep(0.2)
            time.sleep(8)  # the probes reach their young spacing (1, 2, 4, 5 s)
            young = measure(url, addr, "outage, young")
            down_ms = int(outage_field(url, "down_ms"))
            redis_cli(url, "hset", "bf:{wait}:outage", "down_ms", str(down_ms - 3_600_000))
            time.sleep(35)  # the next failed probe sets the long spacing
            long = measure(url, addr, "outage, an hour old")
        finally:
            stop_all(workers, sim, redis)
    print(json.dumps({"workers": WORKERS, "window_s": WINDOW, "idle_window_s": IDLE_WINDOW,
                      "idle_cmds_per_worker_s": round(idle[0], 2),
                      "outage_young_cmds_per_worker_s": round(young[0], 2), "outage_young_calls": young[1],
                      "outage_long_cmds_per_worker_s": round(long[0], 2), "outage_long_calls": long[1]}))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""`make bench-ratelimit`: how much of a provider's limit the fleet uses, and
how many 429s it causes, for 1, 4 and 8 workers of concurrency 64 and for a
tokens/min-bound job (the spec states the limit); then for 1, 4 and 8 workers
whose spec states no limit at all (llm-sim tells it in OpenAI's headers), and
for 2 workers against the other ways llm-sim can tell it (`--limit-headers
litellm`, `none`), measured after WARMUP seconds of learning (default 60).
RUNS=told or RUNS=untold runs only those.

llm-sim enforces the limits itself and is the judge: utilization is what it
accepted over the window against its limit, the 429 rate is its 429s over all
requests. Each run lasts SECONDS (default 40). Release build, 127.0.0.1 only.

What the throttled fleet costs Redis, per model call in the window (`INFO`
deltas): CPU, commands (those scripts run inside included), round trips
(the times Redis read a client's socket: on these machines each costs it
more than a small command), and two floors measured beside the run over
the same window, not subtracted from it: a redis-server with no client at
all (its `serverCron`), and one answering a `PING` a model call, one at a
time at the limit's pace (a fleet that spent one round trip a call). Then,
over SCRIPT_SECONDS more (default 10), the command time of the limiter's
two scripts, `limit_acquire.lua` and `limit_settle.lua` (SLOWLOG, which
then keeps every command: it costs Redis CPU of its own, so it is not on
while the CPU is measured).
"""
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time

from benchlib import (BIN, ROOT, Poll, log_every_command, redis_commands, redis_cpu, redis_reads, script_times,
                      sim_stats, start_redis, start_sim, stop_all)

SECONDS = int(os.environ.get("SECONDS_PER_RUN", "40"))
WARMUP = int(os.environ.get("WARMUP_SECONDS", "60"))
SCRIPT_SECONDS = int(os.environ.get("SCRIPT_SECONDS", "10"))
RPM = int(os.environ.get("RPM", "1200"))


def ping_every(url, every, stop):
    """One PING every `every` seconds, each answered before the next, until stop is set."""
    poll, due = Poll(url), time.monotonic()
    try:
        while not stop.is_set():
            poll.sock.sendall(b"PING\r\n")
            assert poll.replies.readline() == b"+PONG\r\n"
            due += every
            stop.wait(max(0.0, due - time.monotonic()))
    finally:
        poll.close()


def run(tmp, workers, tpm, headers=None):
    """`headers`: None = the spec states the limit; else no `[limits]` at all
    and llm-sim's `--limit-headers` mode, measured after WARMUP seconds."""
    redis, url = start_redis(tmp)
    idle, idle_url = start_redis(tmp)
    pinged, pinged_url = start_redis(tmp)
    sim, addr = start_sim("--latency-ms", "50", "--rpm", str(RPM), *(["--tpm", str(tpm)] if tpm else []),
                          "--limit-headers", headers or "openai")
    procs = []
    try:
        spec = open(os.path.join(ROOT, "examples", "job.toml")).read()
        spec = spec.replace("requests_per_minute = 10000", "" if headers else f"requests_per_minute = {RPM}")
        spec = spec.replace("input_tokens_per_minute = 2000000", f"tokens_per_minute = {tpm}" if tpm else "")
        spec = spec.replace("output_tokens_per_minute = 500000", "").replace("max_concurrent = 64", "")
        spec_path = os.path.join(tmp, f"spec-{workers}-{tpm}-{headers}.toml")
        open(spec_path, "w").write(spec)
        data = os.path.join(tmp, "data.jsonl")
        if not os.path.exists(data):
            with open(data, "w") as f:
                for i in range(RPM * (SECONDS + WARMUP) // 60 * 2):
                    f.write(json.dumps({"message_id": f"m{i}", "channel": "chat", "task_type": "classify",
                                        "text": f"message number {i}: where is my order?"}) + "\n")
        subprocess.run([os.path.join(BIN, "producer"), "enqueue", data, "--job", "rl", "--spec", spec_path,
                        "--redis", url, "--no-progress"], check=True, stdout=subprocess.DEVNULL)
        env = dict(os.environ, OPENAI_API_KEY="sk-bench", RUST_LOG="warn")
        for _ in range(workers):
            procs.append(subprocess.Popen([os.path.join(BIN, "worker"), "--redis", url, "--job", "rl",
                                           "--base-url", addr + "/v1", "--concurrency", "64",
                                           "--metrics-addr", "127.0.0.1:0"],
                                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        if headers:
            time.sleep(WARMUP)
        stop = threading.Event()
        pinger = threading.Thread(target=ping_every, args=(pinged_url, 60 / RPM, stop))
        pinger.start()
        time.sleep(1)
        a, t0, cpu0, cmd0, reads0 = sim_stats(addr), time.time(), redis_cpu(url), redis_commands(url), redis_reads(url)
        idle0, pinged0 = redis_cpu(idle_url), redis_cpu(pinged_url)
        time.sleep(SECONDS)
        b, t1, cpu1, cmd1, reads1 = sim_stats(addr), time.time(), redis_cpu(url), redis_commands(url), redis_reads(url)
        idle1, pinged1 = redis_cpu(idle_url), redis_cpu(pinged_url)
        stop.set()
        pinger.join()
        log_every_command(url)
        time.sleep(SCRIPT_SECONDS)
        c = sim_stats(addr)
        scripts = script_times(url)
    finally:
        stop_all(procs, sim, redis, idle, pinged)
    minutes = (t1 - t0) / 60
    ok = b["by_status"].get("200", 0) - a["by_status"].get("200", 0)
    r429 = b["by_status"].get("429", 0) - a["by_status"].get("429", 0)
    tokens = (b["prompt_tokens"] + b["completion_tokens"]) - (a["prompt_tokens"] + a["completion_tokens"])
    util = tokens / (tpm * minutes) if tpm else ok / (RPM * minutes)
    calls = max(1, ok + r429)
    script_calls = max(1, sum(c["by_status"].get(s, 0) - b["by_status"].get(s, 0) for s in ("200", "429")))
    acquire, settle = scripts.get("limit_acquire.lua", (0, 0, 0)), scripts.get("limit_settle.lua", (0, 0, 0))
    cost = {"cpu_us": (cpu1 - cpu0) * 1e6 / calls, "idle_us": (idle1 - idle0) * 1e6 / calls,
            "pinged_us": (pinged1 - pinged0) * 1e6 / calls, "commands": (cmd1 - cmd0) / calls,
            "reads": (reads1 - reads0) / calls,
            "acquire": (acquire[0] / script_calls, acquire[1] / script_calls, acquire[2]),
            "settle": (settle[0] / script_calls, settle[1] / script_calls, settle[2])}
    return ok, r429, util, r429 / calls, cost


def main():
    tmp = tempfile.mkdtemp(prefix="bf-bench-rl-")
    rows, costs = [], []
    try:
        runs = [(1, 0, None), (4, 0, None), (8, 0, None), (3, RPM * 200 // 3, None),
                (1, 0, "openai"), (4, 0, "openai"), (8, 0, "openai"), (2, 0, "litellm"), (2, 0, "none")]
        only = os.environ.get("RUNS")
        for workers, tpm, headers in runs:
            if only and (only == "told") != (headers is None):
                continue
            ok, r429, util, rate, cost = run(tmp, workers, tpm, headers)
            bound = f"{tpm:,} tokens/min" if tpm else f"{RPM:,} requests/min"
            if headers:
                bound += f", not in the spec (--limit-headers {headers})"
            rows.append((workers, bound, ok, r429, util, rate))
            costs.append((workers, bound, cost))
            print(f"  {workers} worker(s), {bound}: {util:.3f} utilization, {rate:.4f} 429 rate", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(f"| workers | binding limit | accepted in {SECONDS} s | 429s | utilization | 429 rate |")
    print("|---|---|---|---|---|---|")
    for workers, bound, ok, r429, util, rate in rows:
        print(f"| {workers} | {bound} | {ok:,} | {r429} | {util:.1%} | {rate:.2%} |")
    print()
    print("| workers | binding limit | Redis CPU per model call | floor: an idle redis-server "
          "| floor: one PING a model call | Redis commands per model call | round trips per model call "
          "| `limit_acquire.lua` per model call | `limit_settle.lua` per model call "
          "| limiter per model call at the scripts' median times |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for workers, bound, c in costs:
        (an, at, am), (sn, st, sm) = c["acquire"], c["settle"]
        print(f"| {workers} | {bound} | {c['cpu_us']:.0f} us | {c['idle_us']:.0f} us | {c['pinged_us']:.0f} us "
              f"| {c['commands']:.1f} | {c['reads']:.2f} "
              f"| {an:.2f} calls, {at:.1f} us (median {am} us a call) "
              f"| {sn:.2f} calls, {st:.1f} us (median {sm} us a call) | {an * am + sn * sm:.0f} us |")
    # The limiter's own cost (its two scripts' calls and command time) must
    # not grow with the fleet: 1 and 8 workers of the same binding limit.
    limiter = {(w, b): (c["acquire"][0] + c["settle"][0], c["acquire"][1] + c["settle"][1]) for w, b, c in costs}
    total = {(w, b): c["cpu_us"] for w, b, c in costs}
    print()
    for bound in dict.fromkeys(b for _, b in limiter):
        ws = sorted(w for w, b in limiter if b == bound)
        if len(ws) < 2:
            continue
        lo, hi = (ws[0], bound), (ws[-1], bound)
        print(f"{bound}: limiter per model call {limiter[lo][0]:.2f} -> {limiter[hi][0]:.2f} script calls, "
              f"{limiter[lo][1]:.0f} -> {limiter[hi][1]:.0f} us ({ws[0]} -> {ws[-1]} workers); "
              f"Redis CPU per call {total[hi] / max(total[lo], 1e-9):.2f}x")
    told = [r for r in rows if "not in the spec" not in r[1]]
    learned = [r for r in rows if "not in the spec" in r[1]]
    print()
    print("goal with the limit in the spec (>= 95% utilization, <= 0.5% 429s):",
          "met" if all(u >= 0.95 and r <= 0.005 for *_, u, r in told) else "NOT met")
    print("goal without it, after the first minute (<= 2% 429s):",
          "met" if all(r <= 0.02 for *_, u, r in learned) else "NOT met")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""`make bench-worker`: worker throughput and memory, with a baseline of the same run.

1. llm-sim at zero latency. Baseline: `sim-load` sends the same number of chat
   requests at the same concurrency with the same HTTP client (no Redis, no
   validation). Then one worker drains N enqueued tasks. Reported: records/s of
   the worker, requests/s of the baseline, their ratio, the worker's peak RSS.
   Beside it, Redis CPU per record (`INFO cpu` deltas over the drain: claim,
   commit, rate-limit grants and their settlement included) and the worker's
   own CPU per record (its rusage); llm-sim's CPU per request in both runs,
   and sim-load's, tell how the 2 cores were shared.
2. llm-sim at 1 s mean latency, one worker with --concurrency 1000: how many
   requests it keeps in flight (llm-sim counts them) and its RSS at that point.
3. Idle: one worker with the default idle poll and nothing to do; the Redis
   commands it costs per second (`total_commands_processed`, script-inner
   ones included), then how long a task enqueued to it takes to be done.

Everything binds to 127.0.0.1 and is stopped at the end. Release build.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from benchlib import BIN, ROOT, proc_cpu, redis_commands, redis_cpu, sim_stats, start_redis, start_sim

N = int(os.environ.get("N", "100000"))
CONC = int(os.environ.get("CONCURRENCY", "64"))
N_SLOW = int(os.environ.get("N_SLOW", "6000"))
IDLE_SECS = float(os.environ.get("IDLE_SECS", "60"))


def done_records(url, job, partitions=4):
    port = url.rsplit(":", 1)[1]
    return sum(int(subprocess.run(["redis-cli", "-p", port, "hlen", f"bf:{{{job}:p{p}}}:results"],
                                  capture_output=True, text=True).stdout.strip() or 0) for p in range(partitions))


def rss_kb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def write_dataset(path, n, prefix):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"message_id": f"{prefix}-{i}", "channel": "email", "task_type": "classify",
                                "text": f"message {i}: my order A{i:06d} has not arrived"}) + "\n")


def unlimited_spec(tmp):
    """The example spec without its [limits] section: this benchmark measures
    the worker, not the fleet's rate limits (bench-ratelimit does)."""
    spec = open(os.path.join(ROOT, "examples", "job.toml")).read()
    start = spec.index("[limits]")
    end = spec.index("[retry]")
    path = os.path.join(tmp, "job-unlimited.toml")
    open(path, "w").write(spec[:start] + spec[end:])
    return path


def enqueue(redis_url, path, job, spec):
    subprocess.run([os.path.join(BIN, "producer"), "enqueue", path, "--job", job, "--spec", spec,
                    "--redis", redis_url, "--no-progress", "--max-backlog", "0"], check=True, stdout=subprocess.DEVNULL)


def worker(redis_url, job, base_url, concurrency, log, drain=True):
    env = dict(os.environ, OPENAI_API_KEY="sk-bench", RUST_LOG="warn")
    return subprocess.Popen([os.path.join(BIN, "worker"), "--redis", redis_url, "--job", job,
                             "--concurrency", str(concurrency), "--base-url", base_url,
                             "--metrics-addr", "127.0.0.1:0"] + (["--drain"] if drain else []),
                            env=env, stdout=subprocess.DEVNULL, stderr=log)


def main():
    tmp = tempfile.mkdtemp(prefix="bf-bench-worker-")
    redis, url = start_redis(tmp)
    procs = [redis]
    try:
        # 1a. Baseline: raw requests against a zero-latency simulator.
        sim, addr = start_sim("--seed", "3")
        procs.append(sim)
        sim0 = proc_cpu(sim.pid)
        load = subprocess.Popen([os.path.join(BIN, "sim-load"), addr + "/v1", str(N), str(CONC)],
                                stdout=subprocess.PIPE, text=True)
        out = load.stdout.read()
        _, status, usage = os.wait4(load.pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "sim-load failed"
        base = json.loads(out)
        base_sim_us = (proc_cpu(sim.pid) - sim0) / N * 1e6
        base_load_us = (usage.ru_utime + usage.ru_stime) / N * 1e6
        sim.terminate(); sim.wait()
        # 1b. One worker draining N tasks against a fresh zero-latency simulator.
        sim, addr = start_sim("--seed", "3")
        procs.append(sim)
        data = os.path.join(tmp, "fast.jsonl")
        write_dataset(data, N, "fast")
        enqueue(url, data, "bench-fast", unlimited_spec(tmp))
        log = open(os.path.join(tmp, "worker-fast.log"), "w")
        cpu0, sim0 = redis_cpu(url), proc_cpu(sim.pid)
        t0 = time.time()
        w = worker(url, "bench-fast", addr + "/v1", CONC, log)
        peak = 0
        while True:
            # Reaped here, for its rusage: the worker's own CPU.
            pid, status, usage = os.wait4(w.pid, os.WNOHANG)
            if pid:
                w.returncode = os.waitstatus_to_exitcode(status)
                break
            peak = max(peak, rss_kb(w.pid))
            time.sleep(0.1)
        wall = time.time() - t0
        redis_us = (redis_cpu(url) - cpu0) / N * 1e6
        worker_us = (usage.ru_utime + usage.ru_stime) / N * 1e6
        sim_us = (proc_cpu(sim.pid) - sim0) / N * 1e6
        assert w.returncode == 0, f"worker failed, see {log.name}"
        fast = N / wall
        served = sim_stats(addr)["requests"]
        sim.terminate(); sim.wait()
        # 2. 1 s mean latency, 1000 in flight.
        sim, addr = start_sim("--latency-ms", "1000", "--seed", "3")
        procs.append(sim)
        data = os.path.join(tmp, "slow.jsonl")
        write_dataset(data, N_SLOW, "slow")
        enqueue(url, data, "bench-slow", unlimited_spec(tmp))
        log2 = open(os.path.join(tmp, "worker-slow.log"), "w")
        w = worker(url, "bench-slow", addr + "/v1", 1000, log2)
        max_in_flight, rss_at_max, peak_slow = 0, 0, 0
        while w.poll() is None:
            s = sim_stats(addr)
            r = rss_kb(w.pid)
            peak_slow = max(peak_slow, r)
            if s["in_flight"] >= max_in_flight:
                max_in_flight, rss_at_max = s["in_flight"], r
            time.sleep(0.1)
        assert w.returncode == 0, f"worker failed, see {log2.name}"
        sim.terminate(); sim.wait()
        # 3. Idle, then new work for the idle worker.
        sim, addr = start_sim("--seed", "3")
        procs.append(sim)
        data = os.path.join(tmp, "idle-0.jsonl")
        write_dataset(data, 1, "idle-0")
        enqueue(url, data, "bench-idle", unlimited_spec(tmp))
        log3 = open(os.path.join(tmp, "worker-idle.log"), "w")
        w = worker(url, "bench-idle", addr + "/v1", 8, log3, drain=False)
        procs.append(w)
        while done_records(url, "bench-idle") < 1:
            time.sleep(0.05)
        time.sleep(2)
        c0, t0 = redis_commands(url), time.time()
        time.sleep(IDLE_SECS)
        idle_rate = (redis_commands(url) - c0 - 1) / (time.time() - t0)
        latencies = []
        for k in range(1, 6):
            data = os.path.join(tmp, f"idle-{k}.jsonl")
            write_dataset(data, 1, f"idle-{k}")
            subprocess.run([os.path.join(BIN, "producer"), "enqueue", data, "--job", "bench-idle", "--spec",
                            unlimited_spec(tmp), "--redis", url, "--no-progress", "--restart"],
                           check=True, stdout=subprocess.DEVNULL)
            t0 = time.time()
            while done_records(url, "bench-idle") < k + 1:
                time.sleep(0.002)
            latencies.append((time.time() - t0) * 1000)
            time.sleep(1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait()
        shutil.rmtree(tmp, ignore_errors=True)

    print()
    print("| run | baseline (sim-load, same concurrency) | worker | ratio | Redis CPU per record | worker CPU per record "
          "| worker peak RSS |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {N:,} tasks, 0 ms latency, concurrency {CONC} | {base['per_sec']:,.0f} req/s | {fast:,.0f} records/s "
          f"({served:,} requests) | {fast / base['per_sec']:.2f} | {redis_us:.1f} us | {worker_us:.1f} us "
          f"| {peak / 1024:.1f} MiB |")
    print()
    print(f"CPU per request: the baseline's sim-load {base_load_us:.1f} us + llm-sim {base_sim_us:.1f} us; "
          f"the worker's run: worker {worker_us:.1f} us + Redis {redis_us:.1f} us + llm-sim {sim_us:.1f} us "
          f"(all on the same {os.cpu_count()} cores)")
    print()
    print("| run | most requests in flight (llm-sim) | worker RSS then | worker peak RSS |")
    print("|---|---|---|---|")
    print(f"| {N_SLOW:,} tasks, 1 s mean latency, concurrency 1000 | {max_in_flight} | {rss_at_max / 1024:.1f} MiB "
          f"| {peak_slow / 1024:.1f} MiB |")
    print()
    print("| idle worker: Redis commands/s (script-inner included) | a task enqueued to it, done after (ms, 5 tries) |")
    print("|---|---|")
    print(f"| {idle_rate:.2f} over {IDLE_SECS:.0f} s | {' / '.join(f'{x:.0f}' for x in latencies)} |")
    ok = peak_slow < 100 * 1024 and max_in_flight >= 900
    print()
    print("target (>= 900 in flight, RSS < 100 MiB at 1,000 in flight):", "met" if ok else "NOT met")
    ok = fast / base["per_sec"] >= 0.7 and redis_us <= 12
    print("#15 hot-path targets (>= 0.70 of sim-load, <= 12 us of Redis CPU per record):", "met" if ok else "NOT met")
    ok = idle_rate <= 2 and max(latencies) <= 100
    print("#15 idle targets (<= 2 Redis commands/s idle, a new task done within 100 ms):", "met" if ok else "NOT met")


if __name__ == "__main__":
    sys.exit(main())

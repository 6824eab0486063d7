#!/usr/bin/env python3
"""`make bench-scale`: one job of N records (default 1,000,000; `N=10000000`
for the 10M run), end to end on one machine: `producer enqueue` (with its
default `--max-backlog`) while two workers drain it against llm-sim at zero
latency into a files sink, then `producer status --require-complete` (the
full reconciliation, and the sink checked against the done set).

Measured: Redis `used_memory` at its peak (sampled every 0.2 s) and at the
end (the workers gone), enqueue and drain records/s, the peak RSS (VmHWM) of
the producer and of each worker, `status`'s time and peak RSS, the sink's
rows, missing and duplicated records. Everything binds to 127.0.0.1 and is
stopped at the end. Release build. Ends with one JSON line.
"""
import json
import os
import shutil
import subprocess
import tempfile
import time

from benchlib import BIN, ROOT, redis_info, start_redis, start_sim, stop_all, write_records

N = int(os.environ.get("N", "1000000"))
WORKERS = int(os.environ.get("WORKERS", "2"))
BASE_BIN = os.environ.get("BASE_BIN")


def used_memory(url):
    return int(redis_info(url, "memory")["used_memory"])


def hwm_kib(pid):
    """Peak resident set of a running process (VmHWM), KiB; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return 0


def run_status(bindir, url, env, tmp):
    """`producer status --require-complete --json` of the job: its
    document, seconds and peak RSS (MiB)."""
    rss_file = os.path.join(tmp, "status-rss")
    s0 = time.time()
    out = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", rss_file, os.path.join(bindir, "producer"), "status",
                          "--job", "scale", "--redis", url, "--require-complete", "--json"],
                         env=env, capture_output=True, text=True)
    secs = time.time() - s0
    return json.loads(out.stdout), secs, round(int(open(rss_file).read().split()[-1]) / 1024, 1)


def sunk(url, partitions):
    total = 0
    for p in range(partitions):
        out = subprocess.run(["redis-cli", "-p", url.rsplit(":", 1)[1], "HGET", f"bf:{{scale:p{p}}}:sunk", "done"],
                             capture_output=True, text=True).stdout.strip()
        total += int(out or 0)
    return total


def main():
    tmp = tempfile.mkdtemp(prefix="bf-bench-scale-")
    procs, servers = [], []
    try:
        redis, url = start_redis(tmp)
        sim, addr = start_sim()
        servers = [sim, redis]
        sink_dir = os.path.join(tmp, "results")
        spec = open(os.path.join(ROOT, "examples", "job.toml")).read()
        # No provider limit binds: the fleet and Redis are what is measured.
        for limit in ("requests_per_minute = 10000", "input_tokens_per_minute = 2000000",
                      "output_tokens_per_minute = 500000"):
            spec = spec.replace(limit, "")
        spec += f'\n[sink]\nkind = "files"\ndir = "{sink_dir}"\n'
        spec_path = os.path.join(tmp, "job.toml")
        open(spec_path, "w").write(spec)
        partitions = 4
        data = os.path.join(tmp, "data.jsonl")
        write_records(data, N, "s")
        env = dict(os.environ, OPENAI_API_KEY="sk-bench", RUST_LOG="warn")
        base = used_memory(url)
        t0 = time.time()
        producer = subprocess.Popen([os.path.join(BIN, "producer"), "enqueue", data, "--job", "scale", "--spec",
                                     spec_path, "--redis", url, "--no-progress"], env=env, stdout=subprocess.DEVNULL)
        procs.append(producer)
        while subprocess.run(["redis-cli", "-p", url.rsplit(":", 1)[1], "EXISTS", "bf:{scale}:spec"],
                             capture_output=True, text=True).stdout.strip() != "1":
            time.sleep(0.05)
        workers = [subprocess.Popen([os.path.join(BIN, "worker"), "--redis", url, "--job", "scale",
                                     "--base-url", addr + "/v1", "--metrics-addr", "off"],
                                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                   for _ in range(WORKERS)]
        procs.extend(workers)
        peak, producer_kib, worker_kib = 0, 0, [0] * WORKERS
        enqueued_at = None
        while True:
            peak = max(peak, used_memory(url) - base)
            producer_kib = max(producer_kib, hwm_kib(producer.pid))
            worker_kib = [max(k, hwm_kib(w.pid)) for k, w in zip(worker_kib, workers)]
            if enqueued_at is None and producer.poll() is not None:
                enqueued_at = time.time()
                assert producer.returncode == 0, "the enqueue failed"
            if enqueued_at is not None and sunk(url, partitions) >= N:
                break
            if time.time() - t0 > 6 * 3600:
                raise SystemExit("the job did not finish within six hours")
            time.sleep(0.2)
        drained_at = time.time()
        worker_kib = [max(k, hwm_kib(w.pid)) for k, w in zip(worker_kib, workers)]
        stop_all(workers)
        procs.clear()
        end = used_memory(url) - base
        status, status_s, status_mib = run_status(BIN, url, env, tmp)
        # With BASE_BIN (a baseline build's bin directory): its status on the
        # same finished job, alternating with this build's, twice each.
        paired = []
        for _ in range(2 if BASE_BIN else 0):
            for label, bindir in (("base", BASE_BIN), ("this", BIN)):
                s_out, secs, mib = run_status(bindir, url, env, tmp)
                paired.append({"build": label, "secs": round(secs, 1), "peak_rss_mib": mib,
                               "complete": s_out.get("complete")})
        verified = (status.get("sink") or {}).get("verified") or {}
        result = {
            "records": N,
            "redis_peak_bytes": peak,
            "redis_end_bytes": end,
            "enqueue_rec_s": round(N / (enqueued_at - t0)),
            "drain_rec_s": round(N / (drained_at - t0)),
            "producer_peak_rss_mib": round(producer_kib / 1024, 1),
            "worker_peak_rss_mib": [round(k / 1024, 1) for k in worker_kib],
            "status_secs": round(status_s, 1),
            "status_peak_rss_mib": status_mib,
            "status_paired": paired,
            "status_complete": status.get("complete"),
            "sink_rows": verified.get("rows"),
            "missing": status.get("missing"),
            "duplicate": status.get("duplicates", 0) + verified.get("duplicates", 0),
        }
    finally:
        stop_all(procs, *servers)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"| records | Redis peak | Redis at the end | enqueue | drain | producer / worker peak RSS "
          f"| status | sink rows | missing | duplicate |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    r = result
    print(f"| {N:,} | {r['redis_peak_bytes'] / 2**20:,.0f} MiB | {r['redis_end_bytes'] / 2**20:,.0f} MiB "
          f"| {r['enqueue_rec_s']:,} rec/s | {r['drain_rec_s']:,} rec/s "
          f"| {r['producer_peak_rss_mib']} / {', '.join(map(str, r['worker_peak_rss_mib']))} MiB "
          f"| {r['status_secs']} s, {r['status_peak_rss_mib']} MiB | {r['sink_rows']:,} | {r['missing']} "
          f"| {r['duplicate']} |")
    for p in r["status_paired"]:
        print(f"status ({p['build']}): {p['secs']} s, {p['peak_rss_mib']} MiB, complete {p['complete']}")
    print(json.dumps({k: r[k] for k in ("records", "redis_peak_bytes", "redis_end_bytes", "enqueue_rec_s",
                                        "drain_rec_s", "missing", "duplicate")}))


if __name__ == "__main__":
    main()

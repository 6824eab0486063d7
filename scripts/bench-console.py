#!/usr/bin/env python3
"""`make bench-console`: how fast the console's pages answer on large jobs.

A job of RECORDS records (default 1,000,000, all queued: enqueued with
`--max-backlog 0`) and a job with REVIEW entries in its review queue
(default 100,000: every answer has a wrong enum, one attempt each, drained
by a worker against llm-sim). The console serves both; each page is fetched
N times (default 50) over one keep-alive connection, signed in:

- the job page of the large job (its first view starts the job's
  reconciliation and answers without waiting for it more than 300 ms; the
  time until the page shows it is reported apart; later views read the
  cached one),
- its live part (what the page fetches every 3 s),
- the review queue of the other job, unfiltered and filtered by an error
  code, and an entry of it,
- the jobs page.

Baseline, in the same run and on the same connection: the console's style
sheet (a static answer from the same server). Reported: each page's median
and 90th percentile in ms, and the median as a multiple of the baseline's.
Everything binds to 127.0.0.1 and is stopped at the end. Release build.
"""
import http.client
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

from benchlib import BIN, ROOT, free_port, start_redis, start_sim
from benchlib import write_records as write

RECORDS = int(os.environ.get("RECORDS", "1000000"))
REVIEW = int(os.environ.get("REVIEW", "100000"))
N = int(os.environ.get("N", "50"))
TOKEN = "bench-" + os.urandom(12).hex()


def main():
    tmp = tempfile.mkdtemp(prefix="bench-console-")
    redis, url = start_redis(tmp)
    sim, addr = start_sim("--latency-ms", "0", "--faults", "bad_enum=1.0")
    procs = []
    try:
        spec = open(os.path.join(ROOT, "examples", "job.toml")).read()
        for limit in ["requests_per_minute = 10000", "input_tokens_per_minute = 2000000",
                      "output_tokens_per_minute = 500000", "max_concurrent = 64"]:
            spec = spec.replace(limit, "")
        spec = spec.replace("max_attempts = 4", "max_attempts = 1")
        spec_path = os.path.join(tmp, "job.toml")
        open(spec_path, "w").write(spec)
        env = dict(os.environ, OPENAI_API_KEY="sk-bench-0123456789", RUST_LOG="warn")

        def enqueue(job, path):
            subprocess.run([os.path.join(BIN, "producer"), "enqueue", path, "--job", job, "--spec", spec_path,
                            "--redis", url, "--no-progress", "--max-backlog", "0"], check=True,
                           stdout=subprocess.DEVNULL, env=env)

        big = os.path.join(tmp, "big.jsonl")
        write(big, RECORDS, "b")
        t0 = time.time()
        enqueue("big", big)
        enqueue_secs = time.time() - t0
        rev = os.path.join(tmp, "rev.jsonl")
        write(rev, REVIEW, "r")
        enqueue("rev", rev)
        subprocess.run([os.path.join(BIN, "worker"), "--redis", url, "--job", "rev", "--base-url", addr + "/v1",
                        "--concurrency", "64", "--metrics-addr", "off", "--drain"], check=True, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        tokens = os.path.join(tmp, "tokens")
        open(tokens, "w").write(f"bench:{TOKEN}\n")
        port = free_port()
        console = subprocess.Popen([os.path.join(BIN, "producer"), "console", "--redis", url, "--bind",
                                    f"127.0.0.1:{port}", "--tokens-file", tokens], env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(console)
        conn = None
        for _ in range(200):
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port)
                conn.request("GET", "/healthz")
                conn.getresponse().read()
                break
            except OSError:
                time.sleep(0.05)
        conn.request("POST", "/login", body=f"token={TOKEN}",
                     headers={"content-type": "application/x-www-form-urlencoded"})
        r = conn.getresponse()
        r.read()
        cookie = r.getheader("set-cookie").split(";")[0]

        def get(path):
            t = time.perf_counter()
            conn.request("GET", path, headers={"cookie": cookie})
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise SystemExit(f"GET {path}: {resp.status} {body[:300]!r}")
            return (time.perf_counter() - t) * 1000, body

        t0 = time.perf_counter()
        first_ms, _ = get("/jobs/big")
        # The first view answers before the job's first reconciliation ends;
        # the page fills in once it has (the live part shows it).
        while 'id="done">…<' in get("/jobs/big/live")[1].decode():
            time.sleep(0.05)
        reconciled_secs = time.perf_counter() - t0
        _, queue = get("/jobs/rev/review")
        entry = queue.decode().split('data-href="', 1)[1].split('"', 1)[0]
        pages = {
            "baseline: /static/console.css": "/static/console.css",
            "job page, 1M-record job": "/jobs/big",
            "its live part": "/jobs/big/live",
            "review queue, 100k entries": "/jobs/rev/review",
            "review queue filtered by code": "/jobs/rev/review?code=E_ENUM",
            "a review entry": entry,
            "jobs page": "/",
        }
        out = {"records": RECORDS, "review_entries": REVIEW, "requests_each": N,
               "job_page_first_view_ms": round(first_ms, 1),
               "first_reconciliation_secs": round(reconciled_secs, 2),
               "enqueue_secs_of_the_large_job": round(enqueue_secs, 1)}
        medians = {}
        for name, path in pages.items():
            times = sorted(get(path)[0] for _ in range(N))
            medians[name] = statistics.median(times)
            out[name] = {"median_ms": round(medians[name], 2), "p90_ms": round(times[int(len(times) * 0.9) - 1], 2)}
        base = medians["baseline: /static/console.css"]
        for name in pages:
            out[name]["x_baseline"] = round(medians[name] / base, 1)
        print(json.dumps(out, indent=2))
    finally:
        for p in procs:
            p.terminate()
            p.wait()
        sim.terminate()
        redis.terminate()
        sim.wait()
        redis.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

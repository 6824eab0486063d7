#!/usr/bin/env python3
"""`make bench-outage`: a provider outage in the middle of a job, in one run.

The example spec over N records (default 6,000) against llm-sim at a steady
LATENCY ms (default 200), drained by two workers (release build). Once a
third of the records are done, llm-sim is killed (by pid) for OUTAGE seconds
(default 20) and started again on the same port. Reported:
- records/s before the outage and after it (same run, same fleet), and their ratio;
- the time from the provider's return to the first record done after it;
- what the provider was sent while it was down: the fleet's failed calls in
  the outage's streak, before and after it was taken for down (probes only);
- at the end: done, review, missing, duplicates (nothing may be lost or
  reviewed for the outage), and the outages the job saw.
Ends with one JSON line. Everything binds to 127.0.0.1 and is stopped.
"""
import json
import os
import subprocess
import tempfile
import time

from benchlib import BIN, ROOT, start_redis, write_records

N = int(os.environ.get("N", "6000"))
LATENCY = os.environ.get("LATENCY", "200")
OUTAGE = float(os.environ.get("OUTAGE", "20"))
CONCURRENCY = os.environ.get("CONCURRENCY", "32")


def sim_at(port):
    p = subprocess.Popen([os.path.join(BIN, "llm-sim"), "--port", str(port), "--latency-ms", LATENCY,
                          "--steady-latency"], stdout=subprocess.PIPE, text=True)
    return p, p.stdout.readline().strip().removeprefix("llm-sim listening on ")


def status(url, job):
    out = subprocess.run([os.path.join(BIN, "producer"), "status", "--job", job, "--redis", url, "--json"],
                         capture_output=True, text=True)
    return json.loads(out.stdout)


def rate_over(url, job, secs):
    """Records done per second over `secs` (from two status reads)."""
    a, t0 = status(url, job)["done"], time.monotonic()
    time.sleep(secs)
    b, t1 = status(url, job)["done"], time.monotonic()
    return (b - a) / (t1 - t0)


def main():
    with tempfile.TemporaryDirectory(prefix="bench-outage-") as tmp:
        redis, url = start_redis(tmp)
        sim, addr = sim_at(0)
        port = int(addr.rsplit(":", 1)[1])
        workers = []
        try:
            data = os.path.join(tmp, "data.jsonl")
            write_records(data, N, "bo-")
            spec = open(os.path.join(ROOT, "examples/job.toml")).read()
            spec_path = os.path.join(tmp, "job.toml")
            open(spec_path, "w").write(spec)
            env = dict(os.environ, OPENAI_API_KEY="sk-bench-not-a-real-key", RUST_LOG="warn")
            subprocess.run([os.path.join(BIN, "producer"), "enqueue", data, "--job", "outage", "--spec", spec_path,
                            "--redis", url, "--no-progress"], check=True, env=env, stdout=subprocess.DEVNULL)
            for i in range(2):
                workers.append(subprocess.Popen(
                    [os.path.join(BIN, "worker"), "--redis", url, "--job", "outage", "--base-url", addr + "/v1",
                     "--drain", "--concurrency", CONCURRENCY, "--metrics-addr", "127.0.0.1:0",
                     "--consumer", f"bench-outage-{i}"],
                    env=env, stderr=open(os.path.join(tmp, f"worker-{i}.log"), "w")))
            while status(url, "outage")["done"] < N // 6:
                time.sleep(0.2)
            before = rate_over(url, "outage", 5)
            sim.kill()
            sim.wait()
            down_at = time.monotonic()
            while not status(url, "outage").get("waiting"):
                time.sleep(0.1)
            taken_down_s = time.monotonic() - down_at
            failed_when_down = status(url, "outage")["provider"]["failed_calls"]
            time.sleep(max(0.0, OUTAGE - (time.monotonic() - down_at)))
            s = status(url, "outage")
            failed_at_end = s["provider"]["failed_calls"]
            done_before_return = s["done"]
            sim, addr2 = sim_at(port)
            assert addr2 == addr, (addr2, addr)
            back_at = time.monotonic()
            while status(url, "outage")["done"] <= done_before_return:
                time.sleep(0.05)
            first_success_s = time.monotonic() - back_at
            time.sleep(2)
            after = rate_over(url, "outage", 5)
            for w in workers:
                w.wait(timeout=600)
            end = status(url, "outage")
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()
            sim.kill()
            redis.terminate()
            redis.wait()
    out = {
        "records": N,
        "latency_ms": int(LATENCY),
        "outage_s": OUTAGE,
        "records_per_s_before": round(before, 1),
        "records_per_s_after": round(after, 1),
        "after_over_before": round(after / before, 3) if before else None,
        "provider_taken_down_after_s": round(taken_down_s, 2),
        "first_success_after_return_s": round(first_success_s, 2),
        "failed_calls_until_taken_down": failed_when_down,
        "failed_calls_while_down": failed_at_end - failed_when_down,
        "done": end["done"],
        "review": end["review"],
        "missing": end["missing"],
        "duplicate": end["duplicates"],
        "outages": end["provider"]["outages"],
    }
    os.makedirs(os.path.join(ROOT, ".bench"), exist_ok=True)
    with open(os.path.join(ROOT, ".bench", "outage.json"), "w") as f:
        json.dump(out, f, indent=2)
    print(f"records/s before the outage {out['records_per_s_before']}, after {out['records_per_s_after']} "
          f"(ratio {out['after_over_before']}); taken for down {out['provider_taken_down_after_s']} s after it "
          f"went away, after {failed_when_down} failed calls; {out['failed_calls_while_down']} calls (probes) "
          f"while down; first record done {out['first_success_after_return_s']} s after it came back; "
          f"{out['done']} done, {out['review']} review, {out['missing']} missing, {out['duplicate']} duplicate")
    print(json.dumps(out))
    if out["review"] or out["missing"] or out["duplicate"] or out["done"] != N:
        raise SystemExit("records lost, reviewed or twice: see above")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""`make bench-routes`: the same job all standard, and routed by the
planner (flex and standard, with a deadline), in one run.

The example spec over N records (default 1,200) against llm-sim refusing
FLEX_REFUSED (default 40%) of flex calls in bursts of 5, the provider's
limit told in `[limits]` (RPM, default 1200: it binds), two workers
(release build). Runs, each on a fresh Redis:
- `standard`: every call standard, no deadline (the baseline);
- `routed`: flex and standard, a deadline with room (twice the standard
  run's time; flex alone takes 1/0.6 of it): the planner keeps calls on flex;
- `routed_tight`: a deadline between the standard run's time and flex
  alone's: the planner sends the share standard that makes it;
- `primary_down`: routed with a fallback provider (a second llm-sim at
  standard prices); the primary goes down (503s) for DOWN seconds (default
  30) a quarter of the way in; the deadline 1.5x the standard run's time.
Each run ends with one JSON line: {"run", "records", "seconds",
"cost_usd", "cost_ratio_vs_standard" (against the standard run's cost, same
run), "deadline_met", "paid_twice", "lost", "by_route"}. Everything binds to
127.0.0.1 and is stopped.
"""
import json
import os
import subprocess
import tempfile
import time

from benchlib import BIN, ROOT, start_redis, start_sim, write_records

N = int(os.environ.get("N", "1200"))
RPM = int(os.environ.get("RPM", "1200"))
FLEX_REFUSED = os.environ.get("FLEX_REFUSED", "0.4")
DOWN = int(os.environ.get("DOWN", "30"))
RUNS = os.environ.get("RUNS", "standard,routed,routed_tight,primary_down").split(",")
ENV = dict(os.environ, OPENAI_API_KEY="sk-bench-not-a-real-key", RUST_LOG="warn")


def producer(url, *args, check=True):
    out = subprocess.run([os.path.join(BIN, "producer"), *args, "--redis", url], capture_output=True, text=True,
                         env=ENV)
    if check and out.returncode != 0:
        raise SystemExit(f"producer {' '.join(args)}: {out.stderr}")
    return out.stdout


def spec_text(tiers, deadline, fallback_url):
    spec = open(os.path.join(ROOT, "examples/job.toml")).read()
    spec = spec.replace("requests_per_minute = 10000", f"requests_per_minute = {RPM}", 1)
    spec = spec.replace("base_delay_ms = 500", "base_delay_ms = 100", 1)
    spec = spec.replace("max_delay_ms = 30000", "max_delay_ms = 2000", 1)
    spec = spec.replace('structured_output = "auto"', f'structured_output = "auto"\ntiers = {json.dumps(tiers)}', 1)
    if deadline:
        spec = spec.replace("partitions = 4 ", f'partitions = 4\ndeadline = "{deadline}s" ', 1)
    if fallback_url:
        spec = spec.replace("\n[limits]", f'\n[[provider.fallbacks]]\nname = "backup"\nbase_url = "{fallback_url}/v1"\n'
                            f'model = "gpt-4o-mini"\n[provider.fallbacks.limits]\nrequests_per_minute = {RPM}\n\n[limits]',
                            1)
    return spec


def run(name, tiers, deadline=None, down=False):
    """One job from enqueue to the workers' exit: its JSON line's figures."""
    with tempfile.TemporaryDirectory(prefix=f"bench-routes-{name}-") as tmp:
        redis, url = start_redis(tmp)
        outage = ["--outage", f"unavailable:{N // 4}:{DOWN}"] if down else []
        sim, addr = start_sim("--flex-unavailable", FLEX_REFUSED, "--flex-burst", "5", "--seed", "11", *outage)
        backup, backup_addr = start_sim() if down else (None, None)
        workers = []
        try:
            data = os.path.join(tmp, "data.jsonl")
            write_records(data, N, "br-")
            spec_path = os.path.join(tmp, "job.toml")
            open(spec_path, "w").write(spec_text(tiers, deadline, backup_addr))
            producer(url, "enqueue", data, "--job", name, "--spec", spec_path, "--no-progress")
            started = time.monotonic()
            deadline_at = time.time() + deadline if deadline else None
            for i in range(2):
                workers.append(subprocess.Popen(
                    [os.path.join(BIN, "worker"), "--redis", url, "--job", name, "--base-url", addr + "/v1",
                     "--drain", "--concurrency", "32", "--metrics-addr", "127.0.0.1:0",
                     "--consumer", f"bench-routes-{i}"],
                    env=ENV, stderr=open(os.path.join(tmp, f"worker-{i}.log"), "w")))
            for w in workers:
                w.wait(timeout=3600)
            ended = time.time()
            seconds = time.monotonic() - started
            s = json.loads(producer(url, "status", "--job", name, "--json"))
            ledger = producer(url, "export", "--job", name, "--what", "ledger", "--out", "-")
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()
            for p in (sim, backup, redis):
                if p is not None:
                    p.terminate()
                    p.wait()
    paid = {}
    for line in ledger.splitlines():
        c = json.loads(line)
        if c["fate"] == "settled":
            paid[c["record_id"]] = paid.get(c["record_id"], 0) + 1
    routes = s.get("routes") or {}
    return {
        "run": name,
        "records": N,
        "seconds": round(seconds, 1),
        "deadline_s": deadline,
        "cost_usd": round(s["cost_usd"], 6),
        "deadline_met": deadline_at is None or ended <= deadline_at,
        "paid_twice": sum(1 for n in paid.values() if n > 1),
        "lost": s["missing"] + s["duplicates"] + (N - s["done"] - s["review"]),
        "review": s["review"],
        "by_route": routes.get("records", {}),
        "status_ratio_vs_standard": round(routes.get("cost_ratio_vs_standard") or 0, 3),
    }


def main():
    results = []
    base = run("standard", ["standard"])
    results.append(base)
    flex_alone = base["seconds"] / (1 - float(FLEX_REFUSED))
    plans = {
        "routed": (["flex", "standard"], round(base["seconds"] * 2 + 10), False),
        "routed_tight": (["flex", "standard"], round((base["seconds"] + flex_alone) / 2 + 10), False),
        "primary_down": (["flex", "standard"], round(base["seconds"] * 1.5 + 10), True),
    }
    for name in RUNS:
        if name in plans:
            tiers, deadline, down = plans[name]
            results.append(run(name, tiers, deadline, down))
    for r in results:
        r["cost_ratio_vs_standard"] = round(r["cost_usd"] / base["cost_usd"], 3) if base["cost_usd"] else None
        print(f"{r['run']:<13} {r['seconds']:>6} s (deadline {r['deadline_s']}): {r['cost_usd']:.6f} USD, "
              f"{r['cost_ratio_vs_standard']} of all-standard; routes {r['by_route']}; deadline met "
              f"{r['deadline_met']}, paid twice {r['paid_twice']}, lost {r['lost']}")
    os.makedirs(os.path.join(ROOT, ".bench"), exist_ok=True)
    with open(os.path.join(ROOT, ".bench", "routes.json"), "w") as f:
        json.dump(results, f, indent=2)
    for r in results:
        print(json.dumps(r))
    if any(r["paid_twice"] or r["lost"] or not r["deadline_met"] for r in results):
        raise SystemExit("a record paid twice or lost, or a deadline missed: see above")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""`make bench-litellm`: a fleet's use of a limit behind a proxy that says
"retry after 60". llm-sim answers as LiteLLM's proxy does
(`--limit-headers litellm`): requests counted per calendar minute, limit and
remaining on every answer, and a 429 over the window that says
`llm_provider-retry-after: 60` whatever is left of the minute.

Two runs of 3 workers x 32 at RPM requests/min (default 300): the limit told
in the spec's `[limits]`, and untold (learned from the proxy's headers).
Each runs MINUTES full calendar minutes (default 3) after the minute it
started in. llm-sim is the judge: what it accepted in each full minute
against the limit, and its 429s over all requests (in the full minutes, and
over the whole run, its start included).
Goal: >= 0.95 of the limit in every full minute, <= 1% 429s, told and untold.
Ends with one JSON line per run.
"""
import json
import os
import shutil
import subprocess
import tempfile
import time

from benchlib import BIN, ROOT, redis_commands, redis_cpu, sim_stats, start_redis, start_sim, stop_all, write_records

RPM = int(os.environ.get("RPM", "300"))
MINUTES = int(os.environ.get("MINUTES", "3"))


def run(tmp, told):
    redis, url = start_redis(tmp)
    sim, addr = start_sim("--latency-ms", "200", "--rpm", str(RPM), "--limit-headers", "litellm")
    procs = []
    try:
        spec = open(os.path.join(ROOT, "examples", "job.toml")).read()
        spec = spec.replace("requests_per_minute = 10000", f"requests_per_minute = {RPM}" if told else "")
        spec = spec.replace("input_tokens_per_minute = 2000000", "").replace("output_tokens_per_minute = 500000", "")
        spec = spec.replace("max_concurrent = 64", "")
        spec_path = os.path.join(tmp, f"spec-{told}.toml")
        open(spec_path, "w").write(spec)
        data = os.path.join(tmp, f"data-{told}.jsonl")
        write_records(data, RPM * (MINUTES + 2), "m")
        subprocess.run([os.path.join(BIN, "producer"), "enqueue", data, "--job", "ll", "--spec", spec_path,
                        "--redis", url, "--no-progress"], check=True, stdout=subprocess.DEVNULL)
        env = dict(os.environ, OPENAI_API_KEY="sk-bench", RUST_LOG="warn")
        started = time.time()
        for _ in range(3):
            procs.append(subprocess.Popen([os.path.join(BIN, "worker"), "--redis", url, "--job", "ll",
                                           "--base-url", addr + "/v1", "--concurrency", "32",
                                           "--metrics-addr", "127.0.0.1:0"],
                                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        first = int(started // 60) + 1
        last = first + MINUTES - 1
        cpu0, cmd0 = redis_cpu(url), redis_commands(url)
        time.sleep(max(0.0, (last + 1) * 60 + 1 - time.time()))
        cpu1, cmd1 = redis_cpu(url), redis_commands(url)
        stats = sim_stats(addr)
    finally:
        stop_all(procs, sim, redis)
    by_minute = {int(m): v for m, v in stats["by_minute"].items()}
    minutes = [by_minute.get(m, [0, 0]) for m in range(first, last + 1)]
    accepted = [ok for ok, _ in minutes]
    refused = sum(r for _, r in minutes)
    calls = max(1, sum(accepted) + refused)
    # The whole run too: the start (the first, partial minute) included.
    run_ok, run_refused = (sum(v[k] for v in by_minute.values()) for k in (0, 1))
    return {"run": "told" if told else "untold", "rpm": RPM, "accepted_per_minute": accepted,
            "min_utilization": round(min(accepted) / RPM, 3), "rate_429": round(refused / calls, 4),
            "rate_429_whole_run": round(run_refused / max(1, run_ok + run_refused), 4), "refused_whole_run": run_refused,
            "redis_cpu_us_per_call": round((cpu1 - cpu0) * 1e6 / calls, 1),
            "redis_commands_per_call": round((cmd1 - cmd0) / calls, 1)}


def main():
    tmp = tempfile.mkdtemp(prefix="bf-bench-litellm-")
    results = []
    try:
        for told in (True, False):
            results.append(run(tmp, told))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"| limit | accepted in each full minute (limit {RPM}) | least utilization | 429s in them "
          "| 429s over the whole run |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['run']} | {', '.join(map(str, r['accepted_per_minute']))} | {r['min_utilization']:.1%} "
              f"| {r['rate_429']:.2%} | {r['refused_whole_run']} ({r['rate_429_whole_run']:.2%}) |")
    met = all(r["min_utilization"] >= 0.95 and r["rate_429_whole_run"] <= 0.01 for r in results)
    print(f"goal (>= 0.95 of the limit every full minute, <= 1% 429s, told and untold): {'met' if met else 'NOT met'}")
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()

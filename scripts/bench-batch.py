#!/usr/bin/env python3
"""`make bench-batch`: the same job online and in provider batch mode, in one run.

The example spec over N records (default 10,000) against one llm-sim with a
small fault mix (invalid answers and 5xx: retries happen), once with
`provider.mode = "online"` and once with `"batch"` (shards of up to 2,500
requests), each into its own throwaway Redis, drained by one worker.
Reported, for each mode and as batch/online ratios:
- paid cost per done record (USD, from `producer report`: every paid call,
  retries included, at the prices of the way it was made);
- HTTP calls the fleet sent to the provider per 10,000 records (llm-sim's
  `api_calls`: chat requests, file uploads and downloads, batch creates,
  polls and lookups);
- provider batches created, and the fleet's Redis CPU per record (INFO
  used_cpu_sys + used_cpu_user deltas).

Everything binds to 127.0.0.1 and is stopped at the end. Release build.
"""
import json
import os
import subprocess
import tempfile

from benchlib import BIN, ROOT, redis_cpu, sim_stats, start_redis, start_sim
from benchlib import write_records as write

N = int(os.environ.get("N", "10000"))
SHARD = int(os.environ.get("SHARD", "2500"))


def run(mode, tmp, sim_addr, data):
    redis, url = start_redis(tmp)
    try:
        spec = open(os.path.join(ROOT, "examples/job.toml")).read()
        if mode == "batch":
            spec = spec.replace('structured_output = "auto"', 'structured_output = "auto"\nmode = "batch"', 1)
            spec = spec.replace("[retry]", f"[batch]\nshard_records = {SHARD}\npoll_secs = 1\npack_wait_secs = 1\n\n[retry]", 1)
        spec_path = os.path.join(tmp, f"job-{mode}.toml")
        open(spec_path, "w").write(spec)
        env = dict(os.environ, OPENAI_API_KEY="sk-bench-not-a-real-key", RUST_LOG="warn")
        job = f"bench-{mode}"
        subprocess.run([os.path.join(BIN, "producer"), "enqueue", data, "--job", job, "--spec", spec_path,
                        "--redis", url, "--no-progress"], check=True, env=env, stdout=subprocess.DEVNULL)
        before_calls = sim_stats(sim_addr)
        cpu0 = redis_cpu(url)
        subprocess.run([os.path.join(BIN, "worker"), "--redis", url, "--job", job, "--base-url", sim_addr + "/v1",
                        "--drain", "--concurrency", "64", "--metrics-addr", "127.0.0.1:0"],
                       check=True, env=env, stderr=open(os.path.join(tmp, f"worker-{mode}.log"), "w"))
        cpu = redis_cpu(url) - cpu0
        after = sim_stats(sim_addr)
        report = json.loads(subprocess.run([os.path.join(BIN, "producer"), "report", "--job", job, "--redis", url,
                                            "--json"], check=True, capture_output=True, text=True, env=env).stdout)
        status = json.loads(subprocess.run([os.path.join(BIN, "producer"), "status", "--job", job, "--redis", url,
                                            "--json"], capture_output=True, text=True, env=env).stdout)
        done = status["done"]
        spend = report["spend"]
        return {
            "mode": mode,
            "records": N,
            "done": done,
            "review": status["review"],
            "paid_calls": spend["calls"],
            "cost_usd": spend["cost_usd"],
            "cost_per_done_record_usd": spend["cost_usd"] / max(done, 1),
            "http_calls": after["api_calls"] - before_calls["api_calls"],
            "http_calls_per_10k_records": (after["api_calls"] - before_calls["api_calls"]) * 10000 / N,
            "batches_created": after["batches_created"] - before_calls["batches_created"],
            "redis_cpu_us_per_record": cpu * 1e6 / N,
            "online_equivalent_usd": spend.get("batch", {}).get("online_cost_usd"),
        }
    finally:
        redis.terminate()
        redis.wait()


def main():
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        data = os.path.join(tmp, "data.jsonl")
        write(data, N, "bb-")
        sim, addr = start_sim("--latency-ms", "20", "--faults", "missing_field=0.05,server_error=0.02",
                              "--seed", "11", "--batch-secs", "2")
        try:
            online = run("online", tmp, addr, data)
            batch = run("batch", tmp, addr, data)
        finally:
            sim.terminate()
            sim.wait()
    ratio = lambda k: batch[k] / online[k] if online[k] else None  # noqa: E731
    out = {
        "online": online,
        "batch": batch,
        "batch_over_online": {
            "cost_per_done_record": ratio("cost_per_done_record_usd"),
            "http_calls_per_10k_records": ratio("http_calls_per_10k_records"),
            "redis_cpu_per_record": ratio("redis_cpu_us_per_record"),
        },
    }
    os.makedirs(os.path.join(ROOT, ".bench"), exist_ok=True)
    with open(os.path.join(ROOT, ".bench", "batch.json"), "w") as f:
        json.dump(out, f, indent=2)
    for m in (online, batch):
        print(f"{m['mode']:>6}: {m['done']} done, {m['review']} review of {N}; {m['paid_calls']} paid calls, "
              f"{m['cost_per_done_record_usd'] * 1e6:.3f} micro-USD per done record; "
              f"{m['http_calls_per_10k_records']:.0f} HTTP calls per 10,000 records; "
              f"{m['batches_created']} batches; Redis CPU {m['redis_cpu_us_per_record']:.1f} us/record")
    r = out["batch_over_online"]
    print(f"batch / online: cost per done record {r['cost_per_done_record']:.3f}, "
          f"HTTP calls {r['http_calls_per_10k_records']:.4f}, Redis CPU per record {r['redis_cpu_per_record']:.2f} "
          "(.bench/batch.json)")


if __name__ == "__main__":
    main()

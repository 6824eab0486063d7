#!/usr/bin/env python3
"""`make bench-sink`: the PostgreSQL result sink, against a baseline of the same run.

1. Rows/s into PostgreSQL: N records are committed into Redis while a psql
   session holds the results table locked (the sink writer waits mid-
   transaction); then the lock is lifted and the time until the sink's
   backlog is empty is measured. Baseline: a raw `COPY` of the same rows
   (exported from the tables: the results and the cost ledger's rows, which
   the sink writes too) into tables of the same shape, primary keys and
   indexes included. Reported: both rates (results per second) and their
   ratio.
2. Redis bytes per record (INFO used_memory deltas): queued (after enqueue),
   finished with its result still in Redis (before the sink wrote it),
   finished once the sink caught up (the result left Redis; its paid call is
   still held in the ledger hash for twice the visibility timeout), and
   after that hold (the paid call left too). The workers run with a 3 s
   visibility timeout (a 2 s provider timeout), so the hold is 6 s.
3. Peak Redis memory of a PEAK_RECORDS-record job (default 1,000,000) with the
   default backlog (`enqueue --max-backlog` and `sink.max_backlog` left at
   their defaults), enqueued while two workers drain it into PostgreSQL
   (`used_memory` sampled every 0.2 s), and the projection for 10,000,000
   records: the peak plus the remaining records at the bytes each finished
   record keeps.

Everything binds to 127.0.0.1 (a throwaway redis-server, llm-sim, and a
PostgreSQL initdb'd into a temp dir) and is stopped at the end. Release build.
"""
import json
import os
import shutil
import subprocess
import tempfile
import time

from benchlib import BIN, ROOT, free_port, proc_cpu, start_redis, start_sim
from benchlib import write_records as write

N = int(os.environ.get("N", "50000"))
PEAK_RECORDS = int(os.environ.get("PEAK_RECORDS", "1000000"))
BATCH_ROWS = int(os.environ.get("BATCH_ROWS", "500"))
WRITERS = int(os.environ.get("WRITERS", "4"))
PASSWORD = "bench-" + os.urandom(6).hex()


def pg_bin():
    found = shutil.which("initdb")
    if found:
        return os.path.dirname(found)
    versions = sorted(os.listdir("/usr/lib/postgresql")) if os.path.isdir("/usr/lib/postgresql") else []
    if not versions:
        raise SystemExit("PostgreSQL's server binaries are not installed (make deps installs them)")
    return f"/usr/lib/postgresql/{versions[-1]}/bin"


def start_postgres(tmp):
    """initdb + pg_ctl start as the `postgres` user when root: (dir, port, url)."""
    d = tempfile.mkdtemp(dir=tmp, prefix="pg")
    os.chmod(tmp, 0o755)
    port = free_port()
    open(os.path.join(d, "pw"), "w").write(PASSWORD)
    as_user = []
    if os.getuid() == 0:
        subprocess.run(["chown", "-R", "postgres", d], check=True)
        as_user = ["runuser", "-u", "postgres", "--"]
    b = pg_bin()
    subprocess.run(as_user + [f"{b}/initdb", "-D", f"{d}/data", "-U", "bf", "-A", "scram-sha-256",
                              "--pwfile", f"{d}/pw"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(as_user + [f"{b}/pg_ctl", "-D", f"{d}/data", "-l", f"{d}/log", "-w", "-o",
                              f"-p {port} -k {d} -c listen_addresses=127.0.0.1", "start"],
                   check=True, stdout=subprocess.DEVNULL)
    return d, port, f"postgres://bf:{PASSWORD}@127.0.0.1:{port}/postgres?sslmode=disable"


def stop_postgres(d):
    try:
        pid = int(open(f"{d}/data/postmaster.pid").readline())
        os.kill(pid, 2)  # its own pid file names it: a fast shutdown of exactly that server
        for _ in range(200):
            os.kill(pid, 0)
            time.sleep(0.05)
    except (OSError, ValueError):
        pass


def psql(port, sql, **kw):
    return subprocess.run(["psql", "-h", "127.0.0.1", "-p", str(port), "-U", "bf", "-d", "postgres", "-XAtq",
                           "-c", sql], env=dict(os.environ, PGPASSWORD=PASSWORD), capture_output=True,
                          text=True, check=True, **kw).stdout.strip()


def used_memory(url):
    port = url.rsplit(":", 1)[1]
    out = subprocess.run(["redis-cli", "-p", port, "INFO", "memory"], capture_output=True, text=True).stdout
    return int(next(l.split(":")[1] for l in out.splitlines() if l.startswith("used_memory:")))


def redis_int(url, *cmd):
    port = url.rsplit(":", 1)[1]
    return int(subprocess.run(["redis-cli", "-p", port, *cmd], capture_output=True, text=True).stdout.strip() or 0)


def cpu_secs(pids):
    """User + system CPU seconds of these processes so far (one gone counts 0)."""
    total = 0
    for pid in pids:
        try:
            total += proc_cpu(pid)
        except (OSError, IndexError, ValueError):
            pass
    return total


def postgres_pids(pg_dir):
    """The postmaster (from its pid file) and its children."""
    try:
        master = int(open(f"{pg_dir}/data/postmaster.pid").readline())
    except (OSError, ValueError):
        return []
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(master)], capture_output=True, text=True).stdout
    return [master] + [int(p) for p in out.split()]


def status(url, env):
    out = subprocess.run([os.path.join(BIN, "producer"), "status", "--job", "bench", "--redis", url, "--json"],
                         capture_output=True, text=True, env=env).stdout
    return json.loads(out)


def main():
    tmp = tempfile.mkdtemp(prefix="bench-sink-")
    redis, url = start_redis(tmp)
    sim, addr = start_sim("--latency-ms", "0")
    pg_dir, pg_port, db_url = start_postgres(tmp)
    procs = []
    try:
        spec = open(os.path.join(ROOT, "examples", "job.toml")).read()
        # No rate limits: the bench measures the sink, not the provider's budget.
        for limit in ["requests_per_minute = 10000", "input_tokens_per_minute = 2000000",
                      "output_tokens_per_minute = 500000", "max_concurrent = 64"]:
            spec = spec.replace(limit, "")
        spec = spec.replace("[retry]", '[sink]\nkind = "postgres"\nurl_env = "BENCH_DATABASE_URL"\n'
                                       f'table = "results"\nmax_backlog = {N * 4}\nbatch_rows = {BATCH_ROWS}\nwriters = {WRITERS}\n\n[retry]', 1)
        spec = spec.replace("timeout_secs = 30", "timeout_secs = 2")
        spec_path = os.path.join(tmp, "job.toml")
        open(spec_path, "w").write(spec)
        env = dict(os.environ, OPENAI_API_KEY="sk-bench", RUST_LOG="warn", BENCH_DATABASE_URL=db_url)

        def enqueue(job, path):
            subprocess.run([os.path.join(BIN, "producer"), "enqueue", path, "--job", job, "--spec", spec_path,
                            "--redis", url, "--no-progress"], check=True, stdout=subprocess.DEVNULL, env=env)

        def worker(job, *extra):
            return subprocess.Popen([os.path.join(BIN, "worker"), "--redis", url, "--job", job, "--base-url",
                                     addr + "/v1", "--concurrency", "64", "--metrics-addr", "127.0.0.1:0",
                                     "--visibility-timeout-ms", "3000", *extra],
                                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        # A first small job creates the tables.
        warm = os.path.join(tmp, "warm.jsonl")
        write(warm, 10, "w")
        enqueue("warm", warm)
        subprocess.run(worker("warm", "--drain").args, env=env, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        data = os.path.join(tmp, "data.jsonl")
        write(data, N, "m")

        base = used_memory(url)
        enqueue("bench", data)
        queued = used_memory(url)
        # The table is locked: every result waits in Redis.
        lock = subprocess.Popen(["psql", "-h", "127.0.0.1", "-p", str(pg_port), "-U", "bf", "-d", "postgres",
                                 "-XAtq", "-c", "BEGIN; LOCK TABLE results IN ACCESS EXCLUSIVE MODE; "
                                                "SELECT pg_sleep(3600);"],
                                env=dict(os.environ, PGPASSWORD=PASSWORD), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(1)
        procs.append(worker("bench"))
        while status(url, env)["done"] < N:
            time.sleep(0.5)
        time.sleep(1)
        finished_in_redis = used_memory(url)
        psql(pg_port, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query LIKE '%pg_sleep(3600)%' "
                      "AND pid <> pg_backend_pid()")
        busy = {"worker": [procs[0].pid], "redis": [redis.pid], "postgres": postgres_pids(pg_dir)}
        cpu0 = {k: cpu_secs(v) for k, v in busy.items()}
        t0 = time.time()
        lock.wait()
        backlog = lambda: sum(redis_int(url, "XLEN", f"bf:{{bench:p{p}}}:sink") for p in range(4))
        while backlog() > 0:
            time.sleep(0.05)
        sink_secs = time.time() - t0
        busy["postgres"] = postgres_pids(pg_dir)
        sink_cpu = {k: round((cpu_secs(v) - cpu0[k]) / sink_secs, 2) for k, v in busy.items()}
        time.sleep(1)
        sunk_held = used_memory(url)
        # The hold (6 s), then an idle writer's next trim (every 30 s).
        held = lambda: sum(redis_int(url, "ZCARD", f"bf:{{bench:p{p}}}:paid:sunk") for p in range(4))
        t_hold = time.time()
        while held() > 0:
            if time.time() - t_hold > 120:
                raise SystemExit("the paid calls the sink holds did not leave Redis within 120 s")
            time.sleep(0.5)
        time.sleep(1)
        sunk = used_memory(url)
        rows = int(psql(pg_port, "SELECT count(*) FROM results WHERE job = 'bench'"))

        ledger_rows = int(psql(pg_port, "SELECT count(*) FROM results_ledger WHERE job = 'bench'"))

        # Baseline: the same rows through a raw COPY into tables of the same shape.
        copy_secs = 0.0
        for table in ["results", "results_ledger"]:
            csv = os.path.join(pg_dir, f"{table}.csv")
            psql(pg_port, f"COPY (SELECT * FROM {table} WHERE job = 'bench') TO '{csv}' WITH (FORMAT csv)")
            psql(pg_port, f"CREATE TABLE copy_{table} (LIKE {table} INCLUDING ALL)")
            t0 = time.time()
            psql(pg_port, f"COPY copy_{table} FROM '{csv}' WITH (FORMAT csv)")
            copy_secs += time.time() - t0
        copied = int(psql(pg_port, "SELECT count(*) FROM copy_results"))

        sink_rate, copy_rate = rows / sink_secs, copied / copy_secs
        per_finished = (sunk - base) / N

        # 3. A large job with the default backlog, enqueued while it drains.
        for p in procs:
            p.terminate()
            p.wait()
        procs.clear()
        peak_spec = spec.replace(f"max_backlog = {N * 4}\n", "")
        peak_spec_path = os.path.join(tmp, "peak.toml")
        open(peak_spec_path, "w").write(peak_spec)
        big = os.path.join(tmp, "big.jsonl")
        write(big, PEAK_RECORDS, "b")
        before = used_memory(url)
        producer = subprocess.Popen([os.path.join(BIN, "producer"), "enqueue", big, "--job", "peak", "--spec",
                                     peak_spec_path, "--redis", url, "--no-progress"], env=env,
                                    stdout=subprocess.DEVNULL)
        procs.append(producer)
        while redis_int(url, "EXISTS", "bf:{peak}:spec") == 0:
            time.sleep(0.05)
        procs.extend([worker("peak"), worker("peak")])
        sunk_done = lambda: sum(redis_int(url, "HGET", f"bf:{{peak:p{p}}}:sunk", "done") for p in range(4))
        peak = 0
        t0 = time.time()
        while sunk_done() < PEAK_RECORDS:
            peak = max(peak, used_memory(url) - before)
            if time.time() - t0 > 3600:
                raise SystemExit("the large job did not finish within an hour")
            time.sleep(0.2)
        producer.wait()
        after = used_memory(url) - before
        peak = max(peak, after)
        out = {
            "records": N,
            "batch_rows": BATCH_ROWS,
            "writers": WRITERS,
            "rows_written": rows,
            "ledger_rows_written": ledger_rows,
            "sink_rows_per_sec": round(sink_rate),
            "copy_rows_per_sec": round(copy_rate),
            "sink_vs_copy": round(sink_rate / copy_rate, 3),
            "sink_cpu_cores_busy": sink_cpu,
            "redis_bytes_per_queued_record": round((queued - base) / N),
            "redis_bytes_per_finished_record_result_in_redis": round((finished_in_redis - base) / N),
            "redis_bytes_per_finished_record_after_sink_calls_held": round((sunk_held - base) / N),
            "redis_bytes_per_finished_record_after_sink": round(per_finished),
            "large_job_records": PEAK_RECORDS,
            "large_job_peak_redis_mib": round(peak / 2**20, 1),
            "large_job_redis_mib_at_the_end": round(after / 2**20, 1),
            "projected_peak_redis_gib_10m_records": round((peak + (10_000_000 - PEAK_RECORDS) * per_finished) / 2**30, 2),
        }
        print(json.dumps(out, indent=2))
    finally:
        for p in procs:
            p.terminate()
            p.wait()
        sim.terminate()
        redis.terminate()
        stop_postgres(pg_dir)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Shared pieces of the Python benchmarks: free ports, a throwaway
redis-server and llm-sim on 127.0.0.1, llm-sim's /stats, what Redis says it
spent (`INFO` deltas; command time per script from SLOWLOG)."""
import hashlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# BF_BIN: another build's binaries (a before/after run of the same bench).
BIN = os.environ.get("BF_BIN") or os.path.join(ROOT, "target", "release")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start_redis(tmp):
    """A redis-server without persistence in a folder under tmp: (process, url)."""
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", tempfile.mkdtemp(dir=tmp)], stdout=subprocess.DEVNULL)
    for _ in range(100):
        if subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).returncode == 0:
            break
        time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}"


def redis_cli(url, *args):
    port = url.rsplit(":", 1)[1]
    return subprocess.run(["redis-cli", "-p", port, *args], capture_output=True, text=True, check=True).stdout


class Poll:
    """One connection for a poll repeated during a measure: `redis-cli` fed
    commands on its input asks the server for `COMMAND DOCS` as it starts
    (about 1 ms of Redis CPU each time), which a poll every 50 ms would add
    to the work measured."""

    def __init__(self, url):
        host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.replies = self.sock.makefile("rb")

    def ints(self, *commands):
        """Integer replies to inline commands, sent together."""
        self.sock.sendall("".join(c + "\r\n" for c in commands).encode())
        out = []
        for _ in commands:
            line = self.replies.readline()
            assert line.startswith(b":"), line
            out.append(int(line[1:]))
        return out

    def close(self):
        self.replies.close()
        self.sock.close()


def redis_info(url, section):
    out = redis_cli(url, "info", section)
    return dict(l.split(":", 1) for l in out.splitlines() if ":" in l and not l.startswith("#"))


def redis_cpu(url):
    """CPU seconds (user + system) the server has used so far."""
    i = redis_info(url, "cpu")
    return float(i["used_cpu_sys"]) + float(i["used_cpu_user"])


def redis_commands(url):
    """Commands processed so far, those scripts run inside included."""
    return int(redis_info(url, "stats")["total_commands_processed"])


def redis_reads(url):
    """Reads of a client's socket so far: the round trips the server served."""
    return int(redis_info(url, "stats")["total_reads_processed"])


def log_every_command(url):
    """From now on SLOWLOG keeps every command (with its time), emptied;
    read it with script_times. Costs Redis a little: for slow runs only."""
    redis_cli(url, "config", "set", "slowlog-log-slower-than", "0")
    redis_cli(url, "config", "set", "slowlog-max-len", "1000000")
    redis_cli(url, "slowlog", "reset")


# The scripts loaded after a prelude, as `RedisStore::connect` loads them.
PRELUDES = {"finish.lua": "counters.lua", "ledger.lua": "counters.lua",
            "limit_acquire.lua": "limit_free.lua", "limit_settle.lua": "limit_free.lua"}


def script_names():
    """{SHA1: script file name} of every script under
    common/src/store/scripts as it is now and, where git can tell, as every
    commit had it: another build's binaries (BF_BIN) run the scripts of
    their own commit."""
    rel = "common/src/store/scripts"
    folder = os.path.join(ROOT, rel)
    names = {}
    read = lambda f: open(os.path.join(folder, f), "rb").read()
    for f in os.listdir(folder):
        names[hashlib.sha1(read(f)).hexdigest()] = f
        # Loaded after its prelude (see redis_store.rs).
        if f in PRELUDES:
            names[hashlib.sha1(read(PRELUDES[f]) + read(f)).hexdigest()] = f
        path = f"{rel}/{f}"
        log = subprocess.run(["git", "-C", ROOT, "log", "--format=%H", "--", path],
                             capture_output=True, text=True)
        for commit in log.stdout.split() if log.returncode == 0 else []:
            old = subprocess.run(["git", "-C", ROOT, "show", f"{commit}:{path}"], capture_output=True)
            if old.returncode == 0:
                names.setdefault(hashlib.sha1(old.stdout).hexdigest(), f)
    return names


def script_times(url):
    """{script file name: (calls, microseconds of command time, median
    microseconds a call)} from SLOWLOG since log_every_command, a script
    known by the SHA1 of its source (how the store loads it; any version,
    see script_names). SLOWLOG's times are wall time: on a shared machine a
    call Redis was descheduled in counts its whole wait, which the median
    leaves out and the total does not."""
    names = script_names()
    out = redis_cli(url, "--json", "slowlog", "get", "1000000")
    each = {}
    for _id, _at, micros, cmd, *_ in json.loads(out):
        if cmd and cmd[0].lower() == "evalsha" and len(cmd) > 1:
            each.setdefault(names.get(cmd[1], cmd[1][:12]), []).append(micros)
    return {name: (len(t), sum(t), sorted(t)[len(t) // 2]) for name, t in each.items()}


def proc_cpu(pid):
    """CPU seconds (user + system) a running process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_sim(*args):
    """llm-sim on a free port: (process, http://address)."""
    p = subprocess.Popen([os.path.join(BIN, "llm-sim"), "--port", "0", *args], stdout=subprocess.PIPE, text=True)
    return p, p.stdout.readline().strip().removeprefix("llm-sim listening on ")


def write_records(path, n, prefix):
    """A dataset of n example records whose ids start with prefix."""
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"message_id": f"{prefix}{i}", "channel": "chat", "task_type": "classify",
                                "text": f"message number {i}: where is my order?"}) + "\n")


def sim_stats(addr):
    with urllib.request.urlopen(addr + "/stats") as r:
        return json.load(r)["stats"]


def stop_all(procs, *servers):
    """Drains the workers (SIGTERM, then waits for each), then stops the servers."""
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        p.wait()
    for s in servers:
        s.terminate()
        s.wait()

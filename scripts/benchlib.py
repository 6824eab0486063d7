"""Shared pieces of the Python benchmarks: free ports, a throwaway
redis-server and llm-sim on 127.0.0.1, llm-sim's /stats."""
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release")


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

#!/usr/bin/env python3
"""Benchmark data: N records of about 300 bytes for the example spec, and the
raw-baseline Redis protocol (SET NX EX + XADD per record) for redis-cli --pipe.

usage: gen_bench_data.py N DATASET.jsonl BASELINE.resp
"""
import hashlib
import json
import sys


def resp(*args: str) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def main() -> None:
    n, dataset, baseline = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    filler = "lorem ipsum dolor sit amet consectetur " * 4
    with open(dataset, "w") as d, open(baseline, "wb") as b:
        for i in range(n):
            rec = {
                "message_id": f"bench-{i:09d}",
                "channel": "email",
                "task_type": "classify" if i % 3 else "extract",
                "text": f"message {i}: " + filler[: 170 + i % 40],
                "received_at": "2026-11-29T10:00:00Z",
            }
            line = json.dumps(rec)
            d.write(line + "\n")
            rid = hashlib.sha256(rec["message_id"].encode()).hexdigest()
            p = int(rid[:16], 16) % 4
            tag = "{bench:p%d}" % p
            b.write(resp("SET", f"bf:{tag}:idem:{rid}", f"x:{i+1}", "NX", "EX", "604800"))
            b.write(resp("XADD", f"bf:{tag}:tasks", "*", "rid", rid, "input", line))


if __name__ == "__main__":
    main()

"""Drives `producer serve-batches` with the official `openai` SDK, as a user's
code would: the test (tests/tests/batches_api.rs) runs one phase at a time and
reads the JSON line each phase prints last.

    python3 batches_sdk.py PHASE   (BASE_URL, API_KEY, WORK_DIR in the environment)

Phases: submit (upload, create, the same create retried, the same key with
other parameters), wait (until the batch ends; its output), cancel (a batch
cancelled mid-way: its partial output and error file), invalid (a file with a
duplicate custom_id fails validation), isolation (another key sees nothing),
template (answers validated by a named template: the valid ones in the output
file, those that stay invalid in the error file with their reason), started
(a batch created and running), too_large (an upload over the server's
limit), pages (the batch list paged with limit and after).
"""

import json
import os
import sys
import time

import openai
from openai import OpenAI

client = OpenAI(base_url=os.environ["BASE_URL"], api_key=os.environ["API_KEY"], max_retries=0)
work = os.environ["WORK_DIR"]


def requests_file(name, n, first=0):
    path = os.path.join(work, name)
    with open(path, "w") as f:
        for i in range(first, first + n):
            body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": f"Say hello to number {i}"}]}
            f.write(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n")
    return path


def wait_until(batch_id, statuses, within=120):
    deadline = time.time() + within
    while time.time() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.3)
    raise SystemExit(f"batch {batch_id} did not reach {statuses}: {batch.status}")


def answered(batch_id, n, within=120):
    """Waits until n requests of the batch are answered."""
    deadline = time.time() + within
    while client.batches.retrieve(batch_id).request_counts.completed < n:
        assert time.time() < deadline, f"fewer than {n} requests answered"
        time.sleep(0.2)


def lines(file_id):
    if file_id is None:
        return []
    return [json.loads(l) for l in client.files.content(file_id).text.splitlines() if l.strip()]


def submit():
    path = requests_file("input.jsonl", int(os.environ.get("N", "30")))
    uploaded = client.files.create(file=open(path, "rb"), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == os.path.getsize(path), uploaded
    key = {"Idempotency-Key": "nightly-2026-12-05"}
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h",
        metadata={"run": "nightly"}, extra_headers=key)
    assert batch.status == "validating", batch
    again = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h",
        metadata={"run": "nightly"}, extra_headers=key)
    conflict = None
    try:
        client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h",
            metadata={"run": "other"}, extra_headers=key)
    except openai.ConflictError as e:
        conflict = e.status_code
    listed = [f.id for f in client.files.list(purpose="batch")]
    print(json.dumps({"batch": batch.id, "again": again.id, "conflict": conflict,
                      "file": uploaded.id, "file_listed": uploaded.id in listed}))


def wait():
    batch = wait_until(os.environ["BATCH"], {"completed", "failed", "expired", "cancelled"})
    out = lines(batch.output_file_id)
    err = lines(batch.error_file_id)
    ids = [l["custom_id"] for l in out]
    shapes = all(l["response"]["status_code"] == 200 and l["error"] is None
                 and l["response"]["body"]["object"] == "chat.completion"
                 and l["response"]["body"]["choices"][0]["message"]["content"] for l in out)
    listed = [b.id for b in client.batches.list(limit=1)]  # pages through, one at a time
    print(json.dumps({"status": batch.status, "counts": batch.request_counts.model_dump(),
                      "output_ids": ids, "errors": len(err), "shapes_ok": shapes,
                      "error_codes": sorted({l["error"]["code"] for l in err}),
                      "error_ids": [l["custom_id"] for l in err],
                      "usage_tokens": sum(l["response"]["body"]["usage"]["total_tokens"] for l in out),
                      "listed": batch.id in listed or batch.id in [b.id for b in client.batches.list()]}))


def running(name, n, first, window="24h"):
    """A batch of n requests uploaded, created, and answering (5 answers so far)."""
    path = requests_file(name, n, first=first)
    uploaded = client.files.create(file=open(path, "rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window=window)
    answered(batch.id, 5)
    return batch


def cancel():
    batch = running("big.jsonl", int(os.environ.get("N", "200")), 1000)
    cancelling = client.batches.cancel(batch.id)
    ended = wait_until(batch.id, {"cancelled", "completed"})
    out = lines(ended.output_file_id)
    err = lines(ended.error_file_id)
    print(json.dumps({"batch": batch.id, "cancelling": cancelling.status, "status": ended.status,
                      "output_ids": [l["custom_id"] for l in out],
                      "error_codes": sorted({l["error"]["code"] for l in err}),
                      "error_ids": [l["custom_id"] for l in err],
                      "total": ended.request_counts.total}))


def invalid():
    path = os.path.join(work, "dup.jsonl")
    body = {"messages": [{"role": "user", "content": "hi"}]}
    with open(path, "w") as f:
        for cid in ["a", "b", "a"]:
            f.write(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n")
    uploaded = client.files.create(file=open(path, "rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    ended = wait_until(batch.id, {"failed", "completed"})
    errors = [{"code": e.code, "line": e.line} for e in (ended.errors.data if ended.errors else [])]
    print(json.dumps({"status": ended.status, "errors": errors}))


def isolation():
    seen = None
    try:
        client.batches.retrieve(os.environ["BATCH"])
    except openai.NotFoundError as e:
        seen = e.status_code
    print(json.dumps({"retrieve": seen, "batches": len(list(client.batches.list()))}))


def template():
    path = requests_file("reviews.jsonl", int(os.environ.get("N", "24")), first=2000)
    uploaded = client.files.create(file=open(path, "rb"), purpose="batch")
    unknown = None
    try:
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                              completion_window="24h", metadata={"template": "sentimnet"})
    except openai.BadRequestError as e:
        unknown = e.body.get("message") if isinstance(e.body, dict) else str(e)
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"template": "sentiment"})
    ended = wait_until(batch.id, {"completed", "failed", "expired", "cancelled"})
    out = lines(ended.output_file_id)
    err = lines(ended.error_file_id)
    answers = [json.loads(l["response"]["body"]["choices"][0]["message"]["content"]) for l in out]
    print(json.dumps({"status": ended.status, "counts": ended.request_counts.model_dump(),
                      "unknown_template": unknown, "batch": batch.id,
                      "output_ids": [l["custom_id"] for l in out],
                      "answers": answers,
                      "error_ids": [l["custom_id"] for l in err],
                      "errors": [l["error"] for l in err]}))


def started():
    batch = running("long.jsonl", int(os.environ.get("N", "300")), 3000, window="1h")
    print(json.dumps({"batch": batch.id}))


def too_large():
    path = os.path.join(work, "huge.jsonl")
    with open(path, "w") as f:
        f.write("x" * int(os.environ["BYTES"]) + "\n")
    refused = None
    try:
        client.files.create(file=open(path, "rb"), purpose="batch")
    except openai.APIStatusError as e:
        refused = {"status": e.status_code, "code": e.code, "message": e.message}
    print(json.dumps({"refused": refused, "files": [f.id for f in client.files.list()]}))


def pages():
    everything = [b.id for b in client.batches.list(limit=100)]
    first = client.batches.list(limit=2)
    seen, page, has_more = [], first, [first.has_more]
    while True:
        seen += [b.id for b in page.data]
        if not page.has_more:
            break
        page = client.batches.list(limit=2, after=page.data[-1].id)
        has_more.append(page.has_more)
    created = [client.batches.retrieve(b).created_at for b in seen]
    print(json.dumps({"all": everything, "paged": seen, "has_more": has_more,
                      "newest_first": created == sorted(created, reverse=True)}))


{"submit": submit, "wait": wait, "cancel": cancel, "invalid": invalid, "isolation": isolation,
 "template": template, "started": started, "too_large": too_large, "pages": pages}[sys.argv[1]]()

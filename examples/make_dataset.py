#!/usr/bin/env python3
"""Writes a synthetic dataset of customer messages (no real customer data).

usage: make_dataset.py [N] [SEED] [--bad] > dataset.jsonl
Deterministic for a given N and SEED. Every record has a unique message_id.
With --bad, a few deliberately broken lines are mixed in (one of each kind the
producer drops), so a demo shows how bad input is reported and counted.
"""
import json
import random
import sys

TOPICS = {
    "billing": ["I was charged twice for order {o}.", "My invoice for {o} shows the wrong VAT.",
                "Why did my card get declined when paying for {o}?"],
    "shipping": ["Order {o} has not arrived after two weeks.", "The tracking for {o} stopped updating.",
                 "Can I change the delivery address of {o}?"],
    "bug": ["The checkout button does nothing on the {p} page.", "Your app crashes when I open {p}.",
            "Search returns nothing for {p}."],
    "feature_request": ["Please add dark mode to the app.", "Could you support gift wrapping for {p}?",
                        "I would love a wishlist I can share."],
    "account": ["I cannot reset my password.", "Please delete my account and my data.",
                "How do I change the email on my account?"],
    "other": ["Do you have a store in Lyon?", "Thanks, the {p} is great!", "Who makes the {p}?"],
}
PRODUCTS = ["kettle", "desk lamp", "rain jacket", "blender", "bike light", "yoga mat"]
CHANNELS = ["email", "chat", "phone", "web form"]
# Broken lines written after the record with this index (with --bad).
BAD_AFTER = {
    99: "",                                                        # blank: ignored
    199: '{"message_id": "msg-bad-1", "text": "unterminated',      # malformed_json
    299: '["not", "an", "object"]',                               # not_object
    399: '{"channel": "chat", "task_type": "classify", "text": "no id"}',  # missing_id
    499: '{"message_id": "msg-7-0000010", "channel": "chat", "task_type": "classify", "text": "dup"}',  # duplicate_id
    599: '{"message_id": "msg-bad-2", "channel": "chat", "task_type": "classify", "text": ""}',  # template_missing:text
}


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    bad = "--bad" in sys.argv
    n = int(args[0]) if len(args) > 0 else 1200
    seed = int(args[1]) if len(args) > 1 else 7
    rng = random.Random(seed)
    out = sys.stdout
    for i in range(n):
        topic = rng.choice(list(TOPICS))
        text = rng.choice(TOPICS[topic]).format(o=f"A{rng.randrange(10**6):06d}", p=rng.choice(PRODUCTS))
        record = {
            "message_id": f"msg-{seed}-{i:07d}",
            "channel": rng.choice(CHANNELS),
            "task_type": "extract" if rng.random() < 0.3 else "classify",
            "text": text,
            "received_at": f"2026-11-{1 + i % 28:02d}T{rng.randrange(24):02d}:{rng.randrange(60):02d}:00Z",
        }
        out.write(json.dumps(record) + "\n")
        if bad and i in BAD_AFTER:
            out.write(BAD_AFTER[i] + "\n")


if __name__ == "__main__":
    main()

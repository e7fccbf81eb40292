"""Helpers shared by the simulation and planner tests: small seeded traces, the Mooncake trace paths, trace
files, and the experiment sub-commands run without the rest of the CLI."""
from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

import pytest

from tiers.cli import experiments as cli_experiments
from tiers.sim.trace import Trace, from_requests

TRACE_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "traces"

# Five requests worked by hand in test_sim.py (512-token blocks).
HAND_REQUESTS = [
    (0, 1200, [1, 2, 3]),
    (1, 1100, [1, 2, 4]),
    (2, 600, [5, 6]),
    (3, 1500, [1, 2, 3]),
    (4, 512, [5]),
]


def conversation_like(seed: int = 2024, requests: int = 300, conversations: int = 12) -> Trace:
    """Multi-turn chats: each turn resends the chat so far plus a few new blocks (seeded)."""
    rng = random.Random(seed)
    lengths = [0] * conversations
    rows = []
    for number in range(requests):
        chat = min(int(rng.paretovariate(1.2)) - 1, conversations - 1)
        lengths[chat] = min(lengths[chat] + rng.randint(1, 3), 40)
        blocks = [chat * 1000 + i for i in range(lengths[chat])]
        tokens = len(blocks) * 512 - rng.randint(0, 511)
        rows.append((number * 10, tokens, blocks))
    return from_requests(rows)


def mooncake_trace(name: str) -> str:
    """Path of a stored Mooncake trace, or skip the test saying where it was looked for."""
    path = TRACE_DIR / f"{name}_trace.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not found (the shared Mooncake traces are not beside this checkout)")
    return os.fspath(path)


CONVERSATION_SLICE = (4100, 4300)  # requests of the conversation trace with some reuse inside the slice


def write_jsonl(path, requests):
    """Write (timestamp, input_length, hash_ids) tuples as a Mooncake trace."""
    with open(path, "w") as handle:
        for ts, length, ids in requests:
            handle.write(json.dumps({"timestamp": ts, "input_length": length, "output_length": 7, "hash_ids": ids}) + "\n")
    return str(path)


def write_trace_jsonl(path, trace):
    """Write a Trace back as a Mooncake trace (its dense block ids as hash ids: read back, the same trace)."""
    keys, offsets = trace.keys.tolist(), trace.offsets.tolist()
    return write_jsonl(path, [(int(trace.timestamps[r]), int(trace.input_lengths[r]), keys[offsets[r]:offsets[r + 1]])
                              for r in range(trace.n_requests)])


def shared_prefix_trace(seed: int = 5, requests: int = 250) -> Trace:
    """System prompts, growing chats, hot blocks after fresh ones (non-leading hits), repeats (seeded)."""
    rng = random.Random(seed)
    systems = [[s * 100 + i for i in range(rng.randint(1, 4))] for s in range(6)]
    hot = [900_000 + i for i in range(8)]
    chats = {}
    fresh = iter(range(1_000_000, 2_000_000))
    rows = []
    for number in range(requests):
        chat = rng.randrange(25)
        history = chats.setdefault(chat, rng.choice(systems)[:])
        history.extend(next(fresh) for _ in range(rng.randint(1, 3)))
        del history[30:]
        blocks = history[:] + [next(fresh) for _ in range(rng.randint(0, 3))]
        if rng.random() < 0.3:  # a pasted document after new text: held, but not in the leading run
            blocks.insert(rng.randint(len(blocks) // 2, len(blocks)), rng.choice(hot))
        if rng.random() < 0.05:  # the same block twice in one request
            blocks.append(blocks[rng.randrange(len(blocks))])
        rows.append((number, len(blocks) * 16 - rng.randint(0, 15), blocks))
    return from_requests(rows, block_tokens=16, name="shared-prefix")


def conversation_slice() -> Trace:
    path = mooncake_trace("conversation")
    with open(path, encoding="utf-8") as handle:
        lines = handle.readlines()[slice(*CONVERSATION_SLICE)]
    rows = [json.loads(line) for line in lines]
    return from_requests([(r["timestamp"], r["input_length"], r["hash_ids"]) for r in rows], name="conversation")


def run_experiments(argv):
    """Parse argv with only this module's sub-commands registered and run it."""
    parser = argparse.ArgumentParser(prog="hicache-tiers")
    cli_experiments.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture
def hand_trace(tmp_path):
    """The hand-worked five-request trace as a JSONL file."""
    path = tmp_path / "hand.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 1, "hash_ids": ids}) + "\n"
                            for t, n, ids in HAND_REQUESTS))
    return str(path)

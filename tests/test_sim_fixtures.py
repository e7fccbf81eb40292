"""Helpers shared by the simulation tests (no tests here): small seeded traces and the Mooncake trace paths."""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from tiers.sim.trace import Trace, from_requests

TRACE_DIR = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "traces"

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

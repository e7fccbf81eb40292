"""Cache capacities written with an explicit unit: ``3Mt`` (tokens) or ``100kb`` (blocks)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List

SYNTAX = ("NUMBER[k|M|G]UNIT, UNIT one of t/tokens or b/blocks (k=1e3, M=1e6, G=1e9): "
          "3Mt = 3 million tokens, 100kb = 100,000 blocks; tokens become whole blocks (rounded down)")
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKMG]?)\s*(t|tok|tokens?|b|blk|blocks?)\s*$")
_SCALE = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9}
DEFAULT_CAPACITIES = "1Mt,3Mt,10Mt,30Mt,50Mt,100Mt"


@dataclass(frozen=True)
class Capacity:
    """A cache size as written and in blocks."""

    label: str
    blocks: int


def parse_capacity(text: str, block_tokens: int) -> Capacity:
    """One capacity (ValueError naming the syntax when the unit is missing or unknown)."""
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    match = _PATTERN.match(text)
    if not match:
        raise ValueError(f"bad capacity {text!r}: expected {SYNTAX}")
    number, scale, unit = match.groups()
    amount = float(number) * _SCALE[scale]
    blocks = amount / block_tokens if unit.startswith("t") else amount
    return Capacity(label=text.strip(), blocks=int(blocks + 1e-9))


def parse_capacities(text: str, block_tokens: int) -> List[Capacity]:
    """A comma-separated list of capacities, in the order given."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"no capacity given: expected {SYNTAX}")
    return [parse_capacity(p, block_tokens) for p in parts]

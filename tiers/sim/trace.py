"""Mooncake request traces (JSONL: timestamp, input_length, output_length, hash_ids) as arrays."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, List, Sequence

import numpy as np

DEFAULT_BLOCK_TOKENS = 512


@dataclass
class Trace:
    """Requests in arrival order with their prefix blocks flattened into one access sequence.

    ``keys[offsets[r]:offsets[r + 1]]`` are request r's block ids, dense
    integers 0..n_keys-1 (each file's hash ids namespaced, then renumbered in
    order of first appearance).
    """

    timestamps: np.ndarray  # int64 per request, ms
    input_lengths: np.ndarray  # int64 per request, tokens
    offsets: np.ndarray  # int64, n_requests + 1
    keys: np.ndarray  # int64 per access
    n_keys: int
    block_tokens: int
    names: List[str]

    @property
    def n_requests(self) -> int:
        """Number of requests."""
        return len(self.input_lengths)

    @property
    def n_accesses(self) -> int:
        """Number of block accesses (sum of the requests' block counts)."""
        return len(self.keys)

    def parents(self) -> np.ndarray:
        """Per access, the previous block of the same request (-1 for a request's first block)."""
        parents = np.empty_like(self.keys)
        parents[1:] = self.keys[:-1]
        parents[self.offsets[:-1][np.diff(self.offsets) > 0]] = -1
        return parents

    def block_tokens_per_access(self) -> np.ndarray:
        """Per access, the request's tokens in that block (block_tokens, less for a partial last block)."""
        counts = np.diff(self.offsets)
        request = np.repeat(np.arange(self.n_requests), counts)
        index = np.arange(self.n_accesses) - self.offsets[:-1][request]
        tokens = self.input_lengths[request] - index * self.block_tokens
        return np.clip(tokens, 0, self.block_tokens)


FIELDS = ("timestamp", "input_length", "hash_ids")


def _read_one(path: str) -> tuple:
    """(timestamps, input_lengths, hash id lists) of one JSONL file; a bad line is named with its number."""
    timestamps, lengths, blocks = [], [], []
    with open(path, "r", encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: not JSON ({exc.args[0] if exc.args else exc})") from None
            problem = _line_problem(row)
            if problem:
                raise ValueError(f"{path}:{number}: not a Mooncake trace line: {problem}")
            timestamps.append(int(row["timestamp"]))
            lengths.append(int(row["input_length"]))
            blocks.append(row["hash_ids"])
    if not timestamps:
        raise ValueError(f"{path}: no requests (the file is empty or blank)")
    return timestamps, lengths, blocks


def _line_problem(row) -> str:
    """What is wrong with one decoded trace line, or '' when nothing is."""
    if not isinstance(row, dict):
        return f"expected an object with {', '.join(FIELDS)}, got {type(row).__name__}"
    missing = [f for f in FIELDS if f not in row]
    if missing:
        return f"missing {', '.join(missing)}"
    for field in ("timestamp", "input_length"):
        if isinstance(row[field], bool) or not isinstance(row[field], (int, float)) or row[field] < 0:
            return f"{field} must be a number >= 0, got {row[field]!r}"
    ids = row["hash_ids"]
    if not isinstance(ids, list) or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in ids):
        return "hash_ids must be a list of integers >= 0"
    return ""


def from_requests(requests: Sequence[tuple], block_tokens: int = DEFAULT_BLOCK_TOKENS, name: str = "inline") -> Trace:
    """Build a trace from (timestamp, input_length, hash_ids) tuples (tests, synthetic inputs)."""
    timestamps = [r[0] for r in requests]
    lengths = [r[1] for r in requests]
    blocks = [list(r[2]) for r in requests]
    return _assemble([(timestamps, lengths, blocks)], block_tokens, [name])


def read_traces(paths: Iterable[str], block_tokens: int = DEFAULT_BLOCK_TOKENS) -> Trace:
    """Read one or more Mooncake JSONL traces into one trace; hash ids are namespaced per file."""
    paths = list(paths)
    if not paths:
        raise ValueError("no trace files given")
    return _assemble([_read_one(p) for p in paths], block_tokens, paths)


def _assemble(parts: List[tuple], block_tokens: int, names: List[str]) -> Trace:
    """Merge per-file requests by timestamp (stable: file order breaks ties) and renumber keys."""
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    all_ts, all_len, all_counts, all_ids = [], [], [], []
    for file_index, (timestamps, lengths, blocks) in enumerate(parts):
        counts = np.fromiter((len(b) for b in blocks), dtype=np.int64, count=len(blocks))
        ids = np.fromiter((k for b in blocks for k in b), dtype=np.int64, count=int(counts.sum()))
        # namespace: (file index, hash id) -> one int64, made dense below
        all_ids.append(ids * len(parts) + file_index)
        all_ts.append(np.asarray(timestamps, dtype=np.int64))
        all_len.append(np.asarray(lengths, dtype=np.int64))
        all_counts.append(counts)
    timestamps = np.concatenate(all_ts) if all_ts else np.zeros(0, np.int64)
    lengths = np.concatenate(all_len) if all_len else np.zeros(0, np.int64)
    counts = np.concatenate(all_counts) if all_counts else np.zeros(0, np.int64)
    ids = np.concatenate(all_ids) if all_ids else np.zeros(0, np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    order = np.argsort(timestamps, kind="stable")
    if len(parts) > 1 or np.any(order != np.arange(len(order))):
        ids = np.concatenate([ids[starts[r]:starts[r] + counts[r]] for r in order]) if len(order) else ids
        timestamps, lengths, counts = timestamps[order], lengths[order], counts[order]
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    uniques, first_seen, dense = np.unique(ids, return_index=True, return_inverse=True)
    rank = np.empty(len(uniques), dtype=np.int64)
    rank[np.argsort(first_seen, kind="stable")] = np.arange(len(uniques))
    keys = rank[dense.reshape(-1)] if len(ids) else np.zeros(0, np.int64)
    return Trace(timestamps=timestamps, input_lengths=lengths, offsets=offsets, keys=keys.astype(np.int64),
                 n_keys=len(uniques), block_tokens=block_tokens, names=list(names))

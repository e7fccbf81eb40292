"""Reads that land in registered chunks first (every read unless direct_reads).

A Transfer Engine read cannot be cancelled: one given up at its deadline
may still complete. So a page is read into landing chunks (tiers/stores/remote/
staging.py ``Landing``) and copied into the caller's buffers only when its
transfer completed in time; chunks under a transfer given up stay held
until the engine reports it ended.
"""
from __future__ import annotations

import time
from typing import List, Optional, Sequence, Tuple

from tiers.shm.buffers import scatter_copy
from tiers.stores.remote.engine import Engine, abandoned_batches, abandoned_groups, pair_extents
from tiers.stores.remote.staging import Landing


def read_landed(landing: Landing, engine: Engine, segment: str, remote, size: int,
                dst: Optional[Sequence[memoryview]], timeout: float) -> Optional[bytes]:
    """One page through the landing chunks: its bytes (b"" once copied into dst), None on a miss."""
    chunks = landing.take(size, timeout)
    if chunks is None:
        return None
    abandoned: List[Tuple[int, int]] = []
    try:
        if not engine.transfer(segment, False, pair_extents(landing.extents(chunks, size), remote), timeout, abandoned):
            return None
        landed = landing.views(chunks, size)
        if dst is None:
            return b"".join(landed)
        scatter_copy(dst, landed)
        return b""
    finally:
        if abandoned:
            landing.hold(chunks, abandoned_batches(abandoned))
        else:
            landing.give(chunks)


def land_pages(landing: Landing, engine: Engine, grant, moving: List[int], views: List[List[memoryview]],
               out: List[bool], timeout: float, deadline: Optional[float]) -> None:
    """Read a located batch's pages moving into landing chunks, in waves of as many as fit; set out[k] for each
    page copied into views[k].

    A page is copied only when its transfer completed and the request's
    deadline (Unix seconds) has not passed; the engine-side client waits
    deadlines.margin longer, so the copy fits in it.
    """
    end = time.monotonic() + timeout
    todo = list(moving)
    while todo and time.monotonic() < end:
        wave: List[Tuple[int, List[int]]] = []
        while todo:
            k = todo[0]
            chunks = (landing.take(grant.sizes[k], 0.0) if wave else
                      landing.take(grant.sizes[k], end - time.monotonic()))
            if chunks is None:
                break
            wave.append((k, chunks))
            todo.pop(0)
        if not wave:
            return  # no room before the deadline (held chunks, or a page larger than the landing): misses
        abandoned: List[Tuple[int, int]] = []

        def arrived(done: List[int], wave=wave) -> None:  # copied while the rest of the wave is still moving
            for i in done:
                k, chunks = wave[i]
                if deadline is None or time.time() < deadline:
                    scatter_copy(views[k], landing.views(chunks, grant.sizes[k]))
                    out[k] = True
        engine.transfer_pages(
            grant.segment, False,
            [pair_extents(landing.extents(chunks, grant.sizes[k]), grant.extents[k]) for k, chunks in wave],
            end - time.monotonic(), abandoned, arrived)
        held = set()
        for pages, batches in abandoned_groups(abandoned):  # chunks a given-up transfer may still write
            landing.hold([chunk for i in pages for chunk in wave[i][1]], batches)
            held.update(pages)
        for i, (k, chunks) in enumerate(wave):
            if i not in held:
                landing.give(chunks)

"""Lookups across a chain of tiers: the top tier first, the others at once for what it lacks, answered as soon as
the keys are covered."""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence

from tiers.wire import protocol as P
from tiers.wire.client import TierClient
from tiers.wire.fanout import FanOut


# How long a lookup covered by lower tiers waits for the replies of faster tiers still out.  Their
# answer decides where each page is read from (the fastest holder); without it a lower tier that
# happened to answer first would serve pages DRAM holds.  Bounded: a frozen faster tier costs a
# lookup this much, once.
FASTER_TIER_GRACE_S = 0.010
# The top tier is asked alone first and given this long: when it holds every key (the common case on
# a warm node) no other daemon is woken.  On the real server, asking DRAM, NVMe and remote at once
# took 3-7 ms of a 512-token L3 hit's ~15 ms wait (three daemons woken on two cores) against
# 0.3-0.9 ms here without it (docs/PERFORMANCE.md).  A top tier that is slow or frozen costs this much.
TOP_TIER_HEAD_START_S = 0.002


def lookup_all(clients: Sequence[TierClient], keys: List[str],
               head_start: float = TOP_TIER_HEAD_START_S) -> List[Optional[bytes]]:
    """Ask the top tier (its page directory first, where it hands one out), then, unless it held every key
    within head_start, every other tier at once (head_start 0: every tier at once, the directory not
    looked at); held flags or None per tier (None also for a tier not asked).

    Returns as soon as the tiers that replied hold every key between them and
    no faster tier is still out (or FASTER_TIER_GRACE_S after the keys were
    covered): a slow or frozen lower tier never delays a lookup the tiers
    above answer alone (its late reply is skipped by id on that socket's next
    call).
    """
    n = len(keys)
    results: List[Optional[bytes]] = [None] * len(clients)
    out = set()  # tiers asked that have not answered
    fan = FanOut()
    digests = _packed_digests(clients, keys)
    # head_start 0 asks for every tier's answer: the directory alone does not give it.
    direct = _all_in_directory(clients[0], keys, digests.get(clients[0].namespace)) if head_start > 0 else None
    if direct is not None:
        results[0] = direct
        return results

    def ask(i: int) -> None:
        def answered(flags: Optional[bytes]) -> None:
            out.discard(i)
            results[i] = flags
        out.add(i)
        fan.add(clients[i].start_lookup(keys, digests.get(clients[i].namespace), answered))

    def covered() -> bool:
        return merge_held(results, n) == b"\x01" * n

    def settled() -> bool:
        """The tiers that replied hold every key and no faster tier is still out."""
        if not covered():
            return False
        deepest = max(i for i, flags in enumerate(results) if flags is not None)
        return not any(i < deepest for i in out)

    ask(0)
    if len(clients) == 1:
        fan.wait()
        return results
    if head_start > 0:
        fan.wait(stop_at=time.monotonic() + head_start)
        if results[0] == b"\x01" * n:
            return results
    for i in range(1, len(clients)):
        ask(i)
    fan.wait(done=covered)
    if not settled():  # covered, and a faster tier is still out: its answer decides where each page is read
        fan.wait(done=settled, stop_at=time.monotonic() + FASTER_TIER_GRACE_S)
    return results


def _all_in_directory(client: TierClient, keys: List[str], digests: Optional[bytes]) -> Optional[bytes]:
    """The held flags from the tier's page directory (tiers/shm/directory.py) when it holds every key (no
    daemon need be asked), else None."""
    held = client.held_direct(keys, digests)
    return held if held is not None and held == b"\x01" * len(keys) else None


def _packed_digests(clients: Sequence[TierClient], keys: List[str]) -> Dict[str, bytes]:
    """The keys' packed digests for each namespace of the clients whose tiers take them, hashed once each
    (a node's tiers usually serve one namespace: one native call for the whole lookup)."""
    out: Dict[str, bytes] = {}
    for client in clients:
        if client.answers_digests and client.namespace not in out:
            out[client.namespace] = P.pack_key_digests(client.namespace, keys)
    return out


def per_tier_held(clients: Sequence[TierClient], keys: List[str]) -> List[Optional[bytes]]:
    """Each tier's held flags (None where it did not answer); one tier is asked directly."""
    if len(clients) == 1:
        direct = _all_in_directory(clients[0], keys, None)
        return [direct if direct is not None else clients[0].lookup(keys)]
    return lookup_all(clients, keys)


def merge_held(per_tier: Sequence[Optional[bytes]], n: int) -> bytes:
    """One byte per key: 1 when some tier holds it (a tier that does not answer holds nothing)."""
    answered = [flags for flags in per_tier if flags is not None]
    if not answered:
        return bytes(n)
    if len(answered) == 1:
        return answered[0]
    # Flags are 0/1 bytes: an integer OR of the whole arrays is one C-level pass.
    merged = 0
    for flags in answered:
        merged |= int.from_bytes(flags, "little")
    return merged.to_bytes(n, "little")

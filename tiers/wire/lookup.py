"""Lookups across a chain of tiers: the top tier first, the others at once for what it lacks, answered as soon as
the keys are covered."""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence

import zmq

from tiers.wire import held_wait
from tiers.wire import protocol as P
from tiers.wire.client import TierClient


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
    """Ask the top tier, then, unless it held every key within head_start, every other tier at once
    (head_start 0: every tier at once); held flags or None per tier (None also for a tier not asked).

    Returns as soon as the tiers that replied hold every key between them and
    no faster tier is still out (or FASTER_TIER_GRACE_S after the keys were
    covered): a slow or frozen lower tier never delays a lookup the tiers
    above answer alone (its late reply is skipped by id on that socket's next
    call).
    """
    results: List[Optional[bytes]] = [None] * len(clients)
    waiting = {}
    full = b"\x01" * len(keys)
    digests = _packed_digests(clients, keys)
    sent = clients[0].start_lookup(keys, digests.get(clients[0].namespace))
    reply = clients[0].quick_lookup_reply(sent) if sent is not None else None
    if reply is not None:  # the top tier answered within the reply spin (tiers/wire/held_wait.py)
        results[0] = clients[0].lookup_reply(reply, keys)
        if len(clients) == 1 or results[0] == full:
            return results
    elif sent is not None:
        waiting[0] = sent
        if len(clients) == 1:
            _gather(clients, keys, results, waiting, None)
            return results
        if head_start > 0:
            _gather(clients, keys, results, waiting, time.monotonic() + head_start)
            if results[0] == full:
                return results
    for i, client in enumerate(clients[1:], start=1):
        sent = client.start_lookup(keys, digests.get(client.namespace))
        if sent is not None:
            waiting[i] = sent
    _held_gather(clients, keys, results, waiting)
    if waiting and not _answered(results, waiting, len(keys)):
        _gather(clients, keys, results, waiting, None)
    return results


def _packed_digests(clients: Sequence[TierClient], keys: List[str]) -> Dict[str, bytes]:
    """The keys' packed digests for each namespace of the clients whose tiers take them, hashed once each
    (a node's tiers usually serve one namespace: one native call for the whole lookup)."""
    out: Dict[str, bytes] = {}
    for client in clients:
        if client.answers_digests and client.namespace not in out:
            out[client.namespace] = P.pack_key_digests(client.namespace, keys)
    return out


def _answered(results: List[Optional[bytes]], waiting: dict, n: int) -> bool:
    """The tiers that replied hold every key and no faster tier is still out."""
    if merge_held(results, n) != b"\x01" * n:
        return False
    deepest = max(i for i, r in enumerate(results) if r is not None)
    return not any(i < deepest for i in waiting)


def _held_gather(clients: Sequence[TierClient], keys: List[str], results: List[Optional[bytes]],
                 waiting: dict) -> None:
    """The replies of the tiers in waiting that come within the reply spin, waited for holding the GIL
    (tiers/wire/held_wait.py: in a busy engine each release of the GIL costs a scheduler iteration);
    stops early once the keys are answered.  What is still out stays in waiting."""
    spin = min((clients[i].deadlines.reply_spin for i in waiting), default=0.0)
    held = held_wait.shared() if spin > 0 else None
    if held is None:
        return
    until = time.monotonic() + spin
    while waiting and time.monotonic() < until:
        for i in list(waiting):
            sock, req_id, _end = waiting[i]
            reply = clients[i].held_reply(sock, req_id, time.monotonic(), held)  # one look, no wait
            if reply is not None:
                del waiting[i]
                results[i] = clients[i].lookup_reply(reply, keys)
        if _answered(results, waiting, len(keys)):
            return


def _gather(clients: Sequence[TierClient], keys: List[str], results: List[Optional[bytes]], waiting: dict,
            stop_at: Optional[float]) -> None:
    """Collect replies of the tiers in waiting into results until none is out, the keys are covered
    (with the grace for faster tiers), or stop_at (time.monotonic()) when given; waiting keeps what
    is still out."""
    full = b"\x01" * len(keys)
    covered_until: Optional[float] = None  # the grace for faster tiers' replies, once the keys are covered
    while waiting:
        now = time.monotonic()
        give_up = min(p[2] for p in waiting.values())
        if covered_until is not None:
            give_up = min(give_up, covered_until)
        if stop_at is not None:
            if now >= stop_at:
                return
            give_up = min(give_up, stop_at)
        poller = zmq.Poller()
        for i, (sock, _id, _end) in waiting.items():
            poller.register(sock, zmq.POLLIN)
        ready = dict(poller.poll(max(0, int((give_up - now) * 1000)) + 1))
        for i in list(waiting):
            sock, req_id, end = waiting[i]
            if sock in ready:
                reply = clients[i].poll_reply(sock, req_id)
                if reply is None:
                    continue  # a stale reply to an earlier call was skipped
                del waiting[i]
                results[i] = clients[i].lookup_reply(reply, keys)
            elif time.monotonic() >= end:
                del waiting[i]
                clients[i].give_up(sock, "lookup")
        if merge_held(results, len(keys)) == full:  # the tiers that replied cover every key
            deepest = max(i for i, r in enumerate(results) if r is not None)
            if not any(i < deepest for i in waiting):
                return
            if covered_until is None:
                covered_until = time.monotonic() + FASTER_TIER_GRACE_S
            elif time.monotonic() >= covered_until:
                return


def per_tier_held(clients: Sequence[TierClient], keys: List[str]) -> List[Optional[bytes]]:
    """Each tier's held flags (None where it did not answer); one tier is asked directly."""
    if len(clients) == 1:
        return [clients[0].lookup(keys)]
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

"""What the remote tier's safety tests share: a pool daemon and a store beside it, a pool frozen mid-read, and
staging the caller holds on request.

A RemoteStore reads into memory its caller can keep out of use (the tier
daemon's staging, tiers/shm/arena.py ``hold_blocks``); a read given up at
its deadline asks the caller to hold each page it may still write.  The pool
is frozen (SIGSTOP) right after it answered the read's ``locate``, so the
read's transfers hang until the test thaws it.
"""
from __future__ import annotations

import mmap
from contextlib import contextmanager
from typing import Iterator, List, Optional

from tiers.shm.arena import hold_blocks
from tiers.ops.node_runner import NodeRunner
from tiers.shm.arena import BlockArena
from tiers.shm.buffers import address_of
from tiers.stores.remote.engine import Engine, EngineConfig
from tiers.stores.remote.loopback import free_ports, pool_config
from tiers.stores.remote.store import RemoteStore
from tests.support.nodes import eventually, freeze


@contextmanager
def pool_and_store(tmp, pool_options: dict, store_options: dict, host_bytes: int, page_bytes: int):
    """A pool daemon on loopback (pool_config's options) and, in this process, an engine, a RemoteStore on it
    (store_options) and a registered host buffer of host_bytes: (pool, store, the buffer's view)."""
    (port,) = free_ports(1)
    pool = NodeRunner(pool_config([port], **pool_options), str(tmp / "run"), str(tmp / "data"))
    pool.start()
    store = None
    try:
        engine = Engine(EngineConfig(hostname="127.0.0.1"))
        store = RemoteStore([f"tcp://127.0.0.1:{port}"], engine, pool_timeout=0.5, retry_max=0.2, **store_options)
        view = memoryview(mmap.mmap(-1, host_bytes))
        store.region_mapped(view)
        assert eventually(lambda: store._registrations.covers(address_of(view), page_bytes), 10)
        yield pool, store, view
    finally:
        if store is not None:
            store.close()
        pool.stop()


def freeze_after(store, pid: int, call: str) -> None:
    """Freeze the pool right after it answered the store's next call (``locate``: a read's transfers then hang;
    ``alloc``: a put's)."""
    client = store._pools.clients()[0]
    original = getattr(client, call)

    def answered_then_frozen(*args, **kwargs):
        grant = original(*args, **kwargs)
        freeze(pid)  # stopped before the transfers start
        setattr(client, call, original)
        return grant
    setattr(client, call, answered_then_frozen)


class HeldStaging:
    """A staging arena registered with the store, one allocation a key, the positions the store asked to hold."""

    def __init__(self, store, nbytes: int, block_size: int, page_bytes: int, keys: List[str], name: str):
        self.store, self.keys, self.page_bytes = store, keys, page_bytes
        self.arena = BlockArena(nbytes, block_size, name, prefault=False)
        self.held: List[int] = []
        self.allocs = []
        store.region_mapped(self.arena.view)

    def ready(self) -> None:
        assert eventually(lambda: self.store._registrations.covers(address_of(self.arena.view), self.page_bytes), 10)
        self.allocs = [self.arena.take(self.page_bytes) for _ in self.keys]
        assert all(a is not None for a in self.allocs)

    def _hold(self, position: int):
        self.held.append(position)
        return hold_blocks(self.arena, [self.allocs[position]])

    def read(self, deadline: Optional[float] = None) -> List[Optional[int]]:
        """Zero the staging, read the keys into it holding what is given up: each page's checksum or None."""
        for alloc in self.allocs:
            for v in self.arena.views(alloc):
                v[:] = b"\0" * v.nbytes
        return self.store.get_many_into_with_sums([("ns", k) for k in self.keys],
                                                  [self.arena.views(a) for a in self.allocs], deadline, self._hold)

    def pages(self) -> List[bytes]:
        return [b"".join(bytes(v) for v in self.arena.views(a)) for a in self.allocs]

    def give_back(self) -> None:
        """The engine moved on: the daemon gives its staging back (parked while a given-up transfer may write)."""
        for alloc in self.allocs:
            self.arena.give(alloc)

    def all_blocks(self) -> int:
        return self.arena.size // self.arena.block_size


@contextmanager
def held_staging(store, nbytes: int, block_size: int, page_bytes: int, keys: List[str],
                 name: str) -> Iterator[HeldStaging]:
    staging = HeldStaging(store, nbytes, block_size, page_bytes, keys, name)
    try:
        staging.ready()
        yield staging
    finally:
        store.region_unmapped(staging.arena.view)
        staging.arena.close()

"""Batch chunk files in the NVMe tests: 64 KiB pages, their records, puts and reads of a store, its files on disk."""
from __future__ import annotations

import os
import random
import time
from contextlib import contextmanager

from tiers.stores.nvme import NvmeStore, batch
from tiers.stores.nvme.chunkfile import HEADER_SIZE

PAGE = 64 << 10
RECORD = HEADER_SIZE + PAGE  # a 64 KiB page's record: aligned already


def page(seed: int, size: int = PAGE) -> bytes:
    return random.Random(seed).randbytes(size)


def batch_files(root) -> list:
    top = os.path.join(root, batch.TOP)
    return sorted(os.path.join(d, f) for d, _s, files in os.walk(top) for f in files) if os.path.isdir(top) else []


def disk_bytes(root) -> int:
    """Bytes the file system gives the store's files (holes excluded)."""
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _s, files in os.walk(root) for f in files
               if f not in ("LOCK", "usage.ceiling", "index.snapshot"))  # the chunks, not the store's own files


def put_batch(store, names, seeds):
    keys = [("ns", n) for n in names]
    out = store.put_many(keys, [[memoryview(page(s))] for s in seeds], [None] * len(keys), time.time() + 30)
    assert out == [None] * len(keys), out
    return keys


def read_all(store, keys):
    outs = [bytearray(PAGE) for _ in keys]
    found = store.get_many_into(keys, [[memoryview(o)] for o in outs], time.time() + 30)
    return found, [bytes(o) for o in outs]


@contextmanager
def store_maker(root, capacity: int, **defaults):
    """make(capacity=capacity, **options): NvmeStores on root (each call's options over defaults), every one
    closed at the end."""
    stores = []

    def make(capacity=capacity, **kw):
        store = NvmeStore(str(root), capacity, **{**defaults, **kw})
        stores.append(store)
        return store
    try:
        yield make
    finally:
        for store in stores:
            store.close()

"""A tier of one file per page in a directory (tmpfs by default): the smallest complete PageStore.

Each file is ``xxh3_64(payload) || payload`` under a hashed name; a file whose
checksum does not match is deleted and read as a miss.  Capacity counts
payload bytes and evicts by any installed policy.  The index is rebuilt from
the directory at start, so pages survive a daemon restart (not a reboot, on
tmpfs).  The daemon calls it from one thread (``parallel_io`` False), so one
lock is enough.
"""
from __future__ import annotations

import hashlib
import os
import threading
from typing import Dict, Iterable, List, Optional, Tuple

import xxhash

from tiers.config_values import _str
from tiers.plugins import StoreKind, make_policy
from tiers.stores.base import Buffers, EvictionListener, PageKey, PageStore, PageTooLarge, StoreStats, total_size

CHECKSUM = 8


def _name(key: PageKey) -> str:
    return hashlib.sha256(f"{key[0]}\0{key[1]}".encode()).hexdigest()


class TmpfsStore(PageStore):
    persistent = True  # the index is rebuilt from the directory at start
    def __init__(self, path: str, capacity: int, policy: str = "lru", max_page_bytes: int = 64 << 20,
                 evictions: Optional[EvictionListener] = None):
        self.path, self.capacity, self.max_page_bytes = path, capacity, max_page_bytes
        self._evictions = evictions  # the daemon's demotion to the tier below, when there is one
        self.policy = make_policy(policy)
        self._lock = threading.Lock()
        self._index: Dict[str, Tuple[PageKey, int]] = {}  # file name -> (key, payload bytes)
        self._by_key: Dict[PageKey, str] = {}
        self._stats = StoreStats(capacity_bytes=capacity)
        os.makedirs(path, mode=0o700, exist_ok=True)
        self._rebuild()

    # ------------------------------------------------------------ start-up
    def _rebuild(self) -> None:
        """Pages of an earlier run: their keys are in a side file next to each page."""
        for name in sorted(os.listdir(self.path)):
            if not name.endswith(".key"):
                continue
            page = os.path.join(self.path, name[:-4])
            try:
                with open(os.path.join(self.path, name), encoding="utf-8") as fh:
                    ns, _, key = fh.read().partition("\0")
                size = os.path.getsize(page) - CHECKSUM
            except OSError:
                continue
            self._add((ns, key), name[:-4], size)

    def _add(self, key: PageKey, name: str, size: int) -> None:
        self._index[name] = (key, size)
        self._by_key[key] = name
        self.policy.insert(key)
        self._stats.used_bytes += size
        self._stats.pages += 1

    def _drop(self, key: PageKey, evicted: bool = False) -> None:
        name = self._by_key.pop(key)
        _, size = self._index.pop(name)
        if not evicted:
            self.policy.remove(key)
        for suffix in ("", ".key"):
            try:
                os.unlink(os.path.join(self.path, name + suffix))
            except FileNotFoundError:
                pass
        self._stats.used_bytes -= size
        self._stats.pages -= 1
        self._stats.evictions += evicted

    def _evict(self, key: PageKey) -> None:
        if self._evictions is not None:  # hand the page on before its file goes (reads are not counted here)
            try:
                with open(os.path.join(self.path, self._by_key[key]), "rb") as fh:
                    data = fh.read()
            except OSError:
                data = b""
            if len(data) >= CHECKSUM and xxhash.xxh3_64_digest(data[CHECKSUM:]) == data[:CHECKSUM]:
                self._evictions.page_evicted(key, [memoryview(data)[CHECKSUM:]], 0)
        self._drop(key, evicted=True)

    # ------------------------------------------------------------- pages
    def put(self, key: PageKey, buffers: Buffers, parent: Optional[str] = None) -> None:
        size = total_size(buffers)
        if size > min(self.max_page_bytes, self.capacity):
            raise PageTooLarge(f"{size} bytes is more than this tier takes")
        digest = xxhash.xxh3_64()
        for view in buffers:
            digest.update(view)
        name = _name(key)
        with self._lock:
            if key in self._by_key:
                self._drop(key)
            while self._stats.used_bytes + size > self.capacity:
                self._evict(self.policy.pop_victim())
            tmp = os.path.join(self.path, f".{name}.tmp")
            with open(tmp, "wb") as fh:
                fh.write(digest.digest())
                for view in buffers:
                    fh.write(view)
            with open(os.path.join(self.path, name + ".key"), "w", encoding="utf-8") as fh:
                fh.write(f"{key[0]}\0{key[1]}")
            os.replace(tmp, os.path.join(self.path, name))  # readers see a whole page or none
            self._add(key, name, size)
            self._stats.inserts += 1
            self._stats.bytes_written += size

    def _read(self, key: PageKey) -> Optional[bytes]:
        name = self._by_key.get(key)
        if name is None:
            self._stats.misses += 1
            return None
        try:
            with open(os.path.join(self.path, name), "rb") as fh:
                data = fh.read()
        except OSError:
            data = b""
        if len(data) < CHECKSUM or xxhash.xxh3_64_digest(data[CHECKSUM:]) != data[:CHECKSUM]:
            self._drop(key)  # damaged: gone, and a miss
            self._stats.misses += 1
            return None
        self.policy.touch(key)
        self._stats.hits += 1
        self._stats.bytes_read += len(data) - CHECKSUM
        return data[CHECKSUM:]

    def get_into(self, key: PageKey, buffers: Buffers) -> bool:
        with self._lock:
            if key in self._by_key and self._index[self._by_key[key]][1] != total_size(buffers):
                self._stats.misses += 1
                return False
            data = self._read(key)
        if data is None:
            return False
        at = 0
        for view in buffers:
            view[:] = data[at:at + view.nbytes]
            at += view.nbytes
        return True

    def get_bytes(self, key: PageKey) -> Optional[bytes]:
        with self._lock:
            return self._read(key)

    def contains(self, keys: Iterable[PageKey]) -> List[bool]:
        with self._lock:
            return [k in self._by_key for k in keys]

    def delete(self, keys: Iterable[PageKey]) -> int:
        with self._lock:
            present = [k for k in keys if k in self._by_key]
            for key in present:
                self._drop(key)
            return len(present)

    def clear(self, namespace: Optional[str] = None) -> int:
        with self._lock:
            keys = [k for k in self._by_key if namespace is None or k[0] == namespace]
            for key in keys:
                self._drop(key)
            return len(keys)

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(**{**self._stats.__dict__, "extra": {}, "per_namespace": {}})


def _build(tier, quotas=None, evictions: Optional[EvictionListener] = None) -> TmpfsStore:
    path = tier.options["path"] or os.path.join("/dev/shm", f"hicache-{tier.name}")
    return TmpfsStore(path, tier.capacity, tier.policy, tier.max_page_bytes, evictions)


# What tiers/plugins.py loads for kind = "tmpfs": the options the node configuration may set, and the builder.
KIND = StoreKind("tmpfs", _build,
                 options={"path": (_str, "", "directory of the page files; default /dev/shm/hicache-NAME")},
                 description="one file per page on tmpfs (an example plug-in)")

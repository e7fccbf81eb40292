"""A node of real tier daemons and one engine rank (real host pool, backend from SGLang's factory)."""
from __future__ import annotations

import os
import shutil
import time
from typing import List, Optional

from hicache_ext.lab.sglang_harness import (PageDriver, build_mha_host_pool, create_backend, fill_pages,
                                        host_indices_for_pages, make_keys, make_storage_config,
                                        page_checksums, zero_pages)
from tiers.ops.node_runner import NodeRunner

# Llama-3-8B's KV shape: 32 layers, 8 KV heads, head dim 128, bf16: 128 KiB a token.
SHAPE = dict(layers=32, kv_heads=8, head_dim=128)
TOKEN_BYTES = 32 * 8 * 128 * 2 * 2
# Pages under 1 MiB: a small model (Llama-3.2-1B: 16 layers, 8 KV heads, head dim 64; 32 KiB a token).
SMALL_SHAPE = dict(layers=16, kv_heads=8, head_dim=64)
SMALL_TOKEN_BYTES = 16 * 8 * 64 * 2 * 2
KiB, MiB = 1 << 10, 1 << 20


def page_shape(page_bytes: int):
    """(model shape, tokens a page) for a page of page_bytes: Llama-3-8B from 1 MiB, Llama-3.2-1B below."""
    shape, token = (SHAPE, TOKEN_BYTES) if page_bytes >= MiB else (SMALL_SHAPE, SMALL_TOKEN_BYTES)
    if page_bytes % token:
        raise ValueError(f"a page of {page_bytes} bytes is not a whole number of {token}-byte tokens")
    return shape, page_bytes // token


def _size(nbytes: int) -> str:
    return f"{max(1, -(-nbytes // MiB))}MiB"


def tier_capacity(batch_bytes: int) -> int:
    """What tier_toml gives a tier: a batch and a quarter, and 64 MiB (whole MiB)."""
    return max(1, -(-(batch_bytes * 5 // 4 + 64 * MiB) // MiB)) * MiB


def tier_toml(kind: str, batch_bytes: int, page_bytes: int, pool_port: Optional[int] = None,
              name: Optional[str] = None, **options) -> str:
    """One [[tiers]] table sized for a batch and a quarter (tiers are cleared between repetitions)."""
    name = name or kind
    lines = [f'name = "{name}"', f'kind = "{kind}"', f'capacity = "{tier_capacity(batch_bytes) >> 20}MiB"',
             f'max_page_bytes = "{_size(page_bytes)}"']
    if kind == "remote":
        lines += [f'pools = ["tcp://127.0.0.1:{pool_port}"]', 'te_hostname = "127.0.0.1"',
                  "pool_timeout_ms = 2000", "transfer_timeout_ms = 10000"]
    for key, value in options.items():
        lines.append(f"{key} = {value!r}".replace("'", '"') if not isinstance(value, bool)
                     else f"{key} = {str(value).lower()}")
    return "[[tiers]]\n" + "\n".join(lines) + "\n"


def node_toml(tiers: List[str], write_policy: str = "write_through") -> str:
    return f'[node]\nwrite_policy = "{write_policy}"\n\n' + "\n".join(tiers)


class Node:
    """Daemons of one configuration under root (runtime and data directories), started at once."""

    def __init__(self, root: str, config_text: str):
        shutil.rmtree(root, ignore_errors=True)
        self.root = root
        self.runner = NodeRunner(config_text, os.path.join(root, "run"), os.path.join(root, "data"),
                                 config_path=os.path.join(root, "node.toml"), log_level="warning")
        self.runner.start(timeout=120.0)
        self.wait_prefaulted()

    def wait_prefaulted(self, timeout: float = 120.0) -> None:
        """Wait until each daemon says its arenas are faulted in (stats: arena_prefaulted): a daemon serves at
        once and faults its staging in behind it, and a measurement taken meanwhile would time the faults
        (~10x a warm copy), not the daemon a user runs for hours."""
        from tiers.wire.client import TierClient
        end = time.monotonic() + timeout
        for tier in self.runner.config.tiers:
            client = TierClient(tier.name, tier.endpoint, "bench-probe", curve=tier.curve)
            try:
                while time.monotonic() < end:
                    stats = client.stats()
                    if stats is None or stats.get("arena_prefaulted", 1.0) == 1.0:
                        break
                    time.sleep(0.1)
            finally:
                client.close()

    def data_path(self, tier: str) -> str:
        return self.runner.config.tier(tier).options.get("path") or os.path.join(self.runner.data_dir, tier)

    def close(self) -> None:
        self.runner.stop()
        shutil.rmtree(self.root, ignore_errors=True)


class Rank:
    """One SGLang rank: host pool (memfd unless allocator="default"), backend, controller page functions."""

    def __init__(self, backend_name: str, page_bytes: int, pages: int, extra: dict, allocator: str = "shm",
                 tp_rank: int = 0, tp_size: int = 1, model: str = "bench-llama-3-8b", tiny: bool = False):
        # tiny: 256-byte pages (1 layer, 1 head, dim 8, 8 tokens) for lookups, where bytes do not matter
        shape, tokens = (dict(layers=1, kv_heads=1, head_dim=8), 8) if tiny else page_shape(page_bytes)
        self.pool = build_mha_host_pool(layout="page_first", allocator=allocator, page_size=tokens, pages=pages,
                                        **shape)
        if allocator == "shm":
            extra = {**extra, "allocator": "shm"}
        self.config = make_storage_config(tp_rank=tp_rank, tp_size=tp_size, model_name=model, layout="page_first",
                                          extra_config=extra)
        self.backend = create_backend(backend_name, self.config, self.pool)
        self.driver = PageDriver(self.backend, self.pool, self.config, backend_name)
        self.pages = pages
        self.page_bytes = 256 if tiny else page_bytes
        self.indices = host_indices_for_pages(self.pool, 0, pages)
        fill_pages(self.pool, self.indices, seed=7)
        self.expected = page_checksums(self.pool, self.indices)

    @classmethod
    def tiered(cls, node: Node, page_bytes: int, pages: int, write_policy: Optional[str] = None,
               settings: Optional[dict] = None, **kw) -> "Rank":
        extra = {"backend_name": "hicache_tiers", "module_path": "hicache_ext", "class_name": "TieredHiCacheStorage",
                 "interface_v1": 1, "runtime_dir": node.runner.runtime_dir, "tiers_config": node.runner.config_path,
                 "deadline_base_s": 30.0, "lookup_timeout_s": 5.0}
        if write_policy:
            extra["write_policy"] = write_policy
        extra.update(settings or {})  # more of the backend's settings (hicache_ext/settings.py)
        return cls("dynamic", page_bytes, pages, extra, **kw)

    @property
    def nbytes(self) -> int:
        return self.pages * self.page_bytes

    def keys(self, salt: int) -> List[str]:
        return make_keys(self.pages, salt=salt, page_size=self.pool.page_size)

    def write(self, keys: List[str]) -> int:
        return self.driver.backup(keys, self.indices)

    def read(self, keys: List[str]) -> int:
        return self.driver.prefetch(keys, self.indices)

    def zero(self) -> None:
        zero_pages(self.pool, self.indices)

    def wrong_pages(self, n: int) -> int:
        """Pages among the first n whose bytes differ from what was written."""
        got = page_checksums(self.pool, self.indices)
        return sum(1 for a, b in zip(got[:n], self.expected[:n]) if a != b)

    def clear(self) -> None:
        self.backend.clear()

    def close(self) -> None:
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()


def drop_page_cache(root: str) -> int:
    """Write back and drop the page cache of every file under root (a cold read follows); files dropped."""
    n = 0
    for directory, _dirs, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n

"""This machine's limits for the same bytes: memcpy, raw disk, the raw Transfer Engine, a ZeroMQ round trip.

No torch, no SGLang.  Each function returns one sample (GB/s or seconds) so the
caller can interleave limits with the measurements they bound.
"""
from __future__ import annotations

import importlib.util
import mmap
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List, Tuple

import numpy as np

from tiers.bench.stats import gbps
from tiers.stores.nvme.chunkfile import IOV_MAX, O_DIRECT, preadv_all, pwritev_all
from tiers.wire import held_wait

_COPY_BUFFER = 256 << 20  # source and destination each: far beyond any cache, bounded in memory


def _memfd_array(nbytes: int) -> np.ndarray:
    """A byte array in a fresh memfd mapping (shared memory, as the host pool and the DRAM arena are)."""
    fd = os.memfd_create("hicache-bench", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        return np.frombuffer(mmap.mmap(fd, nbytes), dtype=np.uint8)
    finally:
        os.close(fd)  # the mapping keeps the memory


class Memcpy:
    """Single-thread memcpy of page-size pieces between two out-of-cache buffers.

    shared=False: private numpy buffers (transparent huge pages where the kernel gives them);
    shared=True: two memfd mappings, the memory a DRAM-tier copy really moves between.
    """

    def __init__(self, page_bytes: int, shared: bool = False):
        self.page_bytes = page_bytes
        slots = max(2, _COPY_BUFFER // page_bytes)
        alloc = _memfd_array if shared else (lambda n: np.empty(n, dtype=np.uint8))
        self.src = alloc(slots * page_bytes)
        self.dst = alloc(slots * page_bytes)
        self.src.reshape(-1, 4096)[:] = np.arange(4096, dtype=np.uint8)  # fault both in before any timing
        self.dst[:] = 1
        self.slots = slots
        self._next = 0  # each sample starts where the last ended, so no sample copies cache-hot pages

    def sample(self, pages: int) -> float:
        """GB/s copying pages pages, one np.copyto (a plain memcpy) a page."""
        size, slots = self.page_bytes, self.slots
        order = [(self._next + i) % slots for i in range(pages)]
        self._next = (self._next + pages) % slots
        views = [(self.dst[i * size:(i + 1) * size], self.src[i * size:(i + 1) * size]) for i in order]
        start = time.perf_counter()
        for d, s in views:
            np.copyto(d, s)
        return gbps(pages * size, time.perf_counter() - start)


class AesGcm:
    """Single-thread AES-256-GCM of page-size pieces (cryptography's encrypt_into / decrypt_into): what sealing
    pages alone costs, the bound of a sealed tier's throughput (hicache_ext/sealing.py)."""

    def __init__(self, page_bytes: int):
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        self.page_bytes = page_bytes
        self.slots = max(2, _COPY_BUFFER // page_bytes)
        self.plain = np.empty(self.slots * page_bytes, dtype=np.uint8)
        self.plain.reshape(-1, 4096)[:] = np.arange(4096, dtype=np.uint8)
        self.sealed = [bytearray(page_bytes + 16) for _ in range(self.slots)]
        self.aead = AESGCM(bytes(range(32)))
        self._next = 0

    def sample(self, pages: int) -> Tuple[float, float]:
        """(seal GB/s, open GB/s) over pages pages."""
        size, slots, aead, nonce = self.page_bytes, self.slots, self.aead, bytes(12)
        order = [(self._next + i) % slots for i in range(pages)]
        self._next = (self._next + pages) % slots
        plain = memoryview(self.plain)
        start = time.perf_counter()
        for i in order:
            aead.encrypt_into(nonce, plain[i * size:(i + 1) * size], b"key", self.sealed[i])
        sealed = time.perf_counter() - start
        start = time.perf_counter()
        for i in order:
            aead.decrypt_into(nonce, self.sealed[i], b"key", plain[i * size:(i + 1) * size])
        opened = time.perf_counter() - start
        return gbps(pages * size, sealed), gbps(pages * size, opened)


class RawDisk:
    """One new file a page with fdatasync (what the NVMe tier acknowledges), then O_DIRECT reads, each page into
    memory of its own (as a tier lands a batch)."""

    def __init__(self, directory: str, page_bytes: int, threads: int = 4):
        self.dir = directory
        self.size = page_bytes - page_bytes % 4096
        self.threads = threads
        os.makedirs(directory, exist_ok=True)
        buf = mmap.mmap(-1, self.size)  # page aligned, as O_DIRECT needs
        np.frombuffer(buf, dtype=np.uint8)[:] = np.random.default_rng(1).integers(0, 255, self.size, dtype=np.uint8)
        self.src = [memoryview(buf)]
        self._read_dst: List[memoryview] = []  # read's distinct pages
        self._batch: List[memoryview] = []  # write_batch's distinct pages

    def _path(self, i: int) -> str:
        return os.path.join(self.dir, f"raw{i}")

    def _read_views(self, pages: int) -> List[memoryview]:
        """A page-sized place of its own for each of pages pages, faulted in, kept for the next call: read
        into one buffer a thread, used again for every page, the same reads ran 1.2x faster here (1.22
        against 1.02 GB/s at 256 KiB, 5 rounds alternated; the buffer's pages stay pinned and mapped), a
        limit no tier landing a real batch in distinct memory could reach."""
        if len(self._read_dst) != pages:
            buf = mmap.mmap(-1, pages * self.size)  # page aligned, as O_DIRECT needs
            np.frombuffer(buf, dtype=np.uint8)[:] = 0
            whole = memoryview(buf)
            self._read_dst = [whole[i * self.size:(i + 1) * self.size] for i in range(pages)]
        return self._read_dst

    def _write(self, i: int) -> None:
        fd = os.open(self._path(i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            pwritev_all(fd, self.src)
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def _read(self, i: int) -> None:
        fd = os.open(self._path(i), os.O_RDONLY | O_DIRECT)
        try:
            if preadv_all(fd, [self._read_dst[i]]) != self.size:
                raise RuntimeError("short raw read")
        finally:
            os.close(fd)

    def _run(self, fn, pages: int) -> float:
        with ThreadPoolExecutor(self.threads) as pool:
            start = time.perf_counter()
            for _ in pool.map(fn, range(pages)):
                pass
            return gbps(pages * self.size, time.perf_counter() - start)

    def write(self, pages: int) -> float:
        self.clean(pages)
        os.sync()
        return self._run(self._write, pages)

    def _batch_views(self, pages: int) -> List[memoryview]:
        """pages distinct pages of random bytes, kept for the next call: a batch written from one page
        repeated ran 1.2-1.35x faster than the same bytes from distinct memory here (the source stays in
        the cache), a limit no tier writing a real batch could reach."""
        if len(self._batch) != pages:
            buf = mmap.mmap(-1, pages * self.size)
            rng = np.random.default_rng(2)
            for i in range(pages):
                np.frombuffer(buf, dtype=np.uint8, count=self.size, offset=i * self.size)[:] = \
                    rng.integers(0, 255, self.size, dtype=np.uint8)
            whole = memoryview(buf)
            self._batch = [whole[i * self.size:(i + 1) * self.size] for i in range(pages)]
        return self._batch

    def write_batch(self, pages: int) -> float:
        """A batch of pages written sequentially into one new file (vectored, O_DIRECT where the device takes
        it) with one fdatasync for the batch: what a tier writing a batch as one chunk could reach (issue 30)."""
        views = self._batch_views(pages)
        path = os.path.join(self.dir, "batch")
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        os.sync()
        start = time.perf_counter()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_DIRECT, 0o600)
        except OSError:  # a file system without O_DIRECT
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            per_call = max(1, min(IOV_MAX, pages))
            for first in range(0, pages, per_call):
                pwritev_all(fd, views[first:first + per_call], first * self.size)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        seconds = time.perf_counter() - start
        os.unlink(path)
        return gbps(pages * self.size, seconds)

    def read(self, pages: int) -> float:
        self._read_views(pages)
        return self._run(self._read, pages)

    def clean(self, pages: int) -> None:
        for i in range(pages):
            try:
                os.unlink(self._path(i))
            except FileNotFoundError:
                pass


_ECHO_SERVER = r"""
import sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.ROUTER); s.setsockopt(zmq.LINGER, 0); s.bind(sys.argv[1])
print("ready", flush=True)
while True:
    ident, body = s.recv_multipart()
    if body == b"stop":
        break
    s.send_multipart([ident, body])
"""


class EchoServer:
    """A ZeroMQ ROUTER echoing 64-byte messages in another process: the round trip under any call."""

    def __init__(self, endpoint: str):
        import zmq
        self.proc = subprocess.Popen([sys.executable, "-c", _ECHO_SERVER, endpoint], stdout=subprocess.PIPE)
        self.proc.stdout.readline()
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.body = b"x" * 64
        self.held = held_wait.shared()
        for _ in range(50):  # connect and warm up
            self.round_trip()

    def round_trip(self) -> float:
        """Seconds of one round trip, waited for as the tiers' clients wait for a lookup's reply: holding
        the GIL for up to 1 ms (tiers/wire/held_wait.py, where built), then blocking."""
        start = time.perf_counter()
        if self.held is not None and self.held.send(self.sock, self.body):
            if self.held.receive(self.sock, held_wait.DEFAULT_REPLY_SPIN_S) is None:
                self.sock.recv()
        else:
            self.sock.send(self.body)
            self.sock.recv()
        return time.perf_counter() - start

    def close(self) -> None:
        self.sock.send(b"stop")
        self.sock.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def zmq_round_trips(endpoint: str, calls: int = 2000) -> List[float]:
    """Seconds of each 64-byte DEALER->ROUTER round trip to an echo server in another process."""
    echo = EchoServer(endpoint)
    try:
        return [echo.round_trip() for _ in range(calls)]
    finally:
        echo.close()


def load_bench_remote():
    """scripts/bench_remote.py as a module (the raw Transfer Engine baseline lives there), or None."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "bench_remote.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("hicache_bench_remote", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

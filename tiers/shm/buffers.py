"""Copying pages between lists of byte buffers (the scatter/gather of every tier)."""
from __future__ import annotations

import ctypes
import functools
import ctypes.util
import mmap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Sequence, Tuple

import numpy as np

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _libc.madvise.restype = ctypes.c_int
    _libc.process_vm_readv.restype = ctypes.c_ssize_t
except OSError:  # no libc by that name: populate by touching pages
    _libc = None


def as_bytes_view(buf) -> memoryview:
    """A flat, byte-addressed memoryview of any contiguous buffer."""
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


class MemoryFault(OSError):
    """A copy touched memory that went away under it (a truncated memfd mapping: SIGBUS)."""


def address_of(view) -> int:
    """The address of a contiguous buffer's first byte (read-only buffers too)."""
    if not view.nbytes:
        return 0
    if isinstance(view, memoryview) and not view.readonly:
        # 0.4 us; numpy's 2.7 us was a tenth of an NVMe put's own work a 64 KiB page
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def view_at(address: int, length: int) -> memoryview:
    """A writable byte view of length bytes of this process at address (address_of's inverse)."""
    return memoryview((ctypes.c_char * length).from_address(address)).cast("B")


def scatter_copy(dst: Sequence[memoryview], src: Sequence[memoryview]) -> int:
    """Copy the concatenation of src into the concatenation of dst.

    Both sides must hold the same number of bytes (ValueError otherwise).
    Each step is one memcpy of the largest run both current views allow; all
    runs go to C in one call, without the GIL, under a SIGBUS guard
    (tiers/_guardcopy.c): a source or destination that is a mapping of a
    memfd someone truncated raises MemoryFault instead of killing the process.
    """
    pairs_d = [(address_of(v), v.nbytes) for v in dst if v.nbytes]
    pairs_s = [(address_of(v), v.nbytes) for v in src if v.nbytes]
    return copy_runs(*scatter_runs(pairs_d, pairs_s))


def scatter_runs(dst: Sequence[Tuple[int, int]], src: Sequence[Tuple[int, int]]):
    """(dst addresses, src addresses, lengths) of the memcpys that copy the src runs into the dst runs.

    Runs are (address, length); both sides must add up to the same total (ValueError otherwise).
    """
    if sum(n for _a, n in src) != sum(n for _a, n in dst):
        raise ValueError("page size mismatch")
    return line_up_runs(dst, src)


def line_up_runs(a: Sequence[Tuple[int, int]], b: Sequence[Tuple[int, int]]) -> Tuple[List[int], List[int], List[int]]:
    """Cut two lists of (address, length) runs into pieces both sides hold whole, in order, until either ends:
    (addresses in a, addresses in b, lengths).  Copies (scatter_runs) and Transfer Engine requests
    (tiers/stores/remote/engine.py pair_extents) are made of these."""
    runs_a: List[int] = []
    runs_b: List[int] = []
    runs_n: List[int] = []
    ai = bi = aoff = boff = 0
    while ai < len(a) and bi < len(b):
        (aa, an), (ba, bn) = a[ai], b[bi]
        n = min(an - aoff, bn - boff)
        runs_a.append(aa + aoff)
        runs_b.append(ba + boff)
        runs_n.append(n)
        aoff += n
        boff += n
        if aoff == an:
            ai, aoff = ai + 1, 0
        if boff == bn:
            bi, boff = bi + 1, 0
    return runs_a, runs_b, runs_n


# A batch of memory work this large is cut in two halves done at once (in_halves): one core copies or hashes
# at ~6-10 GB/s, a fraction of the memory's bandwidth.
PARALLEL_BYTES = 8 << 20


_on_helper = threading.local()  # .yes on in_halves' own helper thread


def _mark_helper() -> None:
    _on_helper.yes = True


@functools.lru_cache(maxsize=None)
def _helper() -> ThreadPoolExecutor:
    """The second thread of in_halves (one a process, made on first use)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-halves", initializer=_mark_helper)


class _HalvesBalance:
    """How to cut a batch so that both halves end together: the helper starts its half later than the caller
    (a thread woken: 0.10-0.16 ms on this VM, 8-25% of a half of 8-32 MiB, session 38), so it is given that
    much less work.  Learnt from each large call, a moving average of the helper's start delay and of the
    caller's time an item; where the helper starts at once the halves stay even."""

    def __init__(self) -> None:
        self.delay = 0.0  # seconds from submitting the helper's half to its start
        self.per_item = 0.0  # seconds the caller took an item of its half

    def helper_share(self, count: int) -> int:
        """Items the helper takes of count: half, less half its start delay's worth (at most an eighth)."""
        shift = int(self.delay / (2 * self.per_item)) if self.per_item > 0 else 0
        return count // 2 - min(shift, count // 8)

    def learn(self, delay: float, items: int, seconds: float) -> None:
        self.delay += 0.2 * (delay - self.delay)
        if items:
            self.per_item += 0.2 * (seconds / items - self.per_item)


_balance = _HalvesBalance()


def in_halves(work: Callable[[int, int], list], count: int, nbytes: int) -> list:
    """work(0, count), or, for a batch of PARALLEL_BYTES or more, work(0, h) on this thread and work(h, count)
    on a helper thread at once, their results concatenated (h: about half, _HalvesBalance).  work must be a
    C call without the GIL to gain (the guarded copy and the page hash are); an exception of either half
    propagates once both ended."""
    if nbytes < PARALLEL_BYTES or count < 2 or getattr(_on_helper, "yes", False):
        return work(0, count)  # small, or called from the helper itself (waiting on it would never end)
    split = count - _balance.helper_share(count)
    submitted = time.perf_counter()
    started: List[float] = []

    def second() -> list:
        started.append(time.perf_counter())
        return work(split, count)
    pending = _helper().submit(second)
    try:
        began = time.perf_counter()
        first = work(0, split)
        took = time.perf_counter() - began
    finally:
        rest = pending.result()
    _balance.learn(started[0] - submitted, split, took)
    return first + rest


def copy_runs(dst: Sequence[int], src: Sequence[int], lengths: Sequence[int]) -> int:
    """memcpy(dst[i], src[i], lengths[i]) for every i, guarded; the bytes copied, MemoryFault when one faulted."""
    count = len(lengths)
    if not count:
        return 0
    d = np.asarray(dst, dtype=np.uint64)
    s = np.asarray(src, dtype=np.uint64)
    n = np.asarray(lengths, dtype=np.uint64)
    done = guarded().copy(d, s, n, count)
    if done != count:
        raise MemoryFault(f"a copied region went away during the copy (run {done} of {count}; truncated memfd?)")
    return int(n.sum())


class _Guard:
    """The compiled guarded copy (tiers/_guardcopy.c), or process_vm_readv on ourselves where it is not built."""

    def __init__(self):
        self._lib = None
        self.sums_built = False  # the page checksum functions (built where xxhash.h was found)
        self.pages_built = False  # guarded_copy_pages (a build of this version)
        try:
            from importlib.util import find_spec
            spec = find_spec("tiers._guardcopy")
            if spec is not None and spec.origin:
                lib = ctypes.CDLL(spec.origin)
                ptr = np.ctypeslib.ndpointer(dtype=np.uint64, ndim=1, flags="C_CONTIGUOUS")
                lib.guarded_copy_runs.argtypes = [ptr, ptr, ptr, ctypes.c_int64]
                lib.guarded_copy_runs.restype = ctypes.c_int64
                lib.guard_install.restype = ctypes.c_int
                lib.page_sums_built.restype = ctypes.c_int
                runs = np.ctypeslib.ndpointer(dtype=np.int64, ndim=1, flags="C_CONTIGUOUS")
                lib.guarded_page_sums.argtypes = [ptr, ptr, runs, ctypes.c_int64, ptr]
                lib.guarded_page_sums.restype = ctypes.c_int64
                sums_out = ctypes.c_void_p  # NULL: no sums asked for
                lib.guarded_copy_pages.argtypes = [ptr, ptr, runs, ptr, ptr, runs, ctypes.c_uint64, ctypes.c_int64,
                                                   sums_out]
                lib.guarded_copy_pages.restype = ctypes.c_int64
                self._lib = lib
                self.sums_built = bool(lib.page_sums_built())
                self.pages_built = True
        except (OSError, AttributeError, ImportError):
            self._lib = None
        if self._lib is None:
            import logging
            logging.getLogger("hicache.buffers").warning(
                "tiers._guardcopy is not built (install the package with pip); copies use process_vm_readv, ~20%% slower")

    def copy(self, d: np.ndarray, s: np.ndarray, n: np.ndarray, count: int) -> int:
        if self._lib is not None:
            # Re-installed when someone replaced it (faulthandler.enable() after us): one cheap syscall.
            self._lib.guard_install()
            return int(self._lib.guarded_copy_runs(d, s, n, count))
        return _vm_copy(d, s, n, count)

    def sums(self, ptrs: np.ndarray, lens: np.ndarray, page_runs: np.ndarray, out: np.ndarray) -> int:
        """guarded_page_sums (only when sums_built): the pages hashed whole."""
        self._lib.guard_install()
        return int(self._lib.guarded_page_sums(ptrs, lens, page_runs, len(page_runs), out))

    def copy_pages(self, d_ptrs: np.ndarray, d_lens: np.ndarray, d_runs: np.ndarray, s_ptrs: np.ndarray,
                   s_lens: np.ndarray, s_runs: np.ndarray, s_base: int, sums) -> int:
        """guarded_copy_pages (only when pages_built): pages copied whole, -1 on a page size mismatch."""
        self._lib.guard_install()
        return int(self._lib.guarded_copy_pages(d_ptrs, d_lens, d_runs, s_ptrs, s_lens, s_runs, s_base,
                                                len(d_runs), None if sums is None else sums.ctypes.data))


def _vm_copy(d: np.ndarray, s: np.ndarray, n: np.ndarray, count: int) -> int:
    """The fallback: a kernel copy within this process; a vanished page is EFAULT, not SIGBUS."""
    import os
    pid = os.getpid()
    for i in range(count):
        local = _Iovec(int(d[i]), int(n[i]))
        remote = _Iovec(int(s[i]), int(n[i]))
        if _libc is None or _libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != int(n[i]):
            return i
    return count


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


@functools.lru_cache(maxsize=None)
def guarded() -> _Guard:
    return _Guard()


def block_extents(blocks: Sequence[int], block_size: int, size: int) -> List[Tuple[int, int]]:
    """(offset, length) runs of an arena that size bytes take in these blocks, in order.

    Adjacent blocks merge into one run, so a page in consecutive blocks is one memcpy.
    """
    extents: List[Tuple[int, int]] = []
    remaining = size
    for block in blocks:
        length = min(block_size, remaining)
        offset = block * block_size
        if extents and extents[-1][0] + extents[-1][1] == offset:
            extents[-1] = (extents[-1][0], extents[-1][1] + length)
        else:
            extents.append((offset, length))
        remaining -= length
    return extents


# A slice of a populate beside serving threads: ~5 ms of faults, what another thread's mmap or page fault may
# wait for (a whole 2 GiB staging arena in one call held an engine's first read back 150 ms).
POPULATE_SLICE = 8 << 20


def populate(mapping: mmap.mmap, write: bool = True, step: int = 0) -> bool:
    """Fault a whole shared mapping in (for writing, or for reading), without holding the GIL.

    mmap.madvise keeps the GIL for the whole call (seconds for a large pool),
    which would freeze a daemon's loop; a ctypes call releases it.  With step,
    it goes a slice at a time: the kernel holds the process's mmap lock for a
    call, and every other thread's mmap, munmap (and, behind a waiting writer,
    page fault) waits for it, so a prefault beside serving threads must
    be sliced.  Returns False when the kernel cannot (pages then fault in on
    first use).
    """
    if _libc is None or len(mapping) == 0:
        return False
    with memoryview(mapping) as view:  # works for read-only mappings too; the export ends here
        address = address_of(view)
    advice = MADV_POPULATE_WRITE if write else MADV_POPULATE_READ
    step = step or len(mapping)
    for start in range(0, len(mapping), step):
        if _libc.madvise(address + start, min(step, len(mapping) - start), advice) != 0:
            return False
    return True

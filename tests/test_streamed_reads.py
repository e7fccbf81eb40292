"""Streamed NVMe reads: the daemon answers a leased get at once and marks each page on a progress board as its
read ends; the engine copies each page as it is marked (tiers/shm/progress.py, tiers/node/streamed_reads.py).

Real parts throughout: boards in a memfd mapped read-only by another process, a real NVMe daemon read by the
real backend through SGLang's page functions, a blkio throttle to slow its disk, SIGKILL in the middle of a
read, and the daemon's own staging accounting fed a flood of reads given up at once.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from hicache_ext.lab.sglang_harness import fill_pages, page_checksums
from tests.support.backend_env import Engine, make_keys
from tests.support.nodes import node_toml, nvme_tier, remote_node, start_node
from tests.support.slow_disk import SlowDisk
from tiers.node.reads import PageReads
from tiers.node.streamed_reads import StreamedReads
from tiers.shm import progress
from tiers.shm.arena import BlockArena
from tiers.shm.buffers import address_of
from tiers.stores.nvme.store import NvmeStore
from tiers.wire.client import TierClient

pytestmark = pytest.mark.skipif(not progress.built(), reason="tiers._progress is not built")

SHAPE = dict(layers=8, kv_heads=2, head_dim=128, page_size=32)  # 256 KiB pages
PAGES = 48


def _board(n: int):
    """A memfd holding a board for n pages: (writable mapping, read-only mapping of another descriptor)."""
    fd = os.memfd_create("board")
    size = max(mmap.PAGESIZE, progress.board_bytes(n))
    os.ftruncate(fd, size)
    writable = mmap.mmap(fd, size)
    ro_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
    readonly = mmap.mmap(ro_fd, size, prot=mmap.PROT_READ)
    os.close(fd)
    os.close(ro_fd)
    return writable, readonly


def test_a_board_is_read_across_processes_through_a_read_only_mapping():
    n = 64
    writable, readonly = _board(n)
    writer = progress.BoardWriter(address_of(memoryview(writable)), n)
    pid = os.fork()
    if pid == 0:  # the daemon's side: four runs of 16 pages, a quarter of them missed, 20 ms apart
        try:
            for first in range(0, n, 16):
                time.sleep(0.02)
                writer.mark(list(range(first, first + 16)),
                            [None if i % 4 == 3 else 1000 + i for i in range(first, first + 16)])
        finally:
            os._exit(0)
    try:
        asked = [i != 5 for i in range(n)]  # page 5 was not leased: never waited for
        reader = progress.BoardReader(address_of(memoryview(readonly)), asked)
        read, missed, rounds = [], [], 0
        while reader.left:
            got, lost = reader.next_final(time.monotonic() + 5)
            assert got or lost, "marks stopped coming"
            read += got
            missed += lost
            rounds += 1
        assert rounds >= 2  # the marks came in steps, and the reader waited between them
        assert sorted(read) == [i for i in range(n) if i % 4 != 3 and i != 5]
        assert sorted(missed) == [i for i in range(n) if i % 4 == 3]
        assert all(int(reader.sums[i]) == 1000 + i for i in read)
    finally:
        os.waitpid(pid, 0)


def test_a_reader_stops_at_its_expiry_when_marks_stop():
    n = 16
    writable, readonly = _board(n)
    writer = progress.BoardWriter(address_of(memoryview(writable)), n)
    writer.mark(list(range(8)), list(range(1, 9)))  # then the daemon dies: no more marks
    reader = progress.BoardReader(address_of(memoryview(readonly)), [True] * n)
    assert reader.next_final(time.monotonic() + 5) == (list(range(8)), [])
    began = time.monotonic()
    assert reader.next_final(began + 0.2) == ([], [])
    assert 0.19 <= time.monotonic() - began < 1.0
    assert reader.left == 8


def test_a_reader_stops_waiting_once_the_daemon_is_gone_not_before():
    n = 8
    writable, readonly = _board(n)
    writer = progress.BoardWriter(address_of(memoryview(writable)), n)
    writer.mark([0, 1], [5, 6])
    reader = progress.BoardReader(address_of(memoryview(readonly)), [True] * n)
    assert reader.next_final(time.monotonic() + 5, lambda: False) == ([0, 1], [])  # marks first, whatever
    asked = []
    began = time.monotonic()

    def alive() -> bool:
        asked.append(time.monotonic())
        return len(asked) < 3  # there for two slices, then gone
    assert reader.next_final(began + 5, alive) == ([], [])
    assert len(asked) == 3 and time.monotonic() - began < 1.0
    assert reader.left == 6


def _streamed(client: TierClient) -> int:
    return int(client.stats()["streamed_reads"])


def _one_streamed_read(engine: Engine, admin: TierClient, seed: int):
    """PAGES pages written, then read back whole, exact and streamed (the daemon's count moved by one)."""
    keys = make_keys(PAGES, seed)
    written, expected = engine.write(keys, 0, seed=seed * 7)
    assert written == PAGES
    before = _streamed(admin)
    done, got = engine.read(keys, PAGES)
    assert done == PAGES and got == expected
    assert _streamed(admin) == before + 1
    return keys, expected


def test_nvme_reads_are_streamed_and_exact_and_old_clients_still_read(tmp_path, monkeypatch):
    runner = start_node(tmp_path, node_toml(nvme_tier("64MiB", staging_bytes="32MiB")))
    engine = Engine(runner, pages=2 * PAGES, shape=SHAPE)
    admin = TierClient("nvme", runner.config.tier("nvme").endpoint, "probe")
    try:
        stats = admin.stats()
        gets, pages_got = stats["requests"].get("get", 0), stats["pages_got"]
        keys, expected = _one_streamed_read(engine, admin, 3)
        # The get is counted, and its pages, once its reads ended (the answer left before them).
        stats = admin.stats()
        assert stats["requests"]["get"] == gets + 1 and stats["pages_got"] == pages_got + PAGES
        assert stats["streamed_bytes_in_flight"] == 0
        # An engine that does not ask for it (an older client, or no compiled board) is answered whole.
        streamed = _streamed(admin)
        monkeypatch.setattr(progress, "built", lambda: False)
        done, got = engine.read(keys, PAGES)
        assert done == PAGES and got == expected
        assert _streamed(admin) == streamed
    finally:
        admin.close()
        engine.close()
        runner.stop()


def test_remote_reads_are_streamed_and_exact(tmp_path):
    runner, pool = remote_node(tmp_path)
    engine = Engine(runner, pages=2 * PAGES, shape=SHAPE, deadline_base_s=5.0)
    admin = TierClient("remote", runner.config.tier("remote").endpoint, "probe")
    try:
        _one_streamed_read(engine, admin, 5)
    finally:
        admin.close()
        engine.close()
        runner.stop()
        pool.stop()


@contextlib.contextmanager
def _throttled_nvme(tmp_path, seed: int, **deadlines):
    """An NVMe node whose daemon reads through a blkio throttle set later (``throttle(bps)``), an engine on it,
    and PAGES pages written: (engine, runner, keys, expected checksums, throttle)."""
    why = SlowDisk.unavailable(str(tmp_path))
    if why is not None:
        pytest.skip(why)
    runner = start_node(tmp_path, node_toml(nvme_tier("64MiB", staging_bytes="32MiB", fsync=True)))
    engine = Engine(runner, pages=2 * PAGES, shape=SHAPE, **deadlines)
    slow = []
    try:
        keys = make_keys(PAGES, seed)
        written, expected = engine.write(keys, 0, seed=seed * 10)
        assert written == PAGES
        yield engine, runner, keys, expected, lambda bps: slow.append(SlowDisk(runner.pid("nvme"),
                                                                                runner.data_dir, read_bps=bps))
    finally:
        for throttle in slow:
            throttle.close()
        engine.close()
        runner.stop()


def test_a_streamed_get_is_timed_to_the_end_of_its_reads(tmp_path):
    """The daemon's get duration (request_duration, latency_s_sum) covers the reading, not the early answer."""
    with _throttled_nvme(tmp_path, 6, deadline_base_s=10.0) as (engine, runner, keys, _expected, throttle):
        admin = TierClient("nvme", runner.config.tier("nvme").endpoint, "probe")
        try:
            spent = admin.stats()["latency_s_sum"].get("get", 0.0)
            throttle(24_000_000)  # 12 MiB: ~0.5 s
            started = time.monotonic()
            done, _got = engine.read(keys, PAGES)
            took = time.monotonic() - started
            assert done == PAGES
            timed = admin.stats()["latency_s_sum"]["get"] - spent
            assert 0.3 <= took and 0.5 * took <= timed <= took + 0.1, (took, timed)
        finally:
            admin.close()


def test_a_daemon_killed_mid_read_ends_the_wait_with_no_wrong_or_late_byte(tmp_path):
    with _throttled_nvme(tmp_path, 4, deadline_base_s=6.0, deadline_min_gbps=50.0) as (engine, runner, keys,
                                                                                     expected, throttle):
        idx = engine.indices(PAGES, PAGES)
        fill_pages(engine.pool, idx, seed=77)
        before = page_checksums(engine.pool, idx)
        throttle(6_000_000)  # 12 MiB at 6 MB/s: about 2 s of reads, past any moment the kill can land
        outcome = {}

        def read():
            started = time.monotonic()
            outcome["done"] = engine.driver.prefetch(keys, idx)
            outcome["took"] = time.monotonic() - started
            outcome["ended"] = time.monotonic()
        reader = threading.Thread(target=read)
        reader.start()
        # Killed once the engine copied the first page in (its first run was marked): the pages read
        # before the kill are the engine's, the rest never come.
        deadline = time.monotonic() + 10
        while page_checksums(engine.pool, idx[:SHAPE["page_size"]])[0] != expected[0]:
            assert time.monotonic() < deadline and reader.is_alive(), "no page was copied while the read ran"
            time.sleep(0.005)
        os.kill(runner.pid("nvme"), signal.SIGKILL)
        killed = time.monotonic()
        reader.join(15)
        assert not reader.is_alive()
        done, took = outcome["done"], outcome["took"]
        print(f"\nkilled mid-read: {done} of {PAGES} pages loaded in {took:.2f} s, "
              f"{outcome['ended'] - killed:.2f} s after the kill")
        assert 1 <= done < PAGES, f"{done} pages loaded"
        # The engine saw the daemon's attachment close and stopped waiting then, not at its 6 s deadline.  A
        # killed daemon exits (and closes it) once its reads in flight end: up to ~1 s at this throttle.
        assert took < 4.5 and outcome["ended"] - killed < 2.5, (f"the read took {took:.2f} s, "
                                                                 f"{outcome['ended'] - killed:.2f} s after the kill")
        loaded = page_checksums(engine.pool, idx)
        assert loaded[:done] == expected[:done]
        # SGLang reuses the slots at once; nothing may change them afterwards.
        fill_pages(engine.pool, idx, seed=78)
        mine = page_checksums(engine.pool, idx)
        time.sleep(0.5)
        assert page_checksums(engine.pool, idx) == mine
        assert mine != before


def test_reads_given_up_at_once_hold_no_more_staging_than_the_session_share(tmp_path):
    """A session that asks for streamed reads and gives each up at once: its lease ends, its reads do not, and
    what they hold still counts against its share until they end; another session keeps its own share."""
    page = 256 << 10
    store = NvmeStore(str(tmp_path / "nvme"), 64 << 20, max_page_bytes=page, fsync=False)
    arena = BlockArena(16 << 20, 64 << 10, "staging", prefault=False)
    queued = []  # the daemon's I/O pool, held back: the reads "run" when the test says
    streamed = StreamedReads(store, arena, queued.append, lambda pages, nbytes: None)
    reads = PageReads(store, arena, lambda n, work: [work(i) for i in range(n)], streamed)
    reads.max_lease_bytes = 4 << 20  # a session's share: 16 pages of 256 KiB (and a board)
    try:
        keys = [f"{i:064x}" for i in range(8)]
        data = [os.urandom(page) for _ in keys]
        assert store.put_many([("ns", k) for k in keys], [[memoryview(d)] for d in data], [None] * 8,
                              None) == [None] * 8
        sizes = [page] * 8  # 2 MiB a read

        def ask(owner: int, expiry: float) -> int:
            fields, _pages, _bytes = reads.lease_reads("ns", keys, sizes, owner, expiry, stream=True)
            return sum(fields["found"])
        assert ask(1, time.monotonic() + 0.01) == 8
        time.sleep(0.02)
        arena.expire()  # the engine gave up: its lease ended, its reads (queued) did not
        assert ask(1, time.monotonic() + 0.01) < 8  # the first read's 2 MiB still count: no room for 8 more
        assert ask(2, time.monotonic() + 5) == 8  # another session's share is its own
        before = arena.free_blocks()
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda work: work(), list(queued)))
        time.sleep(0.02)
        arena.expire()
        assert streamed.in_flight_bytes() == 0
        assert arena.free_blocks() > before  # the first session's blocks came back once its reads ended
        assert ask(1, time.monotonic() + 5) == 8
    finally:
        store.close()
        arena.close()

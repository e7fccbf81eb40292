"""Issue 30: a put's pages in one batch chunk file, one flush a batch (tiers/stores/nvme/batch.py).

Real files in temporary directories: the pages of a batch read back byte for
byte from one file; evicting a page gives its blocks back at once (the bytes
the disk holds never pass the capacity); the last page takes the file; a
restart finds every page by scanning the batch files, or from the snapshot;
a batch cut short by a crash is never served.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import pytest

from tiers.stores.nvme import NvmeStore
from tiers.stores.nvme import batch, ceiling
from tiers.stores.nvme.chunkfile import ALIGN, HEADER_SIZE
from tests.support.nvme_batches import (PAGE, RECORD, batch_files, disk_bytes, page, put_batch, read_all,
                                        store_maker)


@pytest.fixture
def make_store(tmp_path, monkeypatch):
    monkeypatch.setattr(ceiling, "MIN_STEP_BYTES", 0)  # as a large tier's (tiers/stores/nvme/ceiling.py)
    with store_maker(tmp_path / "nvme", 64 * RECORD, fsync=True) as make:
        yield make


def test_a_batch_is_one_file_and_reads_back_exactly(make_store, tmp_path):
    store = make_store()
    assert store.batched
    keys = put_batch(store, [f"p{i}" for i in range(16)], range(16))
    files = batch_files(tmp_path / "nvme")
    assert len(files) == 1 and os.path.getsize(files[0]) == 16 * RECORD
    found, data = read_all(store, keys)
    assert found == [True] * 16 and data == [page(i) for i in range(16)]
    assert store.stats().pages == 16


def test_evicting_pages_gives_their_blocks_back_and_the_last_takes_the_file(make_store, tmp_path):
    store = make_store(capacity=24 * RECORD)
    root = tmp_path / "nvme"
    put_batch(store, [f"a{i}" for i in range(16)], range(16))
    most = disk_bytes(root)
    for round_ in range(6):  # each batch of 8 evicts 8 of the oldest pages: holes in the oldest file
        put_batch(store, [f"r{round_}-{i}" for i in range(8)], range(100 + 8 * round_, 108 + 8 * round_))
        most = max(most, disk_bytes(root))
        assert store.stats().used_bytes <= 24 * RECORD
    print(f"\nbatches of 8 into a tier of 24 pages: at most {most // RECORD} pages' bytes on disk")
    assert most <= 24 * RECORD + 4 * ALIGN  # what the index counts, and a directory block or so
    assert len(batch_files(root)) == 3  # the first file went with its last page
    found, data = read_all(store, [("ns", f"r5-{i}") for i in range(8)])
    assert found == [True] * 8 and data == [page(140 + i) for i in range(8)]


@pytest.mark.parametrize("snapshot", [True, False], ids=["snapshot", "scan"])
def test_a_restart_finds_every_page_of_every_batch(make_store, snapshot):
    store = make_store(index_snapshot=snapshot)
    keys = put_batch(store, [f"s{i}" for i in range(12)], range(12))
    keys += put_batch(store, [f"t{i}" for i in range(5)], range(20, 25))
    store.delete([keys[3]])
    store.close()
    again = make_store(index_snapshot=snapshot)
    again._build.done.wait(10)
    found, data = read_all(again, keys)
    assert found == [i != 3 for i in range(17)]
    assert [d for d, ok in zip(data, found) if ok] == [page(s) for i, s in enumerate([*range(12), *range(20, 25)])
                                                       if i != 3]


def test_a_batch_file_cut_short_by_a_crash_is_removed_whole_at_restart(make_store, tmp_path):
    """A batch file is written under its own name and acknowledged after its flush, so a crash before that
    can leave one cut short: records that end past the file's end, a header never written.  The restart
    removes such a file whole (none of its pages was acknowledged), instead of indexing the records before
    the cut and leaving the rest on disk, counted by no one."""
    store = make_store()
    keys = put_batch(store, [f"c{i}" for i in range(4)], range(4))
    store.close()
    whole = open(batch_files(tmp_path / "nvme")[0], "rb").read()
    cut_short = batch.batch_path(str(tmp_path / "nvme"), 77)
    never_written = batch.batch_path(str(tmp_path / "nvme"), 78)
    for path in (cut_short, never_written):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(cut_short, "wb") as f:
        f.write(whole[:RECORD + 100])  # its first record whole, the second cut inside its header
    with open(never_written, "wb") as f:
        f.write(whole[:RECORD] + bytes(HEADER_SIZE) + whole[RECORD + HEADER_SIZE:])  # the second header zeros
    again = make_store(index_snapshot=False)
    assert again._build.done.wait(10)
    assert not os.path.exists(cut_short) and not os.path.exists(never_written)
    st = again.stats()
    assert st.extra["torn_removed"] == 2
    assert st.pages == 4 and st.used_bytes == 4 * RECORD == disk_bytes(tmp_path / "nvme")
    found, data = read_all(again, keys)
    assert found == [True] * 4 and data == [page(i) for i in range(4)]


def test_a_restart_scan_leaves_alone_a_batch_being_written_meanwhile(make_store, monkeypatch):
    """A put that is halfway through its batch file (its first part on disk, the rest still being filled)
    while the restart scan walks the batch directory: the scan leaves the file alone (it is this run's and
    not yet flushed, so it looks cut short), and the put then completes, every page stored and read back.
    Before, the scan removed a file being written as a crash's leftover and the put was refused."""
    import threading
    import xxhash
    from tests.support.nvme_scan import held_back_scan
    from tiers.stores.nvme import batch_writes
    n = batch_writes.FIRST_PART_PAGES + 4  # two parts
    store = make_store(capacity=4 * n * RECORD)
    old = put_batch(store, [f"o{i}" for i in range(3)], range(3))
    store.close()
    release = held_back_scan(monkeypatch)
    store = make_store(capacity=4 * n * RECORD, index_snapshot=False)
    wanted = [page(700 + i) for i in range(n)]
    buffers = [bytearray(PAGE) for _ in range(n)]
    second_part, go = threading.Event(), threading.Event()

    def fill(positions):
        if positions[0] != 0:  # the first part is on its way to the disk: hold the second
            second_part.set()
            assert go.wait(30)
        for p in positions:
            buffers[p][:] = wanted[p]
        return [xxhash.xxh3_64_intdigest(wanted[p]) for p in positions]
    keys = [("ns", f"w{i}") for i in range(n)]
    out = []
    put = threading.Thread(target=lambda: out.extend(store.put_many_filled(
        keys, [[memoryview(b)] for b in buffers], [None] * n, time.time() + 60, None, fill)))
    put.start()
    try:
        assert second_part.wait(30)
        release.set()  # the scan runs now, the put's file half written under its own name
        assert store._build.done.wait(30)
    finally:
        release.set()
        go.set()
        put.join(60)
    assert out == [None] * n
    st = store.stats()
    assert st.extra["torn_removed"] == 0 and st.pages == n + 3
    found, data = read_all(store, keys + old)
    assert found == [True] * (n + 3) and data == wanted + [page(i) for i in range(3)]


def test_an_older_versions_temporary_batch_file_is_removed(make_store, tmp_path):
    store = make_store()
    keys = put_batch(store, [f"c{i}" for i in range(4)], range(4))
    store.close()
    # What a crash mid-write left before batch files were written under their own name: a temporary file
    # that was never renamed into place.
    path = batch.batch_path(str(tmp_path / "nvme"), 77)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        f.write(open(batch_files(tmp_path / "nvme")[0], "rb").read()[:RECORD + 100])
    again = make_store(index_snapshot=False)
    again._build.done.wait(10)
    assert not os.path.exists(path + ".tmp")
    found, data = read_all(again, keys)
    assert found == [True] * 4 and data == [page(i) for i in range(4)]


@pytest.mark.parametrize("snapshot", [True, False], ids=["snapshot", "scan"])
def test_a_page_refused_after_its_file_was_laid_out_leaves_a_hole_and_a_restart_skips_it(make_store, tmp_path,
                                                                                         snapshot):
    """A batch file is laid out (each record's block and room) before its pages' bytes are checked: a page
    whose bytes do not match its writer's checksum is refused there and its record is a hole, so the disk
    holds what the index counts; a restart, by snapshot or by scan, finds the other pages and not that one."""
    store = make_store(index_snapshot=snapshot)
    keys = [("ns", f"h{i}") for i in range(6)]
    data = [page(600 + i) for i in range(6)]
    import xxhash
    sums = [xxhash.xxh3_64_intdigest(d) for d in data]
    sums[2] ^= 1
    sums[5] ^= 1  # the last record too: the file ends before it
    out = store.put_many_with_sums(keys, [[memoryview(d)] for d in data], [None] * 6, time.time() + 30, sums)
    assert [i for i, e in enumerate(out) if e is not None] == [2, 5]
    (path,) = batch_files(tmp_path / "nvme")
    assert os.path.getsize(path) == 5 * RECORD and disk_bytes(tmp_path / "nvme") == 4 * RECORD
    assert store.stats().used_bytes == 4 * RECORD
    store.close()
    again = make_store(index_snapshot=snapshot)
    again._build.done.wait(10)
    found, got = read_all(again, keys)
    assert found == [i not in (2, 5) for i in range(6)]
    assert [g for g, ok in zip(got, found) if ok] == [d for i, d in enumerate(data) if i not in (2, 5)]
    assert again.stats().used_bytes == 4 * RECORD and again.stats().extra["corrupt_removed"] == 0


def test_a_batch_into_a_full_tier_evicts_at_most_a_bounded_amount_a_lock_hold(make_store):
    """Every lookup of the tier waits on the ledger's lock: a put of a whole 64 MiB file into a full tier
    reserves its records (and evicts for them) RESERVE_HOLD_BYTES at a time, each in a hold of its own."""
    import threading
    from tiers.stores.nvme import ledger as ledger_mod
    n = 3 * (ledger_mod.RESERVE_HOLD_BYTES // RECORD) + 5
    store = make_store(capacity=n * RECORD, fsync=False, recycle_bytes=0)  # the index holds the whole capacity
    put_batch(store, [f"old{i}" for i in range(n)], range(n))  # full
    ledger = store._ledger
    holds, evicted = [0], []

    class CountedLock:
        def __init__(self):
            self.inner = threading.Lock()

        def acquire(self, blocking=True, timeout=-1):
            got = self.inner.acquire(blocking, timeout)
            if got:
                holds[0] += 1
            return got

        def release(self):
            self.inner.release()

        def __enter__(self):
            self.acquire()

        def __exit__(self, *exc):
            self.release()
    ledger.lock = CountedLock()
    ledger.dead_bytes._freed = threading.Condition(ledger.lock)  # the ledger's waits on its lock, counted too
    real_pop = ledger.pop_victim_locked

    def counted_pop(*args, **kw):
        victim = real_pop(*args, **kw)
        if victim is not None:
            evicted.append(holds[0])
        return victim
    ledger.pop_victim_locked = counted_pop
    keys = put_batch(store, [f"new{i}" for i in range(n)], range(1000, 1000 + n))
    per_hold = {h: evicted.count(h) for h in set(evicted)}
    assert len(evicted) == n and len(per_hold) >= 4, per_hold
    assert max(per_hold.values()) * RECORD <= ledger_mod.RESERVE_HOLD_BYTES, per_hold
    found, data = read_all(store, keys)
    assert found == [True] * n and data == [page(1000 + i) for i in range(n)]


def test_a_page_rewritten_lives_in_its_newest_batch(make_store):
    store = make_store()
    put_batch(store, ["x", "y"], [1, 2])
    put_batch(store, ["x"], [3])
    found, data = read_all(store, [("ns", "x"), ("ns", "y")])
    assert found == [True, True] and data == [page(3), page(2)]
    assert store.stats().used_bytes == 2 * RECORD


def test_kill_during_batched_writes_and_evictions_serves_no_wrong_page(tmp_path):
    """SIGKILL a process writing batches into a full tier (so every batch evicts and punches), three times at
    random moments; after each restart every page served is the one written, no temporary file is left and the
    bytes on disk stay within the capacity."""
    root = tmp_path / "killed"
    capacity = 40 * RECORD
    code = f"""
import sys, random, time
sys.path.insert(0, {os.getcwd()!r})
from tiers.stores.nvme import NvmeStore
s = NvmeStore({str(root)!r}, {capacity}, fsync=False, index_snapshot=False)
s._build.done.wait(10)
print("ready", flush=True)
i = int(sys.argv[1])
while True:
    names = [f"k{{(i + j) % 97}}" for j in range(8)]
    s.put_many([("ns", n) for n in names], [[memoryview(random.Random(n).randbytes({PAGE}))] for n in names],
               [None] * 8, time.time() + 30)
    i += 8
"""
    rng = random.Random(30)
    for round_ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", code, str(round_ * 1000)], stdout=subprocess.PIPE)
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(0.3 + rng.random() * 0.5)
        proc.kill()
        proc.wait()
        store = NvmeStore(str(root), capacity, fsync=False, index_snapshot=False)
        try:
            store._build.done.wait(30)
            assert not [f for _d, _s, fs in os.walk(root) for f in fs if f.endswith(".tmp")]
            names = [f"k{i}" for i in range(97)]
            present = [n for n, ok in zip(names, store.contains([("ns", n) for n in names])) if ok]
            assert present
            for n in present:
                assert bytes(store.get_bytes(("ns", n))) == random.Random(n).randbytes(PAGE), n
            assert store.stats().extra["corrupt_removed"] == 0
            assert disk_bytes(root) <= capacity + 4 * ALIGN, disk_bytes(root)
            print(f"\nround {round_ + 1}: {len(present)} pages served after SIGKILL, all whole; "
                  f"{disk_bytes(root) // RECORD} pages' bytes on disk of {capacity // RECORD}")
        finally:
            store.close()


def test_a_damaged_record_in_a_run_of_reads_is_a_miss_and_the_rest_are_served(make_store, tmp_path):
    """Adjacent records are read with one preadv; one that fails its checksum is a miss (and goes), the
    others of the run are served."""
    store = make_store()
    keys = put_batch(store, [f"d{i}" for i in range(8)], range(8))
    path = batch_files(tmp_path / "nvme")[0]
    with open(path, "r+b") as f:  # a byte of page 5's payload
        f.seek(5 * RECORD + HEADER_SIZE + 1000)
        byte = f.read(1)
        f.seek(5 * RECORD + HEADER_SIZE + 1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    found, data = read_all(store, keys)
    assert found == [i != 5 for i in range(8)]
    assert [d for d, ok in zip(data, found) if ok] == [page(i) for i in range(8) if i != 5]
    assert store.stats().extra["corrupt_removed"] == 1 and not store.contains([keys[5]])[0]


def test_parts_filled_as_they_are_written_and_a_failed_fill_keeps_nothing_of_its_file(make_store, tmp_path):
    """put_many_filled (the daemon's copy out of the engine's memory overlaps the device): each part's bytes
    arrive when the store asks for them and their sums are kept without hashing again; a fill that fails
    (the engine truncated its pool, the deadline passed) refuses the file's pages, keeps none of its bytes
    or reservations, and leaves no file behind."""
    import xxhash
    from tiers.stores.base import FillFailed
    from tiers.stores.nvme import batch_writes
    first = min(batch_writes.FIRST_PART_PAGES, batch_writes.PART_BYTES // PAGE)
    n = 3 * first + 1  # three parts: the first, twice that, one page
    store = make_store(capacity=2 * n * RECORD)
    wanted = [page(500 + i) for i in range(n)]
    buffers = [bytearray(PAGE) for _ in range(n)]
    asked = []

    def fill(positions):
        asked.append(list(positions))
        for p in positions:
            buffers[p][:] = wanted[p]
        return [xxhash.xxh3_64_intdigest(wanted[p]) for p in positions]
    keys = [("ns", f"f{i}") for i in range(n)]
    sums = [xxhash.xxh3_64_intdigest(w) for w in wanted]
    sums[5] ^= 1  # a writer's sum that its bytes do not match: that page alone is refused
    out = store.put_many_filled(keys, [[memoryview(b)] for b in buffers], [None] * n, time.time() + 30, sums, fill)
    assert len(asked) == 3 and sorted(p for part in asked for p in part) == list(range(n))
    assert [i for i, e in enumerate(out) if e is not None] == [5] and out[5].code == "io_error"
    found, got = read_all(store, keys)
    assert found == [i != 5 for i in range(n)]
    assert all(got[i] == wanted[i] for i in range(n) if i != 5)
    assert store.stats().extra["checksum_refused"] == 1

    used = store.stats().used_bytes
    files = batch_files(store.root)

    def failing(positions):
        if asked and positions[0] != 0:
            raise FillFailed("bad_request", "the host pool went away under the copy")
        asked.append(positions)
        return [xxhash.xxh3_64_intdigest(bytes(PAGE)) for _ in positions]
    asked.clear()
    lost = [("ns", f"g{i}") for i in range(n)]
    out = store.put_many_filled(lost, [[memoryview(bytearray(PAGE))] for _ in range(n)], [None] * n,
                                time.time() + 30, [0] * n, failing)
    assert [e.code for e in out] == ["bad_request"] * n
    assert store.get_many_into(lost, [[memoryview(bytearray(PAGE))] for _ in lost], time.time() + 30) == [False] * n
    assert store.stats().used_bytes == used and batch_files(store.root) == files
    assert not [f for d, _s, fs in os.walk(store.root) for f in fs if f.endswith(".tmp")]
    # and its reservations went back: a batch as large as the room left is stored without evicting a page
    assert store.put_many(lost, [[memoryview(page(9))]] * n, [None] * n, time.time() + 30) == [None] * n
    assert store.stats().pages == 2 * n - 1


def test_a_put_the_daemon_hashes_is_filled_in_parts_and_keeps_each_pages_xxh3(tmp_path):
    """The engine's backup of one tier sends no sums (hash_pages): the daemon hashes the pages in the host
    pool part by part as the device writes (put_many_filled), and each page's xxh3 taken then is what the
    tier keeps and returns with the page."""
    import mmap
    import xxhash
    from tests.support.nodes import node_toml, nvme_tier, start_node
    from tiers.shm.buffers import address_of
    from tiers.stores.nvme import batch_writes
    from tiers.wire import protocol as P
    from tiers.wire.client import TierClient
    n = batch_writes.PART_BYTES // PAGE + 8  # two parts
    runner = start_node(tmp_path, node_toml(nvme_tier(capacity="64MiB", fsync=True)))
    size = 2 * n * PAGE
    fd = os.memfd_create("pool")
    os.ftruncate(fd, size)
    view = mmap.mmap(fd, size)
    wanted = [page(900 + i) for i in range(n)]
    for i, data in enumerate(wanted):
        view[i * PAGE:(i + 1) * PAGE] = data
    client = TierClient("nvme", runner.config.tier("nvme").endpoint, "hashed", attach=True)
    try:
        client.attach_region(fd, size)
        assert client.lookup(["x"]) == b"\x00"  # hello + region registration
        keys = [f"k{i}" for i in range(n)]
        desc, counts = P.encode_descriptors([[(i * PAGE, PAGE)] for i in range(n)])
        assert client.put_region(keys, desc, counts, n * PAGE, hash_pages=True) == [True] * n
        assert len(batch_files(os.path.join(runner.data_dir, "nvme"))) == 1
        # 4 KiB-aligned pages: written straight out of the host pool, no staging copy (_put_in_place)
        assert client.stats()["in_place_puts"] == 1
        base, sums = address_of(memoryview(view)), [0] * n
        assert client.get_leased(keys, [[(base + (n + i) * PAGE, PAGE)] for i in range(n)], sums) == [True] * n
        assert sums == [xxhash.xxh3_64_intdigest(w) for w in wanted]
        assert all(view[(n + i) * PAGE:(n + i + 1) * PAGE] == wanted[i] for i in range(n))
    finally:
        client.close()
        runner.stop()


def test_a_batch_directory_removed_behind_the_stores_back_is_made_again(make_store, monkeypatch):
    """Batch directories are made once and remembered; one removed meanwhile (an operator's cleanup) costs
    no put."""
    import shutil
    from tiers.stores.nvme import batch_writes
    monkeypatch.setattr(batch_writes.secrets, "randbits", lambda bits: 0x5A5A5)  # both puts: one directory
    store = make_store(capacity=64 * RECORD)
    keys = [("ns", f"d{i}") for i in range(4)]
    assert store.put_many(keys, [[memoryview(page(i))] for i in range(4)], [None] * 4, time.time() + 30) == [None] * 4
    store.clear()
    shutil.rmtree(os.path.join(store.root, batch.TOP))
    more = [("ns", f"e{i}") for i in range(4)]
    assert store.put_many(more, [[memoryview(page(7))]] * 4, [None] * 4, time.time() + 30) == [None] * 4
    found, got = read_all(store, more)
    assert all(found) and all(g == page(7) for g in got)


def test_bytes_changed_after_their_fill_hashed_them_are_a_miss_never_served(make_store):
    """A put written straight out of the engine's memory (the daemon's in-place put) hashes each part just
    before the device reads it; an engine that reuses a slot in between puts other bytes on disk under the
    old sum: the read finds the mismatch and misses."""
    n = 6
    store = make_store(capacity=4 * n * RECORD)
    wanted = [page(700 + i) for i in range(n)]
    buffers = [bytearray(w) for w in wanted]

    def fill(positions):
        import xxhash
        sums = [xxhash.xxh3_64_intdigest(wanted[p]) for p in positions]
        for p in positions:
            if p % 2:
                buffers[p][:4096] = bytes(4096)  # the engine wrote this slot after the hash
        return sums
    keys = [("ns", f"c{i}") for i in range(n)]
    out = store.put_many_filled(keys, [[memoryview(b)] for b in buffers], [None] * n, time.time() + 30, None, fill)
    assert out == [None] * n
    found, got = read_all(store, keys)
    assert found == [i % 2 == 0 for i in range(n)]
    assert all(got[i] == wanted[i] for i in range(n) if i % 2 == 0)


def test_a_batch_is_read_in_runs_about_two_a_thread_and_a_page_alone_in_one_request(make_store, monkeypatch):
    """A batch of one file is cut into runs of 1-8 MiB, about two a read thread (one run of the whole file
    left threads idle; runs of 1 MiB kept the device shallow at large pages), every page served exactly;
    and a run of one page is read with one preadv of header and payload, not the one-page path (header
    first, then payload: two requests in series)."""
    from tiers.stores.nvme import batch_reads
    store = make_store(capacity=600 * RECORD, io_threads=2)
    keys = put_batch(store, [f"r{i}" for i in range(128)], range(128))  # 8 MiB of 64 KiB pages: one file
    runs = []
    real_run = batch.read_run
    monkeypatch.setattr(batch_reads.batch, "read_run", lambda path, first, pages, direct: runs.append(len(pages))
                        or real_run(path, first, pages, direct))
    alone = []
    real_one = store._reads.s.read_one
    monkeypatch.setattr(store._reads.s, "read_one", lambda key, dst: alone.append(key) or real_one(key, dst))
    found, data = read_all(store, keys)
    assert found == [True] * 128 and data == [page(i) for i in range(128)]
    assert sum(runs) == 128 and len(runs) == 4 and not alone, runs  # 8 MiB / (2 x 2 threads): 2 MiB runs
    runs.clear()
    found, data = read_all(store, keys[7:8])  # one page: a run of its own
    assert found == [True] and data == [page(7)] and runs == [1] and not alone


def test_a_page_written_again_during_a_restart_scan_gives_back_its_old_record(make_store, monkeypatch):
    """A batch's pages, a restart that scans (held back), and two of them written again meanwhile in a
    new batch: when the scan meets their old records it gives their blocks back (they were no one's count:
    the disk would have held them for good, past the capacity), and the pages read their new bytes."""
    from tests.support.nvme_scan import held_back_scan
    store = make_store()
    keys = put_batch(store, [f"k{i}" for i in range(6)], range(6))
    store.close()
    release = held_back_scan(monkeypatch)
    time.sleep(1.1)  # the old batch's mtime is from a second before the restart began
    store = make_store(index_snapshot=False)
    try:
        put_batch(store, ["k1", "k4"], [101, 104])
    finally:
        release.set()
    assert store._build.done.wait(30)
    st = store.stats()
    assert st.pages == 6 and st.used_bytes == 6 * RECORD == disk_bytes(store.root)
    assert [bytes(store.get_bytes(k)) for k in keys] == [page(s) for s in (0, 101, 2, 3, 104, 5)]

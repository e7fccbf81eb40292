"""NVMe batch files whose every page left, written over by the next batch of their size (tiers/stores/nvme/recycle.py):
the same file and blocks, exact bytes, nothing of the old pages found again after a clean stop or a crash, and
the disk within the capacity throughout."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import pytest

from tiers.stores.nvme import NvmeStore, batch, ceiling, recycle
from tiers.stores.nvme.ledger import Ledger
from tiers.stores.nvme.recycle import RecycledFiles
from tests.support.nvme_batches import RECORD, batch_files, disk_bytes, page, put_batch, read_all, store_maker


@pytest.fixture
def make_store(tmp_path, monkeypatch):
    monkeypatch.setattr(ceiling, "MIN_STEP_BYTES", 0)
    # recycle_bytes: an eighth of the capacity (a tier this small keeps nothing by default)
    with store_maker(tmp_path / "nvme", 80 * RECORD, recycle_bytes=80 * RECORD) as make:
        yield make


def test_a_dead_batch_file_is_written_over_by_the_next_batch_of_its_size(make_store, tmp_path):
    """Cleared, a batch's file is kept (an eighth of the capacity holds it); the next batch of the same size goes
    into the same file and blocks under the same name, reads back exactly, and the old pages are not found."""
    store = make_store()
    root = tmp_path / "nvme"
    old = put_batch(store, [f"old{i}" for i in range(8)], range(8))
    (path,) = batch_files(root)
    ino = os.stat(path).st_ino
    store.clear()
    stats = store.stats().extra
    assert stats["recycled_kept"] == 1 and stats["recycled_bytes"] == 8 * RECORD
    assert batch_files(root) == [path] and open(path, "rb").read(4096) == bytes(4096)  # its first header zeroed
    new = put_batch(store, [f"new{i}" for i in range(8)], range(100, 108))
    assert batch_files(root) == [path] and os.stat(path).st_ino == ino
    assert store.stats().extra["recycled_reused"] == 1 and store.stats().extra["recycled_bytes"] == 0
    found, data = read_all(store, new)
    assert found == [True] * 8 and data == [page(100 + i) for i in range(8)]
    assert read_all(store, old)[0] == [False] * 8
    # A batch of another size gets a new file; nothing of this store's is kept past its limit.
    put_batch(store, [f"other{i}" for i in range(5)], range(200, 205))
    assert len(batch_files(root)) == 2 and store.stats().extra["recycled_reused"] == 1


@pytest.mark.parametrize("crash", [False, True], ids=["clean stop", "crash"])
def test_kept_files_are_gone_after_a_restart_and_their_pages_not_found(make_store, tmp_path, crash):
    """A clean stop removes the files it kept; after a crash the restart's scan finds no record at their start
    and removes them: an evicted or deleted page does not come back either way."""
    store = make_store(index_snapshot=True)
    root = tmp_path / "nvme"
    gone = put_batch(store, [f"gone{i}" for i in range(8)], range(8))
    kept = put_batch(store, [f"kept{i}" for i in range(5)], range(50, 55))
    store.delete(gone)
    assert store.stats().extra["recycled_kept"] == 1 and len(batch_files(root)) == 2
    if crash:  # what a SIGKILL leaves: no close, no snapshot; the directory lock let go
        os.close(store._lock_fd)
        store._lock_fd = None
        store._build.stop()
    else:
        store.close()
    again = make_store(index_snapshot=True)
    again._build.done.wait(30)
    assert len(batch_files(root)) == 1
    assert read_all(again, gone)[0] == [False] * 8
    found, data = read_all(again, kept)
    assert found == [True] * 5 and data == [page(50 + i) for i in range(5)]


def test_recycling_keeps_the_disk_within_the_capacity_of_a_full_tier(make_store, tmp_path):
    """Batches into a full tier: each evicts the oldest whole file, which the next batch is written over; the
    index holds the capacity less what may be kept, and the files on disk never pass the capacity."""
    capacity = 80 * RECORD
    store = make_store(capacity)
    root = tmp_path / "nvme"
    assert store.stats().capacity_bytes == capacity - capacity // 8
    most = 0
    for r in range(20):
        put_batch(store, [f"r{r}-{i}" for i in range(8)], range(8 * r, 8 * r + 8))
        most = max(most, disk_bytes(root))
        assert sum(os.path.getsize(f) for f in batch_files(root)) <= capacity
    assert most <= capacity
    stats = store.stats().extra
    assert stats["recycled_reused"] >= 10, stats
    found, data = read_all(store, [("ns", f"r19-{i}") for i in range(8)])
    assert found == [True] * 8 and data == [page(152 + i) for i in range(8)]


def test_records_evicted_from_a_live_file_stay_in_place_until_it_dies_whole(make_store, tmp_path):
    """The index holds 70 pages (80 less the 10 recycling may keep): not whole files of 8.  A batch into the
    full tier evicts the oldest file's head; those records are left in place (no hole; counted in the budget),
    so the file dies whole a put later and is written over with no block allocated again.  A clean stop
    punches what is left in place: the next start finds the live pages and no byte no index knows."""
    root = tmp_path / "nvme"
    store = make_store(index_snapshot=True)
    put_batch(store, [f"r0-{i}" for i in range(8)], range(8))
    (oldest,) = batch_files(root)
    for r in range(1, 9):  # eight files, then the ninth evicts two pages of the first
        put_batch(store, [f"r{r}-{i}" for i in range(8)], range(8 * r, 8 * r + 8))
    stats = store.stats().extra
    assert stats["recycled_kept"] == 0 and stats["recycled_bytes"] == 2 * RECORD, stats
    blocks = os.stat(oldest).st_blocks
    assert blocks * 512 == 8 * RECORD  # no hole
    put_batch(store, [f"r9-{i}" for i in range(8)], range(72, 80))  # the first file dies whole: written over
    stats = store.stats().extra
    assert stats["recycled_kept"] == 0 and stats["recycled_reused"] == 1, stats  # the put's own claim: not kept
    assert os.stat(oldest).st_blocks == blocks
    assert stats["recycled_bytes"] == 2 * RECORD  # the second file's head, left in place in its turn
    found, data = read_all(store, [("ns", f"r9-{i}") for i in range(8)])
    assert found == [True] * 8 and data == [page(72 + i) for i in range(8)]
    live = [("ns", f"r{r}-{i}") for r in range(10) for i in range(8)]
    held = [key for key, ok in zip(live, store.contains(live)) if ok]
    assert len(held) == 70
    store.close()
    again = make_store(index_snapshot=True)
    assert again.stats().pages == 70 and again.contains(held) == [True] * 70
    assert disk_bytes(root) == again.stats().used_bytes  # nothing left in place that no index knows


@pytest.mark.parametrize("limit", [None, 0], ids=["auto on a small tier", "off"])
def test_a_put_into_a_full_tier_writes_over_the_file_its_own_victims_emptied(make_store, tmp_path, limit):
    """No budget needed: in a tier of ten whole files every put past the tenth evicts the oldest file whole and
    is written over it (the same ten files throughout), nothing kept, the index's capacity whole, the disk
    within it, every page read back exactly and the evicted ones not found.  recycle_bytes 0: a new file a put."""
    capacity = 80 * RECORD
    store = make_store(recycle_bytes=limit)
    root = tmp_path / "nvme"
    assert store.stats().capacity_bytes == capacity
    for r in range(10):
        put_batch(store, [f"r{r}-{i}" for i in range(8)], range(8 * r, 8 * r + 8))
    files = batch_files(root)
    for r in range(10, 20):
        put_batch(store, [f"r{r}-{i}" for i in range(8)], range(8 * r, 8 * r + 8))
        assert disk_bytes(root) <= capacity
    stats = store.stats().extra
    if limit is None:
        assert stats["recycled_reused"] == 10 and stats["recycled_kept"] == 0 and stats["recycled_bytes"] == 0
        assert batch_files(root) == files
    else:
        assert stats["recycled_reused"] == 0 and not set(batch_files(root)) & set(files)
    live = [("ns", f"r{r}-{i}") for r in range(10, 20) for i in range(8)]
    found, data = read_all(store, live)
    assert found == [True] * 80 and data == [page(80 + i) for i in range(80)]
    assert read_all(store, [("ns", f"r{r}-{i}") for r in range(10) for i in range(8)])[0] == [False] * 80


def _dead_file(root, file_id: int, blocks: int) -> str:
    path = batch.batch_path(str(root), file_id)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"x" * (blocks * 4096))
    return path


def _recycled(tmp_path, room_blocks: int, limit: int = 0, on: bool = True):
    """RecycledFiles over a real ledger whose capacity is room_blocks of 4 KiB (dead files are kept within it)."""
    ledger = Ledger(str(tmp_path), room_blocks * 4096, "lru")
    rec = RecycledFiles(ledger, limit, on=on)
    ledger.dead_bytes.spares = rec
    return ledger, rec


def test_a_claim_gets_only_a_file_of_its_size_and_hands_on_one_it_cannot_use(tmp_path):
    """A put's claim takes the dead file of its size its own discard offers, zeroed, whatever the ledger's room;
    a file of another size is not its; a claim settled for another size (some of its put's pages were
    refused) hands its file on: kept where the ledger has room, else removed; a kept file of its size is a
    claim's at once, still counted as dead; off: no claim, nothing kept."""
    size = 10 * 4096
    ledger, rec = _recycled(tmp_path, 12)
    claim = rec.claim(size)
    assert claim.file is None and claim.spare == 0
    ledger.dead_bytes.count = 8 * 4096  # no room for another file beside these
    assert not rec.offer(_dead_file(tmp_path, 1, 5), claim=claim)  # not its size, and no room: removed by the caller
    path = _dead_file(tmp_path, 2, 10)
    assert rec.offer(path, claim=claim) and open(path, "rb").read(4096) == bytes(4096)
    assert not rec.offer(_dead_file(tmp_path, 3, 10), claim=claim)  # the claim has its file
    assert rec.settle(claim, size) == (2, path) and rec.nbytes == 0 and rec.reused == 1
    claim = rec.claim(size)
    path = _dead_file(tmp_path, 4, 10)
    assert rec.offer(path, claim=claim) and rec.settle(claim, size - 4096) is None and not os.path.exists(path)
    ledger.dead_bytes.count = 0  # room again
    claim = rec.claim(size)
    path = _dead_file(tmp_path, 5, 10)
    assert rec.offer(path, claim=claim) and rec.settle(claim, size - 4096) is None
    assert os.path.exists(path) and rec.kept == 1 and ledger.dead == size
    again = rec.claim(size)  # a kept file of its size is a claim's at once, its bytes still counted as dead
    assert again.file == (5, path) and again.spare == size and ledger.dead == size and rec.nbytes == 0
    _ledger, off = _recycled(tmp_path, 100, on=False)
    assert not off.offer(_dead_file(tmp_path, 6, 10), claim=off.claim(size))


def test_a_deletes_bytes_stay_counted_until_its_files_are_gone(tmp_path):
    """A delete's pages leave the index at once, but their bytes stay counted (as dead) until their files
    leave the disk: kept (the held bytes become the kept file's), or removed and then freed."""
    ledger, rec = _recycled(tmp_path, 30)
    ledger.dead_bytes.count = 10 * 4096  # what pop_many(held=True) counted for a file of ten blocks
    path = _dead_file(tmp_path, 1, 10)
    assert rec.offer(path, held=10 * 4096) and ledger.dead == 10 * 4096 and rec.kept == 1
    ledger.dead_bytes.count += 25 * 4096  # another delete's, 25 blocks held: a file of 25 does not fit beside the kept one
    assert not rec.offer(_dead_file(tmp_path, 2, 25), held=25 * 4096) and ledger.dead == 35 * 4096


def test_kept_files_are_given_up_for_room_before_any_live_page(tmp_path):
    """Kept files count in the ledger's room; a reservation that needs room gives them up (removed before its
    writer writes) and evicts no live page while one is kept."""
    ledger, rec = _recycled(tmp_path, 30)
    paths = [_dead_file(tmp_path, i, 10) for i in (1, 2)]
    assert all(rec.offer(p) for p in paths) and ledger.dead == 20 * 4096
    assert not rec.offer(_dead_file(tmp_path, 3, 11))  # past the room: removed by the caller
    victims, got = ledger.reserve_many([4096] * 15, 1, "ns")
    assert got == [True] * 15 and victims == [] and ledger.dead == 10 * 4096 and rec.kept == 2
    assert all(os.path.exists(p) for p in paths)  # given up, not yet removed: the writer removes it first
    rec.remove_given_up()
    assert sum(os.path.exists(p) for p in paths) == 1


@pytest.mark.parametrize("limit", [0, None], ids=["off", "auto on a small tier"])
def test_a_cleared_tier_keeps_its_files_for_the_next_batches_unless_off(make_store, tmp_path, limit):
    """Auto on a tier under 8 GiB: a cleared batch's file is kept (it costs the cache nothing) and the next
    batch of its size is written over it; the index has the whole capacity.  recycle_bytes 0: a dead file goes
    at once.  Auto on 8 GiB and more leaves 128 MiB for dead records left in place."""
    store = make_store(recycle_bytes=limit)
    root = tmp_path / "nvme"
    put_batch(store, [f"a{i}" for i in range(8)], range(8))
    files = batch_files(root)
    store.clear()
    assert store.stats().capacity_bytes == 80 * RECORD
    assert batch_files(root) == ([] if limit == 0 else files)
    assert store.stats().extra["recycled_kept"] == (0 if limit == 0 else 1)
    put_batch(store, [f"b{i}" for i in range(8)], range(10, 18))
    assert (batch_files(root) == files) is (limit is None)
    assert store.stats().extra["recycled_reused"] == (0 if limit == 0 else 1)
    big = NvmeStore(str(tmp_path / "big"), 8 << 30)
    try:
        assert big.stats().capacity_bytes == (8 << 30) - (128 << 20)
    finally:
        big.close()


def test_a_file_written_over_gets_its_first_header_last(tmp_path):
    """Until finish, a file written over starts with the zeros it was kept with (a crash meanwhile: the restart
    removes it whole, never indexes a record cut short over an old one's bytes); finish writes the header."""
    path = _dead_file(tmp_path, 9, 4)
    recycle._zero_first_header(path)
    header = batch.aligned_block()
    header[:8] = b"HEADER!!"
    payload = memoryview(bytearray(b"p" * (3 * 4096)))
    writer = batch.BatchWriter(path, direct=False, over=True)
    writer.add([batch.Record(header, [payload], payload.nbytes)], block=0)
    writer._wait()
    with open(path, "rb") as f:
        assert f.read(4096) == bytes(4096) and f.read() == bytes(payload)
    writer.finish(fsync=True)
    with open(path, "rb") as f:
        assert f.read(8) == b"HEADER!!"


def test_holds_data_outside(tmp_path):
    """Whether a batch file keeps data once the given record ranges are given back (holes skipped)."""
    path = str(tmp_path / "f.hcb")
    with open(path, "wb") as f:
        f.write(b"x" * (10 * 4096))
    assert not batch.holds_data_outside(path, [(0, 10)])
    assert not batch.holds_data_outside(path, [(5, 5), (0, 5)])  # adjacent ranges cover it together
    assert batch.holds_data_outside(path, [(0, 9)])
    assert batch.holds_data_outside(path, [(1, 9)])
    assert batch.punch_ranges(path, [(0, 4)]) is True  # a hole over the first four blocks
    assert not batch.holds_data_outside(path, [(4, 6)])
    assert batch.holds_data_outside(path, [(4, 5)])
    assert not batch.holds_data_outside(str(tmp_path / "gone.hcb"), [(0, 1)])


@pytest.mark.parametrize("budget", [True, False], ids=["kept within a budget", "claims alone"])
def test_kill_while_batches_are_written_over_kept_files_serves_no_wrong_page(tmp_path, budget):
    """SIGKILL a process whose every durable batch into a full tier is written over the file its eviction just
    emptied (kept within the budget, or claimed by the put with none), three times at random moments; after
    each restart every page served is the one written and the bytes on disk stay within the capacity."""
    root = tmp_path / "killed"
    capacity = 80 * RECORD
    recycle_bytes = capacity if budget else None  # None: a small tier's auto, no budget
    code = f"""
import os, sys, random, time
sys.path.insert(0, {os.getcwd()!r})
from tiers.stores.nvme import NvmeStore
s = NvmeStore({str(root)!r}, {capacity}, fsync=True, index_snapshot=False, recycle_bytes={recycle_bytes})
s._build.done.wait(10)
print("ready", flush=True)
i = int(sys.argv[1])
while True:
    names = [f"k{{(i + j) % 197}}" for j in range(8)]
    s.put_many([("ns", n) for n in names], [[memoryview(random.Random(n).randbytes({RECORD - 4096}))] for n in names],
               [None] * 8, time.time() + 30)
    i += 8
    with open(sys.argv[2] + ".new", "w") as f:  # replaced whole: a kill never leaves it half written
        f.write(str(s.stats().extra["recycled_reused"]))
    os.replace(sys.argv[2] + ".new", sys.argv[2])
"""
    rng = random.Random(41)
    counts = tmp_path / "reused"
    for round_ in range(3):
        counts.write_text("")
        proc = subprocess.Popen([sys.executable, "-c", code, str(round_ * 1000), str(counts)],
                                stdout=subprocess.PIPE)
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(0.5 + rng.random() * 0.5)
        proc.kill()
        proc.wait()
        assert int(counts.read_text() or 0) > 0  # batches were being written over kept files when it died
        store = NvmeStore(str(root), capacity, fsync=True, index_snapshot=False, recycle_bytes=recycle_bytes)
        try:
            store._build.done.wait(30)
            names = [f"k{i}" for i in range(197)]
            present = [n for n, ok in zip(names, store.contains([("ns", n) for n in names])) if ok]
            assert present
            for n in present:  # a batch cut short lies in a file that starts with zeros: removed whole
                got = store.get_bytes(("ns", n))
                assert got is not None and bytes(got) == random.Random(n).randbytes(RECORD - 4096), n
            assert store.stats().extra["corrupt_removed"] == 0
            assert disk_bytes(root) <= capacity, disk_bytes(root)
            put_batch(store, [f"after{round_}-{i}" for i in range(8)], range(8))  # the tier writes on
        finally:
            store.close()


@pytest.fixture
def tmpfs_root(tmp_path):
    """A tmpfs of its own (its used bytes, from statvfs, are one atomic reading of everything on it)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {result.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _used(root) -> int:
    st = os.statvfs(root)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


@pytest.mark.parametrize("limit", [None, 0], ids=["recycling", "off"])
def test_concurrent_puts_clears_and_deletes_keep_the_disk_within_the_capacity(tmpfs_root, monkeypatch, limit):
    """Four threads put batches of two sizes, delete and clear at random into a tier of ten batch files for a
    while: the file system never holds more than the capacity (its own reading, sampled after every step),
    and once they stop the ledger's dead bytes are exactly the kept files', every kept file is on disk, and
    every page still indexed reads back exactly.  Found by this test: a clear's files left the index's count
    before the disk (a put wrote meanwhile), a reservation's victims went uncounted while it waited, and two
    give-backs of one file ran at once (one punched ranges of the file the other had handed to its put)."""
    import threading
    monkeypatch.setattr(ceiling, "MIN_STEP_BYTES", 0)
    capacity = 80 * RECORD
    store = NvmeStore(str(tmpfs_root / "nvme"), capacity, fsync=False, index_snapshot=False, recycle_bytes=limit)
    base = _used(tmpfs_root)  # the store's own small files
    stop = time.monotonic() + 4.0
    errors, worst = [], [0]
    written = {}
    lock = threading.Lock()

    def worker(w: int) -> None:
        rng = random.Random(w)
        n = 0
        try:
            while time.monotonic() < stop:
                roll = rng.random()
                if roll < 0.75:
                    size = 8 if rng.random() < 0.7 else 5
                    names = [f"w{w}-{n}-{i}" for i in range(size)]
                    n += 1
                    out = store.put_many([("ns", name) for name in names],
                                         [[memoryview(page(hash(name) & 0xFFFF))] for name in names],
                                         [None] * size, time.time() + 30)
                    with lock:
                        for name, o in zip(names, out):
                            if o is None:
                                written[name] = hash(name) & 0xFFFF
                elif roll < 0.9:
                    with lock:
                        victims = rng.sample(sorted(written), min(6, len(written)))
                    store.delete([("ns", name) for name in victims])
                else:
                    store.clear()
                worst[0] = max(worst[0], _used(tmpfs_root) - base)
        except Exception as exc:  # noqa: BLE001: any failure of a worker fails the test below
            errors.append(exc)
    try:
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert worst[0] <= capacity + 2 * 4096, worst[0]  # the usage ceiling's small file, rewritten
        rec, ledger = store._recycled, store._ledger
        kept = [path for files in rec._by_size.values() for _id, path in files]
        assert ledger.dead == rec._bytes == sum(os.path.getsize(p) for p in kept)
        assert all(os.path.exists(p) for p in kept) and ledger.reserved == 0
        names = sorted(written)
        held = [name for name, ok in zip(names, store.contains([("ns", n) for n in names])) if ok]
        for name in held:
            got = store.get_bytes(("ns", name))
            assert got is not None and bytes(got) == page(written[name]), name
        stats = store.stats().extra
        assert (stats["recycled_reused"] > 0) is (limit is None) and stats["corrupt_removed"] == 0, stats
    finally:
        store.close()

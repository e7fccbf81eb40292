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

from tiers.stores.nvme import NvmeStore, batch, ceiling
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
    assert stats["recycled_kept"] == 1 and stats["recycled_reused"] == 1, stats
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


@pytest.mark.parametrize("recycle", [0, None], ids=["off", "auto on a small tier"])
def test_dead_files_are_removed_at_once_without_recycling(make_store, tmp_path, recycle):
    """recycle_bytes 0, or auto on a tier under 8 GiB: a dead file goes at once and the index has the whole
    capacity; auto on 8 GiB and more keeps 128 MiB."""
    store = make_store(recycle_bytes=recycle)
    put_batch(store, [f"a{i}" for i in range(8)], range(8))
    store.clear()
    assert batch_files(tmp_path / "nvme") == [] and store.stats().extra["recycled_kept"] == 0
    assert store.stats().capacity_bytes == 80 * RECORD
    big = NvmeStore(str(tmp_path / "big"), 8 << 30)
    try:
        assert big.stats().capacity_bytes == (8 << 30) - (128 << 20)
    finally:
        big.close()


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


def test_kill_while_batches_are_written_over_kept_files_serves_no_wrong_page(tmp_path):
    """SIGKILL a process whose every durable batch into a full tier is written over the file its eviction just
    kept, three times at random moments; after each restart every page served is the one written and the bytes
    on disk stay within the capacity."""
    root = tmp_path / "killed"
    capacity = 80 * RECORD
    code = f"""
import os, sys, random, time
sys.path.insert(0, {os.getcwd()!r})
from tiers.stores.nvme import NvmeStore
s = NvmeStore({str(root)!r}, {capacity}, fsync=True, index_snapshot=False, recycle_bytes={capacity})
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
        store = NvmeStore(str(root), capacity, fsync=True, index_snapshot=False, recycle_bytes=capacity)
        try:
            store._build.done.wait(30)
            names = [f"k{i}" for i in range(197)]
            present = [n for n, ok in zip(names, store.contains([("ns", n) for n in names])) if ok]
            assert present
            for n in present:
                got = store.get_bytes(("ns", n))
                assert got is None or bytes(got) == random.Random(n).randbytes(RECORD - 4096), n
            assert disk_bytes(root) <= capacity, disk_bytes(root)
            put_batch(store, [f"after{round_}-{i}" for i in range(8)], range(8))  # the tier writes on
        finally:
            store.close()

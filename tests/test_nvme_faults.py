"""NvmeStore under damage: corrupt files, full disks, interrupted writes, O_DIRECT fallbacks."""
from __future__ import annotations

import mmap
import os
import random
import shutil
import subprocess
import sys
import time
from contextlib import closing

import pytest

from tiers.stores.nvme import NvmeStore, snapshot
from tiers.stores.nvme.chunkfile import HEADER_SIZE, write_file
from tiers.stores.nvme.layout import chunk_path, key_digest, namespace_hash, temp_path
from tiers.stores.base import StoreFull
from tiers.testing import flip_bits

PAGE = 8192


def page(seed: int, size: int = PAGE) -> bytes:
    return random.Random(seed).randbytes(size)


def path_of(store, key):
    return chunk_path(store.root, namespace_hash(key[0]), key_digest(*key))


def leftovers(root):
    return [f for _d, _s, files in os.walk(root) for f in files if f.endswith(".tmp")]


@pytest.fixture
def store(tmp_path):
    s = NvmeStore(str(tmp_path / "nvme"), 1 << 20, fsync=True)
    for i in range(4):
        s.put(("ns", f"k{i}"), [memoryview(page(i))])
    yield s
    s.close()


def flip(path, offset):
    flip_bits(path, offset, mask=0x10)


@pytest.mark.parametrize("damage", ["truncate", "payload", "header", "magic", "grow"])
def test_corrupt_file_is_a_miss_and_removed(store, damage):
    key = ("ns", "k1")
    path = path_of(store, key)
    if damage == "truncate":
        os.truncate(path, HEADER_SIZE + PAGE // 2)
    elif damage == "grow":
        with open(path, "ab") as fh:
            fh.write(b"junk")
    else:
        flip(path, {"payload": HEADER_SIZE + 1234, "header": 60, "magic": 0}[damage])
    assert not store.get_into(key, [memoryview(bytearray(PAGE))])
    assert not os.path.exists(path)
    st = store.stats()
    assert (st.pages, st.extra["corrupt_removed"], st.used_bytes) == (3, 1, 3 * (HEADER_SIZE + PAGE))
    assert store.contains([key]) == [False]
    assert bytes(store.get_bytes(("ns", "k2"))) == page(2)


def test_file_deleted_behind_the_store_is_a_logged_miss(store, caplog):
    os.unlink(path_of(store, ("ns", "k1")))
    with caplog.at_level("WARNING", logger="hicache.nvme"):
        assert store.get_bytes(("ns", "k1")) is None
    assert store.contains([("ns", "k1")]) == [False] and store.stats().pages == 3
    assert "vanished" in caplog.text


def test_swapped_files_are_misses(store):
    a, b = path_of(store, ("ns", "k0")), path_of(store, ("ns", "k3"))
    tmp = a + ".swap"
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)
    assert store.get_bytes(("ns", "k0")) is None
    assert not store.get_into(("ns", "k3"), [memoryview(bytearray(PAGE))])
    assert not os.path.exists(a) and not os.path.exists(b)
    assert store.stats().extra["corrupt_removed"] == 2


def test_corruption_found_after_restart(store):
    path = path_of(store, ("ns", "k2"))
    store.close()
    flip(path, HEADER_SIZE + 5)
    with closing(NvmeStore(store.root, 1 << 20)) as reopened:
        assert reopened.stats().pages == 4  # names are trusted at start, content on read
        assert reopened.get_bytes(("ns", "k2")) is None
        assert reopened.stats().pages == 3 and not os.path.exists(path)


def test_crash_between_temp_write_and_rename(store):
    """A killed writer leaves a temp file: the old page stays, the temp goes at restart."""
    key = ("ns", "k0")
    final = path_of(store, key)
    tmp = temp_path(final)
    write_file(tmp, [memoryview(b"\0" * (HEADER_SIZE + PAGE // 3))], fsync=False, direct=False)
    assert bytes(store.get_bytes(key)) == page(0)
    store.close()
    os.unlink(snapshot.path_of(store.root))  # what the kill leaves: no index snapshot, so the start scans
    with closing(NvmeStore(store.root, 1 << 20)) as reopened:
        assert not os.path.exists(tmp) and reopened.stats().extra["temp_removed"] == 1
        assert bytes(reopened.get_bytes(key)) == page(0)


def test_kill_during_puts_never_exposes_partial_pages(tmp_path):
    """kill -9 a process in the middle of a stream of puts; every visible page is whole."""
    root = tmp_path / "killed"
    code = f"""
import sys, random
sys.path.insert(0, {os.getcwd()!r})
from tiers.stores.nvme import NvmeStore, snapshot
s = NvmeStore({str(root)!r}, 64 << 20, fsync=False)
print("ready", flush=True)
i = 0
while True:
    s.put(("ns", f"k{{i % 50}}"), [memoryview(random.Random(i % 50).randbytes(256 << 10))])
    i += 1
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ready"
    deadline = time.monotonic() + 20
    while not any(f.endswith(".kv") for _d, _s, fs in os.walk(root) for f in fs) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # let it get well into a stream of puts
    proc.kill()
    proc.wait()
    with closing(NvmeStore(str(root), 64 << 20)) as store:
        assert leftovers(root) == []
        present = [i for i in range(50) if store.contains([("ns", f"k{i}")])[0]]
        assert present
        for i in present:
            assert bytes(store.get_bytes(("ns", f"k{i}"))) == random.Random(i).randbytes(256 << 10)
        assert store.stats().extra["corrupt_removed"] == 0


def _tmpfs(mnt, size: str):
    """A tmpfs of size mounted at mnt for the test (skipped where mounting is not allowed)."""
    mnt.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {result.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def small_fs(tmp_path):
    yield from _tmpfs(tmp_path / "small", "4m")


def test_enospc_evicts_and_retries(small_fs):
    with closing(NvmeStore(str(small_fs / "nvme"), 64 << 20, fsync=True)) as store:  # capacity far above the device
        size = 512 << 10
        for i in range(30):
            store.put(("ns", f"k{i}"), [memoryview(page(i, size))])
        st = store.stats()
        assert st.extra["enospc_retries"] >= 1 and st.evictions >= 1
        assert bytes(store.get_bytes(("ns", "k29"))) == page(29, size)
        assert leftovers(small_fs) == []


def test_enospc_clean_refusal_keeps_serving(small_fs):
    with closing(NvmeStore(str(small_fs / "nvme"), 64 << 20, fsync=False)) as store:
        for i in range(3):
            store.put(("ns", f"k{i}"), [memoryview(page(i, 256 << 10))])
        with pytest.raises(StoreFull):
            store.put(("ns", "huge"), [memoryview(page(9, 5 << 20))])  # larger than the device
        assert leftovers(small_fs) == [] and store.contains([("ns", "huge")]) == [False]
        assert all(bytes(store.get_bytes(("ns", f"k{i}"))) == page(i, 256 << 10) for i in range(3))
        # Someone else fills the device: nothing left of ours to evict -> refusal, not a crash.
        store.clear()
        try:
            with open(small_fs / "hog", "wb") as fh:
                fh.write(b"\0" * (4 << 20))
        except OSError:
            pass  # the device is full (the write, or the flush at close): what the hog is for
        with pytest.raises(StoreFull):
            store.put(("ns", "k"), [memoryview(page(1, 512 << 10))])
        assert leftovers(small_fs) == [] and store.stats().pages == 0


def test_a_device_full_below_our_count_gives_up_the_kept_files(small_fs):
    """Dead batch files kept to be written over count in our capacity, not the device's: when another user of
    the disk fills it, the put that meets ENOSPC is refused and gives the kept files up, and the next put
    finds room (a single page's put retries at once)."""
    from tests.support.nvme_batches import batch_files, put_batch
    with closing(NvmeStore(str(small_fs / "nvme"), 64 << 20, fsync=False)) as store:  # capacity above the device
        put_batch(store, [f"a{i}" for i in range(8)], range(8))
        store.clear()
        assert store.stats().extra["recycled_kept"] == 1 and len(batch_files(small_fs / "nvme")) == 1
        try:
            with open(small_fs / "hog", "wb") as fh:
                fh.write(b"\0" * (4 << 20))
        except OSError:
            pass  # the device is full: what the hog is for
        keys = [("ns", f"b{i}") for i in range(5)]  # another size: no claim takes the kept file
        out = store.put_many(keys, [[memoryview(page(i, 64 << 10))] for i in range(5)], [None] * 5, time.time() + 30)
        assert all(isinstance(o, StoreFull) for o in out), out
        assert batch_files(small_fs / "nvme") == [] and store.stats().extra["recycled_bytes"] == 0
        out = store.put_many(keys, [[memoryview(page(i, 64 << 10))] for i in range(5)], [None] * 5, time.time() + 30)
        assert out == [None] * 5
        assert all(bytes(store.get_bytes(k)) == page(i, 64 << 10) for i, k in enumerate(keys))
        assert leftovers(small_fs) == []


def aligned(nbytes):
    return memoryview(mmap.mmap(-1, nbytes))


def test_direct_io_round_trip_and_fallback(tmp_path):
    with closing(NvmeStore(str(tmp_path / "d"), 1 << 20, direct_io=True, fsync=False)) as store:
        if not store.stats().extra["direct_io"]:
            pytest.skip("this file system refuses O_DIRECT")
        data = page(5, 16384)
        src = aligned(16384)
        src[:] = data
        store.put(("ns", "a"), [src[:8192], src[8192:]])
        dst = aligned(16384)
        assert store.get_into(("ns", "a"), [dst]) and bytes(dst) == data
        store.put(("ns", "b"), [memoryview(data)[1:], memoryview(data)[:1]])  # unaligned: buffered
        assert bytes(store.get_bytes(("ns", "b"))) == data[1:] + data[:1]


def test_removed_fanout_directory_is_recreated(tmp_path):
    with closing(NvmeStore(str(tmp_path / "nvme"), 1 << 20, fsync=False)) as store:
        store.put(("ns", "k"), [memoryview(page(1))])
        leaf = os.path.dirname(path_of(store, ("ns", "k")))
        shutil.rmtree(leaf)
        store.put(("ns", "k"), [memoryview(page(2))])
        assert bytes(store.get_bytes(("ns", "k"))) == page(2)


def test_direct_io_on_tmpfs_either_way(small_fs):
    # tmpfs accepts O_DIRECT from Linux 6.6 on and refuses it before: both must work.
    with closing(NvmeStore(str(small_fs / "nvme"), 1 << 20, direct_io=True)) as store:
        store.put(("ns", "k"), [memoryview(page(1))])
        assert bytes(store.get_bytes(("ns", "k"))) == page(1)


def test_bench_smoke(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "scripts/bench_nvme.py", "--dir", str(tmp_path / "b"), "--pages", "2",
                             "--page-mib", "0.25", "--reps", "1", "--json", str(out)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert out.exists() and "store/raw" in result.stdout
    shutil.rmtree(tmp_path / "b", ignore_errors=True)


@pytest.mark.parametrize("batched", [False, True])
def test_a_read_without_descriptors_is_a_miss_that_keeps_the_page(tmp_path, batched):
    """EMFILE (a node out of descriptors for a moment) says nothing about the page on disk: the read
    misses, and the page is served once descriptors are back (it was forgotten, an acknowledged page lost)."""
    import resource
    s = NvmeStore(str(tmp_path / "nvme"), 1 << 20, fsync=True)
    keys = [("ns", f"b{i}") for i in range(4)]
    try:
        if batched:
            assert s.put_many(keys, [[memoryview(page(i))] for i in range(4)], [None] * 4, None) == [None] * 4
        else:
            for i, key in enumerate(keys):
                s.put(key, [memoryview(page(i))])
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(int(fd) for fd in os.listdir("/proc/self/fd")) + 1, hard))
        held = []
        try:
            while True:  # every descriptor below the limit taken
                try:
                    held.append(os.open(os.devnull, os.O_RDONLY))
                except OSError:
                    break
            during = [s.get_bytes(key) for key in keys]
        finally:
            for fd in held:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert during == [None] * 4
        assert [bytes(s.get_bytes(key)) for key in keys] == [page(i) for i in range(4)]
        assert s.stats().extra.get("corrupt_removed", 0) == 0
    finally:
        s.close()


@pytest.fixture
def own_fs(tmp_path):
    """A tmpfs of our own: its used blocks are one counter, read at any moment without walking files that
    come and go."""
    yield from _tmpfs(tmp_path / "own", "64m")


def test_sigkill_and_restart_scans_never_take_the_disk_past_capacity(own_fs):
    """A writer that never stops (single pages and batches of 8 in turn) is SIGKILLed at random moments,
    three times, each restart scanning the directory slowly (10 ms a fan-out directory, serving meanwhile)
    while the writes go on.  Sampled every few milliseconds, the file system's used bytes never pass the
    capacity (plus the store's own small files); after each kill the usage ceiling left on disk covers
    every byte of chunks there; at the end every page held reads back the bytes it was written with."""
    from tiers.stores.nvme.ceiling import UsageCeiling
    root, capacity, size = own_fs / "nvme", 4 << 20, 64 << 10
    code = f"""
import sys, time
sys.path.insert(0, {os.getcwd()!r})
from tiers.stores.nvme import NvmeStore, ceiling, index, rebuild
from tiers.stores.base import StoreFull
ceiling.MIN_STEP_BYTES = 0  # steps of capacity / 32, as a large tier's: the ceiling is raised and lowered often
rebuild.START_WAIT_S = 0.0
real_top = index._scan_top
def slow_top(top):
    time.sleep(0.01)
    return real_top(top)
index._scan_top = slow_top
store = NvmeStore({str(root)!r}, {capacity}, fsync=False)
print("ready", flush=True)
i = 0
while True:
    if i >= 20000:  # the keys the test checks at the end
        time.sleep(1)
        continue
    if i % 2:  # a page in a file of its own
        try:
            store.put(("ns", f"{{sys.argv[1]}}-{{i}}"), [memoryview(bytes([i % 251]) * {size})])
        except StoreFull:
            time.sleep(0.001)  # the scan has not counted enough yet
    else:  # a batch of 8 in one batch file
        keys = [("ns", f"{{sys.argv[1]}}-{{i}}-{{j}}") for j in range(8)]
        pages = [[memoryview(bytes([(i + j) % 251]) * {size})] for j in range(8)]
        if any(store.put_many(keys, pages, [None] * 8, time.time() + 30)):
            time.sleep(0.001)
    i += 1
"""
    slack = 64 << 10  # the store's own files: LOCK, usage.ceiling and its temp, a fan-out directory or two

    def used() -> int:
        st = os.statvfs(own_fs)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    rng = random.Random(5)
    peak = 0
    for round_ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", code, f"r{round_}"], stdout=subprocess.PIPE)
        try:
            assert proc.stdout.readline().strip() == b"ready"
            until = time.monotonic() + rng.uniform(1.0, 3.5)  # the slow scan takes ~2.6 s
            while time.monotonic() < until:
                peak = max(peak, used())
                assert peak <= capacity + slack, f"round {round_}: {peak} bytes on the file system"
                time.sleep(0.002)
        finally:
            proc.kill()
            proc.wait()
        on_disk = sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _s, fs in os.walk(root) for f in fs
                      if f not in ("LOCK", "usage.ceiling"))
        assert on_disk <= UsageCeiling(str(root), capacity).load(), f"round {round_}: the ceiling left is too low"
    assert peak >= capacity // 2  # the writer did fill the tier
    with closing(NvmeStore(str(root), capacity)) as store:
        assert store._build.done.wait(30) and store.stats().used_bytes <= capacity
        expected = {}  # every key the writer may have written, and its bytes
        for round_ in range(3):
            for i in range(20000):
                if i % 2:
                    expected[("ns", f"r{round_}-{i}")] = bytes([i % 251])
                else:
                    expected.update({("ns", f"r{round_}-{i}-{j}"): bytes([(i + j) % 251]) for j in range(8)})
        keys = list(expected)
        held = [key for key, present in zip(keys, store.contains(keys)) if present]
        assert len(held) == store.stats().pages > 0  # every page held is one the writer wrote...
        assert all(bytes(store.get_bytes(key)) == expected[key] * size for key in held)  # ...with its bytes

"""The pieces under NvmeStore: chunk header, names and fan-out, codecs, the rebuild scan, group commit."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from tiers.stores.nvme import chunkfile as cf
from tiers.stores.nvme.codec import Codec, shuffle, unshuffle
from tiers.stores.nvme.dirsync import DirSyncer
from tiers.stores.nvme.index import digests_of, scan
from tiers.stores.nvme.layout import chunk_path, is_temp, key_digest, namespace_hash, parse_name, temp_path


def test_header_round_trip_and_every_byte_checked():
    block = memoryview(bytearray(cf.HEADER_SIZE))
    cf.pack_header(block, "ns.a", "key:1", 2, 1000, 700, 12345)
    hdr = cf.parse_header(block)
    assert (hdr.codec, hdr.raw_len, hdr.payload_len, hdr.payload_hash, hdr.namespace, hdr.key) == \
        (2, 1000, 700, 12345, "ns.a", "key:1")
    assert bytes(block[:8]) == cf.MAGIC
    for offset in (0, 9, 30, 50, 2000, cf.HEADER_SIZE - 1):  # fields, names, padding, checksum
        damaged = bytearray(block)
        damaged[offset] ^= 1
        with pytest.raises(cf.CorruptChunk):
            cf.parse_header(damaged)


def test_a_parts_headers_packed_in_c_are_the_python_headers_byte_for_byte():
    """The batch put packs a part's headers and key digests in one C call (tiers/_chunkscan.c pack_headers):
    each block is what chunkfile.pack_header writes and parse_header accepts, each digest the page's
    key_digest; a namespace and key that do not fit a header are a ValueError, not a torn block."""
    from array import array
    from tiers._chunkscan import pack_headers
    keys = ["a" * 64, "k\u00e9y-\u4e2d", "x"]
    raw = array("Q", [65536, 4096, 1 << 33])
    sums = array("Q", [11, 22, (1 << 64) - 1])
    writer = array("Q", [11, 0, (1 << 64) - 1])  # 0: the writer sent no checksum (no flag)
    blocks = bytearray(3 * cf.HEADER_SIZE)
    digests = pack_headers(blocks, "ns/\u00fc".encode(), keys, raw, sums, writer)
    for k, key in enumerate(keys):
        want = bytearray(cf.HEADER_SIZE)
        cf.pack_header(memoryview(want), "ns/\u00fc", key, 0, raw[k], raw[k], sums[k], writer[k])
        got = blocks[k * cf.HEADER_SIZE:(k + 1) * cf.HEADER_SIZE]
        assert got == want
        header = cf.parse_header(got)
        assert (header.key, header.raw_len, header.payload_hash, header.page_sum) == (key, raw[k], sums[k], writer[k])
        assert digests[k] == key_digest("ns/\u00fc", key)
    with pytest.raises(ValueError, match="too long"):
        pack_headers(bytearray(cf.HEADER_SIZE), b"ns", ["k" * 4040], array("Q", [1]), array("Q", [1]),
                     array("Q", [1]))
    with pytest.raises(ValueError, match="a 4 KiB block"):
        pack_headers(bytearray(100), b"ns", ["k"], array("Q", [1]), array("Q", [1]), array("Q", [1]))


def test_names_are_hashes_under_a_two_level_fanout(tmp_path):
    digest, ns_hash = key_digest("ns", "../../etc/passwd"), namespace_hash("ns")
    path = chunk_path(str(tmp_path), ns_hash, digest)
    rel = os.path.relpath(path, tmp_path).split(os.sep)
    assert len(rel) == 3 and all(len(p) == 2 for p in rel[:2]) and "passwd" not in path
    assert parse_name(rel[2]) == (ns_hash, digest)
    assert parse_name("0x" + rel[2][2:]) is None and parse_name("LOCK") is None
    assert key_digest("a", "b:c") != key_digest("a:b", "c")
    tmp = temp_path(path)
    assert is_temp(os.path.basename(tmp)) and os.path.dirname(tmp) == os.path.dirname(path)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4097])
def test_shuffle_inverts(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    assert (unshuffle(shuffle(data)) == data).all()


def test_codec_rejects_garbage():
    codec = Codec("zstd")
    with pytest.raises(ValueError):
        codec.decode(1, b"not zstd", [memoryview(bytearray(10))], 10)
    with pytest.raises(ValueError):
        Codec("lz4")


def test_scan_keeps_foreign_files_and_drops_misplaced(tmp_path):
    root = str(tmp_path)
    good = chunk_path(root, 1, key_digest("ns", "good"))
    os.makedirs(os.path.dirname(good))
    with open(good, "wb") as fh:
        fh.write(bytes(cf.HEADER_SIZE + 10))
    other = next(k for k in (f"k{i}" for i in range(100))
                 if os.path.dirname(chunk_path(root, 1, key_digest("ns", k))) != os.path.dirname(good))
    # A chunk file moved out of its fan-out directory can never be found: removed.
    misplaced = os.path.join(os.path.dirname(good), os.path.basename(chunk_path(root, 1, key_digest("ns", other))))
    with open(misplaced, "wb") as fh:
        fh.write(bytes(cf.HEADER_SIZE + 10))
    with open(os.path.join(os.path.dirname(good), "README"), "w") as fh:
        fh.write("operator notes")
    found = scan(root)
    assert digests_of(found.array()) == [key_digest("ns", "good")]
    assert found.foreign_files == 1 and os.path.exists(os.path.join(os.path.dirname(good), "README"))
    assert not os.path.exists(misplaced) and found.torn_removed == 1


def test_dirsync_group_commit(tmp_path):
    syncer = DirSyncer()
    dirs = [tmp_path / f"d{i}" for i in range(4)]
    for d in dirs:
        d.mkdir()
    errors = []

    def worker(i):
        try:
            for _ in range(20):
                syncer.sync(str(dirs[i % 4]))
        except OSError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and 4 <= syncer.syncs <= 160
    with pytest.raises(OSError):
        syncer.sync(str(tmp_path / "missing"))
    syncer.sync(str(dirs[0]))  # a failed round does not poison the next one


def test_scan_records_each_chunk_once_oldest_first_and_names_nothing_else(tmp_path):
    """The scan (tiers/_chunkscan.c) reads names and stats only: records come oldest mtime first; a symlink,
    a directory or an upper-case name under a chunk's name is not ours and stays; temp files go."""
    root = str(tmp_path)
    paths = []
    for i, age in enumerate([30, 10, 20]):
        path = chunk_path(root, 7, key_digest("ns", f"k{i}"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(bytes(cf.HEADER_SIZE + i))
        os.utime(path, (1_700_000_000 - age, 1_700_000_000 - age))
        paths.append(path)
    leaf = os.path.dirname(paths[0])
    name = os.path.basename(chunk_path(root, 7, key_digest("ns", "other")))
    os.symlink(paths[0], os.path.join(leaf, name))
    os.mkdir(os.path.join(leaf, os.path.basename(chunk_path(root, 7, key_digest("ns", "dir")))))
    with open(os.path.join(leaf, name.upper()), "wb") as fh:
        fh.write(bytes(cf.HEADER_SIZE))
    temp = os.path.join(leaf, "." + os.path.basename(paths[0]) + ".1.2.tmp")
    with open(temp, "wb") as fh:
        fh.write(b"partial")
    found = scan(root)
    records = found.array()
    assert digests_of(records) == [key_digest("ns", f"k{i}") for i in (0, 2, 1)]
    assert records["size"].tolist() == [cf.HEADER_SIZE, cf.HEADER_SIZE + 2, cf.HEADER_SIZE + 1]
    assert records["ns"].tolist() == [7, 7, 7] and records["mtime"].tolist() == [1_699_999_970, 1_699_999_980,
                                                                                   1_699_999_990]
    assert (found.foreign_files, found.temps_removed, found.torn_removed) == (3, 1, 0)
    assert not os.path.exists(temp) and os.path.islink(os.path.join(leaf, name))

"""The remote tier sends pages that are one piece of memory straight out of the engine's host pool.

A pool daemon and a remote tier daemon run on loopback; engines are SGLang
host pools and the real backend (or a raw client attaching a memfd of its
own).  Pages that are one region each (``page_unified`` here; MLA pools) go
to the pool without the daemon's staging copy once the daemon has the host
pool registered with its Transfer Engine (in the background, on first use);
pages in K and V regions apart (``page_first``) keep going through staging.
Either way every page reads back byte for byte with the checksum it was
written with, and an engine that truncates its host pool under a put gets a
refusal, never a dead daemon.
"""
from __future__ import annotations

import mmap
import os

import pytest

pytest.importorskip("mooncake.engine", reason="needs the Mooncake Transfer Engine (pip install -e .[remote-cpu])")

from hicache_ext.lab.sglang_harness import make_keys  # noqa: E402
from tests.support.backend_env import Engine  # noqa: E402
from tests.support.nodes import eventually, remote_node  # noqa: E402
from tiers.wire import protocol as P  # noqa: E402
from tiers.wire.client import Deadlines, TierClient  # noqa: E402

PAGE = 64 << 10


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    node, pool = remote_node(tmp_path_factory.mktemp("in-place"))
    yield node
    assert node.stop() == {"remote": 0}, open(node.log_path).read()[-3000:]
    pool.stop()


def stats(node) -> dict:
    client = TierClient("remote", node.config.tier("remote").endpoint, "_admin", "test")
    try:
        return client.stats()
    finally:
        client.close()


def written_in_place(engine: Engine, first_salt: int) -> int:
    """Back up fresh batches until one goes out in place (the host pool's registration runs in the background
    after the first put asks for it); the salt of that batch's keys."""
    salt = first_salt
    before = stats(engine.node)["region_puts"]

    def one_more():
        nonlocal salt
        salt += 1
        keys = make_keys(4, salt=salt, page_size=16)
        assert engine.write(keys, 0, seed=salt)[0] == 4
        return stats(engine.node)["region_puts"] > before
    assert eventually(one_more, within=15.0, step=0.1), "no put went out of the host pool in place"
    return salt


@pytest.mark.parametrize("layout, in_place", [("page_unified", True), ("page_first", False)])
def test_pages_read_back_exactly_whether_sent_in_place_or_staged(nodes, layout, in_place):
    engine = Engine(nodes, layout=layout, model=f"in-place-{layout}")
    engine.node = nodes
    try:
        if in_place:
            written_in_place(engine, 100)
        before = stats(nodes)["region_puts"]
        keys = make_keys(8, salt=7 + in_place, page_size=16)
        written, sums = engine.write(keys, 0, seed=3)
        assert written == 8
        assert (stats(nodes)["region_puts"] > before) == in_place  # K and V apart: staged, neighbours merged
        assert engine.read(keys, 8) == (8, sums)  # every byte, checked against the sums it was written with
        assert engine.backend.router_stats()["checksum_mismatches"] == 0
    finally:
        engine.close()


@pytest.mark.parametrize("hash_pages", [False, True])
def test_a_host_pool_truncated_under_puts_in_place_is_a_refusal_not_a_dead_daemon(nodes, hash_pages):
    """Without hash_pages the Transfer Engine itself reads the truncated memory (the kernel's send fails it);
    with it the daemon's guarded hash meets it first (source_gone)."""
    endpoint = nodes.config.tier("remote").endpoint
    size = 16 * PAGE
    fd = os.memfd_create("hostile-pool")
    os.ftruncate(fd, size)
    pool = mmap.mmap(fd, size)
    pool[:] = b"k" * size
    client = TierClient("remote", endpoint, f"victim-{hash_pages}", "test", Deadlines(base=2.0), attach=True)
    extra = {"hash_pages": True} if hash_pages else {}
    try:
        client.attach_region(fd, size)
        assert client.lookup(["x"]) == b"\x00" and client.region_id is not None
        desc, counts = P.encode_descriptors([[(i * PAGE, PAGE)] for i in range(8)])  # a page one region
        before = stats(nodes)["region_puts"]
        batch = iter(range(1000))

        def stored_in_place():
            n = next(batch)
            keys = [f"b{n}-p{i}" for i in range(8)]
            assert client.put_region(keys, desc, counts, 8 * PAGE, **extra) == [True] * 8
            return stats(nodes)["region_puts"] > before and keys
        keys = eventually(stored_in_place, within=15.0, step=0.1)
        assert keys, "no put went out of the host pool in place"
        gone = stats(nodes)["source_gone"]
        os.ftruncate(fd, 0)  # the engine's host pool shrinks under the daemon's mapping and the engine's
        for n in range(3):
            assert client.put_region([f"q{n}-0", f"q{n}-1"], desc[:32], counts[:8], 2 * PAGE, **extra) == [False] * 2
        # The daemon is alive, serves, and the pages stored before are intact.
        found, frames = client.get_frames(keys, 8 * PAGE)
        assert found == [True] * 8 and all(f.bytes == b"k" * PAGE for f in frames)
        assert (stats(nodes)["source_gone"] >= gone + 3) == hash_pages
    finally:
        client.close()
        pool.close()
        os.close(fd)

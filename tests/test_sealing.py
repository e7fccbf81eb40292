"""Issue 29, item 7: pages sealed with AES-256-GCM in the engine's process (hicache_ext/sealing.py).

The real backend from SGLang's factory over a real DRAM -> NVMe chain: the
engine reads back exactly what it wrote, while each tier holds only sealed
bytes; a page changed in a tier, or moved under another key, is a miss; an
engine with another key shares nothing; a key file others may read is refused.
"""
from __future__ import annotations

import os

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from hicache_ext.lab.sglang_harness import host_indices_for_pages, page_bytes
from hicache_ext.sealing import NONCE, OVERHEAD, KeyFileError, PageSealer, read_key_file
from tests.support.backend_env import Engine, make_keys
from tests.support.nodes import dram_tier, node_toml, nvme_tier, start_node
from tiers.cli import main as cli
from tiers.wire.client import Deadlines, TierClient


@pytest.fixture
def node(tmp_path):
    runner = start_node(tmp_path, node_toml(dram_tier("8MiB"), nvme_tier("32MiB"), write_policy="write_through"))
    yield runner
    runner.stop()


def new_key(path) -> str:
    assert cli(["keys", "page-key", str(path)]) == 0
    return str(path)


def tier_pages(runner, tier: str, namespace: str, keys):
    """What one tier itself holds under keys: (found, frames), asked directly."""
    client = TierClient(tier, runner.config.tier(tier).endpoint, namespace, "test", Deadlines(base=2.0))
    try:
        return client.get_frames(keys, len(keys) << 20)
    finally:
        client.close()


def put_raw(runner, tier: str, namespace: str, keys, pages):
    client = TierClient(tier, runner.config.tier(tier).endpoint, namespace, "test", Deadlines(base=2.0))
    try:
        return client.put_frames(keys, [[p] for p in pages], sum(len(p) for p in pages))
    finally:
        client.close()


@pytest.mark.parametrize("layout, interface_v1", [("page_first", True), ("layer_first", True), ("page_first", False)],
                         ids=["page_first", "layer_first-runs", "legacy"])
def test_sealed_pages_read_back_exactly_and_no_tier_holds_plaintext(node, tmp_path, layout, interface_v1):
    key_file = new_key(tmp_path / "page.key")
    engine = Engine(node, layout=layout, interface_v1=interface_v1, page_key_file=key_file)
    try:
        keys = make_keys(6, salt=7, page_size=16)
        written, sums = engine.write(keys, 0, seed=3)
        assert written == 6
        plain = page_bytes(engine.pool, host_indices_for_pages(engine.pool, 0, 6))
        done, got = engine.read(keys, 0)
        assert done == 6 and got == sums  # byte for byte, through the tiers

        namespace = engine.backend.namespace
        assert ".sealed-" in namespace
        aead = AESGCM(read_key_file(key_file))
        for tier in ("dram", "nvme"):
            found, frames = tier_pages(node, tier, namespace, keys)
            assert found == [True] * 6, tier
            for key, frame, page in zip(keys, frames, plain):
                sealed = frame.bytes
                assert len(sealed) == len(page) + OVERHEAD
                assert page[:256] not in sealed and page[-256:] not in sealed  # no run of plaintext in the tier
                assert aead.decrypt(sealed[:NONCE], sealed[NONCE:], namespace.encode() + b"\0" + key.encode()) \
                    == page  # sealed under its namespace and key, nothing else
    finally:
        engine.close()


def test_a_page_changed_or_moved_in_a_tier_is_a_miss_never_served(node, tmp_path):
    key_file = new_key(tmp_path / "page.key")
    engine = Engine(node, page_key_file=key_file)
    try:
        keys = make_keys(4, salt=9, page_size=16)
        written, sums = engine.write(keys, 0, seed=5)
        assert written == 4
        namespace = engine.backend.namespace
        found, frames = tier_pages(node, "dram", namespace, keys)
        sealed = [bytearray(f.bytes) for f in frames]
        flipped = bytearray(sealed[1])
        flipped[len(flipped) // 2] ^= 1
        # In both tiers: page 1 with one bit flipped, page 2 replaced by page 0 (a valid page, wrong key).
        for tier in ("dram", "nvme"):
            assert put_raw(node, tier, namespace, keys[1:3], [bytes(flipped), bytes(sealed[0])]) == [True, True]
        done, got = engine.read(keys, 0)
        assert done == 1 and got[0] == sums[0]  # the prefix stops at the first page that fails to open
        stats = engine.backend.router_stats()
        assert stats["sealed_refused"] >= 1 and stats["checksum_mismatches"] == 0
    finally:
        engine.close()


def test_engines_with_another_key_or_none_share_nothing(node, tmp_path):
    ours = Engine(node, page_key_file=new_key(tmp_path / "a.key"))
    theirs = Engine(node, page_key_file=new_key(tmp_path / "b.key"))
    plain = Engine(node)
    try:
        keys = make_keys(3, salt=11, page_size=16)
        assert ours.write(keys, 0, seed=1)[0] == 3
        assert len({ours.backend.namespace, theirs.backend.namespace, plain.backend.namespace}) == 3
        assert theirs.driver.exists(keys) == 0 and plain.driver.exists(keys) == 0
        # Even forced into our namespace, another key opens nothing.
        intruder = PageSealer(read_key_file(str(tmp_path / "b.key")), ours.backend.namespace)
        found, frames = tier_pages(node, "dram", ours.backend.namespace, keys)
        target = bytearray(len(frames[0].bytes) - OVERHEAD)
        assert not intruder.open_into(keys[0], frames[0].buffer, [memoryview(target)])
    finally:
        for engine in (ours, theirs, plain):
            engine.close()


def test_a_key_file_others_can_read_or_of_the_wrong_size_is_refused(tmp_path):
    loose = new_key(tmp_path / "loose.key")
    os.chmod(loose, 0o644)
    with pytest.raises(KeyFileError, match="readable by others"):
        read_key_file(loose)
    short = tmp_path / "short.key"
    short.write_text("abcd\n")
    os.chmod(short, 0o600)
    with pytest.raises(KeyFileError, match="neither 32 bytes nor 64 hex digits"):
        read_key_file(str(short))
    with pytest.raises(KeyFileError, match="No such file"):
        read_key_file(str(tmp_path / "missing.key"))
    assert cli(["keys", "page-key", loose]) == 1  # an existing key is never overwritten without --force


@pytest.mark.parametrize("run_bytes", [(100, 1, 4096, 17), (700_000, 3, 900_000)], ids=["gathered", "streamed"])
def test_a_page_in_several_runs_seals_and_opens(run_bytes):
    sealer = PageSealer(os.urandom(32), "ns")
    runs = [memoryview(bytearray(os.urandom(n))) for n in run_bytes]
    sealed = sealer.seal("k", runs)
    assert len(sealed) == sum(r.nbytes for r in runs) + OVERHEAD
    out = [memoryview(bytearray(r.nbytes)) for r in runs]
    assert sealer.open_into("k", memoryview(sealed), out)
    assert [bytes(o) for o in out] == [bytes(r) for r in runs]
    assert not sealer.open_into("other", memoryview(sealed), out)  # the key is bound in
    sealed[NONCE] ^= 1
    assert not sealer.open_into("k", memoryview(sealed), out) and sealer.refused == 2

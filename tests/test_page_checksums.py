"""End-to-end page checksums: a wrong byte from any tier is a miss, never a KV page served to the engine.

Real daemons and the real backend through SGLang's factory.  Daemons started
with HICACHE_TIERS_TEST_CORRUPT_READS=N damage the first N pages they serve
(tiers/node/faults.py); the backend must read them as misses, count them and
still read every other page exactly.
"""
import pytest

from hicache_ext.lab.sglang_harness import make_keys, page_checksums, zero_pages
from tests.support.backend_env import Engine
from tests.support.nodes import dram_tier, eventually, node_toml, nvme_tier
from tiers.node.faults import ENV
from tiers.ops.node_runner import NodeRunner
from tiers.wire.client import TierClient

PAGE_BYTES = 32 << 10  # the SMALL_SHAPE page


@pytest.fixture
def make_node(tmp_path):
    """Start a node; corrupt: {tier: value of HICACHE_TIERS_TEST_CORRUPT_READS for that daemon}."""
    runners = []

    def make(config: str, corrupt=None) -> NodeRunner:
        where = tmp_path / f"n{len(runners)}"
        runner = NodeRunner(config, str(where / "run"), str(where / "data"))
        runners.append(runner)
        for tier in runner.config.tiers:
            runner.start(tier.name, env={ENV: corrupt[tier.name]} if tier.name in (corrupt or {}) else None)
        return runner

    yield make
    for runner in runners:
        runner.stop()


def mismatches(engine) -> int:
    return engine.backend.router_stats()["checksum_mismatches"]


def kept_sums(runner, tier: str, engine, keys):
    """The checksums a tier keeps with keys' pages, asked directly (a frames read: no hook is on here)."""
    client = TierClient(tier, runner.config.tier(tier).endpoint, engine.backend.namespace)
    try:
        sums = []
        found, _frames = client.get_frames(keys, len(keys) * PAGE_BYTES, sums)
        assert found == [True] * len(keys)
        return sums
    finally:
        client.close()


def read_flags(engine, keys, first_page: int):
    """batch_get_v1's own flags into zeroed pages, and the host pool's checksums of those pages after it."""
    idx = engine.indices(first_page, len(keys))
    zero_pages(engine.pool, idx)
    return engine.backend.batch_get_v1(keys, idx), page_checksums(engine.pool, idx)


TIERS = {"dram": node_toml(dram_tier("4MiB")), "nvme": node_toml(nvme_tier("16MiB"))}


@pytest.mark.parametrize("tier", ["dram", "nvme"])
def test_pages_read_back_exactly_with_the_checksums_they_were_written_with(make_node, tier):
    runner = make_node(TIERS[tier])
    engine = Engine(runner, model=f"clean-{tier}")
    try:
        keys = make_keys(6, salt=1, page_size=16)
        written, sums = engine.write(keys, 0, seed=1)
        assert written == 6
        # Each page's xxh3 as the engine wrote it, kept with the page (one tier: the daemon hashed it in its copy).
        assert kept_sums(runner, tier, engine, keys) == sums
        assert engine.read(keys, 8) == (6, sums)
        assert mismatches(engine) == 0
    finally:
        engine.close()


# (tier, allocator, interface_v1): leased reads (with and without a host pool memfd), and frames (legacy path).
CORRUPT_CASES = [("dram", "shm", True), ("dram", "default", True), ("dram", "default", False), ("nvme", "shm", True)]


@pytest.mark.parametrize("tier,allocator,interface_v1", CORRUPT_CASES)
def test_corrupted_reads_are_misses_and_the_rest_read_exactly(make_node, tier, allocator, interface_v1):
    runner = make_node(TIERS[tier], corrupt={tier: "2"})
    engine = Engine(runner, allocator=allocator, interface_v1=interface_v1, model=f"bad-{tier}-{allocator}")
    try:
        keys = make_keys(6, salt=2, page_size=16)
        written, sums = engine.write(keys, 0, seed=2)
        assert written == 6
        # SGLang counts leading hits: the first two pages came back damaged, so nothing is read.
        assert engine.driver.prefetch(keys, engine.indices(8, 6)) == 0
        assert mismatches(engine) == 2
        if interface_v1:  # zero-copy: the backend copied the pages into the host pool itself, then checked them
            got = page_checksums(engine.pool, engine.indices(8, 6))
            assert got[:2] != sums[:2]  # the damaged bytes did reach the host pool: the check refused them
            assert got[2:] == sums[2:]
        assert engine.read(keys[2:], 16) == (4, sums[2:])  # undamaged pages read exactly
        # Leased DRAM pages are damaged where they are stored (as a bit flip in memory would be): they stay
        # misses.  Other tiers damaged one staged copy, or a frame: the page itself reads exactly.
        at_rest = tier == "dram" and interface_v1
        done, again = engine.read(keys[:2], 16)
        assert done == (0 if at_rest else 2) and (at_rest or again == sums[:2])
        assert mismatches(engine) == (4 if at_rest else 2)
    finally:
        engine.close()


def test_every_page_of_a_batch_is_checked(make_node):
    """The backend's own flags: each damaged page is False; the pages after it were checked too."""
    runner = make_node(TIERS["nvme"], corrupt={"nvme": "all"})
    engine = Engine(runner, model="all-bad")
    try:
        keys = make_keys(4, salt=3, page_size=16)
        assert engine.write(keys, 0, seed=3)[0] == 4
        flags, _got = read_flags(engine, keys, 8)
        assert flags == [False] * 4 and mismatches(engine) == 4
    finally:
        engine.close()


def chain(write_policy: str = "write_back") -> str:
    return node_toml(dram_tier(8 * PAGE_BYTES), nvme_tier(), write_policy=write_policy)


def write_past_dram(engine, keys):
    """12 pages into a DRAM tier of 8 (write_back): the 4 oldest are demoted to NVMe on eviction."""
    sums = []
    for first in range(0, 12, 4):
        written, batch_sums = engine.write(keys[first:first + 4], first, seed=10 + first)
        assert written == 4
        sums += batch_sums
    return sums


def test_write_back_demotion_and_promotion_keep_each_pages_checksum(make_node):
    runner = make_node(chain())
    engine = Engine(runner, write_policy="write_back", model="wb-clean", promote_min_reads=1)
    try:
        keys = make_keys(12, salt=4, page_size=16)
        sums = write_past_dram(engine, keys)
        assert eventually(lambda: engine.backend.tier_stats()["dram"]["demotions"] == 4)
        assert kept_sums(runner, "nvme", engine, keys[:4]) == sums[:4]  # demoted with their sums
        assert engine.read(keys[:4], 12) == (4, sums[:4])  # from NVMe, checked
        assert eventually(lambda: engine.backend.router_stats()["promotions_done"] == 4)
        assert kept_sums(runner, "dram", engine, keys[:4]) == sums[:4]  # promoted with their sums
        assert mismatches(engine) == 0
    finally:
        engine.close()


def test_write_back_pages_damaged_below_are_misses(make_node):
    runner = make_node(chain(), corrupt={"nvme": "2"})
    engine = Engine(runner, write_policy="write_back", model="wb-bad", promote_min_reads=1)
    try:
        keys = make_keys(12, salt=5, page_size=16)
        sums = write_past_dram(engine, keys)
        assert eventually(lambda: engine.backend.tier_stats()["dram"]["demotions"] == 4)
        flags, got = read_flags(engine, keys[:4], 12)  # demoted: NVMe serves them, the first two it serves damaged
        # NVMe reads a batch's runs on several threads at once and marks each as it ends: which two pages it
        # serves first is the threads' to say, not the keys' order.
        bad = [i for i, ok in enumerate(flags) if not ok]
        assert len(bad) == 2 and mismatches(engine) == 2
        assert all(got[i] != sums[i] for i in bad) and all(got[i] == sums[i] for i in range(4) if i not in bad)
        assert eventually(lambda: engine.backend.router_stats()["promotions_done"] == 2)  # only the good ones
        assert eventually(lambda: engine.backend.tier_stats()["dram"]["demotions"] == 6)  # what they evicted
        assert engine.read(keys, 12) == (12, sums)  # NVMe's copies were sound: everything reads exactly now
        assert mismatches(engine) == 2
    finally:
        engine.close()


def test_a_page_damaged_in_dram_is_never_demoted(make_node):
    """write_back: NVMe checks what it is handed against the writer's checksum, so DRAM's damaged copy is
    refused on its way down (counted), not stored below under a checksum it does not match."""
    runner = make_node(chain(), corrupt={"dram": "1"})
    engine = Engine(runner, write_policy="write_back", model="wb-refused")
    try:
        keys = make_keys(12, salt=8, page_size=16)
        sums = write_past_dram(engine, keys)  # the 4 oldest go down sound
        assert eventually(lambda: engine.backend.tier_stats()["dram"]["demotions"] == 4)
        flags, _got = read_flags(engine, keys[4:5], 12)
        assert flags == [False] and mismatches(engine) == 1
        for first in range(12, 20, 4):  # 8 more pages evict keys 4..11, dirty: all go down, one refused
            assert engine.write(make_keys(4, salt=80 + first, page_size=16), first, seed=first)[0] == 4
        assert eventually(lambda: engine.backend.tier_stats()["dram"]["demotion_failures"] == 1)
        assert engine.backend.tier_stats()["nvme"]["checksum_refused"] == 1
        flags, got = read_flags(engine, keys[4:12], 12)
        assert flags == [False] + [True] * 7 and got[1:] == sums[5:12]
    finally:
        engine.close()


def test_a_page_damaged_in_dram_is_read_from_the_tier_below(make_node):
    """write_through: DRAM's damaged copy is a miss there, so the router reads NVMe's, and promotes it back."""
    runner = make_node(chain("write_through"), corrupt={"dram": "1"})
    engine = Engine(runner, write_policy="write_through", model="wt-heal", promote_min_reads=1)
    try:
        keys = make_keys(3, salt=6, page_size=16)
        written, sums = engine.write(keys, 0, seed=6)
        assert written == 3
        assert engine.read(keys, 8) == (3, sums)
        assert mismatches(engine) == 1
        assert eventually(lambda: engine.backend.router_stats()["promotions_done"] == 1)
        assert engine.read(keys, 8) == (3, sums) and mismatches(engine) == 1  # DRAM holds a sound copy again
    finally:
        engine.close()


def test_remote_pool_pages_carry_their_checksums_and_damage_is_a_miss(make_node):
    """The remote tier: the pool keeps each page's sum (alloc, locate); its daemon's damaged reads are misses."""
    pytest.importorskip("mooncake.engine", reason="needs the Mooncake Transfer Engine (pip install -e .[remote-cpu])")
    from tiers.stores.remote.loopback import free_ports, pool_config, remote_node_config
    (port,) = free_ports(1)
    make_node(pool_config([port], capacity="16MiB", block_size="32KiB"))
    runner = make_node(remote_node_config([port]), corrupt={"remote": "1"})
    engine = Engine(runner, model="remote")
    try:
        keys = make_keys(3, salt=7, page_size=16)
        written, sums = engine.write(keys, 0, seed=7)
        assert written == 3
        flags, got = read_flags(engine, keys, 8)
        assert flags == [False, True, True] and mismatches(engine) == 1
        assert got[1:] == sums[1:]
        assert engine.read(keys, 8) == (3, sums)  # the pool's copy was sound
        assert kept_sums(runner, "remote", engine, keys) == sums
    finally:
        engine.close()


def test_with_page_checksums_off_nothing_is_hashed_or_checked(tmp_path):
    """The switch: writes carry no sums (unknown to every tier) and reads are not checked."""
    from hicache_ext.page_sums import ReadChecks
    checks = ReadChecks(enabled=False)
    page = [memoryview(b"x" * 64)]
    assert checks.sums_of([page]) == b""
    assert checks.verify("dram", ["k"], [True], [12345], lambda idx: [page]) == [True]
    assert checks.counters() == {"checksum_mismatches": 0}
    on = ReadChecks()
    assert on.verify("dram", ["k"], [True], [12345], lambda idx: [page]) == [False]
    assert on.counters() == {"checksum_mismatches": 1}

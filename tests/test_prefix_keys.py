"""Prefix keys (hicache_storage_pass_prefix_keys) link pages across SGLang's 128-page batches and
across requests, so prefix-aware eviction (radix-LRU) trims a prompt from its tail.

Without the links each batch's first page is a root and the previous batch's
last page a leaf, so eviction punches a hole at page 127 and every page after
it is lost to the prefix match.
"""
import pytest

from hicache_ext.lab.sglang_harness import make_keys
from tests.support.backend_env import Engine
from tests.support.nodes import dram_config, start_node

PAGE = 32 * 1024  # SMALL_SHAPE pages
FIRST, SECOND, OTHER = 200, 100, 150  # request 1 (two batches), its continuation, an unrelated prompt
CAPACITY = 400  # pages: 450 written, so at least 50 are evicted


@pytest.fixture
def node(tmp_path):
    runner = start_node(tmp_path, dram_config(capacity=f"{CAPACITY * PAGE // 1024}KiB", policy="radix-lru",
                                              block_size="32KiB"))
    yield runner
    runner.stop()


@pytest.mark.parametrize("linked", [True, False])
def test_eviction_trims_the_prompt_from_its_tail_only_with_prefix_keys(node, linked):
    engine = Engine(node, model=f"prefix-{linked}", pages=FIRST + SECOND + OTHER)
    try:
        prompt = make_keys(FIRST + SECOND, salt=77)
        other = make_keys(OTHER, salt=78)
        prefix = (lambda keys: list(keys)) if linked else (lambda keys: None)
        idx = engine.indices
        # Request 1 (two batches of the backup thread), then request 2 continues the same chain.
        assert engine.driver.backup(prompt[:FIRST], idx(0, FIRST), prefix_keys=prefix([])) == FIRST
        assert engine.driver.backup(prompt[FIRST:], idx(FIRST, SECOND), prefix_keys=prefix(prompt[:FIRST])) == SECOND
        assert engine.driver.backup(other, idx(FIRST + SECOND, OTHER), prefix_keys=prefix([])) == OTHER
        held = engine.backend._route().held(prompt)
        kept = sum(held)
        assert kept <= CAPACITY - OTHER + 1  # eviction did happen, and took pages of the older prompt
        leading = engine.driver.exists(prompt)
        if linked:
            assert leading == kept and held == bytes([1] * kept + [0] * (len(prompt) - kept))
        else:
            assert leading <= 128 and leading < kept  # a hole at a batch or request boundary
    finally:
        engine.close()

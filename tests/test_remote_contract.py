"""The remote tier (a RemoteStore over a real pool daemon on loopback) against the store contract kit.

Its batches are what the kit's batched tests check: exact bytes both ways, and
a call past its deadline lands nothing.  The pool evicts by its own policy, so
the eviction listener does not apply; capacity is the pool's.
"""
import pytest

pytest.importorskip("mooncake.engine", reason="needs the Mooncake Transfer Engine (pip install -e .[remote-cpu])")

from tiers.ops.node_runner import NodeRunner
from tiers.stores.remote.engine import Engine, EngineConfig
from tiers.stores.remote.loopback import free_ports, pool_config
from tiers.stores.remote.store import RemoteStore
from tiers.testing import StoreContract

BLOCK = 16 << 10
POOL_BYTES = 64 * BLOCK


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("remote-contract")
    (port,) = free_ports(1)
    runner = NodeRunner(pool_config([port], capacity=f"{POOL_BYTES}B", block_size=f"{BLOCK}B",
                                    max_page_bytes="1MiB"), str(tmp / "run"), str(tmp / "data"))
    runner.start()
    engine = Engine(EngineConfig(hostname="127.0.0.1"))
    try:
        yield f"tcp://127.0.0.1:{port}", engine
    finally:
        runner.stop()


class TestRemoteStore(StoreContract):
    capacity = POOL_BYTES
    page_bytes = BLOCK
    reports_evictions = False

    @pytest.fixture(autouse=True)
    def _pool(self, pool):
        self._endpoint, self._engine = pool

    def make_store(self, path, capacity, policy, max_page_bytes, evictions=None):
        assert capacity == POOL_BYTES and policy == "lru"  # the pool's, fixed at its start
        store = RemoteStore([self._endpoint], self._engine, max_page_bytes=max_page_bytes, pool_timeout=1.0)
        store.clear()  # one pool serves every test of the class
        return store

"""The example plug-in against hicache-tiers' contract kit: run with pytest from this directory."""
import os

from hicache_tier_tmpfs.arena import ArenaStore
from hicache_tier_tmpfs.mru import MRUPolicy
from hicache_tier_tmpfs.store import TmpfsStore, _name
from tiers.testing import PolicyContract, StoreContract, drain, flip_bits


class TestTmpfsStore(StoreContract):

    def make_store(self, path, capacity, policy, max_page_bytes, evictions=None):
        return TmpfsStore(path, capacity, policy, max_page_bytes, evictions)

    def corrupt(self, store, key):
        flip_bits(os.path.join(store.path, _name(key)), -1, mask=1)
        return True


class TestArenaStore(StoreContract):
    """The kit's arena cases (three-step writes, batches, leases) run for this one: it exports its arena."""

    def make_store(self, path, capacity, policy, max_page_bytes, evictions=None):
        return ArenaStore(capacity, policy, max_page_bytes, evictions, block_size=4096)


class TestMRUPolicy(PolicyContract):
    def make_policy(self):
        return MRUPolicy()


def test_mru_evicts_the_most_recent_first():
    policy = MRUPolicy()
    for key in "abcd":
        policy.insert(key)
    policy.touch("b")
    assert drain(policy) == ["b", "d", "c", "a"]

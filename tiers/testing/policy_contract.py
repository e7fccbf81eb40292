"""The eviction-policy contract: what every policy, built-in or plug-in, must satisfy.

A plug-in's tests subclass it and say which policy to build:

    from tiers.testing import PolicyContract

    class TestMRU(PolicyContract):
        def make_policy(self):
            return MRUPolicy()

The semantics are tiers/policies/__init__.py's; the built-ins run the same
tests (tests/test_policies.py).
"""
from __future__ import annotations

import random
import time

import pytest

from tiers.policies.base import EvictionPolicy


def drain(policy) -> list:
    """Pop every victim until the policy is empty."""
    victims = []
    while True:
        key = policy.pop_victim()
        if key is None:
            return victims
        victims.append(key)


class PolicyContract:
    """Subclass as Test...; override make_policy."""

    def make_policy(self) -> EvictionPolicy:
        raise NotImplementedError("return the policy under test")

    def test_is_an_eviction_policy_with_a_summary(self):
        policy = self.make_policy()
        assert isinstance(policy, EvictionPolicy) and policy.name
        assert type(policy).__doc__ and type(policy).__doc__.strip().splitlines()[0].endswith(".")

    def test_empty(self):
        policy = self.make_policy()
        assert len(policy) == 0
        assert policy.pop_victim() is None
        assert "a" not in policy
        policy.touch("a")
        policy.remove("a")
        assert len(policy) == 0

    def test_insert_len_in_and_duplicate(self):
        policy = self.make_policy()
        for key in range(5):
            policy.insert(key, parent=key - 1 if key else None)
        assert len(policy) == 5 and all(k in policy for k in range(5)) and 5 not in policy
        with pytest.raises(ValueError):
            policy.insert(3)
        assert len(policy) == 5

    def test_pop_returns_every_key_once(self):
        policy = self.make_policy()
        for key in range(50):
            policy.insert(key, parent=key - 1 if key % 5 else None)
        for key in range(0, 50, 3):
            policy.touch(key)
        victims = drain(policy)
        assert sorted(victims) == list(range(50))
        assert len(policy) == 0 and policy.pop_victim() is None

    def test_remove_forgets_without_eviction(self):
        policy = self.make_policy()
        for key in range(10):
            policy.insert(key, parent=key - 1 if key else None)  # one chain: removals orphan children
        policy.remove(4)
        policy.remove(0)
        policy.remove(99)
        assert len(policy) == 8 and 4 not in policy and 0 not in policy
        assert sorted(drain(policy)) == [1, 2, 3, 5, 6, 7, 8, 9]
        policy.insert(4)  # a removed key may come back
        assert policy.pop_victim() == 4

    def test_a_policy_that_evicts_new_pages_last_may_have_room_made_ahead(self):
        """evicts_new_pages_last = True promises that inserting keys changes neither which older key goes
        next nor lets a new key go while an older one remains: after any history, popping k victims before
        inserting a batch gives the victims that popping them after it gives (a store then makes room for a
        batch ahead of inserting it, tiers/stores/dram.py reserve_many)."""
        if not type(self.make_policy()).evicts_new_pages_last:
            pytest.skip("makes no such promise (evicts_new_pages_last = False): page by page only")
        rng = random.Random(7)
        for trial in range(40):
            history = []
            for step in range(60):
                key = rng.randrange(40)
                history.append(("touch" if rng.random() < 0.3 else "insert", key))
            before, after = self.make_policy(), self.make_policy()
            for policy in (before, after):
                for op, key in history:
                    if op == "insert" and key not in policy:
                        policy.insert(key)
                    elif op == "touch":
                        policy.touch(key)
            batch = [100 + i for i in range(rng.randint(1, 8))]
            k = rng.randint(1, len(before))
            early = [before.pop_victim() for _ in range(k)]
            for key in batch:
                after.insert(key)
            late = [after.pop_victim() for _ in range(k)]
            assert early == late, f"trial {trial}: {early} != {late}"

    def test_random_operations_match_a_set(self):
        rng = random.Random(11)
        policy, model = self.make_policy(), set()
        for _ in range(20_000):
            op, key = rng.random(), rng.randrange(300)
            if op < 0.4:
                if key in model:
                    with pytest.raises(ValueError):
                        policy.insert(key)
                else:
                    policy.insert(key, parent=rng.choice([None, key - 1, key + 1]))
                    model.add(key)
            elif op < 0.7:
                policy.touch(key)
            elif op < 0.8:
                policy.remove(key)
                model.discard(key)
            else:
                victim = policy.pop_victim()
                assert (victim is None) == (not model)
                model.discard(victim)
            assert len(policy) == len(model)
        assert all(k in policy for k in model)
        assert sorted(drain(policy)) == sorted(model)

    def test_100k_keys_in_linear_time(self):
        policy = self.make_policy()
        keys = range(100_000)
        start = time.perf_counter()
        for key in keys:
            policy.insert(key, parent=key - 1 if key % 20 else None)
        for key in range(0, 100_000, 2):
            policy.touch(key)
        for _ in range(50_000):
            policy.pop_victim()
        for key in range(100_000, 150_000):
            policy.insert(key)
            policy.pop_victim()
        assert len(policy) == 50_000
        assert time.perf_counter() - start < 3.0  # ~0.6 s here; the old LFU (a scan per pop) took 5 s

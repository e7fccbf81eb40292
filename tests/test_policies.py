"""The eviction-policy contract for every registered policy, and each policy's own order."""
from __future__ import annotations

import pytest

from tiers.plugins import make_policy, policy_names
from tiers.testing import PolicyContract, drain

ALL = policy_names()


def test_registry_has_the_shared_policies():
    assert {"lru", "fifo", "lfu", "s3fifo", "radix-lru"} <= set(ALL)
    assert make_policy("LRU").name == "lru"
    with pytest.raises(ValueError, match="no eviction policy .nope.; installed: .*lru"):
        make_policy("nope")


# The contract every policy satisfies (tiers/testing/policy_contract.py), once per installed policy.
for _name in ALL:
    globals()[f"TestContract_{_name.replace('-', '_')}"] = type(
        f"TestContract_{_name}", (PolicyContract,), {"make_policy": lambda self, n=_name: make_policy(n)})


@pytest.mark.parametrize("name, order", [("lru", ["b", "c", "d", "a"]), ("fifo", ["a", "b", "c", "d"])])
def test_lru_refreshes_on_hit_fifo_does_not(name, order):
    policy = make_policy(name)
    for key in "abcd":
        policy.insert(key)
    policy.touch("a")
    assert drain(policy) == order


def test_lfu_least_frequent_then_least_recent_and_next_minimum():
    policy = make_policy("lfu")
    for key in "abcde":
        policy.insert(key)
    for key, reads in (("a", 3), ("b", 1), ("c", 3), ("d", 5)):
        for _ in range(reads):
            policy.touch(key)
    # counts: a=4 c=4 d=6 b=2 e=1; once e and b leave, the minimum jumps to 4 (no bucket 3)
    assert drain(policy) == ["e", "b", "a", "c", "d"]
    policy.insert("x")
    policy.touch("x")
    policy.insert("y")
    policy.remove("y")  # the min bucket empties by removal: the next minimum is 2
    policy.insert("z")
    policy.touch("z")
    policy.touch("z")
    assert drain(policy) == ["x", "z"]


def test_s3fifo_probation_promotion_and_ghost():
    policy = make_policy("s3fifo")
    for key in range(10):
        policy.insert(key)
    policy.touch(0)
    policy.touch(1)
    # small holds all 10 keys: the read ones move to main, the first unread one goes to the ghost
    assert policy.pop_victim() == 2
    assert [policy.pop_victim() for _ in range(7)] == [3, 4, 5, 6, 7, 8, 9]
    # the ghost keeps int(0.9 x resident) names, so only 8 and 9 are left in it
    policy.insert(9)  # remembered by the ghost: enters main, behind 0 and 1
    policy.insert(20)  # unknown: enters small
    # small (1 of 4 keys) >= 10%: its unread key goes first; then main as a CLOCK: 0 and 1 get a second chance
    assert drain(policy) == [20, 9, 0, 1]


def test_s3fifo_rejects_bad_options():
    with pytest.raises(ValueError):
        make_policy("s3fifo", small_ratio=1.5)


def test_radix_lru_evicts_leaves_tail_first():
    policy = make_policy("radix-lru")
    policy.insert("a")
    policy.insert("b", parent="a")
    policy.insert("c", parent="b")
    policy.insert("d")
    policy.touch("a")
    # LRU would evict b first and strand c; here b waits until its child c has gone
    assert drain(policy) == ["c", "b", "d", "a"]


def test_radix_lru_unknown_parent_is_a_root_and_remove_orphans_children():
    policy = make_policy("radix-lru")
    policy.insert("x", parent="gone")
    policy.insert("p")
    policy.insert("k", parent="p")
    policy.remove("p")  # k becomes a root
    policy.insert("p")
    assert drain(policy) == ["x", "k", "p"]

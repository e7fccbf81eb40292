"""Contract tests for plug-ins: subclass these in a test module (pytest collects the subclasses).

- ``StoreContract``: a tier's page store (tiers/stores/base.py).
- ``PolicyContract``: an eviction policy (tiers/policies/).
Needs pytest (and numpy for page bytes); nothing here runs in a daemon.
"""
from tiers.testing.policy_contract import PolicyContract, drain
from tiers.testing.store_contract import RecordingListener, StoreContract, flip_bits, page, split

__all__ = ["PolicyContract", "RecordingListener", "StoreContract", "drain", "flip_bits", "page", "split"]

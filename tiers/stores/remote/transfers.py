"""What a remote store's reads and writes share: the pools and engine pages move through, the node's
registered memory, the counters, and how long a transfer may take.

A transfer is bounded by ``transfer_timeout`` plus its bytes at ``min_bandwidth``
and, in a batch, by the request's deadline; a pool's lease on the pages
outlives it by ``lease_margin``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from tiers.stores.remote.engine import Engine
from tiers.stores.remote.pools import Pools
from tiers.stores.remote.staging import Abandoned, Counters, Registrations


@dataclass
class Transfers:
    """What tiers/stores/remote/reads.py and writes.py need of the store they move pages for."""

    pools: Pools
    engine: Engine
    registrations: Registrations  # host pools and staging the engine moves bytes from and into directly
    abandoned: Abandoned  # transfers given up at their deadline, until the engine says they ended
    counters: Counters
    max_page_bytes: int
    transfer_timeout: float
    min_bandwidth: float
    lease_margin: float

    def timeout(self, nbytes: int) -> float:
        return self.transfer_timeout + nbytes / self.min_bandwidth


def budget(timeout: float, deadline: Optional[float]) -> float:
    """A transfer's timeout, cut at the request's absolute deadline (Unix seconds)."""
    return timeout if deadline is None else min(timeout, deadline - time.time())

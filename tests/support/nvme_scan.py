"""The NVMe tier's restart scan held back, so a test can act while the store serves an index being rebuilt."""
from __future__ import annotations

import threading


def held_back_scan(monkeypatch) -> threading.Event:
    """The next restart scan waits for the event returned (at most 30 s) and the store serves at once.  The
    usage ceiling steps by capacity / 32, as a large tier's does (a test's tiny tier would otherwise keep it
    at its capacity and take no write until the scan ends: tiers/stores/nvme/ceiling.py MIN_STEP_BYTES)."""
    from tiers.stores.nvme import ceiling, index, rebuild
    monkeypatch.setattr(ceiling, "MIN_STEP_BYTES", 0)
    release = threading.Event()
    real_parts = index.scan_parts

    def held_back(root, stop=None):
        release.wait(30)
        yield from real_parts(root, stop)
    monkeypatch.setattr(index, "scan_parts", held_back)
    monkeypatch.setattr(rebuild, "START_WAIT_S", 0.0)
    return release

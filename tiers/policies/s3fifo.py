"""S3-FIFO (Yang et al., SOSP'23): a small probation FIFO, a main FIFO and a ghost queue."""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Hashable, Optional

from tiers.policies.base import EvictionPolicy, register_policy


@register_policy
class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO: new keys wait in a small FIFO; keys read there move to the main FIFO.

    Sizes are counted in keys and taken relative to the number of resident
    keys when a victim is asked for (the store evicts only when full, so that
    count is the capacity):
    - insert: a key remembered by the ghost queue enters main, any other key small;
    - touch: the key's frequency grows by one, capped at 3;
    - pop_victim: from small while small holds at least ``small_ratio`` of the
      keys (or main is empty): its oldest key moves to main if it was read at
      least ``move_threshold`` times, else it is the victim and its name goes to
      the ghost queue (at most ``ghost_ratio`` x resident names, oldest dropped);
      otherwise from main, as a CLOCK: the oldest key with a frequency above
      zero is reinserted with one less, the first at zero is the victim.
    A key moves to main at most once per insert and is reinserted in main at
    most once per read, so pop_victim is O(1) amortised.
    """

    name = "s3fifo"

    def __init__(self, small_ratio: float = 0.1, ghost_ratio: float = 0.9, move_threshold: int = 1) -> None:
        if not 0.0 < small_ratio < 1.0 or ghost_ratio < 0.0 or move_threshold < 1:
            raise ValueError("need 0 < small_ratio < 1, ghost_ratio >= 0, move_threshold >= 1")
        self.small_ratio = small_ratio
        self.ghost_ratio = ghost_ratio
        self.move_threshold = move_threshold
        self._freq: Dict[Hashable, int] = {}  # resident key -> reads, capped at 3
        self._small: "OrderedDict[Hashable, None]" = OrderedDict()
        self._main: "OrderedDict[Hashable, None]" = OrderedDict()
        self._ghost: "OrderedDict[Hashable, None]" = OrderedDict()

    def insert(self, key, parent=None) -> None:
        if key in self._freq:
            raise ValueError(f"key already present: {key!r}")
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None

    def touch(self, key) -> None:
        freq = self._freq.get(key)
        if freq is not None and freq < 3:
            self._freq[key] = freq + 1

    def remove(self, key) -> None:
        if self._freq.pop(key, None) is None:
            return
        if key in self._small:
            del self._small[key]
        else:
            del self._main[key]

    def pop_victim(self) -> Optional[Hashable]:
        resident = len(self._freq)
        if not resident:
            return None
        if self._small and (len(self._small) >= self.small_ratio * resident or not self._main):
            victim = self._evict_small(resident)
            if victim is not None:
                return victim
        return self._evict_main()

    def _evict_small(self, resident: int) -> Optional[Hashable]:
        """Promote read keys from small to main until an unread one can go (None if small empties)."""
        small, freq = self._small, self._freq
        while small:
            key = small.popitem(last=False)[0]
            if freq[key] >= self.move_threshold:
                self._main[key] = None
                continue
            del freq[key]
            ghost = self._ghost
            ghost[key] = None
            limit = int(self.ghost_ratio * resident)
            while len(ghost) > limit:
                ghost.popitem(last=False)
            return key
        return None

    def _evict_main(self) -> Hashable:
        """Second chance over main: reinsert read keys with one read less, evict the first unread one."""
        main, freq = self._main, self._freq
        while True:
            key = main.popitem(last=False)[0]
            count = freq[key]
            if count:
                freq[key] = count - 1
                main[key] = None
            else:
                del freq[key]
                return key

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key) -> bool:
        return key in self._freq

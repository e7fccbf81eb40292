"""An example hicache-tiers plug-in (docs/WRITING_A_TIER.md walks through it).

- ``store.TmpfsStore`` (kind ``tmpfs``): one file per page in a directory,
  by default on /dev/shm; the shape of a memory tier reached through a file
  system (tmpfs, a DAX device, CXL memory exposed as a file).
- ``arena.ArenaStore`` (kind ``memarena``): pages in an arena the engines
  map read-only; the daemon writes into it in three steps and reads are
  leases the engine copies out of (a store that shares its memory).
- ``mru.MRUPolicy`` (policy ``mru``): evicts the most recently used page,
  which keeps a working set through one long scan that LRU would flush.
"""

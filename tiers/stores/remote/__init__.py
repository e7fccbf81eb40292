"""The remote tier: memory pools reached one-sided through the Mooncake Transfer Engine.

- engine.py: the Transfer Engine, configured (tcp/rdma, devices, metadata) and
  wrapped so every transfer is bounded by a deadline.
- pool.py: a pool daemon's arena store (allocate, commit, locate, release,
  eviction by the shared policies); pool_daemon.py serves it over ZeroMQ.
- placement.py: rendezvous hashing of keys onto pools.
- pool_client.py: one inference node's calls to one pool.
- staging.py: node-side registered memory, staging slots, counters.
- store.py: RemoteStore, the PageStore of a node's remote tier daemon;
  pools.py its clients of the pools (down pools skipped, a batch grouped a
  pool), writes.py its puts, reads.py its gets (landed_reads.py: through
  landing chunks), transfers.py what reads and writes share.
- mooncake_store.py: a remote tier backed by an existing Mooncake Store cluster.
- loopback.py: pool and node configurations on 127.0.0.1 for tests and benchmarks.
"""

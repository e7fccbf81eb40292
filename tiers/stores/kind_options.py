"""The options each built-in tier kind takes: key -> (parser, default, help).

The node's loader (tiers/ops/config.py) rejects keys not listed, so a typo is an error instead of a silent
default; a store builds itself from its tier's options with these defaults (a plug-in kind declares its own
in its StoreKind, tiers/plugins.py).
"""
from __future__ import annotations

from typing import Dict

from tiers.config_values import _bool, _choice, _endpoint, _int, _list_of, _size_or_auto, _str, _weight, parse_size


# The Mooncake Transfer Engine's settings, shared by remote tiers and pools (docs/REMOTE.md).
TRANSFER_ENGINE_OPTIONS: Dict[str, tuple] = {
    "protocol": (_choice("tcp", "rdma"), "tcp", "Transfer Engine transport: rdma on clusters, tcp without an RDMA NIC"),
    "device_name": (_str, "", "RDMA devices, comma separated (e.g. mlx5_0,mlx5_1); empty: every HCA found"),
    "metadata_server": (_str, "P2PHANDSHAKE", "P2PHANDSHAKE (no metadata service), etcd://HOST:PORT or http://HOST:PORT/metadata"),
    "te_hostname": (_str, "", "address peers reach this engine at; default: a pool's endpoint host, 127.0.0.1 for a remote tier"),
    "require_rdma": (_bool, False, "fail at start when RDMA is unusable instead of moving pages over TCP (MC_FORCE_HCA)"),
}
KIND_OPTIONS: Dict[str, Dict[str, tuple]] = {
    "dram": {
        "block_size": (parse_size, "64KiB", "arena allocation unit; pages span whole blocks"),
        "prefault": (_bool, True, "fault the whole arena in at start (first touches are ~10x slower than copies)"),
        "engine_reads": (_bool, True, "engines read hits through a page directory in shared memory, without a "
                                      "round trip to the daemon (false: every read asks the daemon)"),
    },
    "nvme": {
        "path": (_str, "", "directory for chunk files; default DATA_DIR/NAME"),
        "fsync": (_bool, True, "fdatasync each chunk file and fsync the directory of a new one before "
                               "acknowledging (false: a power loss may drop recent pages, never return bad ones)"),
        "compression": (_choice("none", "zstd", "zstd-shuffle"), "none",
                        "chunk codec; zstd-shuffle splits bf16 byte planes first; capacity counts on-disk bytes"),
        "compression_level": (_int, 1, "zstd level (1 is fastest; higher levels gained nothing on bf16 KV data)"),
        "io_threads": (_int, 4, "blocking I/O threads (several reads in flight; the parts of a batch on their way "
                                "to the device)"),
        "direct_io": (_bool, True, "O_DIRECT reads of uncompressed pages into 4 KiB-aligned buffers, and writes "
                                   "of batch chunks from aligned buffers (without fsync: chunks over 40 MiB), "
                                   "where the file system allows; other pages buffered"),
        "direct_writes": (_bool, False, "O_DIRECT writes of single pages in files of their own, and of small batch "
                                        "chunks without fsync, too (with direct_io); buffered measured 1.0-2.4x "
                                        "faster there on the development disk (a flushed page is dropped from the "
                                        "page cache)"),
        "index_snapshot": (_bool, True, "save the index at a clean shutdown and load it at the next start instead "
                                        "of scanning every chunk name (removed once loaded: after a crash the "
                                        "start scans)"),
        "recycle_bytes": (_size_or_auto, "auto", "batch files whose every page left are written over by the next "
                                                 "batch of their size (no allocation or freeing on its way; kept "
                                                 "within the capacity, given up before any live page); evicted "
                                                 "records of live files are left in place up to this many bytes (an "
                                                 "eighth of the capacity at most, taken out of what the index may "
                                                 "hold); auto: 128MiB on tiers of 8GiB and more, 0 below; 0: "
                                                 "recycling off, dead files removed at once"),
    },
    "remote": {
        **TRANSFER_ENGINE_OPTIONS,
        "pools": (_list_of(_endpoint), [], "pool daemon endpoints (tcp://HOST:PORT); keys are placed by rendezvous hashing"),
        "pool_weights": (_list_of(_weight), [], "relative share of keys of each pool; default equal"),
        "pool_timeout_ms": (_int, 200, "a pool's control call (alloc, commit, locate, lookup) gives up after this"),
        "pool_retry_max_ms": (_int, 2000, "longest back-off before a pool that stopped answering is tried again"),
        "transfer_timeout_ms": (_int, 1000, "a page transfer gives up after this plus its bytes at min_bandwidth"),
        "min_bandwidth": (parse_size, "100MB", "bytes per second below which a transfer is given up"),
        "io_threads": (_int, 2, "transfers in flight (and staging slots for pages that arrive as frames)"),
        "direct_reads": (_bool, False, "read pages straight into the engine's host pool, no staging copy; a transfer "
                                       "given up at its deadline cannot be cancelled and may still land there after "
                                       "the engine reused that memory (a corrupted KV page): only where transfers "
                                       "end fast (RDMA with short QP timeouts) and that risk is accepted"),
    },
    "pool": {
        **TRANSFER_ENGINE_OPTIONS,
        "block_size": (parse_size, "1MiB", "arena allocation unit; a page is at most ceil(size/block) transfers"),
        "max_lease_ms": (_int, 60000, "longest a client may pin or reserve pages for one transfer; above the "
                         "Transfer Engine's 30 s stall limit, so a late transfer ends before its blocks are reused"),
        "prefault": (_bool, True, "fault the arena in, in the background from start (first writes are otherwise slow)"),
    },
    "mooncake_store": {
        "master_server_address": (_str, "127.0.0.1:50051", "the Mooncake Store master (HOST:PORT)"),
        "metadata_server": (_str, "P2PHANDSHAKE", "P2PHANDSHAKE, etcd://HOST:PORT or http://HOST:PORT/metadata"),
        "protocol": (_choice("tcp", "rdma"), "tcp", "Transfer Engine transport"),
        "device_name": (_str, "", "RDMA devices, comma separated; empty: every HCA found"),
        "te_hostname": (_str, "127.0.0.1", "address the store's peers reach this node at"),
        "global_segment_size": (parse_size, "0", "memory this node contributes to the cluster (0: none, a pure client)"),
        "local_buffer_size": (parse_size, "256MiB", "the store client's registered transfer buffer"),
        "io_threads": (_int, 2, "transfers in flight"),
    },
}

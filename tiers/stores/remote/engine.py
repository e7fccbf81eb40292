"""The Mooncake Transfer Engine, configured from a tier's options and bounded by deadlines.

One engine a process.  Transport choice is the engine's own: ``tcp`` sets
MC_FORCE_TCP; ``rdma`` lets it discover HCAs (``device_name`` filters them)
and, with ``require_rdma``, sets MC_FORCE_HCA so a node without a usable NIC
fails at start instead of quietly moving pages over TCP.  Transfers are
submitted as asynchronous batches of one entry (the binding reports the status
of a batch's first task only), all of a request's pages at once (pieces
adjacent on both sides merged into one transfer of up to MERGE_BYTES), and polled,
so a call returns by its deadline
even when the peer stopped answering; the engine's own sync calls spin for up
to MC_TRANSFER_TIMEOUT (30 s by default) instead.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from tiers.shm.buffers import line_up_runs

log = logging.getLogger("hicache.remote.engine")

PROTOCOLS = ("tcp", "rdma")
P2P = "P2PHANDSHAKE"
# Bytes one transfer carries at most when adjacent pieces are merged.  Each transfer costs the engine a
# submission and a status poll, and the daemon's thread a look at it.  Through the rig's remote tier
# (scripts/ab_bench.py, 20 samples a tree): 64 KiB pages read 0.90 -> 1.09 GB/s and write 0.91 -> 1.06 with
# transfers of up to 256 KiB, 1.05 and 0.91 with up to 1 MiB; 256 KiB pages (not merged) unchanged.  In one
# process with an idle CPU the count did not matter once the engine was warm (2.7 ms for 8 MiB as 16 or 128).
MERGE_BYTES = 256 << 10


class EngineError(OSError):
    """The Transfer Engine cannot be loaded, started or asked to register memory."""


@dataclass
class EngineConfig:
    """Transfer Engine settings shared by pool daemons and remote tiers."""

    hostname: str = "127.0.0.1"  # the address peers reach this engine at
    protocol: str = "tcp"
    device_name: str = ""  # RDMA devices, comma separated; empty: every HCA found
    metadata_server: str = P2P  # P2PHANDSHAKE, etcd://host:port or http://host:port/metadata
    require_rdma: bool = False  # fail at start when RDMA cannot be used

    @classmethod
    def from_options(cls, options: Dict[str, Any], default_host: str = "127.0.0.1") -> "EngineConfig":
        return cls(hostname=options.get("te_hostname") or default_host, protocol=options.get("protocol", "tcp"),
                   device_name=options.get("device_name", ""),
                   metadata_server=options.get("metadata_server", P2P),
                   require_rdma=bool(options.get("require_rdma", False)))


def _load():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        hint = (" (install Debian's libibverbs1: scripts/install-system-deps.sh)" if "libibverbs" in str(exc)
                else " (pip install mooncake-transfer-engine-non-cuda, or mooncake-transfer-engine with CUDA)")
        raise EngineError(f"cannot load the Mooncake Transfer Engine: {exc}{hint}") from None
    return TransferEngine


class Engine:
    """A started Transfer Engine: registered memory and deadline-bounded transfers."""

    def __init__(self, config: EngineConfig):
        if config.protocol not in PROTOCOLS:
            raise EngineError(f"protocol {config.protocol!r} is not one of {', '.join(PROTOCOLS)}")
        if config.require_rdma and config.protocol != "rdma":
            raise EngineError("require_rdma needs protocol = \"rdma\"")
        self.config = config
        # The engine reads its switches from the environment at initialize().
        if config.protocol == "tcp":
            os.environ["MC_FORCE_TCP"] = "1"
            os.environ.pop("MC_FORCE_HCA", None)
        else:
            os.environ.pop("MC_FORCE_TCP", None)
            if config.require_rdma:
                os.environ["MC_FORCE_HCA"] = "1"
        # The engine logs every segment it opens at INFO; its warnings and errors still show.
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING" if log.getEffectiveLevel() > logging.DEBUG else "INFO")
        te_class = _load()
        self._te = te_class()
        ret = self._te.initialize(config.hostname, config.metadata_server, config.protocol, config.device_name)
        if ret != 0:
            detail = ("no usable RDMA device (require_rdma is set; check device_name and `ibv_devices`)"
                      if config.require_rdma else "see the engine's log above")
            raise EngineError(f"Transfer Engine initialize({config.hostname}, {config.metadata_server}, "
                              f"{config.protocol}, {config.device_name or '*'}) failed: {detail}")
        self.rpc_port = int(self._te.get_rpc_port())
        # Peers name this engine by host:port under P2P handshake, by hostname with a metadata server.
        self.segment = f"{config.hostname}:{self.rpc_port}" if config.metadata_server == P2P else config.hostname
        self.transport = "rdma" if config.protocol == "rdma" and self._hcas() else "tcp"
        if config.protocol == "rdma" and self.transport == "tcp":
            log.warning("protocol is rdma but the engine found no RDMA device: pages move over TCP "
                        "(set require_rdma = true to refuse to start instead)")
        log.info("transfer engine up: segment %s, transport %s", self.segment, self.transport)

    def _hcas(self) -> List[str]:
        """RDMA devices the engine discovered (its topology: {location: [[preferred], [others]]})."""
        try:
            topology = json.loads(self._te.get_local_topology(self.config.device_name or None))
        except (ValueError, TypeError, RuntimeError):
            return []
        return sorted({hca for lists in topology.values() if isinstance(lists, list)
                       for group in lists if isinstance(group, list) for hca in group if isinstance(hca, str)})

    # ------------------------------------------------------------- memory
    def register(self, base: int, length: int) -> None:
        """Register [base, base+length) for transfers (EngineError on refusal)."""
        ret = self._te.register_memory(base, length)
        if ret != 0:
            raise EngineError(f"register_memory of {length} bytes at {base:#x} failed ({ret})")

    def unregister(self, base: int) -> None:
        self._te.unregister_memory(base)

    # ----------------------------------------------------------- transfers
    def transfer(self, segment: str, write: bool, pieces: Sequence[Tuple[int, int, int]], timeout: float,
                 abandoned: Optional[List[Tuple[int, int]]] = None) -> bool:
        """Move (local address, remote address, length) pieces; True when all completed in time.

        ``write`` copies local -> remote.  False on any failure or when timeout
        passes first; pieces still in flight then are abandoned to the engine
        (listed in ``abandoned`` when given, see transfer_pages).
        """
        return self.transfer_pages(segment, write, [pieces], timeout, abandoned)[0]

    def transfer_pages(self, segment: str, write: bool, pages: Sequence[Sequence[Tuple[int, int, int]]],
                       timeout: float, abandoned: Optional[List[Tuple[int, int]]] = None,
                       on_done: Optional[Callable[[List[int]], None]] = None) -> List[bool]:
        """Several pages' pieces, all in flight at once; per page, True when all its pieces completed in time.

        A transfer cannot be cancelled: one still running at the deadline (or
        that the engine reports timed out) may yet move its bytes.  Its
        (page, batch id) is appended to ``abandoned``, for the caller to keep
        the local memory out of use until ``status(batch)`` says it ended.
        ``on_done(pages)`` runs (on this thread) with the pages that got all their
        pieces since the last look, while the others are still moving: one call a
        look, not one a page (a streamed read marks its board once a call).
        """
        submit = self._te.batch_transfer_async_write if write else self._te.batch_transfer_async_read
        deadline = time.monotonic() + timeout
        ok = [True] * len(pages)
        runs = merge_pieces(pages, MERGE_BYTES)
        left = [0] * len(pages)  # transfers each page still waits for
        for _local, _remote, _length, covered in runs:
            for page in covered:
                left[page] += 1
        pending: List[Tuple[int, List[int]]] = []  # (batch id, the pages it carries bytes of)
        live = abandoned if abandoned is not None else []
        for n, (local, remote, length, covered) in enumerate(runs):
            batch = submit(segment, [local], [remote], [length])
            if batch == 0:  # the peer is unreachable or refused: the rest would fail the same way
                log.debug("submit to %s failed", segment)
                for _l, _r, _n, rest in runs[n:]:
                    for page in rest:
                        ok[page] = False
                break
            pending.append((batch, covered))
        check = self._te.transfer_check_status
        pause = 50e-6
        while pending:
            still = []
            arrived: List[int] = []
            for batch, covered in pending:
                status = check(batch)  # 1 done, 0 running, -1 failed, -2 timed out in the engine
                if status == 0:
                    still.append((batch, covered))
                elif status == 1:
                    for page in covered:
                        left[page] -= 1
                        if left[page] == 0 and ok[page]:
                            arrived.append(page)
                else:
                    for page in covered:
                        ok[page] = False
                        if status == -2:  # not freed by the binding and perhaps still moving bytes
                            live.append((page, batch))
            pending = still
            if arrived and on_done is not None:  # every piece of each completed: none can fail after this
                on_done(arrived)
            if not pending:
                break
            if time.monotonic() > deadline:
                log.debug("%d transfers still running at the deadline; abandoned", len(pending))
                for batch, covered in pending:
                    for page in covered:
                        ok[page] = False
                        live.append((page, batch))
                break
            time.sleep(pause)
            pause = min(pause * 2, 200e-6)  # a late wake-up costs as much as the poll it saves
        return ok

    def status(self, batch: int) -> int:
        """An abandoned transfer's state: 1 done, -1 failed (both final: the id is freed), 0 running, -2 timed out.

        Call it again only while it returns 0 or -2.
        """
        return self._te.transfer_check_status(batch)

    def raw(self):
        """The underlying mooncake TransferEngine (benchmarks compare against it)."""
        return self._te


def merge_pieces(pages: Sequence[Sequence[Tuple[int, int, int]]], limit: int) -> List[Tuple[int, int, int, List[int]]]:
    """Pages' (local, remote, length) pieces as transfers: a piece that continues the one before it on both
    sides (the next page of a batch allocated together, on both ends) joins it, up to limit bytes a transfer.
    Each transfer is (local, remote, length, the pages it carries bytes of, in order)."""
    runs: List[List] = []
    for page, pieces in enumerate(pages):
        for local, remote, length in pieces:
            if runs:
                last = runs[-1]
                if (last[0] + last[2] == local and last[1] + last[2] == remote and last[2] + length <= limit):
                    last[2] += length
                    if last[3][-1] != page:
                        last[3].append(page)
                    continue
            runs.append([local, remote, length, [page]])
    return [(local, remote, length, covered) for local, remote, length, covered in runs]


def abandoned_batches(abandoned: Sequence[Tuple[int, int]]) -> List[int]:
    """transfer_pages' abandoned (page, batch id) pairs as batch ids, each once (a transfer may carry several
    pages' bytes; the engine frees an id once it reports its end, so none may be watched twice)."""
    return list(dict.fromkeys(batch for _page, batch in abandoned))


def abandoned_groups(abandoned: Sequence[Tuple[int, int]]) -> List[Tuple[List[int], List[int]]]:
    """transfer_pages' abandoned (page, batch id) pairs as (pages, batch ids) groups, each page and each batch id
    in one group only (the pages and transfers joined by shared transfers): a group's pages may still be written
    until all its transfers have ended."""
    parent: Dict[Tuple[str, int], Tuple[str, int]] = {}

    def root(node: Tuple[str, int]) -> Tuple[str, int]:
        while parent.setdefault(node, node) != node:
            node = parent[node]
        return node
    for page, batch in abandoned:
        parent[root(("page", page))] = root(("batch", batch))
    groups: Dict[Tuple[str, int], Tuple[List[int], List[int]]] = {}
    for page, batch in abandoned:
        pages, batches = groups.setdefault(root(("page", page)), ([], []))
        if page not in pages:
            pages.append(page)
        if batch not in batches:
            batches.append(batch)
    return list(groups.values())


def pair_extents(local: Sequence[Tuple[int, int]], remote: Sequence[Tuple[int, int]]) -> List[Tuple[int, int, int]]:
    """Cut two lists of (address, length) covering the same bytes into aligned transfer pieces."""
    return list(zip(*line_up_runs(local, remote)))

"""Raw pages into a batch file laid out ahead (tiers/stores/nvme/batch_writes.py's default path).

Before a byte is written each of the file's records gets its block and its
room on disk (Ledger.reserve_many: the victims' blocks are given back
first, and a file they empty of this file's size is claimed to be written
over).  Each part's pages are then checked against their writers' checksums,
their headers and key digests packed in one C call (tiers/_chunkscan.c
pack_headers), and runs of them handed to the writer threads at their blocks;
a page refused there leaves a hole.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Set, Tuple

from tiers._chunkscan import pack_headers
from tiers.stores.base import PageTooLarge, StoreFull, StoreIOError
from tiers.stores.nvme import batch, chunkfile as cf
from tiers.stores.nvme.recycle import Claim

if TYPE_CHECKING:  # the target is batch_writes' own: no import at run time (it imports this module)
    from tiers.stores.nvme.batch_writes import BatchTarget


@dataclass
class Layout:
    """A raw batch file's records, laid out before a byte is written (k: a record's number in the file)."""

    ok: List[int]  # the put's positions of the file's pages
    views: List[Sequence[memoryview]]
    sizes: List[int]  # each page's bytes
    disks: List[int]  # each record's bytes on disk (header, payload, padding)
    blocks: List[int]  # each record's first 4 KiB block
    slot: Dict[int, int]  # position -> k
    held: Set[int]  # records whose reservation is neither given back nor committed
    gaps: List[Tuple[int, int]]  # (block, blocks) of records refused after the layout: punched out
    headers: List[Optional[memoryview]]
    digests: List[int]
    claim: Claim  # on the dead file this put's victims empty, settled when the put chooses its file


def lay_out(t: "BatchTarget", namespace: str, ns_hash: int, idx: List[int], pages, page_bytes: List[int],
            out: list) -> Optional[Layout]:
    """The records of the pages idx that fit, each at its block, their room reserved (victims given back
    at once); refusals to out.  None when no page got room."""
    # pwritev and the hash take each page's buffers as they are: no view a buffer, no check a page
    # beyond its size (~7 us a page here through accepted_page).
    ok: List[int] = []
    disks: List[int] = []
    for i in idx:
        disk = batch.record_blocks(page_bytes[i]) * cf.ALIGN
        if 0 < page_bytes[i] <= t.max_page_bytes and disk <= t.capacity:
            ok.append(i)
            disks.append(disk)
        else:
            out[i] = PageTooLarge(f"page of {page_bytes[i]} bytes not accepted (max {t.max_page_bytes}, "
                                  f"capacity {t.capacity})")
    # A dead file of this file's size that the victims below empty is this put's to write over
    # (tiers/stores/nvme/recycle.py): its bytes are the ones reserved here.
    claim = t.recycled.claim(sum(disks)) if t.recycled is not None else Claim()
    victims, got = t.ledger.reserve_many(disks, ns_hash, namespace, spare=claim.spare)
    if claim.spare and not all(got):  # a smaller file now: the kept one goes before anything is written
        t.recycled.drop_spare(claim, max(0, claim.spare - sum(d for d, g in zip(disks, got) if g)))
    # Before a byte of ours is written (never more than capacity on disk); a file of ours emptied by it is
    # the claim's.
    t.discard(victims, True, claim=claim if all(got) else None)
    if not all(got):
        for i, g in zip(ok, got):
            if not g:
                out[i] = StoreFull(f"{t.name}: {t.ledger.reserved} bytes of writes in flight, capacity "
                                   f"{t.capacity}")
        ok, disks = [i for i, g in zip(ok, got) if g], [d for d, g in zip(disks, got) if g]
    if not ok:
        return None
    blocks, at = [], 0
    for disk in disks:
        blocks.append(at)
        at += disk // cf.ALIGN
    return Layout(ok, [pages[i] for i in ok], [page_bytes[i] for i in ok], disks, blocks,
                  {i: k for k, i in enumerate(ok)}, set(range(len(ok))), [], [None] * len(ok), [0] * len(ok), claim)


def write_part(t: "BatchTarget", lay: Layout, writer: batch.BatchWriter, part: List[int], part_sums: List[int],
               checksums, keys, ns_bytes: bytes, ns_hash: int, out: list, aligned: bool) -> None:
    """A part's pages checked against their writers' checksums (a page that does not match is refused and
    leaves a gap), their headers packed in one C call, and runs of them handed to the writer threads."""
    keep = []
    for i, page_sum in zip(part, part_sums):
        k = lay.slot[i]
        checksum = checksums[i] if checksums is not None else 0
        if checksum and checksum != page_sum:  # bytes changed on their way here: refused, not stored
            t.ledger.count("checksum_refused")
            out[i] = StoreIOError(f"{t.name}: the page's bytes do not match the writer's checksum")
            t.ledger.release(lay.disks[k], ns_hash)
            lay.held.discard(k)
            lay.gaps.append((lay.blocks[k], lay.disks[k] // cf.ALIGN))
        else:
            keep.append((k, page_sum, checksum))
    if not keep:
        return
    packed = batch.aligned_buffer(len(keep))
    digests = pack_headers(packed, ns_bytes, [keys[lay.ok[k]][1] for k, _s, _c in keep],
                           array("Q", [lay.sizes[k] for k, _s, _c in keep]), array("Q", [s for _k, s, _c in keep]),
                           array("Q", [c for _k, _s, c in keep]))
    for j, ((k, _s, _c), digest) in enumerate(zip(keep, digests)):
        lay.digests[k] = digest
        lay.headers[k] = packed[j * cf.ALIGN:(j + 1) * cf.ALIGN]
    ordered = [k for k, _s, _c in keep]
    for first, end in _runs([lay.blocks[k] for k in ordered], [lay.disks[k] for k in ordered]):
        run = ordered[first:end]
        writer.add([batch.Record(lay.headers[k], lay.views[k], lay.sizes[k]) for k in run], aligned,
                   block=lay.blocks[run[0]])


def _runs(blocks: List[int], disks: List[int]) -> List[Tuple[int, int]]:
    """(first, end) positions of records that lie back to back on disk (one write each)."""
    runs: List[Tuple[int, int]] = []
    for k in range(len(blocks)):
        if runs and blocks[runs[-1][1] - 1] + disks[runs[-1][1] - 1] // cf.ALIGN == blocks[k]:
            runs[-1] = (runs[-1][0], k + 1)
        else:
            runs.append((k, k + 1))
    return runs

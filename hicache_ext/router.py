"""Routes the backend's page batches to the node's chain of tiers.

The chain is ordered fastest first (as the node configuration lists it).
- lookup: the hit is the longest run of leading keys each held by some tier.
- read: every page comes from the fastest tier holding it.  After a lookup of
  the same keys (SGLang's batch_exists, then batch_get), each tier is asked
  only for the keys it said it holds, all tiers at once; otherwise (or for
  what a tier no longer has) the top tier is asked first, then the next for
  what is still missing.  A page found below the top tier is copied back up
  after the read returned, when ``promote`` is on (hicache_ext/read_plan.py).
- write: write_through stores into every tier at once (a chain costs its
  slowest tier, not the sum of its tiers) and acknowledges a page only when
  all have it; write_back and selective acknowledge once the top tier has it
  (the daemons move pages down on eviction).
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from hicache_ext.break_even import BreakEven
from hicache_ext.direct_read import read_through_directory
from hicache_ext.host_pool import PageBatch
from hicache_ext.page_sums import ReadChecks
from hicache_ext.read_plan import UNKNOWN, LookupHints, Promoter, fastest_tiers
from hicache_ext.sealed_transfers import SealedTransfers, put_sealed
from hicache_ext.sealing import PageSealer
from tiers.wire import protocol as P
from tiers.shm.buffers import scatter_copy
from tiers.shm.checksums import page_sums, page_sums_at
from tiers.wire.client import TierClient
from tiers.wire.fanout import Call, FanOut
from tiers.wire.lookup import merge_held, per_tier_held
from tiers.logs import RateLimitedLog
from tiers.policies.admission import ReadAdmission

log = logging.getLogger("hicache.backend")
_warn = RateLimitedLog(log)


class TierRouter:
    def __init__(self, clients: List[TierClient], write_policy: str = "write_through", promote: bool = True,
                 selective_min_reads: int = 2, promote_max_bytes: int = 256 << 20,
                 break_even: Optional[BreakEven] = None, checksums: bool = True,
                 sealer: Optional[PageSealer] = None, sealed_staging_bytes: int = 128 << 20,
                 promote_min_reads: int = 1):
        if not clients:
            raise ValueError("the tier chain is empty")
        self.clients = clients
        self.break_even = break_even  # lookups report only the pages whose read beats their recompute
        self.unpaid_pages = 0  # held pages a lookup did not report: slower to read than to recompute
        self.direct_pages = 0  # pages read through the top tier's page directory, without asking its daemon
        self.write_policy = write_policy
        self.promote = promote
        self.admission = ReadAdmission(promote_min_reads)  # which pages read from below are promoted
        self.selective_min_reads = selective_min_reads
        self.hints = LookupHints(len(clients))
        self.promoter = Promoter(promote_max_bytes)
        self.checks = ReadChecks(checksums)  # each page read is checked against its checksum (hicache_ext/page_sums.py)
        # Pages sealed here before any tier sees them (hicache_ext/sealing.py), through shared memory that
        # holds only ciphertext (hicache_ext/sealed_transfers.py).
        self.sealed: Optional[SealedTransfers] = None
        if sealer is not None:
            self.sealed = SealedTransfers(sealer, self.checks, sealed_staging_bytes)
            self.sealed.attach(clients)
        # What the top tier is told about each page: demote it later or not.
        self._mode = {"write_through": "through", "write_back": "back", "selective": "selective"}[write_policy]
        # Every tier's session now, each hello bounded by its deadline: a hello said inside a call would hold
        # back the other tiers' requests of that fan-out while it waits (a lower tier frozen before its first
        # lookup cost a lookup the top tier covered 0.5 s).  A tier that does not answer is down, and its
        # client's probe says hello off every call.
        for client in clients:
            client.connect()

    # ---------------------------------------------------------------- lookup
    def held(self, keys: List[str], key_bytes: float = 0, key_tokens: float = 0, first_token: int = 0) -> bytes:
        """One byte per key: held by some tier (every tier asked at once) and worth reading.

        A daemon takes at most P.MAX_BATCH keys a message, and SGLang asks
        for a whole prompt at once (a 128k-token prompt is 2,048 pages, more
        under head shards), so longer lists go in chunks.  Only the leading
        run counts, so chunks stop at the first one with a hole and later
        keys read as not held.  With a break-even rule the leading run is
        cut where reading (key_bytes at each tier's measured speed) stops
        paying for recomputing (key_tokens a key, from context position first_token).
        """
        with self.promoter.engine_call():
            return self._held(keys, key_bytes, key_tokens, first_token)

    def _held(self, keys: List[str], key_bytes: float, key_tokens: float, first_token: int) -> bytes:
        out = bytearray()
        fastest = bytearray()
        breaking_even = self.break_even is not None and self.break_even.enabled
        for start in range(0, len(keys), P.MAX_BATCH):
            chunk = keys[start:start + P.MAX_BATCH]
            per_tier = per_tier_held(self.clients, chunk)
            if len(self.clients) > 1 or breaking_even:  # one tier and no break-even rule: nobody reads them
                chunk_fastest = fastest_tiers(per_tier, len(chunk))
                if len(self.clients) > 1:
                    self.hints.remember(chunk, chunk_fastest)
                fastest += chunk_fastest
            flags = merge_held(per_tier, len(chunk))
            out += flags
            if 0 in flags:  # flags are bytes: one C-level scan (all() took ~5 us a 1,024-key chunk)
                break
        if breaking_even:
            run = P.leading_run(bytes(out))
            paying = self.break_even.paying_pages(bytes(fastest), run, key_bytes, key_tokens, first_token)
            if paying < run:
                out[paying:run] = bytes(run - paying)
                self.unpaid_pages += run - paying
                speeds = ", ".join(f"{c.name} {rate / 1e6:.1f} MB/s" for c, rate in
                                   zip(self.clients, self.break_even.speeds.current()) if rate)
                _warn.warning("unpaid", "hicache-tiers: %d of %d held pages not reported as hits: reading them is "
                              "slower than recomputing them (measured read speeds: %s)", run - paying, run, speeds)
        return bytes(out) + bytes(len(keys) - len(out))

    # --------------------------------------------------------------- writes
    def _write_targets(self) -> List[TierClient]:
        """write_through: every tier; otherwise the fastest tier that is up."""
        if self.write_policy == "write_through":
            return self.clients
        for client in self.clients:
            if not client.is_down():
                return [client]
        return self.clients[:1]

    def _acknowledged(self, start_put: Callable[[TierClient, Callable[[List[bool]], None]], Optional[Call]]
                      ) -> List[bool]:
        """A page is acknowledged when every target tier of the write policy stored it (all asked at once:
        start_put(client, on_stored) sends one tier's put, and the replies are gathered together)."""
        targets = self._write_targets()
        stored: List[List[bool]] = [[] for _ in targets]
        fan = FanOut()
        for i, client in enumerate(targets):
            fan.add(start_put(client, stored[i].extend))
        fan.wait()
        result = stored[0]
        for flags in stored[1:]:
            result = [a and b for a, b in zip(result, flags)]
        return result

    def write(self, batch: PageBatch, parents: Optional[List[Optional[str]]] = None) -> List[bool]:
        if self.sealed is not None:
            return self.write_buffers(batch.keys, batch.views(), parents)
        # Each tier hashes each page in its own copy's pass, while the page is in its cache (tiers/wire/protocol.py
        # hash_pages): no pass over the batch in this thread before the first put leaves.
        return self._acknowledged(lambda client, on_stored: self._put(client, batch, parents, on_stored,
                                                                      mode=self._mode,
                                                                      hash_pages=self.checks.enabled))

    def _put_fields(self, mode: str, promote: bool = False) -> dict:
        """What the daemon is told with a put: demote later or not, and the selective threshold."""
        extra = {"mode": mode}
        if mode == "selective":
            extra["min_reads"] = self.selective_min_reads
        if promote:
            extra["promote"] = True
        return extra

    def _put(self, client: TierClient, batch: PageBatch, parents, on_stored: Callable[[List[bool]], None],
             mode: str = "through", promote: bool = False, sums: bytes = b"", hash_pages: bool = False
             ) -> Optional[Call]:
        """One tier's put of batch, sent; on_stored gets a flag a page."""
        extra = self._put_fields(mode, promote)
        if sums:
            extra["sums"] = sums
        elif hash_pages:
            extra["hash_pages"] = True
        if batch.offsets is not None and client.region_id is None:
            # The host pool is registered by the session's hello: without this, a put that opens the session
            # (a backup before any lookup) sent its whole batch as frames.
            client.connect()
        if batch.offsets is not None and client.region_id is not None:
            desc, counts = batch.descriptors()
            return client.start_put_region(batch.keys, desc, counts, batch.nbytes, parents, on_stored, **extra)
        return client.start_put_frames(batch.keys, batch.views(), batch.nbytes, parents, on_stored, **extra)

    def write_buffers(self, keys: List[str], pages: Sequence[Sequence[memoryview]],
                      parents: Optional[List[Optional[str]]] = None) -> List[bool]:
        """Legacy path: pages given as buffers of this process (same policy fields and parents as write)."""
        if self.sealed is not None:
            fields = self._put_fields(self._mode)
            return self.sealed.write(keys, pages, parents, self._acknowledged,
                                     lambda client, part, part_parents, extents, views, nbytes, sums, on_stored:
                                     put_sealed(client, part, part_parents, extents, views, nbytes,
                                                {**fields, "sums": sums} if sums else fields, on_stored))
        nbytes = sum(v.nbytes for page in pages for v in page)
        extra = {**self._put_fields(self._mode), "sums": self.checks.sums_of(pages)}
        return self._acknowledged(lambda client, on_stored: client.start_put_frames(keys, pages, nbytes, parents,
                                                                                    on_stored, **extra))

    # ---------------------------------------------------------------- reads
    def read(self, batch: PageBatch) -> List[bool]:
        """Each page from the fastest tier holding it; lower tiers' pages are promoted after the return."""
        with self.promoter.engine_call():
            return self._read(batch)

    def _read(self, batch: PageBatch) -> List[bool]:
        n = len(batch.keys)
        plan = self.hints.plan(batch.keys) if len(self.clients) > 1 else None
        asks: Dict[int, List[int]] = {}  # tier -> pages to ask it for
        if plan is None:
            asks[0] = list(range(n))
        else:
            for i, tier in enumerate(plan):
                asks.setdefault(0 if tier == UNKNOWN else tier, []).append(i)
        sums = [0] * n  # each page's checksum, as the tier that served it returned it (promotions keep it)
        found = [False] * n
        below: List[int] = []  # pages a lower tier served
        page_bytes = batch.nbytes / n
        if asks.get(0) and self.sealed is None and self.clients[0].reads_direct():
            rest, read = read_through_directory(self.clients[0], self.checks, self.break_even, batch, asks[0],
                                                found, sums)
            self.direct_pages += read
            if rest:
                asks[0] = rest
            else:
                del asks[0]
        # Rounds: every tier with pages to give is asked at once; what a tier missed goes to the next
        # tier in the round after (one call a tier a round: a tier's socket carries one call at a time).
        while asks:
            served: Dict[int, List[bool]] = {}
            took: Dict[int, float] = {}
            # Calls given up so far, per tier: only the break-even rule reads them (_observe).
            given_up = ({tier: self.clients[tier].calls_given_up() for tier in asks}
                        if self.break_even is not None else {})
            began = time.perf_counter()
            fan = FanOut()
            for tier, idx in sorted(asks.items()):
                def got(flags: List[bool], tier: int = tier) -> None:
                    served[tier] = flags
                    took[tier] = time.perf_counter() - began
                fan.add(self._get(self.clients[tier], batch if len(idx) == n else batch.subset(idx), sums, idx,
                                  got))
            fan.wait()
            following: Dict[int, List[int]] = {}
            for tier, idx in sorted(asks.items()):
                flags = served[tier]
                if self.break_even is not None:  # each tier's read speed, kept current for the break-even rule
                    self._observe(tier, flags, page_bytes, took[tier], given_up[tier])
                missed = []
                for i, ok in zip(idx, flags):
                    if not ok:
                        missed.append(i)
                    else:
                        found[i] = True
                        if tier > 0:
                            below.append(i)
                if missed and tier + 1 < len(self.clients):
                    following.setdefault(tier + 1, []).extend(missed)
            asks = {tier: sorted(idx) for tier, idx in following.items()}
        if below and self.promote and not self.clients[0].is_down():
            below.sort()
            chosen = [i for i, ok in zip(below, self.admission.admit([batch.keys[i] for i in below])) if ok]
            if chosen:
                self._promote(batch.subset(chosen), [sums[i] for i in chosen])
        return found

    def _observe(self, tier: int, found: List[bool], page_bytes: float, seconds: float, given_up: int) -> None:
        """One read's speed for the break-even rule: the pages it found over the time it took.  A read that got
        no reply in time found none, yet it is the slowest read of all: the tier moved the bytes asked for no
        faster than that (a miss, answered, measures nothing).  Counted, a tier whose reads time out stops
        giving hits once its probe finds it up again, instead of costing every prefetch its deadline."""
        nbytes = int(sum(found) * page_bytes)
        if not nbytes and self.clients[tier].calls_given_up() > given_up:
            nbytes = int(len(found) * page_bytes)
        self.break_even.speeds.observe(tier, nbytes, seconds)

    def _walk(self, idx: List[int], fetch: Callable[[TierClient, List[int]], List[bool]],
              first: int = 0, page_bytes: float = 0) -> List[Tuple[int, int]]:
        """Ask tier first for pages idx, the next for what it missed, ...; (page, tier depth) of each hit."""
        hits: List[Tuple[int, int]] = []
        missing = idx
        for depth in range(first, len(self.clients)):
            if not missing:
                break
            given_up = self.clients[depth].calls_given_up() if self.break_even is not None else 0
            began = time.perf_counter()
            got = fetch(self.clients[depth], missing)
            if self.break_even is not None:  # each tier's read speed, kept current for the break-even rule
                self._observe(depth, got, page_bytes, time.perf_counter() - began, given_up)
            hits += [(i, depth) for i, ok in zip(missing, got) if ok]
            missing = [i for i, ok in zip(missing, got) if not ok]
        return hits

    def _promote(self, pages: PageBatch, sums: List[int]) -> None:
        """Queue copies of pages into the top tier (they are below already: the top tier holds them clean).

        With the host pool registered and every page's checksum known, the top tier copies the pages
        out of the host pool itself, later, and checks each against its sum; otherwise they are
        copied here before the read returns and sent as frames."""
        top = self.clients[0]
        extra = self._put_fields("through", promote=True)
        if self.sealed is not None:  # sealed afresh (a new nonce): the lower tier's sums name other bytes
            sealer, checks = self.sealed.sealer, self.checks

            def put_sealed(keys: List[str], copies: List[List[bytes]]) -> List[bool]:
                sealed = sealer.seal_all(keys, [[memoryview(b) for b in page] for page in copies])
                return top.put_frames(keys, sealed, sum(len(p[0]) for p in sealed), None,
                                      sums=checks.sums_of(sealed), **extra)
            self.promoter.submit(pages.keys, pages.views(), put_sealed)
            return
        if any(sums):
            extra["sums"] = P.encode_sums(sums)
        if pages.offsets is not None and top.region_id is not None and all(sums):
            keys, nbytes = pages.keys, pages.nbytes
            desc, counts = pages.descriptors()
            self.promoter.submit_checked(keys, nbytes, lambda: top.put_region(keys, desc, counts, nbytes, None,
                                                                              **extra))
            return

        def put(keys: List[str], copies: List[List[bytes]]) -> List[bool]:
            return top.put_frames(keys, copies, sum(len(b) for page in copies for b in page), None, **extra)
        self.promoter.submit(pages.keys, pages.views(), put)

    def counters(self) -> dict:
        """What the engine side did beside the daemons: promotions queued, done, dropped, failed."""
        return {**self.promoter.counters(), **self.checks.counters(), "unpaid_pages": self.unpaid_pages,
                "direct_pages": self.direct_pages, "promotions_not_admitted": self.admission.not_admitted,
                "sealed_refused": self.sealed.sealer.refused if self.sealed is not None else 0}

    def _get(self, client: TierClient, batch: PageBatch, sums: List[int], positions: List[int],
             on_found: Callable[[List[bool]], None]) -> Optional[Call]:
        """Pages of batch from one tier, sent for; each page is checked after our own copy, sums[positions[i]]
        gets page i's sum, and on_found a flag a page."""
        got: List[int] = []

        def served(found: List[bool]) -> None:
            for position, ok, checksum in zip(positions, found, got):
                if ok:
                    sums[position] = checksum
            on_found(found)
        if self.sealed is not None:  # checked before it is opened
            return self.sealed.start_read(client, batch.keys, batch.views(), got, served)
        if client.can_lease():
            # The daemon leases the pages in its arena and this process copies them in: a frozen
            # daemon can never write into host memory the engine has reused.  Each page is hashed
            # as it is copied, so the check reads nothing again.
            copied: Optional[List[int]] = [] if self.checks.enabled else None
            return client.start_get_leased(
                batch.keys, batch.page_runs(), got, copied,
                lambda found: served(self.checks.verify(client.name, batch.keys, found, got,
                                                        lambda idx: [copied[i] for i in idx])))

        def framed(found: List[bool], frames) -> None:
            found = _fill(found, frames, batch.views) if any(found) else found
            served(self.checks.verify(client.name, batch.keys, found, got,
                                      lambda idx: page_sums_at(batch.pointers[idx], batch.lengths[idx])))
        return client.start_get_frames(batch.keys, batch.nbytes, got, framed)

    def read_buffers(self, keys: List[str], pages: Sequence[Sequence[memoryview]]) -> List[bool]:
        """Legacy path: fill buffers of this process from the fastest tier."""
        def fetch(client: TierClient, idx: List[int]) -> List[bool]:
            nbytes = sum(v.nbytes for i in idx for v in pages[i])
            asked, got = [keys[i] for i in idx], []
            if self.sealed is not None:
                return self.sealed.read(client, asked, [pages[i] for i in idx], got)
            found, frames = client.get_frames(asked, nbytes, got)
            found = _fill(found, frames, lambda: [pages[i] for i in idx])
            return self.checks.verify(client.name, asked, found, got,
                                      lambda sub: page_sums([pages[idx[j]] for j in sub]))

        found = [False] * len(keys)
        for i, _depth in self._walk(list(range(len(keys))), fetch):
            found[i] = True
        return found

    def close(self) -> None:
        self.promoter.close()
        for client in self.clients:
            client.close()
        if self.sealed is not None:
            self.sealed.close()


def _fill(found: List[bool], frames, views: Callable[[], List[Sequence[memoryview]]]) -> List[bool]:
    """Copy each found page's frame into its views; a page of another size under the key is a miss."""
    targets = views()
    frame_iter = iter(frames)
    out = list(found)
    for i, ok in enumerate(found):
        if ok:
            try:
                scatter_copy(targets[i], [next(frame_iter).buffer])
            except ValueError:
                out[i] = False
    return out

"""Page transfers of a tier daemon: put and get batches, from frames or a mapped host pool.

A mixin of TierDaemon (tiers/daemon.py), kept apart because it is the hot
path: every page is checked against the request's deadline before it touches
host memory, and a copy out of host memory that ended after the deadline is
not kept (the engine may already have reused that memory).
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import List, Optional

from tiers import protocol as P
from tiers.demotion import MODES
from tiers.logs import RateLimitedLog
from tiers.store import StoreError

log = logging.getLogger("hicache.daemon")
_warn = RateLimitedLog(log)


class PageTransfers:
    """handle_put / handle_get and the per-page work behind them (needs TierDaemon's state)."""

    def _page_views(self, header: dict, n_pages: int) -> Optional[List[List[memoryview]]]:
        region_id = header.get("region")
        if region_id is None:
            return None
        if self._regions is None:
            raise P.ProtocolError("bad_request", "this daemon takes no shared-memory regions")
        region = self._regions.get(region_id, header.get("s"))
        pages = P.decode_descriptors(header.get("desc"), header.get("regions_per_page"), n_pages, region.size)
        view = region.view
        return [[view[off:off + n] for off, n in page] for page in pages]

    def handle_put(self, header: dict, frames) -> Future:
        ns = self._namespace(header)
        keys = P.keys_field(header)
        pages = self._page_views(header, len(keys))
        if pages is None:
            pages = self._frame_pages(header, keys, frames)
        parents = header.get("parents")
        if not isinstance(parents, list) or len(parents) != len(keys):
            parents = [None] * len(keys)
        for page in pages:
            if sum(v.nbytes for v in page) > self.max_page_bytes:
                raise P.ProtocolError("too_large", f"page over {self.max_page_bytes} bytes")
        mode = header.get("mode", "through")
        min_reads = header.get("min_reads", 2)
        if mode not in MODES or not isinstance(min_reads, int) or isinstance(min_reads, bool) or min_reads < 1:
            raise P.ProtocolError("bad_request", f"mode must be one of {', '.join(MODES)} and min_reads >= 1")
        if header.get("promote") is True:
            self.metrics.promotions += len(keys)
        deadline = header.get("dl")
        return self._pool.submit(self._put_pages, header["id"], ns, keys, pages, parents, deadline, frames,
                                 mode, min_reads)

    @staticmethod
    def _frame_pages(header: dict, keys: list, frames) -> List[List[memoryview]]:
        per_page = header.get("frames_per_page")
        if per_page is None:
            per_page = [1] * len(keys)
        if (not isinstance(per_page, list) or len(per_page) != len(keys)
                or not all(isinstance(n, int) and n > 0 for n in per_page) or sum(per_page) != len(frames)):
            raise P.ProtocolError("bad_request", f"{len(keys)} keys do not match {len(frames)} page frames")
        pages, start = [], 0
        for n in per_page:
            pages.append([f.buffer for f in frames[start:start + n]])
            start += n
        return pages

    def _put_pages(self, req_id, ns, keys, pages, parents, deadline, _frames_kept_alive, mode="through",
                   min_reads=2) -> list:
        many = getattr(self.store, "put_many", None)  # a store that moves a whole batch at once (remote tier)
        outcomes = many([(ns, k) for k in keys], pages, parents, deadline) if many is not None else None

        def put_one(i: int):
            """(stored, refusal) of page i."""
            if deadline is not None and time.time() > deadline:
                return False, ("deadline", "deadline passed during the batch")
            try:
                if outcomes is None:
                    parent = parents[i]
                    self.store.put((ns, keys[i]), pages[i], parent if isinstance(parent, str) else None)
                elif outcomes[i] is not None:
                    raise outcomes[i]
            except StoreError as exc:
                return False, (exc.code, str(exc))
            # The engine may reuse its buffer once it stops waiting: a copy that
            # ended after the deadline may hold torn bytes, so it is not kept.
            if deadline is not None and time.time() > deadline:
                self.store.delete([(ns, keys[i])])
                return False, None
            return True, None
        # A store that takes concurrent calls (disk) gets several pages of the batch in flight.
        fan_out = outcomes is None and len(keys) > 1 and getattr(self.store, "parallel_io", False)
        results = list(self._batch_workers().map(put_one, range(len(keys)))) if fan_out else \
            [put_one(i) for i in range(len(keys))]
        stored = [ok for ok, _why in results]
        refusal = next((why for _ok, why in results if why), None)
        if self.lower is not None:
            for key, ok in zip(keys, stored):
                if ok:
                    self.dirty.add((ns, key), mode, min_reads)
        self.metrics.pages("put", sum(stored), sum(sum(v.nbytes for v in p) for p, ok in zip(pages, stored) if ok))
        fields = {"stored": P.flags(stored)}
        if refusal:
            fields["refusal"] = list(refusal)
            # The operator hears of a full or failing medium here, not only in the engine's log.
            _warn.warning(f"refusal:{refusal[0]}", "tier %s refused %d of %d pages: %s: %s", self.name,
                          len(stored) - sum(stored), len(stored), refusal[0], refusal[1])
        return [P.reply_ok(req_id, **fields)]

    def handle_get(self, header: dict, frames) -> Future:
        ns = self._namespace(header)
        keys = P.keys_field(header)
        pages = self._page_views(header, len(keys))
        return self._pool.submit(self._get_pages, header["id"], ns, keys, pages, header.get("dl"))

    def _get_pages(self, req_id, ns, keys, pages, deadline) -> list:
        many = getattr(self.store, "get_many_into", None)  # a store that moves a whole batch at once
        if many is not None and pages is not None:
            found = many([(ns, k) for k in keys], pages, deadline)
            self.metrics.pages("get", sum(found), sum(sum(v.nbytes for v in p) for p, ok in zip(pages, found) if ok))
            return [P.reply_ok(req_id, found=P.flags(found))]

        def get_one(i: int):
            """(found, bytes or None) of page i."""
            # Writing into host memory after the engine gave up would corrupt
            # pages it has since reused: nothing starts after the deadline.
            if deadline is not None and time.time() > deadline:
                return False, None
            if pages is not None:
                return self.store.get_into((ns, keys[i]), pages[i]), None
            data = self.store.get_bytes((ns, keys[i]))
            return data is not None, data
        # A store that takes concurrent calls (disk) gets several pages of the batch in flight.
        fan_out = len(keys) > 1 and getattr(self.store, "parallel_io", False)
        results = list(self._batch_workers().map(get_one, range(len(keys)))) if fan_out else \
            [get_one(i) for i in range(len(keys))]
        found = [ok for ok, _data in results]
        out_frames = [data for ok, data in results if ok and data is not None]
        if pages is not None:
            nbytes = sum(sum(v.nbytes for v in p) for p, ok in zip(pages, found) if ok)
        else:
            nbytes = sum(len(f) for f in out_frames)
        self.metrics.pages("get", sum(found), nbytes)
        return [P.reply_ok(req_id, found=P.flags(found)), *out_frames]

    def _batch_workers(self) -> ThreadPoolExecutor:
        """Threads that run the pages of one batch concurrently (as many as the I/O pool has)."""
        workers = self.__dict__.get("_batch_pool")
        if workers is None:  # created on first use; setdefault keeps exactly one under races
            workers = self.__dict__.setdefault("_batch_pool", ThreadPoolExecutor(
                max_workers=max(2, self._pool._max_workers), thread_name_prefix=f"{self.name}-page"))
        return workers

    def _close_transfers(self) -> None:
        """Let the page threads finish (called once the I/O pool has drained)."""
        workers = self.__dict__.get("_batch_pool")
        if workers is not None:
            workers.shutdown(wait=True)

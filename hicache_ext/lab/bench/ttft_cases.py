"""One repetition of the TTFT part's cases on a running server and node.

For fresh prompts of each length (random ids from an explicit seed; prompts
share no page):
0. once, untimed: a warm-up prompt computed, backed up and read back from L3;
1. recompute: the prompt's first request, then its device hit at once;
2. filler prompts of new tokens, more than the device pool holds, push every
   prompt off the device; the host pool keeps them: the host hits;
3. /flush_cache (and one untimed prompt of new tokens: ``flush_and_merge``),
   then an L3 hit per prompt from each tier in turn: DRAM (all
   tiers hold the pages), NVMe (the DRAM tier cleared, the chunk files
   dropped from the page cache before each request) and remote (DRAM and
   NVMe cleared).
Each host and L3 hit is followed at once by a device hit of the same prompt:
what the hit added over a device hit is measured as that pair's difference.
Before each timed request the node settles (every tier stored what SGLang
backs up, then nothing moves for 0.3 s), so no backup runs beside it. Every
request's sources are checked against the case (SGLang's
cached_tokens_details; for L3 hits also which tier's daemon handed the pages
out); a mismatch is recorded beside the figure and in the notes, never dropped.
"""
from __future__ import annotations

import random
import time
from typing import Callable, Dict, List

from hicache_ext.lab.bench.rig import drop_page_cache
from hicache_ext.lab.bench.ttft_probe import ProbeError, Sample, TierProbe, sample_of, sglang_figures
from tiers.bench.stats import Figures, Progress
from tiers.bench.ttft_report import CASE_LABELS, L3_CASES, source_problem

PAGE_TOKENS = 16
TOUCH_SETTLE_S = 1.0  # how long a request's L3 source may take to show in its daemons' counters
MERGE_PROMPT_TOKENS = 256


def flush_and_merge(server, salt: str, vocab: int) -> None:
    """/flush_cache, then one untimed prompt of new tokens. A flush frees SGLang's host pool a page at a
    time (one small index tensor each) and its next host allocation joins them all (torch.cat over
    every freed page: 5-11 ms here, more with a bigger pool); the prompt's write to the host pool pays
    that, so the timed hit after it pays only what a hit costs in a running server."""
    server.flush_cache()
    rng = random.Random(f"ttft-merge-{salt}")
    server.generate([rng.randrange(1, vocab) for _ in range(MERGE_PROMPT_TOKENS)], max_new_tokens=1)


def record_pair(figs: Figures, case: str, n: int, hit_s: float, device_s: float) -> None:
    """A hit of case and the device hit of the same prompt right after it: what the hit added."""
    figs.add(f"ttft.{case}.{n}.device_after", device_s, "s")
    figs.add(f"ttft.{case}.{n}.added", hit_s - device_s, "s")


class Cases:
    """The server, the node's daemons and the figures one run of the part fills."""

    def __init__(self, server, node, kinds: List[str], spec, sizes: Dict[str, int], figs: Figures,
                 progress: Progress):
        self.server, self.node, self.kinds, self.spec = server, node, kinds, spec
        self.sizes, self.figs, self.progress = sizes, figs, progress
        self.page_bytes = spec.kv_bytes_per_token * PAGE_TOKENS
        self.probe = TierProbe(node.runner.config.tiers)
        self.rep = 0

    def _prompt(self, rep: int, n: int, salt: str = "") -> List[int]:
        rng = random.Random(f"ttft-{rep}-{n}-{salt}")
        return [rng.randrange(1, self.spec.vocab) for _ in range(n)]

    def _settle(self, before: Dict[str, dict], new_pages: int = 0) -> None:
        try:
            self.probe.settle(before, new_pages)
        except ProbeError as exc:  # timings beside a late backup are suspect: say so, go on
            self.figs.note("ttft", f"repetition {self.rep + 1}: {exc}.")

    def _paired(self, case: str, ids: List[int], hit: Sample) -> None:
        """The device hit of the same prompt right after a host or L3 hit (ids now sit in the device tree):
        what the hit added over a device hit, paired in time, so the drift of the CPU server's extend between
        the cases (tens of ms at 2,048 tokens) does not land in a bound of a few ms."""
        generation = self.server.generate(ids, max_new_tokens=1)
        n = len(ids)
        problem = source_problem("device", n, generation.cached, {}, PAGE_TOKENS)
        if problem:
            self.figs.note("ttft", f"the device hit after {CASE_LABELS[case]}, {n:,} tokens, repetition "
                                   f"{self.rep + 1}: {problem}; not paired.")
            return
        record_pair(self.figs, case, n, hit.seconds, generation.seconds)

    def _timed(self, case: str, ids: List[int]) -> Sample:
        """One request of case with the stats and /metrics read around it; recorded, its sources checked."""
        before_tiers, before_metrics = self.probe.stats(), sglang_figures(self.server.metrics())
        generation = self.server.generate(ids, max_new_tokens=1)
        after_tiers, after_metrics = self.probe.stats(), sglang_figures(self.server.metrics())
        sample = sample_of(generation, before_tiers, after_tiers, before_metrics, after_metrics, self.page_bytes)
        n = len(ids)
        problem = source_problem(case, n, sample.cached, sample.served, PAGE_TOKENS)
        # Pages an engine read through the DRAM tier's page directory reach its daemon's counters as a touch
        # sent after the read (tiers/wire/direct_reads.py): a moment later, not before the reply.
        settle_by = time.monotonic() + TOUCH_SETTLE_S
        while problem and case in L3_CASES and time.monotonic() < settle_by:
            time.sleep(0.02)
            sample = sample_of(generation, before_tiers, self.probe.stats(), before_metrics, after_metrics,
                               self.page_bytes)
            problem = source_problem(case, n, sample.cached, sample.served, PAGE_TOKENS)
        self._record(case, n, sample)
        self.figs.add(f"ttft.{case}.{n}.source_ok", 0.0 if problem else 1.0, "flag")
        if problem:
            self.figs.note("ttft", f"{CASE_LABELS[case]}, {n:,} tokens, repetition {self.rep + 1}: {problem}.")
        cached = ", ".join(f"{k} {v:,}" for k, v in sample.cached.items() if v) or "nothing"
        self.progress.step(f"ttft {self.rep + 1}: {n:,} tokens, {CASE_LABELS[case]}: {sample.seconds * 1e3:,.0f} ms "
                           f"(cached: {cached}){' SOURCE MISMATCH' if problem else ''}")
        # counted from before the request: SGLang's backups may have begun before the reply came
        self._settle(before_tiers, n // PAGE_TOKENS if case == "recompute" else 0)
        return sample

    def _record(self, case: str, n: int, sample: Sample) -> None:
        base, add = f"ttft.{case}.{n}", self.figs.add
        add(base, sample.seconds, "s")
        for where, tokens in sample.cached.items():
            add(f"{base}.cached.{where}", tokens, "tokens")
        for name, value in sample.timings.items():
            add(f"{base}.sglang.{name}", value, "s")
        if case in L3_CASES:
            for tier, pages in sample.served.items():
                add(f"{base}.served.{tier}", pages, "pages")
            add(f"{base}.daemon.lookup", sample.daemon["lookup_s"], "s")
            add(f"{base}.daemon.get", sample.daemon["get_s"], "s")
            add(f"{base}.sglang.prefetch_pages", sample.sglang["prefetch_pages"], "pages")
            if "transfer_s" in sample.sglang:
                add(f"{base}.sglang.transfer", sample.sglang["transfer_s"], "s")

    def warm_up(self) -> None:
        """Untimed: one prompt through every path once (compute, backup to the tiers, an L3 read after a flush),
        so the first timed request pays no first-use cost (connections, allocations, threads)."""
        self.progress.step("ttft: warming up (one prompt computed, backed up and read back from L3; untimed)")
        ids = self._prompt(-1, 512, "warm-up")
        before = self.probe.stats()
        self.server.generate(ids, max_new_tokens=1)
        self._settle(before, len(ids) // PAGE_TOKENS)
        self.server.flush_cache()
        before = self.probe.stats()
        self.server.generate(ids, max_new_tokens=1)
        self._settle(before)

    def repetition(self, rep: int, reps: int, lengths: List[int]) -> None:
        self.rep = rep
        self.progress.step(f"ttft {rep + 1}/{reps}: clearing the tiers and SGLang's caches")
        self.server.flush_cache()
        self.probe.clear()
        prompts = {n: self._prompt(rep, n) for n in lengths}
        for n in lengths:
            self._timed("recompute", prompts[n])
            self._timed("device", prompts[n])
        self._push_off_device(rep)
        for n in lengths:
            self._paired("host", prompts[n], self._timed("host", prompts[n]))
        for case in [c for c in L3_CASES if L3_CASES[c] in self.kinds]:
            before = self.probe.stats()
            flush_and_merge(self.server, f"{rep}-{case}", self.spec.vocab)
            self._settle(before, MERGE_PROMPT_TOKENS // PAGE_TOKENS)
            above = self.kinds[:self.kinds.index(L3_CASES[case])]
            if above:  # the tiers above lose the pages (as restarted DRAM and NVMe daemons would)
                self.probe.clear(above)
            for n in lengths:
                if case == "l3_nvme":
                    drop_page_cache(self.node.data_path("nvme"))
                self._paired(case, prompts[n], self._timed(case, prompts[n]))

    def _push_off_device(self, rep: int) -> None:
        """Prompts of new tokens, more than the device pool holds: every earlier prompt leaves the device."""
        size, count = self.sizes["filler_tokens"], self.sizes["fillers"]
        self.progress.step(f"ttft {rep + 1}: {count} filler prompts of {size:,} tokens push the prompts off the "
                           f"device pool ({self.sizes['device_tokens']:,} tokens)")
        before = self.probe.stats()
        for i in range(count):
            self.server.generate(self._prompt(rep, size, f"filler{i}"), max_new_tokens=1)
        self._settle(before, count * size // PAGE_TOKENS)

    def close(self) -> None:
        self.probe.close()


class FileDirectory:
    """Waits for SGLang's ``file`` backend to hold more pages: one file each in its directory."""

    def __init__(self, directory, figs: Figures):
        self.directory, self.figs = directory, figs

    def _files(self) -> int:
        return sum(1 for _ in self.directory.iterdir()) if self.directory.is_dir() else 0

    def holding(self, pages: int, start: Callable[[], object]) -> None:
        """Run start() (requests after which SGLang backs up that many more pages), then wait until all are
        written."""
        want = self._files() + pages
        start()
        self._settle(want)

    def _settle(self, want: int, quiet: float = 0.3, timeout: float = 120.0) -> None:
        """Until the directory holds want files and nothing was added for quiet s (the backups done)."""
        deadline, last, since = time.monotonic() + timeout, -1, time.monotonic()
        while time.monotonic() < deadline:
            count = self._files()
            if count != last:
                last, since = count, time.monotonic()
            if count >= want and time.monotonic() - since >= quiet:
                return
            time.sleep(0.05)
        self.figs.note("ttft", f"SGLang's file backend wrote {last} of {want} pages within {timeout:g} s.")


class InProcessMemory:
    """Waits for the in-process memory backend to hold more pages. Nothing outside the server sees its
    dict, so it waits MEMORY_BACKUP_S (its backups are copies in memory, ~100 ms for 512 pages here);
    a hit that then misses pages shows as a source mismatch, never as a figure."""
    MEMORY_BACKUP_S = 1.0

    def holding(self, pages: int, start: Callable[[], object]) -> None:
        start()
        time.sleep(self.MEMORY_BACKUP_S)


class ReferenceHits:
    """The same L3 hit through a backend other than ours on a server of the same model and pools, in the
    same run: SGLang's own ``file`` backend (``l3_file``: one file per page, page cache warm) and the
    in-process memory backend (``l3_memory``: SGLang's own path and one copy a page, the floor of any
    backend). Recorded as ``ttft.<case>.<N>`` with its paired device hit, like the tiers' L3 cases."""

    def __init__(self, server, case: str, store, figs: Figures, progress: Progress):
        self.server, self.case, self.store, self.figs, self.progress = server, case, store, figs, progress

    def repetition(self, rep: int, lengths: List[int], vocab: int) -> None:
        label = CASE_LABELS[self.case]
        for n in lengths:
            rng = random.Random(f"ttft-{self.case}-{rep}-{n}")
            ids = [rng.randrange(1, vocab) for _ in range(n)]
            self.store.holding(n // PAGE_TOKENS, lambda: self.server.generate(ids, max_new_tokens=1))
            self.store.holding(MERGE_PROMPT_TOKENS // PAGE_TOKENS,
                               lambda: flush_and_merge(self.server, f"{self.case}-{rep}-{n}", vocab))
            hit = self.server.generate(ids, max_new_tokens=1)
            device = self.server.generate(ids, max_new_tokens=1)
            base = f"ttft.{self.case}.{n}"
            problem = source_problem(self.case, n, hit.cached, {}, PAGE_TOKENS) or \
                source_problem("device", n, device.cached, {}, PAGE_TOKENS)
            self.figs.add(f"{base}.source_ok", 0.0 if problem else 1.0, "flag")
            if problem:
                self.figs.note("ttft", f"{label}, {n:,} tokens, repetition {rep + 1}: {problem}.")
                continue
            self.figs.add(base, hit.seconds, "s")
            for name, value in hit.timings.items():
                self.figs.add(f"{base}.sglang.{name}", value, "s")
            record_pair(self.figs, self.case, n, hit.seconds, device.seconds)
            self.progress.step(f"ttft {rep + 1}: {n:,} tokens, {label}: {hit.seconds * 1e3:,.0f} ms "
                               f"(device hit after it {device.seconds * 1e3:,.0f} ms)")

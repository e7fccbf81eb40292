"""The TTFT section of BENCHMARKS.md: a real SGLang server's time to first token per case and prompt length,
where each hit came from, the bound an L3 hit is held to, and what an L3 hit is made of.

Figures (hicache_ext/lab/bench/ttft_cases.py), per case and prompt length N:
``ttft.<case>.<N>`` (s, the bench's wall time of /generate with max_new_tokens=1),
``.cached.<device|host|storage>`` (SGLang's cached_tokens_details), ``.served.<tier>``
(pages each daemon handed out), ``.source_ok`` (1 when both match the case),
``.daemon.lookup|get`` (the daemons' latency sums), ``.sglang.<name>`` (SGLang's
meta_info timings and /metrics storage histograms). Tier read rates at the model's
page size are the rig's ``<kind>.<page>.read`` of the same run.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from tiers.bench.stats import Figures
from tiers.sim.profile import CASES, L3_KINDS as L3_CASES, Fit, break_even_settings

CASE_LABELS = {"recompute": "recompute", "device": "device hit", "host": "host hit", "l3_dram": "L3 from DRAM",
               "l3_nvme": "L3 from NVMe, cold", "l3_remote": "L3 from the remote pool",
               "l3_file": "L3 from SGLang's file backend", "l3_memory": "L3 from SGLang's in-process memory (floor)"}
SOURCES = {"recompute": None, "device": "device", "host": "host", "l3_dram": "storage", "l3_nvme": "storage",
           "l3_remote": "storage", "l3_file": "storage", "l3_memory": "storage"}
TIER_LABELS = {"dram": "DRAM", "nvme": "NVMe, cold", "remote": "remote pool"}
# What an L3 hit may add over a device hit: READ_FACTOR x (KV bytes / the tier's read rate) + FIXED_S;
# and the 2,048-token L3 hit against recompute.
READ_FACTOR, FIXED_S = 1.5, 0.005
RECOMPUTE_TOKENS, RECOMPUTE_RATIO = 2048, 0.5
REFERENCES = ("l3_file", "l3_memory")  # the same hit through other backends, on their own servers


def expected_hit(n: int, page: int) -> int:
    """The tokens SGLang reuses of an n-token prompt: whole pages less the page of the token it computes."""
    return max(n // page - 1, 0) * page


def _split(cached: Dict[str, int]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in cached.items() if v) or "nothing"


def source_problem(case: str, n: int, cached: Dict[str, int], served: Dict[str, int], page: int) -> Optional[str]:
    """Why a request of case did not hit where the case says (None when it did)."""
    total = sum(cached.values())
    if case == "recompute":
        return None if total == 0 else f"SGLang reports {_split(cached)} cached (expected nothing)"
    where, want = SOURCES[case], expected_hit(n, page)
    problems = []
    if cached.get(where, 0) != want or total != want:
        problems.append(f"SGLang reports {_split(cached)} cached (expected {where} {want:,})")
    tier = L3_CASES.get(case)
    if tier is not None:
        others = {t: p for t, p in served.items() if t != tier and p}
        if served.get(tier, 0) < want // page or others:
            got = ", ".join(f"{t} {p:,}" for t, p in served.items() if p) or "none"
            problems.append(f"the daemons handed out pages: {got} (expected {tier} {want // page:,})")
    return "; ".join(problems) or None


def _ms(seconds: Optional[float]) -> str:
    if seconds is None:
        return "–"
    ms = seconds * 1e3
    return f"{ms:,.0f}" if abs(ms) >= 100 else f"{ms:.1f}"


def _cell(figs: Figures, name: str) -> str:
    med = figs.median(name)
    if med is None:
        return "–"
    lo, hi = figs.spread(name)
    return f"{_ms(med)} ({_ms(lo)}–{_ms(hi)})" if len(figs.series[name]["samples"]) > 1 else _ms(med)


def _mismatches(figs: Figures, case: str, n: int) -> int:
    s = figs.series.get(f"ttft.{case}.{n}.source_ok")
    return sum(1 for v in s["samples"] if v < 1) if s else 0


def added_over_device(figs: Figures, case: str, n: int) -> Optional[float]:
    """What a hit of case added over a device hit: the median of its paired differences (each hit less the
    device hit of the same prompt right after it), else the difference of the two cases' medians."""
    paired = figs.median(f"ttft.{case}.{n}.added")
    if paired is not None:
        return paired
    hit, device = figs.median(f"ttft.{case}.{n}"), figs.median(f"ttft.device.{n}")
    return hit - device if hit is not None and device is not None else None


def _signed_ms(seconds: Optional[float]) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:+.1f}"


def bound_rows(figs: Figures) -> List[dict]:
    """Per tier and prompt length: KV bytes, the tier's read rate, the bound, what the L3 hit added."""
    info = figs.info.get("ttft")
    if not info:
        return []
    rows = []
    for case, kind in L3_CASES.items():
        rate = figs.median(f"{kind}.{info['page_label']}.read")
        for n in info["lengths"]:
            added = added_over_device(figs, case, n)
            if added is None:
                continue
            kv = expected_hit(n, info["page_tokens"]) * info["kv_bytes_per_token"]
            bound = READ_FACTOR * kv / (rate * 1e9) + FIXED_S if rate else None
            floor = added_over_device(figs, "l3_memory", n)
            # What the bound leaves a backend beyond SGLang's own path (the floor) and reading the bytes at
            # the rig's rate: at or below 0, no backend that costs anything more can hold the bound.
            room = bound - floor - kv / (rate * 1e9) if bound is not None and floor is not None else None
            rows.append({"case": case, "kind": kind, "tokens": n, "kv_bytes": kv, "gbps": rate, "bound_s": bound,
                         "added_s": added, "holds": bound is not None and added <= bound,
                         "file_added_s": added_over_device(figs, "l3_file", n),
                         "floor_added_s": floor, "room_s": room,
                         "mismatches": _mismatches(figs, case, n)})
    return rows


def target_rows(figs: Figures) -> List[tuple]:
    """(target, measured, holds) rows for the Targets table."""
    rows = []
    for r in bound_rows(figs):
        bound = f"{r['bound_s'] * 1e3:.1f} ms" if r["bound_s"] is not None else "no read rate"
        rows.append((f"{CASE_LABELS[r['case']]}, {r['tokens']:,} tokens: adds <= {READ_FACTOR}x KV / read rate + "
                     f"{FIXED_S * 1e3:.0f} ms over a device hit ({bound})", f"{r['added_s'] * 1e3:.1f} ms",
                     "yes" if r["holds"] else "**no**"))
    for case in L3_CASES:
        l3, full = figs.median(f"ttft.{case}.{RECOMPUTE_TOKENS}"), figs.median(f"ttft.recompute.{RECOMPUTE_TOKENS}")
        if l3 is not None and full:
            ratio = l3 / full
            rows.append((f"{CASE_LABELS[case]}, {RECOMPUTE_TOKENS:,} tokens <= {RECOMPUTE_RATIO}x recompute",
                         f"{ratio:.2f}x ({_ms(l3)} / {_ms(full)} ms)", "yes" if ratio <= RECOMPUTE_RATIO else "**no**"))
    return rows


def section(figs: Figures) -> List[str]:
    """The TTFT section's Markdown lines (none when the run had no ttft part)."""
    info = figs.info.get("ttft")
    if not info:
        return []
    lengths, cases = info["lengths"], [c for c in CASES if c not in L3_CASES or L3_CASES[c] in info["tiers"]]
    cases += [ref for ref in REFERENCES if any(figs.median(f"ttft.{ref}.{n}") is not None for n in lengths)]
    spec = info["spec"]
    out = ["## Time to first token, real SGLang server on CPU (ms)", "",
           f"`python -m sglang.launch_server` on this CPU (torch_native attention) serving a random Llama "
           f"({spec['layers']} layers, hidden {spec['hidden']}, {spec['heads']} heads, {spec['kv_heads']} KV heads: "
           f"{info['kv_bytes_per_token'] / 1024:g} KiB of KV a token, {info['page_tokens']}-token pages of "
           f"{info['page_bytes'] / 1024:g} KiB) with this backend; device pool {info['device_tokens']:,} tokens, host "
           f"pool x{info['hicache_ratio']}, prefetch policy {info['prefetch_policy']}. One node: "
           f"{', '.join(info['tiers'])} under write_through. TTFT is the wall time of /generate with "
           "max_new_tokens=1, median of the repetitions (min–max). Host hits come after filler prompts pushed the "
           "prompts off the device pool; L3 hits after /flush_cache; NVMe: " + info["nvme_cold"] +
           "; remote: DRAM and NVMe cleared. Every request's source is checked: SGLang's cached_tokens_details, "
           "and for L3 which daemon handed the pages out. The last two columns are references, each on a server of "
           "the same model and pools started after this one: the same hit through SGLang's own `file` backend "
           "(one file per page, page cache warm) and through an in-process memory backend (pages in a dict of "
           "the server's process: SGLang's own L3 path and one copy a page, the floor of any backend; "
           "hicache_ext/lab/bench/memory_backend.py). Before every L3 hit: /flush_cache, then one untimed "
           "prompt of new tokens, so SGLang's merge of the host slots the flush freed is not in the hit.", "",
           "| prompt tokens | " + " | ".join(CASE_LABELS[c] for c in cases) + " | sources |",
           "|---|" + "---|" * (len(cases) + 1)]
    for n in lengths:
        wrong = [f"{CASE_LABELS[c]}: **{_mismatches(figs, c, n)} not as the case says**" for c in cases
                 if _mismatches(figs, c, n)]
        out.append(f"| {n:,} | " + " | ".join(_cell(figs, f"ttft.{c}.{n}") for c in cases) + " | "
                   + ("; ".join(wrong) or "as expected") + " |")
    out.append("")
    bounds = bound_rows(figs)
    if bounds:
        out += [f"What an L3 hit adds over a device hit (the median of each L3 hit less the device hit of the same "
                f"prompt right after it), against {READ_FACTOR} x (KV bytes / the tier's read rate at "
                f"{info['page_label']} pages, the rig in this run) + {FIXED_S * 1e3:.0f} ms:", "",
                "| tier | prompt tokens | KV read | read GB/s | bound (ms) | L3 hit − device hit (ms) | holds | "
                "SGLang's file backend: L3 hit − device hit (ms) | floor, in-process memory: L3 hit − device hit "
                "(ms) | left by the floor (ms) |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in bounds:
            out.append(f"| {TIER_LABELS[r['kind']]} | {r['tokens']:,} | {r['kv_bytes'] / (1 << 20):.1f} MiB | "
                       f"{r['gbps'] or 0:.2f} | {_ms(r['bound_s'])} | {_ms(r['added_s'])} | "
                       f"{'yes' if r['holds'] else '**no**'} | {_ms(r['file_added_s'])} | "
                       f"{_ms(r['floor_added_s'])} | {_signed_ms(r['room_s'])} |")
        out += ["", "Left by the floor: the bound less the floor and less the KV bytes read at the rig's rate, what "
                    "the bound leaves for everything a backend does beyond SGLang's own path and the read itself; "
                    "at or below 0 no backend that costs anything more than that holds the bound on this machine."]
        recompute = [f"- {t}: {m}, {h}" for t, m, h in target_rows(figs) if "recompute" in t]
        out += [""] + (recompute + [""] if recompute else [])
    out += breakdown(figs, info)
    out += fit_lines(figs)
    return out


def breakdown(figs: Figures, info: dict) -> List[str]:
    """What an L3 hit is made of, each figure from the source that reports it."""
    lines = []
    for case, kind in L3_CASES.items():
        for n in info["lengths"]:
            base = f"ttft.{case}.{n}"
            if figs.median(base) is None:
                continue
            added, h2d = added_over_device(figs, case, n), added_over_device(figs, "host", n)
            parts = [figs.median(f"{base}.{name}") for name in ("daemon.lookup", "daemon.get", "sglang.transfer",
                                                                 "sglang.storage_prefetch_wait", "sglang.queue_time",
                                                                 "sglang.forward")]
            lines.append(f"| {TIER_LABELS[kind]} | {n:,} | {_ms(added)} | " + " | ".join(map(_ms, parts))
                         + f" | {_ms(h2d)} |")
    if not lines:
        return []
    return ["What an L3 hit is made of (medians, ms). lookup and get: the daemons' own `latency_s_sum` over the "
            "request (receipt to reply, a streamed get's to the end of its reads; lookup the slowest tier's, the tiers "
            "are asked at once; get summed; a DRAM "
            "read's copy out of the arena is the engine's and not in it). transfer: SGLang's `/metrics`, "
            "`sglang:prefetch_pgs` x page bytes / the mean `sglang:prefetch_bandwidth` of the request's reads (the "
            "backend's batch_get_v1 wall time). prefetch wait, queue, forward: SGLang's meta_info with "
            "--enable-metrics (storage_prefetch_wait: from the scheduler's first poll that found the prefetch "
            "unfinished to the one that found it done; queue_time; forward = prefill_finished_time − "
            "forward_entry_time, the extend with its load to the device). L3 hit − device hit, host → device: "
            "the median of each hit less the device hit of the same prompt right after it (the bench's TTFTs; no "
            "source reports host → device alone).", "",
            "| tier | prompt tokens | L3 hit − device hit | lookup (daemons) | get (daemons) | transfer (SGLang) | "
            "prefetch wait (SGLang) | queue (SGLang) | forward (SGLang) | host → device (bench) |",
            "|---|---|---|---|---|---|---|---|---|---|", *lines, ""]


def fit_lines(figs: Figures) -> List[str]:
    """The profile's fit (tiers/sim/profile.py), when the run wrote one."""
    f = {name: figs.median(f"ttft.fit.{name}") for name in ("overhead_s", "compute_s", "compute_s2", "cached_s",
                                                             "h2d_s", "load_fixed_s", "prefetch_s",
                                                             "hit_handoff_s")}
    if f["compute_s"] is None:
        return []
    errors = ", ".join(f"{case} {figs.median(f'ttft.fit.error.{case}'):.1%}" for case in ("recompute", "device", "host")
                       if figs.median(f"ttft.fit.error.{case}") is not None)
    settings = ", ".join(f"{k} = {v:.1f}" for k, v in
                         break_even_settings(Fit(compute_s=f["compute_s"], compute_s2=f["compute_s2"] or 0.0)).items())
    return ["The profile's fit (`--ttft-profile`, what `hicache-tiers plan --profile` takes): a request costs "
            f"{f['overhead_s'] * 1e3:.1f} ms + {f['compute_s'] * 1e6:.1f} µs × computed tokens + "
            f"{f['compute_s2'] * 1e9:.3f} ns × computed² + {f['cached_s'] * 1e6:.2f} µs × cached tokens + "
            f"({f['h2d_s'] * 1e6:.2f} µs × tokens loaded from host + {(f['load_fixed_s'] or 0) * 1e3:.1f} ms a load "
            "from host, added to compute), and an L3 hit "
            f"{(f['prefetch_s'] or 0) * 1e3:.1f} ms around its storage hit query (SGLang's storage_prefetch_wait on "
            f"recompute less the lookup) and {(f['hit_handoff_s'] or 0) * 1e3:.1f} ms to hand it over to its reads "
            "and back (an L3 hit's storage_prefetch_wait less its transfer and its query, the median over the L3 "
            f"hits); largest relative error of the fit: {errors}. As the backend's "
            f"break-even settings (extra config): {settings}.{_read_fits(figs)}", ""]


def _read_fits(figs: Figures) -> str:
    """The profile's L3 reads as the server measured them (ttft.fit.read.<kind>.*), when the run fitted any."""
    parts = []
    for kind in L3_CASES.values():
        fixed, per_byte = figs.median(f"ttft.fit.read.{kind}.fixed_s"), figs.median(f"ttft.fit.read.{kind}.s_per_byte")
        if fixed is not None and per_byte:
            parts.append(f"{kind} {fixed * 1e3:.2f} ms a storage batch + {1e-9 / per_byte:.2f} GB/s")
    return (" L3 reads in the server (the backend's batch_get wall time, what the planner reads each tier at "
            "instead of the rig's rate): " + "; ".join(parts) + ".") if parts else ""

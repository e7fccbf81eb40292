"""BENCHMARKS.md and the plot from one run's figures: medians, spreads, ratios to the limits and peers."""
from __future__ import annotations

from typing import List, Optional

from tiers.bench import ttft_report
from tiers.bench.stats import Figures

# (label, figure, limit figure, peer figure) per tier and direction; {m} is the page size's label ("64KiB", "1MiB").
TIER_ROWS = [
    ("DRAM write", "dram.{m}.write", "limit.memcpy.{m}", "file.{m}.write"),
    ("DRAM read", "dram.{m}.read", "limit.memcpy.{m}", "file.{m}.read_warm"),
    ("DRAM write, x memcpy between memfds", "dram.{m}.write", "limit.memcpy_shm.{m}", "file.{m}.write"),
    ("SGLang's own floor: write (its page functions, pages in a dict of the engine)", "dram_floor.{m}.write",
     "limit.memcpy.{m}", "file.{m}.write"),
    ("SGLang's own floor: read", "dram_floor.{m}.read", "limit.memcpy.{m}", "file.{m}.read_warm"),
    ("DRAM read, x memcpy between memfds", "dram.{m}.read", "limit.memcpy_shm.{m}", "file.{m}.read_warm"),
    ("DRAM write into a full tier (each batch evicts its size)", "dram.{m}.write_full", "limit.memcpy.{m}",
     "file.{m}.write"),
    ("NVMe write (fsync; the file backend does not)", "nvme.{m}.write", "limit.disk_write.{m}", "file.{m}.write"),
    ("NVMe write, x one file and one fdatasync a batch", "nvme.{m}.write", "limit.disk_write_batch.{m}",
     "file.{m}.write"),
    ("NVMe write, fsync = false", "nvme_nofsync.{m}.write", "limit.disk_write.{m}", "file.{m}.write"),
    ("NVMe read, cold", "nvme.{m}.read", "limit.disk_read_direct.{m}", "file.{m}.read"),
    ("NVMe read, warm", "nvme.{m}.read_warm", "limit.memcpy.{m}", "file.{m}.read_warm"),
    ("remote write", "remote.{m}.write", "limit.te_write.{m}", "mooncake.{m}.write"),
    ("remote read", "remote.{m}.read", "limit.te_read.{m}", "mooncake.{m}.read"),
]
LIMIT_ROWS = [
    ("AES-256-GCM seal, 1 thread", "limit.aes_seal.{m}"),
    ("AES-256-GCM open, 1 thread", "limit.aes_open.{m}"),
    ("memcpy, 1 thread", "limit.memcpy.{m}"),
    ("memcpy, 1 thread, between two memfd mappings (4 KiB pages)", "limit.memcpy_shm.{m}"),
    ("disk write + fdatasync, file a page, 4 threads", "limit.disk_write.{m}"),
    ("disk write of the batch as one file + one fdatasync", "limit.disk_write_batch.{m}"),
    ("disk read O_DIRECT, 4 threads, a page a file into memory of its own", "limit.disk_read_direct.{m}"),
    ("Mooncake TE write (raw, tcp; the batch, at most 128 MiB of it)", "limit.te_write.{m}"),
    ("Mooncake TE read (raw, tcp; the batch, at most 128 MiB of it)", "limit.te_read.{m}"),
]
PEER_ROWS = [
    ("SGLang file: write", "file.{m}.write"),
    ("SGLang file: read, cold", "file.{m}.read"),
    ("SGLang file: read, warm", "file.{m}.read_warm"),
    ("SGLang mooncake (Store): write", "mooncake.{m}.write"),
    ("SGLang mooncake (Store): read", "mooncake.{m}.read"),
]
POLICIES = ("write_through", "write_back", "selective")
# Targets beside which the report shows SGLang's own floor against the same limit (project.SGLangFloor): the
# ratio a backend that only copies a batch in the engine's process reaches through SGLang's page functions.
FLOORS = {"dram.{m}.write": "dram_floor.{m}.write", "dram.{m}.read": "dram_floor.{m}.read"}
# Issue 28's DRAM bounds by page size: 0.8x memcpy at 256 KiB, 0.7x at 64 KiB, 8 MiB staying at 0.95x; 0.7x
# between them.
DRAM_BOUNDS = {"256KiB": 0.8, "8MiB": 0.95}
# (text with {b} for the bound, figure, limit or None, bound or {page size: bound} (others: "default"),
#  "ratio" | "max")
TARGETS = [
    ("DRAM write >= {b}x memcpy", "dram.{m}.write", "limit.memcpy.{m}", {**DRAM_BOUNDS, "default": 0.7}, "ratio"),
    ("DRAM read >= {b}x memcpy", "dram.{m}.read", "limit.memcpy.{m}", {**DRAM_BOUNDS, "default": 0.7}, "ratio"),
    ("NVMe write >= 0.8x raw disk", "nvme.{m}.write", "limit.disk_write.{m}", 0.8, "ratio"),
    ("NVMe write >= 0.8x one file and one fdatasync a batch", "nvme.{m}.write", "limit.disk_write_batch.{m}", 0.8,
     "ratio"),
    ("NVMe cold read >= 0.9x raw O_DIRECT", "nvme.{m}.read", "limit.disk_read_direct.{m}", 0.9, "ratio"),  # issue 30
    ("remote write >= 0.7x raw TE", "remote.{m}.write", "limit.te_write.{m}", 0.7, "ratio"),
    ("remote read >= 0.7x raw TE", "remote.{m}.read", "limit.te_read.{m}", 0.7, "ratio"),
    ("DRAM write >= file backend", "dram.{m}.write", "file.{m}.write", 1.0, "ratio"),
    ("DRAM read >= file backend (warm)", "dram.{m}.read", "file.{m}.read_warm", 1.0, "ratio"),
    ("NVMe write, fsync = false >= file backend (neither flushes)", "nvme_nofsync.{m}.write", "file.{m}.write", 1.0,
     "ratio"),
    ("write_through chain write >= 0.8x its slowest tier alone (NVMe)", "chain.write_through.{m}.write",
     "chain.nvme_alone.{m}.write", 0.8, "ratio"),  # NVMe alone written right before each chain write
    ("NVMe cold read >= file backend cold", "nvme.{m}.read", "file.{m}.read", 1.0, "ratio"),
    ("remote write >= file backend", "remote.{m}.write", "file.{m}.write", 1.0, "ratio"),
    ("remote read >= file backend (cold)", "remote.{m}.read", "file.{m}.read", 1.0, "ratio"),
]
# (text, figure, bound in x the round trip taken between the lookups)
LOOKUP_TARGETS = [("128-key lookup p50 <= 1.5x a bare ZeroMQ round trip", "lookup.128.p50", 1.5),
                  ("1,024-key lookup p50 <= 2x a bare ZeroMQ round trip", "lookup.1024.p50", 2.0)]
# (text, figure, bound in us): the lookup a prefetch makes on a node where every other rank writes
BUSY_TARGETS = [("128-key lookup p99 with 15 ranks writing <= 10 ms", "ranks.16.lookup128.p99", 10000.0),
                ("128-key lookup p99 with 7 ranks writing <= 10 ms", "ranks.8.lookup128.p99", 10000.0)]
RANKS = (1, 2, 4, 8, 16)


def _num(value: Optional[float], digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _cell(figs: Figures, name: str, digits: int = 2) -> str:
    med = figs.median(name)
    if med is None:
        return "–"
    lo, hi = figs.spread(name)
    n = len(figs.series[name]["samples"])
    return f"{med:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f})" if n > 1 else f"{med:.{digits}f}"


def _human(label: str) -> str:
    """ "64KiB" -> "64 KiB" (figure names carry the label without the space)."""
    return label.replace("KiB", " KiB").replace("MiB", " MiB")


def target_rows(figs: Figures, sizes: List[str]) -> List[tuple]:
    rows = []
    for text, fig, limit, bounds, _kind in TARGETS:
        for m in sizes:
            bound = bounds.get(m, bounds["default"]) if isinstance(bounds, dict) else bounds
            ratio = figs.ratio(fig.format(m=m), limit.format(m=m))
            if ratio is not None:
                sglang = figs.ratio(FLOORS[fig].format(m=m), limit.format(m=m)) if fig in FLOORS else None
                shown = f"{ratio:.2f}x" + ("" if sglang is None else f" (SGLang's own floor {sglang:.2f}x)")
                rows.append((f"{text.format(b=bound)} ({_human(m)} pages)", shown,
                             "yes" if ratio >= bound else "**no**"))
    floor = figs.median("lookup.zmq_rtt.p50")
    for text, fig, bound in LOOKUP_TARGETS:
        value = figs.median(fig)
        if value is not None and floor:
            ratio = value / floor
            rows.append((text, f"{ratio:.2f}x ({value:.0f} us, round trip {floor:.0f} us)",
                         "yes" if ratio <= bound else "**no**"))
    chunks, serving = figs.median("restart.chunks"), figs.median("restart.serving_s")
    if chunks is not None and serving is not None:
        rows.append((f"NVMe restart over {chunks:,.0f} chunks: serving within 1 s of the daemon's start",
                     f"{serving:.2f} s", "yes" if serving <= 1.0 else "**no**"))
    restart_bounds = (("after a crash: whole < 10 s", "restart.indexed_s", 10.0, "s"),
                      ("after a clean stop: serving < 1 s", "restart.clean.serving_s", 1.0, "s"),
                      ("after a clean stop: whole < 10 s", "restart.clean.indexed_s", 10.0, "s"),
                      ("index RAM a chunk <= 64 B, whole", "restart.rss_per_chunk", 64.0, "B"),
                      ("index RAM a chunk <= 64 B, peak while scanning", "restart.rss_per_chunk_peak", 64.0, "B"),
                      ("index RAM a chunk <= 64 B, peak while loading", "restart.clean.rss_per_chunk_peak", 64.0, "B"))
    for text, fig, bound, unit in restart_bounds:
        value = figs.median(fig)
        if value is not None and chunks:
            rows.append((f"NVMe restart over {chunks:,.0f} chunks, {text}", f"{value:.2f} {unit}" if unit == "s"
                         else f"{value:.0f} {unit}", "yes" if value <= bound else "**no**"))
    for text, fig, bound in BUSY_TARGETS:
        value = figs.median(fig)
        if value is not None:
            rows.append((text, f"{value:.0f} us", "yes" if value <= bound else "**no**"))
    return rows + ttft_report.target_rows(figs)


def markdown(figs: Figures, sizes: List[str], meta: dict) -> str:
    m_ = meta["machine"]
    out = ["# Benchmarks", "",
           "Generated by `hicache-tiers bench` (hicache_ext/lab/bench, tiers/bench); do not edit by hand. "
           "Every figure is the median of the repetitions with the spread (min–max) in brackets; every "
           "ratio is between figures measured in this one run, each limit sampled just before the step it bounds: "
           "the median of the per-repetition ratios where the limit is sampled once before each repetition (the "
           "NVMe tier against the disk, the write_through chain against NVMe alone), else the ratio of the "
           "medians.",
           "", f"- command: `{meta['command']}`", f"- date: {meta['date']}",
           f"- machine: {m_['cpu']}, {m_['cores']} cores, {m_['memory_gib']} GiB, kernel {m_['kernel']}, "
           f"disk {m_['disk']}, Python {m_['python']}; load average at start {m_['load_average']}",
           f"- batch: {meta['pages']} pages a call, {meta['repeat']} repetitions; pages shaped like Llama-3-8B "
           "(32 layers, 8 KV heads, head dim 128, bf16; 8 tokens a MiB) from 1 MiB, like Llama-3.2-1B (16 layers, "
           "8 KV heads, head dim 64; 32 KiB a token) below, page_first host pool in a memfd",
           f"- wall time: {meta['seconds']:.0f} s", ""]
    rows = target_rows(figs, sizes)
    if rows:
        out += ["## Targets", "", "| target | measured | holds |", "|---|---|---|"]
        out += [f"| {a} | {b} | {c} |" for a, b, c in rows]
        out.append("")
    for m in sizes:
        body = []
        for label, fig, limit, peer in TIER_ROWS:
            fig, limit, peer = fig.format(m=m), limit.format(m=m), peer.format(m=m)
            if figs.median(fig) is None:
                continue
            body.append(f"| {label} | {_cell(figs, fig)} | {_cell(figs, limit)} | {_num(figs.ratio(fig, limit))} | "
                        f"{_num(figs.ratio(fig, peer))} |")
        if body:
            out += [f"## Tiers, {_human(m)} pages (GB/s)", "",
                    "| tier | this project | its limit | x limit | x peer |", "|---|---|---|---|---|", *body, ""]
    out += _sealed_section(figs, sizes)
    pol = []
    for m in sizes:
        for p in POLICIES:
            w, r = f"chain.{p}.{m}.write", f"chain.{p}.{m}.read"
            if figs.median(w) is not None:
                alone = f"chain.nvme_alone.{m}.write"
                pol.append(f"| {_human(m)} | {p} | {_cell(figs, w)} | {_cell(figs, r)} | "
                           f"{_num(figs.ratio(w, f'limit.memcpy.{m}'))} | {_num(figs.ratio(w, alone))} |")
    if pol:
        out += ["## Write policies, DRAM + NVMe chain (GB/s)", "",
                "write_through acknowledges once both tiers hold the page; write_back and selective once DRAM "
                "does. Reads come from DRAM. NVMe alone: a node of NVMe only, written right before each of the "
                "chain's write_through batches.", "",
                "| pages | policy | write | read | write x memcpy | write x NVMe alone |", "|---|---|---|---|---|---|",
                *pol, ""]
    lim = [f"| {label} | " + " | ".join(_cell(figs, f.format(m=m)) for m in sizes) + " |" for label, f in LIMIT_ROWS
           if any(figs.median(f.format(m=m)) is not None for m in sizes)]
    if lim:
        out += ["## Limits of this machine (GB/s)", "", "| path | " + " | ".join(f"{_human(m)}" for m in sizes) + " |",
                "|---|" + "---|" * len(sizes), *lim, ""]
    peer = [f"| {label} | " + " | ".join(_cell(figs, f.format(m=m)) for m in sizes) + " |" for label, f in PEER_ROWS
            if any(figs.median(f.format(m=m)) is not None for m in sizes)]
    if peer:
        out += ["## Peers through SGLang's own page functions (GB/s)", "",
                "| backend | " + " | ".join(f"{_human(m)}" for m in sizes) + " |", "|---|" + "---|" * len(sizes),
                *peer, ""]
    lk = [(n, figs.median(f"lookup.{n}.p50"), figs.median(f"lookup.{n}.p99")) for n in (1, 128, 1024)]
    if any(p is not None for _n, p, _q in lk):
        out += ["## Prefix lookup through the backend (DRAM tier, ipc socket)", "",
                "| keys | p50 (us) | p99 (us) |", "|---|---|---|"]
        out += [f"| {n} | {_num(p, 0)} | {_num(q, 0)} |" for n, p, q in lk if p is not None]
        busy = figs.median("lookup.128.busy.p50")
        if busy is not None:
            out.append(f"| 128, while another rank writes 8 MiB pages | {busy:.0f} | "
                       f"{_num(figs.median('lookup.128.busy.p99'), 0)} |")
        p = figs.median("lookup.zmq_rtt.p50")
        if p is not None:
            out.append(f"| ZeroMQ 64 B round trip, ipc, taken between those lookups and waited for as they are (the "
                       f"GIL held up to 1 ms, tiers/wire/held_wait.py: floor) | {p:.0f} | "
                       f"{_num(figs.median('lookup.zmq_rtt.p99'), 0)} |")
        for t in ("ipc", "tcp"):
            p = figs.median(f"limit.zmq_rtt.{t}.p50")
            if p is not None:
                out.append(f"| ZeroMQ 64 B round trip, {t} (limit) | {p:.0f} | "
                           f"{_num(figs.median(f'limit.zmq_rtt.{t}.p99'), 0)} |")
        out.append("")
    rk = [(n, f"ranks.{n}.write", f"ranks.{n}.read") for n in RANKS]
    if any(figs.median(w) is not None for _n, w, _r in rk):
        out += ["## Concurrent rank processes on one DRAM tier (aggregate GB/s, 4 MiB pages)", "",
                "Each rank is a process with its own host pool and backend; a step ends when its slowest rank "
                "does. The lookups are rank 0's 128-key batch_exists while every other rank writes.", "",
                "| ranks | write | read | 128-key lookup p50 (us) | p99 (us) |", "|---|---|---|---|---|"]
        out += [f"| {n} | {_cell(figs, w)} | {_cell(figs, r)} | {_cell(figs, f'ranks.{n}.lookup128.p50', 0)} | "
                f"{_cell(figs, f'ranks.{n}.lookup128.p99', 0)} |" for n, w, r in rk if figs.median(w) is not None]
        out.append("")
    if figs.median("restart.chunks") is not None:
        out += ["## NVMe restart", "",
                "The daemon restarted over a chunk directory (a few real pages, the rest hard links under real "
                "key names and fan-out): after a crash it serves at once and scans every name behind it (chunks "
                "not yet indexed read as misses); after a clean stop it loads the index it saved. RAM a chunk: "
                "the daemon's anonymous RSS less what it held over the few real pages, once the index is whole "
                "and the most sampled (every 50 ms) while it was built.", "",
                "| start | chunks | first lookup answered (s after spawn) | index complete (s after spawn) | "
                "scan or load (s) | 128-key lookups meanwhile: p50 / p99 (us), unanswered | "
                "daemon RAM a chunk, whole / peak (B) | native index a chunk (B) |",
                "|---|---|---|---|---|---|---|---|"]
        for label, how in (("restart", "after a crash"), ("restart.clean", "after a clean stop")):
            if figs.median(f"{label}.chunks") is None:
                continue
            out.append(f"| {how} | {figs.median(f'{label}.chunks'):,.0f} | {_num(figs.median(f'{label}.serving_s'))} | "
                       f"{_num(figs.median(f'{label}.indexed_s'))} | {_num(figs.median(f'{label}.scan_s'))} | "
                       f"{_num(figs.median(f'{label}.lookup_during.p50'), 0)} / "
                       f"{_num(figs.median(f'{label}.lookup_during.p99'), 0)}, "
                       f"{_num(figs.median(f'{label}.lookup_during.unanswered'), 0)} | "
                       f"{_num(figs.median(f'{label}.rss_per_chunk'), 0)} / "
                       f"{_num(figs.median(f'{label}.rss_per_chunk_peak'), 0)} | "
                       f"{_num(figs.median(f'{label}.index_bytes_per_chunk'), 0)} |")
        out.append("")
    out += ttft_report.section(figs)
    if figs.notes:
        out += ["## Notes", ""] + [f"- {part}: {text}" for part, text in figs.notes.items()] + [""]
    if figs.failures:
        out += ["## Failures", ""] + [f"- {f}" for f in figs.failures] + [""]
    if meta.get("plot"):
        out += [f"![write and read GB/s]({meta['plot']})", ""]
    return "\n".join(out)


def plot(figs: Figures, sizes: List[str], path: str) -> bool:
    """Write and read GB/s of each tier, peer and limit per page size; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    series = {
        "write": [("memcpy", "limit.memcpy"), ("DRAM", "dram.{m}.write"), ("disk raw", "limit.disk_write"),
                  ("NVMe", "nvme.{m}.write"), ("TE raw", "limit.te_write"), ("remote", "remote.{m}.write"),
                  ("SGLang file", "file.{m}.write"), ("SGLang mooncake", "mooncake.{m}.write")],
        "read": [("memcpy", "limit.memcpy"), ("DRAM", "dram.{m}.read"), ("disk raw O_DIRECT", "limit.disk_read_direct"),
                 ("NVMe cold", "nvme.{m}.read"), ("TE raw", "limit.te_read"), ("remote", "remote.{m}.read"),
                 ("SGLang file cold", "file.{m}.read"), ("SGLang mooncake", "mooncake.{m}.read")],
    }
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for ax, (op, rows) in zip(axes, series.items()):
        width = 0.8 / len(rows)
        for j, (label, name) in enumerate(rows):
            key = name if "{m}" in name else name + ".{m}"
            values = [figs.median(key.format(m=m)) or 0.0 for m in sizes]
            ax.bar([i + j * width for i in range(len(sizes))], values, width, label=label)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sizes))])
        ax.set_xticklabels([f"{_human(m)} pages" for m in sizes])
        ax.set_title(op)
        ax.set_ylabel("GB/s (median)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _sealed_section(figs: Figures, sizes: List[str]) -> List[str]:
    """The DRAM tier with pages sealed in the engine (page_key_file), against itself unsealed and AES alone."""
    rows = []
    for m in sizes:
        w, r = f"sealed.{m}.write", f"sealed.{m}.read"
        if figs.median(w) is not None:
            rows.append(f"| {_human(m)} | {_cell(figs, w)} | {_cell(figs, r)} | "
                        f"{_num(figs.ratio(w, f'dram.{m}.write'))} | {_num(figs.ratio(r, f'dram.{m}.read'))} | "
                        f"{_num(figs.ratio(w, f'limit.aes_seal.{m}'))} | {_num(figs.ratio(r, f'limit.aes_open.{m}'))} |")
    if not rows:
        return []
    return ["## Sealed pages (page_key_file: AES-256-GCM in the engine), DRAM tier (GB/s)", "",
            "Each page is sealed from the host pool into a staging memfd the daemon copies from (the host pool is "
            "not shared with it), or copied out of a read lease and opened into the host pool, by one engine "
            "thread.", "",
            "| pages | write | read | write x unsealed | read x unsealed | write x AES alone | read x AES alone |",
            "|---|---|---|---|---|---|---|", *rows, ""]

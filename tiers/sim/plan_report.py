"""The plan's tables (stdout), its JSON document and its figure."""
from __future__ import annotations

import json
from typing import Sequence

from tiers.sim.report import text_table


def _gb(value: float) -> str:
    return f"{value:,.0f}"


def _fronts(row: dict) -> str:
    return "".join(letter for letter, name in (("m", "mean"), ("p", "p90"), ("h", "hit")) if row.get(f"front_{name}"))


def grid_table(rows: Sequence[dict]) -> str:
    """Every point: capacities, cost, hit rate per level, TTFT; the fronts it is on (m: mean TTFT, p: p90, h: hit rate)."""
    header = ["front", "DRAM GB", "NVMe GB", "remote GB", "cost $", "L1", "L2", "L3", "hit", "L3 held",
              "TTFT mean s", "p90 s", "p99 s"]
    lines = [[_fronts(r), _gb(r["dram_gb"]), _gb(r["nvme_gb"]), _gb(r["remote_gb"]),
              f"{r['cost']:,.0f}", f"{r['device_hit_rate']:.3f}", f"{r['host_hit_rate']:.3f}",
              f"{r['storage_hit_rate']:.3f}", f"{r['hit_rate']:.3f}", f"{r['storage_available_rate']:.3f}",
              f"{r['ttft_mean_s']:.3f}", f"{r['ttft_p90_s']:.3f}", f"{r['ttft_p99_s']:.3f}"]
             for r in sorted(rows, key=lambda r: (r["cost"], r["ttft_mean_s"]))]
    return text_table(header, lines)


def settings_table(rows: Sequence[dict]) -> str:
    """One SGLang setting changed at a time at one point, with where L3 hits were lost."""
    header = ["setting", "value", "hit", "d hit", "L3", "L3 held", "TTFT mean s", "d mean", "p90 s",
              "lost to (M tokens)"]
    lines = []
    for r in rows:
        lost = {k[5:]: r[k] for k in r if k.startswith("lost_") and r[k]}
        top = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in sorted(lost.items(), key=lambda kv: -kv[1])[:2])
        lines.append([r["setting"], str(r["value"]), f"{r['hit_rate']:.3f}", f"{r['delta_hit_rate']:+.3f}",
                      f"{r['storage_hit_rate']:.3f}", f"{r['storage_available_rate']:.3f}", f"{r['ttft_mean_s']:.3f}", f"{r['delta_ttft_mean_s']:+.3f}",
                      f"{r['ttft_p90_s']:.3f}", top or "-"])
    return text_table(header, lines)


def write_json(path: str, meta: dict, rows: Sequence[dict], settings: Sequence[dict], extra: dict) -> None:
    """The run's settings, every point, the settings table and any checks as one document."""
    document = dict(meta, points=list(rows), settings=list(settings), **extra)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=1, default=str)
        handle.write("\n")


def plot(path: str, rows: Sequence[dict], title: str) -> None:
    """Cost against mean and p90 TTFT (the front joined) and against hit rate per level."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ordered = sorted(rows, key=lambda r: r["cost"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    costs = [r["cost"] for r in ordered]
    for key, name, color in (("ttft_mean_s", "mean", "tab:blue"), ("ttft_p90_s", "p90", "tab:orange")):
        left.scatter(costs, [r[key] for r in ordered], color=color, alpha=0.4, label=f"{name} TTFT")
        front = [r for r in ordered if r.get(f"front_{name}")]
        left.plot([r["cost"] for r in front], [r[key] for r in front], "-o", color=color, label=f"front ({name})")
        for r in front:
            left.annotate(f"{r['dram_gb']:.0f}/{r['nvme_gb']:.0f}/{r['remote_gb']:.0f}",
                          (r["cost"], r[key]), fontsize=7, textcoords="offset points", xytext=(3, 3))
    left.set_xlabel("node tier cost ($; labels: DRAM/NVMe/remote GB)")
    left.set_ylabel("TTFT (s)")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    bottom = [0.0] * len(ordered)
    for key, label in (("device_hit_rate", "L1 (GPU)"), ("host_hit_rate", "L2 (host)"),
                       ("storage_hit_rate", "L3 (node tiers)")):
        values = [r[key] for r in ordered]
        right.bar(range(len(ordered)), values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    right.plot(range(len(ordered)), [r["device_hit_rate"] + r["host_hit_rate"] + r["storage_available_rate"]
                                     for r in ordered], "k_", markersize=14, label="L1+L2+what L3 held")
    right.set_xticks(range(len(ordered)))
    right.set_xticklabels([f"${r['cost']:,.0f}" for r in ordered], rotation=60, fontsize=7)
    right.set_ylabel("token hit rate")
    right.legend(fontsize=8)
    right.grid(alpha=0.3, axis="y")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

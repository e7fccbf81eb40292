"""PNG plots: hit rate against capacity per policy, and the prefill speed-up curve."""
from __future__ import annotations

from typing import List, Sequence

from tiers.sim.simulate import Score
from tiers.sim.sweep import Row


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend (ImportError says how to install it)."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'hicache-tiers[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _si(value: float) -> str:
    """1000 -> 1k, 3e6 -> 3M: tick labels people read."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:g}{suffix}"
    return f"{value:g}"


def _tick_label(label: str, tokens: int) -> str:
    """The capacity as given ("3Mt" -> "3M"); block capacities say "b"."""
    label = label.strip()
    if label.endswith("tokens"):
        return label[:-len("tokens")]
    if label.endswith("t") and label[:-1]:
        return label[:-1]
    return label or _si(tokens)


def hit_rate_plot(path: str, rows: Sequence[Row], best: Score, title: str, metric: str = "token_hit_rate") -> None:
    """One line per policy over capacity in tokens (log axis), the infinite-cache ceiling dashed.

    Policies whose curves are identical (LRU and radix-LRU often are) would
    hide each other: each policy gets a larger hollow marker than the one
    before, so coinciding points show as nested rings, and the legend says
    which curves coincide.
    """
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(8, 5), dpi=120)
    markers, styles = "osD^vP*X", ["-", "--", "-.", ":"]
    seen = {}
    for index, policy in enumerate(dict.fromkeys(r.policy for r in rows)):
        points = sorted((r.capacity_tokens, getattr(r, metric)) for r in rows if r.policy == policy)
        key = tuple(points)
        label = f"{policy} (= {seen[key]})" if key in seen else policy
        seen.setdefault(key, policy)
        axes.plot([p[0] for p in points], [p[1] for p in points], marker=markers[index % len(markers)],
                  linestyle=styles[index % len(styles)], markersize=4 + 2.5 * index, markerfacecolor="none",
                  markeredgewidth=1.3, linewidth=1.5, label=label, zorder=10 - index)
    ceiling_value = best.token_hit_rate if metric == "token_hit_rate" else best.block_hit_rate
    axes.axhline(ceiling_value, color="black", linestyle=(0, (1, 2)), linewidth=1.2,
                 label=f"infinite cache ({ceiling_value:.3f})")
    axes.set_xscale("log")
    # A label at every measured capacity, as the user wrote it (capacities in tokens are
    # rounded down to whole blocks, so 1Mt sits at 999,936 tokens), none in between.
    ticks = {r.capacity_tokens: r.capacity for r in rows if r.capacity_tokens > 0}
    if ticks:
        axes.set_xticks(sorted(ticks))
        axes.set_xticklabels([_tick_label(ticks[t], t) for t in sorted(ticks)], fontsize=8)
        axes.minorticks_off()
    axes.set_xlabel("cache capacity (tokens, log scale)")
    axes.set_ylabel(metric.replace("_", " "))
    axes.set_ylim(0, max(ceiling_value * 1.1, 0.05))
    axes.set_title(title)
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def speedup_plot(path: str, curve: List[dict], crossover: float, title: str) -> None:
    """Speed-up of TTFT with reuse over reuse fraction a, the crossover a* marked."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=120)
    axes.plot([p["a"] for p in curve], [p["speedup"] for p in curve], linewidth=1.8, label="TTFT speed-up")
    axes.axvline(crossover, color="gray", linestyle="--", linewidth=1, label=f"a* = e/(1+e) = {crossover:.3f}")
    axes.axhline(1.0, color="black", linewidth=0.6)
    peak = max(curve, key=lambda p: p["speedup"])
    axes.plot([peak["a"]], [peak["speedup"]], "o", color="C3", label=f"peak {peak['speedup']:.2f}x at a = {peak['a']:.3f}")
    axes.annotate(f"{peak['speedup']:.2f}x", (peak["a"], peak["speedup"]), textcoords="offset points",
                  xytext=(6, 6), color="C3")
    axes.set_xlabel("reused fraction of the prompt, a")
    axes.set_ylabel("speed-up over no reuse (x)")
    axes.set_xlim(0, 1)
    axes.set_ylim(0, peak["speedup"] * 1.15)
    axes.set_title(title, fontsize=9)
    axes.grid(True, alpha=0.3)
    axes.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)

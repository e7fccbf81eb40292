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


def hit_rate_plot(path: str, rows: Sequence[Row], best: Score, title: str, metric: str = "token_hit_rate") -> None:
    """One line per policy over capacity in tokens (log axis), the infinite-cache ceiling dashed."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(8, 5), dpi=120)
    markers, styles = "osD^vP*X", ["-", "--", "-.", ":"]
    for index, policy in enumerate(dict.fromkeys(r.policy for r in rows)):
        points = sorted((r.capacity_tokens, getattr(r, metric)) for r in rows if r.policy == policy)
        axes.plot([p[0] for p in points], [p[1] for p in points], marker=markers[index % len(markers)],
                  linestyle=styles[index % len(styles)], markersize=4, linewidth=1.5, label=policy)
    ceiling_value = best.token_hit_rate if metric == "token_hit_rate" else best.block_hit_rate
    axes.axhline(ceiling_value, color="black", linestyle=(0, (1, 2)), linewidth=1.2,
                 label=f"infinite cache ({ceiling_value:.3f})")
    axes.set_xscale("log")
    axes.set_xlabel("cache capacity (tokens, log scale)")
    axes.set_ylabel(metric.replace("_", " "))
    axes.set_ylim(0, max(ceiling_value * 1.1, 0.05))
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
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
    axes.set_xlabel("reused fraction of the prompt, a")
    axes.set_ylabel("speed-up over no reuse (x)")
    axes.set_xlim(0, 1)
    axes.set_ylim(0, None)
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)

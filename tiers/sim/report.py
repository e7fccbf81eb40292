"""Result rows as a stdout table, JSON and CSV."""
from __future__ import annotations

import csv
import json
from typing import Dict, List, Sequence

from tiers.sim.simulate import Score
from tiers.sim.sweep import Row


def hit_rate_table(rows: Sequence[Row], best: Score, metric: str = "token_hit_rate") -> str:
    """Capacities down, policies across, metric in each cell; the ceiling in the last line."""
    policies = list(dict.fromkeys(r.policy for r in rows))
    capacities = list(dict.fromkeys((r.capacity, r.capacity_blocks) for r in rows))
    cell: Dict[tuple, float] = {(r.policy, r.capacity, r.capacity_blocks): getattr(r, metric) for r in rows}
    header = ["capacity", "blocks"] + policies
    lines = [header]
    for label, blocks in capacities:
        lines.append([label, f"{blocks:,}"] + [f"{cell[(p, label, blocks)]:.4f}" if (p, label, blocks) in cell else "-"
                                               for p in policies])
    ceiling_value = best.token_hit_rate if metric == "token_hit_rate" else best.block_hit_rate
    lines.append(["infinite", "-"] + [f"{ceiling_value:.4f}"] * len(policies))
    return f"{metric.replace('_', ' ')}:\n" + text_table(header, lines[1:])


def text_table(header: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    """Right-aligned columns, two spaces apart, a dashed line under the header."""
    widths = [max(len(x) for x in col) for col in zip(header, *lines)]
    out = ["  ".join(h.rjust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(x.rjust(w) for x, w in zip(line, widths)) for line in lines]
    return "\n".join(out)


def bench_table(results: List[Dict[str, object]]) -> str:
    """Accesses per second per policy and engine."""
    out = [f"{'policy':>10}  {'engine':>11}  {'points':>6}  {'seconds':>8}  {'accesses/s per point':>21}"]
    for r in results:
        out.append(f"{r['policy']:>10}  {r['engine']:>11}  {r['capacity_points']:>6}  {r['seconds']:>8.3f}  "
                   f"{r['accesses_per_s']:>21,.0f}")
    return "\n".join(out)


def write_json(path: str, rows: Sequence[Row], best: Score, meta: dict) -> None:
    """Rows, the ceiling and run metadata as one JSON document."""
    document = dict(meta, ceiling={"token_hit_rate": best.token_hit_rate, "block_hit_rate": best.block_hit_rate},
                    rows=[r.as_dict() for r in rows])
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=1)
        handle.write("\n")


def write_csv(path: str, rows: Sequence[Row]) -> None:
    """One CSV line per row."""
    if not rows:
        raise ValueError("no rows to write")
    with open(path, "w", encoding="utf-8", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0].as_dict()))
        writer.writeheader()
        for row in rows:
            writer.writerow(row.as_dict())


def write_dict_csv(path: str, rows: Sequence[dict]) -> None:
    """One CSV line per dict (the first row's keys as the header)."""
    if not rows:
        raise ValueError("no rows to write")
    with open(path, "w", encoding="utf-8", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)

"""Seconds per token and per call for the whole-hierarchy simulation, from measurements.

Tier speeds come from a ``hicache-tiers bench --json`` file of the target
machine (never typed): read and write GB/s of each tier kind at the measured
page size nearest the model's page (log scale; outside the measured range the
nearest end), and the lookup latency by key count. The GPU side comes from a
GPU preset whose figures cite their published source: dense BF16 peak for T
(with the model's 2 x params FLOPs a token and an MFU) and the host-to-device
link for loading host (L2) pages back to the GPU.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from tiers.sim.prefill import GB, PRESETS, ModelShape

# The bench figure prefix of each tier kind (tiers/bench: "<prefix>.<page size>.read|write").
KIND_FIGURES = {"dram": "dram", "nvme": "nvme", "remote": "remote", "mooncake_store": "mooncake"}
PAGE_SIZES = {"64KiB": 64 << 10, "256KiB": 256 << 10, "1MiB": 1 << 20, "4MiB": 4 << 20, "8MiB": 8 << 20}


@dataclass(frozen=True)
class GpuPreset:
    """Published figures of one GPU: dense BF16 TFLOPs, host-to-device GB/s, and where they come from."""

    tflops: float
    h2d_gbps: float
    source: str


GPU_PRESETS: Dict[str, GpuPreset] = {
    "a100-sxm": GpuPreset(312.0, 25.0, "NVIDIA A100 datasheet: 312 TFLOPs dense BF16; PCIe 4.0 x16 "
                                      "31.5 GB/s a direction (PCI-SIG), 25 GB/s taken as reached"),
    "h100-sxm": GpuPreset(989.0, 50.0, "NVIDIA H100 datasheet: 989 TFLOPs dense BF16 (SXM); PCIe 5.0 x16 "
                                      "63 GB/s a direction (PCI-SIG), 50 GB/s taken as reached"),
    "h200": GpuPreset(989.0, 50.0, "NVIDIA H200 datasheet: 989 TFLOPs dense BF16; PCIe 5.0 x16, as H100"),
    "l40s": GpuPreset(362.0, 25.0, "NVIDIA L40S datasheet: 362 TFLOPs dense BF16; PCIe 4.0 x16, as A100"),
}


class BenchError(ValueError):
    """The bench file cannot give a figure the simulation needs (named in the message)."""


class BenchFigures:
    """The medians of a ``hicache-tiers bench --json`` file."""

    def __init__(self, document: dict, path: str = "bench.json"):
        figures = document.get("figures") if isinstance(document, dict) else None
        if not isinstance(figures, dict) or not figures:
            raise BenchError(f"{path}: not a hicache-tiers bench --json file (no 'figures')")
        self.path = path
        self.meta = document.get("meta", {})
        self.medians = {name: float(f["median"]) for name, f in figures.items()
                        if isinstance(f, dict) and isinstance(f.get("median"), (int, float))}

    @classmethod
    def load(cls, path: str) -> "BenchFigures":
        """Read path (BenchError naming what is wrong; OSError when it cannot be read)."""
        with open(path, "r", encoding="utf-8") as handle:
            try:
                document = json.load(handle)
            except ValueError as exc:
                raise BenchError(f"{path}: not JSON ({exc})") from None
        return cls(document, path)

    def gbps(self, kind: str, op: str, page_bytes: float) -> float:
        """GB/s of op ('read' or 'write') on tier kind at the measured page size nearest page_bytes."""
        prefix = KIND_FIGURES.get(kind, kind)
        measured = [(size, self.medians.get(f"{prefix}.{label}.{op}")) for label, size in PAGE_SIZES.items()]
        measured = [(size, value) for size, value in measured if value]
        if not measured:
            raise BenchError(f"{self.path}: no '{prefix}.<page size>.{op}' figure: run "
                             f"hicache-tiers bench with the {prefix} part")
        return min(measured, key=lambda m: abs(math.log(m[0]) - math.log(max(page_bytes, 1))))[1]

    def lookup_s(self, keys: int) -> float:
        """Seconds of one lookup of keys pages (p50, interpolated between measured key counts)."""
        points = sorted((int(name.split(".")[1]), value) for name, value in self.medians.items()
                        if name.startswith("lookup.") and name.endswith(".p50") and name.split(".")[1].isdigit())
        if not points:
            raise BenchError(f"{self.path}: no lookup.<keys>.p50 figure: run hicache-tiers bench with the lookup part")
        if keys <= points[0][0]:
            return points[0][1] * 1e-6
        for (k0, v0), (k1, v1) in zip(points, points[1:]):
            if keys <= k1:
                return (v0 + (v1 - v0) * (keys - k0) / (k1 - k0)) * 1e-6
        (k0, v0), (k1, v1) = points[-2:] if len(points) > 1 else (points[0], points[0])
        slope = (v1 - v0) / (k1 - k0) if k1 != k0 else 0.0
        return (v1 + slope * (keys - k1)) * 1e-6


@dataclass(frozen=True)
class TimeModel:
    """Per-token and per-call seconds of one model on one GPU in front of one tier chain."""

    compute_s: float  # T: prefill compute per token
    h2d_s: float  # host (L2) to GPU per token
    tier_read_s: tuple  # per tier of the chain, reading one token's KV
    write_s: float  # W: the chain's write of one token under the router's write policy
    page_tokens: int
    bench: Optional[BenchFigures] = None
    source: str = ""

    def lookup_s(self, pages: int) -> float:
        """One lookup of pages keys (0 without a bench file)."""
        return self.bench.lookup_s(pages) if self.bench is not None else 0.0


def time_model(bench: Optional[BenchFigures], kinds: Sequence[str], router_write_policy: str,
               model: str = "llama-3-8b", gpu: str = "h100-sxm", mfu: float = 0.5, page_tokens: int = 64,
               shape: Optional[ModelShape] = None, compute_s: Optional[float] = None, gpus: int = 1) -> TimeModel:
    """The TimeModel of a model preset on gpus GPUs of a preset in front of tiers of kinds (fastest first).

    compute_s overrides T (a measured figure); without a bench file every tier costs nothing. With
    gpus > 1 (tensor parallel) compute and the host-to-GPU links divide by gpus (no collective cost).
    """
    if gpus < 1:
        raise ValueError("gpus must be at least 1")
    if shape is None:
        if model not in PRESETS:
            raise ValueError(f"unknown model {model!r}; choose one of {', '.join(PRESETS)}")
        shape = PRESETS[model]
    if gpu not in GPU_PRESETS:
        raise ValueError(f"unknown GPU {gpu!r}; choose one of {', '.join(GPU_PRESETS)}")
    if not 0 < mfu <= 1:
        raise ValueError("mfu must be within (0, 1]")
    preset = GPU_PRESETS[gpu]
    per_token = shape.kv_bytes_per_token
    page_bytes = per_token * page_tokens
    t = compute_s if compute_s is not None else 2 * shape.params / (preset.tflops * 1e12 * mfu * gpus)
    reads: List[float] = []
    writes: List[float] = []
    for kind in kinds:
        if bench is None:
            reads.append(0.0)
            writes.append(0.0)
            continue
        reads.append(per_token / (bench.gbps(kind, "read", page_bytes) * GB))
        writes.append(per_token / (bench.gbps(kind, "write", page_bytes) * GB))
    # write_through stores into every tier at once (the slowest sets the pace); the others write the top tier
    write_s = (max(writes) if router_write_policy == "write_through" else writes[0]) if writes else 0.0
    source = (f"T: {model} on {gpus} x {gpu} x MFU {mfu} ({preset.source})" if compute_s is None
              else f"T: given, {compute_s * 1e6:.1f} us a token")
    return TimeModel(compute_s=t, h2d_s=per_token / (preset.h2d_gbps * GB * gpus), tier_read_s=tuple(reads),
                     write_s=write_s, page_tokens=page_tokens, bench=bench, source=source)

"""Seconds per token and per call for the whole-hierarchy simulation, from measurements.

Tier speeds come from a ``hicache-tiers bench --json`` file of the target
machine (never typed): read and write GB/s of each tier kind at the measured
page size nearest the model's page (log scale; outside the measured range the
nearest end), and the lookup latency by key count. The engine side comes from
a GPU preset whose figures cite their published source: dense BF16 peak for T
(with the model's 2 x params FLOPs a token and an MFU) and the host-to-device
link for loading host (L2) pages back to the GPU; or from a measured profile
(``tiers/sim/profile.py``: a real server's prefill, per-cached-token and
host-to-device costs), which takes the preset's place.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from tiers.sim.prefill import GB, PRESETS, ModelShape
from tiers.sim.profile import Profile, preset_fit, service_s

# The bench figure prefix of each tier kind (tiers/bench: "<prefix>.<page size>.read|write").
KIND_FIGURES = {"dram": "dram", "nvme": "nvme", "remote": "remote", "mooncake_store": "mooncake"}
PAGE_LABEL = re.compile(r"^(\d+)(KiB|MiB)$")  # the bench's page-size labels: "64KiB", "128KiB", "8MiB"


def page_label_bytes(label: str) -> Optional[int]:
    """ "128KiB" -> 131072; None for a label that is not a page size."""
    match = PAGE_LABEL.match(label)
    return int(match.group(1)) << (10 if match.group(2) == "KiB" else 20) if match else None


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
    "h200": GpuPreset(989.0, 55.0, "NVIDIA H200 datasheet: 989 TFLOPs dense BF16; host-to-device measured on "
                                  "one H200 (PCIe 5.0 x16, 2026-11-27, scripts/gpu_h2d.py, "
                                  "docs/measured/gpu_h2d_h200.json): 54-55 GB/s one copy from a pinned or "
                                  "cudaHostRegister'd memfd host pool, 48-54 GB/s page by page at 1-8 MiB"),
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
        measured = []
        for name, value in self.medians.items():
            parts = name.split(".")
            if len(parts) == 3 and parts[0] == prefix and parts[2] == op and value:
                size = page_label_bytes(parts[1])
                if size:
                    measured.append((size, value))
        if not measured:
            raise BenchError(f"{self.path}: no '{prefix}.<page size>.{op}' figure: run "
                             f"hicache-tiers bench with the {prefix} part")
        return min(measured, key=lambda m: abs(math.log(m[0]) - math.log(max(page_bytes, 1))))[1]

    def lookup_s(self, keys: int) -> float:
        """Seconds of one lookup of keys pages (p50, interpolated between measured key counts)."""
        # exactly lookup.<keys>.p50: lookup.<keys>.busy.p50 (a lookup beside a flood) is another figure
        points = sorted((int(parts[1]), value) for parts, value in
                        ((name.split("."), value) for name, value in self.medians.items())
                        if len(parts) == 3 and parts[0] == "lookup" and parts[1].isdigit() and parts[2] == "p50")
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
    # What a measured profile adds (a GPU preset leaves them 0 / overlapped): per request, per computed
    # token squared, per cached token; serial_load: the load to the device adds to compute
    overhead_s: float = 0.0
    compute_s2: float = 0.0
    cached_s: float = 0.0
    serial_load: bool = False
    load_fixed_s: float = 0.0  # a request's load from host beyond h2d a token (a profile's; a GPU preset: 0)
    prefetch_s: float = 0.0  # the engine's own time around a storage hit query, beyond the lookups
    hit_handoff_s: float = 0.0  # the engine's own time to carry a hit from its query to its reads and back
    tier_fixed_s: tuple = ()  # per tier of the chain, a storage batch's fixed cost (a profile's ReadFit; else 0)

    def lookup_s(self, pages: int) -> float:
        """One lookup of pages keys (0 without a bench file)."""
        return self.bench.lookup_s(pages) if self.bench is not None else 0.0

    def service_s(self, cached: int, loaded: int, computed: int) -> float:
        """From admission to the first token: cached (L1+L2+L3) tokens, loaded (L2+L3) to the GPU, computed."""
        return service_s(self, cached, loaded, computed, self.write_s)

    def batch_read_s(self, tokens_by_depth: Dict[int, int]) -> float:
        """One storage batch: each tier reads its tokens at once, the slowest sets the time."""
        fixed = self.tier_fixed_s
        return max((fixed[d] if d < len(fixed) else 0.0) + k * self.tier_read_s[d] for d, k in tokens_by_depth.items())


def time_model(bench: Optional[BenchFigures], kinds: Sequence[str], router_write_policy: str,
               model: str = "llama-3-8b", gpu: str = "h100-sxm", mfu: float = 0.5, page_tokens: int = 64,
               shape: Optional[ModelShape] = None, compute_s: Optional[float] = None, gpus: int = 1,
               profile: Optional[Profile] = None) -> TimeModel:
    """The TimeModel of a model preset on gpus GPUs of a preset in front of tiers of kinds (fastest first).

    compute_s overrides T (a measured figure); without a bench file every tier costs nothing. With
    gpus > 1 (tensor parallel) compute and the host-to-GPU links divide by gpus (no collective cost).
    A profile replaces the model and GPU presets: its KV shape, and its fit for every engine figure; and a
    tier's read rate where it measured the server's own reads of that tier kind (``Profile.l3_reads``).
    """
    if gpus < 1:
        raise ValueError("gpus must be at least 1")
    if profile is not None:
        shape = profile.shape
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
    if profile is not None:
        fit = profile.fit
        source = f"engine: measured profile ({profile.source or 'no source'})"
    else:
        fit = preset_fit(2 * shape.params / (preset.tflops * 1e12 * mfu * gpus),
                         per_token / (preset.h2d_gbps * GB * gpus))
        source = f"T: {model} on {gpus} x {gpu} x MFU {mfu} ({preset.source})"
    t = compute_s if compute_s is not None else fit.compute_s
    if compute_s is not None:
        source = f"T: given, {compute_s * 1e6:.1f} us a token"
    reads: List[float] = []
    writes: List[float] = []
    fixed: List[float] = []
    for kind in kinds:
        if bench is None:
            reads.append(0.0)
            writes.append(0.0)
            fixed.append(0.0)
            continue
        read = profile.l3_reads.get(kind) if profile is not None else None
        if read is not None:  # the server's own reads of this tier, as its profile measured them
            reads.append(per_token * read.s_per_byte)
            fixed.append(read.fixed_s)
        else:
            reads.append(per_token / (bench.gbps(kind, "read", page_bytes) * GB))
            fixed.append(0.0)
        writes.append(per_token / (bench.gbps(kind, "write", page_bytes) * GB))
    # write_through stores into every tier at once (the slowest sets the pace); the others write the top tier
    write_s = (max(writes) if router_write_policy == "write_through" else writes[0]) if writes else 0.0
    return TimeModel(compute_s=t, h2d_s=fit.h2d_s, tier_read_s=tuple(reads), write_s=write_s,
                     page_tokens=page_tokens, bench=bench, source=source, overhead_s=fit.overhead_s,
                     compute_s2=fit.compute_s2, cached_s=fit.cached_s, serial_load=fit.serial_load,
                     load_fixed_s=fit.load_fixed_s, prefetch_s=fit.prefetch_s,
                     hit_handoff_s=fit.hit_handoff_s, tier_fixed_s=tuple(fixed))

"""The published prefill model of KV offloading: TTFT with a reused prefix fraction a.

TTFT(a) = max(a*N*T/e, (1-a)*N*W, (1-a)*N*T) against N*T without reuse, where
T is the compute time per token, R = T/e the read time per token and W the
write time per token of the new KV.  Reading wins over computing until the
read term dominates at a* = e / (1 + e), where the speed-up peaks at 1 + e
(when W <= T).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

GB = 1e9


@dataclass(frozen=True)
class ModelShape:
    """What sizes the KV cache and the compute of one token."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: float
    params: float  # parameters, for 2 * params FLOPs per token

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of every layer: 2 x layers x KV heads x head dim x bytes per element."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


PRESETS: Dict[str, ModelShape] = {
    "llama-3-8b": ModelShape(layers=32, kv_heads=8, head_dim=128, dtype_bytes=2, params=8.03e9),
    "llama-3-70b": ModelShape(layers=80, kv_heads=8, head_dim=128, dtype_bytes=2, params=70.6e9),
    "llama-2-7b": ModelShape(layers=32, kv_heads=32, head_dim=128, dtype_bytes=2, params=6.74e9),
    "qwen2.5-7b": ModelShape(layers=28, kv_heads=4, head_dim=128, dtype_bytes=2, params=7.62e9),
}


@dataclass(frozen=True)
class PrefillModel:
    """Per-token times of one model on one GPU and one storage tier."""

    shape: ModelShape
    tflops: float  # GPU peak, dense
    mfu: float  # fraction of the peak prefill reaches
    read_gbps: float  # tier read bandwidth, GB/s (1e9 bytes)
    write_gbps: float  # tier write bandwidth, GB/s

    @property
    def compute_s(self) -> float:
        """T: seconds of GPU compute per prompt token (2 x params FLOPs)."""
        return 2 * self.shape.params / (self.tflops * 1e12 * self.mfu)

    @property
    def read_s(self) -> float:
        """R: seconds to read one token's KV from the tier."""
        return self.shape.kv_bytes_per_token / (self.read_gbps * GB)

    @property
    def write_s(self) -> float:
        """W: seconds to write one token's KV to the tier."""
        return self.shape.kv_bytes_per_token / (self.write_gbps * GB)

    @property
    def e(self) -> float:
        """e = T / R: how many times faster reading a token's KV is than computing it."""
        return self.compute_s / self.read_s

    @property
    def crossover(self) -> float:
        """a* = e / (1 + e): the reuse fraction where reading becomes the bottleneck."""
        return self.e / (1 + self.e)

    def ttft(self, a: float, tokens: int) -> float:
        """Seconds to first token with fraction a of tokens reused."""
        if not 0.0 <= a <= 1.0:
            raise ValueError("reuse fraction must be within [0, 1]")
        t, n = self.compute_s, tokens
        return max(a * n * t / self.e, (1 - a) * n * self.write_s, (1 - a) * n * t)

    def bound(self, a: float) -> str:
        """Which term sets TTFT at reuse fraction a: read, write or compute."""
        terms = {"read": a * self.read_s, "write": (1 - a) * self.write_s, "compute": (1 - a) * self.compute_s}
        return max(terms, key=terms.get)

    def curve(self, tokens: int, points: int) -> List[dict]:
        """TTFT with and without reuse and the speed-up at points evenly spaced values of a."""
        if points < 2:
            raise ValueError("need at least 2 points")
        rows = []
        for i in range(points):
            a = i / (points - 1)
            with_reuse, without = self.ttft(a, tokens), tokens * self.compute_s
            rows.append({"a": a, "ttft_s": with_reuse, "ttft_no_reuse_s": without,
                         "speedup": without / with_reuse if with_reuse else float("inf"), "bound": self.bound(a)})
        return rows

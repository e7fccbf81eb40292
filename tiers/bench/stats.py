"""Series of repeated measurements: medians, spreads, percentiles, and the progress line."""
from __future__ import annotations

import math
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-12) / 1e9


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of fn takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def percentile(values: List[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[rank]


class Figures:
    """Named series of samples (one per repetition) with a unit each, and the failures of the run."""

    def __init__(self):
        self.series: Dict[str, dict] = {}
        self.notes: Dict[str, str] = {}
        self.failures: List[str] = []

    def add(self, name: str, value: float, unit: str = "GB/s") -> None:
        self.series.setdefault(name, {"unit": unit, "samples": []})["samples"].append(float(value))

    def set(self, name: str, value: float, unit: str) -> None:
        """A figure that is itself a statistic (a percentile over many calls)."""
        self.series[name] = {"unit": unit, "samples": [float(value)]}

    def median(self, name: str) -> Optional[float]:
        s = self.series.get(name)
        return statistics.median(s["samples"]) if s and s["samples"] else None

    def spread(self, name: str) -> Optional[tuple]:
        s = self.series.get(name)
        return (min(s["samples"]), max(s["samples"])) if s and s["samples"] else None

    def ratio(self, name: str, limit: str) -> Optional[float]:
        a, b = self.median(name), self.median(limit)
        return None if a is None or not b else a / b

    def note(self, part: str, text: str) -> None:
        self.notes[part] = (self.notes.get(part, "") + " " + text).strip()

    def as_dict(self) -> dict:
        out = {}
        for name, s in self.series.items():
            lo, hi = self.spread(name)
            out[name] = {"unit": s["unit"], "median": self.median(name), "min": lo, "max": hi, "samples": s["samples"]}
        return {"figures": out, "notes": self.notes, "failures": self.failures}


class Progress:
    """One line per step on stderr (rewritten in place on a terminal), with elapsed time."""

    def __init__(self, quiet: bool = False, stream=None):
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.started = time.monotonic()
        self._last = 0

    def step(self, text: str) -> None:
        if self.quiet:
            return
        line = f"[{time.monotonic() - self.started:6.1f}s] {text}"
        if self.tty:
            self.stream.write("\r" + line.ljust(self._last) + "\x1b[K")
            self._last = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self, text: str) -> None:
        if self.quiet:
            return
        if self.tty:
            self.stream.write("\r\x1b[K")
        self.stream.write(f"[{time.monotonic() - self.started:6.1f}s] {text}\n")
        self.stream.flush()

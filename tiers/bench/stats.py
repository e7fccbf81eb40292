"""Series of repeated measurements: medians, spreads, percentiles, and the progress bar."""
from __future__ import annotations

import math
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional


def size_label(page_bytes: int) -> str:
    """The page size in figure names: "64KiB", "1MiB"."""
    return f"{page_bytes >> 20}MiB" if page_bytes % (1 << 20) == 0 else f"{page_bytes >> 10}KiB"


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
        self.info: Dict[str, dict] = {}  # what a part measured on, described (the ttft part's server and model)
        self._pairs: set = set()  # (figure, limit): the limit sampled right before each sample of the figure

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

    def pair(self, name: str, limit: str) -> None:
        """Say that limit is sampled right before each sample of name, one for one (pair), so ratio takes the
        median of the per-sample ratios: a limit that drifts between repetitions (this machine's disk moved
        between 1.5 and 4 GB/s from one minute to the next) then moves both sides of each ratio alike."""
        self._pairs.add((name, limit))

    def ratio(self, name: str, limit: str) -> Optional[float]:
        """name over limit: the median of per-sample ratios where they are paired and as many, else the ratio of
        the medians."""
        if (name, limit) in self._pairs:
            a, b = self.series.get(name), self.series.get(limit)
            if a and b and len(a["samples"]) == len(b["samples"]) and all(b["samples"]):
                return statistics.median(x / y for x, y in zip(a["samples"], b["samples"]))
        a, b = self.median(name), self.median(limit)
        return None if a is None or not b else a / b

    def note(self, part: str, text: str) -> None:
        self.notes[part] = (self.notes.get(part, "") + " " + text).strip()

    def as_dict(self) -> dict:
        out = {}
        for name, s in self.series.items():
            lo, hi = self.spread(name)
            out[name] = {"unit": s["unit"], "median": self.median(name), "min": lo, "max": hi, "samples": s["samples"]}
        return {"figures": out, "notes": self.notes, "failures": self.failures, "info": self.info}


class Progress:
    """Where a long run is: a tqdm bar over its parts on a terminal, one line per step in a log.

    advance(label) starts the next of ``total`` parts; step(text) says what the
    current part is doing (repetitions, round trips); done(text) prints a line
    that stays (a failure, the end).
    """

    def __init__(self, total: int = 0, quiet: bool = False, stream=None):
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.started = time.monotonic()
        tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._bar = None
        if tty and not quiet:
            from tqdm import tqdm
            self._bar = tqdm(total=total or None, unit="part", file=self.stream, leave=False, dynamic_ncols=True,
                             bar_format="{n_fmt}/{total_fmt} [{elapsed}<{remaining}] {desc}")

    def advance(self, label: str) -> None:
        if self._bar is not None:
            self._bar.update(1)
        self.step(label)

    def step(self, text: str) -> None:
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.set_description_str(text)
            return
        self.stream.write(f"[{time.monotonic() - self.started:6.1f}s] {text}\n")
        self.stream.flush()

    def done(self, text: str) -> None:
        if self.quiet:
            return
        line = f"[{time.monotonic() - self.started:6.1f}s] {text}"
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

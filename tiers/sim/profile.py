"""A measured TTFT profile of one engine: what the planner's time model takes instead of a GPU preset.

``hicache-tiers bench --only ttft --ttft-profile FILE`` writes it from a real
SGLang server: the TTFT medians of every case (recompute, device hit, host
hit, L3 hit from each tier) per prompt length, the tokens SGLang reported
cached, the model's KV bytes per token and page size, and a fit of

    service(cached, loaded, computed) = a + d x cached + [load (+|max) (b x computed + c x computed^2)]
    load = h2d x loaded + e (e only when loaded > 0)

where a is the per-request overhead, b + c x N the prefill per computed token
(attention makes it quadratic), d what each cached token costs the extend
that attends over it (the CPU server's device hit is ~1 s at 2,048 tokens,
not zero), h2d the host-to-device load per token and e its fixed cost a
request (host hit minus device hit: on the CPU server it is mostly the fixed
part, ~6 ms whatever the prompt, which a slope alone missed by 20%).
``serial_load`` says whether the load adds to compute (one stream, the
CPU server) or overlaps it (a GPU loads layer by layer while computing).
``prefetch_s`` is the engine's own time around a storage hit query beyond
the lookup (SGLang's prefetch thread and scheduler polls), added to the
query of every L3 hit; ``hit_handoff_s`` what a query that found pages costs
on top before and after their reads (the scheduler takes the hit from the
prefetch thread, allocates host slots, hands the reads to the I/O thread,
and learns they ended from the sync thread): SGLang's storage_prefetch_wait
of an L3 hit less its transfer and its query.
A GPU preset is the same fit with a = c = d = 0 and the load overlapped
(``preset_fit``), so the planner has one formula (``TimeModel.service_s``).
"""
from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from tiers.sim.prefill import ModelShape

FORMAT = "hicache-tiers ttft profile"
VERSION = 1
CASES = ("recompute", "device", "host", "l3_dram", "l3_nvme", "l3_remote")
L3_KINDS = {"l3_dram": "dram", "l3_nvme": "nvme", "l3_remote": "remote"}
# The fit's columns, in the order ties are broken (the fewest, then the earliest, that fit as well).
COLUMNS = ("compute_s", "cached_s", "overhead_s", "compute_s2")


class ProfileError(ValueError):
    """A profile file that cannot be read or lacks what is asked of it (named in the message)."""


@dataclass(frozen=True)
class Fit:
    """Seconds of one request's service: overhead, prefill, per cached token, host-to-device per token."""

    overhead_s: float = 0.0  # a: per request
    compute_s: float = 0.0  # b: prefill per computed token
    compute_s2: float = 0.0  # c: prefill per computed token squared
    cached_s: float = 0.0  # d: per cached token (device, host or L3) the extend attends over
    h2d_s: float = 0.0  # host (L2) to device per loaded token
    serial_load: bool = False  # the load adds to compute (True) or overlaps it (False)
    load_fixed_s: float = 0.0  # e: a request's load from host, beyond h2d a token (0: none measured, a GPU preset)
    # SGLang's own time around each storage hit query, beyond the lookup itself (its prefetch thread and
    # scheduler polls): its storage_prefetch_wait on a recompute (a query that finds nothing) less the lookup
    prefetch_s: float = 0.0
    # SGLang's own time to carry an L3 hit from its query to its reads and back to the scheduler (hand-overs
    # between its prefetch, I/O and sync threads and the scheduler): an L3 hit's storage_prefetch_wait less
    # its transfer and its query, the median over the measured L3 hits
    hit_handoff_s: float = 0.0
    errors: Dict[str, float] = field(default_factory=dict)  # largest relative error per fitted case


@dataclass(frozen=True)
class ReadFit:
    """An L3 read in the measured server, per storage batch (STORAGE_BATCH_PAGES pages at most): fixed_s a
    batch + s_per_byte a byte.  Fitted to the backend's batch_get wall time the server reported (SGLang's
    prefetch metrics: `transfer` in the TTFT report), which the rig's tier rate overstates where the reads
    share the server's cores."""

    fixed_s: float = 0.0
    s_per_byte: float = 0.0
    error: float = 0.0  # rms relative error of the fit over the measured lengths


def fit_reads(transfer: Dict[int, float], hits: Dict[int, int], kv_bytes_per_token: float,
              page_tokens: int, batch_pages: int = 128) -> Optional[ReadFit]:
    """The ReadFit of one tier's measured transfers (prompt length -> seconds; hits: length -> tokens read),
    None without a usable point: the non-negative least squares of [batches, bytes] with the least error."""
    points = [(hits.get(n, 0), t) for n, t in sorted(transfer.items()) if t and t > 0 and hits.get(n, 0) > 0]
    if not points:
        return None
    rows = np.array([[-(-(tokens // page_tokens) // batch_pages), tokens * kv_bytes_per_token]
                     for tokens, _t in points], dtype=float)
    target = np.array([t for _tokens, t in points], dtype=float)
    best = _best_columns(rows, target, ((0, 1), (1,), (0,)))
    if best is None:
        return None
    return ReadFit(fixed_s=best[0][0], s_per_byte=best[0][1], error=best[1])


def service_s(model, cached: float, loaded: float, computed: float, write_s: float = 0.0) -> float:
    """Seconds of one request once admitted: the planner's one formula, for a Fit or a TimeModel (same fields).

    a + d x cached + (h2d x loaded + e) + or max (max(W x computed, b x computed + c x computed^2))."""
    load = loaded * model.h2d_s + (model.load_fixed_s if loaded > 0 else 0.0)
    compute = max(computed * write_s, computed * model.compute_s + computed * computed * model.compute_s2)
    body = load + compute if model.serial_load else max(load, compute)
    return model.overhead_s + cached * model.cached_s + body


def preset_fit(compute_s: float, h2d_s: float) -> Fit:
    """A GPU preset as a Fit: prefill linear in tokens, nothing per request or per cached token, load overlapped."""
    return Fit(compute_s=compute_s, h2d_s=h2d_s)


def _solve(rows: np.ndarray, y: np.ndarray, columns: Sequence[int],
           scale: Optional[np.ndarray] = None) -> Optional[Tuple[np.ndarray, float]]:
    """Least squares of y on the chosen columns, relative to scale (default y itself); (coefficients, rms
    relative error) or None when a coefficient comes out negative (a cost is never negative)."""
    scale = y if scale is None else scale
    a = rows[:, list(columns)] / scale[:, None]
    coef, *_ = np.linalg.lstsq(a, y / scale, rcond=None)
    if (coef < -1e-15).any():
        return None
    coef = np.clip(coef, 0.0, None)
    residual = a @ coef - y / scale
    return coef, float(np.sqrt(np.mean(residual ** 2)))


def _best_columns(rows: np.ndarray, y: np.ndarray, column_sets: Sequence[Sequence[int]],
                  scale: Optional[np.ndarray] = None) -> Optional[Tuple[List[float], float]]:
    """The non-negative _solve with the least error over column_sets, tried in order (a tie keeps the
    earlier): (a value a column of rows, 0 where unused; its error), or None when none is non-negative."""
    best = None
    for columns in column_sets:
        solved = _solve(rows, y, columns, scale)
        if solved is not None and (best is None or solved[1] < best[2] - 1e-9):
            best = (columns, solved[0], solved[1])
    if best is None:
        return None
    values = [0.0] * rows.shape[1]
    for column, value in zip(best[0], best[1]):
        values[column] = float(value)
    return values, best[2]


def fit_service(recompute: Dict[int, float], device: Dict[int, float], device_hit: Dict[int, int],
                host: Optional[Dict[int, float]] = None, host_hit: Optional[Dict[int, int]] = None,
                prefetch_s: float = 0.0, hit_handoff_s: float = 0.0) -> Fit:
    """The Fit of measured medians (prompt length -> seconds; hit: length -> cached tokens).

    Recompute rows are [1, N, N^2, 0], device-hit rows [1, n, n^2, hit] with n = N - hit computed;
    the columns are chosen by least relative error among non-negative solutions (ties: fewer columns,
    then COLUMNS order). (h2d, e) is the least-squares line of (host - device) over the host hit, its terms
    chosen the same way (_fit_load)."""
    rows, y = [], []
    for n, seconds in sorted(recompute.items()):
        rows.append({"overhead_s": 1.0, "compute_s": n, "compute_s2": float(n) * n, "cached_s": 0.0})
        y.append(seconds)
    for n, seconds in sorted(device.items()):
        hit = device_hit[n]
        rows.append({"overhead_s": 1.0, "compute_s": n - hit, "compute_s2": float(n - hit) ** 2, "cached_s": hit})
        y.append(seconds)
    if not rows:
        raise ProfileError("no recompute or device-hit figure to fit")
    matrix = np.array([[r[c] for c in COLUMNS] for r in rows], dtype=float)
    target = np.array(y, dtype=float)
    best = _best_columns(matrix, target, [columns for size in range(1, len(COLUMNS) + 1)
                                          for columns in itertools.combinations(range(len(COLUMNS)), size)])
    if best is None:
        raise ProfileError("no non-negative fit of the recompute and device-hit figures")
    values = dict(zip(COLUMNS, best[0]))
    h2d, fixed = _fit_load(host or {}, host_hit or {}, device)
    fit = Fit(h2d_s=h2d, load_fixed_s=fixed, serial_load=True, **values)
    errors = {"recompute": _max_error(fit, recompute, {}, False),
              "device": _max_error(fit, device, device_hit, False)}
    if host and host_hit:
        errors["host"] = _max_error(fit, host, host_hit, True)
    return Fit(h2d_s=h2d, load_fixed_s=fixed, serial_load=True, prefetch_s=max(prefetch_s, 0.0),
               hit_handoff_s=max(hit_handoff_s, 0.0), errors=errors, **values)


def _fit_load(host: Dict[int, float], host_hit: Dict[int, int], device: Dict[int, float]) -> Tuple[float, float]:
    """(h2d a token, fixed a request): the non-negative least squares of (host - device) on [hit, 1], relative
    to the host hit's time, with the fewer terms on a tie; (0, 0) without a host point or a non-negative fit."""
    pairs = [(host_hit[n], host[n] - device[n], host[n]) for n in sorted(host) if n in device and host_hit.get(n)]
    if not pairs:
        return 0.0, 0.0
    best = _best_columns(np.array([[hit, 1.0] for hit, _d, _s in pairs]), np.array([d for _h, d, _s in pairs]),
                         ((0,), (1,), (0, 1)), scale=np.array([s for _h, _d, s in pairs]))
    return (best[0][0], best[0][1]) if best is not None else (0.0, 0.0)


def _max_error(fit: Fit, measured: Dict[int, float], hits: Dict[int, int], loaded: bool) -> float:
    """The largest |predicted - measured| / measured over measured (loaded: the hit came from host)."""
    worst = 0.0
    for n, seconds in measured.items():
        hit = hits.get(n, 0)
        predicted = service_s(fit, hit, hit if loaded else 0, n - hit)
        worst = max(worst, abs(predicted - seconds) / seconds)
    return worst


@dataclass(frozen=True)
class Profile:
    """A measured engine: KV shape and page, the fit, and every measured case (for the check)."""

    kv_bytes_per_token: float
    page_tokens: int
    fit: Fit
    shape: ModelShape
    measured: Dict[str, Dict[int, float]] = field(default_factory=dict)  # case -> length -> seconds
    hits: Dict[str, Dict[int, int]] = field(default_factory=dict)  # case -> length -> cached tokens
    engine: Dict[str, object] = field(default_factory=dict)  # the server's pools and SGLang settings
    source: str = ""
    # tier kind -> its reads as the server measured them (the planner's L3 read time where present)
    l3_reads: Dict[str, ReadFit] = field(default_factory=dict)
    # case -> length -> (fastest, slowest) repetition: how far the median itself could move
    ranges: Dict[str, Dict[int, Tuple[float, float]]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "source": self.source,
                "kv_bytes_per_token": self.kv_bytes_per_token, "page_tokens": self.page_tokens,
                "page_bytes": self.kv_bytes_per_token * self.page_tokens, "model": asdict(self.shape),
                "engine": dict(self.engine), "fit": asdict(self.fit),
                "backend_extra_config": break_even_settings(self.fit),
                "measured_s": {case: {str(n): s for n, s in sorted(v.items())} for case, v in self.measured.items()},
                "hit_tokens": {case: {str(n): t for n, t in sorted(v.items())} for case, v in self.hits.items()},
                "l3_reads": {kind: asdict(fit) for kind, fit in sorted(self.l3_reads.items())},
                "measured_range_s": {case: {str(n): list(r) for n, r in sorted(v.items())}
                                     for case, v in self.ranges.items()}}

    @classmethod
    def from_json(cls, document: dict, path: str = "profile.json") -> "Profile":
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            raise ProfileError(f"{path}: not a {FORMAT} (hicache-tiers bench --only ttft --ttft-profile FILE)")
        try:
            fit_fields = {f.name for f in fields(Fit)}
            fit = Fit(**{k: v for k, v in document["fit"].items() if k in fit_fields})
            shape = ModelShape(**document["model"])
            measured = {case: {int(n): float(s) for n, s in v.items()}
                        for case, v in document.get("measured_s", {}).items()}
            hits = {case: {int(n): int(t) for n, t in v.items()} for case, v in document.get("hit_tokens", {}).items()}
            # absent from profiles written before it: L3 reads then go at the bench file's tier rates
            l3_reads = {str(kind): ReadFit(**{k: float(v) for k, v in fit_doc.items()})
                        for kind, fit_doc in document.get("l3_reads", {}).items()}
            # absent from profiles written before it: no case then says how far its repetitions spread
            ranges = {case: {int(n): (float(r[0]), float(r[1])) for n, r in v.items()}
                      for case, v in document.get("measured_range_s", {}).items()}
            return cls(kv_bytes_per_token=float(document["kv_bytes_per_token"]),
                       page_tokens=int(document["page_tokens"]), fit=fit, shape=shape, measured=measured,
                       hits=hits, engine=dict(document.get("engine", {})), source=str(document.get("source", "")),
                       l3_reads=l3_reads, ranges=ranges)
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"{path}: {type(exc).__name__}: {exc}") from None

    @classmethod
    def load(cls, path: str) -> "Profile":
        """Read path (ProfileError naming what is wrong; OSError when it cannot be read)."""
        with open(path, "r", encoding="utf-8") as handle:
            try:
                document = json.load(handle)
            except ValueError as exc:
                raise ProfileError(f"{path}: not JSON ({exc})") from None
        return cls.from_json(document, path)

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.to_json(), handle, indent=1)
            handle.write("\n")

    def lengths(self) -> List[int]:
        return sorted({n for v in self.measured.values() for n in v})


def break_even_settings(fit: Fit) -> Dict[str, float]:
    """The backend's break-even keys (hicache_ext/break_even.py) from the fit: a token at position n costs
    recompute_us_per_token + recompute_growth_us_per_ki_token x n / 1024 us, and summed over a prompt of N
    tokens that is b x N + c x N^2 with growth = 2048 x c."""
    return {"recompute_us_per_token": fit.compute_s * 1e6,
            "recompute_growth_us_per_ki_token": 2048 * fit.compute_s2 * 1e6}


def build_profile(measured: Dict[str, Dict[int, float]], hits: Dict[str, Dict[int, int]], shape: ModelShape,
                  page_tokens: int, engine: Optional[dict] = None, source: str = "",
                  prefetch_s: float = 0.0, transfers: Optional[Dict[str, Dict[int, float]]] = None,
                  hit_handoff_s: float = 0.0,
                  ranges: Optional[Dict[str, Dict[int, Tuple[float, float]]]] = None) -> Profile:
    """A Profile of measured medians: the fit of recompute, device and host hits, every case kept, and of each
    L3 case's transfers (case -> length -> seconds of the backend's reads) the tier's ReadFit."""
    fit = fit_service(measured.get("recompute", {}), measured.get("device", {}), hits.get("device", {}),
                      measured.get("host"), hits.get("host"), prefetch_s, hit_handoff_s)
    l3_reads = {}
    for case, transfer in (transfers or {}).items():
        read = fit_reads(transfer, hits.get(case, {}), shape.kv_bytes_per_token, page_tokens)
        if case in L3_KINDS and read is not None:
            l3_reads[L3_KINDS[case]] = read
    return Profile(kv_bytes_per_token=shape.kv_bytes_per_token, page_tokens=page_tokens, fit=fit, shape=shape,
                   measured=measured, hits=hits, engine=dict(engine or {}), source=source, l3_reads=l3_reads,
                   ranges=dict(ranges or {}))

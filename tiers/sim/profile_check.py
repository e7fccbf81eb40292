"""The planner's TTFT formula held against a profile's measured cases: predicted, measured, error.

Each case a real server measured (``hicache-tiers bench --only ttft``) is one
request at an idle engine, so the planner's TTFT = (admission - arrival) +
service has arrival = the first poll:
- recompute: service(0 cached, 0 loaded, N computed);
- device hit: service(hit, 0, N - hit); host hit: service(hit, hit, N - hit);
- L3 hit from a tier: admission after the storage hit query (one lookup per
  128-page batch, ``storage_query_s``), the engine's hand-over of the hit
  (``hit_handoff_s``) and the batches' reads at that tier's
  rate (``TimeModel.batch_read_s``: the profile's fit of the server's own
  reads of it where it has one, else the bench file's rate), cut by the
  prefetch policy (``admission``), then service(hit, hit, N - hit).
The functions are the simulator's own (tiers/sim/hierarchy.py, timing.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from tiers.sim.hierarchy import STORAGE_BATCH_PAGES, SGLangFlags, admission, storage_query_s
from tiers.sim.profile import CASES, L3_KINDS, Profile
from tiers.sim.report import text_table
from tiers.sim.timing import BenchFigures, TimeModel, time_model

TOLERANCE = 0.15  # a prediction further than this from the measured median (relative) is off


@dataclass(frozen=True)
class CheckRow:
    """One measured case and the planner's prediction of it."""

    case: str
    tokens: int
    hit: int
    measured_s: float
    predicted_s: float
    wait_s: float  # admission - arrival: the storage hit query and the reads (L3 cases)
    service_s: float
    range_s: Optional[Tuple[float, float]] = None  # the fastest and slowest repetition, where the profile has them

    @property
    def error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s

    @property
    def holds(self) -> bool:
        return abs(self.error) <= TOLERANCE

    @property
    def inside_range(self) -> bool:
        """The prediction lies between the fastest and the slowest repetition: an off case of this kind is off
        by where its median fell, within what the measurement itself spread."""
        return self.range_s is not None and self.range_s[0] <= self.predicted_s <= self.range_s[1]


def flags_of(profile: Profile) -> SGLangFlags:
    """The SGLang settings the profile's server ran with (its page size; SGLang's defaults otherwise)."""
    engine = profile.engine
    return SGLangFlags(page_size=profile.page_tokens,
                       prefetch_threshold=int(engine.get("prefetch_threshold", 256)),
                       prefetch_policy=str(engine.get("prefetch_policy", "timeout")))


def l3_wait_s(time: TimeModel, flags: SGLangFlags, tokens: int, hit: int) -> float:
    """From arrival to admission for a prompt of tokens whose first hit tokens come from the tier at depth 0."""
    page = flags.page_size
    pages, hit_pages = tokens // page, hit // page
    clock = storage_query_s(time, pages, hit_pages) + (time.hit_handoff_s if hit_pages else 0.0)
    left = hit_pages
    while left > 0:
        batch = min(left, STORAGE_BATCH_PAGES)
        clock += time.batch_read_s({0: batch * page})
        left -= batch
    return admission(flags, 0.0, clock, pages * page)


def predict(profile: Profile, case: str, tokens: int, bench: Optional[BenchFigures]) -> CheckRow:
    """The planner's TTFT of one measured case."""
    flags = flags_of(profile)
    kind = L3_KINDS.get(case)
    if kind is not None and bench is None:
        raise ValueError(f"{case} needs the tier speeds of a bench file")
    time = time_model(bench if kind else None, [kind] if kind else [], "write_through",
                      page_tokens=profile.page_tokens, profile=profile)
    hit = 0 if case == "recompute" else profile.hits.get(case, {}).get(tokens, (tokens // flags.page_size - 1)
                                                                         * flags.page_size)
    loaded = hit if case != "device" else 0
    wait = l3_wait_s(time, flags, tokens, hit) if kind else 0.0
    service = time.service_s(hit, loaded, tokens - hit)
    return CheckRow(case, tokens, hit, profile.measured[case][tokens], wait + service, wait, service,
                    profile.ranges.get(case, {}).get(tokens))


def check(profile: Profile, bench: Optional[BenchFigures]) -> List[CheckRow]:
    """Every case the profile measured (L3 cases only with a bench file), in CASES order then by length."""
    rows = []
    for case in CASES:
        if case in L3_KINDS and bench is None:
            continue
        for tokens in sorted(profile.measured.get(case, {})):
            rows.append(predict(profile, case, tokens, bench))
    return rows


def table(rows: List[CheckRow]) -> str:
    header = ["case", "tokens", "cached", "measured ms", "repetitions ms", "predicted ms", "error",
              f"within {TOLERANCE:.0%}", "L3 wait ms", "service ms"]
    lines = [[r.case, f"{r.tokens:,}", f"{r.hit:,}", f"{r.measured_s * 1e3:,.1f}", _range(r),
              f"{r.predicted_s * 1e3:,.1f}", f"{r.error:+.1%}",
              "yes" if r.holds else ("NO, inside the repetitions" if r.inside_range else "NO"),
              f"{r.wait_s * 1e3:,.1f}", f"{r.service_s * 1e3:,.1f}"]
             for r in rows]
    return text_table(header, lines)


def _range(row: CheckRow) -> str:
    return "-" if row.range_s is None else f"{row.range_s[0] * 1e3:,.1f}–{row.range_s[1] * 1e3:,.1f}"


def summary(rows: List[CheckRow]) -> str:
    """How many cases hold, and of those off, how many are predicted within their own repetitions."""
    off = [r for r in rows if not r.holds]
    text = f"{len(rows) - len(off)} of {len(rows)} cases within {TOLERANCE:.0%}"
    inside = [r for r in off if r.inside_range]
    if inside:
        text += (f"; of the {len(off)} off, {len(inside)} predicted between the fastest and the slowest of their "
                 f"repetitions ({', '.join(f'{r.case} {r.tokens:,}' for r in inside)}): their medians are off by "
                 "less than the measurement spread")
    return text


def fit_summary(profile: Profile) -> str:
    """The profile's fit in one paragraph (microseconds a token, milliseconds a request)."""
    f = profile.fit
    errors = ", ".join(f"{case} {err:.1%}" for case, err in f.errors.items())
    reads = "; ".join(f"{kind} {r.fixed_s * 1e3:.2f} ms a batch + {1e-9 / r.s_per_byte if r.s_per_byte else 0:.2f} GB/s "
                      f"(fit error {r.error:.1%})" for kind, r in sorted(profile.l3_reads.items()))
    return (f"fit: {f.overhead_s * 1e3:.1f} ms a request + {f.compute_s * 1e6:.1f} us x computed + "
            f"{f.compute_s2 * 1e9:.3f} ns x computed^2 + {f.cached_s * 1e6:.2f} us x cached + "
            f"{f.h2d_s * 1e6:.2f} us x loaded + {f.load_fixed_s * 1e3:.1f} ms a load "
            f"({'added to' if f.serial_load else 'overlapping'} compute); "
            f"{f.prefetch_s * 1e3:.1f} ms around each storage hit query, "
            f"{f.hit_handoff_s * 1e3:.1f} ms to hand an L3 hit over to its reads and back; "
            f"largest fit error: {errors or '-'}; {profile.kv_bytes_per_token / 1024:g} KiB of KV a token, "
            f"{profile.page_tokens}-token pages"
            + (f"; L3 reads as the server measured them (used instead of the bench file's rates): {reads}"
               if reads else ""))

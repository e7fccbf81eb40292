#!/usr/bin/env python3
"""What the last step of an L3 hit costs on a GPU: host pool -> device, page by page.

An L3 hit ends with SGLang copying the pages our backend wrote into its host
pool onto the GPU.  `hicache-tiers plan` takes that rate from a preset
(tiers/sim/timing.py GPU_PRESETS: datasheet PCIe figures).  This script
measures it on the GPU at hand, for the host memory our backend makes SGLang
use: with ``"allocator": "shm"`` the host pool is a memfd mapped MAP_SHARED,
which SGLang pins with cudaHostRegister; without it, a pinned torch tensor.
A pageable mapping (never registered) is measured too: what a pool that could
not be pinned would cost.

For each page size, a batch of --pages pages goes host -> device one
cudaMemcpyAsync a page (what a page-first pool's per-page transfer amounts
to; issued from Python, ~10 us a call, which bounds small pages), and
device -> host (a backup); and the batch as one copy (the link's own rate,
what a transfer kernel moving many pages at once approaches); medians of
--repeat, CUDA events.  Also a
bf16 matrix product (the compute side of the planner's preset).  Needs torch
with CUDA; nothing of this project is imported.  Prints a table and writes
--json.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time

SIZES = "64KiB,256KiB,1MiB,4MiB,8MiB"


def parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(text[:-len(unit)]) * factor
    return int(text)


class HostBuffer:
    """Host memory of one kind: 'shm' (memfd, MAP_SHARED, cudaHostRegister'd, as SGLang pins an shm pool),
    'pinned' (torch pin_memory) or 'pageable' (a memfd mapping never registered)."""

    def __init__(self, torch, kind: str, nbytes: int):
        self.kind, self.torch, self._registered = kind, torch, None
        if kind == "pinned":
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self._map = None
            return
        fd = os.memfd_create(f"h2d-{kind}")
        os.ftruncate(fd, nbytes)
        self._map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.tensor.fill_(1)  # faulted in: cudaHostRegister pins resident pages
        if kind == "shm":
            err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister failed: {err}")
            self._registered = self.tensor.data_ptr()

    def close(self) -> None:
        if self._registered is not None:
            self.torch.cuda.cudart().cudaHostUnregister(self._registered)
        del self.tensor
        if self._map is not None:
            self._map.close()


def time_copies(torch, dst, src, page: int, pages: int, repeat: int, whole: bool = False) -> float:
    """Median seconds to copy pages pages of page bytes from src to dst, one async copy a page (whole: one
    copy of the batch, the link's own rate)."""
    stream = torch.cuda.current_stream()
    times = []
    views = ([(dst[:page * pages], src[:page * pages])] if whole else
             [(dst[i * page:(i + 1) * page], src[i * page:(i + 1) * page]) for i in range(pages)])
    for _ in range(repeat + 1):  # the first is a warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for to, frm in views:
            to.copy_(frm, non_blocking=True)
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[1:])


def matmul_tflops(torch, n: int = 8192, repeat: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        a @ b
    torch.cuda.synchronize()
    return 2 * n ** 3 * repeat / (time.perf_counter() - start) / 1e12


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--page-sizes", default=SIZES, help=f"page sizes, comma-separated (default {SIZES})")
    parser.add_argument("--pages", type=int, default=128, help="pages a batch (default 128; at most 1 GiB a batch)")
    parser.add_argument("--repeat", type=int, default=5, help="timed batches a case; figures are medians (default 5)")
    parser.add_argument("--kinds", default="shm,pinned,pageable", help="host memory kinds (default shm,pinned,pageable)")
    parser.add_argument("--json", metavar="FILE", help="write the figures here")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("gpu_h2d: torch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu_h2d: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        return 2
    sizes = [parse_size(s) for s in args.page_sizes.split(",")]
    kinds = args.kinds.split(",")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "pages": args.pages,
           "repeat": args.repeat, "bf16_matmul_tflops": round(matmul_tflops(torch), 1), "cases": []}
    print(f"{out['device']}: bf16 8192^3 matrix product {out['bf16_matmul_tflops']} TFLOP/s")
    print(f"{'page':>8} {'host':>9} {'H2D GB/s':>9} {'D2H GB/s':>9} {'H2D one copy':>13}")
    for page in sizes:
        pages = max(1, min(args.pages, (1 << 30) // page))
        nbytes = page * pages
        device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        for kind in kinds:
            host = HostBuffer(torch, kind, nbytes)
            try:
                h2d = time_copies(torch, device, host.tensor, page, pages, args.repeat)
                d2h = time_copies(torch, host.tensor, device, page, pages, args.repeat)
                whole = time_copies(torch, device, host.tensor, page, pages, args.repeat, whole=True)
            finally:
                host.close()
            case = {"page_bytes": page, "pages": pages, "host": kind,
                    "h2d_gbps": round(nbytes / h2d / 1e9, 2), "d2h_gbps": round(nbytes / d2h / 1e9, 2),
                    "h2d_one_copy_gbps": round(nbytes / whole / 1e9, 2)}
            out["cases"].append(case)
            print(f"{page >> 10:>6}Ki {kind:>9} {case['h2d_gbps']:>9} {case['d2h_gbps']:>9} "
                  f"{case['h2d_one_copy_gbps']:>13}", flush=True)
        del device
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The 64-byte ZeroMQ round trip to another process, ipc and tcp: the floor under any lookup.

Needs neither torch nor SGLang (a run of this part alone starts in a second, not ten).
"""
from __future__ import annotations

import os

from tiers.bench import limits
from tiers.bench.stats import Figures, Progress, percentile
from tiers.stores.remote.loopback import free_ports


def run_zmq(figs: Figures, args, progress: Progress) -> None:
    calls = 500 if args.quick else 2000
    for transport, endpoint in (("ipc", f"ipc://{os.path.join(args.work_dir, 'echo.sock')}"),
                                ("tcp", "tcp://127.0.0.1:%d" % free_ports(1)[0])):
        progress.step(f"zmq: {transport} round trips")
        os.makedirs(args.work_dir, exist_ok=True)
        samples = limits.zmq_round_trips(endpoint, calls)
        figs.set(f"limit.zmq_rtt.{transport}.p50", percentile(samples, 50) * 1e6, "us")
        figs.set(f"limit.zmq_rtt.{transport}.p99", percentile(samples, 99) * 1e6, "us")

"""The peers on the same pages through the same SGLang page functions: the ``file`` and ``mooncake`` backends."""
from __future__ import annotations

import gc
import os
import shutil
import subprocess
import time

from hicache_ext.lab.bench.project import measure
from hicache_ext.lab.bench.rig import MiB, Rank
from tiers.bench.stats import Figures, Progress, size_label
from tiers.ops.node_runner import stop_process
from tiers.stores.remote.loopback import free_ports


def run_file(figs: Figures, args, progress: Progress, size: int) -> None:
    """SGLang's built-in ``file`` backend (legacy flat pages), files on the same disk as the NVMe tier."""
    path = os.path.join(args.work_dir, "sglang-file")
    shutil.rmtree(path, ignore_errors=True)
    rank = Rank("file", size, args.pages, {"file_storage_path": path}, allocator="default")
    try:
        measure(rank, figs, f"file.{size_label(size)}", args.repeat, progress, salt=5000, cold_dir=path, warm=True)
    finally:
        rank.close()
        shutil.rmtree(path, ignore_errors=True)


def run_mooncake(figs: Figures, args, progress: Progress, size: int) -> None:
    """SGLang's built-in ``mooncake`` backend (zero-copy v1) against a local mooncake_master, over TCP."""
    master = shutil.which("mooncake_master")
    if master is None:
        figs.note("mooncake", "mooncake_master is not installed: the Mooncake Store peer did not run.")
        return
    rpc, metrics = free_ports(2)
    log_path = os.path.join(args.work_dir, "mooncake_master.log")
    os.makedirs(args.work_dir, exist_ok=True)
    log = open(log_path, "wb")
    proc = subprocess.Popen([master, "--rpc_address=127.0.0.1", f"--rpc_port={rpc}", "--metrics_host=127.0.0.1",
                             f"--metrics_port={metrics}", "--enable_metric_reporting=false"],
                            stdout=log, stderr=log, env={**os.environ, "MC_FORCE_TCP": "1"})
    os.environ["MC_FORCE_TCP"] = "1"
    rank = None
    try:
        time.sleep(1.0)
        # The backend's clear() removes nothing from the store: room for every repetition's pages.
        segment = (args.repeat + 1) * args.pages * size + 256 * MiB
        extra = {"master_server_address": f"127.0.0.1:{rpc}", "protocol": "tcp", "metadata_server": "P2PHANDSHAKE",
                 "global_segment_size": segment, "local_hostname": "127.0.0.1", "check_server": False,
                 "device_name": ""}
        try:
            rank = Rank("mooncake", size, args.pages, extra, allocator="default")
        except Exception as exc:  # a peer that cannot start here is reported, not a failure of ours
            figs.note("mooncake", f"SGLang's mooncake backend could not start: {type(exc).__name__}: {exc}")
            return
        measure(rank, figs, f"mooncake.{size_label(size)}", args.repeat, progress, salt=6000)
    finally:
        if rank is not None:  # unmount the segment while the master is still there
            rank.close()
            del rank
            gc.collect()
        stop_process(proc)
        log.close()

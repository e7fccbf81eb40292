"""Diagnostic: a timeline of SGLang's HiCache steps in the server, one line per step that took time.

Set HICACHE_TRACE_FILE=/path in the server's environment; the test plug-in then wraps the scheduler's,
the cache controller's and the radix cache's steps and appends "<unix time> <pid> <thread> <step> <ms>" lines
(steps under MIN_MS are left out, so idle loop iterations do not flood the file; the steps in ALWAYS are not,
so each request's arrival and each backend call mark the timeline).
"""
import functools
import os
import threading
import time

MIN_MS = 0.3
ALWAYS = {"Scheduler.handle_generate_request", "TieredHiCacheStorage.batch_exists", "TieredHiCacheStorage.batch_get_v1",
          "InProcessMemoryStorage.batch_exists", "InProcessMemoryStorage.batch_get_v1", "HiCacheController.prefetch",
          "HiCacheController.start_loading"}

_STEPS = {
    "sglang.srt.managers.scheduler:Scheduler": ("handle_generate_request", "get_next_batch_to_run", "run_batch",
                                               "process_batch_result"),
    "sglang.srt.managers.cache_controller:HiCacheController": (
        "prefetch", "_storage_hit_query", "_sync_prefetch_hit_query", "alloc_prefetch_host_buffers",
        "_page_transfer_kv_batch", "_reduce_prefetch_ack", "terminate_prefetch", "load", "start_loading", "write",
        "write_storage"),
    "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache": (
        "prefetch_from_storage", "check_prefetch_progress", "load_back", "init_load_back",
        "drain_storage_control_queues", "check_hicache_events", "ready_to_load_host_cache", "match_prefix",
        "insert", "evict", "write_backup_storage", "writing_check", "loading_check", "_handle_prefetch_result",
        "_finish_storage_prefetch", "cache_finished_req", "cache_unfinished_req"),
    "sglang.srt.model_executor.model_runner:ModelRunner": ("forward",),
    "sglang.srt.mem_cache.pool_host.base:HostKVCache": ("alloc", "free"),
    "hicache_ext.backend:TieredHiCacheStorage": ("batch_exists", "batch_get_v1", "batch_set_v1"),
    "tiers.wire.client:TierClient": ("call", "get_leased"),
    "tiers.wire.arena_map:ArenaMap": ("copy_out",),
    "hicache_ext.lab.bench.memory_backend:InProcessMemoryStorage": ("batch_exists", "batch_get_v1"),
    "hicache_ext.page_sums:ReadChecks": ("verify",),
}


def _timed(method, name, out):
    @functools.wraps(method)
    def timed(*args, **kwargs):
        start = time.time()
        try:
            return method(*args, **kwargs)
        finally:
            ms = (time.time() - start) * 1e3
            if ms >= MIN_MS or name in ALWAYS:
                out.write(f"{start:.6f} {os.getpid()} {threading.current_thread().name} {name} {ms:.2f}\n")
    timed._hicache_traced = True
    return timed


def install():
    interval = os.environ.get("HICACHE_SWITCH_INTERVAL")  # diagnostic: does GIL hand-over latency matter?
    if interval:
        import sys
        sys.setswitchinterval(float(interval))
    path = os.environ.get("HICACHE_TRACE_FILE")
    if not path:
        return
    import importlib
    out = open(path, "a", buffering=1)
    for where, steps in _STEPS.items():
        module, cls_name = where.split(":")
        cls = getattr(importlib.import_module(module), cls_name)
        for step in steps:
            method = getattr(cls, step, None)
            if method is None or getattr(method, "_hicache_traced", False):
                continue
            setattr(cls, step, _timed(method, f"{cls_name}.{step}", out))


def install_profile():
    """HICACHE_PROFILE_FILE=/path: cProfile every call of HICACHE_PROFILE_METHOD (module:Class.method,
    default ModelRunner.forward) after the first HICACHE_PROFILE_SKIP calls; the stats of all dumped to path."""
    path = os.environ.get("HICACHE_PROFILE_FILE")
    if not path:
        return
    import cProfile
    import importlib
    target = os.environ.get("HICACHE_PROFILE_METHOD", "sglang.srt.model_executor.model_runner:ModelRunner.forward")
    module, qualified = target.split(":")
    cls_name, name = qualified.split(".")
    cls = getattr(importlib.import_module(module), cls_name)
    profile = cProfile.Profile()
    method = getattr(cls, name)
    skip = [int(os.environ.get("HICACHE_PROFILE_SKIP", "0"))]

    @functools.wraps(method)
    def profiled(*args, **kwargs):
        if skip[0] > 0:
            skip[0] -= 1
            return method(*args, **kwargs)
        profile.enable()
        try:
            return method(*args, **kwargs)
        finally:
            profile.disable()
            profile.dump_stats(path)  # after every call: the server ends by a signal, no exit hook runs
    setattr(cls, name, profiled)

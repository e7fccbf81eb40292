"""Hits that pay, on the real server: a tier slower than recompute stops giving hits, and TTFT does not rise.

A real ``sglang.launch_server`` on this CPU serves a random Llama from a node
whose only tier is NVMe, with the break-even rule on (recompute_us_per_token).
The NVMe daemon's disk is then made slow: a blkio read throttle on its disk
for the daemon's cgroup (tests/support/slow_disk.py, 8 MB/s: 63 pages of
32 KiB take ~0.26 s to read, five times their recompute), while its lookups,
answered from memory, stay quick: the tier is slow, not down, and no hook in
the product says so.  Where no blkio hierarchy can be written, a thread
freezes the daemon most of the time instead (SIGSTOP 100 ms, SIGCONT 0.5 ms);
that slows its lookups too, and on a loaded machine they can time out, so it
is the fallback, not the rule.  The first read from the slow tier costs what
users of other backends see every time (TTFT above recompute); it measured
the tier, so from then on the backend reports none of its pages and SGLang
recomputes: TTFT back at the recompute time, the same tokens.  Once the tier
is fast again and its slow speed went stale, L3 hits return.
"""
import os
import signal
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("uvicorn", reason="the SGLang HTTP server's packages are not installed (scripts/install.sh)")

from hicache_ext.lab.server import ModelSpec, ServerOptions, SGLangServer, random_llama  # noqa: E402
from tests.support.nodes import eventually, node_toml, nvme_tier, start_node, thaw  # noqa: E402
from tests.support.slow_disk import SlowDisk  # noqa: E402

pytestmark = pytest.mark.server

PROMPT_TOKENS = 1024
PAGE = 16


class DutyCycle:
    """Freeze a process most of the time: stopped `stop_s`, running `run_s`, until close()."""

    def __init__(self, pid: int, stop_s: float = 0.1, run_s: float = 0.0005):
        self.pid, self.stop_s, self.run_s = pid, stop_s, run_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._done.is_set():
            os.kill(self.pid, signal.SIGSTOP)
            self._done.wait(self.stop_s)
            os.kill(self.pid, signal.SIGCONT)
            self._done.wait(self.run_s)

    def close(self):
        self._done.set()
        self._thread.join()
        thaw(self.pid)


def nvme_pages(runner) -> int:
    from tiers.wire.client import TierClient
    client = TierClient("nvme", runner.config.tiers[0].endpoint, "_probe")
    try:
        return (client.stats() or {}).get("pages", 0)
    finally:
        client.close()


def test_a_slow_tier_stops_giving_hits_and_ttft_stays_at_recompute(tmp_path):
    import random
    spec = ModelSpec()
    model = random_llama(spec, tmp_path / "models")
    runner = start_node(tmp_path / "node", node_toml(nvme_tier("256MiB", fsync=False, staging_bytes="64MiB"), write_policy="write_through"))
    # A page of 16 tokens costs 0.8 ms to recompute at 50 us a token. Unhindered, NVMe reads a 32 KiB
    # page here in ~0.1-0.2 ms; at 8 MB/s in ~4 ms; duty-cycled, a batch of 63 pages takes > 100 ms.
    options = ServerOptions(model=model, node_config=Path(runner.config_path), runtime_dir=Path(runner.runtime_dir),
                            max_total_tokens=2048,
                            extra_config={"recompute_us_per_token": 50, "read_speed_stale_s": 15.0})
    server = SGLangServer(options, tmp_path / "server.log")
    rng = random.Random(7)
    prompt = [rng.randrange(1, spec.vocab) for _ in range(PROMPT_TOKENS)]
    held = (PROMPT_TOKENS // PAGE - 1) * PAGE
    throttle = None
    try:
        server.start()
        cold = server.generate(prompt, 8)
        assert cold.cached_total == 0
        assert eventually(lambda: nvme_pages(runner) >= held // PAGE, 30), "the backup never reached NVMe"
        # Recompute time, warm: a prompt of the same length that nothing holds.
        recompute = server.generate([rng.randrange(1, spec.vocab) for _ in range(PROMPT_TOKENS)], 8)
        assert recompute.cached_total == 0
        server.flush_cache()

        hit = server.generate(prompt, 8)  # NVMe's speed is not known yet: its pages count, and it is measured
        assert hit.cached["storage"] == held and hit.output_ids == cold.output_ids

        unthrottled = SlowDisk.unavailable(runner.data_dir)
        throttle = (SlowDisk(runner.pid("nvme"), runner.data_dir, read_bps=8_000_000) if unthrottled is None
                    else DutyCycle(runner.pid("nvme")))
        server.flush_cache()
        probe = server.generate(prompt, 8)  # the last measurement said fast: this read finds it slow
        assert probe.output_ids == cold.output_ids
        # Within read_speed_stale_s of the probe the slow speed stands.  A probe read that outlasts its
        # deadline (the duty cycle on a loaded machine) takes the tier down until its hello answers, and
        # counts as the slowest read of all.  Either way no request gets hits, and once the tier answers
        # the rule is what cuts them: the backend says so (not a lookup that timed out).
        after = []
        until = time.monotonic() + 10
        while len(after) < 2 or "slower than recomputing them" not in server.log_tail(400):
            assert time.monotonic() < until, "the break-even rule never cut the slow tier's hits"
            server.flush_cache()
            g = server.generate(prompt, 8)
            assert g.cached["storage"] == 0, f"a tier slower than recompute still gave hits: {g.cached}"
            assert g.output_ids == cold.output_ids
            after.append(g)
        # Against recompute measured before and after them (a busy machine moves one sample by 10x).
        again = server.generate([rng.randrange(1, spec.vocab) for _ in range(PROMPT_TOKENS)], 8)
        assert again.cached_total == 0
        recomputed = max(recompute.seconds, again.seconds)
        ttft_after = min(g.seconds for g in after)
        assert ttft_after < 1.5 * recomputed + 0.2, (
            f"TTFT rose with a slow tier: {ttft_after:.3f} s against {recomputed:.3f} s recomputed "
            f"(the probe read took {probe.seconds:.3f} s)")

        throttle.close()
        throttle = None

        def hits_again():
            server.flush_cache()
            return server.generate(prompt, 8)
        # The slow speed goes stale after read_speed_stale_s: poll until the pages count again.
        back = eventually(lambda: hits_again().cached["storage"] == held, 60, step=0.5)
        assert back, "L3 hits did not come back once the tier was fast again"
    finally:
        if throttle is not None:
            throttle.close()
        server.stop()
        runner.stop()

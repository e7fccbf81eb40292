"""Load, short: eight clients of mixed lookups, reads and writes for a few seconds (scripts/load.py runs 60 s)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_eight_clients_mixed_load_is_correct_and_does_not_leak(tmp_path):
    out = tmp_path / "load.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "load.py"), "--seconds", "5",
                           "--json", str(out), "--workdir", str(tmp_path / "work")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.exists(), proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    print(f"\nload 5 s: {summary['ops_per_second']} ops/s, latency {summary['latency']}, "
          f"RSS growth {summary['rss_growth_after_warmup_mib']} MiB")
    assert summary["clients"] == 8
    assert summary["wrong_pages"] == 0
    assert summary["ops"] > 500 and all(n > 0 for n in summary["ops_per_second"])
    assert summary["failed_ops"] <= summary["ops"] // 20  # timeouts on a loaded 2-core machine, not errors
    assert not summary["leak"], summary["rss_growth_after_warmup_mib"]
    assert summary["tier_stats"]["dram"]["evictions"] > 0  # the working set is larger than the DRAM tier
    assert proc.returncode == 0

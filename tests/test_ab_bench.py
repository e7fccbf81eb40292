"""scripts/ab_bench.py: two source trees through the real `hicache-tiers bench`, runs alternated, samples pooled."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "ab_bench.py")


def test_two_trees_alternate_and_pool_every_sample():
    """The same tree twice (the bench's ZeroMQ round trips, the quickest part): each tree's median is over
    every run's samples, and the later tree is said as a ratio to the first."""
    out = subprocess.run([sys.executable, SCRIPT, "--trees", f"{ROOT},{ROOT}/", "--only", "zmq", "--repeat", "1",
                          "--runs", "2", "--figures", r"zmq_rtt\.ipc\.p50"], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert sum("run 1/2" in line for line in lines) == 2 and sum("run 2/2" in line for line in lines) == 2
    rows = [line for line in lines if line.startswith("| limit.zmq_rtt.ipc.p50 ")]
    assert len(rows) == 1, out.stdout
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[1].endswith("(n=2)") and cells[2].endswith("(n=2)")  # one sample a run, two runs a tree
    assert float(cells[3]) > 0


def test_a_failing_run_is_a_message_not_a_traceback(tmp_path):
    bad = subprocess.run([sys.executable, SCRIPT, "--trees", f"{ROOT},{tmp_path}"], capture_output=True,
                         text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and "two or more source trees" in bad.stderr and "Traceback" not in bad.stderr
    fails = subprocess.run([sys.executable, SCRIPT, "--trees", f"{ROOT},{ROOT}", "--only", "nothing", "--runs", "1"],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert fails.returncode == 1 and "ab_bench: bench from" in fails.stderr and "Traceback" not in fails.stderr

"""The main job runs end to end: `hicache-tiers demo` starts daemons, moves real SGLang pages, verifies them."""
import subprocess
import sys

import pytest

from tests.support.nodes import dram_tier, node_toml, nvme_tier

ENGINE_SIDE = True  # runs the SGLang backend in a subprocess (tests/conftest.py)

SMALL_NODE = node_toml(dram_tier("32MiB", block_size="64KiB"), nvme_tier(fsync=True))


def test_demo_moves_and_verifies_pages(tmp_path):
    config = tmp_path / "node.toml"
    config.write_text(SMALL_NODE)
    cmd = [sys.executable, "-m", "tiers.cli", "demo", "--config", str(config), "--pages", "12", "--repeat", "2",
           "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--page-tokens", "16",
           "--runtime-dir", str(tmp_path / "run"), "--data-dir", str(tmp_path / "data")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "round 2/2: wrote 12, hits 12, read 12 pages" in out
    assert "wrong pages: 0" in out and "demo: OK" in out
    # write_back, the default: acknowledged in DRAM, and the demo says what that figure measured.
    assert "tier dram: 24 pages" in out and "(write_back, the default by measurement" in out


@pytest.mark.server
def test_demo_server_serves_a_shared_prefix_from_each_tier(tmp_path):
    """`hicache-tiers demo --server`, as the README shows it: a real SGLang server, hits from device and L3."""
    pytest.importorskip("uvicorn", reason="the SGLang HTTP server's packages are not installed (scripts/install.sh)")
    cmd = [sys.executable, "-m", "tiers.cli", "demo", "--server", "--requests", "2", "--prefix-tokens", "512",
           "--suffix-tokens", "16", "--model-layers", "2", "--model-hidden", "128"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert "the same tokens in every round: yes" in out
    assert "the first request after each flush read its prefix from L3: yes" in out
    # 528 tokens of 16-token pages: 32 pages cached at most (the last token is always computed), and the
    # first request after a flush reads all of them from L3, first from DRAM, then from NVMe once DRAM
    # restarted empty (its graceful stop wrote its write_back pages down).
    assert "L3 (dram)" in out and "L3 (dram restarted empty)" in out
    served = [line for line in out.splitlines() if "pages served by each tier" not in line and "median" in line]
    assert served[1].endswith("dram 32, nvme 0") and served[2].endswith("dram 0, nvme 32"), "\n".join(served)

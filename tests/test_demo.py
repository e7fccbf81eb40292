"""The main job runs end to end: `hicache-tiers demo` starts daemons, moves real SGLang pages, verifies them."""
import subprocess
import sys

from tests.nodes import dram_tier, node_toml, nvme_tier

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

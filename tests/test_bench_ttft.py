"""`hicache-tiers bench --only ttft --quick`: a real SGLang server on CPU, every case's row, the sources SGLang
reports, the report's section and a profile that `plan` takes."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from tiers.cli import main  # noqa: E402
from tiers.sim.profile import Profile  # noqa: E402

# The test-only SGLang plug-in that shrinks HiCache's 10 GiB host-memory reserve (a shared 24 GiB test
# machine often has less free): on the server's PYTHONPATH when the checkout has it.
PLUGIN_DIR = Path(__file__).resolve().parent / "server_plugin"
pytestmark = pytest.mark.server

CASES = ("recompute", "device", "host", "l3_dram")


@pytest.fixture
def small_reserve(monkeypatch):
    """The rig's in-process host pools and the server's, under the same small reserve."""
    from sglang.srt.mem_cache.pool_host import base
    monkeypatch.setattr(base, "HICACHE_HOST_MEMORY_RESERVE_BYTES", 256 << 20)
    if PLUGIN_DIR.is_dir():
        path = [str(PLUGIN_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))


def test_quick_ttft_rows_sources_report_and_a_profile_plan_takes(tmp_path, small_reserve, capsys):
    out, data, prof = tmp_path / "B.md", tmp_path / "b.json", tmp_path / "profile.json"
    code = main(["bench", "--only", "ttft", "--quick", "--ttft-tiers", "dram", "--work-dir", str(tmp_path / "work"),
                 "--out", str(out), "--json", str(data), "--ttft-profile", str(prof), "--quiet"])
    document = json.loads(data.read_text())
    assert code == 0, document["failures"]
    figures = document["figures"]
    for case in CASES:
        assert figures[f"ttft.{case}.512"]["median"] > 0
        assert figures[f"ttft.{case}.512.source_ok"]["samples"] == [1.0], document["notes"]
    # where SGLang says each hit came from: 31 pages of 16 tokens (the 32nd holds the token it computes)
    assert figures["ttft.device.512.cached.device"]["median"] == 496
    assert figures["ttft.host.512.cached.host"]["median"] == 496
    assert figures["ttft.l3_dram.512.cached.storage"]["median"] == 496
    assert figures["ttft.l3_dram.512.served.dram"]["median"] >= 31
    assert figures["ttft.recompute.512.cached.storage"]["median"] == 0
    assert figures["dram.32KiB.read"]["median"] > 0  # the tier's rate at the model's page size, this run
    # each host and L3 hit paired with the device hit of the same prompt right after it
    for case in ("host", "l3_dram", "l3_memory"):
        assert len(figures[f"ttft.{case}.512.added"]["samples"]) == 1
        assert figures[f"ttft.{case}.512.device_after"]["median"] > 0
    # the reference a quick run has: the in-process memory backend (the floor) served the same kind of hit
    # from storage; SGLang's file backend (one more server start) is for full runs
    assert figures["ttft.l3_memory.512.source_ok"]["samples"] == [1.0], document["notes"]
    assert figures["ttft.l3_memory.512.sglang.storage_prefetch_wait"]["median"] > 0
    assert "ttft.l3_file.512" not in figures and "file backend is left out" in json.dumps(document["notes"])
    text = out.read_text()
    assert "## Time to first token" in text and "| 512 |" in text and "| DRAM | 512 |" in text
    assert "L3 from SGLang's in-process memory (floor)" in text
    profile = Profile.load(str(prof))
    assert profile.page_tokens == 16 and profile.kv_bytes_per_token == 2048 and profile.lengths() == [512]
    assert profile.fit.compute_s > 0 and set(profile.measured) == set(CASES)
    # each case's repetitions kept (the check says where a prediction falls among them), and the hand-over
    # of an L3 hit between SGLang's threads measured from its own prefetch wait, transfer and query
    low, high = profile.ranges["l3_dram"][512]
    assert low <= profile.measured["l3_dram"][512] <= high
    assert 0 <= profile.fit.hit_handoff_s < figures["ttft.l3_dram.512.sglang.storage_prefetch_wait"]["median"]
    # the profile and the run's figures feed the planner: its check and a plan over a trace
    assert main(["plan", "--bench", str(data), "--profile", str(prof), "--check-profile"]) in (0, 1)
    printed = capsys.readouterr().out
    assert all(case in printed for case in CASES) and "cases within 15%" in printed
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i * 100, "input_length": 1024, "hash_ids": [1, 2 + i % 3]}) + "\n"
                             for i in range(20)))
    assert main(["plan", str(trace), "--bench", str(data), "--profile", str(prof), "--dram-gb", "0,0.01",
                 "--nvme-gb", "0", "--no-settings", "--quiet", "--parallel", "1"]) == 0

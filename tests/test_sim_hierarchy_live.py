"""The whole-hierarchy simulator's L3 calls made for real: a fresh DRAM daemon answers every storage hit
query as the simulated tier did, for built-in policies and for a user's policy in a file of its own."""
from __future__ import annotations

import json
import os

import pytest

from tests.support.sim import shared_prefix_trace, write_trace_jsonl
from tiers.sim.hierarchy import EngineSettings, SGLangFlags, node_settings, simulate
from tiers.sim.node_tiers import TierSpec
from tiers.sim.timing import TimeModel

pytestmark = pytest.mark.slow  # SGLang's import and a daemon per case

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLRU = os.path.join(ROOT, "scripts", "examples", "slru_policy.py") + ":SLRUPolicy"
FREE = TimeModel(compute_s=1e-4, h2d_s=0.0, tier_read_s=(0.0,), write_s=0.0, page_tokens=16)
L3_BLOCKS = 120  # the trace has 895 distinct blocks: the tier evicts all along


def recorded_ops(policy, write_policy="write_through"):
    engine = EngineSettings(device_tokens=30 * 16, host_tokens=45 * 16,
                            flags=SGLangFlags(page_size=16, prefetch_threshold=16, write_policy=write_policy))
    result = simulate(shared_prefix_trace(), engine, node_settings([TierSpec("dram", L3_BLOCKS, policy)]), FREE,
                      record_ops=True)
    return result


@pytest.mark.parametrize("policy,write_policy", [("lru", "write_through"), ("s3fifo", "write_through"),
                                                 ("radix-lru", "write_through"), ("lfu", "write_back"),
                                                 (SLRU, "write_through")])
def test_daemon_answers_the_simulated_l3_calls(policy, write_policy):
    from hicache_ext.lab import live_ops
    result = recorded_ops(policy, write_policy)
    kinds = [op[0] for op in result.ops]
    assert kinds.count("get") > 10 and kinds.count("set") > 50  # a stream with reads, writes and evictions
    check = live_ops.check_against_dram_node(result.ops, policy, L3_BLOCKS)
    simulated = result.counters["l3"]["tiers"][0]
    assert check.lookups == kinds.count("exists") and check.mismatches == 0, check.first_mismatch
    assert check.live_hit_blocks == check.sim_hit_blocks > 0
    assert check.daemon == {k: simulated[k] for k in ("hits", "inserts", "evictions")}
    assert simulated["evictions"] > 0


def test_a_policy_file_is_refused_with_a_reason(tmp_path):
    from tiers.ops.config import ConfigError, load_config
    config = tmp_path / "node.toml"
    for policy, reason in (("slru_policy.py:SLRUPolicy", "absolute path"), (f"{tmp_path}/none.py:X", "no file"),
                           (SLRU.replace("SLRUPolicy", "Missing"), "has no attribute")):
        config.write_text(f'[[tiers]]\nname = "dram"\nkind = "dram"\ncapacity = 1048576\npolicy = "{policy}"\n')
        with pytest.raises(ConfigError, match=reason):
            load_config(str(config))


def test_plan_cli_live_check_and_outputs(tmp_path, capsys):
    """The command's own entry point (what `hicache-tiers` runs), in this process: a child of its own would
    import SGLang again for the live check (~10 s of CPU)."""
    from tiers.cli import main
    trace_path = write_trace_jsonl(tmp_path / "trace.jsonl", shared_prefix_trace())
    block_gb = 16 * 128 * 1024 / 1e9  # 16-token blocks of Llama-3-8B
    out = tmp_path / "plan.json"
    argv = ["plan", str(trace_path), "--bench", os.path.join(ROOT, "docs", "bench.json"),
            "--block-tokens", "16", "--page-size", "16", "--prefetch-threshold", "16",
            "--device-gb", str(30 * block_gb), "--dram-gb", f"0,{L3_BLOCKS * block_gb}", "--nvme-gb", f"0,{900 * block_gb}",
            "--settings-at", f"{L3_BLOCKS * block_gb},0,0", "--live", "--policy", SLRU, "--quiet", "--parallel", "2",
            "--json", str(out), "--csv", str(tmp_path / "plan.csv"), "--plot", str(tmp_path / "plan.png"),
            "--requests", str(tmp_path / "requests.csv")]
    code = main(argv)
    printed = capsys.readouterr()
    assert code == 0, printed.err
    document = json.loads(out.read_text())
    assert len(document["points"]) == 4 and document["live"]["matches"] is True
    assert document["live"]["sim_hit_blocks"] > 0
    assert {r["setting"] for r in document["settings"]} >= {"base", "prefetch_policy", "hicache_ratio"}
    assert "live check" in printed.out and "front" in printed.out
    assert (tmp_path / "plan.png").stat().st_size > 10_000
    lines = (tmp_path / "requests.csv").read_text().splitlines()
    assert len(lines) == 251 and lines[0].startswith("request,tokens,device,host,storage")

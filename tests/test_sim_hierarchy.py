"""Whole-hierarchy simulation: SGLang's write policies and prefetch rules, the node's tiers, time, plan."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.support.sim import shared_prefix_trace, write_trace_jsonl
from tiers.sim import plan
from tiers.sim.hierarchy import LOST_REASONS, EngineSettings, SGLangFlags, node_settings, simulate
from tiers.sim.node_tiers import NodeTiers, TierSpec
from tiers.sim.timing import BenchError, BenchFigures, TimeModel, time_model
from tiers.sim.trace import from_requests

FREE = TimeModel(compute_s=1e-4, h2d_s=0.0, tier_read_s=(0.0, 0.0), write_s=0.0, page_tokens=16)


def engine(device_blocks, host_blocks, **kw):
    """EngineSettings in 16-token blocks with 16-token pages (a block is a page)."""
    kw.setdefault("prefetch_threshold", 16)
    return EngineSettings(device_tokens=device_blocks * 16, host_tokens=host_blocks * 16,
                          flags=SGLangFlags(page_size=16, **kw))


def dram(blocks, policy="lru", write_policy="write_through"):
    return node_settings([TierSpec("dram", blocks, policy)], write_policy=write_policy)


def trace_of(*requests, gap_ms=1000):
    return from_requests([(i * gap_ms, len(blocks) * 16, blocks) for i, blocks in enumerate(requests)],
                         block_tokens=16)


def check_accounting(result):
    """Levels add up per request; every token the tiers held and the request did not get has a reason."""
    assert np.all(result.device + result.host + result.storage <= result.tokens)
    assert np.all(result.storage <= result.storage_available)
    assert sum(result.lost.values()) == int(result.storage_available.sum() - result.storage.sum())


def test_write_through_sends_every_computed_block_to_the_tiers():
    result = simulate(trace_of([1, 2, 3], [1, 2, 4]), engine(10, 20), dram(10), FREE, record_ops=True)
    assert [op for op in result.ops if op[0] == "set"] == [("set", [0, 1, 2], None), ("set", [3], 1)]  # dense ids
    assert result.device.tolist() == [0, 32]
    check_accounting(result)


def test_write_through_selective_backs_up_a_node_on_its_second_use():
    result = simulate(trace_of([1, 2, 3], [1, 2, 4], [9]), engine(10, 20, write_policy="write_through_selective"),
                      dram(10), FREE, record_ops=True)
    sets = [op for op in result.ops if op[0] == "set"]
    assert sets == [("set", [0, 1], None)]  # the shared [1, 2] walked twice; 3, 4 and 9 once


def test_write_back_writes_at_device_eviction_and_an_unbacked_head_blocks_prefetch():
    # [7] is shared: under write_back it stays on the GPU unbacked while the tails are evicted to host
    # and on to the tiers. The last request matches [7] on the GPU and cannot prefetch [1, 2] from L3
    # (SGLang prefetches only under a backed-up match: is_backuped(last_host_node)).
    requests = [[7, 1, 2], [7, 3, 4], [7, 5, 6], [7, 8, 9], [7, 1, 2]]
    back = simulate(trace_of(*requests), engine(5, 3, write_policy="write_back"), dram(50), FREE, record_ops=True)
    assert back.lost["anchor_not_backed"] == 32 and back.storage[-1] == 0 and back.device[-1] == 16
    assert back.storage_available[-1] == 32
    assert [op[1] for op in back.ops if op[0] == "set"] == [[1, 2], [3, 4], [5, 6]]  # as each is evicted
    # write_through backs [7] up with the first request, so the same tail comes from L3
    through = simulate(trace_of(*requests), engine(5, 7), dram(50), FREE)
    assert through.storage[-1] == 32 and through.lost["anchor_not_backed"] == 0
    check_accounting(back)
    check_accounting(through)


# Requests 0 and 1 go through the GPU and host pools, two fillers push them out of both; the
# repeats then find them only in the node's DRAM tier.
REFETCH = [[1, 2], [3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13, 14], [1, 2], [3, 4, 5, 6]]


def test_prefetch_threshold_declines_short_continuations():
    low = simulate(trace_of(*REFETCH), engine(4, 8), dram(50), FREE)
    high = simulate(trace_of(*REFETCH), engine(4, 8, prefetch_threshold=48), dram(50), FREE)
    assert low.storage.tolist()[4:] == [32, 64] and low.host.sum() == 0
    assert high.storage.tolist()[4:] == [0, 64] and high.lost["below_threshold"] == 32
    check_accounting(high)


@pytest.mark.parametrize("policy,base,expected", [("best_effort", 1.0, 0), ("wait_complete", 1.0, 64),
                                                  ("timeout", 0.1, 0), ("timeout", 0.2, 64)])
def test_prefetch_policies_and_sglangs_timeout(policy, base, expected):
    # 4 blocks of 16 tokens at 2 ms a token: one 128-page batch of 0.128 s. SGLang's timeout budget is
    # base + pages * page_size / 1024 * per_ki_token = base + 4 * 16 / 1024 * 0 here.
    slow = TimeModel(compute_s=1e-4, h2d_s=0.0, tier_read_s=(2e-3,), write_s=0.0, page_tokens=16)
    settings = engine(4, 8, prefetch_policy=policy, prefetch_timeout_base=base, prefetch_timeout_per_ki_token=0.0)
    result = simulate(trace_of([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [1, 2, 3, 4]), settings, dram(50), slow)
    assert result.storage[-1] == expected
    assert result.lost["cut_short"] == 64 - expected
    waited = result.wait_s[-1]
    assert waited == pytest.approx({"best_effort": 0.0, "wait_complete": 0.128}.get(policy, min(base, 0.128)))
    assert result.ttft_s[-1] == pytest.approx(waited + (64 - expected) * 1e-4)


def test_host_pool_no_larger_than_the_gpu_leaves_no_room_for_prefetch():
    trace = shared_prefix_trace()
    roomy = simulate(trace, engine(40, 80), dram(2000), FREE)
    tight = simulate(trace, engine(40, 40), dram(2000), FREE)
    assert tight.storage.sum() < roomy.storage.sum() / 2
    assert tight.lost["host_full"] > 0 and roomy.lost["host_full"] == 0
    for result in (roomy, tight):
        check_accounting(result)


def test_queue_lets_best_effort_read_while_requests_wait():
    slow = TimeModel(compute_s=1e-3, h2d_s=0.0, tier_read_s=(1e-5,), write_s=0.0, page_tokens=16)
    trace = trace_of([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [1, 2, 3, 4], gap_ms=0)
    settings = engine(4, 8, prefetch_policy="best_effort")
    idle = simulate(trace, settings, dram(50), slow)
    queued = simulate(trace, settings, dram(50), slow, queue=True)
    assert idle.storage[-1] == 0 and queued.storage[-1] == 64
    assert queued.wait_s[-1] > 0


def test_levels_sum_and_lost_reasons_on_a_real_shaped_trace():
    trace = shared_prefix_trace()
    for kw in ({}, {"write_policy": "write_back"}, {"prefetch_policy": "best_effort"},
               {"write_policy": "write_through_selective"}, {"prefetch_threshold": 64}):
        check_accounting(simulate(trace, engine(30, 45, **kw), dram(300), FREE))
    assert set(LOST_REASONS) == set(simulate(trace, engine(30, 45), dram(300), FREE).lost)


def test_chain_write_back_demotes_and_promotes():
    tiers = NodeTiers([TierSpec("dram", 2), TierSpec("nvme", 10)], write_policy="write_back", promote_min_reads=1)
    tiers.write([1, 2, 3], [None, 1, 2])
    assert tiers.depth(1) == 1 and tiers.depth(3) == 0 and tiers.demoted == 1
    assert tiers.read([1], [None]) == [1]
    assert tiers.depth(1) == 0 and tiers.promoted == 1  # promoted (clean): its eviction is not a demotion
    selective = NodeTiers([TierSpec("dram", 1), TierSpec("nvme", 10)], write_policy="selective", min_reads=1)
    selective.write([1, 2], [None, 1])
    assert selective.depth(1) == -1 and selective.dropped == 1  # never read: dropped, not written down


def test_time_model_reads_the_bench_file(tmp_path):
    bench = BenchFigures.load("docs/bench.json")
    model = time_model(bench, ["dram", "nvme"], "write_through", model="llama-3-8b", gpu="h100-sxm")
    per_token = 2 * 32 * 8 * 128 * 2
    nvme_write = bench.medians["nvme.8MiB.write"]  # 64 tokens x 128 KiB = 8 MiB pages
    assert model.write_s == pytest.approx(per_token / (nvme_write * 1e9))  # write_through: the slowest tier
    assert model.tier_read_s[0] == pytest.approx(per_token / (bench.medians["dram.8MiB.read"] * 1e9))
    assert model.compute_s == pytest.approx(2 * 8.03e9 / (989e12 * 0.5))
    assert bench.lookup_s(128) == pytest.approx(bench.medians["lookup.128.p50"] * 1e-6)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"figures": {"lookup.1.p50": {"median": 100}}}))
    with pytest.raises(BenchError, match="dram.<page size>.read"):
        time_model(BenchFigures.load(str(bad)), ["dram"], "write_back")
    bad.write_text("{")
    with pytest.raises(BenchError, match="not JSON"):
        BenchFigures.load(str(bad))


def test_pareto_fronts():
    rows = [{"cost": 0, "ttft_mean_s": 3.0, "hit_rate": 0.0}, {"cost": 1, "ttft_mean_s": 2.0, "hit_rate": 0.5},
            {"cost": 2, "ttft_mean_s": 2.5, "hit_rate": 0.6}, {"cost": 3, "ttft_mean_s": 1.0, "hit_rate": 0.6}]
    assert [r["cost"] for r in plan.pareto(rows, "ttft_mean_s")] == [0, 1, 3]
    assert [r["cost"] for r in plan.pareto(rows, "-hit_rate")] == [0, 1, 2]


def test_scripting_api_sweep_and_settings():
    trace = shared_prefix_trace()
    setup = plan.Setup(bench=plan.load_bench("docs/bench.json"), device_gb=30 * 16 * 131072 / 1e9,
                       flags=SGLangFlags(page_size=16, prefetch_threshold=16))
    block_gb = 16 * 131072 / 1e9
    rows = plan.sweep(trace, setup, plan.grid(dram_gb=[0, 200 * block_gb], nvme_gb=[0, 2000 * block_gb]))
    assert len(rows) == 4 and all(r["front_hit"] or r["front_mean"] or r["front_p90"] or r["cost"] > 0 for r in rows)
    none = next(r for r in rows if r["cost"] == 0)
    most = max(rows, key=lambda r: r["cost"])
    # how much of the trace the tiers serve depends on docs/bench.json's measured read speeds
    assert none["storage_hit_rate"] == 0 and most["storage_hit_rate"] > 0.05
    assert most["cost"] == pytest.approx(200 * block_gb * 3.0 + 2000 * block_gb * 0.08)
    settings = plan.settings_rows(trace, setup, plan.Point(200 * block_gb, 0, 0),
                                  values={"prefetch_policy": ("best_effort",)})
    assert [r["setting"] for r in settings] == ["base", "prefetch_policy"]
    assert settings[1]["storage_hit_rate"] == 0 and settings[1]["delta_hit_rate"] < 0


def test_example_script_of_experiments_md(tmp_path, capsys):
    import importlib.util
    path = write_trace_jsonl(tmp_path / "trace.jsonl", shared_prefix_trace())
    spec = importlib.util.spec_from_file_location("plan_api", "scripts/examples/plan_api.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    block_gb = 16 * 131072 / 1e9
    assert example.main([str(path), "--block-tokens", "16", "--device-gb", str(20 * block_gb),
                         "--dram-gb", f"{50 * block_gb},{400 * block_gb}", "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert "slru (user file)" in out and "storage_hit_rate" in out and (tmp_path / "p.png").exists()


@pytest.mark.parametrize("extra,message", [
    (["--bench", "no-such.json"], "no-such.json: No such file"),
    (["--bench", "pyproject.toml"], "not JSON"),
    (["--bench", "docs/bench.json", "--cost", "tape=1"], "the kind must be one of dram, nvme, remote"),
    (["--bench", "docs/bench.json", "--dram-gb", "-5"], "expected numbers >= 0"),
    (["--bench", "docs/bench.json", "--policy", "nowhere.py:X"], "no file"),
    (["--bench", "docs/bench.json", "--policy", "mystery"], "no eviction policy 'mystery'"),
    (["--bench", "docs/bench.json", "--settings-at", "1,2"], "expected DRAM_GB,NVME_GB,REMOTE_GB"),
    (["--bench", "docs/bench.json", "--dram-gb", "1", "--nvme-gb", "1", "--settings-at", "1,1,0", "--live",
      "--no-settings"], "--live needs the settings point to be one DRAM tier"),
])
def test_plan_usage_errors_are_one_line(tmp_path, capsys, extra, message):
    from tiers.cli import main
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1024, "hash_ids": [1, 2]}\n')
    try:
        code = main(["plan", str(trace), "--quiet", *extra])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_a_policy_per_tier_kind(tmp_path):
    from tiers.cli import main
    setup = plan.Setup(tier_policy="lru", tier_policies=(("dram", "s3fifo"),))
    node = setup.node(plan.Point(1, 1, 0), 512)
    assert [(s.kind, s.policy) for s in node.tiers] == [("dram", "s3fifo"), ("nvme", "lru")]
    path = write_trace_jsonl(tmp_path / "t.jsonl", shared_prefix_trace())
    out = tmp_path / "p.json"
    assert main(["plan", str(path), "--bench", "docs/bench.json", "--block-tokens", "16", "--dram-gb", "0.1",
                 "--nvme-gb", "1", "--policy", "dram=s3fifo,nvme=scripts/examples/slru_policy.py:SLRUPolicy",
                 "--no-settings", "--quiet", "--parallel", "1", "--json", str(out)]) == 0
    chosen = json.loads(out.read_text())["setup"]
    assert chosen["tier_policy"] == "lru"
    assert [list(p) for p in chosen["tier_policies"]][0] == ["dram", "s3fifo"]
    assert chosen["tier_policies"][1][1].endswith("scripts/examples/slru_policy.py:SLRUPolicy")
    try:
        code = main(["plan", str(path), "--bench", "docs/bench.json", "--policy", "dram=mystery", "--quiet"])
    except SystemExit as exc:
        code = exc.code
    assert code == 2


def test_chain_promotes_a_page_on_its_second_read_from_below_by_default():
    tiers = NodeTiers([TierSpec("dram", 4), TierSpec("nvme", 10)], write_policy="write_back")
    tiers.write([1, 2, 3, 4, 5, 6], [None, 1, 2, 3, 4, 5])  # 1 and 2 demoted to NVMe
    assert tiers.depth(1) == 1
    assert tiers.read([1], [None]) == [1] and tiers.promoted == 0 and tiers.depth(1) == 1  # once: stays below
    assert tiers.read([1], [None]) == [1] and tiers.promoted == 1 and tiers.depth(1) == 0  # twice: promoted
    assert tiers.counters()["not_promoted"] == 1

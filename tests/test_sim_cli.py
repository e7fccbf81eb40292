"""The replay and model sub-commands, and the prefill model behind model."""
from __future__ import annotations

import csv
import json

import pytest

from tests.support.sim import hand_trace, run_experiments as run  # noqa: F401  (hand_trace is a fixture)
from tiers.sim.prefill import PRESETS, PrefillModel


def test_registered_in_the_main_cli():
    from tiers.cli import COMMAND_MODULES
    assert "tiers.cli.experiments" in COMMAND_MODULES


def test_replay_writes_table_json_csv_and_plot(hand_trace, tmp_path, capsys):
    out_json, out_csv, out_png = (str(tmp_path / n) for n in ("r.json", "r.csv", "r.png"))
    code = run(["replay", hand_trace, "--policy", "lru,radix-lru", "--capacity", "4b,2048t,1kb", "--quiet",
                "--json", out_json, "--csv", out_csv, "--plot", out_png])
    assert code == 0
    printed = capsys.readouterr().out
    assert "token hit rate" in printed and "infinite" in printed
    document = json.load(open(out_json))
    assert document["ceiling"]["token_hit_rate"] == pytest.approx(3036 / 4912)
    rows = {(r["policy"], r["capacity_blocks"]): r for r in document["rows"]}
    assert set(rows) == {(p, c) for p in ("lru", "radix-lru") for c in (4, 1000)}  # 2048t is 4 blocks too
    lru4 = rows[("lru", 4)]
    assert (lru4["hit_blocks"], lru4["hit_tokens"], lru4["requests"]) == (2, 1024, 5)
    assert lru4["token_hit_rate"] == pytest.approx(1024 / 4912) and lru4["block_hit_rate"] == pytest.approx(2 / 12)
    assert rows[("lru", 1000)]["token_hit_rate"] == pytest.approx(3036 / 4912)
    assert len(list(csv.DictReader(open(out_csv)))) == 6
    assert open(out_png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_replay_flat_and_bench(hand_trace, capsys):
    assert run(["replay", hand_trace, "--policy", "fifo", "--capacity", "4b", "--flat", "--quiet"]) == 0
    assert "flat" in capsys.readouterr().out
    assert run(["replay", hand_trace, "--policy", "lru,s3fifo", "--capacity", "4b", "--bench"]) == 0
    assert "accesses/s" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--capacity", "3M"], ["--policy", "nope"], ["--block-tokens", "0"]])
def test_replay_usage_errors_exit_2(hand_trace, argv, capsys):
    try:
        code = run(["replay", hand_trace, *argv, "--quiet"])
    except SystemExit as exit_:  # argparse's own checks (--block-tokens 0) exit from the parser
        code = exit_.code
    assert code == 2
    assert capsys.readouterr().err


def test_kv_bytes_per_token_of_the_presets():
    assert PRESETS["llama-3-70b"].kv_bytes_per_token == 320 * 1024
    assert PRESETS["llama-3-8b"].kv_bytes_per_token == 128 * 1024


def test_prefill_model_crossover_and_peak():
    model = PrefillModel(shape=PRESETS["llama-3-70b"], tflops=312, mfu=0.5, read_gbps=1.7, write_gbps=1.7)
    assert model.compute_s == pytest.approx(2 * 70.6e9 / 156e12)
    assert model.read_s == pytest.approx(327680 / 1.7e9)
    assert model.e == pytest.approx(model.compute_s / model.read_s)
    assert model.crossover == pytest.approx(model.e / (1 + model.e))
    n = 1000
    assert model.ttft(0.0, n) == pytest.approx(n * model.compute_s)
    assert n * model.compute_s / model.ttft(model.crossover, n) == pytest.approx(1 + model.e)
    assert model.bound(0.2) == "compute" and model.bound(0.95) == "read"
    slow_writes = PrefillModel(shape=PRESETS["llama-3-70b"], tflops=312, mfu=0.5, read_gbps=1.7, write_gbps=0.1)
    assert slow_writes.bound(0.2) == "write"
    with pytest.raises(ValueError):
        model.ttft(1.5, n)


def test_model_command_prints_curve_and_plots(tmp_path, capsys):
    png, out = str(tmp_path / "m.png"), str(tmp_path / "m.json")
    assert run(["model", "--points", "5", "--plot", png, "--json", out]) == 0
    printed = capsys.readouterr().out
    assert "320 KiB/token" in printed and "a* = e/(1+e)" in printed
    assert len(json.load(open(out))["curve"]) == 5
    assert open(png, "rb").read(4) == b"\x89PNG"
    assert run(["model", "--model", "llama-3-8b", "--layers", "40", "--dtype-bytes", "1", "--points", "3"]) == 0
    assert "80 KiB/token" in capsys.readouterr().out  # 2 x 40 x 8 x 128 x 1
    assert run(["model", "--read-gbps", "0"]) == 2


def test_replay_kernel_engine_without_a_compiler_fails_cleanly(hand_trace, monkeypatch, capsys):
    from tiers.sim import kernels

    def unavailable():
        raise kernels.KernelUnavailable("no C compiler (cc/gcc) on PATH")

    monkeypatch.setattr(kernels, "load", unavailable)
    assert run(["replay", hand_trace, "--policy", "fifo", "--capacity", "4b", "--engine", "kernel", "--quiet"]) == 1
    assert "no C compiler" in capsys.readouterr().err

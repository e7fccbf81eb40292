"""The measured TTFT profile: its fit, the planner's prediction of each case, and `plan --profile`."""
from __future__ import annotations

import json

import pytest

from tests.support.sim import shared_prefix_trace, write_trace_jsonl
from tiers.sim import profile_check
from tiers.sim.prefill import ModelShape
from tiers.sim.profile import Fit, Profile, ProfileError, build_profile, fit_service, preset_fit, service_s
from tiers.sim.timing import BenchFigures, time_model

# A made-up CPU server: 50 ms a request, 2 ms a computed token + 0.1 us x computed^2, 0.4 ms a cached token,
# 0.1 ms a token loaded from host; 8 KiB of KV a token, 16-token pages (128 KiB).
A, B, C, D, E = 0.05, 2e-3, 1e-7, 4e-4, 1e-4
LENGTHS = (512, 1024, 2048, 4096, 8192)
SHAPE = ModelShape(layers=8, kv_heads=4, head_dim=64, dtype_bytes=2, params=1e7)


def hit(n):
    return (n // 16 - 1) * 16


def made_up_measurements():
    recompute = {n: A + B * n + C * n * n for n in LENGTHS}
    device = {n: A + B * 16 + C * 256 + D * hit(n) for n in LENGTHS}
    host = {n: device[n] + E * hit(n) for n in LENGTHS}
    hits = {n: hit(n) for n in LENGTHS}
    return recompute, device, host, hits


def bench_figures(tmp_path):
    """A bench --json file: DRAM reads 2 GB/s, writes 1 GB/s at 128 KiB pages; lookups 100 / 200 us."""
    figures = {"dram.128KiB.read": 2.0, "dram.128KiB.write": 1.0, "lookup.1.p50": 100.0, "lookup.128.p50": 200.0}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"meta": {"date": "test"}, "figures": {k: {"median": v} for k, v in figures.items()}}))
    return BenchFigures.load(str(path)), str(path)


def test_the_fit_recovers_the_made_up_costs_exactly():
    recompute, device, host, hits = made_up_measurements()
    fit = fit_service(recompute, device, hits, host, hits)
    assert (fit.overhead_s, fit.compute_s, fit.compute_s2, fit.cached_s, fit.h2d_s) == pytest.approx((A, B, C, D, E),
                                                                                                      rel=1e-9)
    assert fit.serial_load and fit.load_fixed_s == pytest.approx(0.0, abs=1e-12) and max(fit.errors.values()) < 1e-9


def test_a_load_from_host_with_a_fixed_cost_is_fitted_as_one():
    """A load from host of ~6 ms whatever the prompt (the CPU server's): a slope alone missed it by 20%; the
    fit takes a fixed cost a load, and the check predicts host hits with it."""
    recompute, device, _host, hits = made_up_measurements()
    fixed, slope = 6e-3, 2e-7
    host = {n: device[n] + fixed + slope * hit(n) for n in LENGTHS}
    fit = fit_service(recompute, device, hits, host, hits)
    assert (fit.load_fixed_s, fit.h2d_s) == pytest.approx((fixed, slope), rel=1e-6)
    assert fit.errors["host"] < 1e-9
    assert service_s(fit, hit(512), hit(512), 16) == pytest.approx(host[512])
    assert service_s(fit, hit(512), 0, 16) == pytest.approx(device[512])  # nothing loaded: no fixed cost
    only_fixed = fit_service(recompute, device, hits, {n: device[n] + fixed for n in LENGTHS}, hits)
    assert (only_fixed.load_fixed_s, only_fixed.h2d_s) == pytest.approx((fixed, 0.0), abs=1e-12)


def test_one_length_fits_the_fewest_costs_that_explain_it():
    # recompute 512 and its device hit: a per-token prefill and a per-cached-token cost, nothing else
    fit = fit_service({512: 1.024}, {512: 0.032 + 0.496}, {512: 496})
    assert (fit.compute_s, fit.cached_s, fit.overhead_s, fit.compute_s2) == pytest.approx((2e-3, 1e-3, 0.0, 0.0))
    assert fit.h2d_s == 0.0 and max(fit.errors.values()) < 1e-12


def test_the_planner_predicts_each_case_with_its_own_formula(tmp_path):
    recompute, device, host, hits = made_up_measurements()
    n = 2048
    # the L3 hit as measured: SGLang's 10 ms around the hit query + the lookup (one 128-page batch)
    # + 127 pages read at 2 GB/s + the host hit
    read = 2032 * 8192 / 2e9
    measured = {"recompute": recompute, "device": device, "host": host,
                "l3_dram": {n: 0.01 + 200e-6 + read + host[n]}}
    profile = build_profile(measured, {"device": hits, "host": hits, "l3_dram": {n: hit(n)}}, SHAPE, 16,
                            prefetch_s=0.01)
    bench, _ = bench_figures(tmp_path)
    rows = {(r.case, r.tokens): r for r in profile_check.check(profile, bench)}
    assert rows[("recompute", n)].predicted_s == pytest.approx(0.05 + 4.096 + 0.4194304)
    assert rows[("device", n)].predicted_s == pytest.approx(0.05 + 0.032 + 0.0000256 + 0.8128)
    assert rows[("host", n)].predicted_s == pytest.approx(0.8948256 + 0.2032)
    l3 = rows[("l3_dram", n)]
    assert l3.wait_s == pytest.approx(0.0102 + 0.008323072) and l3.service_s == pytest.approx(1.0980256)
    assert all(r.holds and abs(r.error) < 1e-9 for r in rows.values())
    # a slower L3 than the model's (a per-request cost it lacks) is off by its share
    slow = build_profile({**measured, "l3_dram": {n: 1.5 * measured["l3_dram"][n]}}, profile.hits, SHAPE, 16,
                         prefetch_s=0.01)
    off = [r for r in profile_check.check(slow, bench) if not r.holds]
    assert [(r.case, round(r.error, 4)) for r in off] == [("l3_dram", round(1 / 1.5 - 1, 4))]


def test_a_gpu_preset_is_a_fit_with_the_load_overlapped():
    fit = preset_fit(compute_s=32e-6, h2d_s=2.6e-6)
    for cached, loaded, computed in ((0, 0, 4096), (4000, 4000, 96), (2000, 1000, 1000)):
        assert service_s(fit, cached, loaded, computed, write_s=15e-6) == max(loaded * 2.6e-6, computed * 15e-6,
                                                                               computed * 32e-6)
    model = time_model(None, [], "write_through", model="llama-3-8b", gpu="h100-sxm")
    assert (model.overhead_s, model.cached_s, model.compute_s2, model.serial_load) == (0.0, 0.0, 0.0, False)


def test_profile_file_round_trip_and_errors(tmp_path):
    recompute, device, host, hits = made_up_measurements()
    profile = build_profile({"recompute": recompute, "device": device, "host": host}, {"device": hits, "host": hits},
                            SHAPE, 16, {"device_tokens": 8448}, "made up")
    path = tmp_path / "p.json"
    profile.save(str(path))
    back = Profile.load(str(path))
    assert back == profile and back.kv_bytes_per_token == 8192 and back.lengths() == list(LENGTHS)
    model = time_model(None, ["dram"], "write_back", page_tokens=16, profile=back)
    assert model.cached_s == pytest.approx(D) and model.serial_load and model.source.startswith("engine: measured")
    path.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ProfileError, match="not a hicache-tiers ttft profile"):
        Profile.load(str(path))
    assert isinstance(Fit().errors, dict)


def test_plan_takes_a_profile_and_checks_it(tmp_path, capsys):
    from tiers.cli import main
    recompute, device, host, hits = made_up_measurements()
    measured = {"recompute": recompute, "device": device, "host": host,
                "l3_dram": {2048: 200e-6 + 2032 * 8192 / 2e9 + host[2048]}}
    profile = build_profile(measured, {"device": hits, "host": hits, "l3_dram": {2048: hit(2048)}}, SHAPE, 16)
    prof = tmp_path / "p.json"
    profile.save(str(prof))
    _, bench = bench_figures(tmp_path)
    assert main(["plan", "--bench", bench, "--profile", str(prof), "--check-profile"]) == 0
    out = capsys.readouterr().out
    assert "16 of 16 cases within 15%" in out and "l3_dram" in out
    trace = write_trace_jsonl(tmp_path / "t.jsonl", shared_prefix_trace(requests=40))
    out_json = tmp_path / "plan.json"
    assert main(["plan", str(trace), "--bench", bench, "--profile", str(prof), "--block-tokens", "16",
                 "--dram-gb", "0,0.01", "--nvme-gb", "0", "--no-settings", "--quiet", "--parallel", "1",
                 "--json", str(out_json)]) == 0
    document = json.loads(out_json.read_text())
    assert document["setup"]["page_size"] == 16 and document["profile"] == str(prof)
    assert document["time_model"]["cached_us_per_token"] == pytest.approx(D * 1e6)
    assert main(["plan", "--bench", bench, "--check-profile"]) == 2
    assert "--check-profile needs --profile" in capsys.readouterr().err


def test_the_servers_own_l3_reads_replace_the_bench_rate_where_the_profile_has_them(tmp_path):
    """The transfers a server measured (backend batch_get wall time) fit a cost a storage batch and one a byte;
    the planner then reads that tier at them, not at the bench file's rate, and a profile written before them
    (no l3_reads) reads at the bench rate as before."""
    from tiers.sim.profile import ReadFit, fit_reads
    recompute, device, host, hits = made_up_measurements()
    fixed, per_byte = 3e-3, 1 / 0.8e9  # 3 ms a 128-page batch, 0.8 GB/s
    transfer = {n: -(-(hit(n) // 16) // 128) * fixed + hit(n) * 8192 * per_byte for n in LENGTHS}
    read = fit_reads(transfer, hits, 8192, 16)
    assert (read.fixed_s, read.s_per_byte) == pytest.approx((fixed, per_byte), rel=1e-6) and read.error < 1e-9
    assert fit_reads({}, hits, 8192, 16) is None and fit_reads({512: 0.0}, hits, 8192, 16) is None
    n = 2048
    measured = {"recompute": recompute, "device": device, "host": host,
                "l3_dram": {n: 0.01 + 200e-6 + transfer[n] + host[n]}}
    case_hits = {"device": hits, "host": hits, "l3_dram": {m: hit(m) for m in LENGTHS}}
    profile = build_profile(measured, case_hits, SHAPE, 16, prefetch_s=0.01, transfers={"l3_dram": transfer})
    got = profile.l3_reads["dram"]
    assert isinstance(got, ReadFit) and (got.fixed_s, got.s_per_byte) == pytest.approx((fixed, per_byte), rel=1e-6)
    bench, _ = bench_figures(tmp_path)  # DRAM reads at 2 GB/s there
    model = time_model(bench, ["dram"], "write_through", page_tokens=16, profile=profile)
    assert model.batch_read_s({0: 2032}) == pytest.approx(fixed + 2032 * 8192 * per_byte)
    (row,) = [r for r in profile_check.check(profile, bench) if r.case == "l3_dram"]
    assert row.error == pytest.approx(0.0, abs=1e-9)
    path = tmp_path / "p.json"
    profile.save(str(path))
    assert Profile.load(str(path)).l3_reads == profile.l3_reads
    document = json.loads(path.read_text())
    del document["l3_reads"]
    older = Profile.from_json(document)
    assert older.l3_reads == {}
    assert time_model(bench, ["dram"], "write_through", page_tokens=16, profile=older).batch_read_s({0: 2032}) == \
        pytest.approx(2032 * 8192 / 2e9)


def test_an_l3_hits_hand_over_between_the_engines_threads_is_part_of_its_wait(tmp_path):
    """SGLang carries a hit from its query to its reads and back through its threads (hit_handoff_s, measured
    as an L3 hit's prefetch wait less its transfer and query): the planner adds it to every L3 hit's wait, and a
    profile without it predicts the hit that much too early."""
    recompute, device, host, hits = made_up_measurements()
    n, handoff = 2048, 4e-3
    read = 2032 * 8192 / 2e9
    measured = {"recompute": recompute, "device": device, "host": host,
                "l3_dram": {n: 0.01 + 200e-6 + handoff + read + host[n]}}
    case_hits = {"device": hits, "host": hits, "l3_dram": {n: hit(n)}}
    bench, _ = bench_figures(tmp_path)
    profile = build_profile(measured, case_hits, SHAPE, 16, prefetch_s=0.01, hit_handoff_s=handoff)
    (row,) = [r for r in profile_check.check(profile, bench) if r.case == "l3_dram"]
    assert row.wait_s == pytest.approx(0.0102 + handoff + read) and row.error == pytest.approx(0.0, abs=1e-9)
    without = build_profile(measured, case_hits, SHAPE, 16, prefetch_s=0.01)
    (early,) = [r for r in profile_check.check(without, bench) if r.case == "l3_dram"]
    assert early.predicted_s == pytest.approx(measured["l3_dram"][n] - handoff)
    path = tmp_path / "p.json"
    profile.save(str(path))
    assert Profile.load(str(path)).fit.hit_handoff_s == handoff
    # the simulator's prefetch starts its reads after the hand-over too
    assert time_model(bench, ["dram"], "write_through", page_tokens=16, profile=profile).hit_handoff_s == handoff


def test_a_case_off_by_less_than_its_repetitions_spread_says_so(tmp_path, capsys):
    """A median 25% off the prediction, with repetitions spread around the prediction: the check still counts
    it off (and plan --check-profile exits 1), and says the prediction lies between its repetitions; one whose
    repetitions all lie beyond the prediction is off without that."""
    from tiers.cli import main
    recompute, device, host, hits = made_up_measurements()
    n = 2048
    measured = {"recompute": recompute, "device": device, "host": {**host, n: host[n] * 1.25}}
    ranges = {"host": {n: (host[n] * 0.9, host[n] * 1.3)}, "device": {n: (device[n] * 1.2, device[n] * 1.3)}}
    profile = build_profile(measured, {"device": hits, "host": hits}, SHAPE, 16, ranges=ranges)
    profile = Profile(**{**vars(profile), "fit": fit_service(recompute, device, hits, host, hits)})  # the true fit
    rows = {(r.case, r.tokens): r for r in profile_check.check(profile, None)}
    off = rows[("host", n)]
    assert not off.holds and off.inside_range and off.range_s == ranges["host"][n]
    assert rows[("device", n)].holds and not rows[("device", n)].inside_range  # its range lies above: said as is
    assert rows[("recompute", n)].range_s is None
    text = profile_check.summary(list(rows.values()))
    assert text.startswith(f"{len(rows) - 1} of {len(rows)} cases within 15%") and "host 2,048" in text
    assert "NO, inside the repetitions" in profile_check.table(list(rows.values()))
    path = tmp_path / "p.json"
    profile.save(str(path))
    assert Profile.load(str(path)).ranges == ranges
    _, bench = bench_figures(tmp_path)
    assert main(["plan", "--bench", bench, "--profile", str(path), "--check-profile"]) == 1
    assert "predicted between the fastest and the slowest of their repetitions (host 2,048)" in capsys.readouterr().out


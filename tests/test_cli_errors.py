"""Every sub-command with bad input: one line on stderr that says what is wrong, a nonzero exit, no traceback.

Run as a user runs them: ``python -m tiers.cli`` in a subprocess, so argparse
exits, logging and the last-resort handler are all real.
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACE = os.path.join(ROOT, "..", "shared", "data", "traces", "conversation_trace.jsonl")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "bad.jsonl").write_text('{"timestamp": 0}\n')
    (d / "list.jsonl").write_text("[1, 2]\n")
    (d / "notjson.jsonl").write_text("{oops\n")
    (d / "blank.jsonl").write_text("\n  \n")
    (d / "neg.jsonl").write_text('{"timestamp": 0, "input_length": -3, "hash_ids": [1]}\n')
    (d / "good.jsonl").write_text('{"timestamp": 0, "input_length": 1024, "hash_ids": [1, 2]}\n')
    (d / "bad.toml").write_text("[[tiers]]\nname = 'dram'\nkind = 'dram'\ncapacity = 'lots'\n")
    (d / "tiny.toml").write_text("[[tiers]]\nname = 'dram'\nkind = 'dram'\ncapacity = '1KiB'\n")
    (d / "huge.toml").write_text(f"[[tiers]]\nname = 'nvme'\nkind = 'nvme'\ncapacity = '900TiB'\npath = '{d}/n'\n")
    return d


# (argv with {d} for the fixture directory, what the one line must contain, exit code)
CASES = [
    (["bogus"], "invalid choice: 'bogus'", 2),
    (["serve", "--config", "/nonexistent.toml"], "cannot read", 2),
    (["serve", "--tier", "nope"], "no tier named 'nope'", 2),
    (["serve", "--config", "{d}/bad.toml"], "'lots' is not a size", 2),
    (["sglang-args", "--config", "/nonexistent.toml"], "cannot read", 2),
    (["sglang-args", "--tp-lcm-size", "0"], "--tp-lcm-size must be a positive integer", 2),
    (["sglang-args", "--format", "xml"], "invalid choice: 'xml'", 2),
    (["install-units", "--source", "/nonexistent", "--prefix", "{d}/u", "--config-dir", "{d}/u"],
     "cannot read unit files", 1),
    (["stats", "--tier", "nope"], "no tier named 'nope'", 2),
    (["evict"], "required: --tier, --bytes", 2),
    (["evict", "--tier", "dram", "--bytes", "lots"], "lots", 2),
    (["clear"], "required: --tier", 2),
    (["config", "check", "/nonexistent.toml"], "cannot read", 2),
    (["config", "check", "{d}/tiny.toml"], "less than one block", 2),
    (["config", "check", "{d}/huge.toml"], "more than the whole disk", 2),
    (["config", "show", "--config", "{d}/bad.toml"], "'lots' is not a size", 2),
    (["demo", "--pages", "0"], "must be at least 1", 2),
    (["demo", "--layout", "sideways"], "invalid choice", 2),
    (["replay", "/nonexistent.jsonl"], "/nonexistent.jsonl: No such file", 2),
    (["replay", "{d}/bad.jsonl"], "bad.jsonl:1: not a Mooncake trace line: missing input_length, hash_ids", 2),
    (["replay", "{d}/list.jsonl"], "expected an object", 2),
    (["replay", "{d}/notjson.jsonl"], "notjson.jsonl:1: not JSON", 2),
    (["replay", "{d}/neg.jsonl"], "input_length must be a number >= 0", 2),
    (["replay", "{d}/blank.jsonl"], "no requests", 2),
    (["replay", "{d}/good.jsonl", "--capacity", "-5t"], "bad capacity '-5t'", 2),
    (["replay", "{d}/good.jsonl", "--policy", "nope"], "unknown policy nope", 2),
    (["replay", "{d}/good.jsonl", "--plot", "/nonexistent/dir/x.png"], "directory /nonexistent/dir does not exist", 2),
    (["replay", "{d}/good.jsonl", "--json", "{d}"], "is a directory", 2),
    (["replay", "{d}/good.jsonl", "--block-tokens", "0"], "must be at least 1", 2),
    (["model", "--tokens", "0"], "must be at least 1", 2),
    (["model", "--tflops", "-1"], "--tflops must be positive", 2),
    (["model", "--points", "1"], "at least 2 points", 2),
    (["model", "--plot", "/nonexistent/x.png"], "directory /nonexistent does not exist", 2),
    (["keys", "generate"], "required: DIR", 2),
    (["bench", "--only", "nope"], "choose from", 2),
    (["bench", "--page-sizes", "x"], "is not a size", 2),
    (["bench", "--page-sizes", "48KiB"], "multiples of 32KiB", 2),
    (["bench", "--out", "/nonexistent/x.md"], "directory /nonexistent does not exist", 2),
    (["bench", "--repeat", "0"], "must be at least 1", 2),
]


def run_cli(argv, tmp):
    env = dict(os.environ, HICACHE_TIERS_RUNTIME_DIR=str(tmp / "run"), HICACHE_TIERS_DATA_DIR=str(tmp / "data"))
    env.pop("HICACHE_TIERS_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "tiers.cli", *argv], capture_output=True, text=True, timeout=120,
                          env=env, cwd=str(tmp))


@pytest.mark.parametrize("argv,expected,code", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_is_one_line_and_a_nonzero_exit(files, argv, expected, code):
    proc = run_cli([a.replace("{d}", str(files)) for a in argv], files)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert expected in lines[0], lines[0]


def test_config_check_reports_every_mistake_in_one_run(files):
    (files / "many.toml").write_text(
        "[node]\nbogus = 1\nwrite_policy = 'often'\n"
        "[[tiers]]\nname = 'Bad Name'\nkind = 'dram'\ncapacity = 'x'\n"
        "[[tiers]]\nname = 'nvme'\nkind = 'tape'\n"
        "[[tiers]]\nname = 'd2'\nkind = 'dram'\ncapacity = '1KiB'\nblocksize = 3\n")
    proc = run_cli(["config", "check", str(files / "many.toml")], files)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert lines[-1] == f"hicache-tiers: {files / 'many.toml'}: 7 errors", proc.stderr
    for needle in ("node.bogus", "node.write_policy", "tiers[0].capacity: 'x'", "tiers[0].name: 'Bad Name'",
                   "tiers[1].kind: 'tape'", "tiers[2].blocksize", "tiers[2].capacity: 1024 bytes is less than one block"):
        assert sum(needle in line for line in lines) == 1, (needle, proc.stderr)


def test_good_input_still_works_and_says_what_it_wrote(files):
    out = files / "curve.json"
    proc = run_cli(["model", "--tokens", "4096", "--json", str(out)], files)
    assert proc.returncode == 0 and out.exists() and f"wrote {out}" in proc.stdout
    proc = run_cli(["replay", str(files / "good.jsonl"), str(files / "good.jsonl"), "--capacity", "1kt", "--quiet"],
                   files)
    assert proc.returncode == 0 and "merging 2 traces" in proc.stdout, proc.stderr

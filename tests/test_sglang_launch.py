"""The README's launch line, run by a real shell into SGLang's own argument parser,
and the extra-config rules: unknown keys warn, malformed known values refuse,
a lost shm allocator is reported."""
import argparse
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.server_args import ServerArgs

from hicache_ext.settings import BackendSettings
from hicache_ext.lab.sglang_harness import build_mha_host_pool, create_backend, make_storage_config
from tests.support.backend_env import backend_extra
from tests.support.nodes import dram_config, module_node

README = Path(__file__).resolve().parent.parent / "README.md"
ODD_DIR = "dir with space*and[glob]?"


def readme_launch_line() -> str:
    """The python3 -m sglang.launch_server command of the README, continuation lines joined."""
    text = README.read_text()
    block = text.split("## Running it with SGLang", 1)[1].split("```", 2)[1]
    line = block[block.index("python3 -m sglang.launch_server"):]
    line = line.split("\n\n")[0]
    return re.sub(r"\\\n\s*", " ", line).strip()


def sglang_parse(argv):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(argv)


@pytest.fixture
def odd_config(tmp_path):
    """A node configuration whose paths carry a space and every glob character."""
    odd = tmp_path / ODD_DIR
    odd.mkdir()
    (odd / "g1").mkdir()  # something for a glob to match if one were expanded
    path = odd / "node.toml"
    path.write_text(dram_config().replace("[node]\n", f'[node]\nruntime_dir = "{odd}/run"\n'))
    return path


def run_through_shell(script: str, config: Path, tmp_path: Path):
    """Run script with python3 standing in as a recorder of its argv; the recorded argv."""
    argv_file = tmp_path / "argv"
    shim = (f'python3() {{ shift 2; printf "%s\\0" "$@" > "{argv_file}"; }}\n'
            f'hicache-tiers() {{ "{sys.executable}" -m tiers.cli "$@"; }}\n')
    env = dict(os.environ, HICACHE_TIERS_CONFIG=str(config))
    proc = subprocess.run(["bash", "-c", shim + script], env=env, capture_output=True, text=True, timeout=60,
                          cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    return argv_file.read_bytes().split(b"\0")[:-1]


def check_extra(extra_json: str, config: Path, tp_lcm_size=None):
    extra = json.loads(extra_json)
    assert extra["tiers_config"] == str(config) and extra["runtime_dir"] == f"{config.parent}/run"
    assert extra["allocator"] == "shm" and extra["interface_v1"] == 1  # what get_allocator_type reads
    assert extra.get("tp_lcm_size") == tp_lcm_size
    ours, _, _, _, pass_prefix_keys = HybridCacheController.parse_storage_backend_extra_config(extra_json)
    assert pass_prefix_keys is True
    settings = BackendSettings.from_extra_config(ours)
    assert settings.tiers_config == str(config)


def test_the_readmes_launch_line_reaches_sglang_intact(odd_config, tmp_path, caplog):
    line = readme_launch_line()
    assert "$(hicache-tiers sglang-args)" in line  # unquoted, as people paste it
    argv = [a.decode() for a in run_through_shell(line, odd_config, tmp_path)]
    args = sglang_parse(argv)
    assert args.enable_hierarchical_cache and args.hicache_storage_backend == "dynamic"
    assert args.model_path == "meta-llama/Meta-Llama-3-8B-Instruct" and args.page_size == 64
    with caplog.at_level(logging.WARNING, logger="hicache.backend"):
        check_extra(args.hicache_storage_backend_extra_config, odd_config)
    assert not caplog.records  # no key of sglang-args is unknown to the backend


@pytest.mark.parametrize("form", ["shell", "json", "words"])
def test_every_output_form_gives_the_same_argv(odd_config, tmp_path, form):
    prefix = "python3 -m sglang.launch_server --model-path m"
    script = {
        "shell": f'eval "{prefix} $(hicache-tiers sglang-args --format shell --tp-lcm-size 4)"',
        "words": f"{prefix} $(hicache-tiers sglang-args --format words --tp-lcm-size 4)",
        "json": f'{prefix} --enable-hierarchical-cache --hicache-storage-backend dynamic --hicache-mem-layout '
                f'page_head --hicache-storage-backend-extra-config "$(hicache-tiers sglang-args --json --tp-lcm-size 4)"',
    }[form]
    args = sglang_parse([a.decode() for a in run_through_shell(script, odd_config, tmp_path)])
    assert args.hicache_mem_layout == "page_head"  # the only layout SGLang splits heads for
    check_extra(args.hicache_storage_backend_extra_config, odd_config, tp_lcm_size=4)


def test_bad_tp_lcm_size_is_a_message(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tiers.cli", "sglang-args", "--tp-lcm-size", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == "hicache-tiers: --tp-lcm-size must be a positive integer"


def test_unknown_keys_warn_with_the_nearest_and_sglang_keys_pass(caplog):
    with caplog.at_level(logging.WARNING, logger="hicache.backend"):
        settings = BackendSettings.from_extra_config(
            {"deadline_base": 3, "prefetch_timeout_max": 8, "allocator": "shm", "lookup_timeout_s": 0.2,
             "some_future_sglang_knob": True})
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "'deadline_base'" in messages[0] and "did you mean 'deadline_base_s'" in messages[0]
    assert "'some_future_sglang_knob'" in messages[1] and "did you mean" not in messages[1]
    assert settings.lookup_timeout_s == 0.2 and settings.deadline_base_s == 1.0


@pytest.mark.parametrize("key,value", [("deadline_base_s", "fast"), ("deadline_min_gbps", 0),
                                       ("lookup_timeout_s", True), ("write_policy", "sometimes"),
                                       ("promote", "yes"), ("selective_min_reads", 0), ("tiers_config", 7)])
def test_a_malformed_value_of_a_known_key_is_refused_by_name(key, value):
    with pytest.raises(ValueError, match=key):
        BackendSettings.from_extra_config({key: value})


node = module_node("launch")


def test_a_backend_built_by_the_factory_ignores_unknown_keys(node, caplog):
    pool = build_mha_host_pool("page_first", "shm", layers=2, kv_heads=2, head_dim=32, page_size=4, pages=4)
    config = make_storage_config(model_name="launch-unknown",
                                 extra_config=backend_extra(node, unknown_knob=1, prefetch_timeout_max=5))
    with caplog.at_level(logging.WARNING, logger="hicache.backend"):
        backend = create_backend("dynamic", config, pool)
    try:
        assert [r.getMessage() for r in caplog.records if "unknown" in r.getMessage()] == [
            "hicache-tiers: ignoring unknown extra-config key 'unknown_knob'"]
        assert backend.batch_exists(["ab" * 32]) == 0  # built and answering
    finally:
        backend.close()


@pytest.mark.parametrize("allocator,warned", [("default", True), ("shm", False)])
def test_an_shm_request_without_a_memfd_pool_is_reported(node, caplog, allocator, warned):
    # What @config.json gives: the object says shm, SGLang built the pool without it.
    pool = build_mha_host_pool("page_first", allocator, layers=2, kv_heads=2, head_dim=32, page_size=4, pages=4)
    config = make_storage_config(model_name=f"launch-shm-{allocator}", extra_config=backend_extra(node))
    assert config.extra_config["allocator"] == "shm"
    with caplog.at_level(logging.WARNING, logger="hicache.backend"):
        backend = create_backend("dynamic", config, pool)
    backend.close()
    lost = [r.getMessage() for r in caplog.records if "not in a memfd" in r.getMessage()]
    assert len(lost) == (1 if warned else 0)
    if warned:
        assert "$(hicache-tiers sglang-args --json)" in lost[0] and "@file" in lost[0]

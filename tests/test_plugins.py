"""An out-of-tree tier kind and policy (scripts/plugins/hicache-tier-tmpfs) found by entry point:
in the configuration, in a real daemon behind the real SGLang backend, and through the contract kit.

The plug-in is made visible the way pip would (a .dist-info with its
entry_points.txt on the path), without installing anything into the
environment the rest of the suite runs in.
"""
import os
import subprocess
import sys
import tomllib

import pytest

from hicache_ext.lab.sglang_harness import make_keys
from tests.support.backend_env import Engine
from tests.support.nodes import dram_tier, node_toml, start_node
from tiers import plugins
from tiers.wire.client import TierClient
from tiers.ops.config import ConfigError, parse_config
from tiers.plugins import make_policy, policy_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN = os.path.join(ROOT, "scripts", "plugins", "hicache-tier-tmpfs")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The example plug-in's distribution metadata on sys.path and PYTHONPATH, as an install leaves it."""
    site = tmp_path_factory.mktemp("site")
    with open(os.path.join(PLUGIN, "pyproject.toml"), "rb") as fh:
        project = tomllib.load(fh)["project"]
    info = site / f"hicache_tier_tmpfs-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    lines = []
    for group, entries in project["entry-points"].items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in entries.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    old_path, old_env = list(sys.path), os.environ.get("PYTHONPATH")
    sys.path[:0] = [str(site), PLUGIN]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), PLUGIN, ROOT] + ([old_env] if old_env else []))
    plugins.rescan()
    yield site
    sys.path[:] = old_path
    if old_env is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old_env
    plugins.rescan()


def tmpfs_chain(path: str, policy: str = "mru") -> str:
    return node_toml(dram_tier("8MiB"), {"name": "shm", "kind": "tmpfs", "capacity": "32MiB", "policy": policy,
                                         "path": path}, write_policy="write_through")


def test_names_are_known_without_importing_and_unknown_names_list_what_is_installed(installed):
    assert "tmpfs" in plugins.store_targets() and "mru" in policy_names()
    with pytest.raises(ValueError, match="no eviction policy .nope.; installed: .*mru"):
        make_policy("nope")
    with pytest.raises(ConfigError, match="'tape' is not one of dram, nvme, remote, pool, mooncake_store, memarena, tmpfs"):
        parse_config("[[tiers]]\nname = 'x'\nkind = 'tape'\n", "t.toml")


def test_a_plugin_kind_declares_its_own_options(installed, tmp_path):
    config = parse_config(tmpfs_chain(str(tmp_path / "p")), "t.toml")
    assert config.tier("shm").kind == "tmpfs" and config.tier("shm").options["path"] == str(tmp_path / "p")
    with pytest.raises(ConfigError) as err:
        parse_config(tmpfs_chain(str(tmp_path)) + "size = 3\n", "t.toml")
    assert "tiers[1].size is not a known key for a tmpfs tier" in str(err.value) and "path" in str(err.value)


def test_a_plugin_tier_serves_the_real_backend(installed, tmp_path):
    runner = start_node(tmp_path, tmpfs_chain(str(tmp_path / "pages")))
    engine = Engine(runner, model="plugin", pages=16)
    try:
        keys = make_keys(8, salt=55)
        done, sums = engine.write(keys, 0, seed=5)  # write_through: DRAM and the tmpfs tier
        assert done == 8
        dram = TierClient("dram", runner.config.tier("dram").endpoint, engine.backend.namespace)
        try:
            assert dram.delete(keys) == 8  # now only the plug-in's tier has them
        finally:
            dram.close()
        assert engine.read(keys, 8) == (8, sums)
        assert len([f for f in os.listdir(tmp_path / "pages") if f.endswith(".key")]) == 8
        stats = TierClient("shm", runner.config.tier("shm").endpoint, "_admin").stats()
        assert stats["pages"] == 8 and stats["hits"] >= 8
    finally:
        engine.close()
        runner.stop()


def test_a_plugin_that_shares_its_memory_serves_the_real_backend(installed, tmp_path):
    """The example memarena kind exports its arena: a put from the engine's host pool is reserved, copied by
    the daemon and committed, and a read is a lease the engine copies out of its own mapping."""
    runner = start_node(tmp_path, node_toml({"name": "mem", "kind": "memarena", "capacity": "16MiB",
                                             "block_size": "4KiB"}, write_policy="write_through"))
    engine = Engine(runner, model="plugin-arena", pages=16)
    try:
        keys = make_keys(8, salt=56)
        done, sums = engine.write(keys, 0, seed=6)
        assert done == 8
        assert engine.read(keys, 8) == (8, sums)
        stats = TierClient("mem", runner.config.tier("mem").endpoint, "_admin").stats()
        print(f"\nmemarena: {stats['pages']} pages, {stats['pages_leased']} leased to the engine, "
              f"{stats['pages_copied_in']} put as frames")
        assert stats["pages"] == 8 and stats["inserts"] == 8
        assert stats["pages_copied_in"] == 0  # every page came through reserve, the daemon's copy, commit
        assert stats["pages_leased"] == 8  # and went out by lease, the engine's own copy
    finally:
        engine.close()
        runner.stop()


def test_the_plugins_own_tests_pass_the_kit(installed):
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", PLUGIN,
                           os.path.join(PLUGIN, "tests")], capture_output=True, text=True, timeout=300,
                          cwd=PLUGIN, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout

"""Configuration: the embedded default loads; every kind of mistake names file, key and what is allowed."""
import subprocess
import sys

import pytest

from tiers.ops.config import ConfigError, load_config, parse_config, parse_size


def test_embedded_default_loads_with_overrides(tmp_path):
    config = load_config(runtime_dir=str(tmp_path / "run"), data_dir=str(tmp_path / "data"))
    assert [t.name for t in config.tiers][0] == "dram"
    assert config.tier("dram").endpoint == f"ipc://{tmp_path}/run/dram.sock"
    assert config.write_policy == "write_back"  # chosen by measurement (docs/PERFORMANCE.md)


def test_environment_overrides_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HICACHE_TIERS_RUNTIME_DIR", str(tmp_path / "envrun"))
    config = parse_config('[node]\nruntime_dir = "/nope"\n[[tiers]]\nname="dram"\nkind="dram"\n', "f.toml")
    assert config.runtime_dir == str(tmp_path / "envrun")
    flagged = parse_config('[[tiers]]\nname="dram"\nkind="dram"\n', "f.toml", runtime_dir="/flag")
    assert flagged.runtime_dir == "/flag"


@pytest.mark.parametrize("text, message", [
    ("[[tiers]]\nname='dram'\nkind='dram'\ncapacity='4XB'", "tiers[0].capacity: '4XB' is not a size"),
    ("[[tiers]]\nname='dram'\nkind='dram'\npolicy='random'", "tiers[0].policy: 'random' is not one of"),
    ("[[tiers]]\nname='dram'\nkind='tape'", "tiers[0].kind: 'tape' is not one of dram, nvme, remote"),
    ("[[tiers]]\nname='dram'\nkind='dram'\ncolour='red'", "tiers[0].colour is not a known key for a dram tier; allowed:"),
    ("[[tiers]]\nkind='dram'", "tiers[0].name is required"),
    ("[[tiers]]\nname='Bad Name'\nkind='dram'", "must be 1-32 chars"),
    ("[[tiers]]\nname='a'\nkind='dram'\n[[tiers]]\nname='a'\nkind='dram'", "tier names must be unique"),
    ("[node]\nwrite_policy='sometimes'\n[[tiers]]\nname='a'\nkind='dram'", "node.write_policy: 'sometimes' is not one of"),
    ("[node]\nspeed=3\n[[tiers]]\nname='a'\nkind='dram'", "node.speed is not a known key"),
    ("[extras]\n[[tiers]]\nname='a'\nkind='dram'", "unknown section(s) extras"),
    ("[node]\n", "at least one [[tiers]] table is required"),
    ("[[tiers]\n", "not valid TOML"),
    ("[[tiers]]\nname='a'\nkind='dram'\nendpoint='http://x'", "must start with ipc:// or tcp://"),
    ("[[tiers]]\nname='n'\nkind='nvme'\nrecycle_bytes='some'", "tiers[0].recycle_bytes: 'some' is not a size"),
    ("[[tiers]]\nname='a'\nkind='dram'\n[[tenants]]\nname='t'\nuids=[65534]\nquota={b='1GiB'}",
     "tenant t's quota names no tier b (tiers: a)"),
    ("[[tiers]]\nname='a'\nkind='dram'\n[[tenants]]\nname='t'\nuids=[65534]\nquota={a='lots'}",
     "tenants[0].quota.a: 'lots' is not a size"),
])
def test_each_mistake_has_its_message(text, message):
    with pytest.raises(ConfigError) as err:
        parse_config(text, "/etc/hicache-tiers/node.toml")
    assert str(err.value).startswith("/etc/hicache-tiers/node.toml")
    assert message in str(err.value)


def test_nvme_recycle_bytes_is_auto_or_a_size():
    """auto (the default) leaves the choice to the store (tiers/stores/nvme/store.py); a size is taken as it is."""
    def recycle(line):
        return parse_config(f"[[tiers]]\nname='n'\nkind='nvme'\n{line}", "f.toml").tiers[0].options.get("recycle_bytes")
    assert recycle("") is None and recycle("recycle_bytes='auto'") is None
    assert recycle("recycle_bytes='64MiB'") == 64 << 20 and recycle("recycle_bytes=0") == 0


def test_sizes():
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("512MB") == 512_000_000
    assert parse_size("64k") == 65536
    assert parse_size(123) == 123


def test_cli_reports_config_errors_with_exit_code_2(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[[tiers]]\nname='dram'\nkind='dram'\ncapacity=-1\n")
    proc = subprocess.run([sys.executable, "-m", "tiers.cli", "sglang-args", "--config", str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "bad.toml: tiers[0].capacity" in proc.stderr
    missing = subprocess.run([sys.executable, "-m", "tiers.cli", "serve", "--config", str(tmp_path / "none.toml")],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "cannot read" in missing.stderr

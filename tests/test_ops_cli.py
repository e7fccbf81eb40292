"""The operator CLI against a real daemon: status, stats, evict, clear; config check and show; exit codes."""
import json
import subprocess
import sys
import tomllib

import pytest

from tiers.cli import main
from tiers.ops.config import parse_config
from tests.support.nodes import RawPeer, dram_tier, node_toml
from tests.support.ops import REPO
from tiers.ops.node_runner import NodeRunner

NODE = node_toml(dram_tier(name="spare"), dram_tier(), write_policy="write_through")  # dram, the last, demotes nowhere


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    base = tmp_path_factory.mktemp("ops")
    runner = NodeRunner(NODE, str(base / "run"), str(base / "data"))
    runner.start("dram")  # "spare" is configured but never started: it is down
    yield runner
    assert runner.stop() == {"dram": 0}


def cli(node, *args):
    return main([*args, "--config", node.config_path, "--runtime-dir", node.runtime_dir])


def fill(node, namespace, n, size=4096):
    peer = RawPeer(node.config.tier("dram").endpoint)
    session = peer.hello(namespace)
    reply, _ = peer.call("put", s=session, keys=[f"p{i}" for i in range(n)], frames=[b"x" * size] * n)
    assert reply.get("stored") == b"\x01" * n, reply
    reply, _ = peer.call("get", s=session, keys=["p0", "absent"])  # one hit, one miss
    peer.close()


def test_status_shows_each_tier_and_exits_1_when_one_is_down(node, capsys):
    fill(node, "status-ns", 3)
    assert cli(node, "status") == 1
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["TIER", "KIND", "STATE"] and lines[0].split()[-1] == "PEERS"
    dram = next(line for line in lines if line.startswith("dram")).split()
    assert dram[:4] == ["dram", "dram", "up", "16.0"]
    assert "%" in out and "down: spare" in err
    spare = next(line for line in lines if line.startswith("spare")).split()
    assert spare[2] == "down"
    assert cli(node, "status", "--tier", "dram") == 0
    assert cli(node, "status", "--tier", "nope") == 2
    assert "no tier named 'nope'" in capsys.readouterr().err


def test_stats_json(node, capsys):
    fill(node, "stats-ns", 2)
    assert cli(node, "stats", "--json") == 1  # spare is down
    data = json.loads(capsys.readouterr().out)
    assert data["spare"] is None
    dram = data["dram"]
    for key in ("capacity_bytes", "used_bytes", "pages", "hits", "misses", "evictions", "dirty_pages", "sessions",
                "requests", "bytes_put"):
        assert key in dram, key
    assert dram["capacity_bytes"] == 16 << 20 and dram["hits"] >= 1 and dram["misses"] >= 1
    assert cli(node, "stats", "--tier", "dram") == 0
    assert "pages = " in capsys.readouterr().out


def test_evict_and_clear_through_an_admin_session(node, capsys):
    fill(node, "ev-a", 4)
    fill(node, "ev-b", 4)
    assert cli(node, "evict", "--tier", "dram", "--bytes", "8KiB", "--namespace", "ev-a") == 0
    assert "evicted 2 pages, 8192 bytes" in capsys.readouterr().out
    assert cli(node, "clear", "--tier", "dram", "--namespace", "ev-b") == 0
    assert "cleared 4 pages of namespace ev-b" in capsys.readouterr().out
    assert cli(node, "clear", "--tier", "dram", "--all") == 0
    assert "cleared" in capsys.readouterr().out
    assert cli(node, "evict", "--tier", "dram", "--bytes", "1GiB") == 0
    assert "evicted 0 pages" in capsys.readouterr().out
    # Mistakes and a tier that is down.
    assert cli(node, "evict", "--tier", "dram", "--bytes", "lots") == 2
    assert "--bytes: 'lots' is not a size" in capsys.readouterr().err
    assert cli(node, "clear", "--tier", "spare", "--all", "--timeout", "0.5") == 1
    assert "tier spare at ipc://" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        cli(node, "clear", "--tier", "dram")  # neither --namespace nor --all
    assert exit_.value.code == 2


def test_exit_codes_through_the_installed_entry_point(node):
    run = lambda *a: subprocess.run([sys.executable, "-m", "tiers.cli", *a, "--config", node.config_path,
                                     "--runtime-dir", node.runtime_dir], capture_output=True, text=True, cwd=REPO)
    assert run("status", "--tier", "dram").returncode == 0
    down = run("status")
    assert down.returncode == 1 and "down: spare" in down.stderr


@pytest.mark.parametrize("text, message", [
    ("[[tiers]\n", "not valid TOML"),
    ("[[tiers]]\nname='a'\nkind='dram'\nsize='1G'\n", "tiers[0].size is not a known key for a dram tier; allowed:"),
    ("[[tiers]]\nname='a'\nkind='dram'\ncapacity='lots'\n", "tiers[0].capacity: 'lots' is not a size"),
    ("[[tiers]]\nname='a'\nkind='floppy'\n", "tiers[0].kind: 'floppy' is not one of dram, nvme, remote"),
    ("[[tiers]]\nkind='dram'\n", "tiers[0].name is required"),
    ("[node]\nlog_level='loud'\n[[tiers]]\nname='a'\nkind='dram'\n", "node.log_level: 'loud' is not one of"),
    ("[node]\nmetrics_port=99999\n[[tiers]]\nname='a'\nkind='dram'\n", "node.metrics_port: 99999 is not a TCP port"),
    ("[node]\nmetrics_port=9400\n[[tiers]]\nname='a'\nkind='dram'\n[[tiers]]\nname='b'\nkind='dram'\nmetrics_port=9400\n",
     "tiers[1].metrics_port: 9400 is already used by tier a"),
    ("[pools]\n", "unknown section(s) pools; allowed: node, tiers"),
])
def test_config_check_names_file_key_and_what_is_allowed(tmp_path, capsys, text, message):
    path = tmp_path / "node.toml"
    path.write_text(text)
    assert main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hicache-tiers: {path}: ") and message in err, err


def test_config_check_missing_file_and_valid_summary(tmp_path, capsys):
    assert main(["config", "check", str(tmp_path / "none.toml")]) == 2
    assert "none.toml: cannot read" in capsys.readouterr().err
    path = tmp_path / "node.toml"
    path.write_text(node_toml(dram_tier("4GiB"), dram_tier("1GiB", name="more"), metrics_port=9470))
    assert main(["config", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{path}: valid" in out
    assert "tier dram: dram, 4.0 GiB, policy lru" in out and "metrics port 9471" in out


def test_config_show_applies_flags_and_environment_and_round_trips(tmp_path, capsys, monkeypatch):
    path = tmp_path / "node.toml"
    path.write_text(node_toml(dram_tier("32MiB"), runtime_dir="/from/file", data_dir="/from/file"))
    monkeypatch.setenv("HICACHE_TIERS_DATA_DIR", "/from/env")
    monkeypatch.setenv("HICACHE_TIERS_LOG_LEVEL", "warning")
    assert main(["config", "show", "--config", str(path), "--runtime-dir", "/from/flag"]) == 0
    out = capsys.readouterr().out
    shown = tomllib.loads(out)
    assert shown["node"]["runtime_dir"] == "/from/flag"
    assert shown["node"]["data_dir"] == "/from/env"
    assert shown["node"]["log_level"] == "warning"
    assert shown["tiers"][0]["endpoint"] == "ipc:///from/flag/dram.sock"
    assert shown["tiers"][0]["capacity"] == 32 << 20
    again = parse_config(out, "shown.toml")  # what show prints, the loader accepts
    assert again.tier("dram").capacity == 32 << 20 and again.runtime_dir == "/from/flag"
    # Under systemd, without runtime_dir in the file: the unit's RuntimeDirectory=.
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/hicache-tiers")
    monkeypatch.delenv("HICACHE_TIERS_LOG_LEVEL")
    assert main(["config", "show", "--config", str(tmp_path / "bare.toml")]) == 2
    (tmp_path / "bare.toml").write_text(node_toml(dram_tier()))
    assert main(["config", "show", "--config", str(tmp_path / "bare.toml")]) == 0
    shown = tomllib.loads(capsys.readouterr().out)
    assert shown["node"]["runtime_dir"] == "/run/hicache-tiers" and shown["node"]["log_level"] == "info"
    monkeypatch.setenv("HICACHE_TIERS_CONFIG", str(path))
    monkeypatch.delenv("HICACHE_TIERS_DATA_DIR")
    assert main(["config", "show"]) == 0
    assert 'data_dir = "/from/file"' in capsys.readouterr().out


def test_every_command_has_help(capsys):
    for command in (["status"], ["stats"], ["evict"], ["clear"], ["config"], ["config", "check"], ["config", "show"],
                    ["serve"], ["sglang-args"], ["install-units"]):
        with pytest.raises(SystemExit) as exit_:
            main([*command, "--help"])
        assert exit_.value.code == 0
        assert "usage: hicache-tiers" in capsys.readouterr().out

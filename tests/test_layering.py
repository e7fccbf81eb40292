"""The nevers of docs/ARCHITECTURE.md, as import-linter contracts (pyproject.toml [tool.importlinter]):
the node never imports the engine side, torch or sglang; the protocol imports no store; policies import
nothing of the node; the backend SGLang loads does not import the lab; and the parts are layers (cli, bench
and testing over ops, node, stores, wire, shm, sim, config_values, plugins, policies, logs), so no import goes
round in a circle."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_contracts_are_kept():
    if shutil.which("lint-imports") is None:
        pytest.skip("import-linter is not installed (pip install -e .[test])")
    proc = subprocess.run(["lint-imports", "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "5 kept, 0 broken" in proc.stdout

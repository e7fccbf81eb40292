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


def test_no_test_module_imports_another():
    """Shared test helpers live in tests/support/: a test module imported by another runs its module-level
    setup twice and ties the two together (docs/ARCHITECTURE.md, below the parts table)."""
    import ast
    tests = os.path.join(ROOT, "tests")
    found = []
    for name in sorted(os.listdir(tests)):
        if not (name.startswith("test_") and name.endswith(".py")):
            continue
        with open(os.path.join(tests, name), encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), name)
        for node in ast.walk(tree):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{name}: {m}" for m in modules if m.split(".")[-1].startswith("test_")]
    assert len(os.listdir(tests)) > 20 and not found, found

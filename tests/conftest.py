"""Shared fixtures: the SGLang harness (hicache_ext/lab/sglang_harness.py) on small pools.

The daemon-only suite: with only the node's dependencies installed (``pip install
-e .[test]``, no torch or sglang), the engine-side test modules are left out and
named at the end of the run.  A module is engine-side when it imports torch,
sglang, hicache_ext or tests.support.backend_env, or says ``ENGINE_SIDE = True`` (it runs
the engine in a subprocess).
"""
import ast
import importlib.util
import os

import pytest

ENGINE_MODULES = ("torch", "sglang", "hicache_ext", "tests.support.backend_env")
HAVE_ENGINE = all(importlib.util.find_spec(m) is not None for m in ("torch", "sglang"))


def _engine_side(path: str) -> bool:
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n == m or n.startswith(m + ".") for n in names for m in ENGINE_MODULES):
            return True
        if (isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "ENGINE_SIDE" for t in node.targets)
                and getattr(node.value, "value", False) is True):
            return True
    return False


_HERE = os.path.dirname(os.path.abspath(__file__))
ENGINE_SIDE_MODULES = sorted(f for f in os.listdir(_HERE) if f.startswith("test_") and f.endswith(".py")
                             and _engine_side(os.path.join(_HERE, f)))
collect_ignore = [] if HAVE_ENGINE else list(ENGINE_SIDE_MODULES)


def pytest_terminal_summary(terminalreporter):
    if collect_ignore:
        terminalreporter.write_line(
            f"daemon-only run: {len(collect_ignore)} engine-side modules not run (torch and sglang are not "
            f"installed; scripts/install.sh installs them): {', '.join(collect_ignore)}")

# The Transfer Engine logs through glog at INFO to the terminal (fd 2), past pytest's
# capture when an engine is torn down between tests; warnings and errors still show.
os.environ.setdefault("GLOG_minloglevel", "1")

# Small enough that a test file of round trips stays well under 30 s on 2 cores.
SMALL_MHA = dict(layers=4, kv_heads=2, head_dim=64, page_size=16)


@pytest.fixture
def small_mha_shape():
    """Keyword arguments for a small build_mha_host_pool."""
    return dict(SMALL_MHA)


@pytest.fixture
def file_driver(tmp_path):
    """Factory: (pool, **config) -> (backend, PageDriver) over SGLang's file backend in tmp_path."""
    from hicache_ext.lab import sglang_harness as H

    def make(pool, **config):
        extra = {"file_storage_path": str(tmp_path / "l3"), **config.pop("extra_config", {})}
        cfg = H.make_storage_config(layout=pool.layout, extra_config=extra, **config)
        backend = H.create_backend("file", cfg, pool)
        return backend, H.PageDriver(backend, pool, cfg, "file")

    return make


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups
def pytest_collection_modifyitems(items):
    """On two workers (pytest-xdist, ``-n 2 --dist loadgroup --no-loadscope-reorder``, README): a module's
    tests stay together on one worker (module fixtures start daemons once), and every module that launches
    SGLang servers shares one group, so at most one of them runs at a time (four servers take ~12 GB).
    Those modules come first, then the other long ones: a long module started last would end the run alone
    on one core."""
    def weight(item):
        return 0 if item.get_closest_marker("server") else 1 if item.get_closest_marker("slow") else 2
    module_weight = {}
    for item in items:
        name = item.module.__name__
        module_weight[name] = min(module_weight.get(name, 2), weight(item))
    items.sort(key=lambda item: module_weight[item.module.__name__])  # stable: collection order within a weight
    for item in items:
        name = item.module.__name__
        item.add_marker(pytest.mark.xdist_group("servers" if module_weight[name] == 0 else name))


# On two workers the modules that launch SGLang servers run on one of them while the other goes through the
# rest, many of whose tests hold a daemon to a deadline of a second or two.  A server's start is ~40 s of CPU
# (three processes, each importing sglang): at equal priority it takes half the machine from the other
# worker's daemons.  Started at nice SERVER_NICE (inherited by the server and the test's own daemons), the
# server modules use what the other worker leaves; the worker is put back to 0 for the modules after them.
SERVER_NICE = 10


@pytest.hookimpl(tryfirst=True)  # before the fixtures of the test (and a module's servers) are set up
def pytest_runtest_setup(item):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # one process: nothing runs beside the servers
    want = SERVER_NICE if item.get_closest_marker("server") else 0
    if os.getpriority(os.PRIO_PROCESS, 0) != want:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, want)
        except OSError:  # lowering it again needs CAP_SYS_NICE: the rest of this worker's tests stay niced
            pass

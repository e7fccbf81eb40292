"""Build kernels.c once with the system C compiler and call it through ctypes.

The library is cached under ``$HICACHE_TIERS_CACHE`` (default
``~/.cache/hicache-tiers``) by a hash of the source, so an edit rebuilds it.
Without a compiler the simulator falls back to the Python policy classes.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, Optional

import numpy as np

SOURCE = Path(__file__).with_name("kernels.c")
KERNEL_POLICIES = ("lru", "fifo", "lfu", "s3fifo", "radix-lru")  # policies with a compiled twin
_state: Dict[str, object] = {}

_i64 = ctypes.c_int64
_keys_t = np.ctypeslib.ndpointer(dtype=np.int64, ndim=1, flags="C_CONTIGUOUS")
_hits_t = np.ctypeslib.ndpointer(dtype=np.uint8, ndim=1, flags="C_CONTIGUOUS")


class KernelUnavailable(RuntimeError):
    """The compiled kernels could not be built or loaded here."""


def _cache_dir() -> Path:
    """Where built libraries are kept."""
    return Path(os.environ.get("HICACHE_TIERS_CACHE") or Path.home() / ".cache" / "hicache-tiers")


def _build(target: Path) -> None:
    """Compile SOURCE into target (atomically: temp file, then os.replace)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise KernelUnavailable("no C compiler (cc/gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", tmp, str(SOURCE)],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise KernelUnavailable(f"compiling {SOURCE.name} failed: {done.stderr.strip()[:500]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> ctypes.CDLL:
    """The kernel library, built on first use (KernelUnavailable when that is impossible)."""
    if "lib" in _state:
        return _state["lib"]  # type: ignore[return-value]
    if "error" in _state:
        raise KernelUnavailable(_state["error"])
    try:
        if not SOURCE.exists():
            raise KernelUnavailable(f"{SOURCE} is missing from this installation")
        digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
        target = _cache_dir() / f"kernels-{digest}.so"
        if not target.exists():
            try:
                _build(target)
            except OSError:  # an unwritable home: build in the temp folder instead
                target = Path(tempfile.gettempdir()) / f"hicache-tiers-{os.getuid()}" / target.name
                if not target.exists():
                    _build(target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError, KernelUnavailable) as exc:
        _state["error"] = str(exc)
        raise KernelUnavailable(str(exc)) from None
    lib.stack_distances.argtypes = [_i64, _keys_t, _i64, _keys_t]
    common = [_i64, _keys_t, _keys_t, _i64, _i64, _hits_t]
    for name in ("run_lru", "run_fifo", "run_lfu", "run_radix_lru"):
        getattr(lib, name).argtypes = common
    lib.run_s3fifo.argtypes = common + [ctypes.c_double, ctypes.c_double, _i64]
    _state["lib"] = lib
    return lib


def available() -> Optional[str]:
    """None when the kernels load, else the reason they do not."""
    try:
        load()
        return None
    except KernelUnavailable as exc:
        return str(exc)


def stack_distances(keys: np.ndarray, n_keys: int) -> np.ndarray:
    """LRU stack distance of every access (n_keys for a first access)."""
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    out = np.empty(len(keys), dtype=np.int64)
    if load().stack_distances(len(keys), keys, n_keys, out) != 0:
        raise MemoryError("stack_distances: out of memory")
    return out


def run(policy: str, keys: np.ndarray, parents: np.ndarray, n_keys: int, capacity: int, **options) -> np.ndarray:
    """Per-access hit flags of the compiled twin of policy at capacity (in keys)."""
    lib = load()
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    parents = np.ascontiguousarray(parents, dtype=np.int64)
    hits = np.zeros(len(keys), dtype=np.uint8)
    args = [len(keys), keys, parents, n_keys, int(capacity), hits]
    if policy == "s3fifo":
        args += [float(options.get("small_ratio", 0.1)), float(options.get("ghost_ratio", 0.9)),
                 int(options.get("move_threshold", 1))]
    elif options:
        raise ValueError(f"policy {policy!r} takes no options")
    try:
        function = getattr(lib, "run_" + policy.replace("-", "_"))
    except AttributeError:
        raise ValueError(f"no compiled kernel for policy {policy!r}") from None
    if function(*args) != 0:
        raise MemoryError(f"run_{policy}: out of memory")
    return hits.view(bool)

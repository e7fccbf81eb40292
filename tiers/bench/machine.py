"""The machine a run measured: CPU, cores, memory, kernel, the disk under the data directory."""
from __future__ import annotations

import os
import platform


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def cpu_model() -> str:
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def memory_gib() -> float:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / (1 << 20)
    return 0.0


def disk_of(path: str) -> str:
    """The block device holding path: name, model, size, rotational (best effort)."""
    while not os.path.exists(path):
        path = os.path.dirname(path) or "/"
    dev = os.stat(path).st_dev
    sysdir = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    if not os.path.exists(sysdir):
        return f"device {os.major(dev)}:{os.minor(dev)}"
    real = os.path.realpath(sysdir)
    name = os.path.basename(real)
    disk = real if os.path.exists(os.path.join(real, "device")) else os.path.dirname(real)
    model = _read(os.path.join(disk, "device", "model")) or _read(os.path.join(disk, "device", "vendor"))
    model = {"0x1af4": "virtio disk (0x1af4)"}.get(model, model)
    sectors = _read(os.path.join(disk, "size"))
    size = f"{int(sectors) * 512 / 1e9:.0f} GB" if sectors.isdigit() else "?"
    rotational = _read(os.path.join(disk, "queue", "rotational"))
    kind = {"0": "non-rotational", "1": "rotational"}.get(rotational, "")
    return ", ".join(p for p in (f"/dev/{name}", model or "virtual disk", size, kind) if p)


def describe(data_dir: str) -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "memory_gib": round(memory_gib(), 1),
            "kernel": platform.release(), "disk": disk_of(data_dir), "python": platform.python_version(),
            "load_average": [round(x, 2) for x in os.getloadavg()]}

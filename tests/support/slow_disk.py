"""A disk made slow for one process: a blkio read throttle on the disk under a path (no hook in the product).

The daemon is moved into a cgroup of its own (cgroup v1 blkio) whose reads
of the whole disk are limited to read_bps; its lookups, answered from memory,
stay as quick as ever, so the tier is slow, not down.  Reads that hit the
page cache are not throttled: the NVMe tier reads with O_DIRECT.  Needs root
and a blkio hierarchy: SlowDisk.unavailable(path) says why not, else None.
"""
from __future__ import annotations

import os
from typing import Optional

BLKIO = "/sys/fs/cgroup/blkio"


def _disk_of(path: str) -> Optional[str]:
    """'major:minor' of the whole disk holding path, None when it is no block device (tmpfs, overlay)."""
    dev = os.stat(path).st_dev
    sysfs = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    if not os.path.exists(sysfs):
        return None
    if os.path.exists(os.path.join(sysfs, "partition")):  # throttles apply to whole disks
        sysfs = os.path.join(os.path.realpath(sysfs), "..")
    with open(os.path.join(sysfs, "dev")) as f:
        return f.read().strip()


class SlowDisk:
    @staticmethod
    def unavailable(path: str) -> Optional[str]:
        """Why a read throttle cannot be set for path here, or None when it can."""
        if not os.path.isdir(BLKIO) or not os.access(BLKIO, os.W_OK):
            return f"no writable cgroup v1 blkio hierarchy at {BLKIO}"
        disk = _disk_of(path)
        if disk is None:
            return f"{path} is on no block device"
        probe = os.path.join(BLKIO, f"hct-probe-{os.getpid()}")
        try:  # a read-only or restricted hierarchy (a container's) refuses here, not in the test
            os.makedirs(probe, exist_ok=True)
            with open(os.path.join(probe, "blkio.throttle.read_bps_device"), "w") as f:
                f.write(f"{disk} 0")
        except OSError as exc:
            return f"cannot set a blkio read throttle on {disk}: {exc.strerror}"
        finally:
            try:
                os.rmdir(probe)
            except OSError:
                pass
        return None

    def __init__(self, pid: int, path: str, read_bps: int):
        self.pid = pid
        self.group = os.path.join(BLKIO, f"hct-slow-{os.getpid()}-{pid}")
        os.makedirs(self.group, exist_ok=True)
        with open(os.path.join(self.group, "blkio.throttle.read_bps_device"), "w") as f:
            f.write(f"{_disk_of(path)} {read_bps}")
        with open(os.path.join(self.group, "cgroup.procs"), "w") as f:
            f.write(str(pid))  # every thread of the daemon, and those it starts later

    def close(self) -> None:
        """The daemon back in the root group (if it still runs), the group removed."""
        try:
            with open(os.path.join(BLKIO, "cgroup.procs"), "w") as f:
                f.write(str(self.pid))
        except OSError:
            pass
        try:
            os.rmdir(self.group)
        except OSError:
            pass

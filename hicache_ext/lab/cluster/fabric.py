"""Nodes as Linux network namespaces on a private bridge: the network of a cluster rehearsal.

Each fabric is a "switch" namespace holding a bridge and, per node, a
namespace joined to the bridge by a veth pair.  Nothing is created in the
namespace of the caller: the bridge has no uplink, the nodes have an address
on the fabric's own /24 (10.233.X.0/24, X chosen per fabric) and no default
route, so traffic can only reach addresses this fabric assigned.  Removing
the namespaces removes everything else (veths, bridge, qdiscs).

Names carry the creating process's pid (``hct<pid>x<n>-n0``, ``hct<pid>x<n>-sw``), so
``remove_stale()`` can clean up after a run that was SIGKILLed.

Links are shaped on the node's side of its veth (what leaves the node) and
on the switch's side (what reaches it): ``tc netem`` for delay and loss,
``tbf`` for a rate alone (kernels built without netem still have it); and cut
by setting the switch's side down (a partition: the node and its processes
stay up).
"""
from __future__ import annotations

import itertools
import os
import re
import subprocess
from dataclasses import dataclass
from typing import List, Optional, Sequence

PREFIX = "hct"
_NAME = re.compile(rf"{PREFIX}(\d+)x\d+-(?:sw|n\d+)$")
_fabrics = itertools.count()


class FabricError(RuntimeError):
    """A namespace, link or qdisc could not be set up (permissions, missing ip/tc)."""


def _run(cmd: Sequence[str]) -> str:
    try:
        out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    except FileNotFoundError as exc:
        raise FabricError(f"{cmd[0]} is not installed (iproute2)") from exc
    if out.returncode != 0:
        raise FabricError(f"{' '.join(cmd)}: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout


def _probe(setup: Sequence[Sequence[str]]) -> Optional[str]:
    """Run setup commands in a throwaway namespace; None when all worked, else the first error."""
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _run(["ip", "netns", "add", probe])
    except FabricError as exc:
        return str(exc)
    try:
        for cmd in setup:
            _run([cmd[0], "-n", probe, *cmd[1:]])
    except FabricError as exc:
        return str(exc)
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


_VETH = ("ip", "link", "add", "p0", "type", "veth", "peer", "name", "p1")


def namespaces_permitted() -> Optional[str]:
    """None when this process may create network namespaces and veth pairs, else why not (tests skip with it)."""
    return _probe([_VETH, ("ip", "link", "add", "br0", "type", "bridge")])


def netem_available() -> Optional[str]:
    """None when the kernel has netem (delay, loss), else why not; rate limits use tbf and need only that."""
    return _probe([_VETH, ("tc", "qdisc", "add", "dev", "p0", "root", "netem", "delay", "1ms")])


@dataclass
class Link:
    """Shaping of one node's link (both directions): netem's delay, loss and rate."""

    delay_ms: float = 0.0
    loss_pct: float = 0.0
    rate: str = ""  # tc rate, e.g. "1gbit"; "" for none

    def qdisc(self) -> List[str]:
        """The qdisc that shapes like this: netem for delay or loss (with its rate), tbf for a rate alone,
        [] for none."""
        if self.delay_ms or self.loss_pct:
            args = ["netem"]
            if self.delay_ms:
                args += ["delay", f"{self.delay_ms}ms"]
            if self.loss_pct:
                args += ["loss", f"{self.loss_pct}%"]
            return args + (["rate", self.rate] if self.rate else [])
        if self.rate:  # tbf is in kernels built without netem
            return ["tbf", "rate", self.rate, "burst", "256kb", "latency", "50ms"]
        return []


class Fabric:
    """n node namespaces on one private bridge; a context manager that always tears down."""

    def __init__(self, nodes: int, subnet_octet: Optional[int] = None):
        if not 1 <= nodes <= 200:
            raise ValueError("a fabric has 1 to 200 nodes")
        self.tag = f"{PREFIX}{os.getpid()}x{next(_fabrics)}"  # several fabrics of one process may coexist
        self.switch = f"{self.tag}-sw"
        self.nodes = [f"{self.tag}-n{i}" for i in range(nodes)]
        octet = subnet_octet if subnet_octet is not None else 16 + os.getpid() % 224
        self.prefix = f"10.233.{octet}"
        self.addresses = [f"{self.prefix}.{i + 1}" for i in range(nodes)]
        self._up = False

    # ------------------------------------------------------------ lifecycle
    def create(self) -> "Fabric":
        try:
            _run(["ip", "netns", "add", self.switch])
            self._up = True
            _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
            for i, ns in enumerate(self.nodes):
                _run(["ip", "netns", "add", ns])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                # Created inside the node, one end moved to the switch: never in the caller's namespace.
                _run(["ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"port{i}"])
                _run(["ip", "-n", ns, "link", "set", f"port{i}", "netns", self.switch])
                _run(["ip", "-n", self.switch, "link", "set", f"port{i}", "master", "br0"])
                _run(["ip", "-n", self.switch, "link", "set", f"port{i}", "up"])
                _run(["ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0"])
                _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        except BaseException:
            self.remove()
            raise
        return self

    def remove(self) -> None:
        """Delete every namespace of this fabric (and with them its links); quiet about missing ones."""
        for ns in [*self.nodes, self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._up = False

    def __enter__(self) -> "Fabric":
        return self.create()

    def __exit__(self, *exc) -> None:
        self.remove()

    # ------------------------------------------------------------- running
    def prefix_of(self, node: int) -> List[str]:
        """The command prefix that runs a program inside node's namespace."""
        return ["ip", "netns", "exec", self.nodes[node]]

    def run(self, node: int, cmd: Sequence[str]) -> str:
        return _run([*self.prefix_of(node), *cmd])

    # --------------------------------------------------------------- links
    def shape(self, node: int, link: Link) -> None:
        """Apply link to both directions of node's link (replacing what was there); Link() clears it."""
        args = link.qdisc()
        for ns, dev in ((self.nodes[node], "eth0"), (self.switch, f"port{node}")):
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
            if args:
                _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *args])

    def partition(self, node: int) -> None:
        """Cut node off the bridge: its processes live on, nothing reaches them or leaves."""
        _run(["ip", "-n", self.switch, "link", "set", f"port{node}", "down"])

    def heal(self, node: int) -> None:
        _run(["ip", "-n", self.switch, "link", "set", f"port{node}", "up"])

    def describe(self) -> List[str]:
        return [f"{ns}  {addr}" for ns, addr in zip(self.nodes, self.addresses)]


def remove_stale() -> List[str]:
    """Delete fabrics whose creating process is gone (a run that was killed); names removed."""
    try:
        listed = _run(["ip", "netns", "list"])
    except FabricError:
        return []
    removed = []
    for line in listed.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NAME.match(name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # its creator still runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        removed.append(name)
    return removed

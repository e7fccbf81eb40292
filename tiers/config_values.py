"""Value parsers of the node configuration, and the error type that collects every mistake.

Each parser takes (value, where) and returns the value or raises ConfigError
naming where it is and what is allowed.
"""
from __future__ import annotations

import os
import re
from typing import Any, Callable, List, Optional

from tiers.plugins import BUILTIN_POLICIES, POLICY_FILE, PluginError, policy_class, policy_names

SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20,
              "mb": 10**6, "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}
WRITE_POLICIES = ("write_through", "write_back", "selective")
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    """A configuration mistake, with where it is and what is allowed.

    ``problems`` lists every mistake found in one pass (the message joins them,
    one a line), so a user fixes a file in one round, not one per error.
    """

    def __init__(self, message: str, problems: Optional[List[str]] = None):
        super().__init__(message)
        self.problems = problems or [message]


class _Problems(list):
    """Mistakes collected while parsing goes on with a stand-in value."""

    def check(self, default, parse: Callable, *args):
        try:
            return parse(*args)
        except ConfigError as exc:
            self.extend(exc.problems)
            return default

    def raise_any(self) -> None:
        if self:
            raise ConfigError("\n".join(self), list(self))


def parse_size(value: Any, where: str = "size") -> int:
    """'4GiB', '512MB', '64k' or an int -> bytes (K/M/G/T alone are binary)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value)
        if m and m.group(2).lower() in SIZE_UNITS:
            return int(float(m.group(1)) * SIZE_UNITS[m.group(2).lower()])
    raise ConfigError(f"{where}: {value!r} is not a size (examples: 4GiB, 512MB, 65536)")


def _size_or_auto(value: Any, where: str) -> Optional[int]:
    """A size, or None for "auto" (the component picks one from what it knows)."""
    return None if value == "auto" else parse_size(value, where)


def _bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{where}: {value!r} is not true or false")


def _node_default_bool(value: Any, where: str) -> Optional[bool]:
    return None if value == "node" else _bool(value, where)  # "node": inherit the [node] setting


def _str(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    raise ConfigError(f"{where}: {value!r} is not a string")


def _int(value: Any, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ConfigError(f"{where}: {value!r} is not an integer")


def _choice(*allowed: str) -> Callable[[Any, str], str]:
    def check(value: Any, where: str) -> str:
        if value in allowed:
            return value
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(allowed)}")
    return check


def _port(value: Any, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 65535:
        return value
    raise ConfigError(f"{where}: {value!r} is not a TCP port (0 turns metrics off, 1-65535)")


def _tier_port(value: Any, where: str) -> int:
    return -1 if value == -1 and not isinstance(value, bool) else _port(value, where)  # -1: node.metrics_port + index


def _list_of(parser: Callable[[Any, str], Any]) -> Callable[[Any, str], list]:
    def check(value: Any, where: str) -> list:
        if isinstance(value, list):
            return [parser(item, f"{where}[{i}]") for i, item in enumerate(value)]
        raise ConfigError(f"{where}: {value!r} is not a list")
    return check


def _endpoint(value: Any, where: str) -> str:
    if isinstance(value, str) and value.startswith(("tcp://", "ipc://")):
        return value
    raise ConfigError(f"{where}: {value!r} is not a ZeroMQ endpoint (tcp://HOST:PORT or ipc://PATH)")


def _weight(value: Any, where: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    raise ConfigError(f"{where}: {value!r} is not a positive number")


def _policy(value: Any, where: str) -> str:
    """An installed policy's name, or an absolute "/path/file.py:Class" that loads."""
    if isinstance(value, str) and POLICY_FILE.match(value):
        if not os.path.isabs(value):
            raise ConfigError(f"{where}: a policy file must be an absolute path, got {value!r}")
        try:
            policy_class(value)
        except PluginError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        return value
    if value in BUILTIN_POLICIES:  # no look at the installed plug-ins' metadata (a daemon's start)
        return value
    return _choice(*policy_names())(value, where)

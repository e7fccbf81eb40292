"""Tier kinds and eviction policies as plug-ins, found by entry point.

A package adds a tier kind or a policy with no change here:

    [project.entry-points."hicache_tiers.stores"]
    tmpfs = "my_package.tier:KIND"          # a StoreKind
    [project.entry-points."hicache_tiers.policies"]
    mru = "my_package.policy:MRUPolicy"     # an EvictionPolicy subclass

and a node configuration then says ``kind = "tmpfs"`` or ``policy = "mru"``.
The built-ins are declared the same way (``BUILTIN_STORES``,
``BUILTIN_POLICIES``: the same "module:attribute" strings), and an unknown
name lists everything installed.  Names are known without importing a
plug-in; its module is imported the first time a tier or policy of that name
is built or its options are checked.  ``tiers.testing`` holds the contract
tests a plug-in runs against itself.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Dict, List, Type

from tiers.policies.base import EvictionPolicy

STORE_GROUP = "hicache_tiers.stores"
POLICY_GROUP = "hicache_tiers.policies"
# The engine side adds its commands (demo, bench) and replay's --live runner this way, so the
# node side never imports it (import-linter checks that; pyproject.toml declares them).
COMMAND_GROUP = "hicache_tiers.commands"
LAB_GROUP = "hicache_tiers.lab"

# The built-in kinds and policies, as their entry points would name them.
BUILTIN_STORES = {
    "dram": "tiers.stores.dram:KIND",
    "nvme": "tiers.stores.nvme.store:KIND",
    "remote": "tiers.stores.remote.store:KIND",
    "mooncake_store": "tiers.stores.remote.mooncake_store:KIND",
}
BUILTIN_POLICIES = {
    "lru": "tiers.policies.basic:LRUPolicy",
    "fifo": "tiers.policies.basic:FIFOPolicy",
    "lfu": "tiers.policies.basic:LFUPolicy",
    "s3fifo": "tiers.policies.s3fifo:S3FIFOPolicy",
    "radix-lru": "tiers.policies.radix:RadixLRUPolicy",
}


class PluginError(ValueError):
    """An unknown name (the message lists what is installed) or a plug-in that does not load."""


@dataclass(frozen=True)
class StoreKind:
    """What a tier kind declares: its options and how its store is built.

    ``options``: key -> (parser, default, help), the shape of the built-in
    kinds' tables in tiers/ops/config.py; a parser takes (value, where) and
    returns the value or raises tiers.ops.config.ConfigError.  ``build(tier,
    quotas, evictions)`` returns a tiers.stores.base.PageStore for a validated
    TierConfig; a store that evicts tells ``evictions`` (an EvictionListener,
    or None) of each page it evicts, so the daemon can demote it.
    """

    name: str
    build: Callable[..., Any]
    options: Dict[str, tuple] = field(default_factory=dict)
    description: str = ""


@lru_cache(maxsize=None)
def _entry_points() -> Dict[str, Dict[str, str]]:
    """group -> name -> "module:attribute" of every installed entry point (no import), read once.

    Every distribution on the path is read, not only the first of each name:
    a stale ``*.egg-info`` in a source checkout (the current directory comes
    first on sys.path) would otherwise hide the installed metadata.  Reading
    them costs ~10 ms, and a configuration asks for every tier's kind and
    policy: once per process is enough (``rescan`` after installing at run time).
    """
    from importlib.metadata import distributions  # here: a daemon of built-in kinds and policies never reads them
    found: Dict[str, Dict[str, str]] = {}
    for dist in distributions():
        for ep in dist.entry_points:
            found.setdefault(ep.group, {}).setdefault(ep.name, ep.value)
    return found


def _installed(group: str) -> Dict[str, str]:
    return dict(_entry_points().get(group, {}))


def rescan() -> None:
    """Forget what was found and loaded (a distribution was added to the path since)."""
    for cached in (_entry_points, store_kind, _policy_class):
        cached.cache_clear()


def store_targets() -> Dict[str, str]:
    return {**_installed(STORE_GROUP), **BUILTIN_STORES}  # a built-in name cannot be taken over


def policy_targets() -> Dict[str, str]:
    return {**_installed(POLICY_GROUP), **BUILTIN_POLICIES}


def _target(builtin: Dict[str, str], group: str, name: str) -> Dict[str, str]:
    """Targets to look name up in: a built-in name alone (it cannot be taken over, so a daemon of built-in
    kinds and policies reads no distribution's metadata: 30 ms of its start), else every installed one."""
    if name in builtin:
        return {name: builtin[name]}
    return {**_installed(group), **builtin}


def _load(target: str, what: str) -> Any:
    module_name, _, attribute = target.partition(":")
    try:
        obj = importlib.import_module(module_name)
        for part in attribute.split(".") if attribute else []:
            obj = getattr(obj, part)
    except Exception as exc:  # a broken plug-in is named, not a traceback from deep inside it
        raise PluginError(f"{what} {target!r} does not load: {type(exc).__name__}: {exc}") from None
    return obj


def _named(targets: Dict[str, str], name: str, noun: str, also: str = "") -> Any:
    """Load the target installed as name (PluginError listing what is installed)."""
    if name not in targets:
        raise PluginError(f"no {noun} {name!r}; installed: {', '.join(sorted(targets))}{also}")
    return _load(targets[name], f"{noun} {name}")


@lru_cache(maxsize=None)
def store_kind(name: str) -> StoreKind:
    """The StoreKind registered as name (PluginError listing the installed kinds)."""
    targets = _target(BUILTIN_STORES, STORE_GROUP, name)
    kind = _named(targets, name, "tier kind", also=", pool")
    if not isinstance(kind, StoreKind):
        raise PluginError(f"tier kind {name}: {targets[name]} is a {type(kind).__name__}, not a StoreKind")
    return kind


# A policy in a user's own file, no package needed: "/path/to/my_policy.py:MyPolicy".
POLICY_FILE = re.compile(r"^(?P<path>.+\.py):(?P<attribute>[A-Za-z_][A-Za-z0-9_]*)$")


def absolute_policy(reference: str) -> str:
    """A FILE.py:Class reference with FILE made absolute (other processes, daemons, resolve it elsewhere);
    any other name as it is."""
    in_file = POLICY_FILE.match(reference)
    return f"{os.path.abspath(in_file['path'])}:{in_file['attribute']}" if in_file else reference


def _load_file(path: str, attribute: str, what: str) -> Any:
    """attribute of the Python file at path, imported under a name of its own (PluginError when it does not load)."""
    if not os.path.isfile(path):
        raise PluginError(f"{what}: no file {path}")
    module_name = "hicache_tiers_user_" + hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:16]
    try:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
        spec.loader.exec_module(module)
        return getattr(module, attribute)
    except Exception as exc:  # the user's code is named, not a traceback from deep inside it
        sys.modules.pop(module_name, None)
        raise PluginError(f"{what} does not load: {type(exc).__name__}: {exc}") from None


def policy_class(name: str) -> Type[EvictionPolicy]:
    """The EvictionPolicy class installed as name (any case), or in FILE.py:Class (PluginError, a ValueError,
    naming what is installed)."""
    return _policy_class(name if POLICY_FILE.match(name) else name.lower())


@lru_cache(maxsize=None)
def _policy_class(name: str) -> Type[EvictionPolicy]:
    in_file = POLICY_FILE.match(name)
    if in_file:
        cls = _load_file(in_file["path"], in_file["attribute"], f"policy {name}")
        target = name
    else:
        targets = _target(BUILTIN_POLICIES, POLICY_GROUP, name)
        cls = _named(targets, name, "eviction policy", also=", or FILE.py:Class")
        target = targets[name]
    if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)):
        raise PluginError(f"policy {name}: {target} is not an EvictionPolicy subclass")
    return cls


def policy_names() -> List[str]:
    """Names of every installed policy (built-in and plug-in), sorted."""
    return sorted(policy_targets())


def make_policy(name: str, **options) -> EvictionPolicy:
    """Build the policy installed as name, or in FILE.py:Class (PluginError naming the choices)."""
    return policy_class(name)(**options)


def command_modules() -> List[str]:
    """Modules of the installed extra commands (each has register(subparsers)), by command name."""
    return [value for _, value in sorted(_installed(COMMAND_GROUP).items())]


def lab(name: str) -> Any:
    """A module the engine side installs (e.g. "live"); PluginError saying what to install when absent."""
    targets = _installed(LAB_GROUP)
    if name not in targets:
        raise PluginError(f"{name} needs the SGLang side of hicache-tiers (scripts/install.sh without --no-engine)")
    return _load(targets[name], name)

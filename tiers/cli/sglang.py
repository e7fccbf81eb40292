"""``sglang-args``: the SGLang launch flags that connect a server to this node's daemons.

The flags must survive the two ways people use them:
- ``$(hicache-tiers sglang-args)`` unquoted on a launch line: the shell splits
  the output on whitespace and expands glob characters, but does no quote
  removal.  So the ``words`` form prints compact JSON whose strings carry
  spaces and glob characters as JSON ``\\uXXXX`` escapes: every word arrives
  intact and SGLang's ``json.loads`` gives back the same text.
- Read on a terminal and pasted: the ``shell`` form quotes the JSON for a
  POSIX shell.

SGLang 0.5.23 only honours ``"allocator": "shm"`` in inline JSON (its
``get_allocator_type`` json-loads the flag's string, so ``@file.json`` loses the
memfd host pool); the flags are therefore always inline.
"""
from __future__ import annotations

import json
import os
import shlex
import sys
from typing import Dict, List, Union

from tiers.cli.serve import add_config_args, config_from_args, config_path
from tiers.ops.config import ConfigError, NodeConfig

FORMATS = ("auto", "words", "shell", "json")

# What the unquoted shell substitution would change: IFS characters (tab and
# newline are already escaped by JSON) and pathname-expansion characters.
_SPLIT_UNSAFE = {" ": "\\u0020", "*": "\\u002a", "?": "\\u003f", "[": "\\u005b", "]": "\\u005d"}


def register(sub) -> None:
    p = sub.add_parser("sglang-args", help="print the SGLang flags that connect a server to this node",
                       description="Print the SGLang launch flags for this node's daemons, for "
                                   "python3 -m sglang.launch_server ... $(hicache-tiers sglang-args). "
                                   "Exit codes: 0 printed, 2 configuration error.")
    add_config_args(p)
    p.add_argument("--format", choices=FORMATS, default="auto",
                   help="words: for an unquoted $(...) substitution; shell: quoted, to paste; json: only "
                        "the extra-config object, for --hicache-storage-backend-extra-config \"$(...)\"; "
                        "auto: shell on a terminal, words otherwise (default %(default)s)")
    p.add_argument("--json", action="store_const", const="json", dest="format",
                   help="same as --format json")
    p.add_argument("--write-policy", choices=["write_through", "write_back", "selective"],
                   help="override the node's default write policy for this server")
    p.add_argument("--no-shm", action="store_true",
                   help="do not ask SGLang for a memfd host pool (pages then travel as frames)")
    p.add_argument("--tp-lcm-size", type=int, metavar="N",
                   help="share pages between engines of different TP sizes that all divide N (adds "
                        "tp_lcm_size and --hicache-mem-layout page_head; MLA models share without it)")
    p.add_argument("--no-prefix-keys", action="store_true",
                   help="do not ask SGLang to pass each batch's prefix keys (they link pages across "
                        "batches for prefix-aware eviction)")
    p.set_defaults(func=cmd_sglang_args)


def extra_config(config: NodeConfig, args) -> Dict[str, Union[str, int, bool]]:
    """The --hicache-storage-backend-extra-config object for this node."""
    extra: Dict[str, Union[str, int, bool]] = {
        "backend_name": "hicache_tiers",
        "module_path": "hicache_ext",
        "class_name": "TieredHiCacheStorage",
        "interface_v1": 1,
        "runtime_dir": config.runtime_dir,
    }
    if not args.no_shm:
        extra["allocator"] = "shm"
    if not args.no_prefix_keys:
        extra["hicache_storage_pass_prefix_keys"] = True
    path = config_path(args)
    if path:
        extra["tiers_config"] = os.path.abspath(path)
    if args.write_policy:
        extra["write_policy"] = args.write_policy
    if args.tp_lcm_size:
        extra["tp_lcm_size"] = args.tp_lcm_size
    return extra


def launch_flags(extra: dict) -> List[str]:
    """The SGLang arguments, one list item per argv word."""
    flags = ["--enable-hierarchical-cache", "--hicache-storage-backend", "dynamic"]
    if extra.get("tp_lcm_size"):
        flags += ["--hicache-mem-layout", "page_head"]  # the only layout SGLang splits heads for
    return flags + ["--hicache-storage-backend-extra-config", json.dumps(extra)]


def split_safe_json(extra: dict) -> str:
    """Compact JSON that an unquoted shell substitution passes through as one word."""
    for key, value in extra.items():
        if not isinstance(value, (str, int, bool)):
            raise TypeError(f"extra-config {key} must be a scalar for the words form")
    text = json.dumps(extra, separators=(",", ":"))
    # Every unsafe character is inside a string here (the object holds scalars
    # only), where a \\u escape means the same character to json.loads.
    return "".join(_SPLIT_UNSAFE.get(c, c) for c in text)


def render(extra: dict, fmt: str, isatty: bool) -> str:
    if fmt == "auto":
        fmt = "shell" if isatty else "words"
    if fmt == "json":
        return json.dumps(extra)
    flags = launch_flags(extra)
    if fmt == "shell":
        return shlex.join(flags)
    return " ".join(flags[:-1] + [split_safe_json(extra)])


def cmd_sglang_args(args) -> int:
    if args.tp_lcm_size is not None and args.tp_lcm_size < 1:
        print("hicache-tiers: --tp-lcm-size must be a positive integer", file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"hicache-tiers: {exc}", file=sys.stderr)
        return 2
    print(render(extra_config(config, args), args.format, sys.stdout.isatty()))
    return 0

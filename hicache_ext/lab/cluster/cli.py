"""``scripts/cluster``: a cluster rehearsal on one machine (network namespaces, pools, engines, scenarios)."""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time

from hicache_ext.lab.cluster.fabric import FabricError, Link, namespaces_permitted, remove_stale

SCENARIOS = ("share", "pool-kill", "pool-partition", "netem", "curve", "store-share", "store-kill",
             "store-partition")
POOLS_KIND = ("share", "pool-kill", "pool-partition", "netem")  # on a cluster of pool daemons


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/cluster",
        description="Rehearse a multi-node deployment on this machine: nodes as network namespaces on a private "
                    "bridge (no uplink, no default route), pool daemons and inference nodes (remote tier + an "
                    "engine with the real backend on a real SGLang host pool) in them. Everything is removed on "
                    "exit. Needs root (ip netns, tc). Exit codes: 0 ok, 1 a scenario failed, 2 cannot set up.")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("up", "start a cluster, print where everything runs, hold it until Ctrl-C or --hold"),
                        ("scenario", "run scenarios and print their figures")):
        s = sub.add_parser(name, help=help_, description=help_)
        s.add_argument("--pools", type=int, default=2, help="pool nodes (default 2)")
        s.add_argument("--engines", type=int, default=2, help="inference nodes, one engine each (default 2)")
        s.add_argument("--page-kib", type=int, default=256, help="page size in KiB (default 256)")
        s.add_argument("--pages", type=int, default=32, help="pages an engine writes or reads a call (default 32)")
        s.add_argument("--work-dir", help="runtime and data directories (default: a fresh temporary directory)")
        s.add_argument("--delay-ms", type=float, default=0.0, help="netem delay of every link (default 0)")
        s.add_argument("--loss-pct", type=float, default=0.0, help="netem loss of every link, percent (default 0)")
        s.add_argument("--rate", default="", help="netem rate of every link, e.g. 1gbit (default none)")
        if name == "up":
            s.add_argument("--hold", type=float, default=math.inf, help="seconds to hold it (default: until Ctrl-C)")
        else:
            s.add_argument("which", nargs="*", default=[], metavar="SCENARIO",
                           help=f"scenarios to run: {', '.join(SCENARIOS)} (default all)")
            s.add_argument("--json", action="store_true", help="one JSON object of figures on stdout")
    sub.add_parser("cleanup", help="remove fabrics left by killed runs",
                   description="Delete the network namespaces of fabrics whose creating process is gone.")
    return p


def _layout(args):
    from hicache_ext.lab.cluster.rehearsal import Layout
    if args.pools < 1 or args.engines < 1 or args.page_kib < 4 or args.pages < 1:
        raise SystemExit("scripts/cluster: --pools, --engines, --pages >= 1 and --page-kib >= 4")
    return Layout(pools=args.pools, engines=args.engines, page_bytes=args.page_kib << 10, pages=args.pages,
                  pool_block=f"{min(args.page_kib, 1024)}KiB")


def _show(name: str, figures: dict, as_json: bool) -> None:
    if not as_json:
        print(f"{name}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in figures.items()), flush=True)


def _terminate(signum, _frame):
    raise KeyboardInterrupt  # the with blocks below tear everything down


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "cleanup":
        removed = remove_stale()
        print(f"removed {len(removed)} namespace(s){': ' + ', '.join(removed) if removed else ''}")
        return 0
    unknown = [w for w in getattr(args, "which", []) if w not in SCENARIOS]
    if unknown:
        print(f"scripts/cluster: unknown scenario {unknown[0]!r}; choose from {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    why = namespaces_permitted()
    if why is not None:
        print(f"scripts/cluster: cannot create network namespaces here: {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    remove_stale()
    from hicache_ext.lab.cluster import scenarios
    from hicache_ext.lab.cluster.rehearsal import Cluster
    work = args.work_dir or tempfile.mkdtemp(prefix="hicache-cluster-")
    link = Link(args.delay_ms, args.loss_pct, args.rate)
    layout = _layout(args)
    which = list(args.which or SCENARIOS) if args.cmd == "scenario" else []
    figures: dict = {}
    out = sys.stderr if args.cmd == "scenario" and args.json else sys.stdout
    try:
        if args.cmd == "up" or [w for w in which if w in POOLS_KIND]:
            with Cluster(work, layout) as cluster:
                print("\n".join(cluster.describe()), file=out, flush=True)
                if args.cmd == "up":
                    if link.qdisc():
                        for node in range(len(cluster.fabric.nodes)):
                            cluster.fabric.shape(node, link)
                    print(f"holding; Ctrl-C to tear down (work dir {work})", flush=True)
                    time.sleep(args.hold) if math.isfinite(args.hold) else signal.pause()
                    return 0
                for name in [w for w in which if w in POOLS_KIND]:
                    print(f"scenario {name} ...", file=sys.stderr, flush=True)
                    if name == "share":
                        figures[name] = scenarios.share(cluster)
                    elif name in ("pool-kill", "pool-partition"):
                        figures[name] = scenarios.pool_failure(cluster, "kill" if name == "pool-kill" else "partition")
                    else:
                        figures[name] = scenarios.netem(cluster, link if link.qdisc() else Link(rate="1gbit"))
                    _show(name, figures[name], args.json)
        if "curve" in which:  # a cluster of its own: every tcp:// link with CurveZMQ keys
            from tiers.wire.security import generate
            keys = os.path.join(work, "keys")
            generate(keys, ("server", "client"))
            layout.curve_dir = keys
            print("scenario curve ...", file=sys.stderr, flush=True)
            with Cluster(os.path.join(work, "curve"), layout) as cluster:
                print("\n".join(cluster.describe()), file=out, flush=True)
                figures["curve"] = scenarios.curve(cluster)
                _show("curve", figures["curve"], args.json)
        store = [w for w in which if w.startswith("store-")]
        if store:  # kind mooncake_store: a mooncake_master on node 0, each inference node a store client
            layout.curve_dir, layout.kind = None, "mooncake_store"
            with Cluster(os.path.join(work, "store"), layout) as cluster:
                print("\n".join(cluster.describe()), file=out, flush=True)
                for name in store:
                    print(f"scenario {name} ...", file=sys.stderr, flush=True)
                    if name == "store-share":
                        figures[name] = scenarios.share(cluster, salt=500 + len(figures))
                    else:
                        figures[name] = scenarios.store_node_failure(cluster, name.split("-")[1])
                    _show(name, figures[name], args.json)
        if args.json:
            print(json.dumps(figures))
        failed = [n for n, f in figures.items() if f.get("wrong_pages") or f.get("keyless_hello_answered")]
        return 1 if failed else 0
    except KeyboardInterrupt:
        return 0
    except (FabricError, RuntimeError, TimeoutError, AssertionError) as exc:
        print(f"scripts/cluster: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

"""``demo``: the main job on one machine, no GPU needed (registration only; the work is in hicache_ext.lab.demo)."""
from __future__ import annotations

from tiers.cli import positive_int


def register(sub) -> None:
    p = sub.add_parser(
        "demo", help="start the node's daemons and drive real SGLang pages through the backend",
        description="Start this node's tier daemons (embedded default unless --config), build a real SGLang "
                    "host pool shaped like Llama-3-8B (32 layers, 8 KV heads, head dim 128, bf16, 64-token "
                    "pages: 8 MiB a page), write and read pages through the backend with SGLang's own "
                    "controller page functions, verify every byte, and print pages, hits and GB/s.")
    p.add_argument("--config", metavar="FILE", help="node configuration (TOML); default: the embedded default")
    p.add_argument("--runtime-dir", metavar="DIR", help="sockets (default: a fresh temporary directory)")
    p.add_argument("--data-dir", metavar="DIR", help="NVMe data (default: a fresh temporary directory)")
    p.add_argument("--use-running", action="store_true",
                   help="use daemons already running under --runtime-dir instead of starting them")
    p.add_argument("--pages", type=positive_int, default=256, help="pages to write and read (default 256 = 2 GiB)")
    p.add_argument("--layout", default="page_first", choices=["page_first", "layer_first", "page_first_direct"],
                   help="host pool layout (default page_first)")
    p.add_argument("--no-shm", action="store_true", help="host pool without memfd: pages travel as ZeroMQ frames")
    p.add_argument("--write-policy", choices=["write_through", "write_back", "selective"],
                   help="override the node's write policy")
    p.add_argument("--layers", type=positive_int, default=32, help="model layers (default 32)")
    p.add_argument("--kv-heads", type=positive_int, default=8, help="KV heads (default 8)")
    p.add_argument("--head-dim", type=positive_int, default=128, help="head dimension (default 128)")
    p.add_argument("--page-tokens", type=positive_int, default=64, help="tokens per page (default 64)")
    p.add_argument("--repeat", type=positive_int, default=3, help="write/read rounds; figures are medians (default 3)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from hicache_ext.lab.demo import run_demo  # torch and sglang load only here
    return run_demo(args)

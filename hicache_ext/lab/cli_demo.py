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
    server = p.add_argument_group("--server: a real SGLang server (python -m sglang.launch_server) on this machine")
    server.add_argument("--server", action="store_true",
                        help="launch a real SGLang server with a small random Llama, send a shared-prefix workload "
                             "and print where each request's cached tokens came from and its TTFT")
    server.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="the server's device (default cpu)")
    server.add_argument("--requests", type=positive_int, default=4, help="requests a round (default 4)")
    server.add_argument("--prefix-tokens", type=positive_int, default=1024,
                        help="tokens every request of the workload shares (default 1024)")
    server.add_argument("--suffix-tokens", type=positive_int, default=64,
                        help="tokens of each request's own (default 64)")
    server.add_argument("--model-layers", type=positive_int, default=8, help="layers of the random Llama (default 8)")
    server.add_argument("--model-hidden", type=positive_int, default=512,
                        help="hidden size of the random Llama; heads = hidden/64, KV heads = hidden/128 (default 512)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    if args.server:
        from hicache_ext.lab.server_demo import run_server_demo  # sglang's server loads only here
        return run_server_demo(args)
    from hicache_ext.lab.demo import run_demo  # torch and sglang load only here
    return run_demo(args)

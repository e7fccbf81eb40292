"""A real SGLang server with this backend, started the way users start it.

``python -m sglang.launch_server`` runs as a child process with the flags that
``hicache-tiers sglang-args`` prints for a node, serving a small random Llama
that ``random_llama`` writes with ``transformers`` (no download, loads in
seconds).  The end-to-end tests, ``hicache-tiers demo --server`` and the TTFT
bench drive it over HTTP (``/generate`` with ``input_ids``, ``/flush_cache``)
and read SGLang's own answer to where a prompt's cached tokens came from
(``meta_info.cached_tokens_details``: device, host, storage).

On a machine without a GPU (``device="cpu"``) SGLang needs two things no
package registry serves: the CPU build of ``sgl_kernel`` and pure-torch host
<-> device copies for its HiCache host pool.  Test stand-ins for both live in
the source tree (``tests/cpu_server/stand_ins``); the server's PYTHONPATH
starts with that directory, and nothing of it is part of the product.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

STAND_INS = Path(__file__).resolve().parents[2] / "tests" / "cpu_server" / "stand_ins"
READY_LINE = "The server is fired up and ready to roll"
BIND_FAILED = "error while attempting to bind on address"  # uvicorn's line when the port is taken
BIND_TRIES = 3  # a port of our choosing taken meanwhile: start again on another


class ServerError(RuntimeError):
    """The server did not start, died, or answered a request with an error."""


@dataclass(frozen=True)
class ModelSpec:
    """A random Llama: small enough to load in seconds, real enough to serve."""
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 1024
    seed: int = 0
    # Weights drawn wider than transformers' default 0.02, so the next token
    # depends on the whole context: a wrong KV page changes what is generated.
    init_range: float = 0.3
    max_positions: int = 16384

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bf16

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def random_llama(spec: ModelSpec, root: Path) -> Path:
    """Write spec's model under root (once per spec); the model directory."""
    path = Path(root) / f"llama-{spec.layers}l-{spec.hidden}h-{spec.digest()}"
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                         num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                         num_key_value_heads=spec.kv_heads, max_position_embeddings=spec.max_positions,
                         initializer_range=spec.init_range, torch_dtype="bfloat16")
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    partial = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(partial)
    os.replace(partial, path)
    return path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, below the kernel's ephemeral range: a port the kernel hands out
    (bind to port 0, an outgoing connection: the Transfer Engine, ZeroMQ) can then never take it between
    this check and the server's bind, as one did in a suite run (the server waited 300 s without HTTP)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low = int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = random.randrange(max(1024, low // 2), low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # every try taken: any free port
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerOptions:
    """The launch line's choices; defaults are the CPU route of the issue that introduced this."""
    model: Path
    node_config: Path  # the node configuration whose daemons the server talks to
    runtime_dir: Optional[Path] = None  # the daemons' sockets, when not the configuration's (NodeRunner's)
    device: str = "cpu"
    page_size: int = 16
    max_total_tokens: int = 1024
    hicache_ratio: float = 2.0  # host pool = ratio x device pool
    mem_layout: str = "page_first_direct"  # the CPU route's direct copies serve it and layer_first
    host_write_policy: str = "write_through"  # SGLang's --hicache-write-policy (device -> host)
    prefetch_policy: str = "timeout"
    write_policy: Optional[str] = None  # our backend's (host -> tiers); default: the node's
    extra_config: Dict[str, object] = field(default_factory=dict)  # more backend keys (tests only)
    extra_args: Sequence[str] = ()
    env: Dict[str, str] = field(default_factory=dict)
    port: int = 0
    # SGLang's own `file` backend writing here instead of ours (node_config unused): the bench's reference
    file_backend_dir: Optional[Path] = None
    # Another backend SGLang loads (``dynamic``, this extra config) instead of ours: the bench's floor
    reference_backend: Optional[Dict[str, object]] = None


def sglang_flags(node_config: Path, write_policy: Optional[str] = None, runtime_dir: Optional[Path] = None) -> List[str]:
    """The flags ``hicache-tiers sglang-args`` prints for node_config, run as users run it."""
    cmd = [sys.executable, "-m", "tiers.cli", "sglang-args", "--config", str(node_config), "--format", "shell"]
    if runtime_dir:
        cmd += ["--runtime-dir", str(runtime_dir)]
    if write_policy:
        cmd += ["--write-policy", write_policy]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise ServerError(f"hicache-tiers sglang-args failed: {out.stderr.strip()}")
    import shlex
    return shlex.split(out.stdout)


@dataclass
class Generation:
    """One /generate answer: the tokens, where SGLang says the cached prefix came from, and the time."""
    output_ids: List[int]
    seconds: float
    prompt_tokens: int
    cached: Dict[str, int]  # device, host, storage (SGLang's cached_tokens_details)
    # SGLang's own timings of the request, seconds (with --enable-metrics): queue_time, storage_prefetch_wait,
    # storage_staging_wait, and forward (prefill_finished_time - forward_entry_time)
    timings: Dict[str, float] = field(default_factory=dict)

    @property
    def cached_total(self) -> int:
        return sum(self.cached.values())


class SGLangServer:
    """One ``sglang.launch_server`` child process serving a model with this backend."""

    def __init__(self, options: ServerOptions, log_path: Path):
        self.options = options
        self.log_path = Path(log_path)
        self.port = options.port or free_port()
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> List[str]:
        o = self.options
        if o.file_backend_dir is not None:
            flags = ["--enable-hierarchical-cache", "--hicache-storage-backend", "file"]
        elif o.reference_backend is not None:
            flags = ["--enable-hierarchical-cache", "--hicache-storage-backend", "dynamic",
                     "--hicache-storage-backend-extra-config", json.dumps(o.reference_backend)]
        else:
            flags = sglang_flags(o.node_config, o.write_policy, o.runtime_dir)
        if o.extra_config and o.file_backend_dir is None and o.reference_backend is None:
            at = flags.index("--hicache-storage-backend-extra-config") + 1
            flags[at] = json.dumps({**json.loads(flags[at]), **o.extra_config})
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(o.model),
               "--host", "127.0.0.1", "--port", str(self.port), "--device", o.device,
               "--skip-tokenizer-init", "--page-size", str(o.page_size),
               "--max-total-tokens", str(o.max_total_tokens), "--hicache-ratio", str(o.hicache_ratio),
               "--hicache-mem-layout", o.mem_layout, "--hicache-write-policy", o.host_write_policy,
               "--hicache-storage-prefetch-policy", o.prefetch_policy,
               "--enable-cache-report", "--log-level", "info", *flags]
        if o.device == "cpu":
            cmd += ["--attention-backend", "torch_native", "--hicache-io-backend", "direct",
                    "--cuda-graph-backend-decode=disabled", "--cuda-graph-backend-prefill=disabled"]
        return cmd + list(o.extra_args)

    def environment(self) -> Dict[str, str]:
        env = {**os.environ, **self.options.env, "PYTHONUNBUFFERED": "1"}
        if self.options.file_backend_dir is not None:
            env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(self.options.file_backend_dir)
        if self.options.device == "cpu":
            if not (STAND_INS / "sgl_kernel").is_dir():
                raise ServerError(f"SGLang on CPU needs the test stand-ins of a source checkout ({STAND_INS}); "
                                  "run from a clone of hicache-tiers")
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            env["PYTHONPATH"] = os.pathsep.join([str(STAND_INS), *filter(None, [env.get("PYTHONPATH")])])
        return env

    def start(self, timeout: float = 300.0) -> "SGLangServer":
        """Launch and wait for the ready line; a port of our choosing that another process took in the
        meantime is replaced and the server started again (at most BIND_TRIES times)."""
        for attempt in range(BIND_TRIES):
            if self._start_once(timeout):
                return self
            if self.options.port or attempt == BIND_TRIES - 1:
                break
            self.port = free_port()
        raise ServerError(f"sglang could not bind port {self.port}:\n{self.log_tail()}")

    def _start_once(self, timeout: float) -> bool:
        """True once ready, False when its HTTP server could not bind the port (stopped again)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        start = self.log_path.stat().st_size
        # Its own session, so stop() reaches the scheduler and detokenizer children too.
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.environment(),
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"sglang exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            started = self._log_since(start)
            if READY_LINE in started:
                return True
            if BIND_FAILED in started:  # its HTTP server gave up, the rest keeps running: no use waiting
                self.stop()
                return False
            time.sleep(0.5)
        self.stop()
        raise ServerError(f"sglang was not ready within {timeout:.0f} s:\n{self.log_tail()}")

    def _log_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as fh:
            fh.seek(offset)
            return fh.read().decode(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _http(self, path: str, body: Optional[dict] = None, method: str = "POST", timeout: float = 600.0):
        data = json.dumps(body).encode() if body is not None else b""
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                return reply.read()
        except urllib.error.HTTPError as exc:
            raise ServerError(f"{path}: HTTP {exc.code}: {exc.read().decode(errors='replace')[:500]}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            raise ServerError(f"{path}: {exc}; server alive: {self.alive()}\n{self.log_tail(15)}") from None

    def generate(self, input_ids: Sequence[int], max_new_tokens: int = 1, timeout: float = 600.0) -> Generation:
        """Greedy generation; with max_new_tokens=1 its time is the time to first token."""
        body = {"input_ids": list(input_ids),
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}}
        began = time.perf_counter()
        answer = json.loads(self._http("/generate", body, timeout=timeout))
        seconds = time.perf_counter() - began
        meta = answer["meta_info"]
        details = meta.get("cached_tokens_details") or {}
        cached = {where: int(details.get(where, 0)) for where in ("device", "host", "storage")}
        return Generation(list(answer["output_ids"]), seconds, int(meta["prompt_tokens"]), cached, _timings(meta))

    def metrics(self, timeout: float = 30.0) -> str:
        """SGLang's Prometheus text (GET /metrics; the server needs --enable-metrics)."""
        return self._http("/metrics", method="GET", timeout=timeout).decode(errors="replace")

    def flush_cache(self, timeout: float = 60.0) -> None:
        """Drop the device and host caches (SGLang's /flush_cache); the node's tiers keep their pages."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._http("/flush_cache", timeout=timeout)
                return
            except ServerError:  # refused while requests are still running
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def signal(self, signum: int) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signum)

    def stop(self, grace: float = 1.0) -> Optional[int]:
        """SIGTERM the server's process group, SIGKILL what is left after grace seconds.

        The scheduler (our backend in it) ends on the SIGTERM at once; SGLang's launcher then takes its
        child's end for a crash and sleeps 5 s "to let GPU activity settle" before it exits, which nothing
        here needs (it cost every server a test or the bench stops 5 s)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # children the server left behind
        except OSError:
            pass
        self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> "SGLangServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def _timings(meta: dict) -> Dict[str, float]:
    """The numeric timings of a /generate meta_info that SGLang adds with --enable-metrics."""
    out = {name: float(meta[name]) for name in ("queue_time", "storage_prefetch_wait", "storage_staging_wait")
           if isinstance(meta.get(name), (int, float))}
    entry, finished = meta.get("forward_entry_time"), meta.get("prefill_finished_time")
    if isinstance(entry, (int, float)) and isinstance(finished, (int, float)):
        out["forward"] = float(finished) - float(entry)
    return out


def shared_prefix_prompts(count: int, prefix_tokens: int, suffix_tokens: int, vocab: int, seed: int = 0) -> List[List[int]]:
    """count prompts that share their first prefix_tokens (ids 1..vocab-1, explicit seed)."""
    import random
    rng = random.Random(seed)
    prefix = [rng.randrange(1, vocab) for _ in range(prefix_tokens)]
    return [prefix + [rng.randrange(1, vocab) for _ in range(suffix_tokens)] for _ in range(count)]

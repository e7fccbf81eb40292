"""What the real-server tests share (tests/test_server_e2e.py): nodes of real tier daemons, prompts,
SGLang's page keys, waiting for pages to reach the tiers, and several servers started at once.

Nothing here is a mock: the daemons are ``NodeRunner`` processes, the servers are
``python -m sglang.launch_server`` (hicache_ext/lab/server.py), and whether a tier
holds a page is asked of that tier's daemon with SGLang's own key for the page.
"""
from __future__ import annotations

import os
import random
import threading
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence

from hicache_ext.lab.server import Generation, SGLangServer, ServerOptions
from hicache_ext.settings import derive_namespace
from tests.support.nodes import eventually, node_toml
from tiers.ops.node_runner import NodeRunner
from tiers.wire.client import Deadlines, TierClient

PAGE = 16  # ServerOptions.page_size
NEW_TOKENS = 8  # greedy tokens generated per request
VOCAB = 1024  # ModelSpec.vocab
# The test-only SGLang plug-in (tests/server_plugin): MLA models on the CPU route.
PLUGIN_DIR = Path(__file__).resolve().parent.parent / "server_plugin"
L3_WAIT = 60.0  # seconds for an asynchronous backup to reach the tiers (2 shared cores, several servers)


def prompt(seed: int, tokens: int = 512) -> List[int]:
    """tokens random ids (1..VOCAB-1) from seed: prompts of different seeds share no page."""
    rng = random.Random(f"server-e2e-{seed}")
    return [rng.randrange(1, VOCAB) for _ in range(tokens)]


def hit_tokens(ids: Sequence[int]) -> int:
    """The most tokens of ids SGLang reuses: whole pages, less the page holding the token to compute."""
    return (len(ids) // PAGE - 1) * PAGE


def page_keys(ids: Sequence[int]) -> List[str]:
    """SGLang's storage keys of the pages a hit on ids can use (its own hash chain, no namespace seed)."""
    from sglang.srt.mem_cache.utils import get_hash_str
    return list(get_hash_str(list(ids[:hit_tokens(ids)]), None, page_size=PAGE))


def namespace(model: Path, layout: str, mla: bool = False) -> str:
    """The namespace the backend derives for a TP-1 bf16 server of model (hicache_ext.settings)."""
    config = SimpleNamespace(model_name=str(model), is_mla_model=mla, tp_rank=0, tp_size=1, pp_size=1,
                             extra_config={"interface_v1": 1})
    pool = SimpleNamespace(page_size=PAGE, dtype="torch.bfloat16", layout=layout)
    return derive_namespace(config, pool)


class Node:
    """One node's tier daemons; runtime and data directories are in its TOML, where sglang-args reads them."""

    def __init__(self, root: Path, *tiers: dict, **node):
        root.mkdir(parents=True, exist_ok=True)
        run, data = root / "run", root / "data"
        text = node_toml(*tiers, runtime_dir=str(run), data_dir=str(data), **node)
        self.runner = NodeRunner(text, str(run), str(data))
        self.tiers = [t["name"] for t in tiers]

    @property
    def config_path(self) -> Path:
        return Path(self.runner.config_path)

    def start(self, tier: Optional[str] = None) -> "Node":
        self.runner.start(tier)
        return self

    def stop(self, tier: Optional[str] = None) -> Dict[str, int]:
        return self.runner.stop(tier)

    def pid(self, tier: str) -> int:
        return self.runner.pid(tier)

    def _client(self, tier: str, ns: str) -> TierClient:
        return TierClient(tier, self.runner.config.tier(tier).endpoint, ns, "server-e2e",
                          Deadlines(base=2.0, lookup=2.0))

    def held(self, tier: str, ns: str, keys: List[str]) -> Optional[List[bool]]:
        """Which keys tier holds in namespace ns (None: the tier did not answer)."""
        client = self._client(tier, ns)
        try:
            flags = client.lookup(keys)
            return None if flags is None else [b == 1 for b in flags]
        finally:
            client.close()

    def count(self, tier: str, ns: str, keys: List[str]) -> int:
        """How many of keys tier holds in ns (the tier must answer: a silent tier holds nothing provably)."""
        held = self.held(tier, ns, keys)
        assert held is not None, f"tier {tier} did not answer a lookup"
        return sum(held)

    def stats(self, tier: str) -> dict:
        """The tier's counters as the operator sees them (every namespace)."""
        client = self._client(tier, "_admin")
        try:
            stats = client.stats()
        finally:
            client.close()
        assert stats is not None, f"tier {tier} did not answer a stats request"
        return stats

    def ns_stats(self, tier: str, ns: str) -> dict:
        """pages, bytes, hits, evictions of namespace ns in tier ({} when it has none)."""
        return self.stats(tier)["per_namespace"].get(ns, {})

    def hits(self, tier: str, ns: str) -> int:
        return self.ns_stats(tier, ns).get("hits", 0)

    def holds_all(self, ns: str, keys: List[str], tiers: Sequence[str]) -> bool:
        """Whether every tier named answers that it holds every key."""
        return all(sum(self.held(t, ns, keys) or []) == len(keys) for t in tiers)

    def wait_held(self, ns: str, keys: List[str], tiers: Sequence[str], within: float = L3_WAIT) -> None:
        """Until every tier named holds every key (SGLang backs pages up after the request returned)."""
        if not eventually(lambda: self.holds_all(ns, keys, tiers), within=within, step=0.2):
            seen = {t: self.held(t, ns, keys) and sum(self.held(t, ns, keys)) for t in tiers}
            namespaces = {t: sorted(self.stats(t)["per_namespace"]) for t in tiers}
            raise AssertionError(f"after {within:.0f} s the tiers hold {seen} of {len(keys)} pages of namespace "
                                 f"{ns}; namespaces they hold: {namespaces}")

    def delete(self, ns: str, keys: List[str]) -> None:
        """Take keys out of every tier (as if they had never been written)."""
        for tier in self.tiers:
            client = self._client(tier, ns)
            try:
                client.delete(keys)
            finally:
                client.close()
            assert self.count(tier, ns, keys) == 0, f"tier {tier} still holds deleted pages"

    def evict_namespace(self, tier: str, ns: str) -> int:
        """The operator evicts all of ns from tier (the store's eviction path: write-back and selective
        pages that qualify go down); the pages evicted."""
        client = self._client(tier, "_admin")
        try:
            reply = client.call("evict", 5.0, bytes=1 << 40, ns=ns)
        finally:
            client.close()
        assert reply is not None and reply.header.ok, reply and reply.header
        return reply.header.evicted_pages


# The backend's deadlines for these tests (defaults: 1 s a call, 0.5 s a lookup). The module's two cores are
# shared by up to four servers, two of them starting (a start keeps a core busy for a minute), and the
# daemons: a daemon can go a second without the CPU, and then refuses the whole write_through backup of a
# prompt ("deadline passed during the copy"), which SGLang then drops. The tests are about where pages go
# and what comes back, not about latency on a starved machine.
TEST_DEADLINES = {"deadline_base_s": 5.0, "lookup_timeout_s": 2.0}


def server_options(model: Path, node: Node, mla: bool = False, **kw) -> ServerOptions:
    """The CPU route's options, with the test plug-in on the servers' PYTHONPATH (mla: its absorbed-MLA
    dispatch for torch_native on, and the layer_first layout its MLA host pool copies support).

    ``--sleep-on-idle``: an idle SGLang scheduler otherwise spins a whole core (measured: 99% of a core
    idle, 2% with it), and the module keeps up to four servers alive on two cores."""
    env = {"PYTHONPATH": os.pathsep.join([str(PLUGIN_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if mla:
        env["HICACHE_LAB_MLA_ABSORB"] = "1"
        kw.setdefault("mem_layout", "layer_first")
    kw["extra_args"] = ("--sleep-on-idle", *kw.get("extra_args", ()))
    kw["extra_config"] = {**TEST_DEADLINES, **kw.get("extra_config", {})}
    return ServerOptions(model=model, node_config=node.config_path, env=env, **kw)


def models_dir() -> Path:
    """Where the random models are written once and kept (HICACHE_TEST_MODELS, else ~/.cache): each is
    named by a digest of its parameters, so a changed parameter writes a new one."""
    return Path(os.environ.get("HICACHE_TEST_MODELS") or Path.home() / ".cache" / "hicache-tiers" / "test-models")


MLA_CONFIG = dict(
    vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=32, qk_nope_head_dim=32,
    v_head_dim=32, max_position_embeddings=16384, initializer_range=0.3,
    # Dense MLP in every layer (the MoE fields are there only because the config requires them).
    first_k_dense_replace=100, moe_layer_freq=1, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
    moe_intermediate_size=128,
    # SGLang's CPU rotary embedding for DeepSeek models takes only its deepseek_yarn kind (factor 1: no scaling).
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 1.0,
                     "original_max_position_embeddings": 16384, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                     "mscale_all_dim": 1.0})


def random_mla(root: Path, seed: int = 0) -> Path:
    """A small random DeepSeek-V2 (MLA attention: one 64-wide latent + 32 rope dims a token) under root."""
    import hashlib
    import json
    digest = hashlib.sha256(json.dumps([MLA_CONFIG, seed], sort_keys=True).encode()).hexdigest()[:12]
    path = Path(root) / f"mla-2l-256h-{digest}"
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    config = DeepseekV2Config(**MLA_CONFIG, torch_dtype="bfloat16")
    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(config).to(torch.bfloat16)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(partial)
    try:
        os.replace(partial, path)
    except OSError:  # another run wrote it meanwhile
        if not (path / "config.json").exists():
            raise
        import shutil
        shutil.rmtree(partial, ignore_errors=True)
    return path


class Fleet:
    """Servers started in the background, in launch order, with a bound on how many start at once (a start
    is ~60 s of CPU here, most of it importing SGLang in three processes) and on how many are alive (each
    is ~2 GB: SGLang on CPU checks the machine's free memory as it starts, and fails when it runs short);
    retire() makes room.  A server launched with ``after`` starts only once that one was retired: a
    restart of it, on the same daemons."""

    def __init__(self, log_dir: Path, max_alive: int = 4, max_starting: int = 2):
        self.log_dir = log_dir
        self.max_alive, self.max_starting = max_alive, max_starting
        self._futures: Dict[str, Future] = {}
        self._servers: Dict[str, SGLangServer] = {}
        self._after: Dict[str, Optional[str]] = {}
        self._queue: List[str] = []  # launched, not started yet
        self._alive: set = set()  # started or starting, not retired
        self._retired: set = set()
        self._stopping: List[threading.Thread] = []  # retire()'s stops
        self._starting = 0
        self._closed = False
        self._lock = threading.Lock()

    def launch(self, name: str, options: ServerOptions, after: Optional[str] = None) -> None:
        with self._lock:
            self._servers[name] = SGLangServer(options, self.log_dir / f"{name}.log")
            self._futures[name] = Future()
            self._after[name] = after
            self._queue.append(name)
        self._pump()

    def _pump(self) -> None:
        with self._lock:
            ready = []
            for name in list(self._queue):
                if self._closed or len(self._alive) >= self.max_alive or self._starting >= self.max_starting:
                    break
                if self._after[name] is not None and self._after[name] not in self._retired:
                    continue
                self._queue.remove(name)
                self._alive.add(name)
                self._starting += 1
                ready.append(name)
        for name in ready:
            threading.Thread(target=self._start, args=(name,), name=f"start-{name}", daemon=True).start()

    def _start(self, name: str) -> None:
        server, future = self._servers[name], self._futures[name]
        try:
            server.start()
            future.set_result(server)
        except BaseException as exc:  # reported by get()
            future.set_exception(exc)
        finally:
            with self._lock:
                self._starting -= 1
        self._pump()

    def get(self, name: str, timeout: float = 900.0) -> SGLangServer:
        """name's server once it is up (its start's error if it failed)."""
        return self._futures[name].result(timeout)

    def retire(self, name: str) -> None:
        """Stop name's server for good, in the background (SGLang takes seconds to shut down); the next
        server launched starts once it has stopped."""
        with self._lock:
            queued = name in self._queue
            if queued:
                self._queue.remove(name)
        if queued:
            self._futures[name].set_exception(RuntimeError(f"server {name} was retired before it started"))
            self._retired_now(name)
            return

        def stop():
            try:
                self._futures[name].result(900)
            except BaseException:
                pass
            self._servers[name].stop()
            self._retired_now(name)
        thread = threading.Thread(target=stop, name=f"stop-{name}", daemon=True)
        self._stopping.append(thread)
        thread.start()

    def _retired_now(self, name: str) -> None:
        with self._lock:
            self._alive.discard(name)
            self._retired.add(name)
        self._pump()

    def stop_all(self) -> None:
        """Stop every server, those still starting included (a failed run need not wait for their starts)."""
        with self._lock:
            self._closed = True
            waiting, self._queue = self._queue, []
        for name in waiting:
            self._futures[name].set_exception(RuntimeError(f"server {name} never started (the fleet closed)"))
        for name, future in list(self._futures.items()):
            if name in waiting:
                continue
            server = self._servers[name]
            # A start in progress has its process (or is about to); stopping it ends the start with an error.
            eventually(lambda: server.proc is not None or future.done(), within=60, step=0.1)
            server.stop()
            try:
                future.result(120)
            except BaseException:
                pass
            server.stop()
        for thread in self._stopping:
            thread.join(60)


def cold(server: SGLangServer, ids: Sequence[int]) -> Generation:
    """A prompt's first request: nothing cached anywhere, so this is the reference output."""
    gen = server.generate(ids, NEW_TOKENS)
    assert gen.cached == {"device": 0, "host": 0, "storage": 0}, gen
    assert len(gen.output_ids) == NEW_TOKENS
    return gen


def storage_hit(server: SGLangServer, ids: Sequence[int], reference: Generation) -> Generation:
    """After /flush_cache, ids is served from L3 (all of what a hit can use) with the reference's tokens."""
    server.flush_cache()
    gen = server.generate(ids, NEW_TOKENS)
    assert gen.cached == {"device": 0, "host": 0, "storage": hit_tokens(ids)}, gen
    assert gen.output_ids == reference.output_ids
    return gen

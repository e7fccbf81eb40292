"""The backend in a real SGLang server: ``python -m sglang.launch_server`` on CPU, real tier daemons, /generate.

Every answer is checked twice: SGLang's own account of where the cached prefix
came from (``cached_tokens_details``: device, host, storage = our L3), and the
generated tokens, which must equal the prompt's cold output (the random models
make the next token depend on the whole context, so a wrong page shows).

Servers (launched at module setup, shared by the tests; hicache_ext/lab/server.py, tests/support/server.py):
  a, b  the Llama, write_through, page_first_direct, node 1 (DRAM + NVMe); b runs beside a
  c     another Llama (seed 1, same shapes), selective, layer_first, node 1
  m     a small random DeepSeek-V2 (MLA), write_back, layer_first, node 2 (DRAM + NVMe)
  a2    a again: a new process with a's options, started once a has stopped
Each policy and each layout runs on one server at least, and each server's start (~40 s of CPU on these
two cores) is the module's largest cost: no server is here for one option alone. At most four are alive
at once (about 2 GB each) and two start at once; a server no later test of the run uses is stopped (USES),
which lets the next one start.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

pytest.importorskip("uvicorn", reason="sglang.launch_server's HTTP server (uvicorn) is not installed")
pytest.importorskip("fastapi", reason="sglang.launch_server's HTTP server (fastapi) is not installed")

from hicache_ext.lab.server import ModelSpec, random_llama  # noqa: E402
from tests.support.nodes import dram_tier, eventually, nvme_tier, thaw  # noqa: E402
from tests.support.server import (NEW_TOKENS, Fleet, Node, cold, hit_tokens, models_dir, namespace,  # noqa: E402
                                  page_keys, prompt, random_mla, server_options, storage_hit)

pytestmark = pytest.mark.server

REQUEST_BOUND = 60.0  # seconds any request may take while tiers crash or freeze
TOUCHED = 5.0  # seconds for DRAM's counters to show pages an engine read through its page directory
# The servers each test uses, in the order the tests run.
USES = {
    "test_hit_ladder_device_host_storage": ["a"],
    "test_two_servers_share_one_nodes_pages_and_models_never_mix": ["a", "b", "c"],
    "test_node_daemons_restart_between_requests": ["a"],
    "test_requests_complete_while_tiers_crash_and_freeze": ["a"],
    "test_selective_writes_below_only_pages_read_enough": ["c"],
    "test_write_back_with_layer_first": ["m"],
    "test_mla_model_hits_l3_with_its_cold_tokens": ["m"],
    "test_a_restarted_server_reads_its_predecessors_pages": ["a2"],
}


class Lab:
    def __init__(self, root):
        models = models_dir()
        self.llama = random_llama(ModelSpec(), models)
        self.other = random_llama(ModelSpec(seed=1), models)  # same shapes, other weights
        self.mla = random_mla(models)
        self.n1 = Node(root / "n1", dram_tier("64MiB"), nvme_tier("256MiB"))
        self.n2 = Node(root / "n2", dram_tier("64MiB"), nvme_tier("256MiB"))
        self.nodes = (self.n1, self.n2)
        self.fleet = Fleet(root / "logs")
        self.ns_a = namespace(self.llama, "page_first_direct")  # a and b
        self.ns_c = namespace(self.other, "layer_first")
        self.ns_m = namespace(self.mla, "layer_first", mla=True)
        self.before_restart = None  # (prompt, its cold Generation), served by a before its restart

    def start(self, plan):
        """Start the nodes, and launch the servers the tests of plan use, in the order they first need them."""
        self.plan = plan
        for node in self.nodes:
            node.start()
        options = {
            "a": server_options(self.llama, self.n1, write_policy="write_through"),
            "b": server_options(self.llama, self.n1, write_policy="write_through"),
            "c": server_options(self.other, self.n1, write_policy="selective", mem_layout="layer_first"),
            "m": server_options(self.mla, self.n2, mla=True, write_policy="write_back"),
        }
        options["a2"] = options["a"]  # a again, a new process once a has stopped
        self.launched = []
        for test in plan:
            for name in USES[test]:
                if name == "a2" and "a" not in self.launched:
                    continue  # nothing to restart: its test skips
                if name not in self.launched:
                    self.launched.append(name)
                    self.fleet.launch(name, options[name], after="a" if name == "a2" else None)

    def retire_unused(self, finished: str):
        """Stop the servers no test after finished uses (the next ones may then start)."""
        later = self.plan[self.plan.index(finished) + 1:]
        needed = {name for test in later for name in USES[test]}
        for name in self.launched:
            if name not in needed:
                self.fleet.retire(name)
        self.launched = [name for name in self.launched if name in needed]

    def close(self):
        try:
            self.fleet.stop_all()
        finally:
            for node in self.nodes:
                for tier in node.tiers:
                    if tier in node.runner.procs:
                        thaw(node.pid(tier))
                node.stop()


@pytest.fixture(scope="module")
def lab(tmp_path_factory, request):
    plan = [item.originalname for item in request.session.items if item.module.__name__ == __name__]
    assert set(plan) <= set(USES), f"tests without an entry in USES: {set(plan) - set(USES)}"
    lab = Lab(tmp_path_factory.mktemp("server-e2e"))
    # A SIGTERM (`timeout`, a CI runner) would end pytest without teardown and leave the servers, each in a
    # session of its own, running: make it an interrupt, which pytest tears down after.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        lab.start(plan)
        yield lab
    finally:
        try:
            lab.close()
        finally:
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(autouse=True)
def _retire_servers_no_later_test_uses(lab, request):
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed > failed:  # what the daemons said, where CI shows it
        for node in lab.nodes:
            sys.__stderr__.write(f"\n--- {node.runner.log_path}, last lines ---\n{_tail(node.runner.log_path)}\n")
    lab.retire_unused(request.node.originalname)


def _tail(path: str, lines: int = 200) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return "".join(fh.readlines()[-lines:])
    except OSError as exc:
        return f"(unreadable: {exc})"


# ---------------------------------------------------------- the hit ladder; two servers on one node
def test_hit_ladder_device_host_storage(lab):
    """One prompt climbs down the ladder: cold, device hit, host hit, L3 hit after /flush_cache, each
    with the cold tokens (the last rung, a restarted server, is the module's last test)."""
    a, n1, ns = lab.fleet.get("a"), lab.n1, lab.ns_a
    ids = prompt(1)
    keys = page_keys(ids)
    full = hit_tokens(ids)
    ref = cold(a, ids)
    n1.wait_held(ns, keys, ["dram", "nvme"])  # write_through: every tier has each page

    again = a.generate(ids, NEW_TOKENS)
    assert again.cached == {"device": full, "host": 0, "storage": 0}, again
    assert again.output_ids == ref.output_ids

    # Other prompts (no page in common) push it out of the 1,024-token device pool into the host pool.
    host = None
    for seed in range(100, 106):
        other = a.generate(prompt(seed), NEW_TOKENS)
        assert other.cached["storage"] == 0, other
        host = a.generate(ids, NEW_TOKENS)
        assert host.output_ids == ref.output_ids
        if host.cached["host"]:
            break
    assert host.cached == {"device": 0, "host": full, "storage": 0}, host

    served = n1.hits("dram", ns) + n1.hits("nvme", ns)
    storage_hit(a, ids, ref)
    # The tiers served every page. (Which one is best effort: the fastest holder, unless a lower tier's
    # lookup reply covered the keys and the faster one's was late; tiers/wire/lookup.py.) DRAM counts the
    # pages read through its page directory when their touch arrives, just after the read.
    assert eventually(lambda: n1.hits("dram", ns) + n1.hits("nvme", ns) - served >= len(keys), within=TOUCHED)

    lab.before_restart = (ids, ref)


def test_two_servers_share_one_nodes_pages_and_models_never_mix(lab):
    """b (same model, running beside a) reads a's pages; c (other weights, same shapes, same token ids)
    reads none of them and computes its own tokens, which its own L3 hit then reproduces."""
    a, b, c, n1 = lab.fleet.get("a"), lab.fleet.get("b"), lab.fleet.get("c"), lab.n1
    ids = prompt(2)
    keys = page_keys(ids)
    ref = cold(a, ids)
    n1.wait_held(lab.ns_a, keys, ["dram", "nvme"])

    from_a = b.generate(ids, NEW_TOKENS)  # b never saw this prompt: all of it comes from L3
    assert from_a.cached == {"device": 0, "host": 0, "storage": hit_tokens(ids)}, from_a
    assert from_a.output_ids == ref.output_ids

    own = c.generate(ids, NEW_TOKENS)  # a's pages of the same ids are in the tiers: none may be used
    assert own.cached == {"device": 0, "host": 0, "storage": 0}, own
    assert own.output_ids != ref.output_ids  # the models differ, so a borrowed page would have shown
    n1.wait_held(lab.ns_c, keys, ["dram"])  # selective: c's own pages, in DRAM
    storage_hit(c, ids, own)


# ----------------------------------------------------------------------- the node's daemons restart
def _restart_node(node: Node) -> None:
    """Stop every daemon of node gracefully, then start them all again."""
    assert node.stop() == {tier: 0 for tier in node.tiers}
    node.start()


def test_node_daemons_restart_between_requests(lab):
    """Stop every daemon and start them again: DRAM comes back empty, NVMe reloads its index from disk,
    and the prompt is still an L3 hit with its cold tokens, served by NVMe; read from NVMe a second time,
    it is promoted into DRAM (promote_min_reads = 2: a page read from below once is not).

    The first request after a restart may miss: the backend reconnects to each daemon inside that
    request's lookup (a new session, the host pool registered again, the arena mapped again, one tier
    after the other), which on a loaded machine outlasts SGLang's prefetch wait (1 s + 0.25 s per 1k
    tokens). So a prompt of its own goes first, with its cold tokens whether it hit or not; the prompt
    checked is never computed again, so its hit can only come from the reloaded NVMe index."""
    a, n1, ns = lab.fleet.get("a"), lab.n1, lab.ns_a
    first, ids = prompt(3), prompt(4)
    refs = {tuple(p): cold(a, p) for p in (first, ids)}
    keys = page_keys(ids)
    n1.wait_held(ns, page_keys(first) + keys, ["dram", "nvme"])

    _restart_node(n1)
    assert n1.count("dram", ns, keys) == 0
    assert n1.count("nvme", ns, keys) == len(keys)
    assert n1.hits("nvme", ns) == 0

    a.flush_cache()
    assert a.generate(first, NEW_TOKENS).output_ids == refs[tuple(first)].output_ids  # hit or not
    nvme_hits = n1.hits("nvme", ns)
    storage_hit(a, ids, refs[tuple(ids)])
    assert n1.hits("nvme", ns) - nvme_hits >= len(keys)  # served by NVMe
    time.sleep(0.5)  # well past a promotion's start (20 ms after its read)
    assert n1.count("dram", ns, keys) == 0  # read from below once: not promoted
    storage_hit(a, ids, refs[tuple(ids)])
    assert n1.hits("nvme", ns) - nvme_hits >= 2 * len(keys)  # from NVMe again
    n1.wait_held(ns, keys, ["dram"])  # and promoted into the top tier after this second read
    assert a.alive()


# ------------------------------------------------------------------------------------------- faults
def _wave(server, prompts, refs, timings, errors, answers=None):
    """Every prompt at once, each from its own thread: its time into timings, a wrong answer into errors,
    each Generation into answers."""
    def one(ids):
        began = time.monotonic()
        try:
            gen = server.generate(ids, NEW_TOKENS, timeout=REQUEST_BOUND * 2)
            timings.append(time.monotonic() - began)
            if answers is not None:
                answers.append(gen)
            if gen.output_ids != refs[tuple(ids)].output_ids:
                errors.append(f"prompt {ids[:3]}...: {gen.output_ids} != cold {refs[tuple(ids)].output_ids} "
                              f"({gen.cached})")
        except Exception as exc:  # reported by the test
            errors.append(f"prompt {ids[:3]}...: {exc}")
    threads = [threading.Thread(target=one, args=(ids,), daemon=True) for ids in prompts]
    for thread in threads:
        thread.start()
    return threads


def test_requests_complete_while_tiers_crash_and_freeze(lab):
    """SIGKILL the DRAM daemon and SIGSTOP the NVMe daemon while requests read from and write to L3:
    every request completes in bounded time with its cold tokens and the server lives; once the daemons
    are back, L3 backups and hits resume (SGLang's prefetch and backup threads survived)."""
    a, n1, ns = lab.fleet.get("a"), lab.n1, lab.ns_a
    readers = [prompt(s) for s in (40, 41)]  # in L3: their re-reads prefetch
    writers = [prompt(s) for s in (50, 51)]  # taken out of L3 again: their requests back up
    refs = {tuple(ids): cold(a, ids) for ids in readers + writers}
    n1.wait_held(ns, [k for ids in readers + writers for k in page_keys(ids)], ["dram", "nvme"])
    n1.delete(ns, [k for ids in writers for k in page_keys(ids)])
    a.flush_cache()

    timings, errors = [], []
    nvme_pid = n1.pid("nvme")
    try:
        wave = _wave(a, readers + writers, refs, timings, errors)
        assert eventually(lambda: timings or errors, within=REQUEST_BOUND), "no request of the first wave finished"
        n1.runner.kill("dram")  # SIGKILL while the rest of the wave is in flight
        os.kill(nvme_pid, signal.SIGSTOP)
        for thread in wave:
            thread.join(REQUEST_BOUND * 2)
        assert not errors, errors
        # A second wave entirely under the faults: flushed re-reads of everything, computed again (no
        # tier can serve a page now) and backed up into tiers that cannot take them.
        a.flush_cache()
        answers = []
        for thread in _wave(a, readers + writers, refs, timings, errors, answers):
            thread.join(REQUEST_BOUND * 2)
        assert not errors, errors
        assert [gen.cached["storage"] for gen in answers] == [0] * 4, answers
        assert len(timings) == 8 and max(timings) < REQUEST_BOUND, timings
        assert a.alive()
    finally:
        thaw(nvme_pid)
        if "dram" not in n1.runner.procs:
            n1.start("dram")

    # L3 works again: a new prompt is backed up into both tiers and read back after a flush. The
    # backend's clients find the daemons back within their back-off; each try is a fresh prompt.
    seeds = iter(range(60, 90))

    def resumed():
        ids = prompt(next(seeds))
        ref = cold(a, ids)
        keys = page_keys(ids)
        if not eventually(lambda: n1.holds_all(ns, keys, ["dram", "nvme"]), within=8):
            return None
        return storage_hit(a, ids, ref)
    assert eventually(resumed, within=90, step=0.5), "L3 backups did not resume after the daemons came back"
    # And a reader's pages, on NVMe since before the faults, are an L3 hit again.
    storage_hit(a, readers[0], refs[tuple(readers[0])])
    assert a.alive()


# ------------------------------------------------------- the selective and write_back policies; MLA
def test_selective_writes_below_only_pages_read_enough(lab):
    """selective (selective_min_reads 2): pages are written to DRAM only; when DRAM evicts them, those
    read twice go down to NVMe and the others are dropped. L3 hits with the cold tokens from DRAM, then
    from NVMe for the prompt read twice; the prompt read once is computed again."""
    c, n1, ns = lab.fleet.get("c"), lab.n1, lab.ns_c
    hot, warm, idle = prompt(70), prompt(71), prompt(72)
    refs = {tuple(ids): cold(c, ids) for ids in (hot, warm, idle)}
    keys = {tuple(ids): page_keys(ids) for ids in (hot, warm, idle)}
    n1.wait_held(ns, [k for ks in keys.values() for k in ks], ["dram"])
    assert sum(n1.count("nvme", ns, ks) for ks in keys.values()) == 0  # DRAM only

    for ids, reads in ((hot, 2), (warm, 1)):
        for _ in range(reads):
            storage_hit(c, ids, refs[tuple(ids)])  # from DRAM: one read of each page

    assert n1.evict_namespace("dram", ns) >= 3 * len(keys[tuple(hot)])
    assert n1.count("dram", ns, keys[tuple(hot)]) == 0
    n1.wait_held(ns, keys[tuple(hot)], ["nvme"])  # demoted on eviction (by the demotion thread)
    assert n1.count("nvme", ns, keys[tuple(warm)]) == 0
    assert n1.count("nvme", ns, keys[tuple(idle)]) == 0

    storage_hit(c, hot, refs[tuple(hot)])  # from NVMe
    c.flush_cache()
    gone = c.generate(warm, NEW_TOKENS)
    assert gone.cached == {"device": 0, "host": 0, "storage": 0}, gone
    assert gone.output_ids == refs[tuple(warm)].output_ids


def test_write_back_with_layer_first(lab):
    """write_back (on m, the MLA server): acknowledged once DRAM has a page, which reaches NVMe only when
    DRAM lets it go (here a graceful stop); L3 hits with the cold tokens from DRAM, then from NVMe alone."""
    m, n2, ns = lab.fleet.get("m"), lab.n2, lab.ns_m
    first, ids = prompt(6), prompt(7)
    refs = {tuple(p): cold(m, p) for p in (first, ids)}
    keys = page_keys(ids)
    n2.wait_held(ns, page_keys(first) + keys, ["dram"])
    assert n2.count("nvme", ns, keys) == 0  # dirty in DRAM, not yet below
    assert n2.stats("dram")["dirty_pages"] >= 2 * len(keys)

    dram_hits = n2.hits("dram", ns)
    storage_hit(m, ids, refs[tuple(ids)])
    assert eventually(lambda: n2.hits("dram", ns) - dram_hits >= len(keys), within=TOUCHED)

    assert n2.stop("dram") == {"dram": 0}  # graceful: the dirty pages go down first
    assert n2.count("nvme", ns, keys) == len(keys)
    n2.start("dram")
    assert n2.count("dram", ns, keys) == 0
    # The first request after a restart may miss (see test_node_daemons_restart_between_requests).
    m.flush_cache()
    assert m.generate(first, NEW_TOKENS).output_ids == refs[tuple(first)].output_ids
    nvme_hits = n2.hits("nvme", ns)
    storage_hit(m, ids, refs[tuple(ids)])
    assert n2.hits("nvme", ns) - nvme_hits >= len(keys)


def test_mla_model_hits_l3_with_its_cold_tokens(lab):
    """MLA pages (one latent per token, the same on every rank: no TP rank in the namespace): a device
    hit, then an L3 hit from DRAM after /flush_cache, the cold tokens each time."""
    m, n2, ns = lab.fleet.get("m"), lab.n2, lab.ns_m
    assert ".mla." in ns
    ids = prompt(8)
    keys = page_keys(ids)
    ref = cold(m, ids)
    again = m.generate(ids, NEW_TOKENS)
    assert again.cached == {"device": hit_tokens(ids), "host": 0, "storage": 0}, again
    assert again.output_ids == ref.output_ids
    n2.wait_held(ns, keys, ["dram"])
    hits = n2.hits("dram", ns)
    storage_hit(m, ids, ref)
    assert eventually(lambda: n2.hits("dram", ns) - hits >= len(keys), within=TOUCHED)
    other = cold(m, prompt(9))  # the tokens depend on the context: a wrong page would show
    assert other.output_ids != ref.output_ids


# ------------------------------------------------------- the ladder's last rung: a restarted server
def test_a_restarted_server_reads_its_predecessors_pages(lab):
    """The ladder's last rung: once a has stopped, a new process with its options (a2) on the same daemons
    has empty device and host pools, and the prompt of test_hit_ladder is an L3 hit with its cold tokens."""
    if lab.before_restart is None:
        ladder = "test_hit_ladder_device_host_storage"
        if ladder not in lab.plan:
            pytest.skip(f"needs {ladder} (deselected) to write the pages and restart the server")
        pytest.fail(f"{ladder} did not get as far as its L3 hit")
    ids, ref = lab.before_restart
    storage_hit(lab.fleet.get("a2"), ids, ref)  # started only after a was stopped (Fleet's after=)

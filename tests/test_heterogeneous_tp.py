"""Engines of TP 1, 2 and 4 share one stored copy of a prompt (SGLang's tp_lcm_size, page_head layout).

Each engine's pool holds its rank's slice of the model's KV heads, filled from
one model-wide tensor, so the bytes every rank should read back are known per
head shard.  Real daemons, real host pools, SGLang's own page functions.
"""
import pytest
import torch

from hicache_ext.lab.sglang_harness import make_keys
from tests.support.backend_env import Engine
from tests.support.nodes import module_node

HEADS, LCM, PAGES = 4, 4, 40  # 40 pages: one 128-page batch is not the point here
SHAPE = dict(layers=2, head_dim=32, page_size=4)


node = module_node("hetero")


def model_kv(seed: int) -> torch.Tensor:
    """[2, pages, heads, page_size, layers, head_dim] bf16 of the whole model (finite values)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, PAGES, HEADS, SHAPE["page_size"], SHAPE["layers"], SHAPE["head_dim"])
    bits = torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int32, generator=gen).to(torch.int16)
    return (bits & ~(1 << 14)).view(torch.bfloat16)


class Rank:
    def __init__(self, node, tp_size: int, tp_rank: int, model: str, lcm=LCM, layout="page_head"):
        shape = dict(SHAPE, kv_heads=HEADS // tp_size)
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.heads = slice(tp_rank * HEADS // tp_size, (tp_rank + 1) * HEADS // tp_size)
        ours = {"tp_lcm_size": lcm} if lcm else {}
        self.engine = Engine(node, layout=layout, pages=PAGES, tp_rank=tp_rank, tp_size=tp_size, model=model,
                             shape=shape, **ours)
        self.kv = self.engine.pool.kv_buffer  # [2, page_num, heads, page_size, layers, head_dim]

    def write(self, kv: torch.Tensor, keys) -> int:
        self.kv[:, :PAGES] = kv[:, :, self.heads]
        return self.engine.driver.backup(keys, self.engine.indices(0, len(keys)), prefix_keys=[])

    def read(self, keys) -> int:
        self.kv.zero_()
        return self.engine.driver.prefetch(keys, self.engine.indices(0, len(keys)), prefix_keys=[])

    def shard_matches(self, kv: torch.Tensor, pages: int):
        """Per model head of this rank: are its bytes exactly the model's, over the first pages?"""
        got = self.kv[:, :pages].view(torch.int16)
        want = kv[:, :pages, self.heads].view(torch.int16)
        return [torch.equal(got[:, :, h], want[:, :, h]) for h in range(got.shape[2])]

    def close(self):
        self.engine.close()


def ranks(node, tp_size: int, model: str, **kw):
    return [Rank(node, tp_size, r, model, **kw) for r in range(tp_size)]


@pytest.mark.parametrize("writer_tp", [1, 2, 4])
def test_every_tp_size_reads_what_any_other_wrote(node, writer_tp):
    model = f"hetero-{writer_tp}"
    kv, keys = model_kv(seed=writer_tp), make_keys(PAGES, salt=900 + writer_tp, page_size=SHAPE["page_size"])
    engines = {tp: ranks(node, tp, model) for tp in (1, 2, 4)}
    try:
        assert [r.write(kv, keys) for r in engines[writer_tp]] == [PAGES] * writer_tp
        for tp, group in engines.items():
            for rank in group:
                assert rank.engine.driver.exists(keys) == PAGES, (tp, rank.tp_rank)
                assert rank.read(keys) == PAGES, (tp, rank.tp_rank)
                assert all(rank.shard_matches(kv, PAGES)), (tp, rank.tp_rank)
    finally:
        for group in engines.values():
            for rank in group:
                rank.close()


def test_a_page_is_held_only_where_every_shard_of_the_rank_is(node):
    """TP2 rank 0 alone wrote: heads 0-1 are stored, 2-3 are not."""
    kv, keys = model_kv(seed=11), make_keys(PAGES, salt=911, page_size=SHAPE["page_size"])
    tp2, tp4, tp1 = ranks(node, 2, "hetero-half"), ranks(node, 4, "hetero-half"), ranks(node, 1, "hetero-half")
    try:
        assert tp2[0].write(kv, keys) == PAGES
        assert [r.engine.driver.exists(keys) for r in tp4] == [PAGES, PAGES, 0, 0]
        assert [r.read(keys) for r in tp4] == [PAGES, PAGES, 0, 0]
        assert all(tp4[0].shard_matches(kv, PAGES)) and all(tp4[1].shard_matches(kv, PAGES))
        assert tp2[1].engine.driver.exists(keys) == 0
        assert tp1[0].engine.driver.exists(keys) == 0 and tp1[0].read(keys) == 0  # needs all four shards
        # The missing half arrives from a TP4 engine: now the TP1 engine has the whole page.
        assert tp4[2].write(kv, keys) == PAGES and tp4[3].write(kv, keys) == PAGES
        assert tp1[0].read(keys) == PAGES and all(tp1[0].shard_matches(kv, PAGES))
    finally:
        for rank in tp2 + tp4 + tp1:
            rank.close()


def test_without_tp_lcm_size_or_page_head_ranks_keep_their_own_pages(node, caplog):
    kv, keys = model_kv(seed=12), make_keys(PAGES, salt=912, page_size=SHAPE["page_size"])
    plain2 = ranks(node, 2, "hetero-plain", lcm=None)
    plain4 = ranks(node, 4, "hetero-plain", lcm=None)
    first4 = ranks(node, 4, "hetero-pf", layout="page_first")  # tp_lcm_size without page_head: ignored, said so
    try:
        assert [r.write(kv, keys) for r in plain2] == [PAGES, PAGES]
        assert [r.read(keys) for r in plain2] == [PAGES, PAGES]
        assert [r.engine.driver.exists(keys) for r in plain4] == [0, 0, 0, 0]
        assert any("tp_lcm_size 4 is ignored" in rec.getMessage() for rec in caplog.records)
        assert [f".tp{r.tp_rank}-4." in r.engine.backend.namespace for r in first4] == [True] * 4
        assert not any("heads-of" in r.engine.backend.namespace for r in first4 + plain2)
    finally:
        for rank in plain2 + plain4 + first4:
            rank.close()


def test_mla_pages_are_not_split(node):
    """MLA pages are the same on every rank: tp_lcm_size changes nothing, rank 1 reads rank 0's pages."""
    keys = make_keys(8, salt=913, page_size=16)
    writer = Engine(node, model="hetero-mla", tp_rank=0, tp_size=2, is_mla=True, tp_lcm_size=4, pages=8)
    reader = Engine(node, model="hetero-mla", tp_rank=1, tp_size=2, is_mla=True, tp_lcm_size=4, pages=8)
    try:
        assert not writer.config.should_split_heads
        assert ".mla." in writer.backend.namespace and "heads-of" not in writer.backend.namespace
        done, sums = writer.write(keys, 0, seed=3)
        assert done == 8
        assert reader.read(keys, 0) == (8, sums)
    finally:
        writer.close()
        reader.close()

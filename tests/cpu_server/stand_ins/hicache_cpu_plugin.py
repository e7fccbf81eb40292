"""Test-only SGLang general plug-in (entry point group ``sglang.srt.plugins``).

On the CPU route SGLang's MHA host pool binds no ``direct`` transfer functions
(they come from the CUDA sgl_kernel) and pins its memory (which needs CUDA).
SGLang loads this plug-in in every process it starts; it binds the three
direct transfer functions in plain torch and builds host pools unpinned.
It also lowers the host memory SGLang keeps free beside a HiCache host pool
from 10 GiB to 1 GiB: the servers here are tiny, and several of them (two
sharing a node in one test) must fit a 24 GiB development machine.

And it gives SGLang's torch_native attention an extend that attends only the
new tokens' queries (``extend_attention``). SGLang's own builds a query of the
whole sequence (prefix rows left uninitialised) and runs causal SDPA over all
of it, so an extend of 16 tokens over a 2,048-token cached prefix cost as
much as recomputing the prompt's attention (~0.5 s here, varying by tens of
ms): a device hit, the baseline every cache hit is measured against, was
mostly wasted attention and its noise hid what an L3 hit adds. Every request
(recompute included) goes through the same masked SDPA, so recompute and
hits stay numerically alike; a GPU server never had the waste.

And the scheduler's loop sleeps IDLE_SLEEP_S when it has no batch to run
(``on_idle``) instead of spinning: SGLang yields with ``time.sleep(0)``
there, so a server waiting for a prefetch kept one of this machine's two
cores busy, taking it from the tier daemons and the prefetch threads the
wait is for (a GPU host has cores to spare for its spinning scheduler). A
waiting request is admitted at most IDLE_SLEEP_S later than it would be.

And the launcher forks its scheduler and detokenizer instead of spawning them
(SGLang sets "spawn" for CUDA's sake; HICACHE_TEST_START_METHOD=spawn keeps
it). A spawned child imports sglang.launch_server and the rest again (~10 s of
CPU each, three imports a server start); forked, they begin with what the
launcher imported (this plug-in imports the scheduler there), so a server is
ready in ~11 s instead of ~21-23 here. The processes, their sockets and the
backend in the scheduler are the same either way (the launcher holds no
backend: ours is built in the scheduler).
"""
import functools
import inspect
import multiprocessing
import os
import time

import numpy as np
import torch
from torch.nn.functional import scaled_dot_product_attention

from tiers.shm.buffers import copy_runs


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """Token rows src_indices of each source layer into rows dst_indices of its destination."""
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)].to(dst.device)


def _whole_pages(indices, page_size):
    """The page numbers of indices when they are whole pages, each page's slots in order (else None):
    then a copy moves page blocks, as the CUDA kernel does, instead of gathering row by row."""
    if indices.numel() == 0 or indices.numel() % page_size:
        return None
    rows = indices.view(-1, page_size)
    starts = rows[:, 0]
    if bool((starts % page_size).any()) or not bool((rows - starts[:, None] == _slots(page_size)).all()):
        return None
    return starts // page_size


@functools.lru_cache(maxsize=8)
def _slots(page_size):
    return torch.arange(page_size)


MAX_RUNS = 8  # past this many runs of consecutive pages, one memcpy per page in C beats a slice copy per run


class _PagePlan:
    """How one transfer's pages move, worked out once for all its layers (SGLang calls the per-layer
    function with the same index tensors for every layer): the page numbers of both sides (None when the
    indices are not whole pages) and the runs of pages consecutive on both sides (None past MAX_RUNS)."""
    _last = None  # (src_indices, dst_indices, their versions, plan): one transfer at a time

    def __init__(self, src_indices, dst_indices, page_size):
        self.src_pages, self.dst_pages = _whole_pages(src_indices, page_size), _whole_pages(dst_indices, page_size)
        self.runs = None
        if self.src_pages is not None and self.dst_pages is not None:
            self.runs = _runs(self.src_pages, self.dst_pages)
            self._src_np = self.src_pages.numpy().astype(np.uint64)
            self._dst_np = self.dst_pages.numpy().astype(np.uint64)

    @classmethod
    def of(cls, src_indices, dst_indices, page_size):
        last = cls._last
        if (last is not None and last[0] is src_indices and last[1] is dst_indices
                and last[2] == (src_indices._version, dst_indices._version, page_size)):
            return last[3]
        plan = cls(src_indices, dst_indices, page_size)
        cls._last = (src_indices, dst_indices, (src_indices._version, dst_indices._version, page_size), plan)
        return plan

    @property
    def whole_pages(self):
        return self.src_pages is not None and self.dst_pages is not None

    def copy(self, dst_blocks, src_blocks):
        """dst_blocks[dst_pages] = src_blocks[src_pages] for tensors shaped [pages, ...] (views allowed),
        one copy of the bytes as the CUDA kernel makes: a block copy per run, else a memcpy per page in
        one C call (torch's gather and scatter made two passes and a temporary: 24 ms for 255 pages of 8
        layers here, against 2.6 ms in order)."""
        if self.runs is not None:
            for src, dst, length in self.runs:
                dst_blocks[dst:dst + length] = src_blocks[src:src + length]
        elif src_blocks[0].is_contiguous() and dst_blocks[0].is_contiguous() and not src_blocks.is_cuda:
            size = src_blocks.element_size()
            copy_runs(dst_blocks.data_ptr() + self._dst_np * np.uint64(dst_blocks.stride(0) * size),
                      src_blocks.data_ptr() + self._src_np * np.uint64(src_blocks.stride(0) * size),
                      np.full(len(self._src_np), src_blocks[0].numel() * size, dtype=np.uint64))
        else:
            dst_blocks[self.dst_pages] = src_blocks[self.src_pages]


def _runs(src_pages, dst_pages):
    """(src start, dst start, length) of each run of pages consecutive on both sides, or None past MAX_RUNS."""
    if src_pages.numel() == 1:
        return [(int(src_pages[0]), int(dst_pages[0]), 1)]
    breaks = ((src_pages[1:] - src_pages[:-1] != 1) | (dst_pages[1:] - dst_pages[:-1] != 1)).nonzero().flatten()
    if breaks.numel() >= MAX_RUNS:
        return None
    starts = [0] + (breaks + 1).tolist()
    ends = starts[1:] + [src_pages.numel()]
    src, dst = src_pages.tolist(), dst_pages.tolist()
    return [(src[a], dst[a], b - a) for a, b in zip(starts, ends)]


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
    """One layer from a page_first_direct host pool ([page, layer, slot, ...]) into device rows."""
    plan = _PagePlan.of(src_indices, dst_indices, page_size)
    if plan.whole_pages:
        for src, dst in zip(src_ptrs, dst_ptrs):
            plan.copy(dst.view(-1, page_size, *dst.shape[1:]), src[:, layer_id])
        return
    pages, slots = src_indices // page_size, src_indices % page_size
    for src, dst in zip(src_ptrs, dst_ptrs):
        dst[dst_indices.to(dst.device)] = src[pages, layer_id, slots].to(dst.device)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    """Every layer's device rows (K layers then V layers) into a page_first_direct host pool."""
    layers = len(src_ptrs) // 2
    plan = _PagePlan.of(src_indices, dst_indices, page_size)
    if plan.whole_pages:
        for kind, dst in enumerate(dst_ptrs):
            for layer in range(layers):
                src = src_ptrs[kind * layers + layer]
                plan.copy(dst[:, layer], src.view(-1, page_size, *src.shape[1:]))
        return
    pages, slots = dst_indices // page_size, dst_indices % page_size
    for kind, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            src = src_ptrs[kind * layers + layer]
            dst[pages, layer, slots] = src[src_indices.to(src.device)].to(dst.device)


def _unpinned(init):
    signature = inspect.signature(init)

    @functools.wraps(init)
    def build(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["pin_memory"] = False
        return init(*bound.args, **bound.kwargs)
    return build


TEST_HOST_MEMORY_RESERVE_BYTES = 1 << 30
IDLE_SLEEP_S = 0.0005


def _sleeping_on_idle(on_idle):
    @functools.wraps(on_idle)
    def sleeping(self):
        on_idle(self)
        time.sleep(IDLE_SLEEP_S)
    sleeping._hicache_sleeps = True
    return sleeping


def _exact_extend(original):
    """TorchNativeAttnBackend._run_sdpa_forward_extend attending each request's new queries only (causal:
    query row r, at position prefix + r, sees keys 0..prefix + r); cross-attention and sliding windows go to
    SGLang's own."""
    @functools.wraps(original)
    def extend_attention(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                         extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None, enable_gqa=False,
                         causal=False, is_cross_attn=False, sliding_window_size=None):
        if encoder_lens is not None or is_cross_attn or (sliding_window_size is not None
                                                          and sliding_window_size > -1):
            return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                            extend_prefix_lens, extend_seq_lens, encoder_lens, scaling=scaling,
                            enable_gqa=enable_gqa, causal=causal, is_cross_attn=is_cross_attn,
                            sliding_window_size=sliding_window_size)
        heads_first = query.movedim(0, query.dim() - 2)  # [heads, tokens, dim]
        start = 0
        for i in range(seq_lens.shape[0]):
            q_len, prefix, kv_len = int(extend_seq_lens[i]), int(extend_prefix_lens[i]), int(seq_lens[i])
            q = heads_first[:, start:start + q_len, :]
            tokens = req_to_token[req_pool_indices[i], :kv_len]
            k = k_cache[tokens].movedim(0, query.dim() - 2)
            v = v_cache[tokens].movedim(0, query.dim() - 2)
            if not (q.dtype == k.dtype == v.dtype):
                k, v = k.to(q.dtype), v.to(q.dtype)
            mask = None
            if causal:
                positions = torch.arange(prefix, prefix + q_len, device=q.device)
                mask = torch.arange(kv_len, device=q.device)[None, :] <= positions[:, None]
            out = scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                               enable_gqa=enable_gqa, scale=scaling)
            output[start:start + q_len] = out.squeeze(0).movedim(query.dim() - 2, 0)
            start += q_len
        return output
    extend_attention._hicache_exact = True
    return extend_attention


def _start_method(set_start_method, method_for_spawn):
    """multiprocessing.set_start_method with SGLang's "spawn" made method_for_spawn."""
    @functools.wraps(set_start_method)
    def choosing(method, force=False):
        return set_start_method(method_for_spawn if method == "spawn" else method, force=force)
    choosing._hicache_start_method = method_for_spawn
    return choosing


def install():
    method = os.environ.get("HICACHE_TEST_START_METHOD", "fork")
    if method != "spawn" and not hasattr(multiprocessing.set_start_method, "_hicache_start_method"):
        multiprocessing.set_start_method = _start_method(multiprocessing.set_start_method, method)
    from sglang.srt.managers.scheduler import Scheduler
    if not getattr(Scheduler.on_idle, "_hicache_sleeps", False):
        Scheduler.on_idle = _sleeping_on_idle(Scheduler.on_idle)
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    if not getattr(TorchNativeAttnBackend._run_sdpa_forward_extend, "_hicache_exact", False):
        TorchNativeAttnBackend._run_sdpa_forward_extend = _exact_extend(TorchNativeAttnBackend._run_sdpa_forward_extend)
    from sglang.srt.mem_cache.pool_host import base, mha
    base.HICACHE_HOST_MEMORY_RESERVE_BYTES = TEST_HOST_MEMORY_RESERVE_BYTES
    mha.transfer_kv_direct = transfer_kv_direct
    mha.transfer_kv_per_layer_direct_pf_lf = transfer_kv_per_layer_direct_pf_lf
    mha.transfer_kv_all_layer_direct_lf_pf = transfer_kv_all_layer_direct_lf_pf
    for cls in (mha.MHATokenToKVPoolHost,):
        if not getattr(cls.__init__, "_hicache_unpinned", False):
            cls.__init__ = _unpinned(cls.__init__)
            cls.__init__._hicache_unpinned = True
    import hicache_trace
    hicache_trace.install()
    hicache_trace.install_profile()

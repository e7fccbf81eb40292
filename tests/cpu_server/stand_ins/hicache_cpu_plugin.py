"""Test-only SGLang general plug-in (entry point group ``sglang.srt.plugins``).

On the CPU route SGLang's MHA host pool binds no ``direct`` transfer functions
(they come from the CUDA sgl_kernel) and pins its memory (which needs CUDA).
SGLang loads this plug-in in every process it starts; it binds the three
direct transfer functions in plain torch and builds host pools unpinned.
It also lowers the host memory SGLang keeps free beside a HiCache host pool
from 10 GiB to 1 GiB: the servers here are tiny, and several of them (two
sharing a node in one test) must fit a 24 GiB development machine.
"""
import functools
import inspect


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """Token rows src_indices of each source layer into rows dst_indices of its destination."""
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)].to(dst.device)


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
    """One layer from a page_first_direct host pool ([page, layer, slot, ...]) into device rows."""
    pages, slots = src_indices // page_size, src_indices % page_size
    for src, dst in zip(src_ptrs, dst_ptrs):
        dst[dst_indices.to(dst.device)] = src[pages, layer_id, slots].to(dst.device)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    """Every layer's device rows (K layers then V layers) into a page_first_direct host pool."""
    layers = len(src_ptrs) // 2
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


def install():
    from sglang.srt.mem_cache.pool_host import base, mha
    base.HICACHE_HOST_MEMORY_RESERVE_BYTES = TEST_HOST_MEMORY_RESERVE_BYTES
    mha.transfer_kv_direct = transfer_kv_direct
    mha.transfer_kv_per_layer_direct_pf_lf = transfer_kv_per_layer_direct_pf_lf
    mha.transfer_kv_all_layer_direct_lf_pf = transfer_kv_all_layer_direct_lf_pf
    for cls in (mha.MHATokenToKVPoolHost,):
        if not getattr(cls.__init__, "_hicache_unpinned", False):
            cls.__init__ = _unpinned(cls.__init__)
            cls.__init__._hicache_unpinned = True

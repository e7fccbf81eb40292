"""Test stand-in for the CPU build of sgl_kernel, which no package registry serves.

SGLang imports a handful of ``*_cpu`` ops at module load when
SGLANG_USE_CPU_ENGINE=1.  The two the CPU route of a small Llama calls are
written here in plain torch; any other name resolves to a function that raises
with its name, so an unexpected call fails loudly instead of computing garbage.
Only server processes that the tests (and the lab's CPU server) start put this
directory on PYTHONPATH; the product never imports it.
"""
import ctypes

import torch

__version__ = "0.0.0+hicache-tiers-test-stand-in"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len):
    """req_to_token[req, start:end] = the next (end - start) slots of out_cache_loc, per request."""
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), starts, ends):
        length = end - start
        req_to_token[row, start:end] = out_cache_loc[offset:offset + length].to(req_to_token.dtype)
        offset += length


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """Copy the row at each src_loc to tgt_loc in every buffer (base pointer, row stride in bytes)."""
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist()))
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        for tgt, src in pairs:
            if tgt != src:
                ctypes.memmove(base + tgt * stride, base + src * stride, stride)


def _missing(name):
    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} has no pure-torch stand-in (tests/cpu_server)")
    missing.__name__ = name
    return missing


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)

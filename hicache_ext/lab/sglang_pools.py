"""Real SGLang host pools on a CPU-only machine, and page-level helpers over them.

A host pool is built the way SGLang's assembler builds one: a real device pool
(``MHATokenToKVPool`` / ``MLATokenToKVPool``) is created on the "cpu" device,
its ``get_device_pool_infos()[0].buffer_info`` is handed to the host pool class,
and ``pin_memory=False`` skips cudaHostRegister.  ``host_token_capacity`` pins
the pool to exactly ``pages`` pages (no padding page).  The device pool stays
reachable as ``pool.harness_device_pool`` (the driver's HostPoolGroup entry
needs it).

``allocator="shm"`` selects SGLang's ``ShmHostTensorAllocator``: the whole
``kv_buffer`` (K and V) is one memfd mapping starting at offset 0, exposed as
``pool.fd`` (== ``pool.allocator.fds[0]``) and ``pool.allocator.mms[0]``.  So a
region's offset in the memfd is ``ptr - pool.kv_buffer.data_ptr()``.

Page regions (``pool.get_page_buffer_meta(indices)``, one page = page_size slots):
- MHA page_first / page_first_direct: [K, V] per page, each
  layers*page_size*heads*dim*itemsize bytes; V = K + layers*size*heads*dim*itemsize.
- MHA layer_first: [K_l0, V_l0, K_l1, V_l1, ...], each page_size*heads*dim*itemsize.
- MHA page_head: [K, V] per page, heads-major inside each ([heads, page_size, layers, dim]).
- MHA page_unified: one block per page (SGLang 0.5.23 has no get_page_buffer_meta
  for it; hicache_ext.host_pool.page_buffer_meta supplies it).
- MLA page_first / page_first_direct: one region per page; layer_first: one per layer;
  page_first_kv_split: [K latent, V rope] per page, each its own buffer (two memfds with shm).
"""
from __future__ import annotations

import ctypes
import hashlib
from array import array
from typing import List

import torch
import xxhash

from hicache_ext.host_pool import page_buffer_meta

MHA_LAYOUTS = ("page_first", "layer_first", "page_first_direct", "page_head", "page_unified")
MLA_LAYOUTS = ("page_first", "layer_first", "page_first_direct", "page_first_kv_split")
ALLOCATORS = ("default", "shm")

# Integer views of each float width; clearing the second-highest bit keeps the
# exponent below its all-ones value, so random bits never form Inf or NaN.
_BITS_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32}


# SGLang leaves 10 GiB of the host's memory free when it checks a HiCache pool against it (a server's pools
# are tens of GB).  The lab's pools are what a demo, a bench or a test asks for (MiBs, a few GiB at most):
# they are checked against the memory free less LAB_HOST_MEMORY_RESERVE_BYTES, so that one built beside
# running SGLang servers (the suite on two workers) is not refused while the memory is there.
LAB_HOST_MEMORY_RESERVE_BYTES = 512 << 20


def _lab_memory_budget():
    """SGLang's budget scope, for the host pool built inside it: the memory free less the lab's reserve."""
    from sglang.srt.mem_cache.pool_host.base import available_host_memory_bytes, host_memory_budget_scope
    free = available_host_memory_bytes(allow_cgroup_fallback=True)
    return host_memory_budget_scope(max(0, free - LAB_HOST_MEMORY_RESERVE_BYTES))


def _check(layout: str, layouts, allocator: str, pages: int, page_size: int) -> None:
    if layout not in layouts:
        raise ValueError(f"layout {layout!r} not in {layouts}")
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator {allocator!r} not in {ALLOCATORS}")
    if pages <= 0 or page_size <= 0:
        raise ValueError("pages and page_size must be positive")


def build_mha_host_pool(layout: str = "page_first", allocator: str = "default", layers: int = 32,
                        kv_heads: int = 8, head_dim: int = 128, dtype: torch.dtype = torch.bfloat16,
                        page_size: int = 64, pages: int = 256):
    """A real MHATokenToKVPoolHost of exactly `pages` pages on CPU."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls

    _check(layout, MHA_LAYOUTS, allocator, pages, page_size)
    # One page of device slots is enough: the harness never moves device<->host.
    device = MHATokenToKVPool(size=page_size, page_size=page_size, dtype=dtype, head_num=kv_heads,
                              head_dim=head_dim, layer_num=layers, device="cpu",
                              enable_memory_saver=False, enable_alt_stream=False)
    info = device.get_device_pool_infos()[0].buffer_info
    with _lab_memory_budget():
        pool = get_mha_host_pool_cls(info)(
            info, 0, 0, page_size, layout, pin_memory=False, device="cpu", allocator_type=allocator,
            device_capacity_tokens=device.size, start_layer=device.start_layer, end_layer=device.end_layer,
            host_token_capacity=pages * page_size)
    pool.harness_device_pool = device
    return pool


def build_mla_host_pool(layout: str = "page_first", allocator: str = "default", layers: int = 61,
                        kv_lora_rank: int = 512, qk_rope_head_dim: int = 64,
                        dtype: torch.dtype = torch.bfloat16, page_size: int = 64, pages: int = 64):
    """A real MLATokenToKVPoolHost of exactly `pages` pages on CPU."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    _check(layout, MLA_LAYOUTS, allocator, pages, page_size)
    device = MLATokenToKVPool(size=page_size, page_size=page_size, dtype=dtype, kv_lora_rank=kv_lora_rank,
                              qk_rope_head_dim=qk_rope_head_dim, layer_num=layers, device="cpu",
                              enable_memory_saver=False)
    info = device.get_device_pool_infos()[0].buffer_info
    if layout == "page_first_kv_split":
        info = _split_buffer_info(info, device)
    with _lab_memory_budget():
        pool = MLATokenToKVPoolHost(
            info, 0, 0, page_size, layout, pin_memory=False, device="cpu", allocator_type=allocator,
            override_kv_cache_dim=device.kv_cache_dim, device_capacity_tokens=device.size,
            start_layer=device.start_layer, end_layer=device.end_layer, target_layer_num=layers,
            host_token_capacity=pages * page_size)
    pool.harness_device_pool = device
    return pool


def _split_buffer_info(info, device):
    """The split (K latent, V rope) buffer info an Ascend MLA device pool reports.

    page_first_kv_split host pools are built only from native split buffers
    (NPUMLATokenToKVPool._mla_native_buffers); CPU tensors of the same shapes
    stand in for the NPU ones, without a DSA indexer.
    """
    import msgspec
    from sglang.srt.mem_cache.device_pool_info import MLASplitBuffers

    slots = device.size + device.page_size
    split = MLASplitBuffers(
        k=torch.zeros((device.layer_num, slots, 1, device.kv_lora_rank), dtype=info.dtype),
        v=torch.zeros((device.layer_num, slots, 1, device.qk_rope_head_dim), dtype=info.dtype),
        index_k=None, index_scales=None, index_layer_indices=(), k_width=device.kv_lora_rank,
        v_width=device.qk_rope_head_dim, index_width=0)
    return msgspec.structs.replace(info, buffers=split, data_ptrs=None)


def host_indices_for_pages(pool, first_page: int, n_pages: int) -> torch.Tensor:
    """The int64 token slots of pages [first_page, first_page + n_pages)."""
    ps = pool.page_size
    if first_page < 0 or n_pages < 0 or (first_page + n_pages) * ps > pool.size:
        raise ValueError(f"pages [{first_page}, {first_page + n_pages}) outside a pool of "
                         f"{pool.size // ps} pages")
    return torch.arange(first_page * ps, (first_page + n_pages) * ps, dtype=torch.int64)


def page_regions(pool, host_indices: torch.Tensor) -> List[List[tuple]]:
    """Per page, its (pointer, nbytes) regions from SGLang's get_page_buffer_meta."""
    n = _page_count(pool, host_indices)
    if n == 0:
        return []
    ptrs, sizes = page_buffer_meta(pool, host_indices)
    if len(ptrs) % n:
        raise ValueError("page buffer meta does not split evenly into pages")
    per = len(ptrs) // n
    return [list(zip(ptrs[i * per:(i + 1) * per], sizes[i * per:(i + 1) * per])) for i in range(n)]


def _page_count(pool, host_indices: torch.Tensor) -> int:
    if len(host_indices) % pool.page_size:
        raise ValueError(f"{len(host_indices)} slots is not a whole number of {pool.page_size}-slot pages")
    return len(host_indices) // pool.page_size


def fill_pages(pool, host_indices: torch.Tensor, seed: int) -> None:
    """Write deterministic finite pseudo-random values into each page (one stream per seed).

    Region by region (get_page_buffer_meta order), so every layout is filled
    the same way, page_first_kv_split and page_unified included.
    """
    bits_dtype = _BITS_DTYPES.get(pool.dtype.itemsize)
    if bits_dtype is None:
        raise ValueError(f"no fill for {pool.dtype}")
    gen = torch.Generator().manual_seed(seed)
    top = 1 << (8 * pool.dtype.itemsize - 2)  # the second-highest bit
    for regions in page_regions(pool, host_indices):
        for ptr, nbytes in regions:
            raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
            raw.view(bits_dtype).bitwise_and_(~top)
            ctypes.memmove(ptr, raw.data_ptr(), nbytes)


def zero_pages(pool, host_indices: torch.Tensor) -> None:
    """Zero every region of the pages (what a fresh prefetch target looks like)."""
    for regions in page_regions(pool, host_indices):
        for ptr, nbytes in regions:
            ctypes.memset(ptr, 0, nbytes)


def page_bytes(pool, host_indices: torch.Tensor) -> List[bytes]:
    """Each page's bytes: its regions concatenated in get_page_buffer_meta order."""
    return [b"".join(ctypes.string_at(p, n) for p, n in regions)
            for regions in page_regions(pool, host_indices)]


def page_checksums(pool, host_indices: torch.Tensor) -> List[int]:
    """xxh3_64 of each page's bytes, hashed in place without a copy."""
    out = []
    for regions in page_regions(pool, host_indices):
        h = xxhash.xxh3_64()
        for p, n in regions:
            h.update((ctypes.c_char * n).from_address(p))
        out.append(h.intdigest())
    return out


def make_tokens(n_pages: int, salt: int, page_size: int = 64, vocab: int = 128_000) -> List[int]:
    """Deterministic token ids for n_pages pages (torch.Generator seeded with salt)."""
    gen = torch.Generator().manual_seed(salt)
    return torch.randint(0, vocab, (n_pages * page_size,), generator=gen).tolist()


def chain_keys(tokens: List[int], page_size: int, prior_hash: str | None = None) -> List[str]:
    """SGLang's storage keys: key_i = sha256(key_{i-1} bytes || page i tokens as uint32 LE)."""
    # Mirrors mem_cache/cpp_utils/hash_binding.cpp for ids < 2**32 (the test checks
    # it against sglang's get_hash_str); full pages only, as HiCache stores them.
    prior = bytes.fromhex(prior_hash) if prior_hash else b""
    keys = []
    for start in range(0, len(tokens) - len(tokens) % page_size, page_size):
        prior = hashlib.sha256(prior + array("I", tokens[start:start + page_size]).tobytes()).digest()
        keys.append(prior.hex())
    return keys


def make_keys(n: int, salt: int, page_size: int = 64) -> List[str]:
    """n SGLang-style 64-hex SHA-256 chain keys for the token stream seeded by salt."""
    return chain_keys(make_tokens(n, salt, page_size), page_size)

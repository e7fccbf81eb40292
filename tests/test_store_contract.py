"""The built-in page stores pass the contract kit plug-ins use (tiers/testing/store_contract.py)."""
from tiers.stores.dram import DramStore
from tiers.stores.nvme import NvmeStore
from tiers.stores.nvme.layout import chunk_path, key_digest, namespace_hash
from tiers.testing import StoreContract, flip_bits


class TestDramStore(StoreContract):
    def make_store(self, path, capacity, policy, max_page_bytes, evictions=None):
        return DramStore(capacity, policy, block_size=4096, max_page_bytes=max_page_bytes, prefault=False,
                         evictions=evictions)


class TestNvmeStore(StoreContract):
    capacity = 64 * (20 << 10)  # on-disk bytes: each page also carries a 4 KiB header

    def make_store(self, path, capacity, policy, max_page_bytes, evictions=None):
        return NvmeStore(path, capacity, policy=policy, max_page_bytes=max_page_bytes, fsync=False,
                         evictions=evictions)

    def corrupt(self, store, key):
        flip_bits(chunk_path(store.root, namespace_hash(key[0]), key_digest(*key)), -100)
        return True


class TestNvmeStoreCompressed(TestNvmeStore):
    def make_store(self, path, capacity, policy, max_page_bytes, evictions=None):
        return NvmeStore(path, capacity, policy=policy, max_page_bytes=max_page_bytes, fsync=False,
                         compression="zstd", evictions=evictions)

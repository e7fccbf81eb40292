"""The built-in page stores pass the contract kit plug-ins use (tiers/testing/store_contract.py)."""
from tiers.stores.dram import DramStore
from tiers.stores.nvme import NvmeStore
from tiers.stores.nvme.layout import chunk_path, key_digest, namespace_hash
from tiers.testing import StoreContract


class TestDramStore(StoreContract):
    def make_store(self, path, capacity, policy, max_page_bytes):
        return DramStore(capacity, policy, block_size=4096, max_page_bytes=max_page_bytes, prefault=False)


class TestNvmeStore(StoreContract):
    capacity = 64 * (20 << 10)  # on-disk bytes: each page also carries a 4 KiB header

    def make_store(self, path, capacity, policy, max_page_bytes):
        return NvmeStore(path, capacity, policy=policy, max_page_bytes=max_page_bytes, fsync=False)

    def corrupt(self, store, key):
        path = chunk_path(store.root, namespace_hash(key[0]), key_digest(*key))
        with open(path, "r+b") as fh:
            fh.seek(-100, 2)
            byte = fh.read(1)
            fh.seek(-100, 2)
            fh.write(bytes([byte[0] ^ 0xFF]))
        return True


class TestNvmeStoreCompressed(TestNvmeStore):
    def make_store(self, path, capacity, policy, max_page_bytes):
        return NvmeStore(path, capacity, policy=policy, max_page_bytes=max_page_bytes, fsync=False,
                         compression="zstd")

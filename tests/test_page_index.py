"""The native page index (tiers/_pageindex.c) against a plain Python model, operation by operation.

Random sequences of inserts, removals (by version too), touches, victims,
restart-scan placements and growth past every resize are run on the index
and on dicts and ordered dicts that say what LRU and FIFO mean; after every
step both must agree on what is held, each row's figures and every tenant's
eviction order.
"""
import random
from collections import OrderedDict

import pytest

from tiers.stores.page_index import (MAX_TENANTS, ORDER_FIFO, ORDER_LRU, ORDER_NONE, ROW_BYTES, PageIndex, Row,
                                   order_for, row)


class Model:
    def __init__(self, order):
        self.order = order
        self.rows = {}  # digest -> [gen, tenant, size, raw, reads, stamp, file, block]
        self.lists = {}  # tenant -> OrderedDict digest -> None, first = next victim
        self.scanned = set()

    def insert(self, digest, tenant, size, gen, raw=0, stamp=0, scanned=False, file=0, block=0):
        self.rows[digest] = [gen, tenant, size, 0, 0, stamp, file, block]  # raw is not kept
        q = self.lists.setdefault(tenant, OrderedDict())
        q[digest] = None
        if scanned:
            q.move_to_end(digest, last=False)
            self.scanned.add(digest)

    def remove(self, digest):
        values = self.rows.pop(digest)
        del self.lists[values[1]][digest]
        self.scanned.discard(digest)
        return tuple(values)

    def touch(self, digest, raw=0, stamp=0):
        values = self.rows[digest]
        values[4] = min(values[4] + 1, 255)  # reads saturate; raw is not kept
        if self.order == ORDER_LRU:
            self.lists[values[1]].move_to_end(digest)
            self.scanned.discard(digest)
        if stamp and digest not in self.scanned:  # a scanned row keeps its mtime until placed
            values[5] = stamp
        return values[4]

    def place_scanned(self):
        placed = sorted(self.scanned, key=lambda d: self.rows[d][5])
        for digest in reversed(placed):
            self.lists[self.rows[digest][1]].move_to_end(digest, last=False)
            self.rows[digest][5] = 0
        self.scanned.clear()
        return len(placed)


def agree(ix, model):
    assert len(ix) == len(model.rows)
    for digest, values in model.rows.items():
        assert ix.get(digest) == tuple(values)
    for tenant, q in model.lists.items():
        assert ix.count(tenant) == len(q)
        if model.order != ORDER_NONE:
            assert ix.digests(tenant) == list(q)
        else:
            assert sorted(ix.digests(tenant)) == sorted(q)


@pytest.mark.parametrize("order", [ORDER_LRU, ORDER_FIFO, ORDER_NONE])
def test_the_index_does_what_the_model_says(order):
    rng = random.Random(order)
    ix, model = PageIndex(order), Model(order)
    pool = [rng.getrandbits(128) for _ in range(3000)]
    stamps = iter(rng.sample(range(1, 10**6), 12000))
    for step in range(12000):
        digest = rng.choice(pool)
        op = rng.random()
        if op < 0.45:
            if digest in model.rows:
                with pytest.raises(KeyError):
                    ix.insert(digest, 0, 1)
                continue
            tenant, size = rng.randrange(4), rng.randrange(1, 2**32)
            scanned = rng.random() < 0.2
            stamp = next(stamps) if scanned else 0  # distinct: ties go in the order of the rows
            # A page in a batch chunk (file, block) or in a file of its own (0, 0).
            file, block = rng.choice([(0, 0), (rng.randrange(1, 2**32), rng.randrange(2**32))])
            gen = ix.insert(digest, tenant, size, stamp=stamp, scanned=scanned, file=file, block=block)
            model.insert(digest, tenant, size, gen, stamp=stamp, scanned=scanned, file=file, block=block)
        elif op < 0.6:
            got = ix.remove(digest)
            assert got == (model.remove(digest) if digest in model.rows else None)
        elif op < 0.65 and digest in model.rows:
            stale = model.rows[digest][0] + 1  # another version: left alone
            assert ix.remove(digest, stale) is None and ix.touch(digest, stale) == -1
            assert ix.remove(digest, model.rows[digest][0]) == model.remove(digest)
        elif op < 0.85:
            raw, stamp = rng.choice([(0, 0), (rng.randrange(1, 2**32), rng.randrange(1, 2**32))])
            got = ix.touch(digest, 0, raw, stamp)
            assert got == (model.touch(digest, raw, stamp) if digest in model.rows else -1)
        elif op < 0.95 and order != ORDER_NONE:
            tenant = rng.randrange(4)
            q = model.lists.get(tenant)
            victim = ix.pop_victim(tenant)
            if not q:
                assert victim is None
            else:
                expected = next(iter(q))
                assert victim == (expected, model.remove(expected))
        elif op > 0.995:
            assert ix.place_scanned() == model.place_scanned()
        elif op > 0.99:  # the same, in batches of at most 5 rows' keys, a slice of 2 at a time
            expected, placed = model.place_scanned(), 0
            ix.start_placing()
            bounds = ix.scanned_bounds(5)
            assert bounds == sorted(bounds)
            for lo, hi in zip([0] + bounds, bounds + [None]):
                keys = ix.scanned_order(lo, hi)
                assert 0 < len(keys) // 8 <= 5 or (hi is None and not bounds)  # distinct stamps: no bucket over 5
                placed += sum(ix.place_rows(keys, start, start + 2) for start in range(0, len(keys) // 8, 2))
            assert placed == expected
        if step % 500 == 0:
            agree(ix, model)
            assert ix.contains_many(pool) == bytes(d in model.rows for d in pool)
    agree(ix, model)


def test_growth_and_bytes_per_row():
    ix = PageIndex(ORDER_LRU)
    digests = [((i * 0x9E3779B97F4A7C15 & (2**64 - 1)) << 64) | i for i in range(1, 200_001)]
    for i, d in enumerate(digests):
        ix.insert(d, i % 7, 4096)
    assert len(ix) == len(digests) and all(d in ix for d in digests[::997])
    assert ROW_BYTES == 48
    per_row = ix.nbytes() / len(ix)
    assert 48 < per_row <= 48 + 4 / 0.43 + 1, per_row  # a 4-byte slot at a load of 0.43-0.65
    for d in digests[::2]:
        assert ix.remove(d) is not None
    assert len(ix) == 100_000 and not any(ix.contains_many(digests[::2]))
    assert all(ix.contains_many(digests[1::2]))
    for d in digests[::2]:  # freed rows are reused: the row array does not grow
        ix.insert(d, 0, 1)
    assert ix.nbytes() / len(ix) == per_row


def test_digests_that_share_their_low_bits_still_find_their_rows():
    ix = PageIndex(ORDER_FIFO)
    digests = [(i << 64) | 0xABCDEF for i in range(1, 20_001)]  # the same low 64 bits: the seeded mix spreads them
    for d in digests:
        ix.insert(d, 1, 1)
    assert ix.digests(1) == digests
    for d in digests[:10_000]:
        ix.remove(d)
    assert ix.contains_many(digests) == b"\0" * 10_000 + b"\1" * 10_000


def test_bad_arguments_are_refused():
    ix = PageIndex(ORDER_LRU)
    with pytest.raises(TypeError):
        ix.insert("abc", 0, 1)
    with pytest.raises(OverflowError):
        ix.insert(-1, 0, 1)
    with pytest.raises(OverflowError):
        ix.insert(2**128, 0, 1)
    with pytest.raises(ValueError):
        ix.insert(1, MAX_TENANTS, 1)
    with pytest.raises(OverflowError):
        ix.insert(1, 0, 2**32)
    with pytest.raises(ValueError):
        PageIndex(7)
    with pytest.raises(TypeError):
        PageIndex(ORDER_NONE).pop_victim(0)
    assert len(ix) == 0 and ix.pop_victim(0) is None


def test_rows_read_as_named_tuples_and_policies_map_to_orders():
    ix = PageIndex(ORDER_LRU)
    gen = ix.insert(5, 2, 10, raw=8, stamp=3)
    assert row(ix.get(5)) == Row(gen, 2, 10, 0, 0, 3) and row(ix.get(6)) is None  # raw is not kept
    gen = ix.insert(7, 1, 4096, file=9, block=33)
    assert row(ix.get(7)) == Row(gen, 1, 4096, 0, 0, 0, file=9, block=33)
    assert (order_for("lru"), order_for("fifo"), order_for("lfu")) == (ORDER_LRU, ORDER_FIFO, ORDER_NONE)


def test_victims_taken_while_scanned_rows_are_placed_are_always_the_oldest():
    """Placement runs a slice at a time with the index serving between slices: whatever is evicted then is
    never newer than a scanned row still waiting (the cold end holds the oldest placed, the rest is newer)."""
    rng = random.Random(3)
    ix = PageIndex(ORDER_LRU)
    fresh = [rng.getrandbits(128) for _ in range(50)]
    for d in fresh:
        ix.insert(d, 0, 1)
    stamps = rng.sample(range(1, 10**6), 2000)
    scanned = {rng.getrandbits(128): stamp for stamp in stamps}
    for d, stamp in scanned.items():
        ix.insert(d, 0, 1, stamp=stamp, scanned=True)
    ix.start_placing()
    keys = ix.scanned_order()
    evicted, touched = [], set()
    for start in range(0, len(keys) // 8, 100):
        ix.place_rows(keys, start, start + 100)
        for _ in range(10):
            digest, values = ix.pop_victim(0)
            evicted.append(digest)
            waiting = [scanned[d] for d in scanned if d in ix and ix.get(d)[5] != 0 and d not in touched]
            assert digest in scanned and digest not in touched and (not waiting or scanned[digest] < min(waiting))
        hit = rng.choice([d for d in scanned if d in ix and d not in touched])
        ix.touch(hit)  # a hit meanwhile: out of the scanned rows, to the hot end
        touched.add(hit)
    assert [scanned[d] for d in evicted] == sorted(scanned[d] for d in evicted)
    assert all(d in ix for d in fresh)  # written before the scan ended: behind every scanned row


def test_key_digests_are_the_protocols_key_digest_packed():
    """The native batch hash is xxh3_128 of namespace, NUL, key (short, long and non-ASCII keys alike),
    16 bytes each, low half first: what every index and a lookup by digest use."""
    from tiers.wire import protocol as P
    keys = ["0" * 64, "k", "é" * 40, "x" * 700, ""]
    packed = P.pack_key_digests("ns-é", keys)
    assert len(packed) == 16 * len(keys)
    for i, key in enumerate(keys):
        assert int.from_bytes(packed[16 * i:16 * i + 16], "little") == P.key_digest("ns-é", key)
    with pytest.raises(TypeError):
        P.pack_key_digests("ns", ["a", 3])


def test_contains_packed_answers_each_digest_and_filters_by_tenant():
    index = PageIndex(ORDER_NONE)
    assert index.contains_packed(b"\0" * 32) == b"\0\0"  # an index that never held a row
    digests = [random.getrandbits(128) for _ in range(300)]
    for d in digests[:200]:
        index.insert(d, 7 if d % 2 else 3, 10)
    packed = b"".join(d.to_bytes(16, "little") for d in digests)
    assert index.contains_packed(packed) == b"\1" * 200 + b"\0" * 100
    assert index.contains_packed(packed, 7) == bytes(int(d % 2 == 1) for d in digests[:200]) + b"\0" * 100
    index.remove(digests[0])
    assert index.contains_packed(packed[:32]) == b"\0\1"
    with pytest.raises(ValueError):
        index.contains_packed(b"\0" * 17)


def test_insert_packed_batches_agree_with_one_by_one():
    """A batch's digests held in one call (a DRAM tier's commit): new ones added with their size, one held
    already (or twice in the batch) keeps one row and takes the last size; past several resizes the rows
    read back as one-by-one inserts would have left them, and remove as they would."""
    import struct
    index = PageIndex(ORDER_NONE)
    digests = [random.getrandbits(128) for _ in range(5000)]
    index.insert(digests[0], 0, 7)
    batch = digests + [digests[1]]  # digests[1] twice: held once, with the last size
    sizes = list(range(1, len(digests) + 1)) + [99]
    packed = b"".join(d.to_bytes(16, "little") for d in batch)
    assert index.insert_packed(packed, struct.pack(f"<{len(sizes)}I", *sizes)) == len(digests) - 1
    assert index.contains_packed(b"".join(d.to_bytes(16, "little") for d in digests)) == b"\1" * len(digests)
    assert row(index.get(digests[0])).size == 1 and row(index.get(digests[1])).size == 99
    assert all(row(index.get(d)).size == i + 1 for i, d in enumerate(digests[2:], 2))
    assert all(row(index.get(d)).tenant == 0 for d in digests[:50])
    for d in digests[:100]:
        assert index.remove(d) is not None
    assert index.contains_packed(b"".join(d.to_bytes(16, "little") for d in digests[:101])) == b"\0" * 100 + b"\1"
    assert index.count(0) == len(digests) - 100
    with pytest.raises(ValueError):
        index.insert_packed(b"\0" * 16, b"\0" * 8)  # a size a digest
    with pytest.raises(ValueError):
        PageIndex(ORDER_LRU).insert_packed(b"\0" * 16, b"\0" * 4)  # an ordered index inserts row by row


@pytest.mark.parametrize("order", [ORDER_NONE, ORDER_LRU])
def test_remove_packed_drops_the_batch_and_leaves_the_rest(order):
    """A batch of victims off the index in one call (a DRAM tier's evictions): present digests go (their list
    places too), absent ones and a digest twice are counted once, everything else stays and still inserts."""
    index = PageIndex(order)
    digests = [random.getrandbits(128) for _ in range(3000)]
    for d in digests:
        index.insert(d, 0, 5)
    gone = digests[:1000:2] + [random.getrandbits(128), digests[0]]  # one never held, one twice
    assert index.remove_packed(b"".join(d.to_bytes(16, "little") for d in gone)) == 500
    kept = [d for d in digests if d not in set(digests[:1000:2])]
    assert len(index) == len(kept) == 2500
    assert index.contains_packed(b"".join(d.to_bytes(16, "little") for d in digests[:4])) == b"\0\1\0\1"
    if order == ORDER_LRU:
        assert index.digests(0) == kept  # the list skips exactly the removed rows, in order
    index.insert(digests[0], 0, 9)
    assert row(index.get(digests[0])).size == 9
    with pytest.raises(ValueError):
        index.remove_packed(b"\0" * 17)

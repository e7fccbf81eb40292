/* The page directory: where each page of a DRAM arena lies, in shared memory engines map read-only.
 *
 * A DRAM tier's daemon writes it (one writer: the store's lock); engines read it without asking the
 * daemon, so a hit is read with no round trip and no wake-up of the daemon.  Nothing an engine reads
 * here is trusted further than it can check:
 *   - a slot is a seqlock: its sequence is odd while it is written, and a reader that sees it change
 *     across its read takes the slot as absent;
 *   - every block of the arena carries the id of the page that holds it (owner, 0: none).  Ids are never
 *     reused.  The daemon clears a page's owners before its blocks can be reused, so a reader that found
 *     the page, copied its blocks, and then finds each block still owned by that page id copied the page
 *     as it was committed (the writer's stores are seen in order on x86-64: TSO);
 *   - a slot names its namespace's number as the daemon gave it, so a key of one namespace whose digest
 *     collides with another's never finds the other's page;
 *   - block numbers, sizes and chains are bounded by the directory's header before anything is read.
 * A miss here is never an answer: the engine asks the daemon for the pages it did not find.
 *
 * Layout (little-endian, 8-byte aligned): header (64 bytes), owner u64[n_blocks], next u32[n_blocks]
 * (padded to 8 bytes), slots[n_slots] of 64 bytes.  n_slots is a power of two, at least twice the
 * blocks (a page takes one block at least), so the table is never more than half full.
 *
 * Loaded with ctypes (which releases the GIL around each call); no Python API.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define DIR_MAGIC 0x3152494445474150ULL /* "PAGEDIR1" */
#define DIR_VERSION 1
#define END_BLOCK 0xFFFFFFFFu
#define MAX_PROBES 4096 /* a reader gives up (a miss) past this many slots */

typedef struct {
    uint64_t magic;
    uint32_t version, n_slots, n_blocks, block_size;
    uint64_t next_id; /* the writer's: the last page id handed out */
    uint64_t pad[4];
} dir_header;

typedef struct {
    uint64_t seq;     /* odd while the slot is written */
    uint64_t page_id; /* 0: empty */
    uint64_t d_lo, d_hi;
    uint64_t checksum;
    uint32_t size, first;
    uint32_t ns, pad0;
    uint64_t pad1;
} dir_slot;

_Static_assert(sizeof(dir_header) == 64, "header is 64 bytes");
_Static_assert(sizeof(dir_slot) == 64, "a slot is 64 bytes");

static inline uint64_t *owners(void *base) { return (uint64_t *)((char *)base + sizeof(dir_header)); }
static inline uint32_t *nexts(void *base)
{
    const dir_header *h = base;
    return (uint32_t *)((char *)base + sizeof(dir_header) + 8 * (size_t)h->n_blocks);
}
static inline dir_slot *slots(void *base)
{
    const dir_header *h = base;
    size_t next_bytes = ((4 * (size_t)h->n_blocks) + 7) & ~(size_t)7;
    return (dir_slot *)((char *)base + sizeof(dir_header) + 8 * (size_t)h->n_blocks + next_bytes);
}

uint64_t dir_bytes(uint32_t n_blocks, uint32_t n_slots)
{
    size_t next_bytes = ((4 * (size_t)n_blocks) + 7) & ~(size_t)7;
    return sizeof(dir_header) + 8 * (uint64_t)n_blocks + next_bytes + sizeof(dir_slot) * (uint64_t)n_slots;
}

static inline uint64_t home(uint64_t d_lo, uint32_t ns, uint32_t mask)
{
    return (d_lo ^ ((uint64_t)ns * 0x9E3779B97F4A7C15ULL)) & mask;
}

/* ------------------------------------------------------------------ writer (the daemon, one at a time) */

void dir_init(void *base, uint32_t n_blocks, uint32_t n_slots, uint32_t block_size)
{
    memset(base, 0, dir_bytes(n_blocks, n_slots));
    dir_header *h = base;
    h->version = DIR_VERSION;
    h->n_slots = n_slots;
    h->n_blocks = n_blocks;
    h->block_size = block_size;
    __atomic_store_n(&h->magic, DIR_MAGIC, __ATOMIC_RELEASE);
}

static void slot_write(dir_slot *s, const dir_slot *v)
{
    uint64_t seq = s->seq;
    __atomic_store_n(&s->seq, seq + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    __atomic_store_n(&s->page_id, v->page_id, __ATOMIC_RELAXED);
    __atomic_store_n(&s->d_lo, v->d_lo, __ATOMIC_RELAXED);
    __atomic_store_n(&s->d_hi, v->d_hi, __ATOMIC_RELAXED);
    __atomic_store_n(&s->checksum, v->checksum, __ATOMIC_RELAXED);
    __atomic_store_n(&s->size, v->size, __ATOMIC_RELAXED);
    __atomic_store_n(&s->first, v->first, __ATOMIC_RELAXED);
    __atomic_store_n(&s->ns, v->ns, __ATOMIC_RELAXED);
    __atomic_store_n(&s->seq, seq + 2, __ATOMIC_RELEASE);
}

static int64_t find(void *base, uint64_t d_lo, uint64_t d_hi, uint32_t ns)
{
    const dir_header *h = base;
    dir_slot *t = slots(base);
    uint32_t mask = h->n_slots - 1;
    for (uint64_t i = home(d_lo, ns, mask), k = 0; k < h->n_slots; i = (i + 1) & mask, k++) {
        if (t[i].page_id == 0)
            return -1;
        if (t[i].d_lo == d_lo && t[i].d_hi == d_hi && t[i].ns == ns)
            return (int64_t)i;
    }
    return -1;
}

/* Remove slot i: its blocks lose their owner first, then the slots after it in its run move back
 * (linear probing's deletion without tombstones).  A reader racing a move may miss a page: it asks
 * the daemon then. */
static void remove_at(void *base, uint64_t i)
{
    const dir_header *h = base;
    dir_slot *t = slots(base);
    uint64_t *owner = owners(base);
    uint32_t *next = nexts(base);
    uint32_t mask = h->n_slots - 1;
    uint64_t id = t[i].page_id;
    uint32_t b = t[i].first;
    const uint64_t count = ((uint64_t)t[i].size + h->block_size - 1) / h->block_size;
    for (uint64_t k = 0; k < count && b < h->n_blocks; k++) {
        if (owner[b] == id)
            __atomic_store_n(&owner[b], 0, __ATOMIC_RELEASE);
        b = next[b];
    }
    dir_slot empty = {0};
    slot_write(&t[i], &empty);
    uint64_t hole = i;
    for (uint64_t j = (i + 1) & mask;; j = (j + 1) & mask) {
        if (t[j].page_id == 0)
            return;
        uint64_t k = home(t[j].d_lo, t[j].ns, mask);
        /* t[j] may move into the hole when its home is not cyclically within (hole, j] */
        int stays = hole <= j ? (hole < k && k <= j) : (hole < k || k <= j);
        if (!stays) {
            dir_slot moved = t[j];
            slot_write(&t[hole], &moved);
            slot_write(&t[j], &empty);
            hole = j;
        }
    }
}

/* Publish n pages: digests (16 bytes each: low then high 64 bits), sizes, checksums, and each page's
 * runs of the arena in order (run_counts[i] of them, flat in run_off / run_len: whole blocks but for a
 * page's last).  A page already published under the same digest and namespace is withdrawn first.
 * Returns the pages published (fewer only when a page's runs leave the arena or the table has no free
 * slot: those pages are simply not found). */
int64_t dir_publish(void *base, uint32_t ns, int64_t n, const uint8_t *digests, const uint32_t *sizes,
                    const uint64_t *checksums, const uint64_t *run_off, const uint64_t *run_len,
                    const int64_t *run_counts)
{
    dir_header *h = base;
    dir_slot *t = slots(base);
    uint64_t *owner = owners(base);
    uint32_t *next = nexts(base);
    const uint32_t mask = h->n_slots - 1, bs = h->block_size;
    int64_t published = 0, at = 0;
    for (int64_t p = 0; p < n; p++) {
        const int64_t first_run = at, runs = run_counts[p];
        at += runs;
        uint64_t d_lo, d_hi;
        memcpy(&d_lo, digests + 16 * p, 8);
        memcpy(&d_hi, digests + 16 * p + 8, 8);
        int64_t old = find(base, d_lo, d_hi, ns);
        if (old >= 0)
            remove_at(base, (uint64_t)old);
        int ok = runs > 0;
        for (int64_t r = first_run; ok && r < first_run + runs; r++)
            ok = run_off[r] % bs == 0 && run_len[r] > 0 && (run_off[r] + run_len[r] + bs - 1) / bs <= h->n_blocks;
        if (!ok)
            continue;
        uint64_t id = ++h->next_id;
        uint32_t first = (uint32_t)(run_off[first_run] / bs), prev = END_BLOCK;
        for (int64_t r = first_run; r < first_run + runs; r++) { /* the chain, then the owners */
            for (uint64_t b = run_off[r] / bs; b < (run_off[r] + run_len[r] + bs - 1) / bs; b++) {
                if (prev != END_BLOCK)
                    next[prev] = (uint32_t)b;
                prev = (uint32_t)b;
            }
        }
        next[prev] = END_BLOCK;
        for (int64_t r = first_run; r < first_run + runs; r++)
            for (uint64_t b = run_off[r] / bs; b < (run_off[r] + run_len[r] + bs - 1) / bs; b++)
                __atomic_store_n(&owner[b], id, __ATOMIC_RELEASE);
        for (uint64_t i = home(d_lo, ns, mask), k = 0; k < h->n_slots; i = (i + 1) & mask, k++) {
            if (t[i].page_id == 0) {
                dir_slot v = {0};
                v.page_id = id;
                v.d_lo = d_lo;
                v.d_hi = d_hi;
                v.checksum = checksums[p];
                v.size = sizes[p];
                v.first = first;
                v.ns = ns;
                slot_write(&t[i], &v);
                published++;
                break;
            }
        }
    }
    return published;
}

/* Withdraw n pages of namespace ns (absent ones are skipped); returns the pages withdrawn. */
int64_t dir_withdraw(void *base, uint32_t ns, int64_t n, const uint8_t *digests)
{
    int64_t removed = 0;
    for (int64_t p = 0; p < n; p++) {
        uint64_t d_lo, d_hi;
        memcpy(&d_lo, digests + 16 * p, 8);
        memcpy(&d_hi, digests + 16 * p + 8, 8);
        int64_t at = find(base, d_lo, d_hi, ns);
        if (at >= 0) {
            remove_at(base, (uint64_t)at);
            removed++;
        }
    }
    return removed;
}

/* Pages published (for stats and tests). */
int64_t dir_count(void *base)
{
    const dir_header *h = base;
    dir_slot *t = slots(base);
    int64_t n = 0;
    for (uint64_t i = 0; i < h->n_slots; i++)
        n += t[i].page_id != 0;
    return n;
}

/* ------------------------------------------------------------------ readers (engines, read-only) */

/* A reader's lookup of (d_lo, d_hi, ns): 1 with the slot's snapshot in *v when found; 0 when absent, when the
 * probe passes MAX_PROBES, or when a slot on the way is being written or changed during its read (a miss:
 * the daemon answers for it).  The seqlock's read side, the only one. */
static int probe(void *base, uint64_t d_lo, uint64_t d_hi, uint32_t ns, dir_slot *v)
{
    const dir_header *h = base;
    const uint32_t n_slots = h->n_slots, mask = n_slots - 1;
    dir_slot *t = slots(base);
    for (uint64_t i = home(d_lo, ns, mask), k = 0; k < n_slots && k < MAX_PROBES; i = (i + 1) & mask, k++) {
        dir_slot *s = &t[i];
        uint64_t s1 = __atomic_load_n(&s->seq, __ATOMIC_ACQUIRE);
        v->page_id = __atomic_load_n(&s->page_id, __ATOMIC_RELAXED);
        v->d_lo = __atomic_load_n(&s->d_lo, __ATOMIC_RELAXED);
        v->d_hi = __atomic_load_n(&s->d_hi, __ATOMIC_RELAXED);
        v->checksum = __atomic_load_n(&s->checksum, __ATOMIC_RELAXED);
        v->size = __atomic_load_n(&s->size, __ATOMIC_RELAXED);
        v->first = __atomic_load_n(&s->first, __ATOMIC_RELAXED);
        v->ns = __atomic_load_n(&s->ns, __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        uint64_t s2 = __atomic_load_n(&s->seq, __ATOMIC_RELAXED);
        if ((s1 & 1) || s1 != s2 || v->page_id == 0)
            return 0;
        if (v->d_lo == d_lo && v->d_hi == d_hi && v->ns == ns)
            return 1;
    }
    return 0;
}

/* The header as a reader checks it against its mapping: 0 when usable, -1 when not a directory of this
 * version or larger than the mapping. */
int dir_check(const void *base, uint64_t mapped, uint64_t arena_size)
{
    const dir_header *h = base;
    if (mapped < sizeof(dir_header) || __atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != DIR_MAGIC ||
        h->version != DIR_VERSION)
        return -1;
    if (h->n_slots == 0 || (h->n_slots & (h->n_slots - 1)) || h->block_size == 0 ||
        dir_bytes(h->n_blocks, h->n_slots) > mapped || (uint64_t)h->n_blocks * h->block_size > arena_size)
        return -1;
    return 0;
}

/* Find n pages of namespace ns, each expected at size bytes.  A page found gets its id in ids[i]
 * (0: not found), its checksum in sums[i], its blocks appended to blocks (ceil(size / block_size) of
 * them) and its runs of the arena (offsets merged where blocks are adjacent) appended to run_off /
 * run_len, run_counts[i] of them.  Returns the pages found; -1 when max_runs or max_blocks would be
 * passed (nothing then is usable). */
int64_t dir_resolve(void *base, uint32_t ns, int64_t n, const uint8_t *digests, uint32_t size, uint64_t *ids,
                    uint64_t *sums, uint32_t *blocks, int64_t max_blocks, uint64_t *run_off, uint64_t *run_len,
                    int64_t *run_counts, int64_t max_runs)
{
    const dir_header *h = base;
    const uint32_t n_blocks = h->n_blocks, bs = h->block_size;
    const uint64_t *owner = owners(base);
    const uint32_t *next = nexts(base);
    int64_t found = 0, nb = 0, nr = 0;
    for (int64_t p = 0; p < n; p++) {
        ids[p] = 0;
        sums[p] = 0;
        run_counts[p] = 0;
        uint64_t d_lo, d_hi;
        memcpy(&d_lo, digests + 16 * p, 8);
        memcpy(&d_hi, digests + 16 * p + 8, 8);
        dir_slot v = {0};
        const int hit = probe(base, d_lo, d_hi, ns, &v);
        if (!hit || v.size != size || v.size == 0)
            continue;
        const int64_t count = ((int64_t)v.size + bs - 1) / bs;
        if (nb + count > max_blocks || nr + count > max_runs)
            return -1;
        uint32_t b = v.first;
        int64_t runs = 0;
        uint64_t left = v.size;
        int whole = 1;
        for (int64_t k = 0; k < count; k++) {
            if (b >= n_blocks || __atomic_load_n(&owner[b], __ATOMIC_ACQUIRE) != v.page_id) {
                whole = 0;
                break;
            }
            uint64_t off = (uint64_t)b * bs, len = left < bs ? left : bs;
            blocks[nb + k] = b;
            if (runs && run_off[nr + runs - 1] + run_len[nr + runs - 1] == off)
                run_len[nr + runs - 1] += len;
            else {
                run_off[nr + runs] = off;
                run_len[nr + runs] = len;
                runs++;
            }
            left -= len;
            b = __atomic_load_n(&next[b], __ATOMIC_RELAXED);
        }
        if (!whole)
            continue;
        ids[p] = v.page_id;
        sums[p] = v.checksum;
        run_counts[p] = runs;
        nb += count;
        nr += runs;
        found++;
    }
    return found;
}

/* held[i] = 1 when page i of namespace ns is in the directory (for lookups: no block is read; a page
 * evicted right after is a miss of the read that follows, as after a lookup the daemon answered).
 * Returns how many. */
int64_t dir_held(void *base, uint32_t ns, int64_t n, const uint8_t *digests, uint8_t *held)
{
    int64_t count = 0;
    for (int64_t p = 0; p < n; p++) {
        uint64_t d_lo, d_hi;
        memcpy(&d_lo, digests + 16 * p, 8);
        memcpy(&d_hi, digests + 16 * p + 8, 8);
        dir_slot v;
        held[p] = (uint8_t)probe(base, d_lo, d_hi, ns, &v);
        count += held[p];
    }
    return count;
}

/* After the copy: ok[i] = 1 when every block of found page i (ids[i] != 0, size bytes, its blocks in order
 * as dir_resolve listed them) is still owned by it, so the bytes copied were the committed page's.
 * Returns the pages that held. */
int64_t dir_validate(void *base, int64_t n, const uint64_t *ids, uint32_t size, const uint32_t *blocks, uint8_t *ok)
{
    const dir_header *h = base;
    const uint32_t n_blocks = h->n_blocks, bs = h->block_size;
    const uint64_t *owner = owners(base);
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the copy's loads come before these */
    int64_t held = 0, nb = 0;
    for (int64_t p = 0; p < n; p++) {
        ok[p] = 0;
        if (ids[p] == 0)
            continue;
        const int64_t count = ((int64_t)size + bs - 1) / bs;
        int still = 1;
        for (int64_t k = 0; k < count; k++) {
            uint32_t b = blocks[nb + k];
            if (b >= n_blocks || __atomic_load_n(&owner[b], __ATOMIC_ACQUIRE) != ids[p])
                still = 0;
        }
        nb += count;
        ok[p] = (uint8_t)still;
        held += still;
    }
    return held;
}

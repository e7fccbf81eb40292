/* A page index for a whole node: 128-bit digest -> one fixed 48-byte row (tiers/stores/page_index.py).
 *
 * A tier of tens of millions of pages cannot afford a Python dict entry, an
 * entry object and a policy node a page (the NVMe tier spent ~470 bytes a
 * chunk that way).  Here a page is one row in an array that grows with
 * mremap (no copy, so no second array at the peak) and one 4-byte slot in an
 * open-addressing table (linear probing, deletions shift back: no
 * tombstones).  The slot of a digest mixes it with a per-index random seed,
 * so digests chosen to share their low bits do not pile up in one run.
 *
 * Eviction order lives in the rows too: each tenant (a namespace, a small
 * integer the caller assigns) has a doubly-linked list through the rows'
 * prev/next, head = the next victim.  ORDER_LRU moves a row to the tail on
 * every touch, ORDER_FIFO never; ORDER_NONE keeps no list (a Python policy
 * plug-in orders the digests itself).
 *
 * Every call that changes the index runs holding the GIL: the GIL is the
 * index's lock (a lookup from another thread sees a whole row or none, never
 * a table half rehashed).  Three calls let other threads run: save (its
 * caller keeps every change out), and the passes of scanned_order and
 * scanned_bounds, which read ix->rows anew after each pause and sort a copy.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>
#include <errno.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#define NIL 0xFFFFFFFFu
#define F_USED 1u
#define F_SCANNED 2u /* added by a restart scan, not yet placed in order: kept at the cold end */
#define MAX_TENANTS 65536
#define MIN_SLOTS 1024u

enum { ORDER_NONE = 0, ORDER_LRU = 1, ORDER_FIFO = 2 };

typedef struct {
    uint64_t lo, hi;                 /* the digest */
    uint32_t size, stamp;            /* caller's figures: bytes held, a time in seconds */
    uint32_t prev, next;             /* order list of the tenant; next also chains free rows */
    uint32_t gen;                    /* which version of the digest this row holds (changes at each insert) */
    uint32_t file, block;            /* where the page lies: a file of many pages and its 4 KiB block (0: its own) */
    uint16_t tenant;
    uint8_t flags, reads;            /* reads saturate at MAX_READS: 48 bytes a row (the page's own size is in
                                        its header, read with it) */
} row_t;

#define MAX_READS 255u

typedef struct { uint32_t head, tail, count, placed; } list_t; /* placed: the last row place_rows placed */

typedef struct {
    PyObject_HEAD
    row_t *rows;
    size_t rows_cap, rows_top; /* rows mapped, rows ever used */
    uint32_t free_head, used;
    uint32_t *slots;           /* row index + 1; 0 = empty */
    size_t nslots;
    uint64_t seed;
    uint32_t gen;
    int order;
    list_t *lists;             /* MAX_TENANTS of them (1 MiB an index) */
} PageIndex;

static inline size_t slot_of(const PageIndex *ix, uint64_t lo, uint64_t hi) {
    uint64_t h = (lo ^ ix->seed) * 0x9E3779B97F4A7C15ull ^ (hi + ix->seed);
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    return (size_t)(((unsigned __int128)h * ix->nslots) >> 64); /* any table size, not only powers of two */
}

static inline size_t next_slot(const PageIndex *ix, size_t s) { return s + 1 == ix->nslots ? 0 : s + 1; }

/* Probe steps from slot a forward to slot b (the table wraps around). */
static inline size_t steps(const PageIndex *ix, size_t a, size_t b) { return b >= a ? b - a : b + ix->nslots - a; }

static int digest_of(PyObject *v, uint64_t *lo, uint64_t *hi) {
    if (!PyLong_Check(v)) {
        PyErr_SetString(PyExc_TypeError, "a digest is an int");
        return -1;
    }
    unsigned char b[16];
    if (_PyLong_AsByteArray((PyLongObject *)v, b, 16, 1, 0) < 0)
        return -1;
    memcpy(lo, b, 8);
    memcpy(hi, b + 8, 8);
    return 0;
}

static PyObject *digest_obj(const row_t *r) {
    unsigned char b[16];
    memcpy(b, &r->lo, 8);
    memcpy(b + 8, &r->hi, 8);
    return _PyLong_FromByteArray(b, 16, 1, 0);
}

/* The row of a digest, or NIL. */
static uint32_t find(const PageIndex *ix, uint64_t lo, uint64_t hi) {
    for (size_t s = slot_of(ix, lo, hi);; s = next_slot(ix, s)) {
        uint32_t v = ix->slots[s];
        if (!v) return NIL;
        const row_t *r = &ix->rows[v - 1];
        if (r->lo == lo && r->hi == hi) return v - 1;
    }
}

/* One walk for a find and the place that follows it: the slot holding digest (lo, hi) (*found: its row) or,
   when absent (*found = NIL), the empty slot that ends its run, where an insert puts it. */
static size_t probe(const PageIndex *ix, uint64_t lo, uint64_t hi, uint32_t *found) {
    for (size_t s = slot_of(ix, lo, hi);; s = next_slot(ix, s)) {
        uint32_t v = ix->slots[s];
        if (!v) { *found = NIL; return s; }
        const row_t *r = &ix->rows[v - 1];
        if (r->lo == lo && r->hi == hi) { *found = v - 1; return s; }
    }
}

/* Bulk inserts (a snapshot's load, a scan's records) probe a random slot and a random row a digest, a cache
   miss each on a table of millions: these walk a batch with both fetched ahead, the slot PROBE_AHEAD digests
   before its probe and the row its slot names half as many before (a million-row snapshot's load 208 -> 148
   ms at a load of 0.8, medians of 12 here). */
#define PROBE_AHEAD 16
#define PREFETCH_MIN_SLOT_BYTES (1u << 20) /* a slot table past ~a core's L2: ~170,000 rows */
static inline void prefetch_probe(const PageIndex *ix, uint64_t lo, uint64_t hi) {
    __builtin_prefetch(&ix->slots[slot_of(ix, lo, hi)]);
}
static inline void prefetch_row(const PageIndex *ix, uint64_t lo, uint64_t hi) {
    uint32_t v = ix->slots[slot_of(ix, lo, hi)];
    if (v) __builtin_prefetch(&ix->rows[v - 1]);
}

static void place(PageIndex *ix, uint32_t row) {
    size_t s = slot_of(ix, ix->rows[row].lo, ix->rows[row].hi);
    while (ix->slots[s]) s = next_slot(ix, s);
    ix->slots[s] = row + 1;
}

/* Room for want rows at a load of at most 0.65.  Sized for a known count (exact: reserve, load) the table is
   loaded 0.65; one that grows as rows come grows by 1.5x at least: 6.2-9.2 bytes of slots a row.  Every probe
   past the first reads a row elsewhere (a cache miss at node scale): linear probing at 0.8 took ~3 probes for
   a hit and ~13 for a miss, at 0.65 ~2 and ~5 (128 absent digests of a million-row index: 16.6 -> 2.5 us,
   present 7.5 -> 2.0 us; a snapshot's load 148 -> 129 ms) for 1.2 bytes a row more. */
static int grow_slots(PageIndex *ix, size_t want, int exact) {
    if (ix->nslots && want * 20 <= ix->nslots * 13) return 0;
    size_t n = want * 20 / 13 + 1;
    if (!exact && n < ix->nslots + ix->nslots / 2) n = ix->nslots + ix->nslots / 2;
    if (n < MIN_SLOTS) n = MIN_SLOTS;
    uint32_t *slots = mmap(NULL, n * sizeof(uint32_t), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (slots == MAP_FAILED) { PyErr_NoMemory(); return -1; }
    uint32_t *old = ix->slots;
    size_t old_n = ix->nslots;
    ix->slots = slots;
    ix->nslots = n;
    for (size_t i = 0; i < old_n; i++)
        if (old[i]) place(ix, old[i] - 1);
    if (old) munmap(old, old_n * sizeof(uint32_t));
    return 0;
}

static int grow_rows(PageIndex *ix, size_t want) {
    if (want <= ix->rows_cap) return 0;
    if (want > NIL) { PyErr_SetString(PyExc_OverflowError, "a page index holds at most 2**32 - 1 rows"); return -1; }
    size_t cap = ix->rows_cap ? ix->rows_cap : 4096;
    while (cap < want) cap *= 2;
    if (cap > NIL) cap = NIL;
    void *p = ix->rows ? mremap(ix->rows, ix->rows_cap * sizeof(row_t), cap * sizeof(row_t), MREMAP_MAYMOVE)
                       : mmap(NULL, cap * sizeof(row_t), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) { PyErr_NoMemory(); return -1; }
    ix->rows = p;
    ix->rows_cap = cap;
    return 0;
}

/* Take the row out of the slot table (backward-shift deletion keeps probe runs whole). */
static void unslot(PageIndex *ix, uint32_t row) {
    size_t s = slot_of(ix, ix->rows[row].lo, ix->rows[row].hi);
    while (ix->slots[s] != row + 1) s = next_slot(ix, s);
    size_t hole = s;
    for (size_t j = next_slot(ix, hole); ix->slots[j]; j = next_slot(ix, j)) {
        const row_t *r = &ix->rows[ix->slots[j] - 1];
        size_t home = slot_of(ix, r->lo, r->hi);
        /* The entry at j may fill the hole when its home is not cyclically within (hole, j]. */
        if (steps(ix, home, j) >= steps(ix, hole, j)) {
            ix->slots[hole] = ix->slots[j];
            hole = j;
        }
    }
    ix->slots[hole] = 0;
}

static inline list_t *list_of(PageIndex *ix, uint16_t tenant) { return &ix->lists[tenant]; }

static void list_unlink(PageIndex *ix, uint32_t row) {
    row_t *r = &ix->rows[row];
    list_t *q = list_of(ix, r->tenant);
    if (r->prev != NIL) ix->rows[r->prev].next = r->next; else q->head = r->next;
    if (r->next != NIL) ix->rows[r->next].prev = r->prev; else q->tail = r->prev;
    if (q->placed == row) q->placed = r->prev; /* placed rows are a head segment: its new last is the one before */
    q->count--;
}

static void list_push_tail(PageIndex *ix, uint32_t row) {
    row_t *r = &ix->rows[row];
    list_t *q = list_of(ix, r->tenant);
    r->next = NIL;
    r->prev = q->tail;
    if (q->tail != NIL) ix->rows[q->tail].next = row; else q->head = row;
    q->tail = row;
    q->count++;
}

static void list_push_head(PageIndex *ix, uint32_t row) {
    row_t *r = &ix->rows[row];
    list_t *q = list_of(ix, r->tenant);
    r->prev = NIL;
    r->next = q->head;
    if (q->head != NIL) ix->rows[q->head].prev = row; else q->tail = row;
    q->head = row;
    q->count++;
}

static PyObject *row_tuple(const row_t *r) {
    return Py_BuildValue("(IIIIIIII)", r->gen, (unsigned)r->tenant, r->size, 0u, (unsigned)r->reads, r->stamp,
                         r->file, r->block);
}

static void drop_row(PageIndex *ix, uint32_t row) {
    row_t *r = &ix->rows[row];
    unslot(ix, row);
    if (ix->order != ORDER_NONE) list_unlink(ix, row);
    r->flags = 0;
    r->next = ix->free_head;
    ix->free_head = row;
    ix->used--;
}

/* add_row without the place: filled and in its tenant's list, not yet in a slot (the caller puts it in the
   empty slot its probe found). */
static uint32_t new_row(PageIndex *ix, uint64_t lo, uint64_t hi, uint32_t size, uint32_t reads,
                        uint32_t stamp, uint16_t tenant, int scanned, uint32_t file, uint32_t block) {
    uint32_t row;
    if (ix->free_head != NIL) {
        row = ix->free_head;
        ix->free_head = ix->rows[row].next;
    } else {
        row = (uint32_t)ix->rows_top++;
    }
    uint32_t gen = ++ix->gen ? ix->gen : ++ix->gen; /* never 0: 0 means "any version" to remove and touch */
    ix->rows[row] = (row_t){lo, hi, size, stamp, NIL, NIL, gen, file, block, tenant,
                            (uint8_t)(F_USED | (scanned ? F_SCANNED : 0)), (uint8_t)(reads < MAX_READS ? reads : MAX_READS)};
    if (ix->order != ORDER_NONE) {
        if (scanned) list_push_head(ix, row); else list_push_tail(ix, row);
    }
    ix->used++;
    return row;
}

/* A new row for a digest not in the index (the caller made room: grow_slots for used + 1, grow_rows when no
   row is free): filled, placed in the table, in its tenant's list (a scanned row at the cold end); its row. */
static uint32_t add_row(PageIndex *ix, uint64_t lo, uint64_t hi, uint32_t size, uint32_t reads,
                        uint32_t stamp, uint16_t tenant, int scanned, uint32_t file, uint32_t block) {
    uint32_t row = new_row(ix, lo, hi, size, reads, stamp, tenant, scanned, file, block);
    place(ix, row);
    return row;
}

/* Row goes right behind row after in after's list. */
static void list_insert_after(PageIndex *ix, uint32_t after, uint32_t row) {
    row_t *r = &ix->rows[row];
    list_t *q = list_of(ix, r->tenant);
    r->prev = after;
    r->next = ix->rows[after].next;
    if (r->next != NIL) ix->rows[r->next].prev = row; else q->tail = row;
    ix->rows[after].next = row;
    q->count++;
}

/* Each tenant's placed segment empty: the next place_rows puts its first row at the head. */
static void clear_placed(PageIndex *ix) {
    for (size_t t = 0; t < MAX_TENANTS; t++) ix->lists[t].placed = NIL;
}

/* ------------------------------------------------------------------ methods */

static PyObject *PageIndex_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"order", "expected", NULL};
    int order = ORDER_LRU;
    Py_ssize_t expected = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|in", names, &order, &expected)) return NULL;
    if (order < ORDER_NONE || order > ORDER_FIFO) {
        PyErr_SetString(PyExc_ValueError, "order is ORDER_NONE, ORDER_LRU or ORDER_FIFO");
        return NULL;
    }
    PageIndex *ix = (PageIndex *)type->tp_alloc(type, 0);
    if (!ix) return NULL;
    ix->order = order;
    ix->free_head = NIL;
    if (getrandom(&ix->seed, sizeof ix->seed, 0) != sizeof ix->seed) ix->seed = (uint64_t)(uintptr_t)ix ^ 0x5851F42D4C957F2Dull;
    ix->lists = mmap(NULL, MAX_TENANTS * sizeof(list_t), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ix->lists == MAP_FAILED) { ix->lists = NULL; Py_DECREF(ix); return PyErr_NoMemory(); }
    for (size_t t = 0; t < MAX_TENANTS; t++) ix->lists[t] = (list_t){NIL, NIL, 0, NIL};
    if (grow_slots(ix, expected > 0 ? (size_t)expected : 0, 1) < 0 || grow_rows(ix, expected > 0 ? (size_t)expected : 1) < 0) {
        Py_DECREF(ix);
        return NULL;
    }
    return (PyObject *)ix;
}

static void PageIndex_dealloc(PageIndex *ix) {
    if (ix->rows) munmap(ix->rows, ix->rows_cap * sizeof(row_t));
    if (ix->slots) munmap(ix->slots, ix->nslots * sizeof(uint32_t));
    if (ix->lists) munmap(ix->lists, MAX_TENANTS * sizeof(list_t));
    Py_TYPE(ix)->tp_free((PyObject *)ix);
}

static Py_ssize_t PageIndex_len(PageIndex *ix) { return ix->used; }

static int PageIndex_contains(PageIndex *ix, PyObject *key) {
    uint64_t lo, hi;
    if (digest_of(key, &lo, &hi) < 0) return -1;
    return find(ix, lo, hi) != NIL;
}

static PyObject *PageIndex_get(PageIndex *ix, PyObject *key) {
    uint64_t lo, hi;
    if (digest_of(key, &lo, &hi) < 0) return NULL;
    uint32_t row = find(ix, lo, hi);
    if (row == NIL) Py_RETURN_NONE;
    return row_tuple(&ix->rows[row]);
}

static int tenant_arg(long tenant) {
    if (tenant < 0 || tenant >= MAX_TENANTS) {
        PyErr_Format(PyExc_ValueError, "tenant %ld outside 0..%d", tenant, MAX_TENANTS - 1);
        return -1;
    }
    return 0;
}

/* insert(digest, tenant, size, raw=0, stamp=0, scanned=False, file=0, block=0) -> gen; the digest must be
   absent.  raw is taken and not kept (rows read it as 0). */
static PyObject *PageIndex_insert(PageIndex *ix, PyObject *args, PyObject *kw) {
    static char *names[] = {"digest", "tenant", "size", "raw", "stamp", "scanned", "file", "block", NULL};
    PyObject *key;
    long tenant;
    unsigned long long size, raw = 0, stamp = 0, file = 0, block = 0;
    int scanned = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OlK|KKpKK", names, &key, &tenant, &size, &raw, &stamp, &scanned,
                                     &file, &block))
        return NULL;
    uint64_t lo, hi;
    if (digest_of(key, &lo, &hi) < 0 || tenant_arg(tenant) < 0) return NULL;
    if (size > 0xFFFFFFFFull || raw > 0xFFFFFFFFull || stamp > 0xFFFFFFFFull || file > 0xFFFFFFFFull
        || block > 0xFFFFFFFFull) {
        PyErr_SetString(PyExc_OverflowError, "size, raw, stamp, file and block are 32-bit");
        return NULL;
    }
    if (find(ix, lo, hi) != NIL) {
        PyErr_SetString(PyExc_KeyError, "digest already indexed");
        return NULL;
    }
    if (grow_slots(ix, (size_t)ix->used + 1, 0) < 0) return NULL;
    if (ix->free_head == NIL && grow_rows(ix, ix->rows_top + 1) < 0) return NULL;
    uint32_t row = add_row(ix, lo, hi, (uint32_t)size, 0, (uint32_t)stamp, (uint16_t)tenant, scanned,
                           (uint32_t)file, (uint32_t)block);
    return PyLong_FromUnsignedLong(ix->rows[row].gen);
}

/* remove(digest, gen=0) -> the row's tuple, or None when absent (or holding another version than gen). */
static PyObject *PageIndex_remove(PageIndex *ix, PyObject *args) {
    PyObject *key;
    unsigned int gen = 0;
    if (!PyArg_ParseTuple(args, "O|I", &key, &gen)) return NULL;
    uint64_t lo, hi;
    if (digest_of(key, &lo, &hi) < 0) return NULL;
    uint32_t row = find(ix, lo, hi);
    if (row == NIL || (gen && ix->rows[row].gen != gen)) Py_RETURN_NONE;
    PyObject *out = row_tuple(&ix->rows[row]);
    if (out) drop_row(ix, row);
    return out;
}

/* touch(digest, gen=0, raw=0, stamp=0) -> reads after this one (saturating at 255), or -1 when absent; a hit:
   counts the read, moves the row to the tail under LRU, sets stamp when given (non-zero; raw is not kept). */
static PyObject *PageIndex_touch(PageIndex *ix, PyObject *args) {
    PyObject *key;
    unsigned int gen = 0, raw = 0, stamp = 0;
    if (!PyArg_ParseTuple(args, "O|III", &key, &gen, &raw, &stamp)) return NULL;
    uint64_t lo, hi;
    if (digest_of(key, &lo, &hi) < 0) return NULL;
    uint32_t row = find(ix, lo, hi);
    if (row == NIL || (gen && ix->rows[row].gen != gen)) return PyLong_FromLong(-1);
    row_t *r = &ix->rows[row];
    if (r->reads < MAX_READS) r->reads++;
    (void)raw;
    if (ix->order == ORDER_LRU) {
        r->flags &= ~F_SCANNED;
        list_unlink(ix, row);
        list_push_tail(ix, row);
    }
    if (stamp && !(r->flags & F_SCANNED)) r->stamp = stamp; /* a scanned row's stamp is its mtime until placed */
    return PyLong_FromUnsignedLong(r->reads);
}

/* pop_victim(tenant) -> (digest, tuple) of the tenant's head row, taken out; None when it has none. */
static PyObject *PageIndex_pop_victim(PageIndex *ix, PyObject *arg) {
    long tenant = PyLong_AsLong(arg);
    if (tenant == -1 && PyErr_Occurred()) return NULL;
    if (tenant_arg(tenant) < 0) return NULL;
    if (ix->order == ORDER_NONE) {
        PyErr_SetString(PyExc_TypeError, "this index keeps no order (ORDER_NONE)");
        return NULL;
    }
    uint32_t row = ix->lists[tenant].head;
    if (row == NIL) Py_RETURN_NONE;
    PyObject *digest = digest_obj(&ix->rows[row]);
    PyObject *tuple = digest ? row_tuple(&ix->rows[row]) : NULL;
    if (!tuple) { Py_XDECREF(digest); return NULL; }
    drop_row(ix, row);
    return Py_BuildValue("(NN)", digest, tuple);
}

static PyObject *PageIndex_count(PageIndex *ix, PyObject *arg) {
    long tenant = PyLong_AsLong(arg);
    if (tenant == -1 && PyErr_Occurred()) return NULL;
    if (tenant_arg(tenant) < 0) return NULL;
    if (ix->order == ORDER_NONE) {
        size_t n = 0;
        for (size_t i = 0; i < ix->rows_top; i++)
            n += (ix->rows[i].flags & F_USED) && ix->rows[i].tenant == tenant;
        return PyLong_FromSize_t(n);
    }
    return PyLong_FromUnsignedLong(ix->lists[tenant].count);
}

/* contains_many(digests) -> one byte a digest (1 held), in one call. */
static PyObject *PageIndex_contains_many(PageIndex *ix, PyObject *seq) {
    PyObject *fast = PySequence_Fast(seq, "digests must be a sequence");
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (!out) { Py_DECREF(fast); return NULL; }
    char *held = PyBytes_AS_STRING(out);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t lo, hi;
        if (digest_of(items[i], &lo, &hi) < 0) { Py_DECREF(fast); Py_DECREF(out); return NULL; }
        held[i] = find(ix, lo, hi) != NIL;
    }
    Py_DECREF(fast);
    return out;
}

/* contains_packed(digests, tenant=-1) -> one byte a digest of a packed batch (16 bytes each: the low and
   high 64 bits, little-endian, as key_digests makes them), 1 where held (by tenant, when given).  A
   lookup's keys never become Python objects: a 1,024-key batch is one call. */
static PyObject *PageIndex_contains_packed(PageIndex *ix, PyObject *args) {
    Py_buffer buf;
    long tenant = -1;
    if (!PyArg_ParseTuple(args, "y*|l", &buf, &tenant)) return NULL;
    if (buf.len % 16) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "packed digests are 16 bytes each");
        return NULL;
    }
    Py_ssize_t n = buf.len / 16;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (out) {
        char *held = PyBytes_AS_STRING(out);
        const unsigned char *p = buf.buf;
        /* A lookup's digests are independent: fetched ahead where the table is past the caches (three hashes a
           digest instead of one cost more than they save on a table a cache holds). */
        const int ahead = ix->nslots * sizeof(uint32_t) > PREFETCH_MIN_SLOT_BYTES;
        for (Py_ssize_t i = 0; i < n; i++, p += 16) {
            uint64_t lo, hi;
            if (ahead && i + PROBE_AHEAD < n) {
                memcpy(&lo, p + 16 * PROBE_AHEAD, 8);
                memcpy(&hi, p + 16 * PROBE_AHEAD + 8, 8);
                prefetch_probe(ix, lo, hi);
            }
            if (ahead && i + PROBE_AHEAD / 2 < n) {
                memcpy(&lo, p + 16 * (PROBE_AHEAD / 2), 8);
                memcpy(&hi, p + 16 * (PROBE_AHEAD / 2) + 8, 8);
                prefetch_row(ix, lo, hi);
            }
            memcpy(&lo, p, 8);
            memcpy(&hi, p + 8, 8);
            uint32_t row = ix->nslots ? find(ix, lo, hi) : NIL;
            held[i] = row != NIL && (tenant < 0 || ix->rows[row].tenant == tenant);
        }
    }
    PyBuffer_Release(&buf);
    return out;
}

/* insert_packed(digests, sizes) -> rows added: each 16-byte digest of a packed batch (as key_digests makes them)
   held with its size (a uint32 array, one a digest), tenant 0; a digest held already keeps its row and takes
   the new size (a page written again).  An index without an order only (ORDER_NONE: a DRAM tier's lookup
   set): a batch's commit is one call, no Python int a key. */
static PyObject *PageIndex_insert_packed(PageIndex *ix, PyObject *args) {
    Py_buffer buf, sizes;
    if (!PyArg_ParseTuple(args, "y*y*", &buf, &sizes)) return NULL;
    PyObject *out = NULL;
    Py_ssize_t n = buf.len / 16;
    if (ix->order != ORDER_NONE) {
        PyErr_SetString(PyExc_ValueError, "insert_packed is for an index without an order");
    } else if (buf.len % 16 || sizes.len != n * 4) {
        PyErr_SetString(PyExc_ValueError, "16 bytes a digest and a 4-byte size a digest");
    } else if (grow_slots(ix, (size_t)ix->used + (size_t)n, 0) == 0
               && grow_rows(ix, ix->rows_top + (size_t)n) == 0) {
        const unsigned char *p = buf.buf, *z = sizes.buf;
        long added = 0;
        for (Py_ssize_t i = 0; i < n; i++, p += 16, z += 4) {
            uint64_t lo, hi;
            uint32_t size;
            memcpy(&lo, p, 8);
            memcpy(&hi, p + 8, 8);
            memcpy(&size, z, 4);
            uint32_t row = find(ix, lo, hi);
            if (row != NIL) {
                ix->rows[row].size = size;
                continue;
            }
            add_row(ix, lo, hi, size, 0, 0, 0, 0, 0, 0);
            added++;
        }
        out = PyLong_FromLong(added);
    }
    PyBuffer_Release(&buf);
    PyBuffer_Release(&sizes);
    return out;
}

/* remove_packed(digests) -> rows removed: each 16-byte digest of a packed batch no longer held (absent ones are
   skipped).  A DRAM tier's victims of one put leave its lookup set in one call, no Python int a key. */
static PyObject *PageIndex_remove_packed(PageIndex *ix, PyObject *arg) {
    Py_buffer buf;
    if (PyObject_GetBuffer(arg, &buf, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *out = NULL;
    if (buf.len % 16) {
        PyErr_SetString(PyExc_ValueError, "packed digests are 16 bytes each");
    } else {
        const unsigned char *p = buf.buf;
        long removed = 0;
        for (Py_ssize_t i = 0; i < buf.len / 16; i++, p += 16) {
            uint64_t lo, hi;
            memcpy(&lo, p, 8);
            memcpy(&hi, p + 8, 8);
            uint32_t row = ix->nslots ? find(ix, lo, hi) : NIL;
            if (row != NIL) {
                drop_row(ix, row);
                removed++;
            }
        }
        out = PyLong_FromLong(removed);
    }
    PyBuffer_Release(&buf);
    return out;
}

/* digests(tenant=-1) -> every digest (of one tenant), in list order when the index keeps one. */
static PyObject *PageIndex_digests(PageIndex *ix, PyObject *args) {
    long tenant = -1;
    if (!PyArg_ParseTuple(args, "|l", &tenant)) return NULL;
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    if (tenant >= 0 && tenant < MAX_TENANTS && ix->order != ORDER_NONE) {
        for (uint32_t row = ix->lists[tenant].head; row != NIL; row = ix->rows[row].next) {
            PyObject *d = digest_obj(&ix->rows[row]);
            if (!d || PyList_Append(out, d) < 0) { Py_XDECREF(d); Py_DECREF(out); return NULL; }
            Py_DECREF(d);
        }
        return out;
    }
    for (size_t i = 0; i < ix->rows_top; i++) {
        const row_t *r = &ix->rows[i];
        if (!(r->flags & F_USED) || (tenant >= 0 && r->tenant != tenant)) continue;
        PyObject *d = digest_obj(r);
        if (!d || PyList_Append(out, d) < 0) { Py_XDECREF(d); Py_DECREF(out); return NULL; }
        Py_DECREF(d);
    }
    return out;
}

/* In-place sort of 64-bit keys, no second buffer. */
static void sort_keys(uint64_t *a, size_t n) {
    while (n > 16) {
        uint64_t x = a[0], y = a[n / 2], z = a[n - 1];
        uint64_t pivot = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
        size_t i = 0, j = n - 1;
        for (;;) {
            while (a[i] < pivot) i++;
            while (a[j] > pivot) j--;
            if (i >= j) break;
            uint64_t t = a[i]; a[i] = a[j]; a[j] = t;
            i++; j--;
        }
        /* recurse into the smaller side, loop on the larger: the stack stays O(log n) */
        if (j + 1 < n - j - 1) { sort_keys(a, j + 1); a += j + 1; n -= j + 1; }
        else { sort_keys(a + j + 1, n - j - 1); n = j + 1; }
    }
    for (size_t i = 1; i < n; i++) {
        uint64_t v = a[i];
        size_t k = i;
        while (k && a[k - 1] > v) { a[k] = a[k - 1]; k--; }
        a[k] = v;
    }
}

#define SCANNED_ROW(r) (((r)->flags & (F_USED | F_SCANNED)) == (F_USED | F_SCANNED))

static inline uint64_t scan_key(const row_t *rows, size_t i) { return ((uint64_t)rows[i].stamp << 32) | i; }

static int key_range(PyObject *args, uint64_t *lo, uint64_t *hi) {
    PyObject *lo_obj = NULL, *hi_obj = NULL;
    *lo = 0;
    *hi = UINT64_MAX;
    if (!PyArg_ParseTuple(args, "|OO", &lo_obj, &hi_obj)) return -1;
    if (lo_obj && lo_obj != Py_None && (*lo = PyLong_AsUnsignedLongLong(lo_obj)) == (uint64_t)-1 && PyErr_Occurred())
        return -1;
    if (hi_obj && hi_obj != Py_None && (*hi = PyLong_AsUnsignedLongLong(hi_obj)) == (uint64_t)-1 && PyErr_Occurred())
        return -1;
    return 0;
}

/* Passes over every row hold the GIL a million rows at a time (~5 ms), then let waiting threads run: a daemon
   of ten million chunks would otherwise stop answering for the length of a pass.  The rows may move and change
   meanwhile, so a pass reads ix->rows anew after each yield and takes what it sees. */
#define YIELD_ROWS (1u << 20)
#define MAYBE_YIELD(i) do { if (((i) & (YIELD_ROWS - 1)) == YIELD_ROWS - 1) { Py_BEGIN_ALLOW_THREADS Py_END_ALLOW_THREADS } } while (0)

/* scanned_order(lo=0, hi=None) -> bytes: the rows a scan added that nothing touched since whose key
   (stamp << 32 | row) lies in [lo, hi), as sorted uint64 keys: oldest stamp first, ties in the order the scan
   stored them.  The keys are a copy, sorted without the GIL and without any lock of the caller while the
   index serves and changes (place_rows skips a row that changed meanwhile).  scanned_bounds picks ranges
   that keep the copy small. */
static PyObject *PageIndex_scanned_order(PageIndex *ix, PyObject *args) {
    uint64_t lo, hi;
    if (key_range(args, &lo, &hi) < 0) return NULL;
    size_t n = 0;
    for (size_t i = 0; i < ix->rows_top; i++) {
        if (SCANNED_ROW(&ix->rows[i])) { uint64_t k = scan_key(ix->rows, i); n += k >= lo && k < hi; }
        MAYBE_YIELD(i);
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * sizeof(uint64_t)));
    if (!out) return NULL;
    uint64_t *keys = (uint64_t *)PyBytes_AS_STRING(out);
    size_t k = 0;
    for (size_t i = 0; i < ix->rows_top && k < n; i++) {
        if (SCANNED_ROW(&ix->rows[i])) { uint64_t key = scan_key(ix->rows, i); if (key >= lo && key < hi) keys[k++] = key; }
        MAYBE_YIELD(i);
    }
    Py_BEGIN_ALLOW_THREADS /* the keys are ours alone until returned */
    sort_keys(keys, k);
    Py_END_ALLOW_THREADS
    if (k < n && _PyBytes_Resize(&out, (Py_ssize_t)(k * sizeof(uint64_t))) < 0) return NULL; /* rows went meanwhile */
    return out;
}

#define BOUND_BUCKETS 65536

/* scanned_bounds(budget) -> [hi, ...]: ascending key bounds that cut the scanned rows' keys into batches of
   about budget (a batch is [previous bound or 0, bound), the last one open-ended, so the list may be empty):
   two passes over the rows, a histogram of the keys in between.  A single bucket of more than budget keys
   (many files of one second) makes a batch larger than budget. */
static PyObject *PageIndex_scanned_bounds(PageIndex *ix, PyObject *arg) {
    unsigned long long budget = PyLong_AsUnsignedLongLong(arg);
    if (budget == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (!budget) budget = 1;
    uint64_t bottom = UINT64_MAX, top = 0;
    size_t n = 0;
    for (size_t i = 0; i < ix->rows_top; i++) {
        if (SCANNED_ROW(&ix->rows[i])) {
            uint64_t k = scan_key(ix->rows, i);
            n++;
            if (k < bottom) bottom = k;
            if (k > top) top = k;
        }
        MAYBE_YIELD(i);
    }
    PyObject *out = PyList_New(0);
    if (!out || n <= budget) return out;
    size_t *counts = PyMem_RawCalloc(BOUND_BUCKETS, sizeof(size_t));
    if (!counts) { Py_DECREF(out); return PyErr_NoMemory(); }
    uint64_t width = (top - bottom) / BOUND_BUCKETS + 1;
    for (size_t i = 0; i < ix->rows_top; i++) {
        if (SCANNED_ROW(&ix->rows[i])) {
            uint64_t k = scan_key(ix->rows, i);
            if (k >= bottom && k <= top) counts[(k - bottom) / width]++;
        }
        MAYBE_YIELD(i);
    }
    size_t batch = 0;
    for (size_t b = 0; b < BOUND_BUCKETS; b++) {
        if (batch && batch + counts[b] > budget) {
            PyObject *bound = PyLong_FromUnsignedLongLong(bottom + (uint64_t)b * width);
            if (!bound || PyList_Append(out, bound) < 0) { Py_XDECREF(bound); Py_CLEAR(out); break; }
            Py_DECREF(bound);
            batch = 0;
        }
        batch += counts[b];
    }
    PyMem_RawFree(counts);
    return out;
}

/* place_rows(order, start, stop) -> rows placed: keys [start, stop) of scanned_order, oldest first, each row
   still untouched goes right behind the rows placed before it (the first to the head): the cold end always
   holds the oldest placed, and every unplaced scanned row is newer, however the calls interleave with others.
   Their stamps reset to 0 (never refreshed). */
static PyObject *PageIndex_place_rows(PageIndex *ix, PyObject *args) {
    Py_buffer buf;
    Py_ssize_t start, stop;
    if (!PyArg_ParseTuple(args, "y*nn", &buf, &start, &stop)) return NULL;
    const uint64_t *keys = buf.buf;
    Py_ssize_t n = buf.len / (Py_ssize_t)sizeof(uint64_t);
    if (start < 0) start = 0;
    if (stop > n) stop = n;
    size_t placed = 0;
    for (Py_ssize_t i = start; i < stop; i++) {
        uint32_t row = (uint32_t)keys[i];
        if (row >= ix->rows_top || !SCANNED_ROW(&ix->rows[row])) continue; /* removed or touched meanwhile */
        row_t *r = &ix->rows[row];
        if (ix->order != ORDER_NONE) {
            list_t *q = list_of(ix, r->tenant);
            list_unlink(ix, row);
            if (q->placed == NIL) list_push_head(ix, row); else list_insert_after(ix, q->placed, row);
            q->placed = row;
        }
        r->flags &= ~F_SCANNED;
        r->stamp = 0;
        placed++;
    }
    PyBuffer_Release(&buf);
    return PyLong_FromSize_t(placed);
}

static PyObject *PageIndex_start_placing(PageIndex *ix, PyObject *unused) {
    (void)unused;
    clear_placed(ix);
    Py_RETURN_NONE;
}

/* place_scanned() -> rows placed: scanned_order and place_rows of all of it in one call. */
static PyObject *PageIndex_place_scanned(PageIndex *ix, PyObject *unused) {
    (void)unused;
    clear_placed(ix);
    PyObject *none = PyTuple_New(0);
    PyObject *order = none ? PageIndex_scanned_order(ix, none) : NULL;
    Py_XDECREF(none);
    if (!order) return NULL;
    PyObject *args = Py_BuildValue("(Onn)", order, (Py_ssize_t)0, PyBytes_GET_SIZE(order) / 8);
    PyObject *out = args ? PageIndex_place_rows(ix, args) : NULL;
    Py_XDECREF(args);
    Py_DECREF(order);
    return out;
}

static PyObject *PageIndex_nbytes(PageIndex *ix, PyObject *unused) {
    (void)unused;
    return PyLong_FromSize_t(ix->rows_top * sizeof(row_t) + ix->nslots * sizeof(uint32_t));
}

static PyObject *PageIndex_reserve(PageIndex *ix, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n < 0) return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_ValueError, "reserve a count >= 0");
    if (grow_slots(ix, (size_t)n, 1) < 0 || grow_rows(ix, (size_t)n) < 0) return NULL;
    Py_RETURN_NONE;
}


/* ------------------------------------------------------------- snapshots */

/* What a snapshot keeps of a row: the digest and the caller's figures (the order is the file's order). */
typedef struct {
    uint64_t lo, hi;
    uint32_t size, reads, file, block;
    uint16_t tenant, pad[3];
} saved_t; /* 40 bytes */

static inline uint64_t mix_in(uint64_t h, const void *data, size_t n) {
    const unsigned char *p = data;
    for (size_t i = 0; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 0x9E3779B97F4A7C15ull;
        h ^= h >> 31;
    }
    return h;
}

static int write_all(int fd, const void *buf, size_t n) {
    const char *p = buf;
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0) { if (errno == EINTR) continue; return -1; }
        p += w; n -= (size_t)w;
    }
    return 0;
}

#define SNAP_BATCH 2048

/* save(fd) -> (rows, checksum): every row at fd's position, each tenant's list from its head (the next victim),
   32 bytes a row; the caller writes the header around it. */
static PyObject *PageIndex_save(PageIndex *ix, PyObject *arg) {
    int fd = PyObject_AsFileDescriptor(arg);
    if (fd < 0) return NULL;
    if (ix->order == ORDER_NONE) {
        PyErr_SetString(PyExc_TypeError, "an index without order (ORDER_NONE) is not saved");
        return NULL;
    }
    saved_t *buf = PyMem_RawMalloc(SNAP_BATCH * sizeof(saved_t));
    if (!buf) return PyErr_NoMemory();
    uint64_t h = 0x243F6A8885A308D3ull, rows = 0;
    size_t k = 0;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS /* the caller holds the index still (a store that is closing): no other call runs */
    for (size_t t = 0; t < MAX_TENANTS && !failed; t++) {
        for (uint32_t row = ix->lists[t].head; row != NIL && !failed; row = ix->rows[row].next) {
            const row_t *r = &ix->rows[row];
            buf[k++] = (saved_t){r->lo, r->hi, r->size, r->reads, r->file, r->block, r->tenant, {0, 0, 0}};
            if (k == SNAP_BATCH) {
                h = mix_in(h, buf, k * sizeof(saved_t));
                failed = write_all(fd, buf, k * sizeof(saved_t));
                rows += k; k = 0;
            }
        }
    }
    if (!failed && k) {
        h = mix_in(h, buf, k * sizeof(saved_t));
        failed = write_all(fd, buf, k * sizeof(saved_t));
        rows += k;
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(buf);
    if (failed) return PyErr_SetFromErrno(PyExc_OSError);
    return Py_BuildValue("(KK)", (unsigned long long)rows, (unsigned long long)h);
}

static void reset(PageIndex *ix) {
    memset(ix->slots, 0, ix->nslots * sizeof(uint32_t));
    ix->rows_top = 0; ix->used = 0; ix->free_head = NIL;
    for (size_t t = 0; t < MAX_TENANTS; t++) ix->lists[t] = (list_t){NIL, NIL, 0, NIL};
}

/* load(fd, rows, checksum) -> rows: fill an empty index from save's bytes at fd's position, in their order.
   ValueError (and an empty index) when the bytes are short, do not add up to checksum, or repeat a digest. */
static PyObject *PageIndex_load(PageIndex *ix, PyObject *args) {
    PyObject *file;
    unsigned long long rows, want;
    if (!PyArg_ParseTuple(args, "OKK", &file, &rows, &want)) return NULL;
    int fd = PyObject_AsFileDescriptor(file);
    if (fd < 0) return NULL;
    if (ix->used) { PyErr_SetString(PyExc_ValueError, "load into an empty index only"); return NULL; }
    if (grow_slots(ix, rows, 1) < 0 || grow_rows(ix, ix->rows_top + (rows ? rows : 1)) < 0) return NULL;
    saved_t *buf = PyMem_RawMalloc(SNAP_BATCH * sizeof(saved_t));
    if (!buf) return PyErr_NoMemory();
    uint64_t h = 0x243F6A8885A308D3ull, done = 0;
    const char *why = NULL;
    while (done < rows && !why) {
        size_t n = rows - done < SNAP_BATCH ? (size_t)(rows - done) : SNAP_BATCH, got = 0;
        while (got < n * sizeof(saved_t)) {
            ssize_t r = read(fd, (char *)buf + got, n * sizeof(saved_t) - got);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) { why = "the snapshot is shorter than its header says"; break; }
            got += (size_t)r;
        }
        if (why) break;
        h = mix_in(h, buf, n * sizeof(saved_t));
        for (size_t i = 0; i < n; i++) {
            const saved_t *s = &buf[i];
            if (i + PROBE_AHEAD < n) prefetch_probe(ix, buf[i + PROBE_AHEAD].lo, buf[i + PROBE_AHEAD].hi);
            if (i + PROBE_AHEAD / 2 < n) prefetch_row(ix, buf[i + PROBE_AHEAD / 2].lo, buf[i + PROBE_AHEAD / 2].hi);
            uint32_t found;
            size_t slot = probe(ix, s->lo, s->hi, &found);
            if (found != NIL) { why = "the snapshot holds a digest twice"; break; }
            ix->slots[slot] = new_row(ix, s->lo, s->hi, s->size, s->reads, 0, s->tenant, 0, s->file, s->block) + 1;
        }
        done += n;
    }
    PyMem_RawFree(buf);
    if (!why && h != want) why = "the snapshot's checksum does not match";
    if (why) {
        reset(ix);
        PyErr_SetString(PyExc_ValueError, why);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(done);
}

/* totals() -> {tenant: (rows, size summed)} of an index that keeps order (empty for ORDER_NONE) */
static PyObject *PageIndex_totals(PageIndex *ix, PyObject *unused) {
    (void)unused;
    PyObject *out = PyDict_New();
    if (!out) return NULL;
    for (size_t t = 0; t < MAX_TENANTS; t++) {
        size_t n = 0;
        unsigned long long bytes = 0;
        if (ix->order == ORDER_NONE || !ix->lists[t].count) continue; /* only ordered indexes are saved */
        for (uint32_t row = ix->lists[t].head; row != NIL; row = ix->rows[row].next, n++) bytes += ix->rows[row].size;
        PyObject *key = PyLong_FromSize_t(t), *value = Py_BuildValue("(nK)", (Py_ssize_t)n, bytes);
        if (!key || !value || PyDict_SetItem(out, key, value) < 0) {
            Py_XDECREF(key); Py_XDECREF(value); Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(key); Py_DECREF(value);
    }
    return out;
}

static int add_total(PyObject *totals, long tenant, unsigned long long bytes) {
    PyObject *key = PyLong_FromLong(tenant);
    if (!key) return -1;
    PyObject *old = PyDict_GetItemWithError(totals, key);
    unsigned long long sum = bytes + (old ? PyLong_AsUnsignedLongLong(old) : 0);
    PyObject *value = PyErr_Occurred() ? NULL : PyLong_FromUnsignedLongLong(sum);
    int rc = value ? PyDict_SetItem(totals, key, value) : -1;
    Py_DECREF(key);
    Py_XDECREF(value);
    return rc;
}

/* A restart scan's record (tiers/_chunkscan.c): digest, namespace hash, on-disk bytes, mtime in seconds, and
   where the page lies (a file of many pages and its block; 0, 0: a file of its own). */
typedef struct { uint64_t lo, hi, ns; uint32_t size, mtime, file, block; } scanned_t;

/* insert_scanned(records, tenants) -> {tenant: bytes added}: every record whose digest is not indexed yet, as
   insert(..., stamp=mtime, scanned=True) would; tenants maps each namespace hash of the records to its tenant. */
static PyObject *PageIndex_insert_scanned(PageIndex *ix, PyObject *args) {
    Py_buffer buf;
    PyObject *tenants;
    if (!PyArg_ParseTuple(args, "y*O!", &buf, &PyDict_Type, &tenants)) return NULL;
    PyObject *out = NULL;
    size_t n = (size_t)buf.len / sizeof(scanned_t);
    const scanned_t *recs = buf.buf;
    enum { CACHE = 16 };
    uint64_t cached_ns[CACHE];
    long cached_tenant[CACHE];
    unsigned long long added[CACHE];
    int ncached = 0;
    PyObject *totals = PyDict_New();
    if (!totals) goto done;
    if ((size_t)buf.len % sizeof(scanned_t)) { PyErr_SetString(PyExc_ValueError, "records of 40 bytes"); goto done; }
    if (grow_slots(ix, (size_t)ix->used + n, 0) < 0 || grow_rows(ix, ix->rows_top + n) < 0) goto done;
    for (size_t i = 0; i < n; i++) {
        const scanned_t *s = &recs[i];
        if (i + PROBE_AHEAD < n) prefetch_probe(ix, recs[i + PROBE_AHEAD].lo, recs[i + PROBE_AHEAD].hi);
        if (i + PROBE_AHEAD / 2 < n) prefetch_row(ix, recs[i + PROBE_AHEAD / 2].lo, recs[i + PROBE_AHEAD / 2].hi);
        uint32_t found;
        size_t slot = probe(ix, s->lo, s->hi, &found);
        if (found != NIL) continue;
        int c = 0;
        while (c < ncached && cached_ns[c] != s->ns) c++;
        if (c == ncached) { /* a namespace not seen in this batch: ask the map (flushing the cache when full) */
            PyObject *key = PyLong_FromUnsignedLongLong(s->ns);
            PyObject *value = key ? PyDict_GetItemWithError(tenants, key) : NULL;
            Py_XDECREF(key);
            if (!value) { if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "a namespace hash without a tenant"); goto done; }
            long tenant = PyLong_AsLong(value);
            if ((tenant == -1 && PyErr_Occurred()) || tenant_arg(tenant) < 0) goto done;
            if (ncached == CACHE) {
                for (int k = 0; k < ncached; k++)
                    if (add_total(totals, cached_tenant[k], added[k]) < 0) goto done;
                ncached = c = 0;
            }
            cached_ns[c] = s->ns; cached_tenant[c] = tenant; added[c] = 0;
            ncached++;
        }
        ix->slots[slot] = new_row(ix, s->lo, s->hi, s->size, 0, s->mtime ? s->mtime : 1, (uint16_t)cached_tenant[c],
                                  1, s->file, s->block) + 1;
        added[c] += s->size;
    }
    for (int k = 0; k < ncached; k++)
        if (add_total(totals, cached_tenant[k], added[k]) < 0) goto done;
    out = totals;
    totals = NULL;
done:
    Py_XDECREF(totals);
    PyBuffer_Release(&buf);
    return out;
}

static PyMethodDef PageIndex_methods[] = {
    {"get", (PyCFunction)PageIndex_get, METH_O, "get(digest) -> (gen, tenant, size, raw, reads, stamp, file, block) or None"},
    {"insert", (PyCFunction)(void (*)(void))PageIndex_insert, METH_VARARGS | METH_KEYWORDS,
     "insert(digest, tenant, size, raw=0, stamp=0, scanned=False) -> gen (KeyError when present)"},
    {"remove", (PyCFunction)PageIndex_remove, METH_VARARGS, "remove(digest, gen=0) -> the row's tuple or None"},
    {"touch", (PyCFunction)PageIndex_touch, METH_VARARGS, "touch(digest, gen=0, raw=0, stamp=0) -> reads or -1"},
    {"pop_victim", (PyCFunction)PageIndex_pop_victim, METH_O, "pop_victim(tenant) -> (digest, tuple) or None"},
    {"count", (PyCFunction)PageIndex_count, METH_O, "count(tenant) -> rows of the tenant"},
    {"contains_many", (PyCFunction)PageIndex_contains_many, METH_O, "contains_many(digests) -> bytes"},
    {"contains_packed", (PyCFunction)PageIndex_contains_packed, METH_VARARGS,
     "contains_packed(digests, tenant=-1) -> bytes: one byte a 16-byte digest of the packed batch"},
    {"digests", (PyCFunction)PageIndex_digests, METH_VARARGS, "digests(tenant=-1) -> list of digests"},
    {"remove_packed", (PyCFunction)PageIndex_remove_packed, METH_O,
     "remove_packed(digests) -> rows removed: 16-byte digests packed, absent ones skipped"},
    {"insert_packed", (PyCFunction)PageIndex_insert_packed, METH_VARARGS,
     "insert_packed(digests, sizes) -> rows added: packed 16-byte digests, uint32 sizes (ORDER_NONE only)"},
    {"place_scanned", (PyCFunction)PageIndex_place_scanned, METH_NOARGS,
     "place_scanned() -> rows moved to the cold end, oldest stamp first"},
    {"scanned_order", (PyCFunction)PageIndex_scanned_order, METH_VARARGS,
     "scanned_order(lo=0, hi=None) -> bytes: untouched scanned rows' keys (stamp << 32 | row) in [lo, hi), sorted"},
    {"scanned_bounds", (PyCFunction)PageIndex_scanned_bounds, METH_O,
     "scanned_bounds(budget) -> [bound, ...]: key bounds cutting the scanned rows into batches of ~budget"},
    {"start_placing", (PyCFunction)PageIndex_start_placing, METH_NOARGS,
     "start_placing(): each tenant's placed segment empty (place_rows puts the first row at the head)"},
    {"place_rows", (PyCFunction)PageIndex_place_rows, METH_VARARGS,
     "place_rows(order, start, stop) -> rows placed behind the ones placed before"},
    {"nbytes", (PyCFunction)PageIndex_nbytes, METH_NOARGS, "nbytes() -> bytes of rows and slots in use"},
    {"reserve", (PyCFunction)PageIndex_reserve, METH_O, "reserve(n): room for n rows without growing"},
    {"save", (PyCFunction)PageIndex_save, METH_O, "save(fd) -> (rows, checksum): the rows in order at fd"},
    {"load", (PyCFunction)PageIndex_load, METH_VARARGS, "load(fd, rows, checksum) -> rows read (ValueError if bad)"},
    {"totals", (PyCFunction)PageIndex_totals, METH_NOARGS, "totals() -> {tenant: (rows, bytes)}"},
    {"insert_scanned", (PyCFunction)PageIndex_insert_scanned, METH_VARARGS,
     "insert_scanned(records, tenants) -> {tenant: bytes}: a restart scan's records not indexed yet"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods PageIndex_as_sequence = {
    .sq_length = (lenfunc)PageIndex_len,
    .sq_contains = (objobjproc)PageIndex_contains,
};

static PyTypeObject PageIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tiers._pageindex.PageIndex",
    .tp_basicsize = sizeof(PageIndex),
    .tp_dealloc = (destructor)PageIndex_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "128-bit digest -> a fixed row, with per-tenant eviction lists (tiers/stores/page_index.py)",
    .tp_methods = PageIndex_methods,
    .tp_as_sequence = &PageIndex_as_sequence,
    .tp_new = PageIndex_new,
};

/* key_digests(prefix, keys) -> bytes: xxh3_128(prefix + key) of each str key, 16 bytes each (low then high
   64 bits, little-endian; the int of xxhash.xxh3_128_intdigest, as bytes).  The page key's digest on the
   wire and in every index (tiers/wire/protocol.py key_digest): hashed in one call, no object a key. */
#define KEY_STACK 512
static PyObject *key_digests(PyObject *self, PyObject *args) {
    Py_buffer prefix;
    PyObject *keys;
    if (!PyArg_ParseTuple(args, "y*O", &prefix, &keys)) return NULL;
    PyObject *fast = PySequence_Fast(keys, "keys must be a sequence of str");
    if (!fast) { PyBuffer_Release(&prefix); return NULL; }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 16);
    unsigned char stack[KEY_STACK];
    if (out) {
        unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
        PyObject **items = PySequence_Fast_ITEMS(fast);
        for (Py_ssize_t i = 0; i < n; i++, dst += 16) {
            if (!PyUnicode_Check(items[i])) {
                PyErr_Format(PyExc_TypeError, "key %zd is not a str", i);
                Py_CLEAR(out);
                break;
            }
            Py_ssize_t len;
            const char *key = PyUnicode_AsUTF8AndSize(items[i], &len);
            if (!key) { Py_CLEAR(out); break; }
            XXH128_hash_t h;
            if (prefix.len + len <= KEY_STACK) {
                memcpy(stack, prefix.buf, prefix.len);
                memcpy(stack + prefix.len, key, len);
                h = XXH3_128bits(stack, prefix.len + len);
            } else { /* a long key: hashed in two parts, same digest */
                XXH3_state_t state;
                XXH3_128bits_reset(&state);
                XXH3_128bits_update(&state, prefix.buf, prefix.len);
                XXH3_128bits_update(&state, key, len);
                h = XXH3_128bits_digest(&state);
            }
            memcpy(dst, &h.low64, 8);
            memcpy(dst + 8, &h.high64, 8);
        }
    }
    Py_DECREF(fast);
    PyBuffer_Release(&prefix);
    return out;
}

static PyMethodDef module_methods[] = {
    {"key_digests", key_digests, METH_VARARGS, "key_digests(prefix, keys) -> bytes: xxh3_128(prefix + key), 16 bytes each"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "tiers._pageindex", .m_size = -1,
                                     .m_methods = module_methods};

PyMODINIT_FUNC PyInit__pageindex(void) {
    if (PyType_Ready(&PageIndexType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&PageIndexType);
    if (PyModule_AddObject(m, "PageIndex", (PyObject *)&PageIndexType) < 0 ||
        PyModule_AddIntConstant(m, "ORDER_NONE", ORDER_NONE) < 0 ||
        PyModule_AddIntConstant(m, "ORDER_LRU", ORDER_LRU) < 0 ||
        PyModule_AddIntConstant(m, "ORDER_FIFO", ORDER_FIFO) < 0 ||
        PyModule_AddIntConstant(m, "MAX_TENANTS", MAX_TENANTS) < 0 ||
        PyModule_AddIntConstant(m, "ROW_BYTES", sizeof(row_t)) < 0 ||
        PyModule_AddIntConstant(m, "SAVED_ROW_BYTES", sizeof(saved_t)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

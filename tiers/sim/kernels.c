/* Compiled replay kernels: the same state machines as tiers/policies, on dense int keys.
 *
 * Each run_<policy> replays the access sequence the way tiers/stores/dram.py drives a
 * policy: a resident key is touched (hit), a missing key first makes room
 * (pop_victim while the store holds `capacity` keys) and is then inserted with
 * its parent (the previous block of the request, -1 for none).  hits[i] is set
 * to 1 when access i found its key resident.  tests/test_sim_kernels.py checks
 * every kernel against the Python policy class, access by access, on real traces.
 * Returns 0, or -1 when memory could not be allocated.
 */
#include <stdint.h>
#include <stdlib.h>

typedef int64_t i64;
typedef struct { i64 head, tail, size; } list_t;

static inline void push_back(i64 *prev, i64 *next, list_t *q, i64 k) {
    prev[k] = q->tail; next[k] = -1;
    if (q->tail >= 0) next[q->tail] = k; else q->head = k;
    q->tail = k; q->size++;
}

static inline void push_front(i64 *prev, i64 *next, list_t *q, i64 k) {
    next[k] = q->head; prev[k] = -1;
    if (q->head >= 0) prev[q->head] = k; else q->tail = k;
    q->head = k; q->size++;
}

static inline void unlink_key(i64 *prev, i64 *next, list_t *q, i64 k) {
    if (prev[k] >= 0) next[prev[k]] = next[k]; else q->head = next[k];
    if (next[k] >= 0) prev[next[k]] = prev[k]; else q->tail = prev[k];
    q->size--;
}

static inline i64 pop_front(i64 *prev, i64 *next, list_t *q) {
    i64 k = q->head;
    unlink_key(prev, next, q, k);
    return k;
}

#define ALLOC(ptr, count, type) do { ptr = (type *)calloc((size_t)(count) + 1, sizeof(type)); if (!ptr) goto fail; } while (0)

/* Stack distance of every access: distinct other keys since the key's last access (n_keys when first). */
int stack_distances(i64 n, const i64 *keys, i64 n_keys, i64 *out) {
    i64 *last = NULL, *tree = NULL;
    ALLOC(last, n_keys, i64); ALLOC(tree, n + 1, i64);
    for (i64 k = 0; k < n_keys; k++) last[k] = -1;
    for (i64 t = 0; t < n; t++) {
        i64 k = keys[t], p = last[k];
        if (p < 0) {
            out[t] = n_keys;
        } else {
            i64 count = 0;  /* marks in (p, t): prefix(t) - prefix(p + 1), Fenwick over positions 1..n */
            for (i64 j = t; j > 0; j -= j & -j) count += tree[j];
            for (i64 j = p + 1; j > 0; j -= j & -j) count -= tree[j];
            out[t] = count;
            for (i64 j = p + 1; j <= n; j += j & -j) tree[j] -= 1;
        }
        for (i64 j = t + 1; j <= n; j += j & -j) tree[j] += 1;
        last[k] = t;
    }
    free(last); free(tree);
    return 0;
fail:
    free(last); free(tree);
    return -1;
}

/* LRU (tiers.policies.basic.LRUPolicy) and FIFO (FIFOPolicy): one queue, oldest first. */
static int run_queue(i64 n, const i64 *keys, i64 n_keys, i64 capacity, uint8_t *hits, int refresh_on_hit) {
    i64 *prev = NULL, *next = NULL; uint8_t *present = NULL;
    list_t q = {-1, -1, 0};
    ALLOC(prev, n_keys, i64); ALLOC(next, n_keys, i64); ALLOC(present, n_keys, uint8_t);
    for (i64 i = 0; i < n; i++) {
        i64 k = keys[i];
        if (present[k]) {
            hits[i] = 1;
            if (refresh_on_hit) { unlink_key(prev, next, &q, k); push_back(prev, next, &q, k); }
            continue;
        }
        hits[i] = 0;
        if (capacity <= 0) continue;
        while (q.size >= capacity) present[pop_front(prev, next, &q)] = 0;
        push_back(prev, next, &q, k); present[k] = 1;
    }
    free(prev); free(next); free(present);
    return 0;
fail:
    free(prev); free(next); free(present);
    return -1;
}

int run_lru(i64 n, const i64 *keys, const i64 *parents, i64 n_keys, i64 capacity, uint8_t *hits) {
    (void)parents;
    return run_queue(n, keys, n_keys, capacity, hits, 1);
}

int run_fifo(i64 n, const i64 *keys, const i64 *parents, i64 n_keys, i64 capacity, uint8_t *hits) {
    (void)parents;
    return run_queue(n, keys, n_keys, capacity, hits, 0);
}

/* LFU (LFUPolicy): a FIFO bucket per count, non-empty counts linked in increasing order. */
typedef struct { i64 *prev, *next, *count, *higher, *lower; list_t *bucket; i64 min; } lfu_t;

static void lfu_enter(lfu_t *s, i64 k, i64 c, i64 below) {
    if (s->bucket[c].size == 0) {
        i64 above = below ? s->higher[below] : s->min;
        s->lower[c] = below; s->higher[c] = above;
        if (below) s->higher[below] = c; else s->min = c;
        if (above) s->lower[above] = c;
    }
    push_back(s->prev, s->next, &s->bucket[c], k);
    s->count[k] = c;
}

static i64 lfu_leave(lfu_t *s, i64 k, i64 c) {
    unlink_key(s->prev, s->next, &s->bucket[c], k);
    if (s->bucket[c].size) return c;
    i64 below = s->lower[c], above = s->higher[c];
    if (below) s->higher[below] = above; else s->min = above;
    if (above) s->lower[above] = below;
    return below;
}

int run_lfu(i64 n, const i64 *keys, const i64 *parents, i64 n_keys, i64 capacity, uint8_t *hits) {
    (void)parents;
    lfu_t s = {0};
    i64 resident = 0;
    ALLOC(s.prev, n_keys, i64); ALLOC(s.next, n_keys, i64); ALLOC(s.count, n_keys, i64);
    ALLOC(s.higher, n + 2, i64); ALLOC(s.lower, n + 2, i64); ALLOC(s.bucket, n + 2, list_t);
    for (i64 c = 0; c < n + 2; c++) { s.bucket[c].head = s.bucket[c].tail = -1; }
    for (i64 i = 0; i < n; i++) {
        i64 k = keys[i], c = s.count[k];
        if (c) {
            hits[i] = 1;
            lfu_enter(&s, k, c + 1, lfu_leave(&s, k, c));
            continue;
        }
        hits[i] = 0;
        if (capacity <= 0) continue;
        while (resident >= capacity) {
            i64 victim = s.bucket[s.min].head;
            lfu_leave(&s, victim, s.count[victim]);
            s.count[victim] = 0; resident--;
        }
        lfu_enter(&s, k, 1, 0); resident++;
    }
    free(s.prev); free(s.next); free(s.count); free(s.higher); free(s.lower); free(s.bucket);
    return 0;
fail:
    free(s.prev); free(s.next); free(s.count); free(s.higher); free(s.lower); free(s.bucket);
    return -1;
}

/* S3-FIFO (tiers.policies.s3fifo.S3FIFOPolicy): small, main and ghost FIFOs. */
enum { S3_NONE = 0, S3_SMALL = 1, S3_MAIN = 2, S3_GHOST = 3 };

int run_s3fifo(i64 n, const i64 *keys, const i64 *parents, i64 n_keys, i64 capacity, uint8_t *hits,
               double small_ratio, double ghost_ratio, i64 move_threshold) {
    (void)parents;
    i64 *prev = NULL, *next = NULL; uint8_t *state = NULL, *freq = NULL;
    list_t small = {-1, -1, 0}, main_q = {-1, -1, 0}, ghost = {-1, -1, 0};
    ALLOC(prev, n_keys, i64); ALLOC(next, n_keys, i64); ALLOC(state, n_keys, uint8_t); ALLOC(freq, n_keys, uint8_t);
    for (i64 i = 0; i < n; i++) {
        i64 k = keys[i];
        if (state[k] == S3_SMALL || state[k] == S3_MAIN) {
            hits[i] = 1;
            if (freq[k] < 3) freq[k]++;
            continue;
        }
        hits[i] = 0;
        if (capacity <= 0) continue;
        while (small.size + main_q.size >= capacity) {
            i64 resident = small.size + main_q.size, victim = -1;
            if (small.size && ((double)small.size >= small_ratio * (double)resident || main_q.size == 0)) {
                while (small.size) {
                    i64 s = pop_front(prev, next, &small);
                    if (freq[s] >= move_threshold) { push_back(prev, next, &main_q, s); state[s] = S3_MAIN; continue; }
                    push_back(prev, next, &ghost, s); state[s] = S3_GHOST;
                    i64 limit = (i64)(ghost_ratio * (double)resident);
                    while (ghost.size > limit) state[pop_front(prev, next, &ghost)] = S3_NONE;
                    victim = s;
                    break;
                }
            }
            while (victim < 0) {
                i64 m = pop_front(prev, next, &main_q);
                if (freq[m]) { freq[m]--; push_back(prev, next, &main_q, m); }
                else { state[m] = S3_NONE; victim = m; }
            }
        }
        freq[k] = 0;
        if (state[k] == S3_GHOST) { unlink_key(prev, next, &ghost, k); push_back(prev, next, &main_q, k); state[k] = S3_MAIN; }
        else { push_back(prev, next, &small, k); state[k] = S3_SMALL; }
    }
    free(prev); free(next); free(state); free(freq);
    return 0;
fail:
    free(prev); free(next); free(state); free(freq);
    return -1;
}

/* Radix LRU (tiers.policies.radix.RadixLRUPolicy): LRU among keys without resident children. */
int run_radix_lru(i64 n, const i64 *keys, const i64 *parents, i64 n_keys, i64 capacity, uint8_t *hits) {
    i64 *prev = NULL, *next = NULL, *parent = NULL, *children = NULL; uint8_t *present = NULL, *parked = NULL;
    list_t order = {-1, -1, 0};
    i64 resident = 0;
    ALLOC(prev, n_keys, i64); ALLOC(next, n_keys, i64); ALLOC(parent, n_keys, i64); ALLOC(children, n_keys, i64);
    ALLOC(present, n_keys, uint8_t); ALLOC(parked, n_keys, uint8_t);
    for (i64 i = 0; i < n; i++) {
        i64 k = keys[i];
        if (present[k]) {
            hits[i] = 1;
            if (parked[k]) parked[k] = 0; else unlink_key(prev, next, &order, k);
            push_back(prev, next, &order, k);
            continue;
        }
        hits[i] = 0;
        if (capacity <= 0) continue;
        while (resident >= capacity) {
            i64 v = pop_front(prev, next, &order);
            if (children[v]) { parked[v] = 1; continue; }
            present[v] = 0; resident--;
            i64 p = parent[v];
            if (p >= 0 && --children[p] == 0 && parked[p]) { parked[p] = 0; push_front(prev, next, &order, p); }
        }
        push_back(prev, next, &order, k);
        present[k] = 1; resident++; children[k] = 0; parent[k] = -1;
        i64 p = parents[i];
        if (p >= 0 && p != k && present[p]) { parent[k] = p; children[p]++; }
    }
    free(prev); free(next); free(parent); free(children); free(present); free(parked);
    return 0;
fail:
    free(prev); free(next); free(parent); free(children); free(present); free(parked);
    return -1;
}

/* Copies out of memory another process owns, surviving that memory going away.
 *
 * A tier daemon reads pages out of an engine's host pool, a memfd the engine
 * mapped and handed over.  SGLang creates that memfd without
 * MFD_ALLOW_SEALING, so nothing stops a buggy or hostile engine from
 * truncating it: a plain memcpy from the mapping then dies of SIGBUS and
 * takes the daemon (and every other tenant's service) with it.  Here a copy
 * runs under a per-thread recovery point: a SIGBUS raised inside it makes the
 * copy return -1 instead.  A fault outside a guarded copy goes to the handler
 * that was installed before ours, or kills the process as it would have.
 *
 * The same guard covers the end-to-end page checksums (xxh3_64 of each page,
 * hicache_ext/page_sums.py): a batch is hashed, or copied and hashed a piece
 * at a time while each piece is still in the cache, in one call.  Hashing page by
 * page from Python cost a GIL hand-over per page, which in a busy server
 * (the scheduler spins on the GIL) was milliseconds a batch.
 *
 * Loaded with ctypes (which releases the GIL around each call); no Python API.
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__has_include)
#if __has_include(<xxhash.h>)
#define HAVE_XXHASH 1 /* header only (tiers/_xxh3_page.h): nothing to link, the same xxh3 as python-xxhash */
#endif
#endif

#if defined(__x86_64__)
#include <emmintrin.h> /* SSE2: every x86-64 CPU has it */
#endif

static __thread sigjmp_buf *volatile recovery;

/* A page's bytes go to memory nobody reads soon (the daemon's arena, an engine's host pool that the device
 * reads by DMA), so they are written with non-temporal stores: a plain memcpy first reads each destination
 * line into the cache (read for ownership) and later writes it back, three passes over memory for two.  A
 * checksum is taken a PIECE at a time right after that piece's copy, from the source, still in the L1; the
 * destination is out of the cache by then.  Measured here (scratch C, 128 pages a batch, two threads as
 * in_halves runs them, session 38): memcpy then xxh3 of the destination 0.61 / 2.21 / 8.1 ms at 64 KiB /
 * 256 KiB / 8 MiB pages against 0.42 / 1.49 / 5.0 ms; a one-thread memcpy without a checksum took 0.74 /
 * 2.59 / 10.9.  Hashing the source: a writer changing the source during the copy can only leave a page
 * whose bytes do not match its checksum (read as damaged: a miss), never a torn page that matches. */
#define PIECE (4u << 10)
#define STREAM_MIN 256u /* shorter runs: memcpy (the stores' fence and alignment cost more than they save) */

static void stream_copy(void *to, const void *from, size_t n)
{
#if defined(__x86_64__)
    unsigned char *d = (unsigned char *)to;
    const unsigned char *s = (const unsigned char *)from;
    if (n < STREAM_MIN) {
        memcpy(d, s, n);
        return;
    }
    const size_t head = (16u - ((uintptr_t)d & 15u)) & 15u;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    const size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        const __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        const __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        const __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    memcpy(d + body, s + body, n - body);
#else
    memcpy(to, from, n);
#endif
}

/* Non-temporal stores are weakly ordered: fenced before a copy returns, so whatever the caller does next
 * (a commit that publishes the page, a reply, an owner check) comes after every byte landed. */
static void stream_fence(void)
{
#if defined(__x86_64__)
    _mm_sfence();
#endif
}
static struct sigaction previous;

static void on_sigbus(int sig, siginfo_t *info, void *context)
{
    sigjmp_buf *jump = recovery;
    if (jump != NULL) {
        recovery = NULL;
        siglongjmp(*jump, 1);
    }
    if ((previous.sa_flags & SA_SIGINFO) && previous.sa_sigaction != NULL) {
        previous.sa_sigaction(sig, info, context);
        return;
    }
    if (!(previous.sa_flags & SA_SIGINFO) && previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
        previous.sa_handler(sig);
        return;
    }
    signal(sig, SIG_DFL);
    raise(sig);
}

/* Install the handler unless it is already the current one; 0 on success. */
int guard_install(void)
{
    struct sigaction current, mine;
    if (sigaction(SIGBUS, NULL, &current) != 0)
        return -1;
    if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_sigbus)
        return 0;
    memset(&mine, 0, sizeof mine);
    mine.sa_sigaction = on_sigbus;
    mine.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&mine.sa_mask);
    return sigaction(SIGBUS, &mine, &previous);
}

/* Copy count runs: dst[i] <- src[i], lens[i] bytes.  Returns the number of runs
 * copied whole: count on success, fewer when a run faulted (its bytes are then
 * partly copied and must not be used). */
int64_t guarded_copy_runs(const uint64_t *dst, const uint64_t *src, const uint64_t *lens, int64_t count)
{
    sigjmp_buf jump;
    volatile int64_t done = 0;
    if (sigsetjmp(jump, 1) != 0)
        return done;
    recovery = &jump;
    for (; done < count; done++)
        memcpy((void *)(uintptr_t)dst[done], (const void *)(uintptr_t)src[done], (size_t)lens[done]);
    recovery = NULL;
    return done;
}

#ifdef HAVE_XXHASH
#define PAGE_SUM_NAME hicache_page_sum_baseline
#define PAGE_UPDATE_NAME hicache_page_update_baseline
#include "_xxh3_page.h"
#if defined(__x86_64__)
uint64_t hicache_page_sum_avx2(const uint64_t *ptrs, const uint64_t *lens, int64_t first, int64_t count);
uint64_t hicache_page_sum_avx512(const uint64_t *ptrs, const uint64_t *lens, int64_t first, int64_t count);
void hicache_page_update_avx2(void *state, const void *p, size_t n);
void hicache_page_update_avx512(void *state, const void *p, size_t n);
#endif

/* 2: AVX-512, 1: AVX2, 0: baseline (SSE2): the widest vector code the CPU has. */
static int vector_unit(void)
{
#if defined(__x86_64__)
    static int unit = -1;
    if (unit < 0) {
        __builtin_cpu_init();
        unit = __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return unit;
#else
    return 0;
#endif
}

/* xxh3_64 of the bytes of runs [first, first + count): one page. */
static uint64_t page_sum(const uint64_t *ptrs, const uint64_t *lens, int64_t first, int64_t count)
{
#if defined(__x86_64__)
    const int unit = vector_unit();
    if (unit == 2)
        return hicache_page_sum_avx512(ptrs, lens, first, count);
    if (unit == 1)
        return hicache_page_sum_avx2(ptrs, lens, first, count);
#endif
    return hicache_page_sum_baseline(ptrs, lens, first, count);
}

/* n more bytes at p into a streamed page sum. */
static void page_update(XXH3_state_t *state, const void *p, size_t n)
{
#if defined(__x86_64__)
    const int unit = vector_unit();
    if (unit == 2) {
        hicache_page_update_avx512(state, p, n);
        return;
    }
    if (unit == 1) {
        hicache_page_update_avx2(state, p, n);
        return;
    }
#endif
    hicache_page_update_baseline(state, p, n);
}
#endif

/* 1 when the page checksum functions below are built (xxhash.h was found), else 0. */
int page_sums_built(void)
{
#ifdef HAVE_XXHASH
    return 1;
#else
    return 0;
#endif
}

/* sums[p] <- xxh3_64 of page p, whose bytes are the runs (ptrs, lens) numbered from
 * the sum of page_runs[0..p) on, page_runs[p] of them.  Returns the pages hashed whole:
 * npages, or fewer when a run faulted; -1 when not built. */
int64_t guarded_page_sums(const uint64_t *ptrs, const uint64_t *lens, const int64_t *page_runs, int64_t npages,
                          uint64_t *sums)
{
#ifdef HAVE_XXHASH
    sigjmp_buf jump;
    volatile int64_t done = 0;
    volatile int64_t first = 0;
    if (sigsetjmp(jump, 1) != 0)
        return done;
    recovery = &jump;
    for (; done < npages; done++) {
        sums[done] = page_sum(ptrs, lens, first, page_runs[done]);
        first += page_runs[done];
    }
    recovery = NULL;
    return done;
#else
    (void)ptrs; (void)lens; (void)page_runs; (void)npages; (void)sums;
    return -1;
#endif
}

/* Copy npages pages, each from its source runs into its destination runs, cut where a run of either side
 * ends: page p's destination is the next d_runs[p] runs of (d_ptrs, d_lens), its source the next s_runs[p]
 * runs of (s_ptrs + s_base, s_lens).  One call plans and copies a whole batch (planning it in numpy cost
 * more than the copy at 64 KiB pages).  Stores are non-temporal (stream_copy).  sums, when not NULL, gets
 * each page's xxh3_64, taken a PIECE at a time from the source right after that piece's copy.  Returns the
 * pages copied whole: npages on success, fewer when a run faulted; -1 (nothing copied) when a page's two
 * sides differ in size, -2 when sums are asked for and the checksum code is not built. */
int64_t guarded_copy_pages(const uint64_t *d_ptrs, const uint64_t *d_lens, const int64_t *d_runs,
                           const uint64_t *s_ptrs, const uint64_t *s_lens, const int64_t *s_runs, uint64_t s_base,
                           int64_t npages, uint64_t *sums)
{
#ifndef HAVE_XXHASH
    if (sums != NULL)
        return -2;
#endif
    int64_t di = 0, si = 0;
    for (int64_t p = 0; p < npages; p++) { /* sizes first: a mismatch copies nothing */
        uint64_t d_total = 0, s_total = 0;
        if (d_runs[p] < 0 || s_runs[p] < 0)
            return -1;
        for (int64_t r = 0; r < d_runs[p]; r++)
            d_total += d_lens[di + r];
        for (int64_t r = 0; r < s_runs[p]; r++)
            s_total += s_lens[si + r];
        if (d_total != s_total)
            return -1;
        di += d_runs[p];
        si += s_runs[p];
    }
    sigjmp_buf jump;
    volatile int64_t done = 0;
    if (sigsetjmp(jump, 1) != 0) {
        stream_fence();
        return done;
    }
    recovery = &jump;
    int64_t d_first = 0, s_first = 0;
    for (; done < npages; done++) {
        int64_t d = d_first, s = s_first;
        const int64_t d_end = d_first + d_runs[done], s_end = s_first + s_runs[done];
        uint64_t d_off = 0, s_off = 0;
#ifdef HAVE_XXHASH
        XXH3_state_t state;
        if (sums != NULL)
            XXH3_64bits_reset(&state);
#endif
        while (d < d_end && s < s_end) {
            uint64_t d_left = d_lens[d] - d_off, s_left = s_lens[s] - s_off;
            uint64_t n = d_left < s_left ? d_left : s_left;
            if (sums != NULL && n > PIECE)
                n = PIECE;
            const void *from = (const void *)(uintptr_t)(s_base + s_ptrs[s] + s_off);
            stream_copy((void *)(uintptr_t)(d_ptrs[d] + d_off), from, (size_t)n);
#ifdef HAVE_XXHASH
            if (sums != NULL)
                page_update(&state, from, (size_t)n);
#endif
            d_off += n;
            s_off += n;
            if (d_off == d_lens[d]) { d++; d_off = 0; }
            if (s_off == s_lens[s]) { s++; s_off = 0; }
        }
#ifdef HAVE_XXHASH
        if (sums != NULL)
            sums[done] = XXH3_64bits_digest(&state);
#endif
        d_first = d_end;
        s_first = s_end;
    }
    recovery = NULL;
    stream_fence();
    return done;
}

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
 * hicache_ext/page_sums.py): a batch is hashed, or copied and hashed page by
 * page while each page is still in the cache, in one call.  Hashing page by
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

static __thread sigjmp_buf *volatile recovery;
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

/* A page larger than this is copied and hashed a STREAMED_PIECE at a time, each piece hashed while it is still
 * in the core's L2: hashed after the whole page was copied, a page past the L2 is read from memory a second
 * time.  Measured here (memcpy, then xxh3, against pieces of 64 KiB; two threads at once as in_halves runs
 * them): 4-8 MiB pages 5.1-5.4 -> 5.9-6.4 GB/s; at 1 MiB and below the same (scratch C, session 34). */
#define STREAMED_PAGE_MIN (512u << 10)
#define STREAMED_PIECE (64u << 10)

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
 * more than the copy at 64 KiB pages).  sums, when not NULL, gets each page's xxh3_64 at its destination,
 * hashed right after its copy.  Returns the pages copied whole: npages on success, fewer when a run
 * faulted; -1 (nothing copied) when a page's two sides differ in size, -2 when sums are asked for and
 * the checksum code is not built. */
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
    if (sigsetjmp(jump, 1) != 0)
        return done;
    recovery = &jump;
    int64_t d_first = 0, s_first = 0;
    for (; done < npages; done++) {
        int64_t d = d_first, s = s_first;
        const int64_t d_end = d_first + d_runs[done], s_end = s_first + s_runs[done];
        uint64_t d_off = 0, s_off = 0;
#ifdef HAVE_XXHASH
        uint64_t page_bytes = 0;
        for (int64_t r = d_first; r < d_end; r++)
            page_bytes += d_lens[r];
        const int streamed = sums != NULL && page_bytes > STREAMED_PAGE_MIN;
        XXH3_state_t state;
        if (streamed)
            XXH3_64bits_reset(&state);
#else
        const int streamed = 0;
#endif
        while (d < d_end && s < s_end) {
            uint64_t d_left = d_lens[d] - d_off, s_left = s_lens[s] - s_off;
            uint64_t n = d_left < s_left ? d_left : s_left;
            if (streamed && n > STREAMED_PIECE)
                n = STREAMED_PIECE;
            void *to = (void *)(uintptr_t)(d_ptrs[d] + d_off);
            memcpy(to, (const void *)(uintptr_t)(s_base + s_ptrs[s] + s_off), (size_t)n);
#ifdef HAVE_XXHASH
            if (streamed)
                page_update(&state, to, (size_t)n);
#endif
            d_off += n;
            s_off += n;
            if (d_off == d_lens[d]) { d++; d_off = 0; }
            if (s_off == s_lens[s]) { s++; s_off = 0; }
        }
#ifdef HAVE_XXHASH
        if (sums != NULL)
            sums[done] = streamed ? XXH3_64bits_digest(&state) : page_sum(d_ptrs, d_lens, d_first, d_runs[done]);
#endif
        d_first = d_end;
        s_first = s_end;
    }
    recovery = NULL;
    return done;
}

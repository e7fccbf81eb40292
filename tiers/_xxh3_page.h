/* One page's xxh3_64 over its runs, and a step of a streamed one, compiled once per vector unit: the file
 * that includes this sets "#pragma GCC target(...)" first and defines PAGE_SUM_NAME and PAGE_UPDATE_NAME
 * (tiers/_xxh3_avx2.c, _xxh3_avx512.c).
 * xxhash.h picks its vector code when compiled, so each build is only called where the CPU has
 * that unit (checked at run time in tiers/_guardcopy.c). */
#define XXH_INLINE_ALL
#include <stdint.h>
#include <xxhash.h>

uint64_t PAGE_SUM_NAME(const uint64_t *ptrs, const uint64_t *lens, int64_t first, int64_t count)
{
    if (count == 1)
        return XXH3_64bits((const void *)(uintptr_t)ptrs[first], (size_t)lens[first]);
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    for (int64_t r = first; r < first + count; r++)
        XXH3_64bits_update(&state, (const void *)(uintptr_t)ptrs[r], (size_t)lens[r]);
    return XXH3_64bits_digest(&state);
}

/* state (an XXH3_state_t) takes n more bytes at p: a page hashed a piece at a time, right after each piece
 * was copied (tiers/_guardcopy.c), has the same xxh3_64 as hashed whole. */
void PAGE_UPDATE_NAME(void *state, const void *p, size_t n)
{
    XXH3_64bits_update((XXH3_state_t *)state, p, n);
}

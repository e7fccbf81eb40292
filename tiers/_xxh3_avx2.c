/* The page checksum for AVX2 CPUs (tiers/_xxh3_page.h). */
#if defined(__x86_64__) && defined(__has_include)
#if __has_include(<xxhash.h>)
#pragma GCC target("avx2")
#define PAGE_SUM_NAME hicache_page_sum_avx2
#define PAGE_UPDATE_NAME hicache_page_update_avx2
#include "_xxh3_page.h"
#endif
#endif

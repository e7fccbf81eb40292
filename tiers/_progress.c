/* A streamed read's progress board: the daemon marks each staged page final as its read ends, the engine
 * waits for marks and copies those pages while the rest are still being read (tiers/shm/progress.py).
 *
 * The board lies in the daemon's staging arena, which engines map read-only:
 *   u32 marks at offset 0 (pages marked so far; the futex word), 60 bytes unused,
 *   u32 state[n] at 64 (0 pending, 1 read, 2 missed),
 *   u64 sum[n] after it, 8-byte aligned.
 * A page's sum is stored before its state (release), and the count after both (release): an engine that
 * reads the count (acquire) and then a state (acquire) sees that page's sum.  The futex is a shared one
 * (not FUTEX_PRIVATE): the two sides are different processes mapping one memfd.  Every call here is
 * made through ctypes.CDLL, so the GIL is released while the engine waits.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define BOARD_HEADER 64

static uint32_t *states_of(uint8_t *board) { return (uint32_t *)(board + BOARD_HEADER); }

static uint64_t *sums_of(uint8_t *board, int64_t n)
{
    return (uint64_t *)(board + BOARD_HEADER + 4 * ((n + 1) & ~(int64_t)1));
}

int64_t progress_board_bytes(int64_t n) { return BOARD_HEADER + 4 * ((n + 1) & ~(int64_t)1) + 8 * n; }

/* Daemon: pages positions[0..count) final, state[i] (1 read, 2 missed) with sums[i]; one wake for all. */
void progress_mark(uint8_t *board, int64_t n, const int64_t *positions, const uint32_t *state,
                   const uint64_t *sums, int64_t count)
{
    uint32_t *states = states_of(board);
    uint64_t *page_sums = sums_of(board, n);
    int64_t marked = 0;
    for (int64_t i = 0; i < count; i++) {
        int64_t at = positions[i];
        if (at < 0 || at >= n)
            continue;
        __atomic_store_n(&page_sums[at], sums[i], __ATOMIC_RELAXED);
        __atomic_store_n(&states[at], state[i], __ATOMIC_RELEASE);
        marked++;
    }
    if (!marked)
        return;
    __atomic_add_fetch((uint32_t *)board, (uint32_t)marked, __ATOMIC_RELEASE);
    syscall(SYS_futex, (uint32_t *)board, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Engine: the mark count once it differs from seen, or after timeout_ns (then possibly still seen). */
uint32_t progress_wait(const uint8_t *board, uint32_t seen, int64_t timeout_ns)
{
    const uint32_t *word = (const uint32_t *)board;
    uint32_t now = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    if (now != seen || timeout_ns <= 0)
        return now;
    struct timespec ts = {timeout_ns / 1000000000, timeout_ns % 1000000000};
    /* A wake between the load above and the wait makes the kernel return EAGAIN at once: nothing lost. */
    syscall(SYS_futex, word, FUTEX_WAIT, seen, &ts, NULL, 0);
    return __atomic_load_n(word, __ATOMIC_ACQUIRE);
}

/* Engine: of the pages whose taken[i] is 0, those now final: taken[i] set to their state, sums_out[i]
 * their sum; returns how many became final in this call. */
int64_t progress_take(const uint8_t *board, int64_t n, uint8_t *taken, uint64_t *sums_out)
{
    const uint32_t *states = states_of((uint8_t *)board);
    const uint64_t *page_sums = sums_of((uint8_t *)board, n);
    int64_t got = 0;
    for (int64_t i = 0; i < n; i++) {
        if (taken[i])
            continue;
        uint32_t state = __atomic_load_n(&states[i], __ATOMIC_ACQUIRE);
        if (!state)
            continue;
        taken[i] = (uint8_t)(state > 255 ? 2 : state);
        sums_out[i] = __atomic_load_n(&page_sums[i], __ATOMIC_RELAXED);
        got++;
    }
    return got;
}

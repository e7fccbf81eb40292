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
 * Loaded with ctypes (which releases the GIL around each call); no Python API.
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

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

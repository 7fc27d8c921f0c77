/* pool.h — a small persistent pthread pool for the CPU kernels.
 *
 * Why not OpenMP: torch ships its own OpenMP runtime and two runtimes in one process fight
 * over threads. The pool starts its workers lazily, re-initialises itself in a forked child
 * (DataLoader workers fork after prepare()), and runs one job at a time; the calling thread
 * takes part in the work. */
#ifndef AC_POOL_H
#define AC_POOL_H

#include "ac/ac.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Body of one task: called once for each index in [0, ntasks), from some pool thread or
 * the caller. Tasks must be independent; they must not call ac_pool_run themselves. */
typedef void (*ac_task_fn)(void *ctx, size_t task);

/* Runs fn(ctx, i) for i in [0, ntasks) and returns when all are done. Uses at most
 * ac_pool_get_threads() threads including the caller. Concurrent callers are serialised.
 * Returns AC_ERR_NOMEM / AC_ERR_INTERNAL only if worker threads cannot be started, in which
 * case nothing has run. */
ac_result_t ac_pool_run(size_t ntasks, ac_task_fn fn, void *ctx);

/* Total threads used by ac_pool_run (caller included); >= 1. Default: online CPUs, capped at 64. */
int ac_pool_get_threads(void);

/* Sets the thread count for later runs (n >= 1, capped at 64). Workers beyond n stay idle. */
ac_result_t ac_pool_set_threads(int n);

/* Stops and joins the workers (tests and sanitizers use it; the pool restarts on next use). */
void ac_pool_shutdown(void);

#ifdef __cplusplus
}
#endif
#endif /* AC_POOL_H */

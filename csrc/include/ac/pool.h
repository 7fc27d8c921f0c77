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

/* Registers the fork handlers now (idempotent). Call it when the library is loaded: a child
 * forked before the first ac_pool_run (a DataLoader worker) must still know it is a child and
 * keep away from the parent's OpenMP team. */
void ac_pool_init(void);

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

/* Where ac_pool_run's threads come from:
 *   "pthread" — the pool's own workers;
 *   "openmp"  — the OpenMP runtime (libgomp) that is already loaded in the process, i.e.
 *               torch's. After a torch op its OpenMP workers keep spinning for a while; with
 *               our own workers the two sets fight over the cores (measured: an in-place scale
 *               right after a torch op ran 1.5x slower). Borrowing torch's team avoids the fight
 *               instead of adding a second runtime. Never used in a forked child (libgomp's
 *               team does not survive fork) nor when libgomp is not loaded;
 *   "auto"    — "openmp" when possible, else "pthread" (the default; AC_POOL_BACKEND sets it).
 * ac_pool_set_backend returns AC_ERR_UNSUPPORTED for "openmp" when no libgomp is loaded. */
ac_result_t ac_pool_set_backend(const char *name);
/* The backend the next ac_pool_run will use: "pthread" or "openmp". */
const char *ac_pool_backend(void);

#ifdef __cplusplus
}
#endif
#endif /* AC_POOL_H */

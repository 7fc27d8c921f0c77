/* reducer.h — the reducer's launch: the buckets of a bucket plan (ac/bucket.h) all-reduced over a
 * communicator (ac/comm.h). The collectives know nothing of buckets; this is where the two meet.
 * Called from the gradient hooks (csrc/python/grad_hook_py.c) as buckets become launchable. */
#ifndef AC_REDUCER_H
#define AC_REDUCER_H

#include "ac/bucket.h"
#include "ac/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The reducer's launch: sums buckets [from, to) of `plan`, laid over the buffer `base` of
 * dtype `dt`, in place, through any backend of ac/comm.h. NCCL: on comm_stream, and when
 * `event` is not NULL comm_stream first waits (through `event`, a cudaEvent_t) for the work
 * queued so far on compute_stream, so the all-reduce reads finished gradients while backward
 * goes on. Shared memory: streams and event NULL; the buckets are queued to the group's progress
 * thread (a buffer in the group's window is reduced where it lies), and ac_comm_wait completes
 * them. Collective, in bucket order. */
ac_result_t ac_comm_launch_buckets(ac_comm_t *c, const ac_bucket_plan_t *plan, void *base, ac_dtype_t dt,
                                   size_t from, size_t to, void *compute_stream, void *comm_stream, void *event);

#ifdef __cplusplus
}
#endif
#endif /* AC_REDUCER_H */

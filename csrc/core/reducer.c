/* reducer.c — the reducer's bucket launch (see ac/reducer.h): one in-place all-reduce per bucket
 * of the plan, through the communicator interface (ac/comm.h), whichever backend is behind it. */
#include "ac/reducer.h"

#include "ac/cuda.h"

ac_result_t ac_comm_launch_buckets(ac_comm_t *c, const ac_bucket_plan_t *plan, void *base, ac_dtype_t dt,
                                   size_t from, size_t to, void *compute_stream, void *comm_stream, void *event) {
  if (!c) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_comm_launch_buckets: comm is NULL");
  if (!plan || !base) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_comm_launch_buckets: NULL plan or buffer");
  if (from > to || to > ac_bucket_count(plan))
    return AC_FAIL(AC_ERR_INVALID_ARG, "ac_comm_launch_buckets: buckets [%zu, %zu) of %zu", from, to,
                   ac_bucket_count(plan));
  if (from == to) return AC_OK;
  /* one wait covers every bucket of this call: their gradients were all final when the hooks
   * that completed them ran, i.e. before this point on the compute stream */
  if (event) AC_CHECK(ac_cuda_stream_wait(comm_stream, compute_stream, event));
  size_t esize = ac_dtype_size(dt);
  for (size_t b = from; b < to; b++) {
    size_t first, count;
    AC_CHECK(ac_bucket_range(plan, b, &first, &count));
    char *p = (char *)base + first * esize;
    AC_CHECK(ac_comm_all_reduce(c, p, p, count, dt, AC_RED_SUM, comm_stream));
  }
  return AC_OK;
}

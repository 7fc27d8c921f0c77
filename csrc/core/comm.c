/* comm.c — the communicator interface's entry points (ac/comm.h): the argument checks every
 * backend shares, then the backend's function. */
#include "ac/comm.h"

#define COMM_ARGS(c, what)                                                                   \
  do {                                                                                       \
    if (!(c) || !(c)->ops) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: comm is NULL", what);     \
  } while (0)

static ac_result_t check_op(ac_redop_t op, const char *what) {
  if ((int)op < AC_RED_SUM || op > AC_RED_AVG) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: invalid reduction %d", what, (int)op);
  return AC_OK;
}

static ac_result_t check_dtype(ac_dtype_t dt, const char *what) {
  if (ac_dtype_size(dt) == 0) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: invalid dtype code %d", what, (int)dt);
  return AC_OK;
}

void ac_comm_destroy(ac_comm_t *c) {
  if (c && c->ops) c->ops->destroy(c);
}

int ac_comm_size(const ac_comm_t *c) { return c ? c->nranks : 0; }
int ac_comm_rank(const ac_comm_t *c) { return c ? c->rank : -1; }
const char *ac_comm_backend(const ac_comm_t *c) { return c && c->ops ? c->ops->backend : ""; }
int ac_comm_stream_ordered(const ac_comm_t *c) { return c && c->ops ? c->ops->stream_ordered : 0; }

ac_result_t ac_comm_all_reduce(ac_comm_t *c, const void *send, void *recv, size_t count, ac_dtype_t dt,
                               ac_redop_t op, void *stream) {
  COMM_ARGS(c, "ac_comm_all_reduce");
  AC_CHECK(check_dtype(dt, "ac_comm_all_reduce"));
  AC_CHECK(check_op(op, "ac_comm_all_reduce"));
  if (count && (!send || !recv)) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_comm_all_reduce: NULL buffer");
  return c->ops->all_reduce(c, send, recv, count, dt, op, stream);
}

ac_result_t ac_comm_broadcast(ac_comm_t *c, void *buf, size_t count, ac_dtype_t dt, int root, void *stream) {
  COMM_ARGS(c, "ac_comm_broadcast");
  AC_CHECK(check_dtype(dt, "ac_comm_broadcast"));
  if (root < 0 || root >= c->nranks)
    return AC_FAIL(AC_ERR_INVALID_ARG, "ac_comm_broadcast: root %d of %d ranks", root, c->nranks);
  if (count && !buf) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_comm_broadcast: NULL buffer");
  return c->ops->broadcast(c, buf, count, dt, root, stream);
}

ac_result_t ac_comm_all_gather(ac_comm_t *c, const void *send, void *recv, size_t count, ac_dtype_t dt,
                               void *stream) {
  COMM_ARGS(c, "ac_comm_all_gather");
  AC_CHECK(check_dtype(dt, "ac_comm_all_gather"));
  if (count && (!send || !recv)) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_comm_all_gather: NULL buffer");
  return c->ops->all_gather(c, send, recv, count, dt, stream);
}

ac_result_t ac_comm_reduce_scatter(ac_comm_t *c, const void *send, void *recv, size_t count, ac_dtype_t dt,
                                   ac_redop_t op, void *stream) {
  COMM_ARGS(c, "ac_comm_reduce_scatter");
  AC_CHECK(check_dtype(dt, "ac_comm_reduce_scatter"));
  AC_CHECK(check_op(op, "ac_comm_reduce_scatter"));
  if (count && (!send || !recv)) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_comm_reduce_scatter: NULL buffer");
  return c->ops->reduce_scatter(c, send, recv, count, dt, op, stream);
}

ac_result_t ac_comm_wait(ac_comm_t *c) {
  COMM_ARGS(c, "ac_comm_wait");
  return c->ops->wait ? c->ops->wait(c) : AC_OK;
}

/* comm_shm_comm.c — the shared-memory group as an ac/comm.h communicator (its host-progressed
 * backend): each operation is queued to the group's progress thread (comm_shm_async.c) and
 * remembered; ac_comm_wait waits for all of them in order. An in-place all-reduce of memory in
 * the communicator's window becomes the window all-reduce (each rank reduces its slice straight
 * from every rank's region: no copy in or out), which is how the reducer's buckets travel. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ac/comm_shm.h"

typedef struct {
  struct ac_comm base; /* first: an ac_comm_t * is a shm_comm * */
  ac_shm_queue_t *q;   /* borrowed: outlives this communicator */
  ac_shm_window_t *w;  /* borrowed, or NULL */
  ac_shm_req_t **reqs; /* issued and not yet waited for, in order */
  size_t n, cap;
} shm_comm;

static const ac_comm_ops_t shm_ops;

static ac_result_t shm_type(ac_dtype_t dt, ac_shm_dtype_t *out) {
  switch (dt) {
    case AC_F32: *out = AC_SHM_F32; return AC_OK;
    case AC_F16: *out = AC_SHM_F16; return AC_OK;
    case AC_BF16: *out = AC_SHM_BF16; return AC_OK;
  }
  return AC_FAIL(AC_ERR_INVALID_ARG, "no shared-memory type for dtype code %d", (int)dt);
}

static ac_result_t no_stream(const void *stream, const char *what) {
  if (stream) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: the shared-memory backend takes host buffers and no stream", what);
  return AC_OK;
}

/* Queues `op` and keeps its request for ac_comm_wait. */
static ac_result_t issue(shm_comm *c, const ac_shm_op_t *op) {
  if (c->n == c->cap) {
    size_t cap = c->cap ? 2 * c->cap : 16;
    ac_shm_req_t **r = realloc(c->reqs, cap * sizeof *r);
    if (!r) return AC_FAIL(AC_ERR_NOMEM, "no memory to track shared-memory requests");
    c->reqs = r;
    c->cap = cap;
  }
  ac_shm_req_t *req = NULL;
  AC_CHECK(ac_shm_submit(c->q, op, &req));
  c->reqs[c->n++] = req;
  return AC_OK;
}

ac_result_t ac_shm_comm_create(ac_comm_t **out, ac_shm_queue_t *q, ac_shm_window_t *w) {
  if (!out || !q) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_shm_comm_create: NULL argument");
  *out = NULL;
  shm_comm *c = calloc(1, sizeof *c);
  if (!c) return AC_FAIL(AC_ERR_NOMEM, "no memory for a communicator");
  ac_shm_t *g = ac_shm_queue_comm(q);
  c->base.ops = &shm_ops;
  c->base.nranks = ac_shm_size(g);
  c->base.rank = ac_shm_rank(g);
  c->q = q;
  c->w = w;
  *out = &c->base;
  return AC_OK;
}

/* Where a result buffer of `count` elements (`recv`) lies against the window: 0 outside it, 1
 * wholly inside and element-aligned with its offset (in elements) in *offset, or an error for a
 * buffer partly inside, or inside but `in_place` false (the window collectives work in place; the
 * copy path would write past this rank's region into a peer's). */
static ac_result_t window_place(const shm_comm *c, const char *what, const void *recv, size_t count, ac_dtype_t dt,
                                int in_place, int *inside, size_t *offset) {
  *inside = 0;
  if (!c->w || !count) return AC_OK;
  /* addresses as integers: the buffer and the window are separate objects */
  uintptr_t lo = (uintptr_t)ac_shm_window_base(c->w), wb = ac_shm_window_bytes(c->w), p = (uintptr_t)recv;
  size_t es = ac_dtype_size(dt);
  if (count > SIZE_MAX / es) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: %zu elements overflow", what, count);
  uintptr_t bytes = count * es;
  int in = p >= lo && p - lo <= wb && bytes <= wb - (p - lo);
  int overlaps = p < lo + wb && lo < p + bytes;
  if (overlaps && (!in || !in_place || (p - lo) % es != 0))
    return AC_FAIL(AC_ERR_INVALID_ARG, "%s: a buffer of %zu bytes at offset %lld of the shared window (%zu bytes) "
                   "must lie wholly inside it, in place and element-aligned", what, (size_t)bytes,
                   (long long)((intptr_t)p - (intptr_t)lo), (size_t)wb);
  *inside = in;
  *offset = in ? (size_t)(p - lo) / es : 0;
  return AC_OK;
}

static ac_result_t shm_all_reduce(ac_comm_t *base, const void *send, void *recv, size_t count, ac_dtype_t dt,
                                  ac_redop_t op, void *stream) {
  shm_comm *c = (shm_comm *)base;
  AC_CHECK(no_stream(stream, "ac_comm_all_reduce"));
  ac_shm_op_t o = {.kind = AC_SHM_OP_ALL_REDUCE, .send = send, .recv = recv, .count = count, .op = op};
  AC_CHECK(shm_type(dt, &o.dt));
  int inside;
  AC_CHECK(window_place(c, "ac_comm_all_reduce", recv, count, dt, send == recv, &inside, &o.offset));
  if (inside) {
    o.kind = AC_SHM_OP_WINDOW_ALL_REDUCE; /* in place where every rank's gradients already are */
    o.window = c->w;
    o.send = o.recv = NULL;
  }
  return issue(c, &o);
}

static ac_result_t shm_broadcast(ac_comm_t *base, void *buf, size_t count, ac_dtype_t dt, int root, void *stream) {
  AC_CHECK(no_stream(stream, "ac_comm_broadcast"));
  ac_shm_op_t o = {.kind = AC_SHM_OP_BROADCAST, .recv = buf, .count = count, .root = root};
  AC_CHECK(shm_type(dt, &o.dt));
  return issue((shm_comm *)base, &o);
}

static ac_result_t shm_all_gather(ac_comm_t *base, const void *send, void *recv, size_t count, ac_dtype_t dt,
                                  void *stream) {
  shm_comm *c = (shm_comm *)base;
  AC_CHECK(no_stream(stream, "ac_comm_all_gather"));
  int inside;
  size_t offset, n = (size_t)c->base.nranks, es = ac_dtype_size(dt);
  if (es && count > SIZE_MAX / es / n) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_comm_all_gather: %zu elements overflow", count);
  /* in place: this rank's chunk already at its place in the result */
  int in_place = (const char *)send == (const char *)recv + (size_t)c->base.rank * count * es;
  AC_CHECK(window_place(c, "ac_comm_all_gather", recv, count * n, dt, in_place, &inside, &offset));
  if (inside) { /* every rank reads the others' chunks where they are: no copy in */
    ac_shm_op_t o = {.kind = AC_SHM_OP_WINDOW_ALL_GATHER, .count = count, .window = c->w, .offset = offset};
    AC_CHECK(shm_type(dt, &o.dt));
    return issue(c, &o);
  }
  size_t *counts = malloc(sizeof(size_t) * (size_t)c->base.nranks);
  if (!counts) return AC_FAIL(AC_ERR_NOMEM, "ac_comm_all_gather: counts");
  for (int i = 0; i < c->base.nranks; i++) counts[i] = count;
  ac_shm_op_t o = {.kind = AC_SHM_OP_ALL_GATHER, .send = send, .recv = recv, .counts = counts};
  ac_result_t r = shm_type(dt, &o.dt);
  if (r == AC_OK) r = issue(c, &o); /* the queue copies counts */
  free(counts);
  return r;
}

static ac_result_t shm_reduce_scatter(ac_comm_t *base, const void *send, void *recv, size_t count, ac_dtype_t dt,
                                      ac_redop_t op, void *stream) {
  AC_CHECK(no_stream(stream, "ac_comm_reduce_scatter"));
  ac_shm_op_t o = {.kind = AC_SHM_OP_REDUCE_SCATTER, .send = send, .recv = recv, .count = count, .op = op};
  AC_CHECK(shm_type(dt, &o.dt));
  return issue((shm_comm *)base, &o);
}

static ac_result_t shm_wait(ac_comm_t *base) {
  shm_comm *c = (shm_comm *)base;
  ac_result_t first = AC_OK;
  char msg[1024] = "";
  for (size_t i = 0; i < c->n; i++) {
    ac_result_t r = ac_shm_req_wait(c->reqs[i]); /* each one, so no buffer is in use afterwards */
    if (r != AC_OK && first == AC_OK) {
      first = r;
      snprintf(msg, sizeof msg, "%s", ac_last_error());
    }
  }
  c->n = 0;
  /* the first failure is the one reported, as it was worded (a later one may have overwritten
   * this thread's message meanwhile) */
  return first != AC_OK ? ac_restore_error(first, msg) : AC_OK;
}

static void shm_destroy(ac_comm_t *base) {
  shm_comm *c = (shm_comm *)base;
  /* what is still queued reads and writes the caller's buffers: wait (a dead or silent peer
   * fails it within the group's timeout); only a failure there sets this thread's message */
  if (c->n) (void)shm_wait(base);
  free(c->reqs);
  free(c);
}

static const ac_comm_ops_t shm_ops = {
    .backend = "shm",
    .stream_ordered = 0,
    .all_reduce = shm_all_reduce,
    .broadcast = shm_broadcast,
    .all_gather = shm_all_gather,
    .reduce_scatter = shm_reduce_scatter,
    .wait = shm_wait,
    .destroy = shm_destroy,
};

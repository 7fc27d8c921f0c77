/* comm_shm_async.c — a progress thread per shared-memory communicator (ac/comm_shm.h): requests
 * run in submission order on the thread, each with its own mutex and condition variable, so a
 * request outlives the queue that ran it (a caller may wait after the queue is destroyed). A
 * request is shared by its caller and the queue until both let go (a reference count of 2). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ac/comm_shm.h"

struct ac_shm_req {
  ac_shm_op_t op;
  size_t *counts; /* the copy op.counts points to */
  ac_result_t result;
  char msg[1024];
  int done;
  _Atomic int refs;
  pthread_mutex_t lock;
  pthread_cond_t cv;
  struct ac_shm_req *next;
};

struct ac_shm_queue {
  ac_shm_t *comm;
  pthread_t thread;
  int started, stopping;
  int busy; /* a collective is running (on the progress thread or inline, ac_shm_run) */
  pthread_mutex_t lock;
  pthread_cond_t cv;
  ac_shm_req_t *head, *tail;
};

static void req_unref(ac_shm_req_t *r) {
  if (atomic_fetch_sub(&r->refs, 1) != 1) return;
  pthread_mutex_destroy(&r->lock);
  pthread_cond_destroy(&r->cv);
  free(r->counts);
  free(r);
}

static ac_result_t run(ac_shm_t *c, const ac_shm_op_t *o) {
  switch (o->kind) {
    case AC_SHM_OP_ALL_REDUCE: return ac_shm_all_reduce(c, o->send, o->recv, o->count, o->dt, o->op);
    case AC_SHM_OP_REDUCE_SCATTER: return ac_shm_reduce_scatter(c, o->send, o->recv, o->count, o->dt, o->op);
    case AC_SHM_OP_ALL_GATHER: return ac_shm_all_gather(c, o->send, o->recv, o->counts, o->dt);
    case AC_SHM_OP_BROADCAST: return ac_shm_broadcast(c, o->recv, o->count, o->dt, o->root);
    case AC_SHM_OP_BARRIER: return ac_shm_barrier(c);
    case AC_SHM_OP_WINDOW_ALL_REDUCE: return ac_shm_window_all_reduce(c, o->window, o->offset, o->count, o->dt, o->op);
    case AC_SHM_OP_WINDOW_ALL_GATHER: return ac_shm_window_all_gather(c, o->window, o->offset, o->count, o->dt);
    case AC_SHM_OP_WINDOW_REDUCE_SCATTER:
      return ac_shm_window_reduce_scatter(c, o->window, o->offset, o->recv, o->count, o->dt, o->op);
  }
  return AC_FAIL(AC_ERR_INVALID_ARG, "unknown collective kind %d", (int)o->kind);
}

static void *progress(void *p) {
  ac_shm_queue_t *q = p;
  for (;;) {
    pthread_mutex_lock(&q->lock);
    while ((!q->head || q->busy) && !q->stopping) pthread_cond_wait(&q->cv, &q->lock);
    while (q->busy) pthread_cond_wait(&q->cv, &q->lock); /* stopping: an inline run ends first */
    ac_shm_req_t *r = q->head;
    if (!r) { /* stopping, and nothing left */
      pthread_mutex_unlock(&q->lock);
      return NULL;
    }
    q->head = r->next;
    if (!q->head) q->tail = NULL;
    q->busy = 1;
    pthread_mutex_unlock(&q->lock);
    ac_result_t res = run(q->comm, &r->op);
    pthread_mutex_lock(&q->lock);
    q->busy = 0;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->lock);
    pthread_mutex_lock(&r->lock);
    r->result = res;
    snprintf(r->msg, sizeof r->msg, "%s", res == AC_OK ? "" : ac_last_error());
    r->done = 1;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->lock);
    req_unref(r);
  }
}

ac_result_t ac_shm_queue_create(ac_shm_queue_t **out, ac_shm_t *c) {
  if (!out || !c) return AC_FAIL(AC_ERR_INVALID_ARG, "out and the communicator must not be NULL");
  ac_shm_queue_t *q = calloc(1, sizeof *q);
  if (!q) return AC_FAIL(AC_ERR_NOMEM, "ac_shm_queue_t");
  q->comm = c;
  pthread_mutex_init(&q->lock, NULL);
  pthread_cond_init(&q->cv, NULL);
  *out = q;
  return AC_OK;
}

ac_shm_t *ac_shm_queue_comm(ac_shm_queue_t *q) { return q ? q->comm : NULL; }

ac_result_t ac_shm_submit(ac_shm_queue_t *q, const ac_shm_op_t *op, ac_shm_req_t **req) {
  if (!q || !op || !req) return AC_FAIL(AC_ERR_INVALID_ARG, "queue, op and req must not be NULL");
  *req = NULL;
  ac_shm_req_t *r = calloc(1, sizeof *r);
  if (!r) return AC_FAIL(AC_ERR_NOMEM, "ac_shm_req_t");
  r->op = *op;
  if (op->kind == AC_SHM_OP_ALL_GATHER && op->counts) {
    int n = ac_shm_size(q->comm);
    r->counts = malloc(sizeof(size_t) * (size_t)n);
    if (!r->counts) {
      free(r);
      return AC_FAIL(AC_ERR_NOMEM, "all_gather counts");
    }
    memcpy(r->counts, op->counts, sizeof(size_t) * (size_t)n);
    r->op.counts = r->counts;
  }
  atomic_init(&r->refs, 2);
  pthread_mutex_init(&r->lock, NULL);
  pthread_cond_init(&r->cv, NULL);
  pthread_mutex_lock(&q->lock);
  if (q->stopping) {
    pthread_mutex_unlock(&q->lock);
    atomic_store(&r->refs, 1);
    req_unref(r);
    return AC_FAIL(AC_ERR_STATE, "the shared-memory communicator is closed");
  }
  if (!q->started) {
    if (pthread_create(&q->thread, NULL, progress, q) != 0) {
      pthread_mutex_unlock(&q->lock);
      atomic_store(&r->refs, 1);
      req_unref(r);
      return AC_FAIL(AC_ERR_NOMEM, "could not start the shared-memory progress thread");
    }
    q->started = 1;
  }
  if (q->tail) q->tail->next = r;
  else q->head = r;
  q->tail = r;
  pthread_cond_signal(&q->cv);
  pthread_mutex_unlock(&q->lock);
  *req = r;
  return AC_OK;
}

ac_result_t ac_shm_run(ac_shm_queue_t *q, const ac_shm_op_t *op) {
  if (!q || !op) return AC_FAIL(AC_ERR_INVALID_ARG, "queue and op must not be NULL");
  pthread_mutex_lock(&q->lock);
  if (!q->stopping && !q->head && !q->busy) {
    /* nothing queued or running: run it here, sparing the hand-off to the progress thread and
     * back (two thread wake-ups, most of a small collective's latency); what is submitted
     * meanwhile waits behind it */
    q->busy = 1;
    pthread_mutex_unlock(&q->lock);
    ac_result_t res = run(q->comm, op);
    pthread_mutex_lock(&q->lock);
    q->busy = 0;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->lock);
    return res;
  }
  pthread_mutex_unlock(&q->lock);
  ac_shm_req_t *r = NULL;
  AC_CHECK(ac_shm_submit(q, op, &r));
  return ac_shm_req_wait(r);
}

int ac_shm_req_done(ac_shm_req_t *r) {
  if (!r) return 1;
  pthread_mutex_lock(&r->lock);
  int d = r->done;
  pthread_mutex_unlock(&r->lock);
  return d;
}

ac_result_t ac_shm_req_wait(ac_shm_req_t *r) {
  if (!r) return AC_FAIL(AC_ERR_INVALID_ARG, "request is NULL");
  pthread_mutex_lock(&r->lock);
  while (!r->done) pthread_cond_wait(&r->cv, &r->lock);
  ac_result_t res = r->result;
  char msg[sizeof r->msg];
  memcpy(msg, r->msg, sizeof msg);
  pthread_mutex_unlock(&r->lock);
  req_unref(r);
  if (res != AC_OK) ac_set_error(res, __FILE__, __LINE__, NULL, "%s", msg);
  return res;
}

void ac_shm_req_release(ac_shm_req_t *r) {
  if (r) req_unref(r);
}

void ac_shm_queue_destroy(ac_shm_queue_t *q) {
  if (!q) return;
  ac_shm_abort(q->comm);
  pthread_mutex_lock(&q->lock);
  q->stopping = 1;
  pthread_cond_broadcast(&q->cv);
  while (q->busy) pthread_cond_wait(&q->cv, &q->lock); /* an inline run (aborted) ends first */
  int started = q->started;
  pthread_mutex_unlock(&q->lock);
  if (started) pthread_join(q->thread, NULL);
  ac_shm_destroy(q->comm);
  pthread_mutex_destroy(&q->lock);
  pthread_cond_destroy(&q->cv);
  free(q);
}

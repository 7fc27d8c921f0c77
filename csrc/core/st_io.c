/* st_io.c — the parallel positioned I/O engine of the safetensors writer and reader: a plan of
 * jobs (contiguous file ranges, each one pwritev/preadv of up to ST_JOB_IOV pieces) that a few
 * threads take from a shared counter, each job moved completely (partial transfers, EINTR). */
#define _GNU_SOURCE /* pwritev/preadv; must precede every system header */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#include "st_internal.h"

/* One I/O job moves at most this many bytes: small enough that a few big tensors still spread
 * over all threads, large enough that the syscall cost is noise. */
#define ST_JOB_BYTES ((size_t)8 << 20)
/* iovecs per job: many small tensors (biases, norms) are coalesced into one pwritev. */
#define ST_JOB_IOV 64
#define ST_MAX_THREADS 8

void st_io_plan_free(st_io_plan *p) {
  free(p->iov);
  free(p->iov_tensor);
  free(p->jobs);
  memset(p, 0, sizeof *p);
}

/* Appends bytes [ptr, ptr+len) that belong at file offset `off` (offsets must be added in
 * increasing order). Contiguous pieces share a job until it is full. Returns 0 or -1 (no memory). */
int st_io_plan_add(st_io_plan *p, uint64_t off, char *ptr, size_t len, size_t tensor) {
  while (len > 0) {
    st_io_job *j = p->njobs ? &p->jobs[p->njobs - 1] : NULL;
    int fits = j && j->off + j->total == off && j->total < ST_JOB_BYTES && j->niov < ST_JOB_IOV;
    if (!fits) {
      if (p->njobs == p->cap_jobs) {
        size_t cap = p->cap_jobs ? 2 * p->cap_jobs : 64;
        st_io_job *q = realloc(p->jobs, cap * sizeof *q);
        if (!q) return -1;
        p->jobs = q;
        p->cap_jobs = cap;
      }
      j = &p->jobs[p->njobs++];
      j->off = off;
      j->first = p->niov;
      j->niov = 0;
      j->total = 0;
      j->tensor = tensor;
    }
    size_t piece = ST_JOB_BYTES - j->total;
    if (piece > len) piece = len;
    if (p->niov == p->cap_iov) {
      size_t cap = p->cap_iov ? 2 * p->cap_iov : 64;
      struct iovec *q = realloc(p->iov, cap * sizeof *q);
      if (!q) return -1;
      p->iov = q;
      size_t *t = realloc(p->iov_tensor, cap * sizeof *t);
      if (!t) return -1;
      p->iov_tensor = t;
      p->cap_iov = cap;
    }
    p->iov[p->niov].iov_base = ptr;
    p->iov[p->niov].iov_len = piece;
    p->iov_tensor[p->niov] = tensor;
    p->niov++;
    j->niov++;
    j->total += piece;
    off += piece;
    ptr += piece;
    len -= piece;
  }
  return 0;
}

/* Moves one job completely, looping over partial transfers and EINTR. Returns 0, or an errno
 * (-1 for end of file on a read) and where it stopped. */
static int io_job_run(int fd, int wr, const st_io_plan *p, const st_io_job *j, size_t *at_iov, uint64_t *at_off) {
  struct iovec v[ST_JOB_IOV];
  memcpy(v, p->iov + j->first, j->niov * sizeof *v);
  size_t first = 0, cnt = j->niov;
  uint64_t off = j->off;
  while (cnt > 0) {
    ssize_t n = wr ? pwritev(fd, v + first, (int)cnt, (off_t)off) : preadv(fd, v + first, (int)cnt, (off_t)off);
    if (n < 0) {
      if (errno == EINTR) continue;
      *at_iov = j->first + first;
      *at_off = off;
      return errno ? errno : EIO;
    }
    if (n == 0) {
      *at_iov = j->first + first;
      *at_off = off;
      return wr ? EIO : -1; /* a write of zero bytes should not happen; a read of zero is EOF */
    }
    off += (uint64_t)n;
    size_t left = (size_t)n;
    while (cnt > 0 && left >= v[first].iov_len) {
      left -= v[first].iov_len;
      first++;
      cnt--;
    }
    if (cnt > 0) {
      v[first].iov_base = (char *)v[first].iov_base + left;
      v[first].iov_len -= left;
    }
  }
  return 0;
}

static void *io_worker(void *arg) {
  st_io_run *r = arg;
  for (;;) {
    if (atomic_load_explicit(&r->failed, memory_order_relaxed)) break;
    size_t i = atomic_fetch_add(&r->next, 1);
    if (i >= r->plan->njobs) break;
    size_t at_iov = 0;
    uint64_t at_off = 0;
    int e = io_job_run(r->fd, r->write, r->plan, &r->plan->jobs[i], &at_iov, &at_off);
    if (e) {
      pthread_mutex_lock(&r->mu);
      if (!atomic_load(&r->failed)) {
        r->err = e > 0 ? e : 0;
        r->short_io = e < 0;
        r->bad_iov = at_iov;
        r->bad_off = at_off;
        atomic_store(&r->failed, 1);
      }
      pthread_mutex_unlock(&r->mu);
    }
  }
  return NULL;
}

static int pick_threads(int threads, size_t njobs) {
  if (threads <= 0) {
    long c = sysconf(_SC_NPROCESSORS_ONLN);
    threads = c > 0 ? (int)(c < ST_MAX_THREADS ? c : ST_MAX_THREADS) : 1;
  }
  if (threads > 64) threads = 64;
  if ((size_t)threads > njobs) threads = njobs ? (int)njobs : 1;
  return threads;
}

/* Runs the plan on `threads` threads (the caller is one of them). A worker that cannot be
 * started only costs parallelism, so that is not an error. Returns 0 or 1 (r->err etc. set). */
int st_io_execute(st_io_run *r, int threads) {
  atomic_init(&r->next, 0);
  atomic_init(&r->failed, 0);
  r->err = 0;
  r->short_io = 0;
  pthread_mutex_init(&r->mu, NULL);
  int nt = pick_threads(threads, r->plan->njobs);
  pthread_t tid[64];
  int started = 0;
  for (int i = 1; i < nt; i++) {
    if (pthread_create(&tid[started], NULL, io_worker, r) != 0) break;
    started++;
  }
  io_worker(r);
  for (int i = 0; i < started; i++) pthread_join(tid[i], NULL);
  pthread_mutex_destroy(&r->mu);
  return atomic_load(&r->failed);
}

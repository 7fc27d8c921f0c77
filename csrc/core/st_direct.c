/* st_direct.c — the chunked executor of ac_st_save: the file as one byte stream cut into
 * aligned chunks, each copied into a worker's aligned staging buffer and written with one pwrite.
 * It writes O_DIRECT files, and every file that holds GPU tensors (O_DIRECT or not): those are
 * staged through pinned buffers, a chunk's device pieces copied on the worker's own CUDA stream.
 * The file handling around it (temp file, fallback, fsync, rename) is in st_write.c. */
#define _GNU_SOURCE /* must precede every system header */
#include "st_direct.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#include "ac/cuda.h"

/* Workers when the caller passes threads = 0. Two, so one worker's memcpy into its staging
 * buffer overlaps the other's pwrite (with GPU tensors: one worker's device->host copy overlaps
 * the other's disk write, i.e. double buffering). Measured on the 2-core dev VM (ext4 on virtio, 1 GB file,
 * 8 MiB chunks, medians of 5-7 runs, runs vary by +-15%): one file with 1 worker 560-600 ms,
 * 2 workers 440-530 ms, 4 workers 430-575 ms; save_state's two files (335 + 671 MB) written at
 * once from two threads: 1 worker each 470-505 ms, 2 each 445-540 ms, 4 each 570 ms. More
 * workers only add 8 MiB staging buffers. (Buffered write + fsync of the same 1 GB: 0.8-3.3 s.) */
#define ST_DIRECT_THREADS 2

static atomic_size_t chunk_override; /* 0 = ST_DIRECT_CHUNK */

size_t st_direct_chunk_bytes(void) {
  size_t c = atomic_load_explicit(&chunk_override, memory_order_relaxed);
  return c ? c : ST_DIRECT_CHUNK;
}

int st_direct_set_chunk_bytes(size_t bytes) {
  if (bytes % ST_DIRECT_ALIGN) return -1;
  atomic_store(&chunk_override, bytes);
  return 0;
}

static atomic_int fault_hook;

void st_direct_set_fault(int fault) { atomic_store(&fault_hook, fault); }

int st_direct_fault(void) { return atomic_load_explicit(&fault_hook, memory_order_relaxed); }

size_t st_direct_seg_at(const st_seg *segs, size_t nsegs, uint64_t off) {
  /* the last segment whose start is <= off (segments are sorted and contiguous) */
  size_t lo = 0, hi = nsegs;
  while (hi - lo > 1) {
    size_t mid = lo + (hi - lo) / 2;
    if (segs[mid].off <= off) lo = mid;
    else hi = mid;
  }
  return lo;
}

/* ---- device ops ---------------------------------------------------------------------------- */

static const st_device_ops cuda_ops = {
    .check_device = ac_cuda_check_device,
    .host_alloc = ac_cuda_host_alloc,
    .host_free = ac_cuda_host_free,
    .stream_create = ac_cuda_stream_create,
    .stream_destroy = ac_cuda_stream_destroy,
    .stream_wait_event = ac_cuda_stream_wait_event,
    .copy_async = ac_cuda_copy_to_host_async,
    .stream_sync = ac_cuda_stream_sync,
};

static _Atomic(const st_device_ops *) ops_hook; /* NULL = cuda_ops */

const st_device_ops *st_device_ops_get(void) {
  const st_device_ops *o = atomic_load(&ops_hook);
  return o ? o : &cuda_ops;
}

void st_direct_set_device_ops(const st_device_ops *ops) { atomic_store(&ops_hook, ops); }

/* ---- the executor ---------------------------------------------------------------------------- */

typedef struct {
  int fd;
  int direct; /* fd has O_DIRECT */
  const st_seg *segs;
  size_t nsegs;
  uint64_t total;
  size_t chunk;
  size_t nchunks;
  size_t bufsize;
  /* staged mode (some segment on a device) */
  int staged;
  int ndev;  /* 1 + the highest device ordinal of any segment */
  int dev0;  /* the device of the first device segment: current while allocating the pinned buffer */
  const st_device_ops *ops;
  atomic_int have_buf; /* workers that got a staging buffer */
  atomic_size_t next;
  atomic_int failed;
  atomic_int wrote; /* some pwrite succeeded */
  pthread_mutex_t mu;
  st_direct_fail fail;       /* the first failure, under mu */
  st_direct_fail alloc_fail; /* the first failed pinned allocation, under mu */
  int alloc_failed;
} dw_run;

typedef struct {
  dw_run *run;
  char *buf;      /* aligned staging buffer */
  void *base;     /* what the pinned allocator returned (staged mode) */
  void **streams; /* staged: [ndev], created on first use, on this worker's thread */
  size_t *first;  /* staged: [ndev], tensor of the first piece queued on that device in this chunk */
  size_t *count;  /* staged: [ndev], pieces queued on that device in this chunk */
  void **waited;  /* staged: [ndev], the event that stream last waited for (one per device is usual) */
} dw_worker;

/* Copies the stream's bytes [start, start + len) into buf (host segments only). */
static void fill_chunk(const dw_run *r, char *buf, uint64_t start, size_t len) {
  size_t s = st_direct_seg_at(r->segs, r->nsegs, start);
  uint64_t end = start + len;
  for (; s < r->nsegs && r->segs[s].off < end; s++) {
    const st_seg *g = &r->segs[s];
    if (g->device >= 0) continue; /* staged mode: copied by fill_staged */
    uint64_t lo = g->off > start ? g->off : start;
    uint64_t hi = g->off + g->len < end ? g->off + g->len : end;
    memcpy(buf + (lo - start), g->p + (lo - g->off), (size_t)(hi - lo));
  }
}

static void record(dw_run *r, int err, int unaligned, uint64_t off) {
  pthread_mutex_lock(&r->mu);
  if (!atomic_load(&r->failed)) {
    r->fail.kind = ST_FAIL_WRITE;
    r->fail.err = err;
    r->fail.unaligned = unaligned;
    r->fail.nothing_written = !atomic_load(&r->wrote);
    r->fail.off = off;
    atomic_store(&r->failed, 1);
  }
  pthread_mutex_unlock(&r->mu);
}

/* A device call failed on this thread: keep its message (thread-local) for the caller. */
static void record_copy(dw_run *r, size_t tensor, size_t more, int device, ac_result_t code, uint64_t off) {
  pthread_mutex_lock(&r->mu);
  if (!atomic_load(&r->failed)) {
    r->fail.kind = ST_FAIL_COPY;
    r->fail.tensor = tensor;
    r->fail.more = more;
    r->fail.device = device;
    r->fail.code = code != AC_OK ? code : AC_ERR_CUDA;
    r->fail.off = off;
    snprintf(r->fail.msg, sizeof r->fail.msg, "%s", ac_last_error());
    atomic_store(&r->failed, 1);
  }
  pthread_mutex_unlock(&r->mu);
}

/* Writes one filled, padded chunk; loops on short writes and EINTR. Returns 0 or -1 (recorded). */
static int write_chunk(dw_run *r, const char *buf, size_t padded, uint64_t start) {
  size_t done = 0;
  while (done < padded) {
    ssize_t n;
    int fault = r->direct ? st_direct_fault() : ST_DIRECT_FAULT_NONE;
    if (fault == ST_DIRECT_FAULT_WRITE) n = -1, errno = EINVAL;
    else if (fault == ST_DIRECT_FAULT_SHORT && !atomic_exchange(&r->wrote, 1)) n = 512;
    else n = pwrite(r->fd, buf + done, padded - done, (off_t)(start + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      record(r, errno ? errno : EIO, 0, start + done);
      return -1;
    }
    if (n == 0) {
      record(r, EIO, 0, start + done);
      return -1;
    }
    atomic_store_explicit(&r->wrote, 1, memory_order_relaxed);
    done += (size_t)n;
    /* the rest must start aligned again, or O_DIRECT cannot take it: say so rather than
     * retrying into EINVAL (a file system that does this would need the buffered path) */
    if (r->direct && done < padded && done % ST_DIRECT_ALIGN) {
      record(r, EINVAL, 1, start + done);
      return -1;
    }
  }
  return 0;
}

/* Staged mode: fills the chunk [start, start + len) into w->buf. Device pieces are queued first
 * (cudaMemcpyAsync on this worker's stream for their device), the host pieces memcpy'd while
 * they run, then every stream used is synchronised, also after a failure: the copies write into
 * the buffer, which must not be reused or freed before they are done. Returns 0 or -1 (recorded). */
static int fill_staged(dw_worker *w, uint64_t start, size_t len) {
  dw_run *r = w->run;
  const st_device_ops *ops = r->ops;
  uint64_t end = start + len;
  int bad = 0;
  for (size_t s = st_direct_seg_at(r->segs, r->nsegs, start); s < r->nsegs && r->segs[s].off < end; s++) {
    const st_seg *g = &r->segs[s];
    if (g->device < 0) continue;
    int d = g->device;
    if (!w->streams[d]) {
      ac_result_t rc = ops->stream_create(&w->streams[d], d);
      if (rc != AC_OK) {
        w->streams[d] = NULL;
        record_copy(r, g->tensor, 0, d, rc, start);
        bad = 1;
        break;
      }
    }
    if (w->first[d] == SIZE_MAX) {
      w->first[d] = g->tensor;
      w->count[d] = 0;
    }
    w->count[d]++;
    /* the data may still be being written on the caller's stream: wait for its event first */
    if (g->event && w->waited[d] != g->event) {
      ac_result_t rc = ops->stream_wait_event(w->streams[d], g->event, d);
      if (rc != AC_OK) {
        record_copy(r, g->tensor, 0, d, rc, start);
        bad = 1;
        break;
      }
      w->waited[d] = g->event;
    }
    uint64_t lo = g->off > start ? g->off : start;
    uint64_t hi = g->off + g->len < end ? g->off + g->len : end;
    ac_result_t rc = ops->copy_async(w->buf + (lo - start), g->p + (lo - g->off), (size_t)(hi - lo), d, w->streams[d]);
    if (rc != AC_OK) {
      record_copy(r, g->tensor, 0, d, rc, start);
      bad = 1;
      break;
    }
  }
  if (!bad) fill_chunk(r, w->buf, start, len);
  for (int d = 0; d < r->ndev; d++) {
    if (w->first[d] == SIZE_MAX) continue;
    ac_result_t rc = ops->stream_sync(w->streams[d], d);
    if (rc != AC_OK && !bad) {
      record_copy(r, w->first[d], w->count[d] - 1, d, rc, start);
      bad = 1;
    }
    w->first[d] = SIZE_MAX;
  }
  return bad ? -1 : 0;
}

static void dw_loop(dw_worker *w) {
  dw_run *r = w->run;
  for (;;) {
    if (atomic_load_explicit(&r->failed, memory_order_relaxed)) break;
    size_t c = atomic_fetch_add(&r->next, 1);
    if (c >= r->nchunks) break;
    uint64_t start = (uint64_t)c * r->chunk;
    size_t len = r->total - start < r->chunk ? (size_t)(r->total - start) : r->chunk;
    size_t padded = (len + ST_DIRECT_ALIGN - 1) / ST_DIRECT_ALIGN * ST_DIRECT_ALIGN;
    if (r->staged) {
      if (fill_staged(w, start, len) < 0) break;
    } else {
      fill_chunk(r, w->buf, start, len);
    }
    memset(w->buf + len, 0, padded - len);
    if (write_chunk(r, w->buf, padded, start) < 0) break;
  }
}

static void *dw_main(void *arg) {
  dw_loop(arg);
  return NULL;
}

/* A staged worker, on a thread of its own: allocates its pinned buffer (with the first device
 * current, as every later CUDA call of this thread makes some device current anyway), runs
 * chunks, then destroys its streams and frees its buffer on the same thread. */
static void *dw_staged_main(void *arg) {
  dw_worker *w = arg;
  dw_run *r = w->run;
  void *base = NULL;
  /* slack for the alignment: O_DIRECT needs ST_DIRECT_ALIGN, cudaHostAlloc promises less */
  ac_result_t rc = r->ops->host_alloc(&base, r->bufsize + ST_DIRECT_ALIGN, r->dev0);
  if (rc != AC_OK || !base) {
    pthread_mutex_lock(&r->mu);
    if (!r->alloc_failed) {
      r->alloc_failed = 1;
      r->alloc_fail.kind = ST_FAIL_ALLOC;
      r->alloc_fail.code = rc != AC_OK ? rc : AC_ERR_NOMEM;
      r->alloc_fail.device = r->dev0;
      snprintf(r->alloc_fail.msg, sizeof r->alloc_fail.msg, "%s", rc != AC_OK ? ac_last_error() : "");
    }
    pthread_mutex_unlock(&r->mu);
    return NULL; /* a buffer that cannot be had only costs parallelism */
  }
  w->base = base;
  w->buf = (char *)(((uintptr_t)base + ST_DIRECT_ALIGN - 1) / ST_DIRECT_ALIGN * ST_DIRECT_ALIGN);
  atomic_fetch_add(&r->have_buf, 1);
  dw_loop(w);
  for (int d = 0; d < r->ndev; d++)
    if (w->streams[d]) r->ops->stream_destroy(w->streams[d], d);
  r->ops->host_free(base);
  return NULL;
}

static void free_staged_state(dw_worker *w, int n) {
  for (int i = 0; i < n; i++) {
    free(w[i].streams);
    free(w[i].first);
    free(w[i].count);
    free(w[i].waited);
  }
}

int st_direct_write(int fd, const st_seg *segs, size_t nsegs, uint64_t total, int threads, int direct,
                    st_direct_fail *f) {
  memset(f, 0, sizeof *f);
  dw_run r = {.fd = fd, .direct = direct, .segs = segs, .nsegs = nsegs, .total = total,
              .chunk = st_direct_chunk_bytes(), .dev0 = -1};
  r.nchunks = (size_t)((total + r.chunk - 1) / r.chunk);
  for (size_t i = 0; i < nsegs; i++) {
    int d = segs[i].device;
    if (d < 0) continue;
    if (r.dev0 < 0) r.dev0 = d;
    if (d + 1 > r.ndev) r.ndev = d + 1;
  }
  r.staged = r.ndev > 0;
  r.ops = st_device_ops_get();
  atomic_init(&r.have_buf, 0);
  atomic_init(&r.next, 0);
  atomic_init(&r.failed, 0);
  atomic_init(&r.wrote, 0);
  memset(&r.fail, 0, sizeof r.fail);
  memset(&r.alloc_fail, 0, sizeof r.alloc_fail);
  int nt = threads > 0 ? threads : ST_DIRECT_THREADS;
  if (nt > ST_DIRECT_MAX_THREADS) nt = ST_DIRECT_MAX_THREADS;
  if ((size_t)nt > r.nchunks) nt = (int)r.nchunks;
  if (nt < 1) nt = 1;
  /* A small file needs a buffer of its padded size only, not a whole chunk. */
  r.bufsize = r.chunk;
  if (r.nchunks == 1) r.bufsize = (size_t)((total + ST_DIRECT_ALIGN - 1) / ST_DIRECT_ALIGN * ST_DIRECT_ALIGN);
  dw_worker w[ST_DIRECT_MAX_THREADS];
  memset(w, 0, sizeof w);
  pthread_t tid[ST_DIRECT_MAX_THREADS];
  int started = 0;

  if (!r.staged) {
    int nbuf = 0;
    for (; nbuf < nt; nbuf++) { /* a buffer that cannot be had only costs parallelism */
      void *p = NULL;
      if (posix_memalign(&p, ST_DIRECT_ALIGN, r.bufsize) != 0) break;
      w[nbuf].run = &r;
      w[nbuf].buf = p;
    }
    if (nbuf == 0) {
      f->kind = ST_FAIL_ALLOC;
      f->code = AC_ERR_NOMEM;
      return -1;
    }
    pthread_mutex_init(&r.mu, NULL);
    for (int i = 1; i < nbuf; i++) {
      if (pthread_create(&tid[started], NULL, dw_main, &w[i]) != 0) break;
      started++;
    }
    dw_main(&w[0]);
    for (int i = 0; i < started; i++) pthread_join(tid[i], NULL);
    pthread_mutex_destroy(&r.mu);
    for (int i = 0; i < nbuf; i++) free(w[i].buf);
  } else {
    for (int i = 0; i < nt; i++) {
      w[i].run = &r;
      w[i].streams = calloc((size_t)r.ndev, sizeof *w[i].streams);
      w[i].first = malloc((size_t)r.ndev * sizeof *w[i].first);
      w[i].count = calloc((size_t)r.ndev, sizeof *w[i].count);
      w[i].waited = calloc((size_t)r.ndev, sizeof *w[i].waited);
      if (!w[i].streams || !w[i].first || !w[i].count || !w[i].waited) {
        free_staged_state(w, i + 1);
        f->kind = ST_FAIL_ALLOC;
        f->code = AC_ERR_NOMEM;
        return -1;
      }
      for (int d = 0; d < r.ndev; d++) w[i].first[d] = SIZE_MAX;
    }
    pthread_mutex_init(&r.mu, NULL);
    int terr = 0;
    for (int i = 0; i < nt; i++) {
      int e = pthread_create(&tid[started], NULL, dw_staged_main, &w[i]);
      if (e != 0) {
        terr = e;
        break;
      }
      started++;
    }
    for (int i = 0; i < started; i++) pthread_join(tid[i], NULL);
    pthread_mutex_destroy(&r.mu);
    free_staged_state(w, nt);
    if (started == 0) {
      f->kind = ST_FAIL_THREAD;
      f->err = terr ? terr : EAGAIN;
      return 1;
    }
    if (!atomic_load(&r.failed) && atomic_load(&r.have_buf) == 0) {
      *f = r.alloc_fail;
      return -1;
    }
  }
  if (atomic_load(&r.failed)) {
    *f = r.fail;
    return 1;
  }
  return 0;
}

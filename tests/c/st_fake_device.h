/* st_fake_device.h — a fake CUDA device for test_safetensors_gpu.c: it swaps in for the CUDA
 * layer of the O_DIRECT writer (st_direct_set_device_ops(&fake_ops)) so the staged chunk
 * pipeline runs, and is checked, on a machine without a GPU.
 *
 * Header only and included by that one program: its CHECKs (in to_fake_device and
 * fake_pending_write) must count in the including program's current test, and test_util.h keeps
 * those counters per translation unit. */
#ifndef AC_ST_FAKE_DEVICE_H
#define AC_ST_FAKE_DEVICE_H

#ifndef _GNU_SOURCE
#error "define _GNU_SOURCE before the first include: the fake device needs memfd_create"
#endif

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ac/safetensors.h"
#include "st_direct.h" /* internal: st_device_ops, the layer the fake replaces */
#include "test_util.h"

/* The fake device: "device memory" is a memfd mapped twice, once PROT_NONE (the address the
 * writer gets, so any host access to it crashes, as it would for real device memory) and once
 * readable (where the fake copy engine reads), holding every byte XOR FAKE_KEY, so bytes that
 * reach the file other than through the fake copy (which decodes) differ from the reference.
 * Copies are queued on the fake stream and only done at its sync, as a real cudaMemcpyAsync
 * into pinned memory may finish late: a pwrite before the sync writes garbage.
 * Every device op checks that it runs off the main thread (the writer must not change the
 * caller's current device), that its device is the one the memory is registered on, and that
 * the destination lies inside a live pinned buffer; it counts what it does. */
#define FAKE_KEY 0x5a
#define FAKE_MAX_RANGES 2048
#define FAKE_MAX_PINNED 64
#define FAKE_PIN_SKEW 8 /* the fake pinned allocator returns addresses 8 bytes past 4096-alignment */

typedef struct {
  const unsigned char *p;     /* the device address (PROT_NONE) */
  const unsigned char *alias; /* the same bytes, readable by the fake copy engine */
  size_t n;
  int device;
} fake_range;

/* A "ready event" of the caller's stream: until a stream that waited for it reaches the wait,
 * the tensor's device bytes are still being written by the caller's kernels (the fake holds
 * stale bytes there); completing the event writes the final ones. */
typedef struct {
  int device;
  fake_range *r;
  unsigned char *final; /* the encoded bytes the caller's kernels are writing */
  int done;             /* under fk.mu */
  atomic_int waits;     /* streams that waited for it */
} fake_event;

/* A queued operation: a copy, or (`wait` set) a wait for an event. */
typedef struct {
  void *dst;
  const void *src;
  size_t n;
  fake_event *wait;
} fake_copy;

#define FAKE_MAX_WAITED 8

typedef struct {
  int device;
  fake_copy *q;
  size_t nq, cap;
  fake_event *waited[FAKE_MAX_WAITED]; /* the events this stream has queued a wait for */
  int nwaited;
} fake_stream;

static struct {
  fake_range ranges[FAKE_MAX_RANGES];
  int nranges;
  pthread_t main_thread;
  pthread_mutex_t mu; /* the pinned table */
  struct {
    char *p;
    size_t n;
  } pinned[FAKE_MAX_PINNED];
  const unsigned char *fail_src; /* copy_async fails when its source lies in this range */
  size_t fail_n;
  int fail_sync;   /* stream_sync fails (after doing the copies) */
  int fail_alloc;  /* host_alloc number fail_alloc (1-based) and all later ones fail; 0 = never */
  int fail_wait;   /* stream_wait_event fails */
  fake_event *pending[FAKE_MAX_RANGES]; /* per range: its ready event not yet completed, or NULL */
} fk = {.mu = PTHREAD_MUTEX_INITIALIZER};

static atomic_long fk_allocs, fk_frees, fk_streams, fk_stream_frees, fk_copies, fk_syncs, fk_checks, fk_bad;
static atomic_size_t fk_bytes;

static void fake_reset(void) {
  fk.nranges = 0;
  fk.main_thread = pthread_self();
  fk.fail_src = NULL;
  fk.fail_n = 0;
  fk.fail_sync = 0;
  fk.fail_alloc = 0;
  fk.fail_wait = 0;
  memset(fk.pending, 0, sizeof fk.pending);
  atomic_store(&fk_allocs, 0);
  atomic_store(&fk_frees, 0);
  atomic_store(&fk_streams, 0);
  atomic_store(&fk_stream_frees, 0);
  atomic_store(&fk_copies, 0);
  atomic_store(&fk_syncs, 0);
  atomic_store(&fk_checks, 0);
  atomic_store(&fk_bad, 0);
  atomic_store(&fk_bytes, 0);
}

static void fake_bad(const char *what) {
  atomic_fetch_add(&fk_bad, 1);
  printf("    fake device: %s\n", what);
}

static int on_main(void) { return pthread_equal(pthread_self(), fk.main_thread); }

static ac_result_t fake_check_device(int device) {
  atomic_fetch_add(&fk_checks, 1);
  if (device > 3) return AC_FAIL(AC_ERR_INVALID_ARG, "CUDA device %d does not exist (4 visible)", device);
  return AC_OK;
}

static ac_result_t fake_host_alloc(void **ptr, size_t bytes, int device) {
  *ptr = NULL;
  if (on_main()) fake_bad("host_alloc on the caller's thread");
  if (device < 0 || device > 3) fake_bad("host_alloc with a bad device");
  long k = atomic_fetch_add(&fk_allocs, 1) + 1;
  if (fk.fail_alloc && k >= fk.fail_alloc) {
    atomic_fetch_add(&fk_frees, 1); /* nothing to free: keep the balance */
    return AC_FAIL(AC_ERR_NOMEM, "cudaHostAlloc of %zu bytes (device %d current) failed: fake out of pinned memory",
                   bytes, device);
  }
  char *base = malloc(bytes + 4096 + FAKE_PIN_SKEW);
  if (!base) return AC_FAIL(AC_ERR_NOMEM, "fake: malloc failed");
  char *p = (char *)(((uintptr_t)base + 4095) / 4096 * 4096) + FAKE_PIN_SKEW;
  pthread_mutex_lock(&fk.mu);
  int slot = -1;
  for (int i = 0; i < FAKE_MAX_PINNED && slot < 0; i++)
    if (!fk.pinned[i].p) slot = i;
  if (slot >= 0) {
    fk.pinned[slot].p = p;
    fk.pinned[slot].n = bytes;
  }
  pthread_mutex_unlock(&fk.mu);
  if (slot < 0) {
    free(base);
    fake_bad("too many live pinned buffers");
    return AC_FAIL(AC_ERR_NOMEM, "fake: too many pinned buffers");
  }
  /* remember the malloc base just before the returned address (inside the alignment slack) */
  memcpy(p - FAKE_PIN_SKEW, &base, sizeof base);
  *ptr = p;
  return AC_OK;
}

static void fake_host_free(void *ptr) {
  if (!ptr) return;
  if (on_main()) fake_bad("host_free on the caller's thread");
  int found = 0;
  pthread_mutex_lock(&fk.mu);
  for (int i = 0; i < FAKE_MAX_PINNED; i++)
    if (fk.pinned[i].p == ptr) {
      fk.pinned[i].p = NULL;
      found = 1;
    }
  pthread_mutex_unlock(&fk.mu);
  if (!found) {
    fake_bad("host_free of something not allocated");
    return;
  }
  atomic_fetch_add(&fk_frees, 1);
  char *base;
  memcpy(&base, (char *)ptr - FAKE_PIN_SKEW, sizeof base);
  free(base);
}

static ac_result_t fake_stream_create(void **stream, int device) {
  if (on_main()) fake_bad("stream_create on the caller's thread");
  fake_stream *s = calloc(1, sizeof *s);
  if (!s) return AC_FAIL(AC_ERR_NOMEM, "fake: no stream");
  s->device = device;
  atomic_fetch_add(&fk_streams, 1);
  *stream = s;
  return AC_OK;
}

static void fake_stream_destroy(void *stream, int device) {
  fake_stream *s = stream;
  if (on_main()) fake_bad("stream_destroy on the caller's thread");
  if (s->device != device) fake_bad("stream destroyed with another device");
  if (s->nq) fake_bad("stream destroyed with copies pending");
  atomic_fetch_add(&fk_stream_frees, 1);
  free(s->q);
  free(s);
}

static int fake_queue(fake_stream *s, fake_copy op) {
  if (s->nq == s->cap) {
    size_t cap = s->cap ? 2 * s->cap : 8;
    fake_copy *nq = realloc(s->q, cap * sizeof *nq);
    if (!nq) return -1;
    s->q = nq;
    s->cap = cap;
  }
  s->q[s->nq++] = op;
  return 0;
}

static ac_result_t fake_stream_wait_event(void *stream, void *event, int device) {
  fake_stream *s = stream;
  fake_event *e = event;
  if (on_main()) fake_bad("wait_event on the caller's thread");
  if (s->device != device || e->device != device) fake_bad("wait for an event of another device");
  if (fk.fail_wait)
    return AC_FAIL(AC_ERR_CUDA, "cudaStreamWaitEvent (the tensors' ready event) on device %d failed: fake invalid "
                   "resource handle", device);
  if (s->nwaited < FAKE_MAX_WAITED) s->waited[s->nwaited++] = e;
  if (fake_queue(s, (fake_copy){NULL, NULL, 0, e}) < 0) return AC_FAIL(AC_ERR_NOMEM, "fake: queue");
  atomic_fetch_add(&e->waits, 1);
  return AC_OK;
}

static ac_result_t fake_copy_async(void *dst, const void *src, size_t n, int device, void *stream) {
  fake_stream *s = stream;
  if (on_main()) fake_bad("copy on the caller's thread");
  if (s->device != device) fake_bad("copy on a stream of another device");
  const unsigned char *q = src, *readable = NULL;
  for (int i = 0; i < fk.nranges && !readable; i++)
    if (q >= fk.ranges[i].p && q + n <= fk.ranges[i].p + fk.ranges[i].n && fk.ranges[i].device == device) {
      readable = fk.ranges[i].alias + (q - fk.ranges[i].p);
      fake_event *e = fk.pending[i];
      int waited = !e;
      for (int k = 0; k < s->nwaited && !waited; k++) waited = s->waited[k] == e;
      if (!waited) fake_bad("copy of a tensor before its stream waited for the tensor's ready event");
    }
  if (!readable) {
    fake_bad("copy from memory that is not on that fake device");
    return AC_FAIL(AC_ERR_CUDA, "fake: invalid device pointer");
  }
  int pinned = 0;
  pthread_mutex_lock(&fk.mu);
  for (int i = 0; i < FAKE_MAX_PINNED && !pinned; i++)
    pinned = fk.pinned[i].p && (char *)dst >= fk.pinned[i].p && (char *)dst + n <= fk.pinned[i].p + fk.pinned[i].n;
  pthread_mutex_unlock(&fk.mu);
  if (!pinned) fake_bad("copy into memory that is not a live pinned buffer");
  if (fk.fail_src && q < fk.fail_src + fk.fail_n && fk.fail_src < q + n)
    return AC_FAIL(AC_ERR_CUDA, "cudaMemcpyAsync (device %d to host, %zu bytes) failed: fake device fault", device, n);
  if (fake_queue(s, (fake_copy){dst, readable, n, NULL}) < 0) return AC_FAIL(AC_ERR_NOMEM, "fake: queue");
  atomic_fetch_add(&fk_copies, 1);
  return AC_OK;
}

static ac_result_t fake_stream_sync(void *stream, int device) {
  fake_stream *s = stream;
  if (on_main()) fake_bad("sync on the caller's thread");
  if (s->device != device) fake_bad("sync of a stream with another device");
  for (size_t i = 0; i < s->nq; i++) { /* the "DMA": decode into the pinned buffer */
    fake_event *e = s->q[i].wait;
    if (e) { /* the caller's kernels before the event are done: their bytes are in place */
      pthread_mutex_lock(&fk.mu);
      if (!e->done) memcpy((void *)(uintptr_t)e->r->alias, e->final, e->r->n);
      e->done = 1;
      pthread_mutex_unlock(&fk.mu);
      continue;
    }
    unsigned char *d = s->q[i].dst;
    const unsigned char *src = s->q[i].src;
    for (size_t k = 0; k < s->q[i].n; k++) d[k] = src[k] ^ FAKE_KEY;
    atomic_fetch_add(&fk_bytes, s->q[i].n);
  }
  s->nq = 0;
  atomic_fetch_add(&fk_syncs, 1);
  if (fk.fail_sync)
    return AC_FAIL(AC_ERR_CUDA, "cudaStreamSynchronize (device-to-host copies) on device %d failed: fake illegal "
                   "address", device);
  return AC_OK;
}

static const st_device_ops fake_ops = {
    .check_device = fake_check_device,
    .host_alloc = fake_host_alloc,
    .host_free = fake_host_free,
    .stream_create = fake_stream_create,
    .stream_destroy = fake_stream_destroy,
    .stream_wait_event = fake_stream_wait_event,
    .copy_async = fake_copy_async,
    .stream_sync = fake_stream_sync,
};

/* "Moves" tensor t to fake device `device`: an encoded copy in a fresh double mapping,
 * registered. Returns its handle for free_fake_device. */
static fake_range *to_fake_device(ac_st_tensor_t *t, int device) {
  size_t n = ac_st_dtype_size(t->dtype);
  for (int32_t d = 0; d < t->ndim; d++) n *= (size_t)t->shape[d];
  if (!CHECK(fk.nranges < FAKE_MAX_RANGES)) return NULL;
  size_t len = (n + 4095) / 4096 * 4096 + 4096;
  int fd = memfd_create("fake_device", MFD_CLOEXEC);
  if (!CHECK(fd >= 0 && ftruncate(fd, (off_t)len) == 0)) return NULL;
  unsigned char *alias = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  unsigned char *dev = mmap(NULL, len, PROT_NONE, MAP_SHARED, fd, 0);
  close(fd);
  if (!CHECK(alias != MAP_FAILED && dev != MAP_FAILED)) return NULL;
  for (size_t i = 0; i < n; i++) alias[i] = ((const unsigned char *)t->data)[i] ^ FAKE_KEY;
  fake_range *r = &fk.ranges[fk.nranges++];
  *r = (fake_range){dev, alias, len, device};
  t->data = n ? dev : NULL;
  t->memory = AC_ST_CUDA;
  t->device = device;
  return r;
}

static void free_fake_device(fake_range *r) {
  if (!r) return;
  munmap((void *)(uintptr_t)r->p, r->n);
  munmap((void *)(uintptr_t)r->alias, r->n);
  r->p = r->alias = NULL;
  r->n = 0;
}

/* The tensor on fake range r is still being written by the caller's stream: its device bytes
 * are stale (0xEE) until a copy stream passes a wait for the returned event. */
static fake_event *fake_pending_write(fake_range *r) {
  fake_event *e = calloc(1, sizeof *e);
  if (!CHECK(e && r)) return e;
  e->device = r->device;
  e->r = r;
  e->final = malloc(r->n);
  if (!CHECK(e->final)) return e;
  memcpy(e->final, r->alias, r->n);
  memset((void *)(uintptr_t)r->alias, 0xEE, r->n);
  fk.pending[r - fk.ranges] = e;
  return e;
}

static void free_fake_event(fake_event *e) {
  if (!e) return;
  free(e->final);
  free(e);
}

/* The ops' books balance after a save: every buffer and stream freed, nothing misused. */
static void check_fake_books(const char *label) {
  CHECK_MSG(atomic_load(&fk_allocs) == atomic_load(&fk_frees), "%s: %ld pinned allocs, %ld frees", label,
            atomic_load(&fk_allocs), atomic_load(&fk_frees));
  CHECK_MSG(atomic_load(&fk_streams) == atomic_load(&fk_stream_frees), "%s: %ld streams, %ld destroyed", label,
            atomic_load(&fk_streams), atomic_load(&fk_stream_frees));
  CHECK_MSG(atomic_load(&fk_bad) == 0, "%s: %ld misuses of the fake device", label, atomic_load(&fk_bad));
}

#endif /* AC_ST_FAKE_DEVICE_H */

/* comm_shm_window.c — shared windows (ac/comm_shm.h): a segment every rank of a group maps, one
 * region per rank, so that a buffer living there is reduced with no copy in or out (the reduction
 * itself is ac_shm_window_all_reduce in comm_shm.c, which runs between the group's barriers).
 *
 * Segment: a header page (magic, sizes, the count of ranks that have mapped it), then the regions.
 * Rank 0 creates it (O_EXCL, reserved with posix_fallocate: a full /dev/shm is an error here, not a
 * SIGBUS in the middle of a backward pass); the last rank to map it unlinks the name. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "comm_shm_window.h"

#define WINDOW_MAGIC 0x3177646d68735f61ULL /* "a_shmdw1" */

typedef struct {
  _Atomic uint64_t magic; /* written last by the creator (release) */
  uint64_t region_bytes;
  uint32_t nranks;
  _Atomic uint32_t attached;
} window_header_t;

_Static_assert(sizeof(window_header_t) <= 4096, "the header fits its page");

static void pause_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

ac_result_t ac_shm_window_create(ac_shm_window_t **out, ac_shm_t *c, size_t bytes) {
  if (!out) return AC_FAIL(AC_ERR_INVALID_ARG, "out is NULL");
  *out = NULL;
  if (!c) return AC_FAIL(AC_ERR_INVALID_ARG, "communicator is NULL");
  int n = ac_shm_size(c), rank = ac_shm_rank(c);
  if (bytes == 0 || bytes > ((size_t)1 << 40) / (size_t)n)
    return AC_FAIL(AC_ERR_INVALID_ARG, "window of %zu bytes per rank for %d ranks: must be in [1, 2^40 / ranks]",
                   bytes, n);
  char name[AC_SHM_NAME_MAX];
  int timeout_ms;
  unsigned serial;
  ac_shm_next_window_name(c, name, sizeof name, &timeout_ms, &serial);
  size_t region = (bytes + 4095) & ~(size_t)4095;
  size_t total = 4096 + (size_t)n * region;
  double deadline = ac_shm_now_s() + timeout_ms * 1e-3;
  int fd = -1;
  AC_CHECK(ac_shm_open_segment(name, rank, total, deadline, &fd));
  void *map = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int map_errno = errno;
  close(fd);
  if (map == MAP_FAILED) {
    if (rank == 0) shm_unlink(name);
    return AC_FAIL(AC_ERR_IO, "mmap of shm window '%s' (%zu bytes): %s", name, total, strerror(map_errno));
  }
  ac_shm_window_t *w = calloc(1, sizeof *w);
  if (!w) {
    munmap(map, total);
    if (rank == 0) shm_unlink(name);
    return AC_FAIL(AC_ERR_NOMEM, "ac_shm_window_t");
  }
  *w = (ac_shm_window_t){.map = map, .map_bytes = total, .region_bytes = region, .usable_bytes = bytes,
                         .nranks = n, .rank = rank, .serial = serial};
  /* a hint, as for the private gradient buffers (grad_layout.alloc_flat): honoured where
   * /sys/kernel/mm/transparent_hugepage/shmem_enabled allows it, ignored elsewhere */
  (void)madvise(map, total, MADV_HUGEPAGE);
  window_header_t *h = map;
  ac_result_t r = AC_OK;
  if (rank == 0) {
    h->region_bytes = region;
    h->nranks = (uint32_t)n;
    atomic_store_explicit(&h->magic, WINDOW_MAGIC, memory_order_release);
  } else {
    while (atomic_load_explicit(&h->magic, memory_order_acquire) != WINDOW_MAGIC) {
      if (ac_shm_now_s() > deadline) {
        r = AC_FAIL(AC_ERR_TIMEOUT, "rank %d: shm window '%s' has no valid header", rank, name);
        goto fail;
      }
      pause_ms(1);
    }
    if (h->region_bytes != region || h->nranks != (uint32_t)n) {
      r = AC_FAIL(AC_ERR_INVALID_ARG, "rank %d: shm window '%s' was made with %llu-byte regions for %u ranks; this "
                  "rank asked for %zu-byte regions for %d (every rank must create the same windows in the same order)",
                  rank, name, (unsigned long long)h->region_bytes, h->nranks, region, n);
      goto fail;
    }
  }
  if (atomic_fetch_add(&h->attached, 1) + 1 == (uint32_t)n) shm_unlink(name); /* everyone has it mapped */
  while (atomic_load(&h->attached) < (uint32_t)n) {
    if (ac_shm_now_s() > deadline) {
      if (rank == 0) shm_unlink(name);
      r = AC_FAIL(AC_ERR_TIMEOUT, "rank %d: shm window '%s': %u of %d ranks mapped it within %.1f s", rank, name,
                  atomic_load(&h->attached), n, timeout_ms * 1e-3);
      goto fail;
    }
    pause_ms(1);
  }
  *out = w;
  return AC_OK;
fail:
  ac_shm_window_destroy(w);
  return r;
}

void *ac_shm_window_base(const ac_shm_window_t *w) { return w ? ac_shm_window_region(w, w->rank) : NULL; }

size_t ac_shm_window_bytes(const ac_shm_window_t *w) { return w ? w->usable_bytes : 0; }

void ac_shm_window_destroy(ac_shm_window_t *w) {
  if (!w) return;
  munmap(w->map, w->map_bytes);
  free(w);
}

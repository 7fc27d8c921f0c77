/* st_read.c — the safetensors reader: opens the file, reads and parses its header (st_header.c),
 * and reads requested tensors straight into caller memory with parallel preadv (st_io.c). */
#define _GNU_SOURCE /* O_CLOEXEC, strdup; must precede every system header */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "st_internal.h"

struct ac_st_reader {
  int fd;
  char *path;
  ac_st_header_t *h;
};

void ac_st_reader_destroy(ac_st_reader_t *r) {
  if (!r) return;
  if (r->fd >= 0) close(r->fd);
  ac_st_header_destroy(r->h);
  free(r->path);
  free(r);
}

static int read_all(int fd, void *dst, size_t n, uint64_t off) {
  char *p = dst;
  while (n) {
    ssize_t k = pread(fd, p, n, (off_t)off);
    if (k < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (k == 0) return -1;
    p += k;
    n -= (size_t)k;
    off += (uint64_t)k;
  }
  return 0;
}

ac_result_t ac_st_reader_create(ac_st_reader_t **out, const char *path) {
  if (!out) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_st_reader_create: out is NULL");
  *out = NULL;
  if (ST_BIG_ENDIAN) return AC_FAIL(AC_ERR_UNSUPPORTED, "safetensors I/O needs a little-endian host");
  if (!path || !*path) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_st_reader_create: empty path");
  ac_st_reader_t *r = calloc(1, sizeof *r);
  if (!r) return AC_FAIL(AC_ERR_NOMEM, "%s: out of memory", path);
  r->fd = -1;
  ac_result_t res = AC_OK;
  unsigned char *buf = NULL;
  r->path = strdup(path);
  if (!r->path) {
    res = AC_FAIL(AC_ERR_NOMEM, "%s: out of memory", path);
    goto fail;
  }
  r->fd = open(path, O_RDONLY | O_CLOEXEC);
  if (r->fd < 0) {
    res = AC_FAIL(AC_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    goto fail;
  }
  struct stat st;
  if (fstat(r->fd, &st) != 0) {
    res = AC_FAIL(AC_ERR_IO, "%s: fstat failed: %s", path, strerror(errno));
    goto fail;
  }
  if (!S_ISREG(st.st_mode)) {
    res = AC_FAIL(AC_ERR_IO, "%s: not a regular file", path);
    goto fail;
  }
  uint64_t size = (uint64_t)st.st_size;
  unsigned char len8[8];
  if (size < 8) {
    res = AC_FAIL(AC_ERR_FORMAT, "%s: not a safetensors file: %llu bytes, too short for the 8-byte header length",
                  path, (unsigned long long)size);
    goto fail;
  }
  int e = read_all(r->fd, len8, 8, 0);
  if (e) {
    res = AC_FAIL(AC_ERR_IO, "%s: reading the header length failed: %s", path, e > 0 ? strerror(e) : "file shrank");
    goto fail;
  }
  uint64_t n = st_rd_le64(len8);
  /* check before allocating: the length comes from the file */
  if (n > AC_ST_MAX_HEADER || n > size - 8) {
    res = ac_st_header_parse(&r->h, len8, 8, size, path);
    if (res == AC_OK) res = AC_FAIL(AC_ERR_INTERNAL, "%s: header length check disagrees with the parser", path);
    goto fail;
  }
  buf = malloc((size_t)n + 8);
  if (!buf) {
    res = AC_FAIL(AC_ERR_NOMEM, "%s: out of memory for a %llu-byte header", path, (unsigned long long)n);
    goto fail;
  }
  memcpy(buf, len8, 8);
  e = read_all(r->fd, buf + 8, (size_t)n, 8);
  if (e) {
    res = AC_FAIL(AC_ERR_IO, "%s: reading the header failed: %s", path, e > 0 ? strerror(e) : "file shrank");
    goto fail;
  }
  AC_CHECK_GOTO(ac_st_header_parse(&r->h, buf, (size_t)n + 8, size, path), res, fail);
  free(buf);
  *out = r;
  return AC_OK;
fail:
  free(buf);
  ac_st_reader_destroy(r);
  return res;
}

const ac_st_header_t *ac_st_reader_header(const ac_st_reader_t *r) { return r ? r->h : NULL; }

typedef struct {
  uint64_t off;
  char *dst;
  size_t n;
  size_t tensor;
} rd_span;

static int cmp_span(const void *a, const void *b) {
  const rd_span *x = a, *y = b;
  return x->off < y->off ? -1 : x->off > y->off ? 1 : 0;
}

ac_result_t ac_st_reader_read(ac_st_reader_t *r, const ac_st_read_t *reqs, size_t nreqs, int threads) {
  char nb[128];
  if (!r) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_st_reader_read: reader is NULL");
  if (nreqs && !reqs) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: requests are NULL", r->path);
  const ac_st_header_t *h = r->h;
  ac_result_t res = AC_OK;
  rd_span *sp = malloc((nreqs ? nreqs : 1) * sizeof *sp);
  unsigned char *seen = calloc(h->n ? h->n : 1, 1);
  st_io_plan plan = {0};
  if (!sp || !seen) {
    res = AC_FAIL(AC_ERR_NOMEM, "%s: out of memory", r->path);
    goto done;
  }
  size_t ns = 0;
  for (size_t i = 0; i < nreqs; i++) {
    const ac_st_read_t *q = &reqs[i];
    if (q->index >= h->n) {
      res = AC_FAIL(AC_ERR_INVALID_ARG, "%s: request %zu names tensor index %zu of %zu", r->path, i, q->index, h->n);
      goto done;
    }
    const st_entry *e = &h->t[q->index];
    if (seen[q->index]) {
      res = AC_FAIL(AC_ERR_INVALID_ARG, "%s: tensor '%s' is requested twice", r->path, st_show(e->name, nb, sizeof nb));
      goto done;
    }
    seen[q->index] = 1;
    if (q->nbytes != e->end - e->begin) {
      res = AC_FAIL(AC_ERR_INVALID_ARG, "%s: tensor '%s' is %llu bytes but its destination is %zu bytes", r->path,
                    st_show(e->name, nb, sizeof nb), (unsigned long long)(e->end - e->begin), q->nbytes);
      goto done;
    }
    if (q->nbytes && !q->dst) {
      res = AC_FAIL(AC_ERR_INVALID_ARG, "%s: tensor '%s' has a NULL destination", r->path,
                    st_show(e->name, nb, sizeof nb));
      goto done;
    }
    if (q->nbytes) sp[ns++] = (rd_span){h->data_start + e->begin, q->dst, q->nbytes, q->index};
  }
  if (ns) qsort(sp, ns, sizeof *sp, cmp_span);
  for (size_t i = 0; i < ns; i++)
    if (st_io_plan_add(&plan, sp[i].off, sp[i].dst, sp[i].n, sp[i].tensor) < 0) {
      res = AC_FAIL(AC_ERR_NOMEM, "%s: out of memory planning the reads", r->path);
      goto done;
    }
  st_io_run run = {.fd = r->fd, .write = 0, .plan = &plan};
  if (plan.njobs && st_io_execute(&run, threads)) {
    const char *nm = st_show(h->t[plan.iov_tensor[run.bad_iov]].name, nb, sizeof nb);
    if (run.short_io)
      res = AC_FAIL_HINT(AC_ERR_IO, "was it overwritten while being read?",
                         "%s: tensor '%s': the file ended at offset %llu (it shrank after it was opened)", r->path, nm,
                         (unsigned long long)run.bad_off);
    else
      res = AC_FAIL(AC_ERR_IO, "%s: reading tensor '%s' at offset %llu failed: %s", r->path, nm,
                    (unsigned long long)run.bad_off, strerror(run.err ? run.err : EIO));
  }
done:
  st_io_plan_free(&plan);
  free(sp);
  free(seen);
  return res;
}

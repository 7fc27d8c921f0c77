/* st_write.c — the safetensors writer, ac_st_save: checks every argument before any file exists,
 * lays the tensors out in the safetensors package's order, writes the temp file through the page
 * cache (st_io.c) or in aligned chunks (st_direct.c: O_DIRECT, and every save of GPU tensors),
 * then publishes it durably (ac/durable.h: fsync, atomic rename, fsync of the directory). */
#define _GNU_SOURCE /* O_DIRECT, fallocate; must precede every system header */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ac/durable.h"
#include "st_direct.h"
#include "st_internal.h"

/* An error message of a callee (thread-local, "file.c:123: text"), without its location, copied
 * into buf: it becomes part of a message of ours, which names its own location. */
static const char *inner_msg(const char *msg, char *buf, size_t cap) {
  const char *p = msg;
  const char *colon = strchr(p, ':');
  if (colon && colon > p && colon[1] >= '0' && colon[1] <= '9') {
    const char *q = colon + 1;
    while (*q >= '0' && *q <= '9') q++;
    if (q[0] == ':' && q[1] == ' ') p = q + 2;
  }
  snprintf(buf, cap, "%s", p);
  return buf;
}

/* ---- direct I/O choice ------------------------------------------------------------------------ */

/* Files smaller than this keep the buffered path under ACCELERATE_C_DIRECT_IO=auto. Below a few
 * MiB the page-cache copy costs a millisecond or two and the save is dominated by the fsync and
 * the rename, so O_DIRECT (staging buffers, block-granular writes) has nothing to win; small
 * files (scheduler, RNG and data-loader state) also stay in the page cache for a prompt reload.
 * At 4 MiB and up the erratic page-cache fill of this VM starts to show, and a 1 GB checkpoint
 * is 250 chunks, far beyond it. */
#define ST_DIRECT_MIN_BYTES ((uint64_t)4 << 20)
#define DIRECT_IO_ENV "ACCELERATE_C_DIRECT_IO"

typedef enum { DIO_AUTO, DIO_NEVER, DIO_ALWAYS } dio_mode;

static _Thread_local const char *last_write_mode = "none";

const char *ac_st_last_write_mode(void) { return last_write_mode; }

/* ACCELERATE_C_DIRECT_IO, read per save: unset, "" or "auto", "0", "1". */
static ac_result_t direct_io_setting(const char *path, dio_mode *out) {
  const char *v = getenv(DIRECT_IO_ENV);
  char vb[128];
  if (!v || !*v || strcmp(v, "auto") == 0) *out = DIO_AUTO;
  else if (strcmp(v, "0") == 0) *out = DIO_NEVER;
  else if (strcmp(v, "1") == 0) *out = DIO_ALWAYS;
  else
    return AC_FAIL_HINT(AC_ERR_INVALID_ARG, "use auto (the default), 0 (never O_DIRECT) or 1 (always)",
                        "%s: invalid value '%s' of the environment variable " DIRECT_IO_ENV, path,
                        st_show(v, vb, sizeof vb));
  return AC_OK;
}

#ifdef O_DIRECT
static ac_result_t direct_io_refused(const char *path, const char *tmp, const char *what, int e) {
  return AC_FAIL_HINT(AC_ERR_UNSUPPORTED, "set " DIRECT_IO_ENV "=0 (or auto) to write it through the page cache",
                      "%s: " DIRECT_IO_ENV "=1 asks for O_DIRECT, but the file system refuses it (%s %s: %s)",
                      path, what, tmp ? tmp : "the temporary file", strerror(e));
}
#endif

/* ---- writer ------------------------------------------------------------------------------------ */

/* Layout order: dtype code descending, then name. The codes follow the safetensors package's
 * dtype order, whose element sizes never increase, so this both aligns every tensor to its
 * element size and reproduces the package's layout byte for byte. */
static int cmp_layout(const void *a, const void *b) {
  const st_wr_item *x = a, *y = b;
  if (x->t->dtype != y->t->dtype) return x->t->dtype > y->t->dtype ? -1 : 1;
  return strcmp(x->t->name, y->t->name);
}

static int cmp_str_ptr(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* First duplicate among n strings (sorted copy), or NULL. */
static ac_result_t find_dup(const char **names, size_t n, const char **dup) {
  *dup = NULL;
  if (n < 2) return AC_OK;
  const char **s = malloc(n * sizeof *s);
  if (!s) return AC_FAIL(AC_ERR_NOMEM, "out of memory checking names");
  memcpy(s, names, n * sizeof *s);
  qsort(s, n, sizeof *s, cmp_str_ptr);
  for (size_t i = 1; i < n; i++)
    if (strcmp(s[i - 1], s[i]) == 0) {
      *dup = s[i];
      break;
    }
  free(s);
  return AC_OK;
}

static ac_result_t validate_save_args(const char *path, const ac_st_tensor_t *t, size_t n,
                                      const ac_st_kv_t *meta, size_t nmeta, st_wr_item *items) {
  char nb[128];
  int32_t checked_device = -1;
  if (n && !t) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: tensors is NULL but ntensors is %zu", path, n);
  if (nmeta && !meta) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: metadata is NULL but nmeta is %zu", path, nmeta);
  for (size_t i = 0; i < n; i++) {
    const ac_st_tensor_t *x = &t[i];
    if (!x->name) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: tensor %zu has no name", path, i);
    const char *nm = st_show(x->name, nb, sizeof nb);
    if (!st_utf8_valid(x->name))
      return AC_FAIL(AC_ERR_INVALID_ARG, "%s: tensor name '%s' is not valid UTF-8", path, nm);
    if (strcmp(x->name, "__metadata__") == 0)
      return AC_FAIL_HINT(AC_ERR_INVALID_ARG, "pass metadata through the metadata argument",
                          "%s: '__metadata__' is reserved and cannot name a tensor", path);
    if ((unsigned)x->dtype >= AC_ST_NUM_DTYPES)
      return AC_FAIL(AC_ERR_INVALID_ARG, "%s: tensor '%s' has an invalid dtype code %d", path, nm, (int)x->dtype);
    if (x->ndim < 0) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: tensor '%s' has ndim %d", path, nm, (int)x->ndim);
    if (x->ndim > 0 && !x->shape) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: tensor '%s' has a NULL shape", path, nm);
    for (int32_t d = 0; d < x->ndim; d++)
      if (x->shape[d] < 0)
        return AC_FAIL(AC_ERR_INVALID_ARG, "%s: tensor '%s' has a negative extent %lld in dim %d", path, nm,
                       (long long)x->shape[d], (int)d);
    int ovf;
    uint64_t nbytes = st_nbytes_of(x->shape, x->ndim, ac_st_dtype_size(x->dtype), &ovf);
    if (ovf || nbytes > (uint64_t)SSIZE_MAX)
      return AC_FAIL(AC_ERR_INVALID_ARG, "%s: tensor '%s' is too large to address", path, nm);
    if (nbytes && !x->data) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: tensor '%s' has NULL data", path, nm);
    if (x->memory != AC_ST_HOST && x->memory != AC_ST_CUDA)
      return AC_FAIL(AC_ERR_INVALID_ARG, "%s: tensor '%s' has an invalid memory kind %d", path, nm, (int)x->memory);
    if (x->memory == AC_ST_CUDA && x->device < 0)
      return AC_FAIL(AC_ERR_INVALID_ARG, "%s: tensor '%s' has CUDA device %d", path, nm, (int)x->device);
    if (x->memory == AC_ST_CUDA && x->device != checked_device) {
      /* before any file exists: a CPU-only build, or a device that is not there */
      ac_result_t rc = st_device_ops_get()->check_device(x->device);
      if (rc != AC_OK) {
        char inner[512];
        return AC_FAIL(rc, "%s: tensor '%s' is on CUDA device %d: %s", path, nm, (int)x->device,
                       inner_msg(ac_last_error(), inner, sizeof inner));
      }
      checked_device = x->device;
    }
    items[i].t = x;
    items[i].idx = i;
    items[i].nbytes = nbytes;
  }
  size_t most = n > nmeta ? n : nmeta;
  const char **names = malloc((most ? most : 1) * sizeof *names);
  if (!names) return AC_FAIL(AC_ERR_NOMEM, "%s: out of memory", path);
  for (size_t i = 0; i < n; i++) names[i] = t[i].name;
  const char *dup;
  ac_result_t r = find_dup(names, n, &dup);
  if (r == AC_OK && dup) r = AC_FAIL(AC_ERR_INVALID_ARG, "%s: tensor name '%s' is given twice", path, st_show(dup, nb, sizeof nb));
  for (size_t i = 0; r == AC_OK && i < nmeta; i++) {
    if (!meta[i].key || !meta[i].value) {
      r = AC_FAIL(AC_ERR_INVALID_ARG, "%s: metadata entry %zu has a NULL key or value", path, i);
      break;
    }
    if (!st_utf8_valid(meta[i].key) || !st_utf8_valid(meta[i].value))
      r = AC_FAIL(AC_ERR_INVALID_ARG, "%s: metadata entry '%s' is not valid UTF-8", path, st_show(meta[i].key, nb, sizeof nb));
    names[i] = meta[i].key;
  }
  if (r == AC_OK) r = find_dup(names, nmeta, &dup);
  if (r == AC_OK && dup) r = AC_FAIL(AC_ERR_INVALID_ARG, "%s: metadata key '%s' is given twice", path, st_show(dup, nb, sizeof nb));
  free(names);
  return r;
}

/* A fresh temporary file next to `path` (ac_durable_open: hidden, unique per process and call),
 * with `extra` flags (0 or O_DIRECT). If O_DIRECT was asked for and the file system refuses it
 * (EINVAL), returns AC_OK with *fd_out = -1 and *tmp_out set to a name that does not exist. */
static ac_result_t open_temp(const char *path, int extra, char **tmp_out, int *fd_out) {
  ac_result_t r = ac_durable_open(path, extra, tmp_out, fd_out);
  if (r == AC_OK && *fd_out >= 0 && extra && st_direct_fault() == ST_DIRECT_FAULT_OPEN) { /* test hook */
    close(*fd_out);
    *fd_out = -1;
    unlink(*tmp_out);
  }
  return r;
}

/* The buffered path: header and data through the page cache, with pwritev jobs of <= 8 MiB.
 * Opens the temp file itself (*tmp, *fd: the caller closes and removes them on failure). */
static ac_result_t save_buffered(const char *path, const st_dbuf *hdr, const st_wr_item *items, size_t n,
                                 const ac_st_tensor_t *tensors, int threads, char **tmp, int *fd) {
  st_io_plan plan = {0};
  ac_result_t r = AC_OK;
  uint64_t off = hdr->len;
  for (size_t i = 0; i < n; i++) {
    if (st_io_plan_add(&plan, off, (char *)(uintptr_t)items[i].t->data, (size_t)items[i].nbytes, items[i].idx) < 0) {
      r = AC_FAIL(AC_ERR_NOMEM, "%s: out of memory planning the writes", path);
      goto done;
    }
    off += items[i].nbytes;
  }
  AC_CHECK_GOTO(open_temp(path, 0, tmp, fd), r, done);
  last_write_mode = "buffered";
  int e = ac_write_all(*fd, hdr->p, hdr->len, 0);
  if (e) {
    r = AC_FAIL(AC_ERR_IO, "%s: writing the header to %s failed: %s", path, *tmp, strerror(e));
    goto done;
  }
  st_io_run run = {.fd = *fd, .write = 1, .plan = &plan};
  /* One writer by default: Linux serialises buffered writes to one inode (ext4, xfs and tmpfs
   * hold the inode lock across the copy), so a second thread only waits on, or spins for, that
   * lock; on this 2-core VM two writers made a 400 MB save up to 2.7x slower. Callers that
   * know better (or write several files, as save_model does) pass threads explicitly. */
  if (st_io_execute(&run, threads > 0 ? threads : 1)) {
    char nb[128];
    r = AC_FAIL(AC_ERR_IO, "%s: writing tensor '%s' at file offset %llu to %s failed: %s", path,
                st_show(tensors[plan.iov_tensor[run.bad_iov]].name, nb, sizeof nb),
                (unsigned long long)run.bad_off, *tmp, strerror(run.err ? run.err : EIO));
  }
done:
  st_io_plan_free(&plan);
  return r;
}

/* The chunked path (see st_direct.c). Opens the temp file, with O_DIRECT when `use_direct`, else
 * buffered (saves holding GPU tensors use these chunks, staged through pinned buffers, either
 * way); leaves it written and truncated to `total` bytes. If the file system refuses O_DIRECT
 * (EINVAL at open, or at the first pwrite before anything was written) and `forced` is 0,
 * removes the temp file and sets *refused, so the caller redoes the file buffered; with
 * `forced` that is an error. */
static ac_result_t save_chunked(const char *path, const st_dbuf *hdr, const st_wr_item *items, size_t n,
                                const ac_st_tensor_t *tensors, void *const *ready, uint64_t total, int threads,
                                int use_direct, int forced, char **tmp, int *fd, int *refused) {
  *refused = 0;
#ifdef O_DIRECT
  const int oflag = use_direct ? O_DIRECT : 0;
#else
  const int oflag = 0;
  if (use_direct) {
    if (forced)
      return AC_FAIL_HINT(AC_ERR_UNSUPPORTED, "set " DIRECT_IO_ENV "=0 (or auto)",
                          "%s: " DIRECT_IO_ENV "=1 asks for O_DIRECT, which this platform does not have", path);
    *refused = 1;
    return AC_OK;
  }
#endif
  ac_result_t r = AC_OK;
  st_seg *segs = malloc((n + 1) * sizeof *segs);
  if (!segs) return AC_FAIL(AC_ERR_NOMEM, "%s: out of memory", path);
  size_t ns = 0;
  segs[ns++] = (st_seg){.off = 0, .p = hdr->p, .len = hdr->len, .tensor = SIZE_MAX, .device = -1};
  uint64_t off = hdr->len;
  for (size_t i = 0; i < n; i++) {
    if (!items[i].nbytes) continue; /* zero-size tensors own no bytes */
    const ac_st_tensor_t *t = items[i].t;
    int cuda = t->memory == AC_ST_CUDA;
    segs[ns++] = (st_seg){.off = off, .p = (const char *)t->data, .len = items[i].nbytes, .tensor = items[i].idx,
                          .device = cuda ? (int)t->device : -1,
                          .event = cuda && ready ? ready[items[i].idx] : NULL};
    off += items[i].nbytes;
  }
  AC_CHECK_GOTO(open_temp(path, oflag, tmp, fd), r, done);
  if (*fd < 0) { /* only with O_DIRECT */
#ifdef O_DIRECT
    if (forced) {
      r = direct_io_refused(path, *tmp, "opening", EINVAL);
    } else {
      free(*tmp);
      *tmp = NULL;
      *refused = 1;
    }
#endif
    goto done;
  }
  last_write_mode = use_direct ? "direct" : "buffered";
  /* Reserve the blocks and set the size first: the chunk writes then never extend the file, so
   * ext4 skips its per-write size update (orphan-list journalling) for extending direct writes.
   * Measured on this VM (1 GB, 2 workers, medians of 7): 534 -> 482 ms and 514 -> 440 ms; no
   * change when two files are written at once. Only a full disk or quota is worth reporting
   * here; anything else (EOPNOTSUPP, ENOSYS, EFBIG, ...) leaves the writes to succeed or fail
   * with a message naming the tensor. */
  uint64_t padded = (total + ST_DIRECT_ALIGN - 1) / ST_DIRECT_ALIGN * ST_DIRECT_ALIGN;
  if (fallocate(*fd, 0, 0, (off_t)padded) != 0 && (errno == ENOSPC || errno == EDQUOT)) {
    r = AC_FAIL(AC_ERR_IO, "%s: reserving %llu bytes for %s failed: %s", path, (unsigned long long)padded, *tmp,
                strerror(errno));
    goto done;
  }
  st_direct_fail f;
  int rc = st_direct_write(*fd, segs, ns, total, threads, use_direct, &f);
  char nb[128], inner[sizeof f.msg];
  if (rc < 0) {
    if (f.msg[0])
      r = AC_FAIL(f.code, "%s: no pinned staging buffer for %s could be allocated: %s", path, *tmp,
                  inner_msg(f.msg, inner, sizeof inner));
    else
      r = AC_FAIL(AC_ERR_NOMEM, "%s: out of memory for the %s staging buffer of %s", path,
                  use_direct ? "O_DIRECT" : "chunked", *tmp);
  } else if (rc > 0 && f.kind == ST_FAIL_THREAD) {
    r = AC_FAIL(AC_ERR_NOMEM, "%s: cannot start a thread to stage GPU tensors into %s: %s", path, *tmp,
                strerror(f.err));
  } else if (rc > 0 && f.kind == ST_FAIL_COPY) {
    char more[64] = "";
    if (f.more) snprintf(more, sizeof more, " (and %zu more of its chunk)", f.more);
    r = AC_FAIL(f.code, "%s: copying tensor '%s'%s from CUDA device %d into the staging buffer of %s failed: %s", path,
                st_show(tensors[f.tensor].name, nb, sizeof nb), more, f.device, *tmp,
                inner_msg(f.msg, inner, sizeof inner));
  } else if (rc > 0 && use_direct && f.err == EINVAL && f.nothing_written && !f.unaligned) {
#ifdef O_DIRECT
    if (forced) {
      r = direct_io_refused(path, *tmp, "writing", EINVAL);
    } else {
      ac_durable_discard(tmp, fd);
      *refused = 1;
      last_write_mode = "none";
    }
#endif
  } else if (rc > 0) {
    size_t s = st_direct_seg_at(segs, ns, f.off);
    char what[200];
    if (segs[s].tensor == SIZE_MAX) snprintf(what, sizeof what, "the header");
    else snprintf(what, sizeof what, "tensor '%s'", st_show(tensors[segs[s].tensor].name, nb, sizeof nb));
    if (f.unaligned)
      r = AC_FAIL_HINT(AC_ERR_IO, "set " DIRECT_IO_ENV "=0 to write through the page cache",
                       "%s: a short O_DIRECT write of %s to %s left the rest at file offset %llu, which is not "
                       "a multiple of %zu bytes", path, what, *tmp, (unsigned long long)f.off, ST_DIRECT_ALIGN);
    else
      r = AC_FAIL(AC_ERR_IO, "%s: writing %s at file offset %llu to %s failed%s: %s", path, what,
                  (unsigned long long)f.off, *tmp, use_direct ? " (O_DIRECT)" : "", strerror(f.err));
  } else if (ftruncate(*fd, (off_t)total) != 0) { /* drop the last chunk's zero padding */
    r = AC_FAIL(AC_ERR_IO, "%s: truncating %s to %llu bytes failed: %s", path, *tmp, (unsigned long long)total,
                strerror(errno));
  }
done:
  free(segs);
  return r;
}

ac_result_t ac_st_save(const char *path, const ac_st_tensor_t *tensors, size_t ntensors,
                       const ac_st_kv_t *metadata, size_t nmeta, int threads) {
  return ac_st_save_after(path, tensors, ntensors, metadata, nmeta, threads, NULL);
}

ac_result_t ac_st_save_after(const char *path, const ac_st_tensor_t *tensors, size_t ntensors,
                             const ac_st_kv_t *metadata, size_t nmeta, int threads, void *const *ready) {
  last_write_mode = "none";
  if (ST_BIG_ENDIAN) return AC_FAIL(AC_ERR_UNSUPPORTED, "safetensors I/O needs a little-endian host");
  if (!path || !*path) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_st_save: empty path");
  ac_result_t r = AC_OK;
  st_wr_item *items = malloc((ntensors ? ntensors : 1) * sizeof *items);
  st_dbuf hdr = {0};
  char *tmp = NULL;
  int fd = -1;
  if (!items) return AC_FAIL(AC_ERR_NOMEM, "%s: out of memory", path);
  AC_CHECK_GOTO(validate_save_args(path, tensors, ntensors, metadata, nmeta, items), r, done);
  dio_mode dio = DIO_AUTO;
  AC_CHECK_GOTO(direct_io_setting(path, &dio), r, done);
  if (ntensors) qsort(items, ntensors, sizeof *items, cmp_layout);
  uint64_t data_size = 0;
  AC_CHECK_GOTO(st_json_write_header(path, items, ntensors, metadata, nmeta, &hdr, &data_size), r, done);
  uint64_t total = hdr.len + data_size;
  int direct = dio == DIO_ALWAYS || (dio == DIO_AUTO && total >= ST_DIRECT_MIN_BYTES);
  /* GPU tensors are staged through the chunk pipeline's pinned buffers whatever the mode */
  int staged = 0;
  for (size_t i = 0; i < ntensors && !staged; i++) staged = items[i].nbytes && items[i].t->memory == AC_ST_CUDA;
  if (direct) {
    int refused;
    AC_CHECK_GOTO(save_chunked(path, &hdr, items, ntensors, tensors, ready, total, threads, 1, dio == DIO_ALWAYS,
                               &tmp, &fd, &refused),
                  r, done);
    if (refused) direct = 0; /* this file system has no O_DIRECT: the same bytes, buffered */
  }
  if (!direct && staged) {
    int refused;
    AC_CHECK_GOTO(save_chunked(path, &hdr, items, ntensors, tensors, ready, total, threads, 0, 0, &tmp, &fd,
                               &refused),
                  r, done);
  } else if (!direct) {
    AC_CHECK_GOTO(save_buffered(path, &hdr, items, ntensors, tensors, threads, &tmp, &fd), r, done);
  }
  r = ac_durable_publish(path, &tmp, &fd);

done:
  ac_durable_discard(&tmp, &fd);
  free(hdr.p);
  free(items);
  return r;
}

/* safetensors.c — safetensors writer (parallel pwritev, fsync, temp file + atomic rename) and
 * strictly validating header parser / reader (parallel preadv into caller memory). */
#define _GNU_SOURCE /* pwritev/preadv, O_CLOEXEC, O_DIRECTORY; must precede every system header */
#include "ac/safetensors.h"
#include "ac/durable.h"
#include "st_direct.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

/* The format stores little-endian data and we copy bytes verbatim: a big-endian host would need
 * a byte swap of every element, which nobody has asked for yet. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define ST_BIG_ENDIAN 1
#else
#define ST_BIG_ENDIAN 0
#endif

/* One I/O job moves at most this many bytes: small enough that a few big tensors still spread
 * over all threads, large enough that the syscall cost is noise. */
#define ST_JOB_BYTES ((size_t)8 << 20)
/* iovecs per job: many small tensors (biases, norms) are coalesced into one pwritev. */
#define ST_JOB_IOV 64
#define ST_MAX_THREADS 8

/* ---- dtypes -------------------------------------------------------------------------------- */

static const struct {
  const char *name;
  size_t size;
} DT[AC_ST_NUM_DTYPES] = {
    [AC_ST_BOOL] = {"BOOL", 1},   [AC_ST_U8] = {"U8", 1},     [AC_ST_I8] = {"I8", 1},
    [AC_ST_F8_E5M2] = {"F8_E5M2", 1}, [AC_ST_F8_E4M3] = {"F8_E4M3", 1},
    [AC_ST_F8_E8M0] = {"F8_E8M0", 1}, [AC_ST_I16] = {"I16", 2}, [AC_ST_U16] = {"U16", 2},
    [AC_ST_F16] = {"F16", 2},     [AC_ST_BF16] = {"BF16", 2}, [AC_ST_I32] = {"I32", 4},
    [AC_ST_U32] = {"U32", 4},     [AC_ST_F32] = {"F32", 4},   [AC_ST_C64] = {"C64", 8},
    [AC_ST_F64] = {"F64", 8},     [AC_ST_I64] = {"I64", 8},   [AC_ST_U64] = {"U64", 8},
};

const char *ac_st_dtype_name(ac_st_dtype_t dt) {
  return (unsigned)dt < AC_ST_NUM_DTYPES ? DT[dt].name : "?";
}

size_t ac_st_dtype_size(ac_st_dtype_t dt) { return (unsigned)dt < AC_ST_NUM_DTYPES ? DT[dt].size : 0; }

static int dtype_lookup(const char *s, ac_st_dtype_t *out) {
  for (int i = 0; i < AC_ST_NUM_DTYPES; i++)
    if (strcmp(s, DT[i].name) == 0) {
      *out = (ac_st_dtype_t)i;
      return 1;
    }
  return 0;
}

ac_result_t ac_st_dtype_from_name(const char *name, ac_st_dtype_t *out) {
  if (!name || !out) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_st_dtype_from_name: NULL argument");
  if (!dtype_lookup(name, out)) return AC_FAIL(AC_ERR_FORMAT, "unknown safetensors dtype '%.32s'", name);
  return AC_OK;
}

/* ---- small helpers ------------------------------------------------------------------------- */

/* Names come from files and users: cut them short and hide control bytes so an error message
 * stays one readable line. */
#define SHOW_MAX 96
static const char *show(const char *s, char *buf, size_t cap) {
  if (!s) return "(null)";
  size_t j = 0, i = 0;
  for (; s[i] && j + 4 < cap && i < SHOW_MAX; i++) buf[j++] = ((unsigned char)s[i] < 0x20 || s[i] == 0x7f) ? '?' : s[i];
  if (s[i]) {
    buf[j++] = '.';
    buf[j++] = '.';
    buf[j++] = '.';
  }
  buf[j] = '\0';
  return buf;
}

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

/* Length of the valid UTF-8 sequence starting at p (at most n bytes available), 0 if invalid
 * (overlong forms, surrogates and code points above U+10FFFF are invalid, as in RFC 3629). */
static size_t utf8_seq(const unsigned char *p, size_t n) {
  unsigned c = p[0];
  if (c < 0x80) return 1;
  size_t len;
  unsigned lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) len = 2;
  else if (c == 0xE0) len = 3, lo = 0xA0;
  else if (c == 0xED) len = 3, hi = 0x9F;
  else if (c >= 0xE1 && c <= 0xEF) len = 3;
  else if (c == 0xF0) len = 4, lo = 0x90;
  else if (c >= 0xF1 && c <= 0xF3) len = 4;
  else if (c == 0xF4) len = 4, hi = 0x8F;
  else return 0;
  if (n < len) return 0;
  if (p[1] < lo || p[1] > hi) return 0;
  for (size_t k = 2; k < len; k++)
    if (p[k] < 0x80 || p[k] > 0xBF) return 0;
  return len;
}

static int utf8_valid(const char *s) {
  const unsigned char *p = (const unsigned char *)s;
  size_t n = strlen(s);
  while (n) {
    size_t k = utf8_seq(p, n);
    if (!k) return 0;
    p += k;
    n -= k;
  }
  return 1;
}

static uint64_t rd_le64(const unsigned char *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}

static void wr_le64(unsigned char *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

/* prod(shape) * elem_size, or 0 with *overflow set when it does not fit in 64 bits. */
static uint64_t nbytes_of(const int64_t *shape, int32_t ndim, size_t elem, int *overflow) {
  uint64_t n = elem;
  *overflow = 0;
  for (int32_t d = 0; d < ndim; d++) {
    uint64_t e = (uint64_t)shape[d];
    if (e == 0) n = 0;
    else if (n > UINT64_MAX / e) *overflow = 1;
    else n *= e;
  }
  if (*overflow) {
    /* a zero extent anywhere makes the size 0 even if a partial product overflowed */
    for (int32_t d = 0; d < ndim; d++)
      if (shape[d] == 0) {
        *overflow = 0;
        return 0;
      }
    return 0;
  }
  return n;
}

/* ---- growable byte buffer for the writer's JSON ---------------------------------------------- */

typedef struct {
  char *p;
  size_t len, cap;
  int oom;
} dbuf;

static void db_reserve(dbuf *b, size_t more) {
  if (b->oom) return;
  if (b->len + more + 1 <= b->cap) return;
  size_t cap = b->cap ? b->cap : 4096;
  while (cap < b->len + more + 1) {
    if (cap > SIZE_MAX / 2) {
      b->oom = 1;
      return;
    }
    cap *= 2;
  }
  char *q = realloc(b->p, cap);
  if (!q) {
    b->oom = 1;
    return;
  }
  b->p = q;
  b->cap = cap;
}

static void db_put(dbuf *b, const char *s, size_t n) {
  db_reserve(b, n);
  if (b->oom) return;
  memcpy(b->p + b->len, s, n);
  b->len += n;
  b->p[b->len] = '\0';
}

static void db_puts(dbuf *b, const char *s) { db_put(b, s, strlen(s)); }

static void db_printf(dbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void db_printf(dbuf *b, const char *fmt, ...) {
  char tmp[64];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
  va_end(ap);
  if (n > 0) db_put(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

/* A JSON string literal; the input is valid UTF-8 (checked by the caller), so only quotes,
 * backslashes and control characters need escaping. The escapes are the ones serde_json (the
 * safetensors package) writes, so both writers produce identical bytes for the same tensors. */
static void db_json_str(dbuf *b, const char *s) {
  db_put(b, "\"", 1);
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    unsigned c = *p;
    if (c == '"') db_put(b, "\\\"", 2);
    else if (c == '\\') db_put(b, "\\\\", 2);
    else if (c == '\n') db_put(b, "\\n", 2);
    else if (c == '\r') db_put(b, "\\r", 2);
    else if (c == '\t') db_put(b, "\\t", 2);
    else if (c == '\b') db_put(b, "\\b", 2);
    else if (c == '\f') db_put(b, "\\f", 2);
    else if (c < 0x20) db_printf(b, "\\u%04x", c);
    else db_put(b, (const char *)p, 1);
  }
  db_put(b, "\"", 1);
}

/* ---- parallel positioned I/O ------------------------------------------------------------------ */

/* One contiguous file range moved with one pwritev/preadv (iov[first .. first+niov)). */
typedef struct {
  uint64_t off;
  size_t first, niov;
  size_t total;
  size_t tensor; /* caller's index of the first tensor in the job, for error messages */
} io_job;

typedef struct {
  struct iovec *iov;
  size_t *iov_tensor; /* tensor index of each iovec */
  size_t niov, cap_iov;
  io_job *jobs;
  size_t njobs, cap_jobs;
} io_plan;

static void plan_free(io_plan *p) {
  free(p->iov);
  free(p->iov_tensor);
  free(p->jobs);
  memset(p, 0, sizeof *p);
}

/* Appends bytes [ptr, ptr+len) that belong at file offset `off` (offsets must be added in
 * increasing order). Contiguous pieces share a job until it is full. Returns 0 or -1 (no memory). */
static int plan_add(io_plan *p, uint64_t off, char *ptr, size_t len, size_t tensor) {
  while (len > 0) {
    io_job *j = p->njobs ? &p->jobs[p->njobs - 1] : NULL;
    int fits = j && j->off + j->total == off && j->total < ST_JOB_BYTES && j->niov < ST_JOB_IOV;
    if (!fits) {
      if (p->njobs == p->cap_jobs) {
        size_t cap = p->cap_jobs ? 2 * p->cap_jobs : 64;
        io_job *q = realloc(p->jobs, cap * sizeof *q);
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

typedef struct {
  int fd;
  int write;
  const io_plan *plan;
  atomic_size_t next;
  atomic_int failed;
  pthread_mutex_t mu;
  int err;          /* errno of the first failure; 0 with `short_io` for a short read */
  int short_io;
  size_t bad_iov;   /* the iovec being moved when it failed */
  uint64_t bad_off; /* file offset where it failed */
} io_run;

/* Moves one job completely, looping over partial transfers and EINTR. Returns 0, or an errno
 * (-1 for end of file on a read) and where it stopped. */
static int io_job_run(int fd, int wr, const io_plan *p, const io_job *j, size_t *at_iov, uint64_t *at_off) {
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
  io_run *r = arg;
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
static int io_execute(io_run *r, int threads) {
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
                        show(v, vb, sizeof vb));
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

typedef struct {
  const ac_st_tensor_t *t;
  size_t idx;
  uint64_t nbytes;
} wr_item;

/* Layout order: dtype code descending, then name. The codes follow the safetensors package's
 * dtype order, whose element sizes never increase, so this both aligns every tensor to its
 * element size and reproduces the package's layout byte for byte. */
static int cmp_layout(const void *a, const void *b) {
  const wr_item *x = a, *y = b;
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
                                      const ac_st_kv_t *meta, size_t nmeta, wr_item *items) {
  char nb[128];
  int32_t checked_device = -1;
  if (n && !t) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: tensors is NULL but ntensors is %zu", path, n);
  if (nmeta && !meta) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: metadata is NULL but nmeta is %zu", path, nmeta);
  for (size_t i = 0; i < n; i++) {
    const ac_st_tensor_t *x = &t[i];
    if (!x->name) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: tensor %zu has no name", path, i);
    const char *nm = show(x->name, nb, sizeof nb);
    if (!utf8_valid(x->name)) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: tensor name '%s' is not valid UTF-8", path, nm);
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
    uint64_t nbytes = nbytes_of(x->shape, x->ndim, DT[x->dtype].size, &ovf);
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
  if (r == AC_OK && dup) r = AC_FAIL(AC_ERR_INVALID_ARG, "%s: tensor name '%s' is given twice", path, show(dup, nb, sizeof nb));
  for (size_t i = 0; r == AC_OK && i < nmeta; i++) {
    if (!meta[i].key || !meta[i].value) {
      r = AC_FAIL(AC_ERR_INVALID_ARG, "%s: metadata entry %zu has a NULL key or value", path, i);
      break;
    }
    if (!utf8_valid(meta[i].key) || !utf8_valid(meta[i].value))
      r = AC_FAIL(AC_ERR_INVALID_ARG, "%s: metadata entry '%s' is not valid UTF-8", path, show(meta[i].key, nb, sizeof nb));
    names[i] = meta[i].key;
  }
  if (r == AC_OK) r = find_dup(names, nmeta, &dup);
  if (r == AC_OK && dup) r = AC_FAIL(AC_ERR_INVALID_ARG, "%s: metadata key '%s' is given twice", path, show(dup, nb, sizeof nb));
  free(names);
  return r;
}

/* Builds the 8-byte length plus the space-padded JSON header; offsets follow the layout order. */
static ac_result_t build_header(const char *path, const wr_item *items, size_t n, const ac_st_kv_t *meta,
                                size_t nmeta, dbuf *out, uint64_t *data_size) {
  dbuf b = {0};
  db_put(&b, "\0\0\0\0\0\0\0\0{", 9);
  int first = 1;
  if (nmeta) {
    db_puts(&b, "\"__metadata__\":{");
    for (size_t i = 0; i < nmeta; i++) {
      if (i) db_put(&b, ",", 1);
      db_json_str(&b, meta[i].key);
      db_put(&b, ":", 1);
      db_json_str(&b, meta[i].value);
    }
    db_put(&b, "}", 1);
    first = 0;
  }
  uint64_t off = 0;
  for (size_t i = 0; i < n; i++) {
    const ac_st_tensor_t *x = items[i].t;
    if (!first) db_put(&b, ",", 1);
    first = 0;
    db_json_str(&b, x->name);
    db_printf(&b, ":{\"dtype\":\"%s\",\"shape\":[", DT[x->dtype].name);
    for (int32_t d = 0; d < x->ndim; d++) db_printf(&b, d ? ",%lld" : "%lld", (long long)x->shape[d]);
    db_printf(&b, "],\"data_offsets\":[%llu,", (unsigned long long)off);
    off += items[i].nbytes;
    db_printf(&b, "%llu]}", (unsigned long long)off);
  }
  db_put(&b, "}", 1);
  /* Pad so the data region starts 8-aligned: with the layout order every tensor is then aligned
   * to its element size, which lets readers map the file and use the data in place. */
  while (!b.oom && (b.len - 8) % 8) db_put(&b, " ", 1);
  if (b.oom) {
    free(b.p);
    return AC_FAIL(AC_ERR_NOMEM, "%s: out of memory building the header", path);
  }
  wr_le64((unsigned char *)b.p, (uint64_t)(b.len - 8));
  *out = b;
  *data_size = off;
  return AC_OK;
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
static ac_result_t save_buffered(const char *path, const dbuf *hdr, const wr_item *items, size_t n,
                                 const ac_st_tensor_t *tensors, int threads, char **tmp, int *fd) {
  io_plan plan = {0};
  ac_result_t r = AC_OK;
  uint64_t off = hdr->len;
  for (size_t i = 0; i < n; i++) {
    if (plan_add(&plan, off, (char *)(uintptr_t)items[i].t->data, (size_t)items[i].nbytes, items[i].idx) < 0) {
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
  io_run run = {.fd = *fd, .write = 1, .plan = &plan};
  /* One writer by default: Linux serialises buffered writes to one inode (ext4, xfs and tmpfs
   * hold the inode lock across the copy), so a second thread only waits on, or spins for, that
   * lock; on this 2-core VM two writers made a 400 MB save up to 2.7x slower. Callers that
   * know better (or write several files, as save_model does) pass threads explicitly. */
  if (io_execute(&run, threads > 0 ? threads : 1)) {
    char nb[128];
    r = AC_FAIL(AC_ERR_IO, "%s: writing tensor '%s' at file offset %llu to %s failed: %s", path,
                show(tensors[plan.iov_tensor[run.bad_iov]].name, nb, sizeof nb),
                (unsigned long long)run.bad_off, *tmp, strerror(run.err ? run.err : EIO));
  }
done:
  plan_free(&plan);
  return r;
}

/* The chunked path (see st_direct.c). Opens the temp file, with O_DIRECT when `use_direct`, else
 * buffered (saves holding GPU tensors use these chunks, staged through pinned buffers, either
 * way); leaves it written and truncated to `total` bytes. If the file system refuses O_DIRECT
 * (EINVAL at open, or at the first pwrite before anything was written) and `forced` is 0,
 * removes the temp file and sets *refused, so the caller redoes the file buffered; with
 * `forced` that is an error. */
static ac_result_t save_chunked(const char *path, const dbuf *hdr, const wr_item *items, size_t n,
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
                show(tensors[f.tensor].name, nb, sizeof nb), more, f.device, *tmp,
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
    else snprintf(what, sizeof what, "tensor '%s'", show(tensors[segs[s].tensor].name, nb, sizeof nb));
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
  wr_item *items = malloc((ntensors ? ntensors : 1) * sizeof *items);
  dbuf hdr = {0};
  char *tmp = NULL;
  int fd = -1;
  if (!items) return AC_FAIL(AC_ERR_NOMEM, "%s: out of memory", path);
  AC_CHECK_GOTO(validate_save_args(path, tensors, ntensors, metadata, nmeta, items), r, done);
  dio_mode dio = DIO_AUTO;
  AC_CHECK_GOTO(direct_io_setting(path, &dio), r, done);
  if (ntensors) qsort(items, ntensors, sizeof *items, cmp_layout);
  uint64_t data_size = 0;
  AC_CHECK_GOTO(build_header(path, items, ntensors, metadata, nmeta, &hdr, &data_size), r, done);
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

/* ---- header parser ------------------------------------------------------------------------------ */

typedef struct {
  char *name;
  ac_st_dtype_t dtype;
  int32_t ndim;
  int64_t *shape;
  uint64_t begin, end;
} st_entry;

struct ac_st_header {
  st_entry *t;
  size_t n, cap;
  size_t *by_name; /* indices of t sorted by name, for ac_st_header_find */
  char **mkey, **mval;
  size_t nmeta, capmeta;
  int has_meta;
  uint64_t data_start, data_size;
};

/* Parser state over the JSON text (not NUL-terminated). */
typedef struct {
  const unsigned char *s, *p, *end;
  const char *label;
} js;

#define JFAIL(j, ...) js_fail((j), __LINE__, __VA_ARGS__)
static ac_result_t js_fail(js *j, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static ac_result_t js_fail(js *j, int line, const char *fmt, ...) {
  char msg[600];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  /* the offset is into the whole file (8-byte length first), which is what a hex dump shows */
  return ac_set_error(AC_ERR_FORMAT, __FILE__, line, NULL, "%s: invalid safetensors header at byte %zu: %s",
                      j->label, (size_t)(j->p - j->s) + 8, msg);
}

static void js_ws(js *j) {
  while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r')) j->p++;
}

/* What the next token looks like, for "expected X, found Y" messages. */
static const char *js_what(const js *j) {
  if (j->p >= j->end) return "the end of the header";
  switch (*j->p) {
    case '"': return "a string";
    case '{': return "an object";
    case '[': return "an array";
    case 't': case 'f': return "a boolean";
    case 'n': return "null";
    case '-': return "a negative number";
    default: return (*j->p >= '0' && *j->p <= '9') ? "a number" : "an unexpected character";
  }
}

static int js_eat(js *j, char c) {
  js_ws(j);
  if (j->p < j->end && *j->p == (unsigned char)c) {
    j->p++;
    return 1;
  }
  return 0;
}

static int hexval(unsigned c) {
  if (c >= '0' && c <= '9') return (int)(c - '0');
  if (c >= 'a' && c <= 'f') return (int)(c - 'a' + 10);
  if (c >= 'A' && c <= 'F') return (int)(c - 'A' + 10);
  return -1;
}

static int read_u4(const unsigned char *p, const unsigned char *end, unsigned *out) {
  if (end - p < 4) return 0;
  unsigned v = 0;
  for (int i = 0; i < 4; i++) {
    int h = hexval(p[i]);
    if (h < 0) return 0;
    v = v * 16 + (unsigned)h;
  }
  *out = v;
  return 1;
}

/* Parses a string literal into a new NUL-terminated UTF-8 string. `ctx` says what it is. */
static ac_result_t js_string(js *j, char **out, const char *ctx) {
  *out = NULL;
  js_ws(j);
  if (j->p >= j->end || *j->p != '"') return JFAIL(j, "expected a string for %s, found %s", ctx, js_what(j));
  const unsigned char *q = j->p + 1;
  while (q < j->end && *q != '"') {
    if (*q == '\\' && j->end - q < 2) break;
    q += (*q == '\\') ? 2 : 1;
  }
  if (q >= j->end || *q != '"') return JFAIL(j, "unterminated string (%s)", ctx);
  /* escapes never expand, so the raw length bounds the decoded one */
  char *buf = malloc((size_t)(q - j->p));
  if (!buf) return AC_FAIL(AC_ERR_NOMEM, "%s: out of memory parsing the header", j->label);
  size_t n = 0;
  j->p++;
  while (j->p < q) {
    unsigned c = *j->p;
    if (c < 0x20) {
      free(buf);
      return JFAIL(j, "control character 0x%02x inside a string (%s)", c, ctx);
    }
    if (c >= 0x80) {
      size_t k = utf8_seq(j->p, (size_t)(q - j->p));
      if (!k) {
        free(buf);
        return JFAIL(j, "invalid UTF-8 in a string (%s)", ctx);
      }
      memcpy(buf + n, j->p, k);
      n += k;
      j->p += k;
      continue;
    }
    if (c != '\\') {
      buf[n++] = (char)c;
      j->p++;
      continue;
    }
    unsigned e = j->p[1], cp;
    const char *simple = strchr("\"\\/bfnrt", (int)e);
    if (e && simple) {
      static const char map[] = "\"\\/\b\f\n\r\t";
      buf[n++] = map[simple - "\"\\/bfnrt"];
      j->p += 2;
      continue;
    }
    if (e != 'u' || !read_u4(j->p + 2, q, &cp)) {
      free(buf);
      return JFAIL(j, "invalid escape sequence in a string (%s)", ctx);
    }
    j->p += 6;
    if (cp >= 0xDC00 && cp <= 0xDFFF) {
      free(buf);
      return JFAIL(j, "unpaired UTF-16 surrogate \\u%04x in a string (%s)", cp, ctx);
    }
    if (cp >= 0xD800 && cp <= 0xDBFF) {
      unsigned lo;
      if (q - j->p < 6 || j->p[0] != '\\' || j->p[1] != 'u' || !read_u4(j->p + 2, q, &lo) || lo < 0xDC00 ||
          lo > 0xDFFF) {
        free(buf);
        return JFAIL(j, "unpaired UTF-16 surrogate \\u%04x in a string (%s)", cp, ctx);
      }
      j->p += 6;
      cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
    }
    if (cp == 0) {
      free(buf);
      return JFAIL(j, "\\u0000 inside a string (%s) is not supported", ctx);
    }
    if (cp < 0x80) buf[n++] = (char)cp;
    else if (cp < 0x800) {
      buf[n++] = (char)(0xC0 | (cp >> 6));
      buf[n++] = (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      buf[n++] = (char)(0xE0 | (cp >> 12));
      buf[n++] = (char)(0x80 | ((cp >> 6) & 0x3F));
      buf[n++] = (char)(0x80 | (cp & 0x3F));
    } else {
      buf[n++] = (char)(0xF0 | (cp >> 18));
      buf[n++] = (char)(0x80 | ((cp >> 12) & 0x3F));
      buf[n++] = (char)(0x80 | ((cp >> 6) & 0x3F));
      buf[n++] = (char)(0x80 | (cp & 0x3F));
    }
  }
  j->p = q + 1;
  buf[n] = '\0';
  *out = buf;
  return AC_OK;
}

/* A non-negative integer no larger than `max` (JSON grammar: no leading zeros, no sign). */
static ac_result_t js_uint(js *j, uint64_t max, uint64_t *out, const char *ctx, const char *tname) {
  char nb[128];
  js_ws(j);
  if (j->p < j->end && *j->p == '-')
    return JFAIL(j, "tensor '%s': %s must not be negative", show(tname, nb, sizeof nb), ctx);
  if (j->p >= j->end || *j->p < '0' || *j->p > '9')
    return JFAIL(j, "tensor '%s': expected an integer in %s, found %s", show(tname, nb, sizeof nb), ctx, js_what(j));
  const unsigned char *start = j->p;
  uint64_t v = 0;
  int big = 0;
  while (j->p < j->end && *j->p >= '0' && *j->p <= '9') {
    unsigned d = *j->p - '0';
    if (v > (UINT64_MAX - d) / 10) big = 1;
    else v = v * 10 + d;
    j->p++;
  }
  if (*start == '0' && j->p - start > 1)
    return JFAIL(j, "tensor '%s': number with a leading zero in %s", show(tname, nb, sizeof nb), ctx);
  if (j->p < j->end && (*j->p == '.' || *j->p == 'e' || *j->p == 'E'))
    return JFAIL(j, "tensor '%s': %s must be integers, found a fraction or exponent", show(tname, nb, sizeof nb), ctx);
  if (big || v > max)
    return JFAIL(j, "tensor '%s': value in %s is too large", show(tname, nb, sizeof nb), ctx);
  *out = v;
  return AC_OK;
}

static ac_result_t js_sep(js *j, char close, const char *ctx, int *more) {
  if (js_eat(j, ',')) {
    *more = 1;
    return AC_OK;
  }
  if (js_eat(j, close)) {
    *more = 0;
    return AC_OK;
  }
  return JFAIL(j, "expected ',' or '%c' in %s, found %s", close, ctx, js_what(j));
}

static ac_result_t parse_metadata(js *j, ac_st_header_t *h) {
  char nb[128];
  if (!js_eat(j, '{')) return JFAIL(j, "__metadata__ must be an object of strings, found %s", js_what(j));
  h->has_meta = 1;
  if (js_eat(j, '}')) return AC_OK;
  for (;;) {
    char *k = NULL, *v = NULL;
    AC_CHECK(js_string(j, &k, "a __metadata__ key"));
    if (!js_eat(j, ':')) {
      ac_result_t r = JFAIL(j, "expected ':' after __metadata__ key '%s'", show(k, nb, sizeof nb));
      free(k);
      return r;
    }
    js_ws(j);
    if (j->p >= j->end || *j->p != '"') {
      ac_result_t r = JFAIL(j, "__metadata__ value of '%s' must be a string, found %s", show(k, nb, sizeof nb), js_what(j));
      free(k);
      return r;
    }
    ac_result_t r = js_string(j, &v, "a __metadata__ value");
    if (r != AC_OK) {
      free(k);
      return r;
    }
    if (h->nmeta == h->capmeta) {
      size_t cap = h->capmeta ? 2 * h->capmeta : 8;
      char **a = realloc(h->mkey, cap * sizeof *a);
      if (a) h->mkey = a;
      char **b = a ? realloc(h->mval, cap * sizeof *b) : NULL;
      if (b) h->mval = b;
      if (!a || !b) {
        free(k);
        free(v);
        return AC_FAIL(AC_ERR_NOMEM, "%s: out of memory parsing the header", j->label);
      }
      h->capmeta = cap;
    }
    h->mkey[h->nmeta] = k;
    h->mval[h->nmeta] = v;
    h->nmeta++;
    int more = 0;
    AC_CHECK(js_sep(j, '}', "__metadata__", &more));
    if (!more) return AC_OK;
  }
}

/* Parses one tensor entry {"dtype":..., "shape":[...], "data_offsets":[b, e]} into *e. */
static ac_result_t parse_tensor(js *j, st_entry *e, uint64_t data_size) {
  char nb[128];
  const char *nm = show(e->name, nb, sizeof nb);
  if (!js_eat(j, '{')) return JFAIL(j, "tensor '%s': expected an object, found %s", nm, js_what(j));
  int have_dtype = 0, have_shape = 0, have_off = 0;
  size_t cap = 0;
  if (js_eat(j, '}')) return JFAIL(j, "tensor '%s': empty entry (needs dtype, shape, data_offsets)", nm);
  for (;;) {
    char *key = NULL;
    AC_CHECK(js_string(j, &key, "a tensor field name"));
    if (!js_eat(j, ':')) {
      free(key);
      return JFAIL(j, "tensor '%s': expected ':' after a field name", nm);
    }
    if (strcmp(key, "dtype") == 0) {
      free(key);
      if (have_dtype) return JFAIL(j, "tensor '%s': field 'dtype' appears twice", nm);
      char *dt = NULL;
      AC_CHECK(js_string(j, &dt, "dtype"));
      int ok = dtype_lookup(dt, &e->dtype);
      if (!ok) {
        char db[128];
        int sub = strcmp(dt, "F4") == 0 || strncmp(dt, "F6_", 3) == 0;
        ac_result_t r = JFAIL(j, "tensor '%s': %s dtype '%s'", nm, sub ? "unsupported sub-byte" : "unknown",
                              show(dt, db, sizeof db));
        free(dt);
        return r;
      }
      free(dt);
      have_dtype = 1;
    } else if (strcmp(key, "shape") == 0) {
      free(key);
      if (have_shape) return JFAIL(j, "tensor '%s': field 'shape' appears twice", nm);
      if (!js_eat(j, '[')) return JFAIL(j, "tensor '%s': shape must be an array, found %s", nm, js_what(j));
      have_shape = 1;
      if (!js_eat(j, ']')) {
        for (;;) {
          uint64_t v;
          AC_CHECK(js_uint(j, (uint64_t)INT64_MAX, &v, "shape", e->name));
          if ((size_t)e->ndim == cap) {
            if (cap >= (size_t)INT32_MAX / 2) return JFAIL(j, "tensor '%s': too many dimensions", nm);
            cap = cap ? 2 * cap : 4;
            int64_t *s = realloc(e->shape, cap * sizeof *s);
            if (!s) return AC_FAIL(AC_ERR_NOMEM, "%s: out of memory parsing the header", j->label);
            e->shape = s;
          }
          e->shape[e->ndim++] = (int64_t)v;
          int more = 0;
          AC_CHECK(js_sep(j, ']', "shape", &more));
          if (!more) break;
        }
      }
    } else if (strcmp(key, "data_offsets") == 0) {
      free(key);
      if (have_off) return JFAIL(j, "tensor '%s': field 'data_offsets' appears twice", nm);
      if (!js_eat(j, '[')) return JFAIL(j, "tensor '%s': data_offsets must be an array, found %s", nm, js_what(j));
      AC_CHECK(js_uint(j, UINT64_MAX, &e->begin, "data_offsets", e->name));
      if (!js_eat(j, ',')) return JFAIL(j, "tensor '%s': data_offsets must hold exactly two integers", nm);
      AC_CHECK(js_uint(j, UINT64_MAX, &e->end, "data_offsets", e->name));
      if (!js_eat(j, ']')) return JFAIL(j, "tensor '%s': data_offsets must hold exactly two integers", nm);
      have_off = 1;
    } else {
      char kb[128];
      ac_result_t r = JFAIL(j, "tensor '%s': unknown field '%s'", nm, show(key, kb, sizeof kb));
      free(key);
      return r;
    }
    int more = 0;
    AC_CHECK(js_sep(j, '}', "a tensor entry", &more));
    if (!more) break;
  }
  if (!have_dtype || !have_shape || !have_off)
    return JFAIL(j, "tensor '%s': missing field '%s'", nm, !have_dtype ? "dtype" : !have_shape ? "shape" : "data_offsets");
  if (e->begin > e->end)
    return JFAIL(j, "tensor '%s': data_offsets [%llu, %llu] end before they begin", nm, (unsigned long long)e->begin,
                 (unsigned long long)e->end);
  if (e->end > data_size)
    return JFAIL(j, "tensor '%s': data_offsets [%llu, %llu] run past the end of the data region (%llu bytes)", nm,
                 (unsigned long long)e->begin, (unsigned long long)e->end, (unsigned long long)data_size);
  int ovf;
  uint64_t need = nbytes_of(e->shape, e->ndim, DT[e->dtype].size, &ovf);
  if (ovf) return JFAIL(j, "tensor '%s': shape is too large (the byte size overflows)", nm);
  if (need != e->end - e->begin)
    return JFAIL(j, "tensor '%s': data_offsets span %llu bytes but dtype %s with %d dims needs %llu", nm,
                 (unsigned long long)(e->end - e->begin), DT[e->dtype].name, (int)e->ndim, (unsigned long long)need);
  return AC_OK;
}

static int cmp_offsets(const void *a, const void *b) {
  const st_entry *x = a, *y = b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  if (x->end != y->end) return x->end < y->end ? -1 : 1;
  return strcmp(x->name, y->name);
}

/* qsort has no context argument: sort (index, name) pairs instead. */
typedef struct {
  const char *name;
  size_t idx;
} name_idx;
static int cmp_name_idx(const void *a, const void *b) {
  return strcmp(((const name_idx *)a)->name, ((const name_idx *)b)->name);
}

static ac_result_t check_layout(ac_st_header_t *h, const char *label) {
  char na[128], nb[128];
  if (h->n) qsort(h->t, h->n, sizeof *h->t, cmp_offsets);
  /* names unique (metadata key excluded: it is not a tensor) */
  name_idx *ni = malloc((h->n ? h->n : 1) * sizeof *ni);
  if (!ni) return AC_FAIL(AC_ERR_NOMEM, "%s: out of memory", label);
  for (size_t i = 0; i < h->n; i++) ni[i] = (name_idx){h->t[i].name, i};
  if (h->n) qsort(ni, h->n, sizeof *ni, cmp_name_idx);
  for (size_t i = 1; i < h->n; i++)
    if (strcmp(ni[i - 1].name, ni[i].name) == 0) {
      ac_result_t r = AC_FAIL(AC_ERR_FORMAT, "%s: invalid safetensors header: tensor name '%s' appears twice", label,
                              show(ni[i].name, na, sizeof na));
      free(ni);
      return r;
    }
  h->by_name = malloc((h->n ? h->n : 1) * sizeof *h->by_name);
  if (!h->by_name) {
    free(ni);
    return AC_FAIL(AC_ERR_NOMEM, "%s: out of memory", label);
  }
  for (size_t i = 0; i < h->n; i++) h->by_name[i] = ni[i].idx;
  free(ni);
  for (size_t i = 1; i < h->nmeta; i++)
    for (size_t k = 0; k < i; k++) /* metadata is small (a handful of keys) */
      if (strcmp(h->mkey[i], h->mkey[k]) == 0)
        return AC_FAIL(AC_ERR_FORMAT, "%s: invalid safetensors header: __metadata__ key '%s' appears twice", label,
                       show(h->mkey[i], na, sizeof na));
  /* Sorted by offset, the ranges must tile [0, data_size) exactly: an overlap means two tensors
   * share bytes, a hole or trailing bytes mean data nobody owns (a sign of a corrupt or spliced
   * file). Zero-byte tensors occupy no range and may sit anywhere inside the region. */
  uint64_t pos = 0;
  size_t holder = SIZE_MAX; /* the tensor that ends at pos */
  for (size_t i = 0; i < h->n; i++) {
    const st_entry *e = &h->t[i];
    if (e->begin == e->end) continue;
    if (e->begin > pos) {
      if (holder == SIZE_MAX)
        return AC_FAIL(AC_ERR_FORMAT, "%s: invalid safetensors header: hole at bytes [0, %llu) of the data region "
                       "before tensor '%s'", label, (unsigned long long)e->begin, show(e->name, na, sizeof na));
      return AC_FAIL(AC_ERR_FORMAT, "%s: invalid safetensors header: hole at bytes [%llu, %llu) of the data region "
                     "between tensors '%s' and '%s'", label, (unsigned long long)pos, (unsigned long long)e->begin,
                     show(h->t[holder].name, na, sizeof na), show(e->name, nb, sizeof nb));
    }
    if (e->begin < pos)
      return AC_FAIL(AC_ERR_FORMAT, "%s: invalid safetensors header: tensors '%s' [%llu, %llu) and '%s' [%llu, %llu) "
                     "overlap", label, show(h->t[holder].name, na, sizeof na), (unsigned long long)h->t[holder].begin,
                     (unsigned long long)h->t[holder].end, show(e->name, nb, sizeof nb),
                     (unsigned long long)e->begin, (unsigned long long)e->end);
    pos = e->end;
    holder = i;
  }
  if (pos != h->data_size)
    return AC_FAIL(AC_ERR_FORMAT, "%s: invalid safetensors header: the data region is %llu bytes but the tensors "
                   "cover only [0, %llu) (trailing bytes or a truncated header)", label,
                   (unsigned long long)h->data_size, (unsigned long long)pos);
  return AC_OK;
}

void ac_st_header_destroy(ac_st_header_t *h) {
  if (!h) return;
  for (size_t i = 0; i < h->n; i++) {
    free(h->t[i].name);
    free(h->t[i].shape);
  }
  for (size_t i = 0; i < h->nmeta; i++) {
    free(h->mkey[i]);
    free(h->mval[i]);
  }
  free(h->t);
  free(h->by_name);
  free(h->mkey);
  free(h->mval);
  free(h);
}

static ac_result_t parse_json(ac_st_header_t *h, const unsigned char *s, size_t len, const char *label) {
  js j = {.s = s, .p = s, .end = s + len, .label = label};
  char nb[128];
  if (len == 0 || s[0] != '{') return JFAIL(&j, "the header must start with '{' (found %s)", js_what(&j));
  j.p++;
  if (!js_eat(&j, '}')) {
    for (;;) {
      char *key = NULL;
      AC_CHECK(js_string(&j, &key, "a tensor name"));
      if (!js_eat(&j, ':')) {
        ac_result_t r = JFAIL(&j, "expected ':' after key '%s'", show(key, nb, sizeof nb));
        free(key);
        return r;
      }
      if (strcmp(key, "__metadata__") == 0) {
        free(key);
        if (h->has_meta) return JFAIL(&j, "key '__metadata__' appears twice");
        AC_CHECK(parse_metadata(&j, h));
      } else {
        if (h->n == h->cap) {
          size_t cap = h->cap ? 2 * h->cap : 16;
          st_entry *t = realloc(h->t, cap * sizeof *t);
          if (!t) {
            free(key);
            return AC_FAIL(AC_ERR_NOMEM, "%s: out of memory parsing the header", label);
          }
          h->t = t;
          h->cap = cap;
        }
        st_entry *e = &h->t[h->n++];
        memset(e, 0, sizeof *e);
        e->name = key; /* owned by the header from here on, also on failure */
        AC_CHECK(parse_tensor(&j, e, h->data_size));
      }
      int more = 0;
      AC_CHECK(js_sep(&j, '}', "the header object", &more));
      if (!more) break;
    }
  }
  js_ws(&j);
  if (j.p != j.end) return JFAIL(&j, "unexpected content after the header object (%s)", js_what(&j));
  return check_layout(h, label);
}

ac_result_t ac_st_header_parse(ac_st_header_t **out, const void *buf, size_t len, uint64_t file_size,
                               const char *label) {
  if (!out) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_st_header_parse: out is NULL");
  *out = NULL;
  if (!label) label = "<memory>";
  if (!buf && len) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: buf is NULL", label);
  if (len > file_size) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: buffer (%zu bytes) is longer than the file", label, len);
  if (file_size < 8)
    return AC_FAIL(AC_ERR_FORMAT, "%s: not a safetensors file: %llu bytes, too short for the 8-byte header length",
                   label, (unsigned long long)file_size);
  if (len < 8) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: the buffer must hold at least the 8-byte header length", label);
  uint64_t n = rd_le64(buf);
  if (n > AC_ST_MAX_HEADER)
    return AC_FAIL_HINT(AC_ERR_FORMAT, "is this a safetensors file?",
                        "%s: header length %llu exceeds the %llu-byte limit", label, (unsigned long long)n,
                        (unsigned long long)AC_ST_MAX_HEADER);
  if (n > file_size - 8)
    return AC_FAIL(AC_ERR_FORMAT, "%s: header length %llu runs past the end of the file (%llu bytes)", label,
                   (unsigned long long)n, (unsigned long long)file_size);
  if (len < 8 + n)
    return AC_FAIL(AC_ERR_INVALID_ARG, "%s: the buffer (%zu bytes) does not hold the whole header (%llu bytes)", label,
                   len, (unsigned long long)(8 + n));
  ac_st_header_t *h = calloc(1, sizeof *h);
  if (!h) return AC_FAIL(AC_ERR_NOMEM, "%s: out of memory", label);
  h->data_start = 8 + n;
  h->data_size = file_size - 8 - n;
  ac_result_t r = parse_json(h, (const unsigned char *)buf + 8, (size_t)n, label);
  if (r != AC_OK) {
    ac_st_header_destroy(h);
    return r;
  }
  *out = h;
  return AC_OK;
}

size_t ac_st_header_count(const ac_st_header_t *h) { return h ? h->n : 0; }

ac_result_t ac_st_header_info(const ac_st_header_t *h, size_t i, ac_st_info_t *out) {
  if (!h || !out || i >= h->n)
    return AC_FAIL(AC_ERR_INVALID_ARG, "ac_st_header_info: index %zu out of range (%zu tensors)", i, h ? h->n : 0);
  const st_entry *e = &h->t[i];
  out->name = e->name;
  out->dtype = e->dtype;
  out->ndim = e->ndim;
  out->shape = e->shape;
  out->begin = e->begin;
  out->end = e->end;
  out->file_offset = h->data_start + e->begin;
  out->nbytes = e->end - e->begin;
  return AC_OK;
}

ac_result_t ac_st_header_find(const ac_st_header_t *h, const char *name, size_t *index) {
  char nb[128];
  if (!h || !name || !index) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_st_header_find: NULL argument");
  size_t lo = 0, hi = h->n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int c = strcmp(h->t[h->by_name[mid]].name, name);
    if (c == 0) {
      *index = h->by_name[mid];
      return AC_OK;
    }
    if (c < 0) lo = mid + 1;
    else hi = mid;
  }
  return AC_FAIL(AC_ERR_INVALID_ARG, "no tensor named '%s' in the file", show(name, nb, sizeof nb));
}

uint64_t ac_st_header_data_start(const ac_st_header_t *h) { return h ? h->data_start : 0; }
int ac_st_header_has_metadata(const ac_st_header_t *h) { return h ? h->has_meta : 0; }
size_t ac_st_header_metadata_count(const ac_st_header_t *h) { return h ? h->nmeta : 0; }

ac_result_t ac_st_header_metadata(const ac_st_header_t *h, size_t i, const char **key, const char **value) {
  if (!h || !key || !value || i >= h->nmeta)
    return AC_FAIL(AC_ERR_INVALID_ARG, "ac_st_header_metadata: index %zu out of range", i);
  *key = h->mkey[i];
  *value = h->mval[i];
  return AC_OK;
}

/* ---- reader ---------------------------------------------------------------------------------------- */

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
  uint64_t n = rd_le64(len8);
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
  io_plan plan = {0};
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
      res = AC_FAIL(AC_ERR_INVALID_ARG, "%s: tensor '%s' is requested twice", r->path, show(e->name, nb, sizeof nb));
      goto done;
    }
    seen[q->index] = 1;
    if (q->nbytes != e->end - e->begin) {
      res = AC_FAIL(AC_ERR_INVALID_ARG, "%s: tensor '%s' is %llu bytes but its destination is %zu bytes", r->path,
                    show(e->name, nb, sizeof nb), (unsigned long long)(e->end - e->begin), q->nbytes);
      goto done;
    }
    if (q->nbytes && !q->dst) {
      res = AC_FAIL(AC_ERR_INVALID_ARG, "%s: tensor '%s' has a NULL destination", r->path, show(e->name, nb, sizeof nb));
      goto done;
    }
    if (q->nbytes) sp[ns++] = (rd_span){h->data_start + e->begin, q->dst, q->nbytes, q->index};
  }
  if (ns) qsort(sp, ns, sizeof *sp, cmp_span);
  for (size_t i = 0; i < ns; i++)
    if (plan_add(&plan, sp[i].off, sp[i].dst, sp[i].n, sp[i].tensor) < 0) {
      res = AC_FAIL(AC_ERR_NOMEM, "%s: out of memory planning the reads", r->path);
      goto done;
    }
  io_run run = {.fd = r->fd, .write = 0, .plan = &plan};
  if (plan.njobs && io_execute(&run, threads)) {
    const char *nm = show(h->t[plan.iov_tensor[run.bad_iov]].name, nb, sizeof nb);
    if (run.short_io)
      res = AC_FAIL_HINT(AC_ERR_IO, "was it overwritten while being read?",
                         "%s: tensor '%s': the file ended at offset %llu (it shrank after it was opened)", r->path, nm,
                         (unsigned long long)run.bad_off);
    else
      res = AC_FAIL(AC_ERR_IO, "%s: reading tensor '%s' at offset %llu failed: %s", r->path, nm,
                    (unsigned long long)run.bad_off, strerror(run.err ? run.err : EIO));
  }
done:
  plan_free(&plan);
  free(sp);
  free(seen);
  return res;
}

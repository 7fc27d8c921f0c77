/* st_internal.h — internal to the core: what the safetensors files (csrc/core/st_*.c) share.
 * Not part of the public API (csrc/include/ac/safetensors.h). The engine is split by concern:
 *
 *   st_dtype.c       the dtype table (names, element sizes) and the byte size of a shape
 *   st_text.c        UTF-8 validity, and names as error messages show them
 *   st_json_write.c  the writer's header: JSON bytes identical to the safetensors package's
 *   st_io.c          the parallel positioned I/O engine (pwritev/preadv jobs on a few threads)
 *   st_write.c       ac_st_save: argument checks, layout order, buffered / chunked / O_DIRECT
 *                    paths, temp file and durable publication
 *   st_direct.c      the chunked executor behind the O_DIRECT and GPU paths (st_direct.h)
 *   st_json_parse.c  the strict header parser (JSON grammar, entries, layout check)
 *   st_header.c      the parsed header: the 8-byte length framing and the ac_st_header_* queries
 *   st_read.c        the reader: open, read the header, parallel preadv into caller memory */
#ifndef AC_ST_INTERNAL_H
#define AC_ST_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "ac/safetensors.h"

/* The format stores little-endian data and we copy bytes verbatim: a big-endian host would need
 * a byte swap of every element, which nobody has asked for yet. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define ST_BIG_ENDIAN 1
#else
#define ST_BIG_ENDIAN 0
#endif

/* The 8-byte little-endian header length at the start of every file. */
static inline uint64_t st_rd_le64(const unsigned char *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}

/* ---- st_dtype.c ---------------------------------------------------------------------------- */

/* 1 and *out set when `s` names a dtype ("F32"), else 0 (no error is set). */
int st_dtype_lookup(const char *s, ac_st_dtype_t *out);
/* prod(shape) * elem_size, or 0 with *overflow set when it does not fit in 64 bits. */
uint64_t st_nbytes_of(const int64_t *shape, int32_t ndim, size_t elem, int *overflow);

/* ---- st_text.c ----------------------------------------------------------------------------- */

/* `s` cut short, control bytes hidden, copied into buf (cap bytes); returns buf ("(null)" for
 * NULL). For names from files and users in error messages. */
const char *st_show(const char *s, char *buf, size_t cap);
/* Length of the valid UTF-8 sequence at p (n bytes available), 0 if invalid (RFC 3629). */
size_t st_utf8_seq(const unsigned char *p, size_t n);
/* Whether the NUL-terminated `s` is valid UTF-8. */
int st_utf8_valid(const char *s);

/* ---- st_json_write.c ----------------------------------------------------------------------- */

/* A growable byte buffer (always NUL-terminated once allocated); `oom` sticks after a failed
 * allocation, so a sequence of puts is checked once at the end. The caller frees `p`. */
typedef struct {
  char *p;
  size_t len, cap;
  int oom;
} st_dbuf;

/* One tensor of a save, with its byte size; ac_st_save sorts these into the layout order. */
typedef struct {
  const ac_st_tensor_t *t;
  size_t idx; /* the caller's index of the tensor */
  uint64_t nbytes;
} st_wr_item;

/* The header of a file holding items[0 .. n) in that order: *out gets the 8-byte length and the
 * padded JSON (the caller frees out->p), *data_size the size of the data region. */
ac_result_t st_json_write_header(const char *path, const st_wr_item *items, size_t n, const ac_st_kv_t *meta,
                                 size_t nmeta, st_dbuf *out, uint64_t *data_size);

/* ---- st_io.c ------------------------------------------------------------------------------- */

/* One contiguous file range moved with one pwritev/preadv (iov[first .. first+niov)). */
typedef struct {
  uint64_t off;
  size_t first, niov;
  size_t total;
  size_t tensor; /* caller's index of the first tensor in the job, for error messages */
} st_io_job;

typedef struct {
  struct iovec *iov;
  size_t *iov_tensor; /* tensor index of each iovec */
  size_t niov, cap_iov;
  st_io_job *jobs;
  size_t njobs, cap_jobs;
} st_io_plan;

/* One run of a plan: the caller sets fd, write and plan; st_io_execute sets the rest. */
typedef struct {
  int fd;
  int write;
  const st_io_plan *plan;
  atomic_size_t next;
  atomic_int failed;
  pthread_mutex_t mu;
  int err;          /* errno of the first failure; 0 with `short_io` for a short read */
  int short_io;
  size_t bad_iov;   /* the iovec being moved when it failed */
  uint64_t bad_off; /* file offset where it failed */
} st_io_run;

void st_io_plan_free(st_io_plan *p);
/* Appends bytes [ptr, ptr+len) that belong at file offset `off` (offsets in increasing order).
 * Returns 0 or -1 (no memory). */
int st_io_plan_add(st_io_plan *p, uint64_t off, char *ptr, size_t len, size_t tensor);
/* Runs r->plan on `threads` threads (0 = default). Returns 0 or 1 (r->err etc. set). */
int st_io_execute(st_io_run *r, int threads);

/* ---- st_json_parse.c, st_header.c ---------------------------------------------------------- */

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

/* Parses the JSON text s[0 .. len) (not NUL-terminated) into `h`, whose data_start and data_size
 * are already set, and checks the layout; on failure `h` holds what was parsed so far (the
 * caller destroys it). `label` names the file in messages. */
ac_result_t st_json_parse_header(ac_st_header_t *h, const unsigned char *s, size_t len, const char *label);

#endif /* AC_ST_INTERNAL_H */

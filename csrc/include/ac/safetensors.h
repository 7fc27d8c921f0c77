/* safetensors.h — the safetensors checkpoint format: a parallel, durable, atomic writer and a
 * strictly validating reader that reads straight into caller-owned memory.
 *
 * File layout (the published format): an 8-byte little-endian unsigned header length N, then N
 * bytes of UTF-8 JSON, then the data region. The JSON is one object mapping each tensor name to
 * {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]} (offsets relative to the data
 * region) plus an optional "__metadata__" object of string -> string. Tensor data is C-order,
 * little-endian. Files written here load with the `safetensors` package and vice versa.
 *
 * Nothing here is collective: every function is called by one process on its own files.
 * All functions are thread-safe for distinct handles; a reader handle may be read from several
 * threads at once (reads use pread and never move a file position). */
#ifndef AC_SAFETENSORS_H
#define AC_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "ac/ac.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest header accepted by the reader (the safetensors package uses the same cap): the header
 * is parsed in memory, so an absurd length in a corrupt file must not turn into a huge malloc. */
#define AC_ST_MAX_HEADER ((uint64_t)100000000)

/* Element types, named as in the file ("F32", ...). Only byte-sized types: the sub-byte ones of
 * newer safetensors versions (F4, F6_*) are rejected as unsupported. Values are stable and in the
 * safetensors package's dtype order (the writer's layout depends on it). */
typedef enum {
  AC_ST_BOOL = 0,
  AC_ST_U8 = 1,
  AC_ST_I8 = 2,
  AC_ST_F8_E5M2 = 3,
  AC_ST_F8_E4M3 = 4,
  AC_ST_F8_E8M0 = 5,
  AC_ST_I16 = 6,
  AC_ST_U16 = 7,
  AC_ST_F16 = 8,
  AC_ST_BF16 = 9,
  AC_ST_I32 = 10,
  AC_ST_U32 = 11,
  AC_ST_F32 = 12,
  AC_ST_C64 = 13,
  AC_ST_F64 = 14,
  AC_ST_I64 = 15,
  AC_ST_U64 = 16,
  AC_ST_NUM_DTYPES = 17
} ac_st_dtype_t;

/* "F32" for AC_ST_F32, ...; "?" for a value out of range. Never NULL. */
const char *ac_st_dtype_name(ac_st_dtype_t dt);
/* Bytes per element (1, 2, 4 or 8); 0 for a value out of range. */
size_t ac_st_dtype_size(ac_st_dtype_t dt);
/* Parses a dtype name ("BF16"); AC_ERR_FORMAT if unknown (the message names it). */
ac_result_t ac_st_dtype_from_name(const char *name, ac_st_dtype_t *out);

/* ---- writing ------------------------------------------------------------------------------- */

/* Where a tensor's bytes live. */
typedef enum {
  AC_ST_HOST = 0, /* host memory (the default: a zeroed ac_st_tensor_t is a host tensor) */
  AC_ST_CUDA = 1  /* memory of CUDA device `device` (needs a CUDA build; see ac_st_save) */
} ac_st_memory_t;

/* One tensor to write. `data` points to dtype_size * prod(shape) bytes of C-order, little-endian
 * memory that must stay valid and unmodified during ac_st_save (for a CUDA tensor: no work that
 * writes it may be pending on any stream, unless ac_st_save_after is given an event that follows
 * that work; the writer copies it on streams of its own). The
 * caller keeps ownership of every pointer. ndim == 0 is a scalar (one element). */
typedef struct {
  const char *name;      /* UTF-8, unique, not "__metadata__" */
  ac_st_dtype_t dtype;
  int32_t ndim;
  const int64_t *shape;  /* ndim entries, each >= 0 */
  const void *data;      /* may be NULL only when the tensor has no bytes */
  ac_st_memory_t memory; /* AC_ST_HOST (0) or AC_ST_CUDA */
  int32_t device;        /* the CUDA device ordinal when memory is AC_ST_CUDA; ignored otherwise */
} ac_st_tensor_t;

/* One "__metadata__" entry (UTF-8 strings, keys unique). */
typedef struct {
  const char *key;
  const char *value;
} ac_st_kv_t;

/* Writes a safetensors file at `path`, durably and atomically:
 *   1. every argument is validated before any file is created;
 *   2. the file is written under a hidden temporary name in the same directory
 *      (".<name>.<pid>.<n>.tmp", so the final rename never crosses file systems), in one of two
 *      ways chosen by the environment variable ACCELERATE_C_DIRECT_IO, read on every call:
 *      - direct ("auto", the default, for files of 4 MiB and more; "1" for every file): the
 *        file is opened with O_DIRECT and written as aligned 8 MiB chunks, each copied into a
 *        worker's aligned staging buffer and written with one pwrite, by up to `threads`
 *        workers (0 = 2); the page cache is bypassed, so the file is not cached afterwards.
 *        If the file system refuses O_DIRECT (EINVAL), "auto" rewrites the file buffered and
 *        "1" fails with AC_ERR_UNSUPPORTED;
 *      - buffered ("auto" below 4 MiB, or "0"): through the page cache, by up to `threads`
 *        threads with pwritev in jobs of <= 8 MiB (0 = one thread: the kernel serialises
 *        buffered writes to one file, so more threads only contend; several files written at
 *        once do scale);
 *      A save with any tensor in CUDA memory always takes the chunked path: O_DIRECT when the
 *      rules above choose direct, else the same chunks through the page cache ("buffered"); the
 *      staging buffers are then pinned host memory, each worker is a thread of its own that
 *      copies its chunk's GPU pieces with cudaMemcpyAsync on its own stream (and waits for
 *      them) while memcpy'ing the host pieces, so with two workers one's device->host copy
 *      overlaps the other's write. The calling thread's current CUDA device is never changed;
 *      the workers make each tensor's device current before copying it. A CPU-only build
 *      refuses CUDA tensors with AC_ERR_UNSUPPORTED ("built without CUDA") before creating
 *      anything; a failed copy is AC_ERR_CUDA naming the file, the tensor and the CUDA error;
 *   3. the file is fsynced, renamed onto `path` (replacing an existing file atomically) and the
 *      directory is fsynced, so after a crash `path` is either the old file or the new one.
 * On any failure the temporary file is removed and `path` is untouched.
 * Tensors are laid out by dtype (in the package's order, which has non-increasing element
 * sizes), then by name, so every tensor starts at a multiple of its element size (the header is
 * space-padded to a multiple of 8); the bytes equal what the safetensors package writes. When nmeta > 0
 * the header carries a "__metadata__" object with those entries (models use {"format": "pt"},
 * which transformers' loader checks). Errors: AC_ERR_INVALID_ARG (bad argument: the message names
 * the tensor or key), AC_ERR_IO (an OS call failed: the message names the call, file and errno),
 * AC_ERR_NOMEM, AC_ERR_UNSUPPORTED (big-endian host; ACCELERATE_C_DIRECT_IO=1 where O_DIRECT
 * is refused; a CUDA tensor in a CPU-only build), AC_ERR_CUDA (a CUDA call failed). An ACCELERATE_C_DIRECT_IO other than unset, "", "auto", "0" or "1" is
 * AC_ERR_INVALID_ARG naming the variable and its value. */
ac_result_t ac_st_save(const char *path, const ac_st_tensor_t *tensors, size_t ntensors,
                       const ac_st_kv_t *metadata, size_t nmeta, int threads);

/* ac_st_save, with the device->host copies of CUDA tensors ordered after work still queued on
 * other streams: `ready` is NULL (= ac_st_save) or has one entry per tensor, NULL or a
 * cudaEvent_t recorded on the stream that produced that tensor's data (the caller's current
 * stream, recorded on the caller's thread: the writer's own threads have other current
 * streams). Each writer stream waits for the event (cudaStreamWaitEvent: the host does not
 * block) before its first copy of the tensor. The events must not be recorded again before the
 * call returns; host tensors' entries are ignored. */
ac_result_t ac_st_save_after(const char *path, const ac_st_tensor_t *tensors, size_t ntensors,
                             const ac_st_kv_t *metadata, size_t nmeta, int threads, void *const *ready);

/* How the last ac_st_save on this thread wrote its data: "direct" (O_DIRECT), "buffered", or
 * "none" (no save yet, or it failed before writing any data). Thread-local; never NULL. */
const char *ac_st_last_write_mode(void);

/* ---- parsing and reading ------------------------------------------------------------------- */

/* What the header says about one tensor. Pointers belong to the header and live as long as it. */
typedef struct {
  const char *name;
  ac_st_dtype_t dtype;
  int32_t ndim;
  const int64_t *shape;
  uint64_t begin, end;   /* data_offsets as written: relative to the data region */
  uint64_t file_offset;  /* absolute offset of the first byte in the file (data start + begin) */
  uint64_t nbytes;       /* end - begin == dtype size * prod(shape) (validated) */
} ac_st_info_t;

/* A parsed and validated header. */
typedef struct ac_st_header ac_st_header_t;

/* Parses and validates a header from memory. `buf` holds the first `len` bytes of a file whose
 * total size is `file_size` (len <= file_size); it must contain at least the 8-byte length and
 * the whole JSON header. `label` names the file in error messages (NULL: "<memory>").
 * Validation, each failure an AC_ERR_FORMAT naming the file and the tensor or key:
 *   the 8-byte length is present, <= AC_ST_MAX_HEADER and inside the file; the JSON is
 *   well-formed UTF-8 starting with '{', one object followed only by whitespace; keys are
 *   unique; "__metadata__" is an object of strings; every other entry is an object with exactly
 *   "dtype" (a known name), "shape" (array of integers >= 0) and "data_offsets" (two integers,
 *   begin <= end); end - begin == dtype size * prod(shape) with no overflow; every range lies in
 *   the data region; sorted by offset the ranges start at 0, neither overlap nor leave holes, and
 *   end exactly at the end of the file.
 * On success *out owns a new header (free it with ac_st_header_destroy); on failure *out is NULL. */
ac_result_t ac_st_header_parse(ac_st_header_t **out, const void *buf, size_t len,
                               uint64_t file_size, const char *label);

/* Frees a header; NULL is a no-op. */
void ac_st_header_destroy(ac_st_header_t *h);

/* Number of tensors; they are indexed 0..count-1 in data-offset order. */
size_t ac_st_header_count(const ac_st_header_t *h);
/* Fills *out for tensor i; AC_ERR_INVALID_ARG if i is out of range. */
ac_result_t ac_st_header_info(const ac_st_header_t *h, size_t i, ac_st_info_t *out);
/* Index of the tensor called `name`; AC_ERR_INVALID_ARG (naming it) if there is none. */
ac_result_t ac_st_header_find(const ac_st_header_t *h, const char *name, size_t *index);
/* Absolute file offset of the data region (8 + header length). */
uint64_t ac_st_header_data_start(const ac_st_header_t *h);
/* 1 if the file has a "__metadata__" object (possibly empty), else 0. */
int ac_st_header_has_metadata(const ac_st_header_t *h);
/* Number of "__metadata__" entries, and entry i (in file order; pointers owned by the header). */
size_t ac_st_header_metadata_count(const ac_st_header_t *h);
ac_result_t ac_st_header_metadata(const ac_st_header_t *h, size_t i, const char **key,
                                  const char **value);

/* An open file with its validated header. */
typedef struct ac_st_reader ac_st_reader_t;

/* Opens `path`, reads the header with pread and validates it as ac_st_header_parse does.
 * On success *out owns the reader (ac_st_reader_destroy closes it); on failure *out is NULL and
 * the error is AC_ERR_IO (open/read failed) or AC_ERR_FORMAT (bad file). */
ac_result_t ac_st_reader_create(ac_st_reader_t **out, const char *path);
/* Closes the file and frees the header; NULL is a no-op. */
void ac_st_reader_destroy(ac_st_reader_t *r);
/* The reader's header (owned by the reader). */
const ac_st_header_t *ac_st_reader_header(const ac_st_reader_t *r);

/* One read: tensor `index` of the header into `dst`, which must be exactly `nbytes` long and
 * equal the tensor's byte size (the caller checks dtype and shape; the core checks the size). */
typedef struct {
  size_t index;
  void *dst;
  size_t nbytes;
} ac_st_read_t;

/* Reads the requested tensors straight into caller memory with pread/preadv, using up to
 * `threads` threads (0 = choose: online CPUs, at most 8; buffered reads of one file do run in
 * parallel). A tensor may be requested at most once; destinations must not
 * overlap. On failure (AC_ERR_IO: a short read means the file shrank after it was opened,
 * AC_ERR_INVALID_ARG: a bad request) some destinations may have been partly written. */
ac_result_t ac_st_reader_read(ac_st_reader_t *r, const ac_st_read_t *reqs, size_t nreqs,
                              int threads);

#ifdef __cplusplus
}
#endif
#endif /* AC_SAFETENSORS_H */

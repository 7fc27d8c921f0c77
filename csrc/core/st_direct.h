/* st_direct.h — internal to the core: the chunked executor behind ac_st_save (st_direct.c),
 * used for O_DIRECT writes and for every save that stages tensors from a GPU.
 * Not part of the public API (csrc/include); the C tests include it for the chunk-size setter,
 * the fault hooks and the device-ops table. */
#ifndef AC_ST_DIRECT_H
#define AC_ST_DIRECT_H

#include <stddef.h>
#include <stdint.h>

#include "ac/ac.h"

/* Every direct write starts at a multiple of this and moves a multiple of it, from a buffer
 * aligned to it: 4096 covers the logical block size of every common device (512 or 4096). */
#define ST_DIRECT_ALIGN ((size_t)4096)
/* Default chunk: one pwrite per chunk, one staging buffer of this size per worker. 8 MiB keeps
 * the syscall count low (~130 for 1 GB) and is what the measurements in the brief used. */
#define ST_DIRECT_CHUNK ((size_t)8 << 20)
/* Most workers one save will start (each holds a chunk-sized staging buffer). */
#define ST_DIRECT_MAX_THREADS 16

/* One contiguous run of the file's bytes: `len` (> 0) bytes from `p` belong at file offset
 * `off`. `tensor` is the caller's tensor index, SIZE_MAX for the header. `device` is -1 when
 * `p` is host memory, else the CUDA device ordinal whose memory `p` points into. */
typedef struct {
  uint64_t off;
  const char *p;
  uint64_t len;
  size_t tensor;
  int device;
  void *event; /* device segments: NULL, or a cudaEvent_t the copy stream waits for before copying */
} st_seg;

/* How a chunked write failed. */
enum {
  ST_FAIL_WRITE = 0,  /* a pwrite failed: err, unaligned, nothing_written, off */
  ST_FAIL_COPY = 1,   /* staging a device segment failed: tensor, device, code, msg */
  ST_FAIL_ALLOC = 2,  /* not one staging buffer could be had: code, msg (pinned) or ENOMEM */
  ST_FAIL_THREAD = 3, /* staged mode could start no worker thread: err */
};

/* Where and why a chunked write failed. */
typedef struct {
  int kind;            /* ST_FAIL_* */
  int err;             /* errno of the failed pwrite (EIO for a write of zero bytes) or pthread_create */
  int unaligned;       /* a short write left a remainder that is not a multiple of ST_DIRECT_ALIGN */
  int nothing_written; /* no pwrite of this save had succeeded yet: EINVAL then means the file
                          system refuses O_DIRECT (not a bug of ours: every write is aligned) */
  uint64_t off;        /* file offset of the write that failed, or of the chunk whose copy failed */
  size_t tensor;       /* ST_FAIL_COPY: caller's index of the (first) tensor being copied */
  size_t more;         /* ST_FAIL_COPY: how many other tensors of that device the failed wait covered */
  int device;          /* ST_FAIL_COPY: its CUDA device */
  ac_result_t code;    /* ST_FAIL_COPY / ST_FAIL_ALLOC: the device layer's result */
  char msg[400];       /* ST_FAIL_COPY / ST_FAIL_ALLOC: the device layer's message ("" for malloc) */
} st_direct_fail;

/* Writes the byte stream described by `segs` (sorted by offset, contiguous, non-empty, covering
 * [0, total) exactly; total > 0) into `fd`. The stream is cut into chunks of
 * st_direct_chunk_bytes() at file offsets that are multiples of it; `threads` workers (0 =
 * default) each fill their own aligned staging buffer with the pieces of one chunk at a time and
 * pwrite it whole. The last chunk is zero-padded to a multiple of ST_DIRECT_ALIGN, so the file
 * may end up to ST_DIRECT_ALIGN - 1 bytes longer than `total`: the caller truncates it.
 * `direct` says `fd` was opened with O_DIRECT (the fault hooks and the rule that a short write
 * must leave an aligned rest apply only then); the same pipeline runs on a buffered fd.
 * Staged mode, when any segment is on a device: the staging buffers are pinned host memory from
 * the device ops, every worker is a thread of its own (the caller only waits, so its current
 * CUDA device never changes), and a chunk's device pieces are queued as device->host copies on
 * the worker's stream for that device (after that stream waited for the segment's event, if it
 * has one), its host pieces memcpy'd meanwhile, and the streams synchronised before the pwrite. Returns 0; 1 with *f set when a pwrite or a device copy failed
 * or staged mode could start no thread; -1 with f->kind ST_FAIL_ALLOC when not even one staging
 * buffer could be allocated. Every buffer and stream is freed before it returns. */
int st_direct_write(int fd, const st_seg *segs, size_t nsegs, uint64_t total, int threads, int direct,
                    st_direct_fail *f);

/* What the chunked writer calls to reach device memory: the CUDA layer (ac/cuda.h) unless a test
 * swapped in a fake device. Every function but check_device runs on a writer thread. */
typedef struct {
  ac_result_t (*check_device)(int device);
  ac_result_t (*host_alloc)(void **ptr, size_t bytes, int device);
  void (*host_free)(void *ptr);
  ac_result_t (*stream_create)(void **stream, int device);
  void (*stream_destroy)(void *stream, int device);
  ac_result_t (*stream_wait_event)(void *stream, void *event, int device);
  ac_result_t (*copy_async)(void *dst, const void *src, size_t n, int device, void *stream);
  ac_result_t (*stream_sync)(void *stream, int device);
} st_device_ops;

/* The ops in use. */
const st_device_ops *st_device_ops_get(void);
/* Test hook: use `ops` (which must stay valid) for the following saves; NULL restores the CUDA
 * layer. Process-wide; not for use while a save runs. */
void st_direct_set_device_ops(const st_device_ops *ops);

/* Index of the segment holding file offset `off` (the last one if `off` is past the end). */
size_t st_direct_seg_at(const st_seg *segs, size_t nsegs, uint64_t off);

/* The chunk size in use: ST_DIRECT_CHUNK unless a test changed it. */
size_t st_direct_chunk_bytes(void);
/* Test hook: use chunks of `bytes` (a positive multiple of ST_DIRECT_ALIGN; 0 restores the
 * default) so tests reach chunk boundaries with small files. Returns 0, or -1 for a bad size. */
int st_direct_set_chunk_bytes(size_t bytes);

/* Test hook: make direct saves behave as on a file system that refuses O_DIRECT, or misbehaves:
 * ST_DIRECT_FAULT_OPEN: open with O_DIRECT fails with EINVAL after creating the file (as tmpfs
 * before Linux 6.6 does); ST_DIRECT_FAULT_WRITE: every direct pwrite fails with EINVAL;
 * ST_DIRECT_FAULT_SHORT: the first direct pwrite of each save reports 512 bytes written (without
 * writing), leaving an unaligned remainder. 0 = none. Process-wide; for tests only. */
enum { ST_DIRECT_FAULT_NONE = 0, ST_DIRECT_FAULT_OPEN = 1, ST_DIRECT_FAULT_WRITE = 2, ST_DIRECT_FAULT_SHORT = 3 };
void st_direct_set_fault(int fault);
int st_direct_fault(void);

#endif /* AC_ST_DIRECT_H */

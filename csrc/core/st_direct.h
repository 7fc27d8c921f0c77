/* st_direct.h — internal to the core: the O_DIRECT executor behind ac_st_save (st_direct.c).
 * Not part of the public API (csrc/include); the C tests include it for the chunk-size setter. */
#ifndef AC_ST_DIRECT_H
#define AC_ST_DIRECT_H

#include <stddef.h>
#include <stdint.h>

/* Every direct write starts at a multiple of this and moves a multiple of it, from a buffer
 * aligned to it: 4096 covers the logical block size of every common device (512 or 4096). */
#define ST_DIRECT_ALIGN ((size_t)4096)
/* Default chunk: one pwrite per chunk, one staging buffer of this size per worker. 8 MiB keeps
 * the syscall count low (~130 for 1 GB) and is what the measurements in the brief used. */
#define ST_DIRECT_CHUNK ((size_t)8 << 20)
/* Most workers one save will start (each holds a chunk-sized staging buffer). */
#define ST_DIRECT_MAX_THREADS 16

/* One contiguous run of the file's bytes: `len` (> 0) bytes from `p` belong at file offset
 * `off`. `tensor` is the caller's tensor index, SIZE_MAX for the header. */
typedef struct {
  uint64_t off;
  const char *p;
  uint64_t len;
  size_t tensor;
} st_seg;

/* Where and why a direct write failed. */
typedef struct {
  int err;             /* errno of the failed pwrite (EIO for a write of zero bytes) */
  int unaligned;       /* a short write left a remainder that is not a multiple of ST_DIRECT_ALIGN */
  int nothing_written; /* no pwrite of this save had succeeded yet: EINVAL then means the file
                          system refuses O_DIRECT (not a bug of ours: every write is aligned) */
  uint64_t off;        /* file offset of the write that failed */
} st_direct_fail;

/* Writes the byte stream described by `segs` (sorted by offset, contiguous, non-empty, covering
 * [0, total) exactly; total > 0) into `fd`, which was opened with O_DIRECT. The stream is cut into
 * chunks of st_direct_chunk_bytes() at file offsets that are multiples of it; `threads` workers
 * (the caller is one; 0 = default) each fill their own aligned staging buffer with the pieces of
 * one chunk at a time and pwrite it whole. The last chunk is zero-padded to a multiple of
 * ST_DIRECT_ALIGN, so the file may end up to ST_DIRECT_ALIGN - 1 bytes longer than `total`: the
 * caller truncates it. Returns 0; 1 with *f set when a pwrite failed; -1 when not even one
 * staging buffer could be allocated (ENOMEM). */
int st_direct_write(int fd, const st_seg *segs, size_t nsegs, uint64_t total, int threads, st_direct_fail *f);

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

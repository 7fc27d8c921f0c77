/* kernels_impl.h (private) — the per-instruction-set chunk functions behind kernels.h.
 * A chunk function handles one contiguous piece on the calling thread; kernels.c splits
 * buffers into pieces, runs them on the pool and combines the partial results in order. */
#ifndef AC_KERNELS_IMPL_H
#define AC_KERNELS_IMPL_H

#include "ac/kernels.h"

typedef void (*ac_stats_fn)(const void *p, size_t n, ac_stats_t *out);
typedef void (*ac_scale_fn)(void *p, size_t n, float f);
typedef void (*ac_scale_stats_fn)(void *p, size_t n, float f, ac_stats_t *out);
typedef void (*ac_cast_fn)(const void *src, void *dst, size_t n);
/* Fills out->sumsq and out->nonfinite (maxabs unused) with ac_sumsq's blocked arithmetic. */
typedef void (*ac_sumsq_fn)(const void *p, size_t n, ac_stats_t *out);

/* ac_sumsq's block: 16 fp32 partial sums per SIMD lane position, 8 lane positions. */
#define AC_SUMSQ_BLOCK 128

typedef struct {
  const char *name;
  ac_stats_fn stats[AC_NUM_DTYPES];
  ac_sumsq_fn sumsq[AC_NUM_DTYPES];
  ac_scale_fn scale[AC_NUM_DTYPES];
  ac_scale_stats_fn scale_stats[AC_NUM_DTYPES];
  ac_cast_fn cast[AC_NUM_DTYPES][AC_NUM_DTYPES]; /* [src][dst]; diagonal unused (memcpy) */
} ac_kernel_table_t;

extern const ac_kernel_table_t ac_kernels_scalar;
/* NULL when not compiled for x86-64; still check the CPU before using it. */
const ac_kernel_table_t *ac_kernels_avx2_table(void);
int ac_cpu_has_avx2(void);

#endif

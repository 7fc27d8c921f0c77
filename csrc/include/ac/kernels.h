/* kernels.h — CPU kernels over flat buffers of fp32 / fp16 / bf16: the gradient post-processing
 * (unscale, non-finite check, norms, clipping) and dtype casts.
 *
 * All functions work on `n` contiguous elements, are safe to call from any thread, split
 * large buffers across the pool (ac_pool_*), and are deterministic for a given buffer and
 * instruction set: partial results are combined in a fixed chunk order whatever the thread
 * count. Arithmetic is done in fp32 (as torch's opmath does for 16-bit types) and rounded to
 * nearest-even on store; sums of squares are accumulated in double. None is collective. */
#ifndef AC_KERNELS_H
#define AC_KERNELS_H

#include "ac/ac.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { AC_F32 = 0, AC_F16 = 1, AC_BF16 = 2 } ac_dtype_t;
#define AC_NUM_DTYPES 3

/* Bytes per element (4 or 2); 0 for a value outside the enum. */
size_t ac_dtype_size(ac_dtype_t dt);
/* "float32", "float16", "bfloat16", or "invalid". */
const char *ac_dtype_name(ac_dtype_t dt);

/* Statistics of a buffer, in one read-only pass.
 * sumsq: sum of x*x in double (NaN/Inf propagate as IEEE says); maxabs: largest |x|, NaN
 * ignored, Inf included; nonfinite: 1 if any element is NaN or +-Inf. */
typedef struct {
  double sumsq;
  float maxabs;
  int nonfinite;
} ac_stats_t;

/* data[i] = data[i] * factor, in place. */
ac_result_t ac_scale(ac_dtype_t dt, void *data, size_t n, float factor);

/* Fills *out with the statistics of data[0..n). Empty buffers give {0, 0, 0}. */
ac_result_t ac_stats(ac_dtype_t dt, const void *data, size_t n, ac_stats_t *out);

/* The fast norm pass: *sumsq = sum of x*x, *nonfinite = 1 if any element is NaN or +-Inf.
 * Memory-bound: squares are summed in fp32 within blocks of 128 elements (16 per SIMD lane)
 * and the block sums in double, so the relative error is about 1e-7 (torch's fp32 norms are
 * worse); a block whose fp32 sum overflows or meets NaN/Inf is redone in double, so the flag
 * is exact and finite inputs never report Inf. Bitwise identical on every ISA and thread
 * count. Use ac_stats when the max-abs or a pure double sum is needed. */
ac_result_t ac_sumsq(ac_dtype_t dt, const void *data, size_t n, double *sumsq, int *nonfinite);

/* sqrt(sumsq) * scale as torch's norm of a tensor of dt gives it (fp32, then rounded to dt),
 * squared: torch.nn.utils.clip_grad_norm_ takes each gradient's norm in the gradient's own
 * dtype, after the gradient was unscaled (scale: the inverse loss scale, or 1). */
double ac_norm_sq_rounded(ac_dtype_t dt, double sumsq, double scale);

/* Per-parameter sums of squares of a flat buffer of n elements, seg holding nseg (offset,
 * length) pairs in elements: *exact = the sum of every segment's sum of squares (ac_sumsq's),
 * *rounded = the sum of ac_norm_sq_rounded(dt, each, scale) (torch's total norm of 16-bit
 * gradients scaled by `scale`, squared), *nonfinite as ac_sumsq's. Segments outside the buffer
 * are refused. */
ac_result_t ac_sumsq_segments(ac_dtype_t dt, const void *data, size_t n, const size_t *seg, size_t nseg,
                              double scale, double *exact, double *rounded, int *nonfinite);

/* *found = 1 if any element is NaN or +-Inf, else 0. */
ac_result_t ac_nonfinite(ac_dtype_t dt, const void *data, size_t n, int *found);

/* Fused: data[i] *= factor in place, and *out = statistics of the scaled values (the
 * non-finite flag sees overflow caused by the scaling itself). One read and one write. */
ac_result_t ac_scale_stats(ac_dtype_t dt, void *data, size_t n, float factor, ac_stats_t *out);

/* A gradient brought into its range of a flat buffer: dst[i] = src[i] * factor (factor 1: a
 * copy; otherwise ac_scale's arithmetic), and, when sumsq is not NULL, *sumsq and *nonfinite of
 * the values written, bitwise what ac_sumsq(dt, dst, n, ...) gives afterwards: each piece is
 * measured right after it was written, while it is in cache, instead of a second pass over
 * memory. sumsq and nonfinite are both NULL or both not. The buffers must not overlap. */
ac_result_t ac_copy_in(ac_dtype_t dt, const void *src, void *dst, size_t n, float factor, double *sumsq,
                       int *nonfinite);

/* dst[i] = (dst_dt) src[i]. Same dtype is a copy. Buffers must not overlap, except when
 * src == dst with the same dtype (a no-op). */
ac_result_t ac_cast(ac_dtype_t src_dt, const void *src, ac_dtype_t dst_dt, void *dst, size_t n);

/* Instruction set used by the kernels: "avx2" (x86-64 with AVX2+FMA+F16C) or "scalar".
 * ac_kernels_set_isa lets tests run both paths; asking for "avx2" on a CPU without it
 * returns AC_ERR_UNSUPPORTED. The environment variable AC_KERNELS_ISA=scalar forces the
 * portable path at start-up. */
const char *ac_kernels_isa(void);
ac_result_t ac_kernels_set_isa(const char *name);

#ifdef __cplusplus
}
#endif
#endif /* AC_KERNELS_H */

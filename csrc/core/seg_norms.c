/* seg_norms.c — sums of squares of a flat gradient buffer taken parameter by parameter, with
 * each parameter's 2-norm rounded as torch.nn.utils.clip_grad_norm_ rounds it.
 *
 * torch takes one norm per gradient tensor, in the gradient's dtype (its CPU and CUDA norm
 * kernels accumulate in fp32, then round the result to the tensor's dtype), and the total norm
 * over those. For a bf16 or fp16 model each per-tensor norm is thus rounded to 8 or 11 bits
 * before it is squared again: the total moves by up to a 16-bit ulp against the exact one, and
 * the clip coefficient (computed in the same dtype) by one of its ulps, which every parameter
 * update then carries. Giving the same numbers as torch means rounding the same way. */
#include <math.h>

#include "ac/kernels.h"
#include "half.h"

double ac_norm_sq_rounded(ac_dtype_t dt, double sumsq, double scale) {
  /* torch's norm of the gradient times `scale` (the unscaled gradient: torch unscales before it
   * takes norms, and a scaled fp16 norm past 65504 would round to inf), in fp32 (NaN stays NaN,
   * inf stays inf) */
  float n = (float)(sqrt(sumsq) * scale);
  if (dt == AC_BF16)
    n = ac_bf16_to_f32(ac_f32_to_bf16(n));
  else if (dt == AC_F16)
    n = ac_f16_to_f32(ac_f32_to_f16(n)); /* a norm past 65504 is inf, as torch's fp16 norm */
  return (double)n * (double)n;
}

ac_result_t ac_sumsq_segments(ac_dtype_t dt, const void *data, size_t n, const size_t *seg, size_t nseg,
                              double scale, double *exact, double *rounded, int *nonfinite) {
  if (!exact || !rounded || !nonfinite)
    return AC_FAIL(AC_ERR_INVALID_ARG, "ac_sumsq_segments: exact, rounded and nonfinite must not be NULL");
  if (nseg && !seg) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_sumsq_segments: seg is NULL");
  size_t es = ac_dtype_size(dt);
  if (es == 0) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_sumsq_segments: invalid dtype %d", (int)dt);
  double ex = 0.0, ro = 0.0;
  int nf = 0;
  for (size_t i = 0; i < nseg; i++) {
    size_t off = seg[2 * i], len = seg[2 * i + 1];
    if (off > n || len > n - off)
      return AC_FAIL(AC_ERR_INVALID_ARG, "ac_sumsq_segments: segment %zu [%zu, +%zu) is outside the %zu elements",
                     i, off, len, n);
    double s;
    int f;
    AC_CHECK(ac_sumsq(dt, (const char *)data + off * es, len, &s, &f));
    ex += s;
    ro += ac_norm_sq_rounded(dt, s, scale);
    nf |= f;
  }
  *exact = ex;
  *rounded = ro;
  *nonfinite = nf;
  return AC_OK;
}

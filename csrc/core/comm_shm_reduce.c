/* comm_shm_reduce.c — the element-wise reductions of the shared-memory collectives (comm_shm.c):
 * one kernel per dtype (sum, max, min, avg over the ranks' sources, in rank order), and the check
 * that picks it. Kept apart from the segment and barrier code so each file holds one concern. */
#include "comm_shm_reduce.h"

#include <stdint.h>

#include "half.h"

#define BLOCK 1024 /* elements accumulated at a time (on the stack) */

size_t ac_shm_dtype_size(ac_shm_dtype_t dt) {
  switch (dt) {
    case AC_SHM_F32:
    case AC_SHM_I32: return 4;
    case AC_SHM_F64:
    case AC_SHM_I64: return 8;
    case AC_SHM_F16:
    case AC_SHM_BF16: return 2;
  }
  return 0;
}

const char *ac_shm_dtype_name(ac_shm_dtype_t dt) {
  static const char *names[] = {"float32", "float64", "float16", "bfloat16", "int32", "int64"};
  return (unsigned)dt < 6 ? names[dt] : "invalid";
}

#define MAXF(a, b) (((a) > (b) || (a) != (a)) ? (a) : (b))
#define MINF(a, b) (((a) < (b) || (a) != (a)) ? (a) : (b))
#define MAXI(a, b) ((a) > (b) ? (a) : (b))
#define MINI(a, b) ((a) < (b) ? (a) : (b))

/* dst[i] = op over q of src[q][i], i < n, accumulating in ACC and in rank order; the sources are
 * read block by block before the block of dst is written, so dst may be one of them. */
#define DEFINE_REDUCE(NAME, T, ACC, LOAD, STORE, ADD, MAX, MIN, AVG_OK)                                  \
  static void NAME(void *dst_, const void *const *src, int nsrc, size_t n, ac_redop_t op) {          \
    T *dst = dst_;                                                                                   \
    ACC acc[BLOCK];                                                                                  \
    for (size_t i0 = 0; i0 < n; i0 += BLOCK) {                                                       \
      size_t m = n - i0 < BLOCK ? n - i0 : BLOCK;                                                    \
      const T *s0 = (const T *)src[0] + i0;                                                          \
      for (size_t j = 0; j < m; j++) acc[j] = LOAD(s0[j]);                                           \
      for (int q = 1; q < nsrc; q++) {                                                               \
        const T *s = (const T *)src[q] + i0;                                                         \
        if (op == AC_RED_MAX)                                                                        \
          for (size_t j = 0; j < m; j++) { ACC v = LOAD(s[j]); acc[j] = MAX(acc[j], v); }             \
        else if (op == AC_RED_MIN)                                                                   \
          for (size_t j = 0; j < m; j++) { ACC v = LOAD(s[j]); acc[j] = MIN(acc[j], v); }             \
        else                                                                                         \
          for (size_t j = 0; j < m; j++) acc[j] = ADD(acc[j], LOAD(s[j]));                           \
      }                                                                                              \
      if (AVG_OK && op == AC_RED_AVG)                                                                \
        for (size_t j = 0; j < m; j++) acc[j] = (ACC)(acc[j] / (ACC)nsrc);                           \
      for (size_t j = 0; j < m; j++) dst[i0 + j] = STORE(acc[j]);                                    \
    }                                                                                                \
  }

#define ID(x) (x)
#define ADDF(a, b) ((a) + (b))
#define ADDI32(a, b) ((int32_t)((uint32_t)(a) + (uint32_t)(b)))
#define ADDI64(a, b) ((int64_t)((uint64_t)(a) + (uint64_t)(b)))
DEFINE_REDUCE(reduce_f32, float, float, ID, ID, ADDF, MAXF, MINF, 1)
DEFINE_REDUCE(reduce_f64, double, double, ID, ID, ADDF, MAXF, MINF, 1)
DEFINE_REDUCE(reduce_f16, uint16_t, float, ac_f16_to_f32, ac_f32_to_f16, ADDF, MAXF, MINF, 1)
DEFINE_REDUCE(reduce_bf16, uint16_t, float, ac_bf16_to_f32, ac_f32_to_bf16, ADDF, MAXF, MINF, 1)
DEFINE_REDUCE(reduce_i32, int32_t, int32_t, ID, ID, ADDI32, MAXI, MINI, 0)
DEFINE_REDUCE(reduce_i64, int64_t, int64_t, ID, ID, ADDI64, MAXI, MINI, 0)

ac_result_t ac_shm_check_op(ac_shm_dtype_t dt, ac_redop_t op, ac_shm_reduce_fn *fn) {
  static const ac_shm_reduce_fn fns[] = {reduce_f32, reduce_f64, reduce_f16, reduce_bf16, reduce_i32, reduce_i64};
  if (ac_shm_dtype_size(dt) == 0) return AC_FAIL(AC_ERR_INVALID_ARG, "invalid dtype code %d", (int)dt);
  if (op != AC_RED_SUM && op != AC_RED_MAX && op != AC_RED_MIN && op != AC_RED_AVG)
    return AC_FAIL(AC_ERR_UNSUPPORTED, "reduction op %d: shm collectives do sum, max, min and avg", (int)op);
  if (op == AC_RED_AVG && (dt == AC_SHM_I32 || dt == AC_SHM_I64))
    return AC_FAIL(AC_ERR_INVALID_ARG, "avg of %s: an integer average would be truncated; sum and divide",
                   ac_shm_dtype_name(dt));
  *fn = fns[dt];
  return AC_OK;
}

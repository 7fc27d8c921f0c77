/* kernels_scalar.c — portable chunk functions: the fallback on any CPU and the reference the
 * vector paths are tested against. */
#include <math.h>

#include "half.h"
#include "kernels_impl.h"
#include "sumsq_common.h"

static inline float ld_f32(const void *p, size_t i) { return ((const float *)p)[i]; }
static inline float ld_f16(const void *p, size_t i) { return ac_f16_to_f32(((const uint16_t *)p)[i]); }
static inline float ld_bf16(const void *p, size_t i) { return ac_bf16_to_f32(((const uint16_t *)p)[i]); }
static inline void st_f32(void *p, size_t i, float v) { ((float *)p)[i] = v; }
static inline void st_f16(void *p, size_t i, float v) { ((uint16_t *)p)[i] = ac_f32_to_f16(v); }
static inline void st_bf16(void *p, size_t i, float v) { ((uint16_t *)p)[i] = ac_f32_to_bf16(v); }

/* Accumulate one value into (acc, mx, nf). `!(a < INFINITY)` is true for Inf and NaN. */
#define ACCUM(v)                      \
  do {                                \
    float a_ = fabsf(v);              \
    acc += (double)(v) * (double)(v); \
    if (!(a_ < INFINITY)) nf = 1;     \
    if (a_ > mx) mx = a_;             \
  } while (0)

#define DEFINE_DTYPE(S)                                                              \
  static void stats_##S(const void *p, size_t n, ac_stats_t *o) {                    \
    double acc = 0.0;                                                                \
    float mx = 0.0f;                                                                 \
    int nf = 0;                                                                      \
    for (size_t i = 0; i < n; i++) {                                                 \
      float v = ld_##S(p, i);                                                        \
      ACCUM(v);                                                                      \
    }                                                                                \
    o->sumsq = acc;                                                                  \
    o->maxabs = mx;                                                                  \
    o->nonfinite = nf;                                                               \
  }                                                                                  \
  static void scale_##S(void *p, size_t n, float f) {                                \
    for (size_t i = 0; i < n; i++) st_##S(p, i, ld_##S(p, i) * f);                   \
  }                                                                                  \
  static void scale_stats_##S(void *p, size_t n, float f, ac_stats_t *o) {           \
    double acc = 0.0;                                                                \
    float mx = 0.0f;                                                                 \
    int nf = 0;                                                                      \
    for (size_t i = 0; i < n; i++) {                                                 \
      st_##S(p, i, ld_##S(p, i) * f);                                                \
      float v = ld_##S(p, i); /* stats of the stored (rounded) value */              \
      ACCUM(v);                                                                      \
    }                                                                                \
    o->sumsq = acc;                                                                  \
    o->maxabs = mx;                                                                  \
    o->nonfinite = nf;                                                               \
  }

/* Emulates the vector code lane by lane: lane j of accumulator 0 takes elements k+j and of
 * accumulator 1 elements k+8+j, for k = 0, 16, ... within a block; separate multiply and add
 * (no FMA) so both paths round identically. */
#define DEFINE_SUMSQ(S)                                                              \
  static void sumsq_##S(const void *p, size_t n, ac_stats_t *o) {                    \
    double t[8] = {0};                                                               \
    double side = 0.0;                                                               \
    int nf = 0;                                                                      \
    size_t i = 0;                                                                    \
    for (; i + AC_SUMSQ_BLOCK <= n; i += AC_SUMSQ_BLOCK) {                           \
      float a0[8] = {0}, a1[8] = {0}, a[8];                                          \
      for (size_t k = 0; k < AC_SUMSQ_BLOCK; k += 16)                                \
        for (int j = 0; j < 8; j++) {                                                \
          float v0 = ld_##S(p, i + k + j), v1 = ld_##S(p, i + k + 8 + j);            \
          float s0 = v0 * v0, s1 = v1 * v1;                                          \
          a0[j] = a0[j] + s0;                                                        \
          a1[j] = a1[j] + s1;                                                        \
        }                                                                            \
      int bad = 0;                                                                   \
      for (int j = 0; j < 8; j++) {                                                  \
        a[j] = a0[j] + a1[j];                                                        \
        if (!(fabsf(a[j]) < INFINITY)) bad = 1;                                      \
      }                                                                              \
      if (bad) {                                                                     \
        ac_sumsq_double(ld_##S, p, i, i + AC_SUMSQ_BLOCK, &side, &nf);               \
      } else {                                                                       \
        for (int j = 0; j < 8; j++) t[j] += (double)a[j];                            \
      }                                                                              \
    }                                                                                \
    ac_sumsq_double(ld_##S, p, i, n, &side, &nf);                                    \
    o->sumsq = ac_sumsq_lanes_total(t) + side;                                       \
    o->maxabs = 0.0f;                                                                \
    o->nonfinite = nf;                                                               \
  }

DEFINE_DTYPE(f32)
DEFINE_DTYPE(f16)
DEFINE_DTYPE(bf16)
DEFINE_SUMSQ(f32)
DEFINE_SUMSQ(f16)
DEFINE_SUMSQ(bf16)

#define DEFINE_CAST(A, B)                                                 \
  static void cast_##A##_##B(const void *src, void *dst, size_t n) {      \
    for (size_t i = 0; i < n; i++) st_##B(dst, i, ld_##A(src, i));        \
  }
DEFINE_CAST(f32, f16)
DEFINE_CAST(f32, bf16)
DEFINE_CAST(f16, f32)
DEFINE_CAST(f16, bf16)
DEFINE_CAST(bf16, f32)
DEFINE_CAST(bf16, f16)

const ac_kernel_table_t ac_kernels_scalar = {
    "scalar",
    {stats_f32, stats_f16, stats_bf16},
    {sumsq_f32, sumsq_f16, sumsq_bf16},
    {scale_f32, scale_f16, scale_bf16},
    {scale_stats_f32, scale_stats_f16, scale_stats_bf16},
    {{NULL, cast_f32_f16, cast_f32_bf16},
     {cast_f16_f32, NULL, cast_f16_bf16},
     {cast_bf16_f32, cast_bf16_f16, NULL}},
};

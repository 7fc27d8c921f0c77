/* kernels_avx2.c — AVX2 + FMA + F16C chunk functions (x86-64), selected at run time when the
 * CPU has them. Built without -mavx2 so the module still loads on older CPUs: each function
 * carries its own target attribute. Tails shorter than one vector use the scalar formulas. */
#include "kernels_impl.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include <math.h>

#include "half.h"
#include "sumsq_common.h"

#define AVX __attribute__((target("avx2,fma,f16c")))

/* Loads 8 elements as fp32. */
AVX static inline __m256 ld8_f32(const void *p, size_t i) { return _mm256_loadu_ps((const float *)p + i); }
AVX static inline __m256 ld8_f16(const void *p, size_t i) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
}
AVX static inline __m256 ld8_bf16(const void *p, size_t i) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* Stores 8 fp32 values rounded to the dtype; returns the stored values as fp32. */
AVX static inline __m256 st8_f32(void *p, size_t i, __m256 v) {
  _mm256_storeu_ps((float *)p + i, v);
  return v;
}
AVX static inline __m256 st8_f16(void *p, size_t i, __m256 v) {
  /* F16C keeps NaN payloads; the scalar path (and c10::Half) gives sign|0x7e00: canonicalise */
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  const __m256 canon = _mm256_or_ps(_mm256_and_ps(v, _mm256_set1_ps(-0.0f)),
                                    _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)));
  v = _mm256_blendv_ps(v, canon, nan);
  __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm_storeu_si128((__m128i *)((uint16_t *)p + i), h);
  return _mm256_cvtph_ps(h);
}
AVX static inline __m256 st8_bf16(void *p, size_t i, __m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i isnan = _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), isnan);
  /* packus works per 128-bit lane; the permute gathers both lanes' results into the low half */
  __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  _mm_storeu_si128((__m128i *)((uint16_t *)p + i), _mm256_castsi256_si128(packed));
  return _mm256_castsi256_ps(_mm256_slli_epi32(r, 16));
}

static inline float ld1_f32(const void *p, size_t i) { return ((const float *)p)[i]; }
static inline float ld1_f16(const void *p, size_t i) { return ac_f16_to_f32(((const uint16_t *)p)[i]); }
static inline float ld1_bf16(const void *p, size_t i) { return ac_bf16_to_f32(((const uint16_t *)p)[i]); }
static inline float st1_f32(void *p, size_t i, float v) { ((float *)p)[i] = v; return v; }
static inline float st1_f16(void *p, size_t i, float v) {
  uint16_t h = ac_f32_to_f16(v);
  ((uint16_t *)p)[i] = h;
  return ac_f16_to_f32(h);
}
static inline float st1_bf16(void *p, size_t i, float v) {
  uint16_t h = ac_f32_to_bf16(v);
  ((uint16_t *)p)[i] = h;
  return ac_bf16_to_f32(h);
}

/* Running statistics: 2 double accumulators per 8 floats keep the FMA chain short. */
typedef struct {
  __m256d acc0, acc1;
  __m256 mx, nf;
} vstats_t;

AVX static inline void vstats_init(vstats_t *s) {
  s->acc0 = _mm256_setzero_pd();
  s->acc1 = _mm256_setzero_pd();
  s->mx = _mm256_setzero_ps();
  s->nf = _mm256_setzero_ps();
}
AVX static inline void vstats_add(vstats_t *s, __m256 v) {
  const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
  __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
  __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
  s->acc0 = _mm256_fmadd_pd(lo, lo, s->acc0);
  s->acc1 = _mm256_fmadd_pd(hi, hi, s->acc1);
  s->nf = _mm256_or_ps(s->nf, _mm256_cmp_ps(a, _mm256_set1_ps(INFINITY), _CMP_NLT_UQ));
  s->mx = _mm256_max_ps(a, s->mx); /* returns s->mx when a is NaN: NaN is ignored */
}
AVX static inline void vstats_finish(const vstats_t *s, ac_stats_t *o) {
  double d[4];
  float m[8];
  _mm256_storeu_pd(d, _mm256_add_pd(s->acc0, s->acc1));
  _mm256_storeu_ps(m, s->mx);
  o->sumsq = (d[0] + d[1]) + (d[2] + d[3]);
  float mx = 0.0f;
  for (int k = 0; k < 8; k++)
    if (m[k] > mx) mx = m[k];
  o->maxabs = mx;
  o->nonfinite = _mm256_movemask_ps(s->nf) != 0;
}
static inline void stats_tail(float v, ac_stats_t *o) {
  float a = fabsf(v);
  o->sumsq += (double)v * (double)v;
  if (!(a < INFINITY)) o->nonfinite = 1;
  if (a > o->maxabs) o->maxabs = a;
}

#define DEFINE_DTYPE(S)                                                         \
  AVX static void stats_##S(const void *p, size_t n, ac_stats_t *o) {           \
    vstats_t s;                                                                 \
    vstats_init(&s);                                                            \
    size_t i = 0;                                                               \
    for (; i + 8 <= n; i += 8) vstats_add(&s, ld8_##S(p, i));                   \
    vstats_finish(&s, o);                                                       \
    for (; i < n; i++) stats_tail(ld1_##S(p, i), o);                            \
  }                                                                             \
  AVX static void scale_##S(void *p, size_t n, float f) {                       \
    const __m256 fv = _mm256_set1_ps(f);                                        \
    size_t i = 0;                                                               \
    for (; i + 8 <= n; i += 8) (void)st8_##S(p, i, _mm256_mul_ps(ld8_##S(p, i), fv)); \
    for (; i < n; i++) (void)st1_##S(p, i, ld1_##S(p, i) * f);                  \
  }                                                                             \
  AVX static void scale_stats_##S(void *p, size_t n, float f, ac_stats_t *o) {  \
    const __m256 fv = _mm256_set1_ps(f);                                        \
    vstats_t s;                                                                 \
    vstats_init(&s);                                                            \
    size_t i = 0;                                                               \
    for (; i + 8 <= n; i += 8) vstats_add(&s, st8_##S(p, i, _mm256_mul_ps(ld8_##S(p, i), fv))); \
    vstats_finish(&s, o);                                                       \
    for (; i < n; i++) stats_tail(st1_##S(p, i, ld1_##S(p, i) * f), o);         \
  }

/* fp32 partial sums per block keep this pass memory-bound (the double conversions of
 * ac_stats make it compute-bound); the order matches kernels_scalar.c's emulation exactly. */
#define DEFINE_SUMSQ(S)                                                              \
  AVX static void sumsq_##S(const void *p, size_t n, ac_stats_t *o) {                \
    __m256d t0 = _mm256_setzero_pd(), t1 = _mm256_setzero_pd();                      \
    const __m256 inf = _mm256_set1_ps(INFINITY), sign = _mm256_set1_ps(-0.0f);       \
    double side = 0.0;                                                               \
    int nf = 0;                                                                      \
    size_t i = 0;                                                                    \
    for (; i + AC_SUMSQ_BLOCK <= n; i += AC_SUMSQ_BLOCK) {                           \
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();                     \
      for (size_t k = 0; k < AC_SUMSQ_BLOCK; k += 16) {                              \
        __m256 v0 = ld8_##S(p, i + k), v1 = ld8_##S(p, i + k + 8);                   \
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(v0, v0));                               \
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(v1, v1));                               \
      }                                                                              \
      __m256 a = _mm256_add_ps(a0, a1);                                              \
      __m256 bad = _mm256_cmp_ps(_mm256_andnot_ps(sign, a), inf, _CMP_NLT_UQ);       \
      if (_mm256_movemask_ps(bad)) {                                                 \
        ac_sumsq_double(ld1_##S, p, i, i + AC_SUMSQ_BLOCK, &side, &nf);              \
      } else {                                                                       \
        t0 = _mm256_add_pd(t0, _mm256_cvtps_pd(_mm256_castps256_ps128(a)));          \
        t1 = _mm256_add_pd(t1, _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)));        \
      }                                                                              \
    }                                                                                \
    ac_sumsq_double(ld1_##S, p, i, n, &side, &nf);                                   \
    double t[8];                                                                     \
    _mm256_storeu_pd(t, t0);                                                         \
    _mm256_storeu_pd(t + 4, t1);                                                     \
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

#define DEFINE_CAST(A, B)                                                      \
  AVX static void cast_##A##_##B(const void *src, void *dst, size_t n) {       \
    size_t i = 0;                                                              \
    for (; i + 8 <= n; i += 8) (void)st8_##B(dst, i, ld8_##A(src, i));         \
    for (; i < n; i++) (void)st1_##B(dst, i, ld1_##A(src, i));                 \
  }
DEFINE_CAST(f32, f16)
DEFINE_CAST(f32, bf16)
DEFINE_CAST(f16, f32)
DEFINE_CAST(f16, bf16)
DEFINE_CAST(bf16, f32)
DEFINE_CAST(bf16, f16)

static const ac_kernel_table_t table = {
    "avx2",
    {stats_f32, stats_f16, stats_bf16},
    {sumsq_f32, sumsq_f16, sumsq_bf16},
    {scale_f32, scale_f16, scale_bf16},
    {scale_stats_f32, scale_stats_f16, scale_stats_bf16},
    {{NULL, cast_f32_f16, cast_f32_bf16},
     {cast_f16_f32, NULL, cast_f16_bf16},
     {cast_bf16_f32, cast_bf16_f16, NULL}},
};

const ac_kernel_table_t *ac_kernels_avx2_table(void) { return &table; }

int ac_cpu_has_avx2(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

#else /* not x86-64 */

const ac_kernel_table_t *ac_kernels_avx2_table(void) { return NULL; }
int ac_cpu_has_avx2(void) { return 0; }

#endif

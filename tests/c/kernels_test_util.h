/* kernels_test_util.h — what the kernel test programs (test_kernels_*.c) share: an independent
 * reference for csrc/include/ac/kernels.h and the conversions of csrc/core/half.h, buffer and
 * statistics comparisons, test data, and switching the instruction set.
 *
 * The reference is naive on purpose (its own fp16/bf16 rounding, done with double arithmetic
 * and neighbour comparison, not with half.h's bit tricks) so that it cannot share a bug with the
 * code under test. Every kernel result is compared with it on both instruction sets; AVX2
 * results must equal the scalar ones bit for bit (sums of squares: within SUMSQ_REL relative,
 * as the summation order differs). Header only, like test_util.h, so the checks made here count
 * in the including program's current test. */
#ifndef AC_KERNELS_TEST_UTIL_H
#define AC_KERNELS_TEST_UTIL_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ac/kernels.h"
#include "ac/pool.h"
#include "test_util.h"

#define CHUNK 65536 /* kernels.c's AC_CHUNK: where work is split between pool tasks */
#define SUMSQ_REL 1e-12

static const ac_dtype_t DTYPES[] = {AC_F32, AC_F16, AC_BF16};
#define NDT 3

/* ======================= independent reference conversions ======================= */

static inline uint32_t fbits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static inline float bitsf(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Value of a half bit pattern, by the IEEE 754 binary16 definition. */
static inline double ref_f16_value(uint16_t h) {
  int sign = h >> 15, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  double v;
  if (e == 0x1f)
    v = m ? NAN : INFINITY;
  else if (e == 0)
    v = ldexp((double)m, -24);
  else
    v = ldexp((double)(1024 + m), e - 25);
  return sign ? -v : v;
}
static inline int f16_is_nan(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0; }
static inline int bf16_is_nan(uint16_t h) { return (h & 0x7f80) == 0x7f80 && (h & 0x7f) != 0; }

/* Nearest representable half to x, ties to even, by comparing x with its two neighbours among
 * all finite halves (found by binary search over the monotone positive patterns). Beyond the
 * largest half (65504) the next "neighbour" is 65536 (the unbounded-exponent successor), which
 * rounds to Inf, exactly as IEEE 754 specifies overflow. NaN gives the canonical sign|0x7e00. */
static inline uint16_t ref_f32_to_f16(float x) {
  uint16_t sign = signbit(x) ? 0x8000 : 0;
  if (isnan(x)) return sign | 0x7e00;
  double a = fabs((double)x);
  uint16_t lo = 0, hi = 0x7bff; /* largest h with value(h) <= a */
  if (a >= 65504.0) {
    lo = 0x7bff;
  } else {
    while (lo < hi) {
      uint16_t mid = (uint16_t)((lo + hi + 1) / 2);
      if (ref_f16_value(mid) <= a)
        lo = mid;
      else
        hi = (uint16_t)(mid - 1);
    }
  }
  double vlo = ref_f16_value(lo);
  if (vlo == a) return sign | lo;
  uint16_t up = (uint16_t)(lo + 1); /* 0x7c00 (Inf) after 0x7bff */
  double vup = lo == 0x7bff ? 65536.0 : ref_f16_value(up);
  double dlo = a - vlo, dup = vup - a; /* exact: few significant bits */
  uint16_t r;
  if (dlo < dup)
    r = lo;
  else if (dup < dlo)
    r = up;
  else
    r = (lo & 1) ? up : lo;
  return sign | r;
}

/* Nearest bf16 to x, ties to even, the same way (neighbours are the truncation and the next
 * pattern up; past the largest bf16 the next neighbour is 2^128, i.e. Inf). NaN -> 0x7fc0. */
static inline uint16_t ref_f32_to_bf16(float x) {
  if (isnan(x)) return 0x7fc0;
  uint32_t u = fbits(x), sign = u & 0x80000000u, au = u & 0x7fffffffu;
  uint32_t lo = au & 0xffff0000u;
  if (lo == au) return (uint16_t)((sign | lo) >> 16);
  uint32_t up = lo + 0x10000u;
  double a = (double)bitsf(au), vlo = (double)bitsf(lo);
  double vup = up == 0x7f800000u ? ldexp(1.0, 128) : (double)bitsf(up);
  double dlo = a - vlo, dup = vup - a;
  uint32_t r;
  if (dlo < dup)
    r = lo;
  else if (dup < dlo)
    r = up;
  else
    r = ((lo >> 16) & 1) ? up : lo;
  return (uint16_t)((sign | r) >> 16);
}

/* ============================ reference kernels ============================ */

static inline size_t dsize(ac_dtype_t dt) { return dt == AC_F32 ? 4 : 2; }

static inline float ref_load(ac_dtype_t dt, const void *p, size_t i) {
  if (dt == AC_F32) return ((const float *)p)[i];
  uint16_t h = ((const uint16_t *)p)[i];
  if (dt == AC_BF16) return bitsf((uint32_t)h << 16);
  return (float)ref_f16_value(h);
}
static inline void ref_store(ac_dtype_t dt, void *p, size_t i, float v) {
  if (dt == AC_F32)
    ((float *)p)[i] = v;
  else if (dt == AC_F16)
    ((uint16_t *)p)[i] = ref_f32_to_f16(v);
  else
    ((uint16_t *)p)[i] = ref_f32_to_bf16(v);
}
static inline uint32_t raw_bits(ac_dtype_t dt, const void *p, size_t i) {
  return dt == AC_F32 ? ((const uint32_t *)p)[i] : ((const uint16_t *)p)[i];
}
static inline int raw_is_nan(ac_dtype_t dt, uint32_t b) {
  if (dt == AC_F32) return (b & 0x7fffffffu) > 0x7f800000u;
  return dt == AC_F16 ? f16_is_nan((uint16_t)b) : bf16_is_nan((uint16_t)b);
}

static inline ac_stats_t ref_stats(ac_dtype_t dt, const void *p, size_t n) {
  ac_stats_t s = {0.0, 0.0f, 0};
  for (size_t i = 0; i < n; i++) {
    float v = ref_load(dt, p, i);
    s.sumsq += (double)v * (double)v;
    if (isnan(v) || isinf(v)) s.nonfinite = 1;
    if (!isnan(v) && fabsf(v) > s.maxabs) s.maxabs = fabsf(v);
  }
  return s;
}

/* Compares two buffers of dtype dt element by element. Bitwise, except that with
 * nan_lenient any NaN matches any NaN (payloads are a separate, known issue).
 * Reports the first few mismatches through CHECK_MSG; returns the number of mismatches. */
static inline size_t cmp_bufs_at(const char *file, int line, ac_dtype_t dt, const void *got,
                                 const void *want, size_t n, int nan_lenient, const char *what) {
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < n; i++) {
    uint32_t g = raw_bits(dt, got, i), w = raw_bits(dt, want, i);
    if (g == w) continue;
    if (nan_lenient && raw_is_nan(dt, g) && raw_is_nan(dt, w)) continue;
    if (!bad) first = i;
    bad++;
  }
  TU_COUNT();
  if (bad)
    tu_fail(file, line, "buffers equal",
            "%s: %zu of %zu %s elements differ; first at %zu: got 0x%x, want 0x%x", what, bad, n,
            ac_dtype_name(dt), first, raw_bits(dt, got, first), raw_bits(dt, want, first));
  return bad;
}
#define CMP_BUFS(dt, got, want, n, lenient, what) \
  cmp_bufs_at(__FILE__, __LINE__, (dt), (got), (want), (n), (lenient), (what))

static inline int same_float_bits(float a, float b) { return fbits(a) == fbits(b); }

/* Stats equality: maxabs and nonfinite exact, sumsq within SUMSQ_REL (NaN == NaN). */
static inline void check_stats_at(const char *file, int line, ac_stats_t got, ac_stats_t want,
                                  const char *what) {
  TU_COUNT();
  if (!same_float_bits(got.maxabs, want.maxabs))
    tu_fail(file, line, "maxabs equal", "%s: maxabs %.9g (0x%08x) != %.9g (0x%08x)", what,
            (double)got.maxabs, fbits(got.maxabs), (double)want.maxabs, fbits(want.maxabs));
  TU_COUNT();
  if (got.nonfinite != want.nonfinite)
    tu_fail(file, line, "nonfinite equal", "%s: nonfinite %d != %d", what, got.nonfinite,
            want.nonfinite);
  TU_COUNT();
  int ok;
  if (isnan(got.sumsq) || isnan(want.sumsq))
    ok = isnan(got.sumsq) && isnan(want.sumsq);
  else if (got.sumsq == want.sumsq)
    ok = 1;
  else
    ok = fabs(got.sumsq - want.sumsq) <= SUMSQ_REL * fmax(fabs(got.sumsq), fabs(want.sumsq));
  if (!ok)
    tu_fail(file, line, "sumsq close", "%s: sumsq %.17g != %.17g (rel %.3g)", what, got.sumsq,
            want.sumsq, fabs(got.sumsq - want.sumsq) / fmax(fabs(got.sumsq), fabs(want.sumsq)));
}
#define CHECK_STATS(got, want, what) check_stats_at(__FILE__, __LINE__, (got), (want), (what))

/* ============================== test data ============================== */

/* Finite values over a wide range (with zeros, subnormals of the dtype, and exact fp16 / bf16
 * rounding ties sprinkled in for the casts), stored in dtype dt. */
static inline void fill_finite(ac_dtype_t dt, void *p, size_t n, uint64_t seed) {
  tu_rng_t r = {seed * 0x9E3779B97F4A7C15ULL + 12345};
  for (size_t i = 0; i < n; i++) {
    uint32_t k = tu_randn(&r, 1000);
    float v;
    if (k < 15) {
      v = k & 1 ? -0.0f : 0.0f;
    } else if (k < 30) { /* fp16 tie: midpoint of two neighbouring halves */
      uint16_t h = (uint16_t)tu_randn(&r, 0x7bfe); /* midpoints up to 65488 */
      v = (float)((ref_f16_value(h) + ref_f16_value((uint16_t)(h + 1))) / 2);
    } else if (k < 45) { /* bf16 tie */
      v = bitsf((tu_rand32(&r) & 0x7fff0000u) | 0x8000u);
      if (isinf(v) || isnan(v)) v = 1.5f;
    } else {
      int e = dt == AC_F16 ? -26 + (int)tu_randn(&r, 36) /* 2^-26 .. 2^9 */
                           : -40 + (int)tu_randn(&r, 60); /* 2^-40 .. 2^19 */
      v = ldexpf(1.0f + (float)(tu_rand32(&r) >> 9) * 0x1p-23f, e);
    }
    if (tu_rand32(&r) & 1) v = -v;
    ref_store(dt, p, i, v);
    if (!isfinite(ref_load(dt, p, i))) ref_store(dt, p, i, 1.5f); /* overflowed the dtype */
  }
}

/* Arbitrary bit patterns: NaNs with payloads, infinities, subnormals, everything. */
static inline void fill_bits(ac_dtype_t dt, void *p, size_t n, uint64_t seed) {
  tu_rng_t r = {seed * 0xD1B54A32D192ED03ULL + 99};
  for (size_t i = 0; i < n; i++) {
    uint32_t b = tu_rand32(&r);
    if (dt == AC_F32)
      ((uint32_t *)p)[i] = b;
    else
      ((uint16_t *)p)[i] = (uint16_t)b;
  }
}

static inline void *xmalloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) {
    printf("out of memory (%zu bytes)\n", bytes);
    exit(2);
  }
  return p;
}

/* ================================ ISAs ================================ */

static const char *const ISAS[] = {"scalar", "avx2"};
#define NISAS 2

/* Selects an ISA; returns 0 (and says so once) when "avx2" is not available here. */
static inline int use_isa(const char *name) {
  static int said;
  ac_result_t r = ac_kernels_set_isa(name);
  if (r == AC_OK) {
    CHECK_STREQ(ac_kernels_isa(), name);
    return 1;
  }
  CHECK_MSG(strcmp(name, "avx2") == 0 && r == AC_ERR_UNSUPPORTED, "set_isa(%s) -> %s: %s", name,
            ac_result_string(r), ac_last_error());
  if (!said++) printf("    note: AVX2 kernels unavailable on this CPU/build; only scalar tested\n");
  return 0;
}

/* The last test of every program that ran a kernel: stop the pool's workers so LeakSanitizer
 * has no live threads to scan at exit (after checking a kernel still runs on a restarted pool). */
static inline void kt_shutdown_pool(void) {
  ac_pool_shutdown();
  float x[1] = {2.0f};
  ac_stats_t s;
  CHECK_OK(ac_stats(AC_F32, x, 1, &s));
  CHECK(s.sumsq == 4.0);
  ac_pool_shutdown();
}

#endif /* AC_KERNELS_TEST_UTIL_H */

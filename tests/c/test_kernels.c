/* test_kernels.c — csrc/include/ac/kernels.h and the conversions of csrc/core/half.h.
 *
 * Every kernel result is compared with a naive reference written here (its own fp16/bf16
 * rounding, done with double arithmetic and neighbour comparison, not with half.h's bit
 * tricks), on both instruction sets; AVX2 results must equal the scalar ones bit for bit
 * (sums of squares: within 1e-12 relative, as the summation order differs). */
#define _POSIX_C_SOURCE 200809L /* clock_gettime under -std=c11 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ac/kernels.h"
#include "ac/pool.h"
#include "half.h"
#include "kernels_impl.h" /* ac_cpu_has_avx2, ac_kernels_avx2_table: what the default should be */
#include "test_util.h"

#define CHUNK 65536 /* kernels.c's AC_CHUNK: where work is split between pool tasks */
#define SUMSQ_REL 1e-12

static const ac_dtype_t DTYPES[] = {AC_F32, AC_F16, AC_BF16};
#define NDT 3
static const size_t SIZES[] = {0, 1, 7, 8, 9, 65535, 65536, 65537, 300000};
#define NSIZES (sizeof SIZES / sizeof SIZES[0])

/* ======================= independent reference conversions ======================= */

static uint32_t fbits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static float bitsf(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Value of a half bit pattern, by the IEEE 754 binary16 definition. */
static double ref_f16_value(uint16_t h) {
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
static int f16_is_nan(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0; }
static int bf16_is_nan(uint16_t h) { return (h & 0x7f80) == 0x7f80 && (h & 0x7f) != 0; }

/* Nearest representable half to x, ties to even, by comparing x with its two neighbours among
 * all finite halves (found by binary search over the monotone positive patterns). Beyond the
 * largest half (65504) the next "neighbour" is 65536 (the unbounded-exponent successor), which
 * rounds to Inf, exactly as IEEE 754 specifies overflow. NaN gives the canonical sign|0x7e00. */
static uint16_t ref_f32_to_f16(float x) {
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
static uint16_t ref_f32_to_bf16(float x) {
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

static size_t dsize(ac_dtype_t dt) { return dt == AC_F32 ? 4 : 2; }

static float ref_load(ac_dtype_t dt, const void *p, size_t i) {
  if (dt == AC_F32) return ((const float *)p)[i];
  uint16_t h = ((const uint16_t *)p)[i];
  if (dt == AC_BF16) return bitsf((uint32_t)h << 16);
  return (float)ref_f16_value(h);
}
static void ref_store(ac_dtype_t dt, void *p, size_t i, float v) {
  if (dt == AC_F32)
    ((float *)p)[i] = v;
  else if (dt == AC_F16)
    ((uint16_t *)p)[i] = ref_f32_to_f16(v);
  else
    ((uint16_t *)p)[i] = ref_f32_to_bf16(v);
}
static uint32_t raw_bits(ac_dtype_t dt, const void *p, size_t i) {
  return dt == AC_F32 ? ((const uint32_t *)p)[i] : ((const uint16_t *)p)[i];
}
static int raw_is_nan(ac_dtype_t dt, uint32_t b) {
  if (dt == AC_F32) return (b & 0x7fffffffu) > 0x7f800000u;
  return dt == AC_F16 ? f16_is_nan((uint16_t)b) : bf16_is_nan((uint16_t)b);
}

static ac_stats_t ref_stats(ac_dtype_t dt, const void *p, size_t n) {
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
static size_t cmp_bufs_at(const char *file, int line, ac_dtype_t dt, const void *got,
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

static int same_float_bits(float a, float b) { return fbits(a) == fbits(b); }

/* Stats equality: maxabs and nonfinite exact, sumsq within SUMSQ_REL (NaN == NaN). */
static void check_stats_at(const char *file, int line, ac_stats_t got, ac_stats_t want,
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
static void fill_finite(ac_dtype_t dt, void *p, size_t n, uint64_t seed) {
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
static void fill_bits(ac_dtype_t dt, void *p, size_t n, uint64_t seed) {
  tu_rng_t r = {seed * 0xD1B54A32D192ED03ULL + 99};
  for (size_t i = 0; i < n; i++) {
    uint32_t b = tu_rand32(&r);
    if (dt == AC_F32)
      ((uint32_t *)p)[i] = b;
    else
      ((uint16_t *)p)[i] = (uint16_t)b;
  }
}

static void *xmalloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) {
    printf("out of memory (%zu bytes)\n", bytes);
    exit(2);
  }
  return p;
}

/* ================================ ISAs ================================ */

static const char *ISAS[] = {"scalar", "avx2"};
#define NISAS 2

/* Selects an ISA; returns 0 (and says so once) when "avx2" is not available here. */
static int use_isa(const char *name) {
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

/* ============================== half.h tests ============================== */

/* Must be the first test: the ISA is chosen lazily on first use, from AC_KERNELS_ISA. */
TEST(isa_default_and_env) {
  const char *env = getenv("AC_KERNELS_ISA");
  int avx2_here = ac_cpu_has_avx2() && ac_kernels_avx2_table() != NULL;
  const char *want = (env && strcmp(env, "scalar") == 0) ? "scalar" : (avx2_here ? "avx2" : "scalar");
  printf("    AC_KERNELS_ISA=%s, CPU/build has AVX2+FMA+F16C: %d, ac_kernels_isa() = %s\n",
         env ? env : "(unset)", avx2_here, ac_kernels_isa());
  CHECK_STREQ(ac_kernels_isa(), want);
  /* A kernel call keeps the cached choice. */
  float x[3] = {1, 2, 3};
  ac_stats_t s;
  CHECK_OK(ac_stats(AC_F32, x, 3, &s));
  CHECK_STREQ(ac_kernels_isa(), want);
  /* ac_kernels_set_isa overrides the environment. */
  CHECK_OK(ac_kernels_set_isa("scalar"));
  CHECK_STREQ(ac_kernels_isa(), "scalar");
  ac_result_t r = ac_kernels_set_isa("avx2");
  if (avx2_here) {
    CHECK_OK(r);
    CHECK_STREQ(ac_kernels_isa(), "avx2");
  } else {
    CHECK_EQ_INT(r, AC_ERR_UNSUPPORTED);
    CHECK_STREQ(ac_kernels_isa(), "scalar"); /* a refused switch changes nothing */
  }
  CHECK_OK(ac_kernels_set_isa(want));
}

TEST(f16_exhaustive_roundtrip) {
  for (uint32_t b = 0; b <= 0xffff; b++) {
    uint16_t h = (uint16_t)b;
    float f = ac_f16_to_f32(h);
    if (f16_is_nan(h)) {
      CHECK_MSG(isnan(f), "0x%04x -> %a is not NaN", h, (double)f);
      CHECK_MSG(!!signbit(f) == !!(h & 0x8000), "0x%04x: NaN sign lost", h);
      uint16_t back = ac_f32_to_f16(f);
      CHECK_MSG(f16_is_nan(back), "0x%04x -> %08x -> 0x%04x is not NaN", h, fbits(f), back);
      continue;
    }
    double want = ref_f16_value(h);
    CHECK_MSG((double)f == want && !!signbit(f) == !!(h & 0x8000), "f16 0x%04x -> %a, want %a", h,
              (double)f, want);
    CHECK_MSG(ac_f32_to_f16(f) == h, "round trip 0x%04x -> %a -> 0x%04x", h, (double)f,
              ac_f32_to_f16(f));
    /* The reference agrees on every exactly representable value (checks the reference). */
    CHECK_MSG(ref_f32_to_f16(f) == h, "reference: 0x%04x -> 0x%04x", h, ref_f32_to_f16(f));
    if (tu_failed()) break;
  }
}

TEST(f16_all_ties_and_neighbours) {
  /* Every midpoint between consecutive finite halves (exact in fp32: 12 significant bits),
   * and the floats just below and above it; both signs. The last midpoint is 65520 (-> Inf). */
  for (uint32_t h = 0; h <= 0x7bff; h++) {
    float lo = (float)ref_f16_value((uint16_t)h);
    double vup = h == 0x7bff ? 65536.0 : ref_f16_value((uint16_t)(h + 1));
    float mid = (float)(((double)lo + vup) / 2);
    CHECK_MSG((double)mid == ((double)lo + vup) / 2, "midpoint after 0x%04x not exact", h);
    uint16_t up = (uint16_t)(h + 1);
    uint16_t even = (h & 1) ? up : (uint16_t)h;
    float below = nextafterf(mid, 0.0f), above = nextafterf(mid, INFINITY);
    for (int s = 0; s < 2; s++) {
      uint16_t sg = s ? 0x8000 : 0;
      float m = s ? -mid : mid, bl = s ? -below : below, ab = s ? -above : above;
      CHECK_MSG(ac_f32_to_f16(m) == (sg | even), "tie %a -> 0x%04x, want 0x%04x", (double)m,
                ac_f32_to_f16(m), sg | even);
      CHECK_MSG(ac_f32_to_f16(bl) == (sg | h), "%a -> 0x%04x, want 0x%04x", (double)bl,
                ac_f32_to_f16(bl), sg | h);
      CHECK_MSG(ac_f32_to_f16(ab) == (sg | up), "%a -> 0x%04x, want 0x%04x", (double)ab,
                ac_f32_to_f16(ab), sg | up);
      CHECK_MSG(ref_f32_to_f16(m) == (sg | even), "reference tie 0x%04x", h);
    }
    if (tu_failed()) break;
  }
}

TEST(f16_edge_cases) {
  static const struct {
    float x;
    uint16_t want;
    const char *what;
  } cases[] = {
      {65504.0f, 0x7bff, "max half"},
      {65519.99f, 0x7bff, "just below the overflow threshold"},
      {65520.0f, 0x7c00, "overflow threshold (tie -> Inf)"},
      {65536.0f, 0x7c00, "2^16"},
      {FLT_MAX, 0x7c00, "FLT_MAX"},
      {0x1p-24f, 0x0001, "smallest subnormal 2^-24"},
      {0x1p-25f, 0x0000, "2^-25: tie -> 0"},
      {0x1.000002p-25f, 0x0001, "just above 2^-25"},
      {0x1.8p-24f /* 3*2^-25 */, 0x0002, "3*2^-25: tie -> 2*2^-24"},
      {0x1.4p-23f /* 5*2^-25 */, 0x0002, "5*2^-25: tie -> 2*2^-24 (even)"},
      {0x1p-26f, 0x0000, "2^-26"},
      {0x1p-149f, 0x0000, "smallest fp32 subnormal"},
      {0x1.ff8p-15f /* 1023*2^-24 */, 0x03ff, "max subnormal"},
      {0x1.ffcp-15f /* 1023.5*2^-24 */, 0x0400, "max subnormal + half step: tie -> min normal"},
      {0x1p-14f, 0x0400, "min normal"},
      {0x1.004p-14f, 0x0401, "min normal + 1 ulp"},
      {0x1.002p-14f, 0x0400, "min normal + half ulp: tie -> even (min normal)"},
      {0x1.006p-14f, 0x0402, "min normal + 1.5 ulp: tie -> even"},
      {1.0f, 0x3c00, "1"},
      {1.0f + 0x1p-11f, 0x3c00, "1 + half ulp: tie -> even (1)"},
      {1.0f + 3 * 0x1p-11f, 0x3c02, "1 + 1.5 ulp: tie -> even (1 + 2 ulp)"},
      {0.1f, 0x2e66, "0.1"},
      {0.0f, 0x0000, "+0"},
      {-0.0f, 0x8000, "-0"},
      {-65504.0f, 0xfbff, "-max half"},
      {-65520.0f, 0xfc00, "-65520 -> -Inf"},
      {-0x1p-24f, 0x8001, "-2^-24"},
      {-0x1p-25f, 0x8000, "-2^-25 -> -0"},
      {INFINITY, 0x7c00, "+Inf"},
      {-INFINITY, 0xfc00, "-Inf"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    CHECK_MSG(ac_f32_to_f16(cases[i].x) == cases[i].want, "%s: %a -> 0x%04x, want 0x%04x",
              cases[i].what, (double)cases[i].x, ac_f32_to_f16(cases[i].x), cases[i].want);
    CHECK_MSG(ref_f32_to_f16(cases[i].x) == cases[i].want, "reference: %s", cases[i].what);
  }
  /* NaN: quiet, sign kept, canonical 0x7e00 as half.h documents (torch's c10::Half). */
  CHECK_EQ_HEX(ac_f32_to_f16(NAN), 0x7e00);
  CHECK_EQ_HEX(ac_f32_to_f16(bitsf(0x7fc00000u)), 0x7e00);
  CHECK_EQ_HEX(ac_f32_to_f16(bitsf(0x7f800001u)), 0x7e00); /* signalling, tiny payload */
  CHECK_EQ_HEX(ac_f32_to_f16(bitsf(0x7fffffffu)), 0x7e00);
  CHECK_EQ_HEX(ac_f32_to_f16(bitsf(0xffc00000u)), 0xfe00);
  /* fp16 -> fp32 specials */
  CHECK(ac_f16_to_f32(0x7c00) == INFINITY);
  CHECK(ac_f16_to_f32(0xfc00) == -INFINITY);
  CHECK(ac_f16_to_f32(0x0001) == 0x1p-24f);
  CHECK(ac_f16_to_f32(0x03ff) == 0x1.ff8p-15f);
  CHECK(ac_f16_to_f32(0x7bff) == 65504.0f);
  CHECK(isnan(ac_f16_to_f32(0x7e00)) && isnan(ac_f16_to_f32(0x7c01)));
  CHECK_EQ_HEX(fbits(ac_f16_to_f32(0x8000)), 0x80000000u);
}

TEST(f16_random_vs_reference) {
  tu_rng_t r = {0x1234567};
  enum { N = 1 << 20 };
  for (int i = 0; i < N; i++) {
    uint32_t b = tu_rand32(&r);
    if (i & 1) /* half the samples in and around the fp16 range: exponents 2^-27 .. 2^17 */
      b = (b & 0x807fffffu) | ((uint32_t)(100 + tu_randn(&r, 45)) << 23);
    float x = bitsf(b);
    uint16_t got = ac_f32_to_f16(x), want = ref_f32_to_f16(x);
    if (isnan(x))
      CHECK_MSG(f16_is_nan(got) && (got & 0x8000) == (want & 0x8000), "NaN 0x%08x -> 0x%04x", b,
                got);
    else
      CHECK_MSG(got == want, "fp32 0x%08x (%a) -> 0x%04x, reference 0x%04x", b, (double)x, got,
                want);
    if (tu_failed()) break;
  }
}

TEST(bf16_exhaustive_roundtrip) {
  for (uint32_t b = 0; b <= 0xffff; b++) {
    uint16_t h = (uint16_t)b;
    float f = ac_bf16_to_f32(h);
    CHECK_EQ_HEX(fbits(f), b << 16);
    uint16_t back = ac_f32_to_bf16(f);
    if (bf16_is_nan(h))
      CHECK_MSG(back == 0x7fc0, "NaN 0x%04x -> 0x%04x, want 0x7fc0", h, back);
    else
      CHECK_MSG(back == h, "round trip 0x%04x -> 0x%04x", h, back);
    if (tu_failed()) break;
  }
}

TEST(bf16_edge_cases) {
  static const struct {
    uint32_t x;
    uint16_t want;
    const char *what;
  } cases[] = {
      {0x3f800000u, 0x3f80, "1"},
      {0x3f808000u, 0x3f80, "tie, even below -> down"},
      {0x3f818000u, 0x3f82, "tie, odd below -> up"},
      {0x3f808001u, 0x3f81, "just above a tie"},
      {0x3f807fffu, 0x3f80, "just below a tie"},
      {0xbf818000u, 0xbf82, "negative tie -> up in magnitude"},
      {0x7f7fffffu, 0x7f80, "FLT_MAX -> Inf"},
      {0x7f7f8000u, 0x7f80, "tie below overflow (0x7f7f odd) -> Inf"},
      {0x7f7f7fffu, 0x7f7f, "largest value that stays finite"},
      {0xff7fffffu, 0xff80, "-FLT_MAX -> -Inf"},
      {0x7f800000u, 0x7f80, "+Inf"},
      {0xff800000u, 0xff80, "-Inf"},
      {0x00000000u, 0x0000, "+0"},
      {0x80000000u, 0x8000, "-0"},
      {0x00000001u, 0x0000, "smallest fp32 subnormal -> 0"},
      {0x00008000u, 0x0000, "subnormal tie -> even (0)"},
      {0x00018000u, 0x0002, "subnormal tie -> even (2)"},
      {0x007fffffu, 0x0080, "max fp32 subnormal -> min normal"},
      {0x7fc00000u, 0x7fc0, "quiet NaN"},
      {0x7f800001u, 0x7fc0, "signalling NaN, payload 1 (truncation would give Inf)"},
      {0x7fffffffu, 0x7fc0, "NaN, all payload bits"},
      {0xffc00000u, 0x7fc0, "negative NaN -> canonical positive 0x7fc0"},
      {0xff800001u, 0x7fc0, "negative signalling NaN"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    float x = bitsf(cases[i].x);
    CHECK_MSG(ac_f32_to_bf16(x) == cases[i].want, "%s: 0x%08x -> 0x%04x, want 0x%04x",
              cases[i].what, cases[i].x, ac_f32_to_bf16(x), cases[i].want);
    CHECK_MSG(ref_f32_to_bf16(x) == cases[i].want, "reference: %s", cases[i].what);
  }
}

TEST(bf16_random_vs_reference) {
  tu_rng_t r = {0xabcdef};
  enum { N = 1 << 20 };
  for (int i = 0; i < N; i++) {
    uint32_t b = tu_rand32(&r);
    if (i % 4 == 0) b = (b & 0xffff0000u) | 0x8000u; /* ties */
    if (i % 4 == 1) b |= 0x7f000000u;                /* near overflow / NaN */
    float x = bitsf(b);
    CHECK_MSG(ac_f32_to_bf16(x) == ref_f32_to_bf16(x), "0x%08x -> 0x%04x, reference 0x%04x", b,
              ac_f32_to_bf16(x), ref_f32_to_bf16(x));
    if (tu_failed()) break;
  }
}

/* ============================== kernel tests ============================== */

TEST(dtype_size_and_name) {
  CHECK_EQ_INT(ac_dtype_size(AC_F32), 4);
  CHECK_EQ_INT(ac_dtype_size(AC_F16), 2);
  CHECK_EQ_INT(ac_dtype_size(AC_BF16), 2);
  CHECK_EQ_INT(ac_dtype_size((ac_dtype_t)7), 0);
  CHECK_EQ_INT(ac_dtype_size((ac_dtype_t)-1), 0);
  CHECK_STREQ(ac_dtype_name(AC_F32), "float32");
  CHECK_STREQ(ac_dtype_name(AC_F16), "float16");
  CHECK_STREQ(ac_dtype_name(AC_BF16), "bfloat16");
  CHECK_STREQ(ac_dtype_name((ac_dtype_t)7), "invalid");
}

static const float FACTORS[] = {0.37f, 3.0e4f, 0x1p-20f};
#define NFACTORS 3

/* For one dtype and size: every kernel on every ISA against the reference; AVX2 vs scalar.
 * Finite input data. */
static void kernels_case(ac_dtype_t dt, size_t n, uint64_t seed) {
  size_t es = dsize(dt);
  char what[160];
  unsigned char *data = xmalloc(n * es), *work = xmalloc(n * es), *want = xmalloc(n * 4);
  unsigned char *out = xmalloc(n * 4);
  fill_finite(dt, data, n, seed);
  ac_stats_t ref = ref_stats(dt, data, n);
  CHECK(!ref.nonfinite);

  /* reference outputs, computed once per case */
  unsigned char *ref_scaled[NFACTORS];
  ac_stats_t ref_scaled_stats[NFACTORS];
  for (int f = 0; f < NFACTORS; f++) {
    ref_scaled[f] = xmalloc(n * es);
    for (size_t i = 0; i < n; i++) ref_store(dt, ref_scaled[f], i, ref_load(dt, data, i) * FACTORS[f]);
    ref_scaled_stats[f] = ref_stats(dt, ref_scaled[f], n);
  }

  ac_stats_t isa_stats[NISAS], isa_ss[NISAS][NFACTORS];
  int ran[NISAS] = {0, 0};
  for (int k = 0; k < NISAS; k++) {
    if (!use_isa(ISAS[k])) continue;
    ran[k] = 1;
    const char *isa = ISAS[k];

    snprintf(what, sizeof what, "%s stats %s n=%zu", isa, ac_dtype_name(dt), n);
    ac_stats_t s = {-1.0, -1.0f, -1};
    CHECK_OK(ac_stats(dt, data, n, &s));
    CHECK_STATS(s, ref, what);
    isa_stats[k] = s;

    int found = -1;
    CHECK_OK(ac_nonfinite(dt, data, n, &found));
    CHECK_MSG(found == 0, "%s nonfinite %s n=%zu: %d", isa, ac_dtype_name(dt), n, found);

    for (int f = 0; f < NFACTORS; f++) {
      snprintf(what, sizeof what, "%s scale x%g %s n=%zu", isa, (double)FACTORS[f],
               ac_dtype_name(dt), n);
      memcpy(work, data, n * es);
      CHECK_OK(ac_scale(dt, work, n, FACTORS[f]));
      CMP_BUFS(dt, work, ref_scaled[f], n, 0, what);

      snprintf(what, sizeof what, "%s scale_stats x%g %s n=%zu", isa, (double)FACTORS[f],
               ac_dtype_name(dt), n);
      memcpy(work, data, n * es);
      ac_stats_t ss = {-1.0, -1.0f, -1};
      CHECK_OK(ac_scale_stats(dt, work, n, FACTORS[f], &ss));
      CMP_BUFS(dt, work, ref_scaled[f], n, 0, what);
      CHECK_STATS(ss, ref_scaled_stats[f], what);
      isa_ss[k][f] = ss;
    }

    for (int d = 0; d < NDT; d++) {
      ac_dtype_t dst = DTYPES[d];
      snprintf(what, sizeof what, "%s cast %s -> %s n=%zu", isa, ac_dtype_name(dt),
               ac_dtype_name(dst), n);
      for (size_t i = 0; i < n; i++) ref_store(dst, want, i, ref_load(dt, data, i));
      memset(out, 0xA5, n * 4);
      CHECK_OK(ac_cast(dt, data, dst, out, n));
      CMP_BUFS(dst, out, want, n, 0, what);
      /* nothing written past the end */
      CHECK_MSG(n * dsize(dst) == n * 4 || out[n * dsize(dst)] == 0xA5 || n == 0,
                "%s wrote past the end", what);
    }
  }
  /* AVX2 against scalar: outputs were each compared bitwise with the same reference, so they
   * are bitwise equal; the statistics are compared here directly. */
  if (ran[0] && ran[1]) {
    snprintf(what, sizeof what, "avx2 vs scalar stats %s n=%zu", ac_dtype_name(dt), n);
    CHECK_STATS(isa_stats[1], isa_stats[0], what);
    for (int f = 0; f < NFACTORS; f++) CHECK_STATS(isa_ss[1][f], isa_ss[0][f], what);
  }
  for (int f = 0; f < NFACTORS; f++) free(ref_scaled[f]);
  free(data);
  free(work);
  free(want);
  free(out);
}

TEST(kernels_all_dtypes_sizes_isas) {
  for (int d = 0; d < NDT; d++)
    for (size_t s = 0; s < NSIZES; s++) kernels_case(DTYPES[d], SIZES[s], 1000 * d + s);
  ac_kernels_set_isa("scalar");
}

/* Arbitrary bit patterns (NaN payloads, Inf, subnormals) through every kernel: each ISA
 * against the reference (NaN matches NaN), and AVX2 against scalar bit for bit on everything
 * except NaN payloads (nan_payload_same_on_both_isas checks those separately). */
TEST(kernels_random_bits_both_isas) {
  static const size_t sizes[] = {9, 65537 + 13};
  char what[160];
  for (int d = 0; d < NDT; d++) {
    ac_dtype_t dt = DTYPES[d];
    size_t es = dsize(dt);
    for (size_t si = 0; si < 2; si++) {
      size_t n = sizes[si];
      unsigned char *data = xmalloc(n * es), *work[NISAS], *cast[NISAS][NDT], *want = xmalloc(n * 4);
      fill_bits(dt, data, n, 77 + d * 10 + si);
      ac_stats_t ref = ref_stats(dt, data, n), st[NISAS], ss[NISAS];
      int ran[NISAS] = {0, 0};
      for (int k = 0; k < NISAS; k++) {
        work[k] = xmalloc(n * es);
        for (int e = 0; e < NDT; e++) cast[k][e] = xmalloc(n * 4);
        if (!use_isa(ISAS[k])) continue;
        ran[k] = 1;
        snprintf(what, sizeof what, "%s random-bits %s n=%zu", ISAS[k], ac_dtype_name(dt), n);
        CHECK_OK(ac_stats(dt, data, n, &st[k]));
        CHECK_STATS(st[k], ref, what);
        int found = 0;
        CHECK_OK(ac_nonfinite(dt, data, n, &found));
        CHECK_EQ_INT(found, ref.nonfinite);
        memcpy(work[k], data, n * es);
        CHECK_OK(ac_scale_stats(dt, work[k], n, 0.5f, &ss[k]));
        for (size_t i = 0; i < n; i++) ref_store(dt, want, i, ref_load(dt, data, i) * 0.5f);
        CMP_BUFS(dt, work[k], want, n, 1, what);
        CHECK_STATS(ss[k], ref_stats(dt, want, n), what);
        for (int e = 0; e < NDT; e++) {
          CHECK_OK(ac_cast(dt, data, DTYPES[e], cast[k][e], n));
          for (size_t i = 0; i < n; i++) ref_store(DTYPES[e], want, i, ref_load(dt, data, i));
          snprintf(what, sizeof what, "%s random-bits cast %s -> %s n=%zu", ISAS[k],
                   ac_dtype_name(dt), ac_dtype_name(DTYPES[e]), n);
          CMP_BUFS(DTYPES[e], cast[k][e], want, n, 1, what);
        }
      }
      if (ran[0] && ran[1]) {
        snprintf(what, sizeof what, "avx2 vs scalar random-bits %s n=%zu", ac_dtype_name(dt), n);
        CHECK_STATS(st[1], st[0], what);
        CHECK_STATS(ss[1], ss[0], what);
        CMP_BUFS(dt, work[1], work[0], n, 1, what);
        for (int e = 0; e < NDT; e++) CMP_BUFS(DTYPES[e], cast[1][e], cast[0][e], n, 1, what);
      }
      for (int k = 0; k < NISAS; k++) {
        free(work[k]);
        for (int e = 0; e < NDT; e++) free(cast[k][e]);
      }
      free(data);
      free(want);
    }
  }
  ac_kernels_set_isa("scalar");
}

/* NaN payloads: the scalar path canonicalises every NaN stored as fp16 to sign|0x7e00 (half.h:
 * "NaN -> 0x7e00", torch's c10::Half), but the AVX2 path's F16C instructions keep the payload
 * (fp32 0x7f812346 -> 0x7e09, fp16 0x7c01 * 2 -> 0x7e01, bf16 0x7f81 -> fp16 0x7e08); and
 * fp16 -> fp32 of a signalling NaN gives 0x7f802000 (scalar, still signalling) vs 0x7fc02000
 * (F16C, quiet). Results then depend on the ISA, contrary to "AVX2 == scalar bit for bit". */
TEST(nan_payload_same_on_both_isas) {
  if (ac_kernels_set_isa("avx2") != AC_OK) {
    printf("    (no AVX2: nothing to compare)\n");
    return;
  }
  enum { N = 2 * 2046 + 2 * 254 + 64 };
  uint16_t h16[N], hb16[N];
  uint32_t f32[N];
  size_t n16 = 0, nb = 0;
  for (uint32_t b = 0; b <= 0xffff; b++) {
    if (f16_is_nan((uint16_t)b)) h16[n16++] = (uint16_t)b;
    if (bf16_is_nan((uint16_t)b)) hb16[nb++] = (uint16_t)b;
  }
  tu_rng_t r = {42};
  for (size_t i = 0; i < N; i++) f32[i] = (tu_rand32(&r) | 0x7f800000u) | (i & 1 ? 0x80000000u : 0);
  f32[0] = 0x7f800001u;
  f32[1] = 0xffffffffu;
  static unsigned char out[2][N * 4];
  struct {
    ac_dtype_t src;
    const void *p;
    size_t n;
  } srcs[] = {{AC_F16, h16, n16}, {AC_BF16, hb16, nb}, {AC_F32, f32, N}};
  for (int s = 0; s < 3; s++) {
    for (int d = 0; d < NDT; d++) {
      if (DTYPES[d] == srcs[s].src) continue;
      for (int k = 0; k < NISAS; k++) {
        ac_kernels_set_isa(ISAS[k]);
        CHECK_OK(ac_cast(srcs[s].src, srcs[s].p, DTYPES[d], out[k], srcs[s].n));
      }
      char what[96];
      snprintf(what, sizeof what, "NaN cast %s -> %s, avx2 vs scalar", ac_dtype_name(srcs[s].src),
               ac_dtype_name(DTYPES[d]));
      CMP_BUFS(DTYPES[d], out[1], out[0], srcs[s].n, 0, what);
    }
    for (int k = 0; k < NISAS; k++) {
      ac_kernels_set_isa(ISAS[k]);
      memcpy(out[k], srcs[s].p, srcs[s].n * dsize(srcs[s].src));
      CHECK_OK(ac_scale(srcs[s].src, out[k], srcs[s].n, 2.0f));
    }
    char what[96];
    snprintf(what, sizeof what, "NaN scale %s, avx2 vs scalar", ac_dtype_name(srcs[s].src));
    CMP_BUFS(srcs[s].src, out[1], out[0], srcs[s].n, 0, what);
  }
  ac_kernels_set_isa("scalar");
}

/* NaN / Inf at the first, last and middle element and on both sides of chunk boundaries. */
TEST(nonfinite_positions) {
  const size_t n = 3 * CHUNK + 5;
  const size_t pos[] = {0, n - 1, n / 2, CHUNK - 1, CHUNK, 2 * CHUNK - 1, 2 * CHUNK, 3 * CHUNK};
  const float vals[] = {NAN, INFINITY, -INFINITY};
  char what[160];
  for (int d = 0; d < NDT; d++) {
    ac_dtype_t dt = DTYPES[d];
    size_t es = dsize(dt);
    unsigned char *data = xmalloc(n * es), *work = xmalloc(n * es);
    fill_finite(dt, data, n, 555 + d);
    for (size_t p = 0; p < sizeof pos / sizeof pos[0]; p++) {
      for (int v = 0; v < 3; v++) {
        unsigned char saved[4];
        memcpy(saved, data + pos[p] * es, es);
        ref_store(dt, data, pos[p], vals[v]);
        ac_stats_t ref = ref_stats(dt, data, n);
        CHECK(ref.nonfinite == 1);
        for (int k = 0; k < NISAS; k++) {
          if (!use_isa(ISAS[k])) continue;
          snprintf(what, sizeof what, "%s %s %g at %zu of %zu", ISAS[k], ac_dtype_name(dt),
                   (double)vals[v], pos[p], n);
          int found = 0;
          CHECK_OK(ac_nonfinite(dt, data, n, &found));
          CHECK_MSG(found == 1, "%s: ac_nonfinite found %d", what, found);
          ac_stats_t s;
          CHECK_OK(ac_stats(dt, data, n, &s));
          CHECK_STATS(s, ref, what);
          if (isnan(vals[v]))
            CHECK_MSG(!isnan(s.maxabs) && s.maxabs < INFINITY, "%s: maxabs %g", what,
                      (double)s.maxabs);
          else
            CHECK_MSG(s.maxabs == INFINITY, "%s: maxabs %g", what, (double)s.maxabs);
          memcpy(work, data, n * es);
          ac_stats_t ss;
          CHECK_OK(ac_scale_stats(dt, work, n, 1.0f, &ss));
          CHECK_MSG(ss.nonfinite == 1, "%s: scale_stats nonfinite %d", what, ss.nonfinite);
        }
        memcpy(data + pos[p] * es, saved, es);
      }
    }
    /* Overflow caused by the scaling itself, at a chunk boundary: 60000 * 2 > 65504 in fp16,
     * 3e38 * 2 > FLT_MAX in fp32/bf16. */
    memset(data, 0, n * es);
    ref_store(dt, data, CHUNK, dt == AC_F16 ? 60000.0f : 3.0e38f);
    for (int k = 0; k < NISAS; k++) {
      if (!use_isa(ISAS[k])) continue;
      memcpy(work, data, n * es);
      ac_stats_t ss;
      CHECK_OK(ac_scale_stats(dt, work, n, 2.0f, &ss));
      CHECK_MSG(ss.nonfinite == 1 && ss.maxabs == INFINITY, "%s %s overflow by scaling: nf %d max %g",
                ISAS[k], ac_dtype_name(dt), ss.nonfinite, (double)ss.maxabs);
      int found = 0;
      CHECK_OK(ac_nonfinite(dt, work, n, &found));
      CHECK_EQ_INT(found, 1);
      /* inf * 0 = NaN: the flag sees the NaN the scaling produced. */
      CHECK_OK(ac_scale_stats(dt, work, n, 0.0f, &ss));
      CHECK_MSG(ss.nonfinite == 1 && isnan(ss.sumsq) && ss.maxabs == 0.0f,
                "%s %s inf*0: nf %d sumsq %g max %g", ISAS[k], ac_dtype_name(dt), ss.nonfinite,
                ss.sumsq, (double)ss.maxabs);
    }
    free(data);
    free(work);
  }
  ac_kernels_set_isa("scalar");
}

/* maxabs ignores NaN wherever it is (vector body or scalar tail, before or after the max). */
TEST(maxabs_ignores_nan) {
  for (int d = 0; d < NDT; d++) {
    ac_dtype_t dt = DTYPES[d];
    for (size_t n = 1; n <= 40; n++) {
      unsigned char buf[40 * 4];
      for (size_t i = 0; i < n; i++) ref_store(dt, buf, i, (i % 3 == 0) ? NAN : -(float)(i % 7));
      float want = 0;
      for (size_t i = 0; i < n; i++)
        if (i % 3 != 0 && (float)(i % 7) > want) want = (float)(i % 7);
      for (int k = 0; k < NISAS; k++) {
        if (!use_isa(ISAS[k])) continue;
        ac_stats_t s;
        CHECK_OK(ac_stats(dt, buf, n, &s));
        CHECK_MSG(same_float_bits(s.maxabs, want) && s.nonfinite == 1 && isnan(s.sumsq),
                  "%s %s n=%zu: maxabs %g want %g nf %d sumsq %g", ISAS[k], ac_dtype_name(dt), n,
                  (double)s.maxabs, (double)want, s.nonfinite, s.sumsq);
      }
      /* all NaN -> maxabs 0 */
      for (size_t i = 0; i < n; i++) ref_store(dt, buf, i, -NAN);
      for (int k = 0; k < NISAS; k++) {
        if (!use_isa(ISAS[k])) continue;
        ac_stats_t s;
        CHECK_OK(ac_stats(dt, buf, n, &s));
        CHECK_MSG(same_float_bits(s.maxabs, 0.0f) && s.nonfinite == 1,
                  "%s %s all-NaN n=%zu: maxabs %g nf %d", ISAS[k], ac_dtype_name(dt), n,
                  (double)s.maxabs, s.nonfinite);
      }
      /* -0 only -> maxabs +0, finite */
      for (size_t i = 0; i < n; i++) ref_store(dt, buf, i, -0.0f);
      for (int k = 0; k < NISAS; k++) {
        if (!use_isa(ISAS[k])) continue;
        ac_stats_t s;
        CHECK_OK(ac_stats(dt, buf, n, &s));
        CHECK_MSG(same_float_bits(s.maxabs, 0.0f) && s.nonfinite == 0 && s.sumsq == 0.0,
                  "%s %s -0 n=%zu", ISAS[k], ac_dtype_name(dt), n);
      }
    }
  }
  ac_kernels_set_isa("scalar");
}

/* ac_sumsq: bitwise identical on both ISAs and all thread counts; within 1e-6 of the double
 * sum on finite data (fp32 blocks); the non-finite flag exact, including a NaN or Inf in any
 * block or tail position, and finite values whose squares overflow fp32 (redone in double). */
TEST(sumsq_fast_pass) {
  static const size_t sizes[] = {0, 1, 127, 128, 129, 1000, 65536, 65536 + 129, 300001};
  int before = ac_pool_get_threads();
  for (int d = 0; d < NDT; d++) {
    ac_dtype_t dt = DTYPES[d];
    size_t es = dsize(dt);
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
      size_t n = sizes[si];
      unsigned char *data = xmalloc(n * es);
      fill_finite(dt, data, n, 777 + d * 31 + si);
      ac_stats_t ref = ref_stats(dt, data, n);
      double first = 0.0;
      int have_first = 0;
      for (int k = 0; k < NISAS; k++) {
        if (!use_isa(ISAS[k])) continue;
        for (int t = 1; t <= 4; t *= 2) {
          CHECK_OK(ac_pool_set_threads(t));
          double sq = -1.0;
          int nf = -1;
          CHECK_OK(ac_sumsq(dt, data, n, &sq, &nf));
          CHECK_MSG(nf == 0, "%s n=%zu: finite data flagged", ac_dtype_name(dt), n);
          CHECK_MSG(fabs(sq - ref.sumsq) <= 1e-6 * ref.sumsq, "%s %s n=%zu: sumsq %.17g vs double %.17g",
                    ISAS[k], ac_dtype_name(dt), n, sq, ref.sumsq);
          if (!have_first) {
            first = sq;
            have_first = 1;
          }
          CHECK_MSG(memcmp(&sq, &first, sizeof sq) == 0, "%s %s n=%zu threads=%d: %.17g differs from %.17g",
                    ISAS[k], ac_dtype_name(dt), n, t, sq, first);
        }
      }
      /* one bad value at several positions: NaN, +Inf, -Inf */
      size_t spots[] = {0, n / 2, n ? n - 1 : 0, 127, 128, 65535, 65536};
      for (size_t q = 0; n && q < sizeof spots / sizeof spots[0]; q++) {
        if (spots[q] >= n) continue;
        for (int b = 0; b < 3; b++) {
          unsigned char *bad = xmalloc(n * es);
          memcpy(bad, data, n * es);
          float v = b == 0 ? NAN : (b == 1 ? INFINITY : -INFINITY);
          ref_store(dt, bad, spots[q], v);
          for (int k = 0; k < NISAS; k++) {
            if (!use_isa(ISAS[k])) continue;
            double sq;
            int nf = 0, found = 0;
            CHECK_OK(ac_sumsq(dt, bad, n, &sq, &nf));
            CHECK_OK(ac_nonfinite(dt, bad, n, &found));
            CHECK_MSG(nf == 1 && found == 1, "%s %s n=%zu: %g at %zu not flagged", ISAS[k], ac_dtype_name(dt),
                      n, (double)v, spots[q]);
          }
          free(bad);
        }
      }
      free(data);
    }
  }
  /* finite fp32 values whose squares overflow fp32: the block is redone in double */
  {
    size_t n = 1000;
    float *big = xmalloc(n * sizeof *big);
    for (size_t i = 0; i < n; i++) big[i] = (i % 7 == 0) ? 3e20f : 1.0f;
    ac_stats_t ref = ref_stats(AC_F32, big, n);
    for (int k = 0; k < NISAS; k++) {
      if (!use_isa(ISAS[k])) continue;
      double sq;
      int nf = 1;
      CHECK_OK(ac_sumsq(AC_F32, big, n, &sq, &nf));
      CHECK_MSG(nf == 0 && isfinite(sq), "%s: overflowing squares misreported (nf=%d, %g)", ISAS[k], nf, sq);
      CHECK_MSG(fabs(sq - ref.sumsq) <= 1e-12 * ref.sumsq, "%s: %.17g vs %.17g", ISAS[k], sq, ref.sumsq);
    }
    free(big);
  }
  double sq;
  int nf;
  CHECK_RC(ac_sumsq(AC_F32, NULL, 5, &sq, &nf), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_sumsq(AC_F32, &sq, 1, NULL, &nf), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_sumsq((ac_dtype_t)7, &sq, 1, &sq, &nf), AC_ERR_INVALID_ARG);
  CHECK_OK(ac_pool_set_threads(before));
  ac_kernels_set_isa("scalar");
}

/* Same results whatever the thread count (fixed chunking, ordered combination). */
TEST(deterministic_across_thread_counts) {
  const size_t n = 1000003;
  static const int threads[] = {1, 2, 4};
  int before = ac_pool_get_threads();
  for (int d = 0; d < NDT; d++) {
    ac_dtype_t dt = DTYPES[d];
    size_t es = dsize(dt);
    unsigned char *data = xmalloc(n * es), *work = xmalloc(n * es), *first_scaled = xmalloc(n * es);
    unsigned char *cast = xmalloc(n * 4), *first_cast = xmalloc(n * 4);
    fill_finite(dt, data, n, 4242 + d);
    ac_dtype_t dst = dt == AC_F32 ? AC_F16 : AC_F32;
    for (int k = 0; k < NISAS; k++) {
      if (!use_isa(ISAS[k])) continue;
      ac_stats_t first = {0}, first_ss = {0};
      for (int t = 0; t < 3; t++) {
        CHECK_OK(ac_pool_set_threads(threads[t]));
        ac_stats_t s, ss;
        CHECK_OK(ac_stats(dt, data, n, &s));
        memcpy(work, data, n * es);
        CHECK_OK(ac_scale_stats(dt, work, n, 0.75f, &ss));
        CHECK_OK(ac_cast(dt, data, dst, cast, n));
        if (t == 0) {
          first = s;
          first_ss = ss;
          memcpy(first_scaled, work, n * es);
          memcpy(first_cast, cast, n * dsize(dst));
          continue;
        }
        CHECK_MSG(memcmp(&s.sumsq, &first.sumsq, sizeof s.sumsq) == 0,
                  "%s %s: sumsq with %d threads %.17g != %.17g with 1", ISAS[k], ac_dtype_name(dt),
                  threads[t], s.sumsq, first.sumsq);
        CHECK(same_float_bits(s.maxabs, first.maxabs) && s.nonfinite == first.nonfinite);
        CHECK_MSG(memcmp(&ss.sumsq, &first_ss.sumsq, sizeof ss.sumsq) == 0,
                  "%s %s: scale_stats sumsq with %d threads differs", ISAS[k], ac_dtype_name(dt),
                  threads[t]);
        CHECK(memcmp(work, first_scaled, n * es) == 0);
        CHECK(memcmp(cast, first_cast, n * dsize(dst)) == 0);
      }
      /* and the reference agrees */
      char what[96];
      snprintf(what, sizeof what, "%s %s n=%zu", ISAS[k], ac_dtype_name(dt), n);
      CHECK_STATS(first, ref_stats(dt, data, n), what);
    }
    free(data);
    free(work);
    free(first_scaled);
    free(cast);
    free(first_cast);
  }
  CHECK_OK(ac_pool_set_threads(before));
  ac_kernels_set_isa("scalar");
}

/* More chunks than kernels.c keeps on the stack (256): the partial results go to the heap. */
TEST(many_chunks_heap_partials) {
  const size_t n = 257 * (size_t)CHUNK + 3;
  uint16_t *data = xmalloc(n * 2);
  fill_finite(AC_BF16, data, n, 31337);
  for (int pass = 0; pass < 2; pass++) {
    data[n - 1] = pass == 0 ? 0x7f80 /* +Inf in the very last chunk */ : 0x3f80 /* 1.0 */;
    ac_stats_t ref = ref_stats(AC_BF16, data, n);
    CHECK_EQ_INT(ref.nonfinite, pass == 0);
    for (int k = 0; k < NISAS; k++) {
      if (!use_isa(ISAS[k])) continue;
      ac_stats_t s;
      CHECK_OK(ac_stats(AC_BF16, data, n, &s));
      CHECK_STATS(s, ref, ISAS[k]);
    }
  }
  free(data);
  ac_kernels_set_isa("scalar");
}

/* ================================ errors ================================ */

TEST(errors) {
  float buf[16] = {0};
  ac_stats_t s;
  int found;
  const ac_dtype_t bad = (ac_dtype_t)7;

  ac_clear_error();
  CHECK_RC(ac_stats(bad, buf, 4, &s), AC_ERR_INVALID_ARG);
  CHECK(ac_last_error()[0] != '\0');
  CHECK_CONTAINS(ac_last_error(), "kernels.c");
  CHECK_CONTAINS(ac_last_error(), "dtype");
  ac_clear_error();
  CHECK_RC(ac_scale(bad, buf, 4, 2.0f), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "kernels.c");
  CHECK_RC(ac_scale_stats(bad, buf, 4, 2.0f, &s), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_nonfinite(bad, buf, 4, &found), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_cast(bad, buf, AC_F32, buf + 8, 4), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_cast(AC_F32, buf, bad, buf + 8, 4), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_stats((ac_dtype_t)-1, buf, 4, &s), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_stats((ac_dtype_t)3, buf, 4, &s), AC_ERR_INVALID_ARG);
  /* an invalid dtype is refused even for an empty buffer */
  CHECK_RC(ac_stats(bad, buf, 0, &s), AC_ERR_INVALID_ARG);

  /* NULL data */
  ac_clear_error();
  CHECK_RC(ac_stats(AC_F32, NULL, 1, &s), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "NULL");
  CHECK_RC(ac_scale(AC_F16, NULL, 5, 1.0f), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_scale_stats(AC_BF16, NULL, 5, 1.0f, &s), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_nonfinite(AC_F32, NULL, 5, &found), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_cast(AC_F32, NULL, AC_F16, buf, 2), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_cast(AC_F32, buf, AC_F16, NULL, 2), AC_ERR_INVALID_ARG);
  /* NULL with n == 0 is fine: empty buffer */
  s = (ac_stats_t){5.0, 5.0f, 5};
  CHECK_OK(ac_stats(AC_F32, NULL, 0, &s));
  CHECK(s.sumsq == 0.0 && s.maxabs == 0.0f && s.nonfinite == 0);
  CHECK_OK(ac_scale(AC_F32, NULL, 0, 2.0f));
  s = (ac_stats_t){5.0, 5.0f, 5};
  CHECK_OK(ac_scale_stats(AC_F16, NULL, 0, 2.0f, &s));
  CHECK(s.sumsq == 0.0 && s.maxabs == 0.0f && s.nonfinite == 0);
  found = 7;
  CHECK_OK(ac_nonfinite(AC_BF16, NULL, 0, &found));
  CHECK_EQ_INT(found, 0);
  CHECK_OK(ac_cast(AC_F32, NULL, AC_BF16, NULL, 0));

  /* NULL outputs */
  CHECK_RC(ac_stats(AC_F32, buf, 4, NULL), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_stats(AC_F32, buf, 0, NULL), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_scale_stats(AC_F32, buf, 4, 1.0f, NULL), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_nonfinite(AC_F32, buf, 4, NULL), AC_ERR_INVALID_ARG);

  /* overlapping cast buffers of different dtypes */
  ac_clear_error();
  CHECK_RC(ac_cast(AC_F32, buf, AC_F16, buf, 4), AC_ERR_INVALID_ARG); /* same start */
  CHECK_CONTAINS(ac_last_error(), "overlap");
  CHECK_RC(ac_cast(AC_F32, buf, AC_F16, (char *)buf + 14, 4), AC_ERR_INVALID_ARG); /* last byte */
  CHECK_RC(ac_cast(AC_F16, (char *)buf + 6, AC_F32, buf, 4), AC_ERR_INVALID_ARG); /* src inside dst */
  CHECK_RC(ac_cast(AC_BF16, buf, AC_F16, (char *)buf + 2, 4), AC_ERR_INVALID_ARG);
  /* one byte in common: dst starts at the last byte of src (misaligned on purpose; a correct
   * check refuses before anything is dereferenced) */
  CHECK_RC(ac_cast(AC_F16, buf, AC_F32, (char *)buf + 7, 4), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_cast(AC_F16, (char *)buf + 15, AC_F32, buf, 4), AC_ERR_INVALID_ARG);
  /* adjacent but not overlapping: allowed */
  CHECK_OK(ac_cast(AC_F32, buf, AC_F16, buf + 4, 4));
  CHECK_OK(ac_cast(AC_F16, (char *)buf + 8, AC_F32, buf, 2));
  /* same dtype, same buffer: a no-op */
  float same[3] = {1.5f, -2.0f, 3.25f};
  CHECK_OK(ac_cast(AC_F32, same, AC_F32, same, 3));
  CHECK(same[0] == 1.5f && same[1] == -2.0f && same[2] == 3.25f);
  /* same dtype, different buffers: a copy */
  float copy[3] = {0};
  CHECK_OK(ac_cast(AC_F32, same, AC_F32, copy, 3));
  CHECK(memcmp(copy, same, sizeof same) == 0);

  /* ISA names */
  const char *isa_before = ac_kernels_isa();
  ac_clear_error();
  CHECK_RC(ac_kernels_set_isa("bogus"), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "bogus");
  CHECK_CONTAINS(ac_last_error(), "hint");
  CHECK_RC(ac_kernels_set_isa(NULL), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_kernels_set_isa(""), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_kernels_set_isa("AVX2"), AC_ERR_INVALID_ARG); /* names are exact */
  CHECK_STREQ(ac_kernels_isa(), isa_before);                /* unchanged by failures */

  /* every result code has a name */
  for (int c = 0; c <= (int)AC_ERR_STATE; c++)
    CHECK_MSG(strcmp(ac_result_string((ac_result_t)c), "AC_ERR_UNKNOWN") != 0, "code %d", c);
  CHECK_STREQ(ac_result_string(AC_ERR_INVALID_ARG), "AC_ERR_INVALID_ARG");
}

/* Last: stop the pool's workers so LeakSanitizer has no live threads to scan at exit. */
TEST(shutdown_pool) {
  ac_pool_shutdown();
  float x[1] = {2.0f};
  ac_stats_t s;
  CHECK_OK(ac_stats(AC_F32, x, 1, &s));
  CHECK(s.sumsq == 4.0);
  ac_pool_shutdown();
}

static const tu_test_t tests[] = {
    TU_CASE(isa_default_and_env), /* must stay first */
    TU_CASE(f16_exhaustive_roundtrip),
    TU_CASE(f16_all_ties_and_neighbours),
    TU_CASE(f16_edge_cases),
    TU_CASE(f16_random_vs_reference),
    TU_CASE(bf16_exhaustive_roundtrip),
    TU_CASE(bf16_edge_cases),
    TU_CASE(bf16_random_vs_reference),
    TU_CASE(dtype_size_and_name),
    TU_CASE(kernels_all_dtypes_sizes_isas),
    TU_CASE(kernels_random_bits_both_isas),
    TU_CASE(nan_payload_same_on_both_isas),
    TU_CASE(nonfinite_positions),
    TU_CASE(maxabs_ignores_nan),
    TU_CASE(sumsq_fast_pass),
    TU_CASE(deterministic_across_thread_counts),
    TU_CASE(many_chunks_heap_partials),
    TU_CASE(errors),
    TU_CASE(shutdown_pool), /* keep last */
};
TU_MAIN(tests)

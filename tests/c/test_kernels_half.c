/* test_kernels_half.c — the fp16 and bf16 conversions of csrc/core/half.h against the reference
 * of kernels_test_util.h: every bit pattern both ways, every fp16 rounding tie and its
 * neighbours, hand-picked edge cases (overflow, subnormals, NaN), and a million random floats. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime under -std=c11 */
#include <float.h>

#include "half.h"
#include "kernels_test_util.h"

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

static const tu_test_t tests[] = {
    TU_CASE(f16_exhaustive_roundtrip),
    TU_CASE(f16_all_ties_and_neighbours),
    TU_CASE(f16_edge_cases),
    TU_CASE(f16_random_vs_reference),
    TU_CASE(bf16_exhaustive_roundtrip),
    TU_CASE(bf16_edge_cases),
    TU_CASE(bf16_random_vs_reference),
};
TU_MAIN(tests)

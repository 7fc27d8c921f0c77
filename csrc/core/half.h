/* half.h (private) — scalar fp16/bf16 <-> fp32 conversions, round-to-nearest-even, matching
 * IEEE 754 and torch's c10::Half / c10::BFloat16 (NaN -> sign|0x7e00 / 0x7fc0; fp16 NaN -> quiet fp32 NaN). */
#ifndef AC_HALF_H
#define AC_HALF_H

#include <stdint.h>
#include <string.h>

static inline uint32_t ac_f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}
static inline float ac_bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline float ac_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t em = h & 0x7fffu;
  if (em > 0x7c00u) return ac_bits_f32(sign | 0x7fc00000u | ((em & 0x3ffu) << 13)); /* NaN, made quiet */
  if (em == 0x7c00u) return ac_bits_f32(sign | 0x7f800000u);
  if (em >= 0x0400u) return ac_bits_f32(sign | ((em << 13) + 0x38000000u));
  /* zero or subnormal: exact in fp32 */
  return ac_bits_f32(sign | ac_f32_bits((float)em * 0x1p-24f));
}

static inline uint16_t ac_f32_to_f16(float f) {
  uint32_t x = ac_f32_bits(f);
  uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u); /* NaN: quiet */
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to Inf */
  if (ax < 0x38800000u) {
    /* below the smallest normal half (2^-14): adding 0.5 makes the float's ulp equal to the
     * half subnormal step (2^-24), so the FPU's own nearest-even rounding does the work. */
    float t = ac_bits_f32(ax) + 0.5f;
    return (uint16_t)(sign | (uint16_t)(ac_f32_bits(t) - 0x3f000000u));
  }
  uint32_t odd = (ax >> 13) & 1u;
  ax += 0xc8000fffu + odd; /* rebias 127 -> 15 and round the 13 dropped bits to nearest even */
  return (uint16_t)(sign | (uint16_t)(ax >> 13));
}

static inline float ac_bf16_to_f32(uint16_t h) { return ac_bits_f32((uint32_t)h << 16); }

static inline uint16_t ac_f32_to_bf16(float f) {
  uint32_t x = ac_f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  x += 0x7fffu + ((x >> 16) & 1u);
  return (uint16_t)(x >> 16);
}

#endif /* AC_HALF_H */

/* sumsq_common.h (private) — the parts of ac_sumsq that every ISA must do in the same order,
 * so that results are bitwise identical across instruction sets. */
#ifndef AC_SUMSQ_COMMON_H
#define AC_SUMSQ_COMMON_H

#include <math.h>
#include <stddef.h>

typedef float (*ac_load1_fn)(const void *p, size_t i);

/* Adds x*x in double for i in [lo, hi), in index order; flags NaN/Inf. The slow path: tails
 * and blocks whose fp32 sum was not finite. */
static inline void ac_sumsq_double(ac_load1_fn ld, const void *p, size_t lo, size_t hi, double *acc, int *nf) {
  for (size_t i = lo; i < hi; i++) {
    float v = ld(p, i);
    *acc += (double)v * (double)v;
    if (!(fabsf(v) < INFINITY)) *nf = 1;
  }
}

/* Combines the 8 per-lane double totals in the fixed order the vector code uses. */
static inline double ac_sumsq_lanes_total(const double t[8]) {
  return ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]));
}

#endif

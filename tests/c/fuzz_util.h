/* fuzz_util.h — what the structured C fuzz targets share: an invariant check that traps (so
 * libFuzzer and the built-in driver both save the input), and a reader taking little-endian
 * integers from the fuzz input (zeros once it is used up). */
#ifndef AC_FUZZ_UTIL_H
#define AC_FUZZ_UTIL_H

#include <stdint.h>
#include <stdio.h>

#define CHECK(c)                                                                           \
  do {                                                                                     \
    if (!(c)) {                                                                            \
      fprintf(stderr, "%s: invariant failed at line %d: %s\n", __FILE__, __LINE__, #c);     \
      __builtin_trap();                                                                    \
    }                                                                                      \
  } while (0)

typedef struct {
  const uint8_t *p;
  size_t n, at;
} reader;

static inline uint64_t take(reader *r, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; i++) v |= (uint64_t)(r->at < r->n ? r->p[r->at++] : 0) << (8 * i);
  return v;
}

#endif

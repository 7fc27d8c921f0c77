/* fuzz_safetensors.c — fuzz target for the safetensors header parser (ac_st_header_parse).
 *
 * A libFuzzer entry point: tests/c/fuzz.sh links it with libFuzzer (clang) or with the built-in
 * driver (tests/c/fuzz_driver.c, any compiler).
 *
 * Input format (so mutations reach the JSON instead of mostly breaking the 8-byte length):
 *   byte 0 odd : the rest is a whole file image, passed as is;
 *   byte 0 even: bytes 1-2 are a little-endian data-region size D, the rest is the JSON header;
 *                the harness prepends the matching 8-byte length and declares D data bytes.
 * After a successful parse the harness checks the invariants the reader relies on and traps if
 * one fails (a parser bug that the sanitizers alone would not see). */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ac/safetensors.h"

static void check_invariants(const ac_st_header_t *h, uint64_t file_size) {
  size_t n = ac_st_header_count(h);
  uint64_t start = ac_st_header_data_start(h);
  if (start < 8 || start > file_size) __builtin_trap();
  uint64_t data = file_size - start, pos = 0;
  for (size_t i = 0; i < n; i++) {
    ac_st_info_t info;
    if (ac_st_header_info(h, i, &info) != AC_OK) __builtin_trap();
    if (info.begin > info.end || info.end > data || info.nbytes != info.end - info.begin) __builtin_trap();
    if (info.file_offset != start + info.begin) __builtin_trap();
    uint64_t want = ac_st_dtype_size(info.dtype);
    if (!want) __builtin_trap();
    for (int32_t d = 0; d < info.ndim; d++) {
      if (info.shape[d] < 0) __builtin_trap();
      want *= (uint64_t)info.shape[d]; /* cannot overflow: the parser checked */
    }
    if (want != info.nbytes) __builtin_trap();
    if (info.nbytes) { /* indices are in offset order and the ranges tile the region */
      if (info.begin != pos) __builtin_trap();
      pos = info.end;
    }
    size_t idx;
    if (ac_st_header_find(h, info.name, &idx) != AC_OK || idx != i) __builtin_trap();
  }
  if (pos != data) __builtin_trap();
  for (size_t i = 0; i < ac_st_header_metadata_count(h); i++) {
    const char *k, *v;
    if (ac_st_header_metadata(h, i, &k, &v) != AC_OK || !k || !v) __builtin_trap();
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  ac_st_header_t *h = NULL;
  if (data[0] & 1) {
    if (ac_st_header_parse(&h, data + 1, size - 1, size - 1, "<fuzz>") == AC_OK) check_invariants(h, size - 1);
  } else {
    if (size < 3) return 0;
    uint64_t dsize = (uint64_t)data[1] | ((uint64_t)data[2] << 8);
    size_t jlen = size - 3;
    uint8_t *img = malloc(8 + jlen + 1);
    if (!img) return 0;
    for (int i = 0; i < 8; i++) img[i] = (uint8_t)((uint64_t)jlen >> (8 * i));
    memcpy(img + 8, data + 3, jlen);
    /* only the header is in memory; the declared data region is never read by the parser */
    if (ac_st_header_parse(&h, img, 8 + jlen, 8 + jlen + dsize, "<fuzz>") == AC_OK)
      check_invariants(h, 8 + jlen + dsize);
    free(img);
  }
  ac_st_header_destroy(h);
  return 0;
}

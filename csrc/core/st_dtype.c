/* st_dtype.c — the safetensors dtype table: names as the file spells them, element sizes, and
 * the byte size of a shape (see st_internal.h). */
#include <string.h>

#include "st_internal.h"

static const struct {
  const char *name;
  size_t size;
} DT[AC_ST_NUM_DTYPES] = {
    [AC_ST_BOOL] = {"BOOL", 1},   [AC_ST_U8] = {"U8", 1},     [AC_ST_I8] = {"I8", 1},
    [AC_ST_F8_E5M2] = {"F8_E5M2", 1}, [AC_ST_F8_E4M3] = {"F8_E4M3", 1},
    [AC_ST_F8_E8M0] = {"F8_E8M0", 1}, [AC_ST_I16] = {"I16", 2}, [AC_ST_U16] = {"U16", 2},
    [AC_ST_F16] = {"F16", 2},     [AC_ST_BF16] = {"BF16", 2}, [AC_ST_I32] = {"I32", 4},
    [AC_ST_U32] = {"U32", 4},     [AC_ST_F32] = {"F32", 4},   [AC_ST_C64] = {"C64", 8},
    [AC_ST_F64] = {"F64", 8},     [AC_ST_I64] = {"I64", 8},   [AC_ST_U64] = {"U64", 8},
};

const char *ac_st_dtype_name(ac_st_dtype_t dt) {
  return (unsigned)dt < AC_ST_NUM_DTYPES ? DT[dt].name : "?";
}

size_t ac_st_dtype_size(ac_st_dtype_t dt) { return (unsigned)dt < AC_ST_NUM_DTYPES ? DT[dt].size : 0; }

int st_dtype_lookup(const char *s, ac_st_dtype_t *out) {
  for (int i = 0; i < AC_ST_NUM_DTYPES; i++)
    if (strcmp(s, DT[i].name) == 0) {
      *out = (ac_st_dtype_t)i;
      return 1;
    }
  return 0;
}

ac_result_t ac_st_dtype_from_name(const char *name, ac_st_dtype_t *out) {
  if (!name || !out) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_st_dtype_from_name: NULL argument");
  if (!st_dtype_lookup(name, out)) return AC_FAIL(AC_ERR_FORMAT, "unknown safetensors dtype '%.32s'", name);
  return AC_OK;
}

uint64_t st_nbytes_of(const int64_t *shape, int32_t ndim, size_t elem, int *overflow) {
  uint64_t n = elem;
  *overflow = 0;
  for (int32_t d = 0; d < ndim; d++) {
    uint64_t e = (uint64_t)shape[d];
    if (e == 0) n = 0;
    else if (n > UINT64_MAX / e) *overflow = 1;
    else n *= e;
  }
  if (*overflow) {
    /* a zero extent anywhere makes the size 0 even if a partial product overflowed */
    for (int32_t d = 0; d < ndim; d++)
      if (shape[d] == 0) {
        *overflow = 0;
        return 0;
      }
    return 0;
  }
  return n;
}

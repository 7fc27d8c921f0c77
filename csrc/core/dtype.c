/* dtype.c — the element types of ac/kernels.h (size and name): apart from the kernels, so that
 * code that only moves elements (the communicators, the reducer's launch) links without them. */
#include "ac/kernels.h"

size_t ac_dtype_size(ac_dtype_t dt) {
  switch (dt) {
    case AC_F32: return 4;
    case AC_F16:
    case AC_BF16: return 2;
  }
  return 0;
}

const char *ac_dtype_name(ac_dtype_t dt) {
  switch (dt) {
    case AC_F32: return "float32";
    case AC_F16: return "float16";
    case AC_BF16: return "bfloat16";
  }
  return "invalid";
}

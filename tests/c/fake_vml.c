/* fake_vml.c — a stand-in for MKL's vmsSqrt (the one VML function csrc/core/adam.c calls), for
 * tests/c/test_adam.c: the correctly rounded square root, element by element; it records the
 * mode it was called with. run.sh builds it as a shared library and passes its path in
 * AC_FAKE_VML. */
#include <math.h>

static long long last_mode = -1;

__attribute__((visibility("default"))) void vmsSqrt(int n, const float *a, float *r, long long mode) {
  last_mode = mode;
  for (int i = 0; i < n; i++) r[i] = sqrtf(a[i]);
}

__attribute__((visibility("default"))) long long fake_vml_last_mode(void) { return last_mode; }

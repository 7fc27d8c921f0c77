/* fake_vml.c — a stand-in for MKL's vsSqrt (the one VML function csrc/core/adam.c calls), for
 * tests/c/test_adam.c: the correctly rounded square root, element by element. run.sh builds it
 * as a shared library and passes its path in AC_FAKE_VML. */
#include <math.h>

__attribute__((visibility("default"))) void vsSqrt(int n, const float *a, float *r) {
  for (int i = 0; i < n; i++) r[i] = sqrtf(a[i]);
}

/* fuzz_dlpack.c — fuzz target for the DLPack consumer's validation (csrc/core/dlpack_check.c):
 * DLTensors built field by field from the input, as a buggy or hostile producer could export
 * them (any ndim, NULL or garbage shape and strides, any dtype code/bits/lanes, any device, byte
 * offsets, NULL data, versioned flags).
 *
 * Invariants (trap on a violation): a rejected tensor has a message that starts with the
 * argument's name; an accepted one has the device the caller asked for, one lane of
 * float32/float16/bfloat16, numel equal to the product of its extents with numel * element
 * size representable, row-major strides wherever an extent is not 1 (when strides are given and
 * numel > 1), a non-NULL data pointer when numel > 0 (data + byte_offset), NULL when empty; a
 * writable check passes only without the read-only and is-copied flags. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ac/dlpack_check.h"

#include "fuzz_util.h"

/* An extent or stride: mostly small, sometimes a raw 64-bit value (negative, huge). */
static int64_t value(reader *r) {
  uint8_t tag = (uint8_t)take(r, 1);
  if (tag < 200) return (int64_t)(tag % 9);
  if (tag < 250) return (int64_t)take(r, 2);
  return (int64_t)take(r, 8);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 8) return 0;
  reader r = {data, size, 0};
  uint8_t mode = (uint8_t)take(&r, 1);
  int32_t ndim = (int32_t)(int8_t)take(&r, 1) % 12; /* -11..11 */
  int64_t shape[16], strides[16];
  for (int d = 0; d < 16; d++) shape[d] = value(&r);
  for (int d = 0; d < 16; d++) strides[d] = value(&r);
  if (mode & 1) { /* make the strides row-major, so acceptance is reachable with any shape */
    int64_t s = 1;
    for (int d = ndim - 1; d >= 0; d--) {
      strides[d] = s;
      s = (int64_t)((uint64_t)s * (uint64_t)shape[d]);
    }
  }
  static char backing[64];
  DLTensor t;
  memset(&t, 0, sizeof t);
  t.ndim = ndim;
  t.shape = (mode & 2) ? NULL : shape;
  t.strides = (mode & 4) ? NULL : strides;
  t.data = (mode & 8) ? NULL : backing;
  t.byte_offset = (mode & 16) ? take(&r, 8) : take(&r, 1);
  t.dtype.code = (uint8_t)take(&r, 1) % 8;
  t.dtype.bits = (uint8_t)take(&r, 1);
  t.dtype.lanes = (uint16_t)(take(&r, 1) % 3);
  t.device.device_type = (DLDeviceType)(take(&r, 1) % 16);
  t.device.device_id = (int32_t)take(&r, 1);
  int where = (int)(take(&r, 1) % 3);
  uint64_t flags = take(&r, 1);
  size_t esize = (size_t)1 << (take(&r, 1) % 4);
  char err[512];
  const char *arg = "tensor";

  size_t n = 12345;
  int k = ac_dl_layout(&t, esize, arg, &n, err, sizeof err);
  if (k == AC_DL_OK) {
    CHECK(t.ndim >= 0);
    size_t prod = 1;
    for (int d = 0; d < t.ndim; d++) {
      CHECK(t.shape[d] >= 0);
      prod *= (size_t)t.shape[d];
    }
    CHECK(n == prod && (n == 0 || n <= SIZE_MAX / esize));
    CHECK(n == 0 || t.data);
    if (t.strides && n > 1) {
      uint64_t s = 1;
      for (int d = t.ndim - 1; d >= 0; d--) {
        CHECK(t.shape[d] == 1 || (uint64_t)t.strides[d] == s);
        s *= (uint64_t)t.shape[d];
      }
    }
  } else {
    CHECK(k == AC_DL_VALUE && strncmp(err, arg, strlen(arg)) == 0);
    CHECK(n == 12345); /* nothing written on failure */
  }

  k = ac_dl_writable(flags, arg, err, sizeof err);
  CHECK((k == AC_DL_OK) == !(flags & (DLPACK_FLAG_BITMASK_READ_ONLY | DLPACK_FLAG_BITMASK_IS_COPIED)));
  if (k != AC_DL_OK) CHECK(strncmp(err, arg, strlen(arg)) == 0);

  ac_dtype_t dt = (ac_dtype_t)99;
  void *ptr = (void *)1;
  n = 12345;
  k = ac_dl_check_float(&t, where, arg, &dt, &n, &ptr, err, sizeof err);
  if (k == AC_DL_OK) {
    int dev = t.device.device_type;
    if (where == AC_DL_ON_CPU) CHECK(dev == kDLCPU || dev == kDLCUDAHost);
    if (where == AC_DL_ON_CUDA) CHECK(dev == kDLCUDA || dev == kDLCUDAManaged);
    CHECK(t.dtype.lanes == 1);
    CHECK((dt == AC_F32 && t.dtype.code == kDLFloat && t.dtype.bits == 32) ||
          (dt == AC_F16 && t.dtype.code == kDLFloat && t.dtype.bits == 16) ||
          (dt == AC_BF16 && t.dtype.code == kDLBfloat && t.dtype.bits == 16));
    size_t n2;
    char err2[512];
    CHECK(ac_dl_layout(&t, dt == AC_F32 ? 4 : 2, arg, &n2, err2, sizeof err2) == AC_DL_OK && n2 == n);
    CHECK(n ? ptr == (char *)t.data + t.byte_offset : ptr == NULL);
  } else {
    CHECK((k == AC_DL_VALUE || k == AC_DL_TYPE) && strncmp(err, arg, strlen(arg)) == 0);
    CHECK(n == 12345 && dt == (ac_dtype_t)99 && ptr == (void *)1);
  }
  return 0;
}

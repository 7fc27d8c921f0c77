/* test_dlpack_check.c — the DLPack consumer's checks (csrc/core/dlpack_check.c): the messages
 * Python sees, and the malformed exports that reach them (tests/c/fuzz_dlpack.c fuzzes the rest).
 * The last three cases are what the checks did not handle when they lived in dlpack_in.c: a NULL
 * shape was read, a NULL data pointer was accepted for a non-empty tensor (the kernels would
 * have written through it), and the row-major stride was an int64 product that overflowed
 * (undefined behaviour) for more than 2^63 one-byte elements. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "ac/dlpack_check.h"
#include "test_util.h"

static char backing[64];

static DLTensor tensor(int32_t ndim, int64_t *shape, int64_t *strides, uint8_t code, uint8_t bits, int dev) {
  DLTensor t;
  memset(&t, 0, sizeof t);
  t.data = backing;
  t.ndim = ndim;
  t.shape = shape;
  t.strides = strides;
  t.dtype.code = code;
  t.dtype.bits = bits;
  t.dtype.lanes = 1;
  t.device.device_type = (DLDeviceType)dev;
  return t;
}

TEST(accepts_a_contiguous_float_tensor) {
  int64_t shape[2] = {3, 4}, strides[2] = {4, 1};
  DLTensor t = tensor(2, shape, strides, kDLFloat, 32, kDLCPU);
  t.byte_offset = 8;
  ac_dtype_t dt;
  size_t n;
  void *data;
  char err[256];
  CHECK_EQ_INT(ac_dl_check_float(&t, AC_DL_ON_CPU, "x", &dt, &n, &data, err, sizeof err), AC_DL_OK);
  CHECK(dt == AC_F32 && n == 12 && data == backing + 8);
}

TEST(messages_name_the_argument_and_the_fault) {
  int64_t shape[2] = {3, 4}, strides[2] = {1, 3};
  DLTensor t = tensor(2, shape, strides, kDLFloat, 32, kDLCPU);
  ac_dtype_t dt;
  size_t n;
  void *data;
  char err[256];
  CHECK_EQ_INT(ac_dl_check_float(&t, AC_DL_ON_CPU, "grads", &dt, &n, &data, err, sizeof err), AC_DL_VALUE);
  CHECK_STREQ(err, "grads: tensor is not contiguous (dim 1 has stride 3, expected 1); call .contiguous() first");
  t = tensor(2, shape, NULL, kDLInt, 8, kDLCPU);
  CHECK_EQ_INT(ac_dl_check_float(&t, AC_DL_ON_CPU, "grads", &dt, &n, &data, err, sizeof err), AC_DL_TYPE);
  CHECK_STREQ(err, "grads: dtype int8 is not supported; expected float32, float16 or bfloat16");
  t = tensor(2, shape, NULL, kDLFloat, 32, kDLCUDA);
  CHECK_EQ_INT(ac_dl_check_float(&t, AC_DL_ON_CPU, "grads", &dt, &n, &data, err, sizeof err), AC_DL_TYPE);
  CHECK_STREQ(err, "grads: expected a CPU tensor, got DLPack device type 2 (CUDA): use the cuda_* kernels");
  CHECK_EQ_INT(ac_dl_writable(DLPACK_FLAG_BITMASK_READ_ONLY, "out", err, sizeof err), AC_DL_VALUE);
  CHECK_STREQ(err, "out: the producer exported read-only memory, which cannot be written in place");
}

TEST(a_null_shape_is_refused_not_read) {
  DLTensor t = tensor(2, NULL, NULL, kDLFloat, 32, kDLCPU);
  size_t n = 7;
  char err[256];
  CHECK_EQ_INT(ac_dl_layout(&t, 4, "x", &n, err, sizeof err), AC_DL_VALUE);
  CHECK_STREQ(err, "x: ndim 2 but no shape");
  CHECK(n == 7);
}

TEST(a_null_data_pointer_is_refused_for_a_non_empty_tensor) {
  int64_t shape[1] = {4}, empty[1] = {0};
  DLTensor t = tensor(1, shape, NULL, kDLFloat, 32, kDLCPU);
  t.data = NULL;
  size_t n;
  char err[256];
  CHECK_EQ_INT(ac_dl_layout(&t, 4, "x", &n, err, sizeof err), AC_DL_VALUE);
  CHECK_STREQ(err, "x: the producer exported a NULL data pointer for 4 elements");
  t.shape = empty; /* an empty tensor may have no data */
  CHECK_EQ_INT(ac_dl_layout(&t, 4, "x", &n, err, sizeof err), AC_DL_OK);
  CHECK(n == 0);
}

TEST(strides_of_more_than_2_to_63_one_byte_elements_do_not_overflow) {
  /* 3 x 2^62 elements: the count fits size_t for 1-byte elements, the int64 product of the
   * extents (the old code's running stride, multiplied once more after the last check) does not */
  int64_t shape[2] = {3, (int64_t)1 << 62}, strides[2] = {(int64_t)1 << 62, 1};
  DLTensor t = tensor(2, shape, strides, kDLUInt, 8, kDLCPU);
  size_t n;
  char err[256];
  /* computed without overflow, then refused: more bytes than ptrdiff_t can address */
  CHECK_EQ_INT(ac_dl_layout(&t, 1, "x", &n, err, sizeof err), AC_DL_VALUE);
  CHECK_CONTAINS(err, "x: byte_offset 0 puts the tensor's 13835058055282163712 elements past the end");
  strides[0] = -1; /* a negative stride is refused, not compared as unsigned */
  CHECK_EQ_INT(ac_dl_layout(&t, 1, "x", &n, err, sizeof err), AC_DL_VALUE);
  CHECK_STREQ(err, "x: tensor is not contiguous (dim 0 has stride -1, expected 4611686018427387904); call .contiguous() first");
}

/* found by tests/c/fuzz_dlpack.c under clang's UBSan: data + byte_offset was computed for any
 * offset, a pointer overflow (undefined behaviour) before anything was dereferenced */
TEST(a_byte_offset_that_wraps_the_address_space_is_refused) {
  int64_t shape[1] = {4};
  DLTensor t = tensor(1, shape, NULL, kDLFloat, 32, kDLCPU);
  t.byte_offset = UINT64_MAX - 8;
  ac_dtype_t dt;
  size_t n = 7;
  void *data = NULL;
  char err[256];
  CHECK_EQ_INT(ac_dl_check_float(&t, AC_DL_ON_CPU, "x", &dt, &n, &data, err, sizeof err), AC_DL_VALUE);
  CHECK_CONTAINS(err, "x: byte_offset 18446744073709551607 puts the tensor's 4 elements past the end");
  CHECK(n == 7 && data == NULL);
  t.byte_offset = (uint64_t)PTRDIFF_MAX + 1; /* no wrap of a low address, but past ptrdiff_t (gcc's UBSan) */
  CHECK_EQ_INT(ac_dl_check_float(&t, AC_DL_ON_CPU, "x", &dt, &n, &data, err, sizeof err), AC_DL_VALUE);
  CHECK(n == 7 && data == NULL);
  t.byte_offset = 16; /* an ordinary offset is fine */
  CHECK_EQ_INT(ac_dl_check_float(&t, AC_DL_ON_CPU, "x", &dt, &n, &data, err, sizeof err), AC_DL_OK);
  CHECK(data == backing + 16);
}

static const tu_test_t tests[] = {
    TU_CASE(a_byte_offset_that_wraps_the_address_space_is_refused),
    TU_CASE(accepts_a_contiguous_float_tensor),
    TU_CASE(messages_name_the_argument_and_the_fault),
    TU_CASE(a_null_shape_is_refused_not_read),
    TU_CASE(a_null_data_pointer_is_refused_for_a_non_empty_tensor),
    TU_CASE(strides_of_more_than_2_to_63_one_byte_elements_do_not_overflow),
};
TU_MAIN(tests)

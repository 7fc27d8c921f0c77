/* dlpack_check.c — validation of a producer's DLTensor (ac/dlpack_check.h), kept out of the
 * CPython module so that it runs (and is fuzzed) without an interpreter. */
#include "ac/dlpack_check.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

static int fail(int kind, char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static int fail(int kind, char *err, size_t errlen, const char *fmt, ...) {
  if (err && errlen) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
  }
  return kind;
}

static const char *dtype_desc(DLDataType t, char *buf, size_t len) {
  const char *kind = t.code == kDLInt ? "int" : t.code == kDLUInt ? "uint" : t.code == kDLFloat ? "float"
                   : t.code == kDLBfloat ? "bfloat" : t.code == kDLComplex ? "complex"
                   : t.code == kDLBool ? "bool" : "opaque";
  snprintf(buf, len, "%s%u%s", kind, (unsigned)t.bits, t.lanes != 1 ? "xN" : "");
  return buf;
}

int ac_dl_layout(const DLTensor *t, size_t esize, const char *arg, size_t *numel, char *err, size_t errlen) {
  if (t->ndim < 0) return fail(AC_DL_VALUE, err, errlen, "%s: negative ndim %d", arg, (int)t->ndim);
  if (t->ndim > 0 && !t->shape) return fail(AC_DL_VALUE, err, errlen, "%s: ndim %d but no shape", arg, (int)t->ndim);
  size_t n = 1;
  for (int32_t d = 0; d < t->ndim; d++) {
    if (t->shape[d] < 0)
      return fail(AC_DL_VALUE, err, errlen, "%s: negative extent %lld in dim %d", arg, (long long)t->shape[d], (int)d);
    /* the byte size must fit too: callers multiply by the element size */
    if (t->shape[d] != 0 && n > SIZE_MAX / (esize ? esize : 1) / (size_t)t->shape[d])
      return fail(AC_DL_VALUE, err, errlen, "%s: element count overflows", arg);
    n *= (size_t)t->shape[d];
  }
  if (t->strides && n > 1) {
    /* the row-major stride of dim d is the product of the extents after it, at most n <= SIZE_MAX:
     * computed unsigned, so a count above INT64_MAX (1-byte elements) cannot overflow, and
     * compared to the producer's stride only where that stride is non-negative */
    uint64_t expect = 1;
    for (int32_t d = t->ndim - 1; d >= 0; d--) {
      if (t->shape[d] != 1 && (t->strides[d] < 0 || (uint64_t)t->strides[d] != expect))
        return fail(AC_DL_VALUE, err, errlen,
                    "%s: tensor is not contiguous (dim %d has stride %lld, expected %llu); call .contiguous() first",
                    arg, (int)d, (long long)t->strides[d], (unsigned long long)expect);
      expect *= (uint64_t)t->shape[d];
    }
  }
  if (n > 0 && !t->data)
    return fail(AC_DL_VALUE, err, errlen, "%s: the producer exported a NULL data pointer for %zu elements", arg, n);
  /* data + byte_offset + the byte size must stay inside the address space, and the offset within
   * ptrdiff_t (C's bound on pointer arithmetic): a pointer sum past either is undefined
   * behaviour before it is ever dereferenced */
  uint64_t nbytes = (uint64_t)n * (esize ? esize : 1);
  if (n > 0 && (t->byte_offset > (uint64_t)PTRDIFF_MAX || nbytes > (uint64_t)PTRDIFF_MAX - t->byte_offset ||
                t->byte_offset > UINTPTR_MAX - (uintptr_t)t->data ||
                nbytes > UINTPTR_MAX - (uintptr_t)t->data - t->byte_offset))
    return fail(AC_DL_VALUE, err, errlen, "%s: byte_offset %llu puts the tensor's %zu elements past the end of the "
                "address space", arg, (unsigned long long)t->byte_offset, n);
  *numel = n;
  return AC_DL_OK;
}

int ac_dl_writable(uint64_t flags, const char *arg, char *err, size_t errlen) {
  if (flags & DLPACK_FLAG_BITMASK_READ_ONLY)
    return fail(AC_DL_VALUE, err, errlen,
                "%s: the producer exported read-only memory, which cannot be written in place", arg);
  if (flags & DLPACK_FLAG_BITMASK_IS_COPIED)
    return fail(AC_DL_VALUE, err, errlen, "%s: the producer exported a copy, so an in-place result would be lost", arg);
  return AC_DL_OK;
}

int ac_dl_check_float(const DLTensor *t, int where, const char *arg, ac_dtype_t *dt, size_t *numel, void **data,
                      char *err, size_t errlen) {
  char buf[32];
  int dev = t->device.device_type;
  if (where == AC_DL_ON_CPU && dev != kDLCPU && dev != kDLCUDAHost)
    return fail(AC_DL_TYPE, err, errlen, "%s: expected a CPU tensor, got DLPack device type %d%s", arg, dev,
                dev == kDLCUDA ? " (CUDA): use the cuda_* kernels" : "");
  if (where == AC_DL_ON_CUDA && dev != kDLCUDA && dev != kDLCUDAManaged)
    return fail(AC_DL_TYPE, err, errlen, "%s: expected a CUDA tensor, got DLPack device type %d", arg, dev);
  if (t->dtype.lanes != 1)
    return fail(AC_DL_TYPE, err, errlen, "%s: vector dtypes are not supported (%s)", arg,
                dtype_desc(t->dtype, buf, sizeof buf));
  ac_dtype_t d;
  if (t->dtype.code == kDLFloat && t->dtype.bits == 32) d = AC_F32;
  else if (t->dtype.code == kDLFloat && t->dtype.bits == 16) d = AC_F16;
  else if (t->dtype.code == kDLBfloat && t->dtype.bits == 16) d = AC_BF16;
  else
    return fail(AC_DL_TYPE, err, errlen, "%s: dtype %s is not supported; expected float32, float16 or bfloat16", arg,
                dtype_desc(t->dtype, buf, sizeof buf));
  size_t n;
  int k = ac_dl_layout(t, d == AC_F32 ? 4 : 2, arg, &n, err, errlen);
  if (k != AC_DL_OK) return k;
  *dt = d;
  *numel = n;
  *data = n ? (char *)t->data + t->byte_offset : NULL;
  return AC_DL_OK;
}

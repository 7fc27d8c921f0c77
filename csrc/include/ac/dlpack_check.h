/* dlpack_check.h — the DLPack consumer's validation of a producer's tensor, without Python: the
 * checks csrc/python/dlpack_in.c makes before it takes a capsule (so they can be fuzzed with
 * tensors built field by field, tests/c/fuzz_dlpack.c). A DLTensor comes from another library
 * and may hold anything: every field is checked before it is used.
 *
 * Each function returns AC_DL_OK, or AC_DL_VALUE / AC_DL_TYPE (what Python raises: ValueError /
 * TypeError) with a message prefixed by `arg` written to err[0, errlen). It does not touch the
 * thread's last error (the messages reach Python as they are, without a file:line prefix). */
#ifndef AC_DLPACK_CHECK_H
#define AC_DLPACK_CHECK_H

#include <stddef.h>
#include <stdint.h>

#include "ac/dlpack.h"
#include "ac/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { AC_DL_OK = 0, AC_DL_VALUE = 1, AC_DL_TYPE = 2 };
enum { AC_DL_ON_CPU = 0, AC_DL_ON_CUDA = 1, AC_DL_ON_ANY = 2 };

/* ndim and extents valid (shape present when ndim > 0), element count times `esize` bytes
 * without overflow, C-contiguous (strides, when given, those of a row-major tensor; extents of 1
 * may have any stride), a data pointer for a non-empty tensor. *numel set on success. */
int ac_dl_layout(const DLTensor *t, size_t esize, const char *arg, size_t *numel, char *err, size_t errlen);
/* The producer neither marked the memory read-only nor exported a copy (versioned flags). */
int ac_dl_writable(uint64_t flags, const char *arg, char *err, size_t errlen);
/* What the kernels take: on the device `where` asks for (CPU: CPU or CUDA-host memory; CUDA:
 * CUDA or managed memory; ANY: either), one lane of float32, float16 or bfloat16, then
 * ac_dl_layout. On success *dt, *numel and *data (NULL when empty; else data + byte_offset). */
int ac_dl_check_float(const DLTensor *t, int where, const char *arg, ac_dtype_t *dt, size_t *numel, void **data,
                      char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif

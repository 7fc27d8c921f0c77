/* cuda_stub.c — the CUDA entry points of a CPU-only build: each says clearly that CUDA was not
 * built, so a GPU tensor never reaches a CPU kernel by accident. */
#include "ac/cuda.h"

#ifndef AC_WITH_CUDA

#define NOT_BUILT()                                                                      \
  AC_FAIL_HINT(AC_ERR_UNSUPPORTED,                                                       \
               "reinstall with nvcc on PATH (or CUDA_HOME set) and ACCELERATE_C_NO_CUDA unset", \
               "accelerate_c was built without CUDA")

int ac_cuda_built(void) { return 0; }

ac_result_t ac_cuda_device_count(int *count) {
  if (!count) return AC_FAIL(AC_ERR_INVALID_ARG, "count is NULL");
  *count = 0;
  return AC_OK;
}

ac_result_t ac_cuda_stats(ac_dtype_t dt, const void *data, size_t n, float *dev_out, void *stream) {
  (void)dt, (void)data, (void)n, (void)dev_out, (void)stream;
  return NOT_BUILT();
}

ac_result_t ac_cuda_scale(ac_dtype_t dt, void *data, size_t n, float factor, const float *dev_factor,
                          void *stream) {
  (void)dt, (void)data, (void)n, (void)factor, (void)dev_factor, (void)stream;
  return NOT_BUILT();
}

ac_result_t ac_cuda_unscale_check(ac_dtype_t dt, void *data, size_t n, const float *dev_inv_scale,
                                  float *dev_found_inf, float *dev_sumsq, void *stream) {
  (void)dt, (void)data, (void)n, (void)dev_inv_scale, (void)dev_found_inf, (void)dev_sumsq, (void)stream;
  return NOT_BUILT();
}

ac_result_t ac_cuda_cast(ac_dtype_t src_dt, const void *src, ac_dtype_t dst_dt, void *dst, size_t n,
                         void *stream) {
  (void)src_dt, (void)src, (void)dst_dt, (void)dst, (void)n, (void)stream;
  return NOT_BUILT();
}

ac_result_t ac_cuda_event_create(void **event) {
  if (event) *event = NULL;
  return NOT_BUILT();
}

void ac_cuda_event_destroy(void *event) { (void)event; }

ac_result_t ac_cuda_stream_wait(void *waiter, void *waitee, void *event) {
  (void)waiter, (void)waitee, (void)event;
  return NOT_BUILT();
}

ac_result_t ac_cuda_device_enter(int device, int *prev) {
  (void)device;
  if (prev) *prev = 0;
  return NOT_BUILT();
}

void ac_cuda_device_leave(int prev) { (void)prev; }

ac_result_t ac_cuda_check_device(int device) {
  (void)device;
  return NOT_BUILT();
}

ac_result_t ac_cuda_host_alloc(void **ptr, size_t bytes, int device) {
  (void)bytes, (void)device;
  if (ptr) *ptr = NULL;
  return NOT_BUILT();
}

void ac_cuda_host_free(void *ptr) { (void)ptr; }

ac_result_t ac_cuda_stream_create(void **stream, int device) {
  (void)device;
  if (stream) *stream = NULL;
  return NOT_BUILT();
}

void ac_cuda_stream_destroy(void *stream, int device) { (void)stream, (void)device; }

ac_result_t ac_cuda_stream_wait_event(void *stream, void *event, int device) {
  (void)stream, (void)event, (void)device;
  return NOT_BUILT();
}

ac_result_t ac_cuda_copy_to_host_async(void *dst, const void *src, size_t n, int device, void *stream) {
  (void)dst, (void)src, (void)n, (void)device, (void)stream;
  return NOT_BUILT();
}

ac_result_t ac_cuda_stream_sync(void *stream, int device) {
  (void)stream, (void)device;
  return NOT_BUILT();
}

#else
typedef int ac_cuda_stub_unused_t; /* ISO C forbids an empty translation unit */
#endif

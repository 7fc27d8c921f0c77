/* staging.cu — pinned host buffers, streams and device->host copies for the checkpoint writer
 * (csrc/core/st_direct.c stages GPU tensors through them). See ac/cuda.h. */
#include <cuda_runtime.h>

#include "ac/cuda.h"

namespace {

/* Makes `device` current on this thread (cheap when it already is). */
ac_result_t use_device(int device, const char *what) {
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) {
    (void)cudaGetLastError(); /* do not leave the error for the next, unrelated check */
    return AC_FAIL(AC_ERR_CUDA, "%s: cudaSetDevice(%d) failed: %s", what, device, cudaGetErrorString(e));
  }
  return AC_OK;
}

ac_result_t failed(const char *call, int device, cudaError_t e) {
  (void)cudaGetLastError();
  return AC_FAIL(AC_ERR_CUDA, "%s on device %d failed: %s", call, device, cudaGetErrorString(e));
}

}  // namespace

extern "C" ac_result_t ac_cuda_check_device(int device) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return AC_FAIL(AC_ERR_CUDA, "no CUDA device can be used for device %d: cudaGetDeviceCount failed: %s", device,
                   cudaGetErrorString(e));
  }
  if (device < 0 || device >= count)
    return AC_FAIL(AC_ERR_INVALID_ARG, "CUDA device %d does not exist (%d visible)", device, count);
  return AC_OK;
}

extern "C" ac_result_t ac_cuda_host_alloc(void **ptr, size_t bytes, int device) {
  if (!ptr) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_cuda_host_alloc: ptr is NULL");
  *ptr = nullptr;
  AC_CHECK(use_device(device, "ac_cuda_host_alloc"));
  void *p = nullptr;
  cudaError_t e = cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocPortable);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return AC_FAIL(e == cudaErrorMemoryAllocation ? AC_ERR_NOMEM : AC_ERR_CUDA,
                   "cudaHostAlloc of %zu bytes (device %d current) failed: %s", bytes, device, cudaGetErrorString(e));
  }
  *ptr = p;
  return AC_OK;
}

extern "C" void ac_cuda_host_free(void *ptr) {
  if (ptr && cudaFreeHost(ptr) != cudaSuccess) (void)cudaGetLastError();
}

extern "C" ac_result_t ac_cuda_stream_create(void **stream, int device) {
  if (!stream) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_cuda_stream_create: stream is NULL");
  *stream = nullptr;
  AC_CHECK(use_device(device, "ac_cuda_stream_create"));
  cudaStream_t s = nullptr;
  cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (e != cudaSuccess) return failed("cudaStreamCreateWithFlags", device, e);
  *stream = (void *)s;
  return AC_OK;
}

extern "C" void ac_cuda_stream_destroy(void *stream, int device) {
  if (!stream) return;
  if (cudaSetDevice(device) != cudaSuccess || cudaStreamDestroy((cudaStream_t)stream) != cudaSuccess)
    (void)cudaGetLastError();
}

extern "C" ac_result_t ac_cuda_copy_to_host_async(void *dst, const void *src, size_t n, int device, void *stream) {
  if (n && (!dst || !src)) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_cuda_copy_to_host_async: NULL pointer");
  AC_CHECK(use_device(device, "ac_cuda_copy_to_host_async"));
  cudaError_t e = cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, (cudaStream_t)stream);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return AC_FAIL(AC_ERR_CUDA, "cudaMemcpyAsync (device %d to host, %zu bytes) failed: %s", device, n,
                   cudaGetErrorString(e));
  }
  return AC_OK;
}

extern "C" ac_result_t ac_cuda_stream_wait_event(void *stream, void *event, int device) {
  if (!event) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_cuda_stream_wait_event: event is NULL");
  AC_CHECK(use_device(device, "ac_cuda_stream_wait_event"));
  cudaError_t e = cudaStreamWaitEvent((cudaStream_t)stream, (cudaEvent_t)event, 0);
  if (e != cudaSuccess) return failed("cudaStreamWaitEvent (the tensors' ready event)", device, e);
  return AC_OK;
}

extern "C" ac_result_t ac_cuda_stream_sync(void *stream, int device) {
  AC_CHECK(use_device(device, "ac_cuda_stream_sync"));
  cudaError_t e = cudaStreamSynchronize((cudaStream_t)stream);
  if (e != cudaSuccess) return failed("cudaStreamSynchronize (device-to-host copies)", device, e);
  return AC_OK;
}

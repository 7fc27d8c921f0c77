/* streams.cu — CUDA events that order the reducer's comm stream after the compute stream, and
 * the current-device guard of the kernel launches. */
#include <cuda_runtime.h>

#include "ac/cuda.h"

extern "C" ac_result_t ac_cuda_event_create(void **event) {
  if (!event) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_cuda_event_create: event is NULL");
  cudaEvent_t e = nullptr;
  cudaError_t rc = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  if (rc != cudaSuccess) {
    *event = nullptr;
    return AC_FAIL(AC_ERR_CUDA, "cudaEventCreateWithFlags failed: %s", cudaGetErrorString(rc));
  }
  *event = (void *)e;
  return AC_OK;
}

extern "C" void ac_cuda_event_destroy(void *event) {
  if (event) (void)cudaEventDestroy((cudaEvent_t)event);
}

extern "C" ac_result_t ac_cuda_stream_wait(void *waiter, void *waitee, void *event) {
  if (!event) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_cuda_stream_wait: event is NULL");
  cudaError_t rc = cudaEventRecord((cudaEvent_t)event, (cudaStream_t)waitee);
  if (rc == cudaSuccess) rc = cudaStreamWaitEvent((cudaStream_t)waiter, (cudaEvent_t)event, 0);
  if (rc != cudaSuccess) return AC_FAIL(AC_ERR_CUDA, "ordering streams failed: %s", cudaGetErrorString(rc));
  return AC_OK;
}

extern "C" ac_result_t ac_cuda_device_enter(int device, int *prev) {
  if (!prev) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_cuda_device_enter: prev is NULL");
  cudaError_t rc = cudaGetDevice(prev);
  if (rc == cudaSuccess && *prev != device) rc = cudaSetDevice(device);
  if (rc != cudaSuccess) {
    (void)cudaGetLastError(); /* do not leave the error for the next, unrelated check */
    return AC_FAIL(AC_ERR_CUDA, "making CUDA device %d current failed: %s", device, cudaGetErrorString(rc));
  }
  return AC_OK;
}

extern "C" void ac_cuda_device_leave(int prev) {
  int cur = -1;
  if (cudaGetDevice(&cur) != cudaSuccess || (cur != prev && cudaSetDevice(prev) != cudaSuccess))
    (void)cudaGetLastError();
}

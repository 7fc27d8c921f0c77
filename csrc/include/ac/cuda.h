/* cuda.h — CUDA kernels over flat device buffers (built only when nvcc was found; otherwise
 * every call returns AC_ERR_UNSUPPORTED, except ac_cuda_device_count which reports 0).
 *
 * Results stay on the device: outputs are device pointers, so a training step needs no
 * device->host synchronisation until it must decide whether to skip the optimizer step.
 * `stream` is a cudaStream_t (NULL = legacy default stream); all work is asynchronous on it.
 * Sums of squares are bitwise reproducible run to run: each block's partial sum (in double)
 * goes to scratch from a stream-ordered pool of ours, and a second one-block pass adds them in
 * block order (no float atomics, whose order depends on timing). The same buffer size gives
 * the same grid, hence the same result; the max and the non-finite flag are order-free. */
#ifndef AC_CUDA_H
#define AC_CUDA_H

#include "ac/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 if this build contains the CUDA kernels. */
int ac_cuda_built(void);

/* Number of usable CUDA devices; 0 (and AC_OK) when there is no driver or no GPU. */
ac_result_t ac_cuda_device_count(int *count);

/* Accumulates statistics of a device buffer into dev_out (3 floats, device memory, zeroed by
 * the caller before the first buffer; on the current device, which must be data's): dev_out[0]
 * += sum of squares (summed in double, rounded once), dev_out[1] =
 * max(dev_out[1], max |x|, NaN ignored), dev_out[2] = 1 if any element is NaN or +-Inf. */
ac_result_t ac_cuda_stats(ac_dtype_t dt, const void *data, size_t n, float *dev_out, void *stream);

/* data[i] *= factor * (dev_factor ? *dev_factor : 1), in place. dev_factor lets a factor that
 * was computed on the device (a clip coefficient) be applied without a host round trip. */
ac_result_t ac_cuda_scale(ac_dtype_t dt, void *data, size_t n, float factor, const float *dev_factor,
                          void *stream);

/* GradScaler's unscale: data[i] *= *dev_inv_scale; *dev_found_inf = 1 if any result is NaN or
 * +-Inf (never reset to 0 here). Also accumulates the sum of squares of the results into
 * *dev_sumsq when dev_sumsq is not NULL, so a following clip needs no extra pass. */
ac_result_t ac_cuda_unscale_check(ac_dtype_t dt, void *data, size_t n, const float *dev_inv_scale,
                                  float *dev_found_inf, float *dev_sumsq, void *stream);

/* dst[i] = (dst_dt) src[i] on the device. */
ac_result_t ac_cuda_cast(ac_dtype_t src_dt, const void *src, ac_dtype_t dst_dt, void *dst, size_t n,
                         void *stream);

/* Makes `device` the calling thread's current CUDA device, returning the one that was current
 * in *prev, for ac_cuda_device_leave(*prev). A kernel can only be launched on a stream of the
 * current device, so every launch on a caller's tensor runs between these two. */
ac_result_t ac_cuda_device_enter(int device, int *prev);
void ac_cuda_device_leave(int prev);

/* Events for ordering streams (the reducer's comm stream against the compute stream). */
ac_result_t ac_cuda_event_create(void **event); /* a cudaEvent_t without timing */
void ac_cuda_event_destroy(void *event);        /* NULL is a no-op */
/* `waiter` waits for the work queued so far on `waitee` (record `event` on waitee, then
 * cudaStreamWaitEvent); nothing blocks on the host. */
ac_result_t ac_cuda_stream_wait(void *waiter, void *waitee, void *event);

/* ---- staging device memory through pinned host memory (the checkpoint writer) ----------------
 * `device` is a CUDA device ordinal. The calls that take one make it the calling thread's
 * current device (cudaSetDevice) and leave it so: call them from threads of your own, not from
 * a thread whose current device others rely on (the safetensors writer calls them only from
 * the worker threads it starts; ac_cuda_check_device changes nothing). */

/* AC_OK if `device` is a visible CUDA device; AC_ERR_INVALID_ARG if it is out of range,
 * AC_ERR_CUDA when no driver or device can be reached (the message has the CUDA error text). */
ac_result_t ac_cuda_check_device(int device);

/* Page-locked host memory (cudaHostAlloc, portable: every device's streams can copy into it at
 * full speed). The driver hands out whole pages, so it is page-aligned in practice; callers
 * that need an alignment (O_DIRECT) still check. *ptr is NULL on failure. */
ac_result_t ac_cuda_host_alloc(void **ptr, size_t bytes, int device);
void ac_cuda_host_free(void *ptr); /* NULL is a no-op */

/* A stream of its own on `device` (non-blocking: not ordered with the legacy default stream,
 * so it never waits on, nor holds up, other work on the device). */
ac_result_t ac_cuda_stream_create(void **stream, int device);
void ac_cuda_stream_destroy(void *stream, int device); /* NULL is a no-op */

/* Queues a copy of n bytes from device memory `src` (on `device`) to host memory `dst` on
 * `stream` (cudaMemcpyAsync, DeviceToHost): asynchronous when dst is pinned. dst must stay
 * valid until ac_cuda_stream_sync on that stream has returned. */
ac_result_t ac_cuda_copy_to_host_async(void *dst, const void *src, size_t n, int device, void *stream);
/* Makes `stream` (of `device`) wait for `event` (recorded by someone else, on any stream of that
 * device) before the work queued on it next; the host does not block. */
ac_result_t ac_cuda_stream_wait_event(void *stream, void *event, int device);
/* Waits for everything queued on `stream` (of `device`); errors of the copies show here. */
ac_result_t ac_cuda_stream_sync(void *stream, int device);

#ifdef __cplusplus
}
#endif
#endif /* AC_CUDA_H */

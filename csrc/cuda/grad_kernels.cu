/* grad_kernels.cu — CUDA kernels for gradient post-processing over flat buffers (see ac/cuda.h). */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include <mutex>

#include "ac/cuda.h"

namespace {

template <typename T> struct Elt;
template <> struct Elt<float> {
  static __device__ __forceinline__ float load(const float *p, size_t i) { return p[i]; }
  static __device__ __forceinline__ void store(float *p, size_t i, float v) { p[i] = v; }
};
template <> struct Elt<__half> {
  static __device__ __forceinline__ float load(const __half *p, size_t i) { return __half2float(p[i]); }
  static __device__ __forceinline__ void store(__half *p, size_t i, float v) { p[i] = __float2half_rn(v); }
};
template <> struct Elt<__nv_bfloat16> {
  static __device__ __forceinline__ float load(const __nv_bfloat16 *p, size_t i) { return __bfloat162float(p[i]); }
  static __device__ __forceinline__ void store(__nv_bfloat16 *p, size_t i, float v) { p[i] = __float2bfloat16_rn(v); }
};

constexpr int kThreads = 256;

__device__ __forceinline__ bool nonfinite(float v) { return !(fabsf(v) < INFINITY); }

/* Block-wide reduction of (sum, max, flag) in a fixed order (lane shuffles, then warp 0's
 * sums in warp order). The block's sum goes to partials[blockIdx.x] (summed by finish_sum in
 * block order, so the total is bitwise the same run to run: float atomics would add the blocks
 * in whatever order they finish), or, with partials NULL (a one-block launch), straight into
 * *out_sum. The max is an integer atomic and the flag a plain store: both are order-free. */
__device__ void block_commit(double sum, float mx, int nf, double *partials, float *out_sum, float *out_max,
                             float *out_flag) {
  __shared__ double s_sum[kThreads / 32];
  __shared__ float s_max[kThreads / 32];
  __shared__ int s_nf[kThreads / 32];
  for (int off = 16; off > 0; off >>= 1) {
    sum += __shfl_down_sync(0xffffffffu, sum, off);
    mx = fmaxf(mx, __shfl_down_sync(0xffffffffu, mx, off));
    nf |= __shfl_down_sync(0xffffffffu, nf, off);
  }
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    s_sum[warp] = sum;
    s_max[warp] = mx;
    s_nf[warp] = nf;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double t = 0.0;
    float m = 0.0f;
    int f = 0;
    for (int w = 0; w < kThreads / 32; w++) {
      t += s_sum[w];
      m = fmaxf(m, s_max[w]);
      f |= s_nf[w];
    }
    if (out_sum && partials) partials[blockIdx.x] = t;
    else if (out_sum) *out_sum += (float)t;
    /* non-negative floats order like their bit patterns, so an integer max is a float max */
    if (out_max) atomicMax(reinterpret_cast<int *>(out_max), __float_as_int(m));
    if (f && out_flag) *out_flag = 1.0f;
  }
}

/* The second pass: one block adds the per-block partials in a fixed order (thread i takes
 * blocks i, i + kThreads, ...; then the same fixed tree as block_commit) into *out_sum. */
__global__ void finish_sum(const double *partials, unsigned nblocks, float *out_sum) {
  double sum = 0.0;
  for (unsigned i = threadIdx.x; i < nblocks; i += kThreads) sum += partials[i];
  block_commit(sum, 0.0f, 0, nullptr, out_sum, nullptr, nullptr);
}

template <typename T>
__global__ void stats_kernel(const T *p, size_t n, double *partials, float *out) {
  double sum = 0.0;
  float mx = 0.0f;
  int nf = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    float v = Elt<T>::load(p, i);
    sum += (double)v * v;
    mx = fmaxf(mx, fabsf(v));
    nf |= nonfinite(v);
  }
  block_commit(sum, mx, nf, partials, &out[0], &out[1], &out[2]);
}

template <typename T>
__global__ void scale_kernel(T *p, size_t n, float factor, const float *dev_factor) {
  float f = dev_factor ? factor * *dev_factor : factor;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    Elt<T>::store(p, i, Elt<T>::load(p, i) * f);
}

template <typename T>
__global__ void unscale_check_kernel(T *p, size_t n, const float *inv_scale, float *found_inf, double *partials,
                                     float *sumsq) {
  float f = *inv_scale;
  double sum = 0.0;
  int nf = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    Elt<T>::store(p, i, Elt<T>::load(p, i) * f);
    float v = Elt<T>::load(p, i);
    sum += (double)v * v;
    nf |= nonfinite(v);
  }
  block_commit(sum, 0.0f, nf, partials, sumsq, nullptr, found_inf);
}

template <typename S, typename D>
__global__ void cast_kernel(const S *src, D *dst, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    Elt<D>::store(dst, i, Elt<S>::load(src, i));
}

unsigned grid_for(size_t n) {
  size_t blocks = (n + kThreads - 1) / kThreads;
  return (unsigned)(blocks > 4096 ? 4096 : (blocks ? blocks : 1));
}

/* ---- scratch for the per-block partial sums ----------------------------------------------------
 * Taken from a memory pool of our own per device (stream-ordered: cudaMallocFromPoolAsync and
 * cudaFreeAsync on the launch's stream, so concurrent launches on other streams each get their
 * own, and nothing blocks the host). The pool keeps its memory (release threshold: never), so a
 * training step does not map and unmap device memory at every synchronisation, as the default
 * pool (threshold 0) would; it holds at most the few KiB of the largest grid in use. */
constexpr int kMaxDevices = 64;

cudaMemPool_t scratch_pool(int device) {
  static std::mutex mu;
  static cudaMemPool_t pools[kMaxDevices];
  static bool tried[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) return nullptr;
  std::lock_guard<std::mutex> lock(mu);
  if (!tried[device]) {
    tried[device] = true;
    int supported = 0;
    if (cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device) == cudaSuccess && supported) {
      cudaMemPoolProps props = {};
      props.allocType = cudaMemAllocationTypePinned;
      props.location.type = cudaMemLocationTypeDevice;
      props.location.id = device;
      cudaMemPool_t pool = nullptr;
      if (cudaMemPoolCreate(&pool, &props) == cudaSuccess) {
        uint64_t keep = UINT64_MAX;
        (void)cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
        pools[device] = pool;
      }
    }
    (void)cudaGetLastError();
  }
  return pools[device];
}

/* Scratch for `nblocks` partials on `s`, or NULL (then the caller launches one block, which
 * needs none: still deterministic, only slower) when no pool can be had on this device. */
double *scratch_alloc(unsigned nblocks, cudaStream_t s) {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  cudaMemPool_t pool = scratch_pool(device);
  void *p = nullptr;
  if (!pool || cudaMallocFromPoolAsync(&p, nblocks * sizeof(double), pool, s) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return static_cast<double *>(p);
}

ac_result_t launched(const char *what) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return AC_FAIL(AC_ERR_CUDA, "%s: kernel launch failed: %s", what, cudaGetErrorString(e));
  return AC_OK;
}

/* After a first pass that wrote partials (non-NULL): the fixed-order second pass into
 * *out_sum, then the scratch goes back to the pool (stream-ordered, after the pass). */
ac_result_t finish(double *partials, unsigned grid, float *out_sum, cudaStream_t s, const char *what) {
  ac_result_t r = launched(what);
  if (partials) {
    if (r == AC_OK) {
      finish_sum<<<1, kThreads, 0, s>>>(partials, grid, out_sum);
      r = launched(what);
    }
    if (cudaFreeAsync(partials, s) != cudaSuccess) (void)cudaGetLastError();
  }
  return r;
}

ac_result_t check_args(ac_dtype_t dt, const void *p, size_t n, const char *what) {
  if (ac_dtype_size(dt) == 0) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: invalid dtype code %d", what, (int)dt);
  if (n > 0 && !p) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: NULL data for %zu elements", what, n);
  return AC_OK;
}

/* Calls F<T>() with T the element type of dt. */
#define AC_DISPATCH(dt, F)                          \
  switch (dt) {                                     \
    case AC_F32: { typedef float T; F; } break;     \
    case AC_F16: { typedef __half T; F; } break;    \
    case AC_BF16: { typedef __nv_bfloat16 T; F; } break; \
  }

}  // namespace

extern "C" int ac_cuda_built(void) { return 1; }

extern "C" ac_result_t ac_cuda_device_count(int *count) {
  if (!count) return AC_FAIL(AC_ERR_INVALID_ARG, "count is NULL");
  int c = 0;
  cudaError_t e = cudaGetDeviceCount(&c);
  if (e != cudaSuccess) {
    /* no driver / no device is a normal state on CPU machines, not an error */
    (void)cudaGetLastError();
    c = 0;
  }
  *count = c;
  return AC_OK;
}

extern "C" ac_result_t ac_cuda_stats(ac_dtype_t dt, const void *data, size_t n, float *dev_out, void *stream) {
  AC_CHECK(check_args(dt, data, n, "ac_cuda_stats"));
  if (!dev_out) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_cuda_stats: dev_out is NULL");
  if (n == 0) return AC_OK;
  cudaStream_t s = (cudaStream_t)stream;
  unsigned grid = grid_for(n);
  double *partials = grid > 1 ? scratch_alloc(grid, s) : nullptr;
  if (!partials) grid = 1;
  AC_DISPATCH(dt, (stats_kernel<T><<<grid, kThreads, 0, s>>>((const T *)data, n, partials, dev_out)));
  return finish(partials, grid, dev_out, s, "ac_cuda_stats");
}

extern "C" ac_result_t ac_cuda_scale(ac_dtype_t dt, void *data, size_t n, float factor, const float *dev_factor,
                                     void *stream) {
  AC_CHECK(check_args(dt, data, n, "ac_cuda_scale"));
  if (n == 0) return AC_OK;
  cudaStream_t s = (cudaStream_t)stream;
  AC_DISPATCH(dt, (scale_kernel<T><<<grid_for(n), kThreads, 0, s>>>((T *)data, n, factor, dev_factor)));
  return launched("ac_cuda_scale");
}

extern "C" ac_result_t ac_cuda_unscale_check(ac_dtype_t dt, void *data, size_t n, const float *dev_inv_scale,
                                             float *dev_found_inf, float *dev_sumsq, void *stream) {
  AC_CHECK(check_args(dt, data, n, "ac_cuda_unscale_check"));
  if (!dev_inv_scale || !dev_found_inf)
    return AC_FAIL(AC_ERR_INVALID_ARG, "ac_cuda_unscale_check: inv_scale and found_inf must be device pointers");
  if (n == 0) return AC_OK;
  cudaStream_t s = (cudaStream_t)stream;
  unsigned grid = grid_for(n);
  double *partials = dev_sumsq && grid > 1 ? scratch_alloc(grid, s) : nullptr;
  if (dev_sumsq && !partials) grid = 1;
  AC_DISPATCH(dt, (unscale_check_kernel<T><<<grid, kThreads, 0, s>>>((T *)data, n, dev_inv_scale, dev_found_inf,
                                                                       partials, dev_sumsq)));
  return finish(partials, grid, dev_sumsq, s, "ac_cuda_unscale_check");
}

extern "C" ac_result_t ac_cuda_cast(ac_dtype_t src_dt, const void *src, ac_dtype_t dst_dt, void *dst, size_t n,
                                    void *stream) {
  AC_CHECK(check_args(src_dt, src, n, "ac_cuda_cast (source)"));
  AC_CHECK(check_args(dst_dt, dst, n, "ac_cuda_cast (destination)"));
  if (n == 0) return AC_OK;
  cudaStream_t s = (cudaStream_t)stream;
  if (src_dt == dst_dt) {
    cudaError_t e = cudaMemcpyAsync(dst, src, n * ac_dtype_size(src_dt), cudaMemcpyDeviceToDevice, s);
    if (e != cudaSuccess) return AC_FAIL(AC_ERR_CUDA, "ac_cuda_cast: copy failed: %s", cudaGetErrorString(e));
    return AC_OK;
  }
#define AC_CAST_TO(D) AC_DISPATCH(src_dt, (cast_kernel<T, D><<<grid_for(n), kThreads, 0, s>>>((const T *)src, (D *)dst, n)))
  switch (dst_dt) {
    case AC_F32: AC_CAST_TO(float); break;
    case AC_F16: AC_CAST_TO(__half); break;
    case AC_BF16: AC_CAST_TO(__nv_bfloat16); break;
  }
#undef AC_CAST_TO
  return launched("ac_cuda_cast");
}

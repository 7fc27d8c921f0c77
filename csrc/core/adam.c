/* adam.c — torch's Adam / AdamW update in one pass, or two around torch.sqrt (ac/adam.h says what
 * is computed and why it matches torch). The order of operations below is torch's _single_tensor_adam, each line one
 * of its tensor operations rounded to fp32 as that operation's kernel rounds. Built with
 * -ffp-contract=off (setup.py, tests/c/run.sh), so the compiler fuses no multiply and add by
 * itself: a fused multiply-add happens only where fmaf / _mm256_fmadd_ps is written, which is
 * where torch's kernels fuse. */
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
#define _GNU_SOURCE /* RTLD_NOLOAD */
#include <dlfcn.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "ac/adam.h"
#include "ac/kernels.h"
#include "ac/pool.h"

/* Elements per task: fixed, and any split gives the same values (every operation is
 * elementwise); 64 Ki elements amortise a task claim. */
#define ADAM_CHUNK ((size_t)1 << 16)

static inline float mul_add(float a, float b, float c, int fma) { return fma ? fmaf(a, b, c) : a * b + c; }

/* The moments of one element: torch's operations in order. */
static inline void moments_one(const ac_adam_param_t *q, size_t i, int flags) {
  const int fma = (flags & AC_ADAM_FMA) != 0;
  float g = q->grad[i];
  if (flags & AC_ADAM_MAXIMIZE) g = -g;                                 /* grad = -grad */
  if ((flags & AC_ADAM_DECAY) && !(flags & AC_ADAM_DECOUPLED))
    g = mul_add(q->decay, q->param[i], g, fma);                         /* grad.add(param, alpha=wd) */
  float m = q->exp_avg[i];
  const float d = g - m;                                                /* lerp_(grad, w): end - self */
  if (fabsf(q->lerp_w) < 0.5f) m = mul_add(q->lerp_w, d, m, fma);       /* self + w*(end - self) */
  else m = mul_add(q->lerp_w - 1.0f, d, g, fma);                        /* end + (w - 1)*(end - self) */
  const float v = q->exp_avg_sq[i] * q->beta2;                          /* exp_avg_sq.mul_(beta2) */
  q->exp_avg[i] = m;
  q->exp_avg_sq[i] = mul_add(q->one_minus_beta2 * g, g, v, fma);        /* .addcmul_(grad, grad, 1 - beta2) */
}

/* The parameter of one element, from torch's sqrt of its exp_avg_sq (`root`). */
static inline void apply_one(const ac_adam_param_t *q, size_t i, float root, int flags) {
  float p = q->param[i];
  if ((flags & AC_ADAM_DECAY) && (flags & AC_ADAM_DECOUPLED)) p = p * q->decay;  /* param.mul_(1 - lr*wd) */
  float den = root / q->bias2_sqrt;                                     /* sqrt / bias_correction2_sqrt */
  den = den + q->eps;                                                   /* .add_(eps) */
  const float num = q->neg_step * q->exp_avg[i];                        /* addcdiv_(exp_avg, denom, -step) */
  q->param[i] = p + num / den;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define AVX __attribute__((target("avx2,fma")))
#define HAVE_AVX2_PATH 1

AVX static inline __m256 mul_add8(__m256 a, __m256 b, __m256 c, int fma) {
  return fma ? _mm256_fmadd_ps(a, b, c) : _mm256_add_ps(_mm256_mul_ps(a, b), c);
}

AVX static void moments_avx2(const ac_adam_param_t *q, size_t lo, size_t hi, int flags) {
  const int fma = (flags & AC_ADAM_FMA) != 0, l2 = (flags & AC_ADAM_DECAY) && !(flags & AC_ADAM_DECOUPLED);
  const int small = fabsf(q->lerp_w) < 0.5f;
  const __m256 decay = _mm256_set1_ps(q->decay), beta2 = _mm256_set1_ps(q->beta2);
  const __m256 omb2 = _mm256_set1_ps(q->one_minus_beta2), sign = _mm256_set1_ps(-0.0f);
  const __m256 coeff = _mm256_set1_ps(small ? q->lerp_w : q->lerp_w - 1.0f);
  size_t i = lo;
  for (; i + 8 <= hi; i += 8) {
    __m256 g = _mm256_loadu_ps(q->grad + i);
    if (flags & AC_ADAM_MAXIMIZE) g = _mm256_xor_ps(g, sign);
    if (l2) g = mul_add8(decay, _mm256_loadu_ps(q->param + i), g, fma);
    __m256 m = _mm256_loadu_ps(q->exp_avg + i);
    m = mul_add8(coeff, _mm256_sub_ps(g, m), small ? m : g, fma);
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(q->exp_avg_sq + i), beta2);
    _mm256_storeu_ps(q->exp_avg + i, m);
    _mm256_storeu_ps(q->exp_avg_sq + i, mul_add8(_mm256_mul_ps(omb2, g), g, v, fma));
  }
  for (; i < hi; i++) moments_one(q, i, flags);
}

/* root[0] is element lo's */
AVX static void apply_avx2(const ac_adam_param_t *q, size_t lo, size_t hi, const float *root, int flags) {
  const int decoupled = (flags & AC_ADAM_DECAY) && (flags & AC_ADAM_DECOUPLED);
  const __m256 decay = _mm256_set1_ps(q->decay), bias2 = _mm256_set1_ps(q->bias2_sqrt);
  const __m256 eps = _mm256_set1_ps(q->eps), neg_step = _mm256_set1_ps(q->neg_step);
  size_t i = lo;
  for (; i + 8 <= hi; i += 8) {
    __m256 p = _mm256_loadu_ps(q->param + i);
    if (decoupled) p = _mm256_mul_ps(p, decay);
    const __m256 den = _mm256_add_ps(_mm256_div_ps(_mm256_loadu_ps(root + (i - lo)), bias2), eps);
    const __m256 num = _mm256_mul_ps(neg_step, _mm256_loadu_ps(q->exp_avg + i));
    _mm256_storeu_ps(q->param + i, _mm256_add_ps(p, _mm256_div_ps(num, den)));
  }
  for (; i < hi; i++) apply_one(q, i, root[i - lo], flags);
}
#endif

static void moments_range(const ac_adam_param_t *q, size_t lo, size_t hi, int flags, int avx2) {
#ifdef HAVE_AVX2_PATH
  if (avx2) {
    moments_avx2(q, lo, hi, flags);
    return;
  }
#endif
  (void)avx2;
  for (size_t i = lo; i < hi; i++) moments_one(q, i, flags);
}

static void apply_range(const ac_adam_param_t *q, size_t lo, size_t hi, const float *root, int flags, int avx2) {
#ifdef HAVE_AVX2_PATH
  if (avx2) {
    apply_avx2(q, lo, hi, root, flags);
    return;
  }
#endif
  (void)avx2;
  for (size_t i = lo; i < hi; i++) apply_one(q, i, root[i - lo], flags);
}

/* The square root torch computes (MKL's vmsSqrt with the mode ATen's vml.h passes, found in
 * torch's own library by ac_adam_load_sqrt): with it the three steps run on cache-sized blocks in
 * one pass. The mode is explicit, as torch's: vsSqrt would follow the calling thread's
 * vmlSetMode, which another MKL user in the process may change. */
typedef void (*sqrt_fn_t)(int n, const float *a, float *r, long long mode);
#define TORCH_VML_MODE 0x140102LL /* VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE */
static _Atomic(sqrt_fn_t) torch_sqrt;
#define ADAM_BLOCK 2048 /* elements per block: 8 KiB of each array, in L1 across the three steps */

enum { MODE_MOMENTS, MODE_APPLY, MODE_FUSED };

typedef struct {
  const ac_adam_param_t *params;
  size_t *tasks; /* per task: parameter index, first element, end (3 entries) */
  int flags;
  int mode;
  int avx2;
  sqrt_fn_t sqrt;
} adam_job_t;

static void run_task(void *ctx, size_t t) {
  const adam_job_t *j = ctx;
  const ac_adam_param_t *q = &j->params[j->tasks[3 * t]];
  const size_t lo = j->tasks[3 * t + 1], hi = j->tasks[3 * t + 2];
  if (j->mode == MODE_MOMENTS) {
    moments_range(q, lo, hi, j->flags, j->avx2);
  } else if (j->mode == MODE_APPLY) {
    apply_range(q, lo, hi, q->root + lo, j->flags, j->avx2);
  } else {
    float root[ADAM_BLOCK];
    for (size_t b = lo; b < hi; b += ADAM_BLOCK) {
      const size_t e = b + ADAM_BLOCK < hi ? b + ADAM_BLOCK : hi;
      moments_range(q, b, e, j->flags, j->avx2);
      j->sqrt((int)(e - b), q->exp_avg_sq + b, root, TORCH_VML_MODE);
      apply_range(q, b, e, root, j->flags, j->avx2);
    }
  }
}

const char *ac_adam_isa(void) { return strcmp(ac_kernels_isa(), "avx2") == 0 ? "avx2" : "scalar"; }

static ac_result_t run(const ac_adam_param_t *params, size_t count, int flags, int mode) {
  static const char *names[] = {"adam_moments", "adam_apply", "adam_fused"};
  const char *fn = names[mode];
  sqrt_fn_t sq = atomic_load(&torch_sqrt);
  if (mode == MODE_FUSED && !sq)
    return AC_FAIL(AC_ERR_STATE, "%s: torch's square root was not found (ac_adam_load_sqrt)", fn);
  if (count > 0 && !params) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: NULL parameter array", fn);
  size_t ntasks = 0;
  for (size_t k = 0; k < count; k++) {
    const ac_adam_param_t *q = &params[k];
    const int l2 = (flags & AC_ADAM_DECAY) && !(flags & AC_ADAM_DECOUPLED);
    const int moments_missing = !q->grad || !q->exp_avg || !q->exp_avg_sq || (!q->param && l2);
    const int apply_missing = !q->param || !q->exp_avg || (!q->root && mode == MODE_APPLY);
    const int missing = mode == MODE_MOMENTS ? moments_missing
                        : mode == MODE_APPLY ? apply_missing : (moments_missing || apply_missing);
    if (q->n > 0 && missing)
      return AC_FAIL(AC_ERR_INVALID_ARG, "%s: parameter %zu has a NULL tensor for %zu elements", fn, k, q->n);
    ntasks += (q->n + ADAM_CHUNK - 1) / ADAM_CHUNK;
  }
  if (ntasks == 0) return AC_OK;
  adam_job_t j = {params, malloc(3 * ntasks * sizeof(size_t)), flags, mode, strcmp(ac_adam_isa(), "avx2") == 0, sq};
  if (!j.tasks) return AC_FAIL(AC_ERR_NOMEM, "%s: %zu tasks", fn, ntasks);
  size_t t = 0;
  for (size_t k = 0; k < count; k++)
    for (size_t lo = 0; lo < params[k].n; lo += ADAM_CHUNK) {
      j.tasks[3 * t] = k;
      j.tasks[3 * t + 1] = lo;
      j.tasks[3 * t + 2] = lo + ADAM_CHUNK < params[k].n ? lo + ADAM_CHUNK : params[k].n;
      t++;
    }
  ac_result_t r = AC_OK;
  if (ntasks == 1) run_task(&j, 0); /* a small parameter: no pool hand-off */
  else r = ac_pool_run(ntasks, run_task, &j);
  free(j.tasks);
  return r;
}

ac_result_t ac_adam_moments(const ac_adam_param_t *params, size_t count, int flags) {
  return run(params, count, flags, MODE_MOMENTS);
}

ac_result_t ac_adam_apply(const ac_adam_param_t *params, size_t count, int flags) {
  return run(params, count, flags, MODE_APPLY);
}

ac_result_t ac_adam_fused(const ac_adam_param_t *params, size_t count, int flags) {
  return run(params, count, flags, MODE_FUSED);
}

ac_result_t ac_adam_load_sqrt(const char *library) {
  if (!library) return AC_FAIL(AC_ERR_INVALID_ARG, "adam_load_sqrt: NULL library path");
  /* RTLD_NOLOAD: only a library torch has loaded already (no second copy of MKL) */
  void *h = dlopen(library, RTLD_LAZY | RTLD_NOLOAD);
  if (!h) return AC_FAIL(AC_ERR_UNSUPPORTED, "adam_load_sqrt: %s is not loaded in this process", library);
  void *f = dlsym(h, "vmsSqrt"); /* MKL's LP64 name (int counts): blocks are at most ADAM_BLOCK long */
  if (!f) {
    dlclose(h);
    return AC_FAIL(AC_ERR_UNSUPPORTED, "adam_load_sqrt: %s has no vmsSqrt (torch built without MKL)", library);
  }
  /* the handle stays open: the library must outlive the pointer (torch keeps it loaded anyway) */
  sqrt_fn_t fp;
  memcpy(&fp, &f, sizeof fp); /* object pointer to function pointer, as POSIX allows */
  atomic_store(&torch_sqrt, fp);
  return AC_OK;
}

void ac_adam_unload_sqrt(void) { atomic_store(&torch_sqrt, (sqrt_fn_t)NULL); }

ac_result_t ac_adam_sqrt(const float *a, float *r, size_t n) {
  sqrt_fn_t sq = atomic_load(&torch_sqrt);
  if (!sq) return AC_FAIL(AC_ERR_STATE, "adam_sqrt: torch's square root was not found (ac_adam_load_sqrt)");
  if (n > 0 && (!a || !r)) return AC_FAIL(AC_ERR_INVALID_ARG, "adam_sqrt: NULL buffer for %zu elements", n);
  for (size_t b = 0; b < n; b += ADAM_BLOCK)
    sq((int)(n - b < ADAM_BLOCK ? n - b : ADAM_BLOCK), a + b, r + b, TORCH_VML_MODE);
  return AC_OK;
}

int ac_adam_denormals_flushed(void) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  return (_mm_getcsr() & 0x8040u) != 0; /* FTZ (bit 15) or DAZ (bit 6) */
#else
  return 0;
#endif
}

/* adam.c — torch's Adam / AdamW update in two passes (ac/adam.h says what is computed and why it
 * matches torch). The order of operations below is torch's _single_tensor_adam, each line one
 * of its tensor operations rounded to fp32 as that operation's kernel rounds. Compiled in ISO C
 * (-std=c11), so the compiler fuses no multiply and add by itself: a fused multiply-add happens
 * only where fmaf / _mm256_fmadd_ps is written, which is where torch's kernels fuse. */
#include <math.h>
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

/* The parameter of one element, from torch's sqrt of exp_avg_sq. */
static inline void apply_one(const ac_adam_param_t *q, size_t i, int flags) {
  float p = q->param[i];
  if ((flags & AC_ADAM_DECAY) && (flags & AC_ADAM_DECOUPLED)) p = p * q->decay;  /* param.mul_(1 - lr*wd) */
  float den = q->root[i] / q->bias2_sqrt;                               /* sqrt / bias_correction2_sqrt */
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

AVX static void apply_avx2(const ac_adam_param_t *q, size_t lo, size_t hi, int flags) {
  const int decoupled = (flags & AC_ADAM_DECAY) && (flags & AC_ADAM_DECOUPLED);
  const __m256 decay = _mm256_set1_ps(q->decay), bias2 = _mm256_set1_ps(q->bias2_sqrt);
  const __m256 eps = _mm256_set1_ps(q->eps), neg_step = _mm256_set1_ps(q->neg_step);
  size_t i = lo;
  for (; i + 8 <= hi; i += 8) {
    __m256 p = _mm256_loadu_ps(q->param + i);
    if (decoupled) p = _mm256_mul_ps(p, decay);
    const __m256 den = _mm256_add_ps(_mm256_div_ps(_mm256_loadu_ps(q->root + i), bias2), eps);
    const __m256 num = _mm256_mul_ps(neg_step, _mm256_loadu_ps(q->exp_avg + i));
    _mm256_storeu_ps(q->param + i, _mm256_add_ps(p, _mm256_div_ps(num, den)));
  }
  for (; i < hi; i++) apply_one(q, i, flags);
}
#endif

typedef struct {
  const ac_adam_param_t *params;
  size_t *tasks; /* per task: parameter index, first element, end (3 entries) */
  int flags;
  int apply;     /* 0: moments, 1: apply */
  int avx2;
} adam_job_t;

static void run_task(void *ctx, size_t t) {
  const adam_job_t *j = ctx;
  const ac_adam_param_t *q = &j->params[j->tasks[3 * t]];
  const size_t lo = j->tasks[3 * t + 1], hi = j->tasks[3 * t + 2];
#ifdef HAVE_AVX2_PATH
  if (j->avx2) {
    if (j->apply) apply_avx2(q, lo, hi, j->flags);
    else moments_avx2(q, lo, hi, j->flags);
    return;
  }
#endif
  for (size_t i = lo; i < hi; i++) {
    if (j->apply) apply_one(q, i, j->flags);
    else moments_one(q, i, j->flags);
  }
}

const char *ac_adam_isa(void) { return strcmp(ac_kernels_isa(), "avx2") == 0 ? "avx2" : "scalar"; }

static ac_result_t run(const ac_adam_param_t *params, size_t count, int flags, int apply) {
  const char *fn = apply ? "adam_apply" : "adam_moments";
  if (count > 0 && !params) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: NULL parameter array", fn);
  size_t ntasks = 0;
  for (size_t k = 0; k < count; k++) {
    const ac_adam_param_t *q = &params[k];
    const int missing = apply ? (!q->param || !q->exp_avg || !q->root)
                              : (!q->grad || !q->exp_avg || !q->exp_avg_sq ||
                                 (!q->param && (flags & AC_ADAM_DECAY) && !(flags & AC_ADAM_DECOUPLED)));
    if (q->n > 0 && missing)
      return AC_FAIL(AC_ERR_INVALID_ARG, "%s: parameter %zu has a NULL tensor for %zu elements", fn, k, q->n);
    ntasks += (q->n + ADAM_CHUNK - 1) / ADAM_CHUNK;
  }
  if (ntasks == 0) return AC_OK;
  adam_job_t j = {params, malloc(3 * ntasks * sizeof(size_t)), flags, apply, strcmp(ac_adam_isa(), "avx2") == 0};
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
  return run(params, count, flags, 0);
}

ac_result_t ac_adam_apply(const ac_adam_param_t *params, size_t count, int flags) {
  return run(params, count, flags, 1);
}

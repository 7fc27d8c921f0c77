/* adam.h — torch.optim.Adam / AdamW's update (torch's single-tensor path for fp32 CPU tensors)
 * in one pass over each parameter instead of torch's nine, element for element the values
 * torch computes.
 *
 * torch runs the update as ~9 tensor operations per parameter (weight decay, lerp of the first
 * moment, mul and addcmul of the second, sqrt, division, add of eps, addcdiv), each a pass over
 * memory that rounds its result to fp32. These kernels apply the same operations in the same
 * order with the same roundings: ac_adam_moments the moments' update, ac_adam_apply the
 * parameter's, ac_adam_fused both with the square root between them on cache-sized blocks.
 * The square root must be torch's own: torch computes it with MKL's vector sqrt, which
 * differs from the correctly rounded square root in the last bit of ~0.7% of the elements. So
 * ac_adam_fused calls it from torch's library (vmsSqrt with the mode ATen passes:
 * ac_adam_load_sqrt), and without it the caller
 * runs the two passes with torch.sqrt between them.
 * Two torch operations are fused multiply-adds in torch's vectorised CPU kernels (AVX2 /
 * AVX-512 capability): lerp (vec::fmadd, and its scalar tail contracted by the compiler) and
 * addcmul (self + value*t1*t2 contracted), and Adam's L2 weight decay (add with alpha); with
 * torch's DEFAULT capability none is. AC_ADAM_FMA selects which: the caller reads torch's
 * capability. Every operation is elementwise, so the result does not depend on how the work is
 * split. */
#ifndef AC_ADAM_H
#define AC_ADAM_H

#include <stddef.h>

#include "ac/ac.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One parameter's tensors (fp32, contiguous, n elements each) and the step's constants, each
 * the fp32 value torch converts its Python scalar to. */
typedef struct {
  float *param;       /* apply: updated; moments: read for Adam's L2 decay */
  const float *grad;  /* moments */
  float *exp_avg;     /* moments: updated; apply: read */
  float *exp_avg_sq;  /* moments: updated */
  const float *root;  /* apply: torch.sqrt(exp_avg_sq) after the moments' update */
  size_t n;
  float decay;      /* decoupled (AdamW): param *= decay (1 - lr*weight_decay); L2 (Adam): grad += decay*param */
  float lerp_w;     /* 1 - beta1 */
  float beta2;
  float one_minus_beta2;
  float bias2_sqrt; /* sqrt(1 - beta2**step) */
  float eps;
  float neg_step;   /* -lr / (1 - beta1**step) */
} ac_adam_param_t;

enum {
  AC_ADAM_DECOUPLED = 1, /* AdamW's decay of the parameter (else Adam's L2 term in the gradient) */
  AC_ADAM_DECAY = 2,     /* weight_decay != 0 */
  AC_ADAM_MAXIMIZE = 4,  /* the gradient negated */
  AC_ADAM_FMA = 8        /* torch's vectorised capability: lerp, addcmul and L2 decay fused */
};

/* The moments of params[0..count) in place: exp_avg's lerp towards the gradient (after
 * maximize's negation and Adam's L2 term) and exp_avg_sq's mul and addcmul. */
ac_result_t ac_adam_moments(const ac_adam_param_t *params, size_t count, int flags);

/* The parameters of params[0..count) in place from exp_avg and root: AdamW's decay, then
 * param + (neg_step*exp_avg) / (root/bias2_sqrt + eps).
 * Both split the elements over the pool and return AC_ERR_INVALID_ARG for a NULL pointer they
 * need with n > 0. */
ac_result_t ac_adam_apply(const ac_adam_param_t *params, size_t count, int flags);

/* The moments, torch's square root and the parameters on blocks of a few thousand elements,
 * in one pass over memory. Needs torch's square root: AC_ERR_STATE until ac_adam_load_sqrt. */
ac_result_t ac_adam_fused(const ac_adam_param_t *params, size_t count, int flags);

/* Finds the square root torch.sqrt computes with (MKL's vmsSqrt, called with ATen's mode) in
 * `library`, a library this process has loaded (torch's libtorch_cpu): AC_ERR_UNSUPPORTED when
 * it is not loaded or has no vmsSqrt. The caller checks that it gives torch.sqrt's values before relying on it.
 * ac_adam_unload_sqrt forgets it (tests). */
ac_result_t ac_adam_load_sqrt(const char *library);
void ac_adam_unload_sqrt(void);
/* r[i] = that square root of a[i] (for the caller's check). AC_ERR_STATE before loading. */
ac_result_t ac_adam_sqrt(const float *a, float *r, size_t n);

/* 1 when the calling thread flushes denormals (FTZ/DAZ, torch.set_flush_denormal(True)): torch's
 * own result then depends on which of its threads ran which element, so the caller leaves the
 * step to torch. */
int ac_adam_denormals_flushed(void);

/* "avx2" or "scalar": which code the kernels run here (follows ac_kernels_set_isa). */
const char *ac_adam_isa(void);

#ifdef __cplusplus
}
#endif
#endif /* AC_ADAM_H */

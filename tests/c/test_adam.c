/* test_adam.c — csrc/include/ac/adam.h: the AVX2 path and the scalar path give the same bits
 * (NaN, infinities and subnormals included) on every size, flag set and thread count, since the
 * Python tests hold the kernels to torch through one of them (tests/test_fused_adam.py runs
 * both); a split over the pool changes nothing; the one-pass form (ac_adam_fused, with
 * tests/c/fake_vml.c standing in for MKL's vmsSqrt) equals the two passes with the same square
 * root; every argument error. Run under ASan/UBSan and ThreadSanitizer. */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "ac/adam.h"
#include "ac/kernels.h"
#include "ac/pool.h"
#include "test_util.h"

static const size_t SIZES[] = {0, 1, 7, 8, 9, 65535, 65536, 65537, 200003};
#define NSIZES (sizeof SIZES / sizeof SIZES[0])

static uint64_t rng = 88172645463325252ull;
static float rnd(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (float)((double)(rng >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

typedef struct {
  float *p, *g, *m, *v, *root;
  size_t n;
} bufs_t;

static bufs_t make(size_t n) {
  bufs_t b = {malloc((n + 1) * 4), malloc((n + 1) * 4), malloc((n + 1) * 4), malloc((n + 1) * 4),
              malloc((n + 1) * 4), n};
  for (size_t i = 0; i < n; i++) {
    b.p[i] = rnd();
    b.g[i] = rnd() * 1e-2f;
    b.m[i] = rnd() * 1e-3f;
    b.v[i] = fabsf(rnd()) * 1e-5f;
  }
  if (n > 6) { /* special values: NaN, infinities, a subnormal, a zero second moment */
    b.g[0] = NAN;
    b.g[1] = INFINITY;
    b.g[2] = -INFINITY;
    b.g[3] = 1e-41f;
    b.v[4] = 0.0f;
    b.g[4] = 0.0f;
    b.m[5] = -0.0f;
  }
  return b;
}

static bufs_t clone(const bufs_t *a) {
  bufs_t b = make(a->n);
  memcpy(b.p, a->p, a->n * 4);
  memcpy(b.g, a->g, a->n * 4);
  memcpy(b.m, a->m, a->n * 4);
  memcpy(b.v, a->v, a->n * 4);
  return b;
}

static void drop(bufs_t *b) {
  free(b->p);
  free(b->g);
  free(b->m);
  free(b->v);
  free(b->root);
}

static ac_adam_param_t param_of(bufs_t *b, float lerp_w) {
  ac_adam_param_t q = {b->p, b->g, b->m, b->v, b->root, b->n, 0.99f, lerp_w, 0.999f, 0.001f, 0.0316f, 1e-8f,
                       -0.0123f};
  return q;
}

/* Both passes with the square root between them (the tests' stand-in for torch's). */
static void step(bufs_t *b, float lerp_w, int flags) {
  ac_adam_param_t q = param_of(b, lerp_w);
  CHECK_OK(ac_adam_moments(&q, 1, flags));
  for (size_t i = 0; i < b->n; i++) b->root[i] = sqrtf(b->v[i]);
  CHECK_OK(ac_adam_apply(&q, 1, flags));
}

static int same_bits(const float *a, const float *b, size_t n) { return memcmp(a, b, n * 4) == 0; }

TEST(avx2_equals_scalar_on_every_size_and_flag_set) {
  if (ac_kernels_set_isa("avx2") != AC_OK) {
    printf("    no AVX2 here: only the scalar path runs\n");
    return;
  }
  for (size_t s = 0; s < NSIZES; s++)
    for (int flags = 0; flags < 16; flags++)
      for (int branch = 0; branch < 2; branch++) {
        const float w = branch ? 0.7f : 0.1f; /* lerp's two formulas */
        bufs_t a = make(SIZES[s]), b = clone(&a);
        CHECK_OK(ac_kernels_set_isa("avx2"));
        CHECK_STREQ(ac_adam_isa(), "avx2");
        step(&a, w, flags);
        CHECK_OK(ac_kernels_set_isa("scalar"));
        CHECK_STREQ(ac_adam_isa(), "scalar");
        step(&b, w, flags);
        if (!CHECK_MSG(same_bits(a.p, b.p, a.n) && same_bits(a.m, b.m, a.n) && same_bits(a.v, b.v, a.n),
                       "n=%zu flags=%d w=%g", a.n, flags, (double)w)) {
          drop(&a);
          drop(&b);
          return;
        }
        drop(&a);
        drop(&b);
      }
  CHECK_OK(ac_kernels_set_isa("avx2"));
}

TEST(thread_count_changes_nothing) {
  bufs_t a = make(500001), b = clone(&a);
  CHECK_OK(ac_pool_set_threads(1));
  step(&a, 0.1f, AC_ADAM_FMA | AC_ADAM_DECAY | AC_ADAM_DECOUPLED);
  CHECK_OK(ac_pool_set_threads(4));
  step(&b, 0.1f, AC_ADAM_FMA | AC_ADAM_DECAY | AC_ADAM_DECOUPLED);
  CHECK(same_bits(a.p, b.p, a.n) && same_bits(a.m, b.m, a.n) && same_bits(a.v, b.v, a.n));
  drop(&a);
  drop(&b);
}

TEST(fma_flag_changes_the_rounding) {
  /* the flag is not ignored: lerp and addcmul round differently with and without it */
  bufs_t a = make(4096), b = clone(&a);
  step(&a, 0.1f, AC_ADAM_FMA);
  step(&b, 0.1f, 0);
  CHECK(!same_bits(a.m, b.m, a.n) || !same_bits(a.v, b.v, a.n));
  drop(&a);
  drop(&b);
}

TEST(several_parameters_in_one_call) {
  bufs_t x[3] = {make(100), make(70000), make(5)}, y[3];
  ac_adam_param_t qs[3];
  for (int k = 0; k < 3; k++) {
    y[k] = clone(&x[k]);
    qs[k] = param_of(&x[k], 0.1f);
    qs[k].neg_step = -0.001f * (float)(k + 1); /* each its own step size */
  }
  CHECK_OK(ac_adam_moments(qs, 3, AC_ADAM_FMA));
  for (int k = 0; k < 3; k++)
    for (size_t i = 0; i < x[k].n; i++) x[k].root[i] = sqrtf(x[k].v[i]);
  CHECK_OK(ac_adam_apply(qs, 3, AC_ADAM_FMA));
  for (int k = 0; k < 3; k++) {
    ac_adam_param_t q = param_of(&y[k], 0.1f);
    q.neg_step = -0.001f * (float)(k + 1);
    CHECK_OK(ac_adam_moments(&q, 1, AC_ADAM_FMA));
    for (size_t i = 0; i < y[k].n; i++) y[k].root[i] = sqrtf(y[k].v[i]);
    CHECK_OK(ac_adam_apply(&q, 1, AC_ADAM_FMA));
    CHECK(same_bits(x[k].p, y[k].p, x[k].n) && same_bits(x[k].m, y[k].m, x[k].n));
    drop(&x[k]);
    drop(&y[k]);
  }
}

TEST(argument_errors) {
  CHECK_RC(ac_adam_moments(NULL, 1, 0), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_adam_apply(NULL, 2, 0), AC_ERR_INVALID_ARG);
  CHECK_OK(ac_adam_moments(NULL, 0, 0)); /* nothing to do */
  bufs_t b = make(10);
  ac_adam_param_t q = param_of(&b, 0.1f);
  q.root = NULL;
  CHECK_OK(ac_adam_moments(&q, 1, 0)); /* the moments do not read the root */
  CHECK_RC(ac_adam_apply(&q, 1, 0), AC_ERR_INVALID_ARG);
  q = param_of(&b, 0.1f);
  q.param = NULL; /* read by the moments only for Adam's L2 decay */
  CHECK_OK(ac_adam_moments(&q, 1, AC_ADAM_DECAY | AC_ADAM_DECOUPLED));
  CHECK_RC(ac_adam_moments(&q, 1, AC_ADAM_DECAY), AC_ERR_INVALID_ARG);
  q = param_of(&b, 0.1f);
  q.grad = NULL;
  CHECK_RC(ac_adam_moments(&q, 1, 0), AC_ERR_INVALID_ARG);
  q.n = 0; /* a NULL tensor of no elements is fine */
  CHECK_OK(ac_adam_moments(&q, 1, 0));
  drop(&b);
  ac_pool_shutdown(); /* LeakSanitizer: no live worker stacks at exit */
}

TEST(fused_equals_two_passes_with_the_same_root) {
  bufs_t b0 = make(8);
  ac_adam_param_t q0 = param_of(&b0, 0.1f);
  CHECK_RC(ac_adam_fused(&q0, 1, 0), AC_ERR_STATE); /* no square root loaded yet */
  CHECK_RC(ac_adam_sqrt(b0.v, b0.root, 8), AC_ERR_STATE);
  CHECK_RC(ac_adam_load_sqrt("/nonexistent/libnothing.so"), AC_ERR_UNSUPPORTED);
  const char *lib = getenv("AC_FAKE_VML");
  if (!CHECK_MSG(lib != NULL, "run.sh sets AC_FAKE_VML")) {
    drop(&b0);
    return;
  }
  CHECK_RC(ac_adam_load_sqrt(lib), AC_ERR_UNSUPPORTED); /* not loaded in the process yet: refused */
  void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
  CHECK(h != NULL);
  CHECK_OK(ac_adam_load_sqrt(lib));
  for (size_t s = 0; s < NSIZES; s++)
    for (int flags = 0; flags < 16; flags++) {
      bufs_t a = make(SIZES[s]), b = clone(&a);
      ac_adam_param_t q = param_of(&a, flags & 1 ? 0.7f : 0.1f);
      CHECK_OK(ac_adam_fused(&q, 1, flags));
      step(&b, flags & 1 ? 0.7f : 0.1f, flags); /* two passes, sqrtf between: the fake's values */
      CHECK_MSG(same_bits(a.p, b.p, a.n) && same_bits(a.m, b.m, a.n) && same_bits(a.v, b.v, a.n), "n=%zu flags=%d",
                a.n, flags);
      drop(&a);
      drop(&b);
    }
  CHECK_OK(ac_adam_sqrt(b0.v, b0.root, 8));
  for (int i = 0; i < 8; i++) CHECK(memcmp(&b0.root[i], &(float){sqrtf(b0.v[i])}, 4) == 0);
  /* called with ATen's mode (VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE), not the thread's */
  long long (*last_mode)(void) = (long long (*)(void))dlsym(h, "fake_vml_last_mode");
  if (CHECK(last_mode != NULL)) CHECK_EQ_HEX(last_mode(), 0x140102);
  ac_adam_unload_sqrt();
  CHECK_RC(ac_adam_fused(&q0, 1, 0), AC_ERR_STATE);
  drop(&b0);
  dlclose(h);
}

TEST(denormal_flushing_is_reported) {
#if defined(__x86_64__)
  const unsigned saved = _mm_getcsr();
  _mm_setcsr(saved & ~0x8040u);
  CHECK_EQ_INT(ac_adam_denormals_flushed(), 0);
  _mm_setcsr(saved | 0x8000u); /* FTZ */
  CHECK_EQ_INT(ac_adam_denormals_flushed(), 1);
  _mm_setcsr((saved & ~0x8040u) | 0x0040u); /* DAZ */
  CHECK_EQ_INT(ac_adam_denormals_flushed(), 1);
  _mm_setcsr(saved);
#else
  CHECK_EQ_INT(ac_adam_denormals_flushed(), 0);
#endif
}

static const tu_test_t tests[] = {
    TU_CASE(avx2_equals_scalar_on_every_size_and_flag_set),
    TU_CASE(thread_count_changes_nothing),
    TU_CASE(fma_flag_changes_the_rounding),
    TU_CASE(several_parameters_in_one_call),
    TU_CASE(fused_equals_two_passes_with_the_same_root),
    TU_CASE(denormal_flushing_is_reported),
    TU_CASE(argument_errors),
};
TU_MAIN(tests)

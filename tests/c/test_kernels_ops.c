/* test_kernels_ops.c — csrc/include/ac/kernels.h: which instruction set is in use (default,
 * AC_KERNELS_ISA, ac_kernels_set_isa); stats, scale, scale_stats, nonfinite, copy_in and cast on every
 * dtype, size and ISA against the reference of kernels_test_util.h, on finite data and on
 * arbitrary bit patterns, with AVX2 equal to scalar (NaN payloads included); and every argument
 * error. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime under -std=c11 */
#include "kernels_impl.h" /* ac_cpu_has_avx2, ac_kernels_avx2_table: what the default should be */
#include "kernels_test_util.h"

static const size_t SIZES[] = {0, 1, 7, 8, 9, 65535, 65536, 65537, 300000};
#define NSIZES (sizeof SIZES / sizeof SIZES[0])

/* Must be the first test: the ISA is chosen lazily on first use, from AC_KERNELS_ISA. */
TEST(isa_default_and_env) {
  const char *env = getenv("AC_KERNELS_ISA");
  int avx2_here = ac_cpu_has_avx2() && ac_kernels_avx2_table() != NULL;
  const char *want = (env && strcmp(env, "scalar") == 0) ? "scalar" : (avx2_here ? "avx2" : "scalar");
  printf("    AC_KERNELS_ISA=%s, CPU/build has AVX2+FMA+F16C: %d, ac_kernels_isa() = %s\n",
         env ? env : "(unset)", avx2_here, ac_kernels_isa());
  CHECK_STREQ(ac_kernels_isa(), want);
  /* A kernel call keeps the cached choice. */
  float x[3] = {1, 2, 3};
  ac_stats_t s;
  CHECK_OK(ac_stats(AC_F32, x, 3, &s));
  CHECK_STREQ(ac_kernels_isa(), want);
  /* ac_kernels_set_isa overrides the environment. */
  CHECK_OK(ac_kernels_set_isa("scalar"));
  CHECK_STREQ(ac_kernels_isa(), "scalar");
  ac_result_t r = ac_kernels_set_isa("avx2");
  if (avx2_here) {
    CHECK_OK(r);
    CHECK_STREQ(ac_kernels_isa(), "avx2");
  } else {
    CHECK_EQ_INT(r, AC_ERR_UNSUPPORTED);
    CHECK_STREQ(ac_kernels_isa(), "scalar"); /* a refused switch changes nothing */
  }
  CHECK_OK(ac_kernels_set_isa(want));
}

TEST(dtype_size_and_name) {
  CHECK_EQ_INT(ac_dtype_size(AC_F32), 4);
  CHECK_EQ_INT(ac_dtype_size(AC_F16), 2);
  CHECK_EQ_INT(ac_dtype_size(AC_BF16), 2);
  CHECK_EQ_INT(ac_dtype_size((ac_dtype_t)7), 0);
  CHECK_EQ_INT(ac_dtype_size((ac_dtype_t)-1), 0);
  CHECK_STREQ(ac_dtype_name(AC_F32), "float32");
  CHECK_STREQ(ac_dtype_name(AC_F16), "float16");
  CHECK_STREQ(ac_dtype_name(AC_BF16), "bfloat16");
  CHECK_STREQ(ac_dtype_name((ac_dtype_t)7), "invalid");
}

static const float FACTORS[] = {0.37f, 3.0e4f, 0x1p-20f};
#define NFACTORS 3

/* ac_copy_in of `data` into `work` with `factor`: the values written are `want` bit for bit,
 * nothing past the end is touched, and the sums it reports are bitwise those of ac_sumsq over
 * what it wrote (the hooks' measurements must equal a later read pass); without sums, the same
 * values. */
static void copy_in_case(ac_dtype_t dt, size_t n, const void *data, unsigned char *work, float factor,
                         const void *want, const char *isa, int nan_ok) {
  size_t es = dsize(dt);
  char what[160];
  snprintf(what, sizeof what, "%s copy_in x%g %s n=%zu", isa, (double)factor, ac_dtype_name(dt), n);
  unsigned char *dst = xmalloc(n * es + 8);
  memset(dst, 0x5A, n * es + 8);
  double sq = -1.0, sq2 = -2.0;
  int nf = -1, nf2 = -2;
  CHECK_OK(ac_copy_in(dt, data, dst, n, factor, &sq, &nf));
  CMP_BUFS(dt, dst, want, n, nan_ok, what);
  for (size_t b = 0; b < 8; b++) CHECK_MSG(dst[n * es + b] == 0x5A, "%s wrote past the end", what);
  CHECK_OK(ac_sumsq(dt, dst, n, &sq2, &nf2));
  CHECK_MSG(memcmp(&sq, &sq2, sizeof sq) == 0 && nf == nf2, "%s: sums %.17g/%d, a read pass after it %.17g/%d",
            what, sq, nf, sq2, nf2);
  memset(work, 0, n * es);
  CHECK_OK(ac_copy_in(dt, data, work, n, factor, NULL, NULL));
  CMP_BUFS(dt, work, want, n, nan_ok, what);
  free(dst);
}

/* For one dtype and size: every kernel on every ISA against the reference; AVX2 vs scalar.
 * Finite input data. */
static void kernels_case(ac_dtype_t dt, size_t n, uint64_t seed) {
  size_t es = dsize(dt);
  char what[160];
  unsigned char *data = xmalloc(n * es), *work = xmalloc(n * es), *want = xmalloc(n * 4);
  unsigned char *out = xmalloc(n * 4);
  fill_finite(dt, data, n, seed);
  ac_stats_t ref = ref_stats(dt, data, n);
  CHECK(!ref.nonfinite);

  /* reference outputs, computed once per case */
  unsigned char *ref_scaled[NFACTORS];
  ac_stats_t ref_scaled_stats[NFACTORS];
  for (int f = 0; f < NFACTORS; f++) {
    ref_scaled[f] = xmalloc(n * es);
    for (size_t i = 0; i < n; i++) ref_store(dt, ref_scaled[f], i, ref_load(dt, data, i) * FACTORS[f]);
    ref_scaled_stats[f] = ref_stats(dt, ref_scaled[f], n);
  }

  ac_stats_t isa_stats[NISAS], isa_ss[NISAS][NFACTORS];
  int ran[NISAS] = {0, 0};
  for (int k = 0; k < NISAS; k++) {
    if (!use_isa(ISAS[k])) continue;
    ran[k] = 1;
    const char *isa = ISAS[k];

    snprintf(what, sizeof what, "%s stats %s n=%zu", isa, ac_dtype_name(dt), n);
    ac_stats_t s = {-1.0, -1.0f, -1};
    CHECK_OK(ac_stats(dt, data, n, &s));
    CHECK_STATS(s, ref, what);
    isa_stats[k] = s;

    int found = -1;
    CHECK_OK(ac_nonfinite(dt, data, n, &found));
    CHECK_MSG(found == 0, "%s nonfinite %s n=%zu: %d", isa, ac_dtype_name(dt), n, found);

    for (int f = 0; f < NFACTORS; f++) {
      snprintf(what, sizeof what, "%s scale x%g %s n=%zu", isa, (double)FACTORS[f],
               ac_dtype_name(dt), n);
      memcpy(work, data, n * es);
      CHECK_OK(ac_scale(dt, work, n, FACTORS[f]));
      CMP_BUFS(dt, work, ref_scaled[f], n, 0, what);

      snprintf(what, sizeof what, "%s scale_stats x%g %s n=%zu", isa, (double)FACTORS[f],
               ac_dtype_name(dt), n);
      memcpy(work, data, n * es);
      ac_stats_t ss = {-1.0, -1.0f, -1};
      CHECK_OK(ac_scale_stats(dt, work, n, FACTORS[f], &ss));
      CMP_BUFS(dt, work, ref_scaled[f], n, 0, what);
      CHECK_STATS(ss, ref_scaled_stats[f], what);
      isa_ss[k][f] = ss;

      copy_in_case(dt, n, data, work, FACTORS[f], ref_scaled[f], isa, 0);
    }
    copy_in_case(dt, n, data, work, 1.0f, data, isa, 0);

    for (int d = 0; d < NDT; d++) {
      ac_dtype_t dst = DTYPES[d];
      snprintf(what, sizeof what, "%s cast %s -> %s n=%zu", isa, ac_dtype_name(dt),
               ac_dtype_name(dst), n);
      for (size_t i = 0; i < n; i++) ref_store(dst, want, i, ref_load(dt, data, i));
      memset(out, 0xA5, n * 4);
      CHECK_OK(ac_cast(dt, data, dst, out, n));
      CMP_BUFS(dst, out, want, n, 0, what);
      /* nothing written past the end */
      CHECK_MSG(n * dsize(dst) == n * 4 || out[n * dsize(dst)] == 0xA5 || n == 0,
                "%s wrote past the end", what);
    }
  }
  /* AVX2 against scalar: outputs were each compared bitwise with the same reference, so they
   * are bitwise equal; the statistics are compared here directly. */
  if (ran[0] && ran[1]) {
    snprintf(what, sizeof what, "avx2 vs scalar stats %s n=%zu", ac_dtype_name(dt), n);
    CHECK_STATS(isa_stats[1], isa_stats[0], what);
    for (int f = 0; f < NFACTORS; f++) CHECK_STATS(isa_ss[1][f], isa_ss[0][f], what);
  }
  for (int f = 0; f < NFACTORS; f++) free(ref_scaled[f]);
  free(data);
  free(work);
  free(want);
  free(out);
}

TEST(kernels_all_dtypes_sizes_isas) {
  for (int d = 0; d < NDT; d++)
    for (size_t s = 0; s < NSIZES; s++) kernels_case(DTYPES[d], SIZES[s], 1000 * d + s);
  ac_kernels_set_isa("scalar");
}

/* Arbitrary bit patterns (NaN payloads, Inf, subnormals) through every kernel: each ISA
 * against the reference (NaN matches NaN), and AVX2 against scalar bit for bit on everything
 * except NaN payloads (nan_payload_same_on_both_isas checks those separately). */
TEST(kernels_random_bits_both_isas) {
  static const size_t sizes[] = {9, 65537 + 13};
  char what[160];
  for (int d = 0; d < NDT; d++) {
    ac_dtype_t dt = DTYPES[d];
    size_t es = dsize(dt);
    for (size_t si = 0; si < 2; si++) {
      size_t n = sizes[si];
      unsigned char *data = xmalloc(n * es), *work[NISAS], *cast[NISAS][NDT], *want = xmalloc(n * 4);
      fill_bits(dt, data, n, 77 + d * 10 + si);
      ac_stats_t ref = ref_stats(dt, data, n), st[NISAS], ss[NISAS];
      int ran[NISAS] = {0, 0};
      for (int k = 0; k < NISAS; k++) {
        work[k] = xmalloc(n * es);
        for (int e = 0; e < NDT; e++) cast[k][e] = xmalloc(n * 4);
        if (!use_isa(ISAS[k])) continue;
        ran[k] = 1;
        snprintf(what, sizeof what, "%s random-bits %s n=%zu", ISAS[k], ac_dtype_name(dt), n);
        CHECK_OK(ac_stats(dt, data, n, &st[k]));
        CHECK_STATS(st[k], ref, what);
        int found = 0;
        CHECK_OK(ac_nonfinite(dt, data, n, &found));
        CHECK_EQ_INT(found, ref.nonfinite);
        memcpy(work[k], data, n * es);
        CHECK_OK(ac_scale_stats(dt, work[k], n, 0.5f, &ss[k]));
        for (size_t i = 0; i < n; i++) ref_store(dt, want, i, ref_load(dt, data, i) * 0.5f);
        CMP_BUFS(dt, work[k], want, n, 1, what);
        CHECK_STATS(ss[k], ref_stats(dt, want, n), what);
        copy_in_case(dt, n, data, want, 0.5f, work[k], ISAS[k], 1); /* NaN/Inf from any bits */
        for (int e = 0; e < NDT; e++) {
          CHECK_OK(ac_cast(dt, data, DTYPES[e], cast[k][e], n));
          for (size_t i = 0; i < n; i++) ref_store(DTYPES[e], want, i, ref_load(dt, data, i));
          snprintf(what, sizeof what, "%s random-bits cast %s -> %s n=%zu", ISAS[k],
                   ac_dtype_name(dt), ac_dtype_name(DTYPES[e]), n);
          CMP_BUFS(DTYPES[e], cast[k][e], want, n, 1, what);
        }
      }
      if (ran[0] && ran[1]) {
        snprintf(what, sizeof what, "avx2 vs scalar random-bits %s n=%zu", ac_dtype_name(dt), n);
        CHECK_STATS(st[1], st[0], what);
        CHECK_STATS(ss[1], ss[0], what);
        CMP_BUFS(dt, work[1], work[0], n, 1, what);
        for (int e = 0; e < NDT; e++) CMP_BUFS(DTYPES[e], cast[1][e], cast[0][e], n, 1, what);
      }
      for (int k = 0; k < NISAS; k++) {
        free(work[k]);
        for (int e = 0; e < NDT; e++) free(cast[k][e]);
      }
      free(data);
      free(want);
    }
  }
  ac_kernels_set_isa("scalar");
}

/* NaN payloads: the scalar path canonicalises every NaN stored as fp16 to sign|0x7e00 (half.h:
 * "NaN -> 0x7e00", torch's c10::Half), but the AVX2 path's F16C instructions keep the payload
 * (fp32 0x7f812346 -> 0x7e09, fp16 0x7c01 * 2 -> 0x7e01, bf16 0x7f81 -> fp16 0x7e08); and
 * fp16 -> fp32 of a signalling NaN gives 0x7f802000 (scalar, still signalling) vs 0x7fc02000
 * (F16C, quiet). Results then depend on the ISA, contrary to "AVX2 == scalar bit for bit". */
TEST(nan_payload_same_on_both_isas) {
  if (ac_kernels_set_isa("avx2") != AC_OK) {
    printf("    (no AVX2: nothing to compare)\n");
    return;
  }
  enum { N = 2 * 2046 + 2 * 254 + 64 };
  uint16_t h16[N], hb16[N];
  uint32_t f32[N];
  size_t n16 = 0, nb = 0;
  for (uint32_t b = 0; b <= 0xffff; b++) {
    if (f16_is_nan((uint16_t)b)) h16[n16++] = (uint16_t)b;
    if (bf16_is_nan((uint16_t)b)) hb16[nb++] = (uint16_t)b;
  }
  tu_rng_t r = {42};
  for (size_t i = 0; i < N; i++) f32[i] = (tu_rand32(&r) | 0x7f800000u) | (i & 1 ? 0x80000000u : 0);
  f32[0] = 0x7f800001u;
  f32[1] = 0xffffffffu;
  static unsigned char out[2][N * 4];
  struct {
    ac_dtype_t src;
    const void *p;
    size_t n;
  } srcs[] = {{AC_F16, h16, n16}, {AC_BF16, hb16, nb}, {AC_F32, f32, N}};
  for (int s = 0; s < 3; s++) {
    for (int d = 0; d < NDT; d++) {
      if (DTYPES[d] == srcs[s].src) continue;
      for (int k = 0; k < NISAS; k++) {
        ac_kernels_set_isa(ISAS[k]);
        CHECK_OK(ac_cast(srcs[s].src, srcs[s].p, DTYPES[d], out[k], srcs[s].n));
      }
      char what[96];
      snprintf(what, sizeof what, "NaN cast %s -> %s, avx2 vs scalar", ac_dtype_name(srcs[s].src),
               ac_dtype_name(DTYPES[d]));
      CMP_BUFS(DTYPES[d], out[1], out[0], srcs[s].n, 0, what);
    }
    for (int k = 0; k < NISAS; k++) {
      ac_kernels_set_isa(ISAS[k]);
      memcpy(out[k], srcs[s].p, srcs[s].n * dsize(srcs[s].src));
      CHECK_OK(ac_scale(srcs[s].src, out[k], srcs[s].n, 2.0f));
    }
    char what[96];
    snprintf(what, sizeof what, "NaN scale %s, avx2 vs scalar", ac_dtype_name(srcs[s].src));
    CMP_BUFS(srcs[s].src, out[1], out[0], srcs[s].n, 0, what);
  }
  ac_kernels_set_isa("scalar");
}

TEST(errors) {
  float buf[16] = {0};
  ac_stats_t s;
  int found;
  const ac_dtype_t bad = (ac_dtype_t)7;

  ac_clear_error();
  CHECK_RC(ac_stats(bad, buf, 4, &s), AC_ERR_INVALID_ARG);
  CHECK(ac_last_error()[0] != '\0');
  CHECK_CONTAINS(ac_last_error(), "kernels.c");
  CHECK_CONTAINS(ac_last_error(), "dtype");
  ac_clear_error();
  CHECK_RC(ac_scale(bad, buf, 4, 2.0f), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "kernels.c");
  CHECK_RC(ac_scale_stats(bad, buf, 4, 2.0f, &s), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_nonfinite(bad, buf, 4, &found), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_cast(bad, buf, AC_F32, buf + 8, 4), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_cast(AC_F32, buf, bad, buf + 8, 4), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_stats((ac_dtype_t)-1, buf, 4, &s), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_stats((ac_dtype_t)3, buf, 4, &s), AC_ERR_INVALID_ARG);
  /* an invalid dtype is refused even for an empty buffer */
  CHECK_RC(ac_stats(bad, buf, 0, &s), AC_ERR_INVALID_ARG);

  /* NULL data */
  ac_clear_error();
  CHECK_RC(ac_stats(AC_F32, NULL, 1, &s), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "NULL");
  CHECK_RC(ac_scale(AC_F16, NULL, 5, 1.0f), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_scale_stats(AC_BF16, NULL, 5, 1.0f, &s), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_nonfinite(AC_F32, NULL, 5, &found), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_cast(AC_F32, NULL, AC_F16, buf, 2), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_cast(AC_F32, buf, AC_F16, NULL, 2), AC_ERR_INVALID_ARG);
  /* NULL with n == 0 is fine: empty buffer */
  s = (ac_stats_t){5.0, 5.0f, 5};
  CHECK_OK(ac_stats(AC_F32, NULL, 0, &s));
  CHECK(s.sumsq == 0.0 && s.maxabs == 0.0f && s.nonfinite == 0);
  CHECK_OK(ac_scale(AC_F32, NULL, 0, 2.0f));
  s = (ac_stats_t){5.0, 5.0f, 5};
  CHECK_OK(ac_scale_stats(AC_F16, NULL, 0, 2.0f, &s));
  CHECK(s.sumsq == 0.0 && s.maxabs == 0.0f && s.nonfinite == 0);
  found = 7;
  CHECK_OK(ac_nonfinite(AC_BF16, NULL, 0, &found));
  CHECK_EQ_INT(found, 0);
  CHECK_OK(ac_cast(AC_F32, NULL, AC_BF16, NULL, 0));

  /* NULL outputs */
  CHECK_RC(ac_stats(AC_F32, buf, 4, NULL), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_stats(AC_F32, buf, 0, NULL), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_scale_stats(AC_F32, buf, 4, 1.0f, NULL), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_nonfinite(AC_F32, buf, 4, NULL), AC_ERR_INVALID_ARG);

  /* overlapping cast buffers of different dtypes */
  ac_clear_error();
  CHECK_RC(ac_cast(AC_F32, buf, AC_F16, buf, 4), AC_ERR_INVALID_ARG); /* same start */
  CHECK_CONTAINS(ac_last_error(), "overlap");
  CHECK_RC(ac_cast(AC_F32, buf, AC_F16, (char *)buf + 14, 4), AC_ERR_INVALID_ARG); /* last byte */
  CHECK_RC(ac_cast(AC_F16, (char *)buf + 6, AC_F32, buf, 4), AC_ERR_INVALID_ARG); /* src inside dst */
  CHECK_RC(ac_cast(AC_BF16, buf, AC_F16, (char *)buf + 2, 4), AC_ERR_INVALID_ARG);
  /* one byte in common: dst starts at the last byte of src (misaligned on purpose; a correct
   * check refuses before anything is dereferenced) */
  CHECK_RC(ac_cast(AC_F16, buf, AC_F32, (char *)buf + 7, 4), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_cast(AC_F16, (char *)buf + 15, AC_F32, buf, 4), AC_ERR_INVALID_ARG);
  /* adjacent but not overlapping: allowed */
  CHECK_OK(ac_cast(AC_F32, buf, AC_F16, buf + 4, 4));
  CHECK_OK(ac_cast(AC_F16, (char *)buf + 8, AC_F32, buf, 2));
  /* same dtype, same buffer: a no-op */
  float same[3] = {1.5f, -2.0f, 3.25f};
  CHECK_OK(ac_cast(AC_F32, same, AC_F32, same, 3));
  CHECK(same[0] == 1.5f && same[1] == -2.0f && same[2] == 3.25f);
  /* same dtype, different buffers: a copy */
  float copy[3] = {0};
  CHECK_OK(ac_cast(AC_F32, same, AC_F32, copy, 3));
  CHECK(memcmp(copy, same, sizeof same) == 0);

  /* ac_copy_in: overlapping buffers, one of the two sums pointers, NULL data */
  {
    float cbuf[16] = {0};
    double csq;
    int cnf;
    CHECK_RC(ac_copy_in(AC_F32, cbuf, cbuf + 4, 8, 1.0f, NULL, NULL), AC_ERR_INVALID_ARG);
    CHECK_CONTAINS(ac_last_error(), "overlap");
    CHECK_RC(ac_copy_in(AC_F32, cbuf, cbuf + 8, 8, 1.0f, &csq, NULL), AC_ERR_INVALID_ARG);
    CHECK_RC(ac_copy_in(AC_F32, NULL, cbuf, 8, 1.0f, &csq, &cnf), AC_ERR_INVALID_ARG);
    CHECK_RC(ac_copy_in((ac_dtype_t)9, cbuf, cbuf + 8, 8, 1.0f, NULL, NULL), AC_ERR_INVALID_ARG);
    CHECK_OK(ac_copy_in(AC_F32, NULL, NULL, 0, 1.0f, &csq, &cnf));
    CHECK_MSG(csq == 0.0 && cnf == 0, "empty copy_in: %g %d", csq, cnf);
  }

  /* ISA names */
  const char *isa_before = ac_kernels_isa();
  ac_clear_error();
  CHECK_RC(ac_kernels_set_isa("bogus"), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "bogus");
  CHECK_CONTAINS(ac_last_error(), "hint");
  CHECK_RC(ac_kernels_set_isa(NULL), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_kernels_set_isa(""), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_kernels_set_isa("AVX2"), AC_ERR_INVALID_ARG); /* names are exact */
  CHECK_STREQ(ac_kernels_isa(), isa_before);                /* unchanged by failures */

  /* every result code has a name */
  for (int c = 0; c <= (int)AC_ERR_STATE; c++)
    CHECK_MSG(strcmp(ac_result_string((ac_result_t)c), "AC_ERR_UNKNOWN") != 0, "code %d", c);
  CHECK_STREQ(ac_result_string(AC_ERR_INVALID_ARG), "AC_ERR_INVALID_ARG");
}

/* Last (see kt_shutdown_pool). */
TEST(shutdown_pool) { kt_shutdown_pool(); }

static const tu_test_t tests[] = {
    TU_CASE(isa_default_and_env), /* must stay first */
    TU_CASE(dtype_size_and_name),
    TU_CASE(kernels_all_dtypes_sizes_isas),
    TU_CASE(kernels_random_bits_both_isas),
    TU_CASE(nan_payload_same_on_both_isas),
    TU_CASE(errors),
    TU_CASE(shutdown_pool), /* keep last */
};
TU_MAIN(tests)

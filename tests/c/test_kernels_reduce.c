/* test_kernels_reduce.c — the reductions of csrc/include/ac/kernels.h (stats, sumsq, nonfinite,
 * and the statistics of scale_stats): NaN and Inf at every chunk edge, overflow caused by the
 * scaling, maxabs ignoring NaN, the sumsq fast pass, results independent of the thread count,
 * and more chunks than fit on the stack; on both instruction sets. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime under -std=c11 */
#include "kernels_test_util.h"

/* NaN / Inf at the first, last and middle element and on both sides of chunk boundaries. */
TEST(nonfinite_positions) {
  const size_t n = 3 * CHUNK + 5;
  const size_t pos[] = {0, n - 1, n / 2, CHUNK - 1, CHUNK, 2 * CHUNK - 1, 2 * CHUNK, 3 * CHUNK};
  const float vals[] = {NAN, INFINITY, -INFINITY};
  char what[160];
  for (int d = 0; d < NDT; d++) {
    ac_dtype_t dt = DTYPES[d];
    size_t es = dsize(dt);
    unsigned char *data = xmalloc(n * es), *work = xmalloc(n * es);
    fill_finite(dt, data, n, 555 + d);
    for (size_t p = 0; p < sizeof pos / sizeof pos[0]; p++) {
      for (int v = 0; v < 3; v++) {
        unsigned char saved[4];
        memcpy(saved, data + pos[p] * es, es);
        ref_store(dt, data, pos[p], vals[v]);
        ac_stats_t ref = ref_stats(dt, data, n);
        CHECK(ref.nonfinite == 1);
        for (int k = 0; k < NISAS; k++) {
          if (!use_isa(ISAS[k])) continue;
          snprintf(what, sizeof what, "%s %s %g at %zu of %zu", ISAS[k], ac_dtype_name(dt),
                   (double)vals[v], pos[p], n);
          int found = 0;
          CHECK_OK(ac_nonfinite(dt, data, n, &found));
          CHECK_MSG(found == 1, "%s: ac_nonfinite found %d", what, found);
          ac_stats_t s;
          CHECK_OK(ac_stats(dt, data, n, &s));
          CHECK_STATS(s, ref, what);
          if (isnan(vals[v]))
            CHECK_MSG(!isnan(s.maxabs) && s.maxabs < INFINITY, "%s: maxabs %g", what,
                      (double)s.maxabs);
          else
            CHECK_MSG(s.maxabs == INFINITY, "%s: maxabs %g", what, (double)s.maxabs);
          memcpy(work, data, n * es);
          ac_stats_t ss;
          CHECK_OK(ac_scale_stats(dt, work, n, 1.0f, &ss));
          CHECK_MSG(ss.nonfinite == 1, "%s: scale_stats nonfinite %d", what, ss.nonfinite);
        }
        memcpy(data + pos[p] * es, saved, es);
      }
    }
    /* Overflow caused by the scaling itself, at a chunk boundary: 60000 * 2 > 65504 in fp16,
     * 3e38 * 2 > FLT_MAX in fp32/bf16. */
    memset(data, 0, n * es);
    ref_store(dt, data, CHUNK, dt == AC_F16 ? 60000.0f : 3.0e38f);
    for (int k = 0; k < NISAS; k++) {
      if (!use_isa(ISAS[k])) continue;
      memcpy(work, data, n * es);
      ac_stats_t ss;
      CHECK_OK(ac_scale_stats(dt, work, n, 2.0f, &ss));
      CHECK_MSG(ss.nonfinite == 1 && ss.maxabs == INFINITY, "%s %s overflow by scaling: nf %d max %g",
                ISAS[k], ac_dtype_name(dt), ss.nonfinite, (double)ss.maxabs);
      int found = 0;
      CHECK_OK(ac_nonfinite(dt, work, n, &found));
      CHECK_EQ_INT(found, 1);
      /* inf * 0 = NaN: the flag sees the NaN the scaling produced. */
      CHECK_OK(ac_scale_stats(dt, work, n, 0.0f, &ss));
      CHECK_MSG(ss.nonfinite == 1 && isnan(ss.sumsq) && ss.maxabs == 0.0f,
                "%s %s inf*0: nf %d sumsq %g max %g", ISAS[k], ac_dtype_name(dt), ss.nonfinite,
                ss.sumsq, (double)ss.maxabs);
    }
    free(data);
    free(work);
  }
  ac_kernels_set_isa("scalar");
}

/* maxabs ignores NaN wherever it is (vector body or scalar tail, before or after the max). */
TEST(maxabs_ignores_nan) {
  for (int d = 0; d < NDT; d++) {
    ac_dtype_t dt = DTYPES[d];
    for (size_t n = 1; n <= 40; n++) {
      unsigned char buf[40 * 4];
      for (size_t i = 0; i < n; i++) ref_store(dt, buf, i, (i % 3 == 0) ? NAN : -(float)(i % 7));
      float want = 0;
      for (size_t i = 0; i < n; i++)
        if (i % 3 != 0 && (float)(i % 7) > want) want = (float)(i % 7);
      for (int k = 0; k < NISAS; k++) {
        if (!use_isa(ISAS[k])) continue;
        ac_stats_t s;
        CHECK_OK(ac_stats(dt, buf, n, &s));
        CHECK_MSG(same_float_bits(s.maxabs, want) && s.nonfinite == 1 && isnan(s.sumsq),
                  "%s %s n=%zu: maxabs %g want %g nf %d sumsq %g", ISAS[k], ac_dtype_name(dt), n,
                  (double)s.maxabs, (double)want, s.nonfinite, s.sumsq);
      }
      /* all NaN -> maxabs 0 */
      for (size_t i = 0; i < n; i++) ref_store(dt, buf, i, -NAN);
      for (int k = 0; k < NISAS; k++) {
        if (!use_isa(ISAS[k])) continue;
        ac_stats_t s;
        CHECK_OK(ac_stats(dt, buf, n, &s));
        CHECK_MSG(same_float_bits(s.maxabs, 0.0f) && s.nonfinite == 1,
                  "%s %s all-NaN n=%zu: maxabs %g nf %d", ISAS[k], ac_dtype_name(dt), n,
                  (double)s.maxabs, s.nonfinite);
      }
      /* -0 only -> maxabs +0, finite */
      for (size_t i = 0; i < n; i++) ref_store(dt, buf, i, -0.0f);
      for (int k = 0; k < NISAS; k++) {
        if (!use_isa(ISAS[k])) continue;
        ac_stats_t s;
        CHECK_OK(ac_stats(dt, buf, n, &s));
        CHECK_MSG(same_float_bits(s.maxabs, 0.0f) && s.nonfinite == 0 && s.sumsq == 0.0,
                  "%s %s -0 n=%zu", ISAS[k], ac_dtype_name(dt), n);
      }
    }
  }
  ac_kernels_set_isa("scalar");
}

/* ac_sumsq: bitwise identical on both ISAs and all thread counts; within 1e-6 of the double
 * sum on finite data (fp32 blocks); the non-finite flag exact, including a NaN or Inf in any
 * block or tail position, and finite values whose squares overflow fp32 (redone in double). */
TEST(sumsq_fast_pass) {
  static const size_t sizes[] = {0, 1, 127, 128, 129, 1000, 65536, 65536 + 129, 300001};
  int before = ac_pool_get_threads();
  for (int d = 0; d < NDT; d++) {
    ac_dtype_t dt = DTYPES[d];
    size_t es = dsize(dt);
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
      size_t n = sizes[si];
      unsigned char *data = xmalloc(n * es);
      fill_finite(dt, data, n, 777 + d * 31 + si);
      ac_stats_t ref = ref_stats(dt, data, n);
      double first = 0.0;
      int have_first = 0;
      for (int k = 0; k < NISAS; k++) {
        if (!use_isa(ISAS[k])) continue;
        for (int t = 1; t <= 4; t *= 2) {
          CHECK_OK(ac_pool_set_threads(t));
          double sq = -1.0;
          int nf = -1;
          CHECK_OK(ac_sumsq(dt, data, n, &sq, &nf));
          CHECK_MSG(nf == 0, "%s n=%zu: finite data flagged", ac_dtype_name(dt), n);
          CHECK_MSG(fabs(sq - ref.sumsq) <= 1e-6 * ref.sumsq, "%s %s n=%zu: sumsq %.17g vs double %.17g",
                    ISAS[k], ac_dtype_name(dt), n, sq, ref.sumsq);
          if (!have_first) {
            first = sq;
            have_first = 1;
          }
          CHECK_MSG(memcmp(&sq, &first, sizeof sq) == 0, "%s %s n=%zu threads=%d: %.17g differs from %.17g",
                    ISAS[k], ac_dtype_name(dt), n, t, sq, first);
        }
      }
      /* one bad value at several positions: NaN, +Inf, -Inf */
      size_t spots[] = {0, n / 2, n ? n - 1 : 0, 127, 128, 65535, 65536};
      for (size_t q = 0; n && q < sizeof spots / sizeof spots[0]; q++) {
        if (spots[q] >= n) continue;
        for (int b = 0; b < 3; b++) {
          unsigned char *bad = xmalloc(n * es);
          memcpy(bad, data, n * es);
          float v = b == 0 ? NAN : (b == 1 ? INFINITY : -INFINITY);
          ref_store(dt, bad, spots[q], v);
          for (int k = 0; k < NISAS; k++) {
            if (!use_isa(ISAS[k])) continue;
            double sq;
            int nf = 0, found = 0;
            CHECK_OK(ac_sumsq(dt, bad, n, &sq, &nf));
            CHECK_OK(ac_nonfinite(dt, bad, n, &found));
            CHECK_MSG(nf == 1 && found == 1, "%s %s n=%zu: %g at %zu not flagged", ISAS[k], ac_dtype_name(dt),
                      n, (double)v, spots[q]);
          }
          free(bad);
        }
      }
      free(data);
    }
  }
  /* finite fp32 values whose squares overflow fp32: the block is redone in double */
  {
    size_t n = 1000;
    float *big = xmalloc(n * sizeof *big);
    for (size_t i = 0; i < n; i++) big[i] = (i % 7 == 0) ? 3e20f : 1.0f;
    ac_stats_t ref = ref_stats(AC_F32, big, n);
    for (int k = 0; k < NISAS; k++) {
      if (!use_isa(ISAS[k])) continue;
      double sq;
      int nf = 1;
      CHECK_OK(ac_sumsq(AC_F32, big, n, &sq, &nf));
      CHECK_MSG(nf == 0 && isfinite(sq), "%s: overflowing squares misreported (nf=%d, %g)", ISAS[k], nf, sq);
      CHECK_MSG(fabs(sq - ref.sumsq) <= 1e-12 * ref.sumsq, "%s: %.17g vs %.17g", ISAS[k], sq, ref.sumsq);
    }
    free(big);
  }
  double sq;
  int nf;
  CHECK_RC(ac_sumsq(AC_F32, NULL, 5, &sq, &nf), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_sumsq(AC_F32, &sq, 1, NULL, &nf), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_sumsq((ac_dtype_t)7, &sq, 1, &sq, &nf), AC_ERR_INVALID_ARG);
  CHECK_OK(ac_pool_set_threads(before));
  ac_kernels_set_isa("scalar");
}

/* Same results whatever the thread count (fixed chunking, ordered combination). */
TEST(deterministic_across_thread_counts) {
  const size_t n = 1000003;
  static const int threads[] = {1, 2, 4};
  int before = ac_pool_get_threads();
  for (int d = 0; d < NDT; d++) {
    ac_dtype_t dt = DTYPES[d];
    size_t es = dsize(dt);
    unsigned char *data = xmalloc(n * es), *work = xmalloc(n * es), *first_scaled = xmalloc(n * es);
    unsigned char *cast = xmalloc(n * 4), *first_cast = xmalloc(n * 4);
    fill_finite(dt, data, n, 4242 + d);
    ac_dtype_t dst = dt == AC_F32 ? AC_F16 : AC_F32;
    for (int k = 0; k < NISAS; k++) {
      if (!use_isa(ISAS[k])) continue;
      ac_stats_t first = {0}, first_ss = {0};
      for (int t = 0; t < 3; t++) {
        CHECK_OK(ac_pool_set_threads(threads[t]));
        ac_stats_t s, ss;
        CHECK_OK(ac_stats(dt, data, n, &s));
        memcpy(work, data, n * es);
        CHECK_OK(ac_scale_stats(dt, work, n, 0.75f, &ss));
        CHECK_OK(ac_cast(dt, data, dst, cast, n));
        if (t == 0) {
          first = s;
          first_ss = ss;
          memcpy(first_scaled, work, n * es);
          memcpy(first_cast, cast, n * dsize(dst));
          continue;
        }
        CHECK_MSG(memcmp(&s.sumsq, &first.sumsq, sizeof s.sumsq) == 0,
                  "%s %s: sumsq with %d threads %.17g != %.17g with 1", ISAS[k], ac_dtype_name(dt),
                  threads[t], s.sumsq, first.sumsq);
        CHECK(same_float_bits(s.maxabs, first.maxabs) && s.nonfinite == first.nonfinite);
        CHECK_MSG(memcmp(&ss.sumsq, &first_ss.sumsq, sizeof ss.sumsq) == 0,
                  "%s %s: scale_stats sumsq with %d threads differs", ISAS[k], ac_dtype_name(dt),
                  threads[t]);
        CHECK(memcmp(work, first_scaled, n * es) == 0);
        CHECK(memcmp(cast, first_cast, n * dsize(dst)) == 0);
      }
      /* and the reference agrees */
      char what[96];
      snprintf(what, sizeof what, "%s %s n=%zu", ISAS[k], ac_dtype_name(dt), n);
      CHECK_STATS(first, ref_stats(dt, data, n), what);
    }
    free(data);
    free(work);
    free(first_scaled);
    free(cast);
    free(first_cast);
  }
  CHECK_OK(ac_pool_set_threads(before));
  ac_kernels_set_isa("scalar");
}

/* More chunks than kernels.c keeps on the stack (256): the partial results go to the heap. */
TEST(many_chunks_heap_partials) {
  const size_t n = 257 * (size_t)CHUNK + 3;
  uint16_t *data = xmalloc(n * 2);
  fill_finite(AC_BF16, data, n, 31337);
  for (int pass = 0; pass < 2; pass++) {
    data[n - 1] = pass == 0 ? 0x7f80 /* +Inf in the very last chunk */ : 0x3f80 /* 1.0 */;
    ac_stats_t ref = ref_stats(AC_BF16, data, n);
    CHECK_EQ_INT(ref.nonfinite, pass == 0);
    for (int k = 0; k < NISAS; k++) {
      if (!use_isa(ISAS[k])) continue;
      ac_stats_t s;
      CHECK_OK(ac_stats(AC_BF16, data, n, &s));
      CHECK_STATS(s, ref, ISAS[k]);
    }
  }
  free(data);
  ac_kernels_set_isa("scalar");
}

/* ac_sumsq_segments: per-segment sums of squares with each segment's norm rounded to the
 * buffer's dtype (torch's per-tensor norms). Values are multiples of 1/4 below 16, so every sum
 * of squares is exact in fp32 and double alike and the reference (naive double sums, the test
 * util's own 16-bit rounding) is exact too. */
TEST(sumsq_segments_rounds_each_norm) {
  const size_t n = 3000;
  tu_rng_t rng = {77};
  float *vals = xmalloc(n * sizeof(float));
  for (size_t i = 0; i < n; i++) vals[i] = (float)((int)tu_randn(&rng, 128) - 64) / 4.0f;
  /* (offset, length) pairs: gaps between them, an empty one, one long past a chunk of 128 */
  const size_t seg[] = {0, 1, 3, 7, 40, 0, 64, 500, 600, 2400};
  const size_t nseg = sizeof seg / sizeof seg[0] / 2;
  for (int d = 0; d < NDT; d++) {
    ac_dtype_t dt = DTYPES[d];
    void *buf = xmalloc(n * dsize(dt));
    for (size_t i = 0; i < n; i++) ref_store(dt, buf, i, vals[i]);
    double want_ex = 0.0, want_ro = 0.0;
    for (size_t k = 0; k < nseg; k++) {
      double sq = 0.0;
      for (size_t i = seg[2 * k]; i < seg[2 * k] + seg[2 * k + 1]; i++) sq += (double)vals[i] * vals[i];
      float norm = (float)sqrt(sq);
      if (dt == AC_BF16) norm = bitsf((uint32_t)ref_f32_to_bf16(norm) << 16);
      if (dt == AC_F16) norm = (float)ref_f16_value(ref_f32_to_f16(norm));
      want_ex += sq;
      want_ro += (double)norm * norm;
    }
    for (int k = 0; k < NISAS; k++) {
      if (!use_isa(ISAS[k])) continue;
      double ex = -1, ro = -1;
      int nf = -1;
      CHECK_OK(ac_sumsq_segments(dt, buf, n, seg, nseg, 1.0, &ex, &ro, &nf));
      CHECK_MSG(ex == want_ex && ro == want_ro && nf == 0, "%s %s: exact %.17g want %.17g rounded %.17g want %.17g",
                ISAS[k], ac_dtype_name(dt), ex, want_ex, ro, want_ro);
      if (dt != AC_F32) CHECK_MSG(ro != ex, "%s: the case should round some norm", ac_dtype_name(dt));
    }
    /* a segment reaching past the buffer is refused, naming it */
    const size_t bad[] = {0, 4, n - 2, 3};
    double ex, ro;
    int nf;
    CHECK_RC(ac_sumsq_segments(dt, buf, n, bad, 2, 1.0, &ex, &ro, &nf), AC_ERR_INVALID_ARG);
    CHECK_CONTAINS(ac_last_error(), "segment 1");
    free(buf);
  }
  /* known values: sqrt(2) is 1.4140625 in bf16 and fp16; an fp16 norm past 65504 is inf (as
   * torch's fp16 norm), the exact sum stays finite */
  CHECK(ac_norm_sq_rounded(AC_BF16, 2.0, 1.0) == 1.4140625 * 1.4140625);
  CHECK(ac_norm_sq_rounded(AC_F16, 2.0, 1.0) == 1.4140625 * 1.4140625);
  CHECK(ac_norm_sq_rounded(AC_F32, 2.0, 1.0) == (double)(float)sqrt(2.0) * (double)(float)sqrt(2.0));
  CHECK(isinf(ac_norm_sq_rounded(AC_F16, 65520.0 * 65520.0, 1.0)));
  CHECK(ac_norm_sq_rounded(AC_F16, 65504.0 * 65504.0, 1.0) == 65504.0 * 65504.0);
  CHECK(isnan(ac_norm_sq_rounded(AC_BF16, NAN, 1.0)) && isinf(ac_norm_sq_rounded(AC_BF16, INFINITY, 1.0)));
  /* the scale applies before the rounding: a loss-scaled fp16 norm past 65504 is finite unscaled */
  CHECK(isinf(ac_norm_sq_rounded(AC_F16, 1e6 * 1e6, 1.0)));
  CHECK(ac_norm_sq_rounded(AC_F16, 1e6 * 1e6, 1.0 / 65536.0) == 15.2578125 * 15.2578125); /* 15.2587890625 in fp16 */
  free(vals);
  ac_kernels_set_isa("scalar");
}

/* Last (see kt_shutdown_pool). */
TEST(shutdown_pool) { kt_shutdown_pool(); }

static const tu_test_t tests[] = {
    TU_CASE(nonfinite_positions),
    TU_CASE(maxabs_ignores_nan),
    TU_CASE(sumsq_fast_pass),
    TU_CASE(deterministic_across_thread_counts),
    TU_CASE(many_chunks_heap_partials),
    TU_CASE(sumsq_segments_rounds_each_norm),
    TU_CASE(shutdown_pool), /* keep last */
};
TU_MAIN(tests)

/* test_bucket.c — csrc/include/ac/bucket.h: the reducer's bucket layout and launch order. */
#include <stdlib.h>
#include <string.h>

#include "ac/bucket.h"
#include "test_util.h"

/* The worked example: caps 64 B then 128 B, fp32, align 4, reverse registration order. */
TEST(layout_worked_example) {
  size_t numel[] = {4, 8, 40, 3, 20}, order[] = {4, 3, 2, 1, 0};
  ac_bucket_plan_t *p = NULL;
  CHECK_OK(ac_bucket_plan_create(&p, 5, numel, order, 4, 64, 128, 4));
  if (!p) return;
  CHECK_EQ_INT(ac_bucket_count(p), 3);
  CHECK_EQ_INT(ac_bucket_nparams(p), 5);
  CHECK_EQ_INT(ac_bucket_total(p), 76);
  /* bytes in arrival order: g4 80 (>= 64: bucket 0 closes), g3 12 + g2 160 (>= 128: bucket 1
   * closes), g1 32 + g0 16 */
  size_t want_off[] = {72, 64, 24, 20, 0}, want_b[] = {2, 2, 1, 1, 0};
  for (size_t i = 0; i < 5; i++) {
    size_t off, b;
    CHECK_OK(ac_bucket_param(p, i, &off, &b));
    CHECK_EQ_INT(off, want_off[i]);
    CHECK_EQ_INT(b, want_b[i]);
  }
  size_t want_first[] = {0, 20, 64}, want_count[] = {20, 44, 12};
  for (size_t b = 0; b < 3; b++) {
    size_t first, count;
    CHECK_OK(ac_bucket_range(p, b, &first, &count));
    CHECK_EQ_INT(first, want_first[b]);
    CHECK_EQ_INT(count, want_count[b]);
  }
  size_t first, count, off, b;
  CHECK_RC(ac_bucket_range(p, 3, &first, &count), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_bucket_param(p, 5, &off, &b), AC_ERR_INVALID_ARG);
  ac_bucket_plan_destroy(p);
}

/* Buckets launch only when complete and only in order. */
TEST(launch_in_order) {
  size_t numel[] = {4, 8, 40, 3, 20}, order[] = {4, 3, 2, 1, 0};
  ac_bucket_plan_t *p = NULL;
  CHECK_OK(ac_bucket_plan_create(&p, 5, numel, order, 4, 64, 128, 4));
  if (!p) return;
  for (int round = 0; round < 2; round++) { /* the same after a reset */
    ac_bucket_reset(p);
    size_t marks[] = {3, 4, 0, 2, 1};
    size_t want_from[] = {0, 0, 1, 1, 2}, want_to[] = {0, 1, 1, 2, 3};
    CHECK_EQ_INT(ac_bucket_ready_count(p), 0);
    for (int k = 0; k < 5; k++) {
      size_t from = 99, to = 99;
      CHECK_EQ_INT(ac_bucket_ready_count(p), k); /* 0 tells the reducer a backward starts */
      CHECK(!ac_bucket_is_ready(p, marks[k]));
      CHECK_OK(ac_bucket_mark_ready(p, marks[k], &from, &to));
      CHECK(ac_bucket_is_ready(p, marks[k]));
      CHECK_MSG(from == want_from[k] && to == want_to[k], "mark %zu: [%zu, %zu) want [%zu, %zu)", marks[k], from,
                to, want_from[k], want_to[k]);
      if (k == 2) {
        size_t pend[5];
        CHECK_EQ_INT(ac_bucket_pending(p, pend, 5), 2);
        CHECK(pend[0] == 1 && pend[1] == 2);
        size_t arr[5];
        CHECK_RC(ac_bucket_arrival_order(p, arr, 5), AC_ERR_STATE);
      }
    }
    size_t arr[5];
    CHECK_OK(ac_bucket_arrival_order(p, arr, 5));
    CHECK(memcmp(arr, marks, sizeof arr) == 0);
    CHECK_EQ_INT(ac_bucket_pending(p, NULL, 0), 0);
  }
  size_t from, to;
  CHECK_RC(ac_bucket_mark_ready(p, 2, &from, &to), AC_ERR_STATE); /* twice in one backward */
  CHECK_CONTAINS(ac_last_error(), "gradient 2 became ready twice");
  CHECK_RC(ac_bucket_mark_ready(p, 9, &from, &to), AC_ERR_INVALID_ARG);
  CHECK(!ac_bucket_is_ready(p, 9)); /* out of range */
  CHECK(!ac_bucket_is_ready(NULL, 0));
  ac_bucket_reset(p);
  CHECK(!ac_bucket_is_ready(p, 2)); /* a reset forgets the marks */
  ac_bucket_plan_destroy(p);
}

TEST(bad_arguments) {
  size_t numel[] = {1, 2, 3}, dup[] = {0, 0, 1}, big[] = {0, 1, 5}, ok[] = {2, 1, 0};
  ac_bucket_plan_t *p = (ac_bucket_plan_t *)1;
  CHECK_RC(ac_bucket_plan_create(&p, 3, numel, dup, 4, 64, 64, 1), AC_ERR_INVALID_ARG);
  CHECK(p == NULL);
  CHECK_CONTAINS(ac_last_error(), "not a permutation");
  CHECK_RC(ac_bucket_plan_create(&p, 3, numel, big, 4, 64, 64, 1), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_bucket_plan_create(&p, 3, numel, ok, 0, 64, 64, 1), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_bucket_plan_create(&p, 3, numel, ok, 4, 0, 64, 1), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_bucket_plan_create(&p, 3, numel, ok, 4, 64, 64, 0), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_bucket_plan_create(&p, 3, NULL, ok, 4, 64, 64, 1), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_bucket_plan_create(NULL, 3, numel, ok, 4, 64, 64, 1), AC_ERR_INVALID_ARG);
  size_t huge[] = {SIZE_MAX / 2};
  size_t one[] = {0};
  CHECK_RC(ac_bucket_plan_create(&p, 1, huge, one, 4, 64, 64, 1), AC_ERR_INVALID_ARG);
  ac_bucket_plan_destroy(NULL);
  /* an empty plan is valid */
  CHECK_OK(ac_bucket_plan_create(&p, 0, NULL, NULL, 4, 64, 64, 1));
  CHECK_EQ_INT(ac_bucket_count(p), 0);
  CHECK_EQ_INT(ac_bucket_total(p), 0);
  ac_bucket_plan_destroy(p);
}

/* Random sizes, orders, caps and arrival orders: the invariants hold. */
TEST(random_plans_keep_invariants) {
  tu_rng_t r = {12345};
  for (int iter = 0; iter < 300; iter++) {
    size_t n = 1 + tu_randn(&r, 40), esize = tu_randn(&r, 2) ? 4 : 2, align = 1 + tu_randn(&r, 32);
    size_t first_cap = 1 + tu_randn(&r, 400), cap = 1 + tu_randn(&r, 2000);
    size_t *numel = malloc(n * sizeof *numel), *order = malloc(n * sizeof *order), *marks = malloc(n * sizeof *marks);
    for (size_t i = 0; i < n; i++) {
      numel[i] = tu_randn(&r, 300); /* zero-size gradients too */
      order[i] = marks[i] = i;
    }
    for (size_t i = n; i > 1; i--) { /* shuffle both */
      size_t j = tu_randn(&r, (uint32_t)i), t = order[i - 1];
      order[i - 1] = order[j];
      order[j] = t;
      j = tu_randn(&r, (uint32_t)i);
      t = marks[i - 1];
      marks[i - 1] = marks[j];
      marks[j] = t;
    }
    ac_bucket_plan_t *p = NULL;
    if (!CHECK_OK(ac_bucket_plan_create(&p, n, numel, order, esize, first_cap, cap, align)) || !p) break;
    size_t nb = ac_bucket_count(p), expect_first = 0;
    for (size_t b = 0; b < nb; b++) { /* contiguous, in order, covering the buffer */
      size_t first, count;
      CHECK_OK(ac_bucket_range(p, b, &first, &count));
      CHECK(first == expect_first);
      expect_first = first + count;
    }
    CHECK(expect_first == ac_bucket_total(p));
    { /* torch's closing rule: every bucket but the last reaches its cap, and only its last
       * gradient takes it there */
      size_t *bytes = calloc(nb ? nb : 1, sizeof *bytes), *last = calloc(nb ? nb : 1, sizeof *last);
      for (size_t k = 0; k < n; k++) {
        size_t off, b;
        ac_bucket_param(p, order[k], &off, &b);
        bytes[b] += numel[order[k]] * esize;
        last[b] = numel[order[k]] * esize;
      }
      for (size_t b = 0; b + 1 < nb; b++) {
        size_t c = b == 0 ? first_cap : cap;
        CHECK_MSG(bytes[b] >= c && bytes[b] - last[b] < c, "bucket %zu: %zu bytes (last %zu), cap %zu", b, bytes[b],
                  last[b], c);
      }
      free(bytes);
      free(last);
    }
    for (size_t i = 0; i < n; i++) { /* each gradient aligned, inside its bucket */
      size_t off, b, first, count;
      CHECK_OK(ac_bucket_param(p, i, &off, &b));
      CHECK_OK(ac_bucket_range(p, b, &first, &count));
      CHECK(off % align == 0 && off >= first && off + numel[i] <= first + count);
    }
    size_t *launched = calloc(nb ? nb : 1, sizeof *launched), next = 0;
    ac_bucket_reset(p);
    for (size_t k = 0; k < n; k++) {
      size_t from, to;
      CHECK_OK(ac_bucket_mark_ready(p, marks[k], &from, &to));
      CHECK(from == next && to >= from);
      for (size_t b = from; b < to; b++) launched[b]++;
      next = to;
      /* nothing launchable is left behind: the next bucket is incomplete */
      if (to < nb) {
        size_t pend[64], np = ac_bucket_pending(p, pend, 64), in_next = 0;
        for (size_t q = 0; q < np && q < 64; q++) {
          size_t off, b;
          ac_bucket_param(p, pend[q], &off, &b);
          if (b == to) in_next = 1;
        }
        CHECK(in_next);
      }
    }
    CHECK(next == nb);
    for (size_t b = 0; b < nb; b++) CHECK(launched[b] == 1);
    free(launched);
    free(numel);
    free(order);
    free(marks);
    ac_bucket_plan_destroy(p);
  }
}

static const tu_test_t tests[] = {
    TU_CASE(layout_worked_example),
    TU_CASE(launch_in_order),
    TU_CASE(bad_arguments),
    TU_CASE(random_plans_keep_invariants),
};
TU_MAIN(tests)

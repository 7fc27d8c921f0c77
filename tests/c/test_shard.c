/* test_shard.c — csrc/include/ac/shard.h: the shard plan's layout, worked by hand and checked
 * on random plans, and the runs that reshard between two plans, checked by simulation. */
#include <stdlib.h>
#include <string.h>

#include "ac/bucket.h"
#include "ac/shard.h"
#include "test_util.h"

static void check_bucket(const ac_shard_plan_t *p, size_t b, size_t full, size_t chunk, size_t local, size_t first,
                         size_t count) {
  ac_shard_bucket_t bk;
  if (!CHECK_OK(ac_shard_bucket(p, b, &bk))) return;
  CHECK_MSG(bk.full_offset == full && bk.chunk == chunk && bk.local_offset == local && bk.first == first &&
                bk.count == count,
            "bucket %zu: B %zu c %zu L %zu first %zu count %zu, want %zu %zu %zu %zu %zu", b, bk.full_offset,
            bk.chunk, bk.local_offset, bk.first, bk.count, full, chunk, local, first, count);
}

static void check_param(const ac_shard_plan_t *p, size_t i, size_t bucket, size_t full, size_t numel) {
  ac_shard_param_t pr;
  if (!CHECK_OK(ac_shard_param(p, i, &pr))) return;
  CHECK_MSG(pr.bucket == bucket && pr.full_offset == full && pr.numel == numel,
            "param %zu: bucket %zu offset %zu numel %zu, want %zu %zu %zu", i, pr.bucket, pr.full_offset, pr.numel,
            bucket, full, numel);
}

static void check_owned(const ac_shard_plan_t *p, size_t i, size_t rank, size_t local, size_t poff, size_t len) {
  size_t l = 99, o = 99, n = 99;
  if (!CHECK_OK(ac_shard_param_shard(p, i, rank, &l, &o, &n))) return;
  CHECK_MSG(l == local && o == poff && n == len, "param %zu rank %zu: (%zu, %zu, %zu), want (%zu, %zu, %zu)", i, rank,
            l, o, n, local, poff, len);
}

static void check_runs(const ac_shard_reshard_t *rs, const ac_shard_run_t *want, size_t n) {
  size_t got = ac_shard_reshard_count(rs);
  if (!CHECK_EQ_INT(got, n)) return;
  const ac_shard_run_t *runs = ac_shard_reshard_runs(rs);
  for (size_t k = 0; k < n; k++)
    CHECK_MSG(runs[k].old_rank == want[k].old_rank && runs[k].old_offset == want[k].old_offset &&
                  runs[k].new_offset == want[k].new_offset && runs[k].length == want[k].length,
              "run %zu: (%zu, %zu, %zu, %zu), want (%zu, %zu, %zu, %zu)", k, runs[k].old_rank, runs[k].old_offset,
              runs[k].new_offset, runs[k].length, want[k].old_rank, want[k].old_offset, want[k].new_offset,
              want[k].length);
}

static void check_from(const ac_shard_reshard_t *rs, size_t q, const ac_shard_run_t *want, size_t n) {
  const ac_shard_run_t *runs = NULL;
  size_t got = 99;
  if (!CHECK_OK(ac_shard_reshard_from(rs, q, &runs, &got)) || !CHECK_EQ_INT(got, n)) return;
  for (size_t k = 0; k < n; k++)
    CHECK_MSG(runs[k].old_rank == q && runs[k].old_offset == want[k].old_offset &&
                  runs[k].new_offset == want[k].new_offset && runs[k].length == want[k].length,
              "old rank %zu run %zu: (%zu, %zu, %zu)", q, k, runs[k].old_offset, runs[k].new_offset, runs[k].length);
}

/* Three parameters of 5, 3 and 8 fp32 elements, placed in reverse order (2, 1, 0), align 2,
 * caps 32 B then 16 B. Packing: p2 (32 B) fills bucket 0 to its cap; p1 (12 B) opens bucket 1,
 * which is under 16 B, so p0 joins it. Bucket 0 uses 8 elements, bucket 1 uses 4 + 6 = 10 (p1
 * padded from 3 to 4). */
static const size_t NUMEL3[] = {5, 3, 8}, REV3[] = {2, 1, 0};

/* world 2: chunks are multiples of 2: bucket 0: 8 -> 8 = 2 x 4; bucket 1: 10 -> 12 = 2 x 6.
 *   full:   [0, 8) bucket 0 = p2 [0, 8);  [8, 20) bucket 1 = p1 [8, 11), pad 11, p0 [12, 17), pad 17..19
 *   rank 0: chunks [0, 4) and [8, 14)  -> shard: p2[0:4] | p1[0:3], pad, p0[0:2]
 *   rank 1: chunks [4, 8) and [14, 20) -> shard: p2[4:8] | p0[2:5], pad, pad, pad */
TEST(worked_example_world_2) {
  ac_shard_plan_t *p = NULL;
  CHECK_OK(ac_shard_plan_create(&p, 3, NUMEL3, REV3, 4, 2, 2, 32, 16));
  if (!p) return;
  CHECK_EQ_INT(ac_shard_nbuckets(p), 2);
  CHECK_EQ_INT(ac_shard_total(p), 20);
  CHECK_EQ_INT(ac_shard_numel(p), 10);
  CHECK_EQ_INT(ac_shard_world(p), 2);
  CHECK_EQ_INT(ac_shard_nparams(p), 3);
  CHECK_EQ_INT(ac_shard_esize(p), 4);
  CHECK_EQ_INT(ac_shard_align(p), 2);
  CHECK_EQ_INT(ac_shard_first_cap(p), 32);
  CHECK_EQ_INT(ac_shard_cap(p), 16);
  check_bucket(p, 0, 0, 4, 0, 0, 1);
  check_bucket(p, 1, 8, 6, 4, 1, 2);
  check_param(p, 0, 1, 12, 5);
  check_param(p, 1, 1, 8, 3);
  check_param(p, 2, 0, 0, 8);
  check_owned(p, 2, 0, 0, 0, 4);
  check_owned(p, 2, 1, 0, 4, 4);
  check_owned(p, 1, 0, 4, 0, 3);
  check_owned(p, 1, 1, 0, 0, 0); /* p1 lies wholly in rank 0's chunk */
  check_owned(p, 0, 0, 8, 0, 2);
  check_owned(p, 0, 1, 4, 2, 3);
  for (size_t k = 0; k < 3; k++) {
    size_t i;
    CHECK_OK(ac_shard_placed(p, k, &i));
    CHECK_EQ_INT(i, REV3[k]);
  }
  ac_shard_bucket_t bk;
  ac_shard_param_t pr;
  size_t a, b, c;
  CHECK_RC(ac_shard_bucket(p, 2, &bk), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "bucket 2 out of range (2 buckets)");
  CHECK_RC(ac_shard_param(p, 3, &pr), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "parameter 3 out of range");
  CHECK_RC(ac_shard_param_shard(p, 3, 0, &a, &b, &c), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_shard_param_shard(p, 0, 2, &a, &b, &c), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "rank 2 out of range (world 2)");
  CHECK_RC(ac_shard_placed(p, 3, &a), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_shard_bucket(p, 0, NULL), AC_ERR_INVALID_ARG);
  ac_shard_plan_destroy(p);
}

/* world 3: chunks are multiples of 2 and buckets of 6: bucket 0: 8 -> 12 = 3 x 4; bucket 1:
 * 10 -> 12 = 3 x 4.
 *   full:   [0, 12) bucket 0 = p2 [0, 8), pad;  [12, 24) bucket 1 = p1 [12, 15), pad, p0 [16, 21), pad
 *   rank 0: [0, 4) and [12, 16)  -> p2[0:4] | p1[0:3], pad
 *   rank 1: [4, 8) and [16, 20)  -> p2[4:8] | p0[0:4]
 *   rank 2: [8, 12) and [20, 24) -> pad x4  | p0[4:5], pad x3 */
TEST(worked_example_world_3) {
  ac_shard_plan_t *p = NULL;
  CHECK_OK(ac_shard_plan_create(&p, 3, NUMEL3, REV3, 4, 3, 2, 32, 16));
  if (!p) return;
  CHECK_EQ_INT(ac_shard_nbuckets(p), 2);
  CHECK_EQ_INT(ac_shard_total(p), 24);
  CHECK_EQ_INT(ac_shard_numel(p), 8);
  check_bucket(p, 0, 0, 4, 0, 0, 1);
  check_bucket(p, 1, 12, 4, 4, 1, 2);
  check_param(p, 0, 1, 16, 5);
  check_param(p, 1, 1, 12, 3);
  check_param(p, 2, 0, 0, 8);
  check_owned(p, 2, 0, 0, 0, 4);
  check_owned(p, 2, 1, 0, 4, 4);
  check_owned(p, 2, 2, 0, 0, 0);
  check_owned(p, 1, 0, 4, 0, 3);
  check_owned(p, 1, 1, 0, 0, 0);
  check_owned(p, 1, 2, 0, 0, 0);
  check_owned(p, 0, 0, 0, 0, 0); /* rank 0's chunk of bucket 1 ends where p0 starts */
  check_owned(p, 0, 1, 4, 0, 4);
  check_owned(p, 0, 2, 4, 4, 1);
  ac_shard_plan_destroy(p);
}

/* Reshards of the worked example: world 2 -> world 3 (same order, caps, align), and world 2 ->
 * one process in registration order, align 1, one bucket (p0 [0, 5), p1 [5, 8), p2 [8, 16)). */
TEST(worked_reshard) {
  ac_shard_plan_t *w2 = NULL, *w3 = NULL, *w1 = NULL;
  size_t fwd[] = {0, 1, 2};
  CHECK_OK(ac_shard_plan_create(&w2, 3, NUMEL3, REV3, 4, 2, 2, 32, 16));
  CHECK_OK(ac_shard_plan_create(&w3, 3, NUMEL3, REV3, 4, 3, 2, 32, 16));
  CHECK_OK(ac_shard_plan_create(&w1, 3, NUMEL3, fwd, 2, 1, 1, SIZE_MAX, SIZE_MAX));
  if (!w2 || !w3 || !w1) goto out;
  CHECK_EQ_INT(ac_shard_nbuckets(w1), 1);
  CHECK_EQ_INT(ac_shard_total(w1), 16);
  ac_shard_reshard_t *rs = NULL;
  /* new rank 0 = p2[0:4] | p1[0:3], pad: old rank 0's [0, 4) and [4, 7), contiguous in both: one run */
  CHECK_OK(ac_shard_reshard_create(&rs, w2, w3, 0));
  {
    const ac_shard_run_t want[] = {{0, 0, 0, 7}};
    check_runs(rs, want, 1);
    check_from(rs, 0, want, 1);
    check_from(rs, 1, NULL, 0);
    CHECK_EQ_INT(ac_shard_reshard_old_world(rs), 2);
  }
  ac_shard_reshard_destroy(rs);
  /* new rank 1 = p2[4:8] | p0[0:4]: p2[4:8] is old rank 1's [0, 4); p0[0:2] old rank 0's [8, 10);
   * p0[2:4] old rank 1's [4, 6) */
  CHECK_OK(ac_shard_reshard_create(&rs, w2, w3, 1));
  {
    const ac_shard_run_t want[] = {{1, 0, 0, 4}, {0, 8, 4, 2}, {1, 4, 6, 2}};
    check_runs(rs, want, 3);
    const ac_shard_run_t from0[] = {{0, 8, 4, 2}}, from1[] = {{1, 0, 0, 4}, {1, 4, 6, 2}};
    check_from(rs, 0, from0, 1);
    check_from(rs, 1, from1, 2);
  }
  ac_shard_reshard_destroy(rs);
  /* new rank 2 = pad x4 | p0[4:5], pad x3: p0[4] is old rank 1's element 6 */
  CHECK_OK(ac_shard_reshard_create(&rs, w2, w3, 2));
  {
    const ac_shard_run_t want[] = {{1, 6, 4, 1}};
    check_runs(rs, want, 1);
  }
  ac_shard_reshard_destroy(rs);
  /* to one process: p0[0:2] r0 [8, 10), p0[2:5] r1 [4, 7), p1 r0 [4, 7), p2[0:4] r0 [0, 4), p2[4:8] r1 [0, 4) */
  CHECK_OK(ac_shard_reshard_create(&rs, w2, w1, 0));
  {
    const ac_shard_run_t want[] = {{0, 8, 0, 2}, {1, 4, 2, 3}, {0, 4, 5, 3}, {0, 0, 8, 4}, {1, 0, 12, 4}};
    check_runs(rs, want, 5);
    const ac_shard_run_t from0[] = {{0, 0, 8, 4}, {0, 4, 5, 3}, {0, 8, 0, 2}}, from1[] = {{1, 0, 12, 4}, {1, 4, 2, 3}};
    check_from(rs, 0, from0, 3);
    check_from(rs, 1, from1, 2);
    const ac_shard_run_t *r;
    size_t n;
    CHECK_RC(ac_shard_reshard_from(rs, 2, &r, &n), AC_ERR_INVALID_ARG);
    CHECK_CONTAINS(ac_last_error(), "old_rank 2 out of range (old world 2)");
  }
  ac_shard_reshard_destroy(rs);
  /* and back: a one-process checkpoint read by world 3's rank 1: p2[4:8] at [12, 16), p0[0:4] at [0, 4) */
  CHECK_OK(ac_shard_reshard_create(&rs, w1, w3, 1));
  {
    const ac_shard_run_t want[] = {{0, 12, 0, 4}, {0, 0, 4, 4}};
    check_runs(rs, want, 2);
  }
  ac_shard_reshard_destroy(rs);
out:
  ac_shard_plan_destroy(w1);
  ac_shard_plan_destroy(w2);
  ac_shard_plan_destroy(w3);
}

/* Zero-element parameters take no space, own nothing, and still have a bucket; a bucket of
 * them alone (after a full one) has chunk 0. */
TEST(zero_element_parameters) {
  size_t numel[] = {0, 4, 0, 0}, order[] = {1, 0, 2, 3};
  ac_shard_plan_t *p = NULL;
  /* p1 (16 B) fills bucket 0's 16 B cap; p0, p2, p3 open bucket 1 and add no bytes */
  CHECK_OK(ac_shard_plan_create(&p, 4, numel, order, 4, 2, 2, 16, 16));
  if (!p) return;
  CHECK_EQ_INT(ac_shard_nbuckets(p), 2);
  CHECK_EQ_INT(ac_shard_total(p), 4);
  CHECK_EQ_INT(ac_shard_numel(p), 2);
  check_bucket(p, 0, 0, 2, 0, 0, 1);
  check_bucket(p, 1, 4, 0, 2, 1, 3);
  check_param(p, 1, 0, 0, 4);
  check_param(p, 0, 1, 4, 0);
  check_param(p, 3, 1, 4, 0);
  for (size_t r = 0; r < 2; r++) {
    check_owned(p, 0, r, 0, 0, 0);
    check_owned(p, 2, r, 0, 0, 0);
  }
  check_owned(p, 1, 1, 0, 2, 2);
  ac_shard_plan_destroy(p);
  /* between non-empty ones they sit at the next offset and take none of it */
  size_t numel2[] = {3, 0, 2}, order2[] = {0, 1, 2};
  CHECK_OK(ac_shard_plan_create(&p, 3, numel2, order2, 2, 1, 4, 1000, 1000));
  if (!p) return;
  check_param(p, 0, 0, 0, 3);
  check_param(p, 1, 0, 4, 0);
  check_param(p, 2, 0, 4, 2);
  CHECK_EQ_INT(ac_shard_total(p), 8);
  ac_shard_plan_destroy(p);
  /* all empty: one bucket of nothing */
  size_t none[] = {0, 0};
  CHECK_OK(ac_shard_plan_create(&p, 2, none, order2, 4, 3, 2, 1, 1));
  if (!p) return;
  CHECK_EQ_INT(ac_shard_nbuckets(p), 1);
  CHECK_EQ_INT(ac_shard_total(p), 0);
  CHECK_EQ_INT(ac_shard_numel(p), 0);
  check_bucket(p, 0, 0, 0, 0, 0, 2);
  ac_shard_reshard_t *rs = NULL;
  CHECK_OK(ac_shard_reshard_create(&rs, p, p, 2));
  CHECK_EQ_INT(ac_shard_reshard_count(rs), 0);
  CHECK(ac_shard_reshard_runs(rs) == NULL);
  ac_shard_reshard_destroy(rs);
  ac_shard_plan_destroy(p);
}

TEST(bad_arguments) {
  size_t numel[] = {1, 2, 3}, dup[] = {0, 0, 1}, big[] = {0, 1, 5}, ok[] = {2, 1, 0};
  ac_shard_plan_t *p = (ac_shard_plan_t *)1;
  CHECK_RC(ac_shard_plan_create(&p, 3, numel, dup, 4, 2, 1, 64, 64), AC_ERR_INVALID_ARG);
  CHECK(p == NULL);
  CHECK_CONTAINS(ac_last_error(), "order is not a permutation of 0..2 (order[1] is 0, repeated)");
  CHECK_RC(ac_shard_plan_create(&p, 3, numel, big, 4, 2, 1, 64, 64), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "order[2] is 5, out of range");
  CHECK_RC(ac_shard_plan_create(&p, 3, numel, ok, 0, 2, 1, 64, 64), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "esize must be > 0");
  CHECK_RC(ac_shard_plan_create(&p, 3, numel, ok, 4, 0, 1, 64, 64), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "world must be > 0");
  CHECK_RC(ac_shard_plan_create(&p, 3, numel, ok, 4, 2, 0, 64, 64), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "align must be > 0");
  CHECK_RC(ac_shard_plan_create(&p, 3, numel, ok, 4, 2, 1, 0, 64), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "first_cap_bytes must be > 0");
  CHECK_RC(ac_shard_plan_create(&p, 3, numel, ok, 4, 2, 1, 64, 0), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "cap_bytes must be > 0");
  CHECK_RC(ac_shard_plan_create(&p, 3, NULL, ok, 4, 2, 1, 64, 64), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "numel is NULL");
  CHECK_RC(ac_shard_plan_create(&p, 3, numel, NULL, 4, 2, 1, 64, 64), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "order is NULL");
  CHECK_RC(ac_shard_plan_create(NULL, 3, numel, ok, 4, 2, 1, 64, 64), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_shard_plan_create(&p, 3, numel, ok, 4, SIZE_MAX / 2, 4, 64, 64), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "world x align overflows");
  /* sizes: one parameter too large for its bytes; a sum that wraps; padding that wraps; bytes */
  size_t one[] = {0}, two[] = {0, 1};
  size_t huge[] = {SIZE_MAX / 2};
  CHECK_RC(ac_shard_plan_create(&p, 1, huge, one, 4, 1, 1, 64, 64), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "parameter 0 has too many elements");
  size_t halves[] = {SIZE_MAX / 2 + 1, SIZE_MAX / 2 + 1};
  CHECK_RC(ac_shard_plan_create(&p, 2, halves, two, 1, 1, 1, SIZE_MAX, SIZE_MAX), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "total size overflows (at parameter 1)");
  size_t nearly[] = {SIZE_MAX - 8};
  CHECK_RC(ac_shard_plan_create(&p, 1, nearly, one, 1, 16, 1, 64, 64), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "total size overflows (at bucket 0)");
  size_t quarters[] = {SIZE_MAX / 4 + 1, SIZE_MAX / 4 + 1}; /* 2^63 elements fit, 2^64 bytes do not */
  CHECK_RC(ac_shard_plan_create(&p, 2, quarters, two, 2, 1, 1, SIZE_MAX, SIZE_MAX), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "size in bytes overflows");
  ac_shard_plan_destroy(NULL);
  /* an empty plan is valid */
  CHECK_OK(ac_shard_plan_create(&p, 0, NULL, NULL, 4, 3, 2, 64, 64));
  CHECK_EQ_INT(ac_shard_nbuckets(p), 0);
  CHECK_EQ_INT(ac_shard_total(p), 0);
  CHECK_EQ_INT(ac_shard_numel(p), 0);
  ac_shard_plan_destroy(p);
  CHECK_EQ_INT(ac_shard_total(NULL), 0);
}

TEST(reshard_bad_arguments) {
  size_t a[] = {5, 3, 8}, b[] = {5, 4, 8}, order[] = {2, 1, 0};
  ac_shard_plan_t *pa = NULL, *pb = NULL, *pc = NULL;
  CHECK_OK(ac_shard_plan_create(&pa, 3, a, order, 4, 2, 1, 64, 64));
  CHECK_OK(ac_shard_plan_create(&pb, 3, b, order, 4, 2, 1, 64, 64));
  CHECK_OK(ac_shard_plan_create(&pc, 2, a, order + 1, 4, 2, 1, 64, 64));
  ac_shard_reshard_t *rs = (ac_shard_reshard_t *)1;
  CHECK_RC(ac_shard_reshard_create(&rs, pa, pb, 0), AC_ERR_INVALID_ARG);
  CHECK(rs == NULL);
  CHECK_CONTAINS(ac_last_error(), "parameter 1 has 3 elements in the old plan and 4 in the new");
  CHECK_RC(ac_shard_reshard_create(&rs, pa, pc, 0), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "the old plan has 3 parameters, the new plan 2");
  CHECK_RC(ac_shard_reshard_create(&rs, pa, pa, 2), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "new_rank 2 out of range (new world 2)");
  CHECK_RC(ac_shard_reshard_create(&rs, NULL, pa, 0), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "old_plan is NULL");
  CHECK_RC(ac_shard_reshard_create(&rs, pa, NULL, 0), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "new_plan is NULL");
  CHECK_RC(ac_shard_reshard_create(NULL, pa, pa, 0), AC_ERR_INVALID_ARG);
  ac_shard_reshard_destroy(NULL);
  CHECK_EQ_INT(ac_shard_reshard_count(NULL), 0);
  ac_shard_plan_destroy(pa);
  ac_shard_plan_destroy(pb);
  ac_shard_plan_destroy(pc);
}

/* ---- random plans ------------------------------------------------------------------------ */

#define PAD 0ULL                 /* padding in a shard (what the caller zeroes) */
#define UNWRITTEN UINT64_MAX     /* a new shard's element no run wrote */
static uint64_t code(size_t param, size_t elem) { return ((uint64_t)(param + 1) << 32) | (uint64_t)elem; }

typedef struct {
  size_t esize, world, align, first_cap, cap;
  size_t *order;
} spec_t;

static void random_spec(tu_rng_t *r, size_t n, spec_t *s) {
  static const size_t aligns[] = {1, 2, 4, 16}, esizes[] = {1, 2, 4, 8};
  s->world = 1 + tu_randn(r, 8);
  s->align = aligns[tu_randn(r, 4)];
  s->esize = esizes[tu_randn(r, 4)];
  s->first_cap = tu_randn(r, 8) == 0 ? SIZE_MAX : 1 + tu_randn(r, 4000);
  s->cap = tu_randn(r, 8) == 0 ? SIZE_MAX : 1 + tu_randn(r, 8000);
  s->order = malloc((n ? n : 1) * sizeof *s->order);
  for (size_t i = 0; i < n; i++) s->order[i] = i;
  for (size_t i = n; i > 1; i--) {
    size_t j = tu_randn(r, (uint32_t)i), t = s->order[i - 1];
    s->order[i - 1] = s->order[j];
    s->order[j] = t;
  }
}

/* Every rank's shard filled through param_shard with code(param, element), padding PAD. */
static uint64_t **fill_shards(const ac_shard_plan_t *p, const size_t *numel) {
  size_t world = ac_shard_world(p), sn = ac_shard_numel(p), n = ac_shard_nparams(p);
  uint64_t **sh = malloc(world * sizeof *sh);
  for (size_t q = 0; q < world; q++) {
    sh[q] = malloc((sn ? sn : 1) * sizeof **sh);
    for (size_t j = 0; j < sn; j++) sh[q][j] = PAD;
    for (size_t i = 0; i < n; i++) {
      size_t l, o, len;
      (void)ac_shard_param_shard(p, i, q, &l, &o, &len);
      if (len && l + len <= sn && o + len <= numel[i])
        for (size_t j = 0; j < len; j++) sh[q][l + j] = code(i, o + j);
    }
  }
  return sh;
}

static void free_shards(uint64_t **sh, size_t world) {
  for (size_t q = 0; q < world; q++) free(sh[q]);
  free(sh);
}

/* The layout's invariants, checked from the buckets and parameters only. */
static void check_layout(const ac_shard_plan_t *p, size_t n, const size_t *numel, const spec_t *s) {
  size_t nb = ac_shard_nbuckets(p), world = s->world, total = ac_shard_total(p), sn = ac_shard_numel(p);
  CHECK(total == world * sn);
  /* buckets tile the full buffer in order, and each rank's chunks tile its shard */
  size_t full = 0, local = 0, placed = 0;
  for (size_t b = 0; b < nb; b++) {
    ac_shard_bucket_t bk;
    if (!CHECK_OK(ac_shard_bucket(p, b, &bk))) return;
    CHECK_MSG(bk.full_offset == full && bk.local_offset == local && bk.first == placed,
              "bucket %zu: B %zu L %zu first %zu, want %zu %zu %zu", b, bk.full_offset, bk.local_offset, bk.first, full,
              local, placed);
    CHECK(bk.chunk % s->align == 0);
    CHECK(bk.count > 0);
    full += world * bk.chunk;
    local += bk.chunk;
    placed += bk.count;
  }
  CHECK(full == total && local == sn && placed == n);
  /* parameters in placement order: inside their bucket, aligned, not overlapping */
  size_t end = 0, prev_bucket = 0;
  for (size_t k = 0; k < n; k++) {
    size_t i;
    ac_shard_param_t pr;
    ac_shard_bucket_t bk;
    CHECK_OK(ac_shard_placed(p, k, &i));
    CHECK(i == s->order[k]);
    if (!CHECK_OK(ac_shard_param(p, i, &pr)) || !CHECK_OK(ac_shard_bucket(p, pr.bucket, &bk))) return;
    CHECK(pr.numel == numel[i]);
    CHECK(k >= bk.first && k < bk.first + bk.count);
    CHECK(pr.bucket >= prev_bucket);
    if (pr.bucket != prev_bucket) CHECK(bk.full_offset >= end);
    CHECK_MSG(pr.full_offset % s->align == 0 && pr.full_offset >= end && pr.full_offset >= bk.full_offset &&
                  pr.full_offset + pr.numel <= bk.full_offset + world * bk.chunk,
              "param %zu at %zu (+%zu), bucket [%zu, +%zu), previous end %zu", i, pr.full_offset, pr.numel,
              bk.full_offset, world * bk.chunk, end);
    /* tight: a parameter starts at the first aligned offset after the previous one */
    if (k > 0 && pr.bucket == prev_bucket) CHECK(pr.full_offset == (end + s->align - 1) / s->align * s->align);
    if (k == bk.first) CHECK(pr.full_offset == bk.full_offset);
    end = pr.full_offset + pr.numel;
    prev_bucket = pr.bucket;
  }
  /* a bucket is padded only up to the next multiple of world x align */
  for (size_t b = 0; b < nb; b++) {
    ac_shard_bucket_t bk;
    ac_shard_param_t last;
    size_t i;
    (void)ac_shard_bucket(p, b, &bk);
    (void)ac_shard_placed(p, bk.first + bk.count - 1, &i);
    (void)ac_shard_param(p, i, &last);
    size_t used = last.full_offset + last.numel - bk.full_offset;
    CHECK_MSG(world * bk.chunk >= used && world * bk.chunk - used < world * s->align,
              "bucket %zu: %zu elements for %zu used", b, world * bk.chunk, used);
  }
  /* ownership: the full buffer written from the parameters' ranges, cut into chunks, equals
   * the shards param_shard describes, and every element of every parameter has one owner */
  uint64_t *fullbuf = malloc((total ? total : 1) * sizeof *fullbuf);
  for (size_t j = 0; j < total; j++) fullbuf[j] = PAD;
  for (size_t i = 0; i < n; i++) {
    ac_shard_param_t pr;
    (void)ac_shard_param(p, i, &pr);
    for (size_t e = 0; e < pr.numel; e++) fullbuf[pr.full_offset + e] = code(i, e);
  }
  uint64_t **sh = fill_shards(p, numel);
  for (size_t q = 0; q < world; q++)
    for (size_t b = 0; b < nb; b++) {
      ac_shard_bucket_t bk;
      (void)ac_shard_bucket(p, b, &bk);
      for (size_t j = 0; j < bk.chunk; j++)
        if (!CHECK_MSG(sh[q][bk.local_offset + j] == fullbuf[bk.full_offset + q * bk.chunk + j],
                       "rank %zu bucket %zu element %zu", q, b, j))
          goto done;
    }
  for (size_t i = 0; i < n; i++) {
    unsigned char *seen = calloc(numel[i] ? numel[i] : 1, 1);
    size_t sum = 0;
    for (size_t q = 0; q < world; q++) {
      size_t l, o, len;
      CHECK_OK(ac_shard_param_shard(p, i, q, &l, &o, &len));
      if (len == 0) {
        CHECK(l == 0 && o == 0);
        continue;
      }
      CHECK(o + len <= numel[i] && l + len <= sn);
      for (size_t e = o; e < o + len && e < numel[i]; e++) seen[e]++;
      sum += len;
    }
    CHECK_EQ_INT(sum, numel[i]);
    for (size_t e = 0; e < numel[i]; e++) CHECK(seen[e] == 1);
    free(seen);
  }
done:
  free_shards(sh, world);
  free(fullbuf);
}

/* bucket.h with the same arguments puts every parameter in the same bucket; on one rank the
 * layouts are the same element for element. */
static void check_matches_bucket_plan(const ac_shard_plan_t *p, size_t n, const size_t *numel, const spec_t *s) {
  ac_bucket_plan_t *bp = NULL;
  if (!CHECK_OK(ac_bucket_plan_create(&bp, n, numel, s->order, s->esize, s->first_cap, s->cap, s->align))) return;
  CHECK_EQ_INT(ac_bucket_count(bp), ac_shard_nbuckets(p));
  if (s->world == 1) CHECK_EQ_INT(ac_bucket_total(bp), ac_shard_total(p));
  for (size_t i = 0; i < n; i++) {
    size_t off, b;
    ac_shard_param_t pr;
    CHECK_OK(ac_bucket_param(bp, i, &off, &b));
    CHECK_OK(ac_shard_param(p, i, &pr));
    CHECK_EQ_INT(pr.bucket, b);
    if (s->world == 1) CHECK_EQ_INT(pr.full_offset, off);
  }
  ac_bucket_plan_destroy(bp);
}

static int cmp_new_offset(const void *key, const void *elem) {
  size_t k = *(const size_t *)key, o = ((const ac_shard_run_t *)elem)->new_offset;
  return (k > o) - (k < o);
}

/* Old shards filled with codes, the runs applied, each new shard compared to what the new plan
 * says it holds: every non-padding element written once with the same (param, element), no
 * padding written. */
static void check_reshard(const ac_shard_plan_t *op, const ac_shard_plan_t *np, const size_t *numel) {
  size_t ow = ac_shard_world(op), nw = ac_shard_world(np), osn = ac_shard_numel(op), nsn = ac_shard_numel(np);
  uint64_t **old = fill_shards(op, numel), **want = fill_shards(np, numel);
  uint64_t *got = malloc((nsn ? nsn : 1) * sizeof *got);
  for (size_t r = 0; r < nw && !tu_failed(); r++) {
    ac_shard_reshard_t *rs = NULL;
    if (!CHECK_OK(ac_shard_reshard_create(&rs, op, np, r))) break;
    CHECK_EQ_INT(ac_shard_reshard_old_world(rs), ow);
    size_t nr = ac_shard_reshard_count(rs);
    const ac_shard_run_t *runs = ac_shard_reshard_runs(rs);
    for (size_t j = 0; j < nsn; j++) got[j] = UNWRITTEN;
    for (size_t k = 0; k < nr; k++) {
      const ac_shard_run_t *u = &runs[k];
      if (!CHECK(u->length > 0 && u->old_rank < ow && u->old_offset + u->length <= osn &&
                 u->new_offset + u->length <= nsn))
        break;
      if (k > 0) {
        const ac_shard_run_t *v = &runs[k - 1];
        CHECK(v->new_offset + v->length <= u->new_offset); /* sorted, disjoint */
        CHECK(!(v->old_rank == u->old_rank && v->old_offset + v->length == u->old_offset &&
                v->new_offset + v->length == u->new_offset)); /* merged */
      }
      for (size_t j = 0; j < u->length; j++) {
        CHECK(got[u->new_offset + j] == UNWRITTEN);
        got[u->new_offset + j] = old[u->old_rank][u->old_offset + j];
      }
    }
    for (size_t j = 0; j < nsn; j++)
      if (!CHECK_MSG(got[j] == (want[r][j] == PAD ? UNWRITTEN : want[r][j]),
                     "new rank %zu element %zu: %llx, want %llx", r, j, (unsigned long long)got[j],
                     (unsigned long long)want[r][j]))
        break;
    /* the by-old-rank view: the same runs, grouped, each group by old offset */
    size_t seen = 0;
    for (size_t q = 0; q < ow; q++) {
      const ac_shard_run_t *g;
      size_t gn;
      if (!CHECK_OK(ac_shard_reshard_from(rs, q, &g, &gn))) break;
      for (size_t k = 0; k < gn; k++) {
        CHECK(g[k].old_rank == q);
        if (k > 0) CHECK(g[k - 1].old_offset + g[k - 1].length <= g[k].old_offset);
        const ac_shard_run_t *m = bsearch(&g[k].new_offset, runs, nr, sizeof *runs, cmp_new_offset);
        CHECK(m && memcmp(m, &g[k], sizeof *m) == 0);
      }
      seen += gn;
    }
    CHECK_EQ_INT(seen, nr);
    ac_shard_reshard_destroy(rs);
  }
  free(got);
  free_shards(old, ow);
  free_shards(want, nw);
}

TEST(random_plans_and_reshards) {
  tu_rng_t r = {0x5eed5a4d};
  for (int iter = 0; iter < 400 && !tu_failed(); iter++) {
    size_t n = tu_randn(&r, 10) == 0 ? tu_randn(&r, 2) : 1 + tu_randn(&r, 24);
    size_t *numel = malloc((n ? n : 1) * sizeof *numel);
    for (size_t i = 0; i < n; i++) numel[i] = tu_randn(&r, 8) == 0 ? 0 : tu_randn(&r, 1001);
    spec_t a, b;
    random_spec(&r, n, &a);
    random_spec(&r, n, &b);
    ac_shard_plan_t *pa = NULL, *pb = NULL;
    CHECK_OK(ac_shard_plan_create(&pa, n, numel, a.order, a.esize, a.world, a.align, a.first_cap, a.cap));
    CHECK_OK(ac_shard_plan_create(&pb, n, numel, b.order, b.esize, b.world, b.align, b.first_cap, b.cap));
    if (pa && pb) {
      check_layout(pa, n, numel, &a);
      check_matches_bucket_plan(pa, n, numel, &a);
      check_reshard(pa, pb, numel);
      check_reshard(pa, pa, numel); /* onto itself: rank r reads only old rank r, at the same offsets */
      for (size_t q = 0; q < a.world; q++) {
        ac_shard_reshard_t *rs = NULL;
        CHECK_OK(ac_shard_reshard_create(&rs, pa, pa, q));
        const ac_shard_run_t *u = ac_shard_reshard_runs(rs);
        for (size_t k = 0; k < ac_shard_reshard_count(rs); k++)
          CHECK(u[k].old_rank == q && u[k].old_offset == u[k].new_offset);
        ac_shard_reshard_destroy(rs);
      }
    }
    if (tu_failed())
      printf("iteration %d: n %zu; a: world %zu align %zu esize %zu caps %zu/%zu; b: world %zu align %zu esize %zu "
             "caps %zu/%zu\n",
             iter, n, a.world, a.align, a.esize, a.first_cap, a.cap, b.world, b.align, b.esize, b.first_cap, b.cap);
    ac_shard_plan_destroy(pa);
    ac_shard_plan_destroy(pb);
    free(a.order);
    free(b.order);
    free(numel);
  }
}

static const tu_test_t tests[] = {
    TU_CASE(worked_example_world_2), TU_CASE(worked_example_world_3), TU_CASE(worked_reshard),
    TU_CASE(zero_element_parameters), TU_CASE(bad_arguments),         TU_CASE(reshard_bad_arguments),
    TU_CASE(random_plans_and_reshards),
};
TU_MAIN(tests)

/* fuzz_shard.c — fuzz target for the shard plan and its resharding arithmetic (csrc/core/shard.c).
 *
 * The input describes two plans over one parameter list (a checkpoint's and this run's): sizes,
 * orders, world sizes, alignments, caps and element sizes. Byte 0 chooses the mode:
 *   even: small values (up to 24 parameters of up to ~300 elements, worlds up to 16) so the
 *         harness can materialize every shard and check every element;
 *   odd : raw 64-bit values (sizes near SIZE_MAX, zero worlds, caps of 0) that must give a
 *         clean AC_ERR_INVALID_ARG with a message, never an overflow or a crash.
 * Invariants checked on every plan the core accepts (trap on a violation):
 *   - total == world * shard_numel; buckets tile the full buffer in order, each chunk a multiple
 *     of align, local offsets the prefix sums of the chunks; the placement is the given order;
 *   - every parameter starts at a multiple of align inside its own bucket, and parameters never
 *     overlap; each bucket's parameters are its placement range;
 *   - ac_shard_param_shard: the ranks' parts of a parameter are disjoint, cover it exactly, and
 *     sit where the bucket-major formula says;
 *   - resharding to every new rank: runs sorted by new offset, disjoint, inside both shards,
 *     old ranks in range; applying them to old shards that hold element ids writes every
 *     non-padding element of the new shard exactly once with the right id, and padding never;
 *     ac_shard_reshard_from lists the same runs grouped by old rank, sorted by old offset.
 * Plans over different parameter lists must be refused (AC_ERR_INVALID_ARG). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ac/shard.h"

#include "fuzz_util.h"

typedef struct {
  size_t nparams, esize, world, align, first_cap, cap;
  size_t *order;
} plan_args;

/* A permutation of 0..n-1 from the input (Fisher-Yates driven by input bytes). */
static void permute(reader *r, size_t *order, size_t n) {
  for (size_t i = 0; i < n; i++) order[i] = i;
  for (size_t i = n; i > 1; i--) {
    size_t j = (size_t)take(r, 1) % i, t = order[i - 1];
    order[i - 1] = order[j];
    order[j] = t;
  }
}

static void small_args(reader *r, plan_args *a, size_t nparams) {
  static const size_t esizes[] = {1, 2, 4, 8};
  a->nparams = nparams;
  a->esize = esizes[take(r, 1) % 4];
  a->world = 1 + (size_t)take(r, 1) % 16;
  a->align = 1 + (size_t)take(r, 1) % 16;
  a->first_cap = 1 + (size_t)take(r, 2) % 2048;
  a->cap = 1 + (size_t)take(r, 2) % 2048;
  permute(r, a->order, nparams);
}

/* Element id held by each position of one rank's shard: param * 65536 + element, or -1 for
 * padding. Built from ac_shard_param_shard, after checking that its parts tile every parameter. */
static void check_plan(const ac_shard_plan_t *p, const plan_args *a, const size_t *numel, int64_t **ids) {
  size_t world = ac_shard_world(p), shard = ac_shard_numel(p), nb = ac_shard_nbuckets(p);
  CHECK(world == a->world && ac_shard_nparams(p) == a->nparams && ac_shard_align(p) == a->align);
  CHECK(ac_shard_total(p) == world * shard);
  size_t full = 0, local = 0, pos = 0;
  for (size_t b = 0; b < nb; b++) {
    ac_shard_bucket_t bk;
    CHECK(ac_shard_bucket(p, b, &bk) == AC_OK);
    CHECK(bk.full_offset == full && bk.local_offset == local && bk.first == pos);
    CHECK(bk.chunk % a->align == 0);
    CHECK(bk.count > 0 || a->nparams == 0);
    size_t end = bk.full_offset; /* parameters in placement order, disjoint, aligned */
    for (size_t k = bk.first; k < bk.first + bk.count; k++) {
      size_t param;
      CHECK(ac_shard_placed(p, k, &param) == AC_OK && param == a->order[k]);
      ac_shard_param_t sp;
      CHECK(ac_shard_param(p, param, &sp) == AC_OK);
      CHECK(sp.bucket == b && sp.numel == numel[param]);
      if (sp.numel) {
        CHECK(sp.full_offset % a->align == 0 && sp.full_offset >= end);
        end = sp.full_offset + sp.numel;
      }
    }
    CHECK(end <= bk.full_offset + world * bk.chunk);
    full += world * bk.chunk;
    local += bk.chunk;
    pos += bk.count;
  }
  CHECK(full == ac_shard_total(p) && local == shard && pos == a->nparams);
  for (size_t q = 0; q < world; q++)
    for (size_t i = 0; i < shard; i++) ids[q][i] = -1;
  for (size_t i = 0; i < a->nparams; i++) {
    ac_shard_param_t sp;
    CHECK(ac_shard_param(p, i, &sp) == AC_OK);
    ac_shard_bucket_t bk;
    CHECK(ac_shard_bucket(p, sp.bucket, &bk) == AC_OK);
    size_t covered = 0;
    for (size_t q = 0; q < world; q++) {
      size_t lo, po, len;
      CHECK(ac_shard_param_shard(p, i, q, &lo, &po, &len) == AC_OK);
      if (!len) {
        CHECK(lo == 0 && po == 0);
        continue;
      }
      CHECK(po + len <= sp.numel && lo + len <= shard);
      /* where the bucket-major layout puts element po of the parameter */
      size_t at = sp.full_offset + po - bk.full_offset;
      CHECK(bk.chunk && at / bk.chunk == q && lo == bk.local_offset + at % bk.chunk);
      CHECK(at % bk.chunk + len <= bk.chunk);
      for (size_t e = 0; e < len; e++) {
        CHECK(ids[q][lo + e] == -1); /* no two parameters own one element */
        ids[q][lo + e] = (int64_t)(i * 65536 + po + e);
      }
      covered += len;
    }
    CHECK(covered == sp.numel);
  }
  size_t dummy;
  CHECK(ac_shard_param_shard(p, 0, world, &dummy, &dummy, &dummy) != AC_OK);
  CHECK(ac_shard_bucket(p, nb, &(ac_shard_bucket_t){0}) != AC_OK);
}

static int64_t **alloc_ids(size_t world, size_t shard) {
  int64_t **ids = calloc(world, sizeof *ids);
  CHECK(ids);
  for (size_t q = 0; q < world; q++) {
    ids[q] = malloc((shard ? shard : 1) * sizeof **ids);
    CHECK(ids[q]);
  }
  return ids;
}

static void free_ids(int64_t **ids, size_t world) {
  if (!ids) return;
  for (size_t q = 0; q < world; q++) free(ids[q]);
  free(ids);
}

static void check_reshard(const ac_shard_plan_t *oldp, int64_t **old_ids, const ac_shard_plan_t *newp,
                          int64_t **new_ids) {
  size_t ow = ac_shard_world(oldp), nw = ac_shard_world(newp);
  size_t osh = ac_shard_numel(oldp), nsh = ac_shard_numel(newp);
  int64_t *got = malloc((nsh ? nsh : 1) * sizeof *got);
  CHECK(got);
  for (size_t r = 0; r < nw; r++) {
    ac_shard_reshard_t *rs = NULL;
    CHECK(ac_shard_reshard_create(&rs, oldp, newp, r) == AC_OK);
    CHECK(ac_shard_reshard_old_world(rs) == ow);
    size_t n = ac_shard_reshard_count(rs);
    const ac_shard_run_t *runs = ac_shard_reshard_runs(rs);
    CHECK(n == 0 || runs);
    for (size_t i = 0; i < nsh; i++) got[i] = -1;
    size_t prev_end = 0;
    for (size_t k = 0; k < n; k++) {
      const ac_shard_run_t *u = &runs[k];
      CHECK(u->length > 0 && u->old_rank < ow);
      CHECK(u->new_offset >= prev_end && u->new_offset + u->length <= nsh);
      CHECK(u->old_offset + u->length <= osh);
      for (size_t e = 0; e < u->length; e++) got[u->new_offset + e] = old_ids[u->old_rank][u->old_offset + e];
      prev_end = u->new_offset + u->length;
    }
    for (size_t i = 0; i < nsh; i++) CHECK(got[i] == new_ids[r][i]);
    size_t total = 0;
    for (size_t q = 0; q < ow; q++) {
      const ac_shard_run_t *f;
      size_t c;
      CHECK(ac_shard_reshard_from(rs, q, &f, &c) == AC_OK);
      for (size_t k = 0; k < c; k++) {
        CHECK(f[k].old_rank == q);
        CHECK(k == 0 || f[k - 1].old_offset + f[k - 1].length <= f[k].old_offset);
        int match = 0; /* the same run is in the new-offset list */
        for (size_t m = 0; m < n && !match; m++) match = !memcmp(&runs[m], &f[k], sizeof f[k]);
        CHECK(match);
      }
      total += c;
    }
    CHECK(total == n);
    const ac_shard_run_t *f;
    size_t c;
    CHECK(ac_shard_reshard_from(rs, ow, &f, &c) != AC_OK);
    ac_shard_reshard_destroy(rs);
  }
  ac_shard_reshard_t *rs = NULL;
  CHECK(ac_shard_reshard_create(&rs, oldp, newp, nw) != AC_OK && rs == NULL);
  free(got);
}

static void small_mode(reader *r) {
  size_t nparams = (size_t)take(r, 1) % 25;
  size_t numel[24], order_a[24], order_b[24];
  for (size_t i = 0; i < nparams; i++) {
    uint64_t v = take(r, 2);
    numel[i] = (v & 0x8000) ? 0 : (size_t)(v % 300); /* zero-element parameters happen */
  }
  plan_args a = {.order = order_a}, b = {.order = order_b};
  small_args(r, &a, nparams);
  small_args(r, &b, nparams);
  ac_shard_plan_t *pa = NULL, *pb = NULL;
  CHECK(ac_shard_plan_create(&pa, nparams, numel, order_a, a.esize, a.world, a.align, a.first_cap, a.cap) == AC_OK);
  CHECK(ac_shard_plan_create(&pb, nparams, numel, order_b, b.esize, b.world, b.align, b.first_cap, b.cap) == AC_OK);
  int64_t **ia = alloc_ids(a.world, ac_shard_numel(pa)), **ib = alloc_ids(b.world, ac_shard_numel(pb));
  check_plan(pa, &a, numel, ia);
  check_plan(pb, &b, numel, ib);
  check_reshard(pa, ia, pb, ib);
  check_reshard(pb, ib, pa, ia);
  /* a different parameter list is refused: one more parameter, or one numel changed */
  if (nparams > 0) {
    size_t changed[24];
    memcpy(changed, numel, nparams * sizeof *numel);
    changed[take(r, 1) % nparams] += 1 + (size_t)take(r, 1);
    ac_shard_plan_t *pc = NULL;
    CHECK(ac_shard_plan_create(&pc, nparams, changed, order_b, b.esize, b.world, b.align, b.first_cap, b.cap) == AC_OK);
    ac_shard_reshard_t *rs = NULL;
    CHECK(ac_shard_reshard_create(&rs, pa, pc, 0) == AC_ERR_INVALID_ARG && rs == NULL);
    CHECK(ac_last_error() && ac_last_error()[0]);
    ac_shard_plan_destroy(pc);
  }
  free_ids(ia, a.world);
  free_ids(ib, b.world);
  ac_shard_plan_destroy(pa);
  ac_shard_plan_destroy(pb);
}

/* Raw values: only errors and small-enough plans are acceptable outcomes; a plan the core
 * accepts must keep total == world * shard_numel without wrapping, and its byte size must fit. */
static void raw_mode(reader *r) {
  size_t nparams = (size_t)take(r, 1) % 9;
  size_t numel[8], order[8];
  for (size_t i = 0; i < nparams; i++) numel[i] = (size_t)take(r, 8);
  int bad_order = take(r, 1) & 1;
  if (bad_order) {
    for (size_t i = 0; i < nparams; i++) order[i] = (size_t)take(r, 1) % (nparams + 2);
  } else {
    permute(r, order, nparams);
  }
  size_t esize = (size_t)take(r, 8), world = (size_t)take(r, 8), align = (size_t)take(r, 8);
  size_t fc = (size_t)take(r, 8), cap = (size_t)take(r, 8);
  ac_shard_plan_t *p = NULL;
  ac_result_t rc = ac_shard_plan_create(&p, nparams, numel, order, esize, world, align, fc, cap);
  if (rc != AC_OK) {
    CHECK(rc == AC_ERR_INVALID_ARG || rc == AC_ERR_NOMEM);
    CHECK(p == NULL && ac_last_error() && ac_last_error()[0]);
    return;
  }
  size_t total = ac_shard_total(p), shard = ac_shard_numel(p);
  CHECK(world && shard == total / world && total % world == 0);
  CHECK(total <= SIZE_MAX / esize);
  size_t sum = 0;
  for (size_t b = 0; b < ac_shard_nbuckets(p); b++) {
    ac_shard_bucket_t bk;
    CHECK(ac_shard_bucket(p, b, &bk) == AC_OK);
    CHECK(bk.chunk % align == 0 && bk.local_offset == sum);
    sum += bk.chunk;
  }
  CHECK(sum == shard);
  for (size_t i = 0; i < nparams; i++) {
    ac_shard_param_t sp;
    CHECK(ac_shard_param(p, i, &sp) == AC_OK);
    CHECK(sp.numel == numel[i] && sp.full_offset <= total && sp.numel <= total - sp.full_offset);
    size_t lo, po, len; /* a few ranks: the first, the last, one in between */
    size_t ranks[3] = {0, world - 1, (size_t)take(r, 8) % world};
    for (int k = 0; k < 3; k++) {
      CHECK(ac_shard_param_shard(p, i, ranks[k], &lo, &po, &len) == AC_OK);
      CHECK(po <= sp.numel && len <= sp.numel - po && lo <= shard && len <= shard - lo);
    }
  }
  /* resharding onto itself, new rank 0, when small enough to list the runs */
  if (total <= (1u << 20) && world <= 64) {
    ac_shard_reshard_t *rs = NULL;
    CHECK(ac_shard_reshard_create(&rs, p, p, 0) == AC_OK);
    size_t n = ac_shard_reshard_count(rs), covered = 0;
    const ac_shard_run_t *runs = ac_shard_reshard_runs(rs);
    for (size_t k = 0; k < n; k++) {
      CHECK(runs[k].old_rank == 0 && runs[k].old_offset == runs[k].new_offset); /* identity */
      covered += runs[k].length;
    }
    CHECK(covered <= shard);
    ac_shard_reshard_destroy(rs);
  }
  ac_shard_plan_destroy(p);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  reader r = {data, size, 1};
  if (data[0] & 1) raw_mode(&r);
  else small_mode(&r);
  return 0;
}

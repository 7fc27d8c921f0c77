/* shard.h — the shard plan: how one flat buffer (one unit, one dtype) is split between `world`
 * ranks so that every bucket's reduce-scatter and all-gather is one contiguous collective, and
 * how shards written under one plan are read back under another (another world size, order,
 * cap or alignment).
 *
 * Layout. Parameters are placed in `order` (a permutation: reverse registration order is about
 * backward's arrival order) and packed into buckets by torch DDP's rule, exactly as bucket.h
 * does it with the same arguments: a bucket closes once it holds at least its cap in bytes
 * (first_cap_bytes for bucket 0, cap_bytes after), counted on the parameters' own bytes, not
 * their padding; a parameter never straddles buckets; each starts at a multiple of `align`
 * elements. So an ac_bucket_plan created with the same (numel, order, esize, caps, align) puts
 * every parameter in the same bucket, and its readiness tracking (ac_bucket_mark_ready) says
 * when a bucket of this plan may be reduce-scattered. Each bucket is then padded to a multiple
 * of world x align elements, so it splits into `world` equal chunks c_b, each a multiple of align.
 * With world == 1 the full buffer is element for element bucket.h's layout.
 *
 * The full buffer is bucket-major: bucket b occupies [B_b, B_b + world*c_b) and rank r's chunk
 * of it is [B_b + r*c_b, B_b + (r+1)*c_b). Rank r's shard is one contiguous local tensor, the
 * concatenation of its chunks in bucket order: chunk b sits at local offset L_b = sum of c_b'
 * for b' < b. Every rank's shard has the same size (shard_numel = sum of c_b) and the same
 * L_b. Why bucket-major: a rank-major buffer (each rank's whole shard contiguous in the full
 * buffer) would make a bucket's pieces strided, and NCCL's and gloo's reduce_scatter_tensor /
 * all_gather_into_tensor take one contiguous input and one contiguous output; bucket-major
 * makes bucket b's collective exactly
 *     reduce_scatter_tensor(shard[L_b : L_b + c_b], full[B_b : B_b + world*c_b])
 *     all_gather_into_tensor(full[B_b : B_b + world*c_b], shard[L_b : L_b + c_b])
 * with no copy, while the shard stays one tensor an optimizer can own. A parameter lies in one
 * bucket, so the part of it one rank owns is one contiguous run (ac_shard_param_shard); it may
 * be empty, and a parameter may be split between several ranks.
 *
 * Padding (the gaps after parameters to reach `align`, and the tail of each bucket) belongs to
 * no parameter. Collectives move it like any other element: keep it finite (zero it once) in
 * every buffer the plan lays out, or a reduction over a shard (found_inf, a norm) sees it.
 *
 * A bucket whose parameters all have zero elements has c_b == 0 (only the last bucket can: a
 * bucket closes only once it holds bytes). A zero-element parameter takes no space; it still
 * belongs to a bucket.
 *
 * Resharding (ac_shard_reshard_*): given the plan a checkpoint was written under and the plan
 * of this run over the same parameter list (same nparams, same numel each), the runs that fill
 * one new rank's shard from the old ranks' shards. Runs are in elements; an old shard written
 * with esize e holds run (q, o, n, len) at bytes [o*e, (o+len)*e) of rank q's file. Plans may
 * differ in everything else, esize included (runs map elements, not bytes).
 *
 * Objects are owned by the caller (_create/_destroy); there are no globals. Nothing changes a
 * plan or a reshard after create, so queries may run on several threads at once; destroy must
 * not race with them. Not collective: every rank builds
 * the same plan from the same arguments, which the caller must make identical on all ranks. */
#ifndef AC_SHARD_H
#define AC_SHARD_H

#include "ac/ac.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ac_shard_plan ac_shard_plan_t;

/* Creates the plan of a flat buffer of `nparams` parameters of numel[i] elements of `esize`
 * bytes, placed in `order` (a permutation of 0..nparams-1), split between `world` ranks, each
 * parameter starting at a multiple of `align` elements. Errors (AC_ERR_INVALID_ARG) name the
 * bad argument: out, numel or order NULL, esize, world, align or a cap 0, order not a
 * permutation (naming the entry), a size that overflows (naming the parameter, or the total:
 * the buffer's bytes must fit in size_t so byte offsets never wrap). nparams == 0 is a valid
 * empty plan. *out is owned by the caller: ac_shard_plan_destroy. */
ac_result_t ac_shard_plan_create(ac_shard_plan_t **out, size_t nparams, const size_t *numel, const size_t *order,
                                 size_t esize, size_t world, size_t align, size_t first_cap_bytes,
                                 size_t cap_bytes);
void ac_shard_plan_destroy(ac_shard_plan_t *plan); /* NULL is a no-op */

/* The arguments the plan was made from (a checkpoint stores them to rebuild the plan it was
 * written under). 0 for a NULL plan. */
size_t ac_shard_nparams(const ac_shard_plan_t *plan);
size_t ac_shard_world(const ac_shard_plan_t *plan);
size_t ac_shard_esize(const ac_shard_plan_t *plan);
size_t ac_shard_align(const ac_shard_plan_t *plan);
size_t ac_shard_first_cap(const ac_shard_plan_t *plan);
size_t ac_shard_cap(const ac_shard_plan_t *plan);
/* The parameter at placement position k (order[k]). */
ac_result_t ac_shard_placed(const ac_shard_plan_t *plan, size_t k, size_t *param);

/* Elements of the full buffer, padding included (sum over buckets of world*c_b). */
size_t ac_shard_total(const ac_shard_plan_t *plan);
/* Elements of every rank's shard (sum of c_b): total == world * shard_numel. */
size_t ac_shard_numel(const ac_shard_plan_t *plan);
size_t ac_shard_nbuckets(const ac_shard_plan_t *plan);

typedef struct {
  size_t full_offset;  /* B_b: the bucket is full[B_b, B_b + world*chunk) */
  size_t chunk;        /* c_b: elements per rank, a multiple of align (0 only for an all-empty bucket) */
  size_t local_offset; /* L_b: every rank's chunk of the bucket is shard[L_b, L_b + chunk) */
  size_t first;        /* placement positions [first, first + count) are the bucket's parameters */
  size_t count;
} ac_shard_bucket_t;

typedef struct {
  size_t bucket;
  size_t full_offset; /* the parameter is full[full_offset, full_offset + numel) */
  size_t numel;
} ac_shard_param_t;

ac_result_t ac_shard_bucket(const ac_shard_plan_t *plan, size_t b, ac_shard_bucket_t *out);
ac_result_t ac_shard_param(const ac_shard_plan_t *plan, size_t param, ac_shard_param_t *out);
/* The part of parameter `param` that `rank` owns: its elements [*param_offset, *param_offset +
 * *length) are shard[*local_offset, *local_offset + *length) of that rank. *length is 0 (and
 * both offsets 0) when the rank owns none of it. */
ac_result_t ac_shard_param_shard(const ac_shard_plan_t *plan, size_t param, size_t rank, size_t *local_offset,
                                 size_t *param_offset, size_t *length);

/* One copy: new_shard[new_offset, new_offset + length) = old shard of old_rank [old_offset,
 * old_offset + length), in elements. */
typedef struct {
  size_t old_rank;
  size_t old_offset;
  size_t new_offset;
  size_t length;
} ac_shard_run_t;

typedef struct ac_shard_reshard ac_shard_reshard_t;

/* The runs that fill rank `new_rank`'s shard of `new_plan` from the shards written under
 * `old_plan`. Every non-padding element of the new shard is written by exactly one run and
 * padding by none (the caller zeroes it); runs that are contiguous both in the old shard and
 * in the new one are merged. Errors (AC_ERR_INVALID_ARG): a NULL argument, new_rank not below
 * the new world, plans over different parameter lists (naming the counts, or the first
 * parameter whose numel differs and both numels). *out is owned by the caller:
 * ac_shard_reshard_destroy. Neither plan is kept. */
ac_result_t ac_shard_reshard_create(ac_shard_reshard_t **out, const ac_shard_plan_t *old_plan,
                                    const ac_shard_plan_t *new_plan, size_t new_rank);
void ac_shard_reshard_destroy(ac_shard_reshard_t *rs); /* NULL is a no-op */

/* Every run, sorted by new_offset (the order to fill the new shard in). The pointer lives as
 * long as `rs`; NULL when there are none. */
size_t ac_shard_reshard_count(const ac_shard_reshard_t *rs);
const ac_shard_run_t *ac_shard_reshard_runs(const ac_shard_reshard_t *rs);
/* The same runs grouped by source: those reading old rank `old_rank`, sorted by old_offset
 * (the order to read that rank's file in; *count 0 when this new rank needs nothing of it).
 * old_rank must be below the old world. */
ac_result_t ac_shard_reshard_from(const ac_shard_reshard_t *rs, size_t old_rank, const ac_shard_run_t **runs,
                                  size_t *count);
/* The old plan's world (the ranks ac_shard_reshard_from takes). */
size_t ac_shard_reshard_old_world(const ac_shard_reshard_t *rs);

#ifdef __cplusplus
}
#endif
#endif

/* bucket.h — the reducer's bucket plan: which gradients share an all-reduce, where each one
 * lives in the flat buffer, and which buckets may be launched as gradients become ready.
 *
 * Buckets are contiguous ranges of one flat gradient buffer, filled in the order gradients are
 * expected to arrive (reverse registration order at first; after the first step the reducer
 * rebuilds the plan from ac_bucket_arrival_order and every rank adopts rank 0's). The first
 * bucket is capped small (1 MiB by default in the reducer) so communication starts early;
 * the others at bucket_cap_mb. Buckets are launched strictly in order on every rank, so all
 * ranks issue the same collectives in the same sequence. Not thread-safe: one plan is driven
 * by one thread (autograd's hooks run on the backward thread). Not collective. */
#ifndef AC_BUCKET_H
#define AC_BUCKET_H

#include "ac/ac.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ac_bucket_plan ac_bucket_plan_t;

/* Creates a plan for `nparams` gradients of numel[i] elements of `esize` bytes each, placed in
 * the order given by `order` (a permutation of 0..nparams-1). A bucket closes as soon as it
 * holds at least its cap (first_cap_bytes for bucket 0, cap_bytes after): torch DDP's rule, so
 * a bucket exceeds its cap by at most its last gradient. Each gradient starts at a multiple of
 * `align` elements (>= 1). Errors name the bad argument (order not a permutation, zero caps,
 * size overflow). *out is owned by the caller: ac_bucket_plan_destroy. */
ac_result_t ac_bucket_plan_create(ac_bucket_plan_t **out, size_t nparams, const size_t *numel, const size_t *order,
                                  size_t esize, size_t first_cap_bytes, size_t cap_bytes, size_t align);
void ac_bucket_plan_destroy(ac_bucket_plan_t *plan); /* NULL is a no-op */

size_t ac_bucket_count(const ac_bucket_plan_t *plan);
/* Number of gradients the plan was created for. */
size_t ac_bucket_nparams(const ac_bucket_plan_t *plan);
/* Total elements of the flat buffer the plan lays out (padding included). */
size_t ac_bucket_total(const ac_bucket_plan_t *plan);
/* Bucket b covers elements [*first, *first + *count) of the flat buffer. */
ac_result_t ac_bucket_range(const ac_bucket_plan_t *plan, size_t b, size_t *first, size_t *count);
/* Gradient `param` lives at element *offset, in bucket *bucket. */
ac_result_t ac_bucket_param(const ac_bucket_plan_t *plan, size_t param, size_t *offset, size_t *bucket);

/* Starts a new backward: no gradient ready, no bucket launched. */
void ac_bucket_reset(ac_bucket_plan_t *plan);
/* Marks gradient `param` ready. Buckets that can now be launched are [*from, *to) (empty when
 * *from == *to): a bucket is launchable once all its gradients are ready and every earlier
 * bucket has been launched. Marking a gradient twice in one backward is AC_ERR_STATE, naming
 * it (a second backward after buckets launched must not silently double-count). */
ac_result_t ac_bucket_mark_ready(ac_bucket_plan_t *plan, size_t param, size_t *from, size_t *to);
/* Whether gradient `param` was marked ready since the last reset (0 for an index out of range). */
int ac_bucket_is_ready(const ac_bucket_plan_t *plan, size_t param);
/* How many gradients have been marked ready since the last reset (0: the next mark is the
 * first of a backward). */
size_t ac_bucket_ready_count(const ac_bucket_plan_t *plan);
/* Writes up to `cap` indices of gradients not ready yet into out; returns how many there are
 * in all (for "parameter X got no gradient" errors and find_unused_parameters). */
size_t ac_bucket_pending(const ac_bucket_plan_t *plan, size_t *out, size_t cap);
/* The order in which gradients were marked ready in this backward (n must be nparams; fails
 * with AC_ERR_STATE if not all are ready). */
ac_result_t ac_bucket_arrival_order(const ac_bucket_plan_t *plan, size_t *out, size_t n);

#ifdef __cplusplus
}
#endif
#endif

/* shard.c — the shard plan (bucket-major full buffer, one contiguous shard per rank) and the
 * runs that reshard a checkpoint between two plans. The layout rules are in ac/shard.h. */
#include "ac/shard.h"

#include <stdlib.h>
#include <string.h>

struct ac_shard_plan {
  size_t nparams, esize, world, align, first_cap, cap;
  size_t nbuckets, total, shard_numel;
  size_t *numel;      /* [nparams] */
  size_t *order;      /* [nparams] placement position -> parameter */
  size_t *offset;     /* [nparams] element offset in the full buffer */
  size_t *bucket_of;  /* [nparams] */
  ac_shard_bucket_t *buckets; /* [nbuckets] */
};

struct ac_shard_reshard {
  size_t nruns, old_world;
  ac_shard_run_t *runs;    /* by new_offset */
  ac_shard_run_t *by_old;  /* by (old_rank, old_offset) */
  size_t *old_start;       /* [old_world + 1]: by_old[old_start[q], old_start[q+1]) read rank q */
};

void ac_shard_plan_destroy(ac_shard_plan_t *p) {
  if (!p) return;
  free(p->numel);
  free(p->order);
  free(p->offset);
  free(p->bucket_of);
  free(p->buckets);
  free(p);
}

/* x rounded up to a multiple of m (m > 0); 0 for x == 0, and 0 when the result overflows
 * (callers with x > 0 treat that 0 as overflow). */
static size_t round_up(size_t x, size_t m) {
  size_t q = x / m + (x % m != 0);
  return q > SIZE_MAX / m ? 0 : q * m;
}

ac_result_t ac_shard_plan_create(ac_shard_plan_t **out, size_t nparams, const size_t *numel, const size_t *order,
                                 size_t esize, size_t world, size_t align, size_t first_cap_bytes,
                                 size_t cap_bytes) {
  if (!out) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_shard_plan_create: out is NULL");
  *out = NULL;
  if (nparams > 0 && !numel) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_shard_plan_create: numel is NULL");
  if (nparams > 0 && !order) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_shard_plan_create: order is NULL");
  if (esize == 0) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_shard_plan_create: esize must be > 0");
  if (world == 0) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_shard_plan_create: world must be > 0");
  if (align == 0) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_shard_plan_create: align must be > 0");
  if (first_cap_bytes == 0) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_shard_plan_create: first_cap_bytes must be > 0");
  if (cap_bytes == 0) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_shard_plan_create: cap_bytes must be > 0");
  if (world > SIZE_MAX / align)
    return AC_FAIL(AC_ERR_INVALID_ARG, "ac_shard_plan_create: world x align overflows (world %zu, align %zu)", world,
                   align);
  size_t unit = world * align; /* every bucket is a multiple of this */
  ac_result_t r = AC_OK;
  ac_shard_plan_t *p = calloc(1, sizeof *p);
  if (!p) return AC_FAIL(AC_ERR_NOMEM, "no memory for a shard plan");
  size_t n = nparams ? nparams : 1;
  p->nparams = nparams;
  p->esize = esize;
  p->world = world;
  p->align = align;
  p->first_cap = first_cap_bytes;
  p->cap = cap_bytes;
  p->numel = calloc(n, sizeof *p->numel);
  p->order = calloc(n, sizeof *p->order);
  p->offset = calloc(n, sizeof *p->offset);
  p->bucket_of = calloc(n, sizeof *p->bucket_of);
  p->buckets = calloc(n, sizeof *p->buckets); /* at most one bucket per parameter */
  if (!p->numel || !p->order || !p->offset || !p->bucket_of || !p->buckets) {
    r = AC_FAIL(AC_ERR_NOMEM, "no memory for a shard plan of %zu parameters", nparams);
    goto fail;
  }
  /* order must be a permutation: bucket_of serves as the seen-set until the packing fills it */
  for (size_t k = 0; k < nparams; k++) {
    if (order[k] >= nparams || p->bucket_of[order[k]]) {
      r = AC_FAIL(AC_ERR_INVALID_ARG,
                  "ac_shard_plan_create: order is not a permutation of 0..%zu (order[%zu] is %zu%s)", nparams - 1, k,
                  order[k], order[k] >= nparams ? ", out of range" : ", repeated");
      goto fail;
    }
    p->bucket_of[order[k]] = 1;
  }
  if (nparams) {
    memcpy(p->numel, numel, nparams * sizeof *numel);
    memcpy(p->order, order, nparams * sizeof *order);
  }
  /* Pass 1: bucket.c's packing, offsets relative to the bucket's start. bytes_in counts the
   * parameters' own bytes (not padding), as bucket.c does, so both plans agree on membership. */
  size_t b = 0, used = 0, bytes_in = 0;
  for (size_t k = 0; k < nparams; k++) {
    size_t i = order[k];
    if (numel[i] > (SIZE_MAX - align) / esize) {
      r = AC_FAIL(AC_ERR_INVALID_ARG, "ac_shard_plan_create: parameter %zu has too many elements (%zu)", i, numel[i]);
      goto fail;
    }
    size_t padded = round_up(numel[i], align); /* cannot overflow: numel[i] <= SIZE_MAX - align */
    size_t cap = b == 0 ? first_cap_bytes : cap_bytes;
    /* torch DDP's rule: close once the bucket holds `cap` bytes, so a large weight shares its
     * bucket with the small parameters placed just before it */
    if (p->buckets[b].count > 0 && bytes_in >= cap) {
      p->buckets[b].chunk = used; /* the bucket's used elements, until pass 2 */
      b++;
      p->buckets[b].first = k;
      used = bytes_in = 0;
    }
    if (used > SIZE_MAX - padded) {
      r = AC_FAIL(AC_ERR_INVALID_ARG, "ac_shard_plan_create: total size overflows (at parameter %zu)", i);
      goto fail;
    }
    p->offset[i] = used;
    p->bucket_of[i] = b;
    p->buckets[b].count++;
    bytes_in += numel[i] * esize; /* wraps only if the buffer's bytes overflow, which pass 2 refuses */
    used += padded;
  }
  p->nbuckets = nparams ? b + 1 : 0;
  if (nparams) p->buckets[b].chunk = used;
  /* Pass 2: pad each bucket to world x align and place it; each rank's chunk follows the last. */
  size_t full = 0, local = 0;
  for (b = 0; b < p->nbuckets; b++) {
    ac_shard_bucket_t *bk = &p->buckets[b];
    size_t size = bk->chunk ? round_up(bk->chunk, unit) : 0;
    if ((bk->chunk && size == 0) || full > SIZE_MAX - size) {
      r = AC_FAIL(AC_ERR_INVALID_ARG, "ac_shard_plan_create: total size overflows (at bucket %zu)", b);
      goto fail;
    }
    bk->full_offset = full;
    bk->local_offset = local;
    bk->chunk = size / world;
    full += size;
    local += bk->chunk;
  }
  if (full > SIZE_MAX / esize) {
    r = AC_FAIL(AC_ERR_INVALID_ARG, "ac_shard_plan_create: the buffer's size in bytes overflows (%zu elements of %zu "
                "bytes)", full, esize);
    goto fail;
  }
  for (size_t i = 0; i < nparams; i++) p->offset[i] += p->buckets[p->bucket_of[i]].full_offset;
  p->total = full;
  p->shard_numel = local;
  *out = p;
  return AC_OK;
fail:
  ac_shard_plan_destroy(p);
  return r;
}

size_t ac_shard_nparams(const ac_shard_plan_t *p) { return p ? p->nparams : 0; }
size_t ac_shard_world(const ac_shard_plan_t *p) { return p ? p->world : 0; }
size_t ac_shard_esize(const ac_shard_plan_t *p) { return p ? p->esize : 0; }
size_t ac_shard_align(const ac_shard_plan_t *p) { return p ? p->align : 0; }
size_t ac_shard_first_cap(const ac_shard_plan_t *p) { return p ? p->first_cap : 0; }
size_t ac_shard_cap(const ac_shard_plan_t *p) { return p ? p->cap : 0; }
size_t ac_shard_total(const ac_shard_plan_t *p) { return p ? p->total : 0; }
size_t ac_shard_numel(const ac_shard_plan_t *p) { return p ? p->shard_numel : 0; }
size_t ac_shard_nbuckets(const ac_shard_plan_t *p) { return p ? p->nbuckets : 0; }

ac_result_t ac_shard_placed(const ac_shard_plan_t *p, size_t k, size_t *param) {
  if (!p || !param) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_shard_placed: NULL argument");
  if (k >= p->nparams)
    return AC_FAIL(AC_ERR_INVALID_ARG, "placement position %zu out of range (%zu parameters)", k, p->nparams);
  *param = p->order[k];
  return AC_OK;
}

ac_result_t ac_shard_bucket(const ac_shard_plan_t *p, size_t b, ac_shard_bucket_t *out) {
  if (!p || !out) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_shard_bucket: NULL argument");
  if (b >= p->nbuckets) return AC_FAIL(AC_ERR_INVALID_ARG, "bucket %zu out of range (%zu buckets)", b, p->nbuckets);
  *out = p->buckets[b];
  return AC_OK;
}

ac_result_t ac_shard_param(const ac_shard_plan_t *p, size_t param, ac_shard_param_t *out) {
  if (!p || !out) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_shard_param: NULL argument");
  if (param >= p->nparams)
    return AC_FAIL(AC_ERR_INVALID_ARG, "parameter %zu out of range (%zu parameters)", param, p->nparams);
  out->bucket = p->bucket_of[param];
  out->full_offset = p->offset[param];
  out->numel = p->numel[param];
  return AC_OK;
}

/* The intersection of parameter i with rank's chunk of its bucket (checked arguments). */
static void owned(const ac_shard_plan_t *p, size_t i, size_t rank, size_t *local, size_t *poff, size_t *len) {
  const ac_shard_bucket_t *bk = &p->buckets[p->bucket_of[i]];
  size_t lo = bk->full_offset + rank * bk->chunk, hi = lo + bk->chunk;
  size_t s = p->offset[i], e = s + p->numel[i];
  if (s < lo) s = lo;
  if (e > hi) e = hi;
  if (s >= e) {
    *local = *poff = *len = 0;
    return;
  }
  *local = bk->local_offset + (s - lo);
  *poff = s - p->offset[i];
  *len = e - s;
}

ac_result_t ac_shard_param_shard(const ac_shard_plan_t *p, size_t param, size_t rank, size_t *local_offset,
                                 size_t *param_offset, size_t *length) {
  if (!p || !local_offset || !param_offset || !length)
    return AC_FAIL(AC_ERR_INVALID_ARG, "ac_shard_param_shard: NULL argument");
  if (param >= p->nparams)
    return AC_FAIL(AC_ERR_INVALID_ARG, "parameter %zu out of range (%zu parameters)", param, p->nparams);
  if (rank >= p->world) return AC_FAIL(AC_ERR_INVALID_ARG, "rank %zu out of range (world %zu)", rank, p->world);
  owned(p, param, rank, local_offset, param_offset, length);
  return AC_OK;
}

/* ---- resharding ------------------------------------------------------------------------- */

void ac_shard_reshard_destroy(ac_shard_reshard_t *rs) {
  if (!rs) return;
  free(rs->runs);
  free(rs->by_old);
  free(rs->old_start);
  free(rs);
}

/* Appends a run, merged into the previous one when it continues it in both shards. */
static int push_run(ac_shard_reshard_t *rs, size_t *cap, size_t q, size_t oo, size_t no, size_t len) {
  if (rs->nruns) {
    ac_shard_run_t *last = &rs->runs[rs->nruns - 1];
    if (last->old_rank == q && last->old_offset + last->length == oo && last->new_offset + last->length == no) {
      last->length += len;
      return 0;
    }
  }
  if (rs->nruns == *cap) {
    size_t ncap = *cap ? *cap * 2 : 16;
    ac_shard_run_t *grown = ncap > SIZE_MAX / sizeof *grown ? NULL : realloc(rs->runs, ncap * sizeof *grown);
    if (!grown) return -1;
    rs->runs = grown;
    *cap = ncap;
  }
  rs->runs[rs->nruns++] = (ac_shard_run_t){q, oo, no, len};
  return 0;
}

static int by_old_offset(const void *a, const void *b) {
  const ac_shard_run_t *x = a, *y = b;
  return (x->old_offset > y->old_offset) - (x->old_offset < y->old_offset);
}

ac_result_t ac_shard_reshard_create(ac_shard_reshard_t **out, const ac_shard_plan_t *old_plan,
                                    const ac_shard_plan_t *new_plan, size_t new_rank) {
  if (!out) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_shard_reshard_create: out is NULL");
  *out = NULL;
  if (!old_plan) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_shard_reshard_create: old_plan is NULL");
  if (!new_plan) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_shard_reshard_create: new_plan is NULL");
  if (new_rank >= new_plan->world)
    return AC_FAIL(AC_ERR_INVALID_ARG, "ac_shard_reshard_create: new_rank %zu out of range (new world %zu)", new_rank,
                   new_plan->world);
  if (old_plan->nparams != new_plan->nparams)
    return AC_FAIL_HINT(AC_ERR_INVALID_ARG, "a checkpoint reloads into the same parameters, in the same groups",
                        "ac_shard_reshard_create: the old plan has %zu parameters, the new plan %zu", old_plan->nparams,
                        new_plan->nparams);
  for (size_t i = 0; i < new_plan->nparams; i++)
    if (old_plan->numel[i] != new_plan->numel[i])
      return AC_FAIL_HINT(AC_ERR_INVALID_ARG, "a checkpoint reloads into the same parameters, in the same order",
                          "ac_shard_reshard_create: parameter %zu has %zu elements in the old plan and %zu in the new",
                          i, old_plan->numel[i], new_plan->numel[i]);
  ac_result_t r = AC_OK;
  ac_shard_reshard_t *rs = calloc(1, sizeof *rs);
  if (!rs) return AC_FAIL(AC_ERR_NOMEM, "no memory for a reshard");
  rs->old_world = old_plan->world;
  size_t cap = 0;
  /* Walking the new plan's buckets, and each bucket's parameters, in placement order visits the
   * new shard in increasing offset: the runs come out sorted by new_offset, and merging with
   * the previous run is the only merge there can be. */
  for (size_t b = 0; b < new_plan->nbuckets; b++) {
    const ac_shard_bucket_t *nb = &new_plan->buckets[b];
    for (size_t k = nb->first; k < nb->first + nb->count; k++) {
      size_t i = new_plan->order[k], nloc, poff, len;
      owned(new_plan, i, new_rank, &nloc, &poff, &len);
      /* the owned run may cross old chunk boundaries: one piece per old rank it meets */
      const ac_shard_bucket_t *ob = &old_plan->buckets[old_plan->bucket_of[i]];
      size_t pos = old_plan->offset[i] + poff - ob->full_offset; /* within the old bucket */
      while (len > 0) {
        size_t q = pos / ob->chunk, within = pos - q * ob->chunk, take = ob->chunk - within;
        if (take > len) take = len;
        if (push_run(rs, &cap, q, ob->local_offset + within, nloc, take) < 0) {
          r = AC_FAIL(AC_ERR_NOMEM, "no memory for the reshard runs of new rank %zu", new_rank);
          goto fail;
        }
        pos += take;
        nloc += take;
        len -= take;
      }
    }
  }
  rs->old_start = calloc(rs->old_world + 1, sizeof *rs->old_start);
  rs->by_old = rs->nruns ? malloc(rs->nruns * sizeof *rs->by_old) : NULL;
  if (!rs->old_start || (rs->nruns && !rs->by_old)) {
    r = AC_FAIL(AC_ERR_NOMEM, "no memory for the reshard runs of new rank %zu", new_rank);
    goto fail;
  }
  /* counting sort by old rank, then each rank's runs by old offset (a file is read forwards) */
  for (size_t k = 0; k < rs->nruns; k++) rs->old_start[rs->runs[k].old_rank + 1]++;
  for (size_t q = 0; q < rs->old_world; q++) rs->old_start[q + 1] += rs->old_start[q];
  {
    size_t *fill = calloc(rs->old_world, sizeof *fill);
    if (!fill) {
      r = AC_FAIL(AC_ERR_NOMEM, "no memory for the reshard runs of new rank %zu", new_rank);
      goto fail;
    }
    for (size_t k = 0; k < rs->nruns; k++) {
      size_t q = rs->runs[k].old_rank;
      rs->by_old[rs->old_start[q] + fill[q]++] = rs->runs[k];
    }
    free(fill);
  }
  for (size_t q = 0; q < rs->old_world; q++) {
    size_t n = rs->old_start[q + 1] - rs->old_start[q];
    if (n > 1) qsort(rs->by_old + rs->old_start[q], n, sizeof *rs->by_old, by_old_offset);
  }
  *out = rs;
  return AC_OK;
fail:
  ac_shard_reshard_destroy(rs);
  return r;
}

size_t ac_shard_reshard_count(const ac_shard_reshard_t *rs) { return rs ? rs->nruns : 0; }
const ac_shard_run_t *ac_shard_reshard_runs(const ac_shard_reshard_t *rs) { return rs ? rs->runs : NULL; }
size_t ac_shard_reshard_old_world(const ac_shard_reshard_t *rs) { return rs ? rs->old_world : 0; }

ac_result_t ac_shard_reshard_from(const ac_shard_reshard_t *rs, size_t old_rank, const ac_shard_run_t **runs,
                                  size_t *count) {
  if (!rs || !runs || !count) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_shard_reshard_from: NULL argument");
  if (old_rank >= rs->old_world)
    return AC_FAIL(AC_ERR_INVALID_ARG, "old_rank %zu out of range (old world %zu)", old_rank, rs->old_world);
  *count = rs->old_start[old_rank + 1] - rs->old_start[old_rank];
  *runs = *count ? rs->by_old + rs->old_start[old_rank] : NULL;
  return AC_OK;
}

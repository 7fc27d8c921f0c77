/* bucket.c — bucket layout and in-order launch tracking for the gradient reducer. */
#include "ac/bucket.h"

#include <stdlib.h>
#include <string.h>

struct ac_bucket_plan {
  size_t nparams, nbuckets, total;
  size_t *offset;       /* [nparams] element offset of each gradient */
  size_t *bucket_of;    /* [nparams] */
  size_t *bstart, *bcount; /* [nbuckets] element range */
  size_t *bsize;        /* [nbuckets] gradients per bucket */
  size_t *bready;       /* [nbuckets] gradients ready this backward */
  unsigned char *ready; /* [nparams] */
  size_t *arrival;      /* [nparams] order of marking */
  size_t narrived;
  size_t launched;      /* buckets launched this backward: 0..nbuckets */
};

void ac_bucket_plan_destroy(ac_bucket_plan_t *p) {
  if (!p) return;
  free(p->offset);
  free(p->bucket_of);
  free(p->bstart);
  free(p->bcount);
  free(p->bsize);
  free(p->bready);
  free(p->ready);
  free(p->arrival);
  free(p);
}

ac_result_t ac_bucket_plan_create(ac_bucket_plan_t **out, size_t nparams, const size_t *numel, const size_t *order,
                                  size_t esize, size_t first_cap_bytes, size_t cap_bytes, size_t align) {
  if (!out) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_bucket_plan_create: out is NULL");
  *out = NULL;
  if (nparams > 0 && (!numel || !order))
    return AC_FAIL(AC_ERR_INVALID_ARG, "ac_bucket_plan_create: numel and order are required");
  if (esize == 0 || align == 0 || first_cap_bytes == 0 || cap_bytes == 0)
    return AC_FAIL(AC_ERR_INVALID_ARG, "ac_bucket_plan_create: esize, align and the caps must be > 0 "
                   "(esize %zu, align %zu, first cap %zu, cap %zu)", esize, align, first_cap_bytes, cap_bytes);
  ac_result_t r = AC_OK;
  ac_bucket_plan_t *p = calloc(1, sizeof *p);
  if (!p) return AC_FAIL(AC_ERR_NOMEM, "no memory for a bucket plan");
  size_t n = nparams ? nparams : 1;
  p->nparams = nparams;
  p->offset = calloc(n, sizeof *p->offset);
  p->bucket_of = calloc(n, sizeof *p->bucket_of);
  p->bstart = calloc(n, sizeof *p->bstart); /* at most one bucket per gradient */
  p->bcount = calloc(n, sizeof *p->bcount);
  p->bsize = calloc(n, sizeof *p->bsize);
  p->bready = calloc(n, sizeof *p->bready);
  p->ready = calloc(n, 1);
  p->arrival = calloc(n, sizeof *p->arrival);
  if (!p->offset || !p->bucket_of || !p->bstart || !p->bcount || !p->bsize || !p->bready || !p->ready ||
      !p->arrival) {
    r = AC_FAIL(AC_ERR_NOMEM, "no memory for a bucket plan of %zu gradients", nparams);
    goto fail;
  }
  /* order must be a permutation: use `ready` as the seen-set, cleared afterwards */
  for (size_t k = 0; k < nparams; k++) {
    if (order[k] >= nparams || p->ready[order[k]]) {
      r = AC_FAIL(AC_ERR_INVALID_ARG, "ac_bucket_plan_create: order is not a permutation of 0..%zu "
                  "(entry %zu is %zu)", nparams - 1, k, order[k]);
      goto fail;
    }
    p->ready[order[k]] = 1;
  }
  memset(p->ready, 0, n);
  size_t pos = 0, b = 0, bytes_in = 0;
  for (size_t k = 0; k < nparams; k++) {
    size_t i = order[k];
    if (numel[i] > (SIZE_MAX - align) / esize) {
      r = AC_FAIL(AC_ERR_INVALID_ARG, "ac_bucket_plan_create: gradient %zu has too many elements (%zu)", i, numel[i]);
      goto fail;
    }
    size_t padded = (numel[i] + align - 1) / align * align;
    size_t cap = b == 0 ? first_cap_bytes : cap_bytes;
    /* torch DDP's rule: a bucket closes as soon as it holds `cap` bytes or more, so a large
     * weight shares its bucket with the small gradients that arrive just before it (the
     * bias of the same layer) instead of leaving them a tiny all-reduce of their own */
    if (p->bsize[b] > 0 && bytes_in >= cap) {
      p->bcount[b] = pos - p->bstart[b];
      b++;
      p->bstart[b] = pos;
      bytes_in = 0;
    }
    if (pos > SIZE_MAX - padded) {
      r = AC_FAIL(AC_ERR_INVALID_ARG, "ac_bucket_plan_create: total size overflows");
      goto fail;
    }
    p->offset[i] = pos;
    p->bucket_of[i] = b;
    p->bsize[b]++;
    bytes_in += numel[i] * esize;
    pos += padded;
  }
  p->nbuckets = nparams ? b + 1 : 0;
  if (nparams) p->bcount[b] = pos - p->bstart[b];
  p->total = pos;
  *out = p;
  return AC_OK;
fail:
  ac_bucket_plan_destroy(p);
  return r;
}

size_t ac_bucket_count(const ac_bucket_plan_t *p) { return p ? p->nbuckets : 0; }
size_t ac_bucket_nparams(const ac_bucket_plan_t *p) { return p ? p->nparams : 0; }
size_t ac_bucket_total(const ac_bucket_plan_t *p) { return p ? p->total : 0; }

ac_result_t ac_bucket_range(const ac_bucket_plan_t *p, size_t b, size_t *first, size_t *count) {
  if (!p || !first || !count) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_bucket_range: NULL argument");
  if (b >= p->nbuckets) return AC_FAIL(AC_ERR_INVALID_ARG, "bucket %zu out of range (%zu buckets)", b, p->nbuckets);
  *first = p->bstart[b];
  *count = p->bcount[b];
  return AC_OK;
}

ac_result_t ac_bucket_param(const ac_bucket_plan_t *p, size_t param, size_t *offset, size_t *bucket) {
  if (!p || !offset || !bucket) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_bucket_param: NULL argument");
  if (param >= p->nparams)
    return AC_FAIL(AC_ERR_INVALID_ARG, "gradient %zu out of range (%zu gradients)", param, p->nparams);
  *offset = p->offset[param];
  *bucket = p->bucket_of[param];
  return AC_OK;
}

void ac_bucket_reset(ac_bucket_plan_t *p) {
  if (!p) return;
  if (p->nparams) memset(p->ready, 0, p->nparams);
  for (size_t b = 0; b < p->nbuckets; b++) p->bready[b] = 0;
  p->narrived = 0;
  p->launched = 0;
}

ac_result_t ac_bucket_mark_ready(ac_bucket_plan_t *p, size_t param, size_t *from, size_t *to) {
  if (!p || !from || !to) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_bucket_mark_ready: NULL argument");
  if (param >= p->nparams)
    return AC_FAIL(AC_ERR_INVALID_ARG, "gradient %zu out of range (%zu gradients)", param, p->nparams);
  if (p->ready[param])
    return AC_FAIL_HINT(AC_ERR_STATE, "call backward once per sync step, or accumulate under no_sync()",
                        "gradient %zu became ready twice in one backward", param);
  p->ready[param] = 1;
  p->arrival[p->narrived++] = param;
  p->bready[p->bucket_of[param]]++;
  *from = p->launched;
  while (p->launched < p->nbuckets && p->bready[p->launched] == p->bsize[p->launched]) p->launched++;
  *to = p->launched;
  return AC_OK;
}

size_t ac_bucket_ready_count(const ac_bucket_plan_t *p) { return p ? p->narrived : 0; }

int ac_bucket_is_ready(const ac_bucket_plan_t *p, size_t param) {
  return p && param < p->nparams && p->ready[param];
}

size_t ac_bucket_pending(const ac_bucket_plan_t *p, size_t *out, size_t cap) {
  if (!p) return 0;
  size_t count = 0;
  for (size_t i = 0; i < p->nparams; i++) {
    if (p->ready[i]) continue;
    if (out && count < cap) out[count] = i;
    count++;
  }
  return count;
}

ac_result_t ac_bucket_arrival_order(const ac_bucket_plan_t *p, size_t *out, size_t n) {
  if (!p || (!out && n)) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_bucket_arrival_order: NULL argument");
  if (n != p->nparams) return AC_FAIL(AC_ERR_INVALID_ARG, "n is %zu, the plan has %zu gradients", n, p->nparams);
  if (p->narrived != p->nparams)
    return AC_FAIL(AC_ERR_STATE, "only %zu of %zu gradients are ready", p->narrived, p->nparams);
  memcpy(out, p->arrival, n * sizeof *out);
  return AC_OK;
}

/* kernels.c — the public kernel entry points: argument checks, ISA dispatch, splitting a
 * buffer into fixed chunks run on the pool, and combining partial results in chunk order. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "ac/pool.h"
#include "kernels_impl.h"

/* Elements per task. Fixed (not derived from the thread count) so results do not depend on
 * how many threads ran; 64 Ki elements is 256 KiB of fp32, enough to amortise a task claim. */
#define AC_CHUNK ((size_t)1 << 16)
/* Partial results for up to this many chunks live on the stack (16 Mi elements). */
#define AC_STACK_PARTIALS 256

static _Atomic(const ac_kernel_table_t *) active_table;

static const ac_kernel_table_t *table_get(void) {
  const ac_kernel_table_t *t = atomic_load_explicit(&active_table, memory_order_acquire);
  if (t) return t;
  const char *env = getenv("AC_KERNELS_ISA");
  int force_scalar = env && strcmp(env, "scalar") == 0;
  t = (!force_scalar && ac_cpu_has_avx2()) ? ac_kernels_avx2_table() : NULL;
  if (!t) t = &ac_kernels_scalar;
  atomic_store_explicit(&active_table, t, memory_order_release);
  return t;
}

const char *ac_kernels_isa(void) { return table_get()->name; }

ac_result_t ac_kernels_set_isa(const char *name) {
  if (!name) return AC_FAIL(AC_ERR_INVALID_ARG, "ISA name is NULL");
  if (strcmp(name, "scalar") == 0) {
    atomic_store(&active_table, &ac_kernels_scalar);
    return AC_OK;
  }
  if (strcmp(name, "avx2") == 0) {
    if (!ac_cpu_has_avx2() || !ac_kernels_avx2_table())
      return AC_FAIL(AC_ERR_UNSUPPORTED, "this CPU or build has no AVX2+FMA+F16C kernels");
    atomic_store(&active_table, ac_kernels_avx2_table());
    return AC_OK;
  }
  return AC_FAIL_HINT(AC_ERR_INVALID_ARG, "use \"avx2\" or \"scalar\"", "unknown ISA '%s'", name);
}

static ac_result_t check_buf(ac_dtype_t dt, const void *p, size_t n, const char *what) {
  if (ac_dtype_size(dt) == 0) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: invalid dtype code %d", what, (int)dt);
  if (n > 0 && !p) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: NULL data for %zu elements", what, n);
  if (n > SIZE_MAX / 4) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: element count %zu too large", what, n);
  return AC_OK;
}

enum op { OP_STATS, OP_SUMSQ, OP_SCALE, OP_SCALE_STATS, OP_CAST, OP_COPY_IN };

typedef struct {
  enum op op;
  const ac_kernel_table_t *t;
  ac_dtype_t dt, dst_dt;
  void *data;
  const void *src;
  size_t n;
  float f;
  ac_stats_t *partial;
  size_t nchunks, nranges;
} job_t;

static void run_chunk(job_t *j, size_t task) {
  size_t lo = task * AC_CHUNK;
  size_t len = j->n - lo < AC_CHUNK ? j->n - lo : AC_CHUNK;
  size_t es = ac_dtype_size(j->dt);
  switch (j->op) {
    case OP_STATS: j->t->stats[j->dt]((const char *)j->src + lo * es, len, &j->partial[task]); break;
    case OP_SUMSQ: j->t->sumsq[j->dt]((const char *)j->src + lo * es, len, &j->partial[task]); break;
    case OP_SCALE: j->t->scale[j->dt]((char *)j->data + lo * es, len, j->f); break;
    case OP_SCALE_STATS:
      j->t->scale_stats[j->dt]((char *)j->data + lo * es, len, j->f, &j->partial[task]);
      break;
    case OP_CAST:
      j->t->cast[j->dt][j->dst_dt]((const char *)j->src + lo * es,
                                   (char *)j->data + lo * ac_dtype_size(j->dst_dt), len);
      break;
    case OP_COPY_IN: {
      char *d = (char *)j->data + lo * es;
      memcpy(d, (const char *)j->src + lo * es, len * es);
      if (j->f != 1.0f) j->t->scale[j->dt](d, len, j->f);
      /* the same chunks as ac_sumsq's, combined in the same order: the same bits */
      if (j->partial) j->t->sumsq[j->dt](d, len, &j->partial[task]);
      break;
    }
  }
}

/* Pool task: thread-sized contiguous runs of chunks (a streaming range per thread beats
 * handing chunks out one at a time); results still land per chunk, so they do not depend on
 * the thread count. */
static void run_range(void *ctx, size_t task) {
  job_t *j = ctx;
  size_t lo = task * j->nchunks / j->nranges, hi = (task + 1) * j->nchunks / j->nranges;
  if (j->op == OP_STATS || j->op == OP_SUMSQ) {
    /* Read-only passes run backwards: they start where the last writer (a copy, backward's
     * gradients in arrival order) ended, so that part is still in cache, and they leave the
     * start of each range in cache for the forward scaling pass that usually follows (clip).
     * Partials still land per chunk, so the result does not change. */
    for (size_t c = hi; c-- > lo;) run_chunk(j, c);
    return;
  }
  for (size_t c = lo; c < hi; c++) run_chunk(j, c);
}

/* Runs the job over all chunks; combines partial stats (if any) in chunk order into *out. */
static ac_result_t run_job(job_t *j, ac_stats_t *out) {
  size_t ntasks = (j->n + AC_CHUNK - 1) / AC_CHUNK;
  ac_stats_t stack_partials[AC_STACK_PARTIALS];
  ac_stats_t *heap = NULL;
  ac_result_t r = AC_OK;
  if (out) {
    if (ntasks > AC_STACK_PARTIALS) {
      heap = calloc(ntasks, sizeof *heap);
      if (!heap) return AC_FAIL(AC_ERR_NOMEM, "no memory for %zu partial results", ntasks);
      j->partial = heap;
    } else {
      j->partial = stack_partials;
    }
  }
  size_t threads = (size_t)ac_pool_get_threads();
  j->nchunks = ntasks;
  j->nranges = ntasks < threads ? ntasks : threads;
  if (j->nranges == 1) {
    run_range(j, 0);
  } else {
    AC_CHECK_GOTO(ac_pool_run(j->nranges, run_range, j), r, done);
  }
  if (out) {
    ac_stats_t acc = {0.0, 0.0f, 0};
    for (size_t k = 0; k < ntasks; k++) {
      acc.sumsq += j->partial[k].sumsq;
      if (j->partial[k].maxabs > acc.maxabs) acc.maxabs = j->partial[k].maxabs;
      acc.nonfinite |= j->partial[k].nonfinite;
    }
    *out = acc;
  }
done:
  free(heap);
  return r;
}

ac_result_t ac_stats(ac_dtype_t dt, const void *data, size_t n, ac_stats_t *out) {
  AC_CHECK(check_buf(dt, data, n, "ac_stats"));
  if (!out) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_stats: out is NULL");
  if (n == 0) {
    *out = (ac_stats_t){0.0, 0.0f, 0};
    return AC_OK;
  }
  job_t j = {.op = OP_STATS, .t = table_get(), .dt = dt, .src = data, .n = n};
  return run_job(&j, out);
}

ac_result_t ac_sumsq(ac_dtype_t dt, const void *data, size_t n, double *sumsq, int *nonfinite) {
  AC_CHECK(check_buf(dt, data, n, "ac_sumsq"));
  if (!sumsq || !nonfinite) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_sumsq: sumsq and nonfinite must not be NULL");
  ac_stats_t s = {0.0, 0.0f, 0};
  if (n > 0) {
    job_t j = {.op = OP_SUMSQ, .t = table_get(), .dt = dt, .src = data, .n = n};
    AC_CHECK(run_job(&j, &s));
  }
  *sumsq = s.sumsq;
  *nonfinite = s.nonfinite;
  return AC_OK;
}

ac_result_t ac_nonfinite(ac_dtype_t dt, const void *data, size_t n, int *found) {
  if (!found) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_nonfinite: found is NULL");
  double unused;
  return ac_sumsq(dt, data, n, &unused, found); /* the memory-bound pass; its flag is exact */
}

ac_result_t ac_scale(ac_dtype_t dt, void *data, size_t n, float factor) {
  AC_CHECK(check_buf(dt, data, n, "ac_scale"));
  if (n == 0) return AC_OK;
  job_t j = {.op = OP_SCALE, .t = table_get(), .dt = dt, .data = data, .n = n, .f = factor};
  return run_job(&j, NULL);
}

ac_result_t ac_scale_stats(ac_dtype_t dt, void *data, size_t n, float factor, ac_stats_t *out) {
  AC_CHECK(check_buf(dt, data, n, "ac_scale_stats"));
  if (!out) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_scale_stats: out is NULL");
  if (n == 0) {
    *out = (ac_stats_t){0.0, 0.0f, 0};
    return AC_OK;
  }
  job_t j = {.op = OP_SCALE_STATS, .t = table_get(), .dt = dt, .data = data, .n = n, .f = factor};
  return run_job(&j, out);
}

ac_result_t ac_copy_in(ac_dtype_t dt, const void *src, void *dst, size_t n, float factor, double *sumsq,
                       int *nonfinite) {
  AC_CHECK(check_buf(dt, src, n, "ac_copy_in (source)"));
  AC_CHECK(check_buf(dt, dst, n, "ac_copy_in (destination)"));
  if (!sumsq != !nonfinite)
    return AC_FAIL(AC_ERR_INVALID_ARG, "ac_copy_in: sumsq and nonfinite must both be NULL or both be given");
  const char *s = src, *d = dst;
  size_t nb = n * ac_dtype_size(dt);
  if (n > 0 && s < d + nb && d < s + nb) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_copy_in: source and destination overlap");
  ac_stats_t st = {0.0, 0.0f, 0};
  if (n > 0) {
    job_t j = {.op = OP_COPY_IN, .t = table_get(), .dt = dt, .src = src, .data = dst, .n = n, .f = factor};
    AC_CHECK(run_job(&j, sumsq ? &st : NULL));
  }
  if (sumsq) {
    *sumsq = st.sumsq;
    *nonfinite = st.nonfinite;
  }
  return AC_OK;
}

ac_result_t ac_cast(ac_dtype_t src_dt, const void *src, ac_dtype_t dst_dt, void *dst, size_t n) {
  AC_CHECK(check_buf(src_dt, src, n, "ac_cast (source)"));
  AC_CHECK(check_buf(dst_dt, dst, n, "ac_cast (destination)"));
  if (n == 0) return AC_OK;
  size_t sb = n * ac_dtype_size(src_dt), db = n * ac_dtype_size(dst_dt);
  const char *s = src;
  char *d = dst;
  if (src_dt == dst_dt) {
    if (s != d) memmove(d, s, sb);
    return AC_OK;
  }
  if (s < d + db && d < s + sb)
    return AC_FAIL(AC_ERR_INVALID_ARG, "ac_cast: source and destination overlap (%s -> %s)",
                   ac_dtype_name(src_dt), ac_dtype_name(dst_dt));
  job_t j = {.op = OP_CAST, .t = table_get(), .dt = src_dt, .dst_dt = dst_dt, .src = src,
             .data = dst, .n = n};
  return run_job(&j, NULL);
}

/* test_comm_shm.c — the shared-memory collectives (csrc/core/comm_shm.c) with threads standing in
 * for processes: each thread joins the group by name as one rank. Expected values are computed
 * here from every rank's inputs (each rank's data is a function of its rank and the index):
 * integer results exactly, fp32/fp64 sums against a double-precision sum, fp16/bf16 against the
 * fp32 sum in rank order rounded once. Small slots make every size cross many pieces. Run under
 * ASan/UBSan by tests/c/run.sh, and under ThreadSanitizer by the same script. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ac/comm_shm.h"
#include "ac/reducer.h"
#include "half.h"
#include "test_util.h"

#define SLOT 8192 /* bytes: a piece is at most 4 KiB, so most sizes below take many */

static int name_counter;

static void fresh_name(char *buf, size_t n) {
  snprintf(buf, n, "/ac_test_shm_%d_%d", (int)getpid(), __atomic_add_fetch(&name_counter, 1, __ATOMIC_SEQ_CST));
}

typedef struct job job_t;
typedef ac_result_t (*rank_fn)(ac_shm_t *c, job_t *j, int rank);

struct job {
  char name[64];
  int nranks;
  size_t slot;
  int timeout_ms;
  rank_fn fn;
  void *arg;
  ac_result_t result[8];
  char error[8][512];
};

typedef struct {
  job_t *j;
  int rank;
} rank_arg_t;

static void *rank_main(void *p) {
  rank_arg_t *a = p;
  job_t *j = a->j;
  ac_shm_t *c = NULL;
  ac_result_t r = ac_shm_create(&c, j->name, j->nranks, a->rank, j->slot, j->timeout_ms);
  if (r == AC_OK) r = j->fn(c, j, a->rank);
  j->result[a->rank] = r;
  snprintf(j->error[a->rank], sizeof j->error[a->rank], "%s", r == AC_OK ? "" : ac_last_error());
  ac_shm_destroy(c);
  return NULL;
}

/* Runs fn on nranks threads; returns how many ranks failed. */
static int run_job(job_t *j) {
  pthread_t th[8];
  rank_arg_t args[8];
  fresh_name(j->name, sizeof j->name);
  if (!j->slot) j->slot = SLOT;
  if (!j->timeout_ms) j->timeout_ms = 20000;
  for (int r = 0; r < j->nranks; r++) {
    args[r] = (rank_arg_t){j, r};
    pthread_create(&th[r], NULL, rank_main, &args[r]);
  }
  int failed = 0;
  for (int r = 0; r < j->nranks; r++) {
    pthread_join(th[r], NULL);
    if (j->result[r] != AC_OK) failed++;
  }
  return failed;
}

/* every rank's input: small integers (exact in every dtype and any order), or values of both signs */
static double value(int rank, size_t i, int integral) {
  if (integral) return (double)((int)((i * 7 + (size_t)rank * 13) % 17) - 8);
  return sin((double)i * 0.37 + rank) * (1.0 + (double)(i % 5)) * 1e-1;
}

static void fill(void *buf, ac_shm_dtype_t dt, size_t n, int rank, int integral) {
  for (size_t i = 0; i < n; i++) {
    double v = value(rank, i, integral);
    switch (dt) {
      case AC_SHM_F32: ((float *)buf)[i] = (float)v; break;
      case AC_SHM_F64: ((double *)buf)[i] = v; break;
      case AC_SHM_F16: ((uint16_t *)buf)[i] = ac_f32_to_f16((float)v); break;
      case AC_SHM_BF16: ((uint16_t *)buf)[i] = ac_f32_to_bf16((float)v); break;
      case AC_SHM_I32: ((int32_t *)buf)[i] = (int32_t)v; break;
      case AC_SHM_I64: ((int64_t *)buf)[i] = (int64_t)v * 1000000007LL; break;
    }
  }
}

static double get(const void *buf, ac_shm_dtype_t dt, size_t i) {
  switch (dt) {
    case AC_SHM_F32: return ((const float *)buf)[i];
    case AC_SHM_F64: return ((const double *)buf)[i];
    case AC_SHM_F16: return ac_f16_to_f32(((const uint16_t *)buf)[i]);
    case AC_SHM_BF16: return ac_bf16_to_f32(((const uint16_t *)buf)[i]);
    case AC_SHM_I32: return ((const int32_t *)buf)[i];
    case AC_SHM_I64: return (double)((const int64_t *)buf)[i];
  }
  return 0;
}

/* The expected reduction of element i over nranks inputs, as a double (16-bit: the fp32 sum in
 * rank order, rounded once). */
static double expected(ac_shm_dtype_t dt, ac_redop_t op, int nranks, size_t i, int integral) {
  double acc = 0;
  float accf = 0;
  for (int q = 0; q < nranks; q++) {
    double v = 0;
    /* value of rank q at index i in dt */
    switch (dt) {
      case AC_SHM_F32: v = (float)value(q, i, integral); break;
      case AC_SHM_F64: v = value(q, i, integral); break;
      case AC_SHM_F16: v = ac_f16_to_f32(ac_f32_to_f16((float)value(q, i, integral))); break;
      case AC_SHM_BF16: v = ac_bf16_to_f32(ac_f32_to_bf16((float)value(q, i, integral))); break;
      case AC_SHM_I32: v = (int32_t)value(q, i, integral); break;
      case AC_SHM_I64: v = (double)((int64_t)value(q, i, integral) * 1000000007LL); break;
    }
    if (op == AC_RED_MAX) acc = q == 0 || v > acc ? v : acc;
    else if (op == AC_RED_MIN) acc = q == 0 || v < acc ? v : acc;
    else {
      acc += v;
      accf = q == 0 ? (float)v : accf + (float)v;
    }
  }
  if (op == AC_RED_AVG) {
    acc /= nranks;
    accf /= (float)nranks;
  }
  if ((dt == AC_SHM_F16 || dt == AC_SHM_BF16) && (op == AC_RED_SUM || op == AC_RED_AVG))
    return dt == AC_SHM_F16 ? ac_f16_to_f32(ac_f32_to_f16(accf)) : ac_bf16_to_f32(ac_f32_to_bf16(accf));
  return acc;
}

typedef struct {
  ac_shm_dtype_t dt;
  ac_redop_t op;
  size_t count;
  int in_place;
  int integral;
  long bad[8]; /* mismatching elements per rank */
} reduce_case_t;

static ac_result_t all_reduce_rank(ac_shm_t *c, job_t *j, int rank) {
  reduce_case_t *k = j->arg;
  size_t es = ac_shm_dtype_size(k->dt);
  unsigned char *send = malloc(k->count * es + 1), *recv = k->in_place ? send : malloc(k->count * es + 1);
  fill(send, k->dt, k->count, rank, k->integral);
  ac_result_t r = ac_shm_all_reduce(c, send, recv, k->count, k->dt, k->op);
  long bad = 0;
  for (size_t i = 0; r == AC_OK && i < k->count; i++) {
    double want = expected(k->dt, k->op, j->nranks, i, k->integral), got = get(recv, k->dt, i);
    double tol = (k->dt == AC_SHM_F32 && !k->integral && (k->op == AC_RED_SUM || k->op == AC_RED_AVG))
                     ? 1e-6 * (1 + fabs(want)) : 0;
    if (fabs(got - want) > tol) bad++;
  }
  k->bad[rank] = bad;
  if (!k->in_place) free(recv);
  free(send);
  return r;
}

TEST(all_reduce_matches_the_reference) {
  static const ac_shm_dtype_t dts[] = {AC_SHM_F32, AC_SHM_F64, AC_SHM_F16, AC_SHM_BF16, AC_SHM_I32, AC_SHM_I64};
  static const ac_redop_t ops[] = {AC_RED_SUM, AC_RED_MAX, AC_RED_MIN, AC_RED_AVG};
  static const size_t counts[] = {0, 1, 17, 1000, 4099, 30001};
  for (int nr = 2; nr <= 4; nr++)
    for (size_t d = 0; d < 6; d++)
      for (size_t o = 0; o < 4; o++)
        for (size_t s = 0; s < 6; s++) {
          if (ops[o] == AC_RED_AVG && (dts[d] == AC_SHM_I32 || dts[d] == AC_SHM_I64)) continue;
          reduce_case_t k = {dts[d], ops[o], counts[s], (int)(s % 2), dts[d] >= AC_SHM_F16, {0}};
          job_t j = {.nranks = nr, .fn = all_reduce_rank, .arg = &k};
          int failed = run_job(&j);
          CHECK_MSG(failed == 0, "%d ranks, %s, op %d, %zu elements: %s", nr, dts[d] == AC_SHM_F32 ? "f32" : "other",
                    (int)ops[o], counts[s], j.error[0]);
          for (int r = 0; r < nr; r++)
            CHECK_MSG(k.bad[r] == 0, "%d ranks, dtype %d, op %d, %zu elements: rank %d has %ld wrong", nr, (int)dts[d],
                      (int)ops[o], counts[s], r, k.bad[r]);
        }
}

typedef struct {
  int nan_rank;
  int ok[8];
} nan_case_t;

static ac_result_t nan_rank_fn(ac_shm_t *c, job_t *j, int rank) {
  nan_case_t *k = j->arg;
  float v[40000];
  for (int i = 0; i < 40000; i++) v[i] = (rank == k->nan_rank && i % 3 == 0) ? NAN : (float)rank;
  ac_result_t r = ac_shm_all_reduce(c, v, v, 40000, AC_SHM_F32, AC_RED_MAX);
  int ok = 1;
  for (int i = 0; i < 40000; i++) ok &= (i % 3 == 0) ? isnan(v[i]) : v[i] == (float)(j->nranks - 1);
  float w[5] = {1, 2, 3, 4, 5};
  if (rank == k->nan_rank) w[2] = NAN;
  if (r == AC_OK) r = ac_shm_all_reduce(c, w, w, 5, AC_SHM_F32, AC_RED_MIN);
  ok &= isnan(w[2]) && w[0] == 1;
  k->ok[rank] = ok;
  return r;
}

TEST(max_and_min_keep_nan_from_any_rank) {
  for (int who = 0; who < 3; who++) {
    nan_case_t k = {who, {0}};
    job_t j = {.nranks = 3, .fn = nan_rank_fn, .arg = &k};
    CHECK_EQ_INT(run_job(&j), 0);
    for (int r = 0; r < 3; r++) CHECK_MSG(k.ok[r], "NaN on rank %d lost on rank %d", who, r);
  }
}

typedef struct {
  size_t count;
  int in_place;
  long bad[8];
} rs_case_t;

static ac_result_t reduce_scatter_rank(ac_shm_t *c, job_t *j, int rank) {
  rs_case_t *k = j->arg;
  int n = j->nranks;
  float *send = malloc(sizeof(float) * (k->count * n + 1)), *own = malloc(sizeof(float) * (k->count + 1));
  for (size_t i = 0; i < k->count * n; i++) send[i] = (float)value(rank, i, 1);
  float *recv = k->in_place ? send + (size_t)rank * k->count : own;
  ac_result_t r = ac_shm_reduce_scatter(c, send, recv, k->count, AC_SHM_F32, AC_RED_SUM);
  long bad = 0;
  for (size_t i = 0; r == AC_OK && i < k->count; i++) {
    double want = 0;
    for (int q = 0; q < n; q++) want += value(q, (size_t)rank * k->count + i, 1);
    bad += recv[i] != (float)want;
  }
  k->bad[rank] = bad;
  free(send);
  free(own);
  return r;
}

TEST(reduce_scatter_gives_each_rank_its_slice) {
  static const size_t counts[] = {0, 1, 5, 700, 3001};
  for (int nr = 2; nr <= 4; nr++)
    for (size_t s = 0; s < 5; s++)
      for (int ip = 0; ip < 2; ip++) {
        rs_case_t k = {counts[s], ip, {0}};
        job_t j = {.nranks = nr, .fn = reduce_scatter_rank, .arg = &k};
        CHECK_MSG(run_job(&j) == 0, "%d ranks, %zu: %s", nr, counts[s], j.error[0]);
        for (int r = 0; r < nr; r++) CHECK_MSG(k.bad[r] == 0, "%d ranks, count %zu, rank %d: %ld wrong", nr, counts[s], r, k.bad[r]);
      }
}

typedef struct {
  size_t counts[8];
  int in_place;
  long bad[8];
} ag_case_t;

static ac_result_t all_gather_rank(ac_shm_t *c, job_t *j, int rank) {
  ag_case_t *k = j->arg;
  int n = j->nranks;
  size_t total = 0, displ = 0;
  for (int q = 0; q < n; q++) {
    if (q < rank) displ += k->counts[q];
    total += k->counts[q];
  }
  int64_t *recv = malloc(sizeof(int64_t) * (total + 1)), *own = malloc(sizeof(int64_t) * (k->counts[rank] + 1));
  int64_t *send = k->in_place ? recv + displ : own;
  for (size_t i = 0; i < k->counts[rank]; i++) send[i] = (int64_t)rank * 1000000 + (int64_t)i;
  ac_result_t r = ac_shm_all_gather(c, send, recv, k->counts, AC_SHM_I64);
  long bad = 0;
  size_t at = 0;
  for (int q = 0; r == AC_OK && q < n; q++)
    for (size_t i = 0; i < k->counts[q]; i++) bad += recv[at++] != (int64_t)q * 1000000 + (int64_t)i;
  k->bad[rank] = bad;
  free(recv);
  free(own);
  return r;
}

TEST(all_gather_equal_and_unequal_sizes) {
  static const size_t sizes[][4] = {{0, 0, 0, 0}, {1, 1, 1, 1}, {700, 700, 700, 700}, {3, 0, 2000, 1},
                                    {1500, 1, 0, 999}};
  for (int nr = 2; nr <= 4; nr++)
    for (int s = 0; s < 5; s++)
      for (int ip = 0; ip < 2; ip++) {
        ag_case_t k = {{0}, ip, {0}};
        for (int q = 0; q < nr; q++) k.counts[q] = sizes[s][q];
        job_t j = {.nranks = nr, .fn = all_gather_rank, .arg = &k};
        CHECK_MSG(run_job(&j) == 0, "%d ranks, case %d: %s", nr, s, j.error[0]);
        for (int r = 0; r < nr; r++) CHECK_MSG(k.bad[r] == 0, "%d ranks, case %d, rank %d: %ld wrong", nr, s, r, k.bad[r]);
      }
}

typedef struct {
  size_t count;
  int root;
  long bad[8];
} bc_case_t;

static ac_result_t broadcast_rank(ac_shm_t *c, job_t *j, int rank) {
  bc_case_t *k = j->arg;
  uint16_t *buf = malloc(2 * (k->count + 1));
  for (size_t i = 0; i < k->count; i++) buf[i] = (uint16_t)(rank == k->root ? i * 3 + 1 : 0xffff);
  ac_result_t r = ac_shm_broadcast(c, buf, k->count, AC_SHM_BF16, k->root);
  long bad = 0;
  for (size_t i = 0; r == AC_OK && i < k->count; i++) bad += buf[i] != (uint16_t)(i * 3 + 1);
  k->bad[rank] = bad;
  free(buf);
  return r;
}

TEST(broadcast_from_every_root) {
  for (int nr = 2; nr <= 4; nr++)
    for (int root = 0; root < nr; root++)
      for (size_t count = 0; count < 20000; count = count * 7 + 3) {
        bc_case_t k = {count, root, {0}};
        job_t j = {.nranks = nr, .fn = broadcast_rank, .arg = &k};
        CHECK_MSG(run_job(&j) == 0, "%s", j.error[0]);
        for (int r = 0; r < nr; r++) CHECK_MSG(k.bad[r] == 0, "root %d, %zu elements, rank %d: %ld wrong", root, count, r, k.bad[r]);
      }
}

/* many collectives of mixed kinds back to back (the pieces' halves and the tags across calls) */
static ac_result_t mixed_rank(ac_shm_t *c, job_t *j, int rank) {
  long *bad = j->arg;
  for (int it = 0; it < 200; it++) {
    int32_t v[3] = {rank + it, 1, -rank};
    AC_CHECK(ac_shm_all_reduce(c, v, v, 3, AC_SHM_I32, AC_RED_SUM));
    int n = j->nranks;
    bad[rank] += v[0] != n * it + n * (n - 1) / 2 || v[1] != n || v[2] != -n * (n - 1) / 2;
    AC_CHECK(ac_shm_barrier(c));
    int64_t b = rank == it % n ? it : -1;
    AC_CHECK(ac_shm_broadcast(c, &b, 1, AC_SHM_I64, it % n));
    bad[rank] += b != it;
  }
  return AC_OK;
}

TEST(back_to_back_collectives_of_mixed_kinds) {
  long bad[8] = {0};
  job_t j = {.nranks = 4, .fn = mixed_rank, .arg = bad};
  CHECK_MSG(run_job(&j) == 0, "%s", j.error[0]);
  for (int r = 0; r < 4; r++) CHECK_EQ_INT(bad[r], 0);
}

/* rank 1 passes another count: every rank gets an error naming the mismatch, not a hang or garbage */
static ac_result_t mismatch_rank(ac_shm_t *c, job_t *j, int rank) {
  (void)j;
  float v[16] = {0};
  return ac_shm_all_reduce(c, v, v, rank == 1 ? 11 : 10, AC_SHM_F32, AC_RED_SUM);
}

TEST(mismatched_calls_fail_on_every_rank) {
  job_t j = {.nranks = 3, .fn = mismatch_rank};
  CHECK_EQ_INT(run_job(&j), 3);
  for (int r = 0; r < 3; r++) {
    CHECK_EQ_INT(j.result[r], AC_ERR_COMM);
    CHECK_MSG(strstr(j.error[r], "different") != NULL, "rank %d: %s", r, j.error[r]);
  }
}

/* rank 2 never calls the collective: the others time out naming it, and refuse more work */
static ac_result_t silent_rank(ac_shm_t *c, job_t *j, int rank) {
  (void)j;
  if (rank == 2) return AC_OK;
  float v[4] = {0};
  ac_result_t r = ac_shm_all_reduce(c, v, v, 4, AC_SHM_F32, AC_RED_SUM);
  if (r != AC_ERR_TIMEOUT) return r == AC_OK ? AC_ERR_INTERNAL : r;
  char(*first)[512] = j->arg;
  snprintf(first[rank], 512, "%s", ac_last_error());
  ac_result_t again = ac_shm_barrier(c);
  return again == AC_ERR_STATE ? AC_ERR_TIMEOUT : AC_ERR_INTERNAL;
}

TEST(a_silent_rank_is_named_after_the_timeout) {
  char first[8][512] = {{0}};
  job_t j = {.nranks = 3, .fn = silent_rank, .timeout_ms = 300, .arg = first};
  run_job(&j);
  CHECK_EQ_INT(j.result[2], AC_OK);
  for (int r = 0; r < 2; r++) {
    CHECK_EQ_INT(j.result[r], AC_ERR_TIMEOUT); /* and then AC_ERR_STATE for the next call */
    CHECK_MSG(strstr(first[r], "rank 2 did not arrive") != NULL, "rank %d: %s", r, first[r]);
    CHECK_MSG(strstr(first[r], "all_reduce") != NULL, "rank %d: %s", r, first[r]);
  }
}

static ac_result_t noop_rank(ac_shm_t *c, job_t *j, int rank) {
  (void)c;
  (void)rank;
  char path[128];
  snprintf(path, sizeof path, "/dev/shm%s", j->name);
  ((int *)j->arg)[rank] = access(path, F_OK) == 0; /* after create returned the name is gone */
  return AC_OK;
}

TEST(the_name_is_unlinked_once_every_rank_has_joined) {
  int left[4] = {1, 1, 1, 1};
  job_t j = {.nranks = 4, .fn = noop_rank, .arg = left};
  CHECK_EQ_INT(run_job(&j), 0);
  for (int r = 0; r < 4; r++) CHECK_EQ_INT(left[r], 0);
}

TEST(bad_arguments_are_refused_by_name) {
  ac_shm_t *c = NULL;
  CHECK_EQ_INT(ac_shm_create(&c, "no_slash", 2, 0, SLOT, 100), AC_ERR_INVALID_ARG);
  CHECK(strstr(ac_last_error(), "must start with '/'") != NULL);
  CHECK_EQ_INT(ac_shm_create(&c, "/bad name", 2, 0, SLOT, 100), AC_ERR_INVALID_ARG);
  CHECK_EQ_INT(ac_shm_create(&c, "/x", 2, 2, SLOT, 100), AC_ERR_INVALID_ARG);
  CHECK_EQ_INT(ac_shm_create(&c, "/x", 2, 0, 100, 100), AC_ERR_INVALID_ARG);
  CHECK_EQ_INT(ac_shm_create(&c, "/x", 0, 0, SLOT, 100), AC_ERR_INVALID_ARG);
  CHECK(c == NULL);
  /* a rank that joins alone times out naming the ranks that did not join; nothing is left behind */
  char name[64], path[96];
  fresh_name(name, sizeof name);
  CHECK_EQ_INT(ac_shm_create(&c, name, 3, 0, SLOT, 200), AC_ERR_TIMEOUT);
  CHECK(strstr(ac_last_error(), "rank(s) 1 2 did not join") != NULL);
  snprintf(path, sizeof path, "/dev/shm%s", name);
  CHECK(access(path, F_OK) != 0);
  /* one rank: every collective is a copy */
  fresh_name(name, sizeof name);
  CHECK_EQ_INT(ac_shm_create(&c, name, 1, 0, SLOT, 200), AC_OK);
  int32_t v[3] = {1, 2, 3}, w[3];
  CHECK_EQ_INT(ac_shm_all_reduce(c, v, w, 3, AC_SHM_I32, AC_RED_SUM), AC_OK);
  CHECK(w[0] == 1 && w[2] == 3);
  CHECK_EQ_INT(ac_shm_all_reduce(c, v, w, 3, AC_SHM_I32, AC_RED_AVG), AC_ERR_INVALID_ARG);
  CHECK(strstr(ac_last_error(), "integer average") != NULL);
  CHECK_EQ_INT(ac_shm_all_reduce(c, v, w, 3, AC_SHM_I32, AC_RED_PROD), AC_ERR_UNSUPPORTED);
  CHECK_EQ_INT(ac_shm_broadcast(c, v, 3, AC_SHM_I32, 1), AC_ERR_INVALID_ARG);
  ac_shm_destroy(c);
}

/* several all-reduces in flight on the progress thread, waited for in order and out of order */
static ac_result_t async_rank(ac_shm_t *c, job_t *j, int rank) {
  long *bad = j->arg;
  ac_shm_queue_t *q = NULL;
  AC_CHECK(ac_shm_queue_create(&q, c));
  enum { K = 6, N = 5000 };
  static _Thread_local float buf[K][N];
  ac_shm_req_t *req[K];
  ac_result_t r = AC_OK;
  for (int k = 0; k < K; k++) {
    for (int i = 0; i < N; i++) buf[k][i] = (float)(rank * 10 + k + i % 7);
    ac_shm_op_t op = {.kind = AC_SHM_OP_ALL_REDUCE, .send = buf[k], .recv = buf[k], .count = N, .dt = AC_SHM_F32,
                      .op = AC_RED_SUM};
    if (r == AC_OK) r = ac_shm_submit(q, &op, &req[k]);
    else req[k] = NULL;
  }
  for (int k = K - 1; k >= 0; k--) /* out of order: each still ran in submission order */
    if (req[k]) {
      ac_result_t rk = ac_shm_req_wait(req[k]);
      r = r == AC_OK ? rk : r;
    }
  int n = j->nranks;
  for (int k = 0; r == AC_OK && k < K; k++)
    for (int i = 0; i < N; i++) bad[rank] += buf[k][i] != (float)(10 * n * (n - 1) / 2 + n * (k + i % 7));
  /* blocking runs (inline when the queue is idle) interleaved with queued requests keep the order */
  for (int k = 0; r == AC_OK && k < K; k++) {
    for (int i = 0; i < N; i++) buf[k][i] = (float)(rank + k);
    ac_shm_op_t op = {.kind = AC_SHM_OP_ALL_REDUCE, .send = buf[k], .recv = buf[k], .count = N, .dt = AC_SHM_F32,
                      .op = AC_RED_SUM};
    if (k % 2) {
      r = ac_shm_run(q, &op);
    } else {
      ac_shm_req_t *one = NULL;
      r = ac_shm_submit(q, &op, &one);
      if (r == AC_OK && k % 4 == 0) r = ac_shm_req_wait(one);
      else ac_shm_req_release(one);
    }
  }
  ac_shm_op_t fence = {.kind = AC_SHM_OP_BARRIER};
  if (r == AC_OK) r = ac_shm_run(q, &fence);
  for (int k = 0; r == AC_OK && k < K; k++)
    for (int i = 0; i < N; i++) bad[rank] += buf[k][i] != (float)(n * (n - 1) / 2 + n * k);
  /* a blocking call after them, through the queue, then closing with a request whose peers never
   * come (only rank 0 submits it): it fails at once instead of waiting for the timeout */
  ac_shm_op_t bar = {.kind = AC_SHM_OP_BARRIER};
  ac_shm_req_t *b = NULL;
  if (r == AC_OK) r = ac_shm_submit(q, &bar, &b);
  if (r == AC_OK) r = ac_shm_req_wait(b);
  ac_shm_req_t *lonely = NULL;
  if (r == AC_OK && rank == 0) r = ac_shm_submit(q, &bar, &lonely);
  ac_shm_queue_destroy(q); /* destroys c too */
  if (lonely) {
    ac_result_t lr = ac_shm_req_wait(lonely);
    if (lr != AC_ERR_STATE) bad[rank] += 1000;
  }
  return r == AC_OK ? AC_OK : r;
}

static void *async_main(void *p) {
  rank_arg_t *a = p;
  job_t *j = a->j;
  ac_shm_t *c = NULL;
  ac_result_t r = ac_shm_create(&c, j->name, j->nranks, a->rank, j->slot, j->timeout_ms);
  if (r == AC_OK) r = async_rank(c, j, a->rank);
  else ac_shm_destroy(c);
  j->result[a->rank] = r;
  return NULL;
}

TEST(async_requests_run_in_order_and_close_fails_what_is_left) {
  long bad[8] = {0};
  job_t j = {.nranks = 3, .slot = SLOT, .timeout_ms = 20000, .arg = bad};
  fresh_name(j.name, sizeof j.name);
  pthread_t th[3];
  rank_arg_t args[3];
  for (int r = 0; r < 3; r++) {
    args[r] = (rank_arg_t){&j, r};
    pthread_create(&th[r], NULL, async_main, &args[r]);
  }
  for (int r = 0; r < 3; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < 3; r++) {
    CHECK_EQ_INT(j.result[r], AC_OK);
    CHECK_EQ_INT(bad[r], 0);
  }
}

/* ---- windows: a buffer in the shared segment, all-reduced in place with no copy ------------- */
typedef struct {
  reduce_case_t k;
  size_t offset;
  long outside[8]; /* elements outside [offset, offset + count) that changed */
} window_case_t;

static ac_result_t window_rank(ac_shm_t *c, job_t *j, int rank) {
  window_case_t *w = j->arg;
  reduce_case_t *k = &w->k;
  size_t es = ac_shm_dtype_size(k->dt), total = w->offset + k->count + 3;
  ac_shm_window_t *win = NULL;
  /* a first window the collective does not use: the second is found by its counter on every rank */
  ac_shm_window_t *spare = NULL;
  AC_CHECK(ac_shm_window_create(&spare, c, 100));
  ac_result_t r = ac_shm_window_create(&win, c, total * es);
  if (r != AC_OK) {
    ac_shm_window_destroy(spare);
    return r;
  }
  unsigned char *base = ac_shm_window_base(win);
  CHECK(((uintptr_t)base & 63) == 0);
  memset(base, 0x5a, total * es);
  fill(base + w->offset * es, k->dt, k->count, rank, k->integral);
  r = ac_shm_window_all_reduce(c, win, w->offset, k->count, k->dt, k->op);
  long bad = 0, outside = 0;
  for (size_t i = 0; r == AC_OK && i < k->count; i++) {
    double want = expected(k->dt, k->op, j->nranks, i, k->integral), got = get(base + w->offset * es, k->dt, i);
    double tol = (k->dt == AC_SHM_F32 && !k->integral && (k->op == AC_RED_SUM || k->op == AC_RED_AVG))
                     ? 1e-6 * (1 + fabs(want)) : 0;
    if (fabs(got - want) > tol) bad++;
  }
  for (size_t b = 0; b < total * es; b++)
    if ((b < w->offset * es || b >= (w->offset + k->count) * es) && base[b] != 0x5a) outside++;
  k->bad[rank] = bad;
  w->outside[rank] = outside;
  ac_shm_window_destroy(win);
  ac_shm_window_destroy(spare);
  return r;
}

TEST(window_all_reduce_matches_the_reference_in_every_region) {
  static const ac_shm_dtype_t dts[] = {AC_SHM_F32, AC_SHM_F64, AC_SHM_F16, AC_SHM_BF16, AC_SHM_I32, AC_SHM_I64};
  static const ac_redop_t ops[] = {AC_RED_SUM, AC_RED_MAX, AC_RED_AVG};
  static const size_t counts[] = {0, 1, 17, 4099, 300001}; /* the last crosses the reduce block per rank */
  for (int nr = 2; nr <= 4; nr++)
    for (size_t d = 0; d < 6; d++)
      for (size_t o = 0; o < 3; o++)
        for (size_t s = 0; s < 5; s++) {
          if (ops[o] == AC_RED_AVG && (dts[d] == AC_SHM_I32 || dts[d] == AC_SHM_I64)) continue;
          if (counts[s] > 100000 && (nr != 3 || o != 0)) continue; /* big: once per dtype */
          window_case_t w = {{dts[d], ops[o], counts[s], 1, dts[d] >= AC_SHM_F16, {0}}, s % 2 ? 5 : 0, {0}};
          job_t j = {.nranks = nr, .fn = window_rank, .arg = &w};
          int failed = run_job(&j);
          CHECK_MSG(failed == 0, "%d ranks, dtype %d, op %d, %zu elements: %s", nr, (int)dts[d], (int)ops[o], counts[s],
                    j.error[0]);
          for (int r = 0; r < nr; r++) {
            CHECK_MSG(w.k.bad[r] == 0, "%d ranks, dtype %d, op %d, %zu elements at %zu: rank %d has %ld wrong", nr,
                      (int)dts[d], (int)ops[o], counts[s], w.offset, r, w.k.bad[r]);
            CHECK_MSG(w.outside[r] == 0, "rank %d: %ld bytes outside the range changed", r, w.outside[r]);
          }
        }
}

/* An in-place all-gather in a window: each rank writes its chunk (a pattern of its rank and
 * the element's index) at its place; afterwards every region holds every chunk bit for bit,
 * and the bytes around the range are untouched. */
typedef struct {
  ac_shm_dtype_t dt;
  size_t chunk, offset;
  long bad[8], outside[8];
} window_gather_case_t;

static unsigned char gather_byte(int q, size_t b) { return (unsigned char)(q * 37 + b * 11 + 1); }

static ac_result_t window_gather_rank(ac_shm_t *c, job_t *j, int rank) {
  window_gather_case_t *w = j->arg;
  int n = j->nranks;
  size_t es = ac_shm_dtype_size(w->dt), span = w->chunk * es, total = (w->offset + w->chunk * (size_t)n + 3) * es;
  ac_shm_window_t *win = NULL;
  AC_CHECK(ac_shm_window_create(&win, c, total));
  unsigned char *base = ac_shm_window_base(win), *range = base + w->offset * es;
  memset(base, 0x5a, total);
  for (size_t b = 0; b < span; b++) range[(size_t)rank * span + b] = gather_byte(rank, b);
  ac_result_t r = ac_shm_window_all_gather(c, win, w->offset, w->chunk, w->dt);
  long bad = 0, outside = 0;
  for (int q = 0; r == AC_OK && q < n; q++)
    for (size_t b = 0; b < span; b++) bad += range[(size_t)q * span + b] != gather_byte(q, b);
  for (size_t b = 0; b < total; b++)
    if ((b < w->offset * es || b >= w->offset * es + span * (size_t)n) && base[b] != 0x5a) outside++;
  w->bad[rank] = bad;
  w->outside[rank] = outside;
  ac_shm_window_destroy(win);
  return r;
}

TEST(window_all_gather_puts_every_chunk_in_every_region) {
  static const ac_shm_dtype_t dts[] = {AC_SHM_F32, AC_SHM_BF16, AC_SHM_I64};
  static const size_t chunks[] = {0, 1, 17, 70001};
  for (int nr = 2; nr <= 4; nr++)
    for (size_t d = 0; d < 3; d++)
      for (size_t s = 0; s < 4; s++) {
        window_gather_case_t w = {dts[d], chunks[s], s % 2 ? 7 : 0, {0}, {0}};
        job_t j = {.nranks = nr, .fn = window_gather_rank, .arg = &w};
        int failed = run_job(&j);
        CHECK_MSG(failed == 0, "%d ranks, dtype %d, chunk %zu: %s", nr, (int)dts[d], chunks[s], j.error[0]);
        for (int r = 0; r < nr; r++) {
          CHECK_MSG(w.bad[r] == 0, "%d ranks, dtype %d, chunk %zu at %zu: rank %d has %ld wrong bytes", nr,
                    (int)dts[d], chunks[s], w.offset, r, w.bad[r]);
          CHECK_MSG(w.outside[r] == 0, "rank %d: %ld bytes outside the range changed", r, w.outside[r]);
        }
      }
}

/* A reduce-scatter whose input lies in a window: every rank's at one place (the window path:
 * each chunk reduced from every region where it is), rank 0's in private memory, or the ranks'
 * at different offsets; whatever the mix, every rank gets its chunk of the sum (integer-valued
 * fp32: exact), in place in its region or into a private result, and only the case where all
 * agree counts as a window collective (ac_shm_window_ops). */
typedef struct {
  int mode; /* 0: all in the window, 1: rank 0 private, 2: rank 1 at another offset */
  int in_place;
  size_t count;
  long bad[8];
  uint64_t window_ops[8];
} window_rs_case_t;

static float rs_value(int q, size_t i) { return (float)((q + 1) * 1000 + (long)(i % 997)); }

static ac_result_t window_rs_rank(ac_shm_t *c, job_t *j, int rank) {
  window_rs_case_t *k = j->arg;
  int n = j->nranks;
  size_t full = k->count * (size_t)n, offset = (k->mode == 2 && rank == 1) ? 64 : 32;
  ac_shm_window_t *win = NULL;
  AC_CHECK(ac_shm_window_create(&win, c, (full + 64 + 32) * sizeof(float)));
  float *base = ac_shm_window_base(win), *in = base + offset;
  float *priv = malloc((full + 1) * sizeof(float)), *out = malloc((k->count + 1) * sizeof(float));
  int private_input = k->mode == 1 && rank == 0;
  float *src = private_input ? priv : in;
  for (size_t i = 0; i < full; i++) src[i] = rs_value(rank, i);
  float *recv = k->in_place && !private_input ? in + (size_t)rank * k->count : out;
  uint64_t before = ac_shm_window_ops(c);
  ac_result_t r = private_input ? ac_shm_reduce_scatter(c, src, recv, k->count, AC_SHM_F32, AC_RED_SUM)
                                : ac_shm_window_reduce_scatter(c, win, offset, recv, k->count, AC_SHM_F32, AC_RED_SUM);
  long bad = 0;
  for (size_t i = 0; r == AC_OK && i < k->count; i++) {
    double want = 0;
    for (int q = 0; q < n; q++) want += rs_value(q, (size_t)rank * k->count + i);
    bad += recv[i] != (float)want;
  }
  k->bad[rank] = bad;
  k->window_ops[rank] = ac_shm_window_ops(c) - before;
  free(priv);
  free(out);
  ac_shm_window_destroy(win);
  return r;
}

TEST(window_reduce_scatter_agrees_inside_the_collective) {
  static const size_t counts[] = {0, 1, 333, 70001};
  for (int nr = 2; nr <= 4; nr++)
    for (int mode = 0; mode < 3; mode++)
      for (int in_place = 0; in_place < 2; in_place++)
        for (size_t s = 0; s < 4; s++) {
          window_rs_case_t k = {mode, in_place, counts[s], {0}, {0}};
          job_t j = {.nranks = nr, .fn = window_rs_rank, .arg = &k};
          int failed = run_job(&j);
          CHECK_MSG(failed == 0, "%d ranks, mode %d, %zu elements: %s", nr, mode, counts[s], j.error[0]);
          for (int r = 0; r < nr; r++) {
            CHECK_MSG(k.bad[r] == 0, "%d ranks, mode %d, in place %d, %zu elements: rank %d has %ld wrong", nr, mode,
                      in_place, counts[s], r, k.bad[r]);
            uint64_t want = mode == 0 && counts[s] > 0 ? 1 : 0;
            CHECK_MSG(k.window_ops[r] == want, "%d ranks, mode %d, %zu elements: rank %d counted %llu window ops, "
                      "expected %llu", nr, mode, counts[s], r, (unsigned long long)k.window_ops[r],
                      (unsigned long long)want);
          }
        }
}

static ac_result_t window_mismatch_rank(ac_shm_t *c, job_t *j, int rank) {
  ac_shm_window_t *win = NULL, *other = NULL;
  AC_CHECK(ac_shm_window_create(&win, c, 4096));
  if (j->arg) { /* rank 1 reduces another window at the same offset and count */
    ac_result_t r = ac_shm_window_create(&other, c, 4096);
    if (r == AC_OK) r = ac_shm_window_all_reduce(c, rank == 1 ? other : win, 0, 64, AC_SHM_F32, AC_RED_SUM);
    ac_shm_window_destroy(other);
    ac_shm_window_destroy(win);
    return r;
  }
  /* a range outside the window is refused before any rank waits (the group stays usable) */
  if (ac_shm_window_all_reduce(c, win, 1000, 64, AC_SHM_F32, AC_RED_SUM) != AC_ERR_INVALID_ARG) {
    ac_shm_window_destroy(win);
    return AC_FAIL(AC_ERR_STATE, "a range outside the window was accepted");
  }
  /* rank 1 names another range: every rank fails, naming the mismatch */
  ac_result_t r = ac_shm_window_all_reduce(c, win, rank == 1 ? 16 : 0, 64, AC_SHM_F32, AC_RED_SUM);
  ac_shm_window_destroy(win);
  return r;
}

TEST(window_mismatch_and_bad_ranges_are_refused) {
  job_t j = {.nranks = 3, .fn = window_mismatch_rank};
  CHECK_EQ_INT(run_job(&j), 3);
  for (int r = 0; r < 3; r++)
    CHECK_MSG(strstr(j.error[r], "different") != NULL, "rank %d: %s", r, j.error[r]);
  int another = 1;
  job_t j2 = {.nranks = 3, .fn = window_mismatch_rank, .arg = &another};
  CHECK_EQ_INT(run_job(&j2), 3);
  for (int r = 0; r < 3; r++)
    CHECK_MSG(strstr(j2.error[r], "different") != NULL, "another window, rank %d: %s", r, j2.error[r]);
  ac_shm_t *c = NULL;
  char name[64];
  fresh_name(name, sizeof name);
  CHECK_EQ_INT(ac_shm_create(&c, name, 1, 0, SLOT, 2000), AC_OK);
  ac_shm_window_t *w = NULL;
  CHECK_EQ_INT(ac_shm_window_create(&w, c, 0), AC_ERR_INVALID_ARG);
  CHECK_EQ_INT(ac_shm_window_create(&w, c, 256), AC_OK);
  CHECK_EQ_INT(ac_shm_window_all_reduce(c, w, 60, 5, AC_SHM_F32, AC_RED_SUM), AC_ERR_INVALID_ARG);
  CHECK(strstr(ac_last_error(), "outside the window") != NULL);
  CHECK_EQ_INT(ac_shm_window_all_gather(c, w, 0, 65, AC_SHM_F32), AC_ERR_INVALID_ARG);
  CHECK(strstr(ac_last_error(), "outside the window") != NULL);
  CHECK_EQ_INT(ac_shm_window_all_gather(c, w, 0, 1, (ac_shm_dtype_t)99), AC_ERR_INVALID_ARG);
  CHECK_EQ_INT(ac_shm_window_all_reduce(c, w, 60, 4, AC_SHM_F32, AC_RED_SUM), AC_OK);
  ac_shm_window_destroy(w);
  ac_shm_destroy(c);
}

/* A peer that writes garbage over the segment header (found by tests/c/fuzz_shm_header.c): the
 * slots were found through the header's data_offset, so a peer that changed it sent the next
 * collective's copies anywhere in the address space. The peer here is written by hand (its
 * offsets are the header layout of comm_shm.c: data_offset at byte 24, attached at 40, rank
 * lines of 64 bytes from byte 64 with the arrival count first and the pid at 16). */
static ac_result_t overwritten_rank(ac_shm_t *c, job_t *j, int rank) {
  (void)j;
  if (rank != 0) return AC_OK;
  float v[4] = {1, 2, 3, 4}, w[4];
  return ac_shm_all_reduce(c, v, w, 4, AC_SHM_F32, AC_RED_SUM);
}

static void *rank0_main(void *p) {
  rank_arg_t a = {p, 0};
  return rank_main(&a);
}

/* The segment rank 0 of job `name` creates, mapped as a hand-written peer sees it once rank 0
 * has sized it and written its magic; NULL if that does not happen within 5 s. */
static unsigned char *map_peer_segment(const char *name, size_t *bytes) {
  int fd = -1;
  struct stat st;
  for (int i = 0; i < 5000; i++) { /* rank 0 creates and sizes the segment */
    fd = shm_open(name, O_RDWR, 0600);
    if (fd >= 0 && fstat(fd, &st) == 0 && st.st_size > 4096) break;
    if (fd >= 0) close(fd);
    fd = -1;
    usleep(1000);
  }
  if (fd < 0) return NULL;
  unsigned char *seg = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (seg == MAP_FAILED) return NULL;
  while (__atomic_load_n((uint64_t *)seg, __ATOMIC_ACQUIRE) == 0) usleep(100); /* the magic */
  *bytes = (size_t)st.st_size;
  return seg;
}

TEST(a_peer_overwriting_the_header_gives_an_error_not_a_crash) {
  job_t j = {.nranks = 2, .slot = SLOT, .timeout_ms = 5000, .fn = overwritten_rank};
  fresh_name(j.name, sizeof j.name);
  pthread_t th;
  pthread_create(&th, NULL, rank0_main, &j);
  size_t seg_bytes = 0;
  unsigned char *seg = map_peer_segment(j.name, &seg_bytes);
  CHECK(seg != NULL);
  uint64_t far = (uint64_t)1 << 40;
  memcpy(seg + 24, &far, sizeof far);
  __atomic_store_n((uint64_t *)(seg + 64 + 64), UINT64_MAX >> 1, __ATOMIC_SEQ_CST); /* rank 1 always arrived */
  __atomic_store_n((int32_t *)(seg + 64 + 64 + 16), (int32_t)getpid(), __ATOMIC_SEQ_CST);
  __atomic_add_fetch((uint32_t *)(seg + 40), 1, __ATOMIC_SEQ_CST); /* joined */
  pthread_join(th, NULL);
  munmap(seg, seg_bytes);
  shm_unlink(j.name); /* the hand-written peer joined last: unlinking the name is its part */
  CHECK_EQ_INT(j.result[0], AC_ERR_COMM);
  CHECK(strstr(j.error[0], "segment header was overwritten") != NULL);
  CHECK(strstr(j.error[0], "data at 1099511627776") != NULL);
}

/* A rank that arrives at a collective and exits right after (its last one) is no error for the
 * peers still waiting in it: they check arrival before death. The peer is written by hand (the
 * header layout above): it arrives while rank 0 sleeps on the futex and then its pid is a reaped
 * child's, without a wake; rank 0's next check finds it arrived, not dead. */
static ac_result_t lone_barrier_rank(ac_shm_t *c, job_t *j, int rank) {
  (void)j;
  return rank == 0 ? ac_shm_barrier(c) : AC_OK;
}

TEST(a_peer_that_arrives_then_exits_completes_the_collective) {
  job_t j = {.nranks = 2, .slot = SLOT, .timeout_ms = 5000, .fn = lone_barrier_rank};
  fresh_name(j.name, sizeof j.name);
  pid_t gone = fork(); /* a pid that is certainly dead once reaped */
  if (gone == 0) _exit(0);
  CHECK(gone > 0);
  CHECK(waitpid(gone, NULL, 0) == gone);
  pthread_t th;
  pthread_create(&th, NULL, rank0_main, &j);
  size_t seg_bytes = 0;
  unsigned char *seg = map_peer_segment(j.name, &seg_bytes);
  CHECK(seg != NULL);
  __atomic_store_n((int32_t *)(seg + 64 + 64 + 16), (int32_t)getpid(), __ATOMIC_SEQ_CST);
  __atomic_add_fetch((uint32_t *)(seg + 40), 1, __ATOMIC_SEQ_CST); /* joined */
  usleep(5000); /* rank 0 is in the barrier, asleep on the futex (10 ms at a time) */
  __atomic_store_n((uint64_t *)(seg + 64 + 64), (uint64_t)1, __ATOMIC_SEQ_CST); /* arrives ... */
  __atomic_store_n((int32_t *)(seg + 64 + 64 + 16), (int32_t)gone, __ATOMIC_SEQ_CST); /* ... and is gone */
  pthread_join(th, NULL);
  munmap(seg, seg_bytes);
  shm_unlink(j.name); /* the hand-written peer joined last: unlinking the name is its part */
  CHECK_EQ_INT(j.result[0], AC_OK);
}

/* ---- the group behind the communicator interface (ac/comm.h, comm_shm_comm.c) -------------
 * The reducer's bucket launch (ac_comm_launch_buckets, the same function the NCCL path runs)
 * over a window, then the copy-path collectives through the interface, each against sums of
 * every rank's inputs computed here. */
typedef struct {
  long bad[8];
  int mismatch; /* the collective whose window path is shown to be taken: 0 all-reduce, 1 all-gather */
} iface_case_t;

static ac_result_t iface_rank(ac_shm_t *c, job_t *j, int rank) {
  iface_case_t *ic = j->arg;
  long *bad = ic->bad;
  int n = j->nranks;
  ac_shm_queue_t *q = NULL;
  ac_result_t r = ac_shm_queue_create(&q, c);
  if (r != AC_OK) {
    ac_shm_destroy(c);
    return r;
  }
  size_t numel[] = {10, 3000, 20, 517}, order[] = {3, 2, 1, 0}; /* buckets of >= 256 B, the first >= 128 B */
  ac_bucket_plan_t *plan = NULL;
  ac_shm_window_t *w = NULL;
  ac_comm_t *cm = NULL;
  r = ac_bucket_plan_create(&plan, 4, numel, order, 4, 128, 256, 32);
  size_t total = plan ? ac_bucket_total(plan) : 0;
  if (r == AC_OK) r = ac_shm_window_create(&w, ac_shm_queue_comm(q), total * sizeof(float));
  if (r == AC_OK) r = ac_shm_comm_create(&cm, q, w);
  if (r == AC_OK) {
    bad[rank] += strcmp(ac_comm_backend(cm), "shm") != 0 || ac_comm_stream_ordered(cm) != 0;
    bad[rank] += ac_comm_size(cm) != n || ac_comm_rank(cm) != rank;
    float *g = ac_shm_window_base(w); /* the gradients, where every rank's backward wrote them */
    for (size_t i = 0; i < total; i++) g[i] = (float)value(rank, i, 1);
    r = ac_comm_launch_buckets(cm, plan, g, AC_F32, 0, ac_bucket_count(plan), NULL, NULL, NULL);
    if (r == AC_OK) r = ac_comm_wait(cm);
    for (size_t i = 0; r == AC_OK && i < total; i++) bad[rank] += g[i] != (float)expected(AC_SHM_F32, AC_RED_SUM, n, i, 1);
  }
  enum { N = 2001, K = 7 };
  static _Thread_local float x[N], out[8 * K], rs_in[8 * K], rs_out[K], bc[N];
  if (r == AC_OK) { /* copy path: private buffers, an average, a gather, a reduce-scatter, a broadcast */
    for (int i = 0; i < N; i++) x[i] = (float)(rank * 4 + i % 5), bc[i] = (float)(rank * 1000 + i);
    for (int i = 0; i < n * K; i++) rs_in[i] = (float)(rank + i);
    r = ac_comm_all_reduce(cm, x, x, N, AC_F32, AC_RED_AVG, NULL);
    if (r == AC_OK) r = ac_comm_all_gather(cm, x, out, K, AC_F32, NULL); /* queued behind the average */
    if (r == AC_OK) r = ac_comm_reduce_scatter(cm, rs_in, rs_out, K, AC_F32, AC_RED_SUM, NULL);
    if (r == AC_OK) r = ac_comm_broadcast(cm, bc, N, AC_F32, n - 1, NULL);
    if (r == AC_OK) r = ac_comm_wait(cm);
    float mean_rank4 = 4.0f * (float)(n - 1) / 2.0f;
    for (int i = 0; r == AC_OK && i < N; i++) {
      bad[rank] += fabsf(x[i] - (mean_rank4 + (float)(i % 5))) > 1e-5f;
      bad[rank] += bc[i] != (float)((n - 1) * 1000 + i);
    }
    for (int q2 = 0; r == AC_OK && q2 < n; q2++)
      for (int i = 0; i < K; i++) bad[rank] += fabsf(out[q2 * K + i] - (mean_rank4 + (float)(i % 5))) > 1e-5f;
    for (int i = 0; r == AC_OK && i < K; i++) /* sum over ranks p of (p + rank*K + i) */
      bad[rank] += rs_out[i] != (float)(n * (n - 1) / 2 + n * (rank * K + i));
  }
  if (r == AC_OK) { /* the 16-bit types through the interface: sums of every rank's values rounded once */
    enum { H = 3001 };
    static _Thread_local uint16_t h16[H], hb16[H];
    for (int i = 0; i < H; i++) {
      h16[i] = ac_f32_to_f16((float)value(rank, (size_t)i, 0));
      hb16[i] = ac_f32_to_bf16((float)value(rank, (size_t)i, 0));
    }
    r = ac_comm_all_reduce(cm, h16, h16, H, AC_F16, AC_RED_SUM, NULL);
    if (r == AC_OK) r = ac_comm_all_reduce(cm, hb16, hb16, H, AC_BF16, AC_RED_AVG, NULL);
    if (r == AC_OK) r = ac_comm_wait(cm);
    for (int i = 0; r == AC_OK && i < H; i++) {
      bad[rank] += ac_f16_to_f32(h16[i]) != (float)expected(AC_SHM_F16, AC_RED_SUM, n, (size_t)i, 0);
      bad[rank] += ac_bf16_to_f32(hb16[i]) != (float)expected(AC_SHM_BF16, AC_RED_AVG, n, (size_t)i, 0);
    }
  }
  if (r == AC_OK) { /* a stream is refused before anything is queued; a product by the group's own
                     * check when it runs (comm_shm.c), reported by the wait, the group still usable */
    bad[rank] += ac_comm_all_reduce(cm, x, x, N, AC_F32, AC_RED_SUM, (void *)1) != AC_ERR_INVALID_ARG;
    bad[rank] += strstr(ac_last_error(), "no stream") == NULL;
    bad[rank] += ac_comm_all_reduce(cm, x, x, N, AC_F32, AC_RED_PROD, NULL) != AC_OK;
    bad[rank] += ac_comm_wait(cm) != AC_ERR_UNSUPPORTED;
    /* a buffer running past the end of this rank's window region (into a peer's), and a result
     * written out of place into the window: neither is taken to the copy path */
    float *g = ac_shm_window_base(w);
    bad[rank] += ac_comm_all_reduce(cm, g + total - 4, g + total - 4, 8, AC_F32, AC_RED_SUM, NULL) != AC_ERR_INVALID_ARG;
    bad[rank] += strstr(ac_last_error(), "wholly inside") == NULL;
    bad[rank] += ac_comm_all_reduce(cm, x, g, 8, AC_F32, AC_RED_SUM, NULL) != AC_ERR_INVALID_ARG;
    /* an all-gather into the window from a private buffer (out of place) is refused too */
    bad[rank] += ac_comm_all_gather(cm, x, g, 4, AC_F32, NULL) != AC_ERR_INVALID_ARG;
    bad[rank] += ac_comm_wait(cm) != AC_OK;
  }
  if (r == AC_OK) { /* an in-place all-gather in the window (ZeRO's parameter buffers): each rank's
                     * chunk at its place, every chunk in every region afterwards */
    float *g = ac_shm_window_base(w);
    size_t chunk = total / (size_t)n;
    for (size_t i = 0; i < chunk; i++) g[(size_t)rank * chunk + i] = (float)(rank * 100000 + (int)i);
    r = ac_comm_all_gather(cm, g + (size_t)rank * chunk, g, chunk, AC_F32, NULL);
    if (r == AC_OK) r = ac_comm_wait(cm);
    for (int q2 = 0; r == AC_OK && q2 < n; q2++)
      for (size_t i = 0; i < chunk; i++) bad[rank] += g[(size_t)q2 * chunk + i] != (float)(q2 * 100000 + (int)i);
  }
  if (r == AC_OK) { /* the window path is the one taken: rank 0 all-reduces (all-gathers) in its
                     * window, the others in private memory of the same size; a window collective
                     * meets a copy-path one, which every rank reports (the copy path alone would
                     * have succeeded); it breaks the group, so one collective per run */
    static _Thread_local float priv[4096];
    float *g = ac_shm_window_base(w), *buf = rank == 0 ? g : priv;
    size_t count = total < 4096 ? total : 4096, chunk = count / (size_t)n;
    ac_result_t m = ic->mismatch ? ac_comm_all_gather(cm, buf + (size_t)rank * chunk, buf, chunk, AC_F32, NULL)
                                 : ac_comm_all_reduce(cm, buf, buf, count, AC_F32, AC_RED_SUM, NULL);
    if (m == AC_OK) m = ac_comm_wait(cm);
    bad[rank] += m == AC_OK;
  }
  ac_comm_destroy(cm);
  ac_shm_window_destroy(w);
  ac_bucket_plan_destroy(plan);
  ac_shm_queue_destroy(q); /* destroys c too */
  return r;
}

static void *iface_main(void *p) {
  rank_arg_t *a = p;
  job_t *j = a->j;
  ac_shm_t *c = NULL;
  ac_result_t r = ac_shm_create(&c, j->name, j->nranks, a->rank, j->slot, j->timeout_ms);
  if (r == AC_OK) r = iface_rank(c, j, a->rank);
  j->result[a->rank] = r;
  snprintf(j->error[a->rank], sizeof j->error[a->rank], "%s", r == AC_OK ? "" : ac_last_error());
  return NULL;
}

TEST(the_comm_interface_launches_buckets_and_runs_every_collective) {
  for (int run = 0; run < 6; run++) {
    int nr = 2 + run / 2;
    iface_case_t ic = {{0}, run % 2};
    long *bad = ic.bad;
    job_t j = {.nranks = nr, .slot = SLOT, .timeout_ms = 20000, .arg = &ic};
    fresh_name(j.name, sizeof j.name);
    pthread_t th[4];
    rank_arg_t args[4];
    for (int r = 0; r < nr; r++) {
      args[r] = (rank_arg_t){&j, r};
      pthread_create(&th[r], NULL, iface_main, &args[r]);
    }
    for (int r = 0; r < nr; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < nr; r++) {
      CHECK_MSG(j.result[r] == AC_OK, "%d ranks, rank %d: %s", nr, r, j.error[r]);
      CHECK_MSG(bad[r] == 0, "%d ranks (window path shown by the %s), rank %d: %ld wrong", nr,
                ic.mismatch ? "all-gather" : "all-reduce", r, bad[r]);
    }
  }
}

static const tu_test_t tests[] = {
    TU_CASE(a_peer_that_arrives_then_exits_completes_the_collective),
    TU_CASE(the_comm_interface_launches_buckets_and_runs_every_collective),
    TU_CASE(window_all_reduce_matches_the_reference_in_every_region),
    TU_CASE(window_all_gather_puts_every_chunk_in_every_region),
    TU_CASE(window_reduce_scatter_agrees_inside_the_collective),
    TU_CASE(window_mismatch_and_bad_ranges_are_refused),
    TU_CASE(async_requests_run_in_order_and_close_fails_what_is_left),
    TU_CASE(all_reduce_matches_the_reference),
    TU_CASE(max_and_min_keep_nan_from_any_rank),
    TU_CASE(reduce_scatter_gives_each_rank_its_slice),
    TU_CASE(all_gather_equal_and_unequal_sizes),
    TU_CASE(broadcast_from_every_root),
    TU_CASE(back_to_back_collectives_of_mixed_kinds),
    TU_CASE(mismatched_calls_fail_on_every_rank),
    TU_CASE(a_silent_rank_is_named_after_the_timeout),
    TU_CASE(the_name_is_unlinked_once_every_rank_has_joined),
    TU_CASE(bad_arguments_are_refused_by_name),
    TU_CASE(a_peer_overwriting_the_header_gives_an_error_not_a_crash),
};
TU_MAIN(tests)

/* test_comm.c — the NCCL loader and communicator (csrc/core/comm_nccl.c), and the reducer's
 * bucket launch over it (csrc/core/reducer.c), against a missing library, a library without
 * NCCL's symbols, and tests/c/fake_nccl.c (one rank, host memory), whose path run.sh passes in
 * AC_FAKE_NCCL. Tests run in table order: the first good load wins for the process, so the
 * failing loads come first. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>

#include "ac/comm_nccl.h"
#include "ac/reducer.h"
#include "test_util.h"

static const char *fake_path(void) { return getenv("AC_FAKE_NCCL"); }

TEST(missing_library_is_a_clear_error) {
  CHECK_RC(ac_nccl_load("/nonexistent/libnccl.so.2"), AC_ERR_UNSUPPORTED);
  CHECK_CONTAINS(ac_last_error(), "NCCL could not be loaded from /nonexistent/libnccl.so.2");
  CHECK_CONTAINS(ac_last_error(), "nvidia-nccl");
  CHECK_STREQ(ac_nccl_source(), "");
}

TEST(library_without_nccl_symbols_is_a_clear_error) {
  CHECK_RC(ac_nccl_load("libm.so.6"), AC_ERR_UNSUPPORTED);
  CHECK_CONTAINS(ac_last_error(), "lacks the symbol ncclGetVersion");
  CHECK_STREQ(ac_nccl_source(), "");
}

TEST(fake_nccl_loads_and_reports) {
  const char *path = fake_path();
  CHECK_MSG(path != NULL, "AC_FAKE_NCCL is not set (run through tests/c/run.sh)");
  if (!path) return;
  CHECK_OK(ac_nccl_load(path));
  CHECK_STREQ(ac_nccl_source(), path);
  CHECK_OK(ac_nccl_load("/another/path.so")); /* the first load wins */
  int v = 0;
  CHECK_OK(ac_nccl_version(&v));
  CHECK_EQ_INT(v, 29999);
  unsigned char id[AC_NCCL_UNIQUE_ID_BYTES] = {0};
  CHECK_OK(ac_nccl_unique_id(id));
  CHECK_EQ_INT(id[0], 0x5a);
  CHECK_EQ_INT(id[AC_NCCL_UNIQUE_ID_BYTES - 1], 0x5a);
}

TEST(communicator_errors_carry_nccl_text) {
  unsigned char id[AC_NCCL_UNIQUE_ID_BYTES];
  CHECK_OK(ac_nccl_unique_id(id));
  ac_comm_t *c = (ac_comm_t *)1;
  CHECK_RC(ac_nccl_comm_create(&c, id, 2, 0), AC_ERR_INVALID_ARG); /* the fake takes one rank only */
  CHECK(c == NULL);
  CHECK_CONTAINS(ac_last_error(), "ncclCommInitRank failed: NCCL error 4 (invalid argument (fake))");
  CHECK_RC(ac_nccl_comm_create(&c, id, 2, 2), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "rank 2 of 2 ranks");
  CHECK_RC(ac_nccl_comm_create(NULL, id, 1, 0), AC_ERR_INVALID_ARG);
}

static int (*fake_calls)(void);
static void *(*fake_stream)(void);
static size_t (*fake_count)(void);
static int (*fake_other)(void);
static const void *(*fake_send)(void);

static int bind_fake(void) {
  void *h = dlopen(fake_path(), RTLD_NOW | RTLD_NOLOAD);
  if (!h) return 0;
  fake_calls = (int (*)(void))dlsym(h, "fake_nccl_all_reduce_calls");
  fake_stream = (void *(*)(void))dlsym(h, "fake_nccl_last_stream");
  fake_count = (size_t(*)(void))dlsym(h, "fake_nccl_last_count");
  fake_other = (int (*)(void))dlsym(h, "fake_nccl_other_calls");
  fake_send = (const void *(*)(void))dlsym(h, "fake_nccl_last_send");
  dlclose(h);
  return fake_calls && fake_stream && fake_count && fake_other && fake_send;
}

TEST(collectives_and_bucket_launch) {
  CHECK_MSG(bind_fake(), "the fake NCCL's test hooks are not reachable");
  if (!fake_calls) return;
  unsigned char id[AC_NCCL_UNIQUE_ID_BYTES];
  CHECK_OK(ac_nccl_unique_id(id));
  ac_comm_t *c = NULL;
  CHECK_OK(ac_nccl_comm_create(&c, id, 1, 0));
  if (!c) return;
  CHECK_EQ_INT(ac_comm_size(c), 1);
  CHECK_EQ_INT(ac_comm_rank(c), 0);
  CHECK_STREQ(ac_comm_backend(c), "nccl");
  CHECK_EQ_INT(ac_comm_stream_ordered(c), 1);
  CHECK_OK(ac_comm_wait(c)); /* stream-ordered: nothing for the host to wait for */
  CHECK_STREQ(ac_comm_backend(NULL), "");
  float src[5] = {1, 2, 3, 4, 5}, dst[5] = {0};
  void *stream = (void *)0x1234;
  int before = fake_calls();
  CHECK_OK(ac_comm_all_reduce(c, src, dst, 5, AC_F32, AC_RED_SUM, stream));
  CHECK_EQ_INT(fake_calls(), before + 1);
  CHECK(fake_stream() == stream);
  CHECK(dst[4] == 5.0f); /* one rank: the sum is the input */
  int others = fake_other();
  CHECK_OK(ac_comm_broadcast(c, dst, 5, AC_F32, 0, NULL));
  CHECK_RC(ac_comm_broadcast(c, dst, 5, AC_F32, 1, NULL), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "root 1 of 1 ranks");
  CHECK_EQ_INT(fake_other(), others + 1); /* the refused root reached no NCCL call */
  CHECK_OK(ac_comm_all_gather(c, src, dst, 5, AC_F32, NULL));
  CHECK_OK(ac_comm_reduce_scatter(c, src, dst, 5, AC_BF16, AC_RED_AVG, NULL));
  CHECK_EQ_INT(fake_other(), others + 3);
  CHECK_RC(ac_comm_all_reduce(c, src, dst, 5, (ac_dtype_t)7, AC_RED_SUM, NULL), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_comm_all_reduce(c, src, dst, 5, AC_F32, (ac_redop_t)9, NULL), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_comm_all_reduce(c, NULL, dst, 5, AC_F32, AC_RED_SUM, NULL), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_comm_all_reduce(NULL, src, dst, 5, AC_F32, AC_RED_SUM, NULL), AC_ERR_INVALID_ARG);

  /* the reducer's launch: one in-place all-reduce per bucket, over that bucket's range */
  size_t numel[] = {10, 300, 20}, order[] = {2, 1, 0}; /* 80 B >= 64: bucket 0; 1200 B >= 1024: bucket 1 */
  ac_bucket_plan_t *plan = NULL;
  CHECK_OK(ac_bucket_plan_create(&plan, 3, numel, order, 4, 64, 1024, 32));
  if (plan) {
    float *buf = calloc(ac_bucket_total(plan), sizeof(float));
    before = fake_calls();
    CHECK_OK(ac_comm_launch_buckets(c, plan, buf, AC_F32, 0, 3, NULL, stream, NULL));
    CHECK_EQ_INT(fake_calls(), before + 3);
    /* the last bucket is gradient 0 (10 elements, padded to 32), after gradient 2's 32 and
     * gradient 1's 320 (300 padded): elements [352, 384) of the buffer (numbers by hand) */
    CHECK_EQ_INT(fake_count(), 32);
    CHECK(fake_send() == (const void *)(buf + 352));
    CHECK_OK(ac_comm_launch_buckets(c, plan, buf, AC_F32, 1, 1, NULL, stream, NULL)); /* nothing */
    CHECK_EQ_INT(fake_calls(), before + 3);
    CHECK_RC(ac_comm_launch_buckets(c, plan, buf, AC_F32, 2, 4, NULL, stream, NULL), AC_ERR_INVALID_ARG);
    CHECK_CONTAINS(ac_last_error(), "buckets [2, 4) of 3");
    /* with an event, this CPU-only build cannot order streams: a clear error, nothing launched */
    CHECK_RC(ac_comm_launch_buckets(c, plan, buf, AC_F32, 0, 1, NULL, stream, (void *)1), AC_ERR_UNSUPPORTED);
    CHECK_EQ_INT(fake_calls(), before + 3);
    free(buf);
    ac_bucket_plan_destroy(plan);
  }
  ac_comm_destroy(c);
  ac_comm_destroy(NULL);
}

static const tu_test_t tests[] = {
    TU_CASE(missing_library_is_a_clear_error),
    TU_CASE(library_without_nccl_symbols_is_a_clear_error),
    TU_CASE(fake_nccl_loads_and_reports),
    TU_CASE(communicator_errors_carry_nccl_text),
    TU_CASE(collectives_and_bucket_launch),
};
TU_MAIN(tests)

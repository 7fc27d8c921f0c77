/* test_safetensors_publish.c — the atomic-write protocol of ac_st_save: refused arguments create
 * no file at all, and a write that fails half-way (buffered or O_DIRECT) leaves the previous
 * file byte-identical and no temporary file behind. */
#define _GNU_SOURCE /* mkdtemp, setrlimit under -std=c11 */
#include <signal.h>
#include <sys/resource.h>

#include "st_test_util.h"

TEST(save_argument_errors_create_nothing) {
  char path[512];
  path_of(path, sizeof path, "args.safetensors");
  static float x[4];
  int64_t s1[1] = {4}, sneg[1] = {-1};
  ac_st_tensor_t ok = {"x", AC_ST_F32, 1, s1, x, AC_ST_HOST, 0};
  struct {
    ac_st_tensor_t t[2];
    size_t n;
    ac_st_kv_t meta[2];
    size_t nmeta;
    const char *want;
  } cases[] = {
      {{ok, ok}, 2, {{0}}, 0, "tensor name 'x' is given twice"},
      {{{"__metadata__", AC_ST_F32, 1, s1, x, AC_ST_HOST, 0}}, 1, {{0}}, 0, "'__metadata__' is reserved"},
      {{{NULL, AC_ST_F32, 1, s1, x, AC_ST_HOST, 0}}, 1, {{0}}, 0, "has no name"},
      {{{"bad\xff", AC_ST_F32, 1, s1, x, AC_ST_HOST, 0}}, 1, {{0}}, 0, "not valid UTF-8"},
      {{{"x", (ac_st_dtype_t)99, 1, s1, x, AC_ST_HOST, 0}}, 1, {{0}}, 0, "invalid dtype code 99"},
      {{{"x", AC_ST_F32, 1, sneg, x, AC_ST_HOST, 0}}, 1, {{0}}, 0, "negative extent -1"},
      {{{"x", AC_ST_F32, -1, s1, x, AC_ST_HOST, 0}}, 1, {{0}}, 0, "has ndim -1"},
      {{{"x", AC_ST_F32, 1, NULL, x, AC_ST_HOST, 0}}, 1, {{0}}, 0, "NULL shape"},
      {{{"x", AC_ST_F32, 1, s1, NULL, AC_ST_HOST, 0}}, 1, {{0}}, 0, "NULL data"},
      {{ok}, 1, {{"k", "a"}, {"k", "b"}}, 2, "metadata key 'k' is given twice"},
      {{ok}, 1, {{"k", NULL}}, 1, "NULL key or value"},
      {{ok}, 1, {{"k", "\xc0"}}, 1, "not valid UTF-8"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    ac_result_t r = ac_st_save(path, cases[i].t, cases[i].n, cases[i].meta, cases[i].nmeta, 0);
    CHECK_MSG(r == AC_ERR_INVALID_ARG, "case %zu returned %s", i, ac_result_string(r));
    CHECK_MSG(strstr(ac_last_error(), cases[i].want) != NULL, "case %zu: \"%s\" lacks \"%s\"", i, ac_last_error(),
              cases[i].want);
    int temps;
    CHECK_EQ_INT(dir_count(&temps), 0);
  }
  CHECK_RC(ac_st_save("", &ok, 1, NULL, 0, 0), AC_ERR_INVALID_ARG);
  char dirpath[512];
  snprintf(dirpath, sizeof dirpath, "%s/", tmpdir());
  CHECK_RC(ac_st_save(dirpath, &ok, 1, NULL, 0, 0), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_st_save("/nonexistent_dir_ac/x.safetensors", &ok, 1, NULL, 0, 0), AC_ERR_IO);
  CHECK_CONTAINS(ac_last_error(), "cannot create the temporary file");
}

/* A write that fails half-way (the file-size limit hits in the data region) must leave the old
 * file byte-identical and no temporary file behind. */
TEST(failed_write_leaves_old_file_and_no_temp) {
  char path[512];
  path_of(path, sizeof path, "atomic.safetensors");
  static const char old[] = "the previous checkpoint";
  write_whole(path, old, sizeof old);
  size_t nb = (size_t)4 << 20;
  unsigned char *big = malloc(nb);
  memset(big, 0x5a, nb);
  int64_t shape[1] = {(int64_t)nb};
  ac_st_tensor_t t = {"big", AC_ST_U8, 1, shape, big, AC_ST_HOST, 0};
  /* both write paths: the buffered one, and O_DIRECT (also what "auto" picks for 4 MiB) */
  static const char *const modes[][2] = {{"0", "buffered"}, {"1", "direct"}, {"auto", "direct"}};
  int temps;
  for (int m = 0; m < 3; m++) {
    setenv("ACCELERATE_C_DIRECT_IO", modes[m][0], 1);
    struct rlimit saved, lim;
    getrlimit(RLIMIT_FSIZE, &saved);
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN); /* EFBIG instead of a signal */
    lim = saved;
    lim.rlim_cur = 1 << 20;
    int limited = setrlimit(RLIMIT_FSIZE, &lim) == 0;
    ac_result_t r = ac_st_save(path, &t, 1, NULL, 0, 4);
    setrlimit(RLIMIT_FSIZE, &saved);
    signal(SIGXFSZ, prev);
    unsetenv("ACCELERATE_C_DIRECT_IO");
    if (CHECK(limited)) {
      CHECK_RC(r, AC_ERR_IO);
      CHECK_CONTAINS(ac_last_error(), "writing tensor 'big'");
      CHECK_CONTAINS(ac_last_error(), "File too large");
      CHECK_CONTAINS(ac_last_error(), ".tmp");
      CHECK_STREQ(ac_st_last_write_mode(), modes[m][1]);
    }
    size_t len;
    unsigned char *now = read_whole(path, &len);
    CHECK_MSG(now && len == sizeof old && memcmp(now, old, len) == 0, "ACCELERATE_C_DIRECT_IO=%s", modes[m][0]);
    free(now);
    CHECK_EQ_INT(dir_count(&temps), 1);
    CHECK_EQ_INT(temps, 0);
  }
  /* and the same save without the limit replaces the file */
  CHECK_OK(ac_st_save(path, &t, 1, NULL, 0, 4));
  ac_st_reader_t *rd;
  if (CHECK_OK(ac_st_reader_create(&rd, path))) {
    CHECK_EQ_INT(ac_st_header_count(ac_st_reader_header(rd)), 1);
    ac_st_reader_destroy(rd);
  }
  CHECK_EQ_INT(dir_count(&temps), 1);
  free(big);
  clear_dir();
}

TEST(cleanup) { st_remove_tmpdir(); }

static const tu_test_t tests[] = {
    TU_CASE(save_argument_errors_create_nothing),
    TU_CASE(failed_write_leaves_old_file_and_no_temp),
    TU_CASE(cleanup),
};
TU_MAIN(tests)

/* test_safetensors_direct.c — the O_DIRECT writer (csrc/core/st_direct.c): byte-identical to the
 * buffered writer across chunk edges, dtypes, thread counts and header-only files; every value of
 * ACCELERATE_C_DIRECT_IO; and a file system that refuses O_DIRECT ("auto" falls back, "1" fails
 * naming the file, a short unaligned write is an error). */
#define _GNU_SOURCE /* mkdtemp under -std=c11 */
#include "st_direct.h" /* internal: the chunk-size and fault test hooks of the O_DIRECT path */
#include "st_test_util.h"

/* Writes the tensors once buffered (the reference) and once direct with `threads` workers, and
 * checks the direct file is byte-identical, the modes are reported, and no temp file is left.
 * Returns the file's length. */
static size_t check_direct_same(const char *label, const ac_st_tensor_t *t, size_t n, const ac_st_kv_t *meta,
                                size_t nmeta, int threads) {
  char ref[512], dio[512];
  path_of(ref, sizeof ref, "ref.safetensors");
  path_of(dio, sizeof dio, "direct.safetensors");
  setenv(DIO_ENV, "0", 1);
  CHECK_MSG(ac_st_save(ref, t, n, meta, nmeta, 1) == AC_OK, "%s: %s", label, ac_last_error());
  CHECK_STREQ(ac_st_last_write_mode(), "buffered");
  setenv(DIO_ENV, "1", 1);
  CHECK_MSG(ac_st_save(dio, t, n, meta, nmeta, threads) == AC_OK, "%s: %s", label, ac_last_error());
  CHECK_STREQ(ac_st_last_write_mode(), "direct");
  unsetenv(DIO_ENV);
  size_t la = 0, lb = 0;
  unsigned char *a = read_whole(ref, &la), *b = read_whole(dio, &lb);
  CHECK_MSG(a && b && la == lb, "%s: %zu bytes buffered, %zu direct", label, la, lb);
  if (a && b && la == lb) {
    size_t i = 0;
    while (i < la && a[i] == b[i]) i++;
    CHECK_MSG(i == la, "%s (threads %d): first difference at byte %zu of %zu", label, threads, i, la);
  }
  free(a);
  free(b);
  int temps;
  CHECK_EQ_INT(dir_count(&temps), 2);
  CHECK_EQ_INT(temps, 0);
  clear_dir();
  return la;
}

/* Checks the direct path on a file of exactly `target` bytes (one U8 tensor, its size found by
 * probing, since the header's length depends on the digits of the size). */
static void check_file_of_len(const char *label, size_t target, unsigned char *data, int threads) {
  size_t n = target > 128 ? target - 128 : 0;
  for (int it = 0; it < 8; it++) {
    size_t len = u8_file_len(data, n);
    if (len == target || len == 0) break;
    n = n + target - len;
  }
  if (!CHECK_MSG(u8_file_len(data, n) == target, "%s: no tensor size gives a %zu-byte file", label, target)) return;
  int64_t shape[1] = {(int64_t)n};
  ac_st_tensor_t t = {"x", AC_ST_U8, 1, shape, data, AC_ST_HOST, 0};
  CHECK_EQ_INT(check_direct_same(label, &t, 1, NULL, 0, threads), target);
}

TEST(direct_bytes_equal_buffered) {
  if (!CHECK(st_direct_set_chunk_bytes(SMALL_CHUNK) == 0)) return;
  CHECK(st_direct_set_chunk_bytes(1000) == -1); /* not a multiple of the alignment */
  CHECK_EQ_INT(st_direct_chunk_bytes(), SMALL_CHUNK);
  tu_rng_t rng = {0xd1ec7ULL};
  size_t cap = 8 * SMALL_CHUNK;
  unsigned char *data = malloc(cap);
  for (size_t i = 0; i < cap; i++) data[i] = (unsigned char)tu_rand32(&rng);

  /* header-only files */
  CHECK_EQ_INT(check_direct_same("no tensors", NULL, 0, NULL, 0, 0), 16);
  ac_st_kv_t meta[] = {{"format", "pt"}, {"note", "x"}};
  check_direct_same("metadata only", NULL, 0, meta, 2, 3);

  /* exactly one chunk, one chunk + 1 byte, aligned sizes that are not chunk multiples,
   * unaligned ones, and chunk multiples */
  const size_t sizes[] = {SMALL_CHUNK, SMALL_CHUNK + 1, SMALL_CHUNK - 1, 4096, 4097, 2 * 4096, SMALL_CHUNK + 4096,
                          2 * SMALL_CHUNK, 3 * SMALL_CHUNK + 777, 7 * SMALL_CHUNK + 4095};
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    char label[64];
    snprintf(label, sizeof label, "a %zu-byte file", sizes[i]);
    for (int threads = 1; threads <= 4; threads += 3) check_file_of_len(label, sizes[i], data, threads);
  }

  /* tensors of several dtypes straddling chunk boundaries, zero-size ones, a scalar */
  {
    int64_t s_f64[1] = {3001}, s_bf16[2] = {7, 111}, s_i8[1] = {13}, s_empty[2] = {0, 5}, s_u16[1] = {6000};
    static int64_t scalar = 0x0102030405060708LL;
    ac_st_tensor_t t[] = {
        {"w.f64", AC_ST_F64, 1, s_f64, data, AC_ST_HOST, 0}, /* 24008 bytes: crosses two boundaries */
        {"w.bf16", AC_ST_BF16, 2, s_bf16, data + 1, AC_ST_HOST, 0},
        {"w.i8", AC_ST_I8, 1, s_i8, data + 2, AC_ST_HOST, 0},
        {"empty.a", AC_ST_F32, 2, s_empty, NULL, AC_ST_HOST, 0},
        {"empty.b", AC_ST_U8, 2, s_empty, NULL, AC_ST_HOST, 0},
        {"step", AC_ST_I64, 0, NULL, &scalar, AC_ST_HOST, 0},
        {"w.u16", AC_ST_U16, 1, s_u16, data + 3, AC_ST_HOST, 0},
    };
    for (int threads = 0; threads <= 16; threads = threads ? threads * 4 : 1)
      check_direct_same("straddling tensors", t, sizeof t / sizeof t[0], meta, 1, threads);
  }

  /* many tiny tensors (1-7 bytes, every tenth empty): the header alone spans several chunks */
  {
    enum { N = 600 };
    ac_st_tensor_t *t = calloc(N, sizeof *t);
    int64_t *shapes = calloc(N, sizeof *shapes);
    char (*names)[40] = calloc(N, sizeof *names);
    size_t off = 0;
    for (int i = 0; i < N; i++) {
      shapes[i] = i % 10 == 0 ? 0 : 1 + i % 7;
      snprintf(names[i], sizeof names[i], "model.layers.%03d.tiny_parameter", i);
      t[i] = (ac_st_tensor_t){names[i], AC_ST_U8, 1, &shapes[i], shapes[i] ? data + off : NULL, AC_ST_HOST, 0};
      off += (size_t)shapes[i];
    }
    for (int threads = 1; threads <= 3; threads += 2) {
      size_t len = check_direct_same("600 tiny tensors", t, N, NULL, 0, threads);
      CHECK(len > 2 * SMALL_CHUNK);
    }
    free(t);
    free(shapes);
    free(names);
  }
  free(data);
  CHECK(st_direct_set_chunk_bytes(0) == 0);
  CHECK_EQ_INT(st_direct_chunk_bytes(), ST_DIRECT_CHUNK);
}

TEST(direct_io_env_values) {
  char path[512];
  path_of(path, sizeof path, "env.safetensors");
  static unsigned char small[1000];
  size_t nbig = (size_t)4 << 20; /* with the header: just above the 4 MiB "auto" threshold */
  unsigned char *big = calloc(nbig, 1);
  int64_t s_small[1] = {sizeof small}, s_big[1] = {(int64_t)nbig};
  ac_st_tensor_t ts = {"s", AC_ST_U8, 1, s_small, small, AC_ST_HOST, 0};
  ac_st_tensor_t tb = {"b", AC_ST_U8, 1, s_big, big, AC_ST_HOST, 0};
  struct {
    const char *value; /* NULL = unset */
    const ac_st_tensor_t *t;
    const char *mode;
  } ok[] = {
      {NULL, &ts, "buffered"},   {NULL, &tb, "direct"},  {"", &ts, "buffered"},   {"", &tb, "direct"},
      {"auto", &ts, "buffered"}, {"auto", &tb, "direct"}, {"0", &ts, "buffered"}, {"0", &tb, "buffered"},
      {"1", &ts, "direct"},      {"1", &tb, "direct"},
  };
  for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
    if (ok[i].value) setenv(DIO_ENV, ok[i].value, 1);
    else unsetenv(DIO_ENV);
    CHECK_MSG(ac_st_save(path, ok[i].t, 1, NULL, 0, 0) == AC_OK, "case %zu: %s", i, ac_last_error());
    CHECK_MSG(strcmp(ac_st_last_write_mode(), ok[i].mode) == 0, "case %zu (%s='%s', %s tensor): %s, expected %s", i,
              DIO_ENV, ok[i].value ? ok[i].value : "(unset)", ok[i].t == &tb ? "big" : "small",
              ac_st_last_write_mode(), ok[i].mode);
  }
  const char *bad[] = {"yes", "2", " 1", "AUTO", "direct", "true"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    setenv(DIO_ENV, bad[i], 1);
    char want[64];
    snprintf(want, sizeof want, "'%s'", bad[i]);
    CHECK_RC(ac_st_save(path, &ts, 1, NULL, 0, 0), AC_ERR_INVALID_ARG);
    CHECK_CONTAINS(ac_last_error(), DIO_ENV);
    CHECK_CONTAINS(ac_last_error(), want);
    CHECK_CONTAINS(ac_last_error(), "env.safetensors");
    CHECK_STREQ(ac_st_last_write_mode(), "none");
  }
  unsetenv(DIO_ENV);
  int temps;
  CHECK_EQ_INT(dir_count(&temps), 1); /* the file of the last good save; no temp file */
  CHECK_EQ_INT(temps, 0);
  free(big);
  clear_dir();
}

/* A file system that refuses O_DIRECT (simulated by the test hook): "auto" rewrites the file
 * buffered, "1" fails naming the file and the variable; either way no temp file is left. */
TEST(direct_io_refused_falls_back_or_fails) {
  char path[512], ref[512];
  path_of(path, sizeof path, "fb.safetensors");
  path_of(ref, sizeof ref, "ref.bin");
  size_t nbig = (size_t)4 << 20;
  unsigned char *big = malloc(nbig);
  for (size_t i = 0; i < nbig; i++) big[i] = (unsigned char)(i * 131 + (i >> 13));
  int64_t shape[1] = {(int64_t)nbig};
  ac_st_tensor_t t = {"big", AC_ST_U8, 1, shape, big, AC_ST_HOST, 0};
  size_t lref = 0, len = 0;
  setenv(DIO_ENV, "0", 1);
  CHECK_OK(ac_st_save(ref, &t, 1, NULL, 0, 1));
  unsigned char *want = read_whole(ref, &lref);
  unlink(ref);
  static const char old[] = "the previous checkpoint";
  int temps;
  const int faults[] = {ST_DIRECT_FAULT_OPEN, ST_DIRECT_FAULT_WRITE};
  for (int k = 0; k < 2; k++) {
    st_direct_set_fault(faults[k]);
    /* auto: the same bytes, buffered */
    setenv(DIO_ENV, "auto", 1);
    CHECK_MSG(ac_st_save(path, &t, 1, NULL, 0, 2) == AC_OK, "fault %d: %s", faults[k], ac_last_error());
    CHECK_STREQ(ac_st_last_write_mode(), "buffered");
    unsigned char *got = read_whole(path, &len);
    CHECK_MSG(got && want && len == lref && memcmp(got, want, len) == 0, "fault %d: the fallback's bytes differ",
              faults[k]);
    free(got);
    CHECK_EQ_INT(dir_count(&temps), 1);
    CHECK_EQ_INT(temps, 0);
    /* 1: an error naming the file and the way out; the old file stays */
    write_whole(path, old, sizeof old);
    setenv(DIO_ENV, "1", 1);
    CHECK_RC(ac_st_save(path, &t, 1, NULL, 0, 2), AC_ERR_UNSUPPORTED);
    CHECK_CONTAINS(ac_last_error(), "fb.safetensors: ACCELERATE_C_DIRECT_IO=1 asks for O_DIRECT");
    CHECK_CONTAINS(ac_last_error(), faults[k] == ST_DIRECT_FAULT_OPEN ? "(opening " : "(writing ");
    CHECK_CONTAINS(ac_last_error(), ".tmp: Invalid argument");
    CHECK_CONTAINS(ac_last_error(), "set ACCELERATE_C_DIRECT_IO=0");
    got = read_whole(path, &len);
    CHECK(got && len == sizeof old && memcmp(got, old, len) == 0);
    free(got);
    CHECK_EQ_INT(dir_count(&temps), 1);
    CHECK_EQ_INT(temps, 0);
  }
  /* a short write that leaves an unaligned rest is an error, not a fallback */
  st_direct_set_fault(ST_DIRECT_FAULT_SHORT);
  setenv(DIO_ENV, "auto", 1);
  CHECK_RC(ac_st_save(path, &t, 1, NULL, 0, 1), AC_ERR_IO);
  CHECK_CONTAINS(ac_last_error(), "a short O_DIRECT write of tensor 'big'");
  CHECK_CONTAINS(ac_last_error(), "at file offset 512, which is not a multiple of 4096");
  CHECK_STREQ(ac_st_last_write_mode(), "direct");
  CHECK_EQ_INT(dir_count(&temps), 1);
  CHECK_EQ_INT(temps, 0);
  st_direct_set_fault(ST_DIRECT_FAULT_NONE);
  unsetenv(DIO_ENV);
  free(want);
  free(big);
  clear_dir();
}

TEST(cleanup) { st_remove_tmpdir(); }

static const tu_test_t tests[] = {
    TU_CASE(direct_bytes_equal_buffered),
    TU_CASE(direct_io_env_values),
    TU_CASE(direct_io_refused_falls_back_or_fails),
    TU_CASE(cleanup),
};
TU_MAIN(tests)

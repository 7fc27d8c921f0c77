/* test_safetensors_roundtrip.c — saving and reading back (csrc/include/ac/safetensors.h): every
 * dtype, scalars, empty tensors and one bigger than an I/O job, with metadata, on one and several
 * threads; subset reads in any order and the read-request errors; names that need JSON escapes;
 * and a file that shrinks under an open reader. */
#define _GNU_SOURCE /* mkdtemp, truncate under -std=c11 */
#include "st_test_util.h"

TEST(roundtrip_all_dtypes) {
  char path[512];
  path_of(path, sizeof path, "rt.safetensors");
  enum { N = AC_ST_NUM_DTYPES };
  ac_st_tensor_t t[N + 3];
  unsigned char *bufs[N + 3];
  int64_t shapes[N + 3][3];
  tu_rng_t rng = {0x1234567ULL};
  char names[N + 3][32];
  size_t nt = 0;
  for (int d = 0; d < N; d++, nt++) {
    shapes[nt][0] = 3 + d;
    shapes[nt][1] = 5;
    size_t nb = (size_t)shapes[nt][0] * 5 * ac_st_dtype_size((ac_st_dtype_t)d);
    bufs[nt] = malloc(nb);
    for (size_t i = 0; i < nb; i++) bufs[nt][i] = (unsigned char)tu_rand32(&rng);
    snprintf(names[nt], sizeof names[nt], "t.%s", ac_st_dtype_name((ac_st_dtype_t)d));
    t[nt] = (ac_st_tensor_t){names[nt], (ac_st_dtype_t)d, 2, shapes[nt], bufs[nt], AC_ST_HOST, 0};
  }
  /* a scalar, an empty tensor, and one bigger than an I/O job (split over several jobs) */
  static float scalar = 2.5f;
  t[nt++] = (ac_st_tensor_t){"scalar", AC_ST_F32, 0, NULL, &scalar, AC_ST_HOST, 0};
  shapes[nt][0] = 0;
  shapes[nt][1] = 7;
  t[nt] = (ac_st_tensor_t){"empty", AC_ST_F64, 2, shapes[nt], NULL, AC_ST_HOST, 0};
  nt++;
  shapes[nt][0] = 5 << 20; /* 20 MiB of F32 */
  bufs[nt] = malloc((size_t)shapes[nt][0] * 4);
  for (size_t i = 0; i < (size_t)shapes[nt][0] * 4; i++) bufs[nt][i] = (unsigned char)(i * 31 + 7);
  t[nt] = (ac_st_tensor_t){"big", AC_ST_F32, 1, shapes[nt], bufs[nt], AC_ST_HOST, 0};
  nt++;
  ac_st_kv_t meta[] = {{"format", "pt"}, {"note", "quote \" backslash \\ newline \n tab \t é"}};
  for (int threads = 1; threads <= 4; threads += 3) {
    CHECK_OK(ac_st_save(path, t, nt, meta, 2, threads));
    ac_st_reader_t *r = NULL;
    if (!CHECK_OK(ac_st_reader_create(&r, path))) return;
    const ac_st_header_t *h = ac_st_reader_header(r);
    CHECK_EQ_INT(ac_st_header_count(h), nt);
    CHECK_EQ_INT(ac_st_header_data_start(h) % 8, 0);
    CHECK(ac_st_header_has_metadata(h));
    CHECK_EQ_INT(ac_st_header_metadata_count(h), 2);
    const char *k, *v;
    CHECK_OK(ac_st_header_metadata(h, 1, &k, &v));
    CHECK_STREQ(k, "note");
    CHECK_STREQ(v, meta[1].value);
    ac_st_read_t req[N + 3];
    void *out[N + 3];
    for (size_t i = 0; i < nt; i++) {
      size_t idx;
      CHECK_OK(ac_st_header_find(h, t[i].name, &idx));
      ac_st_info_t info;
      CHECK_OK(ac_st_header_info(h, idx, &info));
      CHECK_EQ_INT(info.dtype, t[i].dtype);
      CHECK_EQ_INT(info.ndim, t[i].ndim);
      for (int32_t d = 0; d < info.ndim; d++) CHECK_EQ_INT(info.shape[d], t[i].shape[d]);
      /* the layout keeps every tensor aligned to its element size */
      CHECK_EQ_INT(info.file_offset % ac_st_dtype_size(info.dtype), 0);
      out[i] = malloc(info.nbytes ? info.nbytes : 1);
      req[i] = (ac_st_read_t){idx, out[i], info.nbytes};
    }
    CHECK_OK(ac_st_reader_read(r, req, nt, threads));
    for (size_t i = 0; i < nt; i++) {
      if (req[i].nbytes) CHECK_MSG(memcmp(out[i], t[i].data, req[i].nbytes) == 0, "tensor %s", t[i].name);
      free(out[i]);
    }
    ac_st_reader_destroy(r);
  }
  for (size_t i = 0; i < nt; i++)
    if (t[i].data && t[i].data != &scalar) free((void *)t[i].data);
  int temps;
  CHECK_EQ_INT(dir_count(&temps), 1);
  CHECK_EQ_INT(temps, 0);
  clear_dir();
}

TEST(many_small_tensors_and_subset_reads) {
  char path[512];
  path_of(path, sizeof path, "small.safetensors");
  enum { N = 300 };
  ac_st_tensor_t t[N];
  static int32_t data[N][3];
  static int64_t shape[1] = {3};
  char names[N][16];
  for (int i = 0; i < N; i++) {
    for (int k = 0; k < 3; k++) data[i][k] = i * 10 + k;
    snprintf(names[i], sizeof names[i], "w%03d", i);
    t[i] = (ac_st_tensor_t){names[i], AC_ST_I32, 1, shape, data[i], AC_ST_HOST, 0};
  }
  CHECK_OK(ac_st_save(path, t, N, NULL, 0, 3));
  ac_st_reader_t *r;
  if (!CHECK_OK(ac_st_reader_create(&r, path))) return;
  const ac_st_header_t *h = ac_st_reader_header(r);
  CHECK(!ac_st_header_has_metadata(h));
  /* every third tensor, in reverse order */
  ac_st_read_t req[N];
  int32_t out[N][3];
  size_t nr = 0;
  for (int i = N - 1; i >= 0; i -= 3) {
    size_t idx;
    CHECK_OK(ac_st_header_find(h, names[i], &idx));
    req[nr++] = (ac_st_read_t){idx, out[i], sizeof out[i]};
  }
  CHECK_OK(ac_st_reader_read(r, req, nr, 4));
  for (int i = N - 1; i >= 0; i -= 3) CHECK(memcmp(out[i], data[i], sizeof out[i]) == 0);
  /* request errors */
  ac_st_read_t bad = req[0];
  bad.nbytes = 4;
  CHECK_RC(ac_st_reader_read(r, &bad, 1, 1), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "destination is 4 bytes");
  ac_st_read_t twice[2] = {req[0], req[0]};
  CHECK_RC(ac_st_reader_read(r, twice, 2, 1), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "requested twice");
  bad = req[0];
  bad.index = N;
  CHECK_RC(ac_st_reader_read(r, &bad, 1, 1), AC_ERR_INVALID_ARG);
  size_t idx;
  CHECK_RC(ac_st_header_find(h, "nope", &idx), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "'nope'");
  ac_st_reader_destroy(r);
  clear_dir();
}

TEST(names_needing_escapes_roundtrip) {
  char path[512];
  path_of(path, sizeof path, "esc.safetensors");
  static uint8_t one = 1;
  const char *names[] = {"a\"b", "back\\slash", "new\nline", "ctl\x01", "\xc3\xa9t\xc3\xa9", "\xf0\x9f\x98\x80", ""};
  ac_st_tensor_t t[7];
  for (int i = 0; i < 7; i++) t[i] = (ac_st_tensor_t){names[i], AC_ST_U8, 0, NULL, &one, AC_ST_HOST, 0};
  CHECK_OK(ac_st_save(path, t, 7, NULL, 0, 0));
  ac_st_reader_t *r;
  if (!CHECK_OK(ac_st_reader_create(&r, path))) return;
  for (int i = 0; i < 7; i++) {
    size_t idx;
    CHECK_MSG(ac_st_header_find(ac_st_reader_header(r), names[i], &idx) == AC_OK, "name %d", i);
  }
  ac_st_reader_destroy(r);
  clear_dir();
}

TEST(file_shrinking_after_open_is_a_short_read) {
  char path[512];
  path_of(path, sizeof path, "shrink.safetensors");
  static double v[1000];
  int64_t shape[1] = {1000};
  ac_st_tensor_t t = {"v", AC_ST_F64, 1, shape, v, AC_ST_HOST, 0};
  CHECK_OK(ac_st_save(path, &t, 1, NULL, 0, 1));
  ac_st_reader_t *r;
  if (!CHECK_OK(ac_st_reader_create(&r, path))) return;
  ac_st_info_t info;
  CHECK_OK(ac_st_header_info(ac_st_reader_header(r), 0, &info));
  CHECK(truncate(path, (off_t)(info.file_offset + 100)) == 0);
  static double out[1000];
  ac_st_read_t q = {0, out, sizeof out};
  CHECK_RC(ac_st_reader_read(r, &q, 1, 2), AC_ERR_IO);
  CHECK_CONTAINS(ac_last_error(), "tensor 'v': the file ended");
  ac_st_reader_destroy(r);
  clear_dir();
}

TEST(cleanup) { st_remove_tmpdir(); }

static const tu_test_t tests[] = {
    TU_CASE(roundtrip_all_dtypes),
    TU_CASE(many_small_tensors_and_subset_reads),
    TU_CASE(names_needing_escapes_roundtrip),
    TU_CASE(file_shrinking_after_open_is_a_short_read),
    TU_CASE(cleanup),
};
TU_MAIN(tests)

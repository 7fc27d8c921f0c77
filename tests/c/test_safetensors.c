/* test_safetensors.c — csrc/include/ac/safetensors.h: write/read roundtrips, every header
 * validation error, argument errors, the atomic-write protocol under injected failures, the
 * O_DIRECT writer (byte-identical to the buffered one; ACCELERATE_C_DIRECT_IO; fallback), and GPU
 * tensors staged through pinned buffers (against a fake device that swaps in for the CUDA layer). */
#define _GNU_SOURCE /* mkdtemp, setrlimit, ftruncate under -std=c11 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ac/safetensors.h"
#include "st_direct.h" /* internal: the chunk-size and fault test hooks of the O_DIRECT path */
#include "test_util.h"

static char g_dir[256];

static const char *tmpdir(void) {
  if (!g_dir[0]) {
    snprintf(g_dir, sizeof g_dir, "/tmp/ac_st_test_XXXXXX");
    if (!mkdtemp(g_dir)) {
      perror("mkdtemp");
      g_dir[0] = '\0';
      return "/tmp";
    }
  }
  return g_dir;
}

static void path_of(char *buf, size_t n, const char *name) { snprintf(buf, n, "%s/%s", tmpdir(), name); }

/* Entries of the test directory other than . and .., and how many look like temp files. */
static int dir_count(int *temps) {
  DIR *d = opendir(tmpdir());
  int n = 0;
  *temps = 0;
  if (!d) return -1;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    n++;
    if (strstr(e->d_name, ".tmp")) (*temps)++;
  }
  closedir(d);
  return n;
}

static void clear_dir(void) {
  DIR *d = opendir(tmpdir());
  if (!d) return;
  struct dirent *e;
  char p[512];
  while ((e = readdir(d))) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    snprintf(p, sizeof p, "%s/%s", tmpdir(), e->d_name);
    unlink(p);
  }
  closedir(d);
}

static unsigned char *read_whole(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *b = malloc((size_t)n + 1);
  if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
    free(b);
    b = NULL;
  }
  fclose(f);
  *len = (size_t)n;
  return b;
}

static void write_whole(const char *path, const void *p, size_t n) {
  FILE *f = fopen(path, "wb");
  if (!f) return;
  if (n) fwrite(p, 1, n, f);
  fclose(f);
}

/* A file image: 8-byte length, `json`, then `data_size` zero bytes. */
static unsigned char *image(const char *json, size_t data_size, size_t *len) {
  size_t j = strlen(json);
  *len = 8 + j + data_size;
  unsigned char *b = calloc(*len ? *len : 1, 1);
  for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)j >> (8 * i));
  memcpy(b + 8, json, j);
  return b;
}

/* Parses an image; returns the result code and copies the error message. */
static ac_result_t parse_image(const char *json, size_t data_size, char *msg, size_t cap) {
  size_t len;
  unsigned char *b = image(json, data_size, &len);
  ac_st_header_t *h = (ac_st_header_t *)1;
  ac_clear_error();
  ac_result_t r = ac_st_header_parse(&h, b, len, len, "bad.safetensors");
  snprintf(msg, cap, "%s", ac_last_error());
  if (r != AC_OK) CHECK(h == NULL);
  ac_st_header_destroy(r == AC_OK ? h : NULL);
  free(b);
  return r;
}

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

TEST(parser_accepts_valid_variants) {
  char msg[1024];
  /* whitespace everywhere, \u escapes and surrogate pairs, zero-size tensors, empty files */
  CHECK_OK(parse_image("{}", 0, msg, sizeof msg));
  CHECK_OK(parse_image("{}        ", 0, msg, sizeof msg));
  CHECK_OK(parse_image("{\"__metadata__\":{}}", 0, msg, sizeof msg));
  CHECK(parse_image(" \n{ \"a\\u00e9\\ud83d\\ude00\" : { \"shape\" : [ 2 , 2 ] , \"dtype\" : \"F16\" ,"
                       " \"data_offsets\" : [ 0 , 8 ] } , \"z\" : {\"dtype\":\"F32\",\"shape\":[0],"
                       "\"data_offsets\":[8,8]}}\t\r\n ",
                       8, msg, sizeof msg) == AC_ERR_FORMAT); /* leading whitespace is refused */
  CHECK_OK(parse_image("{ \"a\\u00e9\\ud83d\\ude00\" : { \"shape\" : [ 2 , 2 ] , \"dtype\" : \"F16\" ,"
                       " \"data_offsets\" : [ 0 , 8 ] } , \"z\" : {\"dtype\":\"F32\",\"shape\":[0],"
                       "\"data_offsets\":[8,8]}, \"e\":{\"dtype\":\"I8\",\"shape\":[3,0],\"data_offsets\":[0,0]}}"
                       "\t\r\n ",
                       8, msg, sizeof msg));
  size_t len;
  unsigned char *b = image("{\"x\":{\"dtype\":\"BF16\",\"shape\":[],\"data_offsets\":[0,2]},"
                           "\"__metadata__\":{\"k\":\"v\"}}", 2, &len);
  ac_st_header_t *h;
  if (CHECK_OK(ac_st_header_parse(&h, b, len, len, NULL))) {
    ac_st_info_t info;
    CHECK_OK(ac_st_header_info(h, 0, &info));
    CHECK_STREQ(info.name, "x");
    CHECK_EQ_INT(info.ndim, 0);
    CHECK_EQ_INT(info.nbytes, 2);
    CHECK_EQ_INT(info.file_offset, len - 2);
    CHECK_RC(ac_st_header_info(h, 1, &info), AC_ERR_INVALID_ARG);
    ac_st_header_destroy(h);
  }
  free(b);
}

typedef struct {
  const char *json;
  size_t data;
  const char *want; /* substring of the message */
} bad_case;

TEST(parser_rejects_every_fault) {
  static const bad_case cases[] = {
      /* JSON shape */
      {"", 0, "must start with '{'"},
      {"[]", 0, "must start with '{'"},
      {"{", 0, "expected a string for a tensor name"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},}", 4, "expected a string"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}} x", 4, "unexpected content after"},
      {"{\"a\" {}}", 0, "expected ':' after key 'a'"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]} \"b\":1}", 4, "expected ',' or '}'"},
      {"{\"a", 0, "unterminated string"},
      {"{\"a\\", 0, "unterminated string"},
      {"{\"a\\x\":1}", 0, "invalid escape"},
      {"{\"a\\u12\":1}", 0, "invalid escape"},
      {"{\"a\\udc00\":1}", 0, "unpaired UTF-16 surrogate"},
      {"{\"a\\ud800x\":1}", 0, "unpaired UTF-16 surrogate"},
      {"{\"a\\u0000\":1}", 0, "\\u0000"},
      {"{\"a\tb\":1}", 0, "control character 0x09"},
      {"{\"\xff\":1}", 0, "invalid UTF-8"},
      {"{\"\xc0\xaf\":1}", 0, "invalid UTF-8"},        /* overlong '/' */
      {"{\"\xed\xa0\x80\":1}", 0, "invalid UTF-8"},    /* encoded surrogate */
      {"{\"\xf4\x90\x80\x80\":1}", 0, "invalid UTF-8"}, /* above U+10FFFF */
      {"{\"\xe2\x82\":1}", 0, "invalid UTF-8"},         /* truncated sequence */
      /* metadata */
      {"{\"__metadata__\":[]}", 0, "__metadata__ must be an object"},
      {"{\"__metadata__\":{\"format\":1}}", 0, "__metadata__ value of 'format' must be a string"},
      {"{\"__metadata__\":{\"k\":{}}}", 0, "must be a string, found an object"},
      {"{\"__metadata__\":{},\"__metadata__\":{}}", 0, "'__metadata__' appears twice"},
      {"{\"__metadata__\":{\"k\":\"a\",\"k\":\"b\"}}", 0, "__metadata__ key 'k' appears twice"},
      /* tensor entries */
      {"{\"w\":1}", 0, "tensor 'w': expected an object, found a number"},
      {"{\"w\":{}}", 0, "tensor 'w': empty entry"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, "tensor 'w': missing field 'data_offsets'"},
      {"{\"w\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "tensor 'w': missing field 'dtype'"},
      {"{\"w\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, "tensor 'w': missing field 'shape'"},
      {"{\"w\":{\"dtype\":\"F32\",\"dtype\":\"F32\"}}", 4, "field 'dtype' appears twice"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"shape\":[1]}}", 4, "field 'shape' appears twice"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"data_offsets\":[0,4]}}", 4,
       "field 'data_offsets' appears twice"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"extra\":1}}", 4,
       "tensor 'w': unknown field 'extra'"},
      {"{\"w\":{\"dtype\":\"F33\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "tensor 'w': unknown dtype 'F33'"},
      {"{\"w\":{\"dtype\":\"F4\",\"shape\":[2],\"data_offsets\":[0,1]}}", 1, "unsupported sub-byte dtype 'F4'"},
      {"{\"w\":{\"dtype\":32,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "expected a string for dtype"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":1,\"data_offsets\":[0,4]}}", 4, "tensor 'w': shape must be an array"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4, "tensor 'w': shape must not be negative"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1.0],\"data_offsets\":[0,4]}}", 4, "must be integers"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1e0],\"data_offsets\":[0,4]}}", 4, "must be integers"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[01],\"data_offsets\":[0,4]}}", 4, "leading zero"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[\"1\"],\"data_offsets\":[0,4]}}", 4, "expected an integer in shape"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1,],\"data_offsets\":[0,4]}}", 4, "expected an integer in shape"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[9223372036854775808],\"data_offsets\":[0,4]}}", 4, "too large"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[99999999999999999999],\"data_offsets\":[0,4]}}", 4, "too large"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,4]}}", 4,
       "tensor 'w': shape is too large"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 4, "exactly two integers"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 4, "exactly two integers"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":{}}}", 4, "data_offsets must be an array"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,0]}}", 4, "end before they begin"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", 4,
       "tensor 'w': data_offsets span 4 bytes but dtype F32 with 1 dims needs 8"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4, "run past the end of the data region"},
      /* layout of the data region */
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},\"w\":{\"dtype\":\"F32\",\"shape\":[1],"
       "\"data_offsets\":[4,8]}}", 8, "tensor name 'w' appears twice"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"b\":{\"dtype\":\"F32\",\"shape\":[2],"
       "\"data_offsets\":[4,12]}}", 12, "tensors 'a' [0, 8) and 'b' [4, 12) overlap"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},\"b\":{\"dtype\":\"F32\",\"shape\":[1],"
       "\"data_offsets\":[8,12]}}", 12, "hole at bytes [4, 8) of the data region between tensors 'a' and 'b'"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, "hole at bytes [0, 4)"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 6, "data region is 6 bytes"},
      {"{}", 3, "data region is 3 bytes"},
  };
  char msg[1024];
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    const bad_case *c = &cases[i];
    ac_result_t r = parse_image(c->json, c->data, msg, sizeof msg);
    CHECK_MSG(r == AC_ERR_FORMAT, "case %zu (%s): returned %s", i, c->json, ac_result_string(r));
    CHECK_MSG(strstr(msg, c->want) != NULL, "case %zu: message \"%s\" lacks \"%s\"", i, msg, c->want);
    CHECK_MSG(strstr(msg, "bad.safetensors") != NULL, "case %zu: message \"%s\" lacks the file name", i, msg);
  }
  /* a NUL byte after the object (strlen cannot carry it, so build by hand) */
  const char *js = "{} \0";
  unsigned char b[8 + 4] = {4, 0, 0, 0, 0, 0, 0, 0};
  memcpy(b + 8, js, 4);
  ac_st_header_t *h;
  CHECK_RC(ac_st_header_parse(&h, b, sizeof b, sizeof b, "nul"), AC_ERR_FORMAT);
  CHECK_CONTAINS(ac_last_error(), "unexpected content after the header object");
}

TEST(length_prefix_faults) {
  ac_st_header_t *h = NULL;
  unsigned char b[16] = {0};
  CHECK_RC(ac_st_header_parse(&h, b, 5, 5, "short"), AC_ERR_FORMAT);
  CHECK_CONTAINS(ac_last_error(), "short: not a safetensors file: 5 bytes");
  uint64_t n = AC_ST_MAX_HEADER + 1;
  for (int i = 0; i < 8; i++) b[i] = (unsigned char)(n >> (8 * i));
  CHECK_RC(ac_st_header_parse(&h, b, 16, 16, "huge"), AC_ERR_FORMAT);
  CHECK_CONTAINS(ac_last_error(), "exceeds the 100000000-byte limit");
  memset(b, 0, 8);
  b[0] = 9; /* 9 bytes of header in a 16-byte file */
  CHECK_RC(ac_st_header_parse(&h, b, 16, 16, "past"), AC_ERR_FORMAT);
  CHECK_CONTAINS(ac_last_error(), "header length 9 runs past the end of the file");
  memset(b, 0xff, 8);
  CHECK_RC(ac_st_header_parse(&h, b, 16, 16, "max"), AC_ERR_FORMAT);
  b[0] = 2;
  memset(b + 1, 0, 7);
  CHECK_RC(ac_st_header_parse(&h, b, 9, 16, "buf"), AC_ERR_INVALID_ARG); /* buffer too short: caller bug */
  CHECK_RC(ac_st_header_parse(&h, b, 17, 16, "buf"), AC_ERR_INVALID_ARG);
  CHECK(h == NULL);
  /* the same checks through the reader, on real files */
  char path[512];
  path_of(path, sizeof path, "short.safetensors");
  write_whole(path, "abc", 3);
  ac_st_reader_t *r = (ac_st_reader_t *)1;
  CHECK_RC(ac_st_reader_create(&r, path), AC_ERR_FORMAT);
  CHECK(r == NULL);
  CHECK_CONTAINS(ac_last_error(), "short.safetensors: not a safetensors file");
  for (int i = 0; i < 8; i++) b[i] = (unsigned char)(n >> (8 * i));
  write_whole(path, b, 16);
  CHECK_RC(ac_st_reader_create(&r, path), AC_ERR_FORMAT);
  CHECK_CONTAINS(ac_last_error(), "exceeds the");
  path_of(path, sizeof path, "missing.safetensors");
  CHECK_RC(ac_st_reader_create(&r, path), AC_ERR_IO);
  CHECK_CONTAINS(ac_last_error(), "missing.safetensors: cannot open");
  CHECK_RC(ac_st_reader_create(&r, tmpdir()), AC_ERR_IO);
  CHECK_CONTAINS(ac_last_error(), "not a regular file");
  clear_dir();
}

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

TEST(dtype_names) {
  /* the format's names and element sizes, written out by hand (the safetensors spec) */
  static const struct {
    const char *name;
    size_t size;
  } spec[AC_ST_NUM_DTYPES] = {
      [AC_ST_BOOL] = {"BOOL", 1},   [AC_ST_U8] = {"U8", 1},     [AC_ST_I8] = {"I8", 1},
      [AC_ST_F8_E5M2] = {"F8_E5M2", 1}, [AC_ST_F8_E4M3] = {"F8_E4M3", 1}, [AC_ST_F8_E8M0] = {"F8_E8M0", 1},
      [AC_ST_I16] = {"I16", 2},     [AC_ST_U16] = {"U16", 2},   [AC_ST_F16] = {"F16", 2},
      [AC_ST_BF16] = {"BF16", 2},   [AC_ST_I32] = {"I32", 4},   [AC_ST_U32] = {"U32", 4},
      [AC_ST_F32] = {"F32", 4},     [AC_ST_C64] = {"C64", 8},   [AC_ST_F64] = {"F64", 8},
      [AC_ST_I64] = {"I64", 8},     [AC_ST_U64] = {"U64", 8},
  };
  for (int d = 0; d < AC_ST_NUM_DTYPES; d++) {
    ac_st_dtype_t back;
    CHECK_STREQ(ac_st_dtype_name((ac_st_dtype_t)d), spec[d].name);
    CHECK_EQ_INT(ac_st_dtype_size((ac_st_dtype_t)d), spec[d].size);
    CHECK_OK(ac_st_dtype_from_name(spec[d].name, &back));
    CHECK_EQ_INT(back, d);
  }
  ac_st_dtype_t x;
  CHECK_RC(ac_st_dtype_from_name("F4", &x), AC_ERR_FORMAT);
  CHECK_STREQ(ac_st_dtype_name((ac_st_dtype_t)77), "?");
  CHECK_EQ_INT(ac_st_dtype_size((ac_st_dtype_t)77), 0);
  ac_st_header_destroy(NULL);
  ac_st_reader_destroy(NULL);
}

/* ---- the O_DIRECT writer ----------------------------------------------------------------------- */

#define DIO_ENV "ACCELERATE_C_DIRECT_IO"
#define SMALL_CHUNK ((size_t)3 * 4096) /* so tests cross chunk boundaries with small files */

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

/* Length of the file one U8 tensor "x" of n bytes makes (written buffered). */
static size_t u8_file_len(unsigned char *data, size_t n) {
  char p[512];
  path_of(p, sizeof p, "probe.safetensors");
  int64_t shape[1] = {(int64_t)n};
  ac_st_tensor_t t = {"x", AC_ST_U8, 1, shape, data, AC_ST_HOST, 0};
  setenv(DIO_ENV, "0", 1);
  size_t len = 0;
  if (CHECK_OK(ac_st_save(p, &t, 1, NULL, 0, 1))) {
    struct stat st;
    if (CHECK(stat(p, &st) == 0)) len = (size_t)st.st_size;
  }
  unsetenv(DIO_ENV);
  unlink(p);
  return len;
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

/* ---- GPU tensors: the staged chunk pipeline against a fake device ------------------------------ */

/* The fake device: "device memory" is a memfd mapped twice, once PROT_NONE (the address the
 * writer gets, so any host access to it crashes, as it would for real device memory) and once
 * readable (where the fake copy engine reads), holding every byte XOR FAKE_KEY, so bytes that
 * reach the file other than through the fake copy (which decodes) differ from the reference. Copies are queued on the fake stream and only done at its sync, as a real
 * cudaMemcpyAsync into pinned memory may finish late: a pwrite before the sync writes garbage.
 * Every device op checks that it runs off the main thread (the writer must not change the
 * caller's current device), that its device is the one the memory is registered on, and that
 * the destination lies inside a live pinned buffer; it counts what it does. */
#define FAKE_KEY 0x5a
#define FAKE_MAX_RANGES 2048
#define FAKE_MAX_PINNED 64
#define FAKE_PIN_SKEW 8 /* the fake pinned allocator returns addresses 8 bytes past 4096-alignment */

typedef struct {
  const unsigned char *p;     /* the device address (PROT_NONE) */
  const unsigned char *alias; /* the same bytes, readable by the fake copy engine */
  size_t n;
  int device;
} fake_range;

/* A "ready event" of the caller's stream: until a stream that waited for it reaches the wait,
 * the tensor's device bytes are still being written by the caller's kernels (the fake holds
 * stale bytes there); completing the event writes the final ones. */
typedef struct {
  int device;
  fake_range *r;
  unsigned char *final; /* the encoded bytes the caller's kernels are writing */
  int done;             /* under fk.mu */
  atomic_int waits;     /* streams that waited for it */
} fake_event;

/* A queued operation: a copy, or (`wait` set) a wait for an event. */
typedef struct {
  void *dst;
  const void *src;
  size_t n;
  fake_event *wait;
} fake_copy;

#define FAKE_MAX_WAITED 8

typedef struct {
  int device;
  fake_copy *q;
  size_t nq, cap;
  fake_event *waited[FAKE_MAX_WAITED]; /* the events this stream has queued a wait for */
  int nwaited;
} fake_stream;

static struct {
  fake_range ranges[FAKE_MAX_RANGES];
  int nranges;
  pthread_t main_thread;
  pthread_mutex_t mu; /* the pinned table */
  struct {
    char *p;
    size_t n;
  } pinned[FAKE_MAX_PINNED];
  const unsigned char *fail_src; /* copy_async fails when its source lies in this range */
  size_t fail_n;
  int fail_sync;   /* stream_sync fails (after doing the copies) */
  int fail_alloc;  /* host_alloc number fail_alloc (1-based) and all later ones fail; 0 = never */
  int fail_wait;   /* stream_wait_event fails */
  fake_event *pending[FAKE_MAX_RANGES]; /* per range: its ready event not yet completed, or NULL */
} fk = {.mu = PTHREAD_MUTEX_INITIALIZER};

static atomic_long fk_allocs, fk_frees, fk_streams, fk_stream_frees, fk_copies, fk_syncs, fk_checks, fk_bad;
static atomic_size_t fk_bytes;

static void fake_reset(void) {
  fk.nranges = 0;
  fk.main_thread = pthread_self();
  fk.fail_src = NULL;
  fk.fail_n = 0;
  fk.fail_sync = 0;
  fk.fail_alloc = 0;
  fk.fail_wait = 0;
  memset(fk.pending, 0, sizeof fk.pending);
  atomic_store(&fk_allocs, 0);
  atomic_store(&fk_frees, 0);
  atomic_store(&fk_streams, 0);
  atomic_store(&fk_stream_frees, 0);
  atomic_store(&fk_copies, 0);
  atomic_store(&fk_syncs, 0);
  atomic_store(&fk_checks, 0);
  atomic_store(&fk_bad, 0);
  atomic_store(&fk_bytes, 0);
}

static void fake_bad(const char *what) {
  atomic_fetch_add(&fk_bad, 1);
  printf("    fake device: %s\n", what);
}

static int on_main(void) { return pthread_equal(pthread_self(), fk.main_thread); }

static ac_result_t fake_check_device(int device) {
  atomic_fetch_add(&fk_checks, 1);
  if (device > 3) return AC_FAIL(AC_ERR_INVALID_ARG, "CUDA device %d does not exist (4 visible)", device);
  return AC_OK;
}

static ac_result_t fake_host_alloc(void **ptr, size_t bytes, int device) {
  *ptr = NULL;
  if (on_main()) fake_bad("host_alloc on the caller's thread");
  if (device < 0 || device > 3) fake_bad("host_alloc with a bad device");
  long k = atomic_fetch_add(&fk_allocs, 1) + 1;
  if (fk.fail_alloc && k >= fk.fail_alloc) {
    atomic_fetch_add(&fk_frees, 1); /* nothing to free: keep the balance */
    return AC_FAIL(AC_ERR_NOMEM, "cudaHostAlloc of %zu bytes (device %d current) failed: fake out of pinned memory",
                   bytes, device);
  }
  char *base = malloc(bytes + 4096 + FAKE_PIN_SKEW);
  if (!base) return AC_FAIL(AC_ERR_NOMEM, "fake: malloc failed");
  char *p = (char *)(((uintptr_t)base + 4095) / 4096 * 4096) + FAKE_PIN_SKEW;
  pthread_mutex_lock(&fk.mu);
  int slot = -1;
  for (int i = 0; i < FAKE_MAX_PINNED && slot < 0; i++)
    if (!fk.pinned[i].p) slot = i;
  if (slot >= 0) {
    fk.pinned[slot].p = p;
    fk.pinned[slot].n = bytes;
  }
  pthread_mutex_unlock(&fk.mu);
  if (slot < 0) {
    free(base);
    fake_bad("too many live pinned buffers");
    return AC_FAIL(AC_ERR_NOMEM, "fake: too many pinned buffers");
  }
  /* remember the malloc base just before the returned address (inside the alignment slack) */
  memcpy(p - FAKE_PIN_SKEW, &base, sizeof base);
  *ptr = p;
  return AC_OK;
}

static void fake_host_free(void *ptr) {
  if (!ptr) return;
  if (on_main()) fake_bad("host_free on the caller's thread");
  int found = 0;
  pthread_mutex_lock(&fk.mu);
  for (int i = 0; i < FAKE_MAX_PINNED; i++)
    if (fk.pinned[i].p == ptr) {
      fk.pinned[i].p = NULL;
      found = 1;
    }
  pthread_mutex_unlock(&fk.mu);
  if (!found) {
    fake_bad("host_free of something not allocated");
    return;
  }
  atomic_fetch_add(&fk_frees, 1);
  char *base;
  memcpy(&base, (char *)ptr - FAKE_PIN_SKEW, sizeof base);
  free(base);
}

static ac_result_t fake_stream_create(void **stream, int device) {
  if (on_main()) fake_bad("stream_create on the caller's thread");
  fake_stream *s = calloc(1, sizeof *s);
  if (!s) return AC_FAIL(AC_ERR_NOMEM, "fake: no stream");
  s->device = device;
  atomic_fetch_add(&fk_streams, 1);
  *stream = s;
  return AC_OK;
}

static void fake_stream_destroy(void *stream, int device) {
  fake_stream *s = stream;
  if (on_main()) fake_bad("stream_destroy on the caller's thread");
  if (s->device != device) fake_bad("stream destroyed with another device");
  if (s->nq) fake_bad("stream destroyed with copies pending");
  atomic_fetch_add(&fk_stream_frees, 1);
  free(s->q);
  free(s);
}

static int fake_queue(fake_stream *s, fake_copy op) {
  if (s->nq == s->cap) {
    size_t cap = s->cap ? 2 * s->cap : 8;
    fake_copy *nq = realloc(s->q, cap * sizeof *nq);
    if (!nq) return -1;
    s->q = nq;
    s->cap = cap;
  }
  s->q[s->nq++] = op;
  return 0;
}

static ac_result_t fake_stream_wait_event(void *stream, void *event, int device) {
  fake_stream *s = stream;
  fake_event *e = event;
  if (on_main()) fake_bad("wait_event on the caller's thread");
  if (s->device != device || e->device != device) fake_bad("wait for an event of another device");
  if (fk.fail_wait)
    return AC_FAIL(AC_ERR_CUDA, "cudaStreamWaitEvent (the tensors' ready event) on device %d failed: fake invalid "
                   "resource handle", device);
  if (s->nwaited < FAKE_MAX_WAITED) s->waited[s->nwaited++] = e;
  if (fake_queue(s, (fake_copy){NULL, NULL, 0, e}) < 0) return AC_FAIL(AC_ERR_NOMEM, "fake: queue");
  atomic_fetch_add(&e->waits, 1);
  return AC_OK;
}

static ac_result_t fake_copy_async(void *dst, const void *src, size_t n, int device, void *stream) {
  fake_stream *s = stream;
  if (on_main()) fake_bad("copy on the caller's thread");
  if (s->device != device) fake_bad("copy on a stream of another device");
  const unsigned char *q = src, *readable = NULL;
  for (int i = 0; i < fk.nranges && !readable; i++)
    if (q >= fk.ranges[i].p && q + n <= fk.ranges[i].p + fk.ranges[i].n && fk.ranges[i].device == device) {
      readable = fk.ranges[i].alias + (q - fk.ranges[i].p);
      fake_event *e = fk.pending[i];
      int waited = !e;
      for (int k = 0; k < s->nwaited && !waited; k++) waited = s->waited[k] == e;
      if (!waited) fake_bad("copy of a tensor before its stream waited for the tensor's ready event");
    }
  if (!readable) {
    fake_bad("copy from memory that is not on that fake device");
    return AC_FAIL(AC_ERR_CUDA, "fake: invalid device pointer");
  }
  int pinned = 0;
  pthread_mutex_lock(&fk.mu);
  for (int i = 0; i < FAKE_MAX_PINNED && !pinned; i++)
    pinned = fk.pinned[i].p && (char *)dst >= fk.pinned[i].p && (char *)dst + n <= fk.pinned[i].p + fk.pinned[i].n;
  pthread_mutex_unlock(&fk.mu);
  if (!pinned) fake_bad("copy into memory that is not a live pinned buffer");
  if (fk.fail_src && q < fk.fail_src + fk.fail_n && fk.fail_src < q + n)
    return AC_FAIL(AC_ERR_CUDA, "cudaMemcpyAsync (device %d to host, %zu bytes) failed: fake device fault", device, n);
  if (fake_queue(s, (fake_copy){dst, readable, n, NULL}) < 0) return AC_FAIL(AC_ERR_NOMEM, "fake: queue");
  atomic_fetch_add(&fk_copies, 1);
  return AC_OK;
}

static ac_result_t fake_stream_sync(void *stream, int device) {
  fake_stream *s = stream;
  if (on_main()) fake_bad("sync on the caller's thread");
  if (s->device != device) fake_bad("sync of a stream with another device");
  for (size_t i = 0; i < s->nq; i++) { /* the "DMA": decode into the pinned buffer */
    fake_event *e = s->q[i].wait;
    if (e) { /* the caller's kernels before the event are done: their bytes are in place */
      pthread_mutex_lock(&fk.mu);
      if (!e->done) memcpy((void *)(uintptr_t)e->r->alias, e->final, e->r->n);
      e->done = 1;
      pthread_mutex_unlock(&fk.mu);
      continue;
    }
    unsigned char *d = s->q[i].dst;
    const unsigned char *src = s->q[i].src;
    for (size_t k = 0; k < s->q[i].n; k++) d[k] = src[k] ^ FAKE_KEY;
    atomic_fetch_add(&fk_bytes, s->q[i].n);
  }
  s->nq = 0;
  atomic_fetch_add(&fk_syncs, 1);
  if (fk.fail_sync)
    return AC_FAIL(AC_ERR_CUDA, "cudaStreamSynchronize (device-to-host copies) on device %d failed: fake illegal "
                   "address", device);
  return AC_OK;
}

static const st_device_ops fake_ops = {
    .check_device = fake_check_device,
    .host_alloc = fake_host_alloc,
    .host_free = fake_host_free,
    .stream_create = fake_stream_create,
    .stream_destroy = fake_stream_destroy,
    .stream_wait_event = fake_stream_wait_event,
    .copy_async = fake_copy_async,
    .stream_sync = fake_stream_sync,
};

/* "Moves" tensor t to fake device `device`: an encoded copy in a fresh double mapping,
 * registered. Returns its handle for free_fake_device. */
static fake_range *to_fake_device(ac_st_tensor_t *t, int device) {
  size_t n = ac_st_dtype_size(t->dtype);
  for (int32_t d = 0; d < t->ndim; d++) n *= (size_t)t->shape[d];
  if (!CHECK(fk.nranges < FAKE_MAX_RANGES)) return NULL;
  size_t len = (n + 4095) / 4096 * 4096 + 4096;
  int fd = memfd_create("fake_device", MFD_CLOEXEC);
  if (!CHECK(fd >= 0 && ftruncate(fd, (off_t)len) == 0)) return NULL;
  unsigned char *alias = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  unsigned char *dev = mmap(NULL, len, PROT_NONE, MAP_SHARED, fd, 0);
  close(fd);
  if (!CHECK(alias != MAP_FAILED && dev != MAP_FAILED)) return NULL;
  for (size_t i = 0; i < n; i++) alias[i] = ((const unsigned char *)t->data)[i] ^ FAKE_KEY;
  fake_range *r = &fk.ranges[fk.nranges++];
  *r = (fake_range){dev, alias, len, device};
  t->data = n ? dev : NULL;
  t->memory = AC_ST_CUDA;
  t->device = device;
  return r;
}

static void free_fake_device(fake_range *r) {
  if (!r) return;
  munmap((void *)(uintptr_t)r->p, r->n);
  munmap((void *)(uintptr_t)r->alias, r->n);
  r->p = r->alias = NULL;
  r->n = 0;
}

/* The tensor on fake range r is still being written by the caller's stream: its device bytes
 * are stale (0xEE) until a copy stream passes a wait for the returned event. */
static fake_event *fake_pending_write(fake_range *r) {
  fake_event *e = calloc(1, sizeof *e);
  if (!CHECK(e && r)) return e;
  e->device = r->device;
  e->r = r;
  e->final = malloc(r->n);
  if (!CHECK(e->final)) return e;
  memcpy(e->final, r->alias, r->n);
  memset((void *)(uintptr_t)r->alias, 0xEE, r->n);
  fk.pending[r - fk.ranges] = e;
  return e;
}

static void free_fake_event(fake_event *e) {
  if (!e) return;
  free(e->final);
  free(e);
}

/* The ops' books balance after a save: every buffer and stream freed, nothing misused. */
static void check_fake_books(const char *label) {
  CHECK_MSG(atomic_load(&fk_allocs) == atomic_load(&fk_frees), "%s: %ld pinned allocs, %ld frees", label,
            atomic_load(&fk_allocs), atomic_load(&fk_frees));
  CHECK_MSG(atomic_load(&fk_streams) == atomic_load(&fk_stream_frees), "%s: %ld streams, %ld destroyed", label,
            atomic_load(&fk_streams), atomic_load(&fk_stream_frees));
  CHECK_MSG(atomic_load(&fk_bad) == 0, "%s: %ld misuses of the fake device", label, atomic_load(&fk_bad));
}

/* Saves `t` (host tensors) as the reference, then again with the tensors whose index has a
 * non-negative dev[i] on that fake device, under ACCELERATE_C_DIRECT_IO=mode; checks the files
 * are byte-identical, the reported write mode, every device byte copied exactly once, and the
 * books. */
static void check_staged_same(const char *label, const ac_st_tensor_t *t, size_t n, const int *dev, const char *mode,
                              const char *want_mode, int threads) {
  char ref[512], out[512];
  path_of(ref, sizeof ref, "ref.safetensors");
  path_of(out, sizeof out, "staged.safetensors");
  setenv(DIO_ENV, "0", 1);
  CHECK_MSG(ac_st_save(ref, t, n, NULL, 0, 1) == AC_OK, "%s: %s", label, ac_last_error());
  ac_st_tensor_t *ts = malloc((n ? n : 1) * sizeof *ts);
  fake_range **owned = calloc(n ? n : 1, sizeof *owned);
  fake_reset();
  size_t dev_bytes = 0;
  for (size_t i = 0; i < n; i++) {
    ts[i] = t[i];
    if (dev[i] >= 0) {
      owned[i] = to_fake_device(&ts[i], dev[i]);
      size_t b = ac_st_dtype_size(t[i].dtype);
      for (int32_t d = 0; d < t[i].ndim; d++) b *= (size_t)t[i].shape[d];
      dev_bytes += b;
    }
  }
  setenv(DIO_ENV, mode, 1);
  CHECK_MSG(ac_st_save(out, ts, n, NULL, 0, threads) == AC_OK, "%s (%s=%s, threads %d): %s", label, DIO_ENV, mode,
            threads, ac_last_error());
  unsetenv(DIO_ENV);
  CHECK_MSG(strcmp(ac_st_last_write_mode(), want_mode) == 0, "%s (%s=%s): mode %s, expected %s", label, DIO_ENV, mode,
            ac_st_last_write_mode(), want_mode);
  size_t la = 0, lb = 0;
  unsigned char *a = read_whole(ref, &la), *b = read_whole(out, &lb);
  CHECK_MSG(a && b && la == lb, "%s: %zu bytes from host memory, %zu staged", label, la, lb);
  if (a && b && la == lb) {
    size_t i = 0;
    while (i < la && a[i] == b[i]) i++;
    CHECK_MSG(i == la, "%s (%s=%s, threads %d): first difference at byte %zu of %zu", label, DIO_ENV, mode, threads,
              i, la);
  }
  /* exactly once each; a refused first O_DIRECT write costs the copies of the chunks before it */
  if (st_direct_fault() == ST_DIRECT_FAULT_WRITE)
    CHECK_MSG(atomic_load(&fk_bytes) > dev_bytes, "%s: %zu device bytes copied, expected more than %zu", label,
              atomic_load(&fk_bytes), dev_bytes);
  else
    CHECK_MSG(atomic_load(&fk_bytes) == dev_bytes, "%s: %zu device bytes copied, expected %zu", label,
              atomic_load(&fk_bytes), dev_bytes);
  if (dev_bytes) CHECK(atomic_load(&fk_allocs) >= 1 && atomic_load(&fk_syncs) >= 1);
  check_fake_books(label);
  free(a);
  free(b);
  for (size_t i = 0; i < n; i++) free_fake_device(owned[i]);
  free(owned);
  free(ts);
  int temps;
  CHECK_EQ_INT(dir_count(&temps), 2);
  CHECK_EQ_INT(temps, 0);
  clear_dir();
}

TEST(gpu_tensors_staged_bytes_equal_host) {
  st_direct_set_device_ops(&fake_ops);
  if (!CHECK(st_direct_set_chunk_bytes(SMALL_CHUNK) == 0)) return;
  tu_rng_t rng = {0x6a0ULL};
  size_t cap = 8 * SMALL_CHUNK;
  unsigned char *data = malloc(cap);
  for (size_t i = 0; i < cap; i++) data[i] = (unsigned char)tu_rand32(&rng);
  static const char *const modes[][2] = {{"1", "direct"}, {"0", "buffered"}, {"auto", "buffered"}};

  /* one big tensor across several chunks, alone and next to host tensors in the same chunks */
  {
    int64_t s_big[1] = {3 * SMALL_CHUNK + 1001}, s_a[1] = {77}, s_b[2] = {5, 9};
    ac_st_tensor_t t[] = {
        {"big", AC_ST_U8, 1, s_big, data, AC_ST_HOST, 0},
        {"a.f32", AC_ST_F32, 1, s_a, data + 5, AC_ST_HOST, 0},
        {"b.bf16", AC_ST_BF16, 2, s_b, data + 7, AC_ST_HOST, 0},
    };
    const int all[] = {0, 0, 0}, big_only[] = {0, -1, -1}, small_only[] = {-1, 1, 3}, none[] = {-1, -1, -1};
    const int *cases[] = {all, big_only, small_only, none};
    for (int c = 0; c < 4; c++)
      for (int m = 0; m < 3; m++)
        for (int threads = 0; threads <= 4; threads += 2) {
          char label[64];
          snprintf(label, sizeof label, "big tensor, case %d", c);
          /* an all-host save is the plain writer: direct or pwritev, no staging */
          check_staged_same(label, t, 3, cases[c], modes[m][0], c == 3 && m == 2 ? "buffered" : modes[m][1], threads);
        }
  }

  /* files of exactly 1, 2 chunks (+-1 byte) from one device tensor */
  {
    const size_t lens[] = {SMALL_CHUNK, SMALL_CHUNK - 1, SMALL_CHUNK + 1, 2 * SMALL_CHUNK, 4096, 4095};
    for (size_t k = 0; k < sizeof lens / sizeof lens[0]; k++) {
      size_t n = lens[k] > 128 ? lens[k] - 128 : 1;
      for (int it = 0; it < 8; it++) {
        size_t len = u8_file_len(data, n);
        if (len == lens[k] || len == 0) break;
        n = n + lens[k] - len;
      }
      if (!CHECK_MSG(u8_file_len(data, n) == lens[k], "no tensor size gives a %zu-byte file", lens[k])) continue;
      int64_t shape[1] = {(int64_t)n};
      ac_st_tensor_t t = {"x", AC_ST_U8, 1, shape, data, AC_ST_HOST, 0};
      const int d[] = {2};
      char label[64];
      snprintf(label, sizeof label, "a %zu-byte file", lens[k]);
      for (int m = 0; m < 2; m++) check_staged_same(label, &t, 1, d, modes[m][0], modes[m][1], 2);
    }
  }

  /* tensors straddling chunk edges, host and device pieces (two devices) in one chunk, zero-size
   * device tensors and a device scalar */
  {
    int64_t s_f64[1] = {3001}, s_bf16[2] = {7, 111}, s_i8[1] = {13}, s_empty[2] = {0, 5}, s_u16[1] = {6000};
    static int64_t scalar = 0x0102030405060708LL;
    ac_st_tensor_t t[] = {
        {"w.f64", AC_ST_F64, 1, s_f64, data, AC_ST_HOST, 0},
        {"w.bf16", AC_ST_BF16, 2, s_bf16, data + 1, AC_ST_HOST, 0},
        {"w.i8", AC_ST_I8, 1, s_i8, data + 2, AC_ST_HOST, 0},
        {"empty.a", AC_ST_F32, 2, s_empty, NULL, AC_ST_HOST, 0},
        {"empty.b", AC_ST_U8, 2, s_empty, NULL, AC_ST_HOST, 0},
        {"step", AC_ST_I64, 0, NULL, &scalar, AC_ST_HOST, 0},
        {"w.u16", AC_ST_U16, 1, s_u16, data + 3, AC_ST_HOST, 0},
    };
    const int d1[] = {0, -1, 1, 0, -1, 1, -1}, d2[] = {-1, 2, -1, -1, 3, -1, 0}, d3[] = {1, 1, 1, 1, 1, 1, 1};
    const int *cases[] = {d1, d2, d3};
    for (int c = 0; c < 3; c++)
      for (int m = 0; m < 3; m++)
        for (int threads = 1; threads <= 16; threads *= 4)
          check_staged_same("straddling tensors", t, sizeof t / sizeof t[0], cases[c], modes[m][0], modes[m][1],
                            threads);
  }

  /* many tiny tensors alternating host / device 0 / device 1: dozens of pieces per chunk */
  {
    enum { N = 600 };
    ac_st_tensor_t *t = calloc(N, sizeof *t);
    int64_t *shapes = calloc(N, sizeof *shapes);
    int *dev = calloc(N, sizeof *dev);
    char (*names)[40] = calloc(N, sizeof *names);
    size_t off = 0;
    for (int i = 0; i < N; i++) {
      shapes[i] = i % 10 == 0 ? 0 : 1 + i % 7;
      snprintf(names[i], sizeof names[i], "model.layers.%03d.tiny_parameter", i);
      t[i] = (ac_st_tensor_t){names[i], AC_ST_U8, 1, &shapes[i], shapes[i] ? data + off : NULL, AC_ST_HOST, 0};
      dev[i] = i % 3 - 1;
      off += (size_t)shapes[i];
    }
    for (int m = 0; m < 2; m++) check_staged_same("600 tiny tensors", t, N, dev, modes[m][0], modes[m][1], 3);
    free(t);
    free(shapes);
    free(dev);
    free(names);
  }

  /* a file system that refuses O_DIRECT: "auto" (direct from 4 MiB) redoes the staged save
   * through the page cache, with the same bytes and every buffer of the first try freed */
  {
    size_t nbig = (size_t)4 << 20;
    unsigned char *big = malloc(nbig);
    for (size_t i = 0; i < nbig; i++) big[i] = (unsigned char)(i * 131 + (i >> 13));
    int64_t s_big[1] = {(int64_t)nbig}, s_a[1] = {33};
    ac_st_tensor_t t[] = {{"big", AC_ST_U8, 1, s_big, big, AC_ST_HOST, 0},
                          {"a", AC_ST_F32, 1, s_a, data, AC_ST_HOST, 0}};
    const int d[] = {0, -1};
    check_staged_same("4 MiB, auto", t, 2, d, "auto", "direct", 0);
    const int faults[] = {ST_DIRECT_FAULT_OPEN, ST_DIRECT_FAULT_WRITE};
    for (int k = 0; k < 2; k++) {
      st_direct_set_fault(faults[k]);
      check_staged_same("4 MiB, O_DIRECT refused", t, 2, d, "auto", "buffered", 0);
      st_direct_set_fault(ST_DIRECT_FAULT_NONE);
    }
    free(big);
  }
  free(data);
  CHECK(st_direct_set_chunk_bytes(0) == 0);
  st_direct_set_device_ops(NULL);
}

/* Failures while staging: a copy that cannot be queued, a wait that reports an error, no pinned
 * memory, a failed write. Each names the file and the tensor (and the device layer's text), leaves
 * no temporary file and the old file untouched, and frees every pinned buffer and stream. */
TEST(gpu_tensors_staging_failures) {
  st_direct_set_device_ops(&fake_ops);
  if (!CHECK(st_direct_set_chunk_bytes(SMALL_CHUNK) == 0)) return;
  char path[512];
  path_of(path, sizeof path, "fail.safetensors");
  static const char old[] = "the previous checkpoint";
  size_t nb = 5 * SMALL_CHUNK;
  unsigned char *host = malloc(nb);
  for (size_t i = 0; i < nb; i++) host[i] = (unsigned char)(i * 7 + (i >> 9));
  int64_t s_big[1] = {(int64_t)(4 * SMALL_CHUNK)}, s_small[1] = {1000}, s_tail[1] = {3000};
  static const char *const modes[] = {"1", "0"};
  int temps;
  for (int m = 0; m < 2; m++)
    for (int what = 0; what < 5; what++) {
      fake_reset();
      ac_st_tensor_t t[] = {
          {"layer.0.weight", AC_ST_U8, 1, s_big, host, AC_ST_HOST, 0},
          {"layer.1.bias", AC_ST_U8, 1, s_small, host + 11, AC_ST_HOST, 0},
          {"layer.2.scale", AC_ST_U8, 1, s_tail, host + 13, AC_ST_HOST, 0},
      };
      fake_range *d0 = to_fake_device(&t[0], 0), *d1 = to_fake_device(&t[1], 1);
      if (!d0 || !d1) break;
      const char *want[3] = {NULL, NULL, NULL};
      ac_result_t want_rc = AC_ERR_CUDA;
      struct rlimit saved, lim;
      int limited = 0;
      void (*prev)(int) = SIG_DFL;
      if (what == 0) { /* queueing the copy of the second device tensor fails */
        fk.fail_src = d1->p + 100;
        fk.fail_n = 1;
        want[0] = "copying tensor 'layer.1.bias' from CUDA device 1 into the staging buffer of";
        want[1] = "cudaMemcpyAsync (device 1 to host, 1000 bytes) failed: fake device fault";
      } else if (what == 1) { /* the first wait fails */
        fk.fail_sync = 1;
        want[0] = "from CUDA device ";
        want[1] = "cudaStreamSynchronize (device-to-host copies) on device";
        want[2] = "fake illegal address";
      } else if (what == 2) { /* no pinned memory at all */
        fk.fail_alloc = 1;
        want_rc = AC_ERR_NOMEM;
        want[0] = "no pinned staging buffer for";
        want[1] = "fake out of pinned memory";
      } else if (what == 3) { /* the file-size limit hits half-way */
        want_rc = AC_ERR_IO;
        want[0] = "writing tensor 'layer.0.weight' at file offset";
        want[1] = "File too large";
        getrlimit(RLIMIT_FSIZE, &saved);
        prev = signal(SIGXFSZ, SIG_IGN);
        lim = saved;
        lim.rlim_cur = 2 * SMALL_CHUNK;
        limited = setrlimit(RLIMIT_FSIZE, &lim) == 0;
        CHECK(limited);
      } else { /* only the second pinned buffer fails: one worker does it all */
        fk.fail_alloc = 2;
        want_rc = AC_OK;
      }
      write_whole(path, old, sizeof old);
      setenv(DIO_ENV, modes[m], 1);
      ac_result_t r = ac_st_save(path, t, 3, NULL, 0, 2);
      unsetenv(DIO_ENV);
      if (limited) {
        setrlimit(RLIMIT_FSIZE, &saved);
        signal(SIGXFSZ, prev);
      }
      char label[64];
      snprintf(label, sizeof label, "%s=%s, failure %d", DIO_ENV, modes[m], what);
      CHECK_MSG(r == want_rc, "%s: %s (%s)", label, ac_result_string(r), ac_last_error());
      size_t len = 0;
      unsigned char *now = read_whole(path, &len);
      if (want_rc != AC_OK) {
        CHECK_CONTAINS(ac_last_error(), "fail.safetensors: ");
        CHECK_CONTAINS(ac_last_error(), ".tmp");
        for (int k = 0; k < 3; k++)
          if (want[k]) CHECK_MSG(strstr(ac_last_error(), want[k]) != NULL, "%s: \"%s\" lacks \"%s\"", label,
                                 ac_last_error(), want[k]);
        CHECK_MSG(now && len == sizeof old && memcmp(now, old, len) == 0, "%s: the old file changed", label);
      } else {
        CHECK_EQ_INT(atomic_load(&fk_allocs), 2);
        ac_st_reader_t *rd;
        if (CHECK_OK(ac_st_reader_create(&rd, path))) {
          const ac_st_header_t *h = ac_st_reader_header(rd);
          size_t idx;
          CHECK_OK(ac_st_header_find(h, "layer.0.weight", &idx));
          unsigned char *back = malloc(4 * SMALL_CHUNK);
          ac_st_read_t q = {idx, back, 4 * SMALL_CHUNK};
          CHECK_OK(ac_st_reader_read(rd, &q, 1, 1));
          CHECK(memcmp(back, host, 4 * SMALL_CHUNK) == 0);
          free(back);
          ac_st_reader_destroy(rd);
        }
      }
      if (what == 1) {
        /* the wait names the first tensor queued on that device in the chunk */
        CHECK(strstr(ac_last_error(), "tensor 'layer.0.weight'") || strstr(ac_last_error(), "tensor 'layer.1.bias'"));
      }
      free(now);
      check_fake_books(label);
      CHECK_EQ_INT(dir_count(&temps), 1);
      CHECK_EQ_INT(temps, 0);
      free_fake_device(d0);
      free_fake_device(d1);
    }
  /* a sync failure covering several tensors of one device says how many */
  {
    fake_reset();
    int64_t s1[1] = {10};
    ac_st_tensor_t t[] = {{"p.a", AC_ST_U8, 1, s1, host, AC_ST_HOST, 0}, {"p.b", AC_ST_U8, 1, s1, host + 1, AC_ST_HOST, 0},
                          {"p.c", AC_ST_U8, 1, s1, host + 2, AC_ST_HOST, 0}};
    fake_range *d[3];
    for (int i = 0; i < 3; i++) d[i] = to_fake_device(&t[i], 2);
    fk.fail_sync = 1;
    CHECK_RC(ac_st_save(path, t, 3, NULL, 0, 0), AC_ERR_CUDA);
    CHECK_CONTAINS(ac_last_error(), "copying tensor 'p.a' (and 2 more of its chunk) from CUDA device 2");
    check_fake_books("three tensors, failed wait");
    for (int i = 0; i < 3; i++) free_fake_device(d[i]);
    CHECK_EQ_INT(dir_count(&temps), 1);
    CHECK_EQ_INT(temps, 0);
  }
  free(host);
  clear_dir();
  CHECK(st_direct_set_chunk_bytes(0) == 0);
  st_direct_set_device_ops(NULL);
}

/* Tensors still being written on the caller's stream when the save starts: with their ready
 * events (ac_st_save_after), every writer stream waits for the event of each device tensor
 * before copying any of its bytes, so the file holds the final bytes; a failed wait is an
 * error naming the tensor and the file, and leaves the old file. */
TEST(gpu_tensors_wait_for_the_callers_ready_event) {
  st_direct_set_device_ops(&fake_ops);
  if (!CHECK(st_direct_set_chunk_bytes(SMALL_CHUNK) == 0)) return;
  size_t nb = 6 * SMALL_CHUNK;
  unsigned char *host = malloc(nb);
  for (size_t i = 0; i < nb; i++) host[i] = (unsigned char)(i * 13 + (i >> 11));
  int64_t s_big[1] = {(int64_t)(3 * SMALL_CHUNK + 555)}, s_b[1] = {(int64_t)(SMALL_CHUNK + 7)}, s_c[1] = {999};
  const ac_st_tensor_t ref_t[] = {{"dev0.big", AC_ST_U8, 1, s_big, host, AC_ST_HOST, 0},
                                  {"dev1.b", AC_ST_U8, 1, s_b, host + 3, AC_ST_HOST, 0},
                                  {"host.c", AC_ST_U8, 1, s_c, host + 5, AC_ST_HOST, 0}};
  char ref[512], out[512];
  path_of(ref, sizeof ref, "ready_ref.safetensors");
  path_of(out, sizeof out, "ready.safetensors");
  setenv(DIO_ENV, "0", 1);
  CHECK_OK(ac_st_save(ref, ref_t, 3, NULL, 0, 1));
  size_t lref = 0;
  unsigned char *want = read_whole(ref, &lref);
  static const char *const modes[] = {"1", "0"};
  for (int m = 0; m < 2; m++)
    for (int threads = 1; threads <= 4; threads *= 2)
      for (int fail = 0; fail < 2; fail++) {
        fake_reset();
        ac_st_tensor_t t[3];
        memcpy(t, ref_t, sizeof t);
        fake_range *d0 = to_fake_device(&t[0], 0), *d1 = to_fake_device(&t[1], 1);
        fake_event *e0 = fake_pending_write(d0), *e1 = fake_pending_write(d1);
        void *ready[3] = {e0, e1, (void *)(uintptr_t)1}; /* a host tensor's entry is never used */
        fk.fail_wait = fail;
        static const char old[] = "the previous file";
        write_whole(out, old, sizeof old);
        setenv(DIO_ENV, modes[m], 1);
        ac_result_t r = ac_st_save_after(out, t, 3, NULL, 0, threads, ready);
        char label[96];
        snprintf(label, sizeof label, "%s=%s, threads %d%s", DIO_ENV, modes[m], threads, fail ? ", failed wait" : "");
        size_t len = 0;
        unsigned char *got = read_whole(out, &len);
        if (!fail) {
          CHECK_MSG(r == AC_OK, "%s: %s", label, ac_last_error());
          CHECK_MSG(got && want && len == lref && memcmp(got, want, len) == 0, "%s: the file differs from the final "
                    "bytes (copied before the caller's work was done?)", label);
          /* each stream that copied a tensor waited for its event, once */
          CHECK_MSG(atomic_load(&e0->waits) >= 1 && atomic_load(&e1->waits) >= 1, "%s: waits %d, %d", label,
                    atomic_load(&e0->waits), atomic_load(&e1->waits));
          CHECK_MSG(atomic_load(&e0->waits) <= threads && atomic_load(&e1->waits) <= threads, "%s: waits %d, %d",
                    label, atomic_load(&e0->waits), atomic_load(&e1->waits));
        } else {
          CHECK_MSG(r == AC_ERR_CUDA, "%s: %s", label, ac_result_string(r));
          CHECK_CONTAINS(ac_last_error(), "ready.safetensors: copying tensor 'dev");
          CHECK_CONTAINS(ac_last_error(), "cudaStreamWaitEvent (the tensors' ready event)");
          CHECK_MSG(got && len == sizeof old && memcmp(got, old, len) == 0, "%s: the old file changed", label);
        }
        check_fake_books(label);
        free(got);
        free_fake_event(e0);
        free_fake_event(e1);
        free_fake_device(d0);
        free_fake_device(d1);
        int temps;
        CHECK_EQ_INT(dir_count(&temps), 2);
        CHECK_EQ_INT(temps, 0);
      }
  unsetenv(DIO_ENV);
  free(want);
  free(host);
  clear_dir();
  CHECK(st_direct_set_chunk_bytes(0) == 0);
  st_direct_set_device_ops(NULL);
}

/* Argument checks of device tensors happen before any file exists. With the real CUDA layer of
 * this CPU-only build (cuda_stub.c), a device tensor is "built without CUDA". */
TEST(gpu_tensors_argument_errors) {
  char path[512];
  path_of(path, sizeof path, "dev.safetensors");
  static float x[4];
  int64_t s1[1] = {4};
  int temps;
  st_direct_set_device_ops(NULL);
  ac_st_tensor_t t = {"w", AC_ST_F32, 1, s1, x, AC_ST_CUDA, 0};
  for (int mode = 0; mode < 2; mode++) {
    setenv(DIO_ENV, mode ? "1" : "0", 1);
    CHECK_RC(ac_st_save(path, &t, 1, NULL, 0, 0), AC_ERR_UNSUPPORTED);
    CHECK_CONTAINS(ac_last_error(), "dev.safetensors: tensor 'w' is on CUDA device 0: accelerate_c was built "
                                    "without CUDA");
    CHECK_CONTAINS(ac_last_error(), "hint: reinstall with nvcc");
    CHECK_STREQ(ac_st_last_write_mode(), "none");
    CHECK_EQ_INT(dir_count(&temps), 0);
  }
  unsetenv(DIO_ENV);
  ac_st_tensor_t empty = {"e", AC_ST_F32, 1, (int64_t[]){0}, NULL, AC_ST_CUDA, 0};
  CHECK_RC(ac_st_save(path, &empty, 1, NULL, 0, 0), AC_ERR_UNSUPPORTED);
  ac_st_tensor_t bad_kind = {"k", AC_ST_F32, 1, s1, x, (ac_st_memory_t)7, 0};
  CHECK_RC(ac_st_save(path, &bad_kind, 1, NULL, 0, 0), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "tensor 'k' has an invalid memory kind 7");
  ac_st_tensor_t neg = {"n", AC_ST_F32, 1, s1, x, AC_ST_CUDA, -1};
  CHECK_RC(ac_st_save(path, &neg, 1, NULL, 0, 0), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "tensor 'n' has CUDA device -1");
  /* a device the (fake) driver does not have; a host tensor's device field is ignored */
  st_direct_set_device_ops(&fake_ops);
  fake_reset();
  ac_st_tensor_t two[] = {{"host", AC_ST_F32, 1, s1, x, AC_ST_HOST, 99}, {"far", AC_ST_F32, 1, s1, x, AC_ST_CUDA, 9}};
  CHECK_RC(ac_st_save(path, two, 2, NULL, 0, 0), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "dev.safetensors: tensor 'far' is on CUDA device 9: CUDA device 9 does not exist");
  CHECK_EQ_INT(atomic_load(&fk_checks), 1);
  CHECK_EQ_INT(atomic_load(&fk_allocs), 0);
  CHECK_EQ_INT(dir_count(&temps), 0);
  st_direct_set_device_ops(NULL);
}

TEST(cleanup) {
  clear_dir();
  CHECK(rmdir(tmpdir()) == 0);
}

static const tu_test_t tests[] = {
    TU_CASE(roundtrip_all_dtypes),
    TU_CASE(many_small_tensors_and_subset_reads),
    TU_CASE(names_needing_escapes_roundtrip),
    TU_CASE(parser_accepts_valid_variants),
    TU_CASE(parser_rejects_every_fault),
    TU_CASE(length_prefix_faults),
    TU_CASE(save_argument_errors_create_nothing),
    TU_CASE(failed_write_leaves_old_file_and_no_temp),
    TU_CASE(file_shrinking_after_open_is_a_short_read),
    TU_CASE(dtype_names),
    TU_CASE(direct_bytes_equal_buffered),
    TU_CASE(direct_io_env_values),
    TU_CASE(direct_io_refused_falls_back_or_fails),
    TU_CASE(gpu_tensors_staged_bytes_equal_host),
    TU_CASE(gpu_tensors_staging_failures),
    TU_CASE(gpu_tensors_wait_for_the_callers_ready_event),
    TU_CASE(gpu_tensors_argument_errors),
    TU_CASE(cleanup),
};
TU_MAIN(tests)

/* test_safetensors_header.c — reading a safetensors header (csrc/include/ac/safetensors.h): the
 * 8-byte length prefix, the variants the JSON parser accepts, every fault it refuses (each
 * message names the fault and the file), and the dtype table against the format's spec. */
#define _GNU_SOURCE /* mkdtemp under -std=c11 (st_test_util.h) */
#include "st_test_util.h"

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

TEST(cleanup) { st_remove_tmpdir(); }

static const tu_test_t tests[] = {
    TU_CASE(parser_accepts_valid_variants),
    TU_CASE(parser_rejects_every_fault),
    TU_CASE(length_prefix_faults),
    TU_CASE(dtype_names),
    TU_CASE(cleanup),
};
TU_MAIN(tests)

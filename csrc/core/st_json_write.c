/* st_json_write.c — the writer's header: the 8-byte length, then the JSON object (metadata first,
 * then the tensors in the order given, offsets following that order), space-padded so the data
 * region starts 8-aligned. Strings are escaped as serde_json (the safetensors package) does. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "st_internal.h"

static void wr_le64(unsigned char *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

/* ---- growable byte buffer for the writer's JSON ---------------------------------------------- */

static void db_reserve(st_dbuf *b, size_t more) {
  if (b->oom) return;
  if (b->len + more + 1 <= b->cap) return;
  size_t cap = b->cap ? b->cap : 4096;
  while (cap < b->len + more + 1) {
    if (cap > SIZE_MAX / 2) {
      b->oom = 1;
      return;
    }
    cap *= 2;
  }
  char *q = realloc(b->p, cap);
  if (!q) {
    b->oom = 1;
    return;
  }
  b->p = q;
  b->cap = cap;
}

static void db_put(st_dbuf *b, const char *s, size_t n) {
  db_reserve(b, n);
  if (b->oom) return;
  memcpy(b->p + b->len, s, n);
  b->len += n;
  b->p[b->len] = '\0';
}

static void db_puts(st_dbuf *b, const char *s) { db_put(b, s, strlen(s)); }

static void db_printf(st_dbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void db_printf(st_dbuf *b, const char *fmt, ...) {
  char tmp[64];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
  va_end(ap);
  if (n > 0) db_put(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

/* A JSON string literal; the input is valid UTF-8 (checked by the caller), so only quotes,
 * backslashes and control characters need escaping. The escapes are the ones serde_json (the
 * safetensors package) writes, so both writers produce identical bytes for the same tensors. */
static void db_json_str(st_dbuf *b, const char *s) {
  db_put(b, "\"", 1);
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    unsigned c = *p;
    if (c == '"') db_put(b, "\\\"", 2);
    else if (c == '\\') db_put(b, "\\\\", 2);
    else if (c == '\n') db_put(b, "\\n", 2);
    else if (c == '\r') db_put(b, "\\r", 2);
    else if (c == '\t') db_put(b, "\\t", 2);
    else if (c == '\b') db_put(b, "\\b", 2);
    else if (c == '\f') db_put(b, "\\f", 2);
    else if (c < 0x20) db_printf(b, "\\u%04x", c);
    else db_put(b, (const char *)p, 1);
  }
  db_put(b, "\"", 1);
}

/* Builds the 8-byte length plus the space-padded JSON header; offsets follow the layout order. */
ac_result_t st_json_write_header(const char *path, const st_wr_item *items, size_t n, const ac_st_kv_t *meta,
                                 size_t nmeta, st_dbuf *out, uint64_t *data_size) {
  st_dbuf b = {0};
  db_put(&b, "\0\0\0\0\0\0\0\0{", 9);
  int first = 1;
  if (nmeta) {
    db_puts(&b, "\"__metadata__\":{");
    for (size_t i = 0; i < nmeta; i++) {
      if (i) db_put(&b, ",", 1);
      db_json_str(&b, meta[i].key);
      db_put(&b, ":", 1);
      db_json_str(&b, meta[i].value);
    }
    db_put(&b, "}", 1);
    first = 0;
  }
  uint64_t off = 0;
  for (size_t i = 0; i < n; i++) {
    const ac_st_tensor_t *x = items[i].t;
    if (!first) db_put(&b, ",", 1);
    first = 0;
    db_json_str(&b, x->name);
    db_printf(&b, ":{\"dtype\":\"%s\",\"shape\":[", ac_st_dtype_name(x->dtype));
    for (int32_t d = 0; d < x->ndim; d++) db_printf(&b, d ? ",%lld" : "%lld", (long long)x->shape[d]);
    db_printf(&b, "],\"data_offsets\":[%llu,", (unsigned long long)off);
    off += items[i].nbytes;
    db_printf(&b, "%llu]}", (unsigned long long)off);
  }
  db_put(&b, "}", 1);
  /* Pad so the data region starts 8-aligned: with the layout order every tensor is then aligned
   * to its element size, which lets readers map the file and use the data in place. */
  while (!b.oom && (b.len - 8) % 8) db_put(&b, " ", 1);
  if (b.oom) {
    free(b.p);
    return AC_FAIL(AC_ERR_NOMEM, "%s: out of memory building the header", path);
  }
  wr_le64((unsigned char *)b.p, (uint64_t)(b.len - 8));
  *out = b;
  *data_size = off;
  return AC_OK;
}

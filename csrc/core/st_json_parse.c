/* st_json_parse.c — the strict safetensors header parser: the JSON grammar (strings with their
 * escapes and surrogate pairs, unsigned integers), each tensor entry checked against its dtype
 * and shape, and the layout check (unique names and keys, the data region tiled exactly). Syntax
 * errors name their byte offset in the file. Fuzzed by tests/c/fuzz_safetensors.c. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "st_internal.h"

/* Parser state over the JSON text (not NUL-terminated). */
typedef struct {
  const unsigned char *s, *p, *end;
  const char *label;
} js;

#define JFAIL(j, ...) js_fail((j), __LINE__, __VA_ARGS__)
static ac_result_t js_fail(js *j, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static ac_result_t js_fail(js *j, int line, const char *fmt, ...) {
  char msg[600];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  /* the offset is into the whole file (8-byte length first), which is what a hex dump shows */
  return ac_set_error(AC_ERR_FORMAT, __FILE__, line, NULL, "%s: invalid safetensors header at byte %zu: %s",
                      j->label, (size_t)(j->p - j->s) + 8, msg);
}

static void js_ws(js *j) {
  while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r')) j->p++;
}

/* What the next token looks like, for "expected X, found Y" messages. */
static const char *js_what(const js *j) {
  if (j->p >= j->end) return "the end of the header";
  switch (*j->p) {
    case '"': return "a string";
    case '{': return "an object";
    case '[': return "an array";
    case 't': case 'f': return "a boolean";
    case 'n': return "null";
    case '-': return "a negative number";
    default: return (*j->p >= '0' && *j->p <= '9') ? "a number" : "an unexpected character";
  }
}

static int js_eat(js *j, char c) {
  js_ws(j);
  if (j->p < j->end && *j->p == (unsigned char)c) {
    j->p++;
    return 1;
  }
  return 0;
}

static int hexval(unsigned c) {
  if (c >= '0' && c <= '9') return (int)(c - '0');
  if (c >= 'a' && c <= 'f') return (int)(c - 'a' + 10);
  if (c >= 'A' && c <= 'F') return (int)(c - 'A' + 10);
  return -1;
}

static int read_u4(const unsigned char *p, const unsigned char *end, unsigned *out) {
  if (end - p < 4) return 0;
  unsigned v = 0;
  for (int i = 0; i < 4; i++) {
    int h = hexval(p[i]);
    if (h < 0) return 0;
    v = v * 16 + (unsigned)h;
  }
  *out = v;
  return 1;
}

/* Parses a string literal into a new NUL-terminated UTF-8 string. `ctx` says what it is. */
static ac_result_t js_string(js *j, char **out, const char *ctx) {
  *out = NULL;
  js_ws(j);
  if (j->p >= j->end || *j->p != '"') return JFAIL(j, "expected a string for %s, found %s", ctx, js_what(j));
  const unsigned char *q = j->p + 1;
  while (q < j->end && *q != '"') {
    if (*q == '\\' && j->end - q < 2) break;
    q += (*q == '\\') ? 2 : 1;
  }
  if (q >= j->end || *q != '"') return JFAIL(j, "unterminated string (%s)", ctx);
  /* escapes never expand, so the raw length bounds the decoded one */
  char *buf = malloc((size_t)(q - j->p));
  if (!buf) return AC_FAIL(AC_ERR_NOMEM, "%s: out of memory parsing the header", j->label);
  size_t n = 0;
  j->p++;
  while (j->p < q) {
    unsigned c = *j->p;
    if (c < 0x20) {
      free(buf);
      return JFAIL(j, "control character 0x%02x inside a string (%s)", c, ctx);
    }
    if (c >= 0x80) {
      size_t k = st_utf8_seq(j->p, (size_t)(q - j->p));
      if (!k) {
        free(buf);
        return JFAIL(j, "invalid UTF-8 in a string (%s)", ctx);
      }
      memcpy(buf + n, j->p, k);
      n += k;
      j->p += k;
      continue;
    }
    if (c != '\\') {
      buf[n++] = (char)c;
      j->p++;
      continue;
    }
    unsigned e = j->p[1], cp;
    const char *simple = strchr("\"\\/bfnrt", (int)e);
    if (e && simple) {
      static const char map[] = "\"\\/\b\f\n\r\t";
      buf[n++] = map[simple - "\"\\/bfnrt"];
      j->p += 2;
      continue;
    }
    if (e != 'u' || !read_u4(j->p + 2, q, &cp)) {
      free(buf);
      return JFAIL(j, "invalid escape sequence in a string (%s)", ctx);
    }
    j->p += 6;
    if (cp >= 0xDC00 && cp <= 0xDFFF) {
      free(buf);
      return JFAIL(j, "unpaired UTF-16 surrogate \\u%04x in a string (%s)", cp, ctx);
    }
    if (cp >= 0xD800 && cp <= 0xDBFF) {
      unsigned lo;
      if (q - j->p < 6 || j->p[0] != '\\' || j->p[1] != 'u' || !read_u4(j->p + 2, q, &lo) || lo < 0xDC00 ||
          lo > 0xDFFF) {
        free(buf);
        return JFAIL(j, "unpaired UTF-16 surrogate \\u%04x in a string (%s)", cp, ctx);
      }
      j->p += 6;
      cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
    }
    if (cp == 0) {
      free(buf);
      return JFAIL(j, "\\u0000 inside a string (%s) is not supported", ctx);
    }
    if (cp < 0x80) buf[n++] = (char)cp;
    else if (cp < 0x800) {
      buf[n++] = (char)(0xC0 | (cp >> 6));
      buf[n++] = (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      buf[n++] = (char)(0xE0 | (cp >> 12));
      buf[n++] = (char)(0x80 | ((cp >> 6) & 0x3F));
      buf[n++] = (char)(0x80 | (cp & 0x3F));
    } else {
      buf[n++] = (char)(0xF0 | (cp >> 18));
      buf[n++] = (char)(0x80 | ((cp >> 12) & 0x3F));
      buf[n++] = (char)(0x80 | ((cp >> 6) & 0x3F));
      buf[n++] = (char)(0x80 | (cp & 0x3F));
    }
  }
  j->p = q + 1;
  buf[n] = '\0';
  *out = buf;
  return AC_OK;
}

/* A non-negative integer no larger than `max` (JSON grammar: no leading zeros, no sign). */
static ac_result_t js_uint(js *j, uint64_t max, uint64_t *out, const char *ctx, const char *tname) {
  char nb[128];
  js_ws(j);
  if (j->p < j->end && *j->p == '-')
    return JFAIL(j, "tensor '%s': %s must not be negative", st_show(tname, nb, sizeof nb), ctx);
  if (j->p >= j->end || *j->p < '0' || *j->p > '9')
    return JFAIL(j, "tensor '%s': expected an integer in %s, found %s", st_show(tname, nb, sizeof nb), ctx, js_what(j));
  const unsigned char *start = j->p;
  uint64_t v = 0;
  int big = 0;
  while (j->p < j->end && *j->p >= '0' && *j->p <= '9') {
    unsigned d = *j->p - '0';
    if (v > (UINT64_MAX - d) / 10) big = 1;
    else v = v * 10 + d;
    j->p++;
  }
  if (*start == '0' && j->p - start > 1)
    return JFAIL(j, "tensor '%s': number with a leading zero in %s", st_show(tname, nb, sizeof nb), ctx);
  if (j->p < j->end && (*j->p == '.' || *j->p == 'e' || *j->p == 'E'))
    return JFAIL(j, "tensor '%s': %s must be integers, found a fraction or exponent", st_show(tname, nb, sizeof nb),
                 ctx);
  if (big || v > max)
    return JFAIL(j, "tensor '%s': value in %s is too large", st_show(tname, nb, sizeof nb), ctx);
  *out = v;
  return AC_OK;
}

static ac_result_t js_sep(js *j, char close, const char *ctx, int *more) {
  if (js_eat(j, ',')) {
    *more = 1;
    return AC_OK;
  }
  if (js_eat(j, close)) {
    *more = 0;
    return AC_OK;
  }
  return JFAIL(j, "expected ',' or '%c' in %s, found %s", close, ctx, js_what(j));
}

static ac_result_t parse_metadata(js *j, ac_st_header_t *h) {
  char nb[128];
  if (!js_eat(j, '{')) return JFAIL(j, "__metadata__ must be an object of strings, found %s", js_what(j));
  h->has_meta = 1;
  if (js_eat(j, '}')) return AC_OK;
  for (;;) {
    char *k = NULL, *v = NULL;
    AC_CHECK(js_string(j, &k, "a __metadata__ key"));
    if (!js_eat(j, ':')) {
      ac_result_t r = JFAIL(j, "expected ':' after __metadata__ key '%s'", st_show(k, nb, sizeof nb));
      free(k);
      return r;
    }
    js_ws(j);
    if (j->p >= j->end || *j->p != '"') {
      ac_result_t r = JFAIL(j, "__metadata__ value of '%s' must be a string, found %s", st_show(k, nb, sizeof nb), js_what(j));
      free(k);
      return r;
    }
    ac_result_t r = js_string(j, &v, "a __metadata__ value");
    if (r != AC_OK) {
      free(k);
      return r;
    }
    if (h->nmeta == h->capmeta) {
      size_t cap = h->capmeta ? 2 * h->capmeta : 8;
      char **a = realloc(h->mkey, cap * sizeof *a);
      if (a) h->mkey = a;
      char **b = a ? realloc(h->mval, cap * sizeof *b) : NULL;
      if (b) h->mval = b;
      if (!a || !b) {
        free(k);
        free(v);
        return AC_FAIL(AC_ERR_NOMEM, "%s: out of memory parsing the header", j->label);
      }
      h->capmeta = cap;
    }
    h->mkey[h->nmeta] = k;
    h->mval[h->nmeta] = v;
    h->nmeta++;
    int more = 0;
    AC_CHECK(js_sep(j, '}', "__metadata__", &more));
    if (!more) return AC_OK;
  }
}

/* Parses one tensor entry {"dtype":..., "shape":[...], "data_offsets":[b, e]} into *e. */
static ac_result_t parse_tensor(js *j, st_entry *e, uint64_t data_size) {
  char nb[128];
  const char *nm = st_show(e->name, nb, sizeof nb);
  if (!js_eat(j, '{')) return JFAIL(j, "tensor '%s': expected an object, found %s", nm, js_what(j));
  int have_dtype = 0, have_shape = 0, have_off = 0;
  size_t cap = 0;
  if (js_eat(j, '}')) return JFAIL(j, "tensor '%s': empty entry (needs dtype, shape, data_offsets)", nm);
  for (;;) {
    char *key = NULL;
    AC_CHECK(js_string(j, &key, "a tensor field name"));
    if (!js_eat(j, ':')) {
      free(key);
      return JFAIL(j, "tensor '%s': expected ':' after a field name", nm);
    }
    if (strcmp(key, "dtype") == 0) {
      free(key);
      if (have_dtype) return JFAIL(j, "tensor '%s': field 'dtype' appears twice", nm);
      char *dt = NULL;
      AC_CHECK(js_string(j, &dt, "dtype"));
      int ok = st_dtype_lookup(dt, &e->dtype);
      if (!ok) {
        char db[128];
        int sub = strcmp(dt, "F4") == 0 || strncmp(dt, "F6_", 3) == 0;
        ac_result_t r = JFAIL(j, "tensor '%s': %s dtype '%s'", nm, sub ? "unsupported sub-byte" : "unknown",
                              st_show(dt, db, sizeof db));
        free(dt);
        return r;
      }
      free(dt);
      have_dtype = 1;
    } else if (strcmp(key, "shape") == 0) {
      free(key);
      if (have_shape) return JFAIL(j, "tensor '%s': field 'shape' appears twice", nm);
      if (!js_eat(j, '[')) return JFAIL(j, "tensor '%s': shape must be an array, found %s", nm, js_what(j));
      have_shape = 1;
      if (!js_eat(j, ']')) {
        for (;;) {
          uint64_t v;
          AC_CHECK(js_uint(j, (uint64_t)INT64_MAX, &v, "shape", e->name));
          if ((size_t)e->ndim == cap) {
            if (cap >= (size_t)INT32_MAX / 2) return JFAIL(j, "tensor '%s': too many dimensions", nm);
            cap = cap ? 2 * cap : 4;
            int64_t *s = realloc(e->shape, cap * sizeof *s);
            if (!s) return AC_FAIL(AC_ERR_NOMEM, "%s: out of memory parsing the header", j->label);
            e->shape = s;
          }
          e->shape[e->ndim++] = (int64_t)v;
          int more = 0;
          AC_CHECK(js_sep(j, ']', "shape", &more));
          if (!more) break;
        }
      }
    } else if (strcmp(key, "data_offsets") == 0) {
      free(key);
      if (have_off) return JFAIL(j, "tensor '%s': field 'data_offsets' appears twice", nm);
      if (!js_eat(j, '[')) return JFAIL(j, "tensor '%s': data_offsets must be an array, found %s", nm, js_what(j));
      AC_CHECK(js_uint(j, UINT64_MAX, &e->begin, "data_offsets", e->name));
      if (!js_eat(j, ',')) return JFAIL(j, "tensor '%s': data_offsets must hold exactly two integers", nm);
      AC_CHECK(js_uint(j, UINT64_MAX, &e->end, "data_offsets", e->name));
      if (!js_eat(j, ']')) return JFAIL(j, "tensor '%s': data_offsets must hold exactly two integers", nm);
      have_off = 1;
    } else {
      char kb[128];
      ac_result_t r = JFAIL(j, "tensor '%s': unknown field '%s'", nm, st_show(key, kb, sizeof kb));
      free(key);
      return r;
    }
    int more = 0;
    AC_CHECK(js_sep(j, '}', "a tensor entry", &more));
    if (!more) break;
  }
  if (!have_dtype || !have_shape || !have_off)
    return JFAIL(j, "tensor '%s': missing field '%s'", nm, !have_dtype ? "dtype" : !have_shape ? "shape" : "data_offsets");
  if (e->begin > e->end)
    return JFAIL(j, "tensor '%s': data_offsets [%llu, %llu] end before they begin", nm, (unsigned long long)e->begin,
                 (unsigned long long)e->end);
  if (e->end > data_size)
    return JFAIL(j, "tensor '%s': data_offsets [%llu, %llu] run past the end of the data region (%llu bytes)", nm,
                 (unsigned long long)e->begin, (unsigned long long)e->end, (unsigned long long)data_size);
  int ovf;
  uint64_t need = st_nbytes_of(e->shape, e->ndim, ac_st_dtype_size(e->dtype), &ovf);
  if (ovf) return JFAIL(j, "tensor '%s': shape is too large (the byte size overflows)", nm);
  if (need != e->end - e->begin)
    return JFAIL(j, "tensor '%s': data_offsets span %llu bytes but dtype %s with %d dims needs %llu", nm,
                 (unsigned long long)(e->end - e->begin), ac_st_dtype_name(e->dtype), (int)e->ndim,
                 (unsigned long long)need);
  return AC_OK;
}

static int cmp_offsets(const void *a, const void *b) {
  const st_entry *x = a, *y = b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  if (x->end != y->end) return x->end < y->end ? -1 : 1;
  return strcmp(x->name, y->name);
}

/* qsort has no context argument: sort (index, name) pairs instead. */
typedef struct {
  const char *name;
  size_t idx;
} name_idx;
static int cmp_name_idx(const void *a, const void *b) {
  return strcmp(((const name_idx *)a)->name, ((const name_idx *)b)->name);
}

static ac_result_t check_layout(ac_st_header_t *h, const char *label) {
  char na[128], nb[128];
  if (h->n) qsort(h->t, h->n, sizeof *h->t, cmp_offsets);
  /* names unique (metadata key excluded: it is not a tensor) */
  name_idx *ni = malloc((h->n ? h->n : 1) * sizeof *ni);
  if (!ni) return AC_FAIL(AC_ERR_NOMEM, "%s: out of memory", label);
  for (size_t i = 0; i < h->n; i++) ni[i] = (name_idx){h->t[i].name, i};
  if (h->n) qsort(ni, h->n, sizeof *ni, cmp_name_idx);
  for (size_t i = 1; i < h->n; i++)
    if (strcmp(ni[i - 1].name, ni[i].name) == 0) {
      ac_result_t r = AC_FAIL(AC_ERR_FORMAT, "%s: invalid safetensors header: tensor name '%s' appears twice", label,
                              st_show(ni[i].name, na, sizeof na));
      free(ni);
      return r;
    }
  h->by_name = malloc((h->n ? h->n : 1) * sizeof *h->by_name);
  if (!h->by_name) {
    free(ni);
    return AC_FAIL(AC_ERR_NOMEM, "%s: out of memory", label);
  }
  for (size_t i = 0; i < h->n; i++) h->by_name[i] = ni[i].idx;
  free(ni);
  for (size_t i = 1; i < h->nmeta; i++)
    for (size_t k = 0; k < i; k++) /* metadata is small (a handful of keys) */
      if (strcmp(h->mkey[i], h->mkey[k]) == 0)
        return AC_FAIL(AC_ERR_FORMAT, "%s: invalid safetensors header: __metadata__ key '%s' appears twice", label,
                       st_show(h->mkey[i], na, sizeof na));
  /* Sorted by offset, the ranges must tile [0, data_size) exactly: an overlap means two tensors
   * share bytes, a hole or trailing bytes mean data nobody owns (a sign of a corrupt or spliced
   * file). Zero-byte tensors occupy no range and may sit anywhere inside the region. */
  uint64_t pos = 0;
  size_t holder = SIZE_MAX; /* the tensor that ends at pos */
  for (size_t i = 0; i < h->n; i++) {
    const st_entry *e = &h->t[i];
    if (e->begin == e->end) continue;
    if (e->begin > pos) {
      if (holder == SIZE_MAX)
        return AC_FAIL(AC_ERR_FORMAT, "%s: invalid safetensors header: hole at bytes [0, %llu) of the data region "
                       "before tensor '%s'", label, (unsigned long long)e->begin, st_show(e->name, na, sizeof na));
      return AC_FAIL(AC_ERR_FORMAT, "%s: invalid safetensors header: hole at bytes [%llu, %llu) of the data region "
                     "between tensors '%s' and '%s'", label, (unsigned long long)pos, (unsigned long long)e->begin,
                     st_show(h->t[holder].name, na, sizeof na), st_show(e->name, nb, sizeof nb));
    }
    if (e->begin < pos)
      return AC_FAIL(AC_ERR_FORMAT, "%s: invalid safetensors header: tensors '%s' [%llu, %llu) and '%s' [%llu, %llu) "
                     "overlap", label, st_show(h->t[holder].name, na, sizeof na),
                     (unsigned long long)h->t[holder].begin, (unsigned long long)h->t[holder].end, st_show(e->name, nb, sizeof nb),
                     (unsigned long long)e->begin, (unsigned long long)e->end);
    pos = e->end;
    holder = i;
  }
  if (pos != h->data_size)
    return AC_FAIL(AC_ERR_FORMAT, "%s: invalid safetensors header: the data region is %llu bytes but the tensors "
                   "cover only [0, %llu) (trailing bytes or a truncated header)", label,
                   (unsigned long long)h->data_size, (unsigned long long)pos);
  return AC_OK;
}

ac_result_t st_json_parse_header(ac_st_header_t *h, const unsigned char *s, size_t len, const char *label) {
  js j = {.s = s, .p = s, .end = s + len, .label = label};
  char nb[128];
  if (len == 0 || s[0] != '{') return JFAIL(&j, "the header must start with '{' (found %s)", js_what(&j));
  j.p++;
  if (!js_eat(&j, '}')) {
    for (;;) {
      char *key = NULL;
      AC_CHECK(js_string(&j, &key, "a tensor name"));
      if (!js_eat(&j, ':')) {
        ac_result_t r = JFAIL(&j, "expected ':' after key '%s'", st_show(key, nb, sizeof nb));
        free(key);
        return r;
      }
      if (strcmp(key, "__metadata__") == 0) {
        free(key);
        if (h->has_meta) return JFAIL(&j, "key '__metadata__' appears twice");
        AC_CHECK(parse_metadata(&j, h));
      } else {
        if (h->n == h->cap) {
          size_t cap = h->cap ? 2 * h->cap : 16;
          st_entry *t = realloc(h->t, cap * sizeof *t);
          if (!t) {
            free(key);
            return AC_FAIL(AC_ERR_NOMEM, "%s: out of memory parsing the header", label);
          }
          h->t = t;
          h->cap = cap;
        }
        st_entry *e = &h->t[h->n++];
        memset(e, 0, sizeof *e);
        e->name = key; /* owned by the header from here on, also on failure */
        AC_CHECK(parse_tensor(&j, e, h->data_size));
      }
      int more = 0;
      AC_CHECK(js_sep(&j, '}', "the header object", &more));
      if (!more) break;
    }
  }
  js_ws(&j);
  if (j.p != j.end) return JFAIL(&j, "unexpected content after the header object (%s)", js_what(&j));
  return check_layout(h, label);
}

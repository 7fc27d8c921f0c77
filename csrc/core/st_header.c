/* st_header.c — the parsed safetensors header (ac_st_header_t): the 8-byte length checked
 * against the limit and the file size before the JSON is parsed (st_json_parse.c), and the
 * queries on the result. */
#include <stdlib.h>
#include <string.h>

#include "st_internal.h"

void ac_st_header_destroy(ac_st_header_t *h) {
  if (!h) return;
  for (size_t i = 0; i < h->n; i++) {
    free(h->t[i].name);
    free(h->t[i].shape);
  }
  for (size_t i = 0; i < h->nmeta; i++) {
    free(h->mkey[i]);
    free(h->mval[i]);
  }
  free(h->t);
  free(h->by_name);
  free(h->mkey);
  free(h->mval);
  free(h);
}

ac_result_t ac_st_header_parse(ac_st_header_t **out, const void *buf, size_t len, uint64_t file_size,
                               const char *label) {
  if (!out) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_st_header_parse: out is NULL");
  *out = NULL;
  if (!label) label = "<memory>";
  if (!buf && len) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: buf is NULL", label);
  if (len > file_size) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: buffer (%zu bytes) is longer than the file", label, len);
  if (file_size < 8)
    return AC_FAIL(AC_ERR_FORMAT, "%s: not a safetensors file: %llu bytes, too short for the 8-byte header length",
                   label, (unsigned long long)file_size);
  if (len < 8) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: the buffer must hold at least the 8-byte header length", label);
  uint64_t n = st_rd_le64(buf);
  if (n > AC_ST_MAX_HEADER)
    return AC_FAIL_HINT(AC_ERR_FORMAT, "is this a safetensors file?",
                        "%s: header length %llu exceeds the %llu-byte limit", label, (unsigned long long)n,
                        (unsigned long long)AC_ST_MAX_HEADER);
  if (n > file_size - 8)
    return AC_FAIL(AC_ERR_FORMAT, "%s: header length %llu runs past the end of the file (%llu bytes)", label,
                   (unsigned long long)n, (unsigned long long)file_size);
  if (len < 8 + n)
    return AC_FAIL(AC_ERR_INVALID_ARG, "%s: the buffer (%zu bytes) does not hold the whole header (%llu bytes)", label,
                   len, (unsigned long long)(8 + n));
  ac_st_header_t *h = calloc(1, sizeof *h);
  if (!h) return AC_FAIL(AC_ERR_NOMEM, "%s: out of memory", label);
  h->data_start = 8 + n;
  h->data_size = file_size - 8 - n;
  ac_result_t r = st_json_parse_header(h, (const unsigned char *)buf + 8, (size_t)n, label);
  if (r != AC_OK) {
    ac_st_header_destroy(h);
    return r;
  }
  *out = h;
  return AC_OK;
}

size_t ac_st_header_count(const ac_st_header_t *h) { return h ? h->n : 0; }

ac_result_t ac_st_header_info(const ac_st_header_t *h, size_t i, ac_st_info_t *out) {
  if (!h || !out || i >= h->n)
    return AC_FAIL(AC_ERR_INVALID_ARG, "ac_st_header_info: index %zu out of range (%zu tensors)", i, h ? h->n : 0);
  const st_entry *e = &h->t[i];
  out->name = e->name;
  out->dtype = e->dtype;
  out->ndim = e->ndim;
  out->shape = e->shape;
  out->begin = e->begin;
  out->end = e->end;
  out->file_offset = h->data_start + e->begin;
  out->nbytes = e->end - e->begin;
  return AC_OK;
}

ac_result_t ac_st_header_find(const ac_st_header_t *h, const char *name, size_t *index) {
  char nb[128];
  if (!h || !name || !index) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_st_header_find: NULL argument");
  size_t lo = 0, hi = h->n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int c = strcmp(h->t[h->by_name[mid]].name, name);
    if (c == 0) {
      *index = h->by_name[mid];
      return AC_OK;
    }
    if (c < 0) lo = mid + 1;
    else hi = mid;
  }
  return AC_FAIL(AC_ERR_INVALID_ARG, "no tensor named '%s' in the file", st_show(name, nb, sizeof nb));
}

uint64_t ac_st_header_data_start(const ac_st_header_t *h) { return h ? h->data_start : 0; }
int ac_st_header_has_metadata(const ac_st_header_t *h) { return h ? h->has_meta : 0; }
size_t ac_st_header_metadata_count(const ac_st_header_t *h) { return h ? h->nmeta : 0; }

ac_result_t ac_st_header_metadata(const ac_st_header_t *h, size_t i, const char **key, const char **value) {
  if (!h || !key || !value || i >= h->nmeta)
    return AC_FAIL(AC_ERR_INVALID_ARG, "ac_st_header_metadata: index %zu out of range", i);
  *key = h->mkey[i];
  *value = h->mval[i];
  return AC_OK;
}

/* st_text.c — text rules shared by the safetensors writer and parser: UTF-8 validity (names and
 * metadata must be valid UTF-8 in the file), and names as error messages show them. */
#include <string.h>

#include "st_internal.h"

/* Names come from files and users: cut them short and hide control bytes so an error message
 * stays one readable line. */
#define SHOW_MAX 96
const char *st_show(const char *s, char *buf, size_t cap) {
  if (!s) return "(null)";
  size_t j = 0, i = 0;
  for (; s[i] && j + 4 < cap && i < SHOW_MAX; i++) buf[j++] = ((unsigned char)s[i] < 0x20 || s[i] == 0x7f) ? '?' : s[i];
  if (s[i]) {
    buf[j++] = '.';
    buf[j++] = '.';
    buf[j++] = '.';
  }
  buf[j] = '\0';
  return buf;
}

/* Length of the valid UTF-8 sequence starting at p (at most n bytes available), 0 if invalid
 * (overlong forms, surrogates and code points above U+10FFFF are invalid, as in RFC 3629). */
size_t st_utf8_seq(const unsigned char *p, size_t n) {
  unsigned c = p[0];
  if (c < 0x80) return 1;
  size_t len;
  unsigned lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) len = 2;
  else if (c == 0xE0) len = 3, lo = 0xA0;
  else if (c == 0xED) len = 3, hi = 0x9F;
  else if (c >= 0xE1 && c <= 0xEF) len = 3;
  else if (c == 0xF0) len = 4, lo = 0x90;
  else if (c >= 0xF1 && c <= 0xF3) len = 4;
  else if (c == 0xF4) len = 4, hi = 0x8F;
  else return 0;
  if (n < len) return 0;
  if (p[1] < lo || p[1] > hi) return 0;
  for (size_t k = 2; k < len; k++)
    if (p[k] < 0x80 || p[k] > 0xBF) return 0;
  return len;
}

int st_utf8_valid(const char *s) {
  const unsigned char *p = (const unsigned char *)s;
  size_t n = strlen(s);
  while (n) {
    size_t k = st_utf8_seq(p, n);
    if (!k) return 0;
    p += k;
    n -= k;
  }
  return 1;
}

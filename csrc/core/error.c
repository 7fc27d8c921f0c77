/* error.c — result-code names and the per-thread last-error message. */
#include "ac/ac.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* One buffer per thread, so concurrent Python threads never see each other's message. Pool
 * tasks cannot fail today; a fallible task would have to hand its message to the caller. */
static _Thread_local char tls_msg[1024];

const char *ac_result_string(ac_result_t r) {
  switch (r) {
    case AC_OK: return "AC_OK";
    case AC_ERR_INVALID_ARG: return "AC_ERR_INVALID_ARG";
    case AC_ERR_NOMEM: return "AC_ERR_NOMEM";
    case AC_ERR_UNSUPPORTED: return "AC_ERR_UNSUPPORTED";
    case AC_ERR_IO: return "AC_ERR_IO";
    case AC_ERR_FORMAT: return "AC_ERR_FORMAT";
    case AC_ERR_CUDA: return "AC_ERR_CUDA";
    case AC_ERR_COMM: return "AC_ERR_COMM";
    case AC_ERR_TIMEOUT: return "AC_ERR_TIMEOUT";
    case AC_ERR_INTERNAL: return "AC_ERR_INTERNAL";
    case AC_ERR_STATE: return "AC_ERR_STATE";
  }
  return "AC_ERR_UNKNOWN";
}

const char *ac_last_error(void) { return tls_msg; }

void ac_clear_error(void) { tls_msg[0] = '\0'; }

ac_result_t ac_restore_error(ac_result_t code, const char *saved) {
  snprintf(tls_msg, sizeof tls_msg, "%s", saved ? saved : "");
  return code;
}

ac_result_t ac_set_error(ac_result_t code, const char *file, int line, const char *hint,
                         const char *fmt, ...) {
  const char *base = strrchr(file, '/');
  base = base ? base + 1 : file;
  int off = snprintf(tls_msg, sizeof tls_msg, "%s:%d: ", base, line);
  if (off < 0 || (size_t)off >= sizeof tls_msg) off = 0;
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(tls_msg + off, sizeof tls_msg - (size_t)off, fmt, ap);
  va_end(ap);
  if (n > 0) off += n;
  if (hint && (size_t)off < sizeof tls_msg)
    snprintf(tls_msg + off, sizeof tls_msg - (size_t)off, " (hint: %s)", hint);
  return code;
}

/* ac.h — result codes and the thread-local last-error message shared by every part of the core. */
#ifndef AC_AC_H
#define AC_AC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Every fallible core function returns one of these. Values are explicit and never reused,
 * because the Python layer and logs print them. */
typedef enum {
  AC_OK = 0,
  AC_ERR_INVALID_ARG = 1,  /* a caller passed a value the function cannot accept */
  AC_ERR_NOMEM = 2,        /* an allocation failed */
  AC_ERR_UNSUPPORTED = 3,  /* valid request, but not built / not available here */
  AC_ERR_IO = 4,           /* a file or OS call failed (errno is in the message) */
  AC_ERR_FORMAT = 5,       /* input data is malformed (e.g. a corrupt file header) */
  AC_ERR_CUDA = 6,         /* a CUDA runtime call failed */
  AC_ERR_COMM = 7,         /* a collective failed */
  AC_ERR_TIMEOUT = 8,      /* something waited longer than it was allowed to */
  AC_ERR_INTERNAL = 9,     /* a bug in accelerate_c: please report */
  AC_ERR_STATE = 10        /* call made in the wrong order / on a handle in the wrong state */
} ac_result_t;

/* Short constant name of a result code ("AC_ERR_NOMEM"); never NULL. */
const char *ac_result_string(ac_result_t r);

/* Message of the last error set on this thread ("" if none): "file:line: text (hint: ...)".
 * The pointer stays valid until the next ac_set_error on the same thread. */
const char *ac_last_error(void);

/* Records an error for this thread and returns `code`, so it can be used as `return AC_FAIL(...)`.
 * `hint` may be NULL. Thread-safe (thread-local storage). */
ac_result_t ac_set_error(ac_result_t code, const char *file, int line, const char *hint,
                         const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 5, 6)))
#endif
    ;

/* Clears this thread's message. */
void ac_clear_error(void);

/* Puts back, as it was, a message copied earlier from ac_last_error (a caller that runs more
 * work after a first failure and reports that first one); returns `code`. */
ac_result_t ac_restore_error(ac_result_t code, const char *saved);

#define AC_FAIL(code, ...) ac_set_error((code), __FILE__, __LINE__, NULL, __VA_ARGS__)
#define AC_FAIL_HINT(code, hint, ...) ac_set_error((code), __FILE__, __LINE__, (hint), __VA_ARGS__)

/* Propagate a failure unchanged (the callee already set the message). */
#define AC_CHECK(expr)                      \
  do {                                      \
    ac_result_t ac_r_ = (expr);             \
    if (ac_r_ != AC_OK) return ac_r_;       \
  } while (0)

/* Same, for functions with a cleanup label: stores the code in `res` and jumps. */
#define AC_CHECK_GOTO(expr, res, label)     \
  do {                                      \
    (res) = (expr);                         \
    if ((res) != AC_OK) goto label;         \
  } while (0)

#ifdef __cplusplus
}
#endif
#endif /* AC_AC_H */

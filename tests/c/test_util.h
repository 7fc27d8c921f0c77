/* test_util.h — a tiny unit-test harness for the C core tests (header only).
 *
 * Write tests as functions declared with TEST(name), list them in a tu_test_t table, and end
 * the file with TU_MAIN(table):
 *
 *   TEST(adds) { CHECK(1 + 1 == 2); CHECK_EQ_INT(2 * 2, 4); }
 *   static const tu_test_t tests[] = { TU_CASE(adds), TU_KNOWN_BUG(nan_payload, "why") };
 *   TU_MAIN(tests)
 *
 * Counting unit: TEST FUNCTIONS. A test passes when none of its checks failed. Every failed
 * check prints "file:line: CHECK failed: <expr> [details]" to stdout (after the first
 * TU_MAX_REPORTS failures of one test the rest are only counted, so a failing loop over 65536
 * values does not flood the log).
 *
 * The last line printed is exactly "N passed, M failed". The exit status is 0 only when M == 0.
 * A test registered with TU_KNOWN_BUG documents a known defect of the core: its failures are
 * printed and counted on a separate "known bugs" line but do not fail the run (set
 * AC_TEST_STRICT=1 to count them as failures). If such a test passes, it says so ("fixed?").
 *
 * Arguments: `prog [substring ...]` runs only the tests whose name contains one of them.
 * Checks may be used from several threads (counters are atomic), but the usual pattern is to
 * collect results in worker threads and CHECK them on the main thread. */
#ifndef AC_TEST_UTIL_H
#define AC_TEST_UTIL_H

#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ac/ac.h"

#define TU_MAX_REPORTS 20

typedef void (*tu_fn)(void);
typedef struct {
  const char *name;
  tu_fn fn;
  const char *known_bug; /* NULL for an ordinary test; else a one-line description */
} tu_test_t;

#define TEST(name) static void test_##name(void)
#define TU_CASE(name) {#name, test_##name, NULL}
#define TU_KNOWN_BUG(name, why) {#name, test_##name, (why)}

/* Failed checks in the current test (reset per test), and in the whole run. */
static _Atomic long tu_cur_fail __attribute__((unused));
static _Atomic long tu_cur_checks __attribute__((unused));

__attribute__((format(printf, 4, 5))) static inline void tu_fail(const char *file, int line,
                                                                   const char *expr, const char *fmt,
                                                                   ...) {
  long k = atomic_fetch_add(&tu_cur_fail, 1);
  if (k < TU_MAX_REPORTS) {
    char extra[512] = "";
    if (fmt && fmt[0]) {
      va_list ap;
      va_start(ap, fmt);
      vsnprintf(extra, sizeof extra, fmt, ap);
      va_end(ap);
    }
    const char *base = strrchr(file, '/');
    base = base ? base + 1 : file;
    printf("%s:%d: CHECK failed: %s%s%s\n", base, line, expr, extra[0] ? "  -- " : "", extra);
  } else if (k == TU_MAX_REPORTS) {
    printf("    (further failures in this test are counted but not printed)\n");
  }
  fflush(stdout);
}

/* Every check evaluates to 1 if it passed, 0 if not, so callers can `if (!CHECK(..)) break;`. */
#define TU_COUNT() atomic_fetch_add_explicit(&tu_cur_checks, 1, memory_order_relaxed)

#define CHECK(cond) \
  (TU_COUNT(), (cond) ? 1 : (tu_fail(__FILE__, __LINE__, #cond, NULL), 0))

#define CHECK_MSG(cond, ...) \
  (TU_COUNT(), (cond) ? 1 : (tu_fail(__FILE__, __LINE__, #cond, __VA_ARGS__), 0))

#define CHECK_EQ_INT(a, b) \
  (TU_COUNT(), tu_eq_ll_((long long)(a), (long long)(b), __FILE__, __LINE__, #a " == " #b))
#define CHECK_EQ_HEX(a, b)                                                                     \
  (TU_COUNT(), tu_eq_hex_((unsigned long long)(a), (unsigned long long)(b), __FILE__, __LINE__, \
                          #a " == " #b))
#define CHECK_STREQ(a, b) (TU_COUNT(), tu_streq_((a), (b), __FILE__, __LINE__, #a " == " #b))
#define CHECK_CONTAINS(hay, needle) \
  (TU_COUNT(), tu_contains_((hay), (needle), __FILE__, __LINE__, #hay " contains " #needle))
/* |a - b| <= rel * max(|a|, |b|), or both NaN, or equal (covers equal infinities). */
#define CHECK_CLOSE(a, b, rel) \
  (TU_COUNT(), tu_close_((double)(a), (double)(b), (rel), __FILE__, __LINE__, #a " ~= " #b))

/* An ac_result_t call that must return `want`; prints the names and ac_last_error() if not. */
#define CHECK_RC(expr, want) (TU_COUNT(), tu_rc_ok_((expr), (want), __FILE__, __LINE__, #expr))
#define CHECK_OK(expr) CHECK_RC(expr, AC_OK)

static inline const char *tu_s_(const char *s) { return s ? s : "(null)"; }
static inline int tu_eq_ll_(long long a, long long b, const char *f, int l, const char *e) {
  if (a == b) return 1;
  tu_fail(f, l, e, "%lld != %lld", a, b);
  return 0;
}
static inline int tu_eq_hex_(unsigned long long a, unsigned long long b, const char *f, int l,
                             const char *e) {
  if (a == b) return 1;
  tu_fail(f, l, e, "0x%llx != 0x%llx", a, b);
  return 0;
}
static inline int tu_streq_(const char *a, const char *b, const char *f, int l, const char *e) {
  if (a && b && strcmp(a, b) == 0) return 1;
  tu_fail(f, l, e, "\"%s\" != \"%s\"", tu_s_(a), tu_s_(b));
  return 0;
}
static inline int tu_contains_(const char *h, const char *n, const char *f, int l, const char *e) {
  if (h && n && strstr(h, n)) return 1;
  tu_fail(f, l, e, "\"%s\" does not contain \"%s\"", tu_s_(h), tu_s_(n));
  return 0;
}
static inline int tu_close_(double a, double b, double rel, const char *f, int l, const char *e) {
  int ok;
  if (isnan(a) || isnan(b)) {
    ok = isnan(a) && isnan(b);
  } else if (a == b) {
    ok = 1;
  } else {
    double m = fabs(a) > fabs(b) ? fabs(a) : fabs(b);
    ok = fabs(a - b) <= rel * m;
  }
  if (!ok) tu_fail(f, l, e, "%.17g vs %.17g (rel %.3g)", a, b, rel);
  return ok;
}
static inline int tu_rc_ok_(ac_result_t got, ac_result_t want, const char *file, int line,
                            const char *expr) {
  if (got == want) return 1;
  tu_fail(file, line, expr, "returned %s (%d), wanted %s; last error: \"%s\"",
          ac_result_string(got), (int)got, ac_result_string(want), ac_last_error());
  return 0;
}

/* Has the current test already failed? (lets a long loop stop early) */
static inline int tu_failed(void) { return atomic_load(&tu_cur_fail) != 0; }

static inline double tu_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* xorshift64* — deterministic pseudo-random numbers for the tests. */
typedef struct {
  uint64_t s;
} tu_rng_t;
static inline uint64_t tu_rand64(tu_rng_t *r) {
  r->s ^= r->s >> 12;
  r->s ^= r->s << 25;
  r->s ^= r->s >> 27;
  return r->s * 0x2545F4914F6CDD1DULL;
}
static inline uint32_t tu_rand32(tu_rng_t *r) { return (uint32_t)(tu_rand64(r) >> 32); }
/* Uniform in [0, n). */
static inline uint32_t tu_randn(tu_rng_t *r, uint32_t n) {
  return (uint32_t)(((tu_rand64(r) >> 32) * (uint64_t)n) >> 32);
}

static inline int tu_selected(const char *name, int argc, char **argv) {
  if (argc <= 1) return 1;
  for (int i = 1; i < argc; i++)
    if (strstr(name, argv[i])) return 1;
  return 0;
}

static inline int tu_run_all(const char *prog, const tu_test_t *tests, size_t ntests, int argc,
                             char **argv) {
  const char *strict_env = getenv("AC_TEST_STRICT");
  int strict = strict_env && strcmp(strict_env, "1") == 0;
  int passed = 0, failed = 0, known = 0, fixed = 0;
  double t_all = tu_now();
  printf("== %s\n", prog);
  for (size_t i = 0; i < ntests; i++) {
    const tu_test_t *t = &tests[i];
    if (!tu_selected(t->name, argc, argv)) continue;
    atomic_store(&tu_cur_fail, 0);
    atomic_store(&tu_cur_checks, 0);
    printf("[ RUN  ] %s\n", t->name);
    fflush(stdout);
    double t0 = tu_now();
    ac_clear_error();
    t->fn();
    double dt = tu_now() - t0;
    long nf = atomic_load(&tu_cur_fail), nc = atomic_load(&tu_cur_checks);
    if (nf == 0) {
      passed++;
      if (t->known_bug) {
        fixed++;
        printf("[  OK  ] %s (%ld checks, %.2f s) -- registered as a known bug (%s): fixed?\n",
               t->name, nc, dt, t->known_bug);
      } else {
        printf("[  OK  ] %s (%ld checks, %.2f s)\n", t->name, nc, dt);
      }
    } else if (t->known_bug && !strict) {
      known++;
      printf("[ KNOWN BUG ] %s (%ld of %ld checks failed, %.2f s): %s\n", t->name, nf, nc, dt,
             t->known_bug);
    } else {
      failed++;
      printf("[ FAIL ] %s (%ld of %ld checks failed, %.2f s)%s%s\n", t->name, nf, nc, dt,
             t->known_bug ? ": known bug: " : "", t->known_bug ? t->known_bug : "");
    }
    fflush(stdout);
  }
  if (known || fixed)
    printf("%s: %d known bug(s) still failing (not counted; AC_TEST_STRICT=1 counts them), "
           "%d known bug(s) now passing\n",
           prog, known, fixed);
  printf("%s: total %.2f s\n", prog, tu_now() - t_all);
  printf("%d passed, %d failed\n", passed, failed);
  fflush(stdout);
  return failed == 0 ? 0 : 1;
}

#define TU_MAIN(table)                                                                  \
  int main(int argc, char **argv) {                                                     \
    setvbuf(stdout, NULL, _IOLBF, 0);                                                   \
    return tu_run_all(argv[0], (table), sizeof(table) / sizeof((table)[0]), argc, argv); \
  }

#endif /* AC_TEST_UTIL_H */

/* test_error.c — csrc/include/ac/ac.h: result-code names and the per-thread last-error message. */
#define _POSIX_C_SOURCE 200809L /* pthread_barrier_t, clock_gettime under -std=c11 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "ac/ac.h"
#include "test_util.h"

TEST(fail_sets_file_line_message) {
  ac_clear_error();
  int line = __LINE__ + 1;
  ac_result_t r = AC_FAIL(AC_ERR_IO, "open %s failed: %d", "weights.bin", 42);
  CHECK_EQ_INT(r, AC_ERR_IO);
  char want[256];
  snprintf(want, sizeof want, "test_error.c:%d: open weights.bin failed: 42", line);
  CHECK_STREQ(ac_last_error(), want);
  /* Only the base name of __FILE__, never the directory. */
  CHECK(strchr(ac_last_error(), '/') == NULL);
}

TEST(fail_hint_appends_hint) {
  int line = __LINE__ + 1;
  ac_result_t r = AC_FAIL_HINT(AC_ERR_UNSUPPORTED, "install a newer driver", "no %s here", "GPU");
  CHECK_EQ_INT(r, AC_ERR_UNSUPPORTED);
  char want[256];
  snprintf(want, sizeof want, "test_error.c:%d: no GPU here (hint: install a newer driver)", line);
  CHECK_STREQ(ac_last_error(), want);
  CHECK_CONTAINS(ac_last_error(), "(hint: install a newer driver)");
}

TEST(set_error_direct_and_no_hint) {
  ac_result_t r = ac_set_error(AC_ERR_FORMAT, "/some/dir/file.c", 7, NULL, "bad header");
  CHECK_EQ_INT(r, AC_ERR_FORMAT);
  CHECK_STREQ(ac_last_error(), "file.c:7: bad header");
  CHECK(strstr(ac_last_error(), "hint") == NULL);
  /* A file name without a directory is used as is. */
  ac_set_error(AC_ERR_FORMAT, "plain.c", 1, "h", "x");
  CHECK_STREQ(ac_last_error(), "plain.c:1: x (hint: h)");
}

TEST(clear_error_empties) {
  AC_FAIL(AC_ERR_INTERNAL, "something");
  CHECK(ac_last_error()[0] != '\0');
  ac_clear_error();
  CHECK_STREQ(ac_last_error(), "");
  /* Never NULL, and the pointer is stable for the thread. */
  const char *p = ac_last_error();
  CHECK(p != NULL);
  AC_FAIL(AC_ERR_INTERNAL, "again");
  CHECK(ac_last_error() == p);
  ac_clear_error();
}

TEST(restore_error_puts_a_saved_message_back_as_it_was) {
  AC_FAIL(AC_ERR_TIMEOUT, "rank %d is silent", 3);
  char saved[1024];
  snprintf(saved, sizeof saved, "%s", ac_last_error());
  AC_FAIL(AC_ERR_STATE, "a later failure");
  CHECK_EQ_INT(ac_restore_error(AC_ERR_TIMEOUT, saved), AC_ERR_TIMEOUT);
  CHECK_STREQ(ac_last_error(), saved); /* no second file:line prefix */
  CHECK_EQ_INT(ac_restore_error(AC_ERR_IO, NULL), AC_ERR_IO);
  CHECK_STREQ(ac_last_error(), "");
}

TEST(long_message_is_truncated_safely) {
  /* Far longer than the 1024-byte buffer: must truncate, stay NUL-terminated, not overflow
   * (ASan watches the writes). */
  static char big[4000];
  memset(big, 'x', sizeof big - 1);
  big[sizeof big - 1] = '\0';
  AC_FAIL_HINT(AC_ERR_INVALID_ARG, "a hint", "%s", big);
  size_t len = strlen(ac_last_error());
  CHECK(len > 0 && len < 1024);
  CHECK(strncmp(ac_last_error(), "test_error.c:", 13) == 0);
  /* A long hint after a short message is truncated too. */
  AC_FAIL_HINT(AC_ERR_INVALID_ARG, big, "short");
  len = strlen(ac_last_error());
  CHECK(len > 0 && len < 1024);
  CHECK_CONTAINS(ac_last_error(), "short (hint: xxx");
  /* A long file name. */
  ac_set_error(AC_ERR_IO, big, 1, NULL, "tail");
  CHECK(strlen(ac_last_error()) < 1024);
  ac_clear_error();
}

static ac_result_t propagate(ac_result_t inner, int *reached_end) {
  AC_CHECK(inner == AC_OK ? AC_OK : AC_FAIL(inner, "inner failure"));
  *reached_end = 1;
  return AC_OK;
}

static ac_result_t propagate_goto(ac_result_t inner, int *cleaned) {
  ac_result_t r = AC_OK;
  AC_CHECK_GOTO(inner == AC_OK ? AC_OK : AC_FAIL(inner, "inner failure"), r, done);
  r = AC_OK;
done:
  *cleaned = 1;
  return r;
}

TEST(check_macros_propagate) {
  int end = 0;
  CHECK_EQ_INT(propagate(AC_OK, &end), AC_OK);
  CHECK_EQ_INT(end, 1);
  end = 0;
  CHECK_EQ_INT(propagate(AC_ERR_TIMEOUT, &end), AC_ERR_TIMEOUT);
  CHECK_EQ_INT(end, 0);
  CHECK_CONTAINS(ac_last_error(), "inner failure");
  int cleaned = 0;
  CHECK_EQ_INT(propagate_goto(AC_ERR_COMM, &cleaned), AC_ERR_COMM);
  CHECK_EQ_INT(cleaned, 1);
  cleaned = 0;
  CHECK_EQ_INT(propagate_goto(AC_OK, &cleaned), AC_OK);
  CHECK_EQ_INT(cleaned, 1);
  ac_clear_error();
}

TEST(result_strings) {
  static const char *names[] = {"AC_OK",           "AC_ERR_INVALID_ARG", "AC_ERR_NOMEM",
                                "AC_ERR_UNSUPPORTED", "AC_ERR_IO",       "AC_ERR_FORMAT",
                                "AC_ERR_CUDA",     "AC_ERR_COMM",        "AC_ERR_TIMEOUT",
                                "AC_ERR_INTERNAL", "AC_ERR_STATE"};
  for (int c = 0; c <= (int)AC_ERR_STATE; c++) {
    CHECK_STREQ(ac_result_string((ac_result_t)c), names[c]);
    CHECK(strcmp(ac_result_string((ac_result_t)c), "AC_ERR_UNKNOWN") != 0);
  }
  CHECK_STREQ(ac_result_string((ac_result_t)11), "AC_ERR_UNKNOWN");
  CHECK_STREQ(ac_result_string((ac_result_t)-1), "AC_ERR_UNKNOWN");
  CHECK_STREQ(ac_result_string((ac_result_t)1000), "AC_ERR_UNKNOWN");
}

/* ---- per-thread messages ---- */

typedef struct {
  char seen_at_start[256]; /* what the thread saw before setting anything */
  char own_after_set[256]; /* its own message after setting one */
  char own_final[256];     /* its own message after main cleared main's */
  pthread_barrier_t *b;
  int id;
} thr_arg_t;

static void *thread_body(void *p) {
  thr_arg_t *a = p;
  snprintf(a->seen_at_start, sizeof a->seen_at_start, "%s", ac_last_error());
  pthread_barrier_wait(a->b); /* everyone has looked */
  AC_FAIL(AC_ERR_COMM, "thread %d message", a->id);
  pthread_barrier_wait(a->b); /* everyone has set its own */
  snprintf(a->own_after_set, sizeof a->own_after_set, "%s", ac_last_error());
  pthread_barrier_wait(a->b); /* main sets its own while threads are still alive */
  pthread_barrier_wait(a->b);
  snprintf(a->own_final, sizeof a->own_final, "%s", ac_last_error());
  return NULL;
}

TEST(messages_are_per_thread) {
  enum { NT = 4 };
  pthread_barrier_t b;
  CHECK_EQ_INT(pthread_barrier_init(&b, NULL, NT + 1), 0);
  AC_FAIL(AC_ERR_IO, "main thread message");
  char main_msg[256];
  snprintf(main_msg, sizeof main_msg, "%s", ac_last_error());

  thr_arg_t args[NT];
  pthread_t th[NT];
  for (int i = 0; i < NT; i++) {
    memset(&args[i], 0, sizeof args[i]);
    args[i].b = &b;
    args[i].id = i;
    CHECK_EQ_INT(pthread_create(&th[i], NULL, thread_body, &args[i]), 0);
  }
  pthread_barrier_wait(&b);
  pthread_barrier_wait(&b);
  /* The threads' messages must not have replaced main's. */
  CHECK_STREQ(ac_last_error(), main_msg);
  pthread_barrier_wait(&b);
  ac_clear_error(); /* clearing main must not clear the threads' */
  pthread_barrier_wait(&b);
  for (int i = 0; i < NT; i++) pthread_join(th[i], NULL);
  pthread_barrier_destroy(&b);

  for (int i = 0; i < NT; i++) {
    CHECK_STREQ(args[i].seen_at_start, ""); /* a fresh thread sees no message */
    char want[64];
    snprintf(want, sizeof want, "thread %d message", i);
    CHECK_CONTAINS(args[i].own_after_set, want);
    CHECK(strstr(args[i].own_after_set, "main thread") == NULL);
    CHECK_STREQ(args[i].own_final, args[i].own_after_set);
  }
  CHECK_STREQ(ac_last_error(), "");
}

static const tu_test_t tests[] = {
    TU_CASE(fail_sets_file_line_message),
    TU_CASE(fail_hint_appends_hint),
    TU_CASE(set_error_direct_and_no_hint),
    TU_CASE(clear_error_empties),
    TU_CASE(restore_error_puts_a_saved_message_back_as_it_was),
    TU_CASE(long_message_is_truncated_safely),
    TU_CASE(check_macros_propagate),
    TU_CASE(result_strings),
    TU_CASE(messages_are_per_thread),
};
TU_MAIN(tests)

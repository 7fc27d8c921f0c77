/* test_pool.c — csrc/include/ac/pool.h: the persistent pthread pool. */
#define _POSIX_C_SOURCE 200809L /* fork, waitpid, clock_gettime under -std=c11 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ac/pool.h"
#include "test_util.h"

#define MAX_SEEN 128

/* One job's bookkeeping: how often each task ran and which threads ran them. */
typedef struct {
  size_t ntasks;
  atomic_int *count; /* [ntasks] */
  atomic_long calls;
  pthread_mutex_t mu;
  pthread_t seen[MAX_SEEN];
  int nseen;
  atomic_int bad_index; /* a task index >= ntasks was passed */
} job_t;

static void job_init(job_t *j, size_t ntasks) {
  memset(j, 0, sizeof *j);
  j->ntasks = ntasks;
  j->count = calloc(ntasks ? ntasks : 1, sizeof *j->count);
  pthread_mutex_init(&j->mu, NULL);
}
static void job_free(job_t *j) {
  free(j->count);
  pthread_mutex_destroy(&j->mu);
}

static void counting_task(void *ctx, size_t task) {
  job_t *j = ctx;
  atomic_fetch_add(&j->calls, 1);
  if (task >= j->ntasks) {
    atomic_store(&j->bad_index, 1);
    return;
  }
  atomic_fetch_add(&j->count[task], 1);
  pthread_t self = pthread_self();
  pthread_mutex_lock(&j->mu);
  int known = 0;
  for (int k = 0; k < j->nseen; k++)
    if (pthread_equal(j->seen[k], self)) known = 1;
  if (!known && j->nseen < MAX_SEEN) j->seen[j->nseen++] = self;
  pthread_mutex_unlock(&j->mu);
}

/* Number of tasks that did not run exactly once (0 = correct). */
static size_t job_errors(job_t *j) {
  size_t bad = 0;
  for (size_t i = 0; i < j->ntasks; i++)
    if (atomic_load(&j->count[i]) != 1) bad++;
  if (atomic_load(&j->calls) != (long)j->ntasks) bad++;
  if (atomic_load(&j->bad_index)) bad++;
  return bad;
}

/* Runs a counting job of `ntasks` and CHECKs it; returns the number of distinct threads. */
static int run_counting_job(size_t ntasks) {
  job_t j;
  job_init(&j, ntasks);
  CHECK_OK(ac_pool_run(ntasks, counting_task, &j));
  size_t errs = job_errors(&j);
  CHECK_MSG(errs == 0, "ntasks=%zu threads=%d: %zu tasks ran != 1 time (calls=%ld)", ntasks,
            ac_pool_get_threads(), errs, atomic_load(&j.calls));
  int nseen = j.nseen;
  job_free(&j);
  return nseen;
}

/* Must run first: the default thread count before anything has set it. */
TEST(default_threads) {
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  if (ncpu < 1) ncpu = 1;
  if (ncpu > 64) ncpu = 64;
  int n = ac_pool_get_threads();
  CHECK(n >= 1);
  CHECK_EQ_INT(n, ncpu);
  CHECK_EQ_INT(ac_pool_get_threads(), n); /* stable */
}

TEST(set_threads_validation) {
  int before = ac_pool_get_threads();
  ac_clear_error();
  CHECK_RC(ac_pool_set_threads(0), AC_ERR_INVALID_ARG);
  CHECK(ac_last_error()[0] != '\0');
  CHECK_CONTAINS(ac_last_error(), "pool.c");
  CHECK_RC(ac_pool_set_threads(-1), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_pool_set_threads(-2147483647 - 1), AC_ERR_INVALID_ARG);
  CHECK_EQ_INT(ac_pool_get_threads(), before); /* rejected values change nothing */
  CHECK_OK(ac_pool_set_threads(1000));
  CHECK_EQ_INT(ac_pool_get_threads(), 64); /* capped */
  run_counting_job(1000);
  CHECK_OK(ac_pool_set_threads(1));
  CHECK_EQ_INT(ac_pool_get_threads(), 1);
  CHECK_OK(ac_pool_set_threads(before));
  CHECK_EQ_INT(ac_pool_get_threads(), before);
}

static atomic_int never_called_hits;
static void never_called(void *ctx, size_t task) {
  (void)ctx, (void)task;
  atomic_fetch_add(&never_called_hits, 1);
}

TEST(run_arguments) {
  CHECK_OK(ac_pool_run(0, never_called, NULL));
  CHECK_OK(ac_pool_run(0, NULL, NULL)); /* nothing to do */
  CHECK_EQ_INT(atomic_load(&never_called_hits), 0);
  ac_clear_error();
  CHECK_RC(ac_pool_run(5, NULL, NULL), AC_ERR_INVALID_ARG);
  CHECK(ac_last_error()[0] != '\0');
}

TEST(every_task_exactly_once) {
  static const size_t sizes[] = {1, 2, 3, 100, 10000};
  for (int t = 1; t <= 8; t++) {
    CHECK_OK(ac_pool_set_threads(t));
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
      for (int rep = 0; rep < 3; rep++) {
        int nseen = run_counting_job(sizes[s]);
        /* "at most ac_pool_get_threads() threads including the caller" */
        CHECK_MSG(nseen >= 1 && nseen <= t, "threads=%d ntasks=%zu: %d distinct threads", t,
                  sizes[s], nseen);
      }
    }
  }
  /* Lowering the count after more workers were started: the extra workers stay idle. */
  CHECK_OK(ac_pool_set_threads(8));
  run_counting_job(10000);
  CHECK_OK(ac_pool_set_threads(2));
  for (int rep = 0; rep < 20; rep++) {
    int nseen = run_counting_job(10000);
    CHECK_MSG(nseen <= 2, "threads=2 after 8: %d distinct threads", nseen);
  }
  CHECK_OK(ac_pool_set_threads(4));
}

TEST(one_thread_runs_on_caller) {
  CHECK_OK(ac_pool_set_threads(1));
  job_t j;
  job_init(&j, 1000);
  CHECK_OK(ac_pool_run(1000, counting_task, &j));
  CHECK_EQ_INT(job_errors(&j), 0);
  CHECK_EQ_INT(j.nseen, 1);
  CHECK(j.nseen == 1 && pthread_equal(j.seen[0], pthread_self()));
  job_free(&j);
  CHECK_OK(ac_pool_set_threads(4));
}

/* Task 0 waits (up to 10 s) until another task runs at the same time; the others sleep 1 ms.
 * With more than one thread this ends at once, whatever the machine's load. */
typedef struct {
  atomic_int running, peak;
  atomic_int done;
} par_t;
static void parallel_task(void *ctx, size_t task) {
  par_t *p = ctx;
  int now = atomic_fetch_add(&p->running, 1) + 1;
  int pk = atomic_load(&p->peak);
  while (now > pk && !atomic_compare_exchange_weak(&p->peak, &pk, now)) {
  }
  if (task == 0) {
    double deadline = tu_now() + 10.0;
    while (atomic_load(&p->peak) < 2 && tu_now() < deadline) {
      struct timespec ts = {0, 200000};
      nanosleep(&ts, NULL);
    }
  } else {
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  atomic_fetch_sub(&p->running, 1);
  atomic_fetch_add(&p->done, 1);
}

TEST(threads_really_run_in_parallel) {
  CHECK_OK(ac_pool_set_threads(4));
  par_t p;
  memset(&p, 0, sizeof p);
  CHECK_OK(ac_pool_run(40, parallel_task, &p));
  CHECK_EQ_INT(atomic_load(&p.done), 40);
  CHECK_EQ_INT(atomic_load(&p.running), 0);
  CHECK_MSG(atomic_load(&p.peak) >= 2 && atomic_load(&p.peak) <= 4, "peak concurrency %d",
            atomic_load(&p.peak));
}

/* ---- concurrent callers ---- */

#define NCALLERS 4
static atomic_int inflight[NCALLERS];
static atomic_int overlap_seen;

typedef struct {
  int id;
  size_t ntasks;
  atomic_int *count;
  atomic_long sum;
} cjob_t;

static void concurrent_task(void *ctx, size_t task) {
  cjob_t *c = ctx;
  atomic_fetch_add(&inflight[c->id], 1);
  /* Jobs are serialised: while a task of this caller's job runs, no other job has tasks. */
  for (int k = 0; k < NCALLERS; k++)
    if (k != c->id && atomic_load(&inflight[k]) != 0) atomic_store(&overlap_seen, 1);
  atomic_fetch_add(&c->count[task], 1);
  atomic_fetch_add(&c->sum, (long)task);
  atomic_fetch_sub(&inflight[c->id], 1);
}

typedef struct {
  int id;
  int jobs;
  long wrong; /* jobs whose result was wrong */
  long rc_errors;
} caller_t;

static void *caller_main(void *p) {
  caller_t *a = p;
  tu_rng_t rng = {0x9E3779B97F4A7C15ULL * (uint64_t)(a->id + 1)};
  atomic_int *count = calloc(5000, sizeof *count);
  for (int jn = 0; jn < a->jobs; jn++) {
    size_t n = 1 + tu_randn(&rng, 4999);
    for (size_t i = 0; i < n; i++) atomic_store(&count[i], 0);
    cjob_t c = {.id = a->id, .ntasks = n, .count = count};
    atomic_store(&c.sum, 0);
    if (ac_pool_run(n, concurrent_task, &c) != AC_OK) {
      a->rc_errors++;
      continue;
    }
    int ok = atomic_load(&c.sum) == (long)(n * (n - 1) / 2);
    for (size_t i = 0; i < n && ok; i++) ok = atomic_load(&count[i]) == 1;
    if (!ok) a->wrong++;
  }
  free(count);
  return NULL;
}

static atomic_int stop_flipping;
static void *thread_flipper(void *p) {
  (void)p;
  int t = 1;
  while (!atomic_load(&stop_flipping)) {
    ac_pool_set_threads(t);
    (void)ac_pool_get_threads();
    t = t % 6 + 1;
    struct timespec ts = {0, 100000};
    nanosleep(&ts, NULL);
  }
  return NULL;
}

TEST(concurrent_callers_serialise) {
  for (int with_flipper = 0; with_flipper <= 1; with_flipper++) {
    CHECK_OK(ac_pool_set_threads(4));
    atomic_store(&overlap_seen, 0);
    atomic_store(&stop_flipping, 0);
    pthread_t flip;
    if (with_flipper) CHECK_EQ_INT(pthread_create(&flip, NULL, thread_flipper, NULL), 0);
    pthread_t th[NCALLERS];
    caller_t args[NCALLERS];
    for (int i = 0; i < NCALLERS; i++) {
      args[i] = (caller_t){.id = i, .jobs = 150};
      CHECK_EQ_INT(pthread_create(&th[i], NULL, caller_main, &args[i]), 0);
    }
    for (int i = 0; i < NCALLERS; i++) pthread_join(th[i], NULL);
    atomic_store(&stop_flipping, 1);
    if (with_flipper) pthread_join(flip, NULL);
    for (int i = 0; i < NCALLERS; i++) {
      CHECK_MSG(args[i].wrong == 0, "caller %d: %ld wrong jobs (flipper %d)", i, args[i].wrong,
                with_flipper);
      CHECK_MSG(args[i].rc_errors == 0, "caller %d: %ld failed runs", i, args[i].rc_errors);
    }
    CHECK_MSG(atomic_load(&overlap_seen) == 0, "tasks of two jobs ran at once (flipper %d)",
              with_flipper);
  }
  CHECK_OK(ac_pool_set_threads(4));
}

/* ---- fork safety ---- */

/* In a forked child: run a counting job with 4 threads, exit 0 if it was correct. */
static void child_job_and_exit(void) {
  if (ac_pool_set_threads(4) != AC_OK) _exit(2);
  size_t n = 1000;
  atomic_int *count = calloc(n, sizeof *count);
  if (!count) _exit(3);
  cjob_t c = {.id = 0, .ntasks = n, .count = count};
  atomic_store(&c.sum, 0);
  for (int rep = 0; rep < 5; rep++) {
    for (size_t i = 0; i < n; i++) atomic_store(&count[i], 0);
    atomic_store(&c.sum, 0);
    if (ac_pool_run(n, concurrent_task, &c) != AC_OK) _exit(4);
    if (atomic_load(&c.sum) != (long)(n * (n - 1) / 2)) _exit(5);
    for (size_t i = 0; i < n; i++)
      if (atomic_load(&count[i]) != 1) _exit(6);
  }
  free(count);
  _exit(0);
}

/* Waits for the child with a deadline (a deadlocked child must fail the test, not hang it). */
static int wait_child(pid_t pid, int *status) {
  double deadline = tu_now() + 60.0;
  for (;;) {
    pid_t r = waitpid(pid, status, WNOHANG);
    if (r == pid) return 1;
    if (r < 0 && errno != EINTR) return 0;
    if (tu_now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, status, 0);
      return 0;
    }
    struct timespec ts = {0, 5000000};
    nanosleep(&ts, NULL);
  }
}

static void check_fork_once(const char *what) {
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) child_job_and_exit();
  if (!CHECK_MSG(pid > 0, "%s: fork failed: %s", what, strerror(errno))) return;
  int st = 0;
  int waited = wait_child(pid, &st);
  CHECK_MSG(waited, "%s: child %d did not finish within 60 s (deadlock?)", what, (int)pid);
  if (waited)
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s: child status 0x%x (exited %d, code %d)",
              what, st, WIFEXITED(st), WIFEXITED(st) ? WEXITSTATUS(st) : -1);
}

TEST(fork_child_can_use_pool) {
  CHECK_OK(ac_pool_set_threads(4));
  run_counting_job(1000); /* the parent's workers are running */
  check_fork_once("after a job");
  run_counting_job(1000); /* the parent's pool still works after the fork */
  /* Fork while no worker is alive (after a shutdown). */
  ac_pool_shutdown();
  check_fork_once("after shutdown");
  run_counting_job(1000);
}

static atomic_int bg_stop;
static atomic_long bg_wrong, bg_jobs;
static void *background_jobs(void *p) {
  (void)p;
  size_t n = 3000;
  atomic_int *count = calloc(n, sizeof *count);
  while (!atomic_load(&bg_stop)) {
    for (size_t i = 0; i < n; i++) atomic_store(&count[i], 0);
    cjob_t c = {.id = 1, .ntasks = n, .count = count};
    atomic_store(&c.sum, 0);
    if (ac_pool_run(n, concurrent_task, &c) != AC_OK ||
        atomic_load(&c.sum) != (long)(n * (n - 1) / 2))
      atomic_fetch_add(&bg_wrong, 1);
    atomic_fetch_add(&bg_jobs, 1);
  }
  free(count);
  return NULL;
}

TEST(fork_while_another_thread_runs_jobs) {
  /* The at-fork handlers must not let the child inherit a pool lock taken mid-job. */
  CHECK_OK(ac_pool_set_threads(4));
  atomic_store(&bg_stop, 0);
  atomic_store(&bg_wrong, 0);
  atomic_store(&bg_jobs, 0);
  pthread_t bg;
  CHECK_EQ_INT(pthread_create(&bg, NULL, background_jobs, NULL), 0);
  for (int k = 0; k < 6; k++) {
    struct timespec ts = {0, 3000000};
    nanosleep(&ts, NULL);
    check_fork_once("while jobs run");
  }
  atomic_store(&bg_stop, 1);
  pthread_join(bg, NULL);
  CHECK_EQ_INT(atomic_load(&bg_wrong), 0);
  CHECK(atomic_load(&bg_jobs) > 0);
}

/* Backend selection: "openmp" only where a libgomp is loaded (run.sh links one into the
 * *_omp build and sets AC_POOL_BACKEND=openmp), never in a forked child. */
TEST(backend_selection) {
  const char *env = getenv("AC_POOL_BACKEND");
  int omp = env && strcmp(env, "openmp") == 0;
  CHECK_STREQ(ac_pool_backend(), omp ? "openmp" : "pthread");
  if (!omp) CHECK_RC(ac_pool_set_backend("openmp"), AC_ERR_UNSUPPORTED);
  CHECK_RC(ac_pool_set_backend("bogus"), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_pool_set_backend(NULL), AC_ERR_INVALID_ARG);
  CHECK_OK(ac_pool_set_backend("pthread"));
  CHECK_STREQ(ac_pool_backend(), "pthread");
  run_counting_job(1000);
  CHECK_OK(ac_pool_set_backend("auto"));
  CHECK_STREQ(ac_pool_backend(), omp ? "openmp" : "pthread");
  run_counting_job(1000);
  if (omp) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) _exit(strcmp(ac_pool_backend(), "pthread") == 0 ? 0 : 7);
    int st = 0;
    CHECK(pid > 0 && wait_child(pid, &st) && WIFEXITED(st) && WEXITSTATUS(st) == 0);
  }
}

TEST(shutdown_then_reuse) {
  CHECK_OK(ac_pool_set_threads(4));
  run_counting_job(500);
  ac_pool_shutdown();
  run_counting_job(500); /* restarts lazily */
  ac_pool_shutdown();
  ac_pool_shutdown(); /* twice in a row is harmless */
  CHECK_OK(ac_pool_set_threads(3));
  int nseen = run_counting_job(10000);
  CHECK(nseen <= 3);
  CHECK_EQ_INT(ac_pool_get_threads(), 3); /* shutdown keeps the setting */
  for (int k = 0; k < 20; k++) {
    ac_pool_shutdown();
    run_counting_job(64);
  }
  /* Last: stop the workers so LeakSanitizer sees no live threads' stacks at exit. */
  ac_pool_shutdown();
}

static const tu_test_t tests[] = {
    TU_CASE(default_threads), /* must stay first */
    TU_CASE(set_threads_validation),
    TU_CASE(run_arguments),
    TU_CASE(every_task_exactly_once),
    TU_CASE(one_thread_runs_on_caller),
    TU_CASE(threads_really_run_in_parallel),
    TU_CASE(concurrent_callers_serialise),
    TU_CASE(fork_child_can_use_pool),
    TU_CASE(fork_while_another_thread_runs_jobs),
    TU_CASE(backend_selection),
    TU_CASE(shutdown_then_reuse), /* keep last: ends with ac_pool_shutdown() */
};
TU_MAIN(tests)

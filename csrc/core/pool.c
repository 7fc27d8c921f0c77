/* pool.c — persistent pthread pool with lazy start, fork safety and dynamic task claiming. */
#define _GNU_SOURCE /* RTLD_NOLOAD; must precede every system header */
#include "ac/pool.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define AC_POOL_MAX 64

static struct {
  pthread_mutex_t run_mu; /* one job at a time */
  pthread_mutex_t mu;     /* guards everything below */
  pthread_cond_t work_cv;
  pthread_cond_t done_cv;
  pthread_t threads[AC_POOL_MAX];
  unsigned long start_gen[AC_POOL_MAX]; /* gen each worker was created at: it waits for the next */
  int started;    /* workers alive (ids 1..started) */
  int want;       /* total threads incl. caller; 0 = not yet decided */
  int stop;
  unsigned long gen; /* bumped once per published job */
  int job_workers;   /* workers with id <= this take part in the current job */
  int busy;          /* participating workers not yet finished */
  ac_task_fn fn;
  void *ctx;
  size_t ntasks;
  atomic_size_t next;
} P = {.run_mu = PTHREAD_MUTEX_INITIALIZER,
       .mu = PTHREAD_MUTEX_INITIALIZER,
       .work_cv = PTHREAD_COND_INITIALIZER,
       .done_cv = PTHREAD_COND_INITIALIZER};

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

/* ---- the borrowed OpenMP team --------------------------------------------------------- */
typedef void (*gomp_parallel_fn)(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags);
enum { BACKEND_AUTO = 0, BACKEND_PTHREAD = 1, BACKEND_OPENMP = 2 };
static struct {
  pthread_once_t once;
  gomp_parallel_fn parallel; /* NULL: no libgomp in this process */
  _Atomic int choice;        /* BACKEND_* */
  _Atomic int forked;        /* set in a forked child: the team is gone */
} G = {.once = PTHREAD_ONCE_INIT};

static void gomp_resolve(void) {
  /* RTLD_NOLOAD: use a libgomp someone already loaded (torch), never load one ourselves */
  void *h = dlopen("libgomp.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (h) {
    *(void **)(&G.parallel) = dlsym(h, "GOMP_parallel");
    if (!G.parallel) dlclose(h);
  }
  const char *env = getenv("AC_POOL_BACKEND");
  if (env && strcmp(env, "pthread") == 0) atomic_store(&G.choice, BACKEND_PTHREAD);
  if (env && strcmp(env, "openmp") == 0) atomic_store(&G.choice, BACKEND_OPENMP);
}

static int use_openmp(void) {
  pthread_once(&G.once, gomp_resolve);
  if (!G.parallel || atomic_load(&G.forked)) return 0;
  return atomic_load(&G.choice) != BACKEND_PTHREAD;
}

ac_result_t ac_pool_set_backend(const char *name) {
  pthread_once(&G.once, gomp_resolve);
  if (!name) return AC_FAIL(AC_ERR_INVALID_ARG, "backend name is NULL");
  if (strcmp(name, "auto") == 0) {
    atomic_store(&G.choice, BACKEND_AUTO);
  } else if (strcmp(name, "pthread") == 0) {
    atomic_store(&G.choice, BACKEND_PTHREAD);
  } else if (strcmp(name, "openmp") == 0) {
    if (!G.parallel || atomic_load(&G.forked))
      return AC_FAIL_HINT(AC_ERR_UNSUPPORTED, "import torch (which loads libgomp) first",
                          "no OpenMP runtime (libgomp) is loaded in this process");
    atomic_store(&G.choice, BACKEND_OPENMP);
  } else {
    return AC_FAIL_HINT(AC_ERR_INVALID_ARG, "use \"auto\", \"pthread\" or \"openmp\"", "unknown pool backend '%s'",
                        name);
  }
  return AC_OK;
}

const char *ac_pool_backend(void) { return use_openmp() ? "openmp" : "pthread"; }

typedef struct {
  ac_task_fn fn;
  void *ctx;
  size_t ntasks;
  atomic_size_t next;
} omp_job_t;

static void omp_body(void *arg) {
  omp_job_t *j = arg;
  for (;;) {
    size_t i = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
    if (i >= j->ntasks) break;
    j->fn(j->ctx, i);
  }
}

static void claim_and_run(ac_task_fn fn, void *ctx, size_t ntasks) {
  for (;;) {
    size_t i = atomic_fetch_add_explicit(&P.next, 1, memory_order_relaxed);
    if (i >= ntasks) break;
    fn(ctx, i);
  }
}

static void *worker_main(void *arg) {
  int id = (int)(intptr_t)arg;
  pthread_mutex_lock(&P.mu);
  unsigned long seen = P.start_gen[id];
  for (;;) {
    while (!P.stop && P.gen == seen) pthread_cond_wait(&P.work_cv, &P.mu);
    if (P.stop) break;
    seen = P.gen;
    if (id > P.job_workers) continue;
    ac_task_fn fn = P.fn;
    void *ctx = P.ctx;
    size_t ntasks = P.ntasks;
    pthread_mutex_unlock(&P.mu);
    claim_and_run(fn, ctx, ntasks);
    pthread_mutex_lock(&P.mu);
    if (--P.busy == 0) pthread_cond_signal(&P.done_cv);
  }
  pthread_mutex_unlock(&P.mu);
  return NULL;
}

/* Fork: hold both locks across fork() so the child never inherits a lock taken mid-job; the
 * child has none of the parent's workers, so it forgets them and restarts lazily. */
static void atfork_prepare(void) {
  pthread_mutex_lock(&P.run_mu);
  pthread_mutex_lock(&P.mu);
}
static void atfork_parent(void) {
  pthread_mutex_unlock(&P.mu);
  pthread_mutex_unlock(&P.run_mu);
}
static void atfork_child(void) {
  atomic_store(&G.forked, 1);
  pthread_mutex_init(&P.run_mu, NULL);
  pthread_mutex_init(&P.mu, NULL);
  pthread_cond_init(&P.work_cv, NULL);
  pthread_cond_init(&P.done_cv, NULL);
  P.started = 0;
  P.stop = 0;
  P.busy = 0;
  P.job_workers = 0;
}
static void register_atfork(void) { pthread_atfork(atfork_prepare, atfork_parent, atfork_child); }

void ac_pool_init(void) { pthread_once(&atfork_once, register_atfork); }

static int default_threads(void) {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  if (n < 1) n = 1;
  if (n > AC_POOL_MAX) n = AC_POOL_MAX;
  return (int)n;
}

int ac_pool_get_threads(void) {
  pthread_mutex_lock(&P.mu);
  if (P.want == 0) P.want = default_threads();
  int n = P.want;
  pthread_mutex_unlock(&P.mu);
  return n;
}

ac_result_t ac_pool_set_threads(int n) {
  if (n < 1) return AC_FAIL(AC_ERR_INVALID_ARG, "thread count must be >= 1, got %d", n);
  if (n > AC_POOL_MAX) n = AC_POOL_MAX;
  pthread_mutex_lock(&P.mu);
  P.want = n;
  pthread_mutex_unlock(&P.mu);
  return AC_OK;
}

/* Called with run_mu and mu held. */
static ac_result_t ensure_workers(int nworkers) {
  while (P.started < nworkers) {
    int id = P.started + 1;
    P.start_gen[id] = P.gen;
    int rc = pthread_create(&P.threads[id], NULL, worker_main, (void *)(intptr_t)id);
    if (rc != 0) {
      if (P.started > 0) return AC_OK; /* run with the workers we have */
      return AC_FAIL(AC_ERR_NOMEM, "pthread_create failed: %s", strerror(rc));
    }
    P.started = id;
  }
  return AC_OK;
}

ac_result_t ac_pool_run(size_t ntasks, ac_task_fn fn, void *ctx) {
  if (ntasks == 0) return AC_OK;
  if (!fn) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_pool_run: fn is NULL");
  pthread_once(&atfork_once, register_atfork);
  if (ntasks > 1 && use_openmp()) {
    int want = ac_pool_get_threads();
    unsigned team = (size_t)want < ntasks ? (unsigned)want : (unsigned)ntasks;
    omp_job_t job = {.fn = fn, .ctx = ctx, .ntasks = ntasks};
    atomic_store_explicit(&job.next, 0, memory_order_relaxed);
    pthread_mutex_lock(&P.run_mu); /* same contract as the pthread path: one job at a time */
    G.parallel(omp_body, &job, team, 0);
    pthread_mutex_unlock(&P.run_mu);
    return AC_OK;
  }
  pthread_mutex_lock(&P.run_mu);
  pthread_mutex_lock(&P.mu);
  if (P.want == 0) P.want = default_threads();
  int workers = P.want - 1;
  if ((size_t)workers > ntasks - 1) workers = (int)(ntasks - 1);
  if (workers >= AC_POOL_MAX) workers = AC_POOL_MAX - 1;
  if (workers > 0) {
    ac_result_t r = ensure_workers(workers);
    if (r != AC_OK) {
      pthread_mutex_unlock(&P.mu);
      pthread_mutex_unlock(&P.run_mu);
      return r;
    }
    if (workers > P.started) workers = P.started;
  }
  P.fn = fn;
  P.ctx = ctx;
  P.ntasks = ntasks;
  atomic_store_explicit(&P.next, 0, memory_order_relaxed);
  P.job_workers = workers;
  P.busy = workers;
  if (workers > 0) {
    P.gen++;
    pthread_cond_broadcast(&P.work_cv);
  }
  pthread_mutex_unlock(&P.mu);

  claim_and_run(fn, ctx, ntasks);

  pthread_mutex_lock(&P.mu);
  while (P.busy > 0) pthread_cond_wait(&P.done_cv, &P.mu);
  P.fn = NULL;
  P.ctx = NULL;
  pthread_mutex_unlock(&P.mu);
  pthread_mutex_unlock(&P.run_mu);
  return AC_OK;
}

void ac_pool_shutdown(void) {
  pthread_mutex_lock(&P.run_mu);
  pthread_mutex_lock(&P.mu);
  int n = P.started;
  P.stop = 1;
  pthread_cond_broadcast(&P.work_cv);
  pthread_mutex_unlock(&P.mu);
  for (int id = 1; id <= n; id++) pthread_join(P.threads[id], NULL);
  pthread_mutex_lock(&P.mu);
  P.started = 0;
  P.stop = 0;
  pthread_mutex_unlock(&P.mu);
  pthread_mutex_unlock(&P.run_mu);
}

/* late_gloo_release.c — LD_PRELOAD shim for tests/test_exit.py: a gloo worker thread that
 * releases a work late and then waits for the GIL until the interpreter is shutting down, as a
 * preempted thread on a loaded machine sometimes does.
 *
 * The interleaving it forces (only on threads named "pt_gloo_runloop", gloo's workers):
 * 1. after waking the waiter of a finished work (pthread_cond_broadcast), the worker pauses
 *    HOLD_MS, so the main thread drops its reference to the work first and the worker's is
 *    the last one;
 * 2. if releasing that last reference needs the GIL (the work holds a Python object), the
 *    worker's GIL request (PyEval_AcquireThread, what pybind11's gil_scoped_acquire calls) waits
 *    until the interpreter is finalizing, as if the main thread had kept the GIL until its
 *    exit; bounded by MAX_WAIT_MS, so a run that is not ending only slows down.
 * Step 2 leaves out the release of a tensor's Python object (c10::TensorImpl::decref_pyobject
 * on the stack): torch keeps a tensor's Python object alive while C++ holds the tensor, so a
 * temporary handed to any collective, in plain torch scripts too, is released that way when
 * the worker's reference is the last; that race is torch's, not what this test is about.
 * Without a Python object in the work, step 2 never happens and the shim only slows gloo. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <pthread.h>
#include <string.h>
#include <time.h>

#define HOLD_MS 5
#define MAX_WAIT_MS 500

static int in_gloo_worker(void) {
  char name[16] = "";
  pthread_getname_np(pthread_self(), name, sizeof name);
  return strcmp(name, "pt_gloo_runloop") == 0;
}

static void sleep_ms(long ms) {
  const struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static int releasing_a_tensor(void) {
  void *pcs[48];
  int n = backtrace(pcs, 48);
  for (int i = 0; i < n; i++) {
    Dl_info info;
    if (dladdr(pcs[i], &info) && info.dli_sname && strstr(info.dli_sname, "decref_pyobject")) return 1;
  }
  return 0;
}

int pthread_cond_broadcast(pthread_cond_t *cond) {
  static int (*real)(pthread_cond_t *);
  if (!real) *(void **)&real = dlsym(RTLD_NEXT, "pthread_cond_broadcast");
  int rc = real(cond);
  if (in_gloo_worker()) sleep_ms(HOLD_MS);
  return rc;
}

void PyEval_AcquireThread(void *tstate) {
  static void (*real)(void *);
  static int (*finalizing)(void);
  if (!real) *(void **)&real = dlsym(RTLD_NEXT, "PyEval_AcquireThread");
  /* CPython >= 3.13 exports Py_IsFinalizing; 3.10-3.12 _Py_IsFinalizing */
  if (!finalizing) *(void **)&finalizing = dlsym(RTLD_DEFAULT, "Py_IsFinalizing");
  if (!finalizing) *(void **)&finalizing = dlsym(RTLD_DEFAULT, "_Py_IsFinalizing");
  if (finalizing && in_gloo_worker() && !releasing_a_tensor())
    for (int i = 0; i < MAX_WAIT_MS && !finalizing(); i++) sleep_ms(1);
  real(tstate);
}

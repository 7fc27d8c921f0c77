/* reducer_py.h (private) — the Reducer and GradHook objects, shared by reducer_py.c (the
 * Reducer: the bucket plan, readiness, the NCCL launch) and grad_hook_py.c (the GradHook, the
 * copy-in in C, and the sums of squares taken in the hooks). */
#ifndef PYAC_REDUCER_PY_H
#define PYAC_REDUCER_PY_H

#include "pyac.h"

#include "ac/bucket.h"
#include "ac/comm.h"
#include "ac/cuda.h"
#include "ac/reducer.h"

typedef struct {
  PyObject_HEAD
  ac_bucket_plan_t *plan;
  PyObject *on_first; /* on_first(): the first gradient of a backward is about to be marked */
  PyObject *launch;   /* launch(from, to): buckets [from, to) may start their all-reduce */
  PyObject *slow;     /* slow(i, param) -> bool: handles a gradient that is not the view; False: skip */
  PyObject *grad_name; /* interned "grad" */
  int launching;      /* set by the glue for sync steps of multi-process runs */
  /* NCCL: buckets are launched from the hook in C, no Python on the way */
  PyObject *comm;     /* NcclComm, or NULL: the Python `launch` function is used */
  PyObject *buffer;   /* the Buffer whose memory the plan lays out */
  void *base;
  ac_dtype_t dt;
  void *comm_stream, *compute_stream;
  void *ev_ready;     /* comm stream waits for the compute stream */
  void *ev_done;      /* compute stream waits for the comm stream */
  size_t *numel;      /* elements of each gradient (for the hooks' in-place pre-division) */
  int on_cuda;        /* the buffer is device memory */
  float prescale;     /* launching backwards: gradients x prescale (1/world) as they become ready */
  int defer;          /* complete buckets wait for the glue to launch them at the end of backward */
  int requeue;        /* the next hook calls on_first again (an end of backward came too early) */
  /* Sums of squares taken in the hooks (one process, once clip has asked for a 2-norm): each
   * gradient's range is measured right after autograd or the copy-in wrote it, while it is in
   * cache, so that clip costs one scaling pass. A slot is valid while every write to the buffer
   * since its chain began was a measured one: each measurement expects the buffer's version
   * counter to have moved by at most one (its own gradient's write) since the previous one,
   * and anything else (an unmeasured backward, a user's in-place change, resync, a kernel's
   * write) forgets every slot. sums() also wants the version unchanged since the last. */
  int measure;        /* set by the glue for the backwards whose sums clip will use */
  double *sq;         /* per gradient: sum of squares of its range */
  unsigned char *nf;  /* per gradient: its range holds NaN/Inf */
  unsigned char *have; /* per gradient: sq/nf are valid in the current chain */
  size_t nhave;       /* slots valid in the current chain */
  long long last_version; /* the buffer's version after the last measurement */
  PyObject *version_name; /* interned "_version" */
  /* bump((tensor,)): torch's version-counter increment, set by the glue; the copy-in in C (see
   * fast_copy_in) writes the view through its pointer and bumps the version as torch's own
   * copy_ would. NULL: every copy-in goes to the glue's slow path. */
  PyObject *bump;
} ReducerObject;

typedef struct {
  PyObject_HEAD
  PyObject *reducer; /* ReducerObject */
  PyObject *view;    /* the parameter's range of the flat buffer, shaped like it */
  PyObject *views1;  /* (view,): the argument of the reducer's bump */
  PyObject *dtype;   /* view.dtype, the dtype a gradient copied in C must have */
  size_t index;
} HookObject;

/* reducer_py.c */
/* 1 when the Reducer has its plan; else 0 with an exception set. */
int pyac_reducer_has_plan(ReducerObject *self);
/* Launches buckets [from, to) over the attached NCCL communicator (None, or NULL on error). */
PyObject *pyac_reducer_launch_nccl(ReducerObject *self, size_t from, size_t to);

/* grad_hook_py.c: Reducer methods that belong to the hooks */
PyObject *pyac_reducer_hook(PyObject *op, PyObject *const *a, Py_ssize_t n);
PyObject *pyac_reducer_measure_now(PyObject *op, PyObject *const *a, Py_ssize_t n);
PyObject *pyac_reducer_sums(PyObject *op, PyObject *arg);
PyObject *pyac_reducer_forget_sums(PyObject *op, PyObject *unused);
PyObject *pyac_reducer_get_measured(PyObject *op, void *c);

#endif

/* reducer_py.c — Reducer (the C bucket plan as a Python type) and GradHook, the per-parameter
 * post-accumulate-grad hook that is a C callable.
 *
 * The hot path of a hook (the gradient already is the parameter's view of the flat buffer)
 * never runs Python bytecode: one attribute read, one C call that marks the gradient ready,
 * and, when buckets became launchable on a sync step, one call of the launch function the
 * Python glue registered. A new gradient tensor (the first backward after zero_grad set `.grad`
 * to None) is copied into the view here too (fast_copy_in), once the glue has set the reducer's
 * `bump`; rare cases (CUDA buffers, a gradient with a graph, a model cast after prepare) go to
 * the glue's copy-in function. On one process, once clip has asked for a 2-norm,
 * the hook also measures the range it just saw written (after the copy-in, or after autograd's
 * in-place accumulation, which bumps the version before the hook runs), for Reducer.sums. The
 * core itself never calls Python (docs/architecture.md, "Layers"); the calls back into Python
 * are made here, in the extension layer. */
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

/* ---- sequences of sizes ----------------------------------------------------------------- */

static int sizes_from(PyObject *seq, const char *what, size_t **out, Py_ssize_t *n) {
  PyObject *fast = PySequence_Fast(seq, what);
  if (!fast) return -1;
  *n = PySequence_Fast_GET_SIZE(fast);
  *out = PyMem_Malloc((size_t)(*n ? *n : 1) * sizeof(size_t));
  if (!*out) {
    Py_DECREF(fast);
    PyErr_NoMemory();
    return -1;
  }
  for (Py_ssize_t i = 0; i < *n; i++) {
    PyObject *it = PySequence_Fast_GET_ITEM(fast, i);
    size_t v = PyLong_AsSize_t(it);
    if (v == (size_t)-1 && PyErr_Occurred()) {
      PyErr_Format(PyExc_ValueError, "%s[%zd] must be a non-negative int", what, i);
      PyMem_Free(*out);
      *out = NULL;
      Py_DECREF(fast);
      return -1;
    }
    (*out)[i] = v;
  }
  Py_DECREF(fast);
  return 0;
}

static PyObject *size_list(const size_t *v, size_t n) {
  PyObject *l = PyList_New((Py_ssize_t)n);
  if (!l) return NULL;
  for (size_t i = 0; i < n; i++) {
    PyObject *x = PyLong_FromSize_t(v[i]);
    if (!x) {
      Py_DECREF(l);
      return NULL;
    }
    PyList_SET_ITEM(l, (Py_ssize_t)i, x);
  }
  return l;
}

/* ---- Reducer ---------------------------------------------------------------------------- */

static int reducer_init(PyObject *op, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"numel", "order", "esize", "first_cap_bytes", "cap_bytes", "align",
                           "on_first", "launch", "slow", NULL};
  ReducerObject *self = (ReducerObject *)op;
  /* Once built, a Reducer's plan, sizes, buffer (base pointer, dtype) and hooks belong together:
   * a second __init__ would swap the plan and sizes under a buffer attached for the old ones,
   * and the hooks' in-place pre-division would then write past its end. */
  if (self->plan) {
    PyErr_SetString(PyExc_RuntimeError,
                    "Reducer.__init__ called on a Reducer that is already initialised: create a new Reducer");
    return -1;
  }
  PyObject *numel_o, *order_o, *on_first = Py_None, *launch = Py_None, *slow = Py_None;
  Py_ssize_t esize, first_cap, cap, align;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOnnnn|OOO:Reducer", kwlist, &numel_o, &order_o, &esize, &first_cap,
                                   &cap, &align, &on_first, &launch, &slow))
    return -1;
  if (esize <= 0 || first_cap <= 0 || cap <= 0 || align <= 0) {
    PyErr_Format(PyExc_ValueError, "Reducer: esize, caps and align must be > 0 (got %zd, %zd, %zd, %zd)", esize,
                 first_cap, cap, align);
    return -1;
  }
  size_t *numel = NULL, *order = NULL;
  Py_ssize_t n1, n2;
  if (sizes_from(numel_o, "numel", &numel, &n1) < 0) return -1;
  if (sizes_from(order_o, "order", &order, &n2) < 0) {
    PyMem_Free(numel);
    return -1;
  }
  if (n1 != n2) {
    PyErr_Format(PyExc_ValueError, "Reducer: %zd sizes but an order of %zd", n1, n2);
    PyMem_Free(numel);
    PyMem_Free(order);
    return -1;
  }
  ac_bucket_plan_t *plan = NULL;
  ac_result_t r = ac_bucket_plan_create(&plan, (size_t)n1, numel, order, (size_t)esize, (size_t)first_cap,
                                        (size_t)cap, (size_t)align);
  PyMem_Free(order);
  if (r != AC_OK) {
    PyMem_Free(numel);
    pyac_raise(pyac_module_of(op), r);
    return -1;
  }
  size_t slots = (size_t)(n1 ? n1 : 1);
  double *sq = PyMem_Malloc(slots * sizeof(double));
  unsigned char *nf = PyMem_Calloc(slots, 1), *have = PyMem_Calloc(slots, 1);
  if (!sq || !nf || !have) {
    PyMem_Free(sq);
    PyMem_Free(nf);
    PyMem_Free(have);
    PyMem_Free(numel);
    ac_bucket_plan_destroy(plan);
    PyErr_NoMemory();
    return -1;
  }
  self->plan = plan;
  self->numel = numel;
  self->sq = sq;
  self->nf = nf;
  self->have = have;
  self->nhave = 0;
  self->measure = 0;
  self->last_version = -1;
  self->prescale = 1.0f;
  Py_XSETREF(self->on_first, on_first == Py_None ? NULL : Py_NewRef(on_first));
  Py_XSETREF(self->launch, launch == Py_None ? NULL : Py_NewRef(launch));
  Py_XSETREF(self->slow, slow == Py_None ? NULL : Py_NewRef(slow));
  if (!self->grad_name && !(self->grad_name = PyUnicode_InternFromString("grad"))) return -1;
  if (!self->version_name && !(self->version_name = PyUnicode_InternFromString("_version"))) return -1;
  self->launching = 0;
  return 0;
}

static int reducer_traverse(PyObject *op, visitproc visit, void *arg) {
  ReducerObject *self = (ReducerObject *)op;
  Py_VISIT(Py_TYPE(op));
  Py_VISIT(self->comm);
  Py_VISIT(self->buffer);
  Py_VISIT(self->on_first);
  Py_VISIT(self->launch);
  Py_VISIT(self->slow);
  Py_VISIT(self->bump);
  return 0;
}

static int reducer_clear(PyObject *op) {
  ReducerObject *self = (ReducerObject *)op;
  Py_CLEAR(self->comm);
  Py_CLEAR(self->buffer);
  Py_CLEAR(self->on_first);
  Py_CLEAR(self->launch);
  Py_CLEAR(self->slow);
  Py_CLEAR(self->bump);
  return 0;
}

static void reducer_dealloc(PyObject *op) {
  ReducerObject *self = (ReducerObject *)op;
  PyTypeObject *tp = Py_TYPE(op);
  PyObject_GC_UnTrack(op);
  reducer_clear(op);
  Py_CLEAR(self->grad_name);
  Py_CLEAR(self->version_name);
  PyMem_Free(self->sq);
  PyMem_Free(self->nf);
  PyMem_Free(self->have);
  ac_bucket_plan_destroy(self->plan);
  self->plan = NULL;
  ac_cuda_event_destroy(self->ev_ready);
  ac_cuda_event_destroy(self->ev_done);
  PyMem_Free(self->numel);
  tp->tp_free(op);
  Py_DECREF(tp);
}

static int has_plan(ReducerObject *self) {
  if (self->plan) return 1;
  PyErr_SetString(PyExc_RuntimeError, "Reducer was not initialised");
  return 0;
}

static PyObject *reducer_count(PyObject *op, PyObject *unused) {
  (void)unused;
  if (!has_plan((ReducerObject *)op)) return NULL;
  return PyLong_FromSize_t(ac_bucket_count(((ReducerObject *)op)->plan));
}

static PyObject *reducer_total(PyObject *op, PyObject *unused) {
  (void)unused;
  if (!has_plan((ReducerObject *)op)) return NULL;
  return PyLong_FromSize_t(ac_bucket_total(((ReducerObject *)op)->plan));
}

static PyObject *reducer_range(PyObject *op, PyObject *arg) {
  ReducerObject *self = (ReducerObject *)op;
  if (!has_plan(self)) return NULL;
  size_t b = PyLong_AsSize_t(arg), first, count;
  if (b == (size_t)-1 && PyErr_Occurred()) return NULL;
  ac_result_t r = ac_bucket_range(self->plan, b, &first, &count);
  if (r != AC_OK) return pyac_raise(pyac_module_of(op), r);
  return Py_BuildValue("(nn)", (Py_ssize_t)first, (Py_ssize_t)count);
}

static PyObject *reducer_layout(PyObject *op, PyObject *unused) {
  (void)unused;
  ReducerObject *self = (ReducerObject *)op;
  if (!has_plan(self)) return NULL;
  /* (offsets per gradient, bucket per gradient) in one call: the glue lays out views with it */
  size_t n = ac_bucket_nparams(self->plan);
  size_t *off = PyMem_Malloc((n ? n : 1) * sizeof(size_t)), *bk = PyMem_Malloc((n ? n : 1) * sizeof(size_t));
  if (!off || !bk) {
    PyMem_Free(off);
    PyMem_Free(bk);
    return PyErr_NoMemory();
  }
  for (size_t i = 0; i < n; i++) (void)ac_bucket_param(self->plan, i, &off[i], &bk[i]);
  PyObject *a = size_list(off, n), *b = size_list(bk, n);
  PyMem_Free(off);
  PyMem_Free(bk);
  if (!a || !b) {
    Py_XDECREF(a);
    Py_XDECREF(b);
    return NULL;
  }
  return Py_BuildValue("(NN)", a, b);
}

static PyObject *reducer_reset(PyObject *op, PyObject *unused) {
  (void)unused;
  ac_bucket_reset(((ReducerObject *)op)->plan);
  Py_RETURN_NONE;
}

static PyObject *reducer_ready_count(PyObject *op, PyObject *unused) {
  (void)unused;
  return PyLong_FromSize_t(ac_bucket_ready_count(((ReducerObject *)op)->plan));
}

static PyObject *reducer_mark_ready(PyObject *op, PyObject *arg) {
  ReducerObject *self = (ReducerObject *)op;
  if (!has_plan(self)) return NULL;
  size_t i = PyLong_AsSize_t(arg), from, to;
  if (i == (size_t)-1 && PyErr_Occurred()) return NULL;
  ac_result_t r = ac_bucket_mark_ready(self->plan, i, &from, &to);
  if (r != AC_OK) return pyac_raise(pyac_module_of(op), r);
  return Py_BuildValue("(nn)", (Py_ssize_t)from, (Py_ssize_t)to);
}

static PyObject *reducer_pending(PyObject *op, PyObject *unused) {
  (void)unused;
  ReducerObject *self = (ReducerObject *)op;
  if (!has_plan(self)) return NULL;
  size_t n = ac_bucket_pending(self->plan, NULL, 0);
  size_t *v = PyMem_Malloc((n ? n : 1) * sizeof(size_t));
  if (!v) return PyErr_NoMemory();
  ac_bucket_pending(self->plan, v, n);
  PyObject *l = size_list(v, n);
  PyMem_Free(v);
  return l;
}

static PyObject *reducer_arrival_order(PyObject *op, PyObject *arg) {
  ReducerObject *self = (ReducerObject *)op;
  if (!has_plan(self)) return NULL;
  size_t n = PyLong_AsSize_t(arg);
  if (n == (size_t)-1 && PyErr_Occurred()) return NULL;
  size_t *v = PyMem_Malloc((n ? n : 1) * sizeof(size_t));
  if (!v) return PyErr_NoMemory();
  ac_result_t r = ac_bucket_arrival_order(self->plan, v, n);
  if (r != AC_OK) {
    PyMem_Free(v);
    return pyac_raise(pyac_module_of(op), r);
  }
  PyObject *l = size_list(v, n);
  PyMem_Free(v);
  return l;
}

static PyObject *reducer_hook(PyObject *op, PyObject *const *a, Py_ssize_t n) {
  if (n != 2) {
    PyErr_Format(PyExc_TypeError, "hook(index, view) takes 2 arguments, %zd given", n);
    return NULL;
  }
  size_t i = PyLong_AsSize_t(a[0]);
  if (i == (size_t)-1 && PyErr_Occurred()) return NULL;
  PyObject *mod = pyac_module_of(op);
  pyac_state *st = pyac_get_state(mod);
  HookObject *h = PyObject_GC_New(HookObject, st->hook_type);
  if (!h) return NULL;
  h->reducer = Py_NewRef(op);
  h->view = Py_NewRef(a[1]);
  h->views1 = PyTuple_Pack(1, a[1]);
  h->dtype = NULL;
  h->index = i;
  if (!h->views1) {
    PyObject_GC_Track((PyObject *)h);
    Py_DECREF(h);
    return NULL;
  }
  /* a stand-in that is no tensor (ZeRO-2's shards: no gradient is ever a view) has no dtype:
   * the copy in C is then never taken */
  h->dtype = PyObject_GetAttrString(a[1], "dtype");
  if (!h->dtype) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
      PyObject_GC_Track((PyObject *)h);
      Py_DECREF(h);
      return NULL;
    }
    PyErr_Clear();
  }
  PyObject_GC_Track((PyObject *)h);
  return (PyObject *)h;
}

/* Takes the flat buffer the plan lays out (a Buffer): its base pointer, dtype and device. */
static int take_buffer(ReducerObject *self, PyObject *buffer, const char *who) {
  pyac_state *st = pyac_get_state(pyac_module_of((PyObject *)self));
  if (!PyObject_TypeCheck(buffer, st->buffer_type)) {
    PyErr_Format(PyExc_TypeError, "%s: buffer must be a Buffer (of the flat gradient buffer)", who);
    return -1;
  }
  pyac_view v;
  if (pyac_view_from(pyac_module_of((PyObject *)self), buffer, PYAC_WRITE, PYAC_ON_ANY, "buffer", &v) < 0) return -1;
  size_t n = v.n;
  void *base = v.data;
  ac_dtype_t dt = v.dt;
  int on_cuda = v.device.device_type == kDLCUDA || v.device.device_type == kDLCUDAManaged;
  pyac_view_release(&v);
  if (n < ac_bucket_total(self->plan)) {
    PyErr_Format(PyExc_ValueError, "%s: the buffer has %zu elements, the plan lays out %zu", who, n,
                 ac_bucket_total(self->plan));
    return -1;
  }
  Py_XSETREF(self->buffer, Py_NewRef(buffer));
  self->base = base;
  self->dt = dt;
  self->on_cuda = on_cuda;
  return 0;
}

static PyObject *reducer_set_buffer(PyObject *op, PyObject *buffer) {
  return take_buffer((ReducerObject *)op, buffer, "set_buffer") < 0 ? NULL : Py_NewRef(Py_None);
}

static PyObject *reducer_get_prescale(PyObject *op, void *c) {
  (void)c;
  return PyFloat_FromDouble((double)((ReducerObject *)op)->prescale);
}

static int reducer_set_prescale(PyObject *op, PyObject *v, void *c) {
  (void)c;
  double d = v ? PyFloat_AsDouble(v) : -1.0;
  if (!v || (d == -1.0 && PyErr_Occurred())) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_AttributeError, "prescale cannot be deleted");
    return -1;
  }
  ((ReducerObject *)op)->prescale = (float)d;
  return 0;
}

static PyObject *reducer_attach_nccl(PyObject *op, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"comm", "buffer", "comm_stream", "use_events", NULL};
  ReducerObject *self = (ReducerObject *)op;
  PyObject *comm, *buffer, *stream_o;
  int use_events = 1;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|p:attach_nccl", kwlist, &comm, &buffer, &stream_o, &use_events))
    return NULL;
  pyac_state *st = pyac_get_state(pyac_module_of(op));
  if (!PyObject_TypeCheck(comm, st->comm_type)) {
    PyErr_SetString(PyExc_TypeError, "attach_nccl: comm must be an NcclComm");
    return NULL;
  }
  void *stream;
  if (pyac_stream(stream_o, 0, &stream) < 0 || take_buffer(self, buffer, "attach_nccl") < 0) return NULL;
  if (use_events && !self->ev_ready) {
    ac_result_t r = ac_cuda_event_create(&self->ev_ready);
    if (r == AC_OK) r = ac_cuda_event_create(&self->ev_done);
    if (r != AC_OK) return pyac_raise(pyac_module_of(op), r);
  }
  Py_XSETREF(self->comm, Py_NewRef(comm));
  self->comm_stream = stream;
  Py_RETURN_NONE;
}

static PyObject *reducer_set_compute_stream(PyObject *op, PyObject *arg) {
  return pyac_stream(arg, 0, &((ReducerObject *)op)->compute_stream) < 0 ? NULL : Py_NewRef(Py_None);
}

static PyObject *reducer_launch_nccl(ReducerObject *self, size_t from, size_t to) {
  ac_comm_t *c = pyac_comm_handle(self->comm);
  if (!c) {
    PyErr_SetString(PyExc_ValueError, "the Reducer's NcclComm is closed");
    return NULL;
  }
  ac_result_t r = ac_comm_launch_buckets(c, self->plan, self->base, self->dt, from, to, self->compute_stream,
                                         self->comm_stream, self->ev_ready);
  if (r != AC_OK) return pyac_raise(pyac_module_of((PyObject *)self), r);
  Py_RETURN_NONE;
}

static PyObject *reducer_nccl_launch(PyObject *op, PyObject *args) {
  Py_ssize_t from, to;
  if (!PyArg_ParseTuple(args, "nn:nccl_launch", &from, &to)) return NULL;
  ReducerObject *self = (ReducerObject *)op;
  if (!self->comm || from < 0 || to < from) {
    PyErr_SetString(PyExc_ValueError, "nccl_launch: no NcclComm attached, or a bad range");
    return NULL;
  }
  return reducer_launch_nccl(self, (size_t)from, (size_t)to);
}

static PyObject *reducer_nccl_wait(PyObject *op, PyObject *unused) {
  (void)unused;
  ReducerObject *self = (ReducerObject *)op;
  if (!self->comm) {
    PyErr_SetString(PyExc_ValueError, "nccl_wait: no NcclComm attached");
    return NULL;
  }
  if (!self->ev_done) Py_RETURN_NONE; /* no events (the fake-NCCL tests): nothing to order */
  ac_result_t r = ac_cuda_stream_wait(self->compute_stream, self->comm_stream, self->ev_done);
  if (r != AC_OK) return pyac_raise(pyac_module_of(op), r);
  Py_RETURN_NONE;
}

/* ---- sums of squares taken in the hooks --------------------------------------------------- */

/* Ranges at least this long are measured with the GIL released (the sum runs on the pool). */
#define MEASURE_NOGIL_MIN ((size_t)1 << 16)

static void forget_sums(ReducerObject *self) {
  size_t n = ac_bucket_nparams(self->plan);
  memset(self->have, 0, n ? n : 1);
  self->nhave = 0;
}

/* Keeps gradient i's measurement, taken when the buffer's version was `ver`. */
static void record_sums(ReducerObject *self, size_t i, double sq, int nf, long long ver) {
  self->sq[i] = sq;
  self->nf[i] = (unsigned char)(nf != 0);
  if (!self->have[i]) {
    self->have[i] = 1;
    self->nhave++;
  }
  self->last_version = ver;
}

/* The buffer's version counter, read through a view (-1 with an exception set on failure). */
static long long view_version(ReducerObject *self, PyObject *view) {
  PyObject *vo = PyObject_GetAttr(view, self->version_name);
  if (!vo) return -1;
  long long ver = PyLong_AsLongLong(vo);
  Py_DECREF(vo);
  return ver;
}

/* Gradient i's range was just written (autograd accumulated into it, or the copy-in filled
 * it): its sum of squares and non-finite flag, while it is in cache. The version is read
 * before the sum, so a write by another thread while the GIL is released shows as a change. */
static int measure_slot(ReducerObject *self, size_t i, PyObject *view) {
  long long ver = view_version(self, view);
  if (ver == -1 && PyErr_Occurred()) return -1;
  /* one write since the last measurement: this gradient's own; none: nothing changed */
  if (self->nhave && ver != self->last_version && ver != self->last_version + 1) forget_sums(self);
  size_t off, bucket, n = self->numel[i];
  double sq = 0.0;
  int nf = 0;
  ac_result_t r = ac_bucket_param(self->plan, i, &off, &bucket);
  if (r == AC_OK) {
    const void *p = (const char *)self->base + off * ac_dtype_size(self->dt);
    if (n >= MEASURE_NOGIL_MIN) {
      Py_BEGIN_ALLOW_THREADS r = ac_sumsq(self->dt, p, n, &sq, &nf);
      Py_END_ALLOW_THREADS
    } else {
      r = ac_sumsq(self->dt, p, n, &sq, &nf);
    }
  }
  if (r != AC_OK) {
    forget_sums(self);
    pyac_raise(pyac_module_of((PyObject *)self), r);
    return -1;
  }
  record_sums(self, i, sq, nf, ver);
  return 0;
}

/* ---- the copy-in in C ----------------------------------------------------------------------- */

/* 1 when obj.name is true, 0 when false, -1 with an exception set */
static int attr_true(PyObject *obj, const char *name) {
  PyObject *v = PyObject_GetAttrString(obj, name);
  if (!v) return -1;
  int t = PyObject_IsTrue(v);
  Py_DECREF(v);
  return t;
}

/* An integer result of obj.name() (-1 with an exception set, or when it is not one). */
static long long call_int(PyObject *obj, const char *name) {
  PyObject *r = PyObject_CallMethod(obj, name, NULL);
  if (!r) return -1;
  long long v = PyLong_AsLongLong(r);
  Py_DECREF(r);
  return v;
}

/* The common copy-in (a new gradient after zero_grad set `.grad` to None): done here instead of
 * in the glue's Python (GradLayout._copy_in), with the measurement for clip fused into the copy
 * (ac_copy_in measures each piece right after writing it, in cache, and gives the bits a later
 * read pass of the range gives). Taken only for what the slow path would do the same way: a
 * plain tensor (the view's type or its base) of the buffer's dtype (the parameter's too), CPU, contiguous,
 * without a negative or conjugate bit, of the range's size, not requiring grad, not overlapping
 * the buffer; everything else (a cast parameter, a gradient with
 * a graph, CUDA buffers) returns 0 and goes to the slow path. On success the view holds the
 * gradient times the reducer's prescale (as the slow path's torch.mul), its version is bumped as
 * torch's copy_ would, and `.grad` points at it. Returns 1 done, 0 not taken, -1 error. */
static int fast_copy_in(ReducerObject *red, HookObject *h, PyObject *param, PyObject *g, int *measured) {
  *measured = 0;
  /* the view is a GradView (grad_layout.py), a direct subclass of torch.Tensor; the gradient
   * must be a plain torch.Tensor (or a GradView) */
  if (!red->bump || !red->base || red->on_cuda || !h->dtype) return 0;
  if (Py_TYPE(g) != Py_TYPE(h->view) && Py_TYPE(g) != Py_TYPE(h->view)->tp_base) return 0;
  size_t n = red->numel[h->index];
  /* the gradient's dtype and the parameter's (torch >= 2.9's grad_dtype lets them differ: a
   * parameter cast after prepare() must still reach the slow path, which rebuilds the buffer) */
  PyObject *objs[2] = {g, param};
  for (int k = 0; k < 2; k++) {
    PyObject *dt = PyObject_GetAttrString(objs[k], "dtype");
    if (!dt) return -1;
    int same = dt == h->dtype;
    Py_DECREF(dt);
    if (!same) return 0;
  }
  int t = attr_true(g, "requires_grad");
  if (t != 0) return t < 0 ? -1 : 0;
  if ((t = attr_true(g, "is_cpu")) != 1) return t < 0 ? -1 : 0;
  /* the memory must hold the values as they read: no lazy negation or conjugation (copy_
   * resolves those bits; a raw copy would not) */
  static const char *const must_be_false[] = {"is_neg", "is_conj"};
  for (int k = 0; k < 2; k++) {
    PyObject *b = PyObject_CallMethod(g, must_be_false[k], NULL);
    if (!b) return -1;
    t = PyObject_IsTrue(b);
    Py_DECREF(b);
    if (t != 0) return t < 0 ? -1 : 0;
  }
  PyObject *c = PyObject_CallMethod(g, "is_contiguous", NULL);
  if (!c) return -1;
  t = PyObject_IsTrue(c);
  Py_DECREF(c);
  if (t != 1) return t < 0 ? -1 : 0;
  long long numel = call_int(g, "numel");
  if (numel == -1 && PyErr_Occurred()) return -1;
  if (numel < 0 || (size_t)numel != n) return 0;
  long long ptr = call_int(g, "data_ptr");
  if (ptr == -1 && PyErr_Occurred()) return -1;
  size_t off, bucket, es = ac_dtype_size(red->dt);
  if (ac_bucket_param(red->plan, h->index, &off, &bucket) != AC_OK) return 0;
  char *dst = (char *)red->base + off * es;
  const char *src = (const char *)(uintptr_t)ptr;
  if (n && (!src || (src < dst + n * es && dst < src + n * es))) return 0;
  double sq = 0.0;
  int nf = 0, want = red->measure;
  float f = red->prescale;
  ac_result_t r;
  if (n >= MEASURE_NOGIL_MIN) {
    /* `g` and the view stay referenced by this frame: their memory outlives the copy */
    Py_BEGIN_ALLOW_THREADS r = ac_copy_in(red->dt, src, dst, n, f, want ? &sq : NULL, want ? &nf : NULL);
    Py_END_ALLOW_THREADS
  } else {
    r = ac_copy_in(red->dt, src, dst, n, f, want ? &sq : NULL, want ? &nf : NULL);
  }
  if (r != AC_OK) {
    forget_sums(red);
    pyac_raise(pyac_module_of((PyObject *)red), r);
    return -1;
  }
  /* the view was written: from here a failure also drops the hooks' measurements, which could
   * otherwise describe memory that changed without a version bump */
  PyObject *b = PyObject_CallOneArg(red->bump, h->views1);
  if (!b || PyObject_SetAttr(param, red->grad_name, h->view) < 0) {
    Py_XDECREF(b);
    forget_sums(red);
    return -1;
  }
  Py_DECREF(b);
  if (want) {
    long long ver = view_version(red, h->view);
    if (ver == -1 && PyErr_Occurred()) {
      forget_sums(red);
      return -1;
    }
    /* one write since the last measurement (this one): the chain goes on; else it starts over */
    if (red->nhave && ver != red->last_version + 1) forget_sums(red);
    record_sums(red, h->index, sq, nf, ver);
    *measured = 1;
  }
  return 1;
}

static PyObject *reducer_measure_now(PyObject *op, PyObject *const *a, Py_ssize_t n) {
  ReducerObject *self = (ReducerObject *)op;
  if (n != 2) {
    PyErr_Format(PyExc_TypeError, "measure_now(index, view) takes 2 arguments, %zd given", n);
    return NULL;
  }
  if (!has_plan(self)) return NULL;
  size_t i = PyLong_AsSize_t(a[0]);
  if (i == (size_t)-1 && PyErr_Occurred()) return NULL;
  if (i >= ac_bucket_nparams(self->plan)) {
    PyErr_Format(PyExc_IndexError, "measure_now: gradient %zu of %zu", i, ac_bucket_nparams(self->plan));
    return NULL;
  }
  if (!self->base || self->on_cuda) Py_RETURN_NONE; /* nothing is measured on a device buffer */
  return measure_slot(self, i, a[1]) < 0 ? NULL : Py_NewRef(Py_None);
}

static PyObject *reducer_sums(PyObject *op, PyObject *arg) {
  ReducerObject *self = (ReducerObject *)op;
  if (!has_plan(self)) return NULL;
  long long ver = PyLong_AsLongLong(arg);
  if (ver == -1 && PyErr_Occurred()) return NULL;
  size_t n = ac_bucket_nparams(self->plan);
  if (n == 0 || self->nhave != n || ver != self->last_version) Py_RETURN_NONE;
  double total = 0.0, rounded = 0.0;
  int nf = 0;
  for (size_t i = 0; i < n; i++) { /* parameter order: the result does not depend on hook timing */
    total += self->sq[i];
    /* fp32 buffers: the exact sum stands for torch's (GradLayout.sums says why) */
    rounded += self->dt == AC_F32 ? self->sq[i] : ac_norm_sq_rounded(self->dt, self->sq[i], 1.0);
    nf |= self->nf[i];
  }
  return Py_BuildValue("(ddO)", total, rounded, nf ? Py_True : Py_False);
}

static PyObject *reducer_forget_sums(PyObject *op, PyObject *unused) {
  (void)unused;
  if (!has_plan((ReducerObject *)op)) return NULL;
  forget_sums((ReducerObject *)op);
  Py_RETURN_NONE;
}

static PyObject *reducer_get_measured(PyObject *op, void *c) {
  (void)c;
  return PyLong_FromSize_t(((ReducerObject *)op)->nhave);
}

/* The Reducer's flags (launching, defer, requeue): one getter and setter, the field's offset
 * in the closure. */
static PyObject *reducer_get_flag(PyObject *op, void *offset) {
  return PyBool_FromLong(*(int *)((char *)op + (size_t)offset));
}

static int reducer_set_flag(PyObject *op, PyObject *v, void *offset) {
  if (!v) {
    PyErr_SetString(PyExc_AttributeError, "Reducer flags cannot be deleted");
    return -1;
  }
  int t = PyObject_IsTrue(v);
  if (t < 0) return -1;
  *(int *)((char *)op + (size_t)offset) = t;
  return 0;
}

#define FLAG(field) (void *)offsetof(ReducerObject, field)

static PyMethodDef reducer_methods[] = {
    {"count", reducer_count, METH_NOARGS, "count() -> number of buckets"},
    {"total", reducer_total, METH_NOARGS, "total() -> elements of the flat buffer, padding included"},
    {"range", reducer_range, METH_O, "range(b) -> (first, count): bucket b's elements"},
    {"layout", reducer_layout, METH_NOARGS, "layout() -> (offsets, buckets), one entry per gradient"},
    {"reset", reducer_reset, METH_NOARGS, "reset(): a new backward; nothing ready, nothing launched"},
    {"ready_count", reducer_ready_count, METH_NOARGS, "ready_count() -> gradients marked since reset()"},
    {"mark_ready", reducer_mark_ready, METH_O, "mark_ready(i) -> (from, to): buckets now launchable"},
    {"pending", reducer_pending, METH_NOARGS, "pending() -> gradients not marked ready in this backward"},
    {"arrival_order", reducer_arrival_order, METH_O, "arrival_order(n) -> the order gradients were marked"},
    {"attach_nccl", (PyCFunction)(void (*)(void))reducer_attach_nccl, METH_VARARGS | METH_KEYWORDS,
     "attach_nccl(comm, buffer, comm_stream, use_events=True): hooks launch complete buckets with NCCL "
     "from C on comm_stream, after the compute stream's work"},
    {"set_buffer", reducer_set_buffer, METH_O,
     "set_buffer(buffer): the flat buffer (a Buffer) the plan lays out; the hooks pre-divide in it"},
    {"set_compute_stream", reducer_set_compute_stream, METH_O,
     "set_compute_stream(stream): the stream backward runs on (read at each backward)"},
    {"nccl_launch", reducer_nccl_launch, METH_VARARGS, "nccl_launch(from, to): launch buckets [from, to)"},
    {"nccl_wait", reducer_nccl_wait, METH_NOARGS,
     "nccl_wait(): the compute stream waits for every all-reduce launched so far (no host wait)"},
    {"sums", reducer_sums, METH_O,
     "sums(version) -> (sum_of_squares, sum_of_rounded_norms_squared, has_nonfinite) of the whole buffer from the "
     "hooks' measurements, in parameter order (the second with each gradient's norm rounded to the buffer's dtype, "
     "as torch's clip_grad_norm_ takes them); None unless every gradient was measured and the buffer's version is still `version`"},
    {"measure_now", (PyCFunction)(void (*)(void))reducer_measure_now, METH_FASTCALL,
     "measure_now(i, view): gradient i's range (`view`, of the buffer) was just written outside a hook "
     "(GradLayout.resync): measure it as a hook would"},
    {"forget_sums", reducer_forget_sums, METH_NOARGS, "forget_sums(): every measurement taken in the hooks is dropped"},
    {"hook", (PyCFunction)(void (*)(void))reducer_hook, METH_FASTCALL,
     "hook(i, view) -> a GradHook for gradient i, to pass to register_post_accumulate_grad_hook"},
    {NULL, NULL, 0, NULL},
};

static PyObject *reducer_get_bump(PyObject *op, void *c) {
  (void)c;
  PyObject *b = ((ReducerObject *)op)->bump;
  return Py_NewRef(b ? b : Py_None);
}

static int reducer_set_bump(PyObject *op, PyObject *v, void *c) {
  (void)c;
  if (v && v != Py_None && !PyCallable_Check(v)) {
    PyErr_SetString(PyExc_TypeError, "Reducer.bump must be callable or None");
    return -1;
  }
  Py_XSETREF(((ReducerObject *)op)->bump, v && v != Py_None ? Py_NewRef(v) : NULL);
  return 0;
}

static PyGetSetDef reducer_getset[] = {
    {"launching", reducer_get_flag, reducer_set_flag,
     "whether hooks call launch() for buckets that become complete (sync steps of multi-process runs)",
     FLAG(launching)},
    {"defer", reducer_get_flag, reducer_set_flag,
     "hooks do not launch complete buckets (neither over NCCL nor through launch()); the glue launches "
     "them all at the end of backward, so every rank issues them in an order a joined rank can shadow",
     FLAG(defer)},
    {"requeue", reducer_get_flag, reducer_set_flag,
     "the next hook calls on_first again although gradients are marked (the glue's end of backward "
     "ran in a reentrant backward nested in the one still delivering this buffer's gradients)",
     FLAG(requeue)},
    {"measure", reducer_get_flag, reducer_set_flag,
     "hooks measure each gradient's range (sum of squares, non-finite) right after it was written, for "
     "sums() (CPU buffers)", FLAG(measure)},
    {"measured", reducer_get_measured, NULL, "gradients with a valid measurement (see sums())", NULL},
    {"bump", reducer_get_bump, reducer_set_bump,
     "bump((tensor,)): torch's version-counter increment (torch._C._increment_version). Set, the hooks copy "
     "a new CPU gradient into its view in C (measured on the way when `measure`) and bump the view's "
     "version; None: every copy-in goes to the slow path", NULL},
    {"prescale", reducer_get_prescale, reducer_set_prescale,
     "on launching backwards, a gradient that already is its view is multiplied by this in place when it "
     "becomes ready (1/world: the all-reduce's sum is then the average)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot reducer_slots[] = {
    {Py_tp_init, reducer_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, reducer_dealloc},
    {Py_tp_traverse, reducer_traverse},
    {Py_tp_clear, reducer_clear},
    {Py_tp_methods, reducer_methods},
    {Py_tp_getset, reducer_getset},
    {Py_tp_doc, "Reducer(numel, order, esize, first_cap_bytes, cap_bytes, align, on_first=None, launch=None, "
                "slow=None): the bucket plan of one flat gradient buffer and readiness tracking for its hooks."},
    {0, NULL},
};

PyType_Spec pyac_reducer_spec = {
    .name = "accelerate_c._C.Reducer",
    .basicsize = sizeof(ReducerObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = reducer_slots,
};

/* ---- GradHook --------------------------------------------------------------------------- */

static PyObject *hook_call(PyObject *op, PyObject *args, PyObject *kwds) {
  HookObject *h = (HookObject *)op;
  ReducerObject *red = (ReducerObject *)h->reducer;
  if (kwds && PyDict_GET_SIZE(kwds)) {
    PyErr_SetString(PyExc_TypeError, "GradHook takes no keyword arguments");
    return NULL;
  }
  if (PyTuple_GET_SIZE(args) != 1) {
    PyErr_Format(PyExc_TypeError, "GradHook takes 1 argument (the parameter), %zd given", PyTuple_GET_SIZE(args));
    return NULL;
  }
  if (!has_plan(red)) return NULL;
  PyObject *param = PyTuple_GET_ITEM(args, 0);
  if ((ac_bucket_ready_count(red->plan) == 0 || red->requeue) && red->on_first) {
    PyObject *r = PyObject_CallNoArgs(red->on_first);
    if (!r) return NULL;
    Py_DECREF(r);
  }
  PyObject *g = PyObject_GetAttr(param, red->grad_name);
  if (!g) return NULL;
  int is_view = g == h->view, measured = 0, fast = 0;
  if (!is_view) fast = fast_copy_in(red, h, param, g, &measured);
  Py_DECREF(g);
  if (fast < 0) return NULL;
  if (!is_view && !fast) {
    if (!red->slow) {
      PyErr_SetString(PyExc_RuntimeError, "GradHook: the gradient is not the buffer's view and no slow path is set");
      return NULL;
    }
    PyObject *idx = PyLong_FromSize_t(h->index);
    if (!idx) return NULL;
    PyObject *r = PyObject_CallFunctionObjArgs(red->slow, idx, param, NULL);
    Py_DECREF(idx);
    if (!r) return NULL;
    int keep = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (keep < 0) return NULL;
    if (!keep) Py_RETURN_NONE;
  }
  if (is_view && red->launching && red->prescale != 1.0f && red->base) {
    /* the average is taken before the sum, in the memory the all-reduce will read, as torch
     * DDP divides (the slow path folds it into its copy); on CUDA on the compute stream */
    size_t off, bucket;
    ac_result_t rs = ac_bucket_param(red->plan, h->index, &off, &bucket);
    void *p = (char *)red->base + off * ac_dtype_size(red->dt);
    if (rs == AC_OK)
      rs = red->on_cuda ? ac_cuda_scale(red->dt, p, red->numel[h->index], red->prescale, NULL, red->compute_stream)
                        : ac_scale(red->dt, p, red->numel[h->index], red->prescale);
    if (rs != AC_OK) return pyac_raise(pyac_module_of(h->reducer), rs);
  }
  if (red->measure && !red->on_cuda && red->base && !measured) {
    /* after the copy-in, the gradient is the view unless it was kept (create_graph) */
    int now_view = is_view || fast;
    if (!now_view) {
      PyObject *g2 = PyObject_GetAttr(param, red->grad_name);
      if (!g2) return NULL;
      now_view = g2 == h->view;
      Py_DECREF(g2);
    }
    if (now_view && measure_slot(red, h->index, h->view) < 0) return NULL;
  }
  /* A backward that reduces nothing (one process, no_sync) may see one gradient twice, e.g. a
   * weight used by two reentrant-checkpointed segments: autograd accumulated it into the view,
   * as torch does, and nothing waits on its bucket. Only a reduced backward must refuse it. */
  if (!red->launching && ac_bucket_is_ready(red->plan, h->index)) Py_RETURN_NONE;
  size_t from, to;
  ac_result_t rc = ac_bucket_mark_ready(red->plan, h->index, &from, &to);
  if (rc != AC_OK) return pyac_raise(pyac_module_of(h->reducer), rc);
  if (!red->launching || to == from || red->defer) Py_RETURN_NONE;
  if (red->comm) return reducer_launch_nccl(red, from, to);
  if (red->launch) {
    PyObject *r = PyObject_CallFunction(red->launch, "nn", (Py_ssize_t)from, (Py_ssize_t)to);
    if (!r) return NULL;
    Py_DECREF(r);
  }
  Py_RETURN_NONE;
}

static int hook_traverse(PyObject *op, visitproc visit, void *arg) {
  HookObject *h = (HookObject *)op;
  Py_VISIT(Py_TYPE(op));
  Py_VISIT(h->reducer);
  Py_VISIT(h->view);
  Py_VISIT(h->views1);
  Py_VISIT(h->dtype);
  return 0;
}

static int hook_clear(PyObject *op) {
  HookObject *h = (HookObject *)op;
  Py_CLEAR(h->reducer);
  Py_CLEAR(h->view);
  Py_CLEAR(h->views1);
  Py_CLEAR(h->dtype);
  return 0;
}

static void hook_dealloc(PyObject *op) {
  PyTypeObject *tp = Py_TYPE(op);
  PyObject_GC_UnTrack(op);
  hook_clear(op);
  tp->tp_free(op);
  Py_DECREF(tp);
}

static PyObject *hook_get_index(PyObject *op, void *c) {
  (void)c;
  return PyLong_FromSize_t(((HookObject *)op)->index);
}

static PyGetSetDef hook_getset[] = {
    {"index", hook_get_index, NULL, "the gradient's index in its Reducer", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyObject *hook_new_disallowed(PyTypeObject *t, PyObject *a, PyObject *k) {
  (void)t, (void)a, (void)k;
  PyErr_SetString(PyExc_TypeError, "GradHook objects are made by Reducer.hook(i, view)");
  return NULL;
}

static PyType_Slot hook_slots[] = {
    {Py_tp_new, hook_new_disallowed},
    {Py_tp_call, hook_call},
    {Py_tp_dealloc, hook_dealloc},
    {Py_tp_traverse, hook_traverse},
    {Py_tp_clear, hook_clear},
    {Py_tp_getset, hook_getset},
    {Py_tp_doc, "GradHook: the post-accumulate-grad hook of one parameter (Reducer.hook(i, view))."},
    {0, NULL},
};

PyType_Spec pyac_hook_spec = {
    .name = "accelerate_c._C.GradHook",
    .basicsize = sizeof(HookObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = hook_slots,
};

/* comm_shm_py.c — ShmComm: the shared-memory collectives (ac/comm_shm.h) as a Python type, and
 * ShmWork, the handle of one asynchronous collective. Tensors arrive through DLPack (CPU,
 * C-contiguous; float32/64, float16, bfloat16, int32, int64). Every collective goes through the
 * communicator's queue (its progress thread runs them in call order, whichever Python thread
 * called; a blocking one finding the queue idle runs on the calling thread); a blocking one waits
 * with the GIL released, an async_op=True one returns a ShmWork that
 * keeps its tensors (and their DLPack exports) alive until it is waited for. */
#include "pyac.h"

#include <time.h>

#include "ac/comm_shm.h"
#include "shm_window_py.h"

typedef struct {
  PyObject_HEAD
  ac_shm_queue_t *q;
  int nranks, rank;
  /* calls using q with the GIL released (a blocking collective run inline, a window being made):
   * close() lets them end (aborting the communicator) before it frees q */
  int active;
} ShmObject;

typedef struct {
  void *data;
  size_t n;
  ac_shm_dtype_t dt;
  void *owner;
  int versioned;
} shm_view;

typedef struct {
  int writable;
  const char *arg;
  shm_view *v;
} shm_check_ctx;

static int map_dtype(DLDataType d, ac_shm_dtype_t *out) {
  if (d.lanes != 1) return 0;
  if (d.code == kDLFloat && d.bits == 32) return *out = AC_SHM_F32, 1;
  if (d.code == kDLFloat && d.bits == 64) return *out = AC_SHM_F64, 1;
  if (d.code == kDLFloat && d.bits == 16) return *out = AC_SHM_F16, 1;
  if (d.code == kDLBfloat && d.bits == 16) return *out = AC_SHM_BF16, 1;
  if (d.code == kDLInt && d.bits == 32) return *out = AC_SHM_I32, 1;
  if (d.code == kDLInt && d.bits == 64) return *out = AC_SHM_I64, 1;
  return 0;
}

static int shm_check(const DLTensor *t, uint64_t flags, void *p) {
  shm_check_ctx *c = p;
  if (t->device.device_type != kDLCPU) {
    PyErr_Format(PyExc_ValueError, "%s: shared-memory collectives take CPU tensors (DLPack device type %d)", c->arg,
                 (int)t->device.device_type);
    return -1;
  }
  if (!map_dtype(t->dtype, &c->v->dt)) {
    PyErr_Format(PyExc_ValueError, "%s: dtype (DLPack code %u, %u bits) is not float32/float64/float16/bfloat16/"
                 "int32/int64", c->arg, (unsigned)t->dtype.code, (unsigned)t->dtype.bits);
    return -1;
  }
  size_t n;
  if ((c->writable && pyac_dl_writable(flags, c->arg) < 0) ||
      pyac_dl_layout(t, ac_shm_dtype_size(c->v->dt), c->arg, &n) < 0)
    return -1;
  c->v->n = n;
  c->v->data = n ? (char *)t->data + t->byte_offset : NULL;
  return 0;
}

static int view(PyObject *obj, int writable, const char *arg, shm_view *v) {
  memset(v, 0, sizeof *v);
  shm_check_ctx ctx = {writable, arg, v};
  return pyac_dlpack_take(obj, arg, shm_check, &ctx, &v->owner, &v->versioned);
}

static void release(shm_view *v) {
  pyac_dlpack_release(v->owner, v->versioned);
  v->owner = NULL;
}

static int parse_op(PyObject *o, ac_redop_t *op) {
  if (!o) return 0;
  const char *s = PyUnicode_AsUTF8(o);
  if (!s) return -1;
  static const struct {
    const char *name;
    ac_redop_t op;
  } names[] = {{"sum", AC_RED_SUM}, {"max", AC_RED_MAX}, {"min", AC_RED_MIN}, {"avg", AC_RED_AVG}};
  for (int i = 0; i < 4; i++)
    if (strcmp(s, names[i].name) == 0) return *op = names[i].op, 0;
  PyErr_Format(PyExc_ValueError, "op must be 'sum', 'max', 'min' or 'avg', not %R", o);
  return -1;
}

static ac_shm_queue_t *open_queue(PyObject *op) {
  ac_shm_queue_t *q = ((ShmObject *)op)->q;
  if (!q) PyErr_SetString(PyExc_ValueError, "the ShmComm is closed");
  return q;
}

/* ---- ShmWork -------------------------------------------------------------------------------- */
typedef struct {
  PyObject_HEAD
  ac_shm_req_t *req;
  shm_view views[2];
  int nviews;
  PyObject *keep;  /* the tensors, alive until the collective has run */
  PyObject *etype, *evalue, *etb; /* the exception of a failed wait, raised again by later waits */
} WorkObject;

/* Waits (GIL released), then lets go of the tensors; 0, or -1 with the collective's error set. */
static int work_finish(WorkObject *w) {
  if (w->req) {
    ac_result_t r;
    Py_BEGIN_ALLOW_THREADS r = ac_shm_req_wait(w->req);
    Py_END_ALLOW_THREADS
    w->req = NULL;
    for (int i = 0; i < w->nviews; i++) release(&w->views[i]);
    w->nviews = 0;
    Py_CLEAR(w->keep);
    if (r != AC_OK) {
      pyac_raise_value(pyac_module_of((PyObject *)w), r);
      PyErr_Fetch(&w->etype, &w->evalue, &w->etb);
      PyErr_NormalizeException(&w->etype, &w->evalue, &w->etb);
    }
  }
  if (w->etype) {
    Py_XINCREF(w->etype);
    Py_XINCREF(w->evalue);
    Py_XINCREF(w->etb);
    PyErr_Restore(w->etype, w->evalue, w->etb);
    return -1;
  }
  return 0;
}

static PyObject *work_wait(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kw) {
  (void)args;
  (void)nargs;
  (void)kw; /* torch's Work.wait(timeout=...): the communicator's own timeout applies */
  if (work_finish((WorkObject *)op) < 0) return NULL;
  Py_RETURN_TRUE;
}

static PyObject *work_is_completed(PyObject *op, PyObject *unused) {
  (void)unused;
  WorkObject *w = (WorkObject *)op;
  return PyBool_FromLong(!w->req || ac_shm_req_done(w->req));
}

static void work_dealloc(PyObject *op) {
  WorkObject *w = (WorkObject *)op;
  if (w->req) { /* never waited for: the buffers must outlive the collective */
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    if (work_finish(w) < 0) PyErr_Clear();
    PyErr_Restore(t, v, tb);
  }
  Py_CLEAR(w->keep);
  Py_CLEAR(w->etype);
  Py_CLEAR(w->evalue);
  Py_CLEAR(w->etb);
  pyac_plain_dealloc(op);
}

static PyMethodDef work_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))work_wait, METH_FASTCALL | METH_KEYWORDS,
     "wait(): blocks until the collective has run; raises its error"},
    {"is_completed", work_is_completed, METH_NOARGS, "is_completed(): whether the collective has run"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot work_slots[] = {
    {Py_tp_dealloc, work_dealloc},
    {Py_tp_methods, work_methods},
    {Py_tp_doc, "ShmWork: one asynchronous shared-memory collective (ShmComm(..., async_op=True))"},
    {0, NULL},
};

PyType_Spec pyac_shm_work_spec = {
    .name = "accelerate_c._C.ShmWork",
    .basicsize = sizeof(WorkObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = work_slots,
};

/* Submits `o` on the views (consumed: released here or by the ShmWork). Blocking: waits and
 * returns None; async: returns a ShmWork keeping `keep` alive. */
static PyObject *submit(PyObject *op, const ac_shm_op_t *o, shm_view *views, int nviews, PyObject *keep,
                        int async) {
  ac_shm_queue_t *q = open_queue(op);
  if (q && !async) { /* on this thread when the queue is idle (ac_shm_run): no hand-off */
    ac_result_t r;
    ((ShmObject *)op)->active++;
    Py_BEGIN_ALLOW_THREADS r = ac_shm_run(q, o);
    Py_END_ALLOW_THREADS
    ((ShmObject *)op)->active--;
    for (int i = 0; i < nviews; i++) release(&views[i]);
    if (r != AC_OK) return pyac_raise_value(pyac_module_of(op), r);
    Py_RETURN_NONE;
  }
  ac_shm_req_t *req = NULL;
  ac_result_t r = q ? ac_shm_submit(q, o, &req) : AC_ERR_STATE;
  if (!q || r != AC_OK) {
    for (int i = 0; i < nviews; i++) release(&views[i]);
    return q ? pyac_raise_value(pyac_module_of(op), r) : NULL;
  }
  PyObject *mod = pyac_module_of(op);
  PyObject *work_type = PyObject_GetAttrString(mod, "ShmWork");
  WorkObject *w = work_type ? PyObject_New(WorkObject, (PyTypeObject *)work_type) : NULL;
  Py_XDECREF(work_type);
  if (!w) { /* the collective is queued: it must still be waited for before the buffers go */
    Py_BEGIN_ALLOW_THREADS ac_shm_req_wait(req);
    Py_END_ALLOW_THREADS
    for (int i = 0; i < nviews; i++) release(&views[i]);
    return NULL;
  }
  w->req = req;
  w->nviews = nviews;
  for (int i = 0; i < nviews; i++) w->views[i] = views[i];
  Py_INCREF(keep);
  w->keep = keep;
  w->etype = w->evalue = w->etb = NULL;
  if (async) return (PyObject *)w;
  int rc = work_finish(w);
  Py_DECREF(w);
  if (rc < 0) return NULL;
  Py_RETURN_NONE;
}

/* submit() keeping the Python objects `a` and `b` (the tensors) alive with the request. */
static PyObject *submit_keeping(PyObject *op, const ac_shm_op_t *o, shm_view *views, int nviews, PyObject *a,
                                PyObject *b, int async) {
  PyObject *keep = PyTuple_Pack(2, a, b);
  if (!keep) {
    for (int i = 0; i < nviews; i++) release(&views[i]);
    return NULL;
  }
  PyObject *res = submit(op, o, views, nviews, keep, async);
  Py_DECREF(keep);
  return res;
}

/* ---- ShmComm -------------------------------------------------------------------------------- */
static int shm_init(PyObject *op, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"name", "nranks", "rank", "slot_bytes", "timeout_s", NULL};
  const char *name;
  int nranks, rank;
  Py_ssize_t slot = 4 << 20;
  double timeout_s = 1800.0;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "sii|nd:ShmComm", kwlist, &name, &nranks, &rank, &slot, &timeout_s))
    return -1;
  if (slot < 0 || !(timeout_s > 0) || timeout_s > 2e6) {
    PyErr_Format(PyExc_ValueError, "slot_bytes must be >= 0 and timeout_s in (0, 2e6], got %zd and %g", slot,
                 timeout_s);
    return -1;
  }
  ShmObject *self = (ShmObject *)op;
  if (self->q) {
    PyErr_SetString(PyExc_RuntimeError, "ShmComm.__init__ called twice");
    return -1;
  }
  ac_shm_t *c = NULL;
  ac_shm_queue_t *q = NULL;
  ac_result_t r;
  Py_BEGIN_ALLOW_THREADS r = ac_shm_create(&c, name, nranks, rank, (size_t)slot, (int)(timeout_s * 1000.0));
  if (r == AC_OK && (r = ac_shm_queue_create(&q, c)) != AC_OK) ac_shm_destroy(c);
  Py_END_ALLOW_THREADS
  if (r != AC_OK) {
    pyac_raise_value(pyac_module_of(op), r);
    return -1;
  }
  self->q = q;
  self->nranks = nranks;
  self->rank = rank;
  return 0;
}

static PyObject *shm_all_reduce(PyObject *op, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"tensor", "op", "out", "async_op", NULL};
  PyObject *t, *opname = NULL, *out = Py_None;
  int async = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|UOp:all_reduce", kwlist, &t, &opname, &out, &async)) return NULL;
  ac_redop_t rop = AC_RED_SUM;
  if (!open_queue(op) || parse_op(opname, &rop) < 0) return NULL;
  shm_view v[2];
  if (view(t, out == Py_None, "tensor", &v[0]) < 0) return NULL;
  int nv = 1;
  if (out != Py_None) {
    if (view(out, 1, "out", &v[1]) < 0) {
      release(&v[0]);
      return NULL;
    }
    nv = 2;
    if (v[1].n != v[0].n || v[1].dt != v[0].dt) {
      release(&v[0]);
      release(&v[1]);
      PyErr_Format(PyExc_ValueError, "all_reduce: out must have tensor's dtype and %zu elements", v[0].n);
      return NULL;
    }
  }
  ac_shm_op_t o = {.kind = AC_SHM_OP_ALL_REDUCE, .send = v[0].data, .recv = nv == 2 ? v[1].data : v[0].data,
                   .count = v[0].n, .dt = v[0].dt, .op = rop};
  size_t es = ac_shm_dtype_size(v[0].dt), at;
  ac_shm_window_t *w;
  if (nv == 1 && pyac_shm_window_find(((ShmObject *)op)->q, v[0].data, v[0].n * es, &w, &at) && at % es == 0) {
    /* the tensor lives in a shared window: reduced there, no copy in or out (every rank's does:
     * a rank whose tensor does not is named by the collective's argument check) */
    o.kind = AC_SHM_OP_WINDOW_ALL_REDUCE;
    o.window = w;
    o.offset = at / es;
  }
  return submit_keeping(op, &o, v, nv, t, out, async);
}

static PyObject *shm_reduce_scatter(PyObject *op, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"out", "tensor", "op", "async_op", NULL};
  PyObject *o_, *t, *opname = NULL;
  int async = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|Up:reduce_scatter", kwlist, &o_, &t, &opname, &async)) return NULL;
  ac_redop_t rop = AC_RED_SUM;
  if (!open_queue(op) || parse_op(opname, &rop) < 0) return NULL;
  shm_view v[2];
  if (view(o_, 1, "out", &v[0]) < 0) return NULL;
  if (view(t, 0, "tensor", &v[1]) < 0) {
    release(&v[0]);
    return NULL;
  }
  size_t n = (size_t)((ShmObject *)op)->nranks;
  if (v[0].dt != v[1].dt || v[1].n != v[0].n * n) {
    PyErr_Format(PyExc_ValueError, "reduce_scatter: tensor must have out's dtype and %zu x %zu elements, has %zu", n,
                 v[0].n, v[1].n);
    release(&v[0]);
    release(&v[1]);
    return NULL;
  }
  ac_shm_op_t o = {.kind = AC_SHM_OP_REDUCE_SCATTER, .send = v[1].data, .recv = v[0].data, .count = v[0].n,
                   .dt = v[0].dt, .op = rop};
  size_t es = ac_shm_dtype_size(v[1].dt), at;
  ac_shm_window_t *w;
  /* the result private, or exactly this rank's chunk of the input (in place): any other place
   * in the input would be written while a peer reads it (the copy path copies first) */
  const char *in = v[1].data, *res = v[0].data;
  size_t rb = v[0].n * es;
  int out_ok = res + rb <= in || res >= in + v[1].n * es || res == in + (size_t)((ShmObject *)op)->rank * rb;
  if (v[1].n && out_ok && pyac_shm_window_find(((ShmObject *)op)->q, v[1].data, v[1].n * es, &w, &at) &&
      at % es == 0) {
    /* the input lives in a shared window: where every rank's does (at the same place), each
     * reduces its chunk from every region with no copy in or out; otherwise the ranks agree
     * inside the collective to take the slots (ac_shm_window_reduce_scatter) */
    o.kind = AC_SHM_OP_WINDOW_REDUCE_SCATTER;
    o.window = w;
    o.offset = at / es;
    o.send = NULL;
  }
  return submit_keeping(op, &o, v, 2, o_, t, async);
}

static PyObject *shm_all_gather(PyObject *op, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"out", "tensor", "counts", "async_op", NULL};
  PyObject *o_, *t, *counts_o = Py_None;
  int async = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|Op:all_gather", kwlist, &o_, &t, &counts_o, &async)) return NULL;
  if (!open_queue(op)) return NULL;
  int n = ((ShmObject *)op)->nranks, me = ((ShmObject *)op)->rank;
  size_t counts[AC_SHM_MAX_RANKS];
  shm_view v[2];
  if (view(o_, 1, "out", &v[0]) < 0) return NULL;
  if (view(t, 0, "tensor", &v[1]) < 0) {
    release(&v[0]);
    return NULL;
  }
  size_t total = 0;
  int bad = 0;
  if (counts_o == Py_None) {
    for (int q = 0; q < n; q++) counts[q] = v[1].n;
    total = v[1].n * (size_t)n;
  } else {
    PyObject *seq = PySequence_Fast(counts_o, "counts must be a sequence of ints");
    if (!seq || PySequence_Fast_GET_SIZE(seq) != n) {
      if (seq) PyErr_Format(PyExc_ValueError, "counts must have one entry per rank (%d)", n);
      bad = 1;
    }
    for (int q = 0; !bad && q < n; q++) {
      Py_ssize_t k = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, q));
      if (k < 0) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "counts[%d] is negative", q);
        bad = 1;
        break;
      }
      counts[q] = (size_t)k;
      total += (size_t)k;
    }
    Py_XDECREF(seq);
  }
  if (!bad && (v[0].dt != v[1].dt || v[1].n != counts[me] || v[0].n != total)) {
    PyErr_Format(PyExc_ValueError, "all_gather: tensor must have out's dtype and %zu elements (counts[%d]), out %zu; "
                 "got %zu and %zu", counts[me], me, total, v[1].n, v[0].n);
    bad = 1;
  }
  if (bad) {
    release(&v[0]);
    release(&v[1]);
    return NULL;
  }
  ac_shm_op_t o = {.kind = AC_SHM_OP_ALL_GATHER, .send = v[1].data, .recv = v[0].data, .dt = v[0].dt,
                   .counts = counts};
  size_t es = ac_shm_dtype_size(v[0].dt), at;
  ac_shm_window_t *w;
  if (counts_o == Py_None && v[1].n && (const char *)v[1].data == (const char *)v[0].data + (size_t)me * v[1].n * es &&
      pyac_shm_window_find(((ShmObject *)op)->q, v[0].data, v[0].n * es, &w, &at) && at % es == 0) {
    /* an in-place all-gather of a tensor in a shared window (this rank's chunk already at its
     * place): every rank copies the others' chunks from their regions, with no copy in (every
     * rank's must be in place in the window: a rank whose is not is named by the argument check) */
    o.kind = AC_SHM_OP_WINDOW_ALL_GATHER;
    o.window = w;
    o.offset = at / es;
    o.count = v[1].n;
    o.counts = NULL; /* the caller's stack array: only the copy path's request copies it */
  }
  return submit_keeping(op, &o, v, 2, o_, t, async);
}

static PyObject *shm_broadcast(PyObject *op, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"tensor", "root", "async_op", NULL};
  PyObject *t;
  int root, async = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "Oi|p:broadcast", kwlist, &t, &root, &async)) return NULL;
  if (!open_queue(op)) return NULL;
  shm_view v;
  if (view(t, 1, "tensor", &v) < 0) return NULL;
  ac_shm_op_t o = {.kind = AC_SHM_OP_BROADCAST, .recv = v.data, .count = v.n, .dt = v.dt, .root = root};
  return submit_keeping(op, &o, &v, 1, t, Py_None, async);
}

static PyObject *shm_barrier(PyObject *op, PyObject *unused) {
  (void)unused;
  ac_shm_op_t o = {.kind = AC_SHM_OP_BARRIER};
  return submit_keeping(op, &o, NULL, 0, Py_None, Py_None, 0);
}

static PyObject *shm_window(PyObject *op, PyObject *arg) {
  Py_ssize_t n = PyLong_AsSsize_t(arg);
  if (n == -1 && PyErr_Occurred()) return NULL;
  ac_shm_queue_t *q = open_queue(op);
  if (!q) return NULL;
  if (n <= 0) {
    PyErr_Format(PyExc_ValueError, "window: nbytes must be positive, got %zd", n);
    return NULL;
  }
  ac_shm_window_t *w = NULL;
  ac_result_t r;
  ((ShmObject *)op)->active++;
  Py_BEGIN_ALLOW_THREADS r = ac_shm_window_create(&w, ac_shm_queue_comm(q), (size_t)n);
  Py_END_ALLOW_THREADS
  ((ShmObject *)op)->active--;
  if (r != AC_OK) return pyac_raise_value(pyac_module_of(op), r);
  if (((ShmObject *)op)->q != q) { /* closed meanwhile: the window would name a freed queue */
    ac_shm_window_destroy(w);
    PyErr_SetString(PyExc_ValueError, "the ShmComm was closed while the window was being made");
    return NULL;
  }
  return pyac_shm_window_wrap(op, q, w);
}

static PyObject *shm_window_ops(PyObject *op, PyObject *unused) {
  (void)unused;
  ac_shm_queue_t *q = open_queue(op);
  if (!q) return NULL;
  return PyLong_FromUnsignedLongLong((unsigned long long)ac_shm_window_ops(ac_shm_queue_comm(q)));
}

static PyObject *shm_in_window(PyObject *op, PyObject *arg) {
  ac_shm_queue_t *q = ((ShmObject *)op)->q;
  if (!q) Py_RETURN_FALSE;
  shm_view v;
  if (view(arg, 0, "tensor", &v) < 0) return NULL;
  ac_shm_window_t *w;
  size_t at;
  int found = pyac_shm_window_find(q, v.data, v.n * ac_shm_dtype_size(v.dt), &w, &at) &&
              at % ac_shm_dtype_size(v.dt) == 0;
  release(&v);
  return PyBool_FromLong(found);
}

static PyObject *shm_set_timeout(PyObject *op, PyObject *arg) {
  double s = PyFloat_AsDouble(arg);
  if (s == -1.0 && PyErr_Occurred()) return NULL;
  ac_shm_queue_t *q = open_queue(op);
  if (!q) return NULL;
  if (!(s > 0) || s > 2e6) {
    PyErr_Format(PyExc_ValueError, "timeout must be in (0, 2e6] seconds, got %g", s);
    return NULL;
  }
  /* read by the progress thread at its next wait: a plain int store, as good as atomic here */
  ac_result_t r = ac_shm_set_timeout(ac_shm_queue_comm(q), (int)(s * 1000.0));
  if (r != AC_OK) return pyac_raise(pyac_module_of(op), r);
  Py_RETURN_NONE;
}

/* Stops `q` (ShmObject.q, already cleared): a call running on another thread with the GIL
 * released is aborted and waited out before the queue is freed. */
static void stop_queue(ShmObject *self, ac_shm_queue_t *q) {
  pyac_shm_windows_forget(q);
  if (!q) return;
  ac_shm_abort(ac_shm_queue_comm(q)); /* thread-safe: what runs fails at its next wait */
  while (self->active > 0) {
    Py_BEGIN_ALLOW_THREADS struct timespec ts = {0, 1000000L};
    nanosleep(&ts, NULL);
    Py_END_ALLOW_THREADS
  }
}

static PyObject *shm_close(PyObject *op, PyObject *unused) {
  (void)unused;
  ShmObject *self = (ShmObject *)op;
  ac_shm_queue_t *q = self->q;
  self->q = NULL;
  stop_queue(self, q);
  if (q) {
    /* what is still queued fails at once (ShmWork.wait raises it); the thread is joined */
    Py_BEGIN_ALLOW_THREADS ac_shm_queue_destroy(q);
    Py_END_ALLOW_THREADS
  }
  Py_RETURN_NONE;
}

static PyObject *shm_get_rank(PyObject *op, void *closure) {
  (void)closure;
  return PyLong_FromLong(((ShmObject *)op)->rank);
}

static PyObject *shm_get_size(PyObject *op, void *closure) {
  (void)closure;
  return PyLong_FromLong(((ShmObject *)op)->nranks);
}

static void shm_dealloc(PyObject *op) {
  ShmObject *self = (ShmObject *)op;
  if (self->q) { /* no call can be active: it would hold a reference to this object */
    pyac_shm_windows_forget(self->q);
    Py_BEGIN_ALLOW_THREADS ac_shm_queue_destroy(self->q);
    Py_END_ALLOW_THREADS
    self->q = NULL;
  }
  pyac_plain_dealloc(op);
}

static PyMethodDef shm_methods[] = {
    {"all_reduce", (PyCFunction)(void (*)(void))shm_all_reduce, METH_VARARGS | METH_KEYWORDS,
     "all_reduce(tensor, op='sum', out=None, async_op=False): op over ranks of tensor, into out (default: in "
     "place); async_op: returns a ShmWork"},
    {"reduce_scatter", (PyCFunction)(void (*)(void))shm_reduce_scatter, METH_VARARGS | METH_KEYWORDS,
     "reduce_scatter(out, tensor, op='sum', async_op=False): out = this rank's slice of op over ranks of tensor "
     "(nranks x out)"},
    {"all_gather", (PyCFunction)(void (*)(void))shm_all_gather, METH_VARARGS | METH_KEYWORDS,
     "all_gather(out, tensor, counts=None, async_op=False): out = every rank's tensor concatenated in rank order "
     "(counts: the element count of each rank's tensor, when they differ); `out` in a shared window with `tensor` "
     "its own chunk in place is gathered in the window, with no copy in"},
    {"broadcast", (PyCFunction)(void (*)(void))shm_broadcast, METH_VARARGS | METH_KEYWORDS,
     "broadcast(tensor, root, async_op=False): tensor on every rank = tensor of root"},
    {"barrier", shm_barrier, METH_NOARGS, "barrier(): returns when every rank has called it"},
    {"window", shm_window, METH_O,
     "window(nbytes): a ShmWindow, this rank's region of nbytes in memory every rank maps (a collective: every rank "
     "makes its windows in the same order); a tensor in it (torch.frombuffer) is all-reduced there, with no copy"},
    {"window_ops", shm_window_ops, METH_NOARGS,
     "window_ops(): how many collectives so far took a window path (no copy in or out): all-reduces and "
     "all-gathers in a window, reduce-scatters whose every rank's input was at one place of one window"},
    {"in_window", shm_in_window, METH_O,
     "in_window(tensor): whether all_reduce(tensor) takes the window path (the tensor lies in a window of this "
     "communicator)"},
    {"set_timeout", shm_set_timeout, METH_O, "set_timeout(seconds): the timeout of later collectives"},
    {"close", shm_close, METH_NOARGS, "close(): what is still queued fails; the segment is unmapped"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef shm_getset[] = {
    {"rank", shm_get_rank, NULL, "this rank", NULL},
    {"size", shm_get_size, NULL, "the number of ranks", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot shm_slots[] = {
    {Py_tp_init, shm_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, shm_dealloc},
    {Py_tp_methods, shm_methods},
    {Py_tp_getset, shm_getset},
    {Py_tp_doc, "ShmComm(name, nranks, rank, slot_bytes=4 MiB, timeout_s=1800): collectives between the processes "
                "of one host through one shared-memory segment (every rank passes the same name)"},
    {0, NULL},
};

PyType_Spec pyac_shm_comm_spec = {
    .name = "accelerate_c._C.ShmComm",
    .basicsize = sizeof(ShmObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = shm_slots,
};

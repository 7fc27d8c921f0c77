/* comm_shm_py.c — ShmComm: the shared-memory collectives (ac/comm_shm.h) as a Python type.
 * Tensors arrive through DLPack (CPU, C-contiguous; float32/64, float16, bfloat16, int32,
 * int64); the GIL is released for the whole collective, and one lock per communicator keeps two
 * Python threads from interleaving collectives on it. */
#include <pthread.h>

#include "pyac.h"

#include "ac/comm_shm.h"

typedef struct {
  PyObject_HEAD
  ac_shm_t *comm;
  pthread_mutex_t lock;
  int lock_ok;
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

static ac_shm_t *open_comm(PyObject *op) {
  ac_shm_t *c = ((ShmObject *)op)->comm;
  if (!c) PyErr_SetString(PyExc_ValueError, "the ShmComm is closed");
  return c;
}

/* Runs a collective without the GIL and under the communicator's lock. */
#define RUN_LOCKED(self, r, call)                          \
  do {                                                     \
    Py_BEGIN_ALLOW_THREADS pthread_mutex_lock(&(self)->lock); \
    (r) = (call);                                          \
    pthread_mutex_unlock(&(self)->lock);                   \
    Py_END_ALLOW_THREADS                                   \
  } while (0)

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
  if (!self->lock_ok) {
    if (pthread_mutex_init(&self->lock, NULL) != 0) {
      PyErr_SetString(PyExc_RuntimeError, "pthread_mutex_init failed");
      return -1;
    }
    self->lock_ok = 1;
  }
  ac_shm_t *c = NULL;
  ac_result_t r;
  Py_BEGIN_ALLOW_THREADS r = ac_shm_create(&c, name, nranks, rank, (size_t)slot, (int)(timeout_s * 1000.0));
  Py_END_ALLOW_THREADS
  if (r != AC_OK) {
    pyac_raise_value(pyac_module_of(op), r);
    return -1;
  }
  ac_shm_destroy(self->comm);
  self->comm = c;
  return 0;
}

static PyObject *shm_all_reduce(PyObject *op, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"tensor", "op", "out", NULL};
  PyObject *t, *opname = NULL, *out = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|UO:all_reduce", kwlist, &t, &opname, &out)) return NULL;
  ac_shm_t *c = open_comm(op);
  ac_redop_t rop = AC_RED_SUM;
  if (!c || parse_op(opname, &rop) < 0) return NULL;
  shm_view vs, vd;
  if (view(t, out == Py_None, "tensor", &vs) < 0) return NULL;
  if (out != Py_None && view(out, 1, "out", &vd) < 0) {
    release(&vs);
    return NULL;
  }
  ac_result_t r;
  if (out != Py_None && (vd.n != vs.n || vd.dt != vs.dt)) {
    r = AC_FAIL(AC_ERR_INVALID_ARG, "all_reduce: out must have tensor's dtype and %zu elements", vs.n);
  } else {
    void *dst = out == Py_None ? vs.data : vd.data;
    RUN_LOCKED((ShmObject *)op, r, ac_shm_all_reduce(c, vs.data, dst, vs.n, vs.dt, rop));
  }
  release(&vs);
  if (out != Py_None) release(&vd);
  if (r != AC_OK) return pyac_raise_value(pyac_module_of(op), r);
  Py_RETURN_NONE;
}

static PyObject *shm_reduce_scatter(PyObject *op, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"out", "tensor", "op", NULL};
  PyObject *o, *t, *opname = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|U:reduce_scatter", kwlist, &o, &t, &opname)) return NULL;
  ac_shm_t *c = open_comm(op);
  ac_redop_t rop = AC_RED_SUM;
  if (!c || parse_op(opname, &rop) < 0) return NULL;
  shm_view vd, vs;
  if (view(o, 1, "out", &vd) < 0) return NULL;
  if (view(t, 0, "tensor", &vs) < 0) {
    release(&vd);
    return NULL;
  }
  ac_result_t r;
  size_t n = (size_t)ac_shm_size(c);
  if (vd.dt != vs.dt || vs.n != vd.n * n)
    r = AC_FAIL(AC_ERR_INVALID_ARG, "reduce_scatter: tensor must have out's dtype and %zu x %zu elements, has %zu", n,
                vd.n, vs.n);
  else
    RUN_LOCKED((ShmObject *)op, r, ac_shm_reduce_scatter(c, vs.data, vd.data, vd.n, vs.dt, rop));
  release(&vs);
  release(&vd);
  if (r != AC_OK) return pyac_raise_value(pyac_module_of(op), r);
  Py_RETURN_NONE;
}

static PyObject *shm_all_gather(PyObject *op, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"out", "tensor", "counts", NULL};
  PyObject *o, *t, *counts_o = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|O:all_gather", kwlist, &o, &t, &counts_o)) return NULL;
  ac_shm_t *c = open_comm(op);
  if (!c) return NULL;
  int n = ac_shm_size(c);
  size_t *counts = PyMem_Calloc((size_t)n, sizeof(size_t));
  if (!counts) return PyErr_NoMemory();
  shm_view vd, vs;
  if (view(o, 1, "out", &vd) < 0) {
    PyMem_Free(counts);
    return NULL;
  }
  if (view(t, 0, "tensor", &vs) < 0) {
    release(&vd);
    PyMem_Free(counts);
    return NULL;
  }
  ac_result_t r = AC_OK;
  size_t total = 0;
  if (counts_o == Py_None) {
    for (int q = 0; q < n; q++) counts[q] = vs.n;
    total = vs.n * (size_t)n;
  } else {
    PyObject *seq = PySequence_Fast(counts_o, "counts must be a sequence of ints");
    if (!seq || PySequence_Fast_GET_SIZE(seq) != n) {
      Py_XDECREF(seq);
      release(&vs);
      release(&vd);
      PyMem_Free(counts);
      if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "counts must have one entry per rank (%d)", n);
      return NULL;
    }
    for (int q = 0; q < n; q++) {
      Py_ssize_t k = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, q));
      if (k < 0) {
        Py_DECREF(seq);
        release(&vs);
        release(&vd);
        PyMem_Free(counts);
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "counts[%d] is negative", q);
        return NULL;
      }
      counts[q] = (size_t)k;
      total += (size_t)k;
    }
    Py_DECREF(seq);
  }
  int me = ac_shm_rank(c);
  if (vd.dt != vs.dt || vs.n != counts[me] || vd.n != total)
    r = AC_FAIL(AC_ERR_INVALID_ARG, "all_gather: tensor must have out's dtype and %zu elements (counts[%d]), out %zu; "
                "got %zu and %zu", counts[me], me, total, vs.n, vd.n);
  else
    RUN_LOCKED((ShmObject *)op, r, ac_shm_all_gather(c, vs.data, vd.data, counts, vs.dt));
  release(&vs);
  release(&vd);
  PyMem_Free(counts);
  if (r != AC_OK) return pyac_raise_value(pyac_module_of(op), r);
  Py_RETURN_NONE;
}

static PyObject *shm_broadcast(PyObject *op, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"tensor", "root", NULL};
  PyObject *t;
  int root;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "Oi:broadcast", kwlist, &t, &root)) return NULL;
  ac_shm_t *c = open_comm(op);
  if (!c) return NULL;
  shm_view v;
  if (view(t, 1, "tensor", &v) < 0) return NULL;
  ac_result_t r;
  RUN_LOCKED((ShmObject *)op, r, ac_shm_broadcast(c, v.data, v.n, v.dt, root));
  release(&v);
  if (r != AC_OK) return pyac_raise_value(pyac_module_of(op), r);
  Py_RETURN_NONE;
}

static PyObject *shm_barrier(PyObject *op, PyObject *unused) {
  (void)unused;
  ac_shm_t *c = open_comm(op);
  if (!c) return NULL;
  ac_result_t r;
  RUN_LOCKED((ShmObject *)op, r, ac_shm_barrier(c));
  if (r != AC_OK) return pyac_raise(pyac_module_of(op), r);
  Py_RETURN_NONE;
}

static PyObject *shm_set_timeout(PyObject *op, PyObject *arg) {
  double s = PyFloat_AsDouble(arg);
  if (s == -1.0 && PyErr_Occurred()) return NULL;
  ac_shm_t *c = open_comm(op);
  if (!c) return NULL;
  if (!(s > 0) || s > 2e6) {
    PyErr_Format(PyExc_ValueError, "timeout must be in (0, 2e6] seconds, got %g", s);
    return NULL;
  }
  ac_result_t r = ac_shm_set_timeout(c, (int)(s * 1000.0));
  if (r != AC_OK) return pyac_raise(pyac_module_of(op), r);
  Py_RETURN_NONE;
}

static PyObject *shm_close(PyObject *op, PyObject *unused) {
  (void)unused;
  ShmObject *self = (ShmObject *)op;
  if (self->comm) {
    Py_BEGIN_ALLOW_THREADS pthread_mutex_lock(&self->lock); /* a collective of another thread ends first */
    ac_shm_destroy(self->comm);
    self->comm = NULL;
    pthread_mutex_unlock(&self->lock);
    Py_END_ALLOW_THREADS
  }
  Py_RETURN_NONE;
}

static PyObject *shm_get_rank(PyObject *op, void *closure) {
  (void)closure;
  ac_shm_t *c = open_comm(op);
  return c ? PyLong_FromLong(ac_shm_rank(c)) : NULL;
}

static PyObject *shm_get_size(PyObject *op, void *closure) {
  (void)closure;
  ac_shm_t *c = open_comm(op);
  return c ? PyLong_FromLong(ac_shm_size(c)) : NULL;
}

static void shm_dealloc(PyObject *op) {
  ShmObject *self = (ShmObject *)op;
  ac_shm_destroy(self->comm);
  self->comm = NULL;
  if (self->lock_ok) pthread_mutex_destroy(&self->lock);
  pyac_plain_dealloc(op);
}

static PyMethodDef shm_methods[] = {
    {"all_reduce", (PyCFunction)(void (*)(void))shm_all_reduce, METH_VARARGS | METH_KEYWORDS,
     "all_reduce(tensor, op='sum', out=None): op over ranks of tensor, into out (default: in place)"},
    {"reduce_scatter", (PyCFunction)(void (*)(void))shm_reduce_scatter, METH_VARARGS | METH_KEYWORDS,
     "reduce_scatter(out, tensor, op='sum'): out = this rank's slice of op over ranks of tensor (nranks x out)"},
    {"all_gather", (PyCFunction)(void (*)(void))shm_all_gather, METH_VARARGS | METH_KEYWORDS,
     "all_gather(out, tensor, counts=None): out = every rank's tensor concatenated in rank order (counts: the "
     "element count of each rank's tensor, when they differ)"},
    {"broadcast", (PyCFunction)(void (*)(void))shm_broadcast, METH_VARARGS | METH_KEYWORDS,
     "broadcast(tensor, root): tensor on every rank = tensor of root"},
    {"barrier", shm_barrier, METH_NOARGS, "barrier(): returns when every rank has called it"},
    {"set_timeout", shm_set_timeout, METH_O, "set_timeout(seconds): the timeout of later collectives"},
    {"close", shm_close, METH_NOARGS, "close(): unmaps the segment (the communicator cannot be used after)"},
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

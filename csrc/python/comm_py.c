/* comm_py.c — NcclComm (the C NCCL communicator as a Python type) and the NCCL loader functions. */
#include "pyac.h"

#include "ac/comm_nccl.h"

typedef struct {
  PyObject_HEAD
  ac_comm_t *comm;
} CommObject;

struct ac_comm *pyac_comm_handle(PyObject *obj) { return ((CommObject *)obj)->comm; }

static int parse_op(PyObject *o, ac_redop_t *op) {
  const char *s = PyUnicode_AsUTF8(o);
  if (!s) return -1;
  static const char *names[] = {"sum", "prod", "max", "min", "avg"};
  for (int i = 0; i < 5; i++)
    if (strcmp(s, names[i]) == 0) {
      *op = (ac_redop_t)i;
      return 0;
    }
  PyErr_Format(PyExc_ValueError, "op must be one of 'sum', 'prod', 'max', 'min', 'avg', not %R", o);
  return -1;
}

static int comm_init(PyObject *op, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"unique_id", "nranks", "rank", NULL};
  Py_buffer id;
  int nranks, rank;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*ii:NcclComm", kwlist, &id, &nranks, &rank)) return -1;
  if (id.len != AC_NCCL_UNIQUE_ID_BYTES) {
    PyErr_Format(PyExc_ValueError, "unique_id must be %d bytes, got %zd", AC_NCCL_UNIQUE_ID_BYTES, id.len);
    PyBuffer_Release(&id);
    return -1;
  }
  unsigned char raw[AC_NCCL_UNIQUE_ID_BYTES];
  memcpy(raw, id.buf, sizeof raw);
  PyBuffer_Release(&id);
  ac_comm_t *c = NULL;
  ac_result_t r;
  /* ncclCommInitRank blocks until every rank joined: other Python threads keep running */
  Py_BEGIN_ALLOW_THREADS r = ac_nccl_comm_create(&c, raw, nranks, rank);
  Py_END_ALLOW_THREADS
  if (r != AC_OK) {
    pyac_raise(pyac_module_of(op), r);
    return -1;
  }
  CommObject *self = (CommObject *)op;
  ac_comm_destroy(self->comm);
  self->comm = c;
  return 0;
}

static ac_comm_t *open_comm(PyObject *op) {
  ac_comm_t *c = ((CommObject *)op)->comm;
  if (!c) PyErr_SetString(PyExc_ValueError, "the NcclComm is closed");
  return c;
}

static PyObject *comm_all_reduce(PyObject *op, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"tensor", "op", "stream", NULL};
  PyObject *t, *opname = NULL, *stream_o = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|UO:all_reduce", kwlist, &t, &opname, &stream_o)) return NULL;
  ac_comm_t *c = open_comm(op);
  ac_redop_t rop = AC_RED_SUM;
  void *stream;
  if (!c || (opname && parse_op(opname, &rop) < 0) || pyac_stream(stream_o, 1, &stream) < 0) return NULL;
  pyac_view v;
  if (pyac_view_from(pyac_module_of(op), t, PYAC_WRITE, PYAC_ON_ANY, "tensor", &v) < 0) return NULL;
  ac_result_t r = ac_comm_all_reduce(c, v.data, v.data, v.n, v.dt, rop, stream);
  pyac_view_release(&v);
  if (r != AC_OK) return pyac_raise(pyac_module_of(op), r);
  Py_RETURN_NONE;
}

static PyObject *comm_broadcast(PyObject *op, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"tensor", "root", "stream", NULL};
  PyObject *t, *stream_o = Py_None;
  int root = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|iO:broadcast", kwlist, &t, &root, &stream_o)) return NULL;
  ac_comm_t *c = open_comm(op);
  void *stream;
  if (!c || pyac_stream(stream_o, 1, &stream) < 0) return NULL;
  pyac_view v;
  if (pyac_view_from(pyac_module_of(op), t, PYAC_WRITE, PYAC_ON_ANY, "tensor", &v) < 0) return NULL;
  ac_result_t r = ac_comm_broadcast(c, v.data, v.n, v.dt, root, stream);
  pyac_view_release(&v);
  if (r != AC_OK) return pyac_raise(pyac_module_of(op), r);
  Py_RETURN_NONE;
}

/* all_gather(send, recv) / reduce_scatter(send, recv, op): recv is nranks x send, or the reverse */
static PyObject *gather_scatter(PyObject *op, PyObject *args, PyObject *kwds, int gather) {
  static char *kwlist[] = {"send", "recv", "op", "stream", NULL};
  PyObject *s, *d, *opname = NULL, *stream_o = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, gather ? "OO|UO:all_gather" : "OO|UO:reduce_scatter", kwlist, &s, &d,
                                   &opname, &stream_o))
    return NULL;
  ac_comm_t *c = open_comm(op);
  ac_redop_t rop = AC_RED_SUM;
  void *stream;
  if (!c || (opname && parse_op(opname, &rop) < 0) || pyac_stream(stream_o, 1, &stream) < 0) return NULL;
  pyac_view vs, vd;
  if (pyac_view_from(pyac_module_of(op), s, PYAC_READ, PYAC_ON_ANY, "send", &vs) < 0) return NULL;
  if (pyac_view_from(pyac_module_of(op), d, PYAC_WRITE, PYAC_ON_ANY, "recv", &vd) < 0) {
    pyac_view_release(&vs);
    return NULL;
  }
  if (pyac_same_device(gather ? "all_gather" : "reduce_scatter", &vs, "send", &vd, "recv") < 0) {
    pyac_view_release(&vs);
    pyac_view_release(&vd);
    return NULL;
  }
  size_t n = (size_t)ac_comm_size(c);
  size_t small = gather ? vs.n : vd.n, big = gather ? vd.n : vs.n;
  ac_result_t r = AC_OK;
  if (vs.dt != vd.dt) {
    r = AC_FAIL(AC_ERR_INVALID_ARG, "send and recv must have the same dtype");
  } else if (big != small * n) {
    r = AC_FAIL(AC_ERR_INVALID_ARG, "%s: %s has %zu elements, expected %zu (%zu ranks x %zu)",
                gather ? "all_gather" : "reduce_scatter", gather ? "recv" : "send", big, small * n, n, small);
  } else if (gather) {
    r = ac_comm_all_gather(c, vs.data, vd.data, vs.n, vs.dt, stream);
  } else {
    r = ac_comm_reduce_scatter(c, vs.data, vd.data, vd.n, vs.dt, rop, stream);
  }
  pyac_view_release(&vs);
  pyac_view_release(&vd);
  if (r != AC_OK) return pyac_raise(pyac_module_of(op), r);
  Py_RETURN_NONE;
}

static PyObject *comm_all_gather(PyObject *op, PyObject *args, PyObject *kwds) {
  return gather_scatter(op, args, kwds, 1);
}

static PyObject *comm_reduce_scatter(PyObject *op, PyObject *args, PyObject *kwds) {
  return gather_scatter(op, args, kwds, 0);
}

static PyObject *comm_close(PyObject *op, PyObject *unused) {
  (void)unused;
  CommObject *self = (CommObject *)op;
  ac_comm_t *c = self->comm;
  self->comm = NULL;
  Py_BEGIN_ALLOW_THREADS ac_comm_destroy(c);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

static PyObject *comm_get_size(PyObject *op, void *c) {
  (void)c;
  return PyLong_FromLong(ac_comm_size(((CommObject *)op)->comm));
}

static PyObject *comm_get_rank(PyObject *op, void *c) {
  (void)c;
  return PyLong_FromLong(ac_comm_rank(((CommObject *)op)->comm));
}

static void comm_dealloc(PyObject *op) {
  PyTypeObject *tp = Py_TYPE(op);
  ac_comm_destroy(((CommObject *)op)->comm);
  tp->tp_free(op);
  Py_DECREF(tp);
}

#define KW(f) (PyCFunction)(void (*)(void))(f), METH_VARARGS | METH_KEYWORDS

static PyMethodDef comm_methods[] = {
    {"all_reduce", KW(comm_all_reduce), "all_reduce(tensor, op='sum', stream=None): in place, collective"},
    {"broadcast", KW(comm_broadcast), "broadcast(tensor, root=0, stream=None): in place, collective"},
    {"all_gather", KW(comm_all_gather), "all_gather(send, recv, stream=None): recv holds nranks x send"},
    {"reduce_scatter", KW(comm_reduce_scatter),
     "reduce_scatter(send, recv, op='sum', stream=None): send holds nranks x recv"},
    {"close", comm_close, METH_NOARGS, "close(): destroy the communicator (idempotent)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef comm_getset[] = {
    {"size", comm_get_size, NULL, "number of ranks", NULL},
    {"rank", comm_get_rank, NULL, "this process's rank", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot comm_slots[] = {
    {Py_tp_init, comm_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, comm_dealloc},
    {Py_tp_methods, comm_methods},
    {Py_tp_getset, comm_getset},
    {Py_tp_doc, "NcclComm(unique_id, nranks, rank): an NCCL communicator on the current CUDA device "
                "(collective: every rank must construct it). Streams are cudaStream_t values as ints."},
    {0, NULL},
};

PyType_Spec pyac_comm_spec = {
    .name = "accelerate_c._C.NcclComm",
    .basicsize = sizeof(CommObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = comm_slots,
};

/* ---- module functions ------------------------------------------------------------------- */

static PyObject *py_nccl_load(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  if (n > 1) {
    PyErr_SetString(PyExc_TypeError, "nccl_load(path=None) takes at most 1 argument");
    return NULL;
  }
  const char *path = NULL;
  if (n == 1 && a[0] != Py_None && !(path = PyUnicode_AsUTF8(a[0]))) return NULL;
  ac_result_t r = ac_nccl_load(path);
  if (r != AC_OK) return pyac_raise(m, r);
  return PyUnicode_FromString(ac_nccl_source());
}

static PyObject *py_nccl_version(PyObject *m, PyObject *unused) {
  (void)unused;
  int v = 0;
  ac_result_t r = ac_nccl_version(&v);
  if (r != AC_OK) return pyac_raise(m, r);
  return PyLong_FromLong(v);
}

static PyObject *py_nccl_unique_id(PyObject *m, PyObject *unused) {
  (void)unused;
  unsigned char id[AC_NCCL_UNIQUE_ID_BYTES];
  ac_result_t r = ac_nccl_unique_id(id);
  if (r != AC_OK) return pyac_raise(m, r);
  return PyBytes_FromStringAndSize((const char *)id, sizeof id);
}

PyMethodDef pyac_comm_methods[] = {
    {"nccl_load", (PyCFunction)(void (*)(void))py_nccl_load, METH_FASTCALL,
     "nccl_load(path=None) -> where NCCL came from: the process's own NCCL (torch's), libnccl.so.2, or path"},
    {"nccl_version", py_nccl_version, METH_NOARGS, "nccl_version() -> NCCL's version code (loads NCCL)"},
    {"nccl_unique_id", py_nccl_unique_id, METH_NOARGS, "nccl_unique_id() -> 128 bytes for NcclComm"},
    {NULL, NULL, 0, NULL},
};

/* dlpack_in.c — the DLPack consumer (versioned and legacy capsules) and the Buffer type that
 * keeps a consumed tensor alive so per-step calls skip the capsule exchange entirely. */
#include "pyac.h"

#include "ac/dlpack_check.h"

#include <string.h>

typedef struct {
  PyObject_HEAD
  pyac_view view;
} BufferObject;

/* PyErr_Fetch is deprecated from 3.12 and its replacement is missing before: hide the split. */
static PyObject *take_exception(void) {
#if PY_VERSION_HEX >= 0x030C0000
  return PyErr_GetRaisedException();
#else
  PyObject *t, *v, *tb;
  PyErr_Fetch(&t, &v, &tb);
  PyErr_NormalizeException(&t, &v, &tb);
  if (tb && v) PyException_SetTraceback(v, tb);
  Py_XDECREF(t);
  Py_XDECREF(tb);
  return v;
#endif
}
static void restore_exception(PyObject *exc) {
#if PY_VERSION_HEX >= 0x030C0000
  PyErr_SetRaisedException(exc);
#else
  PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
#endif
}

void pyac_dlpack_release(void *owner, int versioned) {
  if (!owner) return;
  /* Error paths release views after raising; a producer's deleter may call into Python, which
   * must not run with an exception set (it could clear or replace it). Park it meanwhile. */
  PyObject *pending = PyErr_Occurred() ? take_exception() : NULL;
  if (versioned) {
    DLManagedTensorVersioned *m = owner;
    if (m->deleter) m->deleter(m);
  } else {
    DLManagedTensor *m = owner;
    if (m->deleter) m->deleter(m);
  }
  if (pending) restore_exception(pending);
}

void pyac_view_release(pyac_view *v) {
  pyac_dlpack_release(v->owner, v->versioned);
  v->owner = NULL;
}

/* The checks live in the core (csrc/core/dlpack_check.c, fuzzed without Python); here their
 * verdicts become the exceptions Python callers have always seen. */
static int raise_dl(int kind, const char *msg) {
  PyErr_SetString(kind == AC_DL_TYPE ? PyExc_TypeError : PyExc_ValueError, msg);
  return -1;
}

int pyac_dl_layout(const DLTensor *t, size_t esize, const char *arg, size_t *numel) {
  char err[512];
  int k = ac_dl_layout(t, esize, arg, numel, err, sizeof err);
  return k == AC_DL_OK ? 0 : raise_dl(k, err);
}

int pyac_dl_writable(uint64_t flags, const char *arg) {
  char err[512];
  int k = ac_dl_writable(flags, arg, err, sizeof err);
  return k == AC_DL_OK ? 0 : raise_dl(k, err);
}

/* Validates one DLTensor into *v (no ownership change). */
static int check_tensor(const DLTensor *t, int where, const char *arg, pyac_view *v) {
  char err[512];
  int k = ac_dl_check_float(t, where == PYAC_ON_CUDA ? AC_DL_ON_CUDA : where == PYAC_ON_CPU ? AC_DL_ON_CPU : AC_DL_ON_ANY,
                            arg, &v->dt, &v->n, &v->data, err, sizeof err);
  if (k != AC_DL_OK) return raise_dl(k, err);
  v->device = t->device;
  return 0;
}

/* Consumes a capsule: `check` validates first (a rejected capsule stays usable and is freed by
 * its own destructor), then the capsule is renamed "used_..." and its tensor owned, as the
 * DLPack spec requires. */
static int take_capsule(PyObject *cap, const char *arg, pyac_dlpack_check check, void *ctx, void **owner,
                        int *versioned) {
  if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
    DLManagedTensorVersioned *m = PyCapsule_GetPointer(cap, "dltensor_versioned");
    if (!m) return -1;
    if (m->version.major != AC_DLPACK_MAJOR) {
      PyErr_Format(PyExc_BufferError, "%s: DLPack major version %u is not supported (this build reads %d.x)",
                   arg, (unsigned)m->version.major, AC_DLPACK_MAJOR);
      return -1;
    }
    if (check(&m->dl_tensor, m->flags, ctx) < 0) return -1;
    if (PyCapsule_SetName(cap, "used_dltensor_versioned") < 0) return -1;
    *owner = m;
    *versioned = 1;
    return 0;
  }
  if (PyCapsule_IsValid(cap, "dltensor")) {
    DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
    if (!m) return -1;
    if (check(&m->dl_tensor, 0, ctx) < 0) return -1;
    if (PyCapsule_SetName(cap, "used_dltensor") < 0) return -1;
    *owner = m;
    *versioned = 0;
    return 0;
  }
  const char *name = PyCapsule_GetName(cap);
  PyErr_Clear();
  if (name && strncmp(name, "used_", 5) == 0)
    PyErr_Format(PyExc_ValueError, "%s: this DLPack capsule was already consumed; export the tensor again", arg);
  else
    PyErr_Format(PyExc_TypeError, "%s: capsule '%s' is not a DLPack tensor", arg, name ? name : "(unnamed)");
  return -1;
}

int pyac_dlpack_take(PyObject *obj, const char *arg, pyac_dlpack_check check, void *ctx, void **owner,
                     int *versioned) {
  *owner = NULL;
  *versioned = 0;
  if (PyCapsule_CheckExact(obj)) return take_capsule(obj, arg, check, ctx, owner, versioned);
  PyObject *meth = PyObject_GetAttrString(obj, "__dlpack__");
  if (!meth) {
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "%s: expected a tensor (an object with __dlpack__), got %s", arg,
                 Py_TYPE(obj)->tp_name);
    return -1;
  }
  PyObject *cap = NULL;
  PyObject *kw = Py_BuildValue("{s:(ii)}", "max_version", AC_DLPACK_MAJOR, 0);
  if (kw) {
    PyObject *empty = PyTuple_New(0);
    if (empty) cap = PyObject_Call(meth, empty, kw);
    Py_XDECREF(empty);
    Py_DECREF(kw);
  }
  if (!cap && PyErr_ExceptionMatches(PyExc_TypeError)) {
    /* an older producer that does not know max_version: ask for a legacy capsule */
    PyErr_Clear();
    cap = PyObject_CallNoArgs(meth);
  }
  Py_DECREF(meth);
  if (!cap) {
    if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_RuntimeError)) {
      PyObject *exc = take_exception();
      PyErr_Format(PyExc_TypeError, "%s: cannot export the tensor through DLPack: %S "
                   "(tensors that require grad must be detached first)", arg, exc);
      Py_DECREF(exc);
    }
    return -1;
  }
  if (!PyCapsule_CheckExact(cap)) {
    PyErr_Format(PyExc_TypeError, "%s: __dlpack__ returned %s, not a capsule", arg, Py_TYPE(cap)->tp_name);
    Py_DECREF(cap);
    return -1;
  }
  int rc = take_capsule(cap, arg, check, ctx, owner, versioned);
  Py_DECREF(cap);
  return rc;
}

/* pyac_view_from's check: the kernels' access and placement rules, then check_tensor. */
typedef struct {
  int access, where;
  const char *arg;
  pyac_view *v;
} view_check_ctx;

static int view_check(const DLTensor *t, uint64_t flags, void *p) {
  view_check_ctx *c = p;
  if (c->access == PYAC_WRITE && pyac_dl_writable(flags, c->arg) < 0) return -1;
  return check_tensor(t, c->where, c->arg, c->v);
}

int pyac_view_from(PyObject *module, PyObject *obj, int access, int where, const char *arg, pyac_view *v) {
  pyac_state *st = pyac_get_state(module);
  memset(v, 0, sizeof *v);
  if (PyObject_TypeCheck(obj, st->buffer_type)) {
    /* Buffers are validated once at creation; the view is borrowed. */
    const pyac_view *b = &((BufferObject *)obj)->view;
    if (where == PYAC_ON_CPU && b->device.device_type != kDLCPU && b->device.device_type != kDLCUDAHost) {
      PyErr_Format(PyExc_TypeError, "%s: Buffer is on a CUDA device: use the cuda_* kernels", arg);
      return -1;
    }
    if (where == PYAC_ON_CUDA && b->device.device_type != kDLCUDA && b->device.device_type != kDLCUDAManaged) {
      PyErr_Format(PyExc_TypeError, "%s: Buffer is not on a CUDA device", arg);
      return -1;
    }
    *v = *b;
    v->owner = NULL;
    return 0;
  }
  view_check_ctx ctx = {access, where, arg, v};
  void *owner;
  int versioned;
  if (pyac_dlpack_take(obj, arg, view_check, &ctx, &owner, &versioned) < 0) return -1;
  v->owner = owner;
  v->versioned = versioned;
  return 0;
}

/* ---- Buffer: a consumed tensor kept alive, validated once ---------------------------------- */

static PyObject *buffer_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"tensor", NULL};
  PyObject *obj;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:Buffer", kwlist, &obj)) return NULL;
  PyObject *module = PyType_GetModule(type);
  if (!module) return NULL;
  if (PyObject_TypeCheck(obj, type)) {
    /* two Buffers would share one owner and both release it */
    PyErr_SetString(PyExc_TypeError, "tensor: already a Buffer");
    return NULL;
  }
  pyac_view v;
  /* A Buffer may be on either device; accept both by probing CPU first. */
  if (pyac_view_from(module, obj, PYAC_WRITE, PYAC_ON_CPU, "tensor", &v) < 0) {
    if (!PyErr_ExceptionMatches(PyExc_TypeError)) return NULL;
    PyObject *cpu_err = take_exception();
    if (pyac_view_from(module, obj, PYAC_WRITE, PYAC_ON_CUDA, "tensor", &v) < 0) {
      PyErr_Clear();
      restore_exception(cpu_err);
      return NULL;
    }
    Py_DECREF(cpu_err);
  }
  BufferObject *self = (BufferObject *)type->tp_alloc(type, 0);
  if (!self) {
    pyac_view_release(&v);
    return NULL;
  }
  self->view = v;
  return (PyObject *)self;
}

static void buffer_dealloc(PyObject *op) {
  BufferObject *self = (BufferObject *)op;
  PyTypeObject *tp = Py_TYPE(op);
  pyac_view_release(&self->view);
  tp->tp_free(op);
  Py_DECREF(tp);
}

static PyObject *buffer_get_numel(PyObject *op, void *c) {
  (void)c;
  return PyLong_FromSize_t(((BufferObject *)op)->view.n);
}
static PyObject *buffer_get_nbytes(PyObject *op, void *c) {
  (void)c;
  BufferObject *self = (BufferObject *)op;
  return PyLong_FromSize_t(self->view.n * ac_dtype_size(self->view.dt));
}
static PyObject *buffer_get_dtype(PyObject *op, void *c) {
  (void)c;
  return PyUnicode_FromString(ac_dtype_name(((BufferObject *)op)->view.dt));
}
static PyObject *buffer_get_device(PyObject *op, void *c) {
  (void)c;
  BufferObject *self = (BufferObject *)op;
  return Py_BuildValue("(ii)", (int)self->view.device.device_type, (int)self->view.device.device_id);
}
static PyObject *buffer_get_data_ptr(PyObject *op, void *c) {
  (void)c;
  return PyLong_FromVoidPtr(((BufferObject *)op)->view.data);
}

static PyGetSetDef buffer_getset[] = {
    {"numel", buffer_get_numel, NULL, "number of elements", NULL},
    {"nbytes", buffer_get_nbytes, NULL, "size in bytes", NULL},
    {"dtype", buffer_get_dtype, NULL, "'float32', 'float16' or 'bfloat16'", NULL},
    {"device", buffer_get_device, NULL, "(DLPack device type, device id)", NULL},
    {"data_ptr", buffer_get_data_ptr, NULL, "address of the first element", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot buffer_slots[] = {
    {Py_tp_new, buffer_new},
    {Py_tp_dealloc, buffer_dealloc},
    {Py_tp_getset, buffer_getset},
    {Py_tp_doc, "Buffer(tensor): a contiguous float tensor consumed once through DLPack and kept "
                "alive, so kernels called on it every step skip the capsule exchange."},
    {0, NULL},
};

PyType_Spec pyac_buffer_spec = {
    .name = "accelerate_c._C.Buffer",
    .basicsize = sizeof(BufferObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = buffer_slots,
};

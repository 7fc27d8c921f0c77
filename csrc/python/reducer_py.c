/* reducer_py.c — Reducer: the C bucket plan of one flat gradient buffer as a Python type, the
 * readiness its hooks mark, and the NCCL launch of complete buckets from C. The hooks
 * themselves (GradHook), the copy-in in C and the sums of squares taken in them are in
 * grad_hook_py.c; the two share reducer_py.h. */
#include "reducer_py.h"

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

int pyac_reducer_has_plan(ReducerObject *self) {
  if (self->plan) return 1;
  PyErr_SetString(PyExc_RuntimeError, "Reducer was not initialised");
  return 0;
}

static PyObject *reducer_count(PyObject *op, PyObject *unused) {
  (void)unused;
  if (!pyac_reducer_has_plan((ReducerObject *)op)) return NULL;
  return PyLong_FromSize_t(ac_bucket_count(((ReducerObject *)op)->plan));
}

static PyObject *reducer_total(PyObject *op, PyObject *unused) {
  (void)unused;
  if (!pyac_reducer_has_plan((ReducerObject *)op)) return NULL;
  return PyLong_FromSize_t(ac_bucket_total(((ReducerObject *)op)->plan));
}

static PyObject *reducer_range(PyObject *op, PyObject *arg) {
  ReducerObject *self = (ReducerObject *)op;
  if (!pyac_reducer_has_plan(self)) return NULL;
  size_t b = PyLong_AsSize_t(arg), first, count;
  if (b == (size_t)-1 && PyErr_Occurred()) return NULL;
  ac_result_t r = ac_bucket_range(self->plan, b, &first, &count);
  if (r != AC_OK) return pyac_raise(pyac_module_of(op), r);
  return Py_BuildValue("(nn)", (Py_ssize_t)first, (Py_ssize_t)count);
}

static PyObject *reducer_layout(PyObject *op, PyObject *unused) {
  (void)unused;
  ReducerObject *self = (ReducerObject *)op;
  if (!pyac_reducer_has_plan(self)) return NULL;
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
  if (!pyac_reducer_has_plan(self)) return NULL;
  size_t i = PyLong_AsSize_t(arg), from, to;
  if (i == (size_t)-1 && PyErr_Occurred()) return NULL;
  ac_result_t r = ac_bucket_mark_ready(self->plan, i, &from, &to);
  if (r != AC_OK) return pyac_raise(pyac_module_of(op), r);
  return Py_BuildValue("(nn)", (Py_ssize_t)from, (Py_ssize_t)to);
}

static PyObject *reducer_pending(PyObject *op, PyObject *unused) {
  (void)unused;
  ReducerObject *self = (ReducerObject *)op;
  if (!pyac_reducer_has_plan(self)) return NULL;
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
  if (!pyac_reducer_has_plan(self)) return NULL;
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

PyObject *pyac_reducer_launch_nccl(ReducerObject *self, size_t from, size_t to) {
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
  return pyac_reducer_launch_nccl(self, (size_t)from, (size_t)to);
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
    {"sums", pyac_reducer_sums, METH_O,
     "sums(version) -> (sum_of_squares, sum_of_rounded_norms_squared, has_nonfinite) of the whole buffer from the "
     "hooks' measurements, in parameter order (the second with each gradient's norm rounded to the buffer's dtype, "
     "as torch's clip_grad_norm_ takes them); None unless every gradient was measured and the buffer's version is still `version`"},
    {"measure_now", (PyCFunction)(void (*)(void))pyac_reducer_measure_now, METH_FASTCALL,
     "measure_now(i, view): gradient i's range (`view`, of the buffer) was just written outside a hook "
     "(GradLayout.resync): measure it as a hook would"},
    {"forget_sums", pyac_reducer_forget_sums, METH_NOARGS, "forget_sums(): every measurement taken in the hooks is dropped"},
    {"hook", (PyCFunction)(void (*)(void))pyac_reducer_hook, METH_FASTCALL,
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
    {"measured", pyac_reducer_get_measured, NULL, "gradients with a valid measurement (see sums())", NULL},
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

/* grad_hook_py.c — GradHook, the per-parameter post-accumulate-grad hook that is a C callable
 * (made by Reducer.hook; the Reducer is in reducer_py.c), with the copy-in in C and the sums
 * of squares the hooks take for clip (Reducer.sums / measure_now / forget_sums).
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
#include "reducer_py.h"

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

PyObject *pyac_reducer_measure_now(PyObject *op, PyObject *const *a, Py_ssize_t n) {
  ReducerObject *self = (ReducerObject *)op;
  if (n != 2) {
    PyErr_Format(PyExc_TypeError, "measure_now(index, view) takes 2 arguments, %zd given", n);
    return NULL;
  }
  if (!pyac_reducer_has_plan(self)) return NULL;
  size_t i = PyLong_AsSize_t(a[0]);
  if (i == (size_t)-1 && PyErr_Occurred()) return NULL;
  if (i >= ac_bucket_nparams(self->plan)) {
    PyErr_Format(PyExc_IndexError, "measure_now: gradient %zu of %zu", i, ac_bucket_nparams(self->plan));
    return NULL;
  }
  if (!self->base || self->on_cuda) Py_RETURN_NONE; /* nothing is measured on a device buffer */
  return measure_slot(self, i, a[1]) < 0 ? NULL : Py_NewRef(Py_None);
}

PyObject *pyac_reducer_sums(PyObject *op, PyObject *arg) {
  ReducerObject *self = (ReducerObject *)op;
  if (!pyac_reducer_has_plan(self)) return NULL;
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

PyObject *pyac_reducer_forget_sums(PyObject *op, PyObject *unused) {
  (void)unused;
  if (!pyac_reducer_has_plan((ReducerObject *)op)) return NULL;
  forget_sums((ReducerObject *)op);
  Py_RETURN_NONE;
}

PyObject *pyac_reducer_get_measured(PyObject *op, void *c) {
  (void)c;
  return PyLong_FromSize_t(((ReducerObject *)op)->nhave);
}

PyObject *pyac_reducer_hook(PyObject *op, PyObject *const *a, Py_ssize_t n) {
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
  if (!pyac_reducer_has_plan(red)) return NULL;
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
  if (red->comm) return pyac_reducer_launch_nccl(red, from, to);
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

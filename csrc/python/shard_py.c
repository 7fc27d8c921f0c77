/* shard_py.c — ShardPlan: the C shard plan (ac/shard.h) as an immutable Python type.
 *
 * Every call is a handful of lookups or one pass over the parameters, so the GIL is kept.
 * Indices out of range are IndexError and refused values ValueError, both naming the argument;
 * the plan is built in __new__, so a ShardPlan never exists without one. */
#include "pyac.h"

#include "ac/shard.h"

#define DDP_FIRST_CAP ((Py_ssize_t)1 << 20) /* torch DDP's first bucket: 1 MiB */
#define DDP_CAP ((Py_ssize_t)25 << 20)      /* and the others: bucket_cap_mb=25 */

typedef struct {
  PyObject_HEAD
  ac_shard_plan_t *plan;
} ShardPlanObject;

static ac_shard_plan_t *plan_of(PyObject *op) { return ((ShardPlanObject *)op)->plan; }

static PyObject *size_tuple(size_t n, const size_t *v) {
  PyObject *t = PyTuple_New((Py_ssize_t)n);
  if (!t) return NULL;
  for (size_t k = 0; k < n; k++) {
    PyObject *x = PyLong_FromSize_t(v[k]);
    if (!x) {
      Py_DECREF(t);
      return NULL;
    }
    PyTuple_SET_ITEM(t, (Py_ssize_t)k, x);
  }
  return t;
}

/* A list of ints (any object with __index__) as size_t; `what` names it in errors. */
static int sizes_of(PyObject *seq, const char *what, size_t **out, Py_ssize_t *n) {
  PyObject *fast = PySequence_Fast(seq, what);
  if (!fast) {
    if (PyErr_ExceptionMatches(PyExc_TypeError)) {
      PyErr_Clear();
      PyErr_Format(PyExc_TypeError, "ShardPlan: %s must be a sequence of ints, got %s", what, Py_TYPE(seq)->tp_name);
    }
    return -1;
  }
  *n = PySequence_Fast_GET_SIZE(fast);
  *out = PyMem_Malloc((size_t)(*n ? *n : 1) * sizeof(size_t));
  if (!*out) {
    Py_DECREF(fast);
    PyErr_NoMemory();
    return -1;
  }
  for (Py_ssize_t i = 0; i < *n; i++) {
    PyObject *idx = PyNumber_Index(PySequence_Fast_GET_ITEM(fast, i));
    size_t v = idx ? PyLong_AsSize_t(idx) : (size_t)-1;
    Py_XDECREF(idx);
    if (v == (size_t)-1 && PyErr_Occurred()) {
      if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "ShardPlan: %s[%zd] must be a non-negative int", what, i);
      } else if (PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "ShardPlan: %s[%zd] must be an int", what, i);
      }
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

/* An index argument below `limit` (IndexError otherwise, naming `fn`, `arg` and what it counts). */
static int index_of(PyObject *o, size_t limit, const char *fn, const char *arg, const char *of, size_t *out) {
  Py_ssize_t v = PyNumber_AsSsize_t(o, PyExc_IndexError);
  if (v == -1 && PyErr_Occurred()) {
    if (PyErr_ExceptionMatches(PyExc_TypeError)) {
      PyErr_Clear();
      PyErr_Format(PyExc_TypeError, "ShardPlan.%s: %s must be an int, got %s", fn, arg, Py_TYPE(o)->tp_name);
    }
    return -1;
  }
  if (v < 0 || (size_t)v >= limit) {
    PyErr_Format(PyExc_IndexError, "ShardPlan.%s: %s %zd out of range (%zu %s)", fn, arg, v, limit, of);
    return -1;
  }
  *out = (size_t)v;
  return 0;
}

static PyObject *shard_plan_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"numel", "esize", "world", "order", "align", "first_cap_bytes", "cap_bytes", NULL};
  PyObject *numel_o, *order_o = Py_None;
  Py_ssize_t esize, world, align = 1, first_cap = DDP_FIRST_CAP, cap = DDP_CAP;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "Onn|$Onnn:ShardPlan", kwlist, &numel_o, &esize, &world, &order_o,
                                   &align, &first_cap, &cap))
    return NULL;
  const char *bad = esize <= 0 ? "esize" : world <= 0 ? "world" : align <= 0 ? "align" :
                    first_cap <= 0 ? "first_cap_bytes" : cap <= 0 ? "cap_bytes" : NULL;
  if (bad) {
    Py_ssize_t v = esize <= 0 ? esize : world <= 0 ? world : align <= 0 ? align : first_cap <= 0 ? first_cap : cap;
    PyErr_Format(PyExc_ValueError, "ShardPlan: %s must be > 0, got %zd", bad, v);
    return NULL;
  }
  size_t *numel = NULL, *order = NULL;
  Py_ssize_t n, norder;
  if (sizes_of(numel_o, "numel", &numel, &n) < 0) return NULL;
  if (order_o == Py_None) { /* reverse registration order: roughly when backward produces them */
    order = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *order);
    if (!order) {
      PyMem_Free(numel);
      return PyErr_NoMemory();
    }
    for (Py_ssize_t k = 0; k < n; k++) order[k] = (size_t)(n - 1 - k);
  } else {
    if (sizes_of(order_o, "order", &order, &norder) < 0) {
      PyMem_Free(numel);
      return NULL;
    }
    if (norder != n) {
      PyErr_Format(PyExc_ValueError, "ShardPlan: order has %zd entries for %zd parameters", norder, n);
      PyMem_Free(numel);
      PyMem_Free(order);
      return NULL;
    }
  }
  ac_shard_plan_t *plan = NULL;
  ac_result_t r = ac_shard_plan_create(&plan, (size_t)n, numel, order, (size_t)esize, (size_t)world, (size_t)align,
                                       (size_t)first_cap, (size_t)cap);
  PyMem_Free(numel);
  PyMem_Free(order);
  if (r != AC_OK) return pyac_raise_value(PyType_GetModule(type), r);
  ShardPlanObject *self = (ShardPlanObject *)type->tp_alloc(type, 0);
  if (!self) {
    ac_shard_plan_destroy(plan);
    return NULL;
  }
  self->plan = plan;
  return (PyObject *)self;
}

static void shard_plan_dealloc(PyObject *op) {
  PyTypeObject *tp = Py_TYPE(op);
  ac_shard_plan_destroy(plan_of(op));
  tp->tp_free(op);
  Py_DECREF(tp);
}

static PyObject *bucket_tuple(const ac_shard_plan_t *p, size_t b) {
  ac_shard_bucket_t bk;
  (void)ac_shard_bucket(p, b, &bk); /* b is checked */
  size_t v[] = {bk.full_offset, bk.chunk, bk.local_offset, bk.first, bk.count};
  return size_tuple(5, v);
}

static PyObject *sp_bucket(PyObject *op, PyObject *arg) {
  size_t b;
  if (index_of(arg, ac_shard_nbuckets(plan_of(op)), "bucket", "b", "buckets", &b) < 0) return NULL;
  return bucket_tuple(plan_of(op), b);
}

static PyObject *sp_buckets(PyObject *op, PyObject *unused) {
  (void)unused;
  size_t nb = ac_shard_nbuckets(plan_of(op));
  PyObject *l = PyList_New((Py_ssize_t)nb);
  if (!l) return NULL;
  for (size_t b = 0; b < nb; b++) {
    PyObject *t = bucket_tuple(plan_of(op), b);
    if (!t) {
      Py_DECREF(l);
      return NULL;
    }
    PyList_SET_ITEM(l, (Py_ssize_t)b, t);
  }
  return l;
}

static PyObject *param_tuple(const ac_shard_plan_t *p, size_t i) {
  ac_shard_param_t pr;
  (void)ac_shard_param(p, i, &pr); /* i is checked */
  size_t v[] = {pr.bucket, pr.full_offset, pr.numel};
  return size_tuple(3, v);
}

static PyObject *sp_param(PyObject *op, PyObject *arg) {
  size_t i;
  if (index_of(arg, ac_shard_nparams(plan_of(op)), "param", "i", "parameters", &i) < 0) return NULL;
  return param_tuple(plan_of(op), i);
}

static PyObject *sp_params(PyObject *op, PyObject *unused) {
  (void)unused;
  size_t n = ac_shard_nparams(plan_of(op));
  PyObject *l = PyList_New((Py_ssize_t)n);
  if (!l) return NULL;
  for (size_t i = 0; i < n; i++) {
    PyObject *t = param_tuple(plan_of(op), i);
    if (!t) {
      Py_DECREF(l);
      return NULL;
    }
    PyList_SET_ITEM(l, (Py_ssize_t)i, t);
  }
  return l;
}

static PyObject *sp_param_shard(PyObject *op, PyObject *const *a, Py_ssize_t nargs) {
  if (!pyac_nargs_ok("param_shard", nargs, 2)) return NULL;
  const ac_shard_plan_t *p = plan_of(op);
  size_t i, rank, v[3];
  if (index_of(a[0], ac_shard_nparams(p), "param_shard", "i", "parameters", &i) < 0 ||
      index_of(a[1], ac_shard_world(p), "param_shard", "rank", "ranks", &rank) < 0)
    return NULL;
  (void)ac_shard_param_shard(p, i, rank, &v[0], &v[1], &v[2]);
  return size_tuple(3, v);
}

static PyObject *run_list(const ac_shard_run_t *runs, size_t n) {
  PyObject *l = PyList_New((Py_ssize_t)n);
  if (!l) return NULL;
  for (size_t k = 0; k < n; k++) {
    size_t v[] = {runs[k].old_rank, runs[k].old_offset, runs[k].new_offset, runs[k].length};
    PyObject *t = size_tuple(4, v);
    if (!t) {
      Py_DECREF(l);
      return NULL;
    }
    PyList_SET_ITEM(l, (Py_ssize_t)k, t);
  }
  return l;
}

static PyObject *sp_reshard_runs(PyObject *op, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"old_plan", "new_rank", "old_rank", NULL};
  PyObject *old_o, *new_rank_o, *old_rank_o = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|O:reshard_runs", kwlist, &old_o, &new_rank_o, &old_rank_o))
    return NULL;
  if (!PyObject_TypeCheck(old_o, Py_TYPE(op))) {
    PyErr_Format(PyExc_TypeError, "ShardPlan.reshard_runs: old_plan must be a ShardPlan, got %s",
                 Py_TYPE(old_o)->tp_name);
    return NULL;
  }
  const ac_shard_plan_t *np = plan_of(op), *opl = plan_of(old_o);
  size_t new_rank, old_rank = 0;
  if (index_of(new_rank_o, ac_shard_world(np), "reshard_runs", "new_rank", "ranks in this plan", &new_rank) < 0)
    return NULL;
  if (old_rank_o != Py_None &&
      index_of(old_rank_o, ac_shard_world(opl), "reshard_runs", "old_rank", "ranks in old_plan", &old_rank) < 0)
    return NULL;
  ac_shard_reshard_t *rs = NULL;
  ac_result_t r = ac_shard_reshard_create(&rs, opl, np, new_rank);
  if (r != AC_OK) return pyac_raise_value(pyac_module_of(op), r);
  PyObject *out;
  if (old_rank_o == Py_None) {
    out = run_list(ac_shard_reshard_runs(rs), ac_shard_reshard_count(rs));
  } else {
    const ac_shard_run_t *runs;
    size_t n;
    (void)ac_shard_reshard_from(rs, old_rank, &runs, &n); /* old_rank is checked */
    out = run_list(runs, n);
  }
  ac_shard_reshard_destroy(rs);
  return out;
}

static PyObject *sp_repr(PyObject *op) {
  const ac_shard_plan_t *p = plan_of(op);
  char buf[256];
  snprintf(buf, sizeof buf, "ShardPlan(nparams=%zu, esize=%zu, world=%zu, align=%zu, nbuckets=%zu, total=%zu, "
           "shard_numel=%zu)", ac_shard_nparams(p), ac_shard_esize(p), ac_shard_world(p), ac_shard_align(p),
           ac_shard_nbuckets(p), ac_shard_total(p), ac_shard_numel(p));
  return PyUnicode_FromString(buf);
}

/* ---- properties ------------------------------------------------------------------------- */

#define SIZE_GETTER(name, fn)                                   \
  static PyObject *sp_get_##name(PyObject *op, void *c) {       \
    (void)c;                                                    \
    return PyLong_FromSize_t(fn(plan_of(op)));                  \
  }
SIZE_GETTER(total, ac_shard_total)
SIZE_GETTER(shard_numel, ac_shard_numel)
SIZE_GETTER(world, ac_shard_world)
SIZE_GETTER(nparams, ac_shard_nparams)
SIZE_GETTER(nbuckets, ac_shard_nbuckets)
SIZE_GETTER(esize, ac_shard_esize)
SIZE_GETTER(align, ac_shard_align)
SIZE_GETTER(first_cap_bytes, ac_shard_first_cap)
SIZE_GETTER(cap_bytes, ac_shard_cap)

static PyObject *sp_get_numel(PyObject *op, void *c) {
  (void)c;
  const ac_shard_plan_t *p = plan_of(op);
  size_t n = ac_shard_nparams(p);
  PyObject *t = PyTuple_New((Py_ssize_t)n);
  if (!t) return NULL;
  for (size_t i = 0; i < n; i++) {
    ac_shard_param_t pr;
    (void)ac_shard_param(p, i, &pr);
    PyObject *x = PyLong_FromSize_t(pr.numel);
    if (!x) {
      Py_DECREF(t);
      return NULL;
    }
    PyTuple_SET_ITEM(t, (Py_ssize_t)i, x);
  }
  return t;
}

static PyObject *sp_get_order(PyObject *op, void *c) {
  (void)c;
  const ac_shard_plan_t *p = plan_of(op);
  size_t n = ac_shard_nparams(p);
  PyObject *t = PyTuple_New((Py_ssize_t)n);
  if (!t) return NULL;
  for (size_t k = 0; k < n; k++) {
    size_t i;
    (void)ac_shard_placed(p, k, &i);
    PyObject *x = PyLong_FromSize_t(i);
    if (!x) {
      Py_DECREF(t);
      return NULL;
    }
    PyTuple_SET_ITEM(t, (Py_ssize_t)k, x);
  }
  return t;
}

#define SIZE_PROP(name, doc) {#name, sp_get_##name, NULL, doc, NULL}

static PyGetSetDef sp_getset[] = {
    SIZE_PROP(total, "elements of the full buffer, padding included (world * shard_numel)"),
    SIZE_PROP(shard_numel, "elements of every rank's shard (sum of the buckets' chunks)"),
    SIZE_PROP(world, "ranks the buffer is split between"),
    SIZE_PROP(nparams, "parameters the plan lays out"),
    SIZE_PROP(nbuckets, "buckets (one reduce-scatter / all-gather each)"),
    SIZE_PROP(esize, "bytes per element (the caps count bytes)"),
    SIZE_PROP(align, "every parameter starts at a multiple of this many elements"),
    SIZE_PROP(first_cap_bytes, "bucket 0's cap in bytes"),
    SIZE_PROP(cap_bytes, "the other buckets' cap in bytes"),
    {"numel", sp_get_numel, NULL, "elements of each parameter (a tuple, in parameter order)", NULL},
    {"order", sp_get_order, NULL, "the placement order (a tuple: order[k] is the k-th parameter placed)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef sp_methods[] = {
    {"bucket", sp_bucket, METH_O,
     "bucket(b) -> (full_offset, chunk, local_offset, first, count): bucket b is full[full_offset : full_offset + "
     "world*chunk], every rank's chunk of it is shard[local_offset : local_offset + chunk], and its parameters are "
     "order[first : first + count]"},
    {"buckets", sp_buckets, METH_NOARGS, "buckets() -> [bucket(b) for every b]"},
    {"param", sp_param, METH_O,
     "param(i) -> (bucket, full_offset, numel): parameter i is full[full_offset : full_offset + numel]"},
    {"params", sp_params, METH_NOARGS, "params() -> [param(i) for every i]"},
    {"param_shard", (PyCFunction)(void (*)(void))sp_param_shard, METH_FASTCALL,
     "param_shard(i, rank) -> (local_offset, param_offset, length): rank owns elements [param_offset : param_offset "
     "+ length] of parameter i (flattened), at shard[local_offset : local_offset + length]; length 0 (and offsets 0) "
     "when it owns none"},
    {"reshard_runs", (PyCFunction)(void (*)(void))sp_reshard_runs, METH_VARARGS | METH_KEYWORDS,
     "reshard_runs(old_plan, new_rank, old_rank=None) -> [(old_rank, old_offset, new_offset, length)]: the copies, "
     "in elements, that fill new_rank's shard of this plan from the shards written under old_plan (same parameters, "
     "any world, order, caps, align). Sorted by new_offset; with old_rank, only those reading that old rank's shard, "
     "sorted by old_offset. Padding gets no run (zero it)."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot sp_slots[] = {
    {Py_tp_new, shard_plan_new},
    {Py_tp_dealloc, shard_plan_dealloc},
    {Py_tp_repr, sp_repr},
    {Py_tp_methods, sp_methods},
    {Py_tp_getset, sp_getset},
    {Py_tp_doc, "ShardPlan(numel, esize, world, *, order=None, align=1, first_cap_bytes=1 MiB, cap_bytes=25 MiB): "
                "the layout of one flat buffer split between `world` ranks (csrc/include/ac/shard.h). Parameters are "
                "placed in `order` (default: reverse, n-1 .. 0) and packed into buckets by torch DDP's cap rule; "
                "each bucket is padded to a multiple of world*align and split into equal chunks; the full buffer is "
                "bucket-major and each rank's shard is its chunks, concatenated."},
    {0, NULL},
};

PyType_Spec pyac_shard_plan_spec = {
    .name = "accelerate_c._C.ShardPlan",
    .basicsize = sizeof(ShardPlanObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = sp_slots,
};

/* safetensors_py.c — Python entry points of the safetensors engine: tensors of any dtype in
 * through DLPack, the GIL released around all file I/O, core errors out as CoreError. */
#include "pyac.h"

#include <string.h>

#include "ac/safetensors.h"

/* DLPack 1.1 float8 type codes (declared here rather than in dlpack.h, which only carries what
 * the kernels consume); torch exports its float8 dtypes with these. */
enum { DL_FLOAT8_E4M3FN = 10, DL_FLOAT8_E5M2 = 12, DL_FLOAT8_E8M0FNU = 14 };

/* A tensor exported through DLPack and owned until st_view_release. Unlike pyac_view_from
 * (float kernels only) this accepts every dtype a checkpoint may hold. */
typedef struct {
  void *owner;
  int versioned;
  const DLTensor *t;
  void *data;
  size_t nbytes;
  ac_st_dtype_t dtype;
  ac_st_memory_t memory; /* AC_ST_CUDA for CUDA device (or managed) memory */
  int32_t device;
} st_view;

static void st_view_release(st_view *v) {
  pyac_dlpack_release(v->owner, v->versioned);
  v->owner = NULL;
}

static int map_dtype(DLDataType d, ac_st_dtype_t *out) {
  if (d.lanes != 1) return 0;
  switch (d.code) {
    case kDLBool: return d.bits == 8 ? (*out = AC_ST_BOOL, 1) : 0;
    case kDLUInt:
      switch (d.bits) {
        case 8: *out = AC_ST_U8; return 1;
        case 16: *out = AC_ST_U16; return 1;
        case 32: *out = AC_ST_U32; return 1;
        case 64: *out = AC_ST_U64; return 1;
      }
      return 0;
    case kDLInt:
      switch (d.bits) {
        case 8: *out = AC_ST_I8; return 1;
        case 16: *out = AC_ST_I16; return 1;
        case 32: *out = AC_ST_I32; return 1;
        case 64: *out = AC_ST_I64; return 1;
      }
      return 0;
    case kDLFloat:
      switch (d.bits) {
        case 16: *out = AC_ST_F16; return 1;
        case 32: *out = AC_ST_F32; return 1;
        case 64: *out = AC_ST_F64; return 1;
      }
      return 0;
    case kDLBfloat: return d.bits == 16 ? (*out = AC_ST_BF16, 1) : 0;
    case kDLComplex: return d.bits == 64 ? (*out = AC_ST_C64, 1) : 0;
    case DL_FLOAT8_E4M3FN: return d.bits == 8 ? (*out = AC_ST_F8_E4M3, 1) : 0;
    case DL_FLOAT8_E5M2: return d.bits == 8 ? (*out = AC_ST_F8_E5M2, 1) : 0;
    case DL_FLOAT8_E8M0FNU: return d.bits == 8 ? (*out = AC_ST_F8_E8M0, 1) : 0;
  }
  return 0;
}

typedef struct {
  int writable, cuda_ok;
  const char *name, *arg; /* the tensor's name, and it quoted for the shared DLPack checks */
  st_view *v;
} st_check_ctx;

/* The engine's rules for one exported tensor (pyac_dlpack_take's check): contiguous memory of a
 * supported dtype, on the CPU, or with `cuda_ok` also CUDA device memory (which the core stages
 * through pinned buffers; a CPU-only core refuses it with a clear error); `writable` also
 * requires memory the producer did not copy or mark read-only. Fills the view's fields. */
static int st_check(const DLTensor *t, uint64_t flags, void *p) {
  st_check_ctx *c = p;
  st_view *v = c->v;
  int dev = t->device.device_type;
  int on_cuda = dev == kDLCUDA || dev == kDLCUDAManaged;
  if (dev != kDLCPU && dev != kDLCUDAHost && !(c->cuda_ok && on_cuda)) {
    PyErr_Format(PyExc_ValueError, "tensor '%s' is on DLPack device type %d; copy it to the CPU first", c->name, dev);
    return -1;
  }
  if (!map_dtype(t->dtype, &v->dtype)) {
    PyErr_Format(PyExc_ValueError, "tensor '%s' has an unsupported dtype (DLPack code %u, %u bits, %u lanes)",
                 c->name, (unsigned)t->dtype.code, (unsigned)t->dtype.bits, (unsigned)t->dtype.lanes);
    return -1;
  }
  size_t n;
  if ((c->writable && pyac_dl_writable(flags, c->arg) < 0) ||
      pyac_dl_layout(t, ac_st_dtype_size(v->dtype), c->arg, &n) < 0)
    return -1;
  v->t = t;
  v->nbytes = n * ac_st_dtype_size(v->dtype);
  v->data = v->nbytes ? (char *)t->data + t->byte_offset : NULL;
  v->memory = on_cuda ? AC_ST_CUDA : AC_ST_HOST;
  v->device = on_cuda ? t->device.device_id : 0;
  return 0;
}

/* Exports `obj` (anything with __dlpack__, or a DLPack capsule, e.g. one safetensors_io
 * exported under a CUDA tensor's own device) under the engine's rules (st_check). `name`
 * labels errors. Returns 0, or -1 with an exception set. */
static int st_view_from(PyObject *obj, int writable, int cuda_ok, const char *name, st_view *v) {
  memset(v, 0, sizeof *v);
  char arg[256];
  snprintf(arg, sizeof arg, "'%s'", name);
  st_check_ctx ctx = {writable, cuda_ok, name, arg, v};
  return pyac_dlpack_take(obj, arg, st_check, &ctx, &v->owner, &v->versioned);
}

static int get_threads(PyObject *o, int *out) {
  long v = PyLong_AsLong(o);
  if (v == -1 && PyErr_Occurred()) return -1;
  if (v < 0 || v > 1024) {
    PyErr_Format(PyExc_ValueError, "threads must be in [0, 1024] (0 = choose), got %ld", v);
    return -1;
  }
  *out = (int)v;
  return 0;
}

static int fs_path(PyObject *o, PyObject **bytes) {
  if (!PyUnicode_FSConverter(o, bytes)) return -1;
  return 0;
}

/* UTF-8 of a str with no embedded NUL (C strings cannot carry one). */
static const char *utf8_of(PyObject *s, const char *what) {
  if (!PyUnicode_Check(s)) {
    PyErr_Format(PyExc_TypeError, "%s must be str, got %s", what, Py_TYPE(s)->tp_name);
    return NULL;
  }
  Py_ssize_t n;
  const char *u = PyUnicode_AsUTF8AndSize(s, &n);
  if (u && (size_t)n != strlen(u)) {
    PyErr_Format(PyExc_ValueError, "%s %R contains a NUL character", what, s);
    return NULL;
  }
  return u;
}

/* ready[i] for each CUDA tensor: the event handle `events` (a dict {device index: int, a
 * cudaEvent_t}) has for its device; NULL when `events` is None. Returns 0, or -1 with an
 * exception naming the tensor. */
static int ready_events(PyObject *events, const ac_st_tensor_t *ts, Py_ssize_t nt, void **ready) {
  if (events == Py_None) return 0;
  if (!PyDict_Check(events)) {
    PyErr_Format(PyExc_TypeError, "st_save: ready must be a dict of CUDA device index to event handle, or None; "
                 "got %s", Py_TYPE(events)->tp_name);
    return -1;
  }
  for (Py_ssize_t i = 0; i < nt; i++) {
    if (ts[i].memory != AC_ST_CUDA) continue;
    PyObject *key = PyLong_FromLong(ts[i].device);
    if (!key) return -1;
    PyObject *h = PyDict_GetItemWithError(events, key); /* borrowed */
    Py_DECREF(key);
    if (!h) {
      if (!PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "st_save: ready has no event for CUDA device %d (tensor '%s')",
                     (int)ts[i].device, ts[i].name);
      return -1;
    }
    ready[i] = PyLong_AsVoidPtr(h);
    if (!ready[i]) {
      if (!PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "st_save: the event for CUDA device %d (tensor '%s') is a NULL handle",
                     (int)ts[i].device, ts[i].name);
      return -1;
    }
  }
  return 0;
}

static PyObject *py_st_save(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  if (n != 5 && n != 6) {
    PyErr_Format(PyExc_TypeError,
                 "st_save(path, names, tensors, metadata, threads[, ready]) takes 5 or 6 arguments (%zd given)", n);
    return NULL;
  }
  int threads;
  if (get_threads(a[4], &threads) < 0) return NULL;
  PyObject *path = NULL, *names = NULL, *tensors = NULL, *meta = NULL, *ret = NULL;
  ac_st_tensor_t *ts = NULL;
  void **ready = NULL;
  st_view *views = NULL;
  ac_st_kv_t *kv = NULL;
  Py_ssize_t nt = 0, nv = 0, nm = 0;
  if (fs_path(a[0], &path) < 0) goto done;
  /* tuples: the caller's lists could change while the GIL is released */
  names = PySequence_Tuple(a[1]);
  tensors = names ? PySequence_Tuple(a[2]) : NULL;
  if (!tensors) goto done;
  nt = PyTuple_GET_SIZE(names);
  if (PyTuple_GET_SIZE(tensors) != nt) {
    PyErr_Format(PyExc_ValueError, "st_save: %zd names but %zd tensors", nt, PyTuple_GET_SIZE(tensors));
    goto done;
  }
  if (a[3] != Py_None) {
    if (!PyDict_Check(a[3])) {
      PyErr_Format(PyExc_TypeError, "metadata must be a dict of str to str or None, got %s", Py_TYPE(a[3])->tp_name);
      goto done;
    }
    meta = PyDict_Items(a[3]); /* a list of new (key, value) tuples that we own */
    if (!meta) goto done;
    nm = PyList_GET_SIZE(meta);
  }
  ts = PyMem_Calloc((size_t)(nt ? nt : 1), sizeof *ts);
  ready = PyMem_Calloc((size_t)(nt ? nt : 1), sizeof *ready);
  views = PyMem_Calloc((size_t)(nt ? nt : 1), sizeof *views);
  kv = PyMem_Calloc((size_t)(nm ? nm : 1), sizeof *kv);
  if (!ts || !ready || !views || !kv) {
    PyErr_NoMemory();
    goto done;
  }
  for (Py_ssize_t i = 0; i < nm; i++) {
    PyObject *item = PyList_GET_ITEM(meta, i);
    kv[i].key = utf8_of(PyTuple_GET_ITEM(item, 0), "metadata key");
    if (!kv[i].key) goto done;
    kv[i].value = utf8_of(PyTuple_GET_ITEM(item, 1), "metadata value");
    if (!kv[i].value) goto done;
  }
  for (Py_ssize_t i = 0; i < nt; i++) {
    const char *nm_i = utf8_of(PyTuple_GET_ITEM(names, i), "tensor name");
    if (!nm_i || st_view_from(PyTuple_GET_ITEM(tensors, i), 0, 1, nm_i, &views[i]) < 0) goto done;
    nv = i + 1;
    ts[i].name = nm_i;
    ts[i].dtype = views[i].dtype;
    ts[i].ndim = views[i].t->ndim;
    ts[i].shape = views[i].t->shape;
    ts[i].data = views[i].data;
    ts[i].memory = views[i].memory;
    ts[i].device = views[i].device;
  }
  PyObject *events = n == 6 ? a[5] : Py_None;
  if (ready_events(events, ts, nt, ready) < 0) goto done;
  const char *p = PyBytes_AS_STRING(path);
  ac_result_t r;
  Py_BEGIN_ALLOW_THREADS r = ac_st_save_after(p, ts, (size_t)nt, kv, (size_t)nm, threads,
                                              events == Py_None ? NULL : (void *const *)ready);
  Py_END_ALLOW_THREADS
  if (r != AC_OK) {
    pyac_raise(m, r);
    goto done;
  }
  ret = Py_NewRef(Py_None);
done:
  for (Py_ssize_t i = 0; i < nv; i++) st_view_release(&views[i]);
  PyMem_Free(ts);
  PyMem_Free(ready);
  PyMem_Free(views);
  PyMem_Free(kv);
  Py_XDECREF(meta);
  Py_XDECREF(tensors);
  Py_XDECREF(names);
  Py_XDECREF(path);
  return ret;
}

static PyObject *header_dict(const ac_st_header_t *h) {
  PyObject *d = PyDict_New(), *tl = NULL, *md = NULL;
  if (!d) return NULL;
  size_t n = ac_st_header_count(h);
  tl = PyList_New((Py_ssize_t)n);
  if (!tl) goto fail;
  for (size_t i = 0; i < n; i++) {
    ac_st_info_t info;
    if (ac_st_header_info(h, i, &info) != AC_OK) goto fail;
    PyObject *shape = PyTuple_New(info.ndim);
    if (!shape) goto fail;
    for (int32_t k = 0; k < info.ndim; k++) {
      PyObject *e = PyLong_FromLongLong(info.shape[k]);
      if (!e) {
        Py_DECREF(shape);
        goto fail;
      }
      PyTuple_SET_ITEM(shape, k, e);
    }
    PyObject *row = Py_BuildValue("(ssNKK)", info.name, ac_st_dtype_name(info.dtype), shape,
                                  (unsigned long long)info.begin, (unsigned long long)info.end);
    if (!row) goto fail;
    PyList_SET_ITEM(tl, (Py_ssize_t)i, row);
  }
  if (ac_st_header_has_metadata(h)) {
    md = PyDict_New();
    if (!md) goto fail;
    for (size_t i = 0; i < ac_st_header_metadata_count(h); i++) {
      const char *k, *v;
      if (ac_st_header_metadata(h, i, &k, &v) != AC_OK) goto fail;
      PyObject *vs = PyUnicode_FromString(v);
      if (!vs || PyDict_SetItemString(md, k, vs) < 0) {
        Py_XDECREF(vs);
        goto fail;
      }
      Py_DECREF(vs);
    }
  } else {
    md = Py_NewRef(Py_None);
  }
  PyObject *ds = PyLong_FromUnsignedLongLong((unsigned long long)ac_st_header_data_start(h));
  if (!ds || PyDict_SetItemString(d, "data_start", ds) < 0) {
    Py_XDECREF(ds);
    goto fail;
  }
  Py_DECREF(ds);
  if (PyDict_SetItemString(d, "tensors", tl) < 0 || PyDict_SetItemString(d, "metadata", md) < 0) goto fail;
  Py_DECREF(tl);
  Py_DECREF(md);
  return d;
fail:
  Py_XDECREF(tl);
  Py_XDECREF(md);
  Py_DECREF(d);
  return NULL;
}

static int open_reader(PyObject *m, PyObject *pathobj, ac_st_reader_t **rd) {
  PyObject *path;
  if (fs_path(pathobj, &path) < 0) return -1;
  const char *p = PyBytes_AS_STRING(path);
  ac_result_t r;
  Py_BEGIN_ALLOW_THREADS r = ac_st_reader_create(rd, p);
  Py_END_ALLOW_THREADS
  Py_DECREF(path);
  if (r != AC_OK) {
    pyac_raise(m, r);
    return -1;
  }
  return 0;
}

static PyObject *py_st_header(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  if (n != 1) {
    PyErr_Format(PyExc_TypeError, "st_header(path) takes 1 argument (%zd given)", n);
    return NULL;
  }
  ac_st_reader_t *rd;
  if (open_reader(m, a[0], &rd) < 0) return NULL;
  PyObject *d = header_dict(ac_st_reader_header(rd));
  ac_st_reader_destroy(rd);
  return d;
}

static PyObject *py_st_load_into(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  if (n != 3) {
    PyErr_Format(PyExc_TypeError, "st_load_into(path, {name: tensor}, threads) takes 3 arguments (%zd given)", n);
    return NULL;
  }
  if (!PyDict_Check(a[1])) {
    PyErr_Format(PyExc_TypeError, "st_load_into: targets must be a dict of name to tensor, got %s",
                 Py_TYPE(a[1])->tp_name);
    return NULL;
  }
  int threads;
  if (get_threads(a[2], &threads) < 0) return NULL;
  PyObject *items = PyDict_Items(a[1]), *ret = NULL;
  if (!items) return NULL;
  Py_ssize_t nt = PyList_GET_SIZE(items), nv = 0;
  st_view *views = PyMem_Calloc((size_t)(nt ? nt : 1), sizeof *views);
  ac_st_read_t *reqs = PyMem_Calloc((size_t)(nt ? nt : 1), sizeof *reqs);
  ac_st_reader_t *rd = NULL;
  if (!views || !reqs) {
    PyErr_NoMemory();
    goto done;
  }
  if (open_reader(m, a[0], &rd) < 0) goto done;
  const ac_st_header_t *h = ac_st_reader_header(rd);
  for (Py_ssize_t i = 0; i < nt; i++) {
    PyObject *item = PyList_GET_ITEM(items, i);
    const char *name = utf8_of(PyTuple_GET_ITEM(item, 0), "tensor name");
    if (!name) goto done;
    size_t idx;
    ac_result_t r = ac_st_header_find(h, name, &idx);
    if (r != AC_OK) {
      PyErr_Format(PyExc_KeyError, "%R: no tensor of that name in %R", PyTuple_GET_ITEM(item, 0), a[0]);
      goto done;
    }
    if (st_view_from(PyTuple_GET_ITEM(item, 1), 1, 0, name, &views[i]) < 0) goto done;
    nv = i + 1;
    ac_st_info_t info;
    if (ac_st_header_info(h, idx, &info) != AC_OK) {
      pyac_raise(m, AC_ERR_INTERNAL);
      goto done;
    }
    const DLTensor *t = views[i].t;
    int same = views[i].dtype == info.dtype && t->ndim == info.ndim;
    for (int32_t k = 0; same && k < t->ndim; k++) same = t->shape[k] == info.shape[k];
    if (!same) {
      PyErr_Format(PyExc_ValueError, "tensor '%s' in the file is %s with %d dims; the destination is %s with %d dims "
                   "or another shape", name, ac_st_dtype_name(info.dtype), (int)info.ndim,
                   ac_st_dtype_name(views[i].dtype), (int)t->ndim);
      goto done;
    }
    reqs[i] = (ac_st_read_t){idx, views[i].data, views[i].nbytes};
  }
  ac_result_t r;
  Py_BEGIN_ALLOW_THREADS r = ac_st_reader_read(rd, reqs, (size_t)nt, threads);
  Py_END_ALLOW_THREADS
  if (r != AC_OK) {
    pyac_raise(m, r);
    goto done;
  }
  ret = Py_NewRef(Py_None);
done:
  for (Py_ssize_t i = 0; i < nv; i++) st_view_release(&views[i]);
  ac_st_reader_destroy(rd);
  PyMem_Free(views);
  PyMem_Free(reqs);
  Py_DECREF(items);
  return ret;
}

static PyObject *py_st_last_write_mode(PyObject *m, PyObject *unused) {
  (void)m, (void)unused;
  return PyUnicode_FromString(ac_st_last_write_mode());
}

PyMethodDef pyac_safetensors_methods[] = {
    PYAC_FAST("st_save", py_st_save,
         "st_save(path, names, tensors, metadata, threads[, ready]): write a safetensors file (contiguous tensors or "
         "DLPack capsules, any dtype; CPU memory, or CUDA memory in a CUDA build, staged through pinned buffers: "
         "whose copies wait for ready[device], a cudaEvent_t handle recorded after the work that writes them; "
         "without ready, the caller must have finished that work) atomically and durably; metadata is a dict of "
         "str or None; threads 0 = choose."),
    PYAC_FAST("st_header", py_st_header,
         "st_header(path) -> {'tensors': [(name, dtype, shape, begin, end), ...] in offset order, "
         "'metadata': dict or None, 'data_start': int}; validates the whole header."),
    PYAC_FAST("st_load_into", py_st_load_into,
         "st_load_into(path, {name: tensor}, threads): read those tensors straight into the given contiguous, "
         "writable CPU tensors of the file's dtype and shape."),
    {"st_last_write_mode", py_st_last_write_mode, METH_NOARGS,
     "st_last_write_mode() -> 'direct', 'buffered' or 'none': how the last st_save on this thread wrote its "
     "data (O_DIRECT or through the page cache; 'none' if it failed before writing)."},
    {NULL, NULL, 0, NULL},
};

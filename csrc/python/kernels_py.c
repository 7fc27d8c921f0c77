/* kernels_py.c — Python entry points of the kernels: convert arguments, release the GIL around
 * the work, map results. No algorithm lives here. */
#include "pyac.h"

#include "ac/cuda.h"
#include "ac/pool.h"

static int get_float(PyObject *o, const char *arg, float *out) {
  double d = PyFloat_AsDouble(o);
  if (d == -1.0 && PyErr_Occurred()) {
    if (PyErr_ExceptionMatches(PyExc_TypeError)) {
      PyErr_Clear();
      PyErr_Format(PyExc_TypeError, "%s must be a number, got %s", arg, Py_TYPE(o)->tp_name);
    }
    return -1; /* e.g. OverflowError for an int too large for a double: keep it */
  }
  *out = (float)d;
  return 0;
}

static PyObject *stats_tuple(const ac_stats_t *s) {
  return Py_BuildValue("(ddO)", s->sumsq, (double)s->maxabs, s->nonfinite ? Py_True : Py_False);
}

static PyObject *py_scale_(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  float f;
  pyac_view v;
  if (!pyac_nargs_ok("scale_", n, 2) || get_float(a[1], "factor", &f) < 0) return NULL;
  if (pyac_view_from(m, a[0], PYAC_WRITE, PYAC_ON_CPU, "tensor", &v) < 0) return NULL;
  ac_result_t r;
  Py_BEGIN_ALLOW_THREADS r = ac_scale(v.dt, v.data, v.n, f);
  Py_END_ALLOW_THREADS pyac_view_release(&v);
  if (r != AC_OK) return pyac_raise(m, r);
  Py_RETURN_NONE;
}

static PyObject *py_stats(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  pyac_view v;
  ac_stats_t s;
  if (!pyac_nargs_ok("stats", n, 1)) return NULL;
  if (pyac_view_from(m, a[0], PYAC_READ, PYAC_ON_CPU, "tensor", &v) < 0) return NULL;
  ac_result_t r;
  Py_BEGIN_ALLOW_THREADS r = ac_stats(v.dt, v.data, v.n, &s);
  Py_END_ALLOW_THREADS pyac_view_release(&v);
  if (r != AC_OK) return pyac_raise(m, r);
  return stats_tuple(&s);
}

static PyObject *py_sumsq(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  pyac_view v;
  double sq = 0.0;
  int nf = 0;
  if (!pyac_nargs_ok("sumsq", n, 1)) return NULL;
  if (pyac_view_from(m, a[0], PYAC_READ, PYAC_ON_CPU, "tensor", &v) < 0) return NULL;
  ac_result_t r;
  Py_BEGIN_ALLOW_THREADS r = ac_sumsq(v.dt, v.data, v.n, &sq, &nf);
  Py_END_ALLOW_THREADS pyac_view_release(&v);
  if (r != AC_OK) return pyac_raise(m, r);
  return Py_BuildValue("(dO)", sq, nf ? Py_True : Py_False);
}

/* segs: array('Q') of (offset, length) pairs (64-bit size_t), built once per layout
 * (GradLayout.build), so a step parses no Python ints. */
static PyObject *py_sumsq_segments(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  pyac_view v;
  Py_buffer segs;
  double ex = 0.0, ro = 0.0, scale;
  int nf = 0;
  if (!pyac_nargs_ok("sumsq_segments", n, 3)) return NULL;
  scale = PyFloat_AsDouble(a[2]);
  if (scale == -1.0 && PyErr_Occurred()) return NULL;
  if (PyObject_GetBuffer(a[1], &segs, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return NULL;
  /* unsigned 64-bit integers ('Q', or 'L'/'N' where those are 64-bit), as array('Q') holds */
  const char *fmt = segs.format ? segs.format : "B";
  if (*fmt == '@' || *fmt == '=') fmt++;
  int unsigned64 = segs.itemsize == (Py_ssize_t)sizeof(size_t) && sizeof(size_t) == 8 && fmt[1] == '\0' &&
                   (fmt[0] == 'Q' || fmt[0] == 'L' || fmt[0] == 'N');
  if (!unsigned64 || segs.len % (Py_ssize_t)(2 * sizeof(size_t)) != 0) {
    PyErr_Format(PyExc_ValueError, "sumsq_segments: segs must hold (offset, length) pairs of unsigned 64-bit "
                 "integers (array('Q')), got format '%s' with %zd-byte items, %zd bytes", segs.format ? segs.format : "B",
                 segs.itemsize, segs.len);
    PyBuffer_Release(&segs);
    return NULL;
  }
  if (pyac_view_from(m, a[0], PYAC_READ, PYAC_ON_CPU, "tensor", &v) < 0) {
    PyBuffer_Release(&segs);
    return NULL;
  }
  size_t nseg = (size_t)segs.len / (2 * sizeof(size_t));
  ac_result_t r;
  Py_BEGIN_ALLOW_THREADS r = ac_sumsq_segments(v.dt, v.data, v.n, (const size_t *)segs.buf, nseg, scale, &ex, &ro, &nf);
  Py_END_ALLOW_THREADS pyac_view_release(&v);
  PyBuffer_Release(&segs);
  if (r != AC_OK) return pyac_raise(m, r);
  return Py_BuildValue("(ddO)", ex, ro, nf ? Py_True : Py_False);
}

static PyObject *py_nonfinite(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  pyac_view v;
  int found = 0;
  if (!pyac_nargs_ok("nonfinite", n, 1)) return NULL;
  if (pyac_view_from(m, a[0], PYAC_READ, PYAC_ON_CPU, "tensor", &v) < 0) return NULL;
  ac_result_t r;
  Py_BEGIN_ALLOW_THREADS r = ac_nonfinite(v.dt, v.data, v.n, &found);
  Py_END_ALLOW_THREADS pyac_view_release(&v);
  if (r != AC_OK) return pyac_raise(m, r);
  return PyBool_FromLong(found);
}

static PyObject *py_scale_stats_(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  float f;
  pyac_view v;
  ac_stats_t s;
  if (!pyac_nargs_ok("scale_stats_", n, 2) || get_float(a[1], "factor", &f) < 0) return NULL;
  if (pyac_view_from(m, a[0], PYAC_WRITE, PYAC_ON_CPU, "tensor", &v) < 0) return NULL;
  ac_result_t r;
  Py_BEGIN_ALLOW_THREADS r = ac_scale_stats(v.dt, v.data, v.n, f, &s);
  Py_END_ALLOW_THREADS pyac_view_release(&v);
  if (r != AC_OK) return pyac_raise(m, r);
  return stats_tuple(&s);
}

/* Fetches dst and src views; checks equal element counts. */
static int cast_views(PyObject *m, PyObject *const *a, int where, pyac_view *dst, pyac_view *src) {
  if (pyac_view_from(m, a[0], PYAC_WRITE, where, "dst", dst) < 0) return -1;
  if (pyac_view_from(m, a[1], PYAC_READ, where, "src", src) < 0) {
    pyac_view_release(dst);
    return -1;
  }
  if (dst->n != src->n) {
    PyErr_Format(PyExc_ValueError, "cast_: dst has %zu elements but src has %zu", dst->n, src->n);
    pyac_view_release(dst);
    pyac_view_release(src);
    return -1;
  }
  return 0;
}

static PyObject *py_cast_(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  pyac_view d, s;
  if (!pyac_nargs_ok("cast_", n, 2) || cast_views(m, a, PYAC_ON_CPU, &d, &s) < 0) return NULL;
  ac_result_t r;
  Py_BEGIN_ALLOW_THREADS r = ac_cast(s.dt, s.data, d.dt, d.data, d.n);
  Py_END_ALLOW_THREADS pyac_view_release(&d);
  pyac_view_release(&s);
  if (r != AC_OK) return pyac_raise(m, r);
  Py_RETURN_NONE;
}

static PyObject *py_set_num_threads(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  if (!pyac_nargs_ok("set_num_threads", n, 1)) return NULL;
  long k = PyLong_AsLong(a[0]);
  if (k == -1 && PyErr_Occurred()) return NULL;
  if (k < 1 || k > 1 << 20) {
    PyErr_Format(PyExc_ValueError, "set_num_threads: n must be between 1 and %d, got %ld", 1 << 20, k);
    return NULL;
  }
  ac_result_t r = ac_pool_set_threads((int)k);
  if (r != AC_OK) return pyac_raise(m, r);
  Py_RETURN_NONE;
}

static PyObject *py_get_num_threads(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  (void)m, (void)a;
  if (!pyac_nargs_ok("get_num_threads", n, 0)) return NULL;
  return PyLong_FromLong(ac_pool_get_threads());
}

static PyObject *py_pool_backend(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  (void)m, (void)a;
  if (!pyac_nargs_ok("pool_backend", n, 0)) return NULL;
  return PyUnicode_FromString(ac_pool_backend());
}

static PyObject *py_set_pool_backend(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  if (!pyac_nargs_ok("set_pool_backend", n, 1)) return NULL;
  const char *name = PyUnicode_AsUTF8(a[0]);
  if (!name) return NULL;
  ac_result_t r = ac_pool_set_backend(name);
  if (r != AC_OK) return pyac_raise(m, r);
  Py_RETURN_NONE;
}

static PyObject *py_kernel_isa(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  (void)m, (void)a;
  if (!pyac_nargs_ok("kernel_isa", n, 0)) return NULL;
  return PyUnicode_FromString(ac_kernels_isa());
}

static PyObject *py_set_kernel_isa(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  if (!pyac_nargs_ok("set_kernel_isa", n, 1)) return NULL;
  const char *name = PyUnicode_AsUTF8(a[0]);
  if (!name) return NULL;
  ac_result_t r = ac_kernels_set_isa(name);
  if (r != AC_OK) return pyac_raise(m, r);
  Py_RETURN_NONE;
}

static PyObject *py_cuda_device_count(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  (void)a;
  int c = 0;
  if (!pyac_nargs_ok("cuda_device_count", n, 0)) return NULL;
  ac_result_t r = ac_cuda_device_count(&c);
  if (r != AC_OK) return pyac_raise(m, r);
  return PyLong_FromLong(c);
}

/* ---- CUDA: results stay in device tensors; `stream` is a cudaStream_t as an int ---------- */

/* A small float32 device tensor used as an output/input scalar slot, on the device of `on`
 * (the tensor the kernel works on). */
static int device_f32(PyObject *m, PyObject *o, int access, size_t min_n, const char *arg, const char *fn,
                      const pyac_view *on, pyac_view *v) {
  if (pyac_view_from(m, o, access, PYAC_ON_CUDA, arg, v) < 0) return -1;
  if (v->dt != AC_F32 || v->n < min_n) {
    PyErr_Format(PyExc_TypeError, "%s must be a float32 CUDA tensor of at least %zu elements", arg, min_n);
    pyac_view_release(v);
    return -1;
  }
  if (pyac_same_device(fn, on, "tensor", v, arg) < 0) {
    pyac_view_release(v);
    return -1;
  }
  return 0;
}

/* Runs a launch with the device of `on` current (a kernel can only go to a stream of the
 * current device; the caller's current device is restored). */
#define ON_DEVICE(on, r, launch)                                      \
  do {                                                                \
    int prev_;                                                        \
    (r) = ac_cuda_device_enter((on)->device.device_id, &prev_);       \
    if ((r) == AC_OK) {                                               \
      (r) = (launch);                                                 \
      ac_cuda_device_leave(prev_);                                    \
    }                                                                 \
  } while (0)

static PyObject *py_cuda_stats_(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  pyac_view v, out;
  void *stream;
  if (!pyac_nargs_ok("cuda_stats_", n, 3) || pyac_stream(a[2], 0, &stream) < 0) return NULL;
  if (pyac_view_from(m, a[0], PYAC_READ, PYAC_ON_CUDA, "tensor", &v) < 0) return NULL;
  if (device_f32(m, a[1], PYAC_WRITE, 3, "out", "cuda_stats_", &v, &out) < 0) {
    pyac_view_release(&v);
    return NULL;
  }
  ac_result_t r;
  ON_DEVICE(&v, r, ac_cuda_stats(v.dt, v.data, v.n, out.data, stream));
  pyac_view_release(&v);
  pyac_view_release(&out);
  if (r != AC_OK) return pyac_raise(m, r);
  Py_RETURN_NONE;
}

static PyObject *py_cuda_scale_(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  pyac_view v, df = {0};
  float f;
  void *stream;
  if (!pyac_nargs_ok("cuda_scale_", n, 4) || get_float(a[1], "factor", &f) < 0 || pyac_stream(a[3], 0, &stream) < 0)
    return NULL;
  if (pyac_view_from(m, a[0], PYAC_WRITE, PYAC_ON_CUDA, "tensor", &v) < 0) return NULL;
  if (a[2] != Py_None && device_f32(m, a[2], PYAC_READ, 1, "dev_factor", "cuda_scale_", &v, &df) < 0) {
    pyac_view_release(&v);
    return NULL;
  }
  ac_result_t r;
  ON_DEVICE(&v, r, ac_cuda_scale(v.dt, v.data, v.n, f, df.data, stream));
  pyac_view_release(&v);
  pyac_view_release(&df);
  if (r != AC_OK) return pyac_raise(m, r);
  Py_RETURN_NONE;
}

static PyObject *py_cuda_unscale_check_(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  static const char fn[] = "cuda_unscale_check_";
  pyac_view v, inv, found, sq = {0};
  void *stream;
  if (!pyac_nargs_ok(fn, n, 5) || pyac_stream(a[4], 0, &stream) < 0) return NULL;
  if (pyac_view_from(m, a[0], PYAC_WRITE, PYAC_ON_CUDA, "tensor", &v) < 0) return NULL;
  if (device_f32(m, a[1], PYAC_READ, 1, "inv_scale", fn, &v, &inv) < 0) goto fail_v;
  if (device_f32(m, a[2], PYAC_WRITE, 1, "found_inf", fn, &v, &found) < 0) goto fail_inv;
  if (a[3] != Py_None && device_f32(m, a[3], PYAC_WRITE, 1, "sumsq", fn, &v, &sq) < 0) goto fail_found;
  ac_result_t r;
  ON_DEVICE(&v, r, ac_cuda_unscale_check(v.dt, v.data, v.n, inv.data, found.data, sq.data, stream));
  pyac_view_release(&sq);
  pyac_view_release(&found);
  pyac_view_release(&inv);
  pyac_view_release(&v);
  if (r != AC_OK) return pyac_raise(m, r);
  Py_RETURN_NONE;
fail_found:
  pyac_view_release(&found);
fail_inv:
  pyac_view_release(&inv);
fail_v:
  pyac_view_release(&v);
  return NULL;
}

static PyObject *py_cuda_cast_(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  pyac_view d, s;
  void *stream;
  if (!pyac_nargs_ok("cuda_cast_", n, 3) || pyac_stream(a[2], 0, &stream) < 0) return NULL;
  if (cast_views(m, a, PYAC_ON_CUDA, &d, &s) < 0) return NULL;
  ac_result_t r = AC_OK;
  if (pyac_same_device("cuda_cast_", &d, "dst", &s, "src") == 0)
    ON_DEVICE(&d, r, ac_cuda_cast(s.dt, s.data, d.dt, d.data, d.n, stream));
  pyac_view_release(&d);
  pyac_view_release(&s);
  if (PyErr_Occurred()) return NULL;
  if (r != AC_OK) return pyac_raise(m, r);
  Py_RETURN_NONE;
}

PyMethodDef pyac_kernel_methods[] = {
    PYAC_FAST("scale_", py_scale_, "scale_(tensor, factor): tensor *= factor in place (CPU)."),
    PYAC_FAST("stats", py_stats, "stats(tensor) -> (sum_of_squares, max_abs, has_nonfinite) (CPU)."),
    PYAC_FAST("sumsq", py_sumsq,
         "sumsq(tensor) -> (sum_of_squares, has_nonfinite): the fast norm pass (fp32 blocks, ~1e-7 relative) (CPU)."),
    PYAC_FAST("sumsq_segments", py_sumsq_segments,
         "sumsq_segments(tensor, segs, scale) -> (sum_of_squares, sum_of_rounded_norms_squared, has_nonfinite) "
         "over the (offset, length) pairs in segs (array('Q')): each segment's norm times scale rounded to the "
         "tensor's dtype, as torch's clip_grad_norm_ takes per-tensor norms of unscaled gradients (CPU)."),
    PYAC_FAST("nonfinite", py_nonfinite, "nonfinite(tensor) -> True if any element is NaN or +-Inf (CPU)."),
    PYAC_FAST("scale_stats_", py_scale_stats_,
         "scale_stats_(tensor, factor) -> stats of tensor after tensor *= factor, in one pass (CPU)."),
    PYAC_FAST("cast_", py_cast_, "cast_(dst, src): dst[:] = src converted to dst's dtype (CPU)."),
    PYAC_FAST("set_num_threads", py_set_num_threads, "set_num_threads(n): threads used by the CPU kernels."),
    PYAC_FAST("get_num_threads", py_get_num_threads, "get_num_threads() -> threads used by the CPU kernels."),
    PYAC_FAST("pool_backend", py_pool_backend, "pool_backend() -> 'openmp' (torch's team) or 'pthread'."),
    PYAC_FAST("set_pool_backend", py_set_pool_backend, "set_pool_backend('auto'|'pthread'|'openmp')."),
    PYAC_FAST("kernel_isa", py_kernel_isa, "kernel_isa() -> 'avx2' or 'scalar'."),
    PYAC_FAST("set_kernel_isa", py_set_kernel_isa, "set_kernel_isa(name): force 'avx2' or 'scalar' (tests)."),
    PYAC_FAST("cuda_device_count", py_cuda_device_count, "cuda_device_count() -> usable CUDA devices (0 if none)."),
    PYAC_FAST("cuda_stats_", py_cuda_stats_,
         "cuda_stats_(tensor, out, stream): out[0] += sumsq, out[1] = max(out[1], maxabs), out[2] = 1 if non-finite."),
    PYAC_FAST("cuda_scale_", py_cuda_scale_,
         "cuda_scale_(tensor, factor, dev_factor_or_None, stream): tensor *= factor * dev_factor."),
    PYAC_FAST("cuda_unscale_check_", py_cuda_unscale_check_,
         "cuda_unscale_check_(tensor, inv_scale, found_inf, sumsq_or_None, stream): GradScaler's unscale."),
    PYAC_FAST("cuda_cast_", py_cuda_cast_, "cuda_cast_(dst, src, stream): dtype conversion on the device."),
    {NULL, NULL, 0, NULL},
};

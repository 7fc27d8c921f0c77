/* adam_py.c — Python entry points of the two-pass Adam update (ac/adam.h): take the lists of
 * tensors by DLPack, check them, release the GIL around the work. No algorithm here. */
#include "pyac.h"

#include <stdlib.h>

#include "ac/adam.h"

#define CONSTS_PER_PARAM 7 /* decay, lerp_w, beta2, 1 - beta2, bias2_sqrt, eps, neg_step */

enum slot { S_PARAM, S_GRAD, S_AVG, S_SQ, S_ROOT };
static const char *slot_names[] = {"param", "grad", "exp_avg", "exp_avg_sq", "root"};

typedef struct {
  const char *fn;
  int nlists;
  enum slot slots[4];
  int access[4];
  ac_result_t (*run)(const ac_adam_param_t *, size_t, int);
} spec_t;

static const spec_t MOMENTS = {"adam_moments", 4, {S_PARAM, S_GRAD, S_AVG, S_SQ},
                               {PYAC_READ, PYAC_READ, PYAC_WRITE, PYAC_WRITE}, ac_adam_moments};
static const spec_t APPLY = {"adam_apply", 3, {S_PARAM, S_AVG, S_ROOT}, {PYAC_WRITE, PYAC_READ, PYAC_READ},
                             ac_adam_apply};

static const spec_t FUSED = {"adam_fused", 4, {S_PARAM, S_GRAD, S_AVG, S_SQ},
                             {PYAC_WRITE, PYAC_READ, PYAC_WRITE, PYAC_WRITE}, ac_adam_fused};

static void set_slot(ac_adam_param_t *q, enum slot s, void *data) {
  switch (s) {
  case S_PARAM: q->param = data; break;
  case S_GRAD: q->grad = data; break;
  case S_AVG: q->exp_avg = data; break;
  case S_SQ: q->exp_avg_sq = data; break;
  case S_ROOT: q->root = data; break;
  }
}

static int get_consts(const char *fn, PyObject *o, Py_ssize_t count, Py_buffer *b) {
  if (PyObject_GetBuffer(o, b, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
  const char *fmt = b->format ? b->format : "B";
  if (*fmt == '@' || *fmt == '=') fmt++;
  if (b->itemsize != 4 || fmt[0] != 'f' || fmt[1] != '\0' ||
      b->len != (Py_ssize_t)(count * CONSTS_PER_PARAM * sizeof(float))) {
    PyErr_Format(PyExc_ValueError, "%s: consts must hold %d float32 values per parameter (array('f')), got %zd "
                 "bytes of format '%s' for %zd parameters", fn, CONSTS_PER_PARAM, b->len,
                 b->format ? b->format : "B", count);
    PyBuffer_Release(b);
    return -1;
  }
  return 0;
}

/* fn(list_1, ..., list_k, consts, flags) */
static PyObject *call(PyObject *m, PyObject *const *a, Py_ssize_t n, const spec_t *sp) {
  if (!pyac_nargs_ok(sp->fn, n, sp->nlists + 2)) return NULL;
  for (int k = 0; k < sp->nlists; k++)
    if (!PyList_Check(a[k]))
      return PyErr_Format(PyExc_TypeError, "%s: argument %d (%ss) must be a list", sp->fn, k,
                          slot_names[sp->slots[k]]);
  const Py_ssize_t count = PyList_GET_SIZE(a[0]);
  for (int k = 1; k < sp->nlists; k++)
    if (PyList_GET_SIZE(a[k]) != count)
      return PyErr_Format(PyExc_ValueError, "%s: %zd params but %zd %ss", sp->fn, count, PyList_GET_SIZE(a[k]),
                          slot_names[sp->slots[k]]);
  const long flags = PyLong_AsLong(a[sp->nlists + 1]);
  if (flags == -1 && PyErr_Occurred()) return NULL;
  Py_buffer consts;
  if (get_consts(sp->fn, a[sp->nlists], count, &consts) < 0) return NULL;
  const size_t cnt = count ? (size_t)count : 1;
  ac_adam_param_t *ps = calloc(cnt, sizeof *ps);
  pyac_view *views = calloc(cnt * (size_t)sp->nlists, sizeof *views);
  Py_ssize_t nviews = 0;
  PyObject *result = NULL;
  if (!ps || !views) {
    PyErr_NoMemory();
    goto done;
  }
  const float *c = consts.buf;
  for (Py_ssize_t i = 0; i < count; i++) {
    ac_adam_param_t *q = &ps[i];
    for (int k = 0; k < sp->nlists; k++) {
      pyac_view *v = &views[nviews];
      const char *name = slot_names[sp->slots[k]];
      if (pyac_view_from(m, PyList_GET_ITEM(a[k], i), sp->access[k], PYAC_ON_CPU, name, v) < 0) goto done;
      nviews++;
      if (v->dt != AC_F32) {
        PyErr_Format(PyExc_ValueError, "%s: %s %zd is %s; the Adam kernels take float32 only", sp->fn, name, i,
                     ac_dtype_name(v->dt));
        goto done;
      }
      if (k > 0 && v->n != q->n) {
        PyErr_Format(PyExc_ValueError, "%s: %s %zd has %zu elements, its parameter %zu", sp->fn, name, i, v->n, q->n);
        goto done;
      }
      q->n = v->n;
      set_slot(q, sp->slots[k], v->data);
    }
    const float *ci = c + CONSTS_PER_PARAM * i;
    q->decay = ci[0];
    q->lerp_w = ci[1];
    q->beta2 = ci[2];
    q->one_minus_beta2 = ci[3];
    q->bias2_sqrt = ci[4];
    q->eps = ci[5];
    q->neg_step = ci[6];
  }
  ac_result_t r;
  Py_BEGIN_ALLOW_THREADS r = sp->run(ps, (size_t)count, (int)flags);
  Py_END_ALLOW_THREADS if (r != AC_OK) pyac_raise(m, r);
  else result = Py_NewRef(Py_None);
done:
  for (Py_ssize_t i = 0; i < nviews; i++) pyac_view_release(&views[i]);
  free(views);
  free(ps);
  PyBuffer_Release(&consts);
  return result;
}

static PyObject *py_adam_moments(PyObject *m, PyObject *const *a, Py_ssize_t n) { return call(m, a, n, &MOMENTS); }
static PyObject *py_adam_apply(PyObject *m, PyObject *const *a, Py_ssize_t n) { return call(m, a, n, &APPLY); }

static PyObject *py_adam_fused(PyObject *m, PyObject *const *a, Py_ssize_t n) { return call(m, a, n, &FUSED); }

static PyObject *py_adam_load_sqrt(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  if (!pyac_nargs_ok("adam_load_sqrt", n, 1)) return NULL;
  const char *path = PyUnicode_AsUTF8(a[0]);
  if (!path) return NULL;
  ac_result_t r = ac_adam_load_sqrt(path);
  if (r == AC_ERR_UNSUPPORTED) Py_RETURN_FALSE; /* no such function here: the caller keeps torch.sqrt */
  if (r != AC_OK) return pyac_raise(m, r);
  Py_RETURN_TRUE;
}

static PyObject *py_adam_unload_sqrt(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  (void)m;
  (void)a;
  if (!pyac_nargs_ok("adam_unload_sqrt", n, 0)) return NULL;
  ac_adam_unload_sqrt();
  Py_RETURN_NONE;
}

static PyObject *py_adam_sqrt(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  pyac_view src, dst;
  if (!pyac_nargs_ok("adam_sqrt", n, 2)) return NULL;
  if (pyac_view_from(m, a[0], PYAC_READ, PYAC_ON_CPU, "src", &src) < 0) return NULL;
  if (pyac_view_from(m, a[1], PYAC_WRITE, PYAC_ON_CPU, "dst", &dst) < 0) {
    pyac_view_release(&src);
    return NULL;
  }
  ac_result_t r = AC_OK;
  if (src.dt != AC_F32 || dst.dt != AC_F32 || src.n != dst.n)
    PyErr_Format(PyExc_ValueError, "adam_sqrt: src and dst must be float32 tensors of one size (%zu and %zu elements)",
                 src.n, dst.n);
  else {
    Py_BEGIN_ALLOW_THREADS r = ac_adam_sqrt(src.data, dst.data, src.n);
    Py_END_ALLOW_THREADS
  }
  pyac_view_release(&src);
  pyac_view_release(&dst);
  if (PyErr_Occurred()) return NULL;
  if (r != AC_OK) return pyac_raise(m, r);
  Py_RETURN_NONE;
}

static PyObject *py_adam_denormals_flushed(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  (void)m;
  (void)a;
  if (!pyac_nargs_ok("adam_denormals_flushed", n, 0)) return NULL;
  return PyBool_FromLong(ac_adam_denormals_flushed());
}

static PyObject *py_adam_isa(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  (void)m;
  (void)a;
  if (!pyac_nargs_ok("adam_isa", n, 0)) return NULL;
  return PyUnicode_FromString(ac_adam_isa());
}

PyMethodDef pyac_adam_methods[] = {
    PYAC_FAST("adam_moments", py_adam_moments,
              "adam_moments(params, grads, exp_avgs, exp_avg_sqs, consts, flags): torch's Adam/AdamW moment updates "
              "of float32 CPU tensors in one pass (accelerate_c/fused_adam.py builds the arguments)."),
    PYAC_FAST("adam_apply", py_adam_apply,
              "adam_apply(params, exp_avgs, roots, consts, flags): torch's Adam/AdamW parameter update from "
              "roots = torch.sqrt(exp_avg_sq), in one pass."),
    PYAC_FAST("adam_fused", py_adam_fused,
              "adam_fused(params, grads, exp_avgs, exp_avg_sqs, consts, flags): the moments, torch's square root and "
              "the parameters in one pass (after adam_load_sqrt)."),
    PYAC_FAST("adam_load_sqrt", py_adam_load_sqrt,
              "adam_load_sqrt(path) -> bool: finds torch's square root (MKL's vsSqrt) in the loaded library at path."),
    PYAC_FAST("adam_unload_sqrt", py_adam_unload_sqrt, "adam_unload_sqrt(): forgets it (tests)."),
    PYAC_FAST("adam_sqrt", py_adam_sqrt, "adam_sqrt(src, dst): dst = that square root of src (float32, CPU)."),
    PYAC_FAST("adam_denormals_flushed", py_adam_denormals_flushed,
              "adam_denormals_flushed() -> True when this thread flushes denormals (torch.set_flush_denormal)."),
    PYAC_FAST("adam_isa", py_adam_isa, "adam_isa() -> 'avx2' or 'scalar': the code the Adam kernels run."),
    {NULL, NULL, 0, NULL},
};

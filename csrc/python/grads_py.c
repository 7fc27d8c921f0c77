/* grads_py.c — host memory and per-step bookkeeping around the flat gradient buffers: which
 * parameters' `.grad` still is their view of the buffer (a walk over every parameter at every
 * step, where a Python loop costs ~1 us per parameter) and huge-page advice for the buffers. */
#define _GNU_SOURCE /* MADV_HUGEPAGE */
#include "pyac.h"

#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

/* grad_views(params, views, ptrs, dtype, device_index) -> list of indices, or None.
 *
 * None: the group is broken (a parameter was cast or moved after prepare(): its dtype is not
 * `dtype`, or it is not on the group's device: the CPU for device_index -1 (p.is_cpu), else CUDA
 * device `device_index` (p.is_cuda and p.get_device()), or a `.grad` that still is
 * its view has had its storage swapped underneath, as module._apply does with
 * `param.grad.data = ...`). Otherwise: the indices i whose params[i].grad is not views[i]
 * (None or an assigned tensor), which the caller resyncs; an empty list is the common case. */
enum { GV_VIEW = 0, GV_LOOSE = 1, GV_BROKEN = 2 };

/* One parameter: GV_VIEW (its .grad is its view, intact), GV_LOOSE (.grad is None or another
 * tensor), GV_BROKEN (cast or moved, see grad_views), or -1 with an exception set. */
/* The attribute names the walk looks up, interned once (they live as long as the process). */
static PyObject *s_grad, *s_dtype, *s_get_device, *s_data_ptr, *s_is_cuda, *s_is_cpu;

static int intern_names(void) {
  if (s_is_cpu) return 0;
  PyObject **slots[] = {&s_grad, &s_dtype, &s_get_device, &s_data_ptr, &s_is_cuda, &s_is_cpu};
  const char *names[] = {"grad", "dtype", "get_device", "data_ptr", "is_cuda", "is_cpu"};
  for (int k = 0; k < 6; k++)
    if (!*slots[k] && !(*slots[k] = PyUnicode_InternFromString(names[k]))) return -1;
  return 0;
}

/* 1 when obj.name is true, 0 when false, -1 with an exception set */
static int attr_is_true(PyObject *obj, PyObject *name) {
  PyObject *v = PyObject_GetAttr(obj, name);
  if (!v) return -1;
  int t = PyObject_IsTrue(v);
  Py_DECREF(v);
  return t;
}

static int grad_view_state(PyObject *p, PyObject *v, PyObject *ptr0, PyObject *dtype, long dev) {
  PyObject *dt = PyObject_GetAttr(p, s_dtype);
  if (!dt) return -1;
  int same_dtype = dt == dtype;
  Py_DECREF(dt);
  if (!same_dtype) return GV_BROKEN;
  /* the device type first (is_cpu for a CPU group, which a meta or other device fails too;
   * is_cuda for a CUDA one, since get_device() gives 0 for device 0 of any accelerator) */
  int on_type = attr_is_true(p, dev < 0 ? s_is_cpu : s_is_cuda);
  if (on_type <= 0) return on_type < 0 ? -1 : GV_BROKEN;
  if (dev >= 0) {
    PyObject *d = PyObject_CallMethodNoArgs(p, s_get_device);
    if (!d) return -1;
    long pd = PyLong_AsLong(d);
    Py_DECREF(d);
    if (pd == -1 && PyErr_Occurred()) return -1;
    if (pd != dev) return GV_BROKEN;
  }
  PyObject *g = PyObject_GetAttr(p, s_grad);
  if (!g) return -1;
  int is_view = g == v;
  Py_DECREF(g);
  if (!is_view) return GV_LOOSE;
  PyObject *ptr = PyObject_CallMethodNoArgs(v, s_data_ptr);
  if (!ptr) return -1;
  int moved = PyObject_RichCompareBool(ptr, ptr0, Py_NE);
  Py_DECREF(ptr);
  if (moved < 0) return -1;
  return moved ? GV_BROKEN : GV_VIEW;
}

static PyObject *py_grad_views(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
  (void)mod;
  if (n != 5) {
    PyErr_Format(PyExc_TypeError, "grad_views(params, views, ptrs, dtype, device_index) takes 5 arguments (%zd given)", n);
    return NULL;
  }
  PyObject *params = a[0], *views = a[1], *ptrs = a[2], *dtype = a[3];
  if (!PyList_Check(params) || !PyList_Check(views) || !PyList_Check(ptrs)) {
    PyErr_SetString(PyExc_TypeError, "grad_views: params, views and ptrs must be lists");
    return NULL;
  }
  Py_ssize_t np = PyList_GET_SIZE(params);
  if (PyList_GET_SIZE(views) != np || PyList_GET_SIZE(ptrs) != np) {
    PyErr_Format(PyExc_ValueError, "grad_views: %zd params but %zd views and %zd pointers", np,
                 PyList_GET_SIZE(views), PyList_GET_SIZE(ptrs));
    return NULL;
  }
  long dev = PyLong_AsLong(a[4]);
  if (dev == -1 && PyErr_Occurred()) return NULL;
  PyObject *loose = PyList_New(0);
  if (!loose) return NULL;
  PyObject *result = NULL;
  if (intern_names() < 0) goto done;
  for (Py_ssize_t i = 0; i < np; i++) {
    /* owned for the iteration: the calls below may run Python code (a tensor subclass's
     * __torch_function__) that could change the lists */
    if (PyList_GET_SIZE(params) != np || PyList_GET_SIZE(views) != np || PyList_GET_SIZE(ptrs) != np) {
      PyErr_SetString(PyExc_RuntimeError, "grad_views: the parameter lists changed during the walk");
      goto done;
    }
    PyObject *p = Py_NewRef(PyList_GET_ITEM(params, i)), *v = Py_NewRef(PyList_GET_ITEM(views, i));
    PyObject *ptr0 = Py_NewRef(PyList_GET_ITEM(ptrs, i));
    int st = grad_view_state(p, v, ptr0, dtype, dev);
    Py_DECREF(p);
    Py_DECREF(v);
    Py_DECREF(ptr0);
    if (st < 0) goto done;
    if (st == GV_BROKEN) {
      result = Py_NewRef(Py_None);
      goto done;
    }
    if (st == GV_LOOSE) {
      PyObject *idx = PyLong_FromSsize_t(i);
      if (!idx || PyList_Append(loose, idx) < 0) {
        Py_XDECREF(idx);
        goto done;
      }
      Py_DECREF(idx);
    }
  }
  result = loose;
  loose = NULL;
done:
  Py_XDECREF(loose);
  return result;
}

/* advise_hugepages(buffer) -> bool: asks the kernel to back the whole 2 MiB pages inside a CPU
 * Buffer's memory with transparent huge pages (madvise MADV_HUGEPAGE). Given before the memory
 * is first touched, every later fault maps 2 MiB at once: the whole-buffer passes (backward's
 * copy-in, unscale/norm/clip, the optimizer's reads) take 512x fewer TLB misses. A hint: False
 * where the kernel has no THP or refuses (the buffer works the same, only slower). */
static PyObject *py_advise_hugepages(PyObject *mod, PyObject *arg) {
  pyac_view v;
  if (pyac_view_from(mod, arg, PYAC_WRITE, PYAC_ON_CPU, "buffer", &v) < 0) return NULL;
  int ok = 0;
#ifdef MADV_HUGEPAGE
  const uintptr_t huge = (uintptr_t)2 << 20;
  uintptr_t lo = ((uintptr_t)v.data + huge - 1) & ~(huge - 1);
  uintptr_t hi = ((uintptr_t)v.data + v.n * ac_dtype_size(v.dt)) & ~(huge - 1);
  if (hi > lo) ok = madvise((void *)lo, hi - lo, MADV_HUGEPAGE) == 0;
#endif
  pyac_view_release(&v);
  return PyBool_FromLong(ok);
}

PyMethodDef pyac_grads_methods[] = {
    {"grad_views", (PyCFunction)(void (*)(void))py_grad_views, METH_FASTCALL,
     "grad_views(params, views, ptrs, dtype, device_index) -> indices whose .grad is not its view, "
     "or None if a parameter was cast or moved."},
    {"advise_hugepages", py_advise_hugepages, METH_O,
     "advise_hugepages(buffer) -> bool: madvise(MADV_HUGEPAGE) on the whole 2 MiB pages of a CPU buffer."},
    {NULL, NULL, 0, NULL},
};

/* malloc_py.c — glibc's malloc settings for the whole process, applied only when the user asks
 * (accelerate_c/host_malloc.py decides; docs/performance.md says what they buy and cost). */
#include "pyac.h"

#include <limits.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

/* tune_host_malloc(mmap_threshold, trim_threshold, top_pad) -> bool: mallopt() of the three.
 *
 * A training step allocates and frees the same activations and temporaries every step. With
 * glibc's defaults, blocks above the (dynamic) mmap threshold are mmapped and unmapped, and the
 * top of the heap is trimmed once more than the trim threshold is free, so each step faults the
 * same memory in again, 4 KiB at a time, the kernel zeroing every page. Blocks up to
 * mmap_threshold served from the heap, up to trim_threshold of free heap top kept, the heap
 * grown top_pad at a time: the step reuses its memory. Setting either threshold also turns
 * glibc's dynamic threshold off, as the MALLOC_*_ variables do.
 *
 * True: all three set. False: not glibc (musl, macOS), nothing changed. ValueError: a value
 * out of int range, or one glibc refused (M_MMAP_THRESHOLD above HEAP_MAX_SIZE / 2, 32 MiB on
 * 64-bit); the settings before it in the list may then be applied already. */
static PyObject *py_tune_host_malloc(PyObject *mod, PyObject *args) {
  (void)mod;
  Py_ssize_t v[3];
  if (!PyArg_ParseTuple(args, "nnn:tune_host_malloc", &v[0], &v[1], &v[2])) return NULL;
  static const char *names[3] = {"mmap_threshold", "trim_threshold", "top_pad"};
  for (int i = 0; i < 3; i++) {
    if (v[i] < 0 || v[i] > INT_MAX) {
      PyErr_Format(PyExc_ValueError, "tune_host_malloc: %s=%zd is out of range [0, %d]", names[i], v[i], INT_MAX);
      return NULL;
    }
  }
#ifdef __GLIBC__
  static const int params[3] = {M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, M_TOP_PAD};
  for (int i = 0; i < 3; i++) {
    if (mallopt(params[i], (int)v[i]) != 1) {
      PyErr_Format(PyExc_ValueError, "tune_host_malloc: glibc refused %s=%zd", names[i], v[i]);
      return NULL;
    }
  }
  Py_RETURN_TRUE;
#else
  Py_RETURN_FALSE;
#endif
}

PyMethodDef pyac_malloc_methods[] = {
    {"tune_host_malloc", py_tune_host_malloc, METH_VARARGS,
     "tune_host_malloc(mmap_threshold, trim_threshold, top_pad) -> bool: glibc's mallopt for the whole "
     "process; False where the C library is not glibc."},
    {NULL, NULL, 0, NULL},
};

/* durable_py.c — the durable-write protocol (ac/durable.h) for Python: accelerate_c.durable uses
 * these for every file it publishes, so Python and the C safetensors writer share one
 * implementation of temp name, fsync, rename and directory fsync. */
#include "pyac.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "ac/durable.h"

static int nargs(const char *sig, Py_ssize_t n, Py_ssize_t want) {
  if (n == want) return 0;
  PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", sig, want, n);
  return -1;
}

static PyObject *py_durable_open(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  if (nargs("durable_open(path)", n, 1) < 0) return NULL;
  PyObject *path;
  if (!PyUnicode_FSConverter(a[0], &path)) return NULL;
  char *tmp = NULL;
  int fd = -1;
  ac_result_t r;
  Py_BEGIN_ALLOW_THREADS r = ac_durable_open(PyBytes_AS_STRING(path), 0, &tmp, &fd);
  Py_END_ALLOW_THREADS
  Py_DECREF(path);
  if (r != AC_OK) return pyac_raise(m, r);
  PyObject *out = Py_BuildValue("(iN)", fd, PyUnicode_DecodeFSDefault(tmp));
  if (!out) ac_durable_discard(&tmp, &fd);
  free(tmp);
  return out;
}

static PyObject *py_durable_publish(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  if (nargs("durable_publish(path, tmp, fd)", n, 3) < 0) return NULL;
  long lfd = PyLong_Check(a[2]) ? PyLong_AsLong(a[2]) : -1;
  int fd = lfd >= 0 && lfd <= INT_MAX ? (int)lfd : -1;
  if (fd < 0) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "durable_publish: fd must be an open descriptor");
    return NULL;
  }
  PyObject *path = NULL, *tmpb = NULL;
  if (!PyUnicode_FSConverter(a[0], &path) || !PyUnicode_FSConverter(a[1], &tmpb)) {
    Py_XDECREF(path);
    return NULL;
  }
  char *tmp = strdup(PyBytes_AS_STRING(tmpb));
  Py_DECREF(tmpb);
  if (!tmp) {
    Py_DECREF(path);
    return PyErr_NoMemory();
  }
  ac_result_t r;
  /* the descriptor is the caller's until here and ours from now on: closed whatever happens */
  Py_BEGIN_ALLOW_THREADS r = ac_durable_publish(PyBytes_AS_STRING(path), &tmp, &fd);
  ac_durable_discard(&tmp, &fd);
  Py_END_ALLOW_THREADS
  Py_DECREF(path);
  if (r != AC_OK) return pyac_raise(m, r);
  Py_RETURN_NONE;
}

static PyObject *py_durable_write(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  if (nargs("durable_write(path, data)", n, 2) < 0) return NULL;
  PyObject *path;
  if (!PyUnicode_FSConverter(a[0], &path)) return NULL;
  Py_buffer view;
  if (PyObject_GetBuffer(a[1], &view, PyBUF_SIMPLE) < 0) {
    Py_DECREF(path);
    return NULL;
  }
  ac_result_t r;
  Py_BEGIN_ALLOW_THREADS r = ac_durable_write(PyBytes_AS_STRING(path), view.buf, (size_t)view.len);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&view);
  Py_DECREF(path);
  if (r != AC_OK) return pyac_raise(m, r);
  Py_RETURN_NONE;
}

static PyObject *py_fsync_dir(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  if (nargs("fsync_dir(path)", n, 1) < 0) return NULL;
  PyObject *path;
  if (!PyUnicode_FSConverter(a[0], &path)) return NULL;
  ac_result_t r;
  Py_BEGIN_ALLOW_THREADS r = ac_fsync_dir(PyBytes_AS_STRING(path));
  Py_END_ALLOW_THREADS
  Py_DECREF(path);
  if (r != AC_OK) return pyac_raise(m, r);
  Py_RETURN_NONE;
}

#define FAST(name, fn, doc) {name, (PyCFunction)(void (*)(void))(fn), METH_FASTCALL, doc}

PyMethodDef pyac_durable_methods[] = {
    FAST("durable_open", py_durable_open,
         "durable_open(path) -> (fd, tmp): a fresh hidden temporary file next to path (O_EXCL, a name unique per "
         "process and call), open for writing."),
    FAST("durable_publish", py_durable_publish,
         "durable_publish(path, tmp, fd): fsync and close fd, rename tmp over path, fsync the directory. The "
         "descriptor is closed whatever happens; on failure tmp is removed (unless it was already renamed)."),
    FAST("durable_write", py_durable_write,
         "durable_write(path, data): durable_open, write the bytes-like data, durable_publish (GIL released)."),
    FAST("fsync_dir", py_fsync_dir, "fsync_dir(path): fsync a directory (a no-op where the file system cannot)."),
    {NULL, NULL, 0, NULL},
};

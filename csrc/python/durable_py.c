/* durable_py.c — the durable-write protocol (ac/durable.h) for Python: accelerate_c.durable uses
 * these for every file it publishes, so Python and the C safetensors writer share one
 * implementation of temp name, fsync, rename and directory fsync. */
#include "pyac.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "ac/durable.h"

static PyObject *py_durable_open(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  if (!pyac_nargs_ok("durable_open", n, 1)) return NULL;
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
  if (!pyac_nargs_ok("durable_publish", n, 3)) return NULL;
  long lfd = PyLong_Check(a[2]) ? PyLong_AsLong(a[2]) : -1;
  int fd = lfd >= 0 && lfd <= INT_MAX ? (int)lfd : -1;
  if (fd < 0) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "durable_publish: fd must be an open descriptor");
    return NULL;
  }
  /* the descriptor is ours from here on: closed, and tmp removed, on every failure below */
  PyObject *path = NULL, *tmpb = NULL;
  char *tmp = NULL;
  if (PyUnicode_FSConverter(a[1], &tmpb)) {
    tmp = strdup(PyBytes_AS_STRING(tmpb));
    Py_DECREF(tmpb);
    if (!tmp) PyErr_NoMemory();
  }
  if (!tmp || !PyUnicode_FSConverter(a[0], &path)) {
    ac_durable_discard(&tmp, &fd);
    return NULL;
  }
  ac_result_t r;
  Py_BEGIN_ALLOW_THREADS r = ac_durable_publish(PyBytes_AS_STRING(path), &tmp, &fd);
  ac_durable_discard(&tmp, &fd);
  Py_END_ALLOW_THREADS
  Py_DECREF(path);
  if (r != AC_OK) return pyac_raise(m, r);
  Py_RETURN_NONE;
}

static PyObject *py_durable_write(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  if (!pyac_nargs_ok("durable_write", n, 2)) return NULL;
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
  if (!pyac_nargs_ok("fsync_dir", n, 1)) return NULL;
  PyObject *path;
  if (!PyUnicode_FSConverter(a[0], &path)) return NULL;
  ac_result_t r;
  Py_BEGIN_ALLOW_THREADS r = ac_fsync_dir(PyBytes_AS_STRING(path));
  Py_END_ALLOW_THREADS
  Py_DECREF(path);
  if (r != AC_OK) return pyac_raise(m, r);
  Py_RETURN_NONE;
}

PyMethodDef pyac_durable_methods[] = {
    PYAC_FAST("durable_open", py_durable_open,
         "durable_open(path) -> (fd, tmp): a fresh hidden temporary file next to path (O_EXCL, a name unique per "
         "process and call), open for writing."),
    PYAC_FAST("durable_publish", py_durable_publish,
         "durable_publish(path, tmp, fd): fsync and close fd, rename tmp over path, fsync the directory. The "
         "descriptor is closed whatever happens; on failure tmp is removed (unless it was already renamed)."),
    PYAC_FAST("durable_write", py_durable_write,
         "durable_write(path, data): durable_open, write the bytes-like data, durable_publish (GIL released)."),
    PYAC_FAST("fsync_dir", py_fsync_dir, "fsync_dir(path): fsync a directory (a no-op where the file system cannot)."),
    {NULL, NULL, 0, NULL},
};

/* scaler_py.c — LossScaler: the C scale state machine as a Python type. */
#include "pyac.h"

#include "ac/scaler.h"

typedef struct {
  PyObject_HEAD
  ac_scaler_t s;
} ScalerObject;

static int scaler_init(PyObject *op, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"init_scale", "growth_factor", "backoff_factor", "growth_interval", NULL};
  double init = 65536.0, growth = 2.0, backoff = 0.5;
  long long interval = 2000;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "|dddL:LossScaler", kwlist, &init, &growth, &backoff, &interval))
    return -1;
  ac_result_t r = ac_scaler_init(&((ScalerObject *)op)->s, (float)init, (float)growth, (float)backoff, interval);
  if (r != AC_OK) {
    pyac_raise(pyac_module_of(op), r);
    return -1;
  }
  return 0;
}

static PyObject *scaler_update(PyObject *op, PyObject *found_inf) {
  int f = PyObject_IsTrue(found_inf);
  if (f < 0) return NULL;
  ac_result_t r = ac_scaler_update(&((ScalerObject *)op)->s, f);
  if (r != AC_OK) return pyac_raise(pyac_module_of(op), r);
  Py_RETURN_NONE;
}

static PyObject *scaler_state(PyObject *op, PyObject *unused) {
  (void)unused;
  const ac_scaler_t *s = &((ScalerObject *)op)->s;
  /* key names are torch.amp.GradScaler.state_dict()'s, so the two are interchangeable */
  return Py_BuildValue("{s:d,s:d,s:d,s:L,s:L}", "scale", (double)s->scale, "growth_factor",
                       (double)s->growth_factor, "backoff_factor", (double)s->backoff_factor, "growth_interval",
                       (long long)s->growth_interval, "_growth_tracker", (long long)s->growth_tracker);
}

static PyObject *scaler_load(PyObject *op, PyObject *const *a, Py_ssize_t n) {
  if (n != 5) {
    PyErr_Format(PyExc_TypeError, "load() takes 5 arguments (scale, growth_factor, backoff_factor, "
                                  "growth_interval, growth_tracker), %zd given", n);
    return NULL;
  }
  double v[3];
  long long iv[2];
  for (int i = 0; i < 3; i++) {
    v[i] = PyFloat_AsDouble(a[i]);
    if (v[i] == -1.0 && PyErr_Occurred()) return NULL;
  }
  for (int i = 0; i < 2; i++) {
    iv[i] = PyLong_AsLongLong(a[3 + i]);
    if (iv[i] == -1 && PyErr_Occurred()) return NULL;
  }
  ac_result_t r = ac_scaler_load(&((ScalerObject *)op)->s, (float)v[0], (float)v[1], (float)v[2], iv[0], iv[1]);
  if (r != AC_OK) return pyac_raise(pyac_module_of(op), r);
  Py_RETURN_NONE;
}

static PyObject *scaler_get_scale(PyObject *op, void *c) {
  (void)c;
  return PyFloat_FromDouble((double)((ScalerObject *)op)->s.scale);
}

static PyObject *scaler_get_tracker(PyObject *op, void *c) {
  (void)c;
  return PyLong_FromLongLong((long long)((ScalerObject *)op)->s.growth_tracker);
}

static PyMethodDef scaler_methods[] = {
    {"update", scaler_update, METH_O, "update(found_inf): back off on overflow, grow after growth_interval clean steps."},
    {"state", scaler_state, METH_NOARGS, "state() -> dict with GradScaler's state_dict keys."},
    {"load", (PyCFunction)(void (*)(void))scaler_load, METH_FASTCALL,
     "load(scale, growth_factor, backoff_factor, growth_interval, growth_tracker): restore a state."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef scaler_getset[] = {
    {"scale", scaler_get_scale, NULL, "current loss scale", NULL},
    {"growth_tracker", scaler_get_tracker, NULL, "clean steps since the scale last changed", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot scaler_slots[] = {
    {Py_tp_init, scaler_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, pyac_plain_dealloc},
    {Py_tp_methods, scaler_methods},
    {Py_tp_getset, scaler_getset},
    {Py_tp_doc, "LossScaler(init_scale=65536, growth_factor=2, backoff_factor=0.5, growth_interval=2000)"},
    {0, NULL},
};

PyType_Spec pyac_scaler_spec = {
    .name = "accelerate_c._C.LossScaler",
    .basicsize = sizeof(ScalerObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = scaler_slots,
};

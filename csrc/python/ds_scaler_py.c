/* ds_scaler_py.c — DeepSpeedLossScaler: DeepSpeed's fp16 loss-scale rule (ac/ds_scaler.h) as a
 * Python type. Every argument comes from Python, so a value the core refuses is a ValueError
 * (pyac_raise_value); the overflow at min_loss_scale is a CoreError (AC_ERR_STATE), a RuntimeError
 * as DeepSpeed's own failure there is an Exception that ends the run. Calls are a few
 * arithmetic operations, so the GIL is kept. */
#include "pyac.h"

#include "ac/ds_scaler.h"

typedef struct {
  PyObject_HEAD
  ac_ds_scaler_t s;
} DsScalerObject;

static ac_ds_scaler_t *state_of(PyObject *op) { return &((DsScalerObject *)op)->s; }

static int ds_init(PyObject *op, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"init_scale", "scale_window",  "min_scale", "hysteresis", "consecutive_hysteresis",
                           "static",     "raise_at_min", NULL};
  double init = 0.0, min_scale = 0.0;
  long long window = 0, hysteresis = 0;
  int consecutive = 0, is_static = 0, raise_at_min = 1;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "dLdLp|$pp:DeepSpeedLossScaler", kwlist, &init, &window, &min_scale,
                                   &hysteresis, &consecutive, &is_static, &raise_at_min))
    return -1;
  ac_result_t r = ac_ds_scaler_init(state_of(op), init, (int64_t)window, min_scale, (int64_t)hysteresis, consecutive,
                                    !is_static, raise_at_min);
  if (r != AC_OK) {
    pyac_raise_value(pyac_module_of(op), r);
    return -1;
  }
  return 0;
}

static PyObject *ds_update(PyObject *op, PyObject *overflow) {
  int f = PyObject_IsTrue(overflow);
  if (f < 0) return NULL;
  ac_result_t r = ac_ds_scaler_update(state_of(op), f);
  if (r != AC_OK) return pyac_raise_value(pyac_module_of(op), r);
  Py_RETURN_NONE;
}

static PyObject *ds_state(PyObject *op, PyObject *unused) {
  (void)unused;
  const ac_ds_scaler_t *s = state_of(op);
  /* DeepSpeed's attribute names, so the keys read as its DynamicLossScaler's fields */
  return Py_BuildValue("{s:d,s:L,s:L,s:L,s:L,s:d,s:L,s:O,s:O}", "cur_scale", s->cur_scale, "cur_iter",
                       (long long)s->cur_iter, "last_overflow_iter", (long long)s->last_overflow_iter,
                       "cur_hysteresis", (long long)s->cur_hysteresis, "scale_window", (long long)s->scale_window,
                       "min_scale", s->min_scale, "delayed_shift", (long long)s->delayed_shift,
                       "consecutive_hysteresis", s->consecutive_hysteresis ? Py_True : Py_False, "dynamic",
                       s->dynamic ? Py_True : Py_False);
}

static PyObject *ds_load(PyObject *op, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"cur_scale",     "cur_iter",  "last_overflow_iter", "cur_hysteresis",
                           "scale_window",  "min_scale", "delayed_shift",      "consecutive_hysteresis",
                           "dynamic",       NULL};
  ac_ds_scaler_t from = *state_of(op); /* raise_at_min is the constructor's choice, not saved state */
  long long it = 0, last = 0, hyst = 0, window = 0, shift = 0;
  int consecutive = 0, dynamic = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "dLLLLdLpp:load", kwlist, &from.cur_scale, &it, &last, &hyst, &window,
                                   &from.min_scale, &shift, &consecutive, &dynamic))
    return NULL;
  from.cur_iter = (int64_t)it;
  from.last_overflow_iter = (int64_t)last;
  from.cur_hysteresis = (int64_t)hyst;
  from.scale_window = (int64_t)window;
  from.delayed_shift = (int64_t)shift;
  from.consecutive_hysteresis = consecutive;
  from.dynamic = dynamic;
  from.scale_factor = AC_DS_SCALE_FACTOR;
  ac_result_t r = ac_ds_scaler_load(state_of(op), &from);
  if (r != AC_OK) return pyac_raise_value(pyac_module_of(op), r);
  Py_RETURN_NONE;
}

static PyObject *ds_get_scale(PyObject *op, void *c) {
  (void)c;
  return PyFloat_FromDouble(state_of(op)->cur_scale);
}

static PyObject *ds_get_dynamic(PyObject *op, void *c) {
  (void)c;
  return PyBool_FromLong(state_of(op)->dynamic);
}

static PyObject *ds_get_raise(PyObject *op, void *c) {
  (void)c;
  return PyBool_FromLong(state_of(op)->raise_at_min);
}

static PyMethodDef ds_methods[] = {
    {"update", ds_update, METH_O,
     "update(overflow): DeepSpeed's DynamicLossScaler.update_scale; CoreError (code AC_ERR_STATE), state unchanged, "
     "on an overflow at min_scale when raise_at_min. A static scaler changes nothing."},
    {"state", ds_state, METH_NOARGS,
     "state() -> dict: cur_scale, cur_iter, last_overflow_iter, cur_hysteresis, scale_window, min_scale, "
     "delayed_shift, consecutive_hysteresis, dynamic."},
    {"load", (PyCFunction)(void (*)(void))ds_load, METH_VARARGS | METH_KEYWORDS,
     "load(cur_scale, cur_iter, last_overflow_iter, cur_hysteresis, scale_window, min_scale, delayed_shift, "
     "consecutive_hysteresis, dynamic): restore state() after checking it (ValueError naming the bad value); "
     "raise_at_min is kept."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef ds_getset[] = {
    {"scale", ds_get_scale, NULL, "current loss scale (cur_scale)", NULL},
    {"dynamic", ds_get_dynamic, NULL, "False for a static scale", NULL},
    {"raise_at_min", ds_get_raise, NULL, "whether an overflow at min_scale is an error", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot ds_slots[] = {
    {Py_tp_init, ds_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, pyac_plain_dealloc},
    {Py_tp_methods, ds_methods},
    {Py_tp_getset, ds_getset},
    {Py_tp_doc,
     "DeepSpeedLossScaler(init_scale, scale_window, min_scale, hysteresis, consecutive_hysteresis, *, static=False, "
     "raise_at_min=True)\n\nDeepSpeed's fp16 loss scale (DynamicLossScaler; with static=True its fixed LossScaler). "
     "hysteresis is DeepSpeed's delayed_shift; raise_at_min is its raise_error_at_min_scale (True in its ZeRO "
     "optimizers). The rule: csrc/include/ac/ds_scaler.h."},
    {0, NULL},
};

PyType_Spec pyac_ds_scaler_spec = {
    .name = "accelerate_c._C.DeepSpeedLossScaler",
    .basicsize = sizeof(DsScalerObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = ds_slots,
};

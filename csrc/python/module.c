/* module.c — the accelerate_c._C module: multi-phase init, module state, the one error mapper. */
#include "pyac.h"

#include "ac/cuda.h"
#include "ac/pool.h"

PyObject *pyac_raise(PyObject *module, ac_result_t r) {
  pyac_state *st = pyac_get_state(module);
  const char *msg = ac_last_error();
  PyObject *exc_args = Py_BuildValue("(s)", msg && *msg ? msg : ac_result_string(r));
  if (!exc_args) return NULL;
  PyObject *exc = PyObject_Call(st->core_error, exc_args, NULL);
  Py_DECREF(exc_args);
  if (!exc) return NULL;
  PyObject *code = PyUnicode_FromString(ac_result_string(r));
  if (code) {
    /* e.code lets callers branch on the kind of failure without parsing the text */
    if (PyObject_SetAttrString(exc, "code", code) < 0) PyErr_Clear(); /* the message matters more */
    Py_DECREF(code);
  }
  PyErr_SetObject(st->core_error, exc);
  Py_DECREF(exc);
  ac_clear_error();
  return NULL;
}

PyObject *pyac_raise_value(PyObject *module, ac_result_t r) {
  if (r != AC_ERR_INVALID_ARG) return pyac_raise(module, r);
  const char *msg = ac_last_error();
  PyObject *exc = PyObject_CallFunction(PyExc_ValueError, "s", msg && *msg ? msg : ac_result_string(r));
  ac_clear_error();
  if (!exc) return NULL;
  PyObject *code = PyUnicode_FromString(ac_result_string(r));
  if (code) {
    if (PyObject_SetAttrString(exc, "code", code) < 0) PyErr_Clear(); /* the message matters more */
    Py_DECREF(code);
  } else {
    PyErr_Clear();
  }
  PyErr_SetObject(PyExc_ValueError, exc);
  Py_DECREF(exc);
  return NULL;
}

void pyac_plain_dealloc(PyObject *op) {
  PyTypeObject *tp = Py_TYPE(op);
  tp->tp_free(op);
  Py_DECREF(tp);
}

static int module_exec(PyObject *m) {
  pyac_state *st = pyac_get_state(m);
  ac_pool_init();
  st->core_error = PyErr_NewExceptionWithDoc(
      "accelerate_c.CoreError", "An error reported by the accelerate_c C core; `code` names its kind.",
      PyExc_RuntimeError, NULL);
  if (!st->core_error || PyModule_AddObjectRef(m, "CoreError", st->core_error) < 0) return -1;
  st->buffer_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &pyac_buffer_spec, NULL);
  if (!st->buffer_type || PyModule_AddObjectRef(m, "Buffer", (PyObject *)st->buffer_type) < 0) return -1;
  PyObject *scaler = PyType_FromModuleAndSpec(m, &pyac_scaler_spec, NULL);
  if (!scaler) return -1;
  int rc = PyModule_AddObjectRef(m, "LossScaler", scaler);
  Py_DECREF(scaler);
  if (rc < 0) return -1;
  PyObject *ds_scaler = PyType_FromModuleAndSpec(m, &pyac_ds_scaler_spec, NULL);
  if (!ds_scaler) return -1;
  rc = PyModule_AddObjectRef(m, "DeepSpeedLossScaler", ds_scaler);
  Py_DECREF(ds_scaler);
  if (rc < 0) return -1;
  PyObject *reducer = PyType_FromModuleAndSpec(m, &pyac_reducer_spec, NULL);
  if (!reducer) return -1;
  rc = PyModule_AddObjectRef(m, "Reducer", reducer);
  Py_DECREF(reducer);
  if (rc < 0) return -1;
  st->hook_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &pyac_hook_spec, NULL);
  if (!st->hook_type || PyModule_AddObjectRef(m, "GradHook", (PyObject *)st->hook_type) < 0) return -1;
  PyObject *shard_plan = PyType_FromModuleAndSpec(m, &pyac_shard_plan_spec, NULL);
  if (!shard_plan) return -1;
  rc = PyModule_AddObjectRef(m, "ShardPlan", shard_plan);
  Py_DECREF(shard_plan);
  if (rc < 0) return -1;
  PyObject *shm = PyType_FromModuleAndSpec(m, &pyac_shm_comm_spec, NULL);
  if (!shm) return -1;
  rc = PyModule_AddObjectRef(m, "ShmComm", shm);
  Py_DECREF(shm);
  if (rc < 0) return -1;
  PyObject *shm_work = PyType_FromModuleAndSpec(m, &pyac_shm_work_spec, NULL);
  if (!shm_work) return -1;
  rc = PyModule_AddObjectRef(m, "ShmWork", shm_work);
  Py_DECREF(shm_work);
  if (rc < 0) return -1;
  PyObject *shm_window = PyType_FromModuleAndSpec(m, &pyac_shm_window_spec, NULL);
  if (!shm_window) return -1;
  rc = PyModule_AddObjectRef(m, "ShmWindow", shm_window);
  Py_DECREF(shm_window);
  if (rc < 0) return -1;
  if (PyModule_AddObjectRef(m, "has_cuda", ac_cuda_built() ? Py_True : Py_False) < 0) return -1;
  if (PyModule_AddStringConstant(m, "dlpack_version", "1.0") < 0) return -1;
  if (PyModule_AddFunctions(m, pyac_safetensors_methods) < 0) return -1;
  if (PyModule_AddFunctions(m, pyac_durable_methods) < 0) return -1;
  if (PyModule_AddFunctions(m, pyac_grads_methods) < 0) return -1;
  if (PyModule_AddFunctions(m, pyac_malloc_methods) < 0) return -1;
  if (PyModule_AddFunctions(m, pyac_adam_methods) < 0) return -1;
  st->comm_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &pyac_comm_spec, NULL);
  if (!st->comm_type || PyModule_AddObjectRef(m, "NcclComm", (PyObject *)st->comm_type) < 0) return -1;
  if (PyModule_AddFunctions(m, pyac_comm_methods) < 0) return -1;
  return 0;
}

static int module_traverse(PyObject *m, visitproc visit, void *arg) {
  pyac_state *st = pyac_get_state(m);
  Py_VISIT(st->core_error);
  Py_VISIT(st->buffer_type);
  Py_VISIT(st->hook_type);
  Py_VISIT(st->comm_type);
  return 0;
}

static int module_clear(PyObject *m) {
  pyac_state *st = pyac_get_state(m);
  Py_CLEAR(st->core_error);
  Py_CLEAR(st->buffer_type);
  Py_CLEAR(st->hook_type);
  Py_CLEAR(st->comm_type);
  return 0;
}

static void module_free(void *m) { module_clear((PyObject *)m); }

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "accelerate_c._C",
    .m_doc = "accelerate_c's C core: gradient kernels, loss scaling, buckets, sharding, checkpoint I/O.",
    .m_size = sizeof(pyac_state),
    .m_methods = pyac_kernel_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&module_def); }

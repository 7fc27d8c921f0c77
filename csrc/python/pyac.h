/* pyac.h (private) — what the files of the extension module share: module state, the error
 * mapper, and the DLPack consumer that turns Python objects into raw buffer views. */
#ifndef PYAC_H
#define PYAC_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "ac/ac.h"
#include "ac/dlpack.h"
#include "ac/kernels.h"

typedef struct {
  PyObject *core_error;    /* accelerate_c.CoreError (subclass of RuntimeError) */
  PyTypeObject *buffer_type; /* accelerate_c._C.Buffer */
  PyTypeObject *hook_type;   /* accelerate_c._C.GradHook (made by Reducer.hook) */
  PyTypeObject *comm_type;   /* accelerate_c._C.NcclComm */
} pyac_state;

static inline pyac_state *pyac_get_state(PyObject *module) {
  return (pyac_state *)PyModule_GetState(module);
}

/* The module that defined the type of `self` (heap types made from module specs). */
static inline PyObject *pyac_module_of(PyObject *self) { return PyType_GetModule(Py_TYPE(self)); }

/* 1 when a METH_FASTCALL function got `want` arguments, else 0 with a TypeError naming `fn`. */
static inline int pyac_nargs_ok(const char *fn, Py_ssize_t nargs, Py_ssize_t want) {
  if (nargs == want) return 1;
  PyErr_Format(PyExc_TypeError, "%s() takes %zd positional arguments (%zd given)", fn, want, nargs);
  return 0;
}

/* A METH_FASTCALL entry of a module's method table. */
#define PYAC_FAST(name, fn, doc) {name, (PyCFunction)(void (*)(void))(fn), METH_FASTCALL, doc}

/* A CUDA stream handle given as an int (torch.cuda.Stream.cuda_stream); None means the default
 * stream (NULL) where `allow_none`. Returns 0, or -1 with a TypeError. */
static inline int pyac_stream(PyObject *o, int allow_none, void **out) {
  if (allow_none && o == Py_None) {
    *out = NULL;
    return 0;
  }
  *out = PyLong_AsVoidPtr(o);
  if (!*out && PyErr_Occurred()) {
    PyErr_Format(PyExc_TypeError, "stream must be an int (torch.cuda.Stream.cuda_stream)%s, got %s",
                 allow_none ? " or None" : "", Py_TYPE(o)->tp_name);
    return -1;
  }
  return 0;
}

/* Raises CoreError carrying the core's last-error message for result `r`; returns NULL so
 * callers can `return pyac_raise(mod, r);`. The one place where ac_result_t becomes Python. */
PyObject *pyac_raise(PyObject *module, ac_result_t r);
/* Same, except that AC_ERR_INVALID_ARG becomes a ValueError with the core's message and the same
 * `code`: for calls whose every argument came from Python, where a value the core refuses is
 * what Python spells ValueError (the shard plan's order, sizes and parameter lists). */
PyObject *pyac_raise_value(PyObject *module, ac_result_t r);

/* tp_dealloc of a heap type whose objects own nothing but their own memory (plain C state):
 * frees the object and drops the reference each instance holds on its heap type. */
void pyac_plain_dealloc(PyObject *op);

/* A borrowed view of a contiguous float buffer, obtained from a Buffer or a DLPack producer. */
typedef struct {
  void *data;
  size_t n;
  ac_dtype_t dt;
  DLDevice device;
  void *owner;   /* managed tensor to release after use; NULL when borrowed from a Buffer */
  int versioned; /* which deleter signature `owner` has */
} pyac_view;

enum { PYAC_READ = 0, PYAC_WRITE = 1 };
enum { PYAC_ON_CPU = 0, PYAC_ON_CUDA = 1, PYAC_ON_ANY = 2 };

/* Fills *v from `obj`: an accelerate_c._C.Buffer, a DLPack capsule ("dltensor" or
 * "dltensor_versioned", consumed and renamed "used_..."), or any object with __dlpack__ (asked
 * for a versioned capsule first, the legacy one if it refuses `max_version`). Checks device,
 * dtype (float32/float16/bfloat16), contiguity and, for WRITE, that the memory is writable and
 * not a copy. `arg` names the argument in error messages. Returns 0, or -1 with an exception.
 * On success the caller must call pyac_view_release. */
int pyac_view_from(PyObject *module, PyObject *obj, int access, int where, const char *arg, pyac_view *v);
void pyac_view_release(pyac_view *v);

/* 0 when views `a` and `b` are on the same device (CUDA memory and CUDA managed memory of one
 * ordinal count as one device); else -1 with a ValueError naming `fn` and both arguments. A
 * CUDA kernel runs on one device and must only touch that device's memory: a tensor of another
 * GPU would be read or written across devices (or fault). */
static inline int pyac_dev_is_cuda(DLDevice d) { return d.device_type == kDLCUDA || d.device_type == kDLCUDAManaged; }

static inline void pyac_dev_name(DLDevice d, char *buf, size_t len) {
  if (pyac_dev_is_cuda(d)) snprintf(buf, len, "cuda:%d", (int)d.device_id);
  else if (d.device_type == kDLCPU) snprintf(buf, len, "cpu");
  else snprintf(buf, len, "DLPack device (%d, %d)", (int)d.device_type, (int)d.device_id);
}

static inline int pyac_same_device(const char *fn, const pyac_view *a, const char *aname, const pyac_view *b,
                                   const char *bname) {
  DLDevice x = a->device, y = b->device;
  if (x.device_id == y.device_id &&
      (x.device_type == y.device_type || (pyac_dev_is_cuda(x) && pyac_dev_is_cuda(y))))
    return 0;
  char nx[48], ny[48];
  pyac_dev_name(x, nx, sizeof nx);
  pyac_dev_name(y, ny, sizeof ny);
  PyErr_Format(PyExc_ValueError, "%s: %s is on %s but %s is on %s; every tensor argument must be on %s's device", fn,
               bname, ny, aname, nx, aname);
  return -1;
}

/* The DLPack exchange under pyac_view_from, for consumers with rules of their own (the
 * safetensors engine takes every dtype): exports `obj` (asking for a versioned capsule first,
 * a legacy one if the producer refuses max_version) or takes a capsule, checks the DLPack
 * version, lets `check(tensor, flags, ctx)` accept it (0) or raise (-1) before the capsule is
 * renamed "used_...", then owns it: *owner / *versioned go to pyac_dlpack_release. `arg` prefixes
 * the error messages. Returns 0, or -1 with an exception set (nothing owned). */
typedef int (*pyac_dlpack_check)(const DLTensor *t, uint64_t flags, void *ctx);
int pyac_dlpack_take(PyObject *obj, const char *arg, pyac_dlpack_check check, void *ctx, void **owner,
                     int *versioned);
/* The checks every consumer makes of an exported tensor, with errors prefixed by `arg`:
 * pyac_dl_layout: ndim and extents valid, element count (times `esize` bytes) without overflow,
 * C-contiguous (*numel set); pyac_dl_writable: the producer neither marked the memory read-only
 * nor exported a copy. Each returns 0, or -1 with a ValueError set. */
int pyac_dl_layout(const DLTensor *t, size_t esize, const char *arg, size_t *numel);
int pyac_dl_writable(uint64_t flags, const char *arg);
/* Runs the producer's deleter (NULL owner: nothing), keeping a pending exception intact. */
void pyac_dlpack_release(void *owner, int versioned);

/* Buffer type spec and the kernel function table (defined in their own files). */
extern PyType_Spec pyac_buffer_spec;
extern PyType_Spec pyac_scaler_spec;
extern PyType_Spec pyac_ds_scaler_spec;
extern PyType_Spec pyac_reducer_spec;
extern PyType_Spec pyac_hook_spec;
extern PyType_Spec pyac_comm_spec;
extern PyType_Spec pyac_shard_plan_spec;
extern PyType_Spec pyac_shm_comm_spec;
extern PyType_Spec pyac_shm_work_spec;
extern PyType_Spec pyac_shm_window_spec;
extern PyMethodDef pyac_comm_methods[];

/* The NCCL communicator behind an accelerate_c._C.NcclComm (NULL after close()). */
struct ac_comm *pyac_comm_handle(PyObject *obj);
extern PyMethodDef pyac_kernel_methods[];
extern PyMethodDef pyac_safetensors_methods[];
extern PyMethodDef pyac_durable_methods[];
extern PyMethodDef pyac_grads_methods[];
extern PyMethodDef pyac_malloc_methods[];
extern PyMethodDef pyac_adam_methods[];

#endif

/* shm_window_py.c — ShmWindow: this rank's region of a shared window (ac/comm_shm.h) as a
 * writable buffer (torch.frombuffer makes the flat gradient buffer of it), and the registry that
 * lets ShmComm.all_reduce recognise a tensor living in a window and reduce it there with no copy.
 *
 * The registry is a list of live windows guarded by the GIL (every access holds it). A window is
 * kept alive by the tensors made from it (torch.frombuffer holds the exporter), and a queued
 * collective keeps its tensor: so a window in use by the progress thread is never unmapped. */
#include "pyac.h"

#include "ac/comm_shm.h"
#include "shm_window_py.h"

typedef struct WindowObject {
  PyObject_HEAD
  ac_shm_window_t *w;
  ac_shm_queue_t *q; /* the communicator's queue; NULL once it is closed */
  PyObject *comm;    /* the ShmComm (kept: its queue outlives the window's use) */
  struct WindowObject *next;
} WindowObject;

static WindowObject *registry;

int pyac_shm_window_find(const ac_shm_queue_t *q, const void *data, size_t nbytes, ac_shm_window_t **w,
                         size_t *offset_bytes) {
  if (!q || !data) return 0;
  for (WindowObject *o = registry; o; o = o->next) {
    const unsigned char *base = ac_shm_window_base(o->w);
    size_t size = ac_shm_window_bytes(o->w);
    const unsigned char *p = data;
    if (o->q == q && p >= base && p < base + size && nbytes <= (size_t)(base + size - p)) {
      *w = o->w;
      *offset_bytes = (size_t)(p - base);
      return 1;
    }
  }
  return 0;
}

void pyac_shm_windows_forget(const ac_shm_queue_t *q) {
  for (WindowObject *o = registry; o; o = o->next)
    if (o->q == q) o->q = NULL;
}

PyObject *pyac_shm_window_wrap(PyObject *comm, ac_shm_queue_t *q, ac_shm_window_t *w) {
  PyObject *type = PyObject_GetAttrString(pyac_module_of(comm), "ShmWindow");
  WindowObject *o = type ? PyObject_New(WindowObject, (PyTypeObject *)type) : NULL;
  Py_XDECREF(type);
  if (!o) {
    ac_shm_window_destroy(w);
    return NULL;
  }
  o->w = w;
  o->q = q;
  Py_INCREF(comm);
  o->comm = comm;
  o->next = registry;
  registry = o;
  return (PyObject *)o;
}

static int window_getbuffer(PyObject *op, Py_buffer *view, int flags) {
  WindowObject *o = (WindowObject *)op;
  /* the view holds a reference to the window (view->obj), so the mapping outlives every tensor
   * made of it */
  return PyBuffer_FillInfo(view, op, ac_shm_window_base(o->w), (Py_ssize_t)ac_shm_window_bytes(o->w), 0, flags);
}

static void window_dealloc(PyObject *op) {
  WindowObject *o = (WindowObject *)op;
  for (WindowObject **p = &registry; *p; p = &(*p)->next)
    if (*p == o) {
      *p = o->next;
      break;
    }
  ac_shm_window_destroy(o->w);
  o->w = NULL;
  Py_CLEAR(o->comm);
  pyac_plain_dealloc(op);
}

static PyObject *window_get_nbytes(PyObject *op, void *closure) {
  (void)closure;
  return PyLong_FromSize_t(ac_shm_window_bytes(((WindowObject *)op)->w));
}

static PyGetSetDef window_getset[] = {
    {"nbytes", window_get_nbytes, NULL, "the bytes of this rank's region", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot window_slots[] = {
    {Py_tp_dealloc, window_dealloc},
    {Py_tp_getset, window_getset},
    {Py_bf_getbuffer, window_getbuffer},
    {Py_tp_doc, "ShmWindow: this rank's region of a shared window (ShmComm.window(nbytes)), a writable buffer; a "
                "tensor made of it (torch.frombuffer) is all-reduced in place through every rank's region"},
    {0, NULL},
};

PyType_Spec pyac_shm_window_spec = {
    .name = "accelerate_c._C.ShmWindow",
    .basicsize = sizeof(WindowObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = window_slots,
};

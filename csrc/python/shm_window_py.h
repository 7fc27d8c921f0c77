/* shm_window_py.h — what comm_shm_py.c asks of the window registry (shm_window_py.c). */
#ifndef PYAC_SHM_WINDOW_PY_H
#define PYAC_SHM_WINDOW_PY_H

#include "ac/comm_shm.h"

/* 1 and the window and the byte offset when [data, data + nbytes) lies in this rank's region of a
 * live window of queue q; else 0. GIL held. */
int pyac_shm_window_find(const ac_shm_queue_t *q, const void *data, size_t nbytes, ac_shm_window_t **w,
                         size_t *offset_bytes);
/* The queue is being closed: its windows are no longer found. GIL held. */
void pyac_shm_windows_forget(const ac_shm_queue_t *q);
/* A new ShmWindow owning w (destroyed on failure). GIL held. */
PyObject *pyac_shm_window_wrap(PyObject *comm, ac_shm_queue_t *q, ac_shm_window_t *w);

#endif

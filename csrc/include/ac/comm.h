/* comm.h — the communicator interface: the collectives the reducer and the strategies need, one
 * table of functions per backend. Two backends implement it:
 *   - NCCL (ac/comm_nccl.h, csrc/core/comm_nccl.c): CUDA device buffers, each operation
 *     asynchronous on the CUDA stream it is given (stream-ordered);
 *   - shared memory between the processes of one host (ac_shm_comm_create in ac/comm_shm.h,
 *     csrc/core/comm_shm_comm.c): host buffers, each operation queued to the group's progress
 *     thread (host-progressed; `stream` must be NULL); an in-place all-reduce of memory in the
 *     group's shared window reduces it where it lies, with no copy in or out.
 * Code above this line (the reducer's bucket launch, ac/reducer.h) is written once against it.
 *
 * Every operation is collective: all ranks of the communicator call it, in the same order, with
 * the same counts. Issuing returns at once; the operation has finished when ac_comm_wait says
 * so (host-progressed) or when the stream has passed it (stream-ordered). The functions below
 * check their arguments (NULL communicator or buffer, reduction, root) and name the one at
 * fault; a backend's own failure carries its message (NCCL's error string, the shm group's
 * timeout naming the silent rank). */
#ifndef AC_COMM_H
#define AC_COMM_H

#include "ac/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ac_comm ac_comm_t;
typedef enum { AC_RED_SUM = 0, AC_RED_PROD = 1, AC_RED_MAX = 2, AC_RED_MIN = 3, AC_RED_AVG = 4 } ac_redop_t;

/* A backend's table. Arguments reach it checked (see above). */
typedef struct ac_comm_ops {
  const char *backend;  /* "nccl", "shm" */
  int stream_ordered;   /* 1: ordered on CUDA streams (NCCL); 0: progressed by the host (ac_comm_wait) */
  ac_result_t (*all_reduce)(ac_comm_t *c, const void *send, void *recv, size_t count, ac_dtype_t dt, ac_redop_t op,
                            void *stream);
  ac_result_t (*broadcast)(ac_comm_t *c, void *buf, size_t count, ac_dtype_t dt, int root, void *stream);
  ac_result_t (*all_gather)(ac_comm_t *c, const void *send, void *recv, size_t count, ac_dtype_t dt, void *stream);
  ac_result_t (*reduce_scatter)(ac_comm_t *c, const void *send, void *recv, size_t count, ac_dtype_t dt,
                                ac_redop_t op, void *stream);
  ac_result_t (*wait)(ac_comm_t *c);
  void (*destroy)(ac_comm_t *c);
} ac_comm_ops_t;

/* The head every backend's communicator starts with. */
struct ac_comm {
  const ac_comm_ops_t *ops;
  int nranks, rank;
};

/* Frees the communicator (a host-progressed one waits for what it issued first); NULL is a
 * no-op. */
void ac_comm_destroy(ac_comm_t *c);
int ac_comm_size(const ac_comm_t *c);
int ac_comm_rank(const ac_comm_t *c);
/* The backend's name ("nccl", "shm"); "" for NULL. */
const char *ac_comm_backend(const ac_comm_t *c);
/* 1 when the backend orders its work on CUDA streams (the caller orders its own stream after it
 * with CUDA events), 0 when ac_comm_wait completes it. */
int ac_comm_stream_ordered(const ac_comm_t *c);

/* recv[i] = op over ranks of send[i], for i < count (send == recv: in place). */
ac_result_t ac_comm_all_reduce(ac_comm_t *c, const void *send, void *recv, size_t count, ac_dtype_t dt,
                               ac_redop_t op, void *stream);
/* buf on every rank = buf of `root`. */
ac_result_t ac_comm_broadcast(ac_comm_t *c, void *buf, size_t count, ac_dtype_t dt, int root, void *stream);
/* recv (nranks * count elements) = the concatenation of every rank's send (count elements). */
ac_result_t ac_comm_all_gather(ac_comm_t *c, const void *send, void *recv, size_t count, ac_dtype_t dt,
                               void *stream);
/* recv (count elements) = this rank's slice of op over ranks of send (nranks * count). */
ac_result_t ac_comm_reduce_scatter(ac_comm_t *c, const void *send, void *recv, size_t count, ac_dtype_t dt,
                                   ac_redop_t op, void *stream);
/* Host-progressed backends: blocks until every operation issued so far has finished and returns
 * the first failure among them (each is waited for, so no buffer is still in use afterwards).
 * Stream-ordered backends: AC_OK at once. */
ac_result_t ac_comm_wait(ac_comm_t *c);

#ifdef __cplusplus
}
#endif
#endif /* AC_COMM_H */

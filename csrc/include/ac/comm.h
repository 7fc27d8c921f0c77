/* comm.h — a small communicator over NCCL, loaded at run time (no link-time dependency, no NCCL
 * headers: the few prototypes and enums are declared in comm_nccl.c from NCCL's published C API).
 *
 * Loading: ac_nccl_load(NULL) first looks for NCCL symbols already in the process (the NCCL
 * that torch loaded, through dlsym(RTLD_DEFAULT)), then dlopen("libnccl.so.2"); a path loads
 * exactly that file. The first successful load wins for the life of the process.
 *
 * Every operation is asynchronous on `stream` (a cudaStream_t; NULL = the legacy default
 * stream) and is collective: all ranks of the communicator must call it, in the same order,
 * with the same counts. Buffers are device pointers (host pointers only with a fake NCCL in
 * the C tests). Errors carry NCCL's own message (ncclGetErrorString / ncclGetLastError). */
#ifndef AC_COMM_H
#define AC_COMM_H

#include "ac/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

#define AC_NCCL_UNIQUE_ID_BYTES 128

typedef struct ac_comm ac_comm_t;
typedef enum { AC_RED_SUM = 0, AC_RED_PROD = 1, AC_RED_MAX = 2, AC_RED_MIN = 3, AC_RED_AVG = 4 } ac_redop_t;

/* Loads NCCL (see above). Missing library or symbol -> AC_ERR_UNSUPPORTED naming what was
 * tried and what is missing. Thread-safe; cheap once loaded. */
ac_result_t ac_nccl_load(const char *path);
/* Where NCCL came from ("process" or the path given to dlopen); "" before a load. */
const char *ac_nccl_source(void);
/* NCCL's version code (e.g. 22703 for 2.27.3). Loads NCCL if needed. */
ac_result_t ac_nccl_version(int *version);
/* A new unique id (rank 0 makes it; the others receive it out of band). */
ac_result_t ac_nccl_unique_id(unsigned char id[AC_NCCL_UNIQUE_ID_BYTES]);

/* Joins the communicator `id` as `rank` of `nranks` on the current CUDA device. Blocks until
 * every rank has joined (collective). *out is owned by the caller: ac_comm_destroy. */
ac_result_t ac_comm_create(ac_comm_t **out, const unsigned char id[AC_NCCL_UNIQUE_ID_BYTES], int nranks, int rank);
/* Frees the communicator (waits for its pending work); NULL is a no-op. */
void ac_comm_destroy(ac_comm_t *c);
int ac_comm_size(const ac_comm_t *c);
int ac_comm_rank(const ac_comm_t *c);

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

#ifdef __cplusplus
}
#endif
#endif /* AC_COMM_H */

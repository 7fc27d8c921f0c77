/* comm_nccl.h — the communicator over NCCL (ac/comm.h's stream-ordered backend), loaded at run
 * time: no link-time dependency and no NCCL headers (the few prototypes and enums are declared
 * in comm_nccl.c from NCCL's published C API).
 *
 * Loading: ac_nccl_load(NULL) first looks for NCCL symbols already in the process (the NCCL
 * that torch loaded, through dlsym(RTLD_DEFAULT)), then dlopen("libnccl.so.2"); a path loads
 * exactly that file. The first successful load wins for the life of the process.
 *
 * Every operation is asynchronous on `stream` (a cudaStream_t; NULL = the legacy default
 * stream). Buffers are device pointers (host pointers only with a fake NCCL in the C tests).
 * Errors carry NCCL's own message (ncclGetErrorString / ncclGetLastError). */
#ifndef AC_COMM_NCCL_H
#define AC_COMM_NCCL_H

#include "ac/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

#define AC_NCCL_UNIQUE_ID_BYTES 128

/* Loads NCCL (see above). Missing library or symbol -> AC_ERR_UNSUPPORTED naming what was
 * tried and what is missing. Thread-safe; cheap once loaded. */
ac_result_t ac_nccl_load(const char *path);
/* Where NCCL came from ("process" or the path given to dlopen); "" before a load. */
const char *ac_nccl_source(void);
/* NCCL's version code (e.g. 22703 for 2.27.3). Loads NCCL if needed. */
ac_result_t ac_nccl_version(int *version);
/* A new unique id (rank 0 makes it; the others receive it out of band). */
ac_result_t ac_nccl_unique_id(unsigned char id[AC_NCCL_UNIQUE_ID_BYTES]);

/* Joins the NCCL communicator `id` as `rank` of `nranks` on the current CUDA device. Blocks
 * until every rank has joined (collective). *out is owned by the caller: ac_comm_destroy. */
ac_result_t ac_nccl_comm_create(ac_comm_t **out, const unsigned char id[AC_NCCL_UNIQUE_ID_BYTES], int nranks,
                                int rank);

#ifdef __cplusplus
}
#endif
#endif /* AC_COMM_NCCL_H */

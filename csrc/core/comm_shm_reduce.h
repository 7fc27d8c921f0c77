/* comm_shm_reduce.h — the reductions the shared-memory collectives apply (comm_shm_reduce.c).
 * Internal to the core: comm_shm.c and the fuzz target that includes it. */
#ifndef AC_COMM_SHM_REDUCE_H
#define AC_COMM_SHM_REDUCE_H

#include <stddef.h>

#include "ac/comm_shm.h"

/* dst[i] = op over q < nsrc of src[q][i] for i < n, accumulated in rank order (16-bit types in
 * fp32, rounded once to nearest even; NaN propagates, max and min too). dst may be one of the
 * sources: each block of the sources is read before that block of dst is written. */
typedef void (*ac_shm_reduce_fn)(void *dst, const void *const *src, int nsrc, size_t n, ac_redop_t op);

/* The kernel for (dt, op), or an error naming what is refused: an unknown dtype or op, and an
 * integer average (it would be truncated). */
ac_result_t ac_shm_check_op(ac_shm_dtype_t dt, ac_redop_t op, ac_shm_reduce_fn *fn);

/* "float32", "bfloat16", ... for messages ("invalid" for an unknown code). */
const char *ac_shm_dtype_name(ac_shm_dtype_t dt);

#endif /* AC_COMM_SHM_REDUCE_H */

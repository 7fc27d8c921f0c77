/* comm_nccl.c — the communicator over NCCL (ac/comm.h's stream-ordered backend), resolved at run
 * time with dlsym (see ac/comm_nccl.h). */
#define _GNU_SOURCE
#include "ac/comm_nccl.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* NCCL's C ABI, declared from its published API (nccl.h): results, types, ops, the id. */
typedef int nccl_result_t; /* ncclSuccess = 0, ..., ncclInProgress = 7 */
typedef void *nccl_comm_t;
typedef struct {
  char internal[AC_NCCL_UNIQUE_ID_BYTES];
} nccl_unique_id_t;
enum { NCCL_FLOAT16 = 6, NCCL_FLOAT32 = 7, NCCL_BFLOAT16 = 9 };

typedef struct {
  nccl_result_t (*get_version)(int *);
  nccl_result_t (*get_unique_id)(nccl_unique_id_t *);
  nccl_result_t (*comm_init_rank)(nccl_comm_t *, int, nccl_unique_id_t, int);
  nccl_result_t (*comm_destroy)(nccl_comm_t);
  nccl_result_t (*all_reduce)(const void *, void *, size_t, int, int, nccl_comm_t, void *);
  nccl_result_t (*broadcast)(const void *, void *, size_t, int, int, nccl_comm_t, void *);
  nccl_result_t (*all_gather)(const void *, void *, size_t, int, nccl_comm_t, void *);
  nccl_result_t (*reduce_scatter)(const void *, void *, size_t, int, int, nccl_comm_t, void *);
  const char *(*get_error_string)(nccl_result_t);
  const char *(*get_last_error)(nccl_comm_t); /* NCCL >= 2.13; may be NULL */
} nccl_api_t;

static nccl_api_t api;
static int api_loaded;
static char api_source[512];
static pthread_mutex_t api_lock = PTHREAD_MUTEX_INITIALIZER;

typedef struct {
  struct ac_comm base; /* first: an ac_comm_t * is a nccl_comm * */
  nccl_comm_t comm;
} nccl_comm;

static const ac_comm_ops_t nccl_ops;

/* Resolves every symbol from `handle` (RTLD_DEFAULT or a dlopen handle); names the first
 * missing one in the error. */
static ac_result_t resolve(void *handle, const char *from, nccl_api_t *out) {
  struct {
    const char *name;
    void **slot;
    int required;
  } syms[] = {
      {"ncclGetVersion", (void **)&out->get_version, 1},
      {"ncclGetUniqueId", (void **)&out->get_unique_id, 1},
      {"ncclCommInitRank", (void **)&out->comm_init_rank, 1},
      {"ncclCommDestroy", (void **)&out->comm_destroy, 1},
      {"ncclAllReduce", (void **)&out->all_reduce, 1},
      {"ncclBroadcast", (void **)&out->broadcast, 1},
      {"ncclAllGather", (void **)&out->all_gather, 1},
      {"ncclReduceScatter", (void **)&out->reduce_scatter, 1},
      {"ncclGetErrorString", (void **)&out->get_error_string, 1},
      {"ncclGetLastError", (void **)&out->get_last_error, 0},
  };
  memset(out, 0, sizeof *out);
  for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
    void *p = dlsym(handle, syms[i].name);
    if (!p && syms[i].required)
      return AC_FAIL(AC_ERR_UNSUPPORTED, "NCCL from %s lacks the symbol %s", from, syms[i].name);
    *syms[i].slot = p;
  }
  return AC_OK;
}

ac_result_t ac_nccl_load(const char *path) {
  ac_result_t r = AC_OK;
  pthread_mutex_lock(&api_lock);
  if (api_loaded) goto done;
  nccl_api_t found;
  if (!path && dlsym(RTLD_DEFAULT, "ncclCommInitRank")) {
    /* the NCCL torch already loaded: one library, one set of globals, one version */
    if (resolve(RTLD_DEFAULT, "the process", &found) == AC_OK) {
      api = found;
      api_loaded = 1;
      snprintf(api_source, sizeof api_source, "process");
      goto done;
    }
    ac_clear_error();
  }
  const char *file = path ? path : "libnccl.so.2";
  void *h = dlopen(file, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char *why = dlerror();
    r = AC_FAIL_HINT(AC_ERR_UNSUPPORTED,
                     "install NCCL (e.g. pip's nvidia-nccl package, which torch's CUDA wheels bring) or pass "
                     "its path",
                     "NCCL could not be loaded from %s: %s", file, why ? why : "unknown error");
    goto done;
  }
  r = resolve(h, file, &found);
  if (r != AC_OK) {
    dlclose(h);
    goto done;
  }
  api = found; /* the handle stays open for the life of the process */
  api_loaded = 1;
  snprintf(api_source, sizeof api_source, "%s", file);
done:
  pthread_mutex_unlock(&api_lock);
  return r;
}

const char *ac_nccl_source(void) { return api_loaded ? api_source : ""; }

static ac_result_t ensure_loaded(void) { return api_loaded ? AC_OK : ac_nccl_load(NULL); }

static ac_result_t nccl_fail(const nccl_comm *c, nccl_result_t rc, const char *what) {
  const char *detail = c && api.get_last_error ? api.get_last_error(c->comm) : NULL;
  /* ncclInvalidArgument (4) / ncclInvalidUsage (5) are the caller's; ncclUnhandledCudaError (1) CUDA's */
  ac_result_t code = rc == 4 || rc == 5 ? AC_ERR_INVALID_ARG : rc == 1 ? AC_ERR_CUDA : AC_ERR_COMM;
  return AC_FAIL(code,
                 "%s failed: NCCL error %d (%s)%s%s", what, rc, api.get_error_string(rc),
                 detail && *detail ? ": " : "", detail && *detail ? detail : "");
}

ac_result_t ac_nccl_version(int *version) {
  if (!version) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_nccl_version: version is NULL");
  AC_CHECK(ensure_loaded());
  nccl_result_t rc = api.get_version(version);
  return rc ? nccl_fail(NULL, rc, "ncclGetVersion") : AC_OK;
}

ac_result_t ac_nccl_unique_id(unsigned char id[AC_NCCL_UNIQUE_ID_BYTES]) {
  if (!id) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_nccl_unique_id: id is NULL");
  AC_CHECK(ensure_loaded());
  nccl_unique_id_t u;
  nccl_result_t rc = api.get_unique_id(&u);
  if (rc) return nccl_fail(NULL, rc, "ncclGetUniqueId");
  memcpy(id, u.internal, AC_NCCL_UNIQUE_ID_BYTES);
  return AC_OK;
}

ac_result_t ac_nccl_comm_create(ac_comm_t **out, const unsigned char id[AC_NCCL_UNIQUE_ID_BYTES], int nranks,
                                int rank) {
  if (!out || !id) return AC_FAIL(AC_ERR_INVALID_ARG, "ac_nccl_comm_create: NULL argument");
  *out = NULL;
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return AC_FAIL(AC_ERR_INVALID_ARG, "ac_nccl_comm_create: rank %d of %d ranks is not valid", rank, nranks);
  AC_CHECK(ensure_loaded());
  nccl_comm *c = calloc(1, sizeof *c);
  if (!c) return AC_FAIL(AC_ERR_NOMEM, "no memory for a communicator");
  nccl_unique_id_t u;
  memcpy(u.internal, id, AC_NCCL_UNIQUE_ID_BYTES);
  nccl_result_t rc = api.comm_init_rank(&c->comm, nranks, u, rank);
  if (rc) {
    ac_result_t r = nccl_fail(NULL, rc, "ncclCommInitRank");
    free(c);
    return r;
  }
  c->base.ops = &nccl_ops;
  c->base.nranks = nranks;
  c->base.rank = rank;
  *out = &c->base;
  return AC_OK;
}

static void nccl_destroy(ac_comm_t *base) {
  nccl_comm *c = (nccl_comm *)base;
  if (api_loaded && c->comm) (void)api.comm_destroy(c->comm);
  free(c);
}

static ac_result_t nccl_type(ac_dtype_t dt, int *out) {
  switch (dt) {
  case AC_F32: *out = NCCL_FLOAT32; return AC_OK;
  case AC_F16: *out = NCCL_FLOAT16; return AC_OK;
  case AC_BF16: *out = NCCL_BFLOAT16; return AC_OK;
  }
  return AC_FAIL(AC_ERR_INVALID_ARG, "no NCCL type for dtype code %d", (int)dt);
}

/* The arguments arrive checked (comm.c); what is left is NCCL's own type code and call. */
static ac_result_t nccl_all_reduce(ac_comm_t *base, const void *send, void *recv, size_t count, ac_dtype_t dt,
                                   ac_redop_t op, void *stream) {
  nccl_comm *c = (nccl_comm *)base;
  int t = 0;
  AC_CHECK(nccl_type(dt, &t));
  nccl_result_t rc = api.all_reduce(send, recv, count, t, (int)op, c->comm, stream);
  return rc ? nccl_fail(c, rc, "ncclAllReduce") : AC_OK;
}

static ac_result_t nccl_broadcast(ac_comm_t *base, void *buf, size_t count, ac_dtype_t dt, int root, void *stream) {
  nccl_comm *c = (nccl_comm *)base;
  int t = 0;
  AC_CHECK(nccl_type(dt, &t));
  nccl_result_t rc = api.broadcast(buf, buf, count, t, root, c->comm, stream);
  return rc ? nccl_fail(c, rc, "ncclBroadcast") : AC_OK;
}

static ac_result_t nccl_all_gather(ac_comm_t *base, const void *send, void *recv, size_t count, ac_dtype_t dt,
                                   void *stream) {
  nccl_comm *c = (nccl_comm *)base;
  int t = 0;
  AC_CHECK(nccl_type(dt, &t));
  nccl_result_t rc = api.all_gather(send, recv, count, t, c->comm, stream);
  return rc ? nccl_fail(c, rc, "ncclAllGather") : AC_OK;
}

static ac_result_t nccl_reduce_scatter(ac_comm_t *base, const void *send, void *recv, size_t count, ac_dtype_t dt,
                                       ac_redop_t op, void *stream) {
  nccl_comm *c = (nccl_comm *)base;
  int t = 0;
  AC_CHECK(nccl_type(dt, &t));
  nccl_result_t rc = api.reduce_scatter(send, recv, count, t, (int)op, c->comm, stream);
  return rc ? nccl_fail(c, rc, "ncclReduceScatter") : AC_OK;
}

static const ac_comm_ops_t nccl_ops = {
    .backend = "nccl",
    .stream_ordered = 1,
    .all_reduce = nccl_all_reduce,
    .broadcast = nccl_broadcast,
    .all_gather = nccl_all_gather,
    .reduce_scatter = nccl_reduce_scatter,
    .wait = NULL, /* stream-ordered: the caller's stream waits through CUDA events */
    .destroy = nccl_destroy,
};

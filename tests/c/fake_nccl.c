/* fake_nccl.c — a stand-in libnccl for the C and Python tests on machines without NCCL or a
 * GPU: the NCCL entry points the core loads, for one rank, on host memory (a sum over one rank
 * is a copy). It records the calls so tests can check what the core asked for. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
  char internal[128];
} fake_id_t;
typedef struct {
  int nranks, rank;
} fake_comm_t;

static int calls_all_reduce, calls_other;
static void *last_stream;
static size_t last_count;
static const void *last_send; /* the all-reduce's input: which range of a buffer was sent */

static size_t type_size(int t) {
  switch (t) {
  case 6: case 9: return 2; /* float16, bfloat16 */
  case 7: return 4;         /* float32 */
  default: return 0;
  }
}

int ncclGetVersion(int *v) { *v = 29999; return 0; }
int ncclGetUniqueId(fake_id_t *id) { memset(id->internal, 0x5a, sizeof id->internal); return 0; }
int ncclCommInitRank(fake_comm_t **comm, int nranks, fake_id_t id, int rank) {
  if (nranks != 1 || rank != 0 || id.internal[0] != 0x5a) return 4; /* ncclInvalidArgument */
  *comm = calloc(1, sizeof **comm);
  if (!*comm) return 2;
  (*comm)->nranks = nranks;
  return 0;
}
int ncclCommDestroy(fake_comm_t *comm) { free(comm); return 0; }
int ncclAllReduce(const void *s, void *r, size_t n, int t, int op, fake_comm_t *c, void *stream) {
  (void)op, (void)c;
  if (!type_size(t)) return 4;
  calls_all_reduce++;
  last_stream = stream;
  last_count = n;
  last_send = s;
  if (s != r) memmove(r, s, n * type_size(t));
  return 0;
}
int ncclBroadcast(const void *s, void *r, size_t n, int t, int root, fake_comm_t *c, void *stream) {
  (void)root, (void)c, (void)stream;
  if (!type_size(t)) return 4;
  calls_other++;
  if (s != r) memmove(r, s, n * type_size(t));
  return 0;
}
int ncclAllGather(const void *s, void *r, size_t n, int t, fake_comm_t *c, void *stream) {
  (void)c, (void)stream;
  calls_other++;
  if (s != r) memmove(r, s, n * type_size(t));
  return 0;
}
int ncclReduceScatter(const void *s, void *r, size_t n, int t, int op, fake_comm_t *c, void *stream) {
  (void)op, (void)c, (void)stream;
  calls_other++;
  if (s != r) memmove(r, s, n * type_size(t));
  return 0;
}
const char *ncclGetErrorString(int rc) { return rc == 4 ? "invalid argument (fake)" : "fake error"; }
const char *ncclGetLastError(fake_comm_t *c) { (void)c; return "fake last error"; }

/* for the tests */
int fake_nccl_all_reduce_calls(void) { return calls_all_reduce; }
int fake_nccl_other_calls(void) { return calls_other; }
void *fake_nccl_last_stream(void) { return last_stream; }
size_t fake_nccl_last_count(void) { return last_count; }
const void *fake_nccl_last_send(void) { return last_send; }

/* comm_shm.h — collectives between the processes of one host through one POSIX shared-memory
 * segment (docs/collectives.md).
 *
 * Joining: every rank calls ac_shm_create with the same `name` (unique per job and process
 * group: the Python side makes it from the rendezvous), its rank and the group's size. Rank 0
 * creates the segment (O_EXCL: a name in use is an error, never shared by accident) and lays its
 * header; the others open it, wait for the header and map it. Every rank counts itself in, and
 * the last one to map the segment unlinks its name, so nothing is left in /dev/shm once the group
 * is formed, whatever happens to the processes later.
 *
 * Each rank owns one slot of `slot_bytes` in the segment; a collective moves its data through the
 * slots in pieces, so any size works with a bounded segment. Every collective is blocking, must
 * be called by every rank of the group in the same order with matching arguments (a mismatch of
 * kind, count or dtype is detected and is an error on every rank), and synchronises with C11
 * atomics (acquire/release) and futex waits after a short spin. A rank that has not arrived
 * within `timeout_ms`, or whose process has died, ends the collective with an error naming the
 * collective and the silent ranks (AC_ERR_TIMEOUT / AC_ERR_COMM); the communicator then refuses
 * further work (AC_ERR_STATE), since its peers are at an unknown point.
 *
 * Reductions: sum, max, min, avg. fp32 and fp64 accumulate in their own type in rank order
 * (every rank gets the same bits); fp16 and bf16 accumulate in fp32 and are rounded once, to
 * nearest even; NaN propagates (max/min too, as torch.maximum); int32/int64 are exact (wrapping
 * on overflow); avg of integers is refused. A reduction is computed once per element, by the
 * rank that owns the element's slice, and copied to every rank. */
#ifndef AC_COMM_SHM_H
#define AC_COMM_SHM_H

#include "ac/ac.h"
#include "ac/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  AC_SHM_F32 = 0,
  AC_SHM_F64 = 1,
  AC_SHM_F16 = 2,
  AC_SHM_BF16 = 3,
  AC_SHM_I32 = 4,
  AC_SHM_I64 = 5
} ac_shm_dtype_t;

#define AC_SHM_MAX_RANKS 256
#define AC_SHM_NAME_MAX 200

typedef struct ac_shm ac_shm_t;

/* Bytes per element of `dt`; 0 for a value outside the enum. */
size_t ac_shm_dtype_size(ac_shm_dtype_t dt);

/* Joins the group `name` (a POSIX shm name: "/" then at most AC_SHM_NAME_MAX - 1 characters of
 * [A-Za-z0-9._-]) as `rank` of `nranks`. slot_bytes: each rank's slot (>= 4096, a multiple of
 * 64). Blocks until every rank has mapped the segment or timeout_ms passes (AC_ERR_TIMEOUT).
 * A segment too big for /dev/shm is AC_ERR_NOMEM naming the size. *out: ac_shm_destroy. */
ac_result_t ac_shm_create(ac_shm_t **out, const char *name, int nranks, int rank, size_t slot_bytes,
                          int timeout_ms);
/* Unmaps the segment; NULL is a no-op. Never blocks. */
void ac_shm_destroy(ac_shm_t *c);
int ac_shm_size(const ac_shm_t *c);
int ac_shm_rank(const ac_shm_t *c);
/* The timeout of later collectives (ms, > 0). */
ac_result_t ac_shm_set_timeout(ac_shm_t *c, int timeout_ms);

/* recv[i] = op over ranks of send[i], i < count (send == recv: in place). */
ac_result_t ac_shm_all_reduce(ac_shm_t *c, const void *send, void *recv, size_t count, ac_shm_dtype_t dt,
                              ac_redop_t op);
/* recv (count elements) = this rank's slice of op over ranks of send (nranks * count elements). */
ac_result_t ac_shm_reduce_scatter(ac_shm_t *c, const void *send, void *recv, size_t count, ac_shm_dtype_t dt,
                                  ac_redop_t op);
/* recv = the concatenation over ranks q of counts[q] elements from each rank's send (this rank
 * sends counts[rank]); counts: one entry per rank, the same on every rank. send may alias this
 * rank's part of recv. */
ac_result_t ac_shm_all_gather(ac_shm_t *c, const void *send, void *recv, const size_t *counts, ac_shm_dtype_t dt);
/* buf on every rank = buf of `root` (count elements). */
ac_result_t ac_shm_broadcast(ac_shm_t *c, void *buf, size_t count, ac_shm_dtype_t dt, int root);
ac_result_t ac_shm_barrier(ac_shm_t *c);

/* ---- shared windows (csrc/core/comm_shm_window.c) ---------------------------------------------
 * A window is memory every rank of the group maps: one region of `bytes` per rank. A buffer that
 * lives in this rank's region (the reducer's flat gradient buffer) is all-reduced in place with no
 * copy in or out: each rank reduces its slice of the range straight from every rank's region and
 * writes the result into every region (docs/collectives.md, "Windows"). Creating one is a
 * collective of the group in the window's own segment (named from the group's, with a counter:
 * every rank creates its windows in the same order); it does not use the group's queue. The
 * segment is unlinked once every rank has mapped it. */
typedef struct ac_shm_window ac_shm_window_t;

/* Joins the group's next window of `bytes` per rank (> 0). Blocks until every rank has mapped it
 * or the group's timeout passes. *out: ac_shm_window_destroy. */
ac_result_t ac_shm_window_create(ac_shm_window_t **out, ac_shm_t *c, size_t bytes);
/* This rank's region (64-byte aligned, zeroed at creation) and its usable size. */
void *ac_shm_window_base(const ac_shm_window_t *w);
size_t ac_shm_window_bytes(const ac_shm_window_t *w);
/* Unmaps it; NULL is a no-op. The caller makes sure no collective still uses it. */
void ac_shm_window_destroy(ac_shm_window_t *w);
/* Elements [offset, offset + count) of dtype `dt` in every rank's region become op over ranks of
 * them (every rank passes the same window, offset, count, dtype and op: checked). Two barriers:
 * everyone's data is in place; everyone's slice is reduced and written everywhere. */
ac_result_t ac_shm_window_all_reduce(ac_shm_t *c, ac_shm_window_t *w, size_t offset, size_t count,
                                     ac_shm_dtype_t dt, ac_redop_t op);
/* An in-place all-gather in a window: rank q's elements [offset + q * chunk, offset + (q + 1) *
 * chunk) of dtype `dt` in its own region are copied into that range of every other rank's region
 * (every rank passes the same window, offset, chunk and dtype: checked). Two barriers: every
 * rank's chunk is in place; every rank has copied every chunk (so no rank overwrites its own
 * before the others read it). No copy in: each rank reads the others' chunks where they are. */
ac_result_t ac_shm_window_all_gather(ac_shm_t *c, ac_shm_window_t *w, size_t offset, size_t chunk,
                                     ac_shm_dtype_t dt);
/* ac_shm_reduce_scatter of the nranks * count elements at `offset` of this rank's region of `w`
 * into recv (which may be this rank's chunk of that range: in place). Where every rank passes
 * the same window and offset, each rank reduces its chunk from every region where it is (two
 * barriers, no copy in or out); where some rank's input is elsewhere (another place, or private
 * memory through ac_shm_reduce_scatter: every reduce-scatter says where its input is), all ranks
 * take the slots, as ac_shm_reduce_scatter. The ranks agree on that inside the collective. */
ac_result_t ac_shm_window_reduce_scatter(ac_shm_t *c, ac_shm_window_t *w, size_t offset, void *recv, size_t count,
                                         ac_shm_dtype_t dt, ac_redop_t op);
/* How many collectives of `c` took a window path so far (all-reduce and all-gather in a window,
 * reduce-scatters whose ranks all had their input at one place of one window): for tests and
 * benchmarks to see that the zero-copy path is the one taken. Thread-safe. */
uint64_t ac_shm_window_ops(const ac_shm_t *c);

/* Makes every collective of `c` that is running or starts later fail at once with AC_ERR_STATE
 * (a communicator being closed while its progress thread waits on a peer). Thread-safe. */
void ac_shm_abort(ac_shm_t *c);

/* ---- asynchronous collectives (csrc/core/comm_shm_async.c) ----------------------------------
 * A queue owns a communicator and one progress thread (started at the first submit) that runs
 * the submitted collectives in submission order, so that the caller (a backward pass launching
 * gradient buckets) goes on meanwhile. Once a communicator has a queue, every collective on it
 * goes through the queue (a blocking one is a submit and a wait), or the order would break. */
typedef enum {
  AC_SHM_OP_ALL_REDUCE = 0,
  AC_SHM_OP_REDUCE_SCATTER = 1,
  AC_SHM_OP_ALL_GATHER = 2,
  AC_SHM_OP_BROADCAST = 3,
  AC_SHM_OP_BARRIER = 4,
  AC_SHM_OP_WINDOW_ALL_REDUCE = 5,
  AC_SHM_OP_WINDOW_ALL_GATHER = 6,
  AC_SHM_OP_WINDOW_REDUCE_SCATTER = 7
} ac_shm_kind_t;

/* One collective's arguments, as the blocking functions above take them (all_gather: counts;
 * broadcast: recv is the buffer, root; window all-reduce: window, offset, count, op; window
 * all-gather: window, offset, count (each rank's chunk), dt; window reduce-scatter: window, offset,
 * recv, count (each rank's chunk), dt, op; the rest:
 * send, recv, count, op). The buffers (and the window) must stay valid until the request is
 * waited for; counts is copied. */
typedef struct {
  ac_shm_kind_t kind;
  const void *send;
  void *recv;
  size_t count;
  ac_shm_dtype_t dt;
  ac_redop_t op;
  int root;
  const size_t *counts;
  ac_shm_window_t *window;
  size_t offset;
} ac_shm_op_t;

typedef struct ac_shm_queue ac_shm_queue_t;
typedef struct ac_shm_req ac_shm_req_t;

/* Takes ownership of `c` (ac_shm_queue_destroy destroys it). */
ac_result_t ac_shm_queue_create(ac_shm_queue_t **out, ac_shm_t *c);
ac_shm_t *ac_shm_queue_comm(ac_shm_queue_t *q);
/* Queues `op`; *req: ac_shm_req_wait or ac_shm_req_release it. */
ac_result_t ac_shm_submit(ac_shm_queue_t *q, const ac_shm_op_t *op, ac_shm_req_t **req);
/* Runs `op` and returns its result: on the calling thread when nothing is queued or running (a
 * blocking collective then costs no thread hand-off), else queued behind the rest and waited for.
 * Either way in submission order. */
ac_result_t ac_shm_run(ac_shm_queue_t *q, const ac_shm_op_t *op);
/* 1 once the request has run (result ready), else 0. */
int ac_shm_req_done(ac_shm_req_t *r);
/* Blocks until the request has run; returns its result (its error message becomes this
 * thread's) and frees the request. */
ac_result_t ac_shm_req_wait(ac_shm_req_t *r);
/* Gives the request up without waiting (it still runs); NULL is a no-op. */
void ac_shm_req_release(ac_shm_req_t *r);
/* Aborts the communicator (ac_shm_abort: what is queued fails at once), joins the thread and
 * destroys the communicator. Requests not yet waited for stay valid (their result: an error). */
void ac_shm_queue_destroy(ac_shm_queue_t *q);

/* ---- the group as an ac/comm.h communicator (csrc/core/comm_shm_comm.c) -----------------------
 * The host-progressed backend of the communicator interface: fp32/fp16/bf16 host buffers (the
 * shm dtypes beyond those stay with the functions above), no stream (NULL). Each
 * operation is submitted to `q` and runs on its progress thread; ac_comm_wait waits for all of
 * them and returns the first failure. An in-place all-reduce of a range inside `w` (may be NULL)
 * is the window all-reduce, and an all-gather into a range inside it whose send buffer is this
 * rank's chunk in place the window all-gather; a result buffer overlapping the window otherwise
 * (partly inside, out of place, misaligned) is refused. q and w are borrowed: both outlive the communicator, which is
 * destroyed first (ac_comm_destroy waits for what is still queued). Not thread-safe: one thread
 * at a time issues, waits and destroys. */
ac_result_t ac_shm_comm_create(ac_comm_t **out, ac_shm_queue_t *q, ac_shm_window_t *w);

#ifdef __cplusplus
}
#endif
#endif /* AC_COMM_SHM_H */

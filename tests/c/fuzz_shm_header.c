/* fuzz_shm_header.c — fuzz target for the shared-memory collectives (csrc/core/comm_shm.c) as a
 * peer that writes garbage into the segment leaves it: the header, the rank lines (arrival
 * counts, collective tags, pids) and the slots.
 *
 * The harness includes comm_shm.c itself, so that it can lay the segment out in heap memory
 * (AddressSanitizer sees every byte outside it) exactly as rank 0's ac_shm_create does, for one
 * rank of a group whose other ranks exist only as what the input wrote. Then it runs one
 * collective from that rank. Acceptable outcomes: AC_OK, or an error (AC_ERR_COMM, _TIMEOUT,
 * _STATE, _INVALID_ARG, _UNSUPPORTED) with a message; never a read or write outside the segment
 * and the caller's buffers, and never a wait past the timeout.
 *
 * Input: byte 0 nranks-1 (up to 8), 1 the rank, 2 the collective, 3 dtype, 4 op, 5-6 count, 7
 * root, 8 slot size / 4096, 9 flags (1, with a length that is a multiple of 16: peers may look
 * absent, so barriers time out, which costs a futex sleep), then (offset, length, bytes) patches written
 * over the header and rank lines, then 0xff, and the rest XORed over the slots. */
/* Short waits. The other ranks exist only as what the input wrote: nothing can arrive later, so a
 * barrier waiting for an absent peer ends the same way after any wait. With the timeout at 0 (set
 * below) it takes every step of the wait loop once (spin, yield, one futex sleep of SLEEP_NS, the
 * dead-peer check, the timeout) and fails at once, instead of sleeping 1 ms per input. */
#define YIELD_S 20e-6
#define SLEEP_NS 1000L
#include "../../csrc/core/comm_shm.c"

#include <sanitizer/asan_interface.h>

#define CHECK(c)                                                                      \
  do {                                                                                \
    if (!(c)) {                                                                       \
      fprintf(stderr, "fuzz_shm_header: invariant failed at line %d: %s\n", __LINE__, #c); \
      __builtin_trap();                                                               \
    }                                                                                 \
  } while (0)

/* The largest layout and buffers an input can ask for (8 ranks, 4 x 4096-byte slots, 6000 elements
 * of 8 bytes, reduce-scatter's send of count per rank). */
#define MAX_SEGMENT (4096 + 8 * 4096 * 4)
#define MAX_SEND (6000 * 8 * 8 + 1)
#define MAX_RECV (6000 * 8 + 1)

/* Each buffer is allocated once, at its largest size, and reused: only its first n bytes are
 * addressable for this input (the rest is poisoned), so an access past them is an AddressSanitizer
 * report as it was with a fresh allocation of n bytes per input (the heap redzone still guards the
 * start), without a fresh mapping and its page faults for every input (large sizes come from ASan's
 * mmap-backed allocator). */
static unsigned char *reuse(unsigned char **buf, size_t cap, size_t align, size_t n) {
  if (!*buf) *buf = align ? aligned_alloc(align, cap) : malloc(cap);
  CHECK(*buf && n <= cap);
  ASAN_UNPOISON_MEMORY_REGION(*buf, n);
  ASAN_POISON_MEMORY_REGION(*buf + n, cap - n);
  return *buf;
}
static unsigned char *seg_buf, *send_buf, *recv_buf;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 10) return 0;
  int nranks = 1 + data[0] % 8, rank = data[1] % nranks, kind = data[2] % 5;
  ac_shm_dtype_t dt = (ac_shm_dtype_t)(data[3] % 7); /* 6 is not a dtype */
  ac_redop_t op = (ac_redop_t)(data[4] % 5);
  size_t count = (size_t)(data[5] | (data[6] << 8)) % 6000;
  int root = data[7] % (nranks + 1); /* nranks: an invalid root */
  size_t slot_bytes = 4096 * (size_t)(1 + data[8] % 4);
  /* every absent-peer input sleeps on the futex (a trip through the scheduler, long on a loaded
   * machine), and mutants keep byte 9: tie it to the length too, so that only a few of an absent
   * seed's descendants pay it */
  int allow_absent = data[9] == 1 && size % 16 == 0;
  const uint8_t *p = data + 10, *end = data + size;

  /* the segment as rank 0 lays it out (ac_shm_create) */
  size_t header = sizeof(shm_header_t) + (size_t)nranks * sizeof(rank_line_t);
  size_t data_offset = (header + 4095) & ~(size_t)4095;
  size_t total = data_offset + (size_t)nranks * slot_bytes;
  unsigned char *seg = reuse(&seg_buf, MAX_SEGMENT, 4096, total);
  memset(seg, 0, total);
  shm_header_t *h = (shm_header_t *)seg;
  h->version = SHM_VERSION;
  h->nranks = (uint32_t)nranks;
  h->slot_bytes = slot_bytes;
  h->data_offset = data_offset;
  h->total_bytes = total;
  atomic_store(&h->magic, SHM_MAGIC);
  atomic_store(&h->attached, (uint32_t)nranks);
  for (int q = 0; q < nranks; q++) atomic_store(&h->ranks[q].pid, (int32_t)getpid());
  ac_shm_t *c = calloc(1, sizeof *c);
  CHECK(c);
  c->h = h;
  c->map_bytes = total;
  c->nranks = nranks;
  c->rank = rank;
  c->half_bytes = slot_bytes / 2;
  c->data_offset = data_offset;
  c->timeout_ms = 0; /* see YIELD_S above: a peer that is absent stays absent */
  snprintf(c->name, sizeof c->name, "/fuzz");

  /* the peer's garbage: patches over the header and rank lines, then the slots */
  while (p + 2 <= end && p[0] != 0xff) {
    size_t off = (size_t)p[0] * 2 % header, len = p[1] % 16;
    p += 2;
    for (size_t i = 0; i < len && p < end; i++, p++)
      if (off + i < header) seg[off + i] = *p;
  }
  if (p < end) p++;
  for (size_t i = 0; p < end && i < total - data_offset; i++, p++) seg[data_offset + i] ^= *p;
  if (!allow_absent) /* peers arrived (at whatever count, as long as it is ahead) */
    for (int q = 0; q < nranks; q++)
      if (q != rank) atomic_store(&h->ranks[q].arrive, atomic_load(&h->ranks[q].arrive) | (1ULL << 62));

  size_t es = ac_shm_dtype_size(dt) ? ac_shm_dtype_size(dt) : 1;
  size_t counts[8];
  size_t gather_total = 0;
  for (int q = 0; q < nranks; q++) gather_total += counts[q] = (count + (size_t)q * 7) % 700;
  size_t nsend = kind == 1 ? count * (size_t)nranks : kind == 2 ? counts[rank] : count;
  size_t nrecv = kind == 2 ? gather_total : count;
  unsigned char *send = reuse(&send_buf, MAX_SEND, 0, nsend * es + 1);
  unsigned char *recv = reuse(&recv_buf, MAX_RECV, 0, nrecv * es + 1);
  memset(send, 0x3c, nsend * es + 1);
  ac_result_t r = AC_OK;
  switch (kind) {
    case 0: r = ac_shm_all_reduce(c, send, recv, count, dt, op); break;
    case 1: r = ac_shm_reduce_scatter(c, send, recv, count, dt, op); break;
    case 2: r = ac_shm_all_gather(c, send, recv, counts, dt); break;
    case 3: r = ac_shm_broadcast(c, recv, count, dt, root); break;
    case 4: r = ac_shm_barrier(c); break;
  }
  if (r != AC_OK) {
    CHECK(r == AC_ERR_COMM || r == AC_ERR_TIMEOUT || r == AC_ERR_STATE || r == AC_ERR_INVALID_ARG ||
          r == AC_ERR_UNSUPPORTED);
    CHECK(ac_last_error() && ac_last_error()[0]);
    /* once failed, the communicator refuses further use rather than running on a torn state */
    if (r == AC_ERR_COMM || r == AC_ERR_TIMEOUT) CHECK(ac_shm_barrier(c) == AC_ERR_STATE);
  }
  free(c);
  return 0;
}

/* comm_shm.c — collectives through one POSIX shared-memory segment per group (ac/comm_shm.h).
 *
 * Segment: a header (magic, sizes, the futex word, one cache line per rank: its arrival count,
 * the collective it is in, its pid), then one slot per rank. A slot is two halves; consecutive
 * pieces of a collective alternate between them. A rank writes a half again only two pieces
 * later, after the first barrier of the piece in between, which no rank reaches before it has
 * finished reading the half: so a piece of a broadcast, all-gather or reduce-scatter needs one
 * barrier (the data is in the slots), and a piece of an all-reduce two (the data is in the
 * slots; each rank's reduced slice is in place). Every collective ends with one more barrier,
 * after which no rank reads a slot, so the next collective starts from a quiet segment.
 *
 * Barrier: a rank raises its own arrival count (seq_cst), bumps the futex word and wakes sleepers
 * if any are registered; it then waits for every other rank's count to reach the same value:
 * 20 us of spinning, 300 us of sched_yield() (ranks often outnumber cores), then futex sleeps of
 * at most 10 ms, each followed by the deadline and dead-peer checks. The sleeper registers itself before
 * it reads the futex word and re-checks the count after, and the waker bumps the word before it
 * reads the sleeper count (all seq_cst), so a wake-up is never lost; the 10 ms cap is a second
 * guard, not the mechanism. */
#define _GNU_SOURCE
#include "ac/comm_shm.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "comm_shm_reduce.h"
#include "comm_shm_window.h"

#define SHM_MAGIC 0x3176636d68735f61ULL /* "a_shmcv1" */
#define SHM_VERSION 2u /* 2: rank_line_t.where */
#define SPIN_CHECK 64  /* spin turns between clock reads */
#define SPIN_S 20e-6    /* spin this long */
/* The fuzz target (tests/c/fuzz_shm_header.c, which includes this file) shortens these two, so
 * that an input whose peers never arrive costs a fraction of a millisecond, not 10 ms. */
#ifndef YIELD_S
#define YIELD_S 300e-6  /* then yield the core this long (ranks often outnumber cores) */
#endif
#ifndef SLEEP_NS
#define SLEEP_NS 10000000L
#endif
#define SMALL_BYTES 131072 /* at most this: every rank reduces the whole message itself */
#define ALIGN_ELEMS 16

typedef struct {
  _Atomic uint64_t arrive; /* barriers this rank has arrived at */
  _Atomic uint64_t tag;    /* (collective number << 24) | a hash of its kind and arguments */
  _Atomic int32_t pid;     /* at byte 16 (tests/c/test_comm_shm.c writes a peer's by hand) */
  int32_t unused;
  /* a reduce-scatter's input: 0 in private memory, else (window serial + 1) << 40 | its offset
   * in the window (elements); read by the others after the collective's first barrier */
  _Atomic uint64_t where;
  char pad[64 - 4 * sizeof(uint64_t)];
} rank_line_t;

typedef struct {
  _Atomic uint64_t magic; /* written last by the creator (release) */
  uint32_t version, nranks;
  uint64_t slot_bytes, data_offset, total_bytes;
  _Atomic uint32_t attached;
  _Atomic uint32_t wake; /* the futex word */
  _Atomic uint32_t sleepers;
  char pad[64 - 8 - 8 - 24 - 12];
  rank_line_t ranks[];
} shm_header_t;

struct ac_shm {
  shm_header_t *h;
  size_t map_bytes;
  int nranks, rank;
  size_t half_bytes;
  size_t data_offset; /* this rank's own copy: the header's can be overwritten by a peer */
  uint64_t seq;   /* barriers passed */
  uint64_t ncoll; /* collectives started */
  int half;       /* the slot half the next piece uses */
  int timeout_ms;
  int broken;
  _Atomic int aborted; /* ac_shm_abort: fail at once */
  const char *what; /* the collective now running, for messages */
  unsigned nwindows; /* windows made so far (ac_shm_next_window_name; not the progress thread's) */
  _Atomic uint64_t window_ops; /* collectives that took a window path (ac_shm_window_ops) */
  char name[AC_SHM_NAME_MAX];
};

_Static_assert(sizeof(rank_line_t) == 64, "one cache line per rank");
_Static_assert(offsetof(rank_line_t, pid) == 16, "the pid where the tests' hand-written peers put it");
_Static_assert(sizeof(shm_header_t) == 64, "the header's fixed part is one cache line");

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

static unsigned char *slot(const ac_shm_t *c, int q, int half) {
  /* c->data_offset, not the header's: a peer that scribbles over the header must not move the
   * slots outside this rank's mapping */
  return (unsigned char *)c->h + c->data_offset + (size_t)q * 2 * c->half_bytes + (size_t)half * c->half_bytes;
}

/* ---- creation ---------------------------------------------------------------------------- */
static ac_result_t check_name(const char *name) {
  if (!name || name[0] != '/')
    return AC_FAIL(AC_ERR_INVALID_ARG, "shm name must start with '/', got '%s'", name ? name : "(null)");
  size_t n = strlen(name);
  if (n < 2 || n >= AC_SHM_NAME_MAX)
    return AC_FAIL(AC_ERR_INVALID_ARG, "shm name '%s' must have 1 to %d characters after '/'", name,
                   AC_SHM_NAME_MAX - 2);
  for (size_t i = 1; i < n; i++) {
    char ch = name[i];
    int ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '.' ||
             ch == '_' || ch == '-';
    if (!ok) return AC_FAIL(AC_ERR_INVALID_ARG, "shm name '%s': character %zu ('%c') is not [A-Za-z0-9._-]", name, i, ch);
  }
  return AC_OK;
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Opens (rank 0: creates and sizes) the segment file; *fd on success. */
ac_result_t ac_shm_open_segment(const char *name, int rank, size_t total, double deadline, int *fd) {
  if (rank == 0) {
    int f = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (f < 0)
      return AC_FAIL(errno == EEXIST ? AC_ERR_STATE : AC_ERR_IO, "shm_open('%s', create): %s%s", name, strerror(errno),
                     errno == EEXIST ? " (another group uses this name)" : "");
    /* posix_fallocate reserves the pages now: a full /dev/shm is an error here, not a SIGBUS
     * at the first touch of a page in the middle of a collective */
    int e = ftruncate(f, (off_t)total) < 0 ? errno : posix_fallocate(f, 0, (off_t)total);
    if (e) {
      close(f);
      shm_unlink(name);
      return AC_FAIL_HINT(e == ENOSPC || e == EFBIG ? AC_ERR_NOMEM : AC_ERR_IO,
                          "enlarge /dev/shm (docker: --shm-size) or use a smaller slot",
                          "shm segment '%s' of %zu bytes: %s", name, total, strerror(e));
    }
    *fd = f;
    return AC_OK;
  }
  for (;;) {
    int f = shm_open(name, O_RDWR, 0600);
    if (f >= 0) {
      struct stat st;
      if (fstat(f, &st) == 0 && (size_t)st.st_size >= total) {
        *fd = f;
        return AC_OK;
      }
      close(f);
    } else if (errno != ENOENT) {
      return AC_FAIL(AC_ERR_IO, "shm_open('%s'): %s", name, strerror(errno));
    }
    if (now_s() > deadline)
      return AC_FAIL(AC_ERR_TIMEOUT, "rank %d: shm segment '%s' was not created by rank 0 in time", rank, name);
    sleep_ms(1);
  }
}

ac_result_t ac_shm_create(ac_shm_t **out, const char *name, int nranks, int rank, size_t slot_bytes,
                          int timeout_ms) {
  if (!out) return AC_FAIL(AC_ERR_INVALID_ARG, "out is NULL");
  *out = NULL;
  AC_CHECK(check_name(name));
  if (nranks < 1 || nranks > AC_SHM_MAX_RANKS)
    return AC_FAIL(AC_ERR_INVALID_ARG, "nranks %d is not in 1..%d", nranks, AC_SHM_MAX_RANKS);
  if (rank < 0 || rank >= nranks) return AC_FAIL(AC_ERR_INVALID_ARG, "rank %d is not in 0..%d", rank, nranks - 1);
  if (slot_bytes < 4096 || slot_bytes % 128 != 0 || slot_bytes > ((size_t)1 << 34))
    return AC_FAIL(AC_ERR_INVALID_ARG, "slot_bytes %zu must be a multiple of 128 in [4096, 2^34]", slot_bytes);
  if (timeout_ms <= 0) return AC_FAIL(AC_ERR_INVALID_ARG, "timeout_ms %d must be positive", timeout_ms);
  size_t header = sizeof(shm_header_t) + (size_t)nranks * sizeof(rank_line_t);
  size_t data_offset = (header + 4095) & ~(size_t)4095;
  size_t total = data_offset + (size_t)nranks * slot_bytes;
  double deadline = now_s() + timeout_ms * 1e-3;

  ac_shm_t *c = calloc(1, sizeof *c);
  if (!c) return AC_FAIL(AC_ERR_NOMEM, "ac_shm_t");
  snprintf(c->name, sizeof c->name, "%s", name);
  c->nranks = nranks;
  c->rank = rank;
  c->half_bytes = slot_bytes / 2;
  c->data_offset = data_offset;
  c->timeout_ms = timeout_ms;
  int fd = -1;
  ac_result_t r = ac_shm_open_segment(name, rank, total, deadline, &fd);
  if (r != AC_OK) {
    free(c);
    return r;
  }
  void *map = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int map_errno = errno;
  close(fd);
  if (map == MAP_FAILED) {
    if (rank == 0) shm_unlink(name);
    free(c);
    return AC_FAIL(AC_ERR_IO, "mmap of shm segment '%s' (%zu bytes): %s", name, total, strerror(map_errno));
  }
  c->h = map;
  c->map_bytes = total;
  shm_header_t *h = c->h;
  if (rank == 0) {
    h->version = SHM_VERSION;
    h->nranks = (uint32_t)nranks;
    h->slot_bytes = slot_bytes;
    h->data_offset = data_offset;
    h->total_bytes = total;
    atomic_store_explicit(&h->magic, SHM_MAGIC, memory_order_release);
  } else {
    while (atomic_load_explicit(&h->magic, memory_order_acquire) != SHM_MAGIC) {
      if (now_s() > deadline) {
        r = AC_FAIL(AC_ERR_TIMEOUT, "rank %d: shm segment '%s' has no valid header", rank, name);
        goto fail;
      }
      sleep_ms(1);
    }
    if (h->version != SHM_VERSION || h->nranks != (uint32_t)nranks || h->slot_bytes != slot_bytes ||
        h->data_offset != data_offset || h->total_bytes != total) {
      r = AC_FAIL(AC_ERR_INVALID_ARG,
                  "rank %d: shm segment '%s' was made for %u ranks with %llu-byte slots (version %u); this rank "
                  "asked for %d ranks with %zu-byte slots",
                  rank, name, h->nranks, (unsigned long long)h->slot_bytes, h->version, nranks, slot_bytes);
      goto fail;
    }
  }
  atomic_store(&h->ranks[rank].pid, (int32_t)getpid());
  if (atomic_fetch_add(&h->attached, 1) + 1 == (uint32_t)nranks) shm_unlink(name); /* every rank has it mapped */
  while (atomic_load(&h->attached) < (uint32_t)nranks) {
    if (now_s() > deadline) {
      char who[256] = "";
      size_t used = 0;
      for (int q = 0; q < nranks && used < sizeof who - 12; q++)
        if (atomic_load(&h->ranks[q].pid) == 0) used += (size_t)snprintf(who + used, sizeof who - used, " %d", q);
      if (rank == 0) shm_unlink(name); /* the job is failing: leave nothing behind */
      r = AC_FAIL(AC_ERR_TIMEOUT, "rank %d: shm group '%s': rank(s)%s did not join within %.1f s", rank, name, who,
                  timeout_ms * 1e-3);
      goto fail;
    }
    sleep_ms(1);
  }
  *out = c;
  return AC_OK;
fail:
  munmap(c->h, c->map_bytes);
  free(c);
  return r;
}

void ac_shm_next_window_name(ac_shm_t *c, char *name, size_t cap, int *timeout_ms, unsigned *serial) {
  /* a window name stays within AC_SHM_NAME_MAX: the group's name is cut short if need be (the
   * counter keeps the windows of one group apart; the group's random part, the groups) */
  *serial = c->nwindows;
  snprintf(name, cap, "%.*s-w%u", AC_SHM_NAME_MAX - 16, c->name, c->nwindows++);
  *timeout_ms = c->timeout_ms;
}

double ac_shm_now_s(void) { return now_s(); }

void ac_shm_destroy(ac_shm_t *c) {
  if (!c) return;
  if (c->h) munmap(c->h, c->map_bytes);
  free(c);
}

void ac_shm_abort(ac_shm_t *c) {
  if (!c) return;
  atomic_store(&c->aborted, 1);
  /* a waiter asleep on the futex sees the flag at its next wake-up (at most 10 ms) */
}

int ac_shm_size(const ac_shm_t *c) { return c ? c->nranks : 0; }
int ac_shm_rank(const ac_shm_t *c) { return c ? c->rank : -1; }

ac_result_t ac_shm_set_timeout(ac_shm_t *c, int timeout_ms) {
  if (!c) return AC_FAIL(AC_ERR_INVALID_ARG, "communicator is NULL");
  if (timeout_ms <= 0) return AC_FAIL(AC_ERR_INVALID_ARG, "timeout_ms %d must be positive", timeout_ms);
  c->timeout_ms = timeout_ms;
  return AC_OK;
}

/* ---- synchronisation ---------------------------------------------------------------------- */
static long futex(_Atomic uint32_t *addr, int op, uint32_t val, const struct timespec *ts) {
  return syscall(SYS_futex, (uint32_t *)addr, op, val, ts, NULL, 0);
}

/* Whether process `pid` has ended: gone, or a zombie its parent has not reaped yet (a launcher
 * reaps a killed rank only at its next poll, and then stops the others: the zombie is the early
 * sign). Ranks are processes of one host in one pid namespace (threads share the caller's pid,
 * which is alive). */
static int pid_dead(int32_t pid) {
  if (pid <= 0) return 0;
  if (kill(pid, 0) < 0) return errno == ESRCH;
  char path[64], buf[256];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = 0;
  const char *p = strrchr(buf, ')'); /* "pid (comm) S ...": comm may hold spaces and parentheses */
  return p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
}

/* Fails the running collective: the ranks whose arrival count is below `target` are named. */
static ac_result_t fail_wait(ac_shm_t *c, uint64_t target, int dead) {
  char who[512] = "";
  size_t used = 0;
  for (int q = 0; q < c->nranks && used < sizeof who - 24; q++) {
    if (atomic_load(&c->h->ranks[q].arrive) >= target) continue;
    int32_t pid = atomic_load(&c->h->ranks[q].pid);
    used += (size_t)snprintf(who + used, sizeof who - used, "%s%d%s", used ? ", " : "", q,
                             pid_dead(pid) ? " (its process is gone)" : "");
  }
  c->broken = 1;
  if (dead)
    return AC_FAIL(AC_ERR_COMM, "shm %s (collective #%llu on rank %d of %d, group '%s'): peer rank %s died", c->what,
                   (unsigned long long)c->ncoll, c->rank, c->nranks, c->name, who);
  return AC_FAIL(AC_ERR_TIMEOUT, "shm %s (collective #%llu on rank %d of %d, group '%s'): rank %s did not arrive "
                 "within %.1f s", c->what, (unsigned long long)c->ncoll, c->rank, c->nranks, c->name, who,
                 c->timeout_ms * 1e-3);
}

static ac_result_t barrier(ac_shm_t *c) {
  shm_header_t *h = c->h;
  uint64_t target = ++c->seq;
  atomic_store(&h->ranks[c->rank].arrive, target);
  atomic_fetch_add(&h->wake, 1);
  if (atomic_load(&h->sleepers)) futex(&h->wake, FUTEX_WAKE, INT_MAX, NULL);
  for (int q = 0; q < c->nranks; q++) {
    if (q == c->rank) continue;
    unsigned spins = 0;
    double started = -1.0;
    while (atomic_load_explicit(&h->ranks[q].arrive, memory_order_acquire) < target) {
      /* spin, then yield, for a bounded time each (the clock read every SPIN_CHECK turns),
       * then sleep on the futex */
      if (++spins % SPIN_CHECK != 0) {
        cpu_relax();
        continue;
      }
      double t = now_s();
      if (started < 0) started = t;
      if (t - started < SPIN_S) continue;
      if (t - started < SPIN_S + YIELD_S) {
        sched_yield();
        continue;
      }
      atomic_fetch_add(&h->sleepers, 1);
      uint32_t w = atomic_load(&h->wake);
      if (atomic_load(&h->ranks[q].arrive) < target) {
        struct timespec ts = {0, SLEEP_NS};
        futex(&h->wake, FUTEX_WAIT, w, &ts);
      }
      atomic_fetch_sub(&h->sleepers, 1);
      /* arrived while this rank slept: done with it, even if it has exited since (a rank may
       * leave right after its last collective; its death is only an error before it arrives) */
      if (atomic_load_explicit(&h->ranks[q].arrive, memory_order_acquire) >= target) break;
      if (atomic_load(&c->aborted)) {
        c->broken = 1;
        return AC_FAIL(AC_ERR_STATE, "shm %s (collective #%llu, group '%s'): the communicator was closed while "
                       "waiting for its peers", c->what, (unsigned long long)c->ncoll, c->name);
      }
      if (pid_dead(atomic_load(&h->ranks[q].pid))) return fail_wait(c, target, 1);
      if (now_s() - started > c->timeout_ms * 1e-3) return fail_wait(c, target, 0);
    }
  }
  return AC_OK;
}

enum { K_ALL_REDUCE = 1, K_REDUCE_SCATTER, K_ALL_GATHER, K_BROADCAST, K_BARRIER, K_WINDOW_ALL_REDUCE,
       K_WINDOW_ALL_GATHER };

/* Starts a collective: publishes what this rank is calling, so that the first barrier can check
 * that every rank calls the same thing. */
static ac_result_t begin(ac_shm_t *c, const char *what, uint64_t kind, uint64_t a, uint64_t b, uint64_t d) {
  if (!c) return AC_FAIL(AC_ERR_INVALID_ARG, "communicator is NULL");
  if (c->broken || atomic_load(&c->aborted))
    return AC_FAIL(AC_ERR_STATE, "shm group '%s' on rank %d: closed, or an earlier collective failed; the group cannot be used "
                   "any more", c->name, c->rank);
  shm_header_t *h = c->h;
  /* the fixed part of the header never changes after create: a different value means a peer
   * (or anything else mapping the segment) wrote over it, and nothing read from it can be trusted */
  if (atomic_load(&h->magic) != SHM_MAGIC || h->version != SHM_VERSION || h->nranks != (uint32_t)c->nranks ||
      h->slot_bytes != 2 * c->half_bytes || h->data_offset != c->data_offset || h->total_bytes != c->map_bytes) {
    c->broken = 1;
    return AC_FAIL(AC_ERR_COMM, "shm %s (group '%s', rank %d): the segment header was overwritten (magic %#llx, "
                   "version %u, %u ranks, %llu-byte slots, data at %llu of %llu bytes); expected version %u, %d "
                   "ranks, %zu-byte slots, data at %zu of %zu bytes",
                   what, c->name, c->rank, (unsigned long long)atomic_load(&h->magic), h->version, h->nranks,
                   (unsigned long long)h->slot_bytes, (unsigned long long)h->data_offset,
                   (unsigned long long)h->total_bytes, SHM_VERSION, c->nranks, 2 * c->half_bytes, c->data_offset,
                   c->map_bytes);
  }
  c->what = what;
  c->ncoll++;
  c->half = 0;
  uint64_t x = kind * 0x9E3779B97F4A7C15ULL;
  x = (x ^ a) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ b) * 0x94D049BB133111EBULL;
  x = (x ^ d) * 0x9E3779B97F4A7C15ULL;
  atomic_store(&c->h->ranks[c->rank].tag, (c->ncoll << 24) | ((x >> 40) & 0xffffffu));
  return AC_OK;
}

/* After the first barrier of a collective: every rank that is still in it called the same. A rank
 * already in a later one agreed (it made the same comparison against this rank's tag). */
static ac_result_t check_tags(ac_shm_t *c) {
  uint64_t mine = atomic_load(&c->h->ranks[c->rank].tag);
  for (int q = 0; q < c->nranks; q++) {
    uint64_t t = atomic_load(&c->h->ranks[q].tag);
    if ((t >> 24) == (mine >> 24) && t != mine) {
      c->broken = 1;
      return AC_FAIL(AC_ERR_COMM, "shm %s (collective #%llu, group '%s'): rank %d called a different collective or "
                     "passed different counts, dtype, op or root than rank %d", c->what,
                     (unsigned long long)c->ncoll, c->name, q, c->rank);
    }
  }
  return AC_OK;
}

/* The first barrier of a collective also checks the tags. */
static ac_result_t first_barrier(ac_shm_t *c) {
  AC_CHECK(barrier(c));
  return check_tags(c);
}


static ac_result_t check_buf(const void *p, size_t n, const char *what) {
  if (n > 0 && !p) return AC_FAIL(AC_ERR_INVALID_ARG, "%s is NULL for %zu elements", what, n);
  if (n > SIZE_MAX / 8 / AC_SHM_MAX_RANKS) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: %zu elements is too many", what, n);
  return AC_OK;
}

/* Elements per piece that fit in a half slot, a multiple of `mult` * ALIGN_ELEMS. */
static size_t piece_elems(const ac_shm_t *c, size_t es, size_t mult) {
  size_t p = c->half_bytes / es / mult;
  return p - p % ALIGN_ELEMS;
}

/* Rank q's slice [*lo, *hi) of m elements split among n ranks: equal slices rounded up to
 * ALIGN_ELEMS (each starts on a 64-byte boundary of an aligned buffer), the last ones shorter or
 * empty. Every rank computes every slice alike, so no slice is reduced twice or missed. */
static void slice_of(size_t m, int n, int q, size_t *lo, size_t *hi) {
  size_t sl = (m + (size_t)n - 1) / (size_t)n;
  sl = (sl + ALIGN_ELEMS - 1) / ALIGN_ELEMS * ALIGN_ELEMS;
  *lo = (size_t)q * sl < m ? (size_t)q * sl : m;
  *hi = *lo + sl < m ? *lo + sl : m;
}

/* ---- the collectives -------------------------------------------------------------------------- */
/* The checks and the start of a reduction (all-reduce, reduce-scatter): count elements per buffer. */
static ac_result_t begin_reduction(ac_shm_t *c, const char *what, uint64_t kind, const void *send, void *recv,
                                   size_t count, ac_shm_dtype_t dt, ac_redop_t op, ac_shm_reduce_fn *fn) {
  AC_CHECK(ac_shm_check_op(dt, op, fn));
  AC_CHECK(check_buf(send, count, "send"));
  AC_CHECK(check_buf(recv, count, "recv"));
  return begin(c, what, kind, count, (uint64_t)dt, (uint64_t)op);
}

/* A collective with nothing to move: its arguments are still checked against the other ranks'. */
static ac_result_t empty(ac_shm_t *c) {
  AC_CHECK(first_barrier(c));
  return barrier(c);
}

ac_result_t ac_shm_all_reduce(ac_shm_t *c, const void *send, void *recv, size_t count, ac_shm_dtype_t dt,
                              ac_redop_t op) {
  ac_shm_reduce_fn fn;
  AC_CHECK(begin_reduction(c, "all_reduce", K_ALL_REDUCE, send, recv, count, dt, op, &fn));
  size_t es = ac_shm_dtype_size(dt);
  int n = c->nranks;
  const void *src[AC_SHM_MAX_RANKS];
  if (count == 0) return empty(c);
  if (count * es <= SMALL_BYTES && count * es <= c->half_bytes) {
    /* latency path: one copy in, and every rank reduces the whole message itself (the same
     * operations in the same order everywhere, so the same bits) */
    memcpy(slot(c, c->rank, 0), send, count * es);
    AC_CHECK(first_barrier(c));
    for (int q = 0; q < n; q++) src[q] = slot(c, q, 0);
    fn(recv, src, n, count, op);
    return barrier(c);
  }
  size_t piece = piece_elems(c, es, 1);
  for (size_t off = 0; off < count; off += piece) {
    size_t m = count - off < piece ? count - off : piece;
    int hf = c->half;
    memcpy(slot(c, c->rank, hf), (const unsigned char *)send + off * es, m * es);
    AC_CHECK(off == 0 ? first_barrier(c) : barrier(c));
    /* this rank reduces its slice of the piece, in place in its own slot (no other rank reads
     * that range of this slot until the next barrier) */
    size_t lo, hi;
    slice_of(m, n, c->rank, &lo, &hi);
    if (hi > lo) {
      for (int q = 0; q < n; q++) src[q] = slot(c, q, hf) + lo * es;
      fn(slot(c, c->rank, hf) + lo * es, src, n, hi - lo, op);
    }
    AC_CHECK(barrier(c));
    for (int q = 0; q < n; q++) {
      size_t a, b;
      slice_of(m, n, q, &a, &b);
      if (b > a) memcpy((unsigned char *)recv + (off + a) * es, slot(c, q, hf) + a * es, (b - a) * es);
    }
    c->half ^= 1;
  }
  return barrier(c);
}

/* The copy path's piece [off, off + m) of every rank's chunk of `send` into this rank's slot half
 * now in use, chunk q at q * m. */
static void copy_rs_piece(ac_shm_t *c, const void *send, size_t count, size_t off, size_t m, size_t es) {
  unsigned char *mine = slot(c, c->rank, c->half);
  for (int q = 0; q < c->nranks; q++)
    memcpy(mine + (size_t)q * m * es, (const unsigned char *)send + ((size_t)q * count + off) * es, m * es);
}

/* A reduce-scatter, whose input may lie in a window (w, offset: then `send` is this rank's region
 * at `offset`). Every rank first says where its input is and passes one barrier (which also
 * checks that all call the same); when every rank's input is at the same place of the same
 * window, each reduces its chunk from every region where it is (no copy in or out: one barrier
 * more); otherwise, whatever mix the ranks brought (a staging buffer is taken during backward,
 * where ranks need not agree), all take the slots: one barrier more than a reduce-scatter whose
 * every rank's input is private, which pays none. */
static ac_result_t reduce_scatter_at(ac_shm_t *c, ac_shm_window_t *w, size_t offset, const void *send, void *recv,
                                     size_t count, ac_shm_dtype_t dt, ac_redop_t op) {
  ac_shm_reduce_fn fn;
  AC_CHECK(begin_reduction(c, "reduce_scatter", K_REDUCE_SCATTER, send, recv, count, dt, op, &fn));
  size_t es = ac_shm_dtype_size(dt);
  int n = c->nranks;
  const void *src[AC_SHM_MAX_RANKS];
  uint64_t where = w ? (((uint64_t)w->serial + 1) << 40) | (uint64_t)offset : 0;
  atomic_store(&c->h->ranks[c->rank].where, where);
  if (count == 0) return empty(c);
  size_t piece = piece_elems(c, es, (size_t)n);
  if (piece == 0) return AC_FAIL(AC_ERR_INVALID_ARG, "shm slot of %zu bytes is too small for %d ranks",
                                 c->half_bytes * 2, n);
  /* A private input's first piece goes into the slot before the first barrier, as it always did,
   * so that a reduce-scatter where no rank has a window pays no barrier more. */
  size_t m0 = count < piece ? count : piece;
  if (!w) copy_rs_piece(c, send, count, 0, m0, es);
  AC_CHECK(first_barrier(c)); /* every rank's `where` is published; no rank moves on before all read it */
  int together = where != 0, all_private = 1;
  for (int q = 0; q < n; q++) {
    uint64_t theirs = atomic_load(&c->h->ranks[q].where);
    together = together && theirs == where;
    all_private = all_private && theirs == 0;
  }
  if (together) {
    /* Only this rank writes its chunk (of its own region or of recv) until the last barrier, and
     * the sources are read block by block before that block of recv is written (recv may be
     * this rank's chunk of its own region: in place). */
    for (int q = 0; q < n; q++) src[q] = ac_shm_window_region(w, q) + (offset + (size_t)c->rank * count) * es;
    fn(recv, src, n, count, op);
    atomic_fetch_add(&c->window_ops, 1);
    return barrier(c); /* every chunk is reduced; no region is written before every rank has read it */
  }
  if (!all_private) { /* a mix: the window ranks' first piece goes in now, then every rank waits for it */
    if (w) copy_rs_piece(c, send, count, 0, m0, es);
    AC_CHECK(barrier(c));
  }
  /* every rank computes the same all_private and together: the same barriers everywhere */
  for (size_t off = 0; off < count; off += piece) {
    size_t m = count - off < piece ? count - off : piece;
    int hf = c->half;
    if (off > 0) {
      copy_rs_piece(c, send, count, off, m, es);
      AC_CHECK(barrier(c));
    }
    for (int q = 0; q < n; q++) src[q] = slot(c, q, hf) + (size_t)c->rank * m * es;
    fn((unsigned char *)recv + off * es, src, n, m, op);
    c->half ^= 1;
  }
  return barrier(c);
}

/* The arguments every window collective checks before it starts: a valid dtype, a window of this
 * group and rank, and `chunks` runs of `count` elements from `offset` inside the window. */
static ac_result_t window_args(const ac_shm_t *c, const ac_shm_window_t *w, const char *what, ac_shm_dtype_t dt,
                               size_t offset, size_t chunks, size_t count) {
  size_t es = ac_shm_dtype_size(dt);
  if (es == 0) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: invalid dtype code %d", what, (int)dt);
  if (!c || !w) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: communicator or window is NULL", what);
  if (w->nranks != c->nranks || w->rank != c->rank)
    return AC_FAIL(AC_ERR_INVALID_ARG, "%s: the window is rank %d of %d, the group rank %d of %d", what, w->rank,
                   w->nranks, c->rank, c->nranks);
  size_t room = w->usable_bytes / es;
  if (offset > room || count > (room - offset) / chunks)
    return AC_FAIL(AC_ERR_INVALID_ARG, "%s: %zu run(s) of %zu elements at %zu of %s are outside the window's %zu bytes",
                   what, chunks, count, offset, ac_shm_dtype_name(dt), w->usable_bytes);
  return AC_OK;
}

ac_result_t ac_shm_reduce_scatter(ac_shm_t *c, const void *send, void *recv, size_t count, ac_shm_dtype_t dt,
                                  ac_redop_t op) {
  return reduce_scatter_at(c, NULL, 0, send, recv, count, dt, op);
}

ac_result_t ac_shm_window_reduce_scatter(ac_shm_t *c, ac_shm_window_t *w, size_t offset, void *recv, size_t count,
                                         ac_shm_dtype_t dt, ac_redop_t op) {
  AC_CHECK(window_args(c, w, "window reduce_scatter", dt, offset, c ? (size_t)c->nranks : 1, count));
  if (offset >= ((uint64_t)1 << 40)) /* `where` keeps 40 bits of it */
    return AC_FAIL(AC_ERR_INVALID_ARG, "window reduce_scatter: offset %zu is too large", offset);
  size_t es = ac_shm_dtype_size(dt);
  return reduce_scatter_at(c, w, offset, ac_shm_window_region(w, c->rank) + offset * es, recv, count, dt, op);
}

ac_result_t ac_shm_all_gather(ac_shm_t *c, const void *send, void *recv, const size_t *counts, ac_shm_dtype_t dt) {
  size_t es = ac_shm_dtype_size(dt);
  if (es == 0) return AC_FAIL(AC_ERR_INVALID_ARG, "invalid dtype code %d", (int)dt);
  if (!c) return AC_FAIL(AC_ERR_INVALID_ARG, "communicator is NULL");
  if (!counts) return AC_FAIL(AC_ERR_INVALID_ARG, "counts is NULL");
  int n = c->nranks;
  size_t total = 0, most = 0;
  uint64_t hash = 0;
  AC_CHECK(check_buf(send, counts[c->rank], "send"));
  for (int q = 0; q < n; q++) {
    if (counts[q] > SIZE_MAX / 8 / AC_SHM_MAX_RANKS)
      return AC_FAIL(AC_ERR_INVALID_ARG, "counts[%d] = %zu is too many elements", q, counts[q]);
    total += counts[q];
    most = counts[q] > most ? counts[q] : most;
    hash = (hash ^ counts[q]) * 0x100000001B3ULL;
  }
  AC_CHECK(check_buf(recv, total, "recv"));
  AC_CHECK(begin(c, "all_gather", K_ALL_GATHER, hash, (uint64_t)dt, total));
  size_t piece = piece_elems(c, es, 1);
  if (most == 0) return empty(c);
  for (size_t off = 0; off < most; off += piece) {
    int hf = c->half;
    size_t mine = counts[c->rank] > off ? counts[c->rank] - off : 0;
    mine = mine < piece ? mine : piece;
    if (mine) memcpy(slot(c, c->rank, hf), (const unsigned char *)send + off * es, mine * es);
    AC_CHECK(off == 0 ? first_barrier(c) : barrier(c));
    size_t displ = 0;
    for (int q = 0; q < n; q++) {
      size_t m = counts[q] > off ? counts[q] - off : 0;
      m = m < piece ? m : piece;
      if (m) memmove((unsigned char *)recv + (displ + off) * es, slot(c, q, hf), m * es);
      displ += counts[q];
    }
    c->half ^= 1;
  }
  return barrier(c);
}

ac_result_t ac_shm_broadcast(ac_shm_t *c, void *buf, size_t count, ac_shm_dtype_t dt, int root) {
  size_t es = ac_shm_dtype_size(dt);
  if (es == 0) return AC_FAIL(AC_ERR_INVALID_ARG, "invalid dtype code %d", (int)dt);
  if (!c) return AC_FAIL(AC_ERR_INVALID_ARG, "communicator is NULL");
  if (root < 0 || root >= c->nranks) return AC_FAIL(AC_ERR_INVALID_ARG, "root %d is not in 0..%d", root, c->nranks - 1);
  AC_CHECK(check_buf(buf, count, "buf"));
  AC_CHECK(begin(c, "broadcast", K_BROADCAST, count, (uint64_t)dt, (uint64_t)root));
  if (count == 0) return empty(c);
  size_t piece = piece_elems(c, es, 1);
  for (size_t off = 0; off < count; off += piece) {
    size_t m = count - off < piece ? count - off : piece;
    int hf = c->half;
    if (c->rank == root) memcpy(slot(c, root, hf), (unsigned char *)buf + off * es, m * es);
    AC_CHECK(off == 0 ? first_barrier(c) : barrier(c));
    if (c->rank != root) memcpy((unsigned char *)buf + off * es, slot(c, root, hf), m * es);
    c->half ^= 1;
  }
  return barrier(c);
}

/* Elements reduced, then written to every region, at a time: the block is still in cache when it
 * is copied out (256 KiB of fp32). */
#define WINDOW_BLOCK 65536

ac_result_t ac_shm_window_all_reduce(ac_shm_t *c, ac_shm_window_t *w, size_t offset, size_t count,
                                     ac_shm_dtype_t dt, ac_redop_t op) {
  ac_shm_reduce_fn fn;
  AC_CHECK(ac_shm_check_op(dt, op, &fn));
  AC_CHECK(window_args(c, w, "window all_reduce", dt, offset, 1, count));
  size_t es = ac_shm_dtype_size(dt);
  /* the window's serial is part of what every rank must agree on: two windows reduced at the
   * same offset would otherwise each be half-reduced */
  AC_CHECK(begin(c, "window all_reduce", K_WINDOW_ALL_REDUCE, count,
                 (uint64_t)dt | ((uint64_t)op << 8) | ((uint64_t)w->serial << 16), offset));
  if (count == 0) return empty(c);
  int n = c->nranks;
  AC_CHECK(first_barrier(c)); /* every rank's range is in its region */
  atomic_fetch_add(&c->window_ops, 1);
  size_t lo, hi;
  slice_of(count, n, c->rank, &lo, &hi);
  /* Only this rank reads or writes its slice of the range in any region until the next barrier
   * (every rank keeps to its own slice), so the result can go straight into every region. */
  const void *src[AC_SHM_MAX_RANKS];
  for (size_t i = lo; i < hi; i += WINDOW_BLOCK) {
    size_t m = hi - i < WINDOW_BLOCK ? hi - i : WINDOW_BLOCK;
    size_t at = (offset + i) * es;
    for (int q = 0; q < n; q++) src[q] = ac_shm_window_region(w, q) + at;
    unsigned char *mine = ac_shm_window_region(w, c->rank) + at;
    fn(mine, src, n, m, op);
    for (int q = 0; q < n; q++)
      if (q != c->rank) memcpy(ac_shm_window_region(w, q) + at, mine, m * es);
  }
  return barrier(c); /* every slice is everywhere; no rank touches the range before this */
}

ac_result_t ac_shm_window_all_gather(ac_shm_t *c, ac_shm_window_t *w, size_t offset, size_t chunk,
                                     ac_shm_dtype_t dt) {
  AC_CHECK(window_args(c, w, "window all_gather", dt, offset, c ? (size_t)c->nranks : 1, chunk));
  size_t es = ac_shm_dtype_size(dt);
  int n = c->nranks;
  AC_CHECK(begin(c, "window all_gather", K_WINDOW_ALL_GATHER, chunk, (uint64_t)dt | ((uint64_t)w->serial << 16),
                 offset));
  if (chunk == 0) return empty(c);
  AC_CHECK(first_barrier(c)); /* every rank's chunk is in its region */
  atomic_fetch_add(&c->window_ops, 1);
  unsigned char *mine = ac_shm_window_region(w, c->rank) + offset * es;
  /* starting after this rank's own chunk, so ranks do not all read rank 0's chunk at once */
  for (int k = 1; k < n; k++) {
    int q = (c->rank + k) % n;
    size_t at = (size_t)q * chunk * es;
    memcpy(mine + at, ac_shm_window_region(w, q) + offset * es + at, chunk * es);
  }
  return barrier(c); /* every chunk was read where it is; its owner may write it again */
}

uint64_t ac_shm_window_ops(const ac_shm_t *c) { return c ? atomic_load(&c->window_ops) : 0; }

ac_result_t ac_shm_barrier(ac_shm_t *c) {
  AC_CHECK(begin(c, "barrier", K_BARRIER, 0, 0, 0));
  return first_barrier(c);
}

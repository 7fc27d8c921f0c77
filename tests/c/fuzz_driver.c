/* fuzz_driver.c — the built-in fuzzing driver for machines without libFuzzer (tests/c/fuzz.sh
 * links it with any fuzz_*.c target when clang's -fsanitize=fuzzer is missing, e.g. gcc-only CI).
 *
 *   fuzz_X_standalone -t SECONDS [-n MAX_EXECS] [-o NEW_DIR] [-a CRASH_PREFIX] [-x DICT]
 *                     [-m MAX_LEN] SEED_DIR...
 *
 * Coverage guided when the target was compiled with gcc's -fsanitize-coverage=trace-pc (fuzz.sh
 * does that for the target and the core sources it tests, not for this file): every executed
 * edge (previous PC, this PC) is hashed into a byte map, and a mutant that sets a byte never set
 * before joins the in-memory corpus and, with -o, is written to NEW_DIR (so a long campaign
 * grows tests/c/corpus/<target>/). Without that instrumentation it still runs, as a blind
 * mutator. Why not AFL or honggfuzz: CI must build with nothing but gcc and the sanitizers.
 *
 * A crash (sanitizer report, __builtin_trap from a broken invariant, abort) saves the input that
 * caused it to CRASH_PREFIX<crash-HASH> before the process dies, so it can be replayed with
 *   fuzz_X_standalone -r FILE
 * which runs the target once on FILE. Exit status: 0 when the time (or -n) ran out without a
 * crash; the sanitizer's or the signal's status otherwise. */
#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* ---- coverage (gcc -fsanitize-coverage=trace-pc calls this at every basic block) ---------- */
enum { MAP = 1 << 16 };
static uint8_t cov[MAP];   /* edges seen by the current input */
static uint8_t seen[MAP];  /* edges seen by any input so far */
static uintptr_t prev_pc;
static int have_cov;

void __sanitizer_cov_trace_pc(void);
void __sanitizer_cov_trace_pc(void) {
  uintptr_t pc = (uintptr_t)__builtin_return_address(0);
  cov[(pc ^ prev_pc) & (MAP - 1)] = 1;
  prev_pc = pc >> 1; /* shifted so that A->B and B->A hash apart */
  have_cov = 1;
}

/* 1 when the last execution reached an edge no earlier one did (and records it). */
static int new_coverage(void) {
  int fresh = 0;
  for (size_t i = 0; i < MAP; i += 8) {
    uint64_t w;
    memcpy(&w, cov + i, 8);
    if (!w) continue;
    for (size_t k = i; k < i + 8; k++)
      if (cov[k] && !seen[k]) {
        seen[k] = 1;
        fresh = 1;
      }
    memset(cov + i, 0, 8);
  }
  return fresh;
}

/* ---- crash capture ------------------------------------------------------------------------ */
static const uint8_t *cur_data;
static size_t cur_size;
static char crash_prefix[3072] = "./";

static uint64_t fnv1a(const uint8_t *p, size_t n) {
  uint64_t h = 1469598103934665603ULL;
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ULL;
  return h;
}

/* Async-signal-safe enough: open/write/close only, the name built without stdio. */
static void save_current(void) {
  if (!cur_data) return;
  char path[4096];
  size_t lp = strlen(crash_prefix);
  if (lp > sizeof path - 32) return;
  memcpy(path, crash_prefix, lp);
  memcpy(path + lp, "crash-", 6);
  lp += 6;
  uint64_t h = fnv1a(cur_data, cur_size);
  for (int i = 15; i >= 0; i--, h >>= 4) path[lp + (size_t)i] = "0123456789abcdef"[h & 15];
  path[lp + 16] = 0;
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd >= 0) {
    ssize_t w = write(fd, cur_data, cur_size);
    (void)w;
    close(fd);
  }
  static const char msg[] = "\n== fuzz driver: the crashing input is saved as ";
  ssize_t w1 = write(2, msg, sizeof msg - 1), w2 = write(2, path, strlen(path)), w3 = write(2, "\n", 1);
  (void)w1, (void)w2, (void)w3;
  cur_data = NULL;
}

void __sanitizer_set_death_callback(void (*callback)(void));

static void on_signal(int sig) {
  save_current();
  signal(sig, SIG_DFL);
  raise(sig);
}

/* ---- corpus, dictionary, mutations -------------------------------------------------------- */
typedef struct {
  uint8_t *p;
  size_t n;
} blob;

static uint64_t rng_state = 88172645463325252ULL;
static uint64_t rnd(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}

static blob *corpus, *dict;
static size_t ncorpus, capc, ndict, capd;

static void add(blob **arr, size_t *n, size_t *cap, const uint8_t *p, size_t len) {
  if (*n == *cap) {
    *cap = *cap ? 2 * *cap : 64;
    *arr = realloc(*arr, *cap * sizeof **arr);
    if (!*arr) abort();
  }
  (*arr)[*n].p = malloc(len ? len : 1);
  if (!(*arr)[*n].p) abort();
  memcpy((*arr)[*n].p, p, len);
  (*arr)[*n].n = len;
  (*n)++;
}

static uint8_t *load_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  uint8_t *out = n >= 0 ? malloc((size_t)n + 1) : NULL;
  *len = (out && fread(out, 1, (size_t)n, f) == (size_t)n) ? (size_t)n : 0;
  fclose(f);
  return out;
}

/* libFuzzer dictionary lines: name="token" with \" \\ and \xNN escapes. */
static void load_dict(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) {
    perror(path);
    exit(2);
  }
  char line[512];
  while (fgets(line, sizeof line, f)) {
    char *q = strchr(line, '"');
    if (!q || line[0] == '#') continue;
    uint8_t tok[256];
    size_t n = 0;
    for (q++; *q && *q != '"' && n < sizeof tok; q++) {
      if (*q == '\\' && q[1] == 'x' && q[2] && q[3]) {
        char hx[3] = {q[2], q[3], 0};
        tok[n++] = (uint8_t)strtol(hx, NULL, 16);
        q += 3;
      } else if (*q == '\\' && q[1]) {
        tok[n++] = (uint8_t)*++q;
      } else {
        tok[n++] = (uint8_t)*q;
      }
    }
    add(&dict, &ndict, &capd, tok, n);
  }
  fclose(f);
}

/* Text mutations (the JSON targets) and binary ones (the struct-building targets: little-endian
 * integers at the edges of their ranges). */
static size_t mutate(uint8_t *buf, size_t n, size_t cap) {
  static const uint8_t interesting[] = {'"', '\\', '{', '}', '[', ']', ',', ':', '-', '0', '9', ' ',
                                        0,   1,    2,   0x7f, 0x80, 0xff, 0xc3, 0xed, 'e', '.'};
  static const uint64_t edges[] = {0, 1, 2, 3, 7, 8, 15, 16, 64, 255, 256, 4096, 0x7fff, 0x8000, 0xffff,
                                   0x7fffffffULL, 0x80000000ULL, 0xffffffffULL, 0x7fffffffffffffffULL,
                                   0x8000000000000000ULL, ~0ULL};
  int rounds = 1 + (int)(rnd() % 4);
  for (int r = 0; r < rounds; r++) {
    switch (rnd() % 9) {
      case 0: if (n) buf[rnd() % n] ^= (uint8_t)(1u << (rnd() % 8)); break;
      case 1: if (n) buf[rnd() % n] = interesting[rnd() % sizeof interesting]; break;
      case 2: /* insert a byte */
        if (n < cap) {
          size_t at = n ? rnd() % (n + 1) : 0;
          memmove(buf + at + 1, buf + at, n - at);
          buf[at] = (uint8_t)rnd();
          n++;
        }
        break;
      case 3: /* delete a run */
        if (n > 1) {
          size_t at = rnd() % n, len = 1 + rnd() % 8;
          if (at + len > n) len = n - at;
          memmove(buf + at, buf + at + len, n - at - len);
          n -= len;
        }
        break;
      case 4: /* dictionary token */
        if (ndict) {
          const blob *t = &dict[rnd() % ndict];
          if (n + t->n <= cap) {
            size_t at = n ? rnd() % (n + 1) : 0;
            memmove(buf + at + t->n, buf + at, n - at);
            memcpy(buf + at, t->p, t->n);
            n += t->n;
          }
        }
        break;
      case 5: /* splice: tail of another corpus entry */
        if (ncorpus && n) {
          const blob *o = &corpus[rnd() % ncorpus];
          size_t at = rnd() % n, from = o->n ? rnd() % o->n : 0, len = o->n - from;
          if (at + len > cap) len = cap - at;
          memcpy(buf + at, o->p + from, len);
          n = at + len;
        }
        break;
      case 6: /* duplicate a run (repeated entries, nesting) */
        if (n > 2) {
          size_t at = rnd() % n, len = 1 + rnd() % 32;
          if (at + len > n) len = n - at;
          if (n + len <= cap) {
            memmove(buf + at + len, buf + at, n - at);
            n += len;
          }
        }
        break;
      case 7: /* an edge-of-range integer, 1, 2, 4 or 8 bytes, little-endian */
        if (n) {
          size_t w = (size_t)1 << (rnd() % 4), at = rnd() % n;
          uint64_t v = edges[rnd() % (sizeof edges / sizeof *edges)];
          if (rnd() & 1) v = 0 - v; /* the negative of the edge, two's complement */
          for (size_t i = 0; i < w && at + i < n; i++) buf[at + i] = (uint8_t)(v >> (8 * i));
        }
        break;
      case 8: /* a small arithmetic step on one byte */
        if (n) buf[rnd() % n] += (uint8_t)(rnd() % 17) - 8;
        break;
    }
  }
  return n;
}

static void save_new(const char *dir, const uint8_t *p, size_t n) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%016llx", dir, (unsigned long long)fnv1a(p, n));
  FILE *f = fopen(path, "wb");
  if (!f) return;
  if (fwrite(p, 1, n, f) != n) fprintf(stderr, "short write to %s\n", path);
  fclose(f);
}

static void run_input(const uint8_t *p, size_t n) {
  cur_data = p;
  cur_size = n;
  LLVMFuzzerTestOneInput(p, n);
  cur_data = NULL;
}

static void load_dir(const char *dir, size_t max_len) {
  DIR *d = opendir(dir);
  if (!d) return; /* an output directory not made yet */
  struct dirent *e;
  char path[4096];
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    size_t n;
    uint8_t *p = load_file(path, &n);
    if (p) {
      if (n > max_len) n = max_len;
      add(&corpus, &ncorpus, &capc, p, n);
      free(p);
    }
  }
  closedir(d);
}

int main(int argc, char **argv) {
  double secs = 10;
  unsigned long long max_execs = 0;
  const char *out_dir = NULL, *replay = NULL;
  size_t max_len = 4096;
  int opt;
  while ((opt = getopt(argc, argv, "t:n:o:a:x:m:r:")) != -1) {
    switch (opt) {
      case 't': secs = atof(optarg); break;
      case 'n': max_execs = strtoull(optarg, NULL, 10); break;
      case 'o': out_dir = optarg; break;
      case 'a': snprintf(crash_prefix, sizeof crash_prefix, "%s", optarg); break;
      case 'x': load_dict(optarg); break;
      case 'm': max_len = (size_t)strtoull(optarg, NULL, 10); break;
      case 'r': replay = optarg; break;
      default:
        fprintf(stderr, "usage: %s -t SECONDS [-n EXECS] [-o NEW_DIR] [-a CRASH_PREFIX] [-x DICT] [-m MAX_LEN] "
                        "SEED_DIR... | -r FILE\n", argv[0]);
        return 2;
    }
  }
  __sanitizer_set_death_callback(save_current);
  signal(SIGILL, on_signal); /* __builtin_trap: a broken invariant */
  signal(SIGABRT, on_signal);
  signal(SIGFPE, on_signal);
  if (replay) {
    size_t n;
    uint8_t *p = load_file(replay, &n);
    if (!p) {
      perror(replay);
      return 2;
    }
    LLVMFuzzerTestOneInput(p, n);
    free(p);
    printf("replayed %s (%zu bytes): no crash\n", replay, n);
    return 0;
  }
  if (max_len < 16) max_len = 16;
  for (int i = optind; i < argc; i++) load_dir(argv[i], max_len);
  if (!ncorpus) {
    fprintf(stderr, "no seeds in the given directories\n");
    return 2;
  }
  if (out_dir) mkdir(out_dir, 0755);
  size_t nseeds = ncorpus;
  for (size_t i = 0; i < nseeds; i++) {
    run_input(corpus[i].p, corpus[i].n);
    new_coverage();
  }
  rng_state ^= (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
  if (!rng_state) rng_state = 1;
  uint8_t *buf = malloc(max_len);
  if (!buf) abort();
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  unsigned long long execs = 0, found = 0;
  for (;;) {
    const blob *b = &corpus[rnd() % ncorpus];
    size_t n = b->n < max_len ? b->n : max_len;
    memcpy(buf, b->p, n);
    n = mutate(buf, n, max_len);
    run_input(buf, n);
    if (have_cov) {
      if (new_coverage() && ncorpus < 65536) {
        add(&corpus, &ncorpus, &capc, buf, n);
        if (out_dir) save_new(out_dir, buf, n);
        found++;
      }
    } else if (ncorpus < 4096 && n > 3 && (rnd() % 64) == 0) {
      /* blind mode: keep a few mutants so mutations stack up and reach deeper states */
      add(&corpus, &ncorpus, &capc, buf, n);
    }
    ++execs;
    if (max_execs && execs >= max_execs) break;
    if ((execs & 255) == 0) {
      clock_gettime(CLOCK_MONOTONIC, &t1);
      if ((double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec) >= secs) break;
    }
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double el = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
  size_t edges = 0;
  for (size_t i = 0; i < MAP; i++) edges += seen[i];
  printf("standalone fuzz: %llu executions in %.1f s (%.0f/s), %s %zu edges, %zu seeds + %llu new inputs, no crash\n",
         execs, el, el > 0 ? (double)execs / el : 0.0, have_cov ? "coverage" : "no coverage (blind mutation),",
         edges, nseeds, found);
  free(buf);
  for (size_t i = 0; i < ncorpus; i++) free(corpus[i].p);
  for (size_t i = 0; i < ndict; i++) free(dict[i].p);
  free(corpus);
  free(dict);
  return 0;
}

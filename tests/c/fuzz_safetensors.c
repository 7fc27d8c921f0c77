/* fuzz_safetensors.c — fuzz target for the safetensors header parser (ac_st_header_parse).
 *
 * Built with clang -fsanitize=fuzzer,address,undefined it is a libFuzzer target; built with
 * -DAC_FUZZ_STANDALONE (any compiler) it is its own random-mutation driver:
 *   fuzz_safetensors_standalone SECONDS CORPUS_DIR [DICT_FILE]
 * tests/c/fuzz.sh picks whichever the machine can build.
 *
 * Input format (so mutations reach the JSON instead of mostly breaking the 8-byte length):
 *   byte 0 odd : the rest is a whole file image, passed as is;
 *   byte 0 even: bytes 1-2 are a little-endian data-region size D, the rest is the JSON header;
 *                the harness prepends the matching 8-byte length and declares D data bytes.
 * After a successful parse the harness checks the invariants the reader relies on and traps if
 * one fails (a parser bug that the sanitizers alone would not see). */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ac/safetensors.h"

static void check_invariants(const ac_st_header_t *h, uint64_t file_size) {
  size_t n = ac_st_header_count(h);
  uint64_t start = ac_st_header_data_start(h);
  if (start < 8 || start > file_size) __builtin_trap();
  uint64_t data = file_size - start, pos = 0;
  for (size_t i = 0; i < n; i++) {
    ac_st_info_t info;
    if (ac_st_header_info(h, i, &info) != AC_OK) __builtin_trap();
    if (info.begin > info.end || info.end > data || info.nbytes != info.end - info.begin) __builtin_trap();
    if (info.file_offset != start + info.begin) __builtin_trap();
    uint64_t want = ac_st_dtype_size(info.dtype);
    if (!want) __builtin_trap();
    for (int32_t d = 0; d < info.ndim; d++) {
      if (info.shape[d] < 0) __builtin_trap();
      want *= (uint64_t)info.shape[d]; /* cannot overflow: the parser checked */
    }
    if (want != info.nbytes) __builtin_trap();
    if (info.nbytes) { /* indices are in offset order and the ranges tile the region */
      if (info.begin != pos) __builtin_trap();
      pos = info.end;
    }
    size_t idx;
    if (ac_st_header_find(h, info.name, &idx) != AC_OK || idx != i) __builtin_trap();
  }
  if (pos != data) __builtin_trap();
  for (size_t i = 0; i < ac_st_header_metadata_count(h); i++) {
    const char *k, *v;
    if (ac_st_header_metadata(h, i, &k, &v) != AC_OK || !k || !v) __builtin_trap();
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  ac_st_header_t *h = NULL;
  if (data[0] & 1) {
    if (ac_st_header_parse(&h, data + 1, size - 1, size - 1, "<fuzz>") == AC_OK) check_invariants(h, size - 1);
  } else {
    if (size < 3) return 0;
    uint64_t dsize = (uint64_t)data[1] | ((uint64_t)data[2] << 8);
    size_t jlen = size - 3;
    uint8_t *img = malloc(8 + jlen + 1);
    if (!img) return 0;
    for (int i = 0; i < 8; i++) img[i] = (uint8_t)((uint64_t)jlen >> (8 * i));
    memcpy(img + 8, data + 3, jlen);
    /* only the header is in memory; the declared data region is never read by the parser */
    if (ac_st_header_parse(&h, img, 8 + jlen, 8 + jlen + dsize, "<fuzz>") == AC_OK)
      check_invariants(h, 8 + jlen + dsize);
    free(img);
  }
  ac_st_header_destroy(h);
  return 0;
}

#ifdef AC_FUZZ_STANDALONE
/* A small mutation fuzzer for machines without libFuzzer: byte flips, interesting bytes,
 * insertions, deletions, dictionary tokens and splices between corpus entries. */
#include <dirent.h>
#include <time.h>

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

static blob *corpus;
static size_t ncorpus;
static blob *dict;
static size_t ndict;

static void add(blob **arr, size_t *n, size_t *cap, const uint8_t *p, size_t len) {
  if (*n == *cap) {
    *cap = *cap ? 2 * *cap : 64;
    *arr = realloc(*arr, *cap * sizeof **arr);
    if (!*arr) exit(2);
  }
  (*arr)[*n].p = malloc(len ? len : 1);
  if (!(*arr)[*n].p) exit(2);
  memcpy((*arr)[*n].p, p, len);
  (*arr)[*n].n = len;
  (*n)++;
}

static int load_file(const char *path, uint8_t **out, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return -1;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  *out = malloc((size_t)n + 1);
  *len = (*out && fread(*out, 1, (size_t)n, f) == (size_t)n) ? (size_t)n : 0;
  fclose(f);
  return 0;
}

/* libFuzzer dictionary lines: name="token" with \" \\ and \xNN escapes. */
static void load_dict(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) return;
  char line[512];
  size_t capd = 0;
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

static size_t mutate(uint8_t *buf, size_t n, size_t cap) {
  int rounds = 1 + (int)(rnd() % 4);
  for (int r = 0; r < rounds; r++) {
    switch (rnd() % 7) {
      case 0: if (n) buf[rnd() % n] ^= (uint8_t)(1u << (rnd() % 8)); break;
      case 1: {
        static const uint8_t interesting[] = {'"', '\\', '{', '}', '[', ']', ',', ':', '-', '0', '9', ' ', 0, 0xff, 0xc3, 0xed, 'e', '.'};
        if (n) buf[rnd() % n] = interesting[rnd() % sizeof interesting];
        break;
      }
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
    }
  }
  return n;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s SECONDS CORPUS_DIR [DICT]\n", argv[0]);
    return 2;
  }
  double secs = atof(argv[1]);
  if (argc > 3) load_dict(argv[3]);
  size_t capc = 0;
  DIR *d = opendir(argv[2]);
  if (!d) {
    perror(argv[2]);
    return 2;
  }
  struct dirent *e;
  char path[4096];
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    snprintf(path, sizeof path, "%s/%s", argv[2], e->d_name);
    uint8_t *p;
    size_t n;
    if (load_file(path, &p, &n) == 0 && p) {
      add(&corpus, &ncorpus, &capc, p, n);
      free(p);
    }
  }
  closedir(d);
  if (!ncorpus) {
    fprintf(stderr, "empty corpus %s\n", argv[2]);
    return 2;
  }
  for (size_t i = 0; i < ncorpus; i++) LLVMFuzzerTestOneInput(corpus[i].p, corpus[i].n);
  rng_state ^= (uint64_t)time(NULL);
  enum { CAP = 8192 };
  static uint8_t buf[CAP];
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  unsigned long long execs = 0;
  for (;;) {
    const blob *b = &corpus[rnd() % ncorpus];
    size_t n = b->n < CAP ? b->n : CAP;
    memcpy(buf, b->p, n);
    n = mutate(buf, n, CAP);
    LLVMFuzzerTestOneInput(buf, n);
    /* keep a few mutants as seeds, so mutations stack up and reach deeper states */
    if (ncorpus < 4096 && n > 3 && (rnd() % 64) == 0) add(&corpus, &ncorpus, &capc, buf, n);
    if ((++execs & 1023) == 0) {
      clock_gettime(CLOCK_MONOTONIC, &t1);
      if ((double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec) >= secs) break;
    }
  }
  printf("standalone fuzz: %llu executions, corpus %zu, no crash\n", execs, ncorpus);
  for (size_t i = 0; i < ncorpus; i++) free(corpus[i].p);
  for (size_t i = 0; i < ndict; i++) free(dict[i].p);
  free(corpus);
  free(dict);
  return 0;
}
#endif

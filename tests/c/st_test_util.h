/* st_test_util.h — what the safetensors test programs (test_safetensors_*.c) share: a private
 * temporary directory per program, whole-file reads and writes, counting what a save left in
 * the directory, and the ACCELERATE_C_DIRECT_IO knob. Header only, like test_util.h, so the
 * CHECKs in these helpers count in the including program's current test.
 *
 * Each program defines _GNU_SOURCE before its first include (mkdtemp, setrlimit, ftruncate,
 * memfd_create under -std=c11) and ends its table with TU_CASE(cleanup), a TEST that calls
 * st_remove_tmpdir(): the rmdir fails if any test left a file behind. */
#ifndef AC_ST_TEST_UTIL_H
#define AC_ST_TEST_UTIL_H

#ifndef _GNU_SOURCE
#error "define _GNU_SOURCE before the first include: the helpers need mkdtemp"
#endif

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ac/safetensors.h"
#include "test_util.h"

#define DIO_ENV "ACCELERATE_C_DIRECT_IO"
#define SMALL_CHUNK ((size_t)3 * 4096) /* so tests cross chunk boundaries with small files */

static char g_dir[256];

static inline const char *tmpdir(void) {
  if (!g_dir[0]) {
    snprintf(g_dir, sizeof g_dir, "/tmp/ac_st_test_XXXXXX");
    if (!mkdtemp(g_dir)) {
      perror("mkdtemp");
      g_dir[0] = '\0';
      return "/tmp";
    }
  }
  return g_dir;
}

static inline void path_of(char *buf, size_t n, const char *name) { snprintf(buf, n, "%s/%s", tmpdir(), name); }

/* Entries of the test directory other than . and .., and how many look like temp files. */
static inline int dir_count(int *temps) {
  DIR *d = opendir(tmpdir());
  int n = 0;
  *temps = 0;
  if (!d) return -1;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    n++;
    if (strstr(e->d_name, ".tmp")) (*temps)++;
  }
  closedir(d);
  return n;
}

static inline void clear_dir(void) {
  DIR *d = opendir(tmpdir());
  if (!d) return;
  struct dirent *e;
  char p[512];
  while ((e = readdir(d))) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    snprintf(p, sizeof p, "%s/%s", tmpdir(), e->d_name);
    unlink(p);
  }
  closedir(d);
}

static inline unsigned char *read_whole(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *b = malloc((size_t)n + 1);
  if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
    free(b);
    b = NULL;
  }
  fclose(f);
  *len = (size_t)n;
  return b;
}

static inline void write_whole(const char *path, const void *p, size_t n) {
  FILE *f = fopen(path, "wb");
  if (!f) return;
  if (n) fwrite(p, 1, n, f);
  fclose(f);
}

/* Length of the file one U8 tensor "x" of n bytes makes (written buffered). */
static inline size_t u8_file_len(unsigned char *data, size_t n) {
  char p[512];
  path_of(p, sizeof p, "probe.safetensors");
  int64_t shape[1] = {(int64_t)n};
  ac_st_tensor_t t = {"x", AC_ST_U8, 1, shape, data, AC_ST_HOST, 0};
  setenv(DIO_ENV, "0", 1);
  size_t len = 0;
  if (CHECK_OK(ac_st_save(p, &t, 1, NULL, 0, 1))) {
    struct stat st;
    if (CHECK(stat(p, &st) == 0)) len = (size_t)st.st_size;
  }
  unsetenv(DIO_ENV);
  unlink(p);
  return len;
}

/* The last test of every program: the directory must be empty by then. */
static inline void st_remove_tmpdir(void) {
  clear_dir();
  CHECK(rmdir(tmpdir()) == 0);
}

#endif /* AC_ST_TEST_UTIL_H */

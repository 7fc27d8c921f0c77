/* fsync_log.c — an LD_PRELOAD shim for the tests: logs every fsync, fdatasync and rename of the
 * process (the C core's and Python's alike) to the file named by $FSYNC_LOG, one line each:
 *
 *   fsync<TAB>/abs/path           (the descriptor's path, from /proc/self/fd)
 *   rename<TAB>/abs/src<TAB>/abs/dst
 *
 * so a test can check the order of a durable write: the file fsynced before its rename, the
 * directory fsynced after. Built by tests/test_durable.py with the system cc. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void fd_path(int fd, char *out, size_t cap) {
  char link[64];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, out, cap - 1);
  out[n > 0 ? (size_t)n : 0] = '\0';
}

/* An absolute spelling of `p` relative to `dirfd` (AT_FDCWD: the working directory). */
static void abs_path(int dirfd, const char *p, char *out, size_t cap) {
  if (p[0] == '/') {
    snprintf(out, cap, "%s", p);
    return;
  }
  char dir[PATH_MAX];
  if (dirfd == AT_FDCWD) {
    if (!getcwd(dir, sizeof dir)) dir[0] = '\0';
  } else {
    fd_path(dirfd, dir, sizeof dir);
  }
  snprintf(out, cap, "%s/%s", dir, p);
}

static void log_line(const char *line) {
  const char *log = getenv("FSYNC_LOG");
  if (!log) return;
  int saved = errno;
  int fd = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd >= 0) {
    /* one write with O_APPEND: lines from several threads never interleave */
    ssize_t w = write(fd, line, strlen(line));
    (void)w;
    close(fd);
  }
  errno = saved;
}

static void log_sync(const char *what, int fd) {
  char p[PATH_MAX], line[PATH_MAX + 32];
  fd_path(fd, p, sizeof p);
  snprintf(line, sizeof line, "%s\t%s\n", what, p);
  log_line(line);
}

static void log_rename(int ofd, const char *a, int nfd, const char *b) {
  char pa[PATH_MAX], pb[PATH_MAX], line[2 * PATH_MAX + 16];
  abs_path(ofd, a, pa, sizeof pa);
  abs_path(nfd, b, pb, sizeof pb);
  snprintf(line, sizeof line, "rename\t%s\t%s\n", pa, pb);
  log_line(line);
}

typedef int (*fd_fn)(int);
typedef int (*rename_fn)(const char *, const char *);
typedef int (*renameat_fn)(int, const char *, int, const char *);
typedef int (*renameat2_fn)(int, const char *, int, const char *, unsigned);

#define REAL(name, type) \
  static type real_ = NULL; \
  if (!real_) real_ = (type)dlsym(RTLD_NEXT, name)

int fsync(int fd) {
  REAL("fsync", fd_fn);
  int rc = real_(fd);
  if (rc == 0) log_sync("fsync", fd);
  return rc;
}

int fdatasync(int fd) {
  REAL("fdatasync", fd_fn);
  int rc = real_(fd);
  if (rc == 0) log_sync("fsync", fd); /* as good as fsync for the data and the size */
  return rc;
}

int rename(const char *a, const char *b) {
  REAL("rename", rename_fn);
  int rc = real_(a, b);
  if (rc == 0) log_rename(AT_FDCWD, a, AT_FDCWD, b);
  return rc;
}

int renameat(int ofd, const char *a, int nfd, const char *b) {
  REAL("renameat", renameat_fn);
  int rc = real_(ofd, a, nfd, b);
  if (rc == 0) log_rename(ofd, a, nfd, b);
  return rc;
}

int renameat2(int ofd, const char *a, int nfd, const char *b, unsigned flags) {
  REAL("renameat2", renameat2_fn);
  int rc = real_(ofd, a, nfd, b, flags);
  if (rc == 0) log_rename(ofd, a, nfd, b);
  return rc;
}

/* durable.c — atomic, durable publication of one file (see ac/durable.h). */
#define _GNU_SOURCE /* O_CLOEXEC, O_DIRECTORY, strndup; must precede every system header */
#include "ac/durable.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Process-wide: two threads (or two calls) never get the same name, and O_EXCL makes another
 * process (another host's same pid on a shared file system) pick the next one. */
static atomic_uint tmp_counter;

ac_result_t ac_durable_open(const char *path, int extra_flags, char **tmp_out, int *fd_out) {
  *tmp_out = NULL;
  *fd_out = -1;
  if (!path || !*path) return AC_FAIL(AC_ERR_INVALID_ARG, "durable write: empty path");
  const char *slash = strrchr(path, '/');
  size_t dirlen = slash ? (size_t)(slash - path) + 1 : 0;
  const char *base = path + dirlen;
  if (!*base) return AC_FAIL(AC_ERR_INVALID_ARG, "%s: the path names a directory, not a file", path);
  size_t cap = strlen(path) + 64;
  char *tmp = malloc(cap);
  if (!tmp) return AC_FAIL(AC_ERR_NOMEM, "%s: out of memory", path);
  for (int attempt = 0; attempt < 100; attempt++) {
    unsigned k = atomic_fetch_add(&tmp_counter, 1);
    /* hidden (leading dot) and ending in ".tmp": a crash never leaves something that looks like
     * the real file */
    snprintf(tmp, cap, "%.*s.%s.%ld.%u.tmp", (int)dirlen, path, base, (long)getpid(), k);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | extra_flags, 0666);
    if (fd >= 0) {
      *tmp_out = tmp;
      *fd_out = fd;
      return AC_OK;
    }
    if (extra_flags && errno == EINVAL) {
      unlink(tmp); /* old tmpfs kernels create the file before refusing the flag */
      *tmp_out = tmp;
      return AC_OK;
    }
    if (errno != EEXIST) {
      int e = errno;
      ac_result_t r = AC_FAIL(AC_ERR_IO, "%s: cannot create the temporary file %s: %s", path, tmp, strerror(e));
      free(tmp);
      return r;
    }
  }
  free(tmp);
  return AC_FAIL(AC_ERR_IO, "%s: could not find a free temporary file name", path);
}

static int fsync_dir_errno(const char *dir) {
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno;
  int e = 0;
  if (fsync(fd) != 0 && errno != EINVAL) e = errno;
  close(fd);
  return e;
}

ac_result_t ac_fsync_dir(const char *dir) {
  int e = fsync_dir_errno(dir);
  if (e) return AC_FAIL(AC_ERR_IO, "%s: fsync of the directory failed: %s", dir, strerror(e));
  return AC_OK;
}

ac_result_t ac_durable_publish(const char *path, char **tmp, int *fd) {
  if (fsync(*fd) != 0) return AC_FAIL(AC_ERR_IO, "%s: fsync of %s failed: %s", path, *tmp, strerror(errno));
  int rc = close(*fd);
  *fd = -1;
  if (rc != 0) /* NFS and friends report deferred write errors here */
    return AC_FAIL(AC_ERR_IO, "%s: close of %s failed: %s", path, *tmp, strerror(errno));
  if (rename(*tmp, path) != 0)
    return AC_FAIL(AC_ERR_IO, "%s: renaming %s into place failed: %s", path, *tmp, strerror(errno));
  free(*tmp);
  *tmp = NULL; /* renamed: nothing to remove any more */
  const char *slash = strrchr(path, '/');
  char *dir;
  if (!slash) dir = strdup(".");
  else if (slash == path) dir = strdup("/");
  else dir = strndup(path, (size_t)(slash - path));
  int e = dir ? fsync_dir_errno(dir) : ENOMEM;
  free(dir);
  if (e)
    return AC_FAIL_HINT(AC_ERR_IO, "the new file is complete and in place, but the rename may not survive a crash",
                        "%s: fsync of the parent directory failed: %s", path, strerror(e));
  return AC_OK;
}

int ac_write_all(int fd, const void *data, size_t n, uint64_t off) {
  const char *p = data;
  while (n) {
    ssize_t k = pwrite(fd, p, n, (off_t)off);
    if (k < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (k == 0) return EIO;
    p += k;
    n -= (size_t)k;
    off += (uint64_t)k;
  }
  return 0;
}

void ac_durable_discard(char **tmp, int *fd) {
  if (*fd >= 0) close(*fd);
  *fd = -1;
  if (*tmp) {
    unlink(*tmp);
    free(*tmp);
    *tmp = NULL;
  }
}

ac_result_t ac_durable_write(const char *path, const void *data, size_t n) {
  char *tmp = NULL;
  int fd = -1;
  ac_result_t r = ac_durable_open(path, 0, &tmp, &fd);
  if (r != AC_OK) return r;
  int e = ac_write_all(fd, data, n, 0);
  if (e) {
    r = AC_FAIL(AC_ERR_IO, "%s: writing %s failed: %s", path, tmp, strerror(e));
    ac_durable_discard(&tmp, &fd);
    return r;
  }
  r = ac_durable_publish(path, &tmp, &fd);
  ac_durable_discard(&tmp, &fd);
  return r;
}

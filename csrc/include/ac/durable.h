/* durable.h — atomic, durable publication of one file: the one protocol every writer uses (the
 * safetensors writer, and Python's accelerate_c.durable for JSON, torch.save and config files).
 *
 *   ac_durable_open     a fresh hidden temporary file next to the target, created with O_EXCL
 *                       under a name unique per process and per call (pid + a process-wide
 *                       counter): threads, and hosts sharing a file system, never share one
 *   (the caller writes)
 *   ac_durable_publish  fsync the file, close it, rename it over the target, fsync the directory
 *
 * A reader therefore sees the old file or the complete new one, never a mix, and after
 * ac_durable_publish returns both the data and the rename survive a crash. */
#ifndef AC_DURABLE_H
#define AC_DURABLE_H

#include <stddef.h>
#include <stdint.h>

#include "ac/ac.h"

/* Creates the temporary file for `path` with open(O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC |
 * extra_flags). On success *tmp_out (malloc'd name) and *fd_out are set. If `extra_flags` is
 * non-zero (O_DIRECT) and the file system refuses it with EINVAL, returns AC_OK with
 * *fd_out = -1 and *tmp_out set to the name, which does not exist. */
ac_result_t ac_durable_open(const char *path, int extra_flags, char **tmp_out, int *fd_out);

/* fsync(*fd), close(*fd), rename(*tmp, path), fsync of path's directory. *fd is -1 afterwards
 * whatever happens once the fsync succeeded; *tmp is freed and NULL once the rename succeeded.
 * On failure the caller closes a remaining *fd and unlinks and frees a remaining *tmp
 * (ac_durable_discard). A failed directory fsync is reported with the file already in place. */
ac_result_t ac_durable_publish(const char *path, char **tmp, int *fd);

/* pwrite of all `n` bytes at `off` (retrying short writes and EINTR): 0, or the errno (EIO for
 * a write that made no progress). */
int ac_write_all(int fd, const void *data, size_t n, uint64_t off);

/* Closes *fd if >= 0, unlinks and frees *tmp if set; both are reset. */
void ac_durable_discard(char **tmp, int *fd);

/* The whole protocol for a buffer in memory: open, write `n` bytes, publish; on failure the
 * temporary file is gone and `path` is untouched (or, after a failed directory fsync, complete). */
ac_result_t ac_durable_write(const char *path, const void *data, size_t n);

/* fsync of a directory, so renames and creations in it survive a crash. File systems that cannot
 * sync a directory (EINVAL) offer nothing more to do: AC_OK. */
ac_result_t ac_fsync_dir(const char *dir);

#endif

"""Atomic, durable files: the one protocol every writer of accelerate_c uses.

The C core implements it (csrc/core/durable.c) and the safetensors writer calls it there; the
functions here hand Python writers (JSON states, ``torch.save`` files, config files) the same
code: a fresh hidden temporary file next to the target (created with O_EXCL under a name unique
per process and per call, so threads and hosts sharing a file system never share one), the
bytes, fsync of the file, rename over the target, fsync of the directory. A reader sees the old
file or the complete new one; once a call returns, the data and the rename survive a crash.
"""
from __future__ import annotations

import os
from typing import Callable

from . import _C

__all__ = ["write_durable", "write_bytes_durable", "fsync_dir", "reserve_temp"]


def write_bytes_durable(path, data) -> None:
    """Publishes ``data`` (bytes-like) as ``path`` (in C, without the GIL)."""
    _C.durable_write(os.fspath(path), data)


def write_durable(path, write: Callable) -> None:
    """Publishes ``path`` with ``write(f)`` filling a binary file object (``torch.save(obj, f)``).
    On any failure the temporary file is removed and ``path`` is untouched."""
    path = os.fspath(path)
    fd, tmp = _C.durable_open(path)
    try:
        with open(fd, "wb", closefd=False) as f:
            write(f)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _C.durable_publish(path, tmp, fd)  # closes fd, and removes tmp on failure


def fsync_dir(directory) -> None:
    """fsyncs a directory, so the renames and creations in it survive a crash (a no-op on file
    systems that cannot sync one)."""
    _C.fsync_dir(os.fspath(directory))


def reserve_temp(path) -> str:
    """A hidden name next to ``path``, unique as the protocol's own temporary names are (an empty
    file is created there): for writers that must finish several files before renaming any
    (model_io's shards), which publish into it and rename it later themselves."""
    fd, tmp = _C.durable_open(os.fspath(path))
    os.close(fd)
    return tmp

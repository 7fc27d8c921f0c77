"""NCCL called from C: finding the library and building a communicator.

The C core loads NCCL at run time (csrc/core/comm_nccl.c): first the NCCL already in the
process (the one torch's CUDA build brought), then libnccl.so.2 from the loader's path, then,
here, the copy pip's nvidia-nccl package installs next to torch. The unique id that joins the
ranks travels through torch.distributed's store, as torch's own ProcessGroupNCCL does it.
"""
from __future__ import annotations

import glob
import itertools
import os
import sys

from . import _C

_ids = itertools.count()


def load() -> str:
    """Loads NCCL once; returns where it came from. A clear error when there is none."""
    try:
        return _C.nccl_load(None)
    except _C.CoreError as first:
        candidates = []
        for entry in sys.path:
            candidates += glob.glob(os.path.join(entry, "nvidia", "nccl", "lib", "libnccl.so*"))
        for path in sorted(candidates):
            try:
                return _C.nccl_load(path)
            except _C.CoreError:
                continue
        raise RuntimeError(f"accelerate_c needs NCCL for GPU gradient all-reduce: {first}") from first


def make_comm(store, rank: int, world: int) -> _C.NcclComm:
    """A communicator over every rank of the default process group (collective: all ranks call
    it in the same order). Rank 0 makes the unique id; the others read it from `store`."""
    load()
    key = f"accelerate_c/nccl_unique_id/{next(_ids)}"
    if rank == 0:
        uid = _C.nccl_unique_id()
        store.set(key, uid)
    else:
        uid = bytes(store.get(key))
    return _C.NcclComm(uid, world, rank)

"""The replicas' agreement under DDP and full sharding: every rank's model has rank src's
structure (an error naming the first difference, not a hang), rank src's weights go to every
rank at prepare, its buffers before each forward (broadcast_buffers)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import collectives


def check_same_structure(model: torch.nn.Module, src: int = 0, allow_meta: bool = False) -> list:
    """Checks that every rank's model has the same parameters and buffers (names, shapes,
    dtypes) as rank `src`'s, which holds real values; returns [(kind, name, tensor)]. A
    difference is an error naming the first one on every rank (not a hang). Tensors on the
    meta device (transformers' from_pretrained builds the model there on all but the main
    process when FSDP's cpu_ram_efficient_loading is on) are accepted on the other ranks only
    with allow_meta, by full sharding, which sends each process its shards from rank `src`."""
    tensors = [("parameter", n, t) for n, t in model.named_parameters()] + \
              [("buffer", n, t) for n, t in model.named_buffers()]
    # (what must agree, whether it is on meta); trainable too: full sharding broadcasts per
    # (dtype, trainable) group
    mine = [((kind, name, tuple(t.shape), str(t.dtype), "trainable" if t.requires_grad else "frozen"), t.is_meta)
            for kind, name, t in tensors]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    want = [sig for sig, _ in everyone[src]]
    for rank, theirs in enumerate(everyone):
        if [sig for sig, _ in theirs] != want:
            diff = next(((a, b) for (a, _), b in zip(theirs, want) if a != b), None)
            detail = (f"rank {rank} has {_sig_text(diff[0])}, rank {src} has {_sig_text(diff[1])}"
                      if diff else f"rank {rank} has {len(theirs)} tensors, rank {src} has {len(want)}")
            raise ValueError(f"the model differs across processes: {detail}")
    for rank, theirs in enumerate(everyone):
        meta = next((sig for sig, on_meta in theirs if on_meta), None)
        if meta is not None and (rank == src or not allow_meta):
            why = ("every process takes its weights, so they must be real there" if rank == src else
                   "only full sharding (FSDP) loads a model the other processes hold on the meta device "
                   "(FSDP_CPU_RAM_EFFICIENT_LOADING); here every process needs real weights")
            raise ValueError(f"rank {rank} has {meta[0]} {meta[1]!r} on the meta device (no values): {why}")
    return tensors


def _sig_text(sig) -> str:
    kind, name, shape, dtype, trainable = sig
    return f"{kind} {name!r} {shape} {dtype} {trainable}"


def broadcast_model(model: torch.nn.Module, src: int = 0) -> None:
    """Gives every rank rank `src`'s parameters and buffers, after check_same_structure."""
    tensors = check_same_structure(model, src)
    with torch.no_grad():
        for _, _, t in tensors:
            collectives.broadcast(t.data, src=src)


def broadcast_buffers(module, src: int):
    """Every rank takes rank `src`'s buffers, one broadcast per dtype and device."""
    by_dtype: dict = {}
    for b in module.buffers():
        by_dtype.setdefault((b.dtype, b.device), []).append(b)
    for bufs in by_dtype.values():
        flat = torch.cat([b.reshape(-1) for b in bufs])
        collectives.broadcast(flat, src=src)
        offset = 0
        for b in bufs:
            n = b.numel()
            b.copy_(flat[offset:offset + n].view_as(b))
            offset += n

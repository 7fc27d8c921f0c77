"""Gradient synchronisation across processes (the reducer's Python side).

This first version reduces each flat gradient buffer with one all-reduce when the step needs
the gradients (clip, unscale, optimizer step) on a sync step: correct on any number of
processes and backends, but without overlap with backward. The bucketed reducer (C bucket
plan, buckets launched from the hooks while backward runs) replaces the launch schedule, not
these semantics:

- SUM across ranks, then x 1/world (gloo has no AVG);
- a parameter has a gradient after the step if any rank gave it one (torch DDP's "globally
  used" rule); ranges without a gradient on a rank count as zeros;
- nothing is communicated on no_sync / accumulation steps: gradients accumulate locally.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _allreduce_(t: torch.Tensor):
    try:
        dist.all_reduce(t)
    except RuntimeError as e:  # a backend without this dtype: reduce in fp32 on the wire
        if t.dtype == torch.float32:
            raise
        wide = t.float()
        dist.all_reduce(wide)
        t.copy_(wide)
        del e


def sync_gradients(manager) -> None:
    """All-reduces every group of `manager` (all ranks call this at the same point of the
    same step, in the same group order) and averages."""
    world = dist.get_world_size()
    manager.resync()
    for g in manager.groups:
        used = torch.tensor([1 if t else 0 for t in g.touched], dtype=torch.int32)
        if g.is_cuda:
            used = used.to(g.device)
        dist.all_reduce(used)
        _allreduce_(g.flat)
        g.scale_(1.0 / world)
        for i, n in enumerate(used.tolist()):
            if n and not g.touched[i]:
                g.touched[i] = True
                g.params[i].grad = g.views[i]
    for p in manager.extra:  # parameters without a buffer (float64): one all-reduce each
        used = torch.tensor([0 if p.grad is None else 1], dtype=torch.int32, device=p.device)
        dist.all_reduce(used)
        if not used.item():
            continue
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad)
        grad.div_(world)
        p.grad = grad
    manager.synced = True


def broadcast_model(model: torch.nn.Module, src: int = 0) -> None:
    """Gives every rank rank `src`'s parameters and buffers, after checking that the models
    have the same structure (a mismatch is an error naming the first difference, not a hang)."""
    tensors = [("parameter", n, t) for n, t in model.named_parameters()] + \
              [("buffer", n, t) for n, t in model.named_buffers()]
    mine = [(kind, name, tuple(t.shape), str(t.dtype)) for kind, name, t in tensors]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[src]:
            diff = next(((a, b) for a, b in zip(theirs, everyone[src]) if a != b), None)
            detail = (f"rank {rank} has {diff[0][0]} {diff[0][1]!r} {diff[0][2]} {diff[0][3]}, rank {src} has "
                      f"{diff[1][0]} {diff[1][1]!r} {diff[1][2]} {diff[1][3]}") if diff else \
                f"rank {rank} has {len(theirs)} tensors, rank {src} has {len(everyone[src])}"
            raise ValueError(f"the model differs across processes: {detail}")
    with torch.no_grad():
        for _, _, t in tensors:
            dist.broadcast(t.data, src=src)

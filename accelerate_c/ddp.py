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


_WIRE: dict = {}  # (backend, dtype) -> the dtype that backend all-reduces it in


def _wire_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype to all-reduce `t` in: its own if the backend takes it (gloo in torch 2.13 takes
    fp16/bf16), else fp32. Decided once per backend and dtype with a 1-element probe, which
    behaves the same on every rank; real failures of real collectives are never retried."""
    key = (dist.get_backend(), t.dtype)
    if key not in _WIRE:
        try:
            dist.all_reduce(torch.zeros(1, dtype=t.dtype, device=t.device))
            _WIRE[key] = t.dtype
        except RuntimeError:
            _WIRE[key] = torch.float32
    return _WIRE[key]


def _allreduce_(t: torch.Tensor):
    wire = _wire_dtype(t)
    if wire == t.dtype:
        dist.all_reduce(t)
    else:
        wide = t.to(wire)
        dist.all_reduce(wide)
        t.copy_(wide)


def sync_gradients(manager) -> None:
    """All-reduces every group of `manager` (all ranks call this at the same point of the
    same step, in the same group order) and averages."""
    world = dist.get_world_size()
    manager.resync()
    # which params have a gradient on any rank: one small all-reduce for everything
    flags = [p.grad is v for g in manager.groups for p, v in zip(g.params, g.views)]
    flags += [p.grad is not None for p in manager.extra]
    device = manager.groups[0].device if manager.groups and manager.groups[0].is_cuda else torch.device("cpu")
    used = torch.tensor(flags, dtype=torch.int32, device=device)
    dist.all_reduce(used)
    used = used.tolist()
    k = 0
    for g in manager.groups:
        _allreduce_(g.flat)
        g.scale_(1.0 / world)
        for p, v in zip(g.params, g.views):
            if used[k] and p.grad is None:  # used on another rank: its (reduced) gradient
                p.grad = v
            k += 1
    for p in manager.extra:  # parameters without a buffer (float64): one all-reduce each
        if used[k]:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad)
            p.grad = grad.div_(world)
        k += 1
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

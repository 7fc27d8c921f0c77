"""Gradients left where autograd puts them: the one-process CPU path without flat buffers.

On several processes the flat buffers (grad_layout.py) are what the bucketed all-reduce reads;
on one process they only serve the fused clip and unscale, and cost a copy of every gradient
into them after backward, the buffer held through the forward beside autograd's fresh
gradients, and a different pattern of frees (docs/performance.md measured the Trainer 4-5%
slower with them on one process). Here each gradient stays autograd's tensor.

clip_grad_norm_ over them is torch's own (its per-tensor norms, then one multi-tensor
multiply), except under fp16, where the unscale is folded into the clip: one C read pass per
gradient (its sum of squares, unscaled) and one `torch._foreach_mul_` by the loss scale's
inverse times torch's coefficient, where torch's unscale_ then clip makes five passes. The
gradients are not measured as they land, as the flat buffers' copy-in does for free: here that
read is a pass of its own, the gradients of a real model are no longer in cache when their
hooks run, and the read evicts what backward works on (measured in docs/performance.md: backward
plus clip 1-5 ms slower a step than torch's clip on the benchmarks' 14-15M-parameter models).

fp16's loss-scale bookkeeping is the manager's for parameters outside the buffers
(GradManager.track_outside).
"""
from __future__ import annotations

import math
import operator
from array import array

import torch

from . import _C
from .clip_math import FINITE_MAX, clip_coef, norm_dtype

_SIXTEEN = (torch.float16, torch.bfloat16)


def _measure(g: torch.Tensor, scale: float = 1.0):
    """(exact sum of squares, the sum of squares of the norm times `scale` rounded to the
    gradient's dtype as torch's clip takes it, non-finite) of one contiguous CPU gradient. fp32:
    the exact sum stands for both (as for the flat buffers: GradLayout.sums)."""
    if g.dtype in _SIXTEEN:
        return _C.sumsq_segments(g, array("Q", (0, g.numel())), scale)
    sumsq, nonfinite = _C.sumsq(g)
    return sumsq, sumsq, nonfinite


def kernel_ok(g: torch.Tensor) -> bool:
    """Whether the C kernels take this gradient in place: CPU, a dtype they know, contiguous,
    without a graph."""
    return g.is_cpu and g.dtype in FINITE_MAX and g.is_contiguous() and not g.requires_grad


class LooseGrads:
    """The trainable parameters of the prepared models on one CPU process, their gradients left
    as autograd's tensors; fp16's unscale folded into clip_grad_norm_."""

    def __init__(self, manager):
        self.manager = manager
        self.params: dict[int, torch.nn.Parameter] = {}  # id -> param
        self._cover_cache = None

    def add(self, params) -> None:
        for p in params:
            if p.requires_grad:
                self.params[id(p)] = p
        self._cover_cache = None

    def cover(self, params):
        """The loose parameters among `params` when the rest hold no gradient (frozen ones, say),
        each once (a repeated one torch counts twice: left to torch's clip); else None. Loops
        pass the same list every step: the split is cached on identities."""
        c = self._cover_cache
        if c is None or len(c[0]) != len(params) or not all(map(operator.is_, params, c[0])):
            mine = [p for p in params if id(p) in self.params]
            rest = [p for p in params if id(p) not in self.params]
            ok = bool(mine) and len({id(p) for p in params}) == len(params)
            c = self._cover_cache = (tuple(params), mine if ok else None, rest)
        if c[1] is None or any(p.grad is not None for p in c[2]):
            return None
        return c[1]

    def clip(self, params, max_norm: float, inv_scale: float, stepped: set):
        """fp16: torch.nn.utils.clip_grad_norm_(params, max_norm) (2-norm) over loose gradients,
        those still carrying the loss scale unscaled in the same pass (inv_scale) if an optimizer
        steps them (`stepped`: their ids), as accelerate's clip unscales every optimizer's
        gradients first and GradScaler only those. Returns the norm as torch's (a 0-dim tensor of
        the gradients' dtype), or None for torch's own clip to do it (nothing to unscale, a
        gradient the kernels do not cover, a loss scale below 1)."""
        per = []
        for p in params:
            g = p.grad
            if g is None:
                continue
            if not kernel_ok(g):
                return None
            rec = self.manager.track_outside(p)
            inv = inv_scale if (rec.carries_scale and id(p) in stepped) else 1.0
            if inv > 1.0:  # unscaling could overflow: torch's path checks it
                return None
            per.append((rec, g, inv))
        if all(inv == 1.0 for _, _, inv in per):
            return None  # torch's clip, as it is
        sumsq, nonfinite, found = 0.0, False, []
        for _, g, inv in per:
            ex, ro, nf = _measure(g, inv)
            # torch unscales before it takes each norm: a 16-bit one is rounded unscaled
            sumsq += ro if g.dtype in _SIXTEEN else ex * inv * inv
            nonfinite = nonfinite or bool(nf)
            found.append(bool(nf))
        total = math.sqrt(sumsq)
        if nonfinite:  # squares are >= 0: only a NaN gradient makes their sum NaN
            total = math.nan if math.isnan(sumsq) else math.inf
        norm, coef = clip_coef(total, max_norm, norm_dtype(g.dtype for _, g, _ in per))
        by_factor: dict = {}
        for (rec, g, inv), nf in zip(per, found):
            f = inv * coef
            if f != 1.0:
                by_factor.setdefault(f, []).append(g)
            if inv != 1.0:  # unscaled here: what the step skips on (GradManager.unscale)
                rec.unscaled(nf)
        # torch's multi-tensor multiply: each element times f computed in fp32 and rounded once,
        # as a C kernel would, at the speed of one pass over memory scattered in many tensors
        # (per-tensor C calls paid their conversion on each); the versions move as torch's do
        for f, grads in by_factor.items():
            torch._foreach_mul_(grads, f)
        return norm

    def clear(self) -> None:
        self.params = {}
        self._cover_cache = None

"""torch.nn.utils.clip_grad_norm_'s arithmetic on a total norm computed elsewhere (the flat
buffers' fused passes, grads.py; sums the hooks measured, loose_grads.py; the sharded
strategies' shards), so that every path clips by the coefficient torch would."""
from __future__ import annotations

import math
import struct

import torch

# the dtypes the C kernels scale and measure, with the largest finite value of each
FINITE_MAX = {torch.float32: torch.finfo(torch.float32).max, torch.float16: torch.finfo(torch.float16).max,
              torch.bfloat16: torch.finfo(torch.bfloat16).max}

_F32 = struct.Struct("f")


def _f32(x: float) -> float:
    """x rounded to the nearest fp32 value (inf beyond fp32's range), as a Python float."""
    try:
        return _F32.unpack(_F32.pack(x))[0]
    except OverflowError:  # rounds to +-inf
        return math.copysign(math.inf, x)


_EPS32 = _f32(1e-6)


def clip_coef(total: float, max_norm: float, dtype):
    """(norm, coefficient) of torch.nn.utils.clip_grad_norm_ for a total norm `total`: the norm
    as a 0-dim tensor of `dtype`, and clamp(max_norm / (norm + 1e-6), max=1) computed in it.
    fp32 (every fp32 model): the same fp32 operations in Python floats (torch's __rdiv__ is a
    reciprocal, then a product), each done in double and rounded once to fp32, which for +, x
    and / of fp32 operands is the correctly rounded fp32 result; the five torch ops on 0-dim
    tensors it replaces cost ~0.2 ms right after a backward, when clip is otherwise one
    scaling pass. Other dtypes: torch's ops."""
    if dtype == torch.float32:
        n32 = _f32(total)
        c = _f32(_f32(1.0 / _f32(n32 + _EPS32)) * _f32(max_norm))
        return torch.full((), n32, dtype=torch.float32), (1.0 if c > 1.0 else c)  # clamp; NaN stays NaN
    norm = torch.tensor(total, dtype=dtype)
    return norm, float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))


def norm_dtype(dtypes) -> torch.dtype:
    """The dtype of the norm torch's clip_grad_norm_ returns, from the dtypes of the gradients
    present: that of the per-gradient norms it stacks, fp32 when they mix dtypes or when there
    is none (its 0-dim zero)."""
    live = set(dtypes)
    return live.pop() if len(live) == 1 else torch.float32


def clip_grad_norm_as_torch(params, max_norm: float, norm_type: float):
    """torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type), the same norm and the same
    gradient bits, without its scaling pass when that pass is the identity. torch multiplies
    every gradient by clamp(max_norm / (norm + 1e-6), max=1) even when the clamp gives 1 (its
    source says why: testing the coefficient would synchronise with a GPU). On the CPU reading
    it costs nothing, and a product by exactly 1.0 returns its operand in every dtype (-0, inf
    and NaN included), so a step whose norm is below max_norm skips a read and a write of every
    gradient (transformers' Trainer clips at 1.0 by default: most steps of a converging run).
    What differs: the skipped gradients' version counters do not move (no autograd graph saves
    a .grad), and a signalling NaN stays signalling."""
    if not hasattr(torch.nn.utils, "get_total_norm"):  # torch < 2.6: its clip in one piece
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type)
    if grads and total.device.type == "cpu" and all(g.device.type == "cpu" for g in grads):
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)  # torch's, in the norm's dtype
        if float(coef) == 1.0:
            return total
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total

"""ZeRO stage 2: the optimizer's state and the gradients sharded across processes (docs/sharding.md).

What stage 1 does (zero.py: the shard plan per model and dtype, the user's optimizer rebuilt in
place over each process's owned runs, fp32 masters under DeepSpeed's 16-bit policy, the
bucket-by-bucket all-gather after the step), with the gradients kept as shards too: a model
prepared under this strategy gets no flat gradient buffer (GradManager leaves it to the
strategy: buffers_gradients), but one grad_shards.GradShard per shard group, whose C hooks
reduce-scatter every backward bucket by bucket while it runs. Between steps `p.grad` is None (no
full gradient exists, as with DeepSpeed); the optimizer reads each owned run of the gradient
shard. The norm the engine clips by is the all-reduce of every process's local sum of squares
(or max), fp16's overflow check is agreed by a MAX all-reduce, and after every optimizer step,
skipped or not, the gradients are cleared, as DeepSpeed's engine clears them.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import collectives
from ..grad_shards import GradShard
from ..grads import clip_coef
from .zero import Zero1Strategy


class Zero2Strategy(Zero1Strategy):
    """ZeRO stage 2 on top of stage 1's sharded optimizer."""

    stage = 2
    buffers_gradients = False

    def __init__(self, manager, handler=None, fp32_masters: bool = False):
        super().__init__(manager, handler, fp32_masters)
        self.grad_shards: list = []
        self.held: dict = {}  # id(param) -> (GradShard, index)

    # ---- prepare ------------------------------------------------------------------------
    def prepare_model(self, model, manager):
        super().prepare_model(model, manager)
        for name, p in model.named_parameters():
            manager.names.setdefault(id(p), name)
        for group, params, _ in self.models[id(model)].gathers:
            gs = GradShard(group, params, self.manager.name_of, self.find_unused, model_key=id(model))
            self.grad_shards.append(gs)
            for i, p in enumerate(params):
                if p.grad is not None:
                    raise ValueError(f"ZeRO stage 2: parameter {self.manager.name_of(p)} has a gradient from before "
                                     "prepare(); under stage 2 each process keeps only its shard of the gradients, "
                                     "built by the backwards after prepare(): zero the gradients first")
                self.held[id(p)] = (gs, i)

    def _split(self, params):
        """{GradShard: [indices]} of the params whose gradients this strategy holds, and whether
        some trainable param with a gradient is outside them."""
        touched, outside = {}, False
        for p in params:
            hit = self.held.get(id(p))
            if hit is None:
                outside = outside or (p.requires_grad and p.grad is not None)
            else:
                touched.setdefault(hit[0], []).append(hit[1])
        return touched, outside

    # ---- what reads the gradients -----------------------------------------------------------
    def sharded_norm(self, params, max_norm, norm_type):
        """clip_grad_norm_ over gradients held as shards: the norm of the whole model (every
        process's local sum of squares, or max, all-reduced), and with max_norm the shards
        scaled by torch's coefficient. None when none of `params` is held here."""
        touched, outside = self._split(params)
        if not touched:
            return None
        if outside:
            raise NotImplementedError("clip_grad_norm_ under ZeRO stage 2 over parameters of a prepared model "
                                      "together with parameters outside it that have gradients; clip them apart")
        inf_norm = norm_type == math.inf
        if norm_type not in (2.0, math.inf):
            raise NotImplementedError(f"clip_grad_norm_(norm_type={norm_type}) under ZeRO stage 2: the 2-norm and the "
                                      "inf-norm are supported")
        sumsq, maxabs, nonfinite = 0.0, 0.0, False
        for gs, idx in touched.items():
            s, m, nf = gs.local_stats(idx, inf_norm)
            sumsq, maxabs, nonfinite = sumsq + s, max(maxabs, m), nonfinite or nf
        if inf_norm:
            t = torch.tensor([maxabs, float(nonfinite)], dtype=torch.float64)
            collectives.all_reduce(t, op=dist.ReduceOp.MAX)
            total = float(t[0])
        else:
            t = torch.tensor([sumsq, float(nonfinite)], dtype=torch.float64)
            collectives.all_reduce(t)
            total = math.sqrt(float(t[0])) if float(t[0]) >= 0 else math.nan
        if float(t[1]) > 0:  # squares are >= 0: only a NaN makes their sum NaN
            total = math.nan if math.isnan(float(t[0])) else math.inf
        if max_norm is None:
            return torch.tensor(total, dtype=torch.float32)
        dtypes = {gs.dtype for gs in touched}
        norm, coef = clip_coef(total, max_norm, dtypes.pop() if len(dtypes) == 1 else torch.float32)
        for gs, idx in touched.items():
            gs.scale_(idx, coef)
        return norm

    def held_nonfinite(self, params) -> bool:
        touched, _ = self._split(params)
        return any(gs.nonfinite(idx) for gs, idx in touched.items())

    def any_found_inf(self, found: bool) -> bool:
        """Each process checked its own shard: every process skips when any found one."""
        t = torch.tensor([float(bool(found))])
        collectives.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t[0] > 0)

    def _grad_of(self, p, o):
        hit = self.held.get(id(p))
        if hit is None:
            return super()._grad_of(p, o)
        return hit[0].run(hit[1])

    def full_grad(self, p):
        hit = self.held.get(id(p))
        if hit is None:
            return super().full_grad(p)
        return hit[0].full_grad(hit[1])

    # ---- zero_grad and the end of a step ----------------------------------------------------
    def _clear(self, optimizer, set_to_none: bool):
        book = self.optimizers.get(id(optimizer))
        if book is None:
            return
        touched, _ = self._split(book.originals)
        for gs, idx in touched.items():
            gs.clear(idx, set_to_none)

    def after_zero_grad(self, optimizer, set_to_none: bool) -> None:
        super().after_zero_grad(optimizer, set_to_none)
        self._clear(optimizer, set_to_none)

    def after_step(self, optimizer) -> None:
        """DeepSpeed's engine clears the gradients after every step, skipped or not."""
        self._clear(optimizer, True)

    def abort_held(self) -> None:
        for gs in self.grad_shards:
            gs.abort()

    def memory(self) -> dict:
        """Bytes of the gradient shards and their staging buffers on this process."""
        return {"grad_shards": sum(gs.shard.numel() * gs.shard.element_size() for gs in self.grad_shards),
                "grad_staging": sum(gs.nbytes() for gs in self.grad_shards)
                - sum(gs.shard.numel() * gs.shard.element_size() for gs in self.grad_shards)}

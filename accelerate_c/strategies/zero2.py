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
from ..clip_math import clip_coef
from .zero import Zero1Strategy


class Zero2Strategy(Zero1Strategy):
    """ZeRO stage 2 on top of stage 1's sharded optimizer."""

    stage = 2
    buffers_gradients = False

    def __init__(self, manager, handler=None, fp32_masters: bool = False, ignore_unused: bool = False):
        super().__init__(manager, handler, fp32_masters, ignore_unused)
        self.grad_shards: list = []
        self.held: dict = {}  # id(param) -> (GradShard, index)

    # ---- prepare ------------------------------------------------------------------------
    def adopt_gradients(self, model, manager):
        """GradManager.prepare_model for a trainable model (buffers_gradients is False): a
        GradShard per shard group of its parameters not held already (a parameter shared with
        a model prepared before stays with that model's shard), and model.zero_grad() reaching
        the shards (it would only see `p.grad`, which is None)."""
        for name, p in model.named_parameters():
            manager.names.setdefault(id(p), name)
        gathers = self.models[id(model)].gathers
        for _, params, _ in gathers:  # checked before anything is installed
            for p in params:
                if p.grad is not None and id(p) not in self.held:
                    raise ValueError(f"ZeRO stage 2: parameter {self.manager.name_of(p)} has a gradient from before "
                                     "prepare(); under stage 2 each process keeps only its shard of the gradients, "
                                     "built by the backwards after prepare(): zero the gradients first")
        for group, params, _ in gathers:
            if any(id(p) in self.held for p in params):
                if all(id(p) in self.held for p in params):
                    continue  # prepared again (after free_memory(), say): its shards are in place
                names = ", ".join(self.manager.name_of(p) for p in params if id(p) in self.held)
                raise NotImplementedError(f"ZeRO stage 2: parameters {names} belong to a model prepared before and "
                                          "to this one; prepare models that share parameters as one module")
            gs = GradShard(group, params, self.manager.name_of, self.find_unused, model_key=id(model), windows=True)
            gs.begin_hook = self._shard_begins
            self.hold(gs)
        self.hook_model_zero_grad(model)

    def _shard_begins(self, gs) -> bool:
        """A backward starts in `gs`: whether its buckets wait for the end of the backward, where
        every shard of the backward's models is finished in turn (DDPStrategy._in_order: with
        find_unused_parameters=True passed, over several shards). The shards then stage their
        whole gradient during the backward (no reduce-scatter overlaps it); DeepSpeed's
        ignore_unused_parameters alone (on by default) does not ask for that, and there a
        backward must reach the same shards on every process (docs/sharding.md)."""
        if not self._in_order(gs.model_key):
            return False
        self.order(gs.model_key)
        return True

    def ordered_members(self) -> list:
        return super().ordered_members() + list(self.grad_shards)

    def hold(self, gs) -> None:
        """From now on the strategy keeps the gradients of `gs`'s parameters."""
        self.grad_shards.append(gs)
        for i, p in enumerate(gs.params):
            self.held[id(p)] = (gs, i)

    def hook_model_zero_grad(self, model) -> None:
        """model.zero_grad() reaches the gradient shards of its parameters (it would only see
        `p.grad`, which is None); once per model."""
        if not hasattr(model, "_zero2_zero_grad"):
            original = model.zero_grad

            def zero_grad(set_to_none: bool = True, _original=original, _key=id(model)):
                _original(set_to_none=set_to_none)
                for gs in self.grad_shards:
                    if gs.model_key == _key:
                        gs.clear(None, set_to_none)

            model._zero2_zero_grad = original
            model.zero_grad = zero_grad

    def finish_awaiting(self) -> None:
        for gs in self.grad_shards:
            if gs.reducer.requeue:
                gs.finish_backward()

    def clear_held(self) -> None:
        """GradManager.clear (free_memory()): the hooks go; a model prepared again gets new shards."""
        for gs in self.grad_shards:
            gs.remove()
        self.grad_shards, self.held = [], {}
        super().clear_held()

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
        inf_norm = norm_type == math.inf
        if norm_type not in (2.0, math.inf):
            raise NotImplementedError(f"clip_grad_norm_(norm_type={norm_type}) under ZeRO stage 2: the 2-norm and the "
                                      "inf-norm are supported")
        sumsq, maxabs, nonfinite = 0.0, 0.0, False
        for gs, idx in touched.items():
            s, m, nf = gs.local_stats(idx, inf_norm)
            sumsq, maxabs, nonfinite = sumsq + s, max(maxabs, m), nonfinite or nf
        # one SUM of (sum of squares, non-finite count, processes with gradients outside), the
        # same collective on every process whatever it found; the inf-norm adds a MAX
        device = next(iter(touched)).stats_device
        t = torch.tensor([sumsq, float(nonfinite), float(outside)], dtype=torch.float64, device=device)
        collectives.all_reduce(t)
        total_sumsq, any_nonfinite, any_outside = t.tolist()
        if any_outside:
            raise NotImplementedError("clip_grad_norm_ under ZeRO stage 2 over parameters of a prepared model "
                                      "together with parameters outside it that have gradients; clip them apart")
        if inf_norm:
            m = torch.tensor([maxabs], dtype=torch.float64, device=device)
            collectives.all_reduce(m, op=dist.ReduceOp.MAX)
            total = float(m[0])
        else:
            total = math.sqrt(total_sumsq) if total_sumsq >= 0 else math.nan
        if any_nonfinite > 0:  # squares are >= 0: only a NaN makes their sum NaN (torch's norms say NaN then)
            total = math.nan if math.isnan(total_sumsq) else math.inf
        if max_norm is None:
            return torch.tensor(total, dtype=torch.float32)
        dtypes = {gs.shard.dtype for gs in touched}
        norm, coef = clip_coef(total, max_norm, dtypes.pop() if len(dtypes) == 1 else torch.float32)
        self._scale(touched, coef)
        return norm

    @staticmethod
    def _scale(touched, factor: float) -> None:
        for gs, idx in touched.items():
            gs.scale_(idx, factor)

    def scale_held(self, params, factor: float) -> None:
        """Multiplies the gradient shards of `params` held here by `factor` (DeepSpeed's unscale
        and clip of the fp32 gradient partitions at stage 3 under fp16, one multiply)."""
        self._scale(self._split(params)[0], factor)

    def unscale_held(self, params, inv_scale: float) -> bool:
        found = False
        for gs, idx in self._split(params)[0].items():
            found = gs.unscale_(idx, inv_scale) or found
        return found

    def new_held_step(self, params) -> None:
        for gs, idx in self._split(params)[0].items():
            gs.new_step(idx)
        for gs in self.grad_shards:
            gs.new_update()

    def held_unscaled_again(self, params) -> list:
        return [gs.params[i] for gs, idx in self._split(params)[0].items() for i in gs.unscaled_again(idx)]

    def held_nonfinite(self, params) -> bool:
        touched, _ = self._split(params)
        return any(gs.nonfinite(idx) for gs, idx in touched.items())

    def any_found_inf(self, found: bool) -> bool:
        """Each process checked its own shard: every process skips when any found one."""
        device = self.grad_shards[0].stats_device if self.grad_shards else torch.device("cpu")
        t = torch.tensor([float(bool(found))], device=device)
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

    def abort_held(self) -> None:
        super().abort_held()
        for gs in self.grad_shards:
            gs.abort()

    def memory(self) -> dict:
        """Bytes of the gradient shards and their staging buffers on this process."""
        shards = sum(gs.shard.numel() * gs.shard.element_size() for gs in self.grad_shards)
        return {"grad_shards": shards, "grad_staging": sum(gs.nbytes() for gs in self.grad_shards) - shards}

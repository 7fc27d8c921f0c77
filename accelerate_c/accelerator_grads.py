"""The Accelerator's gradient post-processing entry points (unscale, clip by norm or value,
the full gradient of a parameter): what each asks of the GradManager (grads.py), the one-process
loose gradients (loose_grads.py) or the sharding strategy, as accelerate's Accelerator does
them. A mixin of accelerator.Accelerator, whose state (`_grads`, `scaler`, `sharding`,
`_optimizers`) it reads."""
from __future__ import annotations

import math

import torch

from .clip_math import clip_coef, clip_grad_norm_as_torch
from .optimizer import AcceleratedOptimizer


def model_parameters(opt) -> list:
    """The model parameters `opt` updates: a prepared optimizer knows them (under sharding its
    param_groups hold views of the owned parts); a plain one lists them."""
    if isinstance(opt, AcceleratedOptimizer):
        return opt.model_parameters()
    return [p for g in opt.param_groups for p in g["params"]]


class GradientFacade:
    """unscale_gradients, clip_grad_norm_, clip_grad_value_, get_full_grad and what they share."""

    def _opt_list(self, optimizer):
        if optimizer is None:
            return self._optimizers
        return list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]

    def unscale_gradients(self, optimizer=None):
        """Divides the gradients of the optimizer(s) by the loss scale (fp16 only), once per step."""
        if self.scaler is None or self.sharding is not None:
            return  # as accelerate under DeepSpeed: the engine unscales inside its step
        inv = 1.0 / self.scaler.get_scale()
        opts = self._opt_list(optimizer)
        for opt in opts:
            self._grads.refuse_unscale_again(model_parameters(opt), "unscale_gradients()")
        for opt in opts:
            self.scaler.record_unscale(opt, self._grads.ready(model_parameters(opt), inv))

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """Unscales (fp16) and clips the gradients' total norm; returns that norm (before
        clipping), as torch.nn.utils.clip_grad_norm_ does. When `parameters` are exactly the
        trainable parameters of prepared models, the C core does it in one read pass and one
        scaling pass per flat buffer.

        Under DeepSpeed, as in accelerate, the engine clips inside the optimizer step at the
        configuration's gradient_clipping, and this only returns the norm (a float): the one
        the step is about to clip on a sync step, the last step's otherwise."""
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        if self.sharding is not None:
            last = [o.engine_norm for o in self._optimizers if o.engine_norm is not None]
            last = float(last[-1]) if last else None
            if not self.sync_gradients:
                return last
            norm = float(self._deepspeed_norm(list(parameters)))
            if self.scaler is not None and not math.isfinite(norm):
                # the step will overflow and be skipped: DeepSpeed's optimizer leaves its norm as
                # the last step taken set it (0.0 before any), which the engine reports
                return 0.0 if last is None else last
            return norm
        norm = self._clip_norm(list(parameters), float(max_norm), float(norm_type))
        if self.scaler is not None and len(self._optimizers) > 1:
            # accelerate's clip unscaled every optimizer: each one's found_inf now counts at the
            # next update, whichever optimizer steps (GradScaler.update; one optimizer's own
            # step reads it anyway). Read back, nothing is unscaled twice.
            self.unscale_gradients()
        return norm

    def _deepspeed_scales(self) -> tuple[float, float]:
        """Under DeepSpeed's fp16: (the scale the gradients carry, the one the engine divides
        them by). Its step updates the scale first and unscales by the updated one, so the two
        differ on a step that grows the scale (DeepSpeedScaler.scale_after_clean_step). (1, 1)
        otherwise."""
        if self.scaler is None:
            return 1.0, 1.0
        return self.scaler.get_scale(), self.scaler.scale_after_clean_step()

    def _deepspeed_norm(self, params, scaled=None):
        """The 2-norm DeepSpeed's engine reports: in fp32, of the gradients as the step will read
        them; under fp16 the loss scale divided out of the norm (not out of the gradients, which
        keep it until the fp32 copies are made): by the scale they carry at stages 1 and 2, by
        the updated one at stage 3 (its step stashes the norm after the update)."""
        if scaled is None:
            scaled = self._clip_norm(params, None, 2.0)
        carried, divided_by = self._deepspeed_scales()
        return scaled / (divided_by if self.sharding.stage == 3 else carried)

    def _unscale_rest(self, stepped: list, inside: set, inv: float) -> None:
        """fp16: as accelerate's clip, which unscales every optimizer's gradients first (`stepped`:
        their parameters), those outside the clipped set (ids in `inside`) now; the clipped ones
        are unscaled with their norm pass."""
        rest = [p for p in stepped if id(p) not in inside]
        if rest:
            self._grads.ready(rest, inv)

    def _clip_norm(self, params, max_norm, norm_type):
        """clip_grad_norm_'s work; max_norm None: the norm only, the gradients left as they are."""
        self._grads.prepare_step()
        # fp16 (not under DeepSpeed, whose engine unscales its fp32 copies): the parameters the
        # optimizers step, whose gradients accelerate's clip unscales first
        stepped = None
        if self.scaler is not None and self.sharding is None:
            stepped = [p for opt in self._opt_list(None) for p in model_parameters(opt)]
            if max_norm is not None:
                self._grads.refuse_unscale_again(stepped, "clip_grad_norm_()")
        strategy = self._grads.strategy
        if not strategy.buffers_gradients:  # ZeRO-2 / full sharding: shards the strategy holds
            if stepped is not None and max_norm is not None:
                # FSDP under fp16: accelerate's clip unscales every optimizer's gradients first
                # (ShardedGradScaler.unscale_), the shards included
                self._grads.ready(stepped, 1.0 / self.scaler.get_scale())
            held = strategy.sharded_norm([p for p in params if p.requires_grad], max_norm, norm_type)
            if held is not None:
                return held
        # frozen parameters are simply outside every group (no gradient: nothing to count, as
        # in torch); not filtering them saves a walk over every parameter right after backward,
        # when each one it touches is a cache miss
        loose = self._grads.loose.cover(params) if (stepped is not None and max_norm is not None
                                                    and norm_type == 2.0) else None
        if loose is not None:  # one CPU process, fp16: autograd's gradients, unscaled within the clip
            inv = 1.0 / self.scaler.get_scale()
            self._unscale_rest(stepped, {id(p) for p in loose}, inv)
            total = self._grads.loose.clip(loose, max_norm, inv, frozenset(map(id, stepped)))
            if total is not None:
                return total
        groups = self._grads.full_groups(params) or None if params else None
        if groups is not None and norm_type in (2.0, math.inf):
            inv = 1.0 / self.scaler.get_scale() if stepped is not None else None
            if inv is not None:
                # those outside the clipped buffers now, the clipped ones fused with their norm pass
                self._unscale_rest(stepped, {id(p) for g in groups for p in g.params}, inv)
            total = self._grads.clip_norm_fused(groups, max_norm, norm_type, inv)
            if total is not None:
                return total
        self.unscale_gradients()
        if max_norm is None:  # in fp32, as DeepSpeed reports it
            self._grads.ready(params)
            return torch.nn.utils.get_total_norm([p.grad.float() for p in params if p.grad is not None], norm_type)
        return clip_grad_norm_as_torch(params, max_norm, norm_type)

    def _engine_clip(self, params):
        """DeepSpeed's clip inside the optimizer step, at the configuration's gradient_clipping
        (2-norm, torch's formula; None: no clipping); the norm is returned either way, as
        DeepSpeed computes it for every step. A 16-bit model's gradients are not rounded again:
        as DeepSpeed clips the fp32 copies the optimizer reads, the coefficient (computed in
        fp32 from the fp32 norm) goes to the strategy, which applies it while widening them."""
        clip = self.sharding.gradient_clipping
        masters = self._compute_dtype is not None and getattr(self._grads.strategy, "fp32_masters", False)
        if not masters and self.scaler is None:
            # the optimizer reads fp32 gradients in place (a 32-bit model, or stage 3's fp32
            # gradient shards under bf16): clipped there
            return self._clip_norm(list(params), clip, 2.0)
        params = list(params)
        scaled = self._clip_norm(params, None, 2.0)
        norm = self._deepspeed_norm(params, scaled)
        # fp16: the unscale, by the scale this step's update leaves (DeepSpeed's order), and the
        # clip measures the norm unscaled by it too
        divided_by = self._deepspeed_scales()[1]
        factor = 1.0 / divided_by
        if clip is not None:  # fp32, NaN for a NaN norm (as torch's)
            factor *= clip_coef(float(scaled / divided_by), clip, torch.float32)[1]
        if factor != 1.0:
            if masters:  # applied to the fp32 copies the masters read, as they are made
                self._grads.strategy.scale_next_step(factor)
            else:  # stage 3 under fp16: its fp32 gradient shards, still scaled, in place
                self._grads.strategy.scale_held(params, factor)
        return norm

    def clip_grad_value_(self, parameters, clip_value):
        if self.sharding is not None:  # as accelerate: the engine only clips norms
            raise RuntimeError("clip_grad_value_ is not supported under DeepSpeed (accelerate refuses it too): the "
                               "DeepSpeed engine clips the gradients' norm at the configuration's gradient_clipping; "
                               "use clip_grad_norm_")
        if not self._grads.strategy.buffers_gradients:  # p.grad is None: nothing would be clipped
            raise RuntimeError("clip_grad_value_ is not supported under FSDP (accelerate refuses it too): each "
                               "process holds a shard of the gradients; use clip_grad_norm_")
        self.unscale_gradients()
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        self._grads.ready(params)
        torch.nn.utils.clip_grad_value_(params, clip_value)

    # ---- collectives (identity on one process) ----------------------------------------

    def get_full_grad(self, param):
        """The whole gradient of `param` as the optimizer step will read it (averaged over the
        processes, before the engine's clip; under DeepSpeed's fp16 still carrying the loss
        scale), or None. Under ZeRO stage 2 no process holds it whole (`param.grad` is None):
        it is gathered, a collective that every process must call for the same parameter, as
        DeepSpeed's `safe_get_full_grad`. Elsewhere it is `param.grad`."""
        self._grads.prepare_step()
        return self._grads.strategy.full_grad(param)

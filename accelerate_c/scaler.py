"""The fp16 loss scaler: GradScaler's interface over the C state machine (csrc/core/scaler.c)."""
from __future__ import annotations

import torch

from . import _C


class ScalerBase:
    """What both loss-scale rules share over their C state machine `_s` (its `scale`, `update`
    and `state`): GradScaler's interface for scaling a loss and recording a step's outcome."""

    _s = None
    _enabled = True

    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        return self._s.scale if self._enabled else 1.0

    def scale(self, outputs):
        """Multiplies a loss (or a nested structure of them) by the current scale."""
        if not self._enabled:
            return outputs
        s = self._s.scale
        if torch.is_tensor(outputs):
            return outputs * s
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(f"scale() takes a tensor or a list/tuple of tensors, got {type(outputs).__name__}")

    def update(self, found_inf: bool = False):
        """One optimizer step's outcome (found_inf: it overflowed and was skipped)."""
        if self._enabled:
            self._s.update(bool(found_inf))

    def state_dict(self) -> dict:
        """The C state's keys (LossScaler: torch.amp.GradScaler's, so a state saved by either
        loads into the other; DeepSpeedScaler: DeepSpeed's attribute names)."""
        return self._s.state() if self._enabled else {}


class LossScaler(ScalerBase):
    """What `accelerator.scaler` is under fp16. The scale lives in C; gradients are unscaled
    and checked by the fused kernels on the flat buffers, not here."""

    # what a saved state must hold (checkpoint_load.py): torch.amp.GradScaler's keys
    STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")

    def __init__(self, init_scale: float = 65536.0, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        self._s = _C.LossScaler(init_scale, growth_factor, backoff_factor, growth_interval)
        self._enabled = enabled
        # GradScaler's per-optimizer record: id(optimizer) -> whether unscaling its gradients
        # since the last update found NaN/Inf (Accelerator.unscale_gradients / clip_grad_norm_,
        # which unscale every optimizer's)
        self._unscaled: dict = {}

    def record_unscale(self, optimizer, found: bool) -> None:
        self._unscaled[id(optimizer)] = self._unscaled.get(id(optimizer), False) or bool(found)

    def update(self, found_inf: bool = False):
        """As torch's GradScaler.update: the scale backs off when the step's optimizer or any
        other optimizer unscaled since the last update found NaN/Inf (accelerate's clip unscales
        every optimizer: a GAN's discriminator still holding its skipped step's infs backs the
        scale off at the generator's update); then every optimizer's record ends."""
        found_inf = bool(found_inf) or any(self._unscaled.values())
        self._unscaled.clear()
        super().update(found_inf)

    def get_growth_factor(self) -> float:
        return self._s.state()["growth_factor"]

    def get_backoff_factor(self) -> float:
        return self._s.state()["backoff_factor"]

    def get_growth_interval(self) -> int:
        return self._s.state()["growth_interval"]

    def load_state_dict(self, state: dict):
        if not state:
            raise RuntimeError("The source state dict is empty, possibly because it was saved from a disabled "
                               "instance of GradScaler.")
        missing = [k for k in self.STATE_KEYS if k not in state]
        if missing:
            raise KeyError(f"loss scaler state is missing {missing}")
        scale = state["scale"]
        scale = float(scale.item() if torch.is_tensor(scale) else scale)
        tracker = state["_growth_tracker"]
        tracker = int(tracker.item() if torch.is_tensor(tracker) else tracker)
        self._s.load(scale, float(state["growth_factor"]), float(state["backoff_factor"]),
                     int(state["growth_interval"]), tracker)

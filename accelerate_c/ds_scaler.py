"""DeepSpeed's fp16 loss scaler with LossScaler's interface, over the C state machine
(csrc/core/ds_scaler.c; the rule and its consequences: csrc/include/ac/ds_scaler.h)."""
from __future__ import annotations

import numbers

import torch

from . import _C
from .scaler import ScalerBase

# state_dict keys: DeepSpeed's DynamicLossScaler attribute names (its ZeRO optimizers save the
# scaler object itself), counters first, then the configuration
STATE_KEYS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis", "scale_window", "min_scale",
              "delayed_shift", "consecutive_hysteresis", "dynamic")
_INT_KEYS = ("cur_iter", "last_overflow_iter", "cur_hysteresis", "scale_window", "delayed_shift")
_BOOL_KEYS = ("consecutive_hysteresis", "dynamic")


def _real(name, value):
    # bool is an int to Python; DeepSpeed's validation refuses it as a number, and so do we
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def _int(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    return int(value)


def _flag(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__}")
    return value


class DeepSpeedScaler(ScalerBase):
    """What `accelerator.scaler` is under a DeepSpeed config with fp16: DeepSpeed's loss-scale
    rule (hysteresis, min_loss_scale, its growth timing) where LossScaler has GradScaler's.

    Keywords are the fp16 config keys: `init_scale` (2**initial_scale_power, or the static
    loss_scale with `static=True`), `loss_scale_window`, `hysteresis`, `consecutive_hysteresis`,
    `min_loss_scale`. Defaults are DeepSpeed's config defaults. `raise_error_at_min_scale`
    (True, as in DeepSpeed's ZeRO optimizers): an overflow with the scale already at
    min_loss_scale raises accelerate_c.CoreError (a RuntimeError) from update() and changes
    nothing. With `static=True` the scale never changes; overflowed steps are still skipped by
    the optimizer wrapper, as DeepSpeed skips them."""

    STATE_KEYS = STATE_KEYS  # what a saved state must hold (checkpoint_load.py)

    def __init__(self, init_scale: float = 2.0 ** 16, loss_scale_window: int = 1000, hysteresis: int = 2,
                 consecutive_hysteresis: bool = False, min_loss_scale: float = 1.0, static: bool = False,
                 raise_error_at_min_scale: bool = True, enabled: bool = True):
        self._s = _C.DeepSpeedLossScaler(
            _real("init_scale", init_scale), _int("loss_scale_window", loss_scale_window),
            _real("min_loss_scale", min_loss_scale), _int("hysteresis", hysteresis),
            _flag("consecutive_hysteresis", consecutive_hysteresis), static=_flag("static", static),
            raise_at_min=_flag("raise_error_at_min_scale", raise_error_at_min_scale))
        self._enabled = enabled

    def is_dynamic(self) -> bool:
        return self._s.dynamic

    def scale_after_clean_step(self) -> float:
        """The scale update(False) would leave, this scaler unchanged: DeepSpeed's ZeRO step
        updates the loss scale before it unscales and clips (unscale_and_clip_grads reads the
        updated loss_scale), so on a step that grows the scale the engine divides the gradients
        by the grown one (deepspeedai/DeepSpeed#8588 shows it). The rule is the C state
        machine's, run on a copy of the state."""
        if not self._enabled:
            return 1.0
        probe = _C.DeepSpeedLossScaler(1.0, 1, 1.0, 1, False, static=False, raise_at_min=False)
        probe.load(**self._s.state())
        probe.update(False)
        return probe.scale

    def load_state_dict(self, state: dict):
        """Restores state_dict()'s keys (STATE_KEYS), configuration included, as LossScaler
        does; raise_error_at_min_scale stays the constructor's. Nothing changes on an error."""
        if not state:
            raise RuntimeError("The source state dict is empty, possibly because it was saved from a disabled "
                               "instance of the loss scaler.")
        if not isinstance(state, dict):
            raise TypeError(f"DeepSpeed loss scaler state must be a dict, got {type(state).__name__}")
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise KeyError(f"DeepSpeed loss scaler state is missing {missing}")
        args = {}
        for k in STATE_KEYS:
            v = state[k]
            if torch.is_tensor(v) and v.numel() == 1:
                v = v.item()
            if k in _INT_KEYS:
                args[k] = _int(f"state[{k!r}]", v)
            elif k in _BOOL_KEYS:
                args[k] = _flag(f"state[{k!r}]", v)
            else:
                args[k] = _real(f"state[{k!r}]", v)
        self._s.load(**args)

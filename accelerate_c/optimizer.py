"""AcceleratedOptimizer: steps and zeroes only on sync steps, skips fp16 overflow steps."""
from __future__ import annotations

import inspect

import torch

from . import fused_adam
from .state import AcceleratorState, GradientState
from .utils.operations import send_to_device


def _parameters(fn) -> tuple:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: assume torch's
        return ("set_to_none",)


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer (without re-running its __init__) so that, on the flat gradient
    buffers of the prepared models:
    - step() and zero_grad() act only when gradients are synchronised (end of accumulation);
    - under fp16, step() unscales (once: clip_grad_norm_ may have done it already), skips the
      update when a gradient is non-finite and updates the loss scale;
    - zero_grad() calls the wrapped optimizer's zero_grad (torch's: `.grad = None`, or zeros
      in the buffer with set_to_none=False)."""

    def __init__(self, optimizer, device_placement: bool = True, scaler=None, grads=None, engine_clip=None,
                 unscale_in_place: bool = True):
        self.optimizer = optimizer
        self.scaler = scaler
        self._grads = grads
        # False under DeepSpeed's fp16 policy: the fp16 gradients keep the loss scale, only
        # checked here; the strategy unscales the fp32 copies the masters read
        self._unscale_in_place = unscale_in_place
        # DeepSpeed's engine clips inside its step: engine_clip(params) -> their norm, clipped
        # to the configuration's gradient_clipping (the Accelerator's, so that clip and step
        # share one code path); `engine_norm` keeps the last such norm
        self._engine_clip = engine_clip
        self.engine_norm = None
        self.accelerator_state = AcceleratorState()
        self.gradient_state = GradientState()
        self.device_placement = device_placement
        self._is_overflow = False
        if device_placement:
            state_dict = self.optimizer.state_dict()
            self.optimizer.load_state_dict(send_to_device(state_dict, self.accelerator_state.device))

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, state):
        self.optimizer.state = state

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, param_groups):
        self.optimizer.param_groups = param_groups

    @property
    def defaults(self):
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults):
        self.optimizer.defaults = defaults

    def add_param_group(self, param_group):
        self.optimizer.add_param_group(param_group)

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)

    def state_dict(self):
        return self.optimizer.state_dict()

    def model_parameters(self) -> list:
        """The model parameters this optimizer updates (a sharded optimizer's param_groups list
        views of the parts this process owns instead)."""
        if self._grads is not None:
            return self._grads.strategy.model_params(self.optimizer)
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none=None):
        """On sync steps, the wrapped optimizer's own zero_grad runs (a subclass's override or a
        wrapper's, as with accelerate); set_to_none defaults to True and is only passed to a
        zero_grad that takes it. The flat buffers need nothing here: the `.grad` values it
        leaves (None, zeroed views, new tensors) are brought into the buffers at the next step
        (GradManager.prepare_step)."""
        if not self.gradient_state.sync_gradients:
            return
        zero_grad = self.optimizer.zero_grad
        if "set_to_none" in _parameters(zero_grad):
            self.optimizer.zero_grad(set_to_none=True if set_to_none is None else set_to_none)
        else:
            if set_to_none is not None:
                raise ValueError(f"zero_grad(set_to_none={set_to_none!r}): {type(self.optimizer).__name__}.zero_grad "
                                 "takes no set_to_none argument")
            self.optimizer.zero_grad()
        if self._grads is not None:
            self._grads.strategy.after_zero_grad(self.optimizer, True if set_to_none is None else set_to_none)

    def step(self, closure=None):
        if not self.gradient_state.sync_gradients:
            return
        found_inf = False
        if self._grads is not None:
            if self.scaler is not None and not self._unscale_in_place:
                found_inf = self._grads.found_nonfinite(self.model_parameters())
            else:
                inv = 1.0 / self.scaler.get_scale() if self.scaler is not None else None
                found_inf = self._grads.ready(self.model_parameters(), inv)
        self._is_overflow = found_inf
        if found_inf and self._engine_clip is not None and self.engine_norm is None:
            self.engine_norm = 0.0  # DeepSpeed's optimizer starts its norm at 0.0; a skipped step keeps it
        if not found_inf:
            if self._engine_clip is not None:
                self.engine_norm = self._engine_clip(self.model_parameters())
            if self._grads is not None:
                self._grads.strategy.optimizer_step(self.optimizer, closure)
            else:
                fused_adam.run_step(self.optimizer, closure)
        if self.scaler is not None:
            self.scaler.update(found_inf)
            if self._grads is not None:
                self._grads.new_scaler_step(self.model_parameters())
        if self._grads is not None:
            self._grads.strategy.after_step(self.optimizer)

    def train(self):
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()

    def eval(self):
        if callable(getattr(self.optimizer, "eval", None)):
            self.optimizer.eval()

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step() was skipped because of an fp16 overflow."""
        return self._is_overflow

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_grads", "_engine_clip")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._grads = None
        self._engine_clip = None

    def __repr__(self):
        return f"AcceleratedOptimizer({self.optimizer!r})"

"""AcceleratedScheduler: an LR scheduler that follows the optimizer's real steps."""
from __future__ import annotations

from .state import AcceleratorState, GradientState


class AcceleratedScheduler:
    """Steps the wrapped scheduler only when the optimizer really stepped: not while
    accumulating (but counted, when adjust_scheduler), not after an fp16 overflow skip; and
    `num_processes` times per call unless split_batches, as accelerate does, so a schedule
    written for the single-process step count ends at the same place. A scheduler built from a
    DeepSpeed configuration (its scheduler block, or a DummyScheduler's lr_scheduler_callable)
    is the engine's in accelerate, which steps it once per optimizer step that was not skipped:
    so does this (once_per_step). A torch scheduler passed under DeepSpeed is accelerate's
    AcceleratedScheduler there too, with the rule above."""

    def __init__(self, scheduler, optimizers, step_with_optimizer: bool = True, split_batches: bool = False,
                 once_per_step: bool = False):
        self.scheduler = scheduler
        self.optimizers = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
        self.split_batches = split_batches
        self.step_with_optimizer = step_with_optimizer
        self.once_per_step = once_per_step
        self.gradient_state = GradientState()

    def step(self, *args, **kwargs):
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            if self.gradient_state.adjust_scheduler:
                self.scheduler._step_count += 1
            return
        if any(getattr(opt, "step_was_skipped", False) for opt in self.optimizers):
            return
        repeats = 1 if self.split_batches or self.once_per_step else AcceleratorState().num_processes
        for _ in range(repeats):
            total = getattr(self.scheduler, "total_steps", None)
            if total is not None and self.scheduler._step_count > total:
                continue  # OneCycleLR raises past its last step
            self.scheduler.step(*args, **kwargs)

    # pass-throughs
    def get_last_lr(self):
        return self.scheduler.get_last_lr()

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict):
        self.scheduler.load_state_dict(state_dict)

    def get_lr(self):
        return self.scheduler.get_lr()

    def print_lr(self, *args, **kwargs):
        return self.scheduler.print_lr(*args, **kwargs)

    def __getattr__(self, name):
        # only reached for attributes not found normally: last_epoch, base_lrs, optimizer, ...
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

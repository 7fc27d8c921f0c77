"""The learning-rate schedules that follow an evaluation metric instead of the step count:
transformers' `lr_scheduler_type` "reduce_lr_on_plateau" (torch's ReduceLROnPlateau, as
transformers builds it) and "greedy" (GreedyLR, written here from transformers 5.23's
documented behaviour: it raises the rate while the metric keeps improving and lowers it when
the metric stalls). The Trainer steps them with the evaluation metric after each evaluation
during training, never per optimizer step (is_metric_driven). Imports nothing of accelerate_c."""
from __future__ import annotations

import inspect
import sys

import torch

# ReduceLROnPlateau's keyword arguments (transformers hands lr_scheduler_kwargs to it unchanged)
PLATEAU_KWARGS = frozenset(n for n in inspect.signature(torch.optim.lr_scheduler.ReduceLROnPlateau).parameters
                           if n != "optimizer")


class GreedyLR:
    """transformers' GreedyLR: `step(metric)` after each evaluation. With `patience` + 1
    improvements in a row the rate is divided by `factor` (at most `max_lr`), and `warmup`
    evaluations are then ignored; with `patience` + 1 evaluations without improvement it is
    multiplied by `factor` (at least `min_lr`), and `cooldown` evaluations are then ignored. An
    improvement beats the best value so far by `threshold` ("rel": a fraction of it, "abs": an
    amount), lower is better under mode "min". `smooth` compares the mean of the last
    `window_size` values instead. Once every group sits at `min_lr` for `reset_start`
    reductions, the rates go back to their first values and the best value is forgotten. A
    change smaller than `eps` is not made."""

    def __init__(self, optimizer, mode="min", factor=0.95, patience=10, threshold=1e-6, threshold_mode="abs",
                 cooldown=0, warmup=0, min_lr=1e-3, max_lr=1.0, eps=1e-8, verbose=False, smooth=False,
                 window_size=50, reset_start=500):
        if factor >= 1.0:
            raise ValueError(f"GreedyLR: factor must be < 1.0, got {factor}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"GreedyLR: {type(optimizer).__name__} is not an Optimizer")
        if mode not in ("min", "max"):
            raise ValueError(f"GreedyLR: mode must be 'min' or 'max', got {mode!r}")
        if threshold_mode not in ("rel", "abs"):
            raise ValueError(f"GreedyLR: threshold_mode must be 'rel' or 'abs', got {threshold_mode!r}")
        self.optimizer = optimizer
        groups = optimizer.param_groups
        self.min_lrs = self._per_group(min_lr, "min_lr", len(groups))
        self.max_lrs = self._per_group(max_lr, "max_lr", len(groups))
        self.mode, self.factor, self.patience, self.threshold = mode, factor, patience, threshold
        self.threshold_mode, self.cooldown, self.warmup, self.eps = threshold_mode, cooldown, warmup, eps
        self.verbose, self.smooth, self.window_size = verbose, smooth, window_size
        self.reset_start = self.reset_start_original = reset_start
        self.last_epoch = 0
        self._init_lrs = [g["lr"] for g in groups]
        self._last_lr = list(self._init_lrs)
        self._forget()

    @staticmethod
    def _per_group(value, name, n):
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(f"GreedyLR: {name} has {len(value)} values for {n} parameter groups")
            return list(value)
        return [value] * n

    def _forget(self):
        """No best value, no counts (at the start and after a reset)."""
        self.best = float("inf") if self.mode == "min" else float("-inf")
        self.num_bad_epochs = self.num_good_epochs = 0
        self.cooldown_counter = self.warmup_counter = 0
        self._window, self._window_sum = [], 0.0  # the last window_size metric values (smooth=True)

    def _better(self, value, best):
        if self.mode == "min":
            return value < (best * (1.0 - self.threshold) if self.threshold_mode == "rel" else best - self.threshold)
        return value > (best * (1.0 + self.threshold) if self.threshold_mode == "rel" else best + self.threshold)

    def step(self, metrics, epoch=None):
        value = float(metrics)
        if self.smooth:
            # a running sum (added in, taken out), as transformers keeps it: the same rounding
            self._window.append(value)
            self._window_sum += value
            if len(self._window) > self.window_size:
                self._window_sum -= self._window.pop(0)
            value = self._window_sum / len(self._window)
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        if self.cooldown_counter > 0 or self.warmup_counter > 0:
            # just changed: this evaluation only counts down
            if self.cooldown_counter > 0:
                self.cooldown_counter -= 1
            else:
                self.warmup_counter -= 1
            self.num_bad_epochs = self.num_good_epochs = 0
        else:
            if self._better(value, self.best):
                self.best, self.num_bad_epochs = value, 0
                self.num_good_epochs += 1
            else:
                self.num_good_epochs = 0
                self.num_bad_epochs += 1
            if self.num_good_epochs > self.patience:
                self._scale(up=True)
                self.reset_start = self.reset_start_original
                self.warmup_counter, self.num_good_epochs = self.warmup, 0
            elif self.num_bad_epochs > self.patience:
                self._scale(up=False)
                if all(g["lr"] <= lo for g, lo in zip(self.optimizer.param_groups, self.min_lrs)):
                    self.reset_start -= 1
                    if self.reset_start <= 0:
                        self._restart()
                self.cooldown_counter, self.num_bad_epochs = self.cooldown, 0
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def _scale(self, up: bool):
        for i, group in enumerate(self.optimizer.param_groups):
            old = float(group["lr"])
            new = min(old / self.factor, self.max_lrs[i]) if up else max(old * self.factor, self.min_lrs[i])
            if (new - old if up else old - new) > self.eps:
                group["lr"] = new
                if self.verbose:
                    print(f"GreedyLR: step {self.last_epoch}: learning rate of group {i} "
                          f"{'raised' if up else 'lowered'} to {new:.4e}")

    def _restart(self):
        for group, lr in zip(self.optimizer.param_groups, self._init_lrs):
            group["lr"] = lr
        self._forget()
        self.reset_start = self.reset_start_original
        if self.verbose:
            print("GreedyLR: learning rates back to their first values")

    def get_last_lr(self) -> list:
        return self._last_lr

    def state_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in vars(self).items() if k != "optimizer"}

    def load_state_dict(self, state_dict: dict):
        for k, v in state_dict.items():
            setattr(self, k, list(v) if isinstance(v, list) else v)
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr


def is_metric_driven(scheduler) -> bool:
    """Whether the Trainer steps `scheduler` with the evaluation metric after each evaluation
    (and not after each optimizer step), as transformers' Trainer decides: torch's
    ReduceLROnPlateau, our GreedyLR, or transformers' own GreedyLR (recognised without
    importing transformers: an object of it exists only once its module is loaded)."""
    if isinstance(scheduler, (torch.optim.lr_scheduler.ReduceLROnPlateau, GreedyLR)):
        return True
    theirs = getattr(sys.modules.get("transformers.optimization"), "GreedyLR", None)
    return isinstance(theirs, type) and isinstance(scheduler, theirs)


GREEDY_KWARGS = frozenset(n for n in inspect.signature(GreedyLR).parameters if n != "optimizer")

"""transformers' learning-rate schedules (`lr_scheduler_type`) as LambdaLR factors over the
optimizer's steps, written from their formulas: linear, cosine, cosine_with_restarts,
polynomial, constant, constant_with_warmup, inverse_sqrt, cosine_with_min_lr. Every schedule
warms up linearly from 0 over `num_warmup_steps`. Checked step by step against transformers'
get_scheduler in tests/test_trainer_vs_transformers.py."""
from __future__ import annotations

import functools
import math

import torch


def _warmup(step, warmup):
    return step / max(1, warmup)


def _linear(step, *, warmup, total):
    if step < warmup:
        return _warmup(step, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


def _cosine(step, *, warmup, total, num_cycles=0.5, min_lr_rate=0.0):
    if step < warmup:
        return _warmup(step, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    factor = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return max(0.0, factor * (1.0 - min_lr_rate) + min_lr_rate)


def _cosine_with_restarts(step, *, warmup, total, num_cycles=1):
    """num_cycles hard restarts: the cosine from 1 to 0 repeated, 0 once training ends."""
    if step < warmup:
        return _warmup(step, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((num_cycles * progress) % 1.0))))


def _polynomial(step, *, warmup, total, lr_init, lr_end=1e-7, power=1.0):
    """From lr_init down to lr_end as (1 - progress) ** power; lr_end after the last step."""
    if step < warmup:
        return _warmup(step, warmup)
    if step > total:
        return lr_end / lr_init
    remaining = 1.0 - (step - warmup) / (total - warmup)
    return ((lr_init - lr_end) * remaining ** power + lr_end) / lr_init


def _constant(step, *, warmup=0, total=0):
    return 1.0


def _constant_with_warmup(step, *, warmup, total=0):
    return step / max(1.0, warmup) if step < warmup else 1.0


def _inverse_sqrt(step, *, warmup, total=0, timescale=None):
    """1 / sqrt((step + timescale - warmup) / timescale) after the warm-up (timescale defaults to
    the warm-up length, or 10000 without one)."""
    if step < warmup:
        return _warmup(step, warmup)
    scale = timescale if timescale is not None else (warmup or 10_000)
    return 1.0 / math.sqrt((step + scale - warmup) / scale)


_SCHEDULES = {"linear": _linear, "cosine": _cosine, "cosine_with_restarts": _cosine_with_restarts,
              "polynomial": _polynomial, "constant": _constant, "constant_with_warmup": _constant_with_warmup,
              "inverse_sqrt": _inverse_sqrt, "cosine_with_min_lr": _cosine}
SCHEDULERS = tuple(_SCHEDULES)
# the lr_scheduler_kwargs each schedule takes (transformers' names)
SCHEDULER_KWARGS = {"cosine": {"num_cycles"}, "cosine_with_restarts": {"num_cycles"},
                    "polynomial": {"lr_end", "power"}, "inverse_sqrt": {"timescale"},
                    "cosine_with_min_lr": {"num_cycles", "min_lr", "min_lr_rate"}}


def get_scheduler(name: str, optimizer, num_warmup_steps: int = 0, num_training_steps: int = 0, **kwargs):
    """transformers' get_scheduler for the schedules above: a LambdaLR over the optimizer's steps."""
    if name not in _SCHEDULES:
        raise ValueError(f"lr_scheduler_type {name!r} is not supported yet by accelerate_c (supported: "
                         f"{', '.join(_SCHEDULES)})")
    unknown = set(kwargs) - SCHEDULER_KWARGS.get(name, set())
    if unknown:
        raise ValueError(f"lr_scheduler_kwargs: {name!r} takes no argument {sorted(unknown)[0]!r}")
    base_lr = optimizer.defaults["lr"]
    if name == "polynomial":
        kwargs["lr_init"] = base_lr
        if kwargs.get("lr_end", 1e-7) >= base_lr:  # transformers: lr_init must be above lr_end
            raise ValueError(f"lr_scheduler_kwargs.lr_end ({kwargs['lr_end']}) must be smaller than the initial "
                             f"learning rate ({base_lr})")
    if name == "cosine_with_min_lr":
        min_lr, rate = kwargs.pop("min_lr", None), kwargs.pop("min_lr_rate", None)
        if (min_lr is None) == (rate is None):
            raise ValueError("lr_scheduler_type 'cosine_with_min_lr' needs exactly one of lr_scheduler_kwargs "
                             "min_lr / min_lr_rate")
        kwargs["min_lr_rate"] = rate if rate is not None else min_lr / base_lr
    fn = functools.partial(_SCHEDULES[name], warmup=num_warmup_steps, total=num_training_steps, **kwargs)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)

"""transformers' learning-rate schedules (`lr_scheduler_type`): those over the optimizer's steps
as LambdaLR factors written from their formulas (linear, cosine, cosine_with_restarts,
polynomial, constant, constant_with_warmup, inverse_sqrt, cosine_with_min_lr,
cosine_warmup_with_min_lr, warmup_stable_decay), and the two that follow an evaluation metric
(reduce_lr_on_plateau, greedy: metric_schedules.py). Checked step by step against transformers'
get_scheduler in tests/test_trainer_vs_transformers.py."""
from __future__ import annotations

import functools
import math
import warnings

import torch

from .metric_schedules import GREEDY_KWARGS, PLATEAU_KWARGS, GreedyLR


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


def _cosine_warmup_with_min_lr(step, *, warmup, total, num_cycles=0.5, min_lr_rate=0.0, warmup_lr_rate=None):
    """transformers' "cosine_warmup_with_min_lr": the warm-up is one step ahead of the others'
    ((step + 1) / warmup, never 0), or linear from warmup_lr_rate to 1 over warmup - 1 steps;
    the cosine down to min_lr_rate is one step ahead too."""
    if step < warmup:
        if warmup_lr_rate is None:
            return (step + 1.0) / max(1.0, warmup)
        return warmup_lr_rate + (1.0 - warmup_lr_rate) * step / max(1, warmup - 1)
    progress = (step - warmup + 1.0) / max(1.0, total - warmup)
    factor = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return max(0, factor * (1 - min_lr_rate) + min_lr_rate)


_WSD_SHAPES = ("linear", "cosine", "1-sqrt")


def _warmup_stable_decay(step, *, warmup, stable, decay, warmup_type="linear", decay_type="cosine",
                         min_lr_ratio=0.0, num_cycles=0.5):
    """Warm-up from min_lr_ratio to 1 (shape warmup_type), `stable` steps at 1, `decay` steps down
    to min_lr_ratio (shape decay_type), then min_lr_ratio."""
    if step < warmup:
        p = step / max(1, warmup)
        if warmup_type == "linear":
            rise = p
        elif warmup_type == "cosine":
            rise = 0.5 * (1.0 - math.cos(math.pi * p))
        else:
            rise = 1.0 - math.sqrt(1.0 - p)
        return max(0.0, rise * (1.0 - min_lr_ratio) + min_lr_ratio)
    if step < warmup + stable:
        return 1.0
    if step < warmup + stable + decay:
        p = (step - warmup - stable) / max(1, decay)
        if decay_type == "linear":
            fall = 1.0 - p
        elif decay_type == "cosine":
            fall = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * p))
        else:
            fall = 1.0 - math.sqrt(p)
        return max(0.0, fall * (1.0 - min_lr_ratio) + min_lr_ratio)
    return min_lr_ratio


_SCHEDULES = {"linear": _linear, "cosine": _cosine, "cosine_with_restarts": _cosine_with_restarts,
              "polynomial": _polynomial, "constant": _constant, "constant_with_warmup": _constant_with_warmup,
              "inverse_sqrt": _inverse_sqrt, "cosine_with_min_lr": _cosine,
              "cosine_warmup_with_min_lr": _cosine_warmup_with_min_lr, "warmup_stable_decay": _warmup_stable_decay}
# stepped with the evaluation metric, not per optimizer step (metric_schedules.is_metric_driven)
_METRIC_SCHEDULES = {"reduce_lr_on_plateau": torch.optim.lr_scheduler.ReduceLROnPlateau, "greedy": GreedyLR}
SCHEDULERS = tuple(_SCHEDULES) + tuple(_METRIC_SCHEDULES)
# the lr_scheduler_kwargs each schedule takes (transformers' names)
SCHEDULER_KWARGS = {"cosine": {"num_cycles"}, "cosine_with_restarts": {"num_cycles"},
                    "polynomial": {"lr_end", "power"}, "inverse_sqrt": {"timescale"},
                    "cosine_with_min_lr": {"num_cycles", "min_lr", "min_lr_rate"},
                    "cosine_warmup_with_min_lr": {"num_cycles", "min_lr", "min_lr_rate", "warmup_lr_rate"},
                    "warmup_stable_decay": {"num_decay_steps", "num_stable_steps", "warmup_type", "decay_type",
                                            "min_lr_ratio", "num_cycles"},
                    "reduce_lr_on_plateau": set(PLATEAU_KWARGS), "greedy": set(GREEDY_KWARGS)}


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_kwargs(name: str, kwargs: dict) -> None:
    """A ValueError naming the lr_scheduler_kwargs entry that schedule `name` cannot take or
    lacks, before any training (transformers finds most of these only when the schedule is built)."""
    allowed = SCHEDULER_KWARGS.get(name, set())
    unknown = sorted(set(kwargs) - allowed, key=str)
    if unknown:
        raise ValueError(f"{name!r} takes no argument {unknown[0]!r}"
                         + (f" (it takes: {', '.join(sorted(allowed))})" if allowed else ""))
    if name not in _METRIC_SCHEDULES:
        for key, value in kwargs.items():
            if key not in ("warmup_type", "decay_type") and value is not None and \
                    (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)):
                raise ValueError(f"{key} must be a finite number, got {value!r}")
    if name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr") and \
            (kwargs.get("min_lr") is None) == (kwargs.get("min_lr_rate") is None):
        raise ValueError(f"{name!r} needs exactly one of min_lr / min_lr_rate")
    if name == "warmup_stable_decay":
        if kwargs.get("num_decay_steps") is None:
            raise ValueError("'warmup_stable_decay' needs num_decay_steps (the length of the decay phase)")
        for key in ("num_decay_steps", "num_stable_steps"):
            if kwargs.get(key) is not None and not _is_count(kwargs[key]):
                raise ValueError(f"{key} must be a whole number of steps >= 0, got {kwargs[key]!r}")
        for key in ("warmup_type", "decay_type"):
            if kwargs.get(key, "linear") not in _WSD_SHAPES:
                raise ValueError(f"{key} must be one of {', '.join(_WSD_SHAPES)}, got {kwargs[key]!r}")
    if name in _METRIC_SCHEDULES:
        # their constructors check the values: built once on a throwaway optimizer
        probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        try:
            _METRIC_SCHEDULES[name](probe, **kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name!r}: {e}") from None


def get_scheduler(name: str, optimizer, num_warmup_steps: int = 0, num_training_steps: int | None = 0, **kwargs):
    """transformers' get_scheduler: a LambdaLR over the optimizer's steps, or for
    reduce_lr_on_plateau / greedy the metric-driven scheduler (warm-up and length unused, as in
    transformers)."""
    if name not in SCHEDULERS:
        raise ValueError(f"lr_scheduler_type {name!r} is not supported by accelerate_c (supported: "
                         f"{', '.join(SCHEDULERS)})")
    try:
        check_kwargs(name, kwargs)
    except ValueError as e:
        raise ValueError(f"lr_scheduler_kwargs: {e}") from None
    if name in _METRIC_SCHEDULES:
        return _METRIC_SCHEDULES[name](optimizer, **kwargs)
    base_lr = optimizer.defaults["lr"]
    if name == "warmup_stable_decay":
        stable = kwargs.pop("num_stable_steps", None)
        if stable is None:
            if num_training_steps is None:
                raise ValueError("lr_scheduler_type 'warmup_stable_decay' needs num_training_steps or "
                                 "lr_scheduler_kwargs.num_stable_steps")
            stable = num_training_steps - num_warmup_steps - kwargs["num_decay_steps"]
        elif num_training_steps is not None:
            warnings.warn("warmup_stable_decay: num_stable_steps is given, so it sets the stable phase; the number "
                          "of training steps does not", stacklevel=2)
        fn = functools.partial(_warmup_stable_decay, warmup=num_warmup_steps, stable=stable,
                               decay=kwargs.pop("num_decay_steps"), **kwargs)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
    if name == "polynomial":
        kwargs["lr_init"] = base_lr
        if kwargs.get("lr_end", 1e-7) >= base_lr:  # transformers: lr_init must be above lr_end
            raise ValueError(f"lr_scheduler_kwargs.lr_end ({kwargs['lr_end']}) must be smaller than the initial "
                             f"learning rate ({base_lr})")
    if name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr"):
        min_lr, rate = kwargs.pop("min_lr", None), kwargs.pop("min_lr_rate", None)
        kwargs["min_lr_rate"] = rate if rate is not None else min_lr / base_lr
    fn = functools.partial(_SCHEDULES[name], warmup=num_warmup_steps, total=num_training_steps, **kwargs)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)

"""The real optimizer and scheduler a DeepSpeed config's `optimizer` / `scheduler` blocks
describe, in plain torch.

Optimizers follow DeepSpeed's choices: "AdamW" is torch AdamW; "Adam" is AdamW too (decoupled
weight decay) unless `adam_w_mode` is false, then torch Adam (L2 weight decay), because DeepSpeed
runs its Adam in AdamW mode by default; "SGD" is torch SGD. Unset Adam parameters take
DeepSpeed's Adam defaults (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0), which differ
from torch AdamW's weight_decay 0.01.

The schedules are DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR, written from their
definitions in DeepSpeed's deepspeed/runtime/lr_schedules.py (docstrings and formulas, read at
microsoft/DeepSpeed 38327e07): with W = max(2, warmup_num_steps) and `it` the index of the last
finished step (-1 before the first one),
- warmup (it < W): gamma = log(it + 1) / log(W) ("log", the default) or it / W ("linear");
- WarmupLR: lr = min_lr + (max_lr - min_lr) * gamma, then max_lr; before the first step min_lr;
- WarmupDecayLR: after warmup gamma = max(0, (T - it) / max(1, T - W)), T = total_num_steps;
- WarmupCosineLR: lr = base_lr * ratio, base_lr the optimizer's lr; warmup ratio =
  warmup_min_ratio + gamma * (1 - warmup_min_ratio), then
  ratio = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * (it - W + 1) / (T - W))) / 2);
  before the first step DeepSpeed sets the first parameter group's lr to 0 and leaves the others.
DeepSpeed steps a config's scheduler once per optimizer step it takes (none on an fp16 overflow).
"""
from __future__ import annotations

import math

import torch

from .config_dict import AUTO


def _concrete(block: dict, what: str) -> dict:
    params = dict(block.get("params", {}))
    left = [k for k, v in params.items() if v == AUTO]
    if left:
        raise ValueError(f"DeepSpeed config: {what}.params {', '.join(left)} still 'auto' (prepare() fills lr and "
                         "weight_decay from the DummyOptim, and the scheduler's steps from the DummyScheduler)")
    return params


def build_optimizer(block: dict, params) -> torch.optim.Optimizer:
    """The torch optimizer for a checked `optimizer` block, over `params` (DummyOptim.params:
    parameters or parameter groups)."""
    kind = str(block["type"]).lower()
    p = _concrete(block, "optimizer")
    if kind == "sgd":
        kw = {k: p[k] for k in ("lr", "momentum", "dampening", "weight_decay", "nesterov") if k in p}
        return torch.optim.SGD(params, **kw)
    adamw = kind == "adamw" or p.get("adam_w_mode", True)
    kw = dict(lr=p.get("lr", 1e-3), betas=tuple(p.get("betas", (0.9, 0.999))), eps=p.get("eps", 1e-8),
              weight_decay=p.get("weight_decay", 0.0))
    return (torch.optim.AdamW if adamw else torch.optim.Adam)(params, **kw)


def _per_group(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"DeepSpeed config: scheduler.params.{name} has {len(value)} values for {n} parameter "
                             "groups")
        return list(value)
    return [value] * n


def warmup_gamma(it: int, warmup: int, kind: str) -> float:
    """DeepSpeed's warmup fraction after step index `it` (0 <= it < warmup, warmup >= 2)."""
    return math.log(it + 1) / math.log(warmup) if kind == "log" else it / warmup


def schedule_lr(kind: str, params: dict, it: int, group: int, base_lr: float, min_lr: float, max_lr: float) -> float:
    """The learning rate of parameter group `group` once step index `it` is done (-1: before the
    first step), for schedule `kind` with its checked params (min_lr/max_lr: this group's)."""
    warmup = max(2, params.get("warmup_num_steps", 1000))
    wtype = params.get("warmup_type", "log")
    if kind == "WarmupCosineLR":  # current DeepSpeed (0.19.3 on): every group 0 before step one,
        if it < 0:                  # the cosine's progress held at 1 once total_num_steps is reached
            return 0.0
        if it < warmup:
            low = params.get("warmup_min_ratio", 0.0)
            return base_lr * (low + warmup_gamma(it, warmup, wtype) * (1.0 - low))
        total = params["total_num_steps"]
        floor = params.get("cos_min_ratio", 0.0001)
        progress = min(1.0, (it - warmup + 1) / max(1, total - warmup))
        ratio = (1 + math.cos(math.pi * progress)) / 2
        return base_lr * max(0.0, floor + (1.0 - floor) * ratio)
    if it < 0:
        return min_lr
    if it < warmup:
        gamma = warmup_gamma(it, warmup, wtype)
    elif kind == "WarmupDecayLR":
        total = params["total_num_steps"]
        gamma = max(0.0, (total - it) / max(1.0, total - warmup))
    else:
        gamma = 1.0
    return min_lr + (max_lr - min_lr) * gamma


class DeepSpeedSchedule(torch.optim.lr_scheduler.LRScheduler):
    """One of DeepSpeed's warmup schedules as a torch LR scheduler: after n calls to step() the
    lrs are DeepSpeed's after n steps (`it` = n - 1). Its state_dict is torch's."""

    def __init__(self, optimizer, kind: str, params: dict):
        self.kind = kind
        self.params = dict(params)
        n = len(optimizer.param_groups)
        self.min_lrs = _per_group(self.params.get("warmup_min_lr", 0.0), n, "warmup_min_lr")
        self.max_lrs = _per_group(self.params.get("warmup_max_lr", 0.001), n, "warmup_max_lr")
        super().__init__(optimizer)

    def get_lr(self):
        it = self.last_epoch - 1
        return [schedule_lr(self.kind, self.params, it, i, base, lo, hi)
                for i, (base, lo, hi) in enumerate(zip(self.base_lrs, self.min_lrs, self.max_lrs))]

    _get_closed_form_lr = get_lr


def build_scheduler(block: dict, optimizer) -> DeepSpeedSchedule:
    """The scheduler for a checked `scheduler` block over the (real) optimizer."""
    return DeepSpeedSchedule(optimizer, block["type"], _concrete(block, "scheduler"))

"""A state's own ``load_state_dict`` tried before the job changes: load_state (checkpoint_load.py)
and the sharded optimizer loads (zero_checkpoint.py) check every file before any state is set, and
what an optimizer or a scheduler would refuse is one of those checks. Each dry run works on a
stand-in that shares no state with the job, so nothing of the job changes and no tensor data is
read; a refusal is a CheckpointError naming the file the state came from.
"""
from __future__ import annotations

import copy
from collections import defaultdict

import torch

from .state_io import CheckpointError


def dry_run_optimizer(opt, sd, where: str) -> None:
    """Runs the optimizer's own load_state_dict on a stand-in that shares nothing with it
    (parameters and state on the meta device, no hooks), so a state it would refuse (a corrupt
    entry: torch's Adam takes float() of a "step" that is a dict) is refused now, before any
    state of the job has changed, and not after the weights were read."""
    inner = getattr(opt, "optimizer", opt)
    if not isinstance(inner, torch.optim.Optimizer):
        return
    dry = copy.copy(inner)
    dry.__dict__ = {k: v for k, v in inner.__dict__.items()}
    dry.param_groups = [{**g, "params": [torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
                                         for p in g["params"]]} for g in inner.param_groups]
    dry.state = defaultdict(dict)
    for hooks in ("_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks",
                  "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks"):
        if hooks in dry.__dict__:
            dry.__dict__[hooks] = type(inner.__dict__[hooks])()
    try:
        dry.load_state_dict(sd)
    except Exception as e:  # noqa: BLE001 - whatever the optimizer refuses, named with the file
        raise CheckpointError(f"{where}: {type(inner).__name__}.load_state_dict refuses this state "
                              f"({type(e).__name__}: {e})") from None


def dry_run_scheduler(sched, sd: dict, where: str) -> None:
    """The scheduler's load_state_dict on a copy (its optimizer shared, not copied: the load does
    not touch it), for the same reason as dry_run_optimizer."""
    inner = getattr(sched, "scheduler", sched)
    opt = getattr(inner, "optimizer", None)
    try:
        dry = copy.deepcopy(inner, {id(opt): opt} if opt is not None else {})
        sd = copy.deepcopy(sd)
    except Exception:  # noqa: BLE001 - a scheduler that cannot be copied gets no dry run
        return
    try:
        dry.load_state_dict(sd)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{where}: {type(inner).__name__}.load_state_dict refuses this state "
                              f"({type(e).__name__}: {e})") from None

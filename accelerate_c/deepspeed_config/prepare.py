"""What a prepare() call does with the DeepSpeed configuration before anything is wrapped, as
accelerate's `_prepare_deepspeed` does: the config's "auto" values filled from the call's data
loaders, model, DummyOptim and DummyScheduler, and the dummies replaced by the real optimizer
and scheduler (the config's blocks, or a DummyScheduler's `lr_scheduler_callable`)."""
from __future__ import annotations

import torch

from .optim import build_optimizer, build_scheduler
from .plugin import is_dummy_optim, is_dummy_scheduler
from .sharding import ShardingConfig, fill_for_prepare


def _first(args, test):
    return next((a for a in args if test(a)), None)


def _is_optimizer(obj) -> bool:
    return isinstance(obj, torch.optim.Optimizer) or is_dummy_optim(obj)


def _is_scheduler(obj) -> bool:
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or is_dummy_scheduler(obj)


def prepare_args(sharding: ShardingConfig, args, *, split_batches: bool) -> tuple[ShardingConfig, list]:
    """(the configuration filled by this call, `args` with the dummies replaced). Without a model
    in the call, only the batch sizes can be filled; the config is final at the call with one."""
    model = _first(args, lambda a: isinstance(a, torch.nn.Module))
    optimizer = _first(args, _is_optimizer)
    scheduler = _first(args, _is_scheduler)
    loaders = [a for a in args if isinstance(a, torch.utils.data.DataLoader)]
    if sharding.pending or optimizer is not None or scheduler is not None:
        sharding = fill_for_prepare(sharding, dataloaders=loaders, model=model, optimizer=optimizer,
                                    scheduler=scheduler, split_batches=split_batches)
    if model is not None and sharding.scheduler is not None and scheduler is None:
        # DeepSpeed's engine would build the block's scheduler and step it itself; here it is
        # stepped through the object prepare() returns for a DummyScheduler (never dropped silently)
        raise ValueError(f"DeepSpeed config{' ' + sharding.source if sharding.source else ''} has a scheduler block "
                         f"({sharding.scheduler.type}) and prepare() got no scheduler: pass "
                         "DummyScheduler(optimizer, ...) to the same prepare() call and step what it returns, or "
                         "remove the block")
    out = list(args)
    built = {}
    for i, obj in enumerate(out):
        if is_dummy_optim(obj):
            built[id(obj)] = out[i] = build_optimizer(sharding.optimizer.block(), obj.params)
    for i, obj in enumerate(out):
        if not is_dummy_scheduler(obj):
            continue
        opt = obj.optimizer
        real = built.get(id(opt), opt)
        if is_dummy_optim(real):
            raise ValueError("DummyScheduler: its optimizer is a DummyOptim that is not passed to the same "
                             "prepare() call; pass both together")
        if obj.lr_scheduler_callable is not None:  # DeepSpeed prefers the client's callable to the block
            out[i] = obj.lr_scheduler_callable(real)
        else:
            out[i] = build_scheduler(sharding.scheduler.block(), real)
    return sharding, out

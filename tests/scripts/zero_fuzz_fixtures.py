"""The pristine sharded checkpoints of the `zero_load_state` fuzz target (tests/pyfuzz_zero.py),
written by a real job of 2 processes (launched once per fuzzing run):

    zero_fuzz_fixtures.py DIR

For each KIND, zero1, zero2 and zero3 (accelerate's DeepSpeedPlugin, ZeRO stages 1 to 3; stage 3
runs on full sharding with DeepSpeed's settings) and fsdp (full sharding through accelerate's
FullyShardedDataParallelPlugin, FSDP2): the model and AdamW of
tests/scripts/zero_checkpoint.py (tied weights, two parameter groups), a StepLR scheduler whose
step size is never reached (the learning rate stays 1e-2 / 5e-3: the fuzz target's plain-torch
reference needs no schedule), a prepared data loader one batch into its epoch, STEPS steps on
each process's half of the global batches, then save_state to DIR/KIND/pristine; one more step
and save_state to DIR/KIND/outside (the other checkpoint a mutation's symbolic links point to).
Then DIR/two_optimizers: ZeRO-2 with the same two parameter groups as two AdamW optimizers (so
each shard group holds parameters of both: the plan lists the other optimizer's as null), STEPS
steps, save_state (tests/test_zero_checkpoint_checks.py loads it on one process).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_checkpoint import GLOBAL, build, local  # noqa: E402  (the model, optimizer and batches)

from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin  # noqa: E402

from accelerate_c import Accelerator  # noqa: E402
from accelerate_c.state import AcceleratorState, GradientState  # noqa: E402

KINDS = ("zero1", "zero2", "zero3", "fsdp")
STEPS = 3


def accelerator(kind: str) -> Accelerator:
    AcceleratorState._reset_state()  # one Accelerator per kind, in one process group
    GradientState._reset_state()
    if kind == "fsdp":
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=300)
        return Accelerator(cpu=True, fsdp_plugin=plugin)
    cfg = {"zero_optimization": {"stage": int(kind[-1])}, "gradient_accumulation_steps": 1,
           "train_micro_batch_size_per_gpu": GLOBAL // dist.get_world_size()}
    return Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))


def step(acc, model, opt, sched, k: int) -> None:
    x, y = local(k, dist.get_rank(), dist.get_world_size())
    acc.backward(torch.nn.functional.cross_entropy(model(x).float(), y))
    opt.step()
    sched.step()
    opt.zero_grad()


def save(kind: str, directory: str) -> None:
    acc = accelerator(kind)
    model, opt = build()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000, gamma=0.5)
    loader = DataLoader(TensorDataset(torch.arange(48.0).view(24, 2)), batch_size=3, shuffle=True)
    model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    batches = iter(loader)
    next(batches)  # mid-epoch: the position and the epoch's starting RNG states are saved
    for k in range(STEPS):
        step(acc, model, opt, sched, k)
    acc.save_state(os.path.join(directory, kind, "pristine"))
    step(acc, model, opt, sched, STEPS)
    acc.save_state(os.path.join(directory, kind, "outside"))
    if acc.is_main_process:
        print(f"{kind}: {sorted(os.listdir(os.path.join(directory, kind, 'pristine')))}", flush=True)


def two_optimizers():
    """build()'s model, and its optimizer's two parameter groups as two AdamW optimizers."""
    model, _ = build()
    named = list(model.named_parameters())
    return model, [torch.optim.AdamW([p for n, p in named if n.endswith("weight")], lr=1e-2, weight_decay=0.1),
                   torch.optim.AdamW([p for n, p in named if not n.endswith("weight")], lr=5e-3, weight_decay=0.0)]


def save_two_optimizers(directory: str) -> None:
    acc = accelerator("zero2")
    model, opts = two_optimizers()
    model, *opts = acc.prepare(model, *opts)
    for k in range(STEPS):
        x, y = local(k, dist.get_rank(), dist.get_world_size())
        acc.backward(torch.nn.functional.cross_entropy(model(x).float(), y))
        for o in opts:
            o.step()
            o.zero_grad()
    acc.save_state(os.path.join(directory, "two_optimizers"))


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    directory = sys.argv[1]
    for kind in KINDS:
        save(kind, directory)
    save_two_optimizers(directory)
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"zero fuzz fixtures written on {dist.get_world_size()} processes", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Reentrant activation checkpointing of the output layer, where a model's buffers are finished
in order by one callback per backward (inside join_uneven_inputs a model with several groups,
or find_unused_parameters over several groups; here a bf16 layer, an fp32 layer and, in one
variant, a float64 layer): the first gradients arrive inside the checkpoint's nested backward,
whose end must not be taken for the backward's (DDPStrategy._finish_ordered defers to the
outer one). torch DDP refuses reentrant checkpointing under Join and with find_unused, so the
reference is torch itself: each rank's gradients of every batch from a plain copy of the model
(parameters fixed: no optimizer step), all-gathered before the loop; at step i the expected
gradient is the sum over the ranks that have batch i, divided by the world size (a joined rank
sends zeros, as torch's Join does), in each parameter's dtype. Rank 0 has one batch more.
Prints "reentrant join OK"."""
from __future__ import annotations

import contextlib
import itertools
import sys

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from accelerate_c import Accelerator
from accelerate_c.utils import DistributedDataParallelKwargs


class Net(torch.nn.Module):
    def __init__(self, f64: bool):
        super().__init__()
        self.a = torch.nn.Linear(8, 8).to(torch.bfloat16)
        self.c = torch.nn.Linear(8, 8).to(torch.float64) if f64 else None
        self.b = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.a(x.to(torch.bfloat16))).float()
        if self.c is not None:
            h = torch.tanh(self.c(h.double())).float()
        return checkpoint(self.b, h, use_reentrant=True)


def run(join: bool, find_unused: bool, f64: bool, raw: bool) -> list[str]:
    acc = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=find_unused)])
    world, rank = acc.num_processes, acc.process_index
    torch.manual_seed(0)
    model = Net(f64)
    ref = Net(f64)
    ref.load_state_dict(model.state_dict())
    model = acc.prepare(model)
    g = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(4, 8, generator=g) for _ in range(3 if (rank == 0 or not join) else 2)]
    # each rank's local gradients of each batch (torch alone), then every rank's
    local = []
    for x in batches:
        ref.zero_grad()
        ref(x).sum().backward()
        local.append([p.grad.detach().double().clone() for p in ref.parameters()])
    everyone = [None] * world
    dist.all_gather_object(everyone, local)
    fails = []
    with acc.join_uneven_inputs([model], even_batches=False) if join else contextlib.nullcontext():
        for i, x in enumerate(batches):
            loss = model(x).sum()
            loss.backward() if raw else acc.backward(loss)
            for k, (name, p) in enumerate(model.named_parameters()):
                want = sum(r[i][k] for r in everyone if i < len(r)) / world
                want = want.to(p.dtype)
                if p.grad is None or not torch.equal(p.grad, want):
                    err = "no gradient" if p.grad is None else float((p.grad.double() - want.double()).abs().max())
                    fails.append(f"join={join} find_unused={find_unused} f64={f64} raw={raw} step {i} {name}: {err}")
            model.zero_grad()
    acc.free_memory()
    return fails


def main() -> int:
    dist.init_process_group("gloo") if not dist.is_initialized() else None
    fails = []
    for join, find_unused, f64, raw in itertools.product((True, False), (False, True), (False, True), (False, True)):
        if not join and not find_unused:
            continue  # no ordered finishing there: tested elsewhere (test_clip_hook_sums, ddp_float64)
        fails += run(join, find_unused, f64, raw)
    for f in fails[:20]:
        print(f, flush=True)
    if dist.get_rank() == 0 and not fails:
        print("reentrant join OK", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())

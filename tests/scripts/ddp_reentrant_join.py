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


class Head(torch.nn.Module):
    """A second prepared model: an fp32 layer and a float64 scale (no buffer)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)
        self.scale = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))

    def forward(self, h):
        return (self.lin(h).double() * self.scale).float()


def two_models(raw: bool, both: bool) -> list[str]:
    """find_unused_parameters over two prepared models, the trunk in a reentrant checkpoint
    below the head (whose gradients come first, in the outer backward) or each model in its own
    checkpoint (two nested backwards): a nested backward is not a new one, so the models ordered
    before it are still finished (a review found the head's float64 scale left un-averaged)."""
    acc = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    torch.manual_seed(0)
    trunk, head = torch.nn.Linear(8, 8), Head()
    ref_trunk, ref_head = torch.nn.Linear(8, 8), Head()
    ref_trunk.load_state_dict(trunk.state_dict())
    ref_head.load_state_dict(head.state_dict())
    trunk, head = acc.prepare(trunk, head)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + acc.process_index))
    ref_head(torch.relu(ref_trunk(x))).sum().backward()
    want = [p.grad.double().clone() for m in (ref_trunk, ref_head) for p in m.parameters()]
    for w in want:
        dist.all_reduce(w)
        w /= acc.num_processes
    h = checkpoint(lambda t: torch.relu(trunk(t)), x.requires_grad_(), use_reentrant=True)
    loss = (checkpoint(head, h, use_reentrant=True) if both else head(h)).sum()
    loss.backward() if raw else acc.backward(loss)
    fails = []
    named = [(f"trunk.{n}", p) for n, p in trunk.named_parameters()] + [(f"head.{n}", p) for n, p in head.named_parameters()]
    for (name, p), w in zip(named, want):
        if p.grad is None or not torch.equal(p.grad, w.to(p.dtype)):
            fails.append(f"two models raw={raw} both={both} {name}: "
                         f"{'no gradient' if p.grad is None else float((p.grad.double() - w).abs().max())}")
    acc.free_memory()
    return fails


def main() -> int:
    dist.init_process_group("gloo") if not dist.is_initialized() else None
    fails = []
    for join, find_unused, f64, raw in itertools.product((True, False), (False, True), (False, True), (False, True)):
        if not join and not find_unused:
            continue  # no ordered finishing there: tested elsewhere (test_clip_hook_sums, ddp_float64)
        fails += run(join, find_unused, f64, raw)
    for raw, both in itertools.product((False, True), (False, True)):
        fails += two_models(raw, both)
    for f in fails[:20]:
        print(f, flush=True)
    if dist.get_rank() == 0 and not fails:
        print("reentrant join OK", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())

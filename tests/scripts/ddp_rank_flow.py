"""Run by tests/test_ddp.py through `accelerate-c launch --num_processes N --cpu`:
find_unused_parameters=True with control flow that differs between ranks, on a model with an
fp32 and a bf16 layer (two gradient groups) and beside a second prepared model, against torch
DDP (find_unused_parameters=True) on the same seed and data: raw loss.backward() twice in one
sync step, `.grad` read right after a raw backward (the average already, as torch's), no_sync
accumulation, and a step in which one rank gives the bf16 layer no gradient at all. The first
model's skipped branch also holds a float64 layer (no gradient buffer: its gradients are reduced one by one at
the end of backward), so a rank that leaves it out must still join that reduction. Prints
"rank flow OK on N processes" when every check passed (strategies/ddp.py, _in_order)."""
import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from accelerate_c import Accelerator
from accelerate_c.utils import DistributedDataParallelKwargs


class Net(nn.Module):
    def __init__(self, double=False):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.mid = nn.Linear(8, 8).to(torch.bfloat16)
        self.dbl = nn.Linear(8, 8).double() if double else None
        self.out = nn.Linear(8, 3)

    def forward(self, x, skip=False):
        h = torch.tanh(self.inp(x))
        if not skip:
            h = torch.tanh(self.mid(h.to(torch.bfloat16))).float()
            if self.dbl is not None:
                h = h + torch.tanh(self.dbl(h.double())).float()
        return self.out(h)


torch.manual_seed(0)
bases = [Net(double=True), Net()]
acc = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
rank, world = acc.process_index, acc.num_processes
ours = acc.prepare(*[copy.deepcopy(b) for b in bases])
theirs = [DDP(copy.deepcopy(b), find_unused_parameters=True) for b in bases]
g = torch.Generator().manual_seed(100 + rank)
fails = []


def loss_of(models, x, y, skip):
    # the second model always runs whole; the first leaves its bf16 layer out where `skip`
    return sum(nn.functional.mse_loss(m(x, skip=s).float(), y) for m, s in zip(models, (skip, False)))


def compare(what):
    for k, (a, b) in enumerate(zip(ours, theirs)):
        for (name, p), q in zip(a.named_parameters(), b.module.parameters()):
            if p.dtype == torch.float64:
                continue
            if (p.grad is None) != (q.grad is None):
                fails.append(f"{what}: model {k} {name}: grad {p.grad is None} vs torch {q.grad is None}")
            elif p.grad is not None:
                # against the gradient's largest magnitude: bf16 sums of 3 ranks in another order
                # (each term x 1/world rounded, against torch's sum then divide) differ by ulps
                err = (p.grad.float() - q.grad.float()).abs().max().item()
                tol = (2e-2 if p.dtype == torch.bfloat16 else 1e-5) * max(q.grad.float().abs().max().item(), 1e-3)
                if err > tol:
                    fails.append(f"{what}: model {k} {name}: gradient off by {err:.3g} (tolerance {tol:.3g})")
    # float64 parameters have no gradient buffer: averaged at the end of the backward too
    # (DDPStrategy.reduce_unbuffered), as torch's bucket holding them (bitwise on 2 ranks; on 3
    # the backends sum three terms in different orders)
    for k, (a, b) in enumerate(zip(ours, theirs)):
        for (name, p), q in zip(a.named_parameters(), b.module.parameters()):
            if p.dtype != torch.float64:
                continue
            if (p.grad is None) != (q.grad is None):
                fails.append(f"{what}: model {k} {name}: grad {p.grad is None} vs torch {q.grad is None}")
            elif p.grad is not None and not (torch.equal(p.grad, q.grad) if world == 2 else torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-16)):
                fails.append(f"{what}: model {k} {name}: float64 gradient off by "
                             f"{(p.grad - q.grad).abs().max().item():.3g}")


def zero():
    for m in list(ours) + theirs:
        m.zero_grad(set_to_none=True)


# the layer left out on rank 0 only, on every rank but the last, or nowhere; each step's .grad
# right after each raw backward, and after two raw backwards in one sync step
for step, skips in enumerate([[r == 0 for r in range(world)], [r != world - 1 for r in range(world)],
                              [False] * world]):
    skip = skips[rank]
    for n in (1, 2):
        zero()
        for i in range(n):
            x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
            loss_of(ours, x, y, skip).backward()
            loss_of(theirs, x, y, skip).backward()
            compare(f"step {step}, raw backward {i + 1} of {n}")

# no_sync accumulation: the bf16 layer used on an accumulation micro-batch, left out on the sync one
zero()
x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
with acc.no_sync(ours[0]), acc.no_sync(ours[1]), theirs[0].no_sync(), theirs[1].no_sync():
    acc.backward(loss_of(ours, x, y, False))
    loss_of(theirs, x, y, False).backward()
x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
acc.backward(loss_of(ours, x, y, rank == 0))
loss_of(theirs, x, y, rank == 0).backward()
compare("no_sync then a sync backward that leaves the bf16 layer out on rank 0")

bad = [None] * world
dist.all_gather_object(bad, fails)
everyone = [f"rank {r}: {f}" for r, fs in enumerate(bad) for f in fs]
if everyone:
    raise SystemExit("\n".join(everyone[:20]))
if rank == 0:
    print(f"rank flow OK on {world} processes")

"""Run by tests/test_fsdp.py on 2 CPU processes: free_memory() under full sharding (FSDP2's
semantics, and DeepSpeed's stage 3 through the same strategy), in the two loops accelerate's
find_executable_batch_size pattern gives, each against torch DDP in the same process:
- the same model and the same (prepared) optimizer handed to prepare() again after free_memory():
  they keep training as torch does (the units stay: the model is already sharded);
- the model and optimizer dropped after free_memory(), a new pair prepared: the dropped ones are
  freed (the strategy once held every prepared model's units until the Accelerator went), and
  the new pair trains as torch does.
Prints "fsdp free_memory OK"."""
from __future__ import annotations

import gc
import weakref

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from accelerate_c import Accelerator
from accelerate_c.fsdp_plugin import FullyShardedDataParallelPlugin


def net(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def x_of(rank, step):
    return torch.randn(3, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def close(ours, theirs, what):
    for (name, p), q in zip(ours, theirs):
        err = (p.detach() - q.detach()).abs().max().item()
        assert err <= 1e-6, f"{what}: {name} off torch DDP's by {err:.3g}"


acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
rank = dist.get_rank()

# 1. the same model and prepared optimizer again
model = net(0)
ref = DDP(net(0))
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for attempt in range(2):
    acc.free_memory()
    model, opt = acc.prepare(model, opt)
    for step in range(2):
        acc.backward(model(x_of(rank, step)).square().sum())
        opt.step()
        opt.zero_grad()
        ref(x_of(rank, step)).square().sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
full = acc.get_state_dict(model)
if rank == 0:
    close(full.items(), ref.module.parameters(), "the same model and optimizer prepared again")

# 2. dropped after free_memory(), a new pair prepared
held = [weakref.ref(model), weakref.ref(opt), weakref.ref(next(iter(acc.unwrap_model(model).parameters())))]
acc.free_memory()
del model, opt
gc.collect()
alive = [type(w()).__name__ for w in held if w() is not None]
assert not alive, f"after free_memory() and the loop dropping them, still alive: {alive}"
model = net(1)
ref = DDP(net(1))
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
acc.backward(model(x_of(rank, 5)).square().sum())
opt.step()
ref(x_of(rank, 5)).square().sum().backward()
ref_opt.step()
full = acc.get_state_dict(model)
if rank == 0:
    close(full.items(), ref.module.parameters(), "a new model prepared after free_memory()")
dist.barrier()
if rank == 0:
    print("fsdp free_memory OK")

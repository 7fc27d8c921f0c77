"""A layer some forwards leave out, under full sharding with no find_unused_parameters flag (2
processes, launched by tests/test_fsdp.py): FSDP2 takes no such flag (accelerate passes none),
so neither does accelerate_c's full sharding. The layer sits in the root unit with the used ones
(NO_WRAP: a unit group partly used in a backward). Against torch's DistributedDataParallel with
find_unused_parameters=True over gloo, the same loop (SGD with momentum and weight decay, so a
wrong update of the unused layer shows): parameters within 1e-5 after every step."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate_c import Accelerator


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.mid = torch.nn.Linear(6, 6)
        self.b = torch.nn.Linear(6, 2)

    def forward(self, x, skip=False):
        h = torch.tanh(self.a(x))
        return self.b(h if skip else torch.tanh(self.mid(h)))


def build():
    torch.manual_seed(0)
    net = Net()
    return net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


def batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)


acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="NO_WRAP"))
rank = acc.process_index
model, opt = acc.prepare(*build())
ref_net, ref_opt = build()
ref = DDP(ref_net, find_unused_parameters=True)
worst = 0.0
for step in range(5):
    skip = step % 2 == 1  # the same on every process
    x, y = batch(step, rank)
    acc.backward(torch.nn.functional.mse_loss(model(x, skip=skip), y))
    opt.step()
    opt.zero_grad()
    torch.nn.functional.mse_loss(ref(x, skip=skip), y).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    full = acc.get_state_dict(model)
    box = [full]
    dist.broadcast_object_list(box, src=0)
    for n, p in ref_net.named_parameters():
        err = (box[0][n] - p.detach()).abs().max().item() / max(p.detach().abs().max().item(), 1e-6)
        worst = max(worst, err)
        assert err <= 1e-5, f"step {step}: {n} off by {err:.3g}"
if rank == 0:
    print(f"fsdp unused layer OK: {worst:.2e} from torch DDP(find_unused_parameters=True)", flush=True)
dist.destroy_process_group()

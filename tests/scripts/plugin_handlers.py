"""Run by tests/test_plugins.py through `accelerate-c launch --num_processes 2 --cpu`, with argv[1]
"accelerate_c" or "accelerate": the package whose DistributedDataParallelKwargs and
InitProcessGroupKwargs classes configure accelerate_c's Accelerator. Prints "result ..." lines
(the process group's timeout, the bucket plan, the trained parameters after checking them
against torch DDP with the same settings); the test compares the two runs' lines."""
import copy
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from accelerate_c import Accelerator


if sys.argv[1] == "accelerate":
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs
else:
    from accelerate_c.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

CAP_MB = 300 / 2**20  # 75 fp32 elements: several buckets for this model
acc = Accelerator(cpu=True, kwargs_handlers=[
    DistributedDataParallelKwargs(bucket_cap_mb=CAP_MB, find_unused_parameters=True, broadcast_buffers=False),
    InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=77))])
timeout = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).options._timeout
# the value given, not just the same in both runs (a handler dropped on the shared path would be too)
assert timeout == timedelta(seconds=77), timeout


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 2)  # never in the graph: find_unused_parameters must cope
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.b(torch.tanh(self.a(x)))))


torch.manual_seed(0)
base = Net()
ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=CAP_MB, find_unused_parameters=True,
                                          broadcast_buffers=False)
model = copy.deepcopy(base)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = acc.prepare(model, opt)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
g = torch.Generator().manual_seed(10 + acc.process_index)
for _ in range(3):
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
    acc.backward(nn.functional.mse_loss(model(x), y))
    opt.step()
    opt.zero_grad()
    nn.functional.mse_loss(ref(x), y).backward()
    ref_opt.step()
    ref_opt.zero_grad()
for (name, p), q in zip(model.named_parameters(), ref.module.parameters()):
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n} vs torch DDP: {m}")
group = acc._grads.groups[0]
spans = [group.reducer.range(b) for b in range(group.reducer.count())]
if acc.is_main_process:
    print(f"result timeout {timeout}")
    print(f"result buckets {spans}")
    print("result params " + " ".join(f"{float(p.double().sum()):.10e}" for p in model.parameters()))

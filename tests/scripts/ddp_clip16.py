"""Run by tests/test_ddp.py through `accelerate-c launch --num_processes 2 --cpu`: bf16 and fp16
models (every gradient 16-bit) clipped with clip_grad_norm_ under DDP, against torch DDP and
torch.nn.utils.clip_grad_norm_ on the same seed, data and bucket size. torch takes each
gradient's norm in its 16-bit dtype before the total, so the Accelerator rounds each parameter's
norm the same way, whether it reads the buffer (the first step) or uses the sums it took bucket by
bucket after each all-reduce (later steps, several buckets). On two processes an average has one
order, so the norms, and the parameters after every step, are torch's bit for bit. Prints
"clip16 OK"."""
import copy

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from accelerate_c import Accelerator
from accelerate_c.utils import DistributedDataParallelKwargs


class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(12, 12) for _ in range(5))
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


BUCKET_MB = 0.0005  # ~500 bytes: a few parameters per bucket
acc = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=BUCKET_MB)])
rank = acc.process_index
fails = []
for dtype in (torch.bfloat16, torch.float16):
    torch.manual_seed(5)
    base = Wide().to(dtype)
    gen = torch.Generator().manual_seed(60 + rank)
    data = [(torch.randn(6, 12, generator=gen).to(dtype), torch.randn(6, 3, generator=gen).to(dtype))
            for _ in range(6)]
    ref = DDP(copy.deepcopy(base), bucket_cap_mb=BUCKET_MB)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model, opt = acc.prepare(model, opt)
    assert len(acc._grads.groups[-1].buckets) > 2, "the case wants several buckets"
    for step, (x, y) in enumerate(data):
        (ref(x).float() - y.float()).pow(2).mean().backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
        acc.backward((model(x).float() - y.float()).pow(2).mean())
        got = acc.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        if not (got.dtype == want.dtype and torch.equal(got, want)):
            fails.append(f"{dtype} step {step}: norm {got} ({got.dtype}), torch {want} ({want.dtype})")
        for (name, p), q in zip(model.named_parameters(), ref.module.parameters()):
            if not torch.equal(p, q):
                fails.append(f"{dtype} step {step}: {name} differs from torch DDP's by "
                             f"{(p.float() - q.float()).abs().max().item():.3g}")
if fails:
    raise SystemExit("\n".join(fails[:12]))
acc.print("clip16 OK")

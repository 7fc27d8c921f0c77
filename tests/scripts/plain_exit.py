"""A plain 2-process training script: it ends by falling off the end, as users' scripts do
(tests/test_exit.py checks that the process then exits 0). Reduced backwards with several
buckets, accumulation and clipping, so the last collectives of the run are launched from the
gradient hooks during backward."""
import torch

from accelerate_c import Accelerator
from accelerate_c.utils import DistributedDataParallelKwargs

torch.manual_seed(0)
acc = Accelerator(cpu=True, gradient_accumulation_steps=2,
                  kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=0.001)])
model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = acc.prepare(model, opt)
for step in range(4):
    with acc.accumulate(model):
        loss = model(torch.randn(4, 8)).square().mean()
        acc.backward(loss)
        if acc.sync_gradients:
            acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
acc.print("trained", step + 1)

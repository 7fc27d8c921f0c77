"""Run on 2 processes by tests/test_fused_adam.py: a prepared loop with AdamW takes the one-pass
kernel at every step, and its parameters equal a torch DDP loop's bit for bit. Under DDP the
gradients are the flat buffer's GradViews; under ZeRO-2 / ZeRO-3 the optimizer steps the owned
runs of fp32 shards (get_state_dict gathers them for the comparison).

Usage: ddp_fused_adam.py ddp|zero2|zero3"""
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import accelerate_c
from accelerate_c import fused_adam

calls = []
real = fused_adam.step
fused_adam.step = lambda opt: (calls.append(1), real(opt))[1]

mode = sys.argv[1]
sharding = {}
if mode != "ddp":
    plugin = accelerate_c.DeepSpeedPlugin(zero_stage=int(mode[-1]), zero3_save_16bit_model=True)
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 4
    sharding["deepspeed_plugin"] = plugin
acc = accelerate_c.Accelerator(cpu=True, **sharding)
rank = acc.process_index
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
ref = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
ref.load_state_dict(model.state_dict())
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
ref_ddp = DistributedDataParallel(ref)
ref_opt = torch.optim.AdamW(ref_ddp.parameters(), lr=1e-2, weight_decay=0.01)
model, opt = acc.prepare(model, opt)
g = torch.Generator().manual_seed(100 + rank)
for _ in range(4):
    x = torch.randn(4, 8, generator=g)
    acc.backward(model(x).pow(2).mean())
    opt.step()
    opt.zero_grad()
    ref_ddp(x).pow(2).mean().backward()
    fused_adam.step = real  # torch's reference steps with torch's own AdamW
    ref_opt.step()
    fused_adam.step = lambda opt: (calls.append(1), real(opt))[1]
    ref_opt.zero_grad()
state = acc.get_state_dict(model)  # ZeRO-3 gathers the full weights on the main process only
same = all(torch.equal(state[k], v) for k, v in ref.state_dict().items()) if state else None
print(f"rank {rank}: fused steps {len(calls)}, equal to torch DDP: {same}", flush=True)
dist.barrier()
sys.exit(0 if same is not False and len(calls) == 4 and (same or rank > 0) else 1)

"""GPU check of NCCL called from C, with one rank (the lent machine has one GPU and NCCL refuses
two ranks on one GPU): run by benchmarks/gpu_check.sh as
`python benchmarks/nccl_check.py`. With world size 1 the
Accelerator does not reduce, so this builds the reducer itself on an NCCL process group of one
and exercises every call: load (torch's NCCL), unique id through the store, NcclComm's
collectives on CUDA tensors and streams, and the Reducer's C launch from the hooks with CUDA
events, checked against a plain torch backward (world 1: the average is the gradient)."""
import copy
import os

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from accelerate_c import _C, nccl
from accelerate_c.strategies.ddp import DDPStrategy
from accelerate_c.strategies import GradStrategy
from accelerate_c.grads import GradManager

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1)
print("NCCL from", nccl.load(), "version", _C.nccl_version())
comm = nccl.make_comm(_get_default_store(), 0, 1)
s = torch.cuda.Stream()
for dt in (torch.float32, torch.float16, torch.bfloat16):
    t = torch.randn(1000, device="cuda").to(dt)
    ref = t.clone()
    comm.all_reduce(t, stream=s.cuda_stream)
    comm.broadcast(t, root=0, stream=s.cuda_stream)
    out = torch.empty_like(t)
    comm.all_gather(t, out, stream=s.cuda_stream)
    red = torch.empty_like(t)
    comm.reduce_scatter(t, red, op="avg", stream=s.cuda_stream)
    s.synchronize()
    assert torch.equal(t, ref) and torch.equal(out, ref) and torch.equal(red, ref), dt
print("NcclComm collectives OK (fp32/fp16/bf16)")

model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)]).cuda()
plain = copy.deepcopy(model)
mgr = GradManager()
mgr.configure(GradStrategy(), bucket_cap_mb=0.25)  # small buckets: several launches per backward
mgr.add_model(model)
mgr.configure(DDPStrategy(mgr, None))
g = mgr.groups[0]
assert g.strategy_state.nccl, "the CUDA group was not attached to the C NCCL launch"
x = torch.randn(64, 256, device="cuda")
for step in range(3):
    model(x).square().mean().backward()
    plain(x).square().mean().backward()
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-7), (step, n)
    assert g.strategy_state.relaid
    for p in list(model.parameters()) + list(plain.parameters()):
        p.grad = None
print(f"Reducer C launch over NCCL OK ({g.reducer.count()} buckets, re-laid in arrival order)")
comm.close()
dist.destroy_process_group()
print("nccl_check OK")

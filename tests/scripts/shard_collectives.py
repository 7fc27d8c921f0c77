"""Run by tests/test_shard_plan.py through `accelerate-c launch --num_processes N --cpu`: the
shard plan's layout on a real gloo group. Per (dtype) group, every rank lays its own gradients
into the full buffer, reduce-scatters bucket by bucket into its shard, and must hold the mean of
every rank's gradients at the positions param_shard names (padding still zero); then it steps
its owned part of the parameters and all-gathers bucket by bucket, and every rank must hold
every updated parameter. Expected values are computed locally from every rank's gradients (each
rank regenerates them from the seeds). Then collectives.gather_chunks / reduce_chunks against
torch's all-gather / reduce-scatter. Prints "shard collectives OK on N processes"."""
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from accelerate_c import collectives
from accelerate_c.shard_plan import ShardLayout

# torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor (the old names warn); older
# torch has only those
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
world, rank = dist.get_world_size(), dist.get_rank()
fails = []

shapes = [(7, 5), (13,), (0,), (3, 3, 3), (100,), (1,), (64, 2), (9,)]
dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16, torch.float32,
          torch.float32, torch.bfloat16]
g = torch.Generator().manual_seed(0)
params = [torch.randn(s, generator=g).to(dt) for s, dt in zip(shapes, dtypes)]


def grads_of(k):
    gk = torch.Generator().manual_seed(100 + k)
    # small integers: their sum is exact in any order, so the expected mean is bitwise on 3+ ranks too
    return [torch.randint(-8, 9, p.shape, generator=gk).to(p.dtype) for p in params]


grads = [grads_of(k) for k in range(world)]
# small caps and align 4: several buckets per group, parameters split between ranks
layout = ShardLayout.from_params(params, world, rank, align=4, first_cap_bytes=64, cap_bytes=200)
if len(layout) != 2 or [gr.dtype for gr in layout] != [torch.float32, torch.bfloat16]:
    fails.append(f"groups: {[gr.dtype for gr in layout]}")
lr = 0.5
for group in layout:
    plan = group.plan
    if plan.nbuckets < 2:
        fails.append(f"{group.dtype}: only {plan.nbuckets} bucket(s)")
    full = torch.zeros(plan.total, dtype=group.dtype)
    for view, j in zip(group.param_views(full), group.indices):
        view.copy_(grads[rank][j])
    shard = torch.zeros(plan.shard_numel, dtype=group.dtype)
    for out, inp in group.bucket_views(shard, full):
        reduce_scatter(out, inp)
    shard /= world
    owned = torch.zeros(plan.shard_numel, dtype=torch.bool)
    means = {}
    for part, j in zip(group.owned_views(shard), group.indices):
        means[j] = sum(grads[k][j] for k in range(world)) / world
        if part is None:
            continue
        n = part.view.numel()
        want = means[j].reshape(-1)[part.param_offset:part.param_offset + n]
        if not torch.equal(part.view, want):
            fails.append(f"rank {rank}: {group.dtype} parameter {j}: reduce-scattered mean differs "
                         f"(max err {(part.view.float() - want.float()).abs().max().item()})")
    for i in range(plan.nparams):
        local, _, n = plan.param_shard(i, rank)
        owned[local:local + n] = True
    if bool((shard[~owned] != 0).any()):
        fails.append(f"rank {rank}: {group.dtype}: padding of the shard is not zero after reduce-scatter")
    # the step on this rank's part only, then every rank gets every updated parameter
    master = group.load_shard([params[j] for j in group.indices], torch.zeros_like(shard))
    master -= lr * shard
    gathered = torch.full((plan.total,), float("nan"), dtype=group.dtype)
    for inp, out in group.bucket_views(master, gathered):
        all_gather(out, inp)
    for view, j in zip(group.param_views(gathered), group.indices):
        want = params[j] - lr * means[j]
        if not torch.equal(view, want):
            fails.append(f"rank {rank}: {group.dtype} parameter {j}: all-gathered parameter differs")
    if bool(gathered.isnan().any()):
        fails.append(f"rank {rank}: {group.dtype}: the all-gather left elements unwritten")

# accelerate_c's in-place chunk collectives (gloo: broadcasts and reduces, not gloo's all-gather /
# reduce-scatter) against torch's own all-gather / reduce-scatter of the same buffers; the values
# are small integers, so every summation order gives the same bits
for dtype in (torch.float32, torch.bfloat16):
    for chunk in (1, 7, 1000, 40_001):
        for async_op in (False, True):
            gk = torch.Generator().manual_seed(chunk * 10 + rank)
            mine = torch.randint(-8, 9, (chunk * world,), generator=gk).to(dtype)
            want = torch.empty(chunk, dtype=dtype)
            reduce_scatter(want, mine.clone())
            got = mine.clone()
            work = collectives.reduce_chunks(got, rank, world, async_op=async_op)
            if async_op:
                work.wait()
            if not torch.equal(got[rank * chunk:(rank + 1) * chunk], want):
                fails.append(f"rank {rank}: reduce_chunks {dtype} chunk {chunk} async={async_op} differs from "
                             "reduce_scatter")
            full = torch.full((chunk * world,), float("nan"), dtype=dtype)
            full[rank * chunk:(rank + 1) * chunk] = mine[:chunk]
            want = torch.empty(chunk * world, dtype=dtype)
            all_gather(want, mine[:chunk].clone())
            work = collectives.gather_chunks(full, rank, world, async_op=async_op)
            if async_op:
                work.wait()
            if not torch.equal(full, want):
                fails.append(f"rank {rank}: gather_chunks {dtype} chunk {chunk} async={async_op} differs from "
                             "all_gather")

# every rank agrees that every rank passed
ok = torch.tensor([0 if fails else 1])
dist.all_reduce(ok, op=dist.ReduceOp.MIN)
for f in fails:
    print(f, flush=True)
dist.destroy_process_group()
if fails or ok.item() != 1:
    sys.exit(1)
if rank == 0:
    print(f"shard collectives OK on {world} processes", flush=True)

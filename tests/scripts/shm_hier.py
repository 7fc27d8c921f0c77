"""Run by tests/test_shm.py on 4 processes with ACCELERATE_C_COMM=shm: the ranks say they are on
2 hosts of 2 (ACCELERATE_C_SHM_HOST_ID, set here per rank before the Accelerator exists), so the
CPU collectives go hierarchically (accelerate_c/shm_hier.py: shared memory within each "host",
gloo between the two leaders). Every collective the Accelerator issues is checked against torch's
own over gloo on the same tensors: reduce (sum, max, mean), gather, broadcast from every rank,
wait_for_everyone; a prepared model's averaged gradients (its buffer in the host's shared
window) against every rank's own torch gradient all-reduced through gloo. (Training over the
split: the differential harness, run.py --comm shm --hosts 2.) Prints "shm hier OK"."""
import os

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
os.environ["ACCELERATE_C_SHM_HOST_ID"] = f"host-{rank // 2}"

from accelerate_c import Accelerator, collectives  # noqa: E402
from accelerate_c.utils import broadcast  # noqa: E402
from window_grads import check_window_gradients  # noqa: E402

acc = Accelerator(cpu=True)
n = acc.num_processes
assert n == 4 and collectives.cpu_comm() == "shm" and collectives.hierarchical(), collectives.cpu_comm()
g = torch.Generator().manual_seed(rank)
x = torch.randint(-50, 50, (3000, 7), generator=g).float()
for red, op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
    want = x.clone()
    dist.all_reduce(want, op=op)
    assert torch.equal(acc.reduce(x, red), want), red
want = x.clone()
dist.all_reduce(want)
assert torch.allclose(acc.reduce(x, "mean"), want / n)
# from 1 MiB reduce stages through a shared window (collectives.all_reduce_into): within each
# host there, gloo between the hosts
big = torch.randint(-50, 50, (1 << 19,), generator=g).float()
for red, op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
    want = big.clone()
    dist.all_reduce(want, op=op)
    assert torch.equal(acc.reduce(big, red), want), ("1 MiB", red)
parts = [torch.empty_like(x) for _ in range(n)]
dist.all_gather(parts, x)
assert torch.equal(acc.gather(x), torch.cat(parts))
for src in range(n):
    b = x.clone() if rank == src else torch.zeros_like(x)
    ref = b.clone()
    dist.broadcast(ref, src)
    assert torch.equal(broadcast(b, from_process=src), ref), src
acc.wait_for_everyone()

check_window_gradients(acc, x)  # window_grads.py
acc.wait_for_everyone()
if rank == 0:
    print("shm hier OK", flush=True)

"""Run by tests/test_shm.py with ACCELERATE_C_COMM set (shm or auto), or with
CpuCommKwargs("shm") against ACCELERATE_C_COMM=gloo (SHM_SELECT_BY=handler): the Accelerator's CPU
collectives go through shared memory (collectives.cpu_comm()), and what they give equals what
torch's own collectives over gloo give on the same tensors; then the cases where shared memory
must not be used: ranks reporting different hosts, a /dev/shm too small for the segment (both:
None, the second with a warning naming the fix). Prints "shm select OK"."""
import os
import warnings

import torch
import torch.distributed as dist

from accelerate_c import Accelerator, collectives
from accelerate_c.shm import ENV_HOST_ID, ShmGroup
from accelerate_c.utils import CpuCommKwargs

if os.environ.get("SHM_SELECT_BY") == "handler":  # the kwargs handler wins over ACCELERATE_C_COMM=gloo
    acc = Accelerator(cpu=True, kwargs_handlers=[CpuCommKwargs("shm")])
else:
    acc = Accelerator(cpu=True)
n, r = acc.num_processes, acc.process_index
assert collectives.cpu_comm() == "shm", collectives.cpu_comm()
g = torch.Generator().manual_seed(r)
x = torch.randint(-50, 50, (1000, 7), generator=g).float()
want = x.clone()
dist.all_reduce(want)  # gloo
assert torch.equal(acc.reduce(x, "sum"), want)
parts = [torch.empty_like(x) for _ in range(n)]
dist.all_gather(parts, x)
assert torch.equal(acc.gather(x), torch.cat(parts))
b = x.clone() if r == 1 else torch.zeros_like(x)
ref = b.clone()
dist.broadcast(ref, 1)
from accelerate_c.utils import broadcast  # noqa: E402
from window_grads import check_window_gradients  # noqa: E402

assert torch.equal(broadcast(b, from_process=1), ref)
acc.wait_for_everyone()

# from 1 MiB, where the host has more ranks than cores, accelerator.reduce stages through a
# shared window (collectives.all_reduce_into, _staged): the same as gloo's, 16-bit sums in fp32
# rounded once (two ranks' fp32 sum of bf16 values is exact), the input untouched; then again
# after the window grew, and once more at its size. Run as the machine decides, then with the
# staging forced (on a machine with a core per rank it would not be reached)
natural = collectives._oversubscribed
for force in (False, True):
    if force:
        collectives._oversubscribed = lambda shm: True
    for numel in ((1 << 18) + 3, (1 << 20) + 5, (1 << 20) + 5):
        for dt in (torch.float32, torch.bfloat16, torch.int64):
            big = (torch.randn(numel, generator=g) * 100).to(dt)
            keep = big.clone()
            want_big = [torch.empty_like(big) for _ in range(n)]
            dist.all_gather(want_big, big)  # gloo
            before = collectives.window_ops()
            got = acc.reduce(big, "sum")
            staged = big.numel() * big.element_size() >= collectives.SCRATCH_MIN and (force or n > os.cpu_count())
            assert collectives.window_ops() == before + staged, (numel, dt, force, "staged" if not staged else
                                                                 "a 1 MiB reduce over shared memory was not staged")
            assert torch.equal(big, keep), "reduce changed its input"
            assert torch.equal(got, torch.stack([w.double() for w in want_big]).sum(0).to(dt)), (numel, dt)
            assert torch.equal(acc.reduce(big, "max"), torch.stack(want_big).max(0).values), (numel, dt)
collectives._oversubscribed = natural
acc.wait_for_everyone()

# ranks that say they are on different hosts: no shared memory
os.environ[ENV_HOST_ID] = f"host-{r}"
assert ShmGroup.create() is None
del os.environ[ENV_HOST_ID]
# a segment larger than /dev/shm: no shared memory, and a warning saying how to enlarge it
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert ShmGroup.create(slot_bytes=1 << 40) is None
assert any("/dev/shm has" in str(w.message) and "--shm-size" in str(w.message) for w in caught), \
    [str(w.message) for w in caught]
acc.wait_for_everyone()

# a later explicit choice switches (every rank makes it at the same point); an implicit one keeps
# what is in use; the reduce after each still equals gloo's
assert collectives.select_cpu_comm("gloo") == "gloo" and collectives.cpu_comm() == "gloo"
assert collectives.select_cpu_comm() == "gloo"
assert torch.equal(acc.reduce(x, "sum"), want)
assert collectives.select_cpu_comm("shm") == "shm" and collectives.cpu_comm() == "shm"
assert torch.equal(acc.reduce(x, "sum"), want)
check_window_gradients(acc, x)  # window_grads.py
acc.wait_for_everyone()
if r == 0:
    print("shm select OK", flush=True)

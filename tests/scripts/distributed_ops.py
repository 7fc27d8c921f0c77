"""Run by tests/test_launch.py through `accelerate-c launch --num_processes N --cpu`: every
collective checked against the values computed locally from what each rank contributed."""
import os
import sys

import torch

from accelerate_c import Accelerator
from accelerate_c.utils import broadcast, gather_object


acc = Accelerator(cpu=True)
n, r = acc.num_processes, acc.process_index
assert n == int(os.environ["WORLD_SIZE"]) > 1, (n, os.environ.get("WORLD_SIZE"))
assert r == int(os.environ["RANK"]) and acc.local_process_index == int(os.environ["LOCAL_RANK"])
assert acc.distributed_type == "MULTI_CPU" and str(acc.distributed_type) == "DistributedType.MULTI_CPU" and acc.use_distributed and acc.state.backend == "gloo"
assert acc.is_main_process == (r == 0) and acc.is_last_process == (r == n - 1)
assert acc.mixed_precision == os.environ.get("EXPECT_MIXED_PRECISION", "no")

def rank_tensor(k, rows=2):
    return torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) + 100 * k

# gather: dim-0 concatenation in rank order; nested structures; 0-dim becomes 1-dim
got = acc.gather({"a": rank_tensor(r), "b": [torch.tensor(float(r))]})
assert torch.equal(got["a"], torch.cat([rank_tensor(k) for k in range(n)]))
assert torch.equal(got["b"][0], torch.arange(n, dtype=torch.float32))
# reduce
assert torch.equal(acc.reduce(rank_tensor(r), "sum"), sum(rank_tensor(k) for k in range(n)))
assert torch.allclose(acc.reduce(rank_tensor(r), "mean"), sum(rank_tensor(k) for k in range(n)) / n)
assert torch.equal(acc.reduce(rank_tensor(r), "max"), rank_tensor(n - 1))
# pad_across_processes: rank k has k+1 rows; everyone pads to n rows
padded = acc.pad_across_processes(rank_tensor(r, rows=r + 1), dim=0, pad_index=-1)
assert padded.shape == (n, 3) and torch.equal(padded[: r + 1], rank_tensor(r, rows=r + 1))
assert bool((padded[r + 1:] == -1).all())
front = acc.pad_across_processes(rank_tensor(r, rows=r + 1), pad_first=True)
assert torch.equal(front[n - r - 1:], rank_tensor(r, rows=r + 1))
# mismatched shapes: a clear error on every rank, not a hang
try:
    acc.gather(rank_tensor(r, rows=r + 1))
    raise AssertionError("gather of mismatched shapes did not raise")
except ValueError as e:
    assert "differ in shape" in str(e) and "rank 0: (1, 3)" in str(e), e
# broadcast and objects
b = broadcast(rank_tensor(r), from_process=n - 1)
assert torch.equal(b, rank_tensor(n - 1))
assert gather_object([f"r{r}"]) == [f"r{k}" for k in range(n)]
# split_between_processes: contiguous shares, earlier ranks take the extra items
items = list(range(2 * n + 1))
with acc.split_between_processes(items) as mine:
    per, extra = divmod(len(items), n)
    start = r * per + min(r, extra)
    assert mine == items[start:start + per + (1 if r < extra else 0)]
with acc.split_between_processes(items, apply_padding=True) as mine:
    assert len(mine) == per + 1
# triggers: one rank sets, all see it
if r == n - 1:
    acc.set_trigger()
assert acc.check_trigger() is True and acc.check_trigger() is False
# main_process_first orders the ranks
order = []
with acc.main_process_first():
    order.append(r)
acc.wait_for_everyone()
# a model whose shape differs on one rank: a clear error on every rank, not a hang
try:
    acc.prepare(torch.nn.Linear(2, 2 + (r == n - 1)))
    raise AssertionError("prepare(model) with different shapes did not raise")
except ValueError as e:
    assert "the model differs across processes" in str(e) and "weight" in str(e), e
acc.print(f"distributed ops OK on {n} processes")

"""Run through `accelerate-c launch --num_processes N --cpu`: a prepared shuffled loader gives
each process its share of one common order (same shuffle on every rank, disjoint batches
that together cover the dataset), epoch after epoch; gather_for_metrics drops the filler."""
import torch
from torch.utils.data import DataLoader, TensorDataset

from accelerate_c import Accelerator
from accelerate_c.utils import set_seed


acc = Accelerator(cpu=True)
n, r = acc.num_processes, acc.process_index
set_seed(1234 + r)  # different seeds per rank: the loader must still agree across ranks
data = TensorDataset(torch.arange(21))
dl = acc.prepare(DataLoader(data, batch_size=4, shuffle=True))
orders = []
for epoch in range(2):
    seen, count = [], 0
    for (batch,) in dl:
        count += 1
        assert acc.gradient_state.remainder == 21 % (4 * n)
        seen += acc.gather_for_metrics(batch).tolist()  # the filler is dropped on the last batch
    assert count == len(dl)
    assert sorted(seen) == list(range(21)), (epoch, seen)
    orders.append(seen)
assert orders[0] != orders[1]  # a new shuffle each epoch, still common to all ranks
iterable = acc.prepare(DataLoader(torch.utils.data.IterableDataset.__new__(type("R", (torch.utils.data.IterableDataset,),
                                                                         {"__iter__": lambda self: iter(range(9))})),
                                  batch_size=2))
seen = acc.gather(torch.cat([b for b in iterable]))
assert set(seen.tolist()) == set(range(9)), seen.tolist()
acc.print(f"data sharding OK on {n} processes")

"""Run by tests/test_skip_batches.py on N processes with argv[1] "accelerate_c" (through
`accelerate-c launch`) or "accelerate" (accelerate 1.15 itself, through torchrun with
ACCELERATE_USE_CPU=1); argv[2] is a directory. For data loaders whose length does not divide,
map-style and iterable, with and without even_batches and split_batches, drop_last or not,
prepared and then skip_first_batches'ed, every
rank writes what a user sees at every step (its batch, the GradientState's remainder and
end_of_dataloader, gather_for_metrics' result) to <dir>/rank<r>.json; the test compares the two
packages' files."""
import itertools
import json
import os
import sys

import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

if sys.argv[1] == "accelerate":
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration
else:
    from accelerate_c import Accelerator
    from accelerate_c.utils import DataLoaderConfiguration



class Stream(IterableDataset):
    """0..n-1 as an iterable dataset with a length."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n).tolist())

    def __len__(self):
        return self.n


out_dir = sys.argv[2]
records = {}
accelerators = {}
for split, even in itertools.product([False, True], [True, False]):
    # dispatch_batches=False: accelerate would otherwise dispatch iterable datasets from rank 0
    # (not built in accelerate_c); map-style loaders are never dispatched
    accelerators[split, even] = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        split_batches=split, even_batches=even, dispatch_batches=False))
n_proc = next(iter(accelerators.values())).num_processes
rank = next(iter(accelerators.values())).process_index


def run(acc, loader):
    steps = []
    for batch in loader:
        batch = batch[0] if isinstance(batch, (list, tuple)) else batch
        gs = acc.gradient_state
        step = {"batch": batch.tolist(), "remainder": gs.remainder, "end": gs.end_of_dataloader}
        if acc.even_batches:  # uneven batches give the ranks different shapes and step counts
            step["gathered"] = acc.gather_for_metrics(batch).tolist()
        steps.append(step)
    return steps


for (split, even), n, bs, drop, skip in itertools.product(accelerators, [1, 5, 7, 10, 13], [2, 3, 6], [False, True],
                                                           [0, 1, 2]):
    if split and bs % n_proc:
        continue
    acc = accelerators[split, even]
    dl = acc.prepare(DataLoader(TensorDataset(torch.arange(n)), batch_size=bs, drop_last=drop))
    key = f"split={split} even={even} n={n} bs={bs} drop_last={drop} skip={skip}"
    # a full pass first (the loader the skipped one is made from), then the skipped loader
    records[key] = {"prepared": run(acc, dl), "skipped": run(acc, acc.skip_first_batches(dl, skip))}
    if even:  # iterable datasets: shards are always even
        dl = acc.prepare(DataLoader(Stream(n), batch_size=bs, drop_last=drop))
        records["iterable " + key] = {"prepared": run(acc, dl), "skipped": run(acc, acc.skip_first_batches(dl, skip))}

with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(records, f, indent=0, sort_keys=True)

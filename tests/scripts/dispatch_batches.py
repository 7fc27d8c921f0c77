"""Run by tests/test_dispatch_batches.py on N processes with argv[1] "accelerate_c" (through
`accelerate-c launch`) or "accelerate" (accelerate 1.15 itself, through torchrun with
ACCELERATE_USE_CPU=1); argv[2] is a directory. Data loaders prepared with dispatch_batches
(map-style and iterable, with and without split_batches / even_batches / drop_last, sizes that
do and do not divide, nested batches of dicts, tuples and lists), then skip_first_batches'ed:
every rank writes what a user sees at every step (its batch, GradientState.remainder and
end_of_dataloader, gather_for_metrics' result, len() of the loader) to <dir>/rank<r>.json; the
test compares the two packages' files."""
import itertools
import json
import os
import sys

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

if sys.argv[1] == "accelerate":
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration
else:
    from accelerate_c import Accelerator
    from accelerate_c.utils import DataLoaderConfiguration


class Rows(Dataset):
    """Sample i: i, or a nested structure built from i."""

    def __init__(self, n, nested=False):
        self.n, self.nested = n, nested

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not self.nested:
            return torch.tensor(i)
        return {"x": torch.tensor([i, -i]), "pair": (torch.tensor(float(i)), [torch.tensor(i * 10)])}


class Stream(IterableDataset):
    def __init__(self, n, nested=False):
        self.rows = Rows(n, nested)

    def __iter__(self):
        return (self.rows[i] for i in range(self.rows.n))


def plain(batch):
    if isinstance(batch, torch.Tensor):
        return batch.tolist()
    if isinstance(batch, dict):
        return {k: plain(v) for k, v in batch.items()}
    return [plain(v) for v in batch]


out_dir = sys.argv[2]
accelerators = {(split, even): Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
    split_batches=split, even_batches=even, dispatch_batches=True)) for split, even in
    itertools.product([False, True], [True, False])}
any_acc = next(iter(accelerators.values()))
n_proc, rank = any_acc.num_processes, any_acc.process_index


def run(acc, loader):
    steps = []
    for batch in loader:
        gs = acc.gradient_state
        steps.append({"batch": plain(batch), "remainder": gs.remainder, "end": gs.end_of_dataloader,
                      "gathered": plain(acc.gather_for_metrics(batch))})
    return steps


records = {}
for (split, even), n, bs, drop, skip, iterable, nested in itertools.product(
        accelerators, [1, 5, 8, 13], [2, 3, 6], [False, True], [0, 2], [False, True], [False, True]):
    if (split and bs % n_proc) or (nested and (n, skip) != (13, 0)):
        continue
    # accelerate fails (TypeError broadcasting None) when the main process has no first global
    # batch; those loaders are left out (tests/test_dispatch_batches.py checks ours on its own)
    loader_batches = n // bs if drop else -(-n // bs)
    after_skip = loader_batches if iterable else loader_batches - skip
    if after_skip < (n_proc if drop and not split else 1):
        continue
    # a first global batch smaller than the number of processes cannot complete a last one for
    # every rank: one gets no sample, and accelerate's gather_for_metrics then waits forever
    per_step = bs if split else bs * n_proc
    first = min(n, per_step), (min(n, per_step) if iterable else min(max(n - skip * bs, 0), per_step))
    if not drop and min(first) < n_proc:
        continue
    acc = accelerators[split, even]
    data = Stream(n, nested) if iterable else Rows(n, nested)
    dl = acc.prepare(DataLoader(data, batch_size=bs, drop_last=drop))
    key = f"split={split} even={even} n={n} bs={bs} drop_last={drop} skip={skip} iterable={iterable} nested={nested}"
    rec = {"prepared": run(acc, dl), "skipped": run(acc, acc.skip_first_batches(dl, skip))}
    if not iterable:
        rec["len"] = len(dl)
    records[key] = rec

# shuffled: the main process's order, the same samples once each over the ranks
acc = accelerators[False, True]
torch.manual_seed(7)
dl = acc.prepare(DataLoader(Rows(22), batch_size=4, shuffle=True))
records["shuffled"] = {"sorted": sorted(x for step in run(acc, dl) for x in step["gathered"])}

with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(records, f, indent=0, sort_keys=True)

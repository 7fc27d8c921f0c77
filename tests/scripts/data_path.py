"""Run by tests/test_data_path.py on 2 processes through `accelerate-c launch`; argv[1] is a
directory shared by the ranks. Each check compares accelerate_c against a reference computed
here with plain torch or the real `datasets` package, and raises on the first difference; the
script prints "data path OK" at the end.

1. dispatch vs sharded: the same global batches step by step, each equal to the plain
   DataLoader's consecutive batches (map-style and iterable, split_batches and even_batches both
   ways), and for sizes that do not divide, gather_for_metrics over the epoch = the dataset.
2. training: dispatched and sharded loaders give the parameters of one process training on the
   global batches with plain torch.
3. non-tensor leaves: a batch with a string column is dispatched as a sharded loader gives it.
4. use_stateful_dataloader: save_state mid-epoch (shuffled map-style, sharded; iterable,
   dispatched), a fresh Accelerator and DataLoader load_state and see exactly the batches the
   uninterrupted run saw next, on every rank, through the next epoch.
5. a streaming datasets.IterableDataset: the same resume (dispatched; and sharded by
   datasets' own shard()), and set_epoch reaching its shuffle (each epoch's samples =
   datasets' own iteration after set_epoch).
6. save_state with a different directory on each process is refused, naming them.
7. the first half of tests/scripts/stateful_resume.py (the uninterrupted run, saving mid-epoch):
   its second half, in a fresh launch, resumes (tests/test_data_path.py).
"""
import copy
import itertools
import os
import sys

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from accelerate_c import Accelerator
from accelerate_c.utils import DataLoaderConfiguration

OUT = sys.argv[1]


class Stream(IterableDataset):
    def __init__(self, data):
        self.data = data

    def __iter__(self):
        return iter(self.data)


class Named(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.tensor([float(i), -float(i)]), "name": f"sample-{i}", "ids": [i, i + 1]}


def acc_for(**cfg):
    return Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**cfg))


base = acc_for()
N, RANK = base.num_processes, base.process_index
assert N == 2, "this script runs on 2 processes"


def check(cond, what):
    if not cond:
        raise AssertionError(f"rank {RANK}: {what}")


def tolist(b):
    return b.tolist() if isinstance(b, torch.Tensor) else b


# ---- 1. dispatch vs sharded: global batches -------------------------------------------------------
for iterable, split, even in itertools.product([False, True], repeat=3):
    bs = 4 if split else 3
    data = torch.arange(24)
    plain = [b.tolist() for b in DataLoader(data, batch_size=bs * (1 if split else N))]
    per_mode = {}
    for dispatch in (True, False):
        acc = acc_for(dispatch_batches=dispatch, split_batches=split, even_batches=even)
        dl = acc.prepare(DataLoader(Stream(data) if iterable else data, batch_size=bs))
        per_mode[dispatch] = [acc.gather(b).tolist() for b in dl]
    what = f"iterable={iterable} split={split} even={even}"
    check(per_mode[True] == plain, f"{what}: dispatched global batches {per_mode[True]}, plain DataLoader {plain}")
    check(per_mode[False] == plain, f"{what}: sharded global batches {per_mode[False]}, plain DataLoader {plain}")
    # a size that does not divide: the epoch gathered for metrics is the dataset, once each
    # (a sharded stream of unknown length cannot tell the duplicates apart: remainder -1, as in
    # accelerate; the dispatched one knows its last batch's size)
    data = torch.arange(23)
    for dispatch in (True, False) if not iterable else (True,):
        acc = acc_for(dispatch_batches=dispatch, split_batches=split, even_batches=True)
        dl = acc.prepare(DataLoader(Stream(data) if iterable else data, batch_size=bs))
        seen = [x for b in dl for x in acc.gather_for_metrics(b).tolist()]
        check(seen == data.tolist(), f"{what} dispatch={dispatch}, 23 samples: gather_for_metrics gave {seen}")

# ---- 2. training: same parameters as one process on the global batches ---------------------------
g = torch.Generator().manual_seed(0)
X, Y = torch.randn(48, 5, generator=g), torch.randn(48, 3, generator=g)
torch.manual_seed(1)
init = torch.nn.Linear(5, 3)


def reference(global_bs):
    model = copy.deepcopy(init)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        for x, y in DataLoader(TensorDataset(X, Y), batch_size=global_bs):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return model


for iterable, split, dispatch in itertools.product([False, True], repeat=3):
    bs = 6 if split else 3
    acc = acc_for(dispatch_batches=dispatch, split_batches=split)
    model = copy.deepcopy(init)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = list(zip(X, Y))
    dl = DataLoader(Stream(rows) if iterable else TensorDataset(X, Y), batch_size=bs)
    model, opt, dl = acc.prepare(model, opt, dl)
    for _ in range(2):
        for x, y in dl:
            opt.zero_grad()
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
    ref = reference(6)
    for (name, p), q in zip(acc.unwrap_model(model).named_parameters(), ref.parameters()):
        check(torch.allclose(p, q, rtol=1e-5, atol=1e-6),
              f"training iterable={iterable} split={split} dispatch={dispatch}: {name} differs from one process "
              f"on the global batches by {(p - q).abs().max().item()}")

# ---- 3. non-tensor leaves: dispatched as sharded -------------------------------------------------
for split in (False, True):
    got = {}
    for dispatch in (True, False):
        acc = acc_for(dispatch_batches=dispatch, split_batches=split)
        dl = acc.prepare(DataLoader(Named(16), batch_size=4))
        got[dispatch] = [{"x": b["x"].tolist(), "name": b["name"], "ids": [t.tolist() for t in b["ids"]]} for b in dl]
    check(got[True] == got[False], f"string column split={split}: dispatched {got[True]}, sharded {got[False]}")
    check(all(isinstance(n, str) for b in got[True] for n in b["name"]), "names are strings")


# ---- 4/5. stateful resume ----------------------------------------------------------------------------
def batches_of(dl, steps=None):
    out = []
    for i, b in enumerate(dl):
        if steps is not None and i == steps:
            break
        out.append(b)
    return out


def as_rows(b):
    if isinstance(b, dict):
        return {k: tolist(v) for k, v in b.items()}
    if isinstance(b, (list, tuple)):
        return [tolist(v) for v in b]
    return tolist(b)


def resume_case(label, make_loader, cfg, save_at=2):
    """Epoch 0 whole; epoch 1 saved after `save_at` steps and run on; then epoch 2. A fresh
    Accelerator and loader load the checkpoint and must see the same from the save on."""
    ckpt = os.path.join(OUT, label)
    acc = acc_for(use_stateful_dataloader=True, **cfg)
    dl = acc.prepare(make_loader())
    batches_of(dl)
    seen_after = []
    for i, b in enumerate(dl):
        if i == save_at - 1:
            acc.save_state(ckpt)
        elif i >= save_at:
            seen_after.append(as_rows(b))
    check(len(seen_after) > 0, f"{label}: the epoch had batches left after the save")
    next_epoch = [as_rows(b) for b in dl]
    torch.rand(7)  # a fresh process's RNGs are elsewhere
    acc2 = acc_for(use_stateful_dataloader=True, **cfg)
    dl2 = acc2.prepare(make_loader())
    acc2.load_state(ckpt)
    resumed = [as_rows(b) for b in dl2]
    check(resumed == seen_after, f"{label}: resumed with {resumed}, the uninterrupted run saw {seen_after}")
    again = [as_rows(b) for b in dl2]
    check(again == next_epoch, f"{label}: the epoch after the resumed one: {again}, uninterrupted {next_epoch}")


resume_case("map_shuffled_sharded", lambda: DataLoader(TensorDataset(torch.arange(40)), batch_size=3, shuffle=True),
            {})
stream = torch.randperm(40, generator=torch.Generator().manual_seed(5)).tolist()
resume_case("iterable_dispatched", lambda: DataLoader(Stream(stream), batch_size=3), {})

import datasets  # noqa: E402 - the streaming part needs it; everything above is plain torch

base_ds = datasets.Dataset.from_dict({"x": list(range(60)), "name": [f"s{i}" for i in range(60)]})


def streaming(buffer_size=1):
    # a buffer of one shuffles the shard order only: datasets' own restore resumes it exactly
    # (a larger buffer is replayed instead: tests/scripts/stateful_resume.py resumes that)
    return base_ds.to_iterable_dataset(num_shards=4).shuffle(seed=11, buffer_size=buffer_size).with_format("torch")


for dispatch in (True, False):
    label = f"streaming_{'dispatched' if dispatch else 'sharded'}"
    resume_case(label, lambda: DataLoader(streaming(), batch_size=4), {"dispatch_batches": dispatch})

# set_epoch reaches the streaming dataset's shuffle: each epoch is datasets' own order for it
for dispatch in (True, False):
    ds = streaming(buffer_size=8)
    acc = acc_for(dispatch_batches=dispatch)
    dl = acc.prepare(DataLoader(ds, batch_size=4))
    epochs = []
    for epoch in range(2):
        if dispatch:  # the main process streams the whole dataset; each step gathers a global batch
            got = [x for b in dl for x in acc.gather_for_metrics(b["x"]).tolist()]
            ref = streaming(buffer_size=8)
        else:  # each process streams its own shards (datasets' shard())
            got = [x for b in dl for x in b["x"].tolist()]
            ref = streaming(buffer_size=8).shard(num_shards=N, index=RANK)
        ref.set_epoch(epoch)
        want = [int(r["x"]) for r in ref]
        check(got == want, f"streaming dispatch={dispatch} epoch {epoch}: got {got}, datasets' own order {want}")
        epochs.append(got)
    check(epochs[0] != epochs[1], f"streaming dispatch={dispatch}: set_epoch changed nothing")

# save_state into a different directory per process: refused on every process, naming both
try:
    base.save_state(os.path.join(OUT, f"own_dir_{RANK}"))
    raise AssertionError(f"rank {RANK}: save_state took a different directory on each process")
except ValueError as e:
    check("own_dir_0" in str(e) and "own_dir_1" in str(e), f"the error names both directories: {e}")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stateful_resume import run as stateful_resume_run  # noqa: E402

stateful_resume_run("save", os.path.join(OUT, "fresh_process"))

base.wait_for_everyone()
if RANK == 0:
    print("data path OK", flush=True)

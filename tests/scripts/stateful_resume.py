"""Stateful loaders resumed in a fresh process, on 2 processes, in two launches:

    run("save", DIR)                the uninterrupted run (tests/scripts/data_path.py calls it, to
                                    save a launch): per case, epoch 0 whole, epoch 1 with a
                                    save_state after SAVE_AT steps, then epoch 2; records what each
                                    rank saw after the save (rest of epoch 1, epoch 2)
    stateful_resume.py resume DIR   a fresh process: per case, a new Accelerator and DataLoader,
                                    load_state, then the rest of the epoch and the next one

into DIR/{mode}_rank{r}.json; tests/test_data_path.py compares them. Cases (use_stateful_dataloader=True):
a streaming datasets.IterableDataset with a shuffle buffer of 8 (datasets' own state would
refill it with other samples), dispatched and sharded by its shard(), without and with a data
loader worker; a shuffled map-style dataset with a worker. The save run also checks its
streaming epoch 1 against datasets' own order for that epoch (plain torch DataLoader over the
dataset after set_epoch(1)), so the reference is not only our own loader.
"""
import json
import os
import sys

import datasets
import torch
from torch.utils.data import DataLoader, TensorDataset

from accelerate_c import Accelerator
from accelerate_c.utils import DataLoaderConfiguration

SAVE_AT = 2
BATCH = 4
ROWS = datasets.Dataset.from_dict({"x": list(range(60))})


def streaming():
    return ROWS.to_iterable_dataset(num_shards=4).shuffle(seed=11, buffer_size=8).with_format("torch")


def map_style():
    return TensorDataset(torch.arange(40) * 10)


CASES = {  # name: (dataset maker, dispatch_batches, num_workers)
    "streaming_dispatched": (streaming, True, 0),
    "streaming_sharded": (streaming, False, 0),
    "streaming_dispatched_worker": (streaming, True, 1),
    "streaming_sharded_worker": (streaming, False, 1),
    "map_shuffled_sharded_worker": (map_style, False, 1),
}


def rows(batch):
    x = batch["x"] if isinstance(batch, dict) else batch[0]
    return x.tolist()


def setup(make, dispatch, workers):
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True,
                                                                          dispatch_batches=dispatch))
    ds = make()
    shuffle = not isinstance(ds, torch.utils.data.IterableDataset)  # the map-style case is shuffled
    dl = DataLoader(ds, batch_size=BATCH, num_workers=workers, shuffle=shuffle)
    return acc, acc.prepare(dl)


def check_against_datasets(acc, name, dispatch, workers, epoch_rows):
    """Epoch 1 of the uninterrupted run = datasets' own order after set_epoch(1), read by a plain
    torch DataLoader with the same workers: the whole stream in global batches when dispatched
    (the last one completed with the epoch's first samples), this process's shard() when sharded."""
    ds = streaming()
    if not dispatch:
        ds = ds.shard(num_shards=acc.num_processes, index=acc.process_index)
    ds.set_epoch(1)
    want = [r for b in DataLoader(ds, batch_size=BATCH, num_workers=workers) for r in b["x"].tolist()]
    if dispatch:
        got = [r for b in epoch_rows for r in acc.gather(torch.tensor(b)).tolist()]
        ok = got[:len(want)] == want and len(got) - len(want) < BATCH * acc.num_processes
    else:
        got = [r for b in epoch_rows for r in b]
        ok = got == want
    assert ok, f"{name} rank {acc.process_index}: epoch 1 {got}, datasets' own order {want}"


def run(mode, out):
    os.makedirs(out, exist_ok=True)
    record = {}
    for name, (make, dispatch, workers) in CASES.items():
        ckpt = os.path.join(out, name)
        acc, dl = setup(make, dispatch, workers)
        if mode == "save":
            for _ in dl:
                pass
            epoch1, after = [], []
            for i, b in enumerate(dl):
                epoch1.append(rows(b))
                if i == SAVE_AT - 1:
                    acc.save_state(ckpt)
                elif i >= SAVE_AT:
                    after.append(rows(b))
            if make is streaming:
                check_against_datasets(acc, name, dispatch, workers, epoch1)
            record[name] = {"rest_of_epoch": after, "next_epoch": [rows(b) for b in dl]}
        else:
            torch.rand(3)  # the process-wide RNGs are not where the saving run had them
            acc.load_state(ckpt)
            record[name] = {"rest_of_epoch": [rows(b) for b in dl], "next_epoch": [rows(b) for b in dl]}
        acc.wait_for_everyone()

    with open(os.path.join(out, f"{mode}_rank{acc.process_index}.json"), "w") as f:
        json.dump(record, f)
    print(f"stateful resume {mode} OK", flush=True)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2])

"""train_sampling_strategy="group_by_length" against transformers 5.23's own objects in the
same test: the index function and LengthGroupedSampler (on a generator and on the global RNG);
transformers' Trainer's train and eval loaders on accelerate 1.15 against ours, with a
datasets.Dataset length column (which transformers reads only when remove_unused_columns keeps
it); and on 2 processes, accelerate_c's Trainer through the launcher against transformers'
LengthGroupedSampler sharded by accelerate's BatchSamplerShard from the same RNG states."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler, DataLoader
from transformers.trainer_pt_utils import DistributedLengthGroupedSampler as TheirDistributed
from transformers.trainer_pt_utils import LengthGroupedSampler as TheirSampler
from transformers.trainer_pt_utils import get_length_grouped_indices

import accelerate_c
from accelerate_c.length_grouped import DistributedLengthGroupedSampler, LengthGroupedSampler, length_grouped_indices
from helpers import fresh_state  # noqa: F401  (autouse: fresh Accelerator states per test)
from timeouts import wait_s

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
sys.path.insert(0, SCRIPTS)
import hf_trainer_llama as llama  # noqa: E402
import trainer_group_by_length as gbl  # noqa: E402


@pytest.mark.parametrize("n,batch,mult", [(37, 4, None), (200, 3, None), (10, 8, None), (64, 2, 3), (5, 1, None)])
def test_index_order_is_transformers(n, batch, mult):
    lengths = torch.randint(1, 6, (n,), generator=torch.Generator().manual_seed(n)).tolist()  # many ties
    for seed in (0, 1, 2):
        want = get_length_grouped_indices(lengths, batch, mega_batch_mult=mult,
                                          generator=torch.Generator().manual_seed(seed))
        got = length_grouped_indices(lengths, batch, mega_batch_mult=mult, generator=torch.Generator().manual_seed(seed))
        assert got == want
    # the samplers without a generator draw from the global RNG (the Trainer's training sampler)
    for kw in (dict(lengths=torch.tensor(lengths)), dict(dataset=[{"input_ids": [0] * k} for k in lengths])):
        torch.manual_seed(5)
        want = list(TheirSampler(batch, **kw))
        torch.manual_seed(5)
        got = list(LengthGroupedSampler(batch, **kw))
        assert got == want and sorted(got) == list(range(n))
    with pytest.raises(ValueError, match="'input_ids'"):
        LengthGroupedSampler(batch, dataset=[{"x": [1]}])


@pytest.mark.parametrize("n,drop_last", [(29, False), (29, True), (32, False)])
def test_distributed_variant_is_transformers(n, drop_last):
    """DistributedLengthGroupedSampler (which transformers' Trainer no longer builds): the same
    indices per rank and epoch as transformers' for the same seed."""
    lengths = torch.randint(1, 9, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    for rank in range(3):
        kw = dict(lengths=lengths, num_replicas=3, rank=rank, seed=7, drop_last=drop_last)
        theirs, ours = TheirDistributed(4, **kw), DistributedLengthGroupedSampler(4, **kw)
        for epoch in (0, 1):
            theirs.set_epoch(epoch)
            ours.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs), (rank, epoch)


def _trainers(tmp_path, train, evalset, **kw):
    """(transformers' Trainer, ours), equal arguments, group_by_length."""
    common = dict(per_device_train_batch_size=3, per_device_eval_batch_size=4, gradient_accumulation_steps=2,
                  use_cpu=True, report_to="none", disable_tqdm=True, seed=11, data_seed=4,
                  train_sampling_strategy="group_by_length", **kw)
    return [cls(model=llama.make_model(), args=args_cls(output_dir=str(tmp_path / name), **common),
                data_collator=gbl.pad, train_dataset=train, eval_dataset=evalset)
            for name, cls, args_cls in (("hf", transformers.Trainer, transformers.TrainingArguments),
                                        ("ours", accelerate_c.Trainer, accelerate_c.TrainingArguments))]


def _epochs(loader, seed, n=2):
    torch.manual_seed(seed)
    return [gbl.first_tokens(loader) for _ in range(n)]


def test_trainer_loaders_match_transformers_trainer(tmp_path):
    rows, evalrows = gbl.make_rows(41, seed=1), gbl.make_rows(14, seed=2)
    ref, ours = _trainers(tmp_path, rows, evalrows)
    want = _epochs(ref.get_train_dataloader(), 3)
    assert _epochs(ours.get_train_dataloader(), 3) == want
    assert want[0] != want[1] and sorted(sum(want[0], [])) == list(range(41))
    # batches of similar length: less padding than the random order
    size = {i: len(r["input_ids"]) for i, r in enumerate(rows)}
    padded = sum(max(size[i] for i in b) * len(b) for b in want[0])
    torch.manual_seed(3)
    shuffled = torch.randperm(41).tolist()
    assert padded < sum(max(size[i] for i in shuffled[k:k + 3]) * len(shuffled[k:k + 3]) for k in range(0, 41, 3))
    # evaluation is length-grouped too, from a generator seeded with data_seed: the same order each time
    want_eval = gbl.first_tokens(ref.get_eval_dataloader())
    assert gbl.first_tokens(ours.get_eval_dataloader()) == want_eval == gbl.first_tokens(ref.get_eval_dataloader())
    assert gbl.first_tokens(ours.get_eval_dataloader()) == want_eval and sum(want_eval, []) != list(range(14))
    np.testing.assert_array_equal(ours.predict(evalrows).label_ids, ref.predict(evalrows).label_ids)


def test_length_column_counts_only_where_transformers_keeps_it(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = gbl.make_rows(30, seed=3)
    ds = datasets.Dataset.from_dict({"input_ids": [r["input_ids"].tolist() for r in rows],
                                     "labels": [r["labels"].tolist() for r in rows],
                                     "length": [20 - len(r["input_ids"]) for r in rows]})  # not the real lengths
    orders = {}
    for remove in (True, False):
        ref, ours = _trainers(tmp_path / str(remove), ds, None, remove_unused_columns=remove)
        orders[remove] = _epochs(ref.get_train_dataloader(), 7, n=1)
        assert _epochs(ours.get_train_dataloader(), 7, n=1) == orders[remove], remove
    assert orders[True] != orders[False]


def test_two_processes_shard_transformers_order(tmp_path):
    exe = shutil.which("accelerate-c", path=os.path.dirname(sys.executable))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    res = subprocess.run([exe, "launch", "--num_processes", "2", "--cpu", "--main_process_port", "0",
                          os.path.join(SCRIPTS, "trainer_group_by_length.py"), str(tmp_path / "out"),
                          str(tmp_path / "res")], capture_output=True, text=True, timeout=wait_s(180), env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = [torch.load(tmp_path / f"res.{r}", weights_only=False) for r in (0, 1)]
    assert [g["num_processes"] for g in got] == [2, 2]
    rows = gbl.make_rows()
    for epoch in range(2):
        # one global order: every rank drew it from the same RNG state, as under transformers
        assert torch.equal(got[0]["rng"][epoch], got[1]["rng"][epoch])
        held = []
        for rank, g in enumerate(got):
            torch.set_rng_state(g["rng"][epoch])
            shard = BatchSamplerShard(BatchSampler(TheirSampler(2 * 2, dataset=rows), 2, drop_last=False),
                                      num_processes=2, process_index=rank, even_batches=True)
            want = gbl.first_tokens(DataLoader(rows, batch_sampler=shard, collate_fn=gbl.pad))
            end = g["marks"][epoch + 1] if epoch + 1 < len(g["marks"]) else len(g["seen"])
            assert g["seen"][g["marks"][epoch]:end] == want, (epoch, rank)
            held += sum(want, [])
        assert set(held) == set(range(len(rows)))


def test_resume_mid_epoch_sees_the_rows_and_reaches_the_weights_of_the_uninterrupted_run(tmp_path):
    """group_by_length, 1 process: a run saved every 5 steps; a new process resumes from
    checkpoint-15 (the second epoch, mid-way) and must feed the model exactly the batches the
    uninterrupted run fed it from there and end with bitwise the same parameters."""
    exe = shutil.which("accelerate-c", path=os.path.dirname(sys.executable))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)

    def run(out, res, mode):
        r = subprocess.run([exe, "launch", "--num_processes", "1", "--cpu", os.path.join(SCRIPTS, "trainer_group_by_length.py"),
                            str(out), str(res), mode], capture_output=True, text=True, timeout=wait_s(180), env=env)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return torch.load(f"{res}.0", weights_only=False)

    full = run(tmp_path / "full", tmp_path / "full", "save")
    steps = full["global_step"]
    assert steps > 15 and (tmp_path / "full" / "checkpoint-15").is_dir()
    os.makedirs(tmp_path / "part")
    shutil.copytree(tmp_path / "full" / "checkpoint-15", tmp_path / "part" / "checkpoint-15")
    part = run(tmp_path / "part", tmp_path / "part", "resume")
    assert part["global_step"] == steps
    # 45 rows in micro-batches of 2: 23 per epoch, 12 optimizer steps per epoch (accumulation 2,
    # the last step of an epoch one micro-batch); step 15 is the third step of the second epoch
    per_epoch = full["marks"][1]
    assert per_epoch == 23 and steps == 24
    start = per_epoch + (15 - 12) * 2
    assert part["seen"] == full["seen"][start:], "the resumed run fed other rows"
    for k, v in full["params"].items():
        assert torch.equal(part["params"][k], v), k

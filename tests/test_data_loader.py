"""Prepared data loaders (DataLoaderShard) and skip_first_batches on one process, compared with
the plain torch DataLoader over the same data (and, where cheap, with accelerate 1.15)."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler, TensorDataset

from accelerate_c import Accelerator, skip_first_batches
from accelerate_c.data_loader import DataLoaderShard
from helpers import batches_of, fresh_state, loss_function, make_dataset, make_loader, make_model  # noqa: F401


class RangeIterable(IterableDataset):
    """An unsized iterable dataset of (x, y) pairs."""

    def __init__(self, n=22, seed=3):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.arange(n)

    def __iter__(self):
        for i in range(len(self.x)):
            yield self.x[i], self.y[i]


class EpochSampler(Sampler):
    """A sampler whose order depends on the epoch it was told via set_epoch."""

    def __init__(self, n):
        self.n = n
        self.epochs = []
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epochs.append(epoch)
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(1000 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self):
        return self.n


def assert_same_batches(got, ref):
    assert len(got) == len(ref), f"{len(got)} batches vs {len(ref)}"
    for k, (a, b) in enumerate(zip(got, ref)):
        assert len(a) == len(b)
        for ta, tb in zip(a, b):
            assert torch.equal(ta, tb), f"batch {k} differs"


# --------------------------------------------------------------------------------------------
# 5. skip_first_batches
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,bs,drop_last", [(30, 4, False), (32, 4, False), (30, 4, True)])
def test_skip_first_batches_map_style(n, bs, drop_last):
    ref = batches_of(make_loader(n=n, batch_size=bs, drop_last=drop_last))
    accelerator = Accelerator()
    dl = accelerator.prepare(make_loader(n=n, batch_size=bs, drop_last=drop_last))
    assert_same_batches(batches_of(dl), ref)
    skipped = accelerator.skip_first_batches(dl, 3)
    assert len(skipped) == len(ref) - 3
    assert_same_batches(batches_of(skipped), ref[3:])
    # nothing skipped / everything skipped
    assert_same_batches(batches_of(accelerator.skip_first_batches(dl, 0)), ref)
    everything = accelerator.skip_first_batches(dl, len(ref))
    assert len(everything) == 0 and batches_of(everything) == []
    # the module-level function gives the same, on prepared and on plain torch loaders
    assert_same_batches(batches_of(skip_first_batches(dl, 3)), ref[3:])
    plain = skip_first_batches(make_loader(n=n, batch_size=bs, drop_last=drop_last), 3)
    assert len(plain) == len(ref) - 3
    assert_same_batches(batches_of(plain), ref[3:])


def test_skip_first_batches_iterable_dataset():
    ds = RangeIterable(22)
    ref = batches_of(DataLoader(ds, batch_size=4))
    assert len(ref) == 6
    accelerator = Accelerator()
    dl = accelerator.prepare(DataLoader(ds, batch_size=4))
    assert_same_batches(batches_of(dl), ref)
    skipped = accelerator.skip_first_batches(dl, 3)
    assert_same_batches(batches_of(skipped), ref[3:])
    plain = skip_first_batches(DataLoader(ds, batch_size=4), 3)
    assert_same_batches(batches_of(plain), ref[3:])


def test_skip_first_batches_iterable_end_of_dataloader_on_last_yielded_batch():
    ds = RangeIterable(22)
    accelerator = Accelerator()
    dl = accelerator.skip_first_batches(accelerator.prepare(DataLoader(ds, batch_size=4)), 2)
    flags = [accelerator.gradient_state.end_of_dataloader for _ in dl]
    assert flags == [False, False, False, True]


def test_skip_first_batches_shuffled_resumes_same_order():
    """A prepared shuffling loader: restoring the generator and skipping 3 batches yields the
    same batches as the 4th.. batches of the run that was interrupted."""
    torch.manual_seed(7)
    accelerator = Accelerator()
    dl = accelerator.prepare(make_loader(n=30, batch_size=4, shuffle=True))
    # whichever generator drives the shuffle (the loader's own, or the global one) is rewound
    gen = getattr(dl, "synchronized_generator", None)
    state = gen.get_state() if gen is not None else None
    global_state = torch.get_rng_state()
    full = batches_of(dl)
    torch.set_rng_state(global_state)
    if gen is not None:
        gen.set_state(state)
    resumed = batches_of(accelerator.skip_first_batches(dl, 3))
    assert_same_batches(resumed, full[3:])
    # the epoch really is a permutation of the dataset
    xs = torch.cat([b[0] for b in full])
    ref_x = make_dataset(30).tensors[0]
    assert sorted(xs[:, 0].tolist()) == sorted(ref_x[:, 0].tolist())


def test_skip_first_batches_matches_accelerate():
    accelerate = pytest.importorskip("accelerate")
    ref_dl = accelerate.Accelerator(cpu=True).prepare(make_loader(n=30, batch_size=4))
    theirs = batches_of(accelerate.skip_first_batches(ref_dl, 3))
    accelerator = Accelerator()
    ours = batches_of(accelerator.skip_first_batches(accelerator.prepare(make_loader(n=30, batch_size=4)), 3))
    assert_same_batches(ours, theirs)


def test_skip_first_batches_negative_raises():
    accelerator = Accelerator()
    dl = accelerator.prepare(make_loader(n=8, batch_size=4))
    with pytest.raises(ValueError):
        accelerator.skip_first_batches(dl, -1)


# --------------------------------------------------------------------------------------------
# 6. DataLoaderShard bookkeeping
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,bs", [(30, 4), (32, 4), (3, 4), (4, 4)])
def test_end_of_dataloader_and_remainder(n, bs):
    ref = batches_of(make_loader(n=n, batch_size=bs))
    accelerator = Accelerator()
    dl = accelerator.prepare(make_loader(n=n, batch_size=bs))
    assert isinstance(dl, DataLoaderShard)
    assert len(dl) == len(make_loader(n=n, batch_size=bs)) == len(ref)
    flags, remainders, got = [], [], []
    for batch in dl:
        flags.append(accelerator.gradient_state.end_of_dataloader)
        remainders.append(accelerator.gradient_state.remainder)
        got.append(batch)
    assert flags == [False] * (len(ref) - 1) + [True]
    assert remainders == [n % bs] * len(ref)
    assert_same_batches(got, ref)
    # outside the loop there is no active data loader any more
    assert not accelerator.gradient_state.end_of_dataloader
    assert not accelerator.gradient_state.in_dataloader
    # a second epoch behaves the same
    assert [accelerator.gradient_state.end_of_dataloader for _ in dl] == flags


def test_end_of_dataloader_and_remainder_match_accelerate():
    accelerate = pytest.importorskip("accelerate")
    ref_acc = accelerate.Accelerator(cpu=True)
    ref_dl = ref_acc.prepare(make_loader(n=30, batch_size=4))
    theirs = [(ref_acc.gradient_state.end_of_dataloader, ref_acc.gradient_state.remainder) for _ in ref_dl]
    accelerator = Accelerator()
    dl = accelerator.prepare(make_loader(n=30, batch_size=4))
    ours = [(accelerator.gradient_state.end_of_dataloader, accelerator.gradient_state.remainder) for _ in dl]
    assert ours == theirs


@pytest.mark.parametrize("dispatch", [None, False])
def test_iterable_dataset_end_of_dataloader_and_remainder_match_accelerate(dispatch):
    # dispatch None: accelerate dispatches an iterable dataset even on one process, and its
    # dispatcher knows the last batch's size (remainder 2 at the end, -1 before); a sharded
    # unsized stream never knows it (-1)
    accelerate = pytest.importorskip("accelerate")
    ref_acc = accelerate.Accelerator(cpu=True, dataloader_config=accelerate.DataLoaderConfiguration(
        dispatch_batches=dispatch))
    ref_dl = ref_acc.prepare(DataLoader(RangeIterable(22), batch_size=4))
    theirs = [(ref_acc.gradient_state.end_of_dataloader, ref_acc.gradient_state.remainder, y.tolist())
              for _, y in ref_dl]
    from accelerate_c.utils import DataLoaderConfiguration

    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=dispatch))
    dl = accelerator.prepare(DataLoader(RangeIterable(22), batch_size=4))
    seen = [(accelerator.gradient_state.end_of_dataloader, accelerator.gradient_state.remainder, y.tolist())
            for _, y in dl]
    assert [f for f, _, _ in seen] == [False] * 5 + [True]
    assert seen == theirs


def test_drop_last_remainder_and_len():
    ref = make_loader(n=30, batch_size=4, drop_last=True)
    accelerator = Accelerator()
    dl = accelerator.prepare(make_loader(n=30, batch_size=4, drop_last=True))
    assert len(dl) == len(ref) == 7
    rem = [accelerator.gradient_state.remainder for _ in dl]
    assert len(rem) == 7
    assert set(rem) == {-1}  # accelerate only computes the remainder when not dropping the last batch


def test_nested_data_loaders_restore_outer_state():
    accelerator = Accelerator()
    outer = accelerator.prepare(make_loader(n=12, batch_size=4))  # 3 batches
    inner = accelerator.prepare(make_loader(n=10, batch_size=4))  # 3 batches, remainder 2
    outer_flags = []
    for _ in outer:
        inner_flags = [(accelerator.gradient_state.end_of_dataloader, accelerator.gradient_state.remainder)
                       for _ in inner]
        assert inner_flags == [(False, 2), (False, 2), (True, 2)]
        outer_flags.append((accelerator.gradient_state.end_of_dataloader, accelerator.gradient_state.remainder))
    assert outer_flags == [(False, 0), (False, 0), (True, 0)]


def test_set_epoch_passes_through_to_sampler():
    ds = make_dataset(12)
    sampler = EpochSampler(12)
    ref_sampler = EpochSampler(12)
    accelerator = Accelerator()
    dl = accelerator.prepare(DataLoader(ds, batch_size=4, sampler=sampler))
    assert len(dl) == 3
    dl.set_epoch(3)
    assert sampler.epochs[-1] == 3
    got = batches_of(dl)
    assert sampler.epoch == 3
    ref_sampler.set_epoch(3)
    ref = batches_of(DataLoader(ds, batch_size=4, sampler=ref_sampler))
    assert_same_batches(got, ref)
    # the next iteration is the next epoch, as in accelerate (iteration counts epochs)
    got5 = batches_of(dl)
    assert sampler.epoch == 4
    ref_sampler.set_epoch(4)
    assert_same_batches(got5, batches_of(DataLoader(ds, batch_size=4, sampler=ref_sampler)))


def test_set_epoch_matches_accelerate():
    accelerate = pytest.importorskip("accelerate")
    ds = make_dataset(12)

    def run(acc):
        sampler = EpochSampler(12)
        dl = acc.prepare(DataLoader(ds, batch_size=4, sampler=sampler))
        dl.set_epoch(5)
        out = batches_of(dl) + batches_of(dl)
        return out, sampler.epochs

    theirs, their_epochs = run(accelerate.Accelerator(cpu=True))
    ours, our_epochs = run(Accelerator())
    assert_same_batches(ours, theirs)
    assert our_epochs[-1] == their_epochs[-1]


def test_set_epoch_passes_through_to_iterable_dataset():
    class EpochIterable(RangeIterable):
        epoch = None

        def set_epoch(self, epoch):
            self.epoch = epoch

    ds = EpochIterable(8)
    accelerator = Accelerator()
    dl = accelerator.prepare(DataLoader(ds, batch_size=4))
    dl.set_epoch(2)
    assert ds.epoch == 2


@pytest.mark.parametrize("n_batches,accum,expected", [
    (5, 2, [False, True, False, True, True]),
    (6, 3, [False, False, True, False, False, True]),
    (4, 1, [True, True, True, True]),
    (3, 4, [False, False, True]),
])
def test_sync_forced_at_end_of_dataloader(n_batches, accum, expected):
    accelerator = Accelerator(gradient_accumulation_steps=accum)
    model = make_model(0)
    loader = make_loader(n=4 * n_batches, batch_size=4)
    model, loader = accelerator.prepare(model, loader)
    syncs = []
    for epoch in range(2):  # the step counter restarts with each epoch
        for inputs, targets in loader:
            with accelerator.accumulate(model):
                accelerator.backward(loss_function(model(inputs), targets))
                syncs.append(accelerator.sync_gradients)
    assert syncs == expected * 2


def test_sync_pattern_matches_accelerate():
    accelerate = pytest.importorskip("accelerate")

    def run(acc):
        model = make_model(0)
        model, loader = acc.prepare(model, make_loader(n=20, batch_size=4))
        out = []
        for inputs, targets in loader:
            with acc.accumulate(model):
                acc.backward(loss_function(model(inputs), targets))
                out.append((acc.sync_gradients, acc.gradient_state.end_of_dataloader))
        return out

    theirs = run(accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2))
    ours = run(Accelerator(gradient_accumulation_steps=2))
    assert ours == theirs


def test_batches_on_device_and_nested_structures():
    class DictDS(torch.utils.data.Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return {"x": torch.full((2,), float(i)), "meta": [torch.tensor(i), "s"]}

    accelerator = Accelerator()
    dl = accelerator.prepare(DataLoader(DictDS(), batch_size=4))
    ref = list(DataLoader(DictDS(), batch_size=4))
    got = list(dl)
    assert len(got) == len(ref) == 2
    for a, b in zip(got, ref):
        assert a.keys() == b.keys()
        assert torch.equal(a["x"], b["x"]) and a["x"].device == accelerator.device
        assert torch.equal(a["meta"][0], b["meta"][0])
        assert a["meta"][1] == b["meta"][1]


def test_gather_for_metrics_over_an_epoch_returns_the_dataset():
    ds = TensorDataset(torch.arange(10).float(), torch.arange(10) * 2)
    accelerator = Accelerator()
    dl = accelerator.prepare(DataLoader(ds, batch_size=4))
    xs, ys = [], []
    for x, y in dl:
        gx, gy = accelerator.gather_for_metrics((x, y))
        xs.append(gx)
        ys.append(gy)
    assert torch.equal(torch.cat(xs), ds.tensors[0])
    assert torch.equal(torch.cat(ys), ds.tensors[1])


def test_custom_batch_sampler_and_skip():
    ds = make_dataset(10)
    ref = batches_of(DataLoader(ds, batch_sampler=torch.utils.data.BatchSampler(
        torch.utils.data.SequentialSampler(ds), 4, False)))
    accelerator = Accelerator()
    dl = accelerator.prepare(DataLoader(ds, batch_sampler=torch.utils.data.BatchSampler(
        torch.utils.data.SequentialSampler(ds), 4, False)))
    assert len(dl) == 3
    assert [accelerator.gradient_state.remainder for _ in dl] == [2, 2, 2]
    assert_same_batches(batches_of(dl), ref)
    skipped = accelerator.skip_first_batches(dl, 1)
    assert len(skipped) == 2
    assert [accelerator.gradient_state.end_of_dataloader for _ in skipped] == [False, True]
    assert_same_batches(batches_of(skipped), ref[1:])


def test_unbatched_loader_batch_size_none_yields_samples_like_torch():
    ds = TensorDataset(torch.arange(6.0).view(6, 1))
    ref = list(DataLoader(ds, batch_size=None))
    accelerator = Accelerator()
    dl = accelerator.prepare(DataLoader(ds, batch_size=None))
    got = list(dl)
    assert len(dl) == len(got) == len(ref) == 6
    for a, b in zip(got, ref):
        assert type(a) is type(b) and len(a) == len(b)
        assert torch.equal(a[0], b[0])


# --------------------------------------------------------------------------------------------
# shuffling: the order follows the global seed set before prepare(), as in accelerate
# --------------------------------------------------------------------------------------------
def _epochs(dl, n=3):
    return [torch.cat([b[0] for b in dl])[:, 0].tolist() for _ in range(n)]




@pytest.mark.parametrize("seed", [0, 123])
def test_shuffled_order_matches_torch_and_accelerate(seed):
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(seed)
    plain = _epochs(make_loader(n=20, batch_size=4, shuffle=True))
    torch.manual_seed(seed)
    theirs = _epochs(accelerate.Accelerator(cpu=True).prepare(make_loader(n=20, batch_size=4, shuffle=True)))
    assert theirs == plain
    from accelerate.state import AcceleratorState as A

    A._reset_state(True)
    torch.manual_seed(seed)
    ours = _epochs(Accelerator().prepare(make_loader(n=20, batch_size=4, shuffle=True)))
    assert ours == plain


def test_shuffled_epochs_are_permutations_that_change():
    torch.manual_seed(0)
    ours = _epochs(Accelerator().prepare(make_loader(n=20, batch_size=4, shuffle=True)))
    ref = sorted(make_dataset(20).tensors[0][:, 0].tolist())
    assert all(sorted(e) == ref for e in ours)
    assert ours[0] != ours[1]


@pytest.mark.parametrize("data_seed", [None, 42])
def test_seedable_sampler_matches_accelerate(data_seed):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.utils import DataLoaderConfiguration as TheirCfg

    from accelerate_c import DataLoaderConfiguration

    torch.manual_seed(3)
    theirs = _epochs(accelerate.Accelerator(
        cpu=True, dataloader_config=TheirCfg(use_seedable_sampler=True, data_seed=data_seed)).prepare(
        make_loader(n=20, batch_size=4, shuffle=True)))
    from accelerate.state import AcceleratorState as A

    A._reset_state(True)
    torch.manual_seed(3)
    ours = _epochs(Accelerator(dataloader_config=DataLoaderConfiguration(
        use_seedable_sampler=True, data_seed=data_seed)).prepare(make_loader(n=20, batch_size=4, shuffle=True)))
    assert ours == theirs

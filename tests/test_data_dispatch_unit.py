"""One-process checks of the dispatch helpers and the stateful loaders (the multi-process
behaviour: tests/test_dispatch_batches.py, tests/test_data_path.py).

- batch_dispatch's combining and slicing of loader batches, against default_collate of the
  same samples (the batch a plain DataLoader would have made of them);
- a dispatched loader on one process against accelerate 1.15's (accelerate dispatches
  iterable datasets on one process too);
- a stateful loader's state_dict()/load_state_dict() against torchdata's StatefulDataLoader on
  the same data, and the ImportError naming torchdata when it is missing."""
import importlib.util

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate

from accelerate_c import Accelerator
from accelerate_c.batch_dispatch import concatenate, slice_batch
from accelerate_c.utils import DataLoaderConfiguration
from helpers import fresh_state  # noqa: F401


def sample(i):
    return {"x": torch.tensor([i, 2 * i]), "name": f"s{i}", "task": "t",
            "pair": (torch.tensor(float(i)), [torch.tensor(i)])}


def test_concatenate_and_slice_are_default_collate_of_the_samples():
    samples = [sample(i) for i in range(8)]
    parts = [default_collate(samples[0:3]), default_collate(samples[3:8])]
    whole = concatenate(parts)
    want = default_collate(samples)
    assert whole["name"] == want["name"] and whole["task"] == want["task"]
    torch.testing.assert_close(whole["x"], want["x"])
    torch.testing.assert_close(whole["pair"][1][0], want["pair"][1][0])
    part = slice_batch(whole, slice(2, 5))
    ref = default_collate(samples[2:5])
    assert part["name"] == ref["name"] and part["task"] == ref["task"]
    torch.testing.assert_close(part["x"], ref["x"])
    torch.testing.assert_close(part["pair"][0], ref["pair"][0])


def test_concatenate_refuses_what_cannot_be_one_batch():
    a = {"x": torch.zeros(2), "tag": "a"}
    with pytest.raises(TypeError, match=r"batch\['tag'\].*differs"):
        concatenate([a, {"x": torch.zeros(2), "tag": "b"}])
    with pytest.raises(TypeError, match="different keys"):
        concatenate([a, {"y": torch.zeros(2), "tag": "a"}])


class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter([{"x": torch.tensor(i), "name": f"s{i}"} for i in range(self.n)])


@pytest.mark.parametrize("split", [False, True])
def test_one_process_dispatch_matches_accelerate(split):
    accelerate = pytest.importorskip("accelerate")

    def run(acc):
        dl = acc.prepare(DataLoader(Stream(10), batch_size=4))
        gs = acc.gradient_state
        return type(dl).__name__, [(b["x"].tolist(), b["name"], gs.end_of_dataloader, gs.remainder) for b in dl]

    theirs = run(accelerate.Accelerator(cpu=True, dataloader_config=accelerate.DataLoaderConfiguration(
        split_batches=split)))
    ours = run(Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=split)))
    assert ours == theirs and ours[0] == "DataLoaderDispatcher"


def test_empty_dispatched_loader_yields_nothing():
    # accelerate 1.15 raises ValueError ("Batch does not contain any data") here
    acc = Accelerator(cpu=True)
    assert list(acc.prepare(DataLoader(Stream(0), batch_size=4))) == []


@pytest.mark.parametrize("iterable", [False, True])
def test_stateful_state_dict_resumes_like_torchdata(iterable):
    td = pytest.importorskip("torchdata.stateful_dataloader")
    data = list(range(23))

    def loader(cls):
        return cls(Stream(23) if iterable else data, batch_size=3)

    def values(b):
        return b["x"].tolist() if isinstance(b, dict) else b.tolist()

    # torchdata's own: a state taken after 3 batches resumes at the 4th
    ref = loader(td.StatefulDataLoader)
    it = iter(ref)
    [next(it) for _ in range(3)]
    state = ref.state_dict()
    ref2 = loader(td.StatefulDataLoader)
    ref2.load_state_dict(state)
    want = [values(b) for b in ref2]
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    dl = acc.prepare(loader(DataLoader))
    assert isinstance(dl, td.StatefulDataLoader) and dl.state_dict() == {}
    for i, _ in enumerate(dl):
        if i == 2:
            ours = dl.state_dict()
    dl.load_state_dict(ours)
    assert [values(b) for b in dl] == want


def test_missing_torchdata_is_named(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name.split(".")[0] == "torchdata" else real(name, *a, **k))
    with pytest.raises(ImportError, match="torchdata"):
        Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    acc = Accelerator(cpu=True)
    acc.dataloader_config.use_stateful_dataloader = True  # set after construction, as accelerate's tests do
    with pytest.raises(ImportError, match="pip install 'torchdata"):
        acc.prepare(DataLoader(list(range(4)), batch_size=2))


def test_a_converted_checkpoint_resumes_a_stateful_loader_in_accelerate(tmp_path):
    # convert-checkpoint writes the stateful loader's state as accelerate's dl_state_dict.bin:
    # accelerate's own load_state then resumes at the batch ours would have given next
    accelerate = pytest.importorskip("accelerate")
    pytest.importorskip("torchdata.stateful_dataloader")
    from accelerate_c.checkpoint_convert import to_accelerate

    data = list(range(20))
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    dl = acc.prepare(DataLoader(data, batch_size=3))
    rest = []
    for i, b in enumerate(dl):
        if i == 2:
            acc.save_state(tmp_path / "ours")
        elif i > 2:
            rest.append(b.tolist())
    written, _ = to_accelerate(tmp_path / "ours", tmp_path / "theirs")
    assert "dl_state_dict.bin" in written
    ref = accelerate.Accelerator(cpu=True, dataloader_config=accelerate.DataLoaderConfiguration(
        use_stateful_dataloader=True))
    ref_dl = ref.prepare(DataLoader(data, batch_size=3))
    ref.load_state(str(tmp_path / "theirs"))
    assert [b.tolist() for b in ref_dl] == rest


@pytest.mark.parametrize("stateful", [False, True])
@pytest.mark.parametrize("iterable", [False, True])
def test_prepared_loaders_are_data_loader_adapters_as_in_accelerate(iterable, stateful):
    """What users can ask of accelerate's DataLoaderAdapter on a prepared loader: the isinstance
    checks and base_dataloader's kind, side by side with accelerate 1.15's prepared loader."""
    accelerate = pytest.importorskip("accelerate")
    if stateful:
        pytest.importorskip("torchdata")
    from accelerate.data_loader import DataLoaderAdapter as TheirAdapter
    from torchdata.stateful_dataloader import StatefulDataLoader

    from accelerate_c.data_loader import DataLoaderAdapter

    def facts(acc, adapter):
        dl = acc.prepare(DataLoader(Stream(6) if iterable else list(range(6)), batch_size=2))
        return {"adapter": isinstance(dl, adapter), "dataloader": isinstance(dl, DataLoader),
                "stateful": isinstance(dl, StatefulDataLoader), "use_stateful": dl.use_stateful_dataloader,
                "base_is_dataloader": isinstance(dl.base_dataloader, DataLoader),
                "base_is_stateful": isinstance(dl.base_dataloader, StatefulDataLoader),
                "kind": type(dl).__name__.replace("Stateful", "")}

    theirs = facts(accelerate.Accelerator(cpu=True, dataloader_config=accelerate.DataLoaderConfiguration(
        use_stateful_dataloader=stateful)), TheirAdapter)
    ours = facts(Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful)),
                 DataLoaderAdapter)
    assert ours == theirs and ours["adapter"] and ours["base_is_stateful"] == stateful
    with pytest.raises(TypeError, match="prepare"):
        DataLoaderAdapter(list(range(4)), batch_size=2)


def test_stateful_streaming_shuffle_buffer_resumes_exactly_and_names_a_shorter_stream():
    """A streaming datasets.IterableDataset with a shuffle buffer of 8, one process: a state taken
    mid-epoch and loaded with load_state_dict after the epoch ended gives exactly the rest of the
    epoch a plain torch DataLoader reads from the same dataset; a dataset shorter than the state
    had read is named."""
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("torchdata")

    def stream(n):
        rows = datasets.Dataset.from_dict({"x": list(range(n))})
        return rows.to_iterable_dataset(num_shards=4).shuffle(seed=3, buffer_size=8).with_format("torch")

    plain = [b["x"].tolist() for b in DataLoader(stream(40), batch_size=4)]
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    dl = acc.prepare(DataLoader(stream(40), batch_size=4))
    for i, b in enumerate(dl):
        if i == 2:
            state = dl.state_dict()
    dl.load_state_dict(state)
    assert [b["x"].tolist() for b in dl] == plain[3:]
    short = acc.prepare(DataLoader(stream(8), batch_size=4))
    short.load_state_dict(state)
    with pytest.raises(ValueError, match="IterableDataset gives only 2"):
        list(short)


def test_a_malformed_stateful_state_is_named():
    from accelerate_c.stateful_loader import replay_count

    assert replay_count({"_num_yielded": 3}) == 3 and replay_count({"_num_yielded": 3, "_iterator_finished": True}) == 0
    assert replay_count({"_snapshot": {"_snapshot_step": 2}, "_steps_since_snapshot": 1}) == 3
    with pytest.raises(ValueError, match="_num_yielded must be a non-negative integer, got 'x'"):
        replay_count({"_num_yielded": "x"})
    with pytest.raises(ValueError, match="_snapshot._snapshot_step"):
        replay_count({"_snapshot": {}, "_steps_since_snapshot": 1})

"""`use_stateful_dataloader=True`: the prepared loaders over torchdata's StatefulDataLoader
(docs/data-loading.md).

`stateful_variant(cls)` is `cls` (DataLoaderShard or DataLoaderDispatcher) with torchdata's
StatefulDataLoader as the DataLoader underneath: the same iteration, plus state_dict() /
load_state_dict(). The prepared loaders read one batch ahead (to know the last one), so the
state they report is a snapshot taken when the batch being handed out was taken from the
StatefulDataLoader (`_take_state` / `_set_state` in data_loader.EpochResume), not the
StatefulDataLoader's own state, which is one batch further: a state saved during a step
resumes at the next step's batch. Under dispatch only the main process reads the loader; the
others report an empty state, which loads as "from the start" and which they never use.

A streaming `datasets.IterableDataset` restores its own position, except a shuffle buffer's
content, which `datasets` refills on load (resumed samples then differ from the uninterrupted
run's). For such a dataset the saved state is not handed to it: the next epoch re-creates the
iterator (the same order, the epoch's shuffle seeded by set_epoch) and reads past the batches
the state had read (`replay_count`), which leaves the buffer as it was.

torchdata is optional (requirements-dev.txt): asking for a stateful loader without it raises
ImportError naming the package.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import sys

from packaging import version

MIN_TORCHDATA = "0.8.0"  # the first torchdata with StatefulDataLoader (accelerate's bound too)


def torchdata_version():
    """torchdata's installed version, or None."""
    if importlib.util.find_spec("torchdata") is None:
        return None
    try:
        return version.parse(importlib.metadata.version("torchdata"))
    except importlib.metadata.PackageNotFoundError:
        return None


def stateful_dataloader_class():
    """torchdata's StatefulDataLoader; ImportError naming the package when it is missing."""
    v = torchdata_version()
    if v is None or v < version.parse(MIN_TORCHDATA):
        found = "not installed" if v is None else f"torchdata {v} is installed"
        raise ImportError(f"use_stateful_dataloader=True needs the `torchdata` package, version {MIN_TORCHDATA} or "
                          f"newer, for its StatefulDataLoader ({found}): pip install 'torchdata>={MIN_TORCHDATA}'")
    from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: PLC0415 (optional package)

    return StatefulDataLoader


def _hf_streaming(dataset) -> bool:
    """Whether `dataset` is a Hugging Face datasets.IterableDataset (looked up only when datasets
    is imported: an object of it cannot exist otherwise)."""
    kind = getattr(sys.modules.get("datasets"), "IterableDataset", None)
    return kind is not None and isinstance(dataset, kind)


def restores_exactly(dataset) -> bool:
    """Whether a datasets.IterableDataset's own load_state_dict resumes at exactly the next sample:
    not when a shuffle buffer of more than one example is anywhere in its pipeline (datasets
    keeps no buffer content in its state). Read off datasets' examples-iterable chain; when that
    chain cannot be read (another datasets layout), False: the replay is exact whatever it holds."""
    buffered = getattr(sys.modules.get("datasets.iterable_dataset"), "BufferShuffledExamplesIterable", None)
    root = getattr(dataset, "_ex_iterable", None)
    if buffered is None or root is None:
        return False
    todo, seen = [root], set()
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, buffered) and getattr(node, "buffer_size", 2) > 1:
            return False
        todo.extend(n for n in [getattr(node, "ex_iterable", None), *getattr(node, "ex_iterables", ())]
                    if n is not None)
    return True


def _worker_states(state: dict) -> list:
    """The per-worker fetcher states of a multi-worker StatefulDataLoader state ([] otherwise)."""
    snapshots = state.get("_snapshot", {}).get("_worker_snapshots", {}) if isinstance(state, dict) else {}
    return [w for w in snapshots.values() if isinstance(w, dict)]


def saved_epoch(state: dict):
    """The epoch a datasets.IterableDataset was in when `state` (a StatefulDataLoader state) was
    taken, or None."""
    found = [state.get("dataset_state")] + [w.get("dataset_state") for w in _worker_states(state)]
    for ds_state in found:
        if isinstance(ds_state, dict) and isinstance(ds_state.get("epoch"), int):
            return ds_state["epoch"]
    return None


def replay_count(state: dict) -> int:
    """How many batches the StatefulDataLoader had yielded in its epoch when `state` was taken
    (0 once the epoch had run out: the next epoch starts afresh)."""
    if not state or state.get("_iterator_finished"):
        return 0
    if "_snapshot" in state:  # workers: the last snapshot's step plus the steps since
        snap = state["_snapshot"]
        counts = (snap.get("_snapshot_step") if isinstance(snap, dict) else None, state.get("_steps_since_snapshot", 0))
        keys = "_snapshot._snapshot_step and _steps_since_snapshot"
    else:
        counts, keys = (state.get("_num_yielded"), 0), "_num_yielded"
    if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
        raise ValueError(f"load_state_dict: a StatefulDataLoader state's {keys} must be non-negative integers, "
                         f"got {counts[0]!r} and {counts[1]!r}" if "_snapshot" in state else
                         f"load_state_dict: a StatefulDataLoader state's {keys} must be a non-negative integer, "
                         f"got {counts[0]!r}")
    return counts[0] + counts[1]


class _StatefulParts:
    """What the stateful variants add to a prepared loader (placed before StatefulDataLoader in
    the method order, so the prepared loader's iteration wraps the StatefulDataLoader's)."""

    use_stateful_dataloader = True
    _replay = 0  # batches the next epoch reads past before its first (load_state_dict's replay)

    def _take_state(self):
        return self._stateful_base.state_dict(self)

    def _set_state(self, state):
        if state is not None:
            self.dl_state_dict = state

    def _catch_up(self, it) -> None:
        """The replay load_state_dict asked for: reads `_replay` batches of the new iterator."""
        n, self._replay = self._replay, 0
        for done in range(n):
            try:
                next(it)
            except StopIteration:
                raise ValueError(f"load_state_dict: the loaded state had read {n} batches of this epoch, the "
                                 f"dataset {type(self.dataset).__name__} gives only {done} now (has it "
                                 "changed?)") from None

    def state_dict(self) -> dict:
        """The state that resumes after the batch last handed out ({} before the first)."""
        return self.__dict__.get("dl_state_dict", {})

    def load_state_dict(self, state_dict: dict) -> None:
        """The next iteration continues where `state_dict` (a state_dict() of this loader, on this
        process) left off; {} starts from the beginning."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"load_state_dict: a data loader state must be a dict, got {type(state_dict).__name__}")
        self._replay = 0
        streaming = _hf_streaming(self.dataset)
        if streaming and state_dict and not restores_exactly(self.dataset):
            # datasets would refill the shuffle buffer with other samples: replay the epoch instead
            self._stateful_base.load_state_dict(self, {})
            self.next_iter_state = None  # a state loaded before is superseded
            self._replay = replay_count(state_dict)
        else:
            self._stateful_base.load_state_dict(self, state_dict)
        epoch = saved_epoch(state_dict) if streaming and not state_dict.get("_iterator_finished") else None
        if epoch is not None:
            # datasets applies a state only in the epoch it was taken in; the next iteration is that epoch
            self.iteration = epoch
        self.dl_state_dict = state_dict


_VARIANTS: dict = {}


def stateful_variant(cls):
    """`cls` over torchdata's StatefulDataLoader (one class per `cls`, made on first use)."""
    base = stateful_dataloader_class()  # checked every time: a missing torchdata is named
    if cls not in _VARIANTS:
        name = "Stateful" + cls.__name__
        variant = type(name, (_StatefulParts, cls, base), {"_stateful_base": base, "__module__": cls.__module__,
                                                          "__qualname__": name, "__doc__": cls.__doc__})
        _VARIANTS[cls] = variant
    return _VARIANTS[cls]

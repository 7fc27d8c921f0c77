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

torchdata is optional (requirements-dev.txt): asking for a stateful loader without it raises
ImportError naming the package.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util

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


class _StatefulParts:
    """What the stateful variants add to a prepared loader (placed before StatefulDataLoader in
    the method order, so the prepared loader's iteration wraps the StatefulDataLoader's)."""

    use_stateful_dataloader = True

    def _take_state(self):
        return self._stateful_base.state_dict(self)

    def _set_state(self, state):
        if state is not None:
            self.dl_state_dict = state

    def state_dict(self) -> dict:
        """The state that resumes after the batch last handed out ({} before the first)."""
        return self.__dict__.get("dl_state_dict", {})

    def load_state_dict(self, state_dict: dict) -> None:
        """The next iteration continues where `state_dict` (a state_dict() of this loader, on this
        process) left off; {} starts from the beginning."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"load_state_dict: a data loader state must be a dict, got {type(state_dict).__name__}")
        self._stateful_base.load_state_dict(self, state_dict)
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

"""Experiment trackers, as accelerate.tracking has them: `GeneralTracker` (the interface a
user's own tracker implements), the built-in JSON-lines and TensorBoard trackers, the registry
of tracker names (`LOGGER_TYPE_TO_CLASS`, `register_tracker_class`) and `filter_trackers`,
which turns an Accelerator's `log_with` into the list it keeps.

The adapters for wandb, mlflow, comet_ml, aim, clearml, dvclive, swanlab and trackio are in
tracking_adapters.py. Differences from accelerate (README, "Differs"): a tracker named in
`log_with` whose package is missing is an ImportError naming the package (accelerate drops it
with a debug message), and a tracker that needs a logging directory without one is a
ValueError at the Accelerator (accelerate's `log_with="all"` fails later, in init_trackers).
"""
from __future__ import annotations

import json
import os
import time
import warnings

from . import tracking_adapters
from .durable import write_bytes_durable
from .tracker_base import (  # noqa: F401  (accelerate.tracking's names, from here as from there)
    PACKAGES,
    GeneralTracker,
    is_available,
    is_tracker_class,
    is_tracker_instance,
    on_main_process,
    plain_value,
    json_value,
    require_package,
)
from .utils.dataclasses import LoggerType


class JSONLTracker(GeneralTracker):
    """accelerate_c's own tracker, with no dependency: `<logging_dir>/<run_name>/metrics.jsonl`
    gets one JSON object per `log` call, `{"_step": step, "_timestamp": seconds, **values}`
    (appended, so a resumed run continues the same file; each line flushed as written), and
    `config.json` the configuration given to init_trackers. NaN and infinities are written as
    Python's json writes them (NaN, Infinity), which Python's json reads back."""

    name = "jsonl"
    requires_logging_directory = True
    RESERVED = ("_step", "_timestamp")

    def __init__(self, run_name: str, logging_dir, filename: str = "metrics.jsonl"):
        super().__init__()
        self.run_name = run_name
        self.logging_dir = os.path.join(os.fspath(logging_dir), run_name)
        self.path = os.path.join(self.logging_dir, filename)
        self.file = None

    @property
    def tracker(self):
        return self.file

    @on_main_process
    def start(self):
        os.makedirs(self.logging_dir, exist_ok=True)
        self.file = open(self.path, "a", encoding="utf-8")

    @on_main_process
    def store_init_configuration(self, values: dict):
        config = {str(k): json_value("JSONLTracker config", str(k), v) for k, v in values.items()}
        write_bytes_durable(os.path.join(self.logging_dir, "config.json"),
                            json.dumps(config, indent=2, sort_keys=True).encode())

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        if kwargs:
            raise TypeError(f"JSONLTracker.log takes no keyword arguments, got {sorted(kwargs)} (log_kwargs['jsonl'])")
        if self.file is None:
            raise RuntimeError("JSONLTracker.log before start(): call accelerator.init_trackers(...) first")
        line = {"_step": step, "_timestamp": time.time()}
        for key, value in values.items():
            key = str(key)
            if key in self.RESERVED:
                raise ValueError(f"JSONLTracker.log: {key!r} is the tracker's own column; rename that value")
            line[key] = json_value("JSONLTracker.log", key, value)
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()

    @on_main_process
    def finish(self):
        if self.file is not None:
            self.file.close()
            self.file = None


class TensorBoardTracker(GeneralTracker):
    """TensorBoard event files under `<logging_dir>/<run_name>`, through torch's SummaryWriter
    (the `tensorboard` package must be installed). Numbers become scalars, strings text, a dict
    of numbers a group of scalars (add_scalars), as in accelerate; a value of any other kind is
    skipped with a warning naming it (accelerate skips it silently). The configuration goes to
    add_hparams and to `hparams.yml` in a subdirectory named by the time, as accelerate writes it."""

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir, **kwargs):
        super().__init__()
        self.run_name = run_name
        self.logging_dir_param = logging_dir
        self.logging_dir = os.path.join(os.fspath(logging_dir), run_name)
        self.init_kwargs = kwargs
        self.writer = None

    @property
    def tracker(self):
        return self.writer

    @on_main_process
    def start(self):
        require_package("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(self.logging_dir, **self.init_kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict):
        import yaml

        self.writer.add_hparams(values, metric_dict={})
        self.writer.flush()
        where = os.path.join(self.logging_dir, str(time.time()))
        os.makedirs(where, exist_ok=True)
        with open(os.path.join(where, "hparams.yml"), "w") as f:
            yaml.dump(values, f)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        for key, value in values.items():
            value = plain_value(value)
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(key, value, global_step=step, **kwargs)
            else:
                warnings.warn(f"TensorBoardTracker.log: {key!r} is a {type(value).__name__}, which is neither a "
                              "number, a string nor a dict of numbers; not logged", stacklevel=3)
        self.writer.flush()

    @on_main_process
    def log_images(self, values: dict, step: int | None = None, **kwargs):
        for key, images in values.items():
            self.writer.add_images(key, images, global_step=step, **kwargs)

    @on_main_process
    def finish(self):
        if self.writer is not None:
            self.writer.close()


# ---- the registry -------------------------------------------------------------------------

def get_available_trackers() -> list:
    """The built-in trackers whose packages are installed (jsonl always), as LoggerType members."""
    return [LoggerType(name) for name in PACKAGES if is_available(name)]


# tracker name -> class: the built-in ones, then those register_tracker_class adds
LOGGER_TYPE_TO_CLASS = {"jsonl": JSONLTracker, "tensorboard": TensorBoardTracker, **tracking_adapters.ADAPTERS}


def register_tracker_class(tracker_class):
    """Makes a GeneralTracker subclass available to `log_with` under its `name` (before the
    Accelerator that names it is built). Built like the built-in ones: (project_name,
    [logging_dir when requires_logging_directory], **init_kwargs[name])."""
    if not is_tracker_class(tracker_class):
        raise ValueError(f"register_tracker_class: expected a subclass of GeneralTracker, got {tracker_class!r}")
    if not getattr(tracker_class, "name", None):
        raise ValueError(f"register_tracker_class: {tracker_class.__name__} has no `name`")
    if not hasattr(tracker_class, "requires_logging_directory"):
        raise ValueError(f"register_tracker_class: {tracker_class.__name__} has no `requires_logging_directory` "
                         "(True when the tracker needs a logging directory)")
    if tracker_class.name in LOGGER_TYPE_TO_CLASS:
        warnings.warn(f"register_tracker_class: {tracker_class.name!r} was already registered; {tracker_class} "
                      "replaces it", stacklevel=2)
    LOGGER_TYPE_TO_CLASS[tracker_class.name] = tracker_class


def filter_trackers(log_with, logging_dir=None) -> list:
    """The trackers `log_with` asks for: names (str or LoggerType, ours or accelerate's) and
    tracker objects, repeats dropped; "all" is every installed built-in one plus the objects
    given. A name whose package is missing is an ImportError naming it; one that writes files
    without a logging directory is a ValueError."""
    if log_with is None:
        return []
    given = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    names = [None if is_tracker_instance(t) else str(getattr(t, "value", t)) for t in given]
    objects = [t for t, n in zip(given, names) if n is None]
    if "all" in names:
        wanted = [str(t) for t in get_available_trackers()]
        chosen = "log_with='all'"
    else:
        wanted = []
        for t, name in zip(given, names):
            if name is None:
                continue
            if name not in LOGGER_TYPE_TO_CLASS:
                raise ValueError(f"Accelerator(log_with={t!r}): unknown tracker; choose from "
                                 f"{['all', *LOGGER_TYPE_TO_CLASS]} or pass a GeneralTracker instance")
            if name not in wanted:
                wanted.append(name)
        for name in wanted:
            if name in PACKAGES:
                require_package(name)
        chosen = f"log_with={log_with!r}"
    need_dir = [n for n in wanted if LOGGER_TYPE_TO_CLASS[n].requires_logging_directory]
    if need_dir and logging_dir is None:
        raise ValueError(f"Accelerator({chosen}): {', '.join(need_dir)} write under a logging directory; pass "
                         "project_dir=... (or ProjectConfiguration(logging_dir=...))")
    return objects + [LoggerType(n) if n in PACKAGES else n for n in wanted]


def check_tracker_kwargs(what: str, kwargs: dict | None, active: list) -> dict:
    """init_kwargs / log_kwargs: a dict keyed by tracker name. A key that names no tracker at all
    is a ValueError (a misspelt name would otherwise be dropped silently); a known tracker that is
    not active here (not installed under "all") is ignored, as accelerate does."""
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise TypeError(f"{what}: expected a dict of tracker name -> keyword arguments, got {type(kwargs).__name__}")
    known = set(LOGGER_TYPE_TO_CLASS) | {getattr(t, "name", None) for t in active}
    for key, value in kwargs.items():
        if key not in known:
            raise ValueError(f"{what}[{key!r}]: no tracker has that name; trackers: {sorted(k for k in known if k)}")
        if not isinstance(value, dict):
            raise TypeError(f"{what}[{key!r}]: expected a dict of keyword arguments, got {type(value).__name__}")
    return kwargs

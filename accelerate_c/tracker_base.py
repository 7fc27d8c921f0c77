"""What every tracker shares: `GeneralTracker` (the interface a user's own tracker implements,
as accelerate.tracking's), the `on_main_process` decorator of tracker methods, which package
each built-in tracker needs, and how logged values are made plain Python. tracking.py and
tracking_adapters.py build on it."""
from __future__ import annotations

import importlib.util
import numbers
from functools import wraps

import torch

from .state import PartialState


def on_main_process(function):
    """For a tracker's methods: run only on the main process when the tracker's
    `main_process_only` is true (read at call time, so no process state is made at import)."""

    @wraps(function)
    def run(self, *args, **kwargs):
        if getattr(self, "main_process_only", False):
            state = PartialState()
            if state.use_distributed and not state.is_main_process:
                return None
        return function(self, *args, **kwargs)

    return run


class GeneralTracker:
    """The interface of a tracker. A subclass sets `name` (how log_with, init_kwargs and
    get_tracker refer to it), `requires_logging_directory`, and a `tracker` property (the
    package's own run object), and overrides what it needs of start, store_init_configuration,
    log and finish. `main_process_only` (default True) makes the methods decorated with
    `on_main_process` run on the main process only."""

    main_process_only = True

    def __init__(self, _blank: bool = False):
        if _blank:  # get_tracker's stand-in on processes that hold no trackers
            return
        missing = [attr for attr in ("name", "requires_logging_directory") if not hasattr(self, attr)]
        if "tracker" not in dir(self):  # a property that may only work after start()
            missing.append("tracker")
        if missing:
            raise NotImplementedError(f"{type(self).__name__} does not define {', '.join(f'`{m}`' for m in missing)}"
                                      ": a GeneralTracker subclass must set name, requires_logging_directory and a "
                                      "tracker property")

    def start(self):
        """Opens the run; called by Accelerator.init_trackers (not by __init__, so a tracker can
        be built before the process group exists)."""

    def store_init_configuration(self, values: dict):
        """Records the run's hyperparameters."""

    def log(self, values: dict, step: int | None = None, **kwargs):
        """Records `values` (name -> number, string, or dict of numbers) at `step`."""

    def finish(self):
        """Closes the run."""


def plain_value(value):
    """A tensor as Python numbers (one element: a number; more: a list), as accelerate's
    trackers see tensors; anything else as it is."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:  # no bfloat16 in numpy/Python: widen exactly
            value = value.float()
        return value.tolist()
    if hasattr(value, "item") and getattr(value, "shape", None) == ():  # numpy scalars
        return value.item()
    return value


def json_value(where: str, key: str, value):
    """value as JSON takes it, or a TypeError naming the key."""
    value = plain_value(value)
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, dict):
        return {str(k): json_value(where, f"{key}.{k}", v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_value(where, f"{key}[{i}]", v) for i, v in enumerate(value)]
    raise TypeError(f"{where}: value of {key!r} is a {type(value).__name__}, which JSON cannot hold (numbers, "
                    "strings, booleans, None, tensors, and lists/dicts of them are taken)")


# tracker name -> the package its adapter needs (None: nothing to install)
PACKAGES = {"jsonl": None, "tensorboard": "tensorboard", "wandb": "wandb", "comet_ml": "comet_ml", "aim": "aim",
            "mlflow": "mlflow", "clearml": "clearml", "dvclive": "dvclive", "swanlab": "swanlab",
            "trackio": "trackio"}


def is_available(name: str) -> bool:
    package = PACKAGES.get(name)
    return package is None or importlib.util.find_spec(package) is not None


def require_package(name: str):
    """ImportError naming the package a tracker needs when it is not installed."""
    package = PACKAGES.get(name, name)
    if package is not None and importlib.util.find_spec(package) is None:
        raise ImportError(f"the {name} tracker needs the `{package}` package, which is not installed "
                          f"(pip install {package}); or choose another tracker in log_with", name=package)



def is_tracker_class(cls) -> bool:
    """cls derives from our GeneralTracker or from accelerate's (recognised by name and package,
    so accelerate need not be imported)."""
    return isinstance(cls, type) and any(
        b is GeneralTracker or (b.__name__ == "GeneralTracker" and b.__module__.split(".")[0] == "accelerate")
        for b in cls.__mro__)


def is_tracker_instance(obj) -> bool:
    """A tracker object given in log_with: an instance of our GeneralTracker or of accelerate's."""
    return is_tracker_class(type(obj))

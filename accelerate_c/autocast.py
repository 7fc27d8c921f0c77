"""Mixed-precision forward: autocast around the model's forward, fp32 outputs."""
from __future__ import annotations

import functools
from contextlib import nullcontext

import torch

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def autocast_context(mixed_precision: str, device_type: str, autocast_kwargs: dict | None = None):
    """The torch.autocast context for a precision mode ("no" -> a null context)."""
    if mixed_precision not in _DTYPES:
        return nullcontext()
    kwargs = dict(autocast_kwargs or {})
    return torch.autocast(device_type=device_type, dtype=_DTYPES[mixed_precision], **kwargs)


class AutocastForward:
    """Calls a forward function under autocast. A class, not a closure, so that it keeps
    the wrapped function reachable (`__wrapped__`) for unwrap_model."""

    def __init__(self, forward, mixed_precision: str, device_type: str, autocast_kwargs: dict | None):
        self.__wrapped__ = forward
        self.mixed_precision = mixed_precision
        self.device_type = device_type
        self.autocast_kwargs = autocast_kwargs
        functools.update_wrapper(self, forward)

    def __call__(self, *args, **kwargs):
        with autocast_context(self.mixed_precision, self.device_type, self.autocast_kwargs):
            return self.__wrapped__(*args, **kwargs)

    def __get__(self, obj, objtype=None):
        # behave like a function when stored on a class
        return self if obj is None else functools.partial(self.__call__, obj)

"""Operations over nested batches (tuples, lists, dicts, namedtuples of tensors)."""
from __future__ import annotations

from collections.abc import Mapping
from functools import update_wrapper

import torch


def _is_namedtuple(obj) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def recursively_apply(func, data, *args, test_type=torch.is_tensor, error_on_other_type=False, **kwargs):
    """Applies func to every leaf of `data` that passes test_type, keeping the container types."""
    if isinstance(data, (tuple, list)):
        items = [recursively_apply(func, d, *args, test_type=test_type, error_on_other_type=error_on_other_type,
                                   **kwargs) for d in data]
        if _is_namedtuple(data):
            return type(data)(*items)
        return type(data)(items)
    if isinstance(data, Mapping):
        return type(data)({k: recursively_apply(func, v, *args, test_type=test_type,
                                                error_on_other_type=error_on_other_type, **kwargs)
                           for k, v in data.items()})
    if test_type(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:
        raise TypeError(f"Unsupported type {type(data)} passed to {func.__name__}: only nested "
                        "lists/tuples/dicts of tensors are supported")
    return data


def send_to_device(tensor, device, non_blocking: bool = False, skip_keys=None):
    """Moves every tensor (or object with `.to`) in a nested batch to `device`."""
    if isinstance(tensor, (tuple, list)):
        items = [send_to_device(t, device, non_blocking=non_blocking, skip_keys=skip_keys) for t in tensor]
        return type(tensor)(*items) if _is_namedtuple(tensor) else type(tensor)(items)
    if isinstance(tensor, Mapping):
        if isinstance(skip_keys, str):
            skip_keys = [skip_keys]
        skip_keys = skip_keys or []
        return type(tensor)({k: t if k in skip_keys else send_to_device(t, device, non_blocking=non_blocking,
                                                                          skip_keys=skip_keys)
                             for k, t in tensor.items()})
    if hasattr(tensor, "to"):
        try:
            return tensor.to(device, non_blocking=non_blocking)
        except TypeError:  # objects whose .to takes no non_blocking
            return tensor.to(device)
    return tensor


def _to_fp32(t):
    return t.float()


def _is_fp16_bf16(t):
    return torch.is_tensor(t) and t.dtype in (torch.float16, torch.bfloat16)


def convert_to_fp32(tensor):
    """Casts every fp16/bf16 tensor of a nested structure to fp32."""
    return recursively_apply(_to_fp32, tensor, test_type=_is_fp16_bf16)


class ConvertOutputsToFp32:
    """Wraps a forward so its fp16/bf16 outputs come back in fp32 (picklable, unlike a closure)."""

    def __init__(self, model_forward):
        self.model_forward = model_forward
        update_wrapper(self, model_forward)

    def __call__(self, *args, **kwargs):
        return convert_to_fp32(self.model_forward(*args, **kwargs))

    def __getstate__(self):
        raise RuntimeError("Cannot pickle a prepared model with automatic mixed precision; unwrap_model() it first")


def convert_outputs_to_fp32(model_forward):
    return ConvertOutputsToFp32(model_forward)


def pad_tensor(tensor, size: int, dim: int = 0, pad_index=0, pad_first: bool = False):
    if tensor.shape[dim] >= size:
        return tensor
    new_shape = list(tensor.shape)
    new_shape[dim] = size
    out = tensor.new_full(new_shape, pad_index)
    idx = [slice(None)] * tensor.dim()
    n = tensor.shape[dim]
    idx[dim] = slice(size - n, size) if pad_first else slice(0, n)
    out[tuple(idx)] = tensor
    return out

"""Operations over nested batches (tuples, lists, dicts, namedtuples of tensors)."""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping
import weakref
from functools import update_wrapper

import torch

from .. import collectives


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


# set by fp32_loss_only(): the prepared forward called next converts only the loss
_LOSS_ONLY = contextvars.ContextVar("accelerate_c_fp32_loss_only", default=False)


@contextlib.contextmanager
def fp32_loss_only():
    """Inside, a forward of a model prepared under mixed precision converts only the loss of its
    outputs to fp32 (a dict's "loss"; a tuple's or list's first element, and a namedtuple's
    `loss` field; any other output whole, as outside): for a caller that reads nothing else,
    such as a Trainer's training step, where the fp32 copy of a language model's logits
    (accelerate's conversion) costs a pass over them, a fresh allocation and its memory held
    through backward, and is never read. The loss is converted as before, so what backward and
    the logged loss see is unchanged. Only the outermost prepared forward: the models it calls
    in turn convert all their outputs, which it reads; and not where a forward hook on the
    model (or a global one) would see the outputs."""
    token = _LOSS_ONLY.set(True)
    try:
        yield
    finally:
        _LOSS_ONLY.reset(token)


def _convert_loss_to_fp32(out):
    """The loss of `out` in fp32, the rest as it is: where transformers' Trainer takes the loss
    (a dict's "loss", else the first element) and where accelerate_c's does (the "loss" key or
    field, else the first element)."""
    if isinstance(out, Mapping) and "loss" in out:
        return type(out)({k: convert_to_fp32(v) if k == "loss" else v for k, v in out.items()})
    if isinstance(out, (tuple, list)) and len(out) > 0:
        named = _is_namedtuple(out)
        at = out._fields.index("loss") if named and "loss" in out._fields else 0
        items = [convert_to_fp32(v) if i in (0, at) else v for i, v in enumerate(out)]
        return type(out)(*items) if named else type(out)(items)
    return convert_to_fp32(out)


def _hooks_see_outputs(module) -> bool:
    """Whether forward hooks would read the module's outputs (its own, or global ones)."""
    if module is None:
        return True  # unknown: as accelerate
    glob = torch.nn.modules.module
    return bool(module._forward_hooks or module._forward_hooks_with_kwargs
                or getattr(glob, "_global_forward_hooks", None))


class ConvertOutputsToFp32:
    """Wraps a forward so its fp16/bf16 outputs come back in fp32; inside fp32_loss_only(), only
    the loss (convert_outputs_to_fp32 puts a plain function around it, as accelerate does).
    `module`: the model whose forward this is (weakly held), for the forward-hook check."""

    def __init__(self, model_forward, module=None):
        self.model_forward = model_forward
        self._module = weakref.ref(module) if module is not None else None
        update_wrapper(self, model_forward)

    def __call__(self, *args, **kwargs):
        if not _LOSS_ONLY.get() or _hooks_see_outputs(self._module() if self._module is not None else None):
            return convert_to_fp32(self.model_forward(*args, **kwargs))
        token = _LOSS_ONLY.set(False)  # the models this forward calls convert all their outputs
        try:
            out = self.model_forward(*args, **kwargs)
        finally:
            _LOSS_ONLY.reset(token)
        return _convert_loss_to_fp32(out)

    def __getstate__(self):
        raise RuntimeError("Cannot pickle a prepared model with automatic mixed precision; unwrap_model() it first")


def convert_outputs_to_fp32(model_forward, module=None):
    """A plain function around ConvertOutputsToFp32 (reachable as its `__wrapped__`), as
    accelerate returns: torch.compile of the prepared model asks for the source file of the
    forward's function (inspect.getfile), which a callable instance has not."""
    converter = ConvertOutputsToFp32(model_forward, module)

    def forward(*args, **kwargs):
        return converter(*args, **kwargs)

    forward.__wrapped__ = converter
    return forward


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


# ---- collectives over torch.distributed (identity on one process) ---------------------------
class DistributedOperationException(Exception):
    """A collective cannot run because the processes passed incompatible tensors (shapes).
    accelerate raises it only in debug mode; accelerate_c checks shapes always."""


class DistributedShapeError(DistributedOperationException, ValueError):
    """Tensors differ in shape across processes (also a ValueError, as accelerate_c raised before)."""


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


def _all_shapes(dist, t, what: str) -> list:
    """Every rank's shape of `t` (one small all_gather)."""
    dims = torch.full((9,), -1, dtype=torch.int64)
    if t.dim() > 8:
        raise ValueError(f"{what}: tensors of more than 8 dimensions are not supported")
    dims[0] = t.dim()
    dims[1:1 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    dims = dims.to(t.device)
    allv = [torch.empty_like(dims) for _ in range(dist.get_world_size())]
    collectives.all_gather(allv, dims)
    return [tuple(v[1:1 + int(v[0])].tolist()) for v in allv]


def _check_same_shape(dist, t, what: str):
    """All ranks must pass the same shape: compare them first (one small all_gather), so a
    mismatch is a clear error naming the shapes instead of a hang or garbage."""
    shapes = _all_shapes(dist, t, what)
    if len(set(shapes)) > 1:
        raise DistributedShapeError(f"{what}: tensors differ in shape across processes: "
                                    + ", ".join(f"rank {r}: {s}" for r, s in enumerate(shapes))
                                    + " (use pad_across_processes first)")


def gather(tensor):
    """Concatenates each tensor of a nested structure from all processes along dim 0."""
    dist = _dist()
    if dist is None:
        return tensor

    def one(t):
        t = t.reshape(1) if t.dim() == 0 else t
        t = t.contiguous()
        _check_same_shape(dist, t, "gather")
        out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        collectives.all_gather(out, t)
        return torch.cat(out, dim=0)

    return recursively_apply(one, tensor, error_on_other_type=True)


def gather_object(obj):
    """A list of every process's `obj` (lists are concatenated, as accelerate does)."""
    dist = _dist()
    if dist is None:
        return obj if isinstance(obj, list) else [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    if all(isinstance(o, list) for o in out):
        return [x for o in out for x in o]
    return out


_REDUCTIONS = ("sum", "mean", "max", "none")


def reduce(tensor, reduction: str = "sum"):
    """Sum, mean or max of each tensor across processes (a copy on one process)."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {list(_REDUCTIONS)}, got {reduction!r}")
    dist = _dist()

    def one(t):
        if dist is None or reduction == "none":
            return t.clone()
        _check_same_shape(dist, t, "reduce")
        out = torch.empty_like(t, memory_format=torch.contiguous_format) if t.is_contiguous() else t.clone()
        # the result lands in `out` in one pass (shared memory reads t and writes out), not a
        # clone of t reduced in place
        collectives.all_reduce_into(t if t.is_contiguous() else out, out,
                                    op=dist.ReduceOp.MAX if reduction == "max" else dist.ReduceOp.SUM)
        if reduction == "mean":
            out = out / dist.get_world_size()  # integer sums become floating means
        return out

    return recursively_apply(one, tensor, error_on_other_type=True)


def broadcast(tensor, from_process: int = 0):
    """Every process gets `from_process`'s values (in place, and returned)."""
    dist = _dist()
    if dist is None:
        return tensor

    def one(t):
        _check_same_shape(dist, t, "broadcast")
        collectives.broadcast(t, src=from_process)
        return t

    return recursively_apply(one, tensor, error_on_other_type=True)


def copy_tensor_to_devices(tensor=None):
    """The tensor that exactly one process holds (the others pass None), on every process:
    unlike broadcast(), the receivers need not know its shape or dtype."""
    dist = _dist()
    if dist is None:
        if tensor is None:
            raise ValueError("copy_tensor_to_devices: no process passed a tensor")
        return tensor
    from ..state import PartialState

    meta = [None if tensor is None else (tuple(tensor.shape), tensor.dtype)]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, meta[0])
    holders = [r for r, m in enumerate(everyone) if m is not None]
    if len(holders) != 1:
        raise ValueError(f"copy_tensor_to_devices: exactly one process must pass a tensor, got ranks {holders}")
    shape, dtype = everyone[holders[0]]
    if tensor is None:
        tensor = torch.empty(shape, dtype=dtype, device=PartialState().device)
    else:
        tensor = tensor.contiguous()
    collectives.broadcast(tensor, src=holders[0])
    return tensor


def broadcast_object_list(object_list: list, from_process: int = 0) -> list:
    dist = _dist()
    if dist is not None:
        dist.broadcast_object_list(object_list, src=from_process)
    return object_list


def pad_across_processes(tensor, dim: int = 0, pad_index=0, pad_first: bool = False):
    """Pads each tensor along `dim` to the largest size any process has."""
    dist = _dist()

    def one(t):
        if dist is None or t.dim() == 0:
            return t
        d = dim if dim >= 0 else t.dim() + dim
        if not 0 <= d < t.dim():
            raise ValueError(f"pad_across_processes: dim {dim} out of range for a {t.dim()}-d tensor")
        shapes = _all_shapes(dist, t, "pad_across_processes")
        if len({len(s) for s in shapes}) > 1:
            raise DistributedShapeError("pad_across_processes: tensors differ in number of dimensions across "
                                        "processes: " + ", ".join(f"rank {r}: {s}" for r, s in enumerate(shapes)))
        return pad_tensor(t, max(s[d] for s in shapes), d, pad_index, pad_first)

    return recursively_apply(one, tensor, error_on_other_type=True)

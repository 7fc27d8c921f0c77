"""A batch built on the main process, sent to every process, and each process's slice of it
(DataLoaderDispatcher, data_loader.py; docs/data-loading.md).

Sending: the batch's structure (nested dicts, lists and tuples, each tensor replaced by its
shape, dtype and place in one byte buffer, every other leaf as it is) is pickled on the main
process; then the structure's bytes and one buffer holding every tensor's bytes go out as
broadcasts of the default group through `collectives.broadcast`, so on one host the CPU data
moves once through shared memory. A structure equal to the previous batch's (the usual case:
same keys, shapes and dtypes) is not sent again. The pickle travels between the ranks of one
job, which run the same program (torch.distributed.broadcast_object_list pickles as well).

Combining and slicing: a global batch is the concatenation of the main process's loader
batches along dim 0. A leaf that is a list or tuple of plain values (str, bytes, numbers,
None) as long as its batch is a column of rows (what default_collate makes of a string
field) and is concatenated and sliced with the tensors; any other non-tensor leaf must be the
same in every batch combined and is handed to every process as it is. accelerate 1.15 raises
TypeError for non-tensor leaves on several processes; a rank here gets the rows a sharded
loader would have given it.
"""
from __future__ import annotations

import pickle
from collections.abc import Mapping

import torch

from . import collectives

_ALIGN = 16  # every tensor starts at a multiple of this in the byte buffer: any dtype can view it
_PLAIN = (str, bytes, int, float, bool, type(None))


def _is_namedtuple(obj) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _rebuild(like, items):
    if _is_namedtuple(like):
        return type(like)(*items)
    return type(like)(items)


def _is_rows(obj, n) -> bool:
    return isinstance(obj, (list, tuple)) and not _is_namedtuple(obj) and len(obj) == n and n > 0 and \
        all(isinstance(v, _PLAIN) for v in obj)


def batch_size_of(batch) -> int | None:
    """The size along dim 0 of the first tensor found (depth first, dict order), else None."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() > 0 else None
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for v in items:
        n = batch_size_of(v)
        if n is not None:
            return n
    return None


def _where(path) -> str:
    return "batch" + "".join(f"[{p!r}]" for p in path)


def concatenate(batches: list, path=(), sizes=None):
    """The batches (same structure) as one, along dim 0 (module docstring for other leaves)."""
    if sizes is None:
        sizes = [batch_size_of(b) for b in batches]
    first = batches[0]
    if len(batches) == 1:
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(batches, dim=0)
    if all(s is not None and _is_rows(b, s) for b, s in zip(batches, sizes)):
        return type(first)(v for b in batches for v in b)
    if isinstance(first, Mapping):
        if any(not isinstance(b, Mapping) or list(b.keys()) != list(first.keys()) for b in batches):
            raise TypeError(f"dispatch_batches: {_where(path)} has different keys in the batches combined into one "
                            f"global batch: {[list(b.keys()) for b in batches]}")
        return type(first)({k: concatenate([b[k] for b in batches], path + (k,), sizes) for k in first})
    if isinstance(first, (list, tuple)):
        if any(type(b) is not type(first) or len(b) != len(first) for b in batches):
            raise TypeError(f"dispatch_batches: {_where(path)} differs in type or length between the batches "
                            "combined into one global batch")
        return _rebuild(first, [concatenate([b[i] for b in batches], path + (i,), sizes) for i in range(len(first))])
    if any(not _same(b, first) for b in batches[1:]):
        raise TypeError(f"dispatch_batches: {_where(path)} is a {type(first).__name__} that differs between the "
                        "batches combined into one global batch, and is not a list of one value per sample; "
                        "pass split_batches=True (one loader batch per step) or dispatch_batches=False")
    return first


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects whose == is not a truth value (arrays): compare identity
        return a is b


def slice_batch(batch, tensor_slice, process_index=None, num_processes=None, _n=None):
    """Each tensor's rows `tensor_slice`, and the same rows of every list of rows (module docstring);
    other leaves as they are. The default slice_fn_for_dispatch (accelerate's signature)."""
    if _n is None:
        _n = batch_size_of(batch)
    if isinstance(batch, torch.Tensor):
        return batch[tensor_slice] if batch.dim() > 0 else batch
    if _n is not None and _is_rows(batch, _n):
        return type(batch)(batch[tensor_slice])
    if isinstance(batch, Mapping):
        return type(batch)({k: slice_batch(v, tensor_slice, _n=_n) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        return _rebuild(batch, [slice_batch(v, tensor_slice, _n=_n) for v in batch])
    return batch


# ---- sending --------------------------------------------------------------------------------------
class _Slot:
    """A tensor's place in the byte buffer, in the pickled structure."""
    __slots__ = ("offset", "shape", "dtype")

    def __init__(self, offset, shape, dtype):
        self.offset, self.shape, self.dtype = offset, shape, dtype

    def __getstate__(self):
        return (self.offset, self.shape, self.dtype)

    def __setstate__(self, st):
        self.offset, self.shape, self.dtype = st


def _skeleton(batch, tensors: list, offset: list):
    if isinstance(batch, torch.Tensor):
        if batch.layout != torch.strided:
            raise TypeError(f"dispatch_batches: a {batch.layout} tensor cannot be dispatched; only dense tensors")
        t = batch.detach()
        tensors.append((offset[0], t))
        slot = _Slot(offset[0], tuple(t.shape), t.dtype)
        offset[0] += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        return slot
    if isinstance(batch, Mapping):
        return type(batch)({k: _skeleton(v, tensors, offset) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        return _rebuild(batch, [_skeleton(v, tensors, offset) for v in batch])
    return batch


def _fill(skeleton, buf: torch.Tensor):
    if isinstance(skeleton, _Slot):
        n = torch.Size(skeleton.shape).numel() * torch.empty((), dtype=skeleton.dtype).element_size()
        return buf[skeleton.offset:skeleton.offset + n].view(skeleton.dtype).view(skeleton.shape)
    if isinstance(skeleton, Mapping):
        return type(skeleton)({k: _fill(v, buf) for k, v in skeleton.items()})
    if isinstance(skeleton, (list, tuple)):
        return _rebuild(skeleton, [_fill(v, buf) for v in skeleton])
    return skeleton


def _words(nbytes: int) -> int:
    return -(-nbytes // 8)


class BatchChannel:
    """Sends batches from process `src` to every process of the default group, one call per batch
    on every process (send on `src`, receive elsewhere), in the same order everywhere."""

    def __init__(self, src: int = 0, device=None):
        import torch.distributed as dist

        self.src = src
        # the carrier tensors live where the default group's collectives take them: the GPU under
        # NCCL, the CPU otherwise (gloo, or shared memory)
        nccl = dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"
        self.carrier = torch.device(device) if nccl and device is not None else torch.device("cpu")
        self._last = None  # the previous structure's bytes (every process keeps its copy)
        self._last_skeleton = None

    def _header(self, values=None):
        h = torch.zeros(4, dtype=torch.int64, device=self.carrier)
        if values is not None:
            h.copy_(torch.tensor(values, dtype=torch.int64))
        collectives.broadcast(h, self.src)
        return [int(v) for v in h.tolist()]

    def send(self, batch, tag: int = 0):
        """On `src`: sends `batch` (None: the end of the data) and a small integer with it."""
        if batch is None:
            self._header([0, 0, 0, tag])
            return
        tensors, offset = [], [0]
        skeleton = _skeleton(batch, tensors, offset)
        raw = pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)
        same = raw == self._last
        self._header([1 if same else 2, 0 if same else len(raw), offset[0], tag])
        if not same:
            words = torch.zeros(_words(len(raw)), dtype=torch.int64)
            words.view(torch.uint8)[:len(raw)].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            collectives.broadcast(words.to(self.carrier), self.src)
            self._last = raw
        if offset[0]:
            data = torch.empty(_words(offset[0]), dtype=torch.int64, device=self.carrier)
            flat = data.view(torch.uint8)
            for off, t in tensors:
                n = t.numel() * t.element_size()
                if n:
                    flat[off:off + n].copy_(t.contiguous().reshape(-1).view(torch.uint8), non_blocking=True)
            collectives.broadcast(data, self.src)

    def recv(self):
        """Elsewhere: (the batch `src` sent, its integer): tensors on the carrier device, views of
        one buffer; None at the end of the data."""
        kind, nraw, nbytes, tag = self._header()
        if kind == 0:
            return None, tag
        if kind == 2:
            words = torch.empty(_words(nraw), dtype=torch.int64, device=self.carrier)
            collectives.broadcast(words, self.src)
            self._last = words.cpu().view(torch.uint8)[:nraw].numpy().tobytes()
            self._last_skeleton = pickle.loads(self._last)  # noqa: S301 - the same job's main process
        elif self._last_skeleton is None:
            raise RuntimeError("dispatch_batches: the main process reused a batch structure this process never "
                               "received (the processes' data loaders are out of step)")
        buf = torch.empty(_words(nbytes), dtype=torch.int64, device=self.carrier)
        if nbytes:
            collectives.broadcast(buf, self.src)
        return _fill(self._last_skeleton, buf.view(torch.uint8)), tag

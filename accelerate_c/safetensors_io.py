"""safetensors files through the C engine: atomic, fsynced, multithreaded writes and strictly
validated reads straight into tensor memory.

Files are byte-compatible with the ``safetensors`` package both ways. Errors about the file
(a corrupt header, an I/O failure) raise ``accelerate_c.CoreError`` whose ``code`` is
``"AC_ERR_FORMAT"`` or ``"AC_ERR_IO"`` and whose message names the file and the tensor.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch

from . import _C
from .durable import fsync_dir, write_durable  # noqa: F401 - re-exported (the public names predate durable.py)

__all__ = ["TensorInfo", "save_file", "record_ready", "wait_ready", "after_ready", "load_file", "load_into", "list_tensors", "read_metadata",
           "write_durable", "fsync_dir", "DTYPES"]

# safetensors dtype names <-> torch dtypes (every byte-sized type the format and torch share)
DTYPES: Dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "C64": torch.complex64,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
                     ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
                     ("F8_E8M0", "float8_e8m0fnu")):
    if hasattr(torch, _attr):  # newer torch only
        DTYPES[_name] = getattr(torch, _attr)


class TensorInfo(NamedTuple):
    """One header entry: dtype name ("F32"), shape, and data_offsets relative to the data region."""
    dtype: str
    shape: Tuple[int, ...]
    data_offsets: Tuple[int, int]


def _cuda_staging() -> bool:
    """Whether the C writer takes CUDA tensors itself (staged through pinned buffers): only a
    CUDA build of the extension can, and only for NVIDIA CUDA (not a ROCm torch)."""
    return bool(_C.has_cuda) and torch.version.hip is None


def _contiguous(name: str, t, cuda_ok: bool) -> torch.Tensor:
    """Detached, contiguous, with no lazy conj/neg bit: on the CPU, or on its CUDA device when
    the C writer stages CUDA tensors itself (`cuda_ok`); other devices are copied to the CPU."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensor {name!r}: expected a torch.Tensor, got {type(t).__name__}")
    t = t.detach()
    if t.device.type != "cpu" and not (cuda_ok and t.device.type == "cuda"):
        t = t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()  # on the GPU for a CUDA tensor: one device copy, not a strided D2H
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def _cuda_devices(obj, out: set) -> set:
    """The CUDA device indices of the tensors in a nested structure (dicts, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cuda":
            out.add(obj.device.index if obj.device.index is not None else torch.cuda.current_device())
    elif isinstance(obj, dict):
        for v in obj.values():
            _cuda_devices(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _cuda_devices(v, out)
    return out


def record_ready(*objs) -> Dict[int, "torch.cuda.Event"]:
    """``{device index: torch.cuda.Event}``: an event recorded now on *this thread's* current
    stream of each CUDA device that holds a tensor of ``objs`` (tensors, or dicts / lists /
    tuples of them). torch's current stream is per thread: a save handed to another thread
    passes these (``save_file(..., ready=...)``) so its copies wait for the work queued on the
    stream that produced the tensors, not for the idle current stream of the writing thread."""
    ready = {}
    for d in sorted(_cuda_devices(objs, set())):
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(d))
        ready[d] = ev
    return ready


def wait_ready(ready: Optional[Dict[int, "torch.cuda.Event"]]) -> None:
    """Makes this thread's current stream of each device wait (on the GPU; the host does not
    block) for the event ``record_ready`` took there, so what this thread queues next (copies
    to the CPU, ``torch.save``) comes after the producer's work."""
    for d, ev in (ready or {}).items():
        torch.cuda.current_stream(d).wait_event(ev)


def after_ready(ready: Optional[Dict[int, "torch.cuda.Event"]], write: Callable):
    """`write`, to run on a writer thread: first that thread's current streams wait for `ready`
    (record_ready on the producing thread; torch's current stream is per thread, so the
    writer's own would not order its device->host copies after kernels the training thread
    queued on a side stream)."""
    def run():
        wait_ready(ready)
        return write()
    return run


def _export_cuda(t: torch.Tensor):
    """A DLPack capsule of a CUDA tensor. torch exports one only while its device is the current
    one, so a save holding tensors of several GPUs exports each under its own device."""
    with torch.cuda.device(t.device):
        try:
            # no stream argument: the C writer's copies wait for save_file's ready events
            return t.__dlpack__(max_version=(1, 0))
        except TypeError:  # an older torch without max_version
            return t.__dlpack__()


def save_file(tensors: Dict[str, torch.Tensor], filename, metadata: Optional[Dict[str, str]] = None,
              *, threads: int = 0) -> None:
    """Writes ``tensors`` to ``filename`` (like ``safetensors.torch.save_file``).

    CPU tensors are written from their own memory. CUDA tensors, when the extension was built
    with CUDA, are taken as they are (non-contiguous ones are made contiguous on the GPU first)
    and copied by the C writer through pinned staging buffers, chunk by chunk; without a CUDA
    build, and for other devices, tensors are copied to the CPU first. The file appears under
    its name only once complete and fsynced (a temporary file is renamed into place); on failure
    nothing is left behind and an existing file is untouched. ``metadata`` (str -> str) becomes
    the header's ``__metadata__``. Tensors sharing memory are each written in full
    (``save_model`` drops tied aliases).

    CUDA tensors are copied once the work queued so far on the calling thread's current stream
    of their device is done, as ``t.to("cpu")`` would wait for it (the host does not block on
    it). A caller that hands the save to another thread runs it there through
    ``after_ready(record_ready(...), ...)``, the events taken on the thread that produced the
    tensors."""
    if not isinstance(tensors, dict):
        raise TypeError(f"tensors must be a dict of name -> tensor, got {type(tensors).__name__}")
    names = list(tensors)
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"tensor names must be str, got {type(n).__name__}: {n!r}")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise TypeError(f"metadata must be a dict of str -> str, got {type(metadata).__name__}")
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"metadata must map str to str; got {k!r}: {v!r}")
    cuda_ok = _cuda_staging()
    values = [_contiguous(n, tensors[n], cuda_ok) for n in names]
    events = None
    if any(t.device.type == "cuda" for t in values):
        # The C writer copies CUDA tensors with cudaMemcpyAsync on streams of its own, from
        # threads of its own: each of those streams waits for an event recorded here, after the
        # work queued so far on this thread's current stream of the device (which writes the
        # tensors, or waited for `ready`, and made the .contiguous() copies). The tensors stay
        # referenced (values, capsules) until st_save has synchronised its streams, so the
        # caching allocator cannot hand their memory out meanwhile.
        evs = record_ready(values)
        events = {d: ev.cuda_event for d, ev in evs.items()}
        values = [_export_cuda(t) if t.device.type == "cuda" else t for t in values]
    _C.st_save(os.fspath(filename), names, values, metadata, int(threads), events)


def _header(filename) -> dict:
    return _C.st_header(os.fspath(filename))


def list_tensors(filename) -> Dict[str, TensorInfo]:
    """Reads and validates only the header: ``{name: TensorInfo(dtype, shape, data_offsets)}``
    in file (offset) order."""
    return {n: TensorInfo(dt, tuple(shape), (b, e)) for n, dt, shape, b, e in _header(filename)["tensors"]}


def read_metadata(filename) -> Optional[Dict[str, str]]:
    """The header's ``__metadata__`` dict, or None when the file has none."""
    return _header(filename)["metadata"]


def torch_dtype_of(filename, name: str, dt: str) -> torch.dtype:
    try:
        return DTYPES[dt]
    except KeyError:
        raise TypeError(f"{os.fspath(filename)}: tensor {name!r} has dtype {dt}, which this torch "
                        f"({torch.__version__}) has no dtype for") from None


def load_file(filename, device="cpu", *, threads: int = 0) -> Dict[str, torch.Tensor]:
    """Loads every tensor (like ``safetensors.torch.load_file``): allocates CPU tensors, reads the
    file straight into them, then moves them to ``device`` if it is not the CPU."""
    out = {}
    for name, dt, shape, _b, _e in _header(filename)["tensors"]:
        out[name] = torch.empty(tuple(shape), dtype=torch_dtype_of(filename, name, dt))
    _C.st_load_into(os.fspath(filename), out, int(threads))
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type != "cpu":
        out = {k: v.to(dev) for k, v in out.items()}
    return out


def _writable_direct(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return (t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous()
            and not t.is_conj() and not t.is_neg())


def load_into(filename, tensors: Dict[str, torch.Tensor], *, threads: int = 0) -> None:
    """Reads the named tensors of the file into the given tensors, in place.

    Each target must have the file's shape. Contiguous CPU targets of the file's dtype are
    read into directly (no extra copy); others (GPU, non-contiguous, another dtype) go through a
    CPU buffer and ``copy_`` (which casts). Raises KeyError naming the tensors the file lacks."""
    infos = list_tensors(filename)
    missing = [n for n in tensors if n not in infos]
    if missing:
        raise KeyError(f"{os.fspath(filename)}: no tensor named {', '.join(map(repr, missing))} in the file")
    direct, staged = {}, {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor {name!r}: expected a torch.Tensor, got {type(t).__name__}")
        info = infos[name]
        if tuple(t.shape) != info.shape:
            raise ValueError(f"{os.fspath(filename)}: tensor {name!r} has shape {list(info.shape)} in the file "
                             f"but {list(t.shape)} in the destination")
        dtype = torch_dtype_of(filename, name, info.dtype)
        if _writable_direct(t, dtype):
            direct[name] = t.detach()
        else:
            staged[name] = (t, torch.empty(info.shape, dtype=dtype))
    targets = dict(direct)
    targets.update({n: buf for n, (_t, buf) in staged.items()})
    _C.st_load_into(os.fspath(filename), targets, int(threads))
    if staged:
        with torch.no_grad():
            for _n, (t, buf) in staged.items():
                t.copy_(buf)

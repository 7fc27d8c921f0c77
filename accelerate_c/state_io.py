"""Training state without pickle: any state dict as a JSON file plus a safetensors file.

A state dict (an optimizer's, a scheduler's, RNG states, a registered object's) is split in
two: its tensors go to ``<name>.safetensors`` under names that follow their place in the dict
(``state.0.exp_avg``, ``param_groups.0.lr``), everything else to ``<name>.json``, where each
tensor is a ``{"__tensor__": "<name in the safetensors file>"}`` reference. Values JSON lacks
are tagged with one-key objects: ``__tuple__``, ``__dict__`` (a dict with non-string keys, as
``[[key, value], ...]``), ``__float__`` ("inf", "-inf", "nan"), ``__ndarray__`` (a numpy array,
stored as a tensor), ``__np__`` (a numpy scalar: [dtype, value]), ``__dtype__`` (a torch dtype).
Anything else (functions, arbitrary objects) is refused with an error naming where it sits:
it cannot be saved without pickle.

Also here: capture/restore of the RNG states, and reading ``torch.save`` files written by
accelerate with ``torch.load(weights_only=True)``, full unpickling only when allowed.
"""
from __future__ import annotations

import json
import math
import os
import pickle
import random
from typing import Any, Dict, List, Optional, Tuple

import torch

from .durable import write_bytes_durable
from .safetensors_io import torch_dtype_of, list_tensors, load_into, save_file

try:  # numpy is optional
    import numpy as np
except ImportError:  # pragma: no cover - numpy is installed with torch here
    np = None

__all__ = ["CheckpointError", "PickleRequiredError", "encode", "decode", "write_state", "StateFile",
           "rng_state", "check_rng_state", "set_rng_state", "torch_load", "write_json_durable"]

STATE_FORMAT = "accelerate_c.state"
STATE_VERSION = 1
MAX_JSON_BYTES = 256 << 20  # a state's JSON holds no tensor data: far below this
_TAGS = ("__tensor__", "__tuple__", "__dict__", "__float__", "__ndarray__", "__np__", "__dtype__")


class CheckpointError(ValueError):
    """A checkpoint file or directory that cannot be loaded: the message names the file and the fault."""


class PickleRequiredError(CheckpointError):
    """A pickle file that only full unpickling can read (it may run arbitrary code)."""


# ---- files -----------------------------------------------------------------------------------
def write_json_durable(path: str, obj) -> None:
    """Writes ``path`` atomically and durably (accelerate_c.durable)."""
    write_bytes_durable(path, (json.dumps(obj, indent=1, allow_nan=False) + "\n").encode())


def read_json(path: str, what: str = "") -> Any:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: missing from the checkpoint{f' ({what})' if what else ''}")
    size = os.path.getsize(path)
    if size > MAX_JSON_BYTES:
        raise CheckpointError(f"{path}: {size} bytes, more than the {MAX_JSON_BYTES} a state JSON may have "
                              "(tensors belong in the .safetensors file)")
    try:
        with open(path, "rb") as f:
            raw = f.read()
        return json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}); the file is corrupt or truncated") from None
    except RecursionError:
        raise CheckpointError(f"{path}: JSON nested too deeply") from None


def _refuse_constant(name):
    raise ValueError(f"non-standard JSON constant {name}")


# ---- encoding ----------------------------------------------------------------------------------
def _path_str(path) -> str:
    return "".join(f"[{p!r}]" for p in path)


class _Encoder:
    def __init__(self, what: str):
        self.what = what
        self.tensors: Dict[str, torch.Tensor] = {}

    def _name(self, path) -> str:
        base = ".".join(str(p) for p in path) or "value"
        name, n = base, 1
        while name in self.tensors:
            n += 1
            name = f"{base}~{n}"
        return name

    def refuse(self, obj, path, why=""):
        raise TypeError(f"{self.what}{_path_str(path)} is a {type(obj).__module__}.{type(obj).__qualname__}, "
                        f"which cannot be saved without pickle{why}. Make the state dict hold only tensors, "
                        "numbers, strings, lists, tuples and dicts, or save with safe_serialization=False")

    def enc(self, obj, path):
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            if math.isfinite(obj):
                return float(obj)
            return {"__float__": "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")}
        if isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided or obj.is_quantized:
                self.refuse(obj, path, " (only dense tensors can be)")
            name = self._name(path)
            self.tensors[name] = obj
            return {"__tensor__": name}
        if isinstance(obj, torch.dtype):
            return {"__dtype__": str(obj).split(".", 1)[1]}
        if np is not None and isinstance(obj, np.ndarray):
            try:
                t = torch.from_numpy(np.ascontiguousarray(obj))
            except TypeError:
                self.refuse(obj, path, f" (numpy dtype {obj.dtype} has no torch equivalent)")
            name = self._name(path)
            self.tensors[name] = t
            return {"__ndarray__": name}
        if np is not None and isinstance(obj, np.generic):
            return {"__np__": [obj.dtype.str, self.enc(obj.item(), path)]}
        if isinstance(obj, tuple):
            if hasattr(obj, "_fields"):
                self.refuse(obj, path, " (a namedtuple would come back as a plain tuple)")
            return {"__tuple__": [self.enc(v, path + [i]) for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [self.enc(v, path + [i]) for i, v in enumerate(obj)]
        if isinstance(obj, dict):
            if all(isinstance(k, str) for k in obj) and not (len(obj) == 1 and next(iter(obj)) in _TAGS):
                return {k: self.enc(v, path + [k]) for k, v in obj.items()}
            items = []
            for k, v in obj.items():
                if not (k is None or isinstance(k, (bool, int, float, str, tuple))):
                    self.refuse(k, path, " (as a dict key)")
                items.append([self.enc(k, path), self.enc(v, path + [k])])
            return {"__dict__": items}
        self.refuse(obj, path)


def encode(obj, what: str = "state") -> Tuple[Any, Dict[str, torch.Tensor]]:
    """(JSON-able value, {tensor name: tensor}) for a state dict; TypeError naming the path of
    anything that needs pickle."""
    e = _Encoder(what)
    return e.enc(obj, []), e.tensors


def decode(value, tensors: Dict[str, torch.Tensor], where: str = "state"):
    """The inverse of encode(); CheckpointError naming ``where`` for a malformed value."""
    used = set()

    def bad(msg):
        raise CheckpointError(f"{where}: {msg}")

    def dec(v):
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, list):
            return [dec(x) for x in v]
        if not isinstance(v, dict):
            bad(f"unexpected JSON value {v!r}")
        if len(v) == 1 and next(iter(v)) in _TAGS:
            tag, arg = next(iter(v.items()))
            if tag in ("__tensor__", "__ndarray__"):
                if not isinstance(arg, str) or arg not in tensors:
                    bad(f"refers to tensor {arg!r}, which the tensor file does not hold")
                used.add(arg)
                t = tensors[arg]
                # no data yet (a skeleton: None; a dry run: a meta tensor): the reference is all
                # that can be checked
                if tag == "__tensor__" or t is None or t.device.type == "meta":
                    return t
                try:
                    return t.numpy()
                except (TypeError, RuntimeError) as e:  # e.g. a bfloat16 tensor: numpy has no such dtype
                    bad(f"tensor {arg!r} cannot be a numpy array ({e})")
            if tag == "__tuple__":
                if not isinstance(arg, list):
                    bad("__tuple__ needs a list")
                return tuple(dec(x) for x in arg)
            if tag == "__dict__":
                if not isinstance(arg, list) or not all(isinstance(p, list) and len(p) == 2 for p in arg):
                    bad("__dict__ needs a list of [key, value] pairs")
                out = {}
                for k, x in arg:
                    k = dec(k)
                    try:
                        out[k] = dec(x)
                    except TypeError:  # unhashable key
                        bad(f"dict key {k!r} is not hashable")
                return out
            if tag == "__float__":
                if arg not in ("inf", "-inf", "nan"):
                    bad(f"__float__ must be 'inf', '-inf' or 'nan', got {arg!r}")
                return float(arg)
            if tag == "__dtype__":
                dt = getattr(torch, arg, None) if isinstance(arg, str) else None
                if not isinstance(dt, torch.dtype):
                    bad(f"unknown torch dtype {arg!r}")
                return dt
            if tag == "__np__":
                if np is None:
                    bad("a numpy value, but numpy is not installed")
                if not (isinstance(arg, list) and len(arg) == 2 and isinstance(arg[0], str)):
                    bad("__np__ needs [dtype, value]")
                try:
                    return np.dtype(arg[0]).type(dec(arg[1]))
                except TypeError as e:
                    bad(f"bad numpy scalar {arg!r}: {e}")
        return {k: dec(x) for k, x in v.items()}

    out = dec(value)
    return out


# ---- one state = <name>.json (+ <name>.safetensors) ---------------------------------------------
def write_state(directory: str, name: str, obj, what: str, extra: Optional[dict] = None) -> List[str]:
    """Writes ``obj`` as ``<name>.json`` and, when it holds tensors, ``<name>.safetensors``
    (tensors first, so the JSON that refers to them never exists without them). Each file is
    atomic and fsynced. Returns the file names written."""
    value, tensors = encode(obj, what)
    files = []
    tensor_file = None
    if tensors:
        tensor_file = f"{name}.safetensors"
        save_file(tensors, os.path.join(directory, tensor_file), metadata={"format": STATE_FORMAT})
        files.append(tensor_file)
    doc = {"format": STATE_FORMAT, "version": STATE_VERSION, "kind": what, "tensors": tensor_file}
    if extra:
        doc.update(extra)
    doc["state"] = value
    write_json_durable(os.path.join(directory, f"{name}.json"), doc)
    files.append(f"{name}.json")
    return files


class StateFile:
    """A state written by write_state, opened and checked (the JSON parsed, the tensor file's
    header validated, every reference resolved) before any tensor data is read."""

    def __init__(self, directory: str, name: str, what: str = ""):
        self.json_path = os.path.join(directory, f"{name}.json")
        doc = read_json(self.json_path, what)
        if not isinstance(doc, dict) or doc.get("format") != STATE_FORMAT or "state" not in doc:
            raise CheckpointError(f"{self.json_path}: not an accelerate_c state file (format "
                                  f"{doc.get('format') if isinstance(doc, dict) else None!r})")
        if not isinstance(doc.get("version"), int) or doc["version"] > STATE_VERSION:
            raise CheckpointError(f"{self.json_path}: state format version {doc.get('version')!r} is newer than "
                                  f"this accelerate_c reads ({STATE_VERSION})")
        self.doc = doc
        self.tensor_path = None
        self.infos = {}
        tf = doc.get("tensors")
        if tf is not None:
            if not isinstance(tf, str) or os.path.basename(tf) != tf or tf in ("", ".", ".."):
                raise CheckpointError(f"{self.json_path}: 'tensors' must name a file in the same directory, got {tf!r}")
            self.tensor_path = os.path.join(directory, tf)
            if not os.path.isfile(self.tensor_path):
                raise FileNotFoundError(f"{self.tensor_path}: missing from the checkpoint ({self.json_path} "
                                        "refers to it)")
            self.infos = list_tensors(self.tensor_path)  # validates the header (CoreError naming the file)
        refs = []
        _collect_refs(doc["state"], refs)
        odd = [r for r in refs if not isinstance(r, str)]
        if odd:
            raise CheckpointError(f"{self.json_path}: a tensor reference must be a name, got {odd[0]!r}")
        absent = sorted(set(refs) - set(self.infos))
        if absent:
            where = self.tensor_path or "(no tensor file)"
            raise CheckpointError(f"{self.json_path}: refers to tensor(s) {', '.join(map(repr, absent[:5]))} "
                                  f"that {where} does not hold")
        for name, info in self.infos.items():
            torch_dtype_of(self.tensor_path, name, info.dtype)

    def skeleton(self):
        """The decoded state with None in place of every tensor (nothing read): for checks."""
        return decode(self.doc["state"], dict.fromkeys(self.infos), self.json_path)

    def load(self, reuse: Optional[Dict[str, torch.Tensor]] = None):
        """Reads the tensors and decodes the state. ``reuse`` maps tensor names to existing
        tensors (an optimizer's current state) that are filled in place when they are contiguous
        CPU tensors of the file's shape and dtype; the others are allocated."""
        tensors = {}
        if self.tensor_path is not None:
            for name, info in self.infos.items():
                dt = torch_dtype_of(self.tensor_path, name, info.dtype)
                t = reuse.get(name) if reuse else None
                if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype == dt and \
                        tuple(t.shape) == tuple(info.shape) and t.is_contiguous() and not t.requires_grad:
                    tensors[name] = t
                else:
                    tensors[name] = torch.empty(tuple(info.shape), dtype=dt)
            load_into(self.tensor_path, tensors)
        return decode(self.doc["state"], tensors, self.json_path)


def _collect_refs(v, out):
    if isinstance(v, list):
        for x in v:
            _collect_refs(x, out)
    elif isinstance(v, dict):
        if len(v) == 1 and next(iter(v)) in ("__tensor__", "__ndarray__"):
            out.append(next(iter(v.values())))
        else:
            for x in v.values():
                _collect_refs(x, out)


# ---- RNG states ----------------------------------------------------------------------------------
def rng_state(step: Optional[int] = None, cuda: bool = True) -> dict:
    """Every RNG a loop touches, under accelerate's key names: python, numpy, torch CPU, and CUDA
    unless ``cuda`` is False (the data loaders' epoch-start records: creating an iterator draws
    on the CPU only, and reading CUDA's states would initialise CUDA). ``step`` is stored too
    when given."""
    states = {} if step is None else {"step": int(step)}
    states.update(random_state=random.getstate(), torch_manual_seed=torch.get_rng_state())
    if np is not None:
        states["numpy_random_seed"] = np.random.get_state()
    if cuda and torch.cuda.is_available():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return states


def check_rng_state(states, where: str) -> None:
    """Raises CheckpointError unless ``states`` can be restored: tried on throwaway generators,
    so nothing global changes."""
    try:
        if not isinstance(states, dict):
            raise TypeError(f"expected a dict, got {type(states).__name__}")
        rs = states["random_state"]
        random.Random().setstate((rs[0], tuple(rs[1]), rs[2]))
        if np is not None and "numpy_random_seed" in states:
            np.random.RandomState().set_state(states["numpy_random_seed"])
        torch.Generator().set_state(states["torch_manual_seed"])
        cuda = states.get("torch_cuda_manual_seed")
        if cuda is not None and not (isinstance(cuda, (list, tuple)) and
                                     all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in cuda)):
            raise TypeError("torch_cuda_manual_seed must be a list of uint8 tensors")
    # OverflowError: a negative or too large word of the Mersenne state (random.setstate)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError, OverflowError) as e:
        raise CheckpointError(f"{where}: invalid random states ({type(e).__name__}: {e})") from None


def set_rng_state(states: dict, where: str) -> None:
    """Restores what rng_state() captured (or accelerate's random_states_*.pkl held)."""
    try:
        rs = states["random_state"]
        random.setstate((rs[0], tuple(rs[1]), rs[2]))
        if np is not None and "numpy_random_seed" in states:
            np.random.set_state(states["numpy_random_seed"])
        torch.set_rng_state(states["torch_manual_seed"])
        cuda = states.get("torch_cuda_manual_seed")
        if cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError, OverflowError) as e:
        raise CheckpointError(f"{where}: invalid random states ({type(e).__name__}: {e})") from None


# ---- accelerate's torch.save files -------------------------------------------------------------------
def _numpy_safe_globals() -> list:
    if np is None:
        return []
    import codecs

    core = getattr(np, "_core", None) or np.core
    out = [core.multiarray._reconstruct, np.ndarray, np.dtype, codecs.encode]
    for t in (np.uint32, np.int64, np.float64, np.uint8, np.int32, np.float32, np.bool_):
        out.append(type(np.dtype(t)))
    return out


def torch_load(path: str, what: str, allow_pickle: bool = False, map_location="cpu", **kwargs):
    """Reads a ``torch.save`` file with ``weights_only=True`` (tensors, numbers, containers,
    numpy arrays for RNG states). A file that needs full unpickling raises PickleRequiredError
    naming it, unless ``allow_pickle``."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: missing from the checkpoint ({what})")
    kwargs.pop("weights_only", None)
    try:
        with torch.serialization.safe_globals(_numpy_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        if not allow_pickle:
            first = str(e).strip().splitlines()
            reason = next((ln for ln in first if "Unsupported global" in ln or "GLOBAL" in ln), first[0] if first else "")
            raise PickleRequiredError(
                f"{path}: the {what} in this file can only be read by full unpickling, which can run arbitrary "
                f"code ({reason.strip()}). If you trust the file, pass allow_pickle=True to load_state") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read as a torch.save file ({type(e).__name__}: {e}); the file "
                              "is corrupt or truncated") from None
    try:
        return torch.load(path, map_location=map_location, weights_only=False, **kwargs)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"{path}: cannot be unpickled ({type(e).__name__}: {e})") from None

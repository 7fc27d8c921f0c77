"""Model weights as Hugging Face lays them out: ``model.safetensors``, or shards
``model-00001-of-0000N.safetensors`` plus ``model.safetensors.index.json``, written through the C
safetensors engine (see docs/checkpoints.md).

``save_model`` matches accelerate's ``Accelerator.save_model`` (same file names, index format
and ``max_shard_size`` rules) with a safer protocol: every shard is complete and fsynced under a
temporary name before any file of an earlier save is replaced, and the earlier save's stale
shards are removed only after the new one is in place.
"""
from __future__ import annotations

import functools
import json
import os
import re
from typing import Dict, List, NamedTuple, Optional, Union

from concurrent.futures import ThreadPoolExecutor

import torch

from .durable import fsync_dir, reserve_temp, write_bytes_durable, write_durable
from .safetensors_io import after_ready, list_tensors, load_into, record_ready, save_file

__all__ = ["save_model", "load_model_weights", "parse_size", "find_aliases", "plan_shards",
           "SAFE_WEIGHTS_NAME", "SAFE_WEIGHTS_INDEX_NAME", "WEIGHTS_NAME", "WEIGHTS_INDEX_NAME"]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"

_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgtKMGT][iI]?)?([bB]))?\s*$")


def parse_size(size: Union[int, str]) -> int:
    """Bytes in ``size``, read as accelerate/transformers do: an int is bytes; "10GB" = 10*10^9,
    "5GiB" = 5*2^30, "500MB", "100KB"; a lowercase "b" after a unit prefix means bits ("5Gb" =
    5*10^9/8 bytes). Raises ValueError for anything else or for a size <= 0."""
    if isinstance(size, bool):
        raise ValueError(f"max_shard_size must be an int or a string like '10GB', got {size!r}")
    if isinstance(size, int):
        value = size
    elif isinstance(size, str):
        m = _SIZE_RE.match(size)
        if not m:
            raise ValueError(f"max_shard_size {size!r} is not understood; use an int (bytes) or a string "
                             "like '10GB', '500MB' or '5GiB'")
        number, prefix, b = m.groups()
        mult = _UNITS[(prefix or "").upper()]
        value = float(number) * mult
        if b == "b" and prefix:  # "Gb": gigabits
            value /= 8
        value = int(value)
    else:
        raise ValueError(f"max_shard_size must be an int or a string like '10GB', got {type(size).__name__}")
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


def _identity(t: torch.Tensor):
    """Two tensors with the same identity are the same values in the same memory (a tied
    weight). Distinct views of one storage (slices of a flat buffer) have different identities
    and are saved separately: accelerate 1.15 keeps only the first name per *storage*, which
    loses the others' data for non-overlapping views."""
    if t.device.type == "meta" or t.numel() == 0:
        return None
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
        return None
    return (t.device, ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def find_aliases(state_dict: Dict[str, torch.Tensor]) -> Dict[str, str]:
    """``{alias: first_name}`` for every tensor that is the same memory as an earlier one."""
    first: Dict[object, str] = {}
    aliases: Dict[str, str] = {}
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            continue
        ident = _identity(t)
        if ident is None:
            continue
        if ident in first:
            aliases[name] = first[ident]
        else:
            first[ident] = name
    return aliases


def plan_shards(sizes: Dict[str, int], max_shard_size: int) -> List[List[str]]:
    """Splits names (in order) into shards of at most ``max_shard_size`` bytes; a tensor larger
    than the limit gets a shard of its own (as huggingface_hub does)."""
    shards: List[List[str]] = []
    cur: List[str] = []
    cur_size = 0
    for name, size in sizes.items():
        if size > max_shard_size:
            shards.append([name])
            continue
        if cur and cur_size + size > max_shard_size:
            shards.append(cur)
            cur, cur_size = [], 0
        cur.append(name)
        cur_size += size
    if cur or not shards:
        shards.append(cur)
    return shards


def _shard_writers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def _stale_pattern(safe: bool):
    if safe:
        return re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$|^model\.safetensors\.index\.json$")
    return re.compile(r"^pytorch_model(-\d{5}-of-\d{5})?\.bin$|^pytorch_model\.bin\.index\.json$")


def save_model(model_or_state_dict, save_directory, max_shard_size: Union[int, str] = "10GB",
               safe_serialization: bool = True) -> List[str]:
    """Saves a model's weights (or a state dict) to ``save_directory`` in the Hugging Face layout.

    One file (``model.safetensors``) when everything fits in ``max_shard_size``, else shards
    ``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json`` ({"metadata":
    {"total_size": bytes}, "weight_map": {name: shard}}). With ``safe_serialization=False`` the
    same with ``pytorch_model*.bin`` files written by ``torch.save``. Tied weights (the same
    memory under several names) are saved once under their first name. Every file is written
    under a temporary name, fsynced, and renamed into place only after all are complete; then
    files of an earlier save that the new one does not use are removed. Returns the file names
    written (shards, then the index if any)."""
    if isinstance(model_or_state_dict, torch.nn.Module):
        state_dict = model_or_state_dict.state_dict()
    elif isinstance(model_or_state_dict, dict):
        state_dict = model_or_state_dict
    else:
        raise TypeError(f"save_model expects an nn.Module or a state dict, got {type(model_or_state_dict).__name__}")
    save_directory = os.fspath(save_directory)
    if os.path.isfile(save_directory):
        raise ValueError(f"Provided path ({save_directory}) should be a directory, not a file")
    limit = parse_size(max_shard_size)
    os.makedirs(save_directory, exist_ok=True)

    aliases = find_aliases(state_dict)
    tensors: Dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if isinstance(t, str):  # as huggingface_hub does (bitsandbytes serialisation markers)
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state dict entry {name!r} is a {type(t).__name__}, not a tensor")
        if name in aliases:
            continue
        tensors[name] = t
    sizes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    shards = plan_shards(sizes, limit)

    if safe_serialization:
        single, index_name, fmt = SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, "model-{:05d}-of-{:05d}.safetensors"
    else:
        single, index_name, fmt = WEIGHTS_NAME, WEIGHTS_INDEX_NAME, "pytorch_model-{:05d}-of-{:05d}.bin"
    n = len(shards)
    files = [single] if n == 1 else [fmt.format(i + 1, n) for i in range(n)]

    # every shard complete under a name of its own (unique per process and call, like the
    # durable writes' own temporary names) before any file of an earlier save is replaced
    temps: List[str] = []

    # the shards written on other threads wait for the work queued so far on this thread's
    # current streams (torch's current stream is per thread); the serial path runs here
    ready = record_ready(tensors)

    def write_shard(i: int) -> None:
        part = {k: tensors[k] for k in shards[i]}
        if safe_serialization:
            save_file(part, temps[i], metadata={"format": "pt"})
        else:
            write_durable(temps[i], lambda f: torch.save({k: v.detach().cpu().contiguous() for k, v in part.items()}, f))

    try:
        for fname in files:
            temps.append(reserve_temp(os.path.join(save_directory, fname)))
        if n == 1 or not safe_serialization:
            for i in range(n):
                write_shard(i)
        else:
            # Shards go to different files, so their writes do run in parallel (writes to one
            # file are serialised by the kernel); the C engine releases the GIL while writing.
            with ThreadPoolExecutor(max_workers=min(n, _shard_writers())) as ex:
                for fut in [ex.submit(after_ready(ready, functools.partial(write_shard, i))) for i in range(n)]:
                    fut.result()
        index_data = None
        if n > 1:
            weight_map = {k: files[i] for i, names in enumerate(shards) for k in names}
            index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
            index_data = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
        # Everything is on disk: now the short window of renames.
        for tmp, fname in zip(temps, files):
            os.replace(tmp, os.path.join(save_directory, fname))
        temps = []
        if index_data is not None:
            write_bytes_durable(os.path.join(save_directory, index_name), index_data)
        fsync_dir(save_directory)
    finally:
        for tmp in temps:
            if os.path.exists(tmp):
                os.unlink(tmp)

    keep = set(files) | ({index_name} if n > 1 else set())
    pattern = _stale_pattern(safe_serialization)
    for entry in os.listdir(save_directory):
        if entry not in keep and pattern.match(entry) and os.path.isfile(os.path.join(save_directory, entry)):
            os.unlink(os.path.join(save_directory, entry))
    return files + ([index_name] if n > 1 else [])


class IncompatibleKeys(NamedTuple):
    missing_keys: List[str]
    unexpected_keys: List[str]


def _weight_files(directory: str):
    """[(file, [names] or None for all)], and whether they are safetensors."""
    for index_name, single, safe in ((SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, True),
                                     (WEIGHTS_INDEX_NAME, WEIGHTS_NAME, False)):
        index_path = os.path.join(directory, index_name)
        if os.path.isfile(index_path):
            with open(index_path, "rb") as f:
                raw = f.read()
            try:  # a corrupt index is a ValueError naming it, whatever the fault
                index = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{index_path}: not valid JSON: {e}") from None
            except RecursionError:
                raise ValueError(f"{index_path}: JSON nested too deeply") from None
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index_path}: no 'weight_map' object")
            by_file: Dict[str, List[str]] = {}
            for name, fname in weight_map.items():
                if not isinstance(fname, str) or os.path.basename(fname) != fname or fname in ("", ".", ".."):
                    raise ValueError(f"{index_path}: tensor {name!r} maps to {fname!r}, not a file in {directory}")
                by_file.setdefault(fname, []).append(name)
            for fname in by_file:
                if not os.path.isfile(os.path.join(directory, fname)):
                    raise FileNotFoundError(f"{index_path} lists {fname}, which is missing from {directory}")
            return [(os.path.join(directory, f), names) for f, names in by_file.items()], safe
        if os.path.isfile(os.path.join(directory, single)):
            return [(os.path.join(directory, single), None)], safe
    raise FileNotFoundError(f"no {SAFE_WEIGHTS_NAME}, {SAFE_WEIGHTS_INDEX_NAME}, {WEIGHTS_NAME} or "
                            f"{WEIGHTS_INDEX_NAME} in {directory}")


def check_keys(where: str, model, missing: List[str], unexpected: List[str], wrong: List[tuple],
               strict: bool, limit: int = 20) -> None:
    """Raises a RuntimeError as torch's load_state_dict reports a mismatch, naming `where` (the
    file): missing / unexpected keys (only when `strict`), then shapes that differ (always; a
    different dtype is no error, the copy casts). wrong: (name, shape in the file, in the model)."""
    if strict and (missing or unexpected):
        bits = ([f"missing keys: {', '.join(missing[:limit])}"] if missing else []) + \
               ([f"unexpected keys: {', '.join(unexpected[:limit])}"] if unexpected else [])
        raise RuntimeError(f"{where}: does not match {type(model).__name__}: " + "; ".join(bits))
    if wrong:
        raise RuntimeError(f"{where}: size mismatch for " + "; ".join(
            f"{n}: file {list(f)}, model {list(m)}" for n, f, m in wrong[:limit]))


def load_model_weights(model: torch.nn.Module, directory, strict: bool = True) -> IncompatibleKeys:
    """Loads weights saved by ``save_model`` (or transformers' ``save_pretrained``) into
    ``model`` in place: safetensors files are read straight into the parameters' memory.

    Reads ``model.safetensors.index.json`` if present, else ``model.safetensors`` (then the
    ``pytorch_model`` equivalents). A tied weight saved under one name satisfies all its names.
    With ``strict`` (default) a missing or unexpected key raises a RuntimeError naming them and
    nothing is loaded; otherwise the rest is loaded and the keys are returned."""
    directory = os.fspath(directory)
    files, safe = _weight_files(directory)
    state = model.state_dict()
    aliases = find_aliases(state)
    file_names: Dict[str, List[str]] = {}
    shapes: Dict[str, tuple] = {}
    loaded_sd = {}
    for path, names in files:
        if safe:
            infos = list_tensors(path)
            if names is not None:
                absent = sorted(set(names) - set(infos))
                if absent:
                    raise ValueError(f"{path}: the index lists {', '.join(absent[:10])} but the file lacks them")
            file_names[path] = list(infos)
            shapes.update({n: tuple(i.shape) for n, i in infos.items()})
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True)
            loaded_sd[path] = sd
            file_names[path] = list(sd)
            shapes.update({n: tuple(t.shape) for n, t in sd.items()})
    in_files = {n for names in file_names.values() for n in names}
    # a tied group is satisfied when any of its names is in the files
    groups: Dict[str, List[str]] = {}
    for k in state:
        groups.setdefault(aliases.get(k, k), []).append(k)
    missing = [k for k in state if not any(m in in_files for m in groups[aliases.get(k, k)])]
    unexpected = sorted(in_files - set(state))
    wrong = sorted((n, shapes[n], tuple(state[n].shape)) for n in in_files
                   if n in state and tuple(state[n].shape) != shapes[n])
    check_keys(f"Error(s) loading weights from {directory}", model, missing, unexpected, wrong, strict,
               limit=len(state) + len(in_files))
    with torch.no_grad():
        for path, names in file_names.items():
            targets = {n: state[n] for n in names if n in state}
            if safe:
                load_into(path, targets)
            else:
                for n, t in targets.items():
                    t.copy_(loaded_sd[path][n])
    return IncompatibleKeys(missing, unexpected)


def save_config_files(model, save_directory: str) -> list:
    """For a transformers PreTrainedModel (recognised by its `config.save_pretrained`, so
    transformers need not be imported here): config.json, and generation_config.json when the
    model can generate, as the model's own save_pretrained writes them (the config records the
    architecture and the parameters' dtype). Without config.json, `from_pretrained(dir)` falls
    back to a default configuration (for Llama a 7B model) instead of the saved one. Returns the
    names written; nothing for any other module."""
    config = getattr(model, "config", None)
    if not callable(getattr(config, "save_pretrained", None)):
        return []
    first = next(iter(model.parameters()), None)
    if first is not None:
        config.dtype = str(first.dtype).split(".")[-1]
    config.architectures = [type(model).__name__]
    config.save_pretrained(save_directory)
    written = ["config.json"]
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if callable(getattr(generation, "save_pretrained", None)) and callable(can_generate) and can_generate():
        generation.save_pretrained(save_directory)
        written.append("generation_config.json")
    return written

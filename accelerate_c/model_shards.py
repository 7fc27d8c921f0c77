"""Sharded model weights (docs/checkpoints.md, "Sharded weights"): under full sharding with
FSDP's SHARDED_STATE_DICT (accelerate's default for FSDP2), and under DeepSpeed's stage 3, whose
checkpoints are sharded too, save_state has each process write the shards of the model it holds
and no process ever gathers the whole model. A load reads, on each process, only the elements
it now holds: any number of processes, any wrap policy, or a strategy that holds the model whole
(one process, DDP, ZeRO-1/2), which reads each parameter whole.

Files, per prepared model i (`_i` after `model` from the second model on, as the other files):
- `model_shards.json` (main process): the number of processes, then per unit group g (a unit's
  parameters of one dtype and trainability, as full sharding lays them out) its plan's arguments
  (shard_plan.plan_spec), its dtype, the unit it belongs to, and per planned parameter its shape
  and every name the model's state dict gives it (a tied weight has several).
- `model_shard_rank{r}.safetensors` (process r): per group g, `g{g}`: process r's shard of the
  group (plan.shard_numel elements: its run of each parameter, in the plan's layout; fp32 masters
  of trainable parameters under a 16-bit policy). Its header names the process (rank, world).
- `model_buffers.safetensors` (main process): the persistent buffers (replicated).

Nothing in these files is trusted before it is checked (docs/security.md): the plan file whole,
every process's header, each tensor's shape and dtype against the plan, and the names and
shapes against the model (strict: missing and unexpected keys, as torch's load_state_dict),
all before a byte of tensor data is read. Reads go into fresh tensors; the model changes only
when everything has been read.
"""
from __future__ import annotations

import math
import os

import torch

from .checkpoint_layout import is_complete, suffix
from .model_io import check_keys
from .safetensors_io import list_tensors, load_file, load_into, save_file
from .shard_plan import plan_spec
from .state_io import CheckpointError, read_json, write_json_durable
from .zero_checkpoint import PlainFiles, ShardFile, check_header, is_int, plan_dtype, range_fills, read_all, rebuild_plan

FORMAT = "accelerate_c.model_shards"
VERSION = 1


def plan_name(i: int) -> str:
    return f"model{suffix(i)}_shards.json"


def shard_name(i: int, rank: int) -> str:
    return f"model{suffix(i)}_shard_rank{rank}.safetensors"


def buffers_name(i: int) -> str:
    return f"model{suffix(i)}_buffers.safetensors"


def files_of(i: int, ranks) -> list:
    """The files of model i's sharded weights that processes `ranks` write (what the completion
    marker must list)."""
    return [plan_name(i), buffers_name(i)] + [shard_name(i, r) for r in ranks]


# ---- save ----------------------------------------------------------------------------------------------
def save_jobs(acc, strategy, tmp: str, rank: int, is_main: bool) -> list:
    """(label, write) pairs: this process's shard of every prepared model, and on the main
    process the plans and the buffers. The tensors are copied here, on the calling thread (the
    state at the call); the writes run later."""
    jobs = []
    for i, model in enumerate(acc._models):
        groups, buffers = strategy.weight_shards(model)
        tensors = {f"g{g}": shard.detach().to("cpu", copy=True) for g, (_, shard) in enumerate(groups)}
        meta = {"format": "accelerate_c.model_shard", "rank": str(rank), "world": str(strategy.world),
                "model": str(i)}
        jobs.append((shard_name(i, rank), lambda t=tensors, n=shard_name(i, rank), m=meta: save_file(
            t, os.path.join(tmp, n), metadata=m)))
        if is_main:
            doc = {"format": FORMAT, "version": VERSION, "world": strategy.world,
                   "groups": [dict(info, plan=plan_spec(info["plan"])) for info, _ in groups]}
            bufs = {k: v.detach().to("cpu", copy=True) for k, v in buffers.items()}
            jobs.append((plan_name(i), lambda d=doc, n=plan_name(i): write_json_durable(os.path.join(tmp, n), d)))
            jobs.append((buffers_name(i), lambda b=bufs, n=buffers_name(i): save_file(
                b, os.path.join(tmp, n), metadata={"format": "pt"})))
    return jobs


# ---- load ----------------------------------------------------------------------------------------------
def read_doc(files, i: int):
    """Model i's `model_shards.json` checked whole: (its path, its world, per group (ShardPlan,
    dtype, [(names, shape)] per planned parameter)). Every name appears once in the whole file."""
    path = files.path(plan_name(i), f"shard plan of model {i}'s weights")
    doc = read_json(path, f"shard plan of model {i}'s weights")

    def bad(msg: str):
        raise CheckpointError(f"{path}: {msg}")

    world = check_header(doc, FORMAT, VERSION, "not an accelerate_c plan of sharded model weights", bad)
    if not isinstance(doc.get("groups"), list):
        bad("'groups' must be a list")
    seen: set = set()
    groups = []
    for g, gdoc in enumerate(doc["groups"]):
        where = f"group {g}"
        if not isinstance(gdoc, dict):
            bad(f"{where} must be an object")
        plan = rebuild_plan(gdoc.get("plan"), where, world, bad)
        dtype = plan_dtype(gdoc.get("dtype"), plan, where, bad)
        params = gdoc.get("params")
        if not isinstance(params, list) or len(params) != plan.nparams:
            bad(f"{where}: 'params' must list {plan.nparams} entries (one per planned parameter)")
        entries = []
        for j, e in enumerate(params):
            names, shape = (e.get("names"), e.get("shape")) if isinstance(e, dict) else (None, None)
            if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
                bad(f"{where}: parameter {j}'s 'names' must be a non-empty list of strings")
            if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape) or \
                    math.prod(shape) != plan.numel[j]:
                bad(f"{where}: parameter {j} ({names[0]}) has shape {shape!r}, the plan {plan.numel[j]} elements")
            for n in names:
                if n in seen:
                    bad(f"{where}: {n} is named twice in the file")
                seen.add(n)
            entries.append((names, tuple(shape)))
        groups.append((plan, dtype, entries))
    return path, world, groups


def _check_names(model, path: str, saved: dict, parts: dict, buffers: dict, buffer_file: str, strict: bool):
    """Missing / unexpected keys (strict) and shapes that differ, as torch's load_state_dict
    reports them, naming the file."""
    have = set(parts) | set(buffers)
    missing = sorted(k for k in have if k not in saved)
    unexpected = sorted(k for k in saved if k not in have)
    shape_of = {k: tuple(parts[k][1] if k in parts else buffers[k].shape) for k in have}
    wrong = [(k, shape, shape_of[k]) for k, shape in saved.items() if k in have and tuple(shape) != shape_of[k]]
    check_keys(f"{path} (+ {buffer_file})", model, missing, unexpected, wrong, strict)


def plan_load(files, i: int, model, strategy, strict: bool = True):
    """(read, apply) for model i's sharded weights into `model` as `strategy` holds it:
    everything checked here; `read` fills fresh tensors with the elements this process holds
    (each from the saved processes whose runs overlap them); `apply` copies them into the model
    (casting, as load_state_dict does) and lets the strategy finish."""
    path, world, groups = read_doc(files, i)
    parts, buffers, finish = strategy.weight_parts(model)
    bpath = files.path(buffers_name(i), f"buffers of model {i}")
    binfo = list_tensors(bpath)  # validates the header: CoreError naming the file
    saved = {n: tuple(info.shape) for n, info in binfo.items()}
    where = {}
    for g, (_plan, _dt, entries) in enumerate(groups):
        for j, (names, shape) in enumerate(entries):
            for n in names:
                if n in saved:
                    raise CheckpointError(f"{path}: {n} is both a parameter there and a buffer in {bpath}")
                saved[n] = shape
                where[n] = (g, j)
    # a name that is a parameter on one side and a buffer on the other: no read would fill it
    crossed = [n for n in parts if n in saved and n not in where] + [n for n in buffers if n in where]
    if crossed:
        raise CheckpointError(f"{path}: {', '.join(sorted(crossed)[:20])}: a parameter in one of the model and the "
                              f"checkpoint ({bpath}) and a buffer in the other")
    _check_names(model, path, saved, parts, buffers, bpath, strict)
    shards = [ShardFile(files.path(shard_name(i, q), f"shard {q} of model {i}'s weights"), q, world)
              for q in range(world)]
    for g, (plan, dtype, _entries) in enumerate(groups):
        for f in shards:
            f.check(f"g{g}", plan.shard_numel, dtype)
    fills, copies, done = [], [], set()
    for name, (key, _shape, pieces) in parts.items():
        if name not in where or key in done:
            continue  # a tied weight is read once, under its first name
        done.add(key)
        g, j = where[name]
        plan, dtype = groups[g][0], groups[g][1]
        for start, dest in pieces:
            temp = torch.empty(dest.numel(), dtype=dtype)
            fills += range_fills(plan, j, start, temp, shards, f"g{g}")
            copies.append((dest, temp))
    buf_targets = {n: torch.empty(binfo[n].shape, dtype=buffers[n].dtype) for n in binfo if n in buffers}

    def read():
        read_all(fills)
        load_into(bpath, buf_targets)

    def apply():
        with torch.no_grad():
            for dest, temp in copies:
                dest.copy_(temp.view(dest.shape))
            for n, t in buf_targets.items():
                buffers[n].copy_(t)
        if finish is not None:
            finish()
    return read, apply


def is_sharded(directory: str, i: int = 0) -> bool:
    """Whether model i's weights in the checkpoint are each process's shards."""
    return os.path.isfile(os.path.join(directory, plan_name(i)))


def merged(directory: str, i: int = 0) -> dict:
    """Model i's full state dict assembled from every process's shard, without a process group
    (`accelerate-c merge-weights`): each parameter once per name it was saved under."""
    # a Trainer checkpoint has no completion marker of ours: its shard files are held to the plan
    # (each header, its process, every group's length) as a load holds them
    if not is_complete(directory) and not is_sharded(directory, i):
        raise CheckpointError(f"{directory}: not a complete accelerate_c checkpoint (no completion marker)")
    files = PlainFiles(directory)
    path, world, groups = read_doc(files, i)
    shards = [ShardFile(files.path(shard_name(i, q), f"shard {q} of model {i}'s weights"), q, world)
              for q in range(world)]
    sd = load_file(files.path(buffers_name(i), f"buffers of model {i}"))
    for g, (plan, dtype, entries) in enumerate(groups):
        for f in shards:
            f.check(f"g{g}", plan.shard_numel, dtype)
        for j, (names, shape) in enumerate(entries):
            full = torch.empty(plan.numel[j], dtype=dtype)
            read_all(range_fills(plan, j, 0, full, shards, f"g{g}"))
            for n in names:
                sd[n] = full.view(shape)
    return sd

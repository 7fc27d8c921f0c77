"""Sharded checkpoints under ZeRO (docs/checkpoints.md, "Under ZeRO"): each process writes its own
shard of the optimizer state, and the main process the shard plans, so that no process ever holds
the whole state; a load on any number of processes reads, on each, only the byte ranges of the
saved shards it now owns.

Files, beside the usual ones (model weights are whole on every process under stages 1 and 2, and
saved once by the main process as always):
- `zero_plan.json` (main process): per optimizer, per shard group it steps (one per model and
  dtype), the plan's arguments (shard_plan.plan_spec), the names, shapes and dtype of its
  parameters, and whether it has fp32 masters; the stage and the number of processes.
- `zero_optimizer{i}_rank{r}.safetensors` (process r): per shard group g and per state key k that
  is one value per element (Adam's moments, a momentum buffer), `g{g}.{k}`: the group's state laid
  out as rank r's shard (plan.shard_numel elements); `g{g}.master` for the fp32 masters of a 16-bit
  model. Its header's metadata names the process (`rank`, `world`).
- `zero_optimizer{i}_rank{r}_state.json` (+ `_state.safetensors` when it holds tensors) (process r): the
  optimizer's param_groups settings, and per parameter it owns part of (by its index in the
  optimizer's parameter list) the keys present in the shard file and its other state (Adam's step).

Loading: the plan file is checked whole (read_plan: every entry a load indexes with), the saved
plans are rebuilt (_C.ShardPlan(**spec)) and this run's parameters matched to the saved ones by
name (same shapes, same optimizer numbering, or an error naming the plan file); for each run of a
parameter this process owns, the old processes whose runs of it overlap give one positioned read
each into the new shard's memory (range_fills), so another world size, stage or wrap policy
loads. Everything is checked
before anything is read (every file present, and under load_state of the size checkpoint.json
recorded; every header; every process's state file; the optimizer's own load_state_dict tried on
a stand-in), and the masters and the optimizer's state (its load_state_dict) are set only once
every read has succeeded. A checkpoint comes from anywhere (docs/security.md): nothing in these
files is trusted before it is checked.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch

from ._C import CoreError, ShardPlan
from .checkpoint_layout import suffix
from .dry_run import dry_run_optimizer
from .safetensors_io import list_tensors, read_metadata, save_file, torch_dtype_of
from .shard_plan import plan_spec
from .strategies.zero import elementwise_state
from .state_io import CheckpointError, StateFile, read_json, write_json_durable, write_state

PLAN_FILE = "zero_plan.json"
PLAN_FORMAT = "accelerate_c.zero_plan"
PLAN_VERSION = 1


def shard_stem(i: int, rank: int) -> str:
    return f"zero_optimizer{suffix(i)}_rank{rank}"


def _groups(strategy, book):
    """The shard groups an optimizer steps, in an order every process agrees on: (group, its
    parameters in plan order, the model's ModelShards)."""
    return [(group, params, shards) for _, group, params, shards in strategy.optimizer_groups(book)]


# ---- save ----------------------------------------------------------------------------------------------
def _fp32_master(shards, group):
    """The group's fp32 master shard, or None: full sharding of a 16-bit model without mixed
    precision keeps its shards in that dtype, which are its weights, not masters (the weights
    load fills them)."""
    master = shards.masters.get(id(group))
    return master if master is not None and master.dtype == torch.float32 else None


def _model_index(acc) -> dict:
    """id(prepared model) -> its index among the Accelerator's models: what a plan names a
    shard group's model by (two models stepped by one optimizer may share parameter names)."""
    return {id(m): k for k, m in enumerate(acc._models)}


def plan_doc(acc, strategy) -> dict:
    optimizers = []
    for opt in acc._optimizers:
        book = strategy.optimizers[id(opt.optimizer)]
        index = {id(p): k for k, p in enumerate(book.originals)}
        model_index = _model_index(acc)
        groups = []
        for key, group, params, shards in strategy.optimizer_groups(book):
            groups.append({"plan": plan_spec(group.plan), "dtype": str(group.dtype).replace("torch.", ""),
                           "model": model_index.get(key),
                           "params": [index.get(id(p)) for p in params],
                           "names": [strategy.manager.name_of(p) for p in params],
                           "shapes": [list(shape) for shape in group.shapes],
                           "master": _fp32_master(shards, group) is not None or
                           (strategy.fp32_masters and group.dtype != torch.float32)})
        optimizers.append({"groups": groups, "num_params": len(book.originals)})
    return {"format": PLAN_FORMAT, "version": PLAN_VERSION, "stage": strategy.stage, "world": strategy.world,
            "optimizers": optimizers}


def save_jobs(acc, strategy, tmp: str, rank: int, is_main: bool) -> list:
    """(label, write) pairs for this process's shard files (and the plan, on the main process).
    The shard tensors are assembled here, on the calling thread; the writes run later."""
    jobs = []
    if is_main:
        plan = plan_doc(acc, strategy)
        jobs.append(("zero plan", lambda: write_json_durable(os.path.join(tmp, PLAN_FILE), plan)))
    for i, opt in enumerate(acc._optimizers):
        torch_opt = opt.optimizer
        book = strategy.optimizers[id(torch_opt)]
        index = {id(p): k for k, p in enumerate(book.originals)}
        by_param = {id(p): (view, o) for view, p, o in book.views}
        tensors, params_doc = {}, {}
        for g, (group, params, shards) in enumerate(_groups(strategy, book)):
            n = group.plan.shard_numel
            flats: dict = {}
            for p in params:
                hit = by_param.get(id(p))
                if hit is None:
                    continue
                view, o = hit
                state = torch_opt.state.get(view, {})
                entry = params_doc.setdefault(str(index[id(p)]), {"keys": [], "other": {}})
                for k, v in state.items():
                    if elementwise_state(v, view):
                        flat = flats.get(k)
                        if flat is None:
                            flat = flats[k] = torch.zeros(n, dtype=v.dtype, device="cpu")
                        flat[o.local_offset:o.local_offset + o.length].copy_(v.detach())
                        entry["keys"].append(k)
                    else:
                        entry["other"][k] = v
            for k, flat in flats.items():
                tensors[f"g{g}.{k}"] = flat
            master = _fp32_master(shards, group)
            if master is not None:
                tensors[f"g{g}.master"] = master.detach().to("cpu", copy=True)
        groups_doc = [{k: v for k, v in pg.items() if k != "params"} for pg in torch_opt.param_groups]
        doc = {"param_groups": groups_doc, "params": params_doc, "rank": rank, "world": strategy.world}
        stem = shard_stem(i, rank)
        # the process that wrote it, in its header: a load refuses another process's file in its place
        meta = {"format": "accelerate_c.zero_shard", "rank": str(rank), "world": str(strategy.world)}
        jobs.append((f"{stem}.safetensors", lambda t=tensors, s=stem, m=meta: save_file(
            t, os.path.join(tmp, f"{s}.safetensors"), metadata=m)))
        jobs.append((f"{stem}_state.json", lambda d=doc, s=stem, i=i: write_state(tmp, f"{s}_state", d,
                                                                               f"ZeRO shard of optimizer {i}")))
    return jobs


# ---- load: the files, checked ------------------------------------------------------------------------
class PlainFiles:
    """A directory's files as the loads below ask for them (`path`, `open`), when no completion
    marker lists them (a Trainer's optimizer directory): present, nothing more. load_state passes
    its own reader instead, which also holds each file to the size checkpoint.json recorded."""

    def __init__(self, directory: str):
        self.dir = directory

    def path(self, name: str, what: str) -> str:
        p = os.path.join(self.dir, name)
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{p}: missing from the checkpoint ({what})")
        return p

    def open(self, name: str, what: str) -> StateFile:
        self.path(f"{name}.json", what)
        return StateFile(self.dir, name, what)


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_PLAN_KEYS = ("numel", "esize", "world", "order", "align", "first_cap_bytes", "cap_bytes")


def rebuild_plan(spec, where: str, world: int, bad) -> ShardPlan:
    """A saved plan's arguments (plan_spec) rebuilt into its ShardPlan, over the checkpoint's
    `world`; anything else is `bad(message)` (which raises, naming the file)."""
    if not isinstance(spec, dict) or sorted(spec) != sorted(_PLAN_KEYS):
        bad(f"{where} must have a 'plan' object of {', '.join(_PLAN_KEYS)}")
    try:
        plan = ShardPlan(**spec)
    except (TypeError, ValueError, OverflowError, IndexError, MemoryError, CoreError) as e:
        bad(f"{where}: not a shard plan ({type(e).__name__}: {e})")
    if plan.world != world:
        bad(f"{where} is planned over {plan.world} processes, the checkpoint's world is {world}")
    return plan


def plan_dtype(name, plan: ShardPlan, where: str, bad) -> torch.dtype:
    """A saved group's dtype name, a torch dtype of the plan's element size, or `bad(message)`."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or dtype.itemsize != plan.esize:
        bad(f"{where}: dtype {name!r} is not a torch dtype of the plan's {plan.esize}-byte elements")
    return dtype


def check_header(doc, fmt: str, version_max: int, not_ours: str, bad) -> int:
    """The head every plan file of ours starts with (format, version, world), checked; returns
    the world. `bad(msg)` raises, naming the file."""
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        bad(not_ours)
    version = doc.get("version")
    if not is_int(version) or not 1 <= version <= version_max:
        bad(f"format version {version!r} is not one this accelerate_c reads ({version_max})")
    world = doc.get("world")
    if not is_int(world) or world < 1:
        bad(f"world must be a positive integer, got {world!r}")
    return world


def read_plan(files, n_optimizers: Optional[int] = None):
    """`zero_plan.json` checked whole, before anything uses it: (its path, the document, per
    optimizer the ShardPlan of each shard group). Everything a load indexes with is checked here
    (a CheckpointError naming the file and the entry): the plans rebuild, their world is the
    checkpoint's, each group lists one name, shape and optimizer index per planned parameter,
    with the element counts the plan has, and no parameter twice."""
    path = files.path(PLAN_FILE, "the ZeRO shard plan")
    doc = read_json(path, "ZeRO shard plan")

    def bad(msg: str):
        raise CheckpointError(f"{path}: {msg}")

    world = check_header(doc, PLAN_FORMAT, PLAN_VERSION, "not an accelerate_c ZeRO plan", bad)
    optimizers = doc.get("optimizers")
    if not isinstance(optimizers, list):
        bad(f"'optimizers' must be a list, got {type(optimizers).__name__}")
    if n_optimizers is not None and len(optimizers) != n_optimizers:
        bad(f"the checkpoint has {len(optimizers)} sharded optimizers, this Accelerator {n_optimizers}")
    plans = []
    for i, odoc in enumerate(optimizers):
        if not isinstance(odoc, dict) or not isinstance(odoc.get("groups"), list) or \
                not is_int(odoc.get("num_params")) or odoc["num_params"] < 0:
            bad(f"optimizer {i} must be an object with a 'groups' list and a 'num_params' count")
        seen: set = set()
        group_plans = []
        for g, gdoc in enumerate(odoc["groups"]):
            where = f"shard group {g} of optimizer {i}"
            if not isinstance(gdoc, dict):
                bad(f"{where} must be an object")
            plan = rebuild_plan(gdoc.get("plan"), where, world, bad)
            n = plan.nparams
            params, names, shapes = gdoc.get("params"), gdoc.get("names"), gdoc.get("shapes")
            if not all(isinstance(v, list) and len(v) == n for v in (params, names, shapes)):
                bad(f"{where}: 'params', 'names' and 'shapes' must be lists of {n} entries (one per planned "
                    "parameter)")
            for j, (pid, name, shape) in enumerate(zip(params, names, shapes)):
                # None: a parameter of the model's group that another optimizer steps
                if pid is not None and (not is_int(pid) or not 0 <= pid < odoc["num_params"] or pid in seen):
                    bad(f"{where}: parameter {j}'s optimizer index {pid!r} is not null or one of "
                        f"0..{odoc['num_params'] - 1} listed once")
                seen.add(pid)
                if not isinstance(name, str):
                    bad(f"{where}: parameter {j}'s name must be a string, got {name!r}")
                if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape) or \
                        math.prod(shape) != plan.numel[j]:
                    bad(f"{where}: parameter {j} ({name}) has shape {shape!r}, the plan {plan.numel[j]} elements")
            plan_dtype(gdoc.get("dtype"), plan, where, bad)
            if not isinstance(gdoc.get("master", False), bool) or not (gdoc.get("model") is None or
                                                                      is_int(gdoc.get("model"))):
                bad(f"{where}: 'master' must be true or false and 'model' an index")
            group_plans.append(plan)
        plans.append(group_plans)
    return path, doc, plans


def _check_shard_doc(doc, path: str, rank: int, world: int, num_params: int, n_groups: int) -> None:
    """A process's `_state.json` (its decoded state): written by process `rank` of `world`, the
    optimizer's param_groups settings, per parameter index the elementwise keys in the shard file
    and the other values. CheckpointError naming the file otherwise."""
    def bad(msg: str):
        raise CheckpointError(f"{path}: {msg}")

    if not isinstance(doc, dict):
        bad("not a ZeRO shard state (an object)")
    if doc.get("rank") != rank or doc.get("world") != world or not is_int(doc.get("rank")) or \
            not is_int(doc.get("world")):
        bad(f"written by process {doc.get('rank')!r} of {doc.get('world')!r}; the plan puts process {rank} of "
            f"{world} here")
    groups = doc.get("param_groups")
    if not isinstance(groups, list) or len(groups) != n_groups or \
            not all(isinstance(pg, dict) and all(isinstance(k, str) for k in pg) for pg in groups):
        bad(f"'param_groups' must be a list of {n_groups} objects (the optimizer's parameter groups)")
    params = doc.get("params")
    if not isinstance(params, dict):
        bad("'params' must be an object")
    for pid, entry in params.items():
        if not isinstance(pid, str) or not (pid.isascii() and pid.isdigit()) or str(int(pid)) != pid or \
                int(pid) >= num_params:
            bad(f"parameter index {pid!r} is not one of 0..{num_params - 1}")
        if not isinstance(entry, dict) or not isinstance(entry.get("keys"), list) or \
                not all(isinstance(k, str) for k in entry["keys"]) or not isinstance(entry.get("other"), dict) or \
                not all(isinstance(k, str) for k in entry["other"]):
            bad(f"parameter {pid}: must be an object with 'keys' (a list of names) and 'other' (an object)")


class ShardFile:
    """One old process's shard file: its header checked, and positioned reads of element ranges."""

    def __init__(self, path: str, rank: int, world: int):
        self.path = path
        try:
            self.tensors = list_tensors(path)
            meta = read_metadata(path) or {}
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
        # written since the shard files name their process (older ones do not): another
        # process's file here, same size as this one's, would load its state in this one's place
        if "rank" in meta and (meta.get("rank"), meta.get("world")) != (str(rank), str(world)):
            raise CheckpointError(f"{path}: holds the shard of process {meta.get('rank')} of {meta.get('world')}, "
                                  f"the plan puts process {rank} of {world} here")
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
        self.data_start = 8 + header_len
        size = os.path.getsize(path)
        for name, info in self.tensors.items():
            if self.data_start + info.data_offsets[1] > size:
                raise CheckpointError(f"{path}: truncated ({size} bytes; tensor {name!r} ends at byte "
                                      f"{self.data_start + info.data_offsets[1]})")

    def check(self, name: str, numel: int, dtype=None):
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: has no tensor {name!r}")
        if tuple(info.shape) != (numel,):
            raise CheckpointError(f"{self.path}: tensor {name!r} has shape {tuple(info.shape)}, the saved plan lays out "
                                  f"({numel},)")
        dt = torch_dtype_of(self.path, name, info.dtype)
        if dtype is not None and dt != dtype:
            raise CheckpointError(f"{self.path}: tensor {name!r} is {dt}, expected {dtype}")
        return dt

    def read_into(self, name: str, offset: int, dest: torch.Tensor) -> None:
        """Elements [offset, offset + dest.numel()) of tensor `name` into `dest` (contiguous CPU)."""
        info = self.tensors[name]
        esize = dest.element_size()
        start = self.data_start + info.data_offsets[0] + offset * esize
        mv = memoryview(dest.view(torch.uint8).numpy()) if dest.numel() else memoryview(b"")
        with open(self.path, "rb", buffering=0) as f:
            done = 0
            while done < len(mv):
                got = os.preadv(f.fileno(), [mv[done:]], start + done)
                if got <= 0:
                    raise CheckpointError(f"{self.path}: short read of tensor {name!r} at byte {start + done}")
                done += got


def _read_shards(files, i: int, world: int, num_params: int, n_groups: int) -> list:
    """Every old process's shard of optimizer i, checked: [(its ShardFile, its state document,
    the state file's path)] by old rank."""
    out = []
    for q in range(world):
        stem, what = shard_stem(i, q), f"ZeRO shard {q} of optimizer {i}"
        shard = ShardFile(files.path(f"{stem}.safetensors", what), q, world)
        sf = files.open(f"{stem}_state", what)
        doc = sf.load()
        _check_shard_doc(doc, sf.json_path, q, world, num_params, n_groups)
        out.append((shard, doc, sf.json_path))
    return out


def _torch_state_dict(torch_opt, state_by_param: list, saved_groups: list) -> dict:
    """The optimizer state in torch's layout (what `torch_opt.load_state_dict` takes): `state_by_param`
    ((parameter of `torch_opt`'s groups, its state) pairs) numbered, the saved settings of each group with its
    parameters numbered as torch numbers them."""
    number = {}
    for pg in torch_opt.param_groups:
        for p in pg["params"]:
            number[id(p)] = len(number)
    return {"state": {number[id(p)]: st for p, st in state_by_param},
            "param_groups": [dict(saved, params=[number[id(p)] for p in pg["params"]])
                             for saved, pg in zip(saved_groups, torch_opt.param_groups)]}


def _dry_run(torch_opt, sd: dict, shards: list) -> None:
    paths = [path for _, _, path in shards]
    dry_run_optimizer(torch_opt, sd, paths[0] + (f" (with {len(paths) - 1} more processes' shard states)"
                                                 if len(paths) > 1 else ""))


def read_all(fills) -> None:
    """Every (shard file, tensor name, element offset, destination) read, in order."""
    for f, name, off, dest in fills:
        f.read_into(name, off, dest)


# ---- load ----------------------------------------------------------------------------------------------
def range_fills(plan, j: int, start: int, dest: torch.Tensor, files: list, name: str) -> list:
    """(file, tensor name, element offset, destination slice) reads that fill `dest` with elements
    [start, start + dest.numel()) of parameter j of a saved `plan`, from the old processes' files
    whose runs of it overlap them (each process owned one contiguous run of each parameter)."""
    out = []
    for q in range(plan.world):
        local, poff, length = plan.param_shard(j, q)
        lo, hi = max(poff, start), min(poff + length, start + dest.numel())
        if lo < hi:
            out.append((files[q], name, local + lo - poff, dest[lo - start:hi - start]))
    return out


def plan_load(acc, strategy, files):
    """(reads, applies) for the sharded optimizer states of a checkpoint written under ZeRO or
    full sharding (`files`: load_state's reader, or PlainFiles(directory)), into this run's
    shards, matched parameter by parameter (by model and name): another number of processes, another
    stage (a full-sharding checkpoint into ZeRO-2 and back), another wrap policy. Every file is
    checked here (plan, names, shapes, numbering, every old rank's file and header, the state
    the optimizer would load); reads fill new tensors, each element range of this process's
    runs from the old processes that owned it; applies set the masters and load the optimizers
    (their own load_state_dict)."""
    path, doc, plans = read_plan(files, len(acc._optimizers))
    old_world = doc["world"]
    reads, applies = [], []
    for i, (opt, odoc) in enumerate(zip(acc._optimizers, doc["optimizers"])):
        torch_opt = opt.optimizer
        book = strategy.optimizers[id(torch_opt)]
        if odoc["num_params"] != len(book.originals):
            raise CheckpointError(f"{path}: optimizer {i} was saved over {odoc['num_params']} parameters, this one "
                                  f"steps {len(book.originals)}: a plan from another model")
        # (model index, name) -> (saved group, index there): two models stepped by one optimizer
        # may both have a parameter of one name
        saved = {}
        for g, gdoc in enumerate(odoc["groups"]):
            for j, name in enumerate(gdoc["names"]):
                saved[(gdoc.get("model"), name)] = (g, j)
        model_index = _model_index(acc)
        shards = _read_shards(files, i, old_world, odoc["num_params"], len(torch_opt.param_groups))
        old_files = [f for f, _, _ in shards]
        index = {id(p): k for k, p in enumerate(book.originals)}
        by_param = {id(p): (view, o) for view, p, o in book.views}
        new_state, fills, master_fills = [], [], []
        for key, group, params, model_shards in strategy.optimizer_groups(book):
            n = group.plan.shard_numel
            flats: dict = {}  # state key -> this group's new shard of it
            wants_master = id(group) in model_shards.masters or (strategy.fp32_masters and group.dtype != torch.float32)
            mflat = torch.zeros(n, dtype=torch.float32) if wants_master else None
            for p, shape, (local, poff, length) in zip(params, group.shapes, group.runs()):
                name = strategy.manager.name_of(p)
                if (model_index.get(key), name) not in saved:
                    raise CheckpointError(f"{path}: optimizer {i} has no saved state for parameter {name} of model "
                                          f"{model_index.get(key)} (a plan from another model)")
                g, j = saved[(model_index.get(key), name)]
                gdoc, old_plan = odoc["groups"][g], plans[i][g]
                if gdoc["shapes"][j] != list(shape):  # full sharding changes p.shape between steps
                    raise CheckpointError(f"{path}: parameter {name} was saved with shape {gdoc['shapes'][j]}, this "
                                          f"model's is {list(shape)}: a plan from another model")
                if gdoc["params"][j] != index.get(id(p)):
                    raise CheckpointError(f"{path}: optimizer {i} numbered parameter {name} {gdoc['params'][j]}, this "
                                          f"one numbers it {index.get(id(p))}")
                if mflat is not None and length:
                    if gdoc.get("master"):
                        mname = f"g{g}.master"
                        for f in old_files:
                            f.check(mname, old_plan.shard_numel, torch.float32)
                        fills += range_fills(old_plan, j, poff, mflat[local:local + length], old_files, mname)
                    elif not getattr(model_shards, "masters_are_weights", False):
                        raise CheckpointError(f"{path}: parameter {name} was saved without fp32 master weights, this "
                                              "run keeps them (the checkpoint was saved under another precision)")
                hit = by_param.get(id(p))
                if hit is None:
                    continue  # stepped by another optimizer, or this process owns none of it
                view, o = hit
                pid = str(index[id(p)])
                entry = next((sdoc["params"][pid] for _, sdoc, _ in shards if pid in sdoc["params"]), None)
                if entry is None:
                    continue  # no state yet (never stepped)
                st = {}
                for k in entry["keys"]:
                    kname = f"g{g}.{k}"
                    dts = {f.check(kname, old_plan.shard_numel) for f in old_files if kname in f.tensors}
                    if len(dts) != 1:
                        raise CheckpointError(f"{old_files[0].path}: state {k!r} of saved group {g} is in no "
                                              "process's file, or has different dtypes in them")
                    dt = dts.pop()
                    flat = flats.get(k)
                    if flat is None:
                        flat = flats[k] = torch.zeros(n, dtype=dt)
                    elif flat.dtype != dt:
                        raise CheckpointError(f"{old_files[0].path}: state {k!r} is saved in both {flat.dtype} and {dt}")
                    dest = flat[o.local_offset:o.local_offset + o.length]
                    # a process that owned none of the parameter may have no such tensor; one that did must
                    for f, nm, off, d in range_fills(old_plan, j, o.param_offset, dest, old_files, kname):
                        f.check(nm, old_plan.shard_numel, dt)
                        fills.append((f, nm, off, d))
                    st[k] = dest
                st.update(entry["other"])
                new_state.append((view, st))
            if mflat is not None and gdoc_has_master(odoc, saved, model_index.get(key), params, strategy):
                master_fills.append((model_shards, group, mflat))
        sd = _torch_state_dict(torch_opt, new_state, shards[0][1]["param_groups"])
        _dry_run(torch_opt, sd, shards)

        def apply(torch_opt=torch_opt, sd=sd, master_fills=master_fills):
            with torch.no_grad():
                for model_shards, group, mflat in master_fills:
                    model_shards.master(group).copy_(mflat.to(model_shards.master(group).device))
            torch_opt.load_state_dict(sd)

        reads.append(lambda fills=fills: read_all(fills))
        applies.append(apply)
    return reads, applies


def gdoc_has_master(odoc, saved: dict, model, params, strategy) -> bool:
    """Whether the saved groups of `params` (of model index `model`) hold fp32 masters (then the
    new masters come from them; otherwise the masters are the weights the model load fills: full
    sharding's)."""
    return any(odoc["groups"][saved[(model, strategy.manager.name_of(p))][0]].get("master") for p in params)


def is_sharded(directory: str) -> bool:
    """Whether the checkpoint's optimizer states were written under ZeRO (one shard per process)."""
    return os.path.isfile(os.path.join(directory, PLAN_FILE))


def plan_load_whole(acc, files):
    """(reads, applies) that load a checkpoint written under ZeRO into unsharded optimizers (one
    process, where ZeRO has nothing to shard): each parameter's state assembled from the runs every
    old process owned of it, in torch's per-parameter layout, loaded by the optimizer's own
    load_state_dict (tried on a stand-in first, with the other checks)."""
    path, doc, plans = read_plan(files, len(acc._optimizers))
    old_world = doc["world"]
    reads, applies = [], []
    for i, (opt, odoc) in enumerate(zip(acc._optimizers, doc["optimizers"])):
        torch_opt = opt.optimizer
        params = [p for pg in torch_opt.param_groups for p in pg["params"] if p.requires_grad]
        if odoc["num_params"] != len(params):
            raise CheckpointError(f"{path}: optimizer {i} was saved over {odoc['num_params']} trainable parameters, "
                                  f"this one steps {len(params)}: a plan from another model")
        shards = _read_shards(files, i, old_world, len(params), len(torch_opt.param_groups))
        fills, new_state = [], []
        for g, (gdoc, old_plan) in enumerate(zip(odoc["groups"], plans[i])):
            for j, (pid, shape) in enumerate(zip(gdoc["params"], gdoc["shapes"])):
                if pid is None:
                    continue  # stepped by another optimizer
                p = params[pid]
                if list(p.shape) != shape:
                    raise CheckpointError(f"{path}: parameter {gdoc['names'][j]} was saved with shape {shape}, this "
                                          f"model's is {list(p.shape)}: a plan from another model")
                saved = [(q, sdoc["params"][str(pid)]) for q, (_, sdoc, _) in enumerate(shards)
                         if str(pid) in sdoc["params"]]
                if not saved:
                    continue
                st = dict(saved[0][1]["other"])
                for k in saved[0][1]["keys"]:
                    name = f"g{g}.{k}"
                    dt = shards[saved[0][0]][0].check(name, old_plan.shard_numel)
                    full = torch.zeros(p.numel(), dtype=dt)
                    for f, nm, off, d in range_fills(old_plan, j, 0, full, [s[0] for s in shards], name):
                        f.check(nm, old_plan.shard_numel, dt)
                        fills.append((f, nm, off, d))
                    st[k] = full.view(p.shape)
                new_state.append((p, st))
        sd = _torch_state_dict(torch_opt, new_state, shards[0][1]["param_groups"])
        _dry_run(torch_opt, sd, shards)
        reads.append(lambda fills=fills: read_all(fills))
        applies.append(lambda o=torch_opt, sd=sd: o.load_state_dict(sd))
    return reads, applies


def merged_weights(directory: str, model_index: int = 0) -> dict:
    """The weights of model `model_index` of a checkpoint as one state dict, without a process
    group: its saved weights, with every parameter that has fp32 masters (DeepSpeed's 16-bit
    policy) replaced by its fp32 master assembled from every process's shard (what DeepSpeed's
    zero_to_fp32.py recovers)."""
    from .checkpoint_layout import is_complete
    from .safetensors_io import load_file

    if not is_complete(directory):
        raise CheckpointError(f"{directory}: not a complete accelerate_c checkpoint (no completion marker)")
    weights = os.path.join(directory, f"model{suffix(model_index)}.safetensors")
    if not os.path.isfile(weights):
        raise FileNotFoundError(f"{weights}: missing from the checkpoint (weights of model {model_index})")
    sd = load_file(weights)
    if not is_sharded(directory):
        return sd
    files = PlainFiles(directory)
    path, doc, plans = read_plan(files)
    for i, odoc in enumerate(doc["optimizers"]):
        shards = None
        for g, (gdoc, plan) in enumerate(zip(odoc["groups"], plans[i])):
            if not gdoc.get("master") or gdoc.get("model") != model_index:
                continue
            if shards is None:
                shards = [ShardFile(files.path(f"{shard_stem(i, q)}.safetensors", f"ZeRO shard {q} of optimizer {i}"),
                                     q, doc["world"]) for q in range(doc["world"])]
            name = f"g{g}.master"
            for f in shards:
                f.check(name, plan.shard_numel, torch.float32)
            for j, (pname, shape) in enumerate(zip(gdoc["names"], gdoc["shapes"])):
                if pname not in sd or list(sd[pname].shape) != shape:
                    raise CheckpointError(f"{path}: parameter {pname} {shape} is not in {weights} with that shape")
                full = torch.empty(plan.param(j)[2], dtype=torch.float32)
                read_all(range_fills(plan, j, 0, full, shards, name))
                sd[pname] = full.view(shape)
    return sd

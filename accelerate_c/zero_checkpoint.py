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
  model.
- `zero_optimizer{i}_rank{r}_state.json` (+ `_state.safetensors` when it holds tensors) (process r): the
  optimizer's param_groups settings, and per parameter it owns part of (by its index in the
  optimizer's parameter list) the keys present in the shard file and its other state (Adam's step).

Loading: the saved plans are rebuilt (_C.ShardPlan(**spec)) and checked against this run's (same
parameters, same sizes, or an error naming the plan file); `ShardPlan.reshard_runs` gives, for
this process, the runs (old rank, old offset, new offset, length) that fill its new shard; each
run is read from the old rank's file with one positioned read into the new shard's memory.
Everything is checked (every file present, every header's size) before anything is read, and the
optimizer's state and the masters are replaced only once every read has succeeded.
"""
from __future__ import annotations

import os

import torch

from ._C import ShardPlan
from .checkpoint_layout import suffix
from .safetensors_io import list_tensors, save_file, torch_dtype_of
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
def plan_doc(acc, strategy) -> dict:
    optimizers = []
    for opt in acc._optimizers:
        book = strategy.optimizers[id(opt.optimizer)]
        index = {id(p): k for k, p in enumerate(book.originals)}
        model_index = {id(m): k for k, m in enumerate(acc._models)}
        groups = []
        for key, group, params, shards in strategy.optimizer_groups(book):
            groups.append({"plan": plan_spec(group.plan), "dtype": str(group.dtype).replace("torch.", ""),
                           "model": model_index.get(key),
                           "params": [index.get(id(p)) for p in params],
                           "names": [strategy.manager.name_of(p) for p in params],
                           "shapes": [list(shape) for shape in group.shapes],
                           "master": id(group) in shards.masters or
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
            master = shards.masters.get(id(group))
            if master is not None:
                tensors[f"g{g}.master"] = master.detach().to("cpu", copy=True)
        groups_doc = [{k: v for k, v in pg.items() if k != "params"} for pg in torch_opt.param_groups]
        doc = {"param_groups": groups_doc, "params": params_doc, "rank": rank, "world": strategy.world}
        stem = shard_stem(i, rank)
        jobs.append((f"{stem}.safetensors", lambda t=tensors, s=stem: save_file(
            t, os.path.join(tmp, f"{s}.safetensors"), metadata={"format": "accelerate_c.zero_shard"})))
        jobs.append((f"{stem}_state.json", lambda d=doc, s=stem, i=i: write_state(tmp, f"{s}_state", d,
                                                                               f"ZeRO shard of optimizer {i}")))
    return jobs


# ---- load ----------------------------------------------------------------------------------------------
class _ShardFile:
    """One old process's shard file: its header checked, and positioned reads of element ranges."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: missing from the checkpoint (a process's ZeRO shard)")
        try:
            self.tensors = list_tensors(path)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
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


def _read_all(fills) -> None:
    """Every (shard file, tensor name, element offset, destination) read, in order."""
    for f, name, off, dest in fills:
        f.read_into(name, off, dest)


def _install(torch_opt, new_state: dict, groups_doc: list) -> None:
    """The loaded state and param_groups settings into `torch_opt` (its parameters' devices)."""
    state = type(torch_opt.state)() if isinstance(torch_opt.state, dict) else {}
    for key, st in new_state.items():
        state[key] = {k: (v.to(key.device) if torch.is_tensor(v) and v.dim() else v) for k, v in st.items()}
    torch_opt.state = state
    for pg, saved in zip(torch_opt.param_groups, groups_doc):
        pg.update(saved)


def _check_plan(doc, path, acc, strategy):
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
        raise CheckpointError(f"{path}: not an accelerate_c ZeRO plan")
    if not isinstance(doc.get("version"), int) or doc["version"] > PLAN_VERSION:
        raise CheckpointError(f"{path}: plan format version {doc.get('version')!r} is newer than this accelerate_c "
                              f"reads ({PLAN_VERSION})")
    if len(doc.get("optimizers", [])) != len(acc._optimizers):
        raise CheckpointError(f"{path}: the checkpoint has {len(doc.get('optimizers', []))} sharded optimizers, this "
                              f"Accelerator {len(acc._optimizers)}")
    world = doc.get("world")
    if not isinstance(world, int) or world < 1:
        raise CheckpointError(f"{path}: world must be a positive integer, got {world!r}")


def plan_load(acc, strategy, directory: str):
    """(reads, applies) for the sharded optimizer states of a checkpoint written under ZeRO: every
    file checked here (plan, shapes, every old rank's file and header); reads fill new tensors;
    applies swap them into the optimizers and masters."""
    path = os.path.join(directory, PLAN_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: missing from the checkpoint (the ZeRO shard plan: a checkpoint saved "
                                "under ZeRO is needed to load the sharded optimizer state)")
    doc = read_json(path, "ZeRO shard plan")
    _check_plan(doc, path, acc, strategy)
    old_world = doc["world"]
    rank = strategy.rank
    reads, applies = [], []
    for i, (opt, odoc) in enumerate(zip(acc._optimizers, doc["optimizers"])):
        torch_opt = opt.optimizer
        book = strategy.optimizers[id(torch_opt)]
        groups = _groups(strategy, book)
        if len(odoc["groups"]) != len(groups) or odoc.get("num_params") != len(book.originals):
            raise CheckpointError(f"{path}: optimizer {i} was saved over {odoc.get('num_params')} parameters in "
                                  f"{len(odoc['groups'])} shard groups, this one steps {len(book.originals)} in "
                                  f"{len(groups)}: a plan from another model")
        files = [_ShardFile(os.path.join(directory, f"{shard_stem(i, q)}.safetensors")) for q in range(old_world)]
        docs = []
        for q in range(old_world):
            sf = StateFile(directory, f"{shard_stem(i, q)}_state", f"ZeRO shard {q} of optimizer {i}")
            docs.append(sf.load())
        index = {id(p): k for k, p in enumerate(book.originals)}
        by_param = {id(p): (view, o) for view, p, o in book.views}
        new_state: dict = {}
        fills = []  # (file, name, old offset, destination)
        master_fills = []
        for g, ((group, params, shards), gdoc) in enumerate(zip(groups, odoc["groups"])):
            if gdoc.get("dtype") != str(group.dtype).replace("torch.", ""):
                raise CheckpointError(f"{path}: shard group {g} of optimizer {i} was saved as {gdoc.get('dtype')}, this "
                                      f"model's is {group.dtype} (the checkpoint was saved under another precision)")
            names = [strategy.manager.name_of(p) for p in params]
            shapes = [list(shape) for shape in group.shapes]  # full sharding changes p.shape between steps
            if gdoc["names"] != names or gdoc["shapes"] != shapes:
                diff = next((k for k in range(min(len(names), len(gdoc["names"])))
                             if (names[k], shapes[k]) != (gdoc["names"][k], gdoc["shapes"][k])), None)
                what = (f"parameter {k} is {gdoc['names'][diff]} {gdoc['shapes'][diff]} there, "
                        f"{names[diff]} {shapes[diff]} here" if diff is not None else
                        f"{len(gdoc['names'])} parameters there, {len(names)} here")
                raise CheckpointError(f"{path}: shard group {g} of optimizer {i} is from another model ({what})")
            old_plan = ShardPlan(**gdoc["plan"])
            runs = group.plan.reshard_runs(old_plan, rank)
            n = group.plan.shard_numel
            # the keys saved for this group: from the old files' docs
            keys = {}
            for p in params:
                for q in range(old_world):
                    e = docs[q]["params"].get(str(index.get(id(p))))
                    if e is not None:
                        for k in e["keys"]:
                            keys.setdefault(k, None)
            flats = {}
            for k in keys:
                name = f"g{g}.{k}"
                dts = {files[q].check(name, old_plan.shard_numel) for q in range(old_world) if name in files[q].tensors}
                if len(dts) != 1:
                    raise CheckpointError(f"{files[0].path}: state {k!r} of shard group {g} is not in every "
                                          "process's file, or has different dtypes")
                flats[k] = torch.zeros(n, dtype=dts.pop())
                for q, o, nn, ln in runs:
                    fills.append((files[q], name, o, flats[k][nn:nn + ln]))
            if gdoc.get("master"):
                name = f"g{g}.master"
                for q in range(old_world):
                    files[q].check(name, old_plan.shard_numel, torch.float32)
                mflat = torch.zeros(n, dtype=torch.float32)
                for q, o, nn, ln in runs:
                    fills.append((files[q], name, o, mflat[nn:nn + ln]))
                master_fills.append((shards, group, mflat))
            for p in params:
                hit = by_param.get(id(p))
                if hit is None:
                    continue
                view, o = hit
                pid = str(index[id(p)])
                saved = [docs[q]["params"].get(pid) for q in range(old_world)]
                saved = [e for e in saved if e is not None]
                st = {}
                if saved:
                    for k in saved[0]["keys"]:
                        st[k] = flats[k][o.local_offset:o.local_offset + o.length]
                    st.update(saved[0]["other"])
                if st:
                    new_state[view] = st
        groups_doc = docs[0]["param_groups"]
        if len(groups_doc) != len(torch_opt.param_groups):
            raise CheckpointError(f"{files[0].path}: {len(groups_doc)} param groups saved, the optimizer has "
                                  f"{len(torch_opt.param_groups)}")

        def apply(torch_opt=torch_opt, new_state=new_state, groups_doc=groups_doc, master_fills=master_fills):
            with torch.no_grad():
                for shards, group, mflat in master_fills:
                    shards.master(group).copy_(mflat.to(shards.master(group).device))
            _install(torch_opt, new_state, groups_doc)

        reads.append(lambda fills=fills: _read_all(fills))
        applies.append(apply)
    return reads, applies


def is_sharded(directory: str) -> bool:
    """Whether the checkpoint's optimizer states were written under ZeRO (one shard per process)."""
    return os.path.isfile(os.path.join(directory, PLAN_FILE))


def plan_load_whole(acc, directory: str):
    """(reads, applies) that load a checkpoint written under ZeRO into unsharded optimizers (one
    process, where ZeRO has nothing to shard): each parameter's state assembled from the runs every
    old process owned of it, in torch's per-parameter layout."""
    path = os.path.join(directory, PLAN_FILE)
    doc = read_json(path, "ZeRO shard plan")
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT or not isinstance(doc.get("world"), int):
        raise CheckpointError(f"{path}: not an accelerate_c ZeRO plan")
    if len(doc.get("optimizers", [])) != len(acc._optimizers):
        raise CheckpointError(f"{path}: the checkpoint has {len(doc.get('optimizers', []))} sharded optimizers, this "
                              f"Accelerator {len(acc._optimizers)}")
    old_world = doc["world"]
    reads, applies = [], []
    for i, (opt, odoc) in enumerate(zip(acc._optimizers, doc["optimizers"])):
        torch_opt = opt.optimizer
        params = [p for pg in torch_opt.param_groups for p in pg["params"] if p.requires_grad]
        if odoc.get("num_params") != len(params):
            raise CheckpointError(f"{path}: optimizer {i} was saved over {odoc.get('num_params')} trainable parameters, "
                                  f"this one steps {len(params)}: a plan from another model")
        files = [_ShardFile(os.path.join(directory, f"{shard_stem(i, q)}.safetensors")) for q in range(old_world)]
        docs = [StateFile(directory, f"{shard_stem(i, q)}_state", f"ZeRO shard {q} of optimizer {i}").load()
                for q in range(old_world)]
        fills, new_state = [], {}
        for g, gdoc in enumerate(odoc["groups"]):
            old_plan = ShardPlan(**gdoc["plan"])
            for j, (pid, shape) in enumerate(zip(gdoc["params"], gdoc["shapes"])):
                p = params[pid]
                if list(p.shape) != shape:
                    raise CheckpointError(f"{path}: parameter {gdoc['names'][j]} was saved with shape {shape}, this "
                                          f"model's is {list(p.shape)}: a plan from another model")
                saved = [(q, docs[q]["params"].get(str(pid))) for q in range(old_world)]
                saved = [(q, e) for q, e in saved if e is not None]
                if not saved:
                    continue
                st = dict(saved[0][1]["other"])
                for k in saved[0][1]["keys"]:
                    name = f"g{g}.{k}"
                    dt = files[saved[0][0]].check(name, old_plan.shard_numel)
                    full = torch.zeros(p.numel(), dtype=dt)
                    for q in range(old_world):
                        local, poff, length = old_plan.param_shard(j, q)
                        if length:
                            files[q].check(name, old_plan.shard_numel, dt)
                            fills.append((files[q], name, local, full[poff:poff + length]))
                    st[k] = full.view(p.shape)
                new_state[p] = st
        groups_doc = docs[0]["param_groups"]

        reads.append(lambda fills=fills: _read_all(fills))
        applies.append(lambda o=torch_opt, st=new_state, g=groups_doc: _install(o, st, g))
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
    path = os.path.join(directory, PLAN_FILE)
    doc = read_json(path, "ZeRO shard plan")
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT or not isinstance(doc.get("world"), int):
        raise CheckpointError(f"{path}: not an accelerate_c ZeRO plan")
    for i, odoc in enumerate(doc["optimizers"]):
        files = None
        for g, gdoc in enumerate(odoc["groups"]):
            if not gdoc.get("master") or gdoc.get("model") != model_index:
                continue
            if files is None:
                files = [_ShardFile(os.path.join(directory, f"{shard_stem(i, q)}.safetensors"))
                         for q in range(doc["world"])]
            plan = ShardPlan(**gdoc["plan"])
            name = f"g{g}.master"
            for q in range(doc["world"]):
                files[q].check(name, plan.shard_numel, torch.float32)
            for j, (pname, shape) in enumerate(zip(gdoc["names"], gdoc["shapes"])):
                if pname not in sd or list(sd[pname].shape) != shape:
                    raise CheckpointError(f"{path}: parameter {pname} {shape} is not in {weights} with that shape")
                full = torch.empty(plan.param(j)[2], dtype=torch.float32)
                for q in range(doc["world"]):
                    local, poff, length = plan.param_shard(j, q)
                    if length:
                        files[q].read_into(name, local, full[poff:poff + length])
                sd[pname] = full.view(shape)
    return sd

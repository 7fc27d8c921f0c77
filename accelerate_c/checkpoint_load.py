"""load_state: checks every file of a checkpoint (ours or accelerate's) before changing any state, then
reads the tensor data, then sets the rest (docs/checkpoints.md says what an I/O error leaves).
The directory conventions it shares with the writer are in checkpoint_layout.py.
"""
from __future__ import annotations

import os
import re
import warnings
from typing import Callable, List, Optional

import torch

from .checkpoint_layout import (AUTO_NAME_RE, MARKER, complete_checkpoints, has_our_files, read_marker,
                                refuse_links_out, sampler_of, suffix)
from . import model_shards, zero_checkpoint
from .dry_run import dry_run_optimizer, dry_run_scheduler
from .model_io import check_keys, find_aliases
from .safetensors_io import DTYPES, list_tensors, load_into
from .state_io import CheckpointError, StateFile, check_rng_state, decode, set_rng_state, torch_load

def _check_loader_state(st, where: str) -> None:
    if not isinstance(st, dict):
        raise CheckpointError(f"{where}: a data loader state must be an object")
    for key in ("iteration", "batches_seen", "sampler_epoch", "sampler_initial_seed"):
        if key in st and (not isinstance(st[key], int) or isinstance(st[key], bool)):
            raise CheckpointError(f"{where}: {key} must be an integer, got {st[key]!r}")
    if "mid_epoch" in st and not isinstance(st["mid_epoch"], bool):
        raise CheckpointError(f"{where}: mid_epoch must be true or false, got {st['mid_epoch']!r}")
    for key in ("sampler_generator", "synchronized_generator"):
        if key in st:
            _check_generator_state(st[key], f"{where}: {key}")


def _check_generator_state(state, what: str) -> None:
    try:
        torch.Generator().set_state(state)
    except (TypeError, RuntimeError) as e:
        raise CheckpointError(f"{what} is not a generator state ({e})") from None


def _check_epoch_starts(starts, where: str) -> None:
    """``dataloader_epoch_start`` of a random_states file: per data loader, None or the RNG
    states at the start of its epoch under way, {"rng": <rng_state()>, "generators": {role:
    state}} (data_loader.epoch_rng_states)."""
    if not isinstance(starts, (list, tuple)):
        raise CheckpointError(f"{where}: dataloader_epoch_start must be a list, got {type(starts).__name__}")
    for i, rec in enumerate(starts):
        key = f"dataloader_epoch_start[{i}]"
        if rec is None:
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("rng"), dict) or \
                not isinstance(rec.get("generators"), dict):
            raise CheckpointError(f"{where}: {key} must be null or an object with 'rng' and 'generators' objects")
        check_rng_state(rec["rng"], f"{where}: {key}['rng']")
        for role, state in rec["generators"].items():
            if not isinstance(role, str):
                raise CheckpointError(f"{where}: {key}['generators'] has a key {role!r} that is not a string")
            _check_generator_state(state, f"{where}: {key}['generators'][{role!r}]")


def _check_stateful_states(states, where: str) -> None:
    """``dataloader_state_dict`` of a random_states file: per data loader, None or a stateful
    loader's state_dict() (an object with string keys)."""
    if not isinstance(states, (list, tuple)):
        raise CheckpointError(f"{where}: dataloader_state_dict must be a list, got {type(states).__name__}")
    for i, sd in enumerate(states):
        if sd is not None and (not isinstance(sd, dict) or not all(isinstance(k, str) for k in sd)):
            raise CheckpointError(f"{where}: dataloader_state_dict[{i}] must be null or an object with string keys "
                                  "(a StatefulDataLoader state_dict())")


def _plan_stateful_loaders(acc, reader, plan, states: list, d: str) -> None:
    """Each stateful loader gets this process's saved state_dict(); from a checkpoint accelerate
    wrote, its dl_state_dict{_i}.bin (one file for every process)."""
    for i, dl in enumerate(acc._dataloaders):
        sd = states[i] if i < len(states) else None
        if not getattr(dl, "use_stateful_dataloader", False):
            if sd is not None:
                warnings.warn(f"{d}: data loader {i} was saved as a stateful data loader; this one is not "
                              "(use_stateful_dataloader=False), so only its position is restored")
            continue
        name = f"dl_state_dict{suffix(i)}.bin"
        if sd is None and reader.marker is None and reader.has(name):
            sd = reader.pickled(name, f"state of stateful data loader {i}")
            _check_stateful_states([sd], os.path.join(d, name))
        if sd is None:
            warnings.warn(f"{d}: no saved state for stateful data loader {i}; it starts its epoch from the beginning")
            continue
        plan.applies.append(lambda dl=dl, sd=sd: dl.load_state_dict(sd))


def _loader_is_iterating(dl, st: dict, where: str) -> bool:
    """load_state inside the loop (an epoch of `dl` under way): the iterator goes on as it is,
    as accelerate's does, and the next epoch is the next one, so the saved position (epoch,
    batch, sampler state) is not applied: armed, it would make the next epoch replay this one.
    A position other than the loader's own is warned about (restoring it needs load_state
    before the epoch starts). True: leave the loader alone."""
    under_way = getattr(dl, "epoch_under_way", None)
    if under_way is None or not under_way():
        return False
    now = dl.resume_position()
    saved = (st.get("iteration", now["iteration"]), st.get("batches_seen", 0))
    if (now["iteration"], now["batches_seen"]) != saved:
        warnings.warn(f"{where}: load_state was called while the data loader is in epoch {now['iteration']} "
                      f"(batch {now['batches_seen']} handed out); it goes on from there, and the checkpoint's "
                      f"position (epoch {saved[0]}, batch {saved[1]}) is not applied. Call load_state before "
                      "the loop (or the epoch) starts to resume the data where the checkpoint was saved")
    return True


def _apply_loader_state(dl, st: dict, where: str) -> None:
    if _loader_is_iterating(dl, st, where):
        return
    if "iteration" in st and hasattr(dl, "iteration"):
        dl.iteration = int(st["iteration"])
    sampler = sampler_of(dl)
    if sampler is not None:
        for attr in ("epoch", "initial_seed"):
            if f"sampler_{attr}" in st and hasattr(sampler, attr):
                setattr(sampler, attr, int(st[f"sampler_{attr}"]))
        g = getattr(sampler, "generator", None)
        if "sampler_generator" in st:
            if not isinstance(g, torch.Generator):
                g = sampler.generator = torch.Generator()
            g.set_state(st["sampler_generator"])
    sg = getattr(dl, "synchronized_generator", None)
    if "synchronized_generator" in st and isinstance(sg, torch.Generator):
        sg.set_state(st["synchronized_generator"])


# ---- load_state ------------------------------------------------------------------------------------------
class _Plan:
    """What load_state will do once every file has been checked: ``reads`` fill the live
    parameters and optimizer state tensors from the files (the only steps doing I/O into live
    state), then ``applies`` set everything else from states already read and checked."""

    def __init__(self):
        self.reads: List[Callable[[], None]] = []
        self.applies: List[Callable[[], None]] = []
        self.step = None
        self.iteration = None


def _check_model_entries(model, state: dict, entries: dict, path: str, strict: bool) -> None:
    """``entries``: {name: (shape, torch dtype or None)} of the file. Raises RuntimeError naming
    the file and the keys for missing/unexpected keys (strict) and shapes that differ."""
    aliases = find_aliases(state)
    groups = {}
    for k in state:
        groups.setdefault(aliases.get(k, k), []).append(k)
    missing = [k for k in state if not any(m in entries for m in groups[aliases.get(k, k)])]
    unexpected = [k for k in entries if k not in state]
    wrong = [(n, shape, state[n].shape) for n, (shape, _dt) in entries.items()
             if n in state and tuple(state[n].shape) != tuple(shape)]
    check_keys(path, model, missing, unexpected, wrong, strict)


def _model_targets(model, path: str, strict: bool, strategy):
    """(what each saved tensor is read into, what then applies them: None when the targets are
    the model's own tensors; under full sharding full-size tensors whose runs go to the shards)."""
    infos = list_tensors(path)  # validates the header: CoreError naming the file
    state, apply = strategy.load_targets(model)
    _check_model_entries(model, state, {n: (i.shape, DTYPES.get(i.dtype)) for n, i in infos.items()}, path, strict)
    return {n: state[n] for n in infos if n in state}, apply


def _check_pickled_model(model, sd, path: str, strict: bool) -> None:
    if not isinstance(sd, dict) or not all(isinstance(k, str) for k in sd):
        raise CheckpointError(f"{path}: not a state dict (a dict of str -> tensor), got {type(sd).__name__}")
    bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"{path}: entries {', '.join(bad[:20])} are not tensors")
    _check_model_entries(model, model.state_dict(), {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}, path,
                         strict)


# the state entries of torch.optim's optimizers that have their parameter's shape
_PARAM_SHAPED = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta",
                           "sum", "grad_avg", "prev", "step_size", "ax", "exp_inf"})


def _check_optimizer_shapes(opt, saved_groups: list, entries, where: str) -> None:
    """``entries``: (saved param id, key, shape) of every tensor in the saved state. Each must
    have the shape of the optimizer's current state tensor there, or for the entries torch's
    optimizers keep per parameter, the parameter's shape: a state from another model is refused
    before anything is read into the optimizer."""
    params = [p for g in opt.param_groups for p in g["params"]]
    # the names mean the parameter's shape in torch.optim's optimizers only (others, e.g. a
    # projected or quantised state, use them for what they like)
    torch_optimizer = type(opt).__module__.startswith("torch.optim")
    ids = [pid for g in saved_groups for pid in g.get("params", ())]
    by_id = dict(zip(ids, params))
    wrong = []
    for pid, key, shape in entries:
        p = by_id.get(pid)
        if p is None:
            continue  # torch keeps state of ids outside the groups as it is
        live = opt.state.get(p, {}).get(key)
        want = tuple(live.shape) if isinstance(live, torch.Tensor) else \
            tuple(p.shape) if key in _PARAM_SHAPED and torch_optimizer else None
        if want is not None and tuple(shape) != want:
            wrong.append(f"state of parameter {pid} [{key!r}]: saved {list(shape)}, expected {list(want)}")
    if wrong:
        raise CheckpointError(f"{where}: optimizer state of another model: " + "; ".join(wrong[:20]))


def _saved_state_entries(sf) -> list:
    """(param id, key, shape) of the tensors in an optimizer state file, from its JSON and the
    tensor file's header (nothing read)."""
    st = sf.doc["state"].get("state") if isinstance(sf.doc.get("state"), dict) else None
    pairs = st.get("__dict__") if isinstance(st, dict) and list(st) == ["__dict__"] else \
        (list(st.items()) if isinstance(st, dict) else [])
    out = []
    for pair in pairs if isinstance(pairs, list) else []:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[1], dict)):
            continue
        pid, entry = pair
        for key, ref in entry.items():
            if isinstance(ref, dict) and list(ref) == ["__tensor__"] and ref["__tensor__"] in sf.infos:
                out.append((pid, key, sf.infos[ref["__tensor__"]].shape))
    return out


def _check_optimizer(opt, sd, where: str) -> None:
    if not isinstance(sd, dict) or not isinstance(sd.get("param_groups"), list) or not isinstance(sd.get("state"), dict):
        raise CheckpointError(f"{where}: not an optimizer state dict (needs 'state' and 'param_groups')")
    groups = opt.param_groups
    if len(groups) != len(sd["param_groups"]):
        raise CheckpointError(f"{where}: {len(sd['param_groups'])} parameter groups, but the optimizer has {len(groups)}")
    for pid, entry in sd["state"].items():
        if not isinstance(entry, dict):  # torch's optimizers keep a dict of state per parameter
            raise CheckpointError(f"{where}: the state of parameter {pid!r} must be an object, got {entry!r}")
    for gi, s in enumerate(sd["param_groups"]):
        ids = s.get("params") if isinstance(s, dict) else None
        if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise CheckpointError(f"{where}: parameter group {gi}: 'params' must be a list of parameter ids, got {ids!r}")
    for gi, (g, s) in enumerate(zip(groups, sd["param_groups"])):
        if not isinstance(s, dict) or len(s.get("params", ())) != len(g["params"]):
            raise CheckpointError(f"{where}: parameter group {gi} has {len(s.get('params', ())) if isinstance(s, dict) else '?'} "
                                  f"parameters, but the optimizer's has {len(g['params'])}")


def _meta_state(sf):
    """The decoded state of a state file with a meta tensor (shape and dtype, no data) for each
    saved tensor: what a dry run of load_state_dict takes, nothing read."""
    from .safetensors_io import torch_dtype_of

    metas = {name: torch.empty(info.shape, dtype=torch_dtype_of(sf.tensor_path, name, info.dtype), device="meta")
             for name, info in sf.infos.items()}
    return decode(sf.doc["state"], metas, sf.json_path)


class _Reader:
    """Names and checks the files of one checkpoint directory, ours or accelerate's."""

    def __init__(self, directory: str, allow_pickle: bool, load_kwargs: dict):
        self.dir = directory
        self.allow_pickle = allow_pickle
        self.load_kwargs = {k: v for k, v in load_kwargs.items() if k not in ("map_location", "weights_only")}
        self.marker = None
        if os.path.isfile(os.path.join(directory, MARKER)):
            self.marker = read_marker(directory)
        elif has_our_files(directory):
            raise CheckpointError(f"{directory}: incomplete checkpoint (no {MARKER}, which save_state writes last): "
                                  "a save was interrupted; load an earlier checkpoint")

    def path(self, name: str, what: str, required: bool = True) -> Optional[str]:
        p = os.path.join(self.dir, name)
        if self.marker is not None:
            files = self.marker["files"]
            if name not in files:
                if not required:
                    return None
                if os.path.exists(p):
                    raise CheckpointError(f"{p}: not part of the checkpoint recorded in {MARKER} (left over from "
                                          f"another save?); expected the {what} there")
                raise FileNotFoundError(f"{p}: missing from the checkpoint ({what})")
            if not os.path.isfile(p):
                raise FileNotFoundError(f"{p}: missing from the checkpoint ({what}), though {MARKER} lists it")
            size = os.path.getsize(p)
            if size != files[name]:
                raise CheckpointError(f"{p}: {size} bytes, but the checkpoint recorded {files[name]}: the file was "
                                      "modified or truncated after the save")
            return p
        if not os.path.isfile(p):
            if not required:
                return None
            raise FileNotFoundError(f"{p}: missing from the checkpoint ({what})")
        return p

    def has(self, name: str) -> bool:
        if self.marker is not None:
            return name in self.marker["files"]
        return os.path.isfile(os.path.join(self.dir, name))

    def open(self, name: str, what: str) -> StateFile:
        """A state saved as <name>.json (+ .safetensors), checked; no tensor data read yet."""
        self.path(f"{name}.json", what)
        sf = StateFile(self.dir, name, what)
        if sf.tensor_path is not None:
            self.path(os.path.basename(sf.tensor_path), what)
        return sf

    def state(self, name: str, what: str):
        """A state saved as <name>.json (+ .safetensors): read now, checked, in memory."""
        return self.open(name, what).load()

    def pickled(self, name: str, what: str, map_location="cpu"):
        return torch_load(self.path(name, what), what, allow_pickle=self.allow_pickle, map_location=map_location,
                          **self.load_kwargs)

    def either(self, stem: str, pkl_name: str, what: str, map_location="cpu"):
        """Our <stem>.json form when present, else accelerate's pickle file."""
        if self.has(f"{stem}.json"):
            return self.state(stem, what), os.path.join(self.dir, f"{stem}.json")
        return self.pickled(pkl_name, what, map_location), os.path.join(self.dir, pkl_name)


def _plan_load(acc, reader: _Reader, models: list, strict: bool, map_location) -> _Plan:
    plan = _Plan()
    d = reader.dir
    for i, model in enumerate(models):
        safe_name, bin_name = f"model{suffix(i)}.safetensors", f"pytorch_model{suffix(i)}.bin"
        if reader.has(model_shards.plan_name(i)):  # each process's shards (model_shards.py)
            read, apply = model_shards.plan_load(reader, i, model, acc._grads.strategy, strict)
            plan.reads.append(read)
            plan.applies.append(apply)
        elif reader.has(safe_name):
            path = reader.path(safe_name, f"weights of model {i}")
            targets, apply = _model_targets(model, path, strict, acc._grads.strategy)
            plan.reads.append(lambda p=path, t=targets: load_into(p, t))
            if apply is not None:
                plan.applies.append(apply)
        else:
            if not reader.has(bin_name):
                raise FileNotFoundError(f"{os.path.join(d, safe_name)}: missing from the checkpoint (weights of model "
                                        f"{i}; no {bin_name} or {model_shards.plan_name(i)} either)")
            path = os.path.join(d, bin_name)
            sd = reader.pickled(bin_name, f"weights of model {i}")
            if acc._grads.strategy.load_targets(model)[1] is not None:
                raise CheckpointError(f"{path}: pickled weights under full sharding are not supported; save with "
                                      "safe_serialization=True (the default)")
            _check_pickled_model(model, sd, path, strict)  # torch's load_state_dict copies until a mismatch
            plan.applies.append(lambda m=model, sd=sd: m.load_state_dict(sd, strict=strict))
    strategy = acc._grads.strategy
    # written under ZeRO: this process's shards resharded from whatever wrote them, or (no ZeRO
    # here, one process) each parameter's state assembled from every old process's runs. Whether
    # it was is the marker's word (its plan file listed, and then held to its recorded size like
    # every file), not a plan file lying in the directory.
    zero_saved = reader.has(zero_checkpoint.PLAN_FILE)
    if strategy.sharded_state or zero_saved:
        reads, applies = zero_checkpoint.plan_load(acc, strategy, reader) if strategy.sharded_state else \
            zero_checkpoint.plan_load_whole(acc, reader)
        plan.reads += reads
        plan.applies += applies
    for i, opt in enumerate([] if (strategy.sharded_state or zero_saved) else acc._optimizers):
        stem, what = f"optimizer{suffix(i)}", f"state of optimizer {i}"
        if reader.has(f"{stem}.json"):
            sf = reader.open(stem, what)
            skeleton = sf.skeleton()
            _check_optimizer(opt, skeleton, sf.json_path)
            _check_optimizer_shapes(opt, skeleton["param_groups"], _saved_state_entries(sf), sf.json_path)
            dry_run_optimizer(opt, _meta_state(sf), sf.json_path)
            # read straight into the optimizer's current state tensors where they fit; set
            # once every file has been read
            loaded = {}
            plan.reads.append(lambda o=opt, sf=sf, out=loaded: out.update(sd=sf.load(reuse=_optimizer_reuse(o, sf.doc))))
            plan.applies.append(lambda o=opt, out=loaded: o.load_state_dict(out["sd"]))
        else:
            where = os.path.join(d, f"{stem}.bin")
            sd = reader.pickled(f"{stem}.bin", what, map_location)
            _check_optimizer(opt, sd, where)
            state = sd["state"] if isinstance(sd["state"], dict) else {}
            _check_optimizer_shapes(opt, sd["param_groups"], [
                (pid, k, tuple(v.shape)) for pid, e in state.items() if isinstance(e, dict)
                for k, v in e.items() if isinstance(v, torch.Tensor)], where)
            dry_run_optimizer(opt, sd, where)
            plan.applies.append(lambda o=opt, sd=sd: o.load_state_dict(sd))
    for i, sched in enumerate(acc._schedulers):
        sd, where = reader.either(f"scheduler{suffix(i)}", f"scheduler{suffix(i)}.bin", f"state of scheduler {i}")
        if not isinstance(sd, dict):
            raise CheckpointError(f"{where}: a scheduler state must be a dict, got {type(sd).__name__}")
        dry_run_scheduler(sched, sd, where)
        plan.applies.append(lambda s=sched, sd=sd: s.load_state_dict(sd))
    saved_loaders = reader.marker.get("dataloaders") if reader.marker is not None else None
    resumed = {}  # data loader index -> (loader, its saved position): positions that record mid_epoch
    for i, dl in enumerate(acc._dataloaders):
        if reader.has(f"dataloader_{i}.json"):
            st = reader.state(f"dataloader_{i}", f"position of data loader {i}")
            _check_loader_state(st, os.path.join(d, f"dataloader_{i}.json"))
            plan.applies.append(lambda dl=dl, st=st, w=os.path.join(d, f"dataloader_{i}.json"):
                                _apply_loader_state(dl, st, w))
            if "mid_epoch" in st and callable(getattr(dl, "resume_from", None)):
                resumed[i] = (dl, st)
        elif saved_loaders is not None:
            warnings.warn(f"{d}: holds the positions of {saved_loaders} data loaders, this Accelerator has "
                          f"{len(acc._dataloaders)}; data loader {i} keeps its current position")
        sampler_name = f"sampler{suffix(i)}.bin"  # accelerate pickles a whole sampler (and its dataset)
        if reader.marker is None and reader.has(sampler_name):
            sampler = reader.pickled(sampler_name, f"sampler of data loader {i}")
            plan.applies.append(lambda dl=dl, s=sampler: _apply_pickled_sampler(dl, s))
    if acc.scaler is not None:
        if reader.has("scaler.json") or reader.has("scaler.pt"):
            st, where = reader.either("scaler", "scaler.pt", "loss scaler state")
            missing = [k for k in acc.scaler.STATE_KEYS if not isinstance(st, dict) or k not in st]
            if missing:
                raise CheckpointError(f"{where}: loss scaler state lacks {missing}")
            plan.applies.append(lambda st=st: acc.scaler.load_state_dict(st))
        elif reader.marker is None and acc.device.type == "cpu":
            warnings.warn(f"{d}: no scaler.pt (accelerate 1.15 trains fp16 on a CPU without a loss scaler); the "
                          "loss scaler keeps its current state")
        else:
            raise FileNotFoundError(f"{os.path.join(d, 'scaler.json')}: missing from the checkpoint (loss scaler state)")
    rank = acc.process_index
    epoch_starts, stateful_states = [], []
    rng_json, rng_pkl = f"random_states_{rank}.json", f"random_states_{rank}.pkl"
    if reader.has(rng_json) or reader.has(rng_pkl):
        st, where = reader.either(f"random_states_{rank}", rng_pkl, f"random states of process {rank}")
        check_rng_state(st, where)
        if "step" in st:
            if not isinstance(st["step"], int):
                raise CheckpointError(f"{where}: step must be an integer, got {st['step']!r}")
            plan.step = int(st["step"])
        if "dataloader_epoch_start" in st:
            _check_epoch_starts(st["dataloader_epoch_start"], where)
            epoch_starts = list(st["dataloader_epoch_start"])
        if "dataloader_state_dict" in st:
            _check_stateful_states(st["dataloader_state_dict"], where)
            stateful_states = list(st["dataloader_state_dict"])
        plan.applies.append(lambda st=st, w=where: set_rng_state(st, w))
    else:
        saved_n = reader.marker.get("num_processes") if reader.marker is not None else None
        if saved_n is not None and saved_n == acc.num_processes or \
                not any(re.match(r"^random_states_\d+\.(json|pkl)$", e) for e in os.listdir(d)):
            raise FileNotFoundError(f"{os.path.join(d, rng_json if reader.marker else rng_pkl)}: missing from the "
                                    f"checkpoint (random states of process {rank})")
        warnings.warn(f"{d}: no random states for process {rank} (saved by another number of processes); its "
                      "random number generators keep their current state")
    # Positions saved with `mid_epoch` (not those of older checkpoints, which resume as before):
    # the next epoch of each such loader is the resumed one; mid-epoch, it re-creates its
    # iterator under this process's record of the epoch's start (none when this process has no
    # random states here: saved by another number of processes, warned above).
    _plan_stateful_loaders(acc, reader, plan, stateful_states, d)
    for i, (dl, pos) in resumed.items():
        rec = epoch_starts[i] if pos["mid_epoch"] and i < len(epoch_starts) else None
        plan.applies.append(lambda dl=dl, rec=rec, pos=pos:
                            dl.resume_from(rec, pos["mid_epoch"], pos.get("batches_seen", 0)))
    if reader.marker is not None:
        saved = reader.marker.get("custom_objects", 0)
    else:
        saved = len([f for f in os.listdir(d) if re.search(r"^custom_checkpoint_\d+\.pkl$", f)])
    if saved != len(acc._custom_objects):
        raise RuntimeError(f"Number of custom checkpoints in folder {d} does not match the number of registered "
                           f"objects:\n\tFound checkpoints: {saved}\n\tRegistered objects: {len(acc._custom_objects)}\n"
                           "Please make sure to only load checkpoints from folders that were created with the same set "
                           "of registered objects.")
    for i, obj in enumerate(acc._custom_objects):
        st, _where = reader.either(f"custom_checkpoint_{i}", f"custom_checkpoint_{i}.pkl",
                                   f"state of registered object {i} ({type(obj).__qualname__})")
        plan.applies.append(lambda o=obj, st=st: o.load_state_dict(st))
    if reader.marker is not None:
        nxt = reader.marker.get("next_iteration")
        # checked now: the counter is set after everything else, when a bad value would leave
        # the job loaded but the load reported as failed
        if nxt is not None and (not isinstance(nxt, int) or isinstance(nxt, bool) or nxt < 0):
            raise CheckpointError(f"{os.path.join(d, MARKER)}: next_iteration must be a non-negative integer, "
                                  f"got {nxt!r}")
        plan.iteration = nxt
    return plan


def _optimizer_reuse(opt, doc) -> dict:
    """{tensor name in the file: the optimizer's current state tensor at the same place}."""
    cur = opt.state_dict()["state"]
    st = doc["state"].get("state") if isinstance(doc.get("state"), dict) else None
    pairs = st.get("__dict__") if isinstance(st, dict) else None
    out = {}
    for pair in pairs if isinstance(pairs, list) else []:
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], dict)):
            continue
        pid, entry = pair
        if not isinstance(pid, int) or not isinstance(cur.get(pid), dict):
            continue
        for key, ref in entry.items():
            live = cur[pid].get(key)
            if isinstance(ref, dict) and list(ref) == ["__tensor__"] and isinstance(live, torch.Tensor):
                out[ref["__tensor__"]] = live
    return out


def _apply_pickled_sampler(dl, loaded):
    ours = sampler_of(dl)
    if ours is not None and all(hasattr(loaded, a) for a in ("epoch", "initial_seed")) and \
            all(hasattr(ours, a) for a in ("epoch", "initial_seed")):
        ours.epoch, ours.initial_seed = loaded.epoch, loaded.initial_seed
    elif hasattr(dl, "set_sampler"):
        dl.set_sampler(loaded)


def load_state(acc, input_dir=None, load_kwargs: Optional[dict] = None, allow_pickle: bool = False,
               **load_model_func_kwargs):
    """Accelerator.load_state; see the module docstring and docs/checkpoints.md."""
    cfg = acc.project_configuration
    if input_dir is not None:
        input_dir = os.path.expanduser(os.fspath(input_dir))
        if not os.path.isdir(input_dir):
            raise ValueError(f"Tried to find {input_dir} but folder does not exist")
    elif cfg.automatic_checkpoint_naming:
        base = os.path.join(cfg.project_dir, "checkpoints")
        done = complete_checkpoints(base)
        if not done:
            raise ValueError(f"No complete checkpoint_<n> directory in {base} to load")
        input_dir = done[-1][1]
    else:
        raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
    load_kwargs = dict(load_kwargs or {})
    if load_kwargs.get("weights_only") is False:
        allow_pickle = True
    map_location = load_model_func_kwargs.pop("map_location", None)
    if map_location not in (None, "cpu", "on_device"):
        raise TypeError("Unsupported optimizer map location passed, please choose one of `None`, `'cpu'`, or "
                        "`'on_device'`")
    map_location = acc.device if map_location == "on_device" else "cpu"
    strict = load_model_func_kwargs.pop("strict", True)
    if load_model_func_kwargs:
        raise TypeError(f"load_state: unexpected arguments {sorted(load_model_func_kwargs)}")

    models = list(acc._models)
    for hook in list(acc.__dict__.get("_load_model_state_pre_hook", {}).values()):
        hook(models, input_dir)
    refuse_links_out(input_dir)
    reader = _Reader(input_dir, allow_pickle, load_kwargs)
    plan = _plan_load(acc, reader, models, strict, map_location)
    # Every file has been checked. The reads can still fail on an I/O error (the message names
    # the file): the parameters and optimizer state tensors may then hold part of the
    # checkpoint, while everything set by the applies (schedulers, scaler, RNG, step, ...) is
    # untouched. See docs/checkpoints.md.
    with torch.no_grad():
        for action in plan.reads:
            action()
        for action in plan.applies:
            action()
    for opt in acc._optimizers:
        # the norm DeepSpeed's engine reports for a skipped step is the last one its optimizer
        # stashed, which no checkpoint holds: a resumed engine reports 0.0 until a step is taken
        opt.engine_norm = None
    if plan.step is not None:
        acc.step = plan.step
    if plan.iteration is not None:
        cfg.iteration = int(plan.iteration)
    elif cfg.automatic_checkpoint_naming:
        m = AUTO_NAME_RE.match(os.path.basename(os.path.normpath(input_dir)))
        if m:  # accelerate's checkpoint_<n>: the next save is n + 1
            cfg.iteration = int(m.group(1)) + 1

"""save_state and the rest of the checkpoint API: directories that are complete or absent, never
half-written (load_state: checkpoint_load.py).

Layout (docs/checkpoints.md): models under accelerate's names (``model.safetensors``,
``model_1.safetensors``, ...), everything else without pickle (``optimizer.json`` +
``optimizer.safetensors``, ``scheduler.json``, ``scaler.json``, ``random_states_{rank}.json`` +
``.safetensors``, ``dataloader_{i}.json``, ``custom_checkpoint_{i}.json`` + ``.safetensors``),
and ``checkpoint.json`` written last: the list of files with their sizes, the save counter and
the number of processes. With ``safe_serialization=False`` the files are accelerate's own
(``torch.save``). Checkpoints written by accelerate 1.15 load too (``torch.load(weights_only=True)``).

Protocol: the writer fills a hidden sibling ``.<name>.tmp-<token>-n<node>``, every file
fsynced, then ``checkpoint.json``, then renames the directory into place and fsyncs the parent;
older checkpoints beyond ``total_limit`` are removed only after that. Nodes that share a file
system (they see each other's temporary directories) write into one, their lowest node's, which
alone is published. Processes agree (an all-reduce of an error flag) between the phases, so a
failure on one rank raises on every rank instead of leaving the others waiting in a barrier.
"""
from __future__ import annotations

import collections
import os
import re
import shutil
import time
import zlib
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.utils import hooks

from .checkpoint_layout import (AUTO_NAME_RE, CHECKPOINT_FORMAT, CHECKPOINT_VERSION, MARKER, complete_checkpoints,
                                loader_state, suffix)
from .checkpoint_load import load_state
from . import collectives, model_shards, zero_checkpoint
from .compilation import plain_keys
from .model_io import find_aliases, save_config_files, save_model as _save_model
from .durable import fsync_dir, write_durable
from .safetensors_io import after_ready, record_ready, save_file
from .state_io import CheckpointError, PickleRequiredError, rng_state, write_json_durable, write_state

__all__ = ["save_state", "load_state", "save", "save_model", "get_state_dict", "register_for_checkpointing",
           "register_save_state_pre_hook", "register_load_state_pre_hook", "complete_checkpoints",
           "CheckpointError", "PickleRequiredError", "MARKER"]

PAUSE_ENV = "ACCELERATE_C_TEST_PAUSE_SAVE"  # tests only: pause the writer after its first file
_LEFTOVER_RE = re.compile(r"^\.(?P<name>.+)\.(?:tmp|deleting)-(?P<token>[0-9a-f]+)(?:-n\d+)?$")


# ---- processes -----------------------------------------------------------------------------------
def _is_writer(acc) -> bool:
    if acc.project_configuration.save_on_each_node:
        return acc.is_local_main_process
    return acc.is_main_process


def _agree(acc, ok: bool) -> bool:
    """True on every process when every process says ok (an all-reduce, not a bare barrier: a
    failing rank does not leave the others waiting)."""
    if acc.num_processes == 1:
        return ok
    import torch.distributed as dist

    flag = torch.tensor([0 if ok else 1], dtype=torch.int64, device=acc.device)
    collectives.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item()) == 0


def _check(acc, err: Optional[BaseException], doing: str):
    if not _agree(acc, err is None):
        if err is not None:
            raise err
        raise RuntimeError(f"another process failed to {doing}; see its error")


def _gather(acc, values) -> list:
    """Every process's list of ints (one all_gather)."""
    t = torch.tensor(values, dtype=torch.int64, device=acc.device)
    if acc.num_processes == 1:
        return [t.tolist()]
    out = [torch.empty_like(t) for _ in range(acc.num_processes)]
    collectives.all_gather(out, t)
    return [o.tolist() for o in out]


def _token_and_nodes(acc, final: str):
    """A token naming this save (rank 0's random draw, shared by all: a pid could repeat across
    hosts or after a restart) and every rank's node index (ranks of one node are contiguous, as
    every launcher numbers them; a node starts at each local rank 0). A checkpoint is written by
    every process into one directory: processes that name different ones are refused."""
    rows = _gather(acc, [acc.local_process_index, int.from_bytes(os.urandom(6), "little"),
                         zlib.crc32(final.encode("utf-8", "surrogateescape"))])
    if len({row[2] for row in rows}) > 1:
        import torch.distributed as dist

        paths = [None] * acc.num_processes
        dist.all_gather_object(paths, final)
        raise ValueError("save_state: the processes name different checkpoint directories ("
                         + ", ".join(f"rank {r}: {p}" for r, p in enumerate(paths)) + "); every process writes its "
                         "part of one checkpoint, so every process must pass the same directory")
    nodes, node = [], -1
    for local, _, _ in rows:
        if local == 0 or not nodes:
            node += 1
        nodes.append(node)
    return f"{rows[0][1]:x}", nodes


def _run_on_writer(acc, fn: Callable, doing: str):
    err, out = None, None
    if _is_writer(acc):
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, on every process
            err = e
    _check(acc, err, doing)
    return out


# ---- small API ---------------------------------------------------------------------------------------
def get_state_dict(acc, model, strategy, unwrap: bool = True, keep: bool | None = None):
    """The model's full state dict, as the gradient strategy has it (one process, DDP: the
    model's own; full sharding gathers the shards, to the main process unless `keep` says
    this process needs them too)."""
    if unwrap:
        model = acc.unwrap_model(model)
    return strategy.model_state_dict(model, keep)


def register_for_checkpointing(acc, *objects):
    bad = [f"\n\t- Item at index {i}, `{type(o).__qualname__}`" for i, o in enumerate(objects)
           if not (callable(getattr(o, "state_dict", None)) and callable(getattr(o, "load_state_dict", None)))]
    if bad:
        raise ValueError("All `objects` must include a `state_dict` and `load_state_dict` function to be stored. "
                         "The following inputs are invalid:" + "".join(bad))
    acc._custom_objects.extend(objects)


def _hook_dict(acc, attr: str) -> collections.OrderedDict:
    d = acc.__dict__.get(attr)
    if d is None:
        d = acc.__dict__[attr] = collections.OrderedDict()
    return d


def register_save_state_pre_hook(acc, hook) -> hooks.RemovableHandle:
    d = _hook_dict(acc, "_save_model_state_pre_hook")
    handle = hooks.RemovableHandle(d)
    d[handle.id] = hook
    return handle


def register_load_state_pre_hook(acc, hook) -> hooks.RemovableHandle:
    d = _hook_dict(acc, "_load_model_state_pre_hook")
    handle = hooks.RemovableHandle(d)
    d[handle.id] = hook
    return handle


def torch_save_durable(obj, path: str) -> None:
    write_durable(path, lambda f: torch.save(obj, f))


def _safe_tensors(obj, what: str, drop_aliases: bool):
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        raise TypeError(f"{what} with safe_serialization=True needs a dict of str -> tensor, got "
                        f"{type(obj).__name__}")
    if drop_aliases:
        aliases = find_aliases(obj)
        obj = {k: v for k, v in obj.items() if k not in aliases}
    return obj


def save(acc, obj, f, safe_serialization: bool = False):
    """accelerate's Accelerator.save: once per machine (main process, or each node's local main
    with save_on_each_node). torch.save, or a safetensors file for a dict of tensors (state
    dicts lose tied aliases, as accelerate does). Paths are written atomically and fsynced."""
    if not _is_writer(acc):
        return
    if safe_serialization:
        tensors = _safe_tensors(obj, "Accelerator.save", isinstance(obj, collections.OrderedDict))
        save_file(tensors, f, metadata={"format": "pt"})
    elif isinstance(f, (str, os.PathLike)):
        torch_save_durable(obj, os.fspath(f))
    else:
        torch.save(obj, f)


def save_model(acc, model, save_directory, max_shard_size="10GB", safe_serialization: bool = True):
    """accelerate's Accelerator.save_model through model_io.save_model (atomic shards); the
    writer process writes, every process returns once the files are in place."""
    save_directory = os.fspath(save_directory)
    if os.path.isfile(save_directory):
        raise ValueError(f"Provided path ({save_directory}) should be a directory, not a file")
    if any(p.device.type == "meta" for p in model.parameters()):
        raise RuntimeError("You can't save the model since some parameters are on the meta device.")
    # where it is written (a collective); a compiled model's weights under the names of the
    # user's model (accelerate keeps torch.compile's `_orig_mod.`, a folder from_pretrained cannot
    # read: a difference from accelerate, README)
    state_dict = acc.get_state_dict(model, keep=_is_writer(acc))
    if state_dict:
        state_dict = plain_keys(state_dict)
    unwrapped = acc.unwrap_model(model, keep_torch_compile=False)

    def write():
        _save_model(state_dict, save_directory, max_shard_size=max_shard_size, safe_serialization=safe_serialization)
        # a PreTrainedModel's config.json (+ generation_config.json), so from_pretrained(dir) loads
        # it: accelerate writes only the weights (a difference from accelerate, docs/checkpoints.md)
        save_config_files(unwrapped, save_directory)

    _run_on_writer(acc, write, "save the model")


def _remove_leftovers(base: str, name: str, token: str, auto: bool) -> None:
    """Temporary or half-deleted directories that a crashed save left next to ``name``."""
    for entry in os.listdir(base):
        m = _LEFTOVER_RE.match(entry)
        if not m or m.group("token") == token:
            continue
        if m.group("name") == name or (auto and AUTO_NAME_RE.match(m.group("name"))):
            shutil.rmtree(os.path.join(base, entry), ignore_errors=True)


def _prune(base: str, limit: int, token: str) -> None:
    done = complete_checkpoints(base)
    for i, path in done[: max(0, len(done) - max(1, limit))]:
        trash = os.path.join(base, f".checkpoint_{i}.deleting-{token}")
        os.rename(path, trash)  # out of sight first: a crash in rmtree leaves no half checkpoint
        fsync_dir(base)
        shutil.rmtree(trash, ignore_errors=True)


def _publish(tmp: str, final: str) -> None:
    fsync_dir(tmp)
    parent = os.path.dirname(final)
    if not os.path.lexists(final):
        os.rename(tmp, final)
        fsync_dir(parent)
        return
    # an existing directory (an explicit output_dir): its marker goes first, the files are
    # renamed in one by one (each atomically), the new marker last
    marker = os.path.join(final, MARKER)
    if os.path.lexists(marker):
        os.unlink(marker)
        fsync_dir(final)
    for entry in sorted(os.listdir(tmp)):
        if entry == MARKER:
            continue
        src, dst = os.path.join(tmp, entry), os.path.join(final, entry)
        if os.path.isdir(src) and os.path.isdir(dst) and not os.path.islink(dst):
            shutil.rmtree(dst)
        os.replace(src, dst)
    fsync_dir(final)
    os.replace(os.path.join(tmp, MARKER), marker)
    fsync_dir(final)
    os.rmdir(tmp)
    fsync_dir(parent)


# ---- what goes into a checkpoint ------------------------------------------------------------------------
def _pause_for_tests():
    path = os.environ.get(PAUSE_ENV)
    if path:
        with open(path, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)


def _writer_jobs(acc, tmp: str, weights: list, safe: bool) -> list:
    """(label, write) pairs, one file (pair) each. Every state_dict() is taken here, on the
    calling thread, and so are the CUDA events the writes wait for (record_ready: the work
    queued so far on this thread's current streams); only encoding and writing run on the
    worker threads."""
    jobs = []
    states = list(weights)

    def add(label, stem, state, what, pkl_name):
        states.append(state)
        if safe:
            jobs.append((label, lambda: write_state(tmp, stem, state, what)))
        else:
            jobs.append((label, lambda: torch_save_durable(state, os.path.join(tmp, pkl_name))))

    for i, sd in enumerate(weights):
        if safe:
            name = f"model{suffix(i)}.safetensors"
            jobs.append((name, lambda sd=sd, name=name: save_file(
                _safe_tensors(sd, "model weights", True), os.path.join(tmp, name), metadata={"format": "pt"})))
        else:
            name = f"pytorch_model{suffix(i)}.bin"
            jobs.append((name, lambda sd=sd, name=name: torch_save_durable(sd, os.path.join(tmp, name))))
    sharded = acc._grads.strategy.sharded_state  # each process writes its own optimizer shards
    for kind, objs in (("optimizer", [] if sharded else acc._optimizers), ("scheduler", acc._schedulers)):
        for i, obj in enumerate(objs):
            add(kind, f"{kind}{suffix(i)}", obj.state_dict(), f"{kind}.state_dict()", f"{kind}{suffix(i)}.bin")
    for i, dl in enumerate(acc._dataloaders):
        st = loader_state(dl)
        jobs.append(("dataloader", lambda st=st, i=i: write_state(tmp, f"dataloader_{i}", st, f"dataloader {i}")))
        if not safe and getattr(dl, "use_stateful_dataloader", False):  # accelerate's own file for it too
            jobs.append(("dataloader", lambda sd=dl.state_dict(), i=i: torch_save_durable(
                sd, os.path.join(tmp, f"dl_state_dict{suffix(i)}.bin"))))
    if acc.scaler is not None:
        add("scaler", "scaler", acc.scaler.state_dict(), "scaler", "scaler.pt")
    for i, obj in enumerate(acc._custom_objects):
        add("custom", f"custom_checkpoint_{i}", obj.state_dict(), f"{type(obj).__qualname__}.state_dict()",
            f"custom_checkpoint_{i}.pkl")
    ready = record_ready(states)
    return [(label, after_ready(ready, write)) for label, write in jobs]


def _run_jobs(jobs: list) -> None:
    """Writes the files, several at once: one file per thread (the C writer releases the GIL,
    and writes to different files do not wait for each other's inode lock)."""
    if not jobs:
        return
    first = [True]

    def run(job):
        job[1]()
        if first[0]:
            first[0] = False
            _pause_for_tests()

    if len(jobs) == 1:
        run(jobs[0])
        return
    with ThreadPoolExecutor(max_workers=min(len(jobs), max(2, min(4, os.cpu_count() or 1)))) as ex:
        futures = [ex.submit(run, job) for job in jobs]
        errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e


# ---- save_state ----------------------------------------------------------------------------------------
def save_state(acc, output_dir=None, safe_serialization: bool = True, **save_model_func_kwargs):
    """Accelerator.save_state; see the module docstring and docs/checkpoints.md."""
    cfg = acc.project_configuration
    auto = cfg.automatic_checkpoint_naming
    if auto:
        if cfg.project_dir is None:
            raise ValueError("automatic_checkpoint_naming needs ProjectConfiguration(project_dir=...)")
        base = os.path.abspath(os.path.join(cfg.project_dir, "checkpoints"))
        final = os.path.join(base, f"checkpoint_{cfg.iteration}")
        if os.path.lexists(final):
            raise ValueError(f"Checkpoint directory {final} ({cfg.iteration}) already exists. Please manually "
                             "override `self.save_iteration` with what iteration to start with.")
    else:
        if output_dir is None:
            raise ValueError("save_state needs an output_dir, or ProjectConfiguration(automatic_checkpoint_naming=True)")
        final = os.path.abspath(os.path.expanduser(os.fspath(output_dir)))
        base = os.path.dirname(final)
        if os.path.lexists(final) and not os.path.isdir(final):
            raise ValueError(f"save_state: {final} exists and is not a directory")
    name = os.path.basename(final)
    token, nodes = _token_and_nodes(acc, final)
    node, n_nodes, rank = nodes[acc.process_index], nodes[-1] + 1, acc.process_index
    agent = acc.is_local_main_process  # sets up and publishes for its node
    tmp_of = [os.path.join(base, f".{name}.tmp-{token}-n{k}") for k in range(n_nodes)]

    # 1. every node's agent makes a temporary directory of its own: on a shared file system
    #    the nodes' directories sit side by side, on node-local disks each is alone
    err, made = None, False
    if agent:
        try:
            os.makedirs(base, exist_ok=True)
            _remove_leftovers(base, name, token, auto)
            os.mkdir(tmp_of[node])
            made = True
        except Exception as e:  # noqa: BLE001
            err = e
    if not _agree(acc, err is None):
        if made:
            os.rmdir(tmp_of[node])
        _check(acc, err, "create the checkpoint directory")

    # 2. the nodes that see each other's directories share a file system: the first of them
    #    leads, and every rank of the group writes into the leader's directory; the others'
    #    empty directories go. One directory, one publish, one marker per file system.
    err, lead = None, -1
    if agent:
        try:
            lead = min(k for k in range(n_nodes) if k == node or os.path.isdir(tmp_of[k]))
        except Exception as e:  # noqa: BLE001
            err = e
    leaders = [row[0] for row in _gather(acc, [lead])]
    _check(acc, err, "find the nodes sharing the checkpoint directory")
    node_leader = {nodes[r]: leaders[r] for r in range(acc.num_processes) if leaders[r] >= 0}
    my_leader = node_leader[node]
    tmp = tmp_of[my_leader]
    leader = agent and my_leader == node
    group = [r for r in range(acc.num_processes) if node_leader[nodes[r]] == my_leader]
    # the files every process shares: written once per file system with save_on_each_node,
    # else once, by the main process
    writer = leader if cfg.save_on_each_node else acc.is_main_process
    keeps = leader and (cfg.save_on_each_node or 0 in group)
    err = None
    if agent and not leader:
        try:
            os.rmdir(tmp_of[node])
        except Exception as e:  # noqa: BLE001
            err = e

    # 3. every rank writes its part
    try:
        if err is not None:
            raise err
        strategy = acc._grads.strategy
        if strategy.sharded_weights:  # each process its shards of the weights (model_shards.py)
            weights = [{} for _ in acc._models]
        else:  # the weights where they are written (full sharding gathers them there; a collective)
            weights = [get_state_dict(acc, m, strategy, unwrap=False, keep=writer) for m in acc._models]
        for hook in list(acc.__dict__.get("_save_model_state_pre_hook", {}).values()):
            hook(acc._models, weights, tmp)
        jobs = _writer_jobs(acc, tmp, [] if strategy.sharded_weights else weights, safe_serialization) \
            if writer else []
        if strategy.sharded_weights:  # safetensors whatever safe_serialization says, as the optimizer shards
            jobs += model_shards.save_jobs(acc, strategy, tmp, rank, acc.is_main_process)
        if strategy.sharded_state:  # ZeRO: every process its own shard, the main one the plans
            jobs += zero_checkpoint.save_jobs(acc, strategy, tmp, rank, acc.is_main_process)
        states = rng_state(acc.step)
        # per process, per data loader: the RNG states its epoch under way began with (None when
        # none is), which a resume replays to re-create that epoch's iterator (data_loader.py)
        states["dataloader_epoch_start"] = [
            dl.resume_position()["epoch_start"] if callable(getattr(dl, "resume_position", None)) else None
            for dl in acc._dataloaders]
        # per process, per data loader: a stateful loader's state_dict() (None for the others);
        # each process has its own (its shard of the data, or under dispatch the main one's reads)
        states["dataloader_state_dict"] = [dl.state_dict() if getattr(dl, "use_stateful_dataloader", False) else None
                                           for dl in acc._dataloaders]
        if safe_serialization:
            jobs.append(("rng", lambda: write_state(tmp, f"random_states_{rank}", states, "random states")))
        else:
            jobs.append(("rng", lambda: torch_save_durable(states, os.path.join(tmp, f"random_states_{rank}.pkl"))))
        _run_jobs(jobs)
        err = None
    except Exception as e:  # noqa: BLE001
        err = e
    if not _agree(acc, err is None):
        if leader:
            shutil.rmtree(tmp, ignore_errors=True)
        _agree(acc, True)  # every process leaves after the clean-up
        if err is not None:
            raise err
        raise RuntimeError(f"another process failed while writing the checkpoint; {final} was not written")

    # 4. each leader checks that every rank of its group delivered, writes the marker, publishes
    def finish():
        rng_name = "random_states_{}." + ("json" if safe_serialization else "pkl")
        expected = [rng_name.format(r) for r in group]
        if acc._grads.strategy.sharded_state:
            expected += [f"{zero_checkpoint.shard_stem(i, r)}{ext}" for r in group
                         for i in range(len(acc._optimizers)) for ext in (".safetensors", "_state.json")]
            expected.append(zero_checkpoint.PLAN_FILE)
        if acc._grads.strategy.sharded_weights:
            expected += [n for i in range(len(acc._models)) for n in model_shards.files_of(i, group)]
        absent = [n for n in expected if not os.path.isfile(os.path.join(tmp, n))]
        if absent:
            raise CheckpointError(f"{tmp}: {', '.join(absent)} missing after every process reported its write done "
                                  "(a file system that does not show other nodes' files?)")
        files = {}
        for entry in sorted(os.listdir(tmp)):
            path = os.path.join(tmp, entry)
            if not entry.startswith(".") and os.path.isfile(path):
                files[entry] = os.path.getsize(path)
        marker = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "safe_serialization": bool(safe_serialization),
                  "iteration": cfg.iteration, "next_iteration": cfg.iteration + 1, "step": int(acc.step),
                  "num_processes": acc.num_processes, "ranks": group,
                  "nodes": sorted({nodes[r] for r in group}), "models": len(weights), "optimizers": len(acc._optimizers),
                  "schedulers": len(acc._schedulers), "dataloaders": len(acc._dataloaders),
                  "scaler": acc.scaler is not None, "custom_objects": len(acc._custom_objects), "files": files}
        write_json_durable(os.path.join(tmp, MARKER), marker)
        _publish(tmp, final)
        if auto and cfg.total_limit is not None:
            _prune(base, cfg.total_limit, token)

    err = None
    if keeps:
        try:
            finish()
        except Exception as e:  # noqa: BLE001
            err = e
            shutil.rmtree(tmp, ignore_errors=True)
    elif leader:
        # without save_on_each_node only the main process's file system gets a checkpoint
        shutil.rmtree(tmp, ignore_errors=True)
        warnings.warn(f"save_state: node {node} does not see the main process's {base}; the random states of "
                      f"processes {group} are not saved (ProjectConfiguration(save_on_each_node=True) writes a "
                      "checkpoint on every node's disk)")
    _check(acc, err, "complete the checkpoint")
    cfg.iteration += 1
    return Path(final)




def save_sharded_optimizers(acc, directory: str) -> None:
    """Each process writes its own shard of every prepared optimizer's state into `directory` (the
    main process also the plans: zero_checkpoint.py), for a Trainer that saves the model apart.
    A collective; errors are agreed, so no process waits for one that failed. Nothing is written
    when the optimizers are not sharded."""
    strategy = acc._grads.strategy
    if not strategy.sharded_state:
        raise RuntimeError("save_sharded_optimizers: the optimizers are not sharded (no ZeRO / FSDP strategy)")
    _write_own_shards(acc, directory, zero_checkpoint.save_jobs, "save its optimizer shard")


def load_sharded_optimizers(acc, directory: str) -> None:
    """The optimizers' shards from `directory` (written by save_sharded_optimizers on any number
    of processes): every file checked before anything changes, then each process's ranges read."""
    strategy = acc._grads.strategy
    reads, applies = zero_checkpoint.plan_load(acc, strategy, zero_checkpoint.PlainFiles(directory))
    for read in reads:
        read()
    for apply in applies:
        apply()


def save_model_shards(acc, directory: str) -> None:
    """Each process writes its shard of every prepared model's weights into `directory` (the main
    process also the plans and the buffers: model_shards.py), for a Trainer checkpoint under
    FSDP's SHARDED_STATE_DICT. A collective; errors are agreed, so no process waits for one
    that failed."""
    strategy = acc._grads.strategy
    if not strategy.sharded_weights:
        raise RuntimeError("save_model_shards: the weights are not sharded (full sharding with SHARDED_STATE_DICT, "
                           "or DeepSpeed stage 3)")
    _write_own_shards(acc, directory, model_shards.save_jobs, "save its shard of the weights")


def _write_own_shards(acc, directory: str, save_jobs, what: str) -> None:
    """Runs this process's writes of `save_jobs` into `directory`; the error of any process is
    agreed on (_check), so no process goes on to wait for one that failed."""
    err = None
    try:
        os.makedirs(directory, exist_ok=True)
        for _, write in save_jobs(acc, acc._grads.strategy, directory, acc.process_index, acc.is_main_process):
            write()
    except Exception as e:  # noqa: BLE001
        err = e
    _check(acc, err, f"{what} in {directory}")


def load_model_shards(acc, model, directory: str, strict: bool = True) -> None:
    """`model`'s weights from the shards in `directory` (save_model_shards, on any number of
    processes): every file checked before anything changes; then this process's elements read,
    whole parameters where `model` is not (or not yet) sharded."""
    i = next((k for k, m in enumerate(acc._models) if m is model), 0)
    read, apply = model_shards.plan_load(zero_checkpoint.PlainFiles(directory), i, model, acc._grads.strategy, strict)
    read()
    apply()


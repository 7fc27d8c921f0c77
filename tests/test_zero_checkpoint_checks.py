"""Sharded checkpoints (ZeRO, full sharding) from a stranger, loaded on one process: each fault
below (found by the zero_load_state fuzz target or while writing it: docs/security.md, "Findings")
is refused with an error naming the file, and the job stays bitwise as it was. And a checkpoint
whose model two optimizers share loads on one process, to plain torch's values.

The checkpoints are written once per test process by 2 launched processes
(tests/scripts/zero_fuzz_fixtures.py, through pyfuzz_zero.fixtures(); the fuzz target's short run
shares them)."""
from __future__ import annotations

import json
import os
import shutil

import pytest

import pyfuzz_zero
from accelerate_c.checkpoint_layout import MARKER
from accelerate_c.state_io import CheckpointError
from checkpoint_helpers import assert_state_equal
from helpers import fresh_state  # noqa: F401  (an autouse fixture: fresh accelerator states)

PLAN = "zero_plan.json"


def _copy(tmp_path, kind: str = "zero2") -> str:
    d = str(tmp_path / "ck")
    shutil.copytree(os.path.join(pyfuzz_zero.fixtures(), kind, "pristine"), d)
    return d


def _edit_json(d: str, name: str, edit) -> None:
    """edit(doc) on file `name`, then checkpoint.json's recorded sizes made consistent (so the
    checks behind the size gate are the ones that see the fault)."""
    path = os.path.join(d, name)
    with open(path) as f:
        doc = json.load(f)
    edit(doc)
    with open(path, "w") as f:
        json.dump(doc, f)
    _fix_sizes(d)


def _fix_sizes(d: str) -> None:
    with open(os.path.join(d, MARKER)) as f:
        marker = json.load(f)
    for name in marker["files"]:
        marker["files"][name] = os.path.getsize(os.path.join(d, name))
    with open(os.path.join(d, MARKER), "w") as f:
        json.dump(marker, f)


def _refused(d: str, names: str, *also: str, error=CheckpointError):
    """load_state of `d` by a fresh one-process job: `error` naming file `names` (and saying
    `also`), the job bitwise unchanged."""
    job = pyfuzz_zero.ZeroJob(pyfuzz_zero.fixtures())
    before = pyfuzz_zero.job_snapshot(job)
    with pytest.raises(error) as e:
        job.acc.load_state(d)
    msg = str(e.value)
    assert os.path.join(d, names) in msg and all(a in msg for a in also), msg
    assert_state_equal(pyfuzz_zero.job_snapshot(job), before, "the job after a refused load")


def _set(*path_and_value):
    *path, value = path_and_value

    def edit(doc):
        node = doc
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value
    return edit


def test_a_plan_whose_optimizers_are_not_a_list_is_refused_by_name(tmp_path):
    d = _copy(tmp_path)
    _edit_json(d, PLAN, lambda doc: doc.update(optimizers={"0": doc["optimizers"][0]}))
    _refused(d, PLAN, "'optimizers' must be a list")


def test_a_group_plan_that_does_not_rebuild_is_refused_by_name(tmp_path):
    d = _copy(tmp_path)
    _edit_json(d, PLAN, _set("optimizers", 0, "groups", 0, "plan", "esize", "4"))
    _refused(d, PLAN, "shard group 0 of optimizer 0: not a shard plan")


def test_a_parameter_index_out_of_range_is_refused_by_name(tmp_path):
    d = _copy(tmp_path)
    _edit_json(d, PLAN, _set("optimizers", 0, "groups", 0, "params", 0, 10 ** 6))
    _refused(d, PLAN, "optimizer index 1000000")


def test_a_plan_of_fewer_processes_than_its_groups_is_refused(tmp_path):
    """The old load read the shards of the plan's world only: process 1's part of every
    parameter's state stayed zeros, and the load succeeded."""
    d = _copy(tmp_path)
    _edit_json(d, PLAN, _set("world", 1))
    _refused(d, PLAN, "planned over 2 processes, the checkpoint's world is 1")


def test_param_groups_that_are_not_objects_are_refused_before_anything_changes(tmp_path):
    """The old load set the param_groups last, in the apply phase: after the weights had been
    read, a TypeError (a half-loaded job)."""
    d = _copy(tmp_path)
    _edit_json(d, "zero_optimizer_rank0_state.json", _set("state", "param_groups", 5))
    _refused(d, "zero_optimizer_rank0_state.json", "'param_groups' must be a list of 2 objects")


def test_a_step_the_optimizer_refuses_is_refused_before_anything_changes(tmp_path):
    """The old load installed the state as it was: a "step" that is an object loaded, and the
    next optimizer step failed. Now the optimizer's own load_state_dict is tried on a stand-in."""
    d = _copy(tmp_path)

    def edit(doc):
        params = doc["state"]["params"]
        params[sorted(params)[0]]["other"]["step"] = {"a": 1}
    _edit_json(d, "zero_optimizer_rank0_state.json", edit)
    _refused(d, "zero_optimizer_rank0_state.json", "AdamW.load_state_dict refuses this state")


def test_two_processes_shard_files_swapped_are_refused(tmp_path):
    """Same names, shapes and sizes: the old load read process 1's state as process 0's."""
    d = _copy(tmp_path)
    a, b = (os.path.join(d, f"zero_optimizer_rank{r}.safetensors") for r in (0, 1))
    os.rename(a, a + ".tmp")
    os.rename(b, a)
    os.rename(a + ".tmp", b)
    _refused(d, "zero_optimizer_rank0.safetensors", "holds the shard of process 1 of 2")


def test_a_shard_state_of_another_size_than_recorded_is_refused(tmp_path):
    """ZeRO's files are held to checkpoint.json's sizes like every other file (they were not)."""
    d = _copy(tmp_path)
    with open(os.path.join(d, "zero_optimizer_rank1_state.json"), "a") as f:
        f.write("\n")
    _refused(d, "zero_optimizer_rank1_state.json", "but the checkpoint recorded")


def test_a_missing_plan_is_named(tmp_path):
    """The marker lists the plan: its absence is named (the old load went the unsharded way and
    named optimizer.bin)."""
    d = _copy(tmp_path)
    os.unlink(os.path.join(d, PLAN))
    _refused(d, PLAN, "missing from the checkpoint", error=FileNotFoundError)


def test_a_checkpoint_two_optimizers_share_loads_on_one_process():
    """ZeRO-2 on 2 processes with two AdamW optimizers over one model (each shard group holds
    parameters of both; the plan lists the other optimizer's as null): one process loads it, to
    what plain torch computes. (The old load indexed the parameters with the null: TypeError.)"""
    import torch
    from zero_fuzz_fixtures import two_optimizers

    from accelerate_c import Accelerator
    from helpers import reset_all_states

    reset_all_states()
    acc = Accelerator(cpu=True)
    model, opts = two_optimizers()
    model, *opts = acc.prepare(model, *opts)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    acc.load_state(os.path.join(pyfuzz_zero.fixtures(), "two_optimizers"))
    pyfuzz_zero.check_against_torch(model, opts, "two optimizers")


def _del(*path):
    def edit(doc):
        node = doc
        for p in path[:-1]:
            node = node[p] if not callable(p) else p(node)
        del node[path[-1]]
    return edit


def _first_entry(params):
    return params[sorted(params)[0]]


@pytest.mark.parametrize("label,edit,says", [
    ("an entry without keys", _del("state", "params", _first_entry, "keys"), "must be an object with 'keys'"),
    ("an entry without other", _del("state", "params", _first_entry, "other"), "must be an object with 'keys'"),
    ("params null", _set("state", "params", None), "'params' must be an object"),
    ("no param_groups", _del("state", "param_groups"), "'param_groups' must be a list"),
])
def test_a_malformed_shard_state_is_refused_by_name(tmp_path, label, edit, says):
    """Found by the fuzz target: the old load indexed these documents unchecked (KeyError,
    TypeError, naming nothing)."""
    d = _copy(tmp_path, "zero1")
    _edit_json(d, "zero_optimizer_rank1_state.json", edit)
    _refused(d, "zero_optimizer_rank1_state.json", says)


def test_a_later_load_keeps_no_param_group_setting_of_an_earlier_one(tmp_path):
    """Found by the fuzz target: the old one-process load merged the saved param_groups settings
    into the live groups, so a key one checkpoint brought stayed through every later load (torch's
    load_state_dict, which the load now runs, replaces the groups)."""
    d = _copy(tmp_path, "fsdp")
    _edit_json(d, "zero_optimizer_rank0_state.json",
               lambda doc: doc["state"]["param_groups"][0].update(maximize_extra=True))
    pristine = os.path.join(pyfuzz_zero.fixtures(), "fsdp", "pristine")
    job = pyfuzz_zero.ZeroJob(pyfuzz_zero.fixtures())
    job.acc.load_state(d)
    assert job.opt.param_groups[0]["maximize_extra"] is True  # torch keeps what a state dict brings
    job.acc.load_state(pristine)
    got = pyfuzz_zero.job_snapshot(job)["optimizer"]  # before the next job resets the states
    clean = pyfuzz_zero.ZeroJob(pyfuzz_zero.fixtures())
    clean.acc.load_state(pristine)
    assert_state_equal(got, pyfuzz_zero.job_snapshot(clean)["optimizer"], "the optimizer after the later load")

"""The `zero_load_state` fuzz target (docs/security.md): `load_state` of SHARDED checkpoints, mutated.

The pristine checkpoints are written once per run by a real job of 2 processes launched through
the real launcher (tests/scripts/zero_fuzz_fixtures.py): ZeRO-1, ZeRO-2 and ZeRO-3 (accelerate's
DeepSpeedPlugin) and full sharding (its FullyShardedDataParallelPlugin), each with its shard plan
`zero_plan.json` and per process `zero_optimizer_rank{r}.safetensors` + `_state.json`. The
fuzzing process loads them into ONE process: there nothing is sharded, and load_state assembles
each parameter's optimizer state from every old process's shard (zero_checkpoint.plan_load_whole),
as a user resuming a multi-process run on one machine does.

Each example takes one kind, mutates a copy of its checkpoint as the `load_state` target does
(tests/pyfuzz.py: bits flipped, files truncated, swapped, deleted, extra files, symbolic links out
of the directory, JSON nodes edited, sizes in checkpoint.json made consistent), with two more
kinds of JSON edit aimed at the shard plan and at the shard state files, and requires the same
outcome (pyfuzz.check_load): an error naming a file of the checkpoint with the job bitwise as it
was, or a load, equal to the pristine one's when no byte inside the directory changed; never
pickle, an open() outside the directory or a hang.

The pristine loads themselves are held to plain torch once per run: the model and AdamW trained
on the whole global batches in this process (ZeRO and full sharding train as DDP does).
"""
from __future__ import annotations

import atexit
import functools
import os
import shutil
import sys
import tempfile

import torch
from hypothesis import strategies as st

import pyfuzz

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts")
if SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)

KINDS = ("zero1", "zero2", "zero3", "fsdp")
ZERO_OPS = pyfuzz.MUTATION_OPS + ("json_edit_plan", "json_edit_shard_state")
# the files the two extra JSON edits pick among
FOCUS = {"json_edit_plan": r"zero_plan\.json", "json_edit_shard_state": r"zero_optimizer(_\d+)?_rank\d+_state\.json"}
# extra files: a third process's shard, a second optimizer's, the unsharded optimizer's files
EXTRAS = ("zero_optimizer_rank2.safetensors", "zero_optimizer_rank2_state.json", "zero_optimizer_1_rank0.safetensors",
          "optimizer.json", "optimizer.safetensors", "optimizer.bin", "zero_plan.json", "notes.txt")
FIXTURE_STEPS = 3  # tests/scripts/zero_fuzz_fixtures.py's STEPS (before the pristine save)


@functools.lru_cache(maxsize=None)  # the fixtures are written once per process, at first use
def fixtures() -> str:
    """The directory tests/scripts/zero_fuzz_fixtures.py wrote on 2 launched processes."""
    from test_launch import launch
    from timeouts import wait_s

    root = tempfile.mkdtemp(prefix="ac_fuzz_zero_")
    atexit.register(shutil.rmtree, root, True)
    res = launch(["--num_processes", "2", "--cpu", "--main_process_port", "0",
                  os.path.join(SCRIPTS, "zero_fuzz_fixtures.py"), root], timeout=wait_s(300))
    assert res.returncode == 0 and "zero fuzz fixtures written on 2 processes" in res.stdout, \
        res.stdout[-3000:] + res.stderr[-3000:]
    return root


class ZeroJob:
    """A one-process job like the fixtures' (their model, AdamW and StepLR and a data loader like
    theirs, prepared by an Accelerator without a plugin: one process shards nothing); `root`: the
    fixtures' directory. A new one resets the accelerator states."""

    def __init__(self, root: str):
        from torch.utils.data import DataLoader, TensorDataset
        from zero_checkpoint import build

        from accelerate_c import Accelerator
        from helpers import reset_all_states

        self.root = root
        reset_all_states()
        self.acc = Accelerator(cpu=True)
        model, opt = build()
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000, gamma=0.5)
        loader = DataLoader(TensorDataset(torch.arange(48.0).view(24, 2)), batch_size=3, shuffle=True)
        self.model, self.opt, self.sched, self.loader = self.acc.prepare(model, opt, sched, loader)


@functools.lru_cache(maxsize=None)  # the fuzzing runs' job (one per process)
def zero_job() -> ZeroJob:
    return ZeroJob(fixtures())


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| relative to max |want| (the measure of tests/scripts/zero_checkpoint.py)."""
    return (got.float() - want.float()).abs().max().item() / max(want.float().abs().max().item(), 1e-6)


def check_against_torch(model_here, opts_here, what: str) -> None:
    """`model_here` and its optimizers `opts_here` (one, or the two of the fixtures' two_optimizers,
    holding build()'s two parameter groups), as a pristine fixture loaded in this process left
    them, hold what plain torch computes: build()'s model and AdamW after the fixtures' steps on
    the whole global batches (2 processes x half a batch, gradients averaged: the same mean loss),
    fp32 summation order apart."""
    from zero_checkpoint import build, global_batch

    with torch.random.fork_rng(devices=[]):  # build() seeds: the job's RNG state is not this check's
        model, opt = build()
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000, gamma=0.5)  # as the fixtures: lr unchanged
        for k in range(FIXTURE_STEPS):
            x, y = global_batch(k)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
            opt.zero_grad()
    lives = [getattr(o, "optimizer", o) for o in opts_here]
    state_of = {id(p): o.state.get(p) for o in lives for g in o.param_groups for p in g["params"]}
    for (name, got), want in zip(model_here.named_parameters(), model.parameters()):
        assert _close(got.detach(), want.detach()) <= 1e-5, f"{what}: parameter {name} differs from plain torch"
        mine, ref = state_of[id(got)], opt.state[want]
        assert mine is not None and sorted(mine) == sorted(ref), f"{what}: {name}: optimizer state {mine!r}"
        assert float(mine["step"]) == float(ref["step"]) == FIXTURE_STEPS, f"{what}: {name}: step {mine['step']}"
        for key in ("exp_avg", "exp_avg_sq"):
            assert mine[key].shape == ref[key].shape and _close(mine[key], ref[key]) <= 1e-5, \
                f"{what}: {name}: {key} differs from plain torch"
    groups = [g for o in lives for g in o.param_groups]
    assert len(groups) == len(opt.param_groups), what
    for got, want in zip(groups, opt.param_groups):
        assert len(got["params"]) == len(want["params"]), what
        for k in ("lr", "weight_decay", "betas", "eps"):
            assert got[k] == want[k], f"{what}: param group setting {k}: {got[k]!r} != {want[k]!r}"


class KindBench(pyfuzz.CheckpointBench):
    """One kind's pristine checkpoint, its decoy beside it and the state a clean load gives, over
    the shared one-process job (what pyfuzz.check_load needs)."""

    def __init__(self, job: ZeroJob, kind: str):
        self.acc, self.model, self.opt, self.sched, self.loader = job.acc, job.model, job.opt, job.sched, job.loader
        self.pristine = os.path.join(job.root, kind, "pristine")
        self.decoy = os.path.join(job.root, kind, "outside")
        self.work = os.path.join(job.root, kind, "ck")
        self.files = sorted(os.listdir(self.pristine))
        assert "zero_plan.json" in self.files and "zero_optimizer_rank1.safetensors" in self.files, self.files
        self.extras, self.focus = EXTRAS, FOCUS
        self.sched_attrs = set(vars(self.sched.scheduler if hasattr(self.sched, "scheduler") else self.sched))
        self.acc.load_state(self.pristine)
        check_against_torch(self.model, [self.opt], kind)
        self.reference = self.snapshot()

    def snapshot(self) -> dict:
        return job_snapshot(self)


def job_snapshot(job) -> dict:
    """Everything a load may change of a ZeroJob (or a KindBench): the load_state target's
    snapshot (model, optimizer, scheduler, RNGs, step, save counter) and the loader's position."""
    from accelerate_c.checkpoint_layout import loader_state

    out = pyfuzz.CheckpointBench.snapshot(job)
    out["loader"] = loader_state(job.loader)
    return out


@functools.lru_cache(maxsize=None)
def kind_bench(kind: str) -> KindBench:
    return KindBench(zero_job(), kind)


def zero_mutations():
    return st.tuples(st.sampled_from(KINDS), pyfuzz.mutations(ZERO_OPS))


def check_zero_load_state(case) -> None:
    """load_state, in one process, of a mutated copy of a sharded checkpoint of kind `case[0]`."""
    kind, ops = case
    pyfuzz.count("zero_load_state")
    pyfuzz.check_load(kind_bench(kind), ops)

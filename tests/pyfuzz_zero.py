"""The `zero_load_state` fuzz target (docs/security.md): `load_state` of SHARDED checkpoints, mutated.

The pristine checkpoints are written once per run by a real job of 2 processes launched through
the real launcher (tests/scripts/zero_fuzz_fixtures.py): ZeRO-1 and ZeRO-2 (accelerate's
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

KINDS = ("zero1", "zero2", "fsdp")
ZERO_OPS = pyfuzz.MUTATION_OPS + ("json_edit_plan", "json_edit_shard_state")
# the files the two extra JSON edits pick among
FOCUS = {"json_edit_plan": r"zero_plan\.json", "json_edit_shard_state": r"zero_optimizer(_\d+)?_rank\d+_state\.json"}
# extra files: a third process's shard, a second optimizer's, the unsharded optimizer's files
EXTRAS = ("zero_optimizer_rank2.safetensors", "zero_optimizer_rank2_state.json", "zero_optimizer_1_rank0.safetensors",
          "optimizer.json", "optimizer.safetensors", "optimizer.bin", "zero_plan.json", "notes.txt")
FIXTURE_STEPS = 3  # tests/scripts/zero_fuzz_fixtures.py's STEPS (before the pristine save)


class ZeroJob:
    """The fuzzing process's job: the fixtures' model, AdamW and StepLR and a data loader like
    theirs, prepared by a one-process Accelerator; and the directory the fixtures were written to."""

    def __init__(self):
        from test_launch import launch
        from timeouts import wait_s
        from torch.utils.data import DataLoader, TensorDataset
        from zero_checkpoint import build

        from accelerate_c import Accelerator
        from helpers import reset_all_states

        self.root = tempfile.mkdtemp(prefix="ac_fuzz_zero_")
        atexit.register(shutil.rmtree, self.root, True)
        res = launch(["--num_processes", "2", "--cpu", "--main_process_port", "0",
                      os.path.join(SCRIPTS, "zero_fuzz_fixtures.py"), self.root], timeout=wait_s(300))
        assert res.returncode == 0 and "zero fuzz fixtures written on 2 processes" in res.stdout, \
            res.stdout[-3000:] + res.stderr[-3000:]
        reset_all_states()
        self.acc = Accelerator(cpu=True)
        model, opt = build()
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000, gamma=0.5)
        loader = DataLoader(TensorDataset(torch.arange(48.0).view(24, 2)), batch_size=3, shuffle=True)
        self.model, self.opt, self.sched, self.loader = self.acc.prepare(model, opt, sched, loader)


@functools.lru_cache(maxsize=None)  # the fixtures are written once per process, at first use
def zero_job() -> ZeroJob:
    return ZeroJob()


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| relative to max |want| (the measure of tests/scripts/zero_checkpoint.py)."""
    return (got.float() - want.float()).abs().max().item() / max(want.float().abs().max().item(), 1e-6)


def _check_against_torch(job: ZeroJob, kind: str) -> None:
    """The pristine checkpoint of `kind`, loaded here, holds what plain torch computes: the model
    and AdamW after the fixtures' steps on the whole global batches (2 processes x half a batch,
    gradients averaged: the same mean loss), fp32 summation order apart."""
    from zero_checkpoint import build, global_batch

    model, opt = build()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000, gamma=0.5)  # as the fixtures: lr unchanged
    for k in range(FIXTURE_STEPS):
        x, y = global_batch(k)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    live = job.opt.optimizer if hasattr(job.opt, "optimizer") else job.opt
    for (name, got), want in zip(job.model.named_parameters(), model.parameters()):
        assert _close(got.detach(), want.detach()) <= 1e-5, f"{kind}: parameter {name} differs from plain torch"
        mine, ref = live.state[got], opt.state[want]
        assert sorted(mine) == sorted(ref), f"{kind}: {name}: optimizer state keys {sorted(mine)} != {sorted(ref)}"
        assert float(mine["step"]) == float(ref["step"]) == FIXTURE_STEPS, f"{kind}: {name}: step {mine['step']}"
        for key in ("exp_avg", "exp_avg_sq"):
            assert mine[key].shape == ref[key].shape and _close(mine[key], ref[key]) <= 1e-5, \
                f"{kind}: {name}: {key} differs from plain torch"
    for got, want in zip(live.param_groups, opt.param_groups):
        assert {k: v for k, v in got.items() if k != "params"} == {k: v for k, v in want.items() if k != "params"}


class KindBench(pyfuzz.CheckpointBench):
    """One kind's pristine checkpoint, its decoy beside it and the state a clean load gives, over
    the shared one-process job (what pyfuzz.check_load needs)."""

    def __init__(self, job: ZeroJob, kind: str):
        from accelerate_c.checkpoint_layout import loader_state

        self._loader_state = loader_state
        self.acc, self.model, self.opt, self.sched, self.loader = job.acc, job.model, job.opt, job.sched, job.loader
        self.pristine = os.path.join(job.root, kind, "pristine")
        self.decoy = os.path.join(job.root, kind, "outside")
        self.work = os.path.join(job.root, kind, "ck")
        self.files = sorted(os.listdir(self.pristine))
        assert "zero_plan.json" in self.files and "zero_optimizer_rank1.safetensors" in self.files, self.files
        self.extras, self.focus = EXTRAS, FOCUS
        self.sched_attrs = set(vars(self.sched.scheduler if hasattr(self.sched, "scheduler") else self.sched))
        self.acc.load_state(self.pristine)
        _check_against_torch(job, kind)
        self.reference = self.snapshot()

    def snapshot(self) -> dict:
        out = super().snapshot()
        out["loader"] = self._loader_state(self.loader)
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

"""Shared by the checkpoint tests (test_checkpoint_*.py): the reference job, written in plain
PyTorch, whose state every save/load is compared against, and the subprocess plumbing for runs
that need a fresh interpreter (new-process resumes, accelerate's own singletons)."""
from __future__ import annotations

import os
import subprocess
import sys

import torch
from torch import nn

from accelerate_c import Accelerator

from helpers import make_loader, make_model
from timeouts import wait_s


HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "checkpoint_resume.py")
PY = sys.executable
ENV = dict(os.environ, PYTHONPATH=os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def run_py(args, timeout=wait_s(300), env=None):
    return subprocess.run([PY, *args], capture_output=True, text=True, timeout=timeout, env=env or ENV)


def plain_setup(seed=0):
    """A plain-PyTorch model, AdamW and LambdaLR after 3 steps: the reference states."""
    model = make_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for x, y in make_loader(n=12, batch_size=4):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def prepared(seed=0, **acc_kw):
    acc = Accelerator(cpu=True, **acc_kw)
    model, opt, sched = plain_setup(seed)
    return acc, *acc.prepare(model, opt, sched)


def assert_state_equal(got, ref, where="state"):
    if isinstance(ref, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == ref.dtype and torch.equal(got.cpu(), ref.cpu()), where
    elif isinstance(ref, dict):
        assert isinstance(got, dict) and list(got) == list(ref), f"{where}: keys {list(got)} != {list(ref)}"
        for k in ref:
            assert_state_equal(got[k], ref[k], f"{where}[{k!r}]")
    elif isinstance(ref, (list, tuple)):
        assert type(got) is type(ref) and len(got) == len(ref), f"{where}: {got!r} != {ref!r}"
        for i, (a, b) in enumerate(zip(got, ref)):
            assert_state_equal(a, b, f"{where}[{i}]")
    elif isinstance(ref, float) and ref != ref:
        assert got != got, where
    else:
        assert got == ref and type(got) is type(ref), f"{where}: {got!r} != {ref!r}"

"""`accelerate-c convert-checkpoint DIR --to accelerate`: a checkpoint saved by accelerate_c is
rewritten in accelerate's save_state layout and loaded by accelerate 1.15's own load_state in the
same test; what accelerate restores (weights, optimizer and scheduler state, RNG states, a
registered object) is compared with the states the objects had when accelerate_c saved them."""
from __future__ import annotations

import os
import random
import subprocess
import sys

import accelerate
import numpy as np
import pytest
import torch

import accelerate_c
from helpers import fresh_state, make_loader, make_model  # noqa: F401  (fresh_state: autouse)


class Counter:
    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def _setup(acc_cls, **kw):
    acc = acc_cls(cpu=True, **kw)
    model = make_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    model, opt, dl, sched = acc.prepare(model, opt, make_loader(n=16, batch_size=4, shuffle=True), sched)
    return acc, model, opt, dl, sched, counter


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "accelerate_c.commands.main", *args], capture_output=True,
                          text=True, timeout=120)


def test_accelerate_load_state_reads_the_converted_checkpoint(tmp_path):
    acc, model, opt, dl, sched, counter = _setup(accelerate_c.Accelerator, mixed_precision="fp16")
    for x, y in dl:
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        sched.step()
        opt.zero_grad()
    counter.n = 7
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": opt.state_dict(),
             "sched": sched.state_dict(), "scaler": acc.scaler.state_dict(), "torch_rng": torch.get_rng_state(),
             "py_rng": random.getstate(), "np_rng": np.random.get_state()}
    acc.save_state(str(tmp_path / "ours"))

    res = _cli("convert-checkpoint", str(tmp_path / "ours"), "--to", "accelerate")
    assert res.returncode == 0, res.stderr
    out = tmp_path / "ours_accelerate"
    assert sorted(os.listdir(out)) == ["custom_checkpoint_0.pkl", "model.safetensors", "optimizer.bin",
                                       "random_states_0.pkl", "scaler.pt", "scheduler.bin"]
    assert "dataloader_0.json" in res.stdout  # said to be left out

    # accelerate 1.15 (no fp16 on CPU: no scaler to restore there; the file is read below)
    theirs, t_model, t_opt, _, t_sched, t_counter = _setup(accelerate.Accelerator)
    torch.manual_seed(99)
    theirs.load_state(str(out))
    for k, v in saved["model"].items():
        assert torch.equal(t_model.state_dict()[k], v), k
    t_state = t_opt.state_dict()
    for pid, st in saved["opt"]["state"].items():
        for k, v in st.items():
            assert torch.equal(t_state["state"][pid][k], v), (pid, k)
    assert t_state["param_groups"] == saved["opt"]["param_groups"]
    assert t_sched.state_dict() == saved["sched"] and t_counter.n == 7
    assert torch.equal(torch.get_rng_state(), saved["torch_rng"]) and random.getstate() == saved["py_rng"]
    np_state = np.random.get_state()
    assert np_state[0] == saved["np_rng"][0] and np.array_equal(np_state[1], saved["np_rng"][1])
    assert torch.load(out / "scaler.pt", weights_only=True) == saved["scaler"]


def test_refusals(tmp_path, capsys):
    from accelerate_c.checkpoint_convert import to_accelerate
    from accelerate_c.commands.main import main
    from accelerate_c.state_io import CheckpointError

    acc, model, opt, dl, sched, _ = _setup(accelerate_c.Accelerator)
    acc.save_state(str(tmp_path / "ck"))
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="taken exists"):
        main(["convert-checkpoint", str(tmp_path / "ck"), "--to", "accelerate", "--output", str(tmp_path / "taken")])
    with pytest.raises(CheckpointError, match="checkpoint.json"):  # not a checkpoint of ours
        main(["convert-checkpoint", str(tmp_path / "taken"), "--to", "accelerate"])
    with pytest.raises(SystemExit):
        main(["convert-checkpoint", str(tmp_path / "ck"), "--to", "deepspeed"])
    assert "invalid choice: 'deepspeed'" in capsys.readouterr().err
    marker = (tmp_path / "ck" / "checkpoint.json")
    marker.write_text(marker.read_text().replace('"files": {', '"files": {"zero_plan.json": 10, '))
    with pytest.raises(CheckpointError, match="merge-weights"):
        to_accelerate(str(tmp_path / "ck"), str(tmp_path / "zero_out"))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary directory left

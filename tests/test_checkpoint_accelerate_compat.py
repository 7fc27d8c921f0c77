"""Checkpoints of accelerate 1.15 itself, both ways: one written by accelerate's save_state loads
here (pickled files, its automatic naming, its sampler only with allow_pickle=True), and one we
write in pickle mode loads in accelerate. accelerate runs in a subprocess where its singletons
would clash with ours, or after ours are reset."""
from __future__ import annotations

import os
import random
import textwrap

import numpy as np
import pytest
import torch

from accelerate_c import Accelerator, ProjectConfiguration
from accelerate_c.checkpointing import PickleRequiredError

from checkpoint_helpers import HERE, assert_state_equal, plain_setup, prepared, run_py
from helpers import fresh_state, make_loader, reset_all_states  # noqa: F401


# ---- accelerate 1.15 checkpoints, both ways ------------------------------------------------------------------
ACCELERATE_SAVE = textwrap.dedent("""
    import random, sys, json
    import numpy as np, torch
    from torch import nn
    sys.path.insert(0, sys.argv[2])
    from helpers import make_loader, make_model
    from accelerate import Accelerator
    from accelerate.data_loader import SeedableRandomSampler

    class Counter:
        def __init__(self): self.n = 5
        def state_dict(self): return {"n": self.n, "t": torch.arange(3.0)}
        def load_state_dict(self, sd): self.n = sd["n"]

    acc = Accelerator(cpu=True)
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    for x, y in make_loader(n=12, batch_size=4):
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step(); sched.step(); opt.zero_grad()
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=9)  # writes scaler.pt
    acc.scaler._lazy_init_scale_growth_tracker("cpu")
    acc.register_for_checkpointing(Counter())
    acc.step = 3
    random.seed(11); np.random.seed(11); torch.manual_seed(11)
    acc.save_state(sys.argv[1])
    draws = [random.random(), float(np.random.rand()), torch.rand(3).tolist()]
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                "scaler": acc.scaler.state_dict(), "draws": draws}, sys.argv[1] + "/../reference.pt")
    # what accelerate pickles for a seedable sampler: the whole object, with its dataset
    s = SeedableRandomSampler(list(range(10)), data_seed=42); s.set_epoch(4)
    torch.save(s, sys.argv[1] + "/../sampler.bin")
""")


class _Counter:
    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n, "t": torch.zeros(3)}

    def load_state_dict(self, sd):
        self.n = sd["n"]
        assert torch.equal(sd["t"], torch.arange(3.0))


def test_checkpoint_written_by_accelerate_loads(tmp_path):
    ckpt = tmp_path / "proj" / "checkpoints" / "checkpoint_4"  # as accelerate's automatic naming lays it out
    script = tmp_path / "acc_save.py"
    script.write_text(ACCELERATE_SAVE)
    res = run_py([str(script), str(ckpt), HERE])
    assert res.returncode == 0, res.stderr[-3000:]
    assert {"optimizer.bin", "scheduler.bin", "scaler.pt", "random_states_0.pkl", "model.safetensors",
            "custom_checkpoint_0.pkl"} <= set(os.listdir(ckpt))
    ref = torch.load(ckpt.parent / "reference.pt", weights_only=False)

    acc = Accelerator(cpu=True, mixed_precision="fp16", project_config=ProjectConfiguration(
        project_dir=str(tmp_path / "proj"), automatic_checkpoint_naming=True))
    model, opt, sched = acc.prepare(*plain_setup(seed=4))
    counter = _Counter()
    acc.register_for_checkpointing(counter)
    acc.load_state()  # accelerate's checkpoint_4 counts as complete (its random_states_0.pkl is there)
    assert acc.save_iteration == 5
    assert_state_equal(model.state_dict(), ref["model"], "model")
    assert_state_equal(opt.state_dict(), ref["opt"], "optimizer")
    assert_state_equal(sched.state_dict(), ref["sched"], "scheduler")
    assert acc.scaler.state_dict() == {k: (float(v) if k == "scale" else v) for k, v in ref["scaler"].items()}
    assert acc.step == 3 and counter.n == 5
    assert [random.random(), float(np.random.rand()), torch.rand(3).tolist()] == ref["draws"]

    # accelerate's sampler.bin holds a pickled sampler (and its dataset): refused unless allowed
    dl = acc.prepare(make_loader(n=10, batch_size=2, shuffle=True))
    os.replace(ckpt.parent / "sampler.bin", ckpt / "sampler.bin")
    with pytest.raises(PickleRequiredError, match=r"sampler\.bin: .*full unpickling.*allow_pickle=True"):
        acc.load_state(ckpt)
    from accelerate_c.checkpoint_layout import sampler_of as _sampler

    def position():
        s = _sampler(dl)
        return getattr(s, "epoch", None), getattr(s, "initial_seed", None)

    assert position() != (4, 42)
    acc.load_state(ckpt, allow_pickle=True)
    assert position() == (4, 42)  # the pickled sampler (epoch 4, data_seed 42) now drives the loader


def test_our_pickle_mode_checkpoint_loads_in_accelerate(tmp_path):
    ref_model, ref_opt, ref_sched = plain_setup(0)
    acc, model, opt, sched = prepared(0)
    path = acc.save_state(tmp_path / "ck", safe_serialization=False)
    names = set(os.listdir(path))
    assert {"pytorch_model.bin", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"} <= names
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    acc.load_state(path)  # ours reads it back too
    assert_state_equal(model.state_dict(), ref_model.state_dict(), "model (accelerate_c)")
    reset_all_states()
    import accelerate

    a = accelerate.Accelerator(cpu=True)
    m, o, s = a.prepare(*plain_setup(seed=9))
    a.load_state(str(path))
    assert_state_equal(m.state_dict(), ref_model.state_dict(), "model")
    assert_state_equal(o.state_dict(), ref_opt.state_dict(), "optimizer")
    assert_state_equal(s.state_dict(), ref_sched.state_dict(), "scheduler")

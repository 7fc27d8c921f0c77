"""save_state / load_state / save_model / save round trips in one process, against torch's own
state_dict()s of a plain-PyTorch model, optimizer, scheduler and GradScaler: the JSON tags, the
loader position, automatic naming and total_limit, explicit directories, the save/load hooks."""
from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

from accelerate_c import Accelerator, ProjectConfiguration
from accelerate_c.checkpointing import MARKER
from accelerate_c.safetensors_io import list_tensors, load_file

from checkpoint_helpers import assert_state_equal, plain_setup, prepared
from helpers import fresh_state, make_loader, make_model, reset_all_states  # noqa: F401


# ---- round trips against torch's own state ----------------------------------------------------------------
def test_round_trip_matches_torch_state_dicts(tmp_path):
    ref_model, ref_opt, ref_sched = plain_setup(0)
    acc, model, opt, sched = prepared(0)
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    path = acc.save_state(tmp_path / "ck")
    draws = (random.random(), float(np.random.rand()), torch.rand(3))
    reset_all_states()
    acc2, model2, opt2, sched2 = prepared(seed=3)  # other weights, other optimizer state
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    acc2.load_state(path)
    assert_state_equal(model2.state_dict(), ref_model.state_dict(), "model")
    assert_state_equal(opt2.state_dict(), ref_opt.state_dict(), "optimizer")
    assert_state_equal(sched2.state_dict(), ref_sched.state_dict(), "scheduler")
    assert random.random() == draws[0] and float(np.random.rand()) == draws[1]
    assert torch.equal(torch.rand(3), draws[2])
    # no pickle anywhere: nothing torch.load would open, and every file is JSON or safetensors
    for name in os.listdir(path):
        assert name.endswith((".json", ".safetensors")), name
        if name.endswith(".safetensors"):
            list_tensors(path / name)
        else:
            json.loads((path / name).read_text())


def test_fp16_scaler_state_round_trips_with_gradscaler_keys(tmp_path):
    acc = Accelerator(cpu=True, mixed_precision="fp16")
    m = make_model(0)
    model, opt = acc.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))
    ref = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=7)
    ref_state = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 7,
                 "_growth_tracker": 3}
    acc.scaler.load_state_dict(ref_state)
    path = acc.save_state(tmp_path / "ck")
    assert json.loads((path / "scaler.json").read_text())["state"] == ref_state
    acc.scaler.load_state_dict(dict(ref_state, scale=1.0, _growth_tracker=0))
    acc.load_state(path)
    assert acc.scaler.state_dict() == ref_state
    # torch's GradScaler takes the same state
    ref.load_state_dict(acc.scaler.state_dict())
    assert ref.get_scale() == 1024.0


def test_json_tags_round_trip():
    from accelerate_c.state_io import decode, encode

    value = {0: {"a": (1, 2.5, float("inf")), "b": [None, True, "s"], "t": torch.arange(3)},
             "nan": float("nan"), "dt": torch.bfloat16, "np": np.arange(4, dtype=np.uint32), "s": np.float32(1.5),
             "tag": {"__tensor__": 1}}
    enc, tensors = encode(value)
    json.dumps(enc, allow_nan=False)
    out = decode(json.loads(json.dumps(enc)), tensors)
    assert out[0]["a"] == (1, 2.5, float("inf")) and out[0]["b"] == [None, True, "s"]
    assert torch.equal(out[0]["t"], torch.arange(3)) and out["dt"] is torch.bfloat16
    assert out["nan"] != out["nan"] and out["np"].dtype == np.uint32 and list(out["np"]) == [0, 1, 2, 3]
    assert out["s"] == np.float32(1.5) and type(out["s"]) is np.float32
    assert out["tag"] == {"__tensor__": 1}


# ---- automatic naming, explicit directories, hooks ----------------------------------------------------------
def test_automatic_naming_total_limit_and_iteration(tmp_path):
    cfg = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    acc, model, opt, sched = prepared(project_config=cfg)
    for _ in range(4):
        acc.save_state()
    base = tmp_path / "checkpoints"
    assert sorted(os.listdir(base)) == ["checkpoint_2", "checkpoint_3"]
    assert json.loads((base / "checkpoint_3" / MARKER).read_text())["iteration"] == 3
    with pytest.raises(ValueError, match="already exists"):
        acc.project_configuration.iteration = 3
        acc.save_state()
    reset_all_states()
    cfg2 = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    acc2, *_ = prepared(project_config=cfg2)
    acc2.load_state()
    assert acc2.save_iteration == 4


def test_explicit_existing_directory_keeps_other_files(tmp_path):
    acc, model, opt, sched = prepared()
    out = tmp_path / "ck"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    acc.save_state(out)
    acc.save_state(out)
    assert (out / "notes.txt").read_text() == "mine"
    assert not [e for e in os.listdir(tmp_path) if e.startswith(".")]
    acc.load_state(out)


def test_hooks_and_register_errors(tmp_path):
    acc, model, opt, sched = prepared()
    seen = []

    def save_hook(models, weights, output_dir):
        seen.append(("save", len(models), sorted(weights[0]), os.path.isdir(output_dir)))
        with open(os.path.join(output_dir, "extra.txt"), "w") as f:
            f.write("hook")

    def load_hook(models, input_dir):
        seen.append(("load", len(models), os.path.basename(input_dir)))

    h1 = acc.register_save_state_pre_hook(save_hook)
    h2 = acc.register_load_state_pre_hook(load_hook)
    path = acc.save_state(tmp_path / "ck")
    acc.load_state(path)
    assert (path / "extra.txt").read_text() == "hook"
    assert seen == [("save", 1, sorted(model.state_dict()), True), ("load", 1, "ck")]
    h1.remove()
    h2.remove()
    acc.save_state(tmp_path / "ck2")
    acc.load_state(tmp_path / "ck2")
    assert len(seen) == 2
    with pytest.raises(ValueError, match=r"(?s)state_dict.*load_state_dict.*Item at index 0, `object`"):
        acc.register_for_checkpointing(object())
    acc.register_for_checkpointing(torch.optim.SGD(make_model(0).parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="Number of custom checkpoints"):
        acc.load_state(path)


def test_save_model_save_and_get_state_dict(tmp_path):
    acc, model, opt, sched = prepared()
    ref = make_model(0)  # a different model: the reference for what the files hold is model.state_dict()
    acc.save_model(model, tmp_path / "m")
    got = load_file(tmp_path / "m" / "model.safetensors")
    assert_state_equal(dict(sorted(got.items())), dict(sorted(model.state_dict().items())), "save_model")
    acc.save_model(model, tmp_path / "m2", max_shard_size=200)
    index = json.loads((tmp_path / "m2" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    ref.load_state_dict(acc.get_state_dict(model))
    assert_state_equal(ref.state_dict(), model.state_dict())
    acc.save({"w": torch.ones(3)}, tmp_path / "w.safetensors", safe_serialization=True)
    assert torch.equal(load_file(tmp_path / "w.safetensors")["w"], torch.ones(3))
    acc.save({"a": [1, 2]}, tmp_path / "obj.pt")
    assert torch.load(tmp_path / "obj.pt") == {"a": [1, 2]}
    with pytest.raises(TypeError, match="dict of str -> tensor"):
        acc.save([1, 2], tmp_path / "x.safetensors", safe_serialization=True)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="should be a directory"):
        acc.save_model(model, tmp_path / "file")


# ---- the loader's position ----------------------------------------------------------------------------------
def test_the_loader_position_is_recorded_mid_epoch(tmp_path):
    """save_state records how many batches of the current epoch were consumed (for the user's
    skip_first_batches on resume, as in accelerate): 3 of 8 here, and which epoch it is."""
    acc = Accelerator(cpu=True)
    dl = acc.prepare(make_loader(n=32, batch_size=4))
    for _ in dl:  # one whole epoch
        pass
    it = iter(dl)
    for _ in range(3):
        next(it)
    path = acc.save_state(tmp_path / "ck")
    st = json.loads((path / "dataloader_0.json").read_text())["state"]
    assert st["batches_seen"] == 3 and st["iteration"] == 1, st

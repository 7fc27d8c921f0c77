"""What a failed save or load leaves: a kill -9 mid-save keeps the previous checkpoint, a
directory without its marker is never loaded, state that needs pickle is refused before anything
is written, and every corrupt, truncated, hostile or mismatched file is named and leaves the job
bitwise as it was (weights, optimizer, schedulers, scaler, every RNG, counters, registered
objects)."""
from __future__ import annotations

import copy
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from torch import nn

from accelerate_c import Accelerator, CoreError, ProjectConfiguration
from accelerate_c.checkpointing import MARKER, CheckpointError, complete_checkpoints

from checkpoint_helpers import ENV, HERE, PY, SCRIPT, assert_state_equal, prepared
from helpers import fresh_state, make_loader, make_model, reset_all_states  # noqa: F401
from timeouts import wait_s


# ---- crash safety ---------------------------------------------------------------------------------
def test_kill_9_during_save_keeps_the_previous_checkpoint(tmp_path):
    paused = tmp_path / "paused"
    proc = subprocess.Popen([PY, SCRIPT, "crash", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=ENV, start_new_session=True)
    try:
        deadline = time.time() + wait_s(240)
        while not paused.exists():
            assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
            assert time.time() < deadline, "the save never paused"
            time.sleep(0.1)
        base = tmp_path / "no" / "checkpoints"
        # mid-save: the oldest checkpoint is still there (accelerate would have deleted it first)
        assert [i for i, _ in complete_checkpoints(str(base))] == [1, 2]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=wait_s(30))
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    entries = sorted(os.listdir(base))
    assert [e for e in entries if not e.startswith(".")] == ["checkpoint_1", "checkpoint_2"]
    leftovers = [e for e in entries if e.startswith(".")]
    assert len(leftovers) == 1 and leftovers[0].startswith(".checkpoint_3.tmp-"), entries
    assert os.listdir(base / leftovers[0]), "the writer had written its first file"
    assert [i for i, _ in complete_checkpoints(str(base))] == [1, 2]
    with open(tmp_path / "crash_hashes.json") as f:
        hashes = json.load(f)

    sys.path.insert(0, os.path.join(HERE, "scripts"))
    try:
        import checkpoint_resume as cr
    finally:
        sys.path.pop(0)
    acc, model, opt, sched, dl, counter = cr.build(str(tmp_path), "no", 99, total_limit=2)
    acc.load_state()
    assert cr.params_hash(model) == hashes["2"]
    assert acc.save_iteration == 3  # restored (accelerate forgets it)
    acc.save_state()
    assert sorted(os.listdir(base)) == ["checkpoint_2", "checkpoint_3"]  # leftover cleaned, oldest pruned
    assert [i for i, _ in complete_checkpoints(str(base))] == [2, 3]


def test_a_directory_without_marker_is_never_loaded(tmp_path):
    acc, model, opt, sched = prepared(project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True))
    acc.save_state()
    acc.save_state()
    base = tmp_path / "checkpoints"
    os.unlink(base / "checkpoint_1" / MARKER)  # as if the save had died before its last file
    reset_all_states()
    acc2, model2, *_ = prepared(seed=5, project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True))
    acc2.load_state()
    assert acc2.save_iteration == 1  # checkpoint_0 was picked
    with pytest.raises(CheckpointError, match=r"checkpoint_1: incomplete checkpoint .*checkpoint\.json"):
        acc2.load_state(base / "checkpoint_1")


# ---- bad files ----------------------------------------------------------------------------------------
def _saved(tmp_path, **kw):
    acc, model, opt, sched = prepared(**kw)
    path = acc.save_state(tmp_path / "ck")
    return acc, model, opt, sched, path


def _truncate(path, keep):
    with open(path, "r+b") as f:
        f.truncate(keep)


@pytest.mark.parametrize("case", ["truncated_tensors", "bad_header", "bad_json", "missing_file",
                                  "dangling_reference", "model_header", "extra_size", "bad_rng"])
def test_corrupt_checkpoint_files_name_the_file_and_change_nothing(tmp_path, case):
    acc, model, opt, sched, path = _saved(tmp_path)
    before_model = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    changed = {k: v.clone() for k, v in model.state_dict().items()}
    opt_before = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state_dict()["state"].items()}
    marker = json.loads((path / MARKER).read_text())
    if case == "truncated_tensors":
        target = path / "optimizer.safetensors"
        _truncate(target, target.stat().st_size - 7)
        marker["files"]["optimizer.safetensors"] -= 7  # a consistent marker: the C reader must catch it
        (path / MARKER).write_text(json.dumps(marker))
        err, match = CoreError, r"optimizer\.safetensors"
    elif case == "bad_header":
        target = path / "optimizer.safetensors"
        with open(target, "r+b") as f:
            f.seek(8)
            f.write(b"[")
        err, match = CoreError, r"optimizer\.safetensors"
    elif case == "bad_json":
        target = path / "scheduler.json"
        data = target.read_bytes()
        target.write_bytes(data[: len(data) // 2] + b" " * (len(data) - len(data) // 2))
        err, match = CheckpointError, r"scheduler\.json: not valid JSON"
    elif case == "missing_file":
        os.unlink(path / "random_states_0.safetensors")
        err, match = FileNotFoundError, r"random_states_0\.safetensors: missing"
    elif case == "dangling_reference":
        doc = json.loads((path / "optimizer.json").read_text())
        doc["state"]["state"]["__dict__"][0][1]["exp_avg"] = {"__tensor__": "no.such.tensor"}
        data = json.dumps(doc).encode()
        (path / "optimizer.json").write_bytes(data)
        marker["files"]["optimizer.json"] = len(data)
        (path / MARKER).write_text(json.dumps(marker))
        err, match = CheckpointError, r"optimizer\.json: refers to tensor\(s\) 'no\.such\.tensor'"
    elif case == "model_header":
        target = path / "model.safetensors"
        with open(target, "r+b") as f:
            f.write((10**12).to_bytes(8, "little"))
        err, match = CoreError, r"model\.safetensors"
    elif case == "bad_rng":  # well-formed JSON, but not a python random state
        doc = json.loads((path / "random_states_0.json").read_text())
        doc["state"]["random_state"] = {"__tuple__": [3, [1, 2], None]}
        data = json.dumps(doc).encode()
        (path / "random_states_0.json").write_bytes(data)
        marker["files"]["random_states_0.json"] = len(data)
        (path / MARKER).write_text(json.dumps(marker))
        err, match = CheckpointError, r"random_states_0\.json: invalid random states"
    else:  # a file that grew after the save
        with open(path / "scheduler.json", "ab") as f:
            f.write(b" ")
        err, match = CheckpointError, r"scheduler\.json: \d+ bytes, but the checkpoint recorded"
    with pytest.raises(err, match=match):
        acc.load_state(path)
    # nothing was loaded: the model keeps its (changed) weights, the optimizer its state
    for k, v in model.state_dict().items():
        assert torch.equal(v, changed[k]), k
        assert not torch.equal(v, before_model[k]) or v.dtype == torch.long
    for k, v in opt.state_dict()["state"].items():
        for n, t in v.items():
            assert torch.equal(t, opt_before[k][n])


def test_missing_directory_and_no_checkpoints(tmp_path):
    acc, model, opt, sched = prepared(project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True))
    with pytest.raises(ValueError, match="does not exist"):
        acc.load_state(tmp_path / "nope")
    with pytest.raises(ValueError, match="No complete checkpoint"):
        acc.load_state()


# ---- state that needs pickle is refused at save time -------------------------------------------------------
def test_unpicklable_state_is_refused_with_its_path(tmp_path):
    acc, model, opt, sched = prepared()

    class Holder:
        def state_dict(self):
            return {"ok": torch.ones(2), "cb": {"fn": print}}

        def load_state_dict(self, sd):
            pass

    acc.register_for_checkpointing(Holder())
    with pytest.raises(TypeError, match=r"Holder\.state_dict\(\)\['cb'\]\['fn'\] is a .*cannot be saved without "
                                        r"pickle.*safe_serialization=False"):
        acc.save_state(tmp_path / "ck")
    assert not (tmp_path / "ck").exists()
    assert os.listdir(tmp_path) == []  # the temporary directory is gone too
    acc.save_state(tmp_path / "ck2", safe_serialization=False)  # pickle mode keeps accelerate's behaviour
    assert (tmp_path / "ck2" / "custom_checkpoint_0.pkl").exists()


def test_scheduler_state_that_needs_pickle_is_refused(tmp_path):
    class Warmup:  # a callable object: LambdaLR saves its __dict__, here holding a function
        def __init__(self):
            self.f = lambda s: 1.0

        def __call__(self, s):
            return self.f(s)

    acc = Accelerator(cpu=True)
    m = make_model(0)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    model, opt, sched = acc.prepare(m, opt, torch.optim.lr_scheduler.LambdaLR(opt, Warmup()))
    with pytest.raises(TypeError, match=r"scheduler\.state_dict\(\)\['lr_lambdas'\]\[0\]\['f'\] is a builtins\.function"):
        acc.save_state(tmp_path / "ck")
    assert os.listdir(tmp_path) == []


# ---- hostile JSON ----------------------------------------------------------------------------------------------
def test_hostile_json_is_refused_with_its_name(tmp_path):
    acc, model, opt, sched, path = _saved(tmp_path)
    marker = json.loads((path / MARKER).read_text())
    data = b"[" * 100000 + b"]" * 100000
    (path / "scheduler.json").write_bytes(data)
    marker["files"]["scheduler.json"] = len(data)
    (path / MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match=r"scheduler\.json: "):
        acc.load_state(path)
    (path / MARKER).write_text("{")
    with pytest.raises(CheckpointError, match=r"checkpoint\.json: not valid JSON"):
        acc.load_state(path)


# ---- a bad checkpoint changes nothing: every file checked before any state is set ------------------------------
def _job_snapshot(acc, model, opt, sched):
    """Everything load_state may set, copied: weights, optimizer, scheduler, scaler, every RNG,
    the step and iteration counters, and a registered object."""
    np_state = np.random.get_state()
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": {"state": {k: {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in v.items()}
                                    for k, v in opt.state_dict()["state"].items()},
                          "param_groups": json.loads(json.dumps(opt.state_dict()["param_groups"]))},
            "scheduler": json.loads(json.dumps(sched.state_dict())),
            "scaler": acc.scaler.state_dict() if acc.scaler is not None else None,
            "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
            "numpy_rng": (np_state[0], np_state[1].tolist(), *np_state[2:]),
            "step": acc.step, "iteration": acc.save_iteration, "registered": acc._custom_objects[0].state_dict()}


class _Registered:
    def __init__(self):
        self.n, self.buf = 0, torch.zeros(3)

    def state_dict(self):
        return {"n": self.n, "buf": self.buf.clone()}

    def load_state_dict(self, sd):
        self.n, self.buf = sd["n"], sd["buf"].clone()


def _rewrite(path, name, data: bytes):
    """Replaces a checkpoint file and records its new size in the marker, as a checkpoint written
    that way would have: only the content is wrong."""
    (path / name).write_bytes(data)
    marker = json.loads((path / MARKER).read_text())
    marker["files"][name] = len(data)
    (path / MARKER).write_text(json.dumps(marker))


def _st_bytes(tensors, fmt="pt"):
    from safetensors.torch import save as st_save

    return st_save(tensors, metadata={"format": fmt})


BAD_CHECKPOINTS = {
    # case: (safe_serialization, expected exception, message pattern)
    "missing_model_file": (True, FileNotFoundError, r"model\.safetensors: missing from the checkpoint"),
    "truncated_model_file": (True, CheckpointError, r"model\.safetensors: \d+ bytes, but the checkpoint recorded"),
    "shape_of_another_model": (True, RuntimeError, r"model\.safetensors: size mismatch for fc2\.bias"),
    "unexpected_key": (True, RuntimeError, r"model\.safetensors: does not match MLP: unexpected keys: extra\.weight"),
    "missing_key": (True, RuntimeError, r"model\.safetensors: does not match MLP: missing keys: fc2\.bias"),
    "optimizer_of_another_model": (True, CheckpointError, r"optimizer\.json: optimizer state of another model: state "
                                                          r"of parameter 3 \['exp_avg'\]: saved \[7\], expected \[4\]"),
    "pickled_weights_of_another_model": (False, RuntimeError, r"pytorch_model\.bin: size mismatch for fc2\.bias"),
    "pickled_optimizer_of_another_model": (False, CheckpointError, r"optimizer\.bin: optimizer state of another model"),
    "bad_last_file": (True, CheckpointError, r"custom_checkpoint_0\.json: not valid JSON"),
}


def test_weights_in_another_dtype_load_cast_as_torch_loads_them(tmp_path):
    """A checkpoint whose weights are bf16 loads into the fp32 model cast, as torch's
    load_state_dict (and accelerate) would: not an error."""
    acc, model, opt, sched = prepared()
    path = acc.save_state(tmp_path / "ck")
    sd = {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    half = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    _rewrite(path, "model.safetensors", _st_bytes(half))
    ref = copy.deepcopy(acc.unwrap_model(model))
    ref.load_state_dict(half)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    acc.load_state(path)
    for (name, a), b in zip(acc.unwrap_model(model).state_dict().items(), ref.state_dict().values()):
        assert a.dtype == torch.float32 and torch.equal(a, b), name


@pytest.mark.parametrize("case", sorted(BAD_CHECKPOINTS))
def test_a_bad_checkpoint_leaves_the_job_bitwise_unchanged(tmp_path, case):
    safe, err, match = BAD_CHECKPOINTS[case]
    acc, model, opt, sched = prepared(mixed_precision="fp16")
    acc.register_for_checkpointing(_Registered())
    path = acc.save_state(tmp_path / "ck", safe_serialization=safe)
    # the job moves on, so that every piece of its state differs from the checkpoint's
    for x, y in make_loader(n=8, batch_size=4, seed=3):
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        sched.step()
        opt.zero_grad()
    acc._custom_objects[0].n = 5
    random.random(), np.random.rand(), torch.rand(1)
    sd = {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}  # file order: fc1 then fc2
    if case == "missing_model_file":
        os.unlink(path / "model.safetensors")
    elif case == "truncated_model_file":
        _truncate(path / "model.safetensors", (path / "model.safetensors").stat().st_size - 4)
    elif case == "shape_of_another_model":  # one tensor differs; a loader going file order would copy others first
        _rewrite(path, "model.safetensors", _st_bytes(dict(sd, **{"fc2.bias": torch.zeros(5)})))
    elif case == "unexpected_key":
        _rewrite(path, "model.safetensors", _st_bytes(dict(sd, **{"extra.weight": torch.zeros(2)})))
    elif case == "missing_key":
        _rewrite(path, "model.safetensors", _st_bytes({k: v for k, v in sd.items() if k != "fc2.bias"}))
    elif case == "optimizer_of_another_model":  # well-formed, consistent, but exp_avg of the wrong shape
        from safetensors.torch import load_file as st_load

        tensors = st_load(str(path / "optimizer.safetensors"))
        tensors["state.3.exp_avg"] = torch.zeros(7)
        _rewrite(path, "optimizer.safetensors", _st_bytes(tensors, "accelerate_c.state"))
    elif case == "pickled_weights_of_another_model":  # torch's load_state_dict would copy fc1 first
        buf = __import__("io").BytesIO()
        torch.save(dict(sd, **{"fc2.bias": torch.zeros(5)}), buf)
        _rewrite(path, "pytorch_model.bin", buf.getvalue())
    elif case == "pickled_optimizer_of_another_model":
        saved = torch.load(path / "optimizer.bin", weights_only=True)
        saved["state"][3]["exp_avg"] = torch.zeros(7)
        buf = __import__("io").BytesIO()
        torch.save(saved, buf)
        _rewrite(path, "optimizer.bin", buf.getvalue())
    else:
        data = (path / "custom_checkpoint_0.json").read_bytes()
        _rewrite(path, "custom_checkpoint_0.json", data[:-3])
    before = _job_snapshot(acc, model, opt, sched)
    with pytest.raises(err, match=match):
        acc.load_state(path)
    assert_state_equal(_job_snapshot(acc, model, opt, sched), before, "job after the failed load")


def test_an_io_error_while_reading_names_the_file_and_leaves_the_rest(tmp_path, monkeypatch):
    """A file that passed every check but cannot be read in full (here: truncated between the
    checks and the read, as a failing disk would) raises naming it; what docs/checkpoints.md
    promises then holds: schedulers, scaler, RNG, counters and registered objects are untouched."""
    from accelerate_c import checkpoint_load

    acc, model, opt, sched = prepared(mixed_precision="fp16")
    opt2 = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    acc.register_for_checkpointing(_Registered())
    for save in (True, False):
        for x, y in make_loader(n=8, batch_size=4, seed=3):
            acc.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt2.step()
            sched.step()
            opt.zero_grad()
        if save:
            path = acc.save_state(tmp_path / "ck")
    acc._custom_objects[0].n = 5
    opt2.param_groups[0]["lr"] = 0.05
    groups = [__import__("copy").deepcopy(o.state_dict()["param_groups"]) for o in (opt, opt2)]
    real_plan = checkpoint_load._plan_load

    def plan_then_fail_the_disk(*a, **k):
        plan = real_plan(*a, **k)
        _truncate(path / "optimizer_1.safetensors", 100)  # the second optimizer's file
        return plan

    monkeypatch.setattr(checkpoint_load, "_plan_load", plan_then_fail_the_disk)
    before = _job_snapshot(acc, model, opt, sched)
    with pytest.raises(CoreError, match=r"optimizer_1\.safetensors"):
        acc.load_state(path)
    after = _job_snapshot(acc, model, opt, sched)
    for key in ("scheduler", "scaler", "torch_rng", "python_rng", "numpy_rng", "step", "iteration", "registered"):
        assert_state_equal(after[key], before[key], key)
    # no optimizer was set from a checkpoint only partly read (the first one's file was fine)
    assert [o.state_dict()["param_groups"] for o in (opt, opt2)] == groups


# ---- found by the load_state fuzz target (tests/pyfuzz.py): symbolic links out of the directory
@pytest.mark.parametrize("relative", [False, True])
def test_a_file_linked_from_outside_the_checkpoint_is_refused_and_changes_nothing(tmp_path, relative):
    """A checkpoint whose file is a symbolic link out of its directory (another checkpoint's file
    of the same size, here) was read through the link: load_state loaded state from elsewhere.
    Now the link is refused, naming it, before any file is read."""
    acc, model, opt, sched, path = _saved(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    changed = {k: v.clone() for k, v in model.state_dict().items()}
    acc.save_model(model, str(outside))  # other weights, same layout
    real = outside / "model.safetensors"
    assert real.stat().st_size == (path / "model.safetensors").stat().st_size
    os.unlink(path / "model.safetensors")
    os.symlink(os.path.relpath(real, path) if relative else real, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: a symbolic link to .*outside the checkpoint"):
        acc.load_state(path)
    for k, v in model.state_dict().items():
        assert torch.equal(v, changed[k]), k
    # a link that stays inside the directory is fine
    os.unlink(path / "model.safetensors")
    os.rename(real, path / "weights.bin.real")
    os.symlink("weights.bin.real", path / "model.safetensors")
    acc.load_state(path)


# ---- found by the load_state fuzz target: states the checks let through, refused at the end --------
def _assert_failed_load_changed_nothing(acc, model, opt, path, err, match):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    changed = {k: v.clone() for k, v in model.state_dict().items()}
    opt_before = copy.deepcopy(opt.state_dict())
    with pytest.raises(err, match=match):
        acc.load_state(path)
    for k, v in model.state_dict().items():
        assert torch.equal(v, changed[k]), k  # the weights were not read before the refusal
    assert_state_equal(opt.state_dict(), opt_before, "optimizer")


def test_an_optimizer_entry_the_optimizer_refuses_is_caught_before_the_weights_are_read(tmp_path):
    """A "step" that decodes to a dict passed every check; AdamW's load_state_dict then raised
    TypeError after the model's weights had been read. Now a dry run of the optimizer's own
    load_state_dict (meta tensors, nothing read) refuses it during the checks."""
    acc, model, opt, sched, path = _saved(tmp_path)
    doc = json.loads((path / "optimizer.json").read_text())
    entry = doc["state"]["state"]["__dict__"][0][1]
    entry["step"] = {"__tensoq__": entry["step"]["__tensor__"]}  # one flipped bit in the tag
    _rewrite(path, "optimizer.json", json.dumps(doc).encode())
    _assert_failed_load_changed_nothing(acc, model, opt, path, CheckpointError,
                                        r"optimizer\.json: AdamW\.load_state_dict refuses this state \(TypeError")


def test_a_state_file_in_the_place_of_another_is_refused_by_name(tmp_path):
    """random_states_0.json's content under optimizer.json's name (sizes made consistent): its
    numpy RNG array (__ndarray__) made the checks themselves raise AttributeError."""
    acc, model, opt, sched, path = _saved(tmp_path)
    _rewrite(path, "optimizer.json", (path / "random_states_0.json").read_bytes())
    _assert_failed_load_changed_nothing(acc, model, opt, path, CheckpointError,
                                        r"optimizer\.json: not an optimizer state dict")


def test_a_negative_word_in_the_python_random_state_is_refused_by_name(tmp_path):
    """random.setstate raises OverflowError (not a ValueError) for a negative word: it escaped the
    RNG check as is (found by the load_state fuzz target)."""
    acc, model, opt, sched, path = _saved(tmp_path)
    doc = json.loads((path / "random_states_0.json").read_text())
    doc["state"]["random_state"]["__tuple__"][1]["__tuple__"][0] = -1
    _rewrite(path, "random_states_0.json", json.dumps(doc).encode())
    _assert_failed_load_changed_nothing(acc, model, opt, path, CheckpointError,
                                        r"random_states_0\.json: invalid random states \(OverflowError")


def test_a_bad_next_iteration_in_the_marker_is_refused_before_anything_changes(tmp_path):
    """checkpoint.json's next_iteration was converted with int() after every state had been set:
    a list there loaded the whole checkpoint and then raised TypeError (found by the load_state
    fuzz target). It is checked with the rest now."""
    acc, model, opt, sched, path = _saved(tmp_path)
    marker = json.loads((path / MARKER).read_text())
    marker["next_iteration"] = []
    (path / MARKER).write_text(json.dumps(marker))
    _assert_failed_load_changed_nothing(acc, model, opt, path, CheckpointError,
                                        r"checkpoint\.json: next_iteration must be a non-negative integer, got \[\]")


@pytest.mark.parametrize("case", ["reference_not_a_name", "param_id_not_an_int", "entry_not_an_object"])
def test_malformed_optimizer_json_is_refused_by_name(tmp_path, case):
    """Well-formed JSON with the wrong shapes inside (found by the load_state fuzz target): a
    tensor reference that is a list and a parameter id that is a list raised TypeError
    (unhashable) from the checks; a per-parameter state that is a list was loaded into the
    optimizer, to fail at its next step."""
    acc, model, opt, sched, path = _saved(tmp_path)
    doc = json.loads((path / "optimizer.json").read_text())
    if case == "reference_not_a_name":
        doc["state"]["state"]["__dict__"][0][1]["exp_avg"] = {"__tensor__": []}
        match = r"optimizer\.json: a tensor reference must be a name, got \[\]"
    elif case == "param_id_not_an_int":
        doc["state"]["param_groups"][0]["params"][-1] = []
        match = r"optimizer\.json: parameter group 0: 'params' must be a list of parameter ids"
    else:
        doc["state"]["state"]["__dict__"][0][1] = []
        match = r"optimizer\.json: the state of parameter 0 must be an object, got \[\]"
    _rewrite(path, "optimizer.json", json.dumps(doc).encode())
    _assert_failed_load_changed_nothing(acc, model, opt, path, CheckpointError, match)

"""save_state / load_state / save_model / save: resume exactness, crash safety, bad files, and
checkpoints written by accelerate 1.15 itself.

References: the uninterrupted run (resume must give bitwise the same losses), torch's own
state_dict()s of a plain-PyTorch model/optimizer/scheduler/GradScaler, and accelerate 1.15's
save_state/load_state run in the same test (in a subprocess where its singletons would clash).
"""
from __future__ import annotations

import json
import copy
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from torch import nn

from accelerate_c import Accelerator, CoreError, ProjectConfiguration
from accelerate_c.checkpointing import MARKER, CheckpointError, PickleRequiredError, complete_checkpoints
from accelerate_c.safetensors_io import list_tensors, load_file

from helpers import fresh_state, make_loader, make_model, reset_all_states  # noqa: F401
from test_launch import launch
from timeouts import wait_s

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "checkpoint_resume.py")
PY = sys.executable
ENV = dict(os.environ, PYTHONPATH=os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
PRECISIONS = "no,bf16,fp16"


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


# ---- resume exactness ---------------------------------------------------------------------------
def _compare_runs(workdir, ranks):
    for rank in range(ranks):
        with open(os.path.join(workdir, f"full_{rank}.json")) as f:
            full = json.load(f)
        with open(os.path.join(workdir, f"resume_{rank}.json")) as f:
            resumed = json.load(f)
        for precision in PRECISIONS.split(","):
            a, b = full[precision], resumed[precision]
            assert len(a["losses"]) == a["m"] > 0
            assert b["losses"] == a["losses"], f"rank {rank} {precision}: losses after resume differ"
            assert b["params"] == a["params"], f"rank {rank} {precision}: final parameters differ"
            assert b["after_save_or_load"] == a["after_save_or_load"], (rank, precision)
        if ranks == 1:
            assert full["fp16"]["after_save_or_load"]["scale"] != 2.0 ** 20  # the scaler moved before the save


def test_resume_is_bitwise_exact_in_a_new_process(tmp_path):
    for phase in ("full", "resume"):
        res = run_py([SCRIPT, phase, str(tmp_path), PRECISIONS])
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    _compare_runs(tmp_path, 1)
    ckpt = tmp_path / "fp16" / "checkpoints" / "checkpoint_0"
    assert sorted(os.listdir(ckpt)) == sorted([
        MARKER, "model.safetensors", "optimizer.json", "optimizer.safetensors", "scheduler.json", "scaler.json",
        "random_states_0.json", "random_states_0.safetensors", "dataloader_0.json", "dataloader_0.safetensors",
        "custom_checkpoint_0.json", "custom_checkpoint_0.safetensors"])


def test_resume_is_bitwise_exact_on_two_processes(tmp_path):
    for phase in ("full", "resume"):
        res = launch(["--num_processes", "2", "--cpu", "--main_process_port", "0", SCRIPT, phase, str(tmp_path),
                      PRECISIONS], env={"PYTHONPATH": ENV["PYTHONPATH"]}, timeout=wait_s(300))
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        assert f"checkpoint_resume {phase} OK on 2 processes" in res.stdout
    _compare_runs(tmp_path, 2)
    ckpt = tmp_path / "no" / "checkpoints" / "checkpoint_0"
    names = set(os.listdir(ckpt))
    assert {"random_states_0.json", "random_states_1.json", MARKER} <= names
    assert not any(n.startswith(".") for n in os.listdir(ckpt.parent)), os.listdir(ckpt.parent)


def test_a_save_failing_on_one_rank_raises_on_every_rank(tmp_path):
    res = launch(["--num_processes", "2", "--cpu", "--main_process_port", "0", SCRIPT, "fail", str(tmp_path)],
                 env={"PYTHONPATH": ENV["PYTHONPATH"]}, timeout=wait_s(300))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"fail_{r}.json").read_text()) for r in (0, 1))
    assert r0["raised"][0] == "TypeError" and "cannot be saved without pickle" in r0["raised"][1]
    assert r1["raised"][0] == "RuntimeError" and "another process failed" in r1["raised"][1]
    assert r0["left"] == r1["left"] == []  # no checkpoint, no temporary directory
    assert r0["iteration"] == r1["iteration"] == 0
    assert r0["weights"] == r1["weights"] == ["model.safetensors"]  # save_model: written once, seen by all


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


# ---- save_on_each_node on a shared file system: two "nodes" on one host ---------------------------------------
def test_save_on_each_node_two_nodes_one_shared_directory(tmp_path):
    """2 launchers x 2 processes (ranks 0,1 on node 0, ranks 2,3 on node 1) save into one
    directory: one complete checkpoint (every rank's random states, one marker that lists them),
    no temporary directories left, weights as torch saved them, each rank's RNG its own."""
    import socket
    import shutil as _shutil

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    exe = _shutil.which("accelerate-c", path=os.path.dirname(sys.executable))
    script = os.path.join(HERE, "scripts", "checkpoint_nodes.py")
    env = dict(ENV, OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf"))
    env.pop("WORLD_SIZE", None)
    out = tmp_path / "shared"
    out.mkdir()
    common = ["--cpu", "--num_processes", "4", "--num_machines", "2", "--main_process_ip", "127.0.0.1",
              "--main_process_port", port, "--same_network"]
    procs = [subprocess.Popen([exe, "launch", *common, "--machine_rank", str(m), script, str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for m in (0, 1)]
    try:
        outs = [p.communicate(timeout=wait_s(240))[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    results = [json.loads((out / f"nodes_{r}.json").read_text()) for r in range(4)]
    assert [(r["node"], r["local"]) for r in results] == [("0", 0), ("0", 1), ("1", 0), ("1", 1)]
    assert not [n for n in os.listdir(out) if n.startswith(".")], os.listdir(out)
    ck = out / "ck"
    marker = json.loads((ck / MARKER).read_text())
    rng = {f"random_states_{r}.{ext}" for r in range(4) for ext in ("json", "safetensors")}
    assert rng <= set(marker["files"]) and rng <= set(os.listdir(ck)), sorted(os.listdir(ck))
    assert marker["ranks"] == [0, 1, 2, 3] and marker["nodes"] == [0, 1]
    assert set(marker["files"]) == set(os.listdir(ck)) - {MARKER}
    for name, size in marker["files"].items():
        assert (ck / name).stat().st_size == size, name
    # the weights file against torch's own copy of the saved weights, read by the safetensors package
    from safetensors.torch import load_file as st_load

    ref = torch.load(out / "params.pt", weights_only=True)
    got = st_load(str(ck / "model.safetensors"))
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    for r in results:
        assert r["restored"], r
        assert r["drawn_after_load"] == r["drawn"], r  # each rank got its own generator back
    assert len({tuple(r["drawn"]) for r in results}) == 4


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

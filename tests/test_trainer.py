"""accelerate_c.Trainer against a hand-written PyTorch loop (same seed, data order, AdamW,
schedule, clipping and accumulation), checkpoint resume in a new process (bitwise), checkpoint
rotation, logging/evaluation cadence, a transformers-style script, and 2 processes through the
real launcher."""
from __future__ import annotations

import copy
import inspect
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from accelerate_c import Trainer, TrainerCallback, TrainingArguments
from helpers import fresh_state  # noqa: F401  (autouse: fresh Accelerator states per test)

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts")
sys.path.insert(0, SCRIPTS)

import trainer_common as tc  # noqa: E402
from timeouts import wait_s

RTOL, ATOL = 1e-6, 1e-7  # fp32: the fused clip computes the norm in double (last-bit differences)


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_params(got: dict, ref: dict, rtol=RTOL, atol=ATOL):
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def _trainer(tmp_path, **overrides):
    return Trainer(tc.make_model(), tc.train_args(str(tmp_path / "out"), **overrides), train_dataset=tc.make_data(),
                   eval_dataset=tc.make_data(tc.N_EVAL, seed=2), compute_loss_func=tc.mse)


def test_signature_matches_transformers():
    names = list(inspect.signature(Trainer.__init__).parameters)[1:14]
    assert names == ["model", "args", "data_collator", "train_dataset", "eval_dataset", "processing_class",
                     "model_init", "compute_loss_func", "compute_metrics", "callbacks", "optimizers",
                     "optimizer_cls_and_kwargs", "preprocess_logits_for_metrics"]


def test_matches_plain_torch_loop(tmp_path):
    trainer = _trainer(tmp_path)
    ref_model = copy.deepcopy(trainer.model)
    out = trainer.train()
    assert out.global_step == 18 and trainer.state.max_steps == 18  # 11 batches, accum 2 -> 6 steps/epoch
    tc.reference_train(ref_model, tc.make_data())
    _assert_params(_params(trainer.accelerator.unwrap_model(trainer.model)), _params(ref_model))
    # weight decay only on the Linear weights; the schedule ended at 0
    groups = trainer.optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0] and len(groups[0]["params"]) == 2
    assert trainer.lr_scheduler.get_last_lr()[0] == 0.0


@pytest.mark.parametrize("kind,expect", [
    ("cosine", lambda s, w, t: 0.5 * (1 + torch.cos(torch.tensor(torch.pi * (s - w) / (t - w)))).item()),
    ("constant", lambda s, w, t: 1.0),
    ("constant_with_warmup", lambda s, w, t: min(1.0, s / w)),
])
def test_schedulers(tmp_path, kind, expect):
    trainer = _trainer(tmp_path, lr_scheduler_type=kind, max_steps=8, logging_steps=1)
    trainer.train()
    lrs = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]
    assert len(lrs) == 8
    for step, lr in enumerate(lrs, start=1):  # the rate step `step` used (the schedule at step - 1), as transformers
        k = step - 1
        want = 1e-2 * (1.0 if kind == "constant" else k / 3 if k < 3 else expect(k, 3, 8))
        assert lr == pytest.approx(want, rel=1e-6, abs=1e-12), (step, lr, want)


def test_plateau_steps_after_evaluations_and_resumes(tmp_path):
    """reduce_lr_on_plateau: the rate each step used is what torch's ReduceLROnPlateau, fed the
    logged eval losses after each evaluation, gives (no warm-up); a run resumed from a
    checkpoint continues with the same rates and ends with the same parameters, bit for bit."""
    kw = dict(lr_scheduler_type="reduce_lr_on_plateau", lr_scheduler_kwargs={"patience": 0, "factor": 0.5},
              eval_strategy="steps", eval_steps=2, max_steps=10, logging_steps=1, learning_rate=0.2,
              save_strategy="steps", save_steps=4)
    full = _trainer(tmp_path / "full", **kw)
    full.train()
    hist = full.state.log_history
    evals = {e["step"]: e["eval_loss"] for e in hist if "eval_loss" in e}
    assert sorted(evals) == [2, 4, 6, 8, 10]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.2)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    want = []
    for step in range(1, 11):
        want.append(opt.param_groups[0]["lr"])
        if step in evals:
            plateau.step(evals[step])
    got = [e["learning_rate"] for e in hist if "loss" in e]
    assert got == want and len(set(want)) >= 2
    resumed = _trainer(tmp_path / "resumed", **kw)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "out" / "checkpoint-4"))
    assert [e["learning_rate"] for e in resumed.state.log_history if "loss" in e and e["step"] > 4] == got[4:]
    a, b = (_params(t.accelerator.unwrap_model(t.model)) for t in (full, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_logging_steps_and_eval_steps(tmp_path):
    trainer = _trainer(tmp_path, max_steps=10, logging_steps=3, eval_strategy="steps", eval_steps=4)
    trainer.train()
    hist = trainer.state.log_history
    assert [e["step"] for e in hist if "loss" in e] == [3, 6, 9]
    assert [e["step"] for e in hist if "eval_loss" in e] == [4, 8]
    assert "train_loss" in hist[-1] and hist[-1]["step"] == 10
    for e in hist:
        if "loss" in e:  # lr logged is the rate that step used: the linear schedule's at step - 1
            k = e["step"] - 1
            assert e["learning_rate"] == pytest.approx(1e-2 * (k / 3 if k < 3 else (10 - k) / 7), rel=1e-6)
    t2 = _trainer(tmp_path / "b", max_steps=4, logging_steps=3, logging_first_step=True)
    t2.train()
    assert [e["step"] for e in t2.state.log_history if "loss" in e] == [1, 3]
    t3 = _trainer(tmp_path / "c", num_train_epochs=2, logging_strategy="epoch")
    t3.train()
    assert [e["step"] for e in t3.state.log_history if "loss" in e] == [6, 12]


def test_logged_loss_is_the_mean_loss(tmp_path):
    trainer = _trainer(tmp_path, max_steps=2, logging_steps=2, gradient_accumulation_steps=1, max_grad_norm=0.0,
                       learning_rate=0.0, warmup_steps=0)
    model = copy.deepcopy(trainer.model)
    trainer.train()
    x, y = tc.make_data().tensors
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(tc.SEED))
    with torch.no_grad():
        want = sum(tc.mse(model(x[order[i * 4:(i + 1) * 4]]), y[order[i * 4:(i + 1) * 4]]).item() for i in range(2)) / 2
    logged = [e for e in trainer.state.log_history if "loss" in e][0]["loss"]
    assert logged == pytest.approx(round(want, 4), abs=1e-4)


def test_evaluate_and_compute_metrics(tmp_path):
    seen = {}

    def metrics(pred):
        preds, labels = pred
        seen["shapes"] = (preds.shape, labels.shape)
        return {"mae": float(abs(preds - labels).mean())}

    trainer = Trainer(tc.make_model(), tc.train_args(str(tmp_path)), eval_dataset=tc.make_data(tc.N_EVAL, seed=2),
                      compute_loss_func=tc.mse, compute_metrics=metrics)
    ref = copy.deepcopy(trainer.model)
    m = trainer.evaluate()
    x, y = tc.make_data(tc.N_EVAL, seed=2).tensors
    with torch.no_grad():
        out = ref(x)
        # per batch (5, then 5) mean losses, weighted by batch size: transformers' eval_loss
        want = (tc.mse(out[:5], y[:5]).item() * 5 + tc.mse(out[5:], y[5:]).item() * 5) / 10
    assert m["eval_loss"] == pytest.approx(want, rel=1e-6)
    assert m["eval_mae"] == pytest.approx((out - y).abs().mean().item(), rel=1e-6)
    assert seen["shapes"] == ((10, 2), (10, 2))
    assert "eval_runtime" in m and trainer.state.log_history[-1]["eval_loss"] == m["eval_loss"]


def _run(args, env=None, timeout=wait_s(120)):
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    full_env.pop("WORLD_SIZE", None)
    return subprocess.Popen([sys.executable, os.path.join(SCRIPTS, "trainer_common.py"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env)


def _wait(proc, timeout=wait_s(150)):
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def test_resume_in_a_new_process_is_bitwise_equal(tmp_path):
    full = _run([str(tmp_path / "full"), str(tmp_path / "full.pt")])
    part = _run([str(tmp_path / "part"), str(tmp_path / "part.pt"), "--interrupt-at", "8"])
    _wait(full)
    _wait(part)
    assert not (tmp_path / "part.pt").exists()
    ckpts = sorted(os.listdir(tmp_path / "part"))
    assert ckpts == ["checkpoint-4", "checkpoint-8"], ckpts
    state = json.loads((tmp_path / "part" / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["global_step"] == 8 and state["epoch"] == pytest.approx(1 + 4 / 11)  # 2nd step of epoch 1
    # an incomplete newer checkpoint (no trainer_state.json) is not picked
    os.makedirs(tmp_path / "part" / "checkpoint-12")
    out = _wait(_run([str(tmp_path / "part"), str(tmp_path / "part.pt"), "--resume"]))
    assert "Resuming from" in out and "checkpoint-8" in out and "skipping 4 batches" in out, out[-2000:]
    a, b = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "part.pt")
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    assert a["eval"]["eval_loss"] == b["eval"]["eval_loss"]
    strip = lambda h: [{k: v for k, v in e.items() if "runtime" not in k and "per_second" not in k} for e in h]  # noqa
    assert strip(a["log_history"])[:-2] == strip(b["log_history"])[:-2]  # all but train summary + final eval


def test_save_total_limit_keeps_the_newest(tmp_path):
    trainer = _trainer(tmp_path, max_steps=9, save_strategy="steps", save_steps=2, save_total_limit=2)
    calls = []
    rotate = trainer._rotate_checkpoints

    def checked(limit):
        newest = os.path.join(trainer.args.output_dir, f"checkpoint-{trainer.state.global_step}")
        calls.append(os.path.isfile(os.path.join(newest, "trainer_state.json")))  # complete before pruning
        rotate(limit)

    trainer._rotate_checkpoints = checked
    trainer.train()
    assert calls and all(calls)
    assert sorted(os.listdir(trainer.args.output_dir)) == ["checkpoint-8", "checkpoint-9"]
    for name in ("checkpoint-8", "checkpoint-9"):
        assert os.path.isfile(os.path.join(trainer.args.output_dir, name, "trainer_state.json"))


def test_best_model_tracking(tmp_path):
    trainer = _trainer(tmp_path, max_steps=6, eval_strategy="steps", eval_steps=2, save_strategy="steps",
                       save_steps=2, metric_for_best_model="loss", save_total_limit=1, load_best_model_at_end=True)
    trainer.train()
    s = trainer.state
    evals = [e["eval_loss"] for e in s.log_history if "eval_loss" in e]
    assert s.best_metric == min(evals)
    assert s.best_model_checkpoint.endswith(f"checkpoint-{2 * (evals.index(min(evals)) + 1)}")
    assert os.path.isdir(s.best_model_checkpoint)


def test_model_without_loss_needs_compute_loss_func(tmp_path):
    trainer = Trainer(tc.make_model(), tc.train_args(str(tmp_path), max_steps=1), train_dataset=tc.make_data())
    with pytest.raises(ValueError, match="did not return a loss"):
        trainer.train()


def test_unsupported_arguments_and_model_init(tmp_path):
    with pytest.raises(TypeError, match="not supported"):
        Trainer(tc.make_model(), tc.train_args(str(tmp_path)), peft_config={"r": 8})
    with pytest.raises(RuntimeError, match="model or a model_init"):
        Trainer(args=tc.train_args(str(tmp_path)))
    t = Trainer(None, tc.train_args(str(tmp_path), max_steps=2), None, tc.make_data(), None, None, tc.make_model,
                tc.mse)
    assert t.train().global_step == 2
    model = tc.make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    t2 = Trainer(model, tc.train_args(str(tmp_path), max_steps=2), train_dataset=tc.make_data(),
                 compute_loss_func=tc.mse, optimizers=(sgd, None))
    t2.train()
    assert t2.optimizer.optimizer is sgd and t2.lr_scheduler.get_last_lr()[0] == pytest.approx(0.1 * 2 / 3)  # warm-up 3


def test_transformers_style_script_ports_by_changing_imports(tmp_path, capsys):
    import trainer_hf_style

    result = trainer_hf_style.main(str(tmp_path / "hf"))
    assert result["eval"]["eval_loss"] < result["eval_before"]["eval_loss"]
    assert 0.0 <= result["eval"]["eval_accuracy"] <= 1.0 and result["eval"]["eval_accuracy"] > 0.5
    assert os.path.isfile(tmp_path / "hf" / "training_args.bin")
    assert sorted(n for n in os.listdir(tmp_path / "hf") if n.startswith("checkpoint-")) == ["checkpoint-12"]


def test_two_processes_match_one_process_with_twice_the_batch(tmp_path):
    exe = shutil.which("accelerate-c", path=os.path.dirname(sys.executable))
    env = dict(os.environ)
    env.pop("WORLD_SIZE", None)
    res = subprocess.run([exe, "launch", "--num_processes", "2", "--cpu", "--main_process_port", "0",
                          os.path.join(SCRIPTS, "trainer_common.py"), str(tmp_path / "ddp"), str(tmp_path / "ddp.pt"),
                          "--batch", "4", "--samples", "48"], capture_output=True, text=True, timeout=wait_s(180), env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = torch.load(tmp_path / "ddp.pt")
    assert got["num_processes"] == 2
    trainer = Trainer(tc.make_model(), tc.train_args(str(tmp_path / "one"), per_device_train_batch_size=8),
                      train_dataset=tc.make_data(48), eval_dataset=tc.make_data(tc.N_EVAL, seed=2),
                      compute_loss_func=tc.mse)
    trainer.train()
    _assert_params(got["params"], _params(trainer.accelerator.unwrap_model(trainer.model)), rtol=1e-5, atol=1e-6)
    assert got["eval"]["eval_loss"] == pytest.approx(trainer.evaluate()["eval_loss"], rel=1e-5)
    assert sorted(os.listdir(tmp_path / "ddp"))[-1] == "checkpoint-9"


def test_model_init_retrains_from_scratch_and_save_only_model(tmp_path):
    args = tc.train_args(str(tmp_path / "a"), max_steps=4, save_strategy="steps", save_steps=2)
    t = Trainer(None, args, None, tc.make_data(), tc.make_data(tc.N_EVAL, seed=2), None, tc.make_model, tc.mse)
    t.evaluate()
    t.train()
    first = _params(t.accelerator.unwrap_model(t.model))
    t.train()  # model_init: a new model, optimizer and schedule, the same result
    _assert_params(_params(t.accelerator.unwrap_model(t.model)), first, rtol=0, atol=0)
    assert len(t.accelerator._models) == 1
    # a finished run resumed: nothing more to do
    assert t.train(resume_from_checkpoint=True).global_step == 4
    only = Trainer(tc.make_model(), tc.train_args(str(tmp_path / "b"), max_steps=2, save_strategy="steps",
                                                   save_steps=2, save_only_model=True),
                   train_dataset=tc.make_data(), compute_loss_func=tc.mse)
    only.train()
    assert os.path.isfile(tmp_path / "b" / "checkpoint-2" / "trainer_state.json")
    with pytest.raises(ValueError, match="no optimizer/scheduler state"):
        only.train(resume_from_checkpoint=True)


def test_resume_on_two_processes_is_bitwise_equal(tmp_path):
    """Mid-epoch resume on 2 ranks: skip_first_batches over the sharded sampler."""
    exe = shutil.which("accelerate-c", path=os.path.dirname(sys.executable))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)

    def launch(out, result, *extra):
        return subprocess.Popen([exe, "launch", "--num_processes", "2", "--cpu", "--main_process_port", "0",
                                 os.path.join(SCRIPTS, "trainer_common.py"), str(tmp_path / out),
                                 str(tmp_path / result), "--samples", "48", *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    full, part = launch("full", "full.pt"), launch("part", "part.pt", "--interrupt-at", "4")
    _wait(full)
    _wait(part)
    assert sorted(os.listdir(tmp_path / "part")) == ["checkpoint-4"]
    out = _wait(launch("part", "part.pt", "--resume"))
    assert "global step 4, epoch 1, skipping 2 batches" in out, out[-2000:]  # 3 steps per epoch
    a, b = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "part.pt")
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k

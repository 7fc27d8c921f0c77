"""accelerate_c's own Trainer against transformers' Trainer (on accelerate 1.15) in the same
test, on a tiny LlamaForCausalLM: evaluate with compute_metrics (the model's
keys_to_ignore_at_inference: its cache is not a prediction), predict, prediction_loss_only,
the learning rate logged at each step, and the metric reports."""
from __future__ import annotations

import io
import json
import os
import sys

import numpy as np
import pytest
import torch
import transformers

import accelerate_c
from helpers import fresh_state  # noqa: F401  (autouse: fresh Accelerator states per test)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts"))
import hf_trainer_llama as script  # noqa: E402


def _pair(tmp_path, compute_metrics=script.compute_metrics, make_model=script.make_model, **kw):
    """(transformers' Trainer, ours) on equal models, data and arguments."""
    common = dict(per_device_train_batch_size=4, per_device_eval_batch_size=4, use_cpu=True, report_to="none",
                  disable_tqdm=True, seed=3, optim="adamw_torch", **kw)
    out = []
    for name, cls, args_cls in (("hf", transformers.Trainer, transformers.TrainingArguments),
                                ("ours", accelerate_c.Trainer, accelerate_c.TrainingArguments)):
        args = args_cls(output_dir=str(tmp_path / name), **common)
        out.append(cls(model=make_model(), args=args, train_dataset=script.make_data(24, 1),
                       eval_dataset=script.make_data(10, 2), compute_metrics=compute_metrics))
    return out


def test_evaluate_and_predict_on_a_causal_lm_match_transformers(tmp_path):
    ref, ours = _pair(tmp_path)
    a, b = ref.evaluate(), ours.evaluate()
    assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-6)
    assert b["eval_accuracy"] == a["eval_accuracy"]
    pa, pb = ref.predict(script.make_data(6, 4)), ours.predict(script.make_data(6, 4))
    assert isinstance(pb.predictions, np.ndarray) and pb.predictions.shape == pa.predictions.shape == (6, 16, 64)
    np.testing.assert_allclose(pb.predictions, pa.predictions, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(pb.label_ids, pa.label_ids)
    assert pb.metrics["test_loss"] == pytest.approx(pa.metrics["test_loss"], rel=1e-6)
    assert pb.metrics["test_accuracy"] == pa.metrics["test_accuracy"]
    # with the cache not ignored, the outputs hold it as transformers' do (a DynamicCache is not an array)
    with pytest.raises(Exception):
        ours.evaluate(ignore_keys=[])


def test_prediction_loss_only_matches_transformers(tmp_path):
    calls = []

    def metrics(p):
        calls.append(1)
        return {"x": 0.0}

    ref, ours = _pair(tmp_path, compute_metrics=metrics, prediction_loss_only=True)
    a, b = ref.evaluate(), ours.evaluate()
    assert calls == []  # neither computed metrics
    timing = ("runtime", "per_second", "preparation_time", "epoch")
    assert {k for k in b if not k.endswith(timing)} == {k for k in a if not k.endswith(timing)} == {"eval_loss"}
    pa, pb = ref.predict(script.make_data(6, 4)), ours.predict(script.make_data(6, 4))
    assert pa.predictions is None and pb.predictions is None
    assert pb.metrics["test_loss"] == pytest.approx(pa.metrics["test_loss"], rel=1e-6)


def test_learning_rate_logged_at_the_step_transformers_logs_it(tmp_path):
    ref, ours = _pair(tmp_path, max_steps=6, warmup_steps=2, logging_steps=1, learning_rate=1e-3,
                      lr_scheduler_type="linear", save_strategy="no", max_grad_norm=1.0)
    ref.train()
    ours.train()
    la = [h for h in ref.state.log_history if "loss" in h]
    lb = [h for h in ours.state.log_history if "loss" in h]
    assert [h["step"] for h in lb] == [h["step"] for h in la] == [1, 2, 3, 4, 5, 6]
    assert [h["learning_rate"] for h in lb] == pytest.approx([h["learning_rate"] for h in la], rel=1e-12)
    assert la[0]["learning_rate"] == 0.0  # the warm-up's first step
    # one process, no accumulation: the same training (accelerate_c's Trainer logs the loss to 4 decimals)
    assert [h["loss"] for h in lb] == pytest.approx([h["loss"] for h in la], abs=5e-5)
    assert [h["grad_norm"] for h in lb] == pytest.approx([h["grad_norm"] for h in la], rel=1e-5)


def test_metric_reports_match_transformers(tmp_path, capsys):
    ref, ours = _pair(tmp_path)
    metrics = {"train_runtime": 83.76, "train_loss": 1.234567891, "total_flos": 3 << 30, "epoch": 2.0,
               "train_samples_per_second": 12.5}
    out = []
    for t in (ref, ours):
        t.log_metrics("train", metrics)
        out.append(capsys.readouterr().out)
        t.save_metrics("train", metrics)
        t.save_metrics("eval", {"eval_loss": 0.5})
        t.save_state()
    assert out[0] == out[1]
    for name in ("train_results.json", "eval_results.json", "all_results.json"):
        with open(tmp_path / "hf" / name) as f, open(tmp_path / "ours" / name) as g:
            assert json.load(f) == json.load(g), name
    with open(tmp_path / "ours" / "trainer_state.json") as f:
        assert json.load(f)["global_step"] == ours.state.global_step


@pytest.mark.parametrize("kind,kwargs", [
    ("linear", {}), ("cosine", {"num_cycles": 0.7}), ("cosine_with_restarts", {"num_cycles": 3}),
    ("polynomial", {"lr_end": 1e-4, "power": 2.0}), ("constant", {}), ("constant_with_warmup", {}),
    ("inverse_sqrt", {}), ("inverse_sqrt", {"timescale": 5}), ("cosine_with_min_lr", {"min_lr": 1e-4}),
    ("cosine_with_min_lr", {"min_lr_rate": 0.2}), ("cosine_warmup_with_min_lr", {"min_lr": 1e-3}),
    ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.1, "warmup_lr_rate": 0.3, "num_cycles": 0.6}),
    ("warmup_stable_decay", {"num_decay_steps": 6}),
    ("warmup_stable_decay", {"num_decay_steps": 5, "warmup_type": "cosine", "decay_type": "linear",
                             "min_lr_ratio": 0.1}),
    ("warmup_stable_decay", {"num_decay_steps": 4, "num_stable_steps": 3, "warmup_type": "1-sqrt",
                             "decay_type": "1-sqrt", "min_lr_ratio": 0.05}),
    ("warmup_stable_decay", {"num_decay_steps": 7, "decay_type": "cosine", "num_cycles": 0.3})])
@pytest.mark.parametrize("warmup_steps", [3, 0.25])
def test_lr_scheduler_types_and_fractional_warmup_match_transformers(tmp_path, kind, kwargs, warmup_steps):
    total = 17
    hf_args = transformers.TrainingArguments(output_dir=str(tmp_path), warmup_steps=warmup_steps, report_to="none")
    ours_args = accelerate_c.TrainingArguments(output_dir=str(tmp_path), warmup_steps=warmup_steps,
                                               lr_scheduler_type=kind, lr_scheduler_kwargs=dict(kwargs))
    assert ours_args.get_warmup_steps(total) == hf_args.get_warmup_steps(total)
    warm = hf_args.get_warmup_steps(total)
    rates = []
    for get in (transformers.get_scheduler, accelerate_c.training_args.get_scheduler):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)
        sched = get(kind, opt, num_warmup_steps=warm, num_training_steps=total,
                    **({"scheduler_specific_kwargs": dict(kwargs)} if get is transformers.get_scheduler
                       else dict(kwargs)))
        seq = []
        for _ in range(total + 4):  # past the end too
            seq.append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
        rates.append(seq)
    assert rates[1] == pytest.approx(rates[0], rel=1e-12, abs=1e-15)


def _tiny_gpt2():
    torch.manual_seed(0)
    # no dropout: two Trainers in one process draw from one global RNG
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32,
                                  bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def test_label_smoothing_shifts_a_causal_lm_not_named_for_causal_lm(tmp_path):
    """GPT2LMHeadModel is in transformers' causal-LM table without the *ForCausalLM name: our
    Trainer's smoothed loss equals transformers' LabelSmoother with its labels shifted, on the same
    outputs. (transformers' own Trainer on GPT-2 is not the reference here: it divides the
    shifted sum by the unshifted label count, 15/16 of the mean on these 16-token rows.)"""
    from transformers.trainer_pt_utils import LabelSmoother

    _, ours = _pair(tmp_path, make_model=_tiny_gpt2, compute_metrics=None, label_smoothing_factor=0.1,
                    save_strategy="no")
    model = ours.model.eval()
    rows = [script.make_data(4, 2)[i] for i in range(4)]
    batch = {k: torch.stack([torch.as_tensor(r[k]) for r in rows]) for k in rows[0]}
    with torch.no_grad():
        got = ours.compute_loss(model, batch)
        outputs = model(input_ids=batch["input_ids"])
        want = LabelSmoother(epsilon=0.1)(outputs, batch["labels"], shift_labels=True)
        unshifted = LabelSmoother(epsilon=0.1)(outputs, batch["labels"], shift_labels=False)
    assert float(got) == pytest.approx(float(want), rel=1e-6) and float(got) != pytest.approx(float(unshifted))


def test_label_smoothing_matches_transformers(tmp_path):
    ref, ours = _pair(tmp_path, label_smoothing_factor=0.1, max_steps=3, logging_steps=1, save_strategy="no",
                      learning_rate=1e-3)
    a, b = ref.evaluate(), ours.evaluate()
    plain = _pair(tmp_path / "plain")[1].evaluate()["eval_loss"]
    assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-6) and b["eval_loss"] != pytest.approx(plain)
    ref.train()
    ours.train()
    la = [h["loss"] for h in ref.state.log_history if "loss" in h]
    lb = [h["loss"] for h in ours.state.log_history if "loss" in h]
    assert len(lb) == len(la) == 3 and lb == pytest.approx(la, abs=5e-5)  # ours: 4 decimals


def _metric_history(n=90, seed=0):
    """Evaluation results with runs of improvement, plateau and worsening (15 each), noisy."""
    g = torch.Generator().manual_seed(seed)
    values, v = [], 2.0
    for i in range(n):
        v += (-0.05, 0.0, 0.02)[(i // 15) % 3] + 0.01 * float(torch.randn((), generator=g))
        values.append(v)
    return values


@pytest.mark.parametrize("kind,kwargs", [
    ("reduce_lr_on_plateau", {}),
    ("reduce_lr_on_plateau", {"patience": 1, "factor": 0.5, "cooldown": 2, "threshold_mode": "abs",
                              "threshold": 0.005, "min_lr": 1e-3}),
    ("reduce_lr_on_plateau", {"mode": "max", "patience": 0}),
    ("greedy", {}),
    ("greedy", {"patience": 1, "factor": 0.7, "cooldown": 1, "warmup": 2, "min_lr": 2e-3, "max_lr": 5e-2}),
    ("greedy", {"patience": 0, "smooth": True, "window_size": 4, "threshold_mode": "rel", "threshold": 1e-3,
                "reset_start": 3, "min_lr": 5e-3}),
    ("greedy", {"mode": "max", "patience": 2, "factor": 0.5})])
def test_metric_driven_schedules_match_transformers(kind, kwargs):
    """Fed the same evaluation results, ours and transformers' scheduler set the same rates after
    every step; ours, saved halfway (torch.save, loaded with weights_only as a checkpoint is) with
    its optimizer and restored onto new ones, goes on alike."""
    rates = []
    for get in (transformers.get_scheduler, accelerate_c.training_args.get_scheduler):
        extra = {"scheduler_specific_kwargs": dict(kwargs)} if get is transformers.get_scheduler else dict(kwargs)

        def build(state=None, get=get, extra=extra):
            opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)
            sched = get(kind, opt, num_warmup_steps=3, num_training_steps=90, **extra)
            if state is not None:
                opt.load_state_dict(state["opt"])
                sched.load_state_dict(torch.load(io.BytesIO(state["sched"]), weights_only=True))
            return opt, sched

        opt, sched = build()
        seq = []
        for i, metric in enumerate(_metric_history()):
            if i == 45 and get is not transformers.get_scheduler:
                buf = io.BytesIO()
                torch.save(sched.state_dict(), buf)
                opt, sched = build({"opt": opt.state_dict(), "sched": buf.getvalue()})
            sched.step(metric)
            seq.append((opt.param_groups[0]["lr"], sched.get_last_lr()[0]))
        rates.append(seq)
    assert rates[1] == rates[0]
    assert len({lr for lr, _ in rates[0]}) >= 3  # the metric moved the rate more than once


@pytest.mark.parametrize("kind,kwargs", [("reduce_lr_on_plateau", {"patience": 0, "factor": 0.5, "threshold": 0.05}),
                                         ("greedy", {"patience": 0, "factor": 0.5, "min_lr": 1e-4,
                                                     "max_lr": 0.05})])
def test_metric_driven_schedules_in_training_match_transformers(tmp_path, kind, kwargs):
    """Stepped with eval_loss after each evaluation (not at eval_on_start, nor per step; no
    warm-up): the learning rate logged at every step is transformers' Trainer's."""
    ref, ours = _pair(tmp_path, lr_scheduler_type=kind, lr_scheduler_kwargs=kwargs, max_steps=6, logging_steps=1,
                      eval_strategy="steps", eval_steps=2, eval_on_start=True, learning_rate=2e-2, warmup_steps=2,
                      save_strategy="no", compute_metrics=None)
    assert ours.args.metric_for_best_model == ref.args.metric_for_best_model == "loss"
    ref.train()
    ours.train()
    la = [h["learning_rate"] for h in ref.state.log_history if "loss" in h]
    lb = [h["learning_rate"] for h in ours.state.log_history if "loss" in h]
    ea = [h["eval_loss"] for h in ref.state.log_history if "eval_loss" in h]
    eb = [h["eval_loss"] for h in ours.state.log_history if "eval_loss" in h]
    assert len(ea) == len(eb) == 4 and eb == pytest.approx(ea, rel=1e-5)
    assert len(la) == len(lb) == 6 and lb == pytest.approx(la, rel=1e-12)
    assert la[0] == 2e-2 and len(set(la)) >= 2  # no warm-up; the evaluations moved the rate


def test_eval_loss_of_gpt2_is_the_token_mean_transformers_reports_15_16_of_it(tmp_path):
    """transformers 5.23's Trainer passes num_items_in_batch (the count of labels that are not
    -100) to a model that takes loss kwargs. It counts the shifted labels only for a model whose
    loss_type is a causal LM's; GPT2LMHeadModel's loss_type is None (its class name names no loss),
    yet its loss function shifts: the 15 losses of each 16-token row are divided by 16. Ours
    reports the model's own mean over the predicted tokens (what transformers reports for a
    LlamaForCausalLM, test above). Both numbers, against plain torch on the same weights."""
    ref, ours = _pair(tmp_path, make_model=_tiny_gpt2, compute_metrics=None, save_strategy="no", max_steps=1,
                      logging_steps=1, learning_rate=1e-3)
    assert ref.model.loss_type is None  # the reason (transformers' _loss_shifts_labels is False)
    rows = [script.make_data(10, 2)[i]["input_ids"] for i in range(10)]
    token_mean, per_label = [], []
    ours.model.eval()
    with torch.no_grad():
        for b in range(0, 10, 4):  # the eval batches (per_device_eval_batch_size=4)
            ids = torch.stack(rows[b:b + 4])
            logits = ours.model(input_ids=ids).logits
            nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                    ids[:, 1:].reshape(-1), reduction="sum")
            token_mean += [float(nll) / ids[:, 1:].numel()] * len(ids)
            per_label += [float(nll) / ids.numel()] * len(ids)
    a, b = ref.evaluate()["eval_loss"], ours.evaluate()["eval_loss"]
    assert b == pytest.approx(np.mean(token_mean), rel=1e-6)
    assert a == pytest.approx(np.mean(per_label), rel=1e-6) and a == pytest.approx(b * 15 / 16, rel=1e-6)
    # training logs the same two numbers (the first step: the same weights and batch on both)
    ref.train()
    ours.train()
    la = [h["loss"] for h in ref.state.log_history if "loss" in h]
    lb = [h["loss"] for h in ours.state.log_history if "loss" in h]
    assert la[0] == pytest.approx(lb[0] * 15 / 16, abs=1e-4)  # ours: 4 decimals

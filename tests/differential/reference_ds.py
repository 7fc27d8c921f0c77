"""A ZeRO case under bf16/fp16 trained with plain PyTorch the way DeepSpeed's engine trains it
(what accelerate computes with a DeepSpeed config that enables bf16 or fp16): the reference the
harness holds accelerate_c's 16-bit policy to. It never imports accelerate_c.

Written from DeepSpeed's documented behaviour (deepspeed/runtime/engine.py, zero/stage_1_and_2.py,
fp16/loss_scaler.py): the model itself cast to 16 bits (no autocast), its gradients averaged in
16 bits by torch DDP; the loss taken in fp32, divided by the accumulation steps and, under fp16,
multiplied by the loss scale; at each window's end an overflow check of the still-scaled 16-bit
gradients (a step with a non-finite one is skipped everywhere and the scale follows DeepSpeed's
rule, tests/ds_scaler_rule.py); otherwise the 2-norm of the 16-bit gradients in double with the
scale divided out, and the optimizer stepping fp32 masters whose gradients are the 16-bit ones
widened, unscaled and multiplied by the clip coefficient; the masters rounded back into the model.
A torch scheduler steps once per process per step (accelerate's AcceleratedScheduler), not on a
skipped one.
"""
from __future__ import annotations

import contextlib

import torch

from ds_scaler_rule import ReferenceScaler

from . import workload as W
from .reference import Addends, batches_of, evaluate, world_rank, wrap

_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


def run(case: dict) -> dict:
    world, rank = world_rank()
    dtype = _DTYPE[case["mp"]]
    models = [m.to(dtype) for m in W.models(case)]
    params = []
    for m in models:
        params += [p for p in m.parameters() if p.requires_grad and all(p is not q for q in params)]
    addends = Addends(params)
    nets = wrap(case, models, world)
    masters = [p.detach().float().clone() for p in params]
    opts = W.optimizers(case, masters)
    sched = W.schedule(opts[0])
    scaler = None
    if case["mp"] == "fp16":
        fp16 = W.deepspeed_fp16(case)
        scaler = ReferenceScaler(2.0 ** fp16["initial_scale_power"], fp16["loss_scale_window"],
                                 fp16["min_loss_scale"], fp16["hysteresis"], fp16["consecutive_hysteresis"])
    batches = batches_of(case, W.dataset(case), world, rank)
    trace = {"steps": [], "initial": [p.detach().float().clone() for p in params]}
    resumed = False
    for epoch in range(case["epochs"]):
        epoch_batches = batches[case["skip_first"]:] if epoch == 0 else batches
        n = len(epoch_batches)
        for i, (x, y) in enumerate(epoch_batches):
            window_end = (i + 1) % case["ga"] == 0 or i + 1 == n
            with contextlib.ExitStack() as stack:
                if world > 1 and not window_end:
                    for d in nets:
                        stack.enter_context(d.no_sync())
                outs = [d(x.to(dtype), **W.forward_kwargs(case, i, rank)) for d in nets]
                loss = W.loss_of([o.float() for o in outs], y).float() / case["ga"]
                if case["overflow"] is not None and case["overflow"] == (rank, i) and epoch == 0:
                    loss = loss * float("inf")
                (loss * scaler.cur_scale if scaler is not None else loss).backward()
            if window_end:
                _step(case, params, masters, opts, sched, scaler, world, trace)
                # the recorded gradients and the addends are both still scaled (DeepSpeed's policy)
                trace["steps"][-1]["addends"] = addends.take(params)
                _zero_grads(case, models, params, masters)
                if case.get("resume") == len(trace["steps"]) and i + 1 < n and not resumed:
                    # where the subject saves and loads (its resume axis): a resumed engine has
                    # stashed no norm yet (a skipped step next reports 0.0)
                    resumed = True
                    trace["last_norm"] = 0.0
    trace.pop("last_norm", None)  # (_step's record of DeepSpeed's stashed norm)
    trace["final"] = [p.detach().float().clone() for p in params]
    if case["eval"]:
        trace["eval"] = evaluate(case, models[0], None, cast=lambda x: x.to(dtype))
    return trace


def _step(case, params, masters, opts, sched, scaler, world, trace):
    """DeepSpeed's ZeRO step (stage_1_and_2.py / stage3.py step()): the overflow check of the
    still-scaled gradients, then the loss scale's update, before anything else; a skipped step
    ends there, its norm left as the last step taken set it (0.0 before any: the engine reports
    that). Otherwise the norm of the scaled gradients, stashed divided by the scale they carry
    (stages 1 and 2) or by the updated one (stage 3), and unscale_and_clip_grads with the
    updated scale: the clip measured against the norm over the updated scale, the gradients
    divided by it (on a step that grows the scale, by twice what they carry)."""
    W.touch_grads(case, params, len(trace["steps"]))
    grads = [None if p.grad is None else p.grad.detach().float().clone() for p in params]
    carried = scaler.cur_scale if scaler is not None else 1.0
    with_grad = [p.grad for p in params if p.grad is not None]
    scaled_norm = float(torch.stack([g.double().square().sum() for g in with_grad]).sum().sqrt())
    skipped = scaler is not None and not all(bool(torch.isfinite(g).all()) for g in with_grad)
    if scaler is not None:
        scaler.update(skipped)
    updated = scaler.cur_scale if scaler is not None else 1.0
    if skipped:
        norm = trace.setdefault("last_norm", 0.0)
    else:
        norm = scaled_norm / (updated if case["sharding"] == "zero3" else carried)
        trace["last_norm"] = norm
        factor = 1.0 / updated
        if case["clip"] == "norm2":  # the engine's gradient_clipping (subject.py); the coefficient in fp32
            coef = torch.clamp(torch.tensor(case["max_norm"], dtype=torch.float32)
                               / (torch.tensor(scaled_norm / updated, dtype=torch.float32) + 1e-6), max=1.0)
            factor *= float(coef)
        for p, m in zip(params, masters):
            m.grad = None if p.grad is None else p.grad.float() * factor
        for opt in opts:
            opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        for _ in range(world):
            sched.step()
    trace["steps"].append({"params": [p.detach().float().clone() for p in params], "grads": grads,
                           "skipped": skipped, "lr": sched.get_last_lr()[0],
                           "scale": scaler.cur_scale if scaler is not None else None,
                           "norm": norm if case["clip"] != "none" else None})


def _zero_grads(case, models, params, masters):
    """The loop's zero_grad, in the case's style, on the model's gradients (the user's optimizer
    is rebuilt over the masters: its zero_grad reaches the model's gradients through the engine)."""
    for m in masters:
        m.grad = None
    style = case["zero_grad"]
    if style == "opt_zeros":
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
    elif style == "model":
        for m in models:
            m.zero_grad()
    else:  # opt_none, manual_none; never: DeepSpeed's engine clears them after its step
        for p in params:
            p.grad = None


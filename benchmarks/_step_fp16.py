"""The fp16 part of bench_step.py.

A separate benchmark times the fp16 gradient post-processing that accelerate_c's C
core replaces, on the same model's gradients: after one fp16-autocast backward with the loss
scaled by 65536 (accelerate_c's Accelerator(mixed_precision="fp16")), it times
  torch         torch.amp.GradScaler("cpu", init_scale=65536).unscale_(opt) +
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0), on a copy of the same grads
  accelerate_c  accelerator.clip_grad_norm_(model.parameters(), 1.0) (unscale + non-finite
                check + norm + clip, fused in C: over each gradient on one CPU process,
                accelerate_c/loose_grads.py; over the flat buffers with
                ACCELERATE_C_GRAD_BUFFERS=flat and on CUDA)
restoring the scaled gradients (untimed) before every call. The results are checked first
(a failure exits non-zero): accelerate_c's norm and gradients within 1e-6 relative of an fp64
reference computed from the same scaled gradients, and of torch's gradients within 1e-6 plus
torch's own norm error (clip_grad_norm_ sums squares in fp32 per tensor; on this model's
3M-element embedding gradient that is off by ~1e-5 overall, so "1e-6 against torch" alone
would fail torch, not us). Target: >= 1.5x faster (median vs median). torch's host read of
found_inf (done in scaler.step) is not timed, which favours torch slightly.
"""
from __future__ import annotations

import math
import sys

import torch

from _common import Contender, Summary, load_sample, other_load_between, print_table, run_interleaved, verdict
from _step_common import FP16_RTOL, FP16_RTOL_CUDA, FP16_SCALE, LR, MAX_NORM, SEED, TORCH_NORM_SANITY, device_note, \
    now, on_cuda, reset_singletons
import _step_common
import _targets
from models import GPT

import accelerate_c

BENCH = "bench_step"  # its name in the result lines (benchmarks/_targets.py)
TARGET_FP16_SPEEDUP = 1.5


def bench_fp16_postprocess(cfg, dataset, batch_size, repeats):
    """Returns (ok, {name: [seconds]}, info)."""
    reset_singletons()
    torch.manual_seed(SEED)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    accelerator = accelerate_c.Accelerator(mixed_precision="fp16", cpu=_step_common.DEVICE.type == "cpu")
    if accelerator.device.type != _step_common.DEVICE.type:
        raise SystemExit(f"accelerate_c's Accelerator picked {accelerator.device}, not {_step_common.DEVICE.type}")
    model, opt = accelerator.prepare(model, opt)
    if accelerator.scaler is None or accelerator.scaler.get_scale() != FP16_SCALE:
        raise SystemExit(f"expected accelerate_c's fp16 loss scale to start at {FP16_SCALE}")
    x = torch.stack([dataset[i][0] for i in range(batch_size)])
    y = torch.stack([dataset[i][1] for i in range(batch_size)])
    if on_cuda():
        x, y = x.to(_step_common.DEVICE), y.to(_step_common.DEVICE)
    loss = model(x, y)
    accelerator.backward(loss)  # loss * 65536 -> scaled grads in the flat buffers
    groups = accelerator._grads.groups  # the flat buffers; none on one CPU process (loose_grads.py)
    if (on_cuda() and not groups) or any(g.is_cuda != on_cuda() for g in groups):
        raise SystemExit(f"expected accelerate_c's gradient buffers on {_step_common.DEVICE.type}, got "
                         f"{[str(g.flat.device) for g in groups]}")
    params = [p for p in model.parameters() if p.requires_grad]
    tensors = [g.flat for g in groups] if groups else [p.grad for p in params]  # what the clip unscales
    saved = [t.clone() for t in tensors]
    if not all(torch.isfinite(p.grad).all() for p in params):
        raise SystemExit("the fp16 backward overflowed at scale 65536; cannot benchmark on these gradients")

    # torch: a separately built model holding a copy of the same scaled grads
    torch.manual_seed(SEED)
    model_t = GPT(cfg).to(_step_common.DEVICE)
    params_t = [p for p in model_t.parameters() if p.requires_grad]
    for p_t, p in zip(params_t, params):
        p_t.grad = p.grad.detach().clone()
    saved_t = [p.grad.clone() for p in params_t]
    opt_t = torch.optim.AdamW(params_t, lr=LR)
    scaler = torch.amp.GradScaler(_step_common.DEVICE.type, init_scale=FP16_SCALE)
    # creates the scale tensor (on the loss's device), as scaler.scale(loss) would
    scaler.scale(torch.ones((), dtype=torch.float32, device=_step_common.DEVICE))
    unscaled = [False]

    def torch_setup():
        if unscaled[0]:
            scaler.update()  # clears the per-optimizer "already unscaled" state (scale stays 65536)
            unscaled[0] = False
        for p, s in zip(params_t, saved_t):
            p.grad.copy_(s)

    def torch_fn():
        scaler.unscale_(opt_t)
        unscaled[0] = True
        # model.parameters(), as a training loop passes it (and as accelerate_c's contender does)
        return torch.nn.utils.clip_grad_norm_(model_t.parameters(), MAX_NORM)

    def ours_setup():
        for t, s in zip(tensors, saved):
            t.copy_(s)  # in place: the .grad views stay valid
        # as after an optimizer step: every gradient counts as scaled again (the scaler's state
        # machine unscales once per step), in the buffers and outside them
        accelerator._grads.new_scaler_step(params)

    def ours_fn():
        return accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)

    # equality check, once, before timing. accelerate_c is held to an fp64 reference computed
    # from the same scaled grads (norm and grads within FP16_RTOL). torch is compared with
    # accelerate_c too, but torch's own norm is inexact (clip_grad_norm_ sums squares in fp32
    # per tensor: on this model's 3M-element embedding grad that is off by ~1e-4 or more), and
    # its clip coefficient inherits that error: so the grads must agree within FP16_RTOL plus
    # torch's measured norm error, which must itself stay under TORCH_NORM_SANITY.
    rtol = FP16_RTOL_CUDA if on_cuda() else FP16_RTOL
    inv = 1.0 / FP16_SCALE
    ref_norm = math.sqrt(sum(float((s.double() * inv).pow(2).sum()) for s in saved))
    ref_coef = min(1.0, MAX_NORM / (ref_norm + 1e-6))
    torch_setup()
    norm_t = float(torch_fn())
    ours_setup()
    norm_o = float(ours_fn())
    if scaler.get_scale() != FP16_SCALE or accelerator.scaler.get_scale() != FP16_SCALE:
        raise SystemExit("a loss scale changed during the check")

    def rel(a, b):  # elementwise max |a - b| / |b| (0/0 = 0)
        a, b = a.double(), b.double()
        return float(((a - b).abs() / b.abs().clamp_min(1e-300)).max()) if a.numel() else 0.0

    grad_vs_ref = max(rel(p.grad, s.double() * (inv * ref_coef)) for p, s in zip(params, saved_t))
    grad_vs_torch = max(rel(p.grad, p_t.grad) for p, p_t in zip(params, params_t))
    norm_rel = abs(norm_o - ref_norm) / ref_norm
    torch_norm_rel = abs(norm_t - ref_norm) / ref_norm
    ok = (norm_rel <= rtol and grad_vs_ref <= rtol and torch_norm_rel <= TORCH_NORM_SANITY
          and grad_vs_torch <= rtol + torch_norm_rel)
    info = dict(rtol=rtol, norm=ref_norm, norm_rel=norm_rel, grad_rel=grad_vs_ref, torch_norm_rel=torch_norm_rel,
                grad_vs_torch=grad_vs_torch, clipped=ref_norm > MAX_NORM, numel=sum(p.numel() for p in params))
    if not ok:
        return ok, None, info

    times = run_interleaved(
        [Contender("torch", torch_fn, torch_setup), Contender("accelerate_c", ours_fn, ours_setup)],
        repeats=repeats, warmup=1, timer=now)  # now(): on the GPU, synchronize, then read the clock
    return ok, times, info


def run_fp16_benchmark(args, cfg, dataset):
    """The fp16 post-processing micro-benchmark with its checks and table; returns [ok], or
    None when the results differ beyond the limits."""
    print(f"fp16 gradient post-processing (unscale + non-finite check + clip) on the same model's "
          f"gradients, {args.fp16_repeats} interleaved repeats:")
    a = load_sample()
    ok, times, info = bench_fp16_postprocess(cfg, dataset, args.batch, args.fp16_repeats)
    load = other_load_between(a, load_sample())
    print(f"  {info['numel'] / 1e6:.1f}M fp32 gradient elements, loss scale {FP16_SCALE:g}; "
          f"norm {info['norm']:.6f} ({'clipped' if info['clipped'] else 'not clipped'} at {MAX_NORM})")
    print(f"  check against an fp64 reference: accelerate_c norm rel err {info['norm_rel']:.1e}, grads max rel "
          f"err {info['grad_rel']:.1e} (limit {info['rtol']:g}); torch norm rel err {info['torch_norm_rel']:.1e} "
          f"(fp32 sums; limit {TORCH_NORM_SANITY:g}); accelerate_c vs torch grads max rel diff "
          f"{info['grad_vs_torch']:.1e} (limit {info['rtol']:g} + torch's norm error)")
    if not ok:
        print("ERROR: the unscale+clip results differ beyond the limits above", file=sys.stderr)
        return None
    T = {n: Summary.of(v) for n, v in times.items()}
    rows = [[n, f"{T[n].median * 1e3:.2f}", f"{T[n].q1 * 1e3:.2f}", f"{T[n].q3 * 1e3:.2f}",
             f"{T[n].min * 1e3:.2f}"] for n in times]
    print_table(["contender", "ms median", "q1", "q3", "min"], rows)
    speedup = T["torch"].median / T["accelerate_c"].median
    ok = speedup >= TARGET_FP16_SPEEDUP
    # recorded here, in whichever process ran it (the fp16 child shares the parent's run token)
    _targets.target(BENCH, f"fp16 unscale+clip vs GradScaler + clip_grad_norm_{device_note()}", speedup,
                    TARGET_FP16_SPEEDUP, limit="memory-bound: 5/3 = 1.67x (element-passes, torch/ours)")
    print(f"  speedup (median torch / median accelerate_c): {speedup:.2f}x   target >= "
          f"{TARGET_FP16_SPEEDUP:.1f}x   {verdict(ok)}")
    if load is not None and load > 0.25:
        print(f"warning: other processes kept ~{load:.1f} CPUs busy while timing; the numbers are noisy")
    print()
    return [ok]

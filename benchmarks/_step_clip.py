"""The clip-in-a-real-loop part of bench_step.py.

A separate benchmark times clip_grad_norm_ in a real loop (one process, CPU) over the flat
gradient buffers (ACCELERATE_C_GRAD_BUFFERS=flat, set here for its Accelerator: the buffers
every multi-process run uses): after a real bf16-autocast backward, the C hooks have measured
each gradient's sum of squares while copying it into its range, so accelerator.clip_grad_norm_
is one scaling pass of the buffer. (One CPU process by default keeps autograd's gradients and
clips with torch's: with no copy to measure on the way, a measuring read in the hooks cost more
than it saved, accelerate_c/loose_grads.py.) It is timed
alone against an in-place scale of the same buffer after the same backward (torch's mul_ and
_C.scale_; the faster is the limit), and beside the same clip with those sums invalidated (a read
pass plus the scaling pass). Checked first: the clip reads no buffer, and its norm and gradients
are within 1e-6 of an fp64 reference from the same gradients (torch's clip_grad_norm_ on a copy
is printed beside; its fp32 norm is off by a few 1e-6 on this model). Target: the clip's own pass >= 90% of the limit's
bandwidth, taken as the median over rounds of the limit's time / the clip's in the same round (the
contenders' order rotates from round to round; the ratio of the medians is printed beside). --skip-clip skips it; --quick runs it on the tiny model, whose 1 MB buffer measures
the clip's fixed cost (~0.1-0.3 ms of Python and bookkeeping) rather than its pass.
"""
from __future__ import annotations

import math
import os
import statistics
from unittest import mock
import sys

import torch

from _common import Contender, Summary, load_sample, other_load_between, print_table, run_interleaved, verdict
from _step_common import LR, SEED, on_cuda, reset_singletons
import _targets
from models import GPT

import accelerate_c
from accelerate_c import _C

BENCH = "bench_step"  # its name in the result lines (benchmarks/_targets.py)
TARGET_CLIP_FRACTION = 0.90  # of the in-place-scale bandwidth, for the clip's own pass
CLIP_REL = 0.5  # max_norm = this x the gradients' norm, so the scaling pass really runs


def bench_clip_in_loop(cfg, dataset, batch_size, repeats):
    """After a real backward (bf16 autocast, zero_grad(set_to_none=True) before it, as the
    step benchmark's loop), times accelerator.clip_grad_norm_(params, max_norm) alone (params:
    the model's parameters, listed once): on one process the hooks measured each gradient while
    backward wrote it, so the clip is one scaling pass of the gradients. Held to an in-place scale of the same buffer after the same backward
    (torch's mul_ and _C.scale_). Also timed, for comparison: the same clip with the hooks'
    sums invalidated (a version bump, no data touched), i.e. a read pass plus the scaling pass,
    what every clip cost before. Returns (ok, times, info)."""
    from torch.autograd.graph import increment_version

    from accelerate_c import grad_layout as layout_mod
    from accelerate_c import grads as grads_mod

    reset_singletons()
    torch.manual_seed(SEED)
    model = GPT(cfg)
    model_t = GPT(cfg)  # torch's reference: a copy holding the same gradients
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    accelerator = accelerate_c.Accelerator(mixed_precision="bf16", cpu=True)
    with mock.patch.dict(os.environ, {"ACCELERATE_C_GRAD_BUFFERS": "flat"}):  # read at prepare
        model, opt = accelerator.prepare(model, opt)
    groups = accelerator._grads.groups  # the flat buffers
    x = torch.stack([dataset[i][0] for i in range(batch_size)])
    y = torch.stack([dataset[i][1] for i in range(batch_size)])
    params = [p for p in model.parameters() if p.requires_grad]

    def targets():
        """What the clip scales: the flat buffers."""
        return [g.flat for g in groups]

    def backward():
        opt.zero_grad(set_to_none=True)
        accelerator.backward(model(x, y))

    backward()
    numel = sum(t.numel() for t in targets())
    esize = targets()[0].element_size()
    norm0 = float(accelerator.clip_grad_norm_(model.parameters(), math.inf))  # asks for 2-norms; no clipping
    max_norm = CLIP_REL * norm0
    coef = max_norm / (norm0 + 1e-6)

    # check, once: the clip after a backward reads no buffer, and its norm and grads are those
    # of an fp64 reference from the same gradients (torch's own fp32 norm is off by ~1e-6 here;
    # printed beside)
    backward()
    saved = [p.grad.detach().clone() for p in params]
    for p_t, g in zip(model_t.parameters(), saved):
        p_t.grad = g.clone()
    torch_norm = float(torch.nn.utils.clip_grad_norm_(model_t.parameters(), max_norm))
    want = math.sqrt(sum(float(g.double().pow(2).sum()) for g in saved))
    ref_coef = min(1.0, max_norm / (want + 1e-6))
    real, reads = grads_mod._C, [0]

    class Counting:  # counts the read passes clip makes over a buffer (GradLayout.sums, or stats)
        def __getattr__(self, name):
            fn = getattr(real, name)
            if name in ("sumsq", "sumsq_segments", "stats"):
                reads[0] += 1
            return fn

    grads_mod._C = layout_mod._C = Counting()
    try:
        got = float(accelerator.clip_grad_norm_(model.parameters(), max_norm))
    finally:
        grads_mod._C = layout_mod._C = real
    grad_rel = max(float(((p.grad.double() - g.double() * ref_coef).abs()
                          / (g.double() * ref_coef).abs().clamp_min(1e-300)).max()) for p, g in zip(params, saved))
    info = dict(numel=numel, esize=esize, norm=norm0, max_norm=max_norm, reads=reads[0],
                norm_rel=abs(got - want) / want, grad_rel=grad_rel, torch_norm_rel=abs(torch_norm - want) / want)
    ok = reads[0] == 0 and info["norm_rel"] <= 1e-6 and grad_rel <= 1e-6
    if not ok:
        return ok, None, info

    def uncached_setup():
        backward()
        for t in targets():
            increment_version(t)  # the hooks' sums no longer match: clip reads the gradients

    def mul_():
        torch._foreach_mul_(targets(), coef)

    def scale_():
        for t in targets():
            _C.scale_(t, coef)

    def clip():  # `params` listed once: iterating model.parameters() is the loop's cost, not the clip's
        accelerator.clip_grad_norm_(params, max_norm)

    times = run_interleaved([
        Contender("clip_grad_norm_ (hook sums)", clip, backward),
        Contender("clip_grad_norm_ (sums not cached)", clip, uncached_setup),
        Contender("limit: torch mul_", mul_, backward),
        Contender("limit: _C.scale_", scale_, backward),
    ], repeats=repeats, warmup=1)
    return ok, times, info


def run_clip_benchmark(args, cfg, dataset):
    """The clip-in-a-real-loop benchmark with its check and table; returns [ok], [] where it
    does not apply (--device cuda: the hooks measure CPU buffers), or None when the check
    fails."""
    if on_cuda():
        print("clip_grad_norm_ in a real loop: skipped on --device cuda (the hooks measure CPU buffers only)\n")
        return []
    print(f"clip_grad_norm_ in a real loop (after a real backward; the sums measured in the hooks), "
          f"{args.clip_repeats} interleaved repeats:")
    a = load_sample()
    ok, times, info = bench_clip_in_loop(cfg, dataset, args.batch, args.clip_repeats)
    load = other_load_between(a, load_sample())
    n, es = info["numel"], info["esize"]
    print(f"  {n / 1e6:.1f}M gradient elements ({es * n / 1e6:.0f} MB), norm {info['norm']:.4f}, "
          f"max_norm {info['max_norm']:.4f}\n  check: buffer reads in clip {info['reads']} (expected 0); against an "
          f"fp64 reference: norm rel err {info['norm_rel']:.1e}, grads max rel err {info['grad_rel']:.1e} (limit "
          f"1e-6); torch's clip_grad_norm_ norm rel err {info['torch_norm_rel']:.1e} (fp32 sums)")
    if not ok:
        print("ERROR: the clip after a backward read the buffer or differs from the reference", file=sys.stderr)
        return None
    T = {k: Summary.of(v) for k, v in times.items()}
    nbytes = {k: (3 if "not cached" in k else 2) * n * es for k in times}  # read + write; + a read uncached
    bw = {k: nbytes[k] / T[k].median / 1e9 for k in times}  # GB/s
    limit_name = max((k for k in times if k.startswith("limit")), key=lambda k: bw[k])
    rows = [[k, f"{nbytes[k] // (n * es)}N", f"{T[k].median * 1e3:.2f}", f"{T[k].q1 * 1e3:.2f}",
             f"{T[k].q3 * 1e3:.2f}", f"{T[k].min * 1e3:.2f}", f"{bw[k]:.1f}", f"{100 * bw[k] / bw[limit_name]:.0f}%"]
            for k in times]
    print_table(["contender", "bytes", "median ms", "q1 ms", "q3 ms", "min ms", "GB/s", "% limit"], rows)
    ours = "clip_grad_norm_ (hook sums)"
    # Paired: within one round the clip and the limit run back to back after the same kind of
    # backward, so the machine's drift from round to round (this VM's bandwidth moves by tens
    # of percent) cancels in each round's ratio; the target is the median of those ratios.
    # The ratio of the two medians is printed beside it.
    frac = statistics.median(times[limit_name][r] / times[ours][r] for r in range(len(times[ours])))
    frac_medians = bw[ours] / bw[limit_name]
    ok = _targets.target(BENCH, "clip_grad_norm_ in a real loop: its pass vs an in-place scale", frac,
                         TARGET_CLIP_FRACTION, unit="%",
                         limit=f"{limit_name.removeprefix('limit: ')} {bw[limit_name]:.1f} GB/s")
    by_min = min(T[k].min for k in times if k.startswith("limit")) / T[ours].min
    print(f"  clip's own pass: {100 * frac:.0f}% of the in-place-scale bandwidth (median over rounds of "
          f"{limit_name.removeprefix('limit: ')}'s time / the clip's, same round)  target >= {100 * TARGET_CLIP_FRACTION:.0f}%  {verdict(ok)}\n"
          f"  (ratio of the medians: {100 * frac_medians:.0f}% of {limit_name.removeprefix('limit: ')}'s "
          f"{bw[limit_name]:.1f} GB/s; by the fastest call of each: {100 * by_min:.0f}%)")
    if load is not None and load > 0.25:
        print(f"warning: other processes kept ~{load:.1f} CPUs busy while timing; the numbers are noisy")
    print()
    return [ok]

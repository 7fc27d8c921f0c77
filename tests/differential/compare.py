"""The comparison of a subject trace with a reference trace, with tolerances stated per dtype."""
from __future__ import annotations

import math

import torch


def tolerance(case: dict) -> float:
    """Relative tolerance on parameters and norms (relative to the reference tensor's largest
    magnitude). fp32 end to end differs only in summation order; 16-bit parameters round each
    update to 8 bits of mantissa, so one ulp apart after a step is legitimate; so does a bf16 comm
    hook (the gradients travel in bf16, and three ranks' sums taken in another order, as gloo
    chunks buckets of other sizes differently, differ by one bf16 ulp: seen in the soak on an
    inf-norm, 1.164 against 1.172)."""
    if case["param_dtype"] != "fp32" or case["comm_hook"] == "bf16":
        return 2e-2
    if case["mp"] != "no" or case["comm_hook"] != "no":
        return 5e-3
    return 1e-4


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float) -> str | None:
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    na, nb = torch.isnan(a), torch.isnan(b)
    if not torch.equal(na, nb):
        return f"NaN in {int(na.sum())} vs {int(nb.sum())} elements"
    a, b = a[~na], b[~nb]
    if a.numel() == 0:
        return None
    ia, ib = torch.isinf(a), torch.isinf(b)
    if not torch.equal(ia, ib) or not torch.equal(a[ia], b[ib]):
        return "infinities differ"
    a, b = a[~ia], b[~ib]
    if a.numel() == 0:
        return None
    err = (a - b).abs().max().item()
    scale = max(b.abs().max().item(), 1e-3)
    return None if err <= rtol * scale else f"max error {err:.3g} (relative {err / scale:.3g} > {rtol:g})"


def _num_close(a, b, rtol) -> bool:
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= rtol * max(abs(b), 1e-6)


def compare(case: dict, sub: dict, ref: dict) -> list[str]:
    """Every difference between the two traces, in words; empty when they agree."""
    rtol = tolerance(case)
    errors = []
    ns, nr = len(sub["steps"]), len(ref["steps"])
    if ns != nr:
        errors.append(f"{ns} optimizer steps, the reference took {nr}")
    for k, (s, r) in enumerate(zip(sub["steps"], ref["steps"])):
        if s["skipped"] != r["skipped"]:
            errors.append(f"step {k}: skipped={s['skipped']}, the reference skipped={r['skipped']}")
        if not _num_close(s["norm"], r["norm"], rtol):
            errors.append(f"step {k}: clip returned {s['norm']}, torch returned {r['norm']}")
        if not _num_close(s["lr"], r["lr"], 1e-9):
            errors.append(f"step {k}: learning rate {s['lr']}, the reference {r['lr']}")
        if s["scale"] != r["scale"]:
            errors.append(f"step {k}: loss scale {s['scale']}, GradScaler's {r['scale']}")
        # the gradients the optimizer reads, each against its own magnitude: a wrong clip
        # coefficient or a doubled sum shows here in full, however small the update it makes.
        # From the second step on they come from parameters already a rounding apart, which a
        # small gradient (a bias near its optimum) magnifies: 8x the tolerance there (a doubled
        # or unclipped gradient is still off by far more)
        grtol = rtol if k == 0 else 8 * rtol
        for j, (a, b) in enumerate(zip(s["grads"], r["grads"])):
            if (a is None) != (b is None):
                errors.append(f"step {k}: gradient {j} is {'None' if a is None else 'set'}, torch's is "
                              f"{'None' if b is None else 'set'}")
            elif a is not None:
                why = _close(a, b, grtol)
                if why:
                    errors.append(f"step {k}: gradient {j} {tuple(b.shape)}: {why}")
        for j, (a, b) in enumerate(zip(s["params"], r["params"])):
            why = _close(a, b, rtol)
            if why:
                errors.append(f"step {k}: parameter {j} {tuple(b.shape)}: {why}")
        if errors:
            break  # later steps only repeat the first divergence
    if not errors:
        for j, (a, b) in enumerate(zip(sub["final"], ref["final"])):
            why = _close(a, b, rtol)
            if why:
                errors.append(f"after training: parameter {j} {tuple(b.shape)}: {why}")
    if "eval" in ref:
        # an autocast forward rounds the outputs to 16 bits: one bf16 ulp is 2^-7 relative
        ertol = {"bf16": 2e-2, "fp16": 5e-3}.get(case["mp"], rtol)
        why = _close(sub["eval"], ref["eval"], max(rtol, ertol))
        if why:
            errors.append(f"gather_for_metrics: {why}")
    return errors

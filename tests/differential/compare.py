"""The comparison of a subject trace with a reference trace, with tolerances stated per dtype."""
from __future__ import annotations

import math

import torch


def _params_16bit(case: dict) -> bool:
    """The parameters are stepped and kept in 16 bits: a 16-bit model, or a ZeRO case under
    bf16/fp16 (DeepSpeed's policy casts the model; its fp32 masters are rounded into it). Not FSDP
    under bf16: its trainable parameters are fp32 masters whatever the model's dtype (accelerate
    upcasts them), only the gathered copies the forward computes with are bf16."""
    if fsdp_bf16(case):
        return False
    return case["param_dtype"] != "fp32" or (case.get("sharding", "none") != "none" and case["mp"] != "no")


def fsdp_bf16(case: dict) -> bool:
    """FSDP2's 16-bit policy (reference_fsdp.py): bf16, or fp16 with its loss scaling (whose
    rounding unit is finer than bf16's: the bf16 bounds below hold for it a fortiori)."""
    return case.get("sharding") == "fsdp" and case["mp"] != "no"


def fsdp_exact(case: dict) -> bool:
    """FSDP under bf16 where the subject and FSDP2's policy round identically: two processes (the
    mean of two bf16 values, x 1/2 exact, summed exactly in fp32 and rounded once, is the exactly
    rounded mean the reference takes) and one micro-batch per step (no accumulation: accelerate's
    FSDP2 accumulates a window's micro-batches in bf16 before one reduce-scatter, accelerate_c
    reduce-scatters each and accumulates in fp32, docs/sharding.md). The same bf16 forward from the
    same masters, the same gradients, fp32 arithmetic after: the runs agree to fp32 roundings
    (measured on 16 such cases, 119 steps: bit for bit, norms within 1.1e-7), so a rounding more
    or less anywhere (a reduce in fp32, a compute in fp32, a clip in bf16) shows at
    FSDP_EXACT_RTOL."""
    # (fp16 too: its products and sums round as bf16's do, at fp16's unit. Case 896072 of
    # --sharding fsdp, one fp16 ulp apart until the reference read a frozen bf16 layer's dtype
    # as FSDP2 shows it before the layer's unit gathers: reference_fsdp._frozen_outside_root)
    return fsdp_bf16(case) and case["world"] == 2 and case["ga"] == 1


# fp32 roundings: the norm's sum in another order (the shards' local sums, then across processes)
FSDP_EXACT_RTOL = 1e-5


def tolerance(case: dict) -> float:
    """Relative tolerance on parameters and norms (relative to the reference tensor's largest
    magnitude). fp32 end to end differs only in summation order; 16-bit parameters round each
    update to 8 bits of mantissa, so one ulp apart after a step is legitimate; so does a bf16 comm
    hook (the gradients travel in bf16, and three ranks' sums taken in another order, as gloo
    chunks buckets of other sizes differently, differ by one bf16 ulp: seen in the soak on an
    inf-norm, 1.164 against 1.172)."""
    if fsdp_exact(case):
        return FSDP_EXACT_RTOL
    if _params_16bit(case) or case["comm_hook"] == "bf16":
        return 2e-2
    if case["mp"] != "no" or case["comm_hook"] != "no":
        return 5e-3
    return 1e-4


# bf16's spacing relative to a value, at its widest (just above a power of two); fp16's is finer
ULP16 = 2.0 ** -7


def param_rtol(case: dict, step: int) -> float:
    """The parameters' tolerance after optimizer step `step` (0-based). With 16-bit parameters
    or a bf16 comm hook every step may add a rounding apart: each rank's 16-bit sums are one
    of the orders three terms can be added in (the subject's buffer puts an element in
    another gloo chunk than torch's bucket does, so it takes another order, each a valid one:
    seen elementwise in case 7000238), and each update rounds to 16 bits from there. So two
    ulps to start with and one more per step. Measured (150 such cases on three ranks, seeds
    7000000 on): the subject against torch up to 0.0127 over all steps, torch against itself
    with another bucket size 0.0069; the soak's case 6160243035 reached 0.0244 at step 3 (4
    ulps of a 0.04 bias) against 2e-2. A doubled or missing update still shows in the
    gradients, which are compared at every step."""
    rtol = tolerance(case)
    if rtol >= 2e-2:
        return max(rtol, ULP16 * (2 + step))
    if step > 0 and chaotic(case):
        # measured on the fp16-hook class: torch against itself up to 3.6e-3 over 600 cases,
        # the subject against torch's other bucket size 5.4e-3; the soak's case 6161137856
        # reached 5.46e-3 against torch itself at step 6. It grows with the steps: in the
        # soak's case 6161143671 (13 steps) torch against itself with another bucket size is
        # 1.26e-2 apart at step 12, the subject 1.2e-2 at step 11
        return max(CHAOTIC_PARAM_FACTOR, 1 + step / 4) * rtol
    return rtol


def chaotic(case: dict) -> bool:
    """An autocast forward on three or more processes whose gradients are summed in 16 bits (a
    16-bit comm hook, or 16-bit parameters). Three ranks' 16-bit sums taken in another order
    (the subject's buffer puts an element in another gloo chunk than torch's bucket does) are a
    16-bit ulp apart from the first step; the 16-bit forward turns parameters that far apart
    into differences of roundings of the forward's terms, which do not shrink when the gradient
    they sum to does (a bias near its optimum). On two processes a sum of two has no order and
    the runs agree bit for bit; without autocast the ulp stays an ulp. Measured:
    docs/differential.md, tolerances (fp32 parameters with an fp16 hook under bf16 autocast;
    and the soak's case 6161135130, bf16 parameters, fp16 autocast, a bf16 hook: one bf16 ulp
    apart at step 0, a bias gradient that fell from 31488 to -64, off by 32, at step 7)."""
    if fsdp_bf16(case):
        # FSDP under bf16 once the two sides have rounded differently (fsdp_exact): fp32 masters a
        # rounding apart are cast to bf16 for every forward, and a master near a bf16 rounding
        # boundary then computes with a bf16 value one ulp away, a difference of the forward's
        # terms that does not shrink with the gradient it feeds. Measured (2 and 3 processes,
        # accumulation 2-4): gradients up to 4.3% apart from the second step on, 0.9 bf16 ulps of
        # their terms at the first
        return not fsdp_exact(case)
    return (case["mp"] != "no" and case["world"] > 2
            and (case["comm_hook"] != "no" or _params_16bit(case)))


# In a chaotic case, from the second step on: the gradients' tolerance (16x 5e-3, or the 8x of
# other later steps where that is more), and the least scale a gradient is measured against, as
# a fraction of the largest magnitude that gradient had in the reference so far. A doubled,
# halved or unaveraged gradient is still off by 1 (relative) unless it has shrunk below 1/8 of
# its largest, and off by more than the tolerance unless it has shrunk below 1% of it.
CHAOTIC_GRAD_RTOL = 0.08
CHAOTIC_PEAK_FRACTION = 1 / 8
# ... and the parameters from the second step on (param_rtol)
CHAOTIC_PARAM_FACTOR = 2
# The inf-norm clip returns is one gradient element, as noisy as the gradients: from the second
# step on it gets 4x tolerance() (2-norms average the noise out and keep tolerance()). Seen in
# the soak's case 6161128984 (bf16 autocast, bf16 hook, three ranks): at step 3 torch against
# itself with another bucket size differs by 5.1%, the subject against torch by 3.2%.
INF_NORM_LATER_FACTOR = 4


# the spacing of 16-bit values relative to a value, at its widest (bf16's is ULP16, above)
_SUM_ULP = {"bf16": ULP16, "fp16": 2.0 ** -10}


def sum_16bit_bound(case: dict) -> float:
    """How far apart, relative to the largest term added at an element, two valid 16-bit
    cross-rank gradient sums may be (0 when gradients are not summed in 16 bits): each element
    gets this times its own largest term (Addends), on top of the tolerance. Each side adds the
    world's terms and accumulates the window's micro-batches, each addition rounding by at most half an ulp of
    a partial sum no larger than the terms' largest (Addends in reference.py records it), and
    the two sides round differently (another order, the micro-batches reduced one by one under
    ZeRO-2 or summed first under DDP's no_sync). A gradient that nearly cancels across ranks is
    then far smaller than its terms and its rounding far larger than a fraction of it: the
    soak's case 6300366040 (three ranks, bf16, ZeRO-2, accumulation 2) summed a bias to 0.0347
    from local gradients up to 0.60, and the two sides were 0.00146 apart: under half a bf16 ulp
    of the terms (0.0039), 4.2% of the sum."""
    if fsdp_bf16(case):
        return 0.0 if fsdp_exact(case) else _fsdp_bound(case)
    if case.get("sharding", "none") != "none" and case["mp"] != "no":
        summed = [case["mp"]]  # DeepSpeed's policy: the whole model cast to mp
    else:  # "mixed": one bf16 layer; a 16-bit comm hook sums in its own dtype
        summed = [{"bf16": "bf16", "mixed": "bf16"}.get(case["param_dtype"]), case["comm_hook"]]
    ulp = max(_SUM_ULP.get(d, 0.0) for d in summed)
    return ulp * (case["world"] + case["ga"]) if case["world"] > 1 else 0.0


def _fsdp_bound(case: dict) -> float:
    """FSDP under bf16, per unit of a gradient's largest term (Addends), at a step whose window
    had up to `ga` micro-batches: the reference rounds ga - 1 bf16 accumulations (autograd adding
    the micro-batches' unsharded bf16 gradients) and one bf16 mean, at most half a bf16 ulp of a
    term each; accelerate_c rounds each micro-batch's mean once on two processes (its terms x 1/2
    are exact) and each of the three terms x 1/3 and their sum on three (over gloo, two pairwise
    bf16 sums: up to 8/3 half-ulps of the largest term), then accumulates in fp32. Two processes:
    (ga - 1 + 1 + ga) half-ulps = ga ulps; three: (ga + 3 ga) half-ulps = 2 ga. Measured at the
    first step (2 processes, ga 2-4): at most 0.94 ulps of the terms."""
    return ULP16 * case["ga"] * (2.0 if case["world"] > 2 else 1.0)


def _norm_tol(case: dict, k: int) -> float:
    """The tolerance on the norm clip_grad_norm_ returns at step k (0-based)."""
    rtol = tolerance(case)
    # (FSDP under bf16 once the sides have rounded apart, chaotic(): the 2-norm sums gradients
    # up to 8% apart, measured 0.9% apart at a third step, cases 11 and 38 of --sharding fsdp)
    later = case["clip"] == "norminf" or (fsdp_bf16(case) and chaotic(case))
    ntol = INF_NORM_LATER_FACTOR * rtol if k > 0 and later else rtol
    if fsdp_bf16(case):
        # the norm of gradients each within _fsdp_bound of its terms: the inf-norm is one of
        # them (case 2024: 0.70703 against 0.70313 at the first step, one bf16 ulp, ga 3)
        ntol += sum_16bit_bound(case)
    if k > 0 and sharded_16bit_step(case):
        ntol = max(ntol, SHARDED_16BIT_NORM_GROWTH * (1 + k / 8))
    return ntol


# the norm's tolerance at step k of sharded_16bit_step cases: 2e-2 x (1 + k/8), twice the worst
# measured at step 11 (2.4%, the soak's case 6463922929)
SHARDED_16BIT_NORM_GROWTH = 2e-2


def sharded_16bit_step(case: dict) -> bool:
    """16-bit parameters stepped as shards (any sharding, no mixed precision: no fp32 masters).
    torch's CPU kernels round a 16-bit `add_(g, alpha=a)` by where an element falls in the
    tensor: the vector body computes p + a*g as one fused fp32 operation rounded once to 16
    bits, the elements of the last partial vector take another path, which rounds otherwise
    (measured: a 1000-element bf16 add_ differs from the fused result only from element 992 =
    31 x 32 on; a whole tensor against one cut 333/667 differs only in the two pieces' last
    partial vectors). A shard cuts a parameter elsewhere than torch's whole tensor, so some
    elements round one 16-bit ulp apart at every step, as FSDP2's own shards would against DDP:
    measured, 140 of 50,000 bf16 elements. The norm drifts apart with the steps: the soak's case
    6463922929 (FSDP, bf16 model, 18 steps) reached 2.4% at step 11 against 2e-2, where torch
    against itself with only each add_ cut in two reached 1.4%; over 80 drawn FSDP cases of this
    class the subject reached 0.76% and torch against the cut torch 0.64%; over 24 drawn ZeRO-1 and
    24 ZeRO-2 cases (2 processes, up to 9 steps) 0.44% and 0.35%. So the norm's
    tolerance grows by an eighth per step (SHARDED_16BIT_NORM_GROWTH); the gradients and
    parameters keep theirs."""
    return (case.get("sharding", "none") != "none" and case["mp"] == "no"
            and case["param_dtype"] != "fp32")


def _fsdp_param_slack(case: dict, ref: dict) -> list | None:
    """FSDP under bf16 where the sides round apart (not fsdp_exact): per step, per parameter, the
    most each element may differ on top of tolerance(): every earlier step's gradient bound carried
    through the reference's SGD update into the parameter. None elsewhere.

    The parameters are fp32 masters stepped by the same fp32 arithmetic on both sides, so they
    differ only by what the gradients they read differ by, carried through the update: with
    momentum mu and learning rate lr_t, a buffer m_t = mu m_{t-1} + g_t and p_t = p_{t-1} - lr_t
    m_t, so |dp_k| <= sum_t lr_t |dm_t| with |dm_t| <= mu |dm_{t-1}| + |dg_t|. Each step's |dg_t|
    is bounded per element by the reduce's rounding bound, _fsdp_bound times the element's largest
    term (Addends: the same bound the gradients are checked with), plus, where the reference
    clipped, the clip coefficient's own spread (the norm's tolerance, _norm_tol) times the
    clipped gradient. A parameter that has moved by several times its own size (a small bias
    stepped back and forth) thus gets a bound of its path's size, not of its final value's: the
    soak's cases 6360292344 and 6360291623 (three processes, a 3-element output bias 0.13 in size
    1.07% and 1.01% apart against a flat 1%) are 0.12 and 0.32 of this bound, and the subject was
    bit for bit (within fp32 roundings) what torch computes with accelerate_c's rounding of the
    reduce (docs/differential.md). A parameter without a gradient at a step is not stepped (torch's
    SGD skips it: its buffer and value stay)."""
    if not fsdp_bf16(case) or fsdp_exact(case):
        return None
    beta = _fsdp_bound(case)
    out: list = []
    moment: list | None = None
    drift: list | None = None
    for k, r in enumerate(ref["steps"]):
        rule = r.get("sgd")
        if rule is None:
            raise ValueError(f"case {case['seed']}: FSDP under bf16 with optimizer {case['optimizer']!r}: the "
                             "parameters' bound is derived for plain SGD (with momentum) only")
        if moment is None:
            moment = [torch.zeros(p.shape) for p in r["params"]]
            drift = [torch.zeros(p.shape) for p in r["params"]]
        n = len(r["params"])
        clipped = set(_clipped_indices(case, n)) if _ref_clipped(case, r) else set()
        ntol = _norm_tol(case, k)
        for j in range(n):
            g = r["grads"][j]
            if g is None:
                continue  # not stepped
            bound = beta * r["addends"][j].reshape(g.shape)
            if j in clipped:
                bound = bound + ntol * g.abs()
            moment[j] = rule["momentum"] * moment[j] + bound
            drift[j] = drift[j] + rule["lr"] * moment[j]
        out.append([d.clone() for d in drift])
    return out


def _clipped_indices(case: dict, n: int) -> list:
    """Which of n trainable parameters the loop clips (workload.clipped's rule)."""
    return list(range(n // 2, n)) if case["clip_subset"] else list(range(n))


def _ref_clipped(case: dict, ref_step: dict) -> bool:
    """The reference's norm clip scaled the gradients at this step."""
    return _norm_clipped(case, ref_step.get("norm"))


def _norm_clipped(case: dict, norm) -> bool:
    """A norm clip that reported `norm` scaled the gradients: torch's coefficient
    max_norm / (norm + 1e-6) is below 1 (a norm equal to max_norm too, by 1e-6 / max_norm)."""
    return case["clip"] in ("norm2", "norminf") and norm is not None and math.isfinite(norm) and \
        norm + 1e-6 > case["max_norm"]


def _natural_fork(case: dict) -> bool:
    """A chaotic case under fp16 autocast with no overflow or NaN injected: a step one side
    skips and the other takes is an fp16 overflow of the backward that parameters a 16-bit
    rounding apart tip one way or the other, and the two runs go separate ways from there (loss
    scale, schedule, parameters). Soak case 66465 (three ranks, fp16 autocast, a bf16 hook over
    shared memory, whose bf16 sums are fp32 sums rounded once where gloo's are pairwise bf16
    sums): torch skipped step 2 and the subject did not; with the reference's hook summing as
    the subject's collective does, both took it. The steps before are compared as usual; an
    injected overflow (the `overflow` axis) or NaN still has its skip compared exactly."""
    return chaotic(case) and case["mp"] == "fp16" and case["overflow"] is None and case["nan_grad_step"] is None


def _at_max_norm(case: dict, norm) -> bool:
    """The subject's clip scaled its gradients with a norm within one bf16 ulp of max_norm,
    where a norm one ulp apart on the reference's side scales nothing."""
    return _norm_clipped(case, norm) and abs(norm - case["max_norm"]) <= case["max_norm"] * 2.0 ** -7


def _bf16_widened(t: torch.Tensor) -> bool:
    return bool(torch.equal(t.to(torch.bfloat16).float(), t))


def _clipped_16bit(case: dict, ref_step: dict) -> bool:
    """A norm clip that clipped gradients summed in 16 bits. Each gradient is then a 16-bit
    sum one ulp from torch's (three ranks' sums in another order) times a coefficient computed
    from a norm that is itself such a sum, in the norm's dtype: for bf16 gradients torch rounds
    the coefficient to bf16 too. The errors add, so the gradient gets the norm's tolerance on
    top of its own. Measured on the soak's case 6154218825 (three ranks, bf16 parameters, an
    inf-norm clip to 0.05 of a norm near 0.58): the sums -0.5703 against -0.5742 and the norms
    0.5859 against 0.5820 are each one bf16 ulp apart, the coefficients 0.08496 and 0.08594
    (bf16) one more, and the clipped gradients 2.02% apart; torch's own arithmetic, replayed on
    the subject's sum and norm, gives the subject's gradient exactly."""
    norm = ref_step.get("norm")
    return (tolerance(case) >= 2e-2 and case["clip"] in ("norm2", "norminf") and norm is not None
            and math.isfinite(norm) and norm > case["max_norm"])


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float, floor: float = 1e-3, extra=None) -> str | None:
    """None when a is within rtol of b, relative to b's largest magnitude (at least `floor`),
    each element allowed `extra` (a tensor like b, or None) on top."""
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    na, nb = torch.isnan(a), torch.isnan(b)
    if not torch.equal(na, nb):
        return f"NaN in {int(na.sum())} vs {int(nb.sum())} elements"
    extra = torch.zeros_like(b) if extra is None else extra
    a, b, extra = a[~na], b[~nb], extra[~nb]
    if a.numel() == 0:
        return None
    ia, ib = torch.isinf(a), torch.isinf(b)
    if not torch.equal(ia, ib) or not torch.equal(a[ia], b[ib]):
        return "infinities differ"
    a, b, extra = a[~ia], b[~ib], extra[~ib]
    if a.numel() == 0:
        return None
    scale = max(b.abs().max().item(), floor)
    over = ((a - b).abs() - extra).max().item()
    if over <= rtol * scale:
        return None
    err = (a - b).abs().max().item()
    return f"max error {err:.3g} (relative {err / scale:.3g} > {rtol:g}{', beyond the terms rounding' if extra.any() else ''})"


def _nonfinite_as_nan(t: torch.Tensor) -> torch.Tensor:
    """An overflowed step's gradient with its infinities and NaNs alike. Which non-finite value an
    element holds there is not stable under a rounding: a product inf x h is NaN where h rounds to
    0 and its sum NaN where two such products differ in sign, so parameters one 16-bit ulp apart
    (three ranks' fp16 sums in another order at the step before) may turn an inf into a NaN. The
    soak's case 6300368612 (fp16, three ranks, ZeRO-1, an injected overflow on rank 2): one element
    of an output layer's weight gradient NaN in the subject, inf in torch. The step is skipped and
    those gradients discarded on both sides; which elements are non-finite is still compared."""
    return torch.where(torch.isfinite(t), t, torch.full_like(t, float("nan")))


def _finite_in_both(a: torch.Tensor, b: torch.Tensor):
    """An overflowed step's gradients in a chaotic case (below), compared where both are finite.
    Where an overflow happens there can depend on the parameters, which may be 16-bit roundings
    apart in such a case: an fp16 activation just under the largest finite value on one side may
    be inf on the other, and the gradients it feeds NaN on that side only (not traced further).
    The soak's case 6309865959 (three ranks, bf16 parameters, fp16 autocast, step 2 skipped on both sides): one element NaN in
    torch, -0.0 in the subject. Both skip the step and discard the gradients; that the step is
    skipped, and the loss scale, are still compared."""
    both = torch.isfinite(a) & torch.isfinite(b)
    nan = torch.full_like(a, float("nan"))
    return torch.where(both, a, nan), torch.where(both, b, nan)


def _clamped_as_nan(case: dict, t: torch.Tensor) -> torch.Tensor:
    """An overflowed step's gradient after clip_grad_value_, its elements at the clamp's bound
    taken as non-finite: the clamp turns an inf into +-max_norm, so there an overflow that one side
    hit and the other did not (_finite_in_both) looks like a finite value. The soak's case
    6537940168 (three ranks, bf16 parameters, fp16 autocast, a bf16 hook, step 1 skipped on both
    sides): one rank's fp16 weight gradient -65504 in torch, -inf in the subject, whose parameters
    were a bf16 ulp away; clamped, -100 against torch's -0.486 average. The bound is max_norm
    rounded to the gradient's 16 bits at most (ULP16)."""
    bound = case["max_norm"] * (1 - ULP16)
    return torch.where(t.abs() >= bound, torch.full_like(t, float("nan")), t)


def _num_close(a, b, rtol) -> bool:
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= rtol * max(abs(b), 1e-6)


def bitwise(case: dict) -> bool:
    """Cases the subject must match bit for bit: a bf16 model, or fp16 (axis fp16) (every update
    rounded to 16 bits, so a difference in the last bit of any norm, coefficient or sum shows in
    the parameters) on one or two replicated processes, where an average has one order. The tolerances below would
    let a systematic rounding difference pass: the per-gradient norms torch's clip rounds to 16
    bits, summed exactly instead, moved bf16 runs by a few ulps a step (soak case 6453089873,
    one process: a norm 2% off at step 3, beyond the tolerance only there)."""
    return case["world"] <= 2 and case.get("sharding", "none") == "none" and case["param_dtype"] == "bf16"


def _same(a, b) -> bool:
    """Bit for bit, NaN equal to NaN (a skipped step's gradients, a NaN clip)."""
    if a is None or b is None:
        return a is b
    if not torch.is_tensor(a):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a.dtype == b.dtype and a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _bitwise_errors(sub: dict, ref: dict) -> list[str]:
    for k, (s, r) in enumerate(zip(sub["steps"], ref["steps"])):
        if not _same(s["norm"], r["norm"]):
            return [f"step {k}: clip returned {s['norm']}, torch {r['norm']}: not bit for bit"]
        for what in ("grads", "params"):
            for j, (a, b) in enumerate(zip(s[what], r[what])):
                if not _same(a, b):
                    return [f"step {k}: {what[:-1]} {j} not bit for bit torch's"]
    for j, (a, b) in enumerate(zip(sub["final"], ref["final"])):
        if not _same(a, b):
            return [f"after training: parameter {j} not bit for bit torch's"]
    return []


def compare(case: dict, sub: dict, ref: dict) -> list[str]:
    """Every difference between the two traces, in words; empty when they agree."""
    if bitwise(case):
        errors = _bitwise_errors(sub, ref)
        if errors:
            return errors
    rtol = tolerance(case)
    errors = []
    ns, nr = len(sub["steps"]), len(ref["steps"])
    if ns != nr:
        errors.append(f"{ns} optimizer steps, the reference took {nr}")
    peak: dict[int, float] = {}  # chaotic cases: each reference gradient's largest magnitude so far
    forked = False  # _natural_fork: the runs went separate ways at an overflow one side hit
    slack = _fsdp_param_slack(case, ref)  # FSDP bf16: each parameter's bound, element by element
    for k, (s, r) in enumerate(zip(sub["steps"], ref["steps"])):
        if s["skipped"] != r["skipped"] and _natural_fork(case):
            forked = True  # at an fp16 overflow one side hit: nothing later compares
            break
        if s["skipped"] != r["skipped"]:
            errors.append(f"step {k}: skipped={s['skipped']}, the reference skipped={r['skipped']}")
        # (FSDP under bf16 once the sides have rounded apart, chaotic(): the 2-norm sums gradients
        # up to 8% apart, measured 0.9% apart at a third step, cases 11 and 38 of --sharding fsdp)
        ntol = _norm_tol(case, k)
        if not _num_close(s["norm"], r["norm"], ntol):
            errors.append(f"step {k}: clip returned {s['norm']}, torch returned {r['norm']}")
        if not _num_close(s["lr"], r["lr"], 1e-9):
            errors.append(f"step {k}: learning rate {s['lr']}, the reference {r['lr']}")
        if s["scale"] != r["scale"]:
            errors.append(f"step {k}: loss scale {s['scale']}, GradScaler's {r['scale']}")
        # the gradients the optimizer reads, each against its own magnitude: a wrong clip
        # coefficient or a doubled sum shows here in full, however small the update it makes.
        # From the second step on they come from parameters already a rounding apart, which a
        # small gradient (a bias near its optimum) magnifies: 8x the tolerance there (a doubled
        # or unclipped gradient is still off by far more); in a chaotic case, CHAOTIC_GRAD_RTOL
        # and never against less than CHAOTIC_PEAK_FRACTION of the gradient's largest so far
        clipped = set(_clipped_indices(case, len(r["grads"])))
        grtol = rtol if k == 0 else max(CHAOTIC_GRAD_RTOL, 8 * rtol) if chaotic(case) else 8 * rtol
        if k == 0 and _clipped_16bit(case, r):
            grtol += rtol
        for j, (a, b) in enumerate(zip(s["grads"], r["grads"])):
            if (a is None) != (b is None):
                errors.append(f"step {k}: gradient {j} is {'None' if a is None else 'set'}, torch's is "
                              f"{'None' if b is None else 'set'}")
            elif a is not None:
                floor = 1e-3
                if chaotic(case):
                    finite = b[torch.isfinite(b)]
                    if finite.numel():
                        peak[j] = max(peak.get(j, 0.0), finite.abs().max().item())
                    if k > 0:
                        floor = max(floor, CHAOTIC_PEAK_FRACTION * peak.get(j, 0.0))
                if r["skipped"]:
                    a, b = _nonfinite_as_nan(a), _nonfinite_as_nan(b)
                    if chaotic(case):
                        if case["clip"] == "value" and j in clipped:
                            a, b = _clamped_as_nan(case, a), _clamped_as_nan(case, b)
                        a, b = _finite_in_both(a, b)
                terms = r.get("addends")
                extra = sum_16bit_bound(case) * terms[j].reshape(b.shape) if terms is not None else None
                why = _close(a, b, grtol, floor, extra)
                if why:
                    errors.append(f"step {k}: gradient {j} {tuple(b.shape)}: {why}")
                elif fsdp_bf16(case) and case["mp"] == "bf16" and r.get("micro_batches") == 1 and _bf16_widened(b) \
                        and not _bf16_widened(a) \
                        and not (j in clipped and _at_max_norm(case, s["norm"]) and not _ref_clipped(case, r)):
                    # one micro-batch, unclipped: FSDP2's gradient shard is its bf16 reduce-scatter's
                    # output widened, whichever order a collective sums in (reduce_dtype = bf16).
                    # Not where the subject's clip scaled it and torch's did not: a norm one bf16
                    # ulp apart (three ranks' sums in another order) can sit at max_norm on one side
                    # (scaled by 1 - 2e-6) and below it on the other (soak case 6427397151: an
                    # inf-norm of exactly 0.5 = max_norm); the tolerance above still holds there.
                    # bf16 only: under fp16 the reduce-scatter's fp16 output is of the scaled
                    # gradients, unscaled after (soak case 6573555115: a reference gradient that
                    # happened to be a bf16 value, the subject's an fp16 one, both right)
                    errors.append(f"step {k}: gradient {j} {tuple(b.shape)} is not a bf16 value widened: "
                                  "not reduced in bf16 (reduce_dtype)")
        before = ref["steps"][k - 1]["params"] if k > 0 else ref.get("initial")
        for j, (a, b) in enumerate(zip(s["params"], r["params"])):
            # measured against the parameter's scale before the step too: an update that nearly
            # cancels it (p - lr g, both large) leaves a small parameter whose rounding, and whose
            # share of a gradient one 16-bit ulp apart (three ranks' sums in another order), is
            # the old value's size (soak case 6180684141: a bf16 bias 0.162 - 0.2 x 0.82 came out
            # 0.00195 against torch's 0.00098, its gradient -0.8203 against -0.8164, one ulp)
            finite = before[j][torch.isfinite(before[j])] if before is not None else None
            floor = max(1e-3, finite.abs().max().item()) if finite is not None and finite.numel() else 1e-3
            if slack is None:
                why = _close(a, b, param_rtol(case, k), floor)
            else:
                why = _close(a, b, tolerance(case), floor, slack[k][j])
            if why:
                errors.append(f"step {k}: parameter {j} {tuple(b.shape)}: {why}")
        if errors:
            break  # later steps only repeat the first divergence
    if forked:
        return errors
    # (uneven inputs: the final model is the longest-running process's, after its steps)
    last = ref.get("final_steps", nr) - 1
    if not errors:
        for j, (a, b) in enumerate(zip(sub["final"], ref["final"])):
            if slack is None or not slack:
                # against the parameter's scale over the last steps too, as each step's check is
                # (an update that nearly cancels it leaves a small value): the soak's case
                # 6461715903 (ZeRO-2, bf16, 2 processes) passed step 6 at 0.059 of the bias's
                # scale before it, then failed here at 0.233 of its final 0.0037
                recent = [st["params"][j] for st in ref["steps"][-2:]]
                floor = max([1e-3] + [t[torch.isfinite(t)].abs().max().item() for t in recent
                                      if torch.isfinite(t).any()])
                why = _close(a, b, param_rtol(case, last), floor)
            else:
                why = _close(a, b, tolerance(case), extra=slack[-1][j])
            if why:
                errors.append(f"after training: parameter {j} {tuple(b.shape)}: {why}")
    if "eval" in ref:
        # an autocast forward rounds the outputs to 16 bits: one bf16 ulp is 2^-7 relative
        ertol = {"bf16": 2e-2, "fp16": 5e-3}.get(case["mp"], rtol) if not fsdp_exact(case) else rtol
        why = _close(sub["eval"], ref["eval"], max(rtol, ertol, param_rtol(case, last)))
        if why:
            errors.append(f"gather_for_metrics: {why}")
    return errors

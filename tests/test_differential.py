"""The differential harness in the test suite (tests/differential/): random training
configurations run through accelerate_c and through plain torch (DDP, GradScaler, clip_grad_*,
torch's compress hooks) in the same process group, compared after every optimizer step; the
cases of the defects found so far; and the bucket plans against torch's own assignment.

Budget: a few minutes here (AC_DIFF_CASES sets how many random cases; `make soak SECONDS=N`
runs new seeds for as long as asked).
"""
from __future__ import annotations

import os
import random

import pytest
import torch
import torch.distributed as dist

from accelerate_c import _C
from differential import run as harness
from differential import compare
from differential.cases import REGRESSIONS, _case, draw

CASES = int(os.environ.get("AC_DIFF_CASES", "500"))


def _fail(failures):
    pytest.fail("\n".join(harness.report(c, e) for c, e in failures), pytrace=False)


@pytest.mark.timeout(900)
def test_defects_found_so_far():
    failures = harness.run_cases([dict(c) for c in REGRESSIONS.values()], log=lambda s: None)
    if failures:
        _fail(failures)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("half", (0, 1))
def test_random_configurations(monkeypatch, half):
    """The default: accelerate_c's CPU collectives through shared memory on this host (DDP's
    buckets in shared windows, ZeRO's chunk collectives, the flags and norms) while the torch
    references stay on gloo; the worker checks that shared memory really carried them. Seeds 1 to
    CASES in two halves, so that pytest's two workers can take one each (the longest test else)."""
    monkeypatch.setenv("ACCELERATE_C_COMM", "shm")
    failures = harness.run_seeds(range(1 + half * (CASES // 2), 1 + (CASES if half else CASES // 2)),
                                 log=lambda s: None)
    if failures:
        _fail(failures)


GLOO_CASES = int(os.environ.get("AC_DIFF_GLOO_CASES", "80"))


@pytest.mark.timeout(900)
def test_random_configurations_over_gloo(monkeypatch):
    """The gloo axis: accelerate_c's CPU collectives through gloo (ACCELERATE_C_COMM=gloo), where
    the other tests take the default, shared memory on one host (the worker checks that shared
    memory really carried those: test_random_configurations sets ACCELERATE_C_COMM=shm)."""
    monkeypatch.setenv("ACCELERATE_C_COMM", "gloo")
    failures = harness.run_seeds(range(700_001, 700_001 + GLOO_CASES), log=lambda s: None)
    if failures:
        _fail(failures)


@pytest.mark.timeout(900)
def test_random_configurations_with_adam(monkeypatch):
    """The Adam axis (run.py --adam): the cases that can draw Adam (fp32 end to end) all do, in
    its four kinds (cases.ADAM_KINDS): the subject's step through accelerate_c's one-pass kernel
    (torch's for amsgrad) against torch's Adam/AdamW, over every strategy the seeds draw."""
    monkeypatch.setenv("ACCELERATE_C_COMM", "shm")
    monkeypatch.setenv("AC_DIFF_ADAM", "1")
    cases = harness.cases_of(range(740_001, 740_301), adam=True)[:30]
    assert len(cases) == 30 and {c["adam_kind"] for c in cases} == {"adamw", "adam_l2", "adamw_maximize",
                                                                     "adamw_amsgrad"}
    failures = harness.run_cases(cases, log=lambda s: None)
    if failures:
        _fail(failures)


@pytest.mark.timeout(900)
def test_random_configurations_over_shared_memory_with_private_gradient_buffers(monkeypatch):
    """Shared memory with the gradient buffers kept private (ACCELERATE_C_SHM_WINDOWS=0, what a
    /dev/shm too small for them gets): every bucket goes through the segment's slots, the path the
    windows replaced in the other shared-memory cases; the worker checks no window was made."""
    monkeypatch.setenv("ACCELERATE_C_COMM", "shm")
    monkeypatch.setenv("ACCELERATE_C_SHM_WINDOWS", "0")
    failures = harness.run_seeds(range(720_001, 720_001 + 40), log=lambda s: None)
    if failures:
        _fail(failures)


@pytest.mark.timeout(900)
def test_random_configurations_over_hosts_joined_by_gloo(monkeypatch):
    """The ranks say they are on 2 hosts (run.py --hosts 2): shared memory within each host, gloo
    between the hosts' leaders (accelerate_c/shm_hier.py), against the same torch references;
    the worker checks that the collectives really split by host."""
    monkeypatch.setenv("ACCELERATE_C_COMM", "shm")
    monkeypatch.setenv("AC_DIFF_HOSTS", "2")
    failures = harness.run_seeds(range(710_001, 710_001 + 40), log=lambda s: None)
    if failures:
        _fail(failures)


def _torch_buckets(numel, esize, caps):
    dtype = {2: torch.bfloat16, 4: torch.float32}[esize]
    tensors = [torch.empty(n, dtype=dtype) for n in numel]
    buckets, _ = dist._compute_bucket_assignment_by_size(tensors, list(caps))
    return sorted(sorted(b) for b in buckets)


def _our_buckets(numel, esize, caps, align):
    plan = _C.Reducer(numel, list(range(len(numel))), esize, caps[0], caps[1], align)
    _, bucket_of = plan.layout()
    groups: dict = {}
    for i, b in enumerate(bucket_of):
        groups.setdefault(b, []).append(i)
    return sorted(groups.values())


@pytest.mark.parametrize("seed", range(200))
def test_bucket_plan_is_torchs(seed):
    """The plan puts the same gradients together as torch DDP's own assignment
    (dist._compute_bucket_assignment_by_size), gradients taken in the same order: the first
    bucket's cap, then the others', a bucket closing once it reaches its cap."""
    r = random.Random(seed)
    n = r.randint(1, 40)
    numel = [r.choice((1, 3, 17, 64, 100, 1000, 4096, 30000)) for _ in range(n)]
    esize = r.choice((2, 4))
    cap = r.choice((64, 400, 4000, 40000, 400000))
    caps = (cap, cap) if r.random() < 0.5 else (r.choice((64, 1024, 16384)), cap)
    # align: the gradient buffers start each range on 32 elements (grad_layout.ALIGN); padding must
    # not move a bucket boundary
    assert _our_buckets(numel, esize, caps, align=r.choice((1, 32))) == _torch_buckets(numel, esize, caps)


def test_replay_with_the_printed_world_is_the_same_case():
    """A failure prints `--replay SEED --world W` with the world size the case drew: drawing
    for that world must give the same case (the world size is always drawn, then overridden)."""
    for seed in range(2000):
        c = draw(seed)
        assert draw(seed, c["world"]) == c
        assert draw(seed, 1 + c["world"] % 3)["world"] == 1 + c["world"] % 3


def _trace(grads):
    """A trace whose parameters agree everywhere (ones), with these gradients step by step."""
    steps = [{"params": [torch.ones(12)], "grads": [g], "norm": None, "lr": 0.1, "skipped": False, "scale": None}
             for g in grads]
    return {"steps": steps, "final": [torch.ones(12)]}


@pytest.mark.parametrize("world", (2, 3))
def test_chaotic_gradients_against_their_largest_magnitude(world):
    """bf16 autocast with an fp16 hook on three processes (compare.chaotic): a gradient that shrank
    from 1 to 0.1 may be 0.008 off (bf16 noise of its terms, 8% of the 0.1), not 2x; elsewhere
    the usual 8x tolerance on its own magnitude applies."""
    case = _case(1, world=world, mp="bf16", comm_hook="fp16")
    ref = _trace([torch.ones(12), torch.full((12,), 0.1)])
    noisy = _trace([torch.ones(12), torch.full((12,), 0.1) + 0.008])
    doubled = _trace([torch.ones(12), torch.full((12,), 0.2)])
    assert compare.chaotic(case) == (world == 3)
    assert bool(compare.compare(case, noisy, ref)) == (world == 2)
    assert any("gradient 0" in e for e in compare.compare(case, doubled, ref))


@pytest.mark.parametrize("world", (2, 3))
def test_a_natural_fp16_overflow_one_side_hit_ends_the_comparison_only_where_chaotic(world):
    """Soak case 66465 (compare._natural_fork): fp16 autocast and a bf16 hook on three processes,
    nothing injected: a step skipped on one side only is where the runs forked, and what follows
    (scale, parameters, the final values) is not compared. On two processes (sums of two have no
    order), or with an overflow injected, the skip is still compared exactly, and the steps
    before the fork are compared as usual."""
    one, two = torch.ones(12), torch.full((12,), 2.0)
    forked = _trace([one, one, one])
    forked["steps"][1]["skipped"] = True
    forked["steps"][2]["params"] = [two]
    forked["final"] = [two]
    ref = _trace([one, one, one])
    case = _case(1, world=world, mp="fp16", comm_hook="bf16")
    assert compare.chaotic(case) == (world == 3)
    errors = compare.compare(case, forked, ref)
    assert bool(errors) == (world == 2), errors
    injected = _case(1, world=world, mp="fp16", comm_hook="bf16", overflow=(0, 1))
    assert any("skipped=True" in e for e in compare.compare(injected, forked, ref))
    before = _trace([two, one, one])  # a doubled gradient at step 0, before the fork
    before["steps"][1]["skipped"] = True
    assert any("gradient 0" in e for e in compare.compare(case, before, ref))


def _fsdp_trace(grad, micro=1, terms=None):
    step = {"params": [torch.ones(12)], "grads": [grad], "norm": None, "lr": 0.1, "skipped": False, "scale": None,
            "micro_batches": micro, "addends": [torch.ones(12) if terms is None else terms],
            "sgd": {"lr": 0.1, "momentum": 0.0}}
    return {"steps": [step], "final": [torch.ones(12)]}


def test_fsdp_bf16_is_held_to_fp32_roundings_where_both_sides_round_alike():
    """FSDP under bf16 (compare.fsdp_exact): on two processes with one micro-batch per step the
    subject and FSDP2's policy round identically, so a gradient a tenth of a bf16 ulp off fails
    (what computing or reducing in fp32 leaves), and a gradient that is not a bf16 value widened,
    where the reference's is, fails as not reduced in bf16 even within the tolerance."""
    exact = _case(1, world=2, mp="bf16", sharding="fsdp", ga=1)
    assert compare.fsdp_exact(exact) and not compare.chaotic(exact)
    g = torch.linspace(-1, 1, 12).to(torch.bfloat16).float()
    assert not compare.compare(exact, _fsdp_trace(g.clone()), _fsdp_trace(g))
    off = g + 2.0 ** -11  # a tenth of a bf16 ulp at 1
    assert any("gradient 0" in e for e in compare.compare(exact, _fsdp_trace(off), _fsdp_trace(g)))
    # accumulation (ga 2): the sides round apart by up to ga bf16 ulps of the terms, no more
    acc = _case(1, world=2, mp="bf16", sharding="fsdp", ga=2)
    assert not compare.fsdp_exact(acc) and compare.chaotic(acc)
    ref = _fsdp_trace(g, micro=2)
    assert not compare.compare(acc, _fsdp_trace(g + 1.5 * 2.0 ** -7, micro=2), ref)
    assert compare.compare(acc, _fsdp_trace(g + 3 * 2.0 ** -7, micro=2), ref)
    # one micro-batch in the window: the shard must be a bf16 value widened where torch's is
    near = g + 2.0 ** -20
    errors = compare.compare(acc, _fsdp_trace(near, micro=1), _fsdp_trace(g, micro=1))
    assert any("not reduced in bf16" in e for e in errors), errors


def test_fsdp_bf16_a_clip_at_max_norm_on_one_side_only_is_not_taken_for_an_fp32_reduction():
    """Soak case 6427397151: three ranks' bf16 sums one ulp apart put the subject's inf-norm at
    exactly max_norm (torch's coefficient 0.5 / (0.5 + 1e-6) scales it by 1 - 2e-6) and the
    reference's one ulp below (unscaled, a bf16 value widened). Within the tolerance that is no
    defect; the same gradient with the subject's norm below max_norm still is."""
    case = _case(1, world=3, mp="bf16", sharding="fsdp", ga=1, clip="norminf", max_norm=0.5)
    g = torch.linspace(-0.5, 0.5, 12).to(torch.bfloat16).float()
    scaled = g * (0.5 / (0.5 + 1e-6))
    ref = _fsdp_trace(g)
    ref["steps"][0]["norm"] = 0.498046875
    at_max = _fsdp_trace(scaled)
    at_max["steps"][0]["norm"] = 0.5
    assert not compare.compare(case, at_max, ref)
    below = _fsdp_trace(scaled)
    below["steps"][0]["norm"] = 0.498046875
    assert any("not reduced in bf16" in e for e in compare.compare(case, below, ref))


def test_fsdp_bf16_parameters_are_bounded_by_their_gradients_bound_carried_through_sgd():
    """FSDP under bf16 where the sides round apart (compare._fsdp_param_slack): the parameters
    may differ by every step's gradient rounding bound (_fsdp_bound x the terms) carried through
    SGD's momentum and learning rate, on top of tolerance(), element by element: a small bias that
    has travelled far gets its path's bound, not 1% of its final value; a bias whose terms were
    small does not, and a doubled update fails whatever the terms."""
    case = _case(1, world=3, mp="bf16", sharding="fsdp", ga=1, optimizer="sgd_momentum")
    beta = compare._fsdp_bound(case)
    g = torch.tensor([1.0, 1.0, 1.0])
    terms = torch.tensor([1.0, 1.0, 0.01])

    def trace(params):
        steps = [{"params": [p], "grads": [g], "norm": None, "lr": 0.1, "skipped": False, "scale": None,
                  "micro_batches": 1, "addends": [terms], "sgd": {"lr": 0.1, "momentum": 0.9}} for p in params]
        return {"steps": steps, "final": [params[-1]], "initial": [torch.full((3,), 0.3)]}

    ref = trace([torch.full((3,), 0.2), torch.full((3,), 0.01)])  # 0.3 -> 0.2 -> 0.01 (a bias near 0)
    bound = 0.1 * beta * terms + 0.1 * (0.9 * beta * terms + beta * terms)  # after the second step
    scale = 0.2  # the parameter's largest before the step
    near = ref["steps"][1]["params"][0] + torch.tensor([0.9, 0.0, 0.0]) * bound
    near = trace([torch.full((3,), 0.2), near])
    assert (0.9 * bound[0]).item() > 0.01 * scale  # past the flat 1% the bias got before
    assert not compare.compare(case, near, ref)
    far = trace([torch.full((3,), 0.2), ref["steps"][1]["params"][0] + torch.tensor([0.0, 0.0, 2e-3])])
    assert any("parameter 0" in e for e in compare.compare(case, far, ref))  # small terms: small bound
    doubled = trace([torch.full((3,), 0.2), torch.full((3,), 0.2 - 2 * 0.19)])
    assert any("parameter 0" in e for e in compare.compare(case, doubled, ref))


def test_fsdp_gather_axes_are_drawn_only_where_supported():
    """The FSDP axes that drive the gathers (cases.py): a forward that leaves out the middle layer
    only where that layer is a unit of its own or find_unused_parameters is on (accelerate_c
    refuses a partly used unit group without it) and never with the model's reentrant
    checkpointing; the output layer called outside the forward never with reentrant
    checkpointing; and every value of each axis drawn somewhere."""
    seen = {"skip": set(), "aux": set(), "prefetch": set()}
    for seed in range(3000):
        c = draw(seed, 2 + seed % 2, "fsdp")
        if c["sharding"] != "fsdp":
            continue
        if c["fsdp_skip"]:
            assert not c["reentrant"] and (c["fsdp_wrap"] != "NO_WRAP" or c["unused"]), c
        if c["fsdp_aux"]:
            assert not c["reentrant"], c
        seen["skip"].add(c["fsdp_skip"])
        seen["aux"].add((c["fsdp_aux"], c["fsdp_wrap"]))
        if c["fsdp_aux"] and c["fsdp_wrap"] == "TRANSFORMER_BASED_WRAP" and c["fsdp_reshard"] and c["mp"] != "no":
            seen["aux"].add("own unit resharded in bf16")  # the defect found and fixed: drawn again
        seen["prefetch"].add(c["fsdp_prefetch"])
    assert seen["skip"] == {0, 2, 3} and seen["prefetch"] == {True, False}
    assert {x[1] for x in seen["aux"] if isinstance(x, tuple) and x[0]} == \
        {"NO_WRAP", "SIZE_BASED_WRAP", "TRANSFORMER_BASED_WRAP"}
    assert "own unit resharded in bf16" in seen["aux"]


def _plain_trace(param, norm=1.5):
    step = {"params": [param], "grads": [param * 0.5], "norm": norm, "lr": 0.1, "skipped": False, "scale": None}
    return {"steps": [step], "final": [param]}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_bf16_model_on_one_or_two_processes_is_held_to_torch_bit_for_bit(world):
    """compare.bitwise: a bf16 model on one or two replicated processes must be torch's bit for
    bit (a parameter one bf16 ulp off fails there, within the 2e-2 tolerance elsewhere; a norm a
    bf16 ulp off too); three processes (another summation order) keep the tolerances."""
    case = _case(1, world=world, param_dtype="bf16", clip="norm2")
    p = torch.linspace(-1, 1, 12).to(torch.bfloat16).float()
    ulp = p.clone()
    ulp[3] = torch.nextafter(p[3].to(torch.bfloat16), torch.tensor(2.0, dtype=torch.bfloat16)).float()
    assert compare.bitwise(case) == (world <= 2)
    assert not compare.compare(case, _plain_trace(p.clone()), _plain_trace(p))
    errors = compare.compare(case, _plain_trace(ulp), _plain_trace(p))
    assert bool(errors) == (world <= 2), errors
    errors = compare.compare(case, _plain_trace(p, norm=1.5078125), _plain_trace(p))
    assert bool(errors) == (world <= 2), errors
    assert not compare.bitwise(_case(1, world=2, param_dtype="bf16", sharding="zero2"))
    assert not compare.bitwise(_case(1, world=1, param_dtype="mixed"))


@pytest.mark.parametrize("world", (2, 3))
def test_a_clamped_overflow_on_a_skipped_step_counts_as_an_overflow_only_where_chaotic(world):
    """Soak case 6537940168 (compare._clamped_as_nan): three ranks, fp16 autocast, a bf16 hook,
    clip_grad_value_ to 100, a step both sides skip where one rank's fp16 gradient overflowed on
    the subject's side only; the clamp turned that inf into -100, against torch's finite -0.486.
    Where chaotic, an element at the bound on a skipped step is an overflow the other side may not
    have hit; on two processes, on a step taken, or away from the bound, it is still compared."""
    case = _case(1, world=world, mp="fp16", comm_hook="bf16", clip="value", max_norm=100.0)
    ref = _trace([torch.full((12,), -0.486)])
    clamped = _trace([torch.full((12,), -0.486)])
    clamped["steps"][0]["grads"][0][3] = -100.0
    off = _trace([torch.full((12,), -0.486)])
    off["steps"][0]["grads"][0][3] = -60.0
    for t in (ref, clamped, off):
        t["steps"][0]["skipped"] = True
    assert compare.chaotic(case) == (world == 3)
    assert bool(compare.compare(case, clamped, ref)) == (world == 2)
    assert any("gradient 0" in e for e in compare.compare(case, off, ref))
    taken = _trace([torch.full((12,), -0.486)])
    taken["steps"][0]["grads"][0][3] = -100.0
    assert any("gradient 0" in e for e in compare.compare(case, taken, _trace([torch.full((12,), -0.486)])))
